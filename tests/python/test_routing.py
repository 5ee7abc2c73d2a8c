"""megamoe.routing: the routing settings and what they become as op arguments (no GPU needed)."""

import pytest
import torch

from megamoe.routing import DeepseekRouting, PrecomputedRouting, SoftmaxRouting, as_routing, op_arguments


def test_names_and_objects():
    assert as_routing("softmax") == SoftmaxRouting()
    assert as_routing("precomputed") == PrecomputedRouting()
    grouped = DeepseekRouting(n_group=8, topk_group=4)
    assert as_routing(grouped) is grouped
    with pytest.raises(ValueError, match="routing must be"):
        as_routing("deepseek")


def test_deepseek_bias_is_held_by_value():
    bias = torch.tensor([0.5, -0.25, 0.0, 1.0])
    routing = DeepseekRouting(n_group=2, topk_group=1, routed_scaling_factor=2.5, e_score_correction_bias=bias)
    bias.zero_()  # the caller's tensor changing later does not change the routing
    assert routing.e_score_correction_bias == (0.5, -0.25, 0.0, 1.0)
    assert routing == DeepseekRouting(n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                      e_score_correction_bias=[0.5, -0.25, 0.0, 1.0])
    mode, renormalize, n_group, topk_group, scaling, bias_arg = op_arguments(routing)
    assert (mode, renormalize, n_group, topk_group, scaling) == ("deepseek_grouped", True, 2, 1, 2.5)
    assert bias_arg.dtype == torch.float32 and bias_arg.tolist() == [0.5, -0.25, 0.0, 1.0]
    with pytest.raises(ValueError, match="1-D"):
        DeepseekRouting(e_score_correction_bias=torch.zeros(2, 2))


def test_op_arguments_of_the_other_modes():
    assert op_arguments(SoftmaxRouting(renormalize=True)) == ("softmax", True, 1, 1, 1.0, None)
    assert op_arguments(PrecomputedRouting()) == ("precomputed", False, 1, 1, 1.0, None)


@pytest.mark.parametrize("make, message", [
    # A truthy string was renormalize=True: "false" from a config file renormalized.
    (lambda: SoftmaxRouting(renormalize="false"), "renormalize must be a bool, not str 'false'"),
    (lambda: SoftmaxRouting(renormalize=None), "renormalize must be a bool, not NoneType None"),
    (lambda: DeepseekRouting(renormalize="no"), "renormalize must be a bool, not str 'no'"),
    (lambda: DeepseekRouting(n_group=8.0, topk_group=4), "n_group must be an int, not float 8.0"),
    (lambda: DeepseekRouting(n_group=8, topk_group="4"), "topk_group must be an int, not str '4'"),
    (lambda: DeepseekRouting(n_group=True), "n_group must be an int, not bool True"),
    (lambda: DeepseekRouting(routed_scaling_factor="2.5"), "routed_scaling_factor must be a float, not str '2.5'"),
    (lambda: DeepseekRouting(e_score_correction_bias=[[0.0, 1.0]]),
     r"e_score_correction_bias must be 1-D \[num_experts\] floats"),
])
def test_routing_fields_are_checked_when_made(make, message):
    with pytest.raises(TypeError, match=message):
        make()
    # What is right passes, as the ops take it.
    assert op_arguments(DeepseekRouting(n_group=8, topk_group=4, routed_scaling_factor=2, renormalize=False))[1:5] == \
        (False, 8, 4, 2.0)


@pytest.mark.parametrize("bias, error, message", [
    # A str is a sequence: "1234" was four biases, 1.0 to 4.0.
    ("1234", TypeError, r"e_score_correction_bias must be 1-D \[num_experts\] floats .*, not '1234'"),
    (b"12", TypeError, r"e_score_correction_bias must be 1-D \[num_experts\] floats"),
    # The cast to float32 dropped the imaginary parts, with only PyTorch's warning.
    (torch.ones(4, dtype=torch.complex64), TypeError, "e_score_correction_bias must be a real tensor, not "
                                                      "torch.complex64"),
    # PyTorch's "Cannot copy out of meta tensor; no data!", naming no argument.
    (torch.ones(4, device="meta"), ValueError, "e_score_correction_bias is on the meta device"),
    # The ops take an empty bias for none: an empty checkpoint tensor routed without its bias.
    ([], ValueError, "e_score_correction_bias is empty: it needs one bias per expert, or None"),
    (torch.empty(0), ValueError, "e_score_correction_bias is empty"),
])
def test_a_bias_that_is_not_one_real_number_per_expert_is_refused(bias, error, message):
    with pytest.raises(error, match=message):
        DeepseekRouting(n_group=2, topk_group=1, e_score_correction_bias=bias)
    # What a checkpoint holds passes: a real tensor of any float dtype, or numbers.
    for good in (torch.tensor([0.5, -0.25, 0.0, 1.0], dtype=torch.bfloat16), (0.5, -0.25, 0, 1)):
        assert DeepseekRouting(n_group=2, topk_group=1, e_score_correction_bias=good).e_score_correction_bias == \
            (0.5, -0.25, 0.0, 1.0)
