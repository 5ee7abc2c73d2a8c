"""prepare_weights, fused_moe and MegaMoE: megamoe's layer as PyTorch calls.

Every argument is checked before any kernel runs: TypeError for a wrong dtype, ValueError for a
wrong shape, device, contiguity or value, NotImplementedError for what the kernels do not support.
Each check has one owner: what the ops receive, the ops check (torch.ops.megamoe.* called directly
get the same errors, from the same code); this module checks what it needs before it calls them
(the Python types it is given, the dtypes it converts, the weights it packs on the GPU).
"""

import dataclasses
import math
from typing import Optional, Union

import torch
from torch import nn

from megamoe import packing
from megamoe._ops import ops
from megamoe.routing import (
    DeepseekRouting,
    PrecomputedRouting,
    Routing,
    SoftmaxRouting,
    as_routing,
    op_arguments,
    require_bool,
    require_values,
)

PRECISIONS = ("bf16", "fp8_block", "fp8_tensor")
_WEIGHT_DTYPES = (torch.bfloat16, torch.float32, torch.float8_e4m3fn)
_PRECOMPUTED = PrecomputedRouting()


def require_tensor(value, name: str, dims: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"megamoe: {name} must be a torch.Tensor, not {type(value).__name__}")
    if value.dim() != dims:
        raise ValueError(f"megamoe: {name} must have {dims} dimensions, got shape {tuple(value.shape)}")
    return value


class LayerHandle:
    """A layer in the ops library's registry, under its handle, with its shapes and formats. Its
    weights are never written, so copies (of a module holding it) share it; it is freed when the
    last reference goes, and it cannot be pickled."""

    _pickle_hint = ""

    def __init__(self, *, handle: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 precision: str, scale_format: str, max_tokens: int, device: torch.device):
        self._handle = handle
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden = hidden
        self.intermediate = intermediate
        self.precision = precision
        self.scale_format = scale_format
        self.max_tokens = max_tokens
        self.device = device

    def _destroy(self, handle: int) -> None:
        raise NotImplementedError

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle is not None:
            try:
                self._destroy(handle)
            except Exception:  # interpreter shutdown: the process frees the device memory
                pass

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def __reduce__(self):
        raise TypeError(f"megamoe: {type(self).__name__} live on a GPU under a handle of this process and cannot "
                        f"be pickled{self._pickle_hint}")


class MoeWeights(LayerHandle):
    """Expert weights packed for megamoe's kernels on one GPU, with the layer's workspace for up to
    `max_tokens` tokens per pass (from prepare_weights; fused_moe runs a larger batch in passes).

    Calls that use the same MoeWeights share its workspace, so two of them must not run at the
    same time: keep them on one stream, or order them with events (CUDA graphs replayed one after
    the other are fine).
    """

    _pickle_hint = "; save the original weights and call prepare_weights again"

    def __init__(self, *, routing: Routing, options: Optional[dict] = None, input_scales: Optional[str] = None,
                 **layer):
        super().__init__(**layer)
        self.routing = routing  # for calls with router_logits and no routing of their own
        self.options = options or {}  # the planner's choices the caller fixed (prepare_weights' keywords)
        # fp8_tensor: "from_checkpoint" (static activation scales) or "dynamic" (computed each forward).
        self.input_scales = input_scales

    def _destroy(self, handle: int) -> None:
        ops.destroy_layer(handle)

    @property
    def workspace_bytes(self) -> int:
        return ops.workspace_bytes(self._handle)

    def invalid_routing_ids(self) -> int:
        """How many routed ids were invalid (>= num_experts, negative other than -1, or repeated
        within a token) since the last call; they contributed nothing. Synchronizes the current
        stream."""
        return ops.invalid_routing_ids(self._handle)

    def __repr__(self) -> str:
        return (
            f"MoeWeights(num_experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden}, "
            f"intermediate={self.intermediate}, precision={self.precision!r}"
            + ("" if self.input_scales is None else f", input_scales={self.input_scales!r}")
            + f", routing={self.routing}, max_tokens={self.max_tokens}, device={self.device}"
            + "".join(f", {name}={value!r}" for name, value in self.options.items()) + ")"
        )


def prepare_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    top_k: int,
    precision: str = "fp8_block",
    w13_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    w13_input_scale: Optional[torch.Tensor] = None,
    w2_input_scale: Optional[torch.Tensor] = None,
    scale_format: str = "fp32",
    routing: Union[Routing, str] = "softmax",
    max_tokens: int = 8192,
    device: Optional[Union[torch.device, str, int]] = None,
    token_tile: Optional[int] = None,
    fc1_token_rows: str = "auto",
    num_sms: Optional[int] = None,
    launch: str = "auto",
) -> MoeWeights:
    """Packs vLLM-layout expert weights for the kernels and uploads them to `device` (default: the
    current CUDA device).

    w13 [E, 2I, H] holds each expert's gate rows then up rows, w2 [E, H, I] its down projection, as
    bfloat16 or float32 tensors (any device), or as float8_e4m3fn with float32 scales: one per 128 x
    128 block (w13_scale [E, 2I/128, H/128], w2_scale [E, H/128, I/128], DeepSeek-V3's
    weight_scale_inv), one per expert ([E]; for w13 also vLLM's [E, 2], gate then up) or one per
    output channel (w13_scale [E, 2I, 1], w2_scale [E, H, 1]; megamoe.packing.checkpoint_scales).
    They are decoded and each packed block re-quantized with amax / 448, which keeps the codes
    only where the checkpoint's own block scale was that (DeepSeek-V3's w2) and re-rounds them
    elsewhere. precision "fp8_block" quantizes to 128 x 128 blocks (scale_format "ue8m0" makes
    every scale a power of two), "bf16" keeps bf16.

    precision "fp8_tensor" runs vLLM's per-tensor FP8 checkpoints: E4M3 weights with one scale per
    expert matrix, vLLM's w13_weight_scale [E] or [E, 2] (gate, up) and w2_weight_scale [E] passed
    as w13_scale and w2_scale, whose codes and scales are kept bit for bit. Any other weights
    (bf16, float32, fp8 with block or channel scales) are decoded and each expert's gate rows, up
    rows and w2 quantized with amax / 448. w13_input_scale and w2_input_scale (vLLM's: one per
    layer, [] or [1], or one per expert, [E] or [E, 1]; the largest is used, as vLLM does) are the
    static scales of the layer input x and of FC2's input (SwiGLU's output), positive normal
    floats; with neither (vLLM's activation_scheme "dynamic") the layer computes both on the GPU
    each forward. They go together, and with precision fp8_tensor only. launch "single_kernel" takes
    fp8_tensor with static scales only; expert-parallel, fp8_tensor runs staged (prepare_ep_weights).

    Weights must be finite: a NaN or inf (a NaN code of float8_e4m3fn) is refused, named with its
    index, after the other checks (it takes a pass over the weights). Weights on a CUDA device are
    packed there (megamoe.packing); others on the host by the C++ packer, where a large layer
    reports its progress on stderr. Both give the same bytes. max_tokens sizes the workspace:
    fused_moe runs a larger batch as consecutive passes of max_tokens tokens.

    The planner's choices stay its own unless fixed here (the output does not depend on them):
    token_tile (16, 32 or 64 tokens per GEMM tile and expert with channels on wgmma M, or 128 with
    tokens on M, for every call), fc1_token_rows
    ("pool" or "row_copy": where fp8 FC1 reads its token rows), num_sms (at most that many
    persistent CTAs, leaving the other SMs to work on other streams) and launch ("per_stage": five
    kernels, "single_kernel": the whole forward in one persistent kernel, opt-in and not yet faster,
    with the same token tiles; docs/design.md#single-kernel-forward).
    """
    checked = checked_weights(w13, w2, w13_scale, w2_scale, precision, w13_input_scale, w2_input_scale)
    routing = as_routing(routing)
    options = {name: value for name, value in (("token_tile", token_tile), ("fc1_token_rows", fc1_token_rows),
                                                ("num_sms", num_sms), ("launch", launch))
               if value not in (None, "auto")}
    layer = (checked.num_experts, checked.hidden, checked.intermediate, require_int(top_k, "top_k"),
             require_str(precision, "precision"), require_str(scale_format, "scale_format"), *op_arguments(routing),
             require_int(max_tokens, "max_tokens"), optional_int(token_tile, "token_tile"),
             require_str(fc1_token_rows, "fc1_token_rows"), optional_int(num_sms, "num_sms"),
             require_str(launch, "launch"))
    ops.check_layer(*layer)
    input_scales = checked.input_scales(precision)
    if launch == "single_kernel" and input_scales == "dynamic":
        # The layer refuses it too, but only on the device.
        raise ValueError("megamoe: launch='single_kernel' with precision 'fp8_tensor' takes static activation scales "
                         "(w13_input_scale and w2_input_scale); dynamic ones run as seven launches (launch='auto' or "
                         "'per_stage')")
    checked.require_finite()
    device = torch.device("cuda", ops.check_device(device_index(device)))
    packed = packed_on(checked, precision, scale_format, device)
    handle = ops.create_layer(*packed, *layer, device.index)
    return MoeWeights(handle=handle, num_experts=checked.num_experts, top_k=top_k, hidden=checked.hidden,
                      intermediate=checked.intermediate, precision=precision, scale_format=scale_format,
                      routing=routing, options=options, input_scales=input_scales, max_tokens=max_tokens,
                      device=device)


def require_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"megamoe: {name} must be an int, not {type(value).__name__} {value!r}")
    return value


def optional_int(value, name: str) -> int:
    """An int the op takes with 0 for "the planner's choice", which None also means here."""
    return 0 if value is None else require_int(value, name)


def require_str(value, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"megamoe: {name} must be a str, not {type(value).__name__} {value!r}")
    return value


def device_index(device) -> int:
    """The index of the CUDA device `device` names (-1: the current one), for the ops to check."""
    if device is None:
        return -1
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"megamoe: device={device} is no CUDA device index: it must be >= 0 (or None for the "
                             f"current device)")
        return device
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"megamoe: device must be a torch.device, str or int, not {type(device).__name__}")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"megamoe: device must be a CUDA device, not {device}")
    return -1 if device.index is None else device.index


@dataclasses.dataclass
class CheckedWeights:
    """vLLM-layout weights whose shapes and dtypes were checked, fp8 scales in a packer's form
    (checkpoint_scales for the precision), fp8_tensor's input scales as 1-D float32 values."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: Optional[torch.Tensor]
    w2_scale: Optional[torch.Tensor]
    num_experts: int
    hidden: int
    intermediate: int
    w13_input_scale: Optional[torch.Tensor] = None
    w2_input_scale: Optional[torch.Tensor] = None

    def input_scales(self, precision: str) -> Optional[str]:
        """Where a `precision` layer of these weights takes its activation scales from: fp8_tensor's
        "from_checkpoint" (static ones given) or "dynamic", None for the other precisions."""
        if precision != "fp8_tensor":
            return None
        return "dynamic" if self.w13_input_scale is None else "from_checkpoint"

    def require_finite(self) -> None:
        """ValueError for a NaN or inf weight: a pass over every weight, so it comes after the cheap checks."""
        packing.require_finite_weights(self.w13, "w13")
        packing.require_finite_weights(self.w2, "w2")


def checked_input_scale(scale, name: str, num_experts: int) -> torch.Tensor:
    """One of fp8_tensor's static activation scales (vLLM's w13_input_scale or w2_input_scale):
    one per layer ([] or [1]) or per expert ([E] or [E, 1]), floating point; as float32 [n]."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"megamoe: {name} must be a torch.Tensor, not {type(scale).__name__}")
    if not scale.is_floating_point():
        raise TypeError(f"megamoe: {name} must be a floating-point tensor, not {scale.dtype}")
    require_values(scale, name)
    shape = tuple(scale.shape)
    if shape not in ((), (1,), (num_experts,), (num_experts, 1)):
        raise ValueError(f"megamoe: {name} must hold one activation scale per layer ([] or [1]) or one per expert "
                         f"([{num_experts}] or [{num_experts}, 1]), got {list(shape)}")
    return scale.detach().float().reshape(-1)


def checked_input_scales(w13_input_scale, w2_input_scale, precision, num_experts: int):
    """fp8_tensor's static activation scales, checked (both or neither, shapes, positive normal
    values), as float32 [n] each; (None, None) for dynamic ones."""
    if w13_input_scale is None and w2_input_scale is None:
        return None, None
    if precision != "fp8_tensor":
        raise ValueError(f"megamoe: input scales (w13_input_scale, w2_input_scale) go with precision fp8_tensor, "
                         f"a per-tensor checkpoint's static activation scales; precision {precision!r} takes none "
                         f"(it computes its own activation scales: drop them, or use precision 'fp8_tensor')")
    if w13_input_scale is None or w2_input_scale is None:
        missing = "w13_input_scale" if w13_input_scale is None else "w2_input_scale"
        raise ValueError(f"megamoe: w13_input_scale and w2_input_scale go together (static activation scales) or "
                         f"neither (dynamic ones, computed on the GPU each forward); {missing} is missing")
    scales = (checked_input_scale(w13_input_scale, "w13_input_scale", num_experts),
              checked_input_scale(w2_input_scale, "w2_input_scale", num_experts))
    packing.input_scales(*scales)  # raises for values that are not positive normal floats
    return scales


def checked_weights(w13, w2, w13_scale, w2_scale, precision: str = "fp8_block", w13_input_scale=None,
                    w2_input_scale=None) -> CheckedWeights:
    """prepare_weights' checks of the weights it packs for `precision` (also prepare_ep_weights')."""
    require_str(precision, "precision")  # before the checks below read it: they would name it as a bad value
    require_tensor(w13, "w13", 3)
    require_tensor(w2, "w2", 3)
    if w13.dtype not in _WEIGHT_DTYPES:
        raise TypeError(f"megamoe: weights must be bfloat16, float32 or float8_e4m3fn, not {w13.dtype}")
    if w2.dtype != w13.dtype:
        raise TypeError(f"megamoe: w13 and w2 must share a dtype, got {w13.dtype} and {w2.dtype}")
    num_experts, two_i, hidden = w13.shape
    if two_i % 2:
        raise ValueError(f"megamoe: w13 [E, 2I, H] needs an even second dimension (gate rows, then up rows), got {two_i}")
    intermediate = two_i // 2
    if tuple(w2.shape) != (num_experts, hidden, intermediate):
        raise ValueError(
            f"megamoe: w2 must be [E, H, I] = {[num_experts, hidden, intermediate]} to match w13 "
            f"{list(w13.shape)}, got {list(w2.shape)}"
        )
    require_values(w13, "w13")
    require_values(w2, "w2")
    if w13.dtype == torch.float8_e4m3fn:
        scales = {}
        for name, scale, rows, columns in (("w13_scale", w13_scale, two_i, hidden),
                                           ("w2_scale", w2_scale, hidden, intermediate)):
            if scale is None:
                raise ValueError(f"megamoe: float8_e4m3fn weights need {name}: one scale per 128 x 128 block "
                                 f"{[num_experts, -(-rows // 128), -(-columns // 128)]}, per expert or per "
                                 f"output channel")
            if not isinstance(scale, torch.Tensor):
                raise TypeError(f"megamoe: {name} must be a torch.Tensor, not {type(scale).__name__}")
            if not scale.is_floating_point():  # integer codes would be taken as scales
                raise TypeError(f"megamoe: {name} must be a floating-point tensor (float32 scales), not {scale.dtype}")
            require_values(scale, name)
            scales[name] = packing.checkpoint_scales(scale, name, num_experts, rows, columns,
                                                     gate_up=name == "w13_scale", precision=precision).to(w13.device)
            values = scale.detach().float()  # as the packers read them: 1e300 in float64 is inf
            bad = ~(torch.isfinite(values) & (values > 0))
            if bad.any():
                raise ValueError(f"megamoe: {packing.first_marked(name, values, bad)}: scales must be finite and "
                                 f"positive")
            # A finite scale past FLT_MAX / 448 decodes E4M3's largest codes to inf: the host packer
            # refuses such a weight, but the GPU packer packed it (an inf block scale and NaN codes,
            # or fp8_tensor's kept scale), and every token routed to the expert came out NaN.
            too_large = ~torch.isfinite(values * packing.E4M3_MAX)
            if too_large.any():
                raise ValueError(f"megamoe: {packing.first_marked(name, values, too_large)}: a scale past "
                                 f"{torch.finfo(torch.float32).max / packing.E4M3_MAX:.3g} (float32's largest over "
                                 f"E4M3's 448) decodes a weight to inf")
        w13_scale, w2_scale = scales["w13_scale"], scales["w2_scale"]
    elif w13_scale is not None or w2_scale is not None:
        raise ValueError(f"megamoe: weight scales go with float8_e4m3fn weights only; these are {w13.dtype}")
    input_scales = checked_input_scales(w13_input_scale, w2_input_scale, precision, num_experts)
    return CheckedWeights(w13, w2, w13_scale, w2_scale, num_experts, hidden, intermediate, *input_scales)


def packed_on(checked: CheckedWeights, precision: str, scale_format: str, device: torch.device):
    """The packed tensors for `device` (checked by ops.check_device): packed on the GPU where the
    weights are, else on the host."""
    detached = [None if t is None else t.detach() for t in
                (checked.w13, checked.w2, checked.w13_scale, checked.w2_scale, checked.w13_input_scale,
                 checked.w2_input_scale)]
    if checked.w13.is_cuda:
        # On the GPU with PyTorch (seconds for a large layer), the same bytes as the host packer.
        on_device = [None if t is None else t.to(device) for t in detached]
        return packing.pack_weights(*on_device[:2], precision, scale_format, *on_device[2:])
    return ops.pack_weights(*detached, precision, scale_format)


def check_activation(t: torch.Tensor, name: str, rows: int, columns: int, device: torch.device) -> None:
    if tuple(t.shape) != (rows, columns):
        raise ValueError(f"megamoe: {name} must be [{rows}, {columns}], got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"megamoe: {name} must be on {device} (the weights' device), not {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"megamoe: {name} must be contiguous (call .contiguous())")


def checked_tokens(x, hidden: int, device: torch.device) -> int:
    """The tokens of x [T, H] bfloat16 (fused_moe's and ep_fused_moe's check)."""
    require_tensor(x, "x", 2)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"megamoe: x must be bfloat16, not {x.dtype} (convert with x.to(torch.bfloat16))")
    check_activation(x, "x", x.shape[0], hidden, device)
    return x.shape[0]


def check_precomputed(topk_ids, topk_weights, tokens: int, top_k: int, device: torch.device) -> None:
    """topk_ids [T, k] int32 or int64 and topk_weights [T, k] floating point on `device`."""
    require_tensor(topk_ids, "topk_ids", 2)
    require_tensor(topk_weights, "topk_weights", 2)
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"megamoe: topk_ids must be int32 or int64, not {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"megamoe: topk_weights must be a floating-point tensor, not {topk_weights.dtype}")
    check_activation(topk_ids, "topk_ids", tokens, top_k, device)
    check_activation(topk_weights, "topk_weights", tokens, top_k, device)


def ids_as_int32(topk_ids: torch.Tensor) -> torch.Tensor:
    """topk_ids as the kernels' int32, on its device, without synchronizing. A cast alone would wrap
    an int64 id beyond int32's range onto another id, perhaps a valid expert; such ids become -2,
    which stays invalid (counted by invalid_routing_ids, contributing nothing)."""
    if topk_ids.dtype == torch.int64:
        topk_ids = topk_ids.masked_fill((topk_ids < -(2**31)) | (topk_ids >= 2**31), -2)
    return topk_ids.to(torch.int32)


def ids_through_expert_map(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """Global expert ids [T, k] as this layer's (int64), by vLLM's expert_map [global E]: this
    layer's index of each global expert, or -1 where another rank holds it. On the device, without
    synchronizing. -1 stays "not routed here"; an id outside the map becomes -2, which the layer
    counts as invalid, as it does a map entry outside [-1, E)."""
    ids = topk_ids.long()
    inside = (ids >= 0) & (ids < expert_map.numel())
    mapped = expert_map.long()[ids.clamp(0, expert_map.numel() - 1)]
    outside = torch.full_like(ids, -2).masked_fill(ids == -1, -1)
    return torch.where(inside, mapped, outside)


def require_prepared(weights) -> None:
    if not isinstance(weights, MoeWeights):
        raise TypeError(f"megamoe: weights must come from megamoe.prepare_weights, not {type(weights).__name__}")


def fused_moe(
    x: torch.Tensor,
    weights: MoeWeights,
    router_logits: Optional[torch.Tensor] = None,
    *,
    topk_ids: Optional[torch.Tensor] = None,
    topk_weights: Optional[torch.Tensor] = None,
    routing: Optional[Union[Routing, str]] = None,
    deterministic: bool = True,
    expert_map: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """y [T, H] bfloat16 = the MoE layer of `weights` applied to x [T, H] bfloat16.

    Route with router_logits [T, E] (float32, or bfloat16/float16, converted), by `routing` or the
    weights' own, or pass topk_ids [T, k] (int32 or int64; -1: not routed here) and topk_weights
    [T, k] (float). With expert parallelism as vLLM does it, topk_ids may hold global expert ids and
    expert_map [global E] (int) this layer's index of each, -1 for experts held elsewhere.
    deterministic=True reduces each token's k expert rows in a fixed order (the same bits every
    run); False adds them with atomics. Enqueues on the current stream without
    host synchronization, so it can be captured in a CUDA graph and traced by torch.compile. The
    routing travels with each call (the weights keep none between calls), so a graph replays the
    routing it captured; a DeepseekRouting bias the weights have not seen is uploaded on its first
    call, which therefore cannot be inside a capture (it raises ValueError there). Calls from several
    threads on the same weights are safe; calls on several streams must be ordered by the caller.
    """
    require_prepared(weights)
    require_bool(deterministic, "deterministic")  # the op takes None as False: the fast combine
    tokens = checked_tokens(x, weights.hidden, weights.device)
    precomputed = topk_ids is not None or topk_weights is not None
    if precomputed:
        if router_logits is not None:
            raise ValueError("megamoe: pass either router_logits or topk_ids with topk_weights, not both")
        if topk_ids is None or topk_weights is None:
            raise ValueError("megamoe: topk_ids and topk_weights go together")
        chosen = _PRECOMPUTED if routing is None else as_routing(routing)
        if not isinstance(chosen, PrecomputedRouting):
            raise ValueError(f"megamoe: topk_ids/topk_weights are precomputed routing, not {chosen}")
        check_precomputed(topk_ids, topk_weights, tokens, weights.top_k, weights.device)
        if expert_map is not None:
            require_tensor(expert_map, "expert_map", 1)
            if expert_map.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"megamoe: expert_map must be int32 or int64, not {expert_map.dtype}")
            if expert_map.device != weights.device:
                raise ValueError(f"megamoe: expert_map is on {expert_map.device}, the layer on {weights.device}")
            if expert_map.numel() < weights.num_experts:
                raise ValueError(f"megamoe: expert_map maps {expert_map.numel()} global experts, fewer than the "
                                 f"layer's {weights.num_experts}")
            topk_ids = ids_through_expert_map(topk_ids, expert_map)
        topk_ids = ids_as_int32(topk_ids)
        topk_weights = topk_weights.to(torch.float32)
    else:
        if router_logits is None:
            raise ValueError("megamoe: pass router_logits [T, E], or topk_ids and topk_weights")
        if expert_map is not None:
            raise ValueError("megamoe: expert_map maps topk_ids; with router_logits the layer routes over its own experts")
        chosen = weights.routing if routing is None else as_routing(routing)
        if isinstance(chosen, PrecomputedRouting):
            # Whose routing it is: the call's own, or the weights' when the call names none.
            whose = "routing=PrecomputedRouting() takes topk_ids and topk_weights" if routing is not None else \
                "these weights were prepared for precomputed routing"
            raise ValueError(f"megamoe: {whose}; with router_logits pass routing=SoftmaxRouting(...) or "
                             f"DeepseekRouting(...)")
        require_tensor(router_logits, "router_logits", 2)
        if not router_logits.is_floating_point():
            raise TypeError(f"megamoe: router_logits must be a floating-point tensor, not {router_logits.dtype}")
        check_activation(router_logits, "router_logits", tokens, weights.num_experts, weights.device)
        router_logits = router_logits.to(torch.float32)
    routing_arguments = op_arguments(chosen)
    if tokens <= weights.max_tokens:
        return ops.forward(weights._handle, x, router_logits, topk_ids, topk_weights, deterministic, *routing_arguments)
    # The workspace holds max_tokens tokens, so a larger batch (a long prefill) runs as consecutive
    # passes of up to max_tokens tokens on this stream, as vLLM chunks its fused_moe; a token's
    # output depends only on its own row and routing.
    pieces = []
    for first in range(0, tokens, weights.max_tokens):
        rows = slice(first, first + weights.max_tokens)
        part = [None if t is None else t[rows] for t in (router_logits, topk_ids, topk_weights)]
        pieces.append(ops.forward(weights._handle, x[rows], *part, deterministic, *routing_arguments))
    return torch.cat(pieces)


class MegaMoE(nn.Module):
    """The experts of a Mixture-of-Experts block (with their routing) on megamoe's kernels.

    Built from vLLM-layout weights (see prepare_weights); forward(hidden_states [..., H] bfloat16,
    router_logits [..., E]) returns the block's output in hidden_states' shape, as does forward
    with topk_ids and topk_weights [..., k] (and expert_map, as fused_moe takes them); the routing
    tensors have hidden_states' leading shape, or are flat ([T, E], [T, k]). The router
    itself (the gate's Linear) and any shared experts stay in the caller's model.
    """

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        top_k: int,
        routing: Union[Routing, str] = "softmax",
        precision: str = "fp8_block",
        w13_scale: Optional[torch.Tensor] = None,
        w2_scale: Optional[torch.Tensor] = None,
        w13_input_scale: Optional[torch.Tensor] = None,
        w2_input_scale: Optional[torch.Tensor] = None,
        scale_format: str = "fp32",
        max_tokens: int = 8192,
        deterministic: bool = True,
        device: Optional[Union[torch.device, str, int]] = None,
        token_tile: Optional[int] = None,
        fc1_token_rows: str = "auto",
        num_sms: Optional[int] = None,
        launch: str = "auto",
    ):
        super().__init__()
        require_bool(deterministic, "deterministic")
        self.weights = prepare_weights(w13, w2, top_k=top_k, precision=precision, w13_scale=w13_scale,
                                       w2_scale=w2_scale, w13_input_scale=w13_input_scale,
                                       w2_input_scale=w2_input_scale, scale_format=scale_format, routing=routing,
                                       max_tokens=max_tokens, device=device, token_tile=token_tile,
                                       fc1_token_rows=fc1_token_rows, num_sms=num_sms, launch=launch)
        self.deterministic = deterministic

    @classmethod
    def from_weights(cls, weights: MoeWeights, *, deterministic: bool = True) -> "MegaMoE":
        """A module over weights already prepared (shared with other modules or fused_moe calls)."""
        require_prepared(weights)
        require_bool(deterministic, "deterministic")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.weights = weights
        module.deterministic = deterministic
        return module

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: Optional[torch.Tensor] = None,
        topk_ids: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        expert_map: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"megamoe: hidden_states must be a torch.Tensor, not {type(hidden_states).__name__}")
        shape = hidden_states.shape
        # Checked before the flattening, which would name x and a shape the caller never passed (or,
        # for a last dimension of 0, fail inside reshape).
        if hidden_states.dim() == 0 or shape[-1] != self.weights.hidden:
            raise ValueError(f"megamoe: hidden_states must be [..., {self.weights.hidden}], got {list(shape)}")
        tokens = math.prod(shape[:-1])
        for name, t in (("router_logits", router_logits), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            # The same leading shape as hidden_states, or flat [T, n]: else each row would meet the
            # routing of another token, as long as the counts agree.
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[:-1] != shape[:-1] and \
                    tuple(t.shape[:-1]) != (tokens,):
                columns = t.shape[-1]
                forms = [[*shape[:-1], columns]] + ([[tokens, columns]] if len(shape) != 2 else [])
                raise ValueError(f"megamoe: {name} must be {' or '.join(map(str, forms))} for hidden_states "
                                 f"{list(shape)}, got {list(t.shape)}")
        flat = lambda t: t.reshape(-1, t.shape[-1]) if isinstance(t, torch.Tensor) and t.dim() >= 1 else t  # noqa: E731
        y = fused_moe(flat(hidden_states), self.weights, flat(router_logits), topk_ids=flat(topk_ids),
                      topk_weights=flat(topk_weights), deterministic=self.deterministic, expert_map=expert_map)
        return y.reshape(shape)

    def extra_repr(self) -> str:
        return repr(self.weights)


__all__ = ["MoeWeights", "prepare_weights", "fused_moe", "MegaMoE", "SoftmaxRouting", "DeepseekRouting",
           "PrecomputedRouting"]
