"""megamoe.workloads: the named workloads, as src/plan/workloads.cpp holds them, and a layer of the
user's own shape, "experts=E,top_k=K,hidden=H,intermediate=I", parsed as megamoe-bench parses it
(tests/plan/test_workloads.cpp): the same keys, the same refusals."""

import pytest

from megamoe.routing import SoftmaxRouting
from megamoe.workloads import WORKLOADS, find_workload


def test_named_workloads_are_found():
    for name, workload in WORKLOADS.items():
        assert find_workload(name) is workload
    assert find_workload("dsv3").intermediate == 2048


@pytest.mark.parametrize("name", ["experts=8,top_k=2,hidden=4096,intermediate=14336",
                                  "hidden=4096,intermediate=14336,top_k=2,experts=8"])
def test_a_shape_in_any_order_is_a_layer_of_that_shape(name):
    w = find_workload(name)
    assert (w.experts, w.top_k, w.hidden, w.intermediate) == (8, 2, 4096, 14336)
    assert w.routing == SoftmaxRouting(renormalize=True)


@pytest.mark.parametrize("name, says", [
    ("experts=8,top_k=2,hidden=4096", "no intermediate"),
    ("experts=8", "no top_k, hidden, intermediate"),
    ("experts=8,top_k=2,hidden=4096,intermediate=14336,bias=1", "unknown key 'bias'"),
    ("experts=8,experts=8,top_k=2,hidden=4096,intermediate=14336", "experts given twice"),
    ("experts=8,top_k=two,hidden=4096,intermediate=14336", "top_k needs a non-negative integer"),
    ("experts=-8,top_k=2,hidden=4096,intermediate=14336", "got '-8'"),
    ("experts=8,top_k=2,hidden=4096,intermediate=99999999999", "at most 9 digits"),
    ("experts=8,top_k=2,hidden=4096,intermediate=14336,", "'' is not key=value"),
    ("experts=8,top_k,hidden=4096,intermediate=14336", "'top_k' is not key=value"),
])
def test_a_shape_says_what_it_lacks(name, says):
    with pytest.raises(ValueError) as refused:
        find_workload(name)
    assert says in str(refused.value)
    assert "experts=E,top_k=K,hidden=H,intermediate=I" in str(refused.value)


def test_an_unknown_name_lists_the_names_and_the_shape_form():
    with pytest.raises(ValueError, match="unknown workload 'mixtral'; known: qwen35-a3b, qwen3-30b-a3b, dsv3, or a "
                                         "shape such as experts=8,top_k=2,hidden=4096,intermediate=14336"):
        find_workload("mixtral")
