"""How a token picks its experts: the routing modes of the layer, as the op arguments carry them.
Each routing object computes its op arguments once, when it is made: every call passes them (the
layer keeps no routing of its own between calls)."""

import numbers
import reprlib
from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

import torch


@dataclass(frozen=True)
class SoftmaxRouting:
    """Softmax over all experts, then the top k (Qwen-MoE, Mixtral); renormalize makes the k
    weights sum to 1."""

    renormalize: bool = False

    def __post_init__(self):
        require_bool(self.renormalize, "renormalize")
        _set_op_arguments(self, ("softmax", self.renormalize, 1, 1, 1.0, None))


@dataclass(frozen=True)
class DeepseekRouting:
    """DeepSeek-V3 routing: s = sigmoid(logit), choice = s + bias; the best topk_group of n_group
    groups (a group scores the sum of its two best choices) hold the candidates; the top k of them
    by choice are taken with weights s, renormalized if asked, times routed_scaling_factor."""

    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    renormalize: bool = True
    e_score_correction_bias: Optional[Tuple[float, ...]] = field(default=None)

    def __post_init__(self):
        for name in ("n_group", "topk_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"megamoe: {name} must be an int, not {type(value).__name__} {value!r}")
        if isinstance(self.routed_scaling_factor, bool) or not isinstance(self.routed_scaling_factor, numbers.Real):
            raise TypeError(f"megamoe: routed_scaling_factor must be a float, not "
                            f"{type(self.routed_scaling_factor).__name__} {self.routed_scaling_factor!r}")
        require_bool(self.renormalize, "renormalize")
        bias = self.e_score_correction_bias
        if isinstance(bias, torch.Tensor):
            if bias.dim() != 1:
                raise ValueError(f"megamoe: e_score_correction_bias must be 1-D [num_experts], got {tuple(bias.shape)}")
            require_values(bias, "e_score_correction_bias")
            if bias.is_complex():  # the cast below would drop the imaginary parts with only a warning
                raise TypeError(f"megamoe: e_score_correction_bias must be a real tensor, not {bias.dtype}")
            bias = bias.detach().to("cpu", torch.float32).tolist()
        if bias is not None:
            try:
                if isinstance(bias, (str, bytes)):  # a sequence too: "0.5" would be three biases
                    raise TypeError
                bias = tuple(float(b) for b in bias)
            except (TypeError, ValueError):
                raise TypeError(f"megamoe: e_score_correction_bias must be 1-D [num_experts] floats (a tensor or a "
                                f"sequence of numbers), not {reprlib.repr(bias)}") from None
            if not bias:  # the ops take an empty bias for none, whatever the layer's experts
                raise ValueError("megamoe: e_score_correction_bias is empty: it needs one bias per expert, or None "
                                 "for no bias")
            object.__setattr__(self, "e_score_correction_bias", bias)
        _set_op_arguments(self, ("deepseek_grouped", self.renormalize, int(self.n_group), int(self.topk_group),
                                 float(self.routed_scaling_factor),
                                 None if bias is None else torch.tensor(bias, dtype=torch.float32)))


@dataclass(frozen=True)
class PrecomputedRouting:
    """The caller routes: topk_ids [T, k] (-1: not routed here) and topk_weights [T, k]."""

    def __post_init__(self):
        _set_op_arguments(self, ("precomputed", False, 1, 1, 1.0, None))


Routing = Union[SoftmaxRouting, DeepseekRouting, PrecomputedRouting]


def as_routing(routing: Union[Routing, str]) -> Routing:
    if isinstance(routing, (SoftmaxRouting, DeepseekRouting, PrecomputedRouting)):
        return routing
    named = {"softmax": SoftmaxRouting, "precomputed": PrecomputedRouting}
    if isinstance(routing, str) and routing in named:
        return named[routing]()
    # An unknown name is a bad value; anything else (a number, None, a class) a bad type.
    error = ValueError if isinstance(routing, str) else TypeError
    raise error(
        f"megamoe: routing must be SoftmaxRouting(...), DeepseekRouting(...), PrecomputedRouting() "
        f"or one of {sorted(named)}, not {type(routing).__name__} {routing!r}"
    )


def op_arguments(routing: Routing) -> tuple:
    """(mode, renormalize, n_group, topk_group, routed_scaling_factor, bias) as the ops take them."""
    return routing._op_arguments


def require_bool(value, name: str) -> bool:
    """`value`, which must be a bool: bool(value) would take any truthy object ("false", "no") as True."""
    if not isinstance(value, bool):
        raise TypeError(f"megamoe: {name} must be a bool, not {type(value).__name__} {value!r}")
    return value


def require_values(t: torch.Tensor, name: str) -> None:
    """A tensor to be read: not one on the meta device, which has a shape but no values."""
    if t.is_meta:
        raise ValueError(f"megamoe: {name} is on the meta device and holds no values (load the weights first)")


def _set_op_arguments(routing, arguments: tuple) -> None:
    # Not a dataclass field: equality and hashing stay those of the routing's own fields.
    object.__setattr__(routing, "_op_arguments", arguments)
