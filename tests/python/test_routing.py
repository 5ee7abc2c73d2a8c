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
