"""Packs vLLM-layout expert weights into megamoe's layout with PyTorch operations, on whatever
device the weights are: the same bytes as the C++ packer (torch.ops.megamoe.pack_weights, which
runs on the host), seconds instead of minutes for a large layer on the GPU.

The layout (include/megamoe/weights.hpp): w13's rows interleaved by 8 (gate[0:8], up[0:8],
gate[8:16], ...), w2's in order; fp8_block: E4M3 codes with one float32 scale per 128 x 128 block
of the packed matrix, amax / 448 (at least 1e-4 / 448), or with scale_format "ue8m0" the next
power of two at or above it; fp8_tensor: E4M3 codes with one float32 scale per expert matrix,
w13's gate rows and up rows apart ([E, 2]) and w2's ([E]), a per-tensor checkpoint's own codes and
scales where it is one, else amax / 448 of each matrix as one block, and the activation scales
(fc1_input_scale, fc2_input_scale) of a checkpoint's static ones; bf16: the values rounded to
bf16. Every division is one of two tensors, as the C++ packer's are (a Python number over a tensor
multiplies by a reciprocal, which can move a product across an E4M3 rounding tie).
"""

from typing import Optional, Tuple

import torch

E4M3_MAX = 448.0
MIN_BLOCK_AMAX = 1e-4
QUANT_BLOCK = 128
# Experts packed at a time: bounds the float32 temporaries to ~1 GiB.
_CHUNK_ELEMENTS = 1 << 28


def per_tensor_scales(scale: Optional[torch.Tensor], experts: int, parts: int) -> Optional[torch.Tensor]:
    """float32 [E, parts] of per-expert scales ([E], [E, 1] or [E, 1, 1], each serving every part;
    with parts 2, w13's gate and up rows, also [E, 2]), or None for scales of another layout."""
    if scale is None:
        return None
    shape = tuple(scale.shape)
    if shape in ((experts,), (experts, 1), (experts, 1, 1)):
        return scale.detach().float().reshape(experts, 1).expand(experts, parts).contiguous()
    if parts == 2 and shape == (experts, 2):
        return scale.detach().float().contiguous()
    return None


def checkpoint_scales(scale: torch.Tensor, name: str, experts: int, rows: int, columns: int,
                      gate_up: bool = False, precision: str = "fp8_block") -> torch.Tensor:
    """The float32 scales of an fp8 checkpoint's [E, rows, columns] codes, as both packers take
    them: per 128 x 128 block, [E, ceil(rows/128), ceil(columns/128)] (DeepSeek-V3's
    weight_scale_inv), as given; per output channel, [E, rows] or [E, rows, 1] (FP8-dynamic
    checkpoints), as [E, rows, 1]; per expert, [E], [E, 1] or [E, 1, 1], and for w13 (gate_up)
    [E, 2], gate then up, as vLLM holds per-tensor scales before merging them: for precision
    fp8_tensor as the packed layout has them (w13 [E, 2], a per-expert scale serving both halves;
    w2 [E]), whose codes the packers keep; otherwise as blocks where every 128 x 128 block lies in
    one scale's span, else as rows (both exact)."""
    block = (experts, -(-rows // QUANT_BLOCK), -(-columns // QUANT_BLOCK))
    shape = tuple(scale.shape)
    if precision == "fp8_tensor":
        per_tensor = per_tensor_scales(scale, experts, 2 if gate_up else 1)
        if per_tensor is not None:
            return per_tensor if gate_up else per_tensor.reshape(experts)
    scale = scale.detach().float()
    if shape == block:
        return scale
    if shape in ((experts, rows), (experts, rows, 1)):
        return scale.reshape(experts, rows, 1)
    if shape in ((experts,), (experts, 1), (experts, 1, 1)):
        per_row, span = scale.reshape(experts, 1, 1).expand(experts, rows, 1), rows
    elif gate_up and shape == (experts, 2):
        per_row, span = scale.repeat_interleave(rows // 2, dim=1).unsqueeze(-1), rows // 2
    else:
        pair = ", [E, 2] (gate, up)" if gate_up else ""
        raise ValueError(
            f"megamoe: {name} must hold one scale per 128 x 128 block {list(block)}, per expert ([E], [E, 1], "
            f"[E, 1, 1]{pair}) or per output channel ([E, {rows}] or [E, {rows}, 1]), with E = {experts}; "
            f"got {list(shape)}"
        )
    if span % QUANT_BLOCK or columns % QUANT_BLOCK:
        return per_row.contiguous()
    return per_row[:, ::QUANT_BLOCK].expand(block).contiguous()


def row_scaled(scales: Optional[torch.Tensor], rows: int) -> bool:
    """Whether checkpoint_scales gave one scale per row (blocks have rows / 128 of them)."""
    return scales is not None and scales.dim() == 3 and scales.shape[-2] == rows


def _values(weights: torch.Tensor, scales: Optional[torch.Tensor]) -> torch.Tensor:
    """float32 values; float8_e4m3fn checkpoints decode as code times its row's or its 128 x 128
    block's scale (checkpoint_scales)."""
    if weights.dtype != torch.float8_e4m3fn:
        return weights.float()
    rows, columns = weights.shape[-2:]
    if row_scaled(scales, rows):
        return weights.float() * scales
    expanded = scales.float().repeat_interleave(QUANT_BLOCK, dim=-2).repeat_interleave(QUANT_BLOCK, dim=-1)
    return weights.float() * expanded[..., :rows, :columns]


def block_scales(amax: torch.Tensor, scale_format: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, factor) of blocks with these amaxes: value = code * scale, code = E4M3(value * factor)."""
    clamped = amax.clamp_min(MIN_BLOCK_AMAX)
    e4m3_max = torch.full_like(clamped, E4M3_MAX)
    if scale_format == "fp32":
        return clamped / e4m3_max, e4m3_max / clamped
    # UE8M0: the ratio's exponent, one up when it has a fraction; a power of two, so 1 / scale is exact.
    bits = (clamped / e4m3_max).view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    scale = (exponent << 23).view(torch.float32)
    return scale, torch.ones_like(scale) / scale


def _quantize_blocks(values: torch.Tensor, scale_format: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes (as bytes) of [e, R, C] values and their [e, R/128, C/128] block scales."""
    experts, rows, columns = values.shape
    blocks = values.reshape(experts, rows // QUANT_BLOCK, QUANT_BLOCK, columns // QUANT_BLOCK, QUANT_BLOCK)
    scale, factor = block_scales(blocks.abs().amax(dim=(2, 4), keepdim=True), scale_format)
    codes = (blocks * factor).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.reshape(experts, rows, columns), scale.reshape(experts, rows // QUANT_BLOCK, columns // QUANT_BLOCK)


def _interleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """[e, 2I, H] gate rows then up rows -> rows interleaved by 8 (gate[0:8], up[0:8], ...)."""
    experts, two_i, hidden = w13.shape
    gate = w13[:, : two_i // 2].reshape(experts, two_i // 16, 8, hidden)
    up = w13[:, two_i // 2:].reshape(experts, two_i // 16, 8, hidden)
    return torch.stack((gate, up), dim=2).reshape(experts, two_i, hidden)


def _quantize_tensors(values: torch.Tensor, parts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes (as bytes) of [e, R, C] values and their [e, parts] scales: each expert's rows in
    `parts` equal ranges (w13: gate rows, up rows), each quantized as one block, as the C++
    packer's quant::quantize_block does (scale amax / 448 and factor 448 / amax, at least 1e-4)."""
    experts, rows, columns = values.shape
    split = values.reshape(experts, parts, rows // parts * columns)
    scale, factor = block_scales(split.abs().amax(dim=2), "fp32")
    codes = (split * factor.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.reshape(experts, rows, columns), scale


def _codes(weights: torch.Tensor) -> torch.Tensor:
    """A float8_e4m3fn checkpoint's codes as bytes, bit for bit."""
    return weights.contiguous().view(torch.uint8)


def non_finite(t: torch.Tensor) -> torch.Tensor:
    """Where t holds NaN or inf (float8_e4m3fn has no inf: where it holds a NaN code, 0x7F or 0xFF)."""
    if t.dtype == torch.float8_e4m3fn:
        return (t.view(torch.uint8) & 0x7F) == 0x7F
    return ~torch.isfinite(t)


def first_marked(name: str, t: torch.Tensor, marked: torch.Tensor, first_row: int = 0) -> str:
    """'name[i, j, ...] = value' for t's first element where `marked` is True; t may be rows
    [first_row, ...) of the tensor `name` calls so (its first index counts from there)."""
    index = [int(i) for i in marked.nonzero()[0]]
    value = t[tuple(index)].float().item()
    if index:
        index[0] += first_row
    return f"{name}[{', '.join(map(str, index))}] = {value}"


def require_finite_weights(weights: torch.Tensor, name: str) -> None:
    """ValueError naming the first NaN or inf of weights [E, rows, columns] (for float8_e4m3fn, a
    NaN code): one would spoil its whole quantization block, and the two packers would not agree
    on how. Read a few experts at a time, so the temporaries stay bounded."""
    experts = max(1, _CHUNK_ELEMENTS // max(1, weights[0].numel())) if weights.shape[0] else 1
    for first in range(0, weights.shape[0], experts):
        part = weights[first:first + experts].detach()
        # A NaN or inf makes the sum NaN or inf, so a finite sum clears the part in one read (2-3x
        # faster than isfinite); only a sum that is not (or overflowed) needs the look below.
        if part.dtype != torch.float8_e4m3fn and torch.isfinite(part.sum(dtype=torch.float32)):
            continue
        bad = non_finite(part)
        if bad.any():
            raise ValueError(f"megamoe: {first_marked(name, part, bad, first)}: weights must be finite (a NaN or "
                             f"inf would spoil the output of every token routed to that expert)")


def input_scales(w13_input_scale: Optional[torch.Tensor], w2_input_scale: Optional[torch.Tensor],
                 device: Optional[torch.device] = None) -> torch.Tensor:
    """fp8_tensor's static activation scales (fc1_input_scale, fc2_input_scale), float32 [2]: the
    largest of each checkpoint scale's values (one per layer or per expert), as vLLM takes them;
    empty [0] (dynamic scales) without either. Both or neither; the values must be positive normal
    floats (the activations are multiplied by 1 / scale), else ValueError."""
    if w13_input_scale is None and w2_input_scale is None:
        return torch.empty(0, dtype=torch.float32, device=device)
    if w13_input_scale is None or w2_input_scale is None:
        missing = "w13_input_scale" if w13_input_scale is None else "w2_input_scale"
        raise ValueError(f"megamoe: w13_input_scale and w2_input_scale go together (static activation scales) or "
                         f"neither (dynamic ones, computed on the device each forward); {missing} is missing")
    largest = []
    for name, scale in (("w13_input_scale", w13_input_scale), ("w2_input_scale", w2_input_scale)):
        values = scale.detach().float().reshape(-1)
        if values.numel() == 0:
            raise ValueError(f"megamoe: {name} holds no values")
        bad = ~(torch.isfinite(values) & (values >= torch.finfo(torch.float32).tiny))
        if bad.any():
            raise ValueError(f"megamoe: {first_marked(name, values, bad)}: activation scales must be "
                             f"positive normal floats (finite, > 0 and not subnormal: the activations are "
                             f"multiplied by 1 / scale)")
        largest.append(values.max())
    return torch.stack(largest).to(w13_input_scale.device if device is None else device)


def pack_weights(w13: torch.Tensor, w2: torch.Tensor, precision: str, scale_format: str = "fp32",
                 w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                 w13_input_scale: Optional[torch.Tensor] = None, w2_input_scale: Optional[torch.Tensor] = None):
    """(w13 bytes [E, 2I, H * b], w13 scales, w2 bytes [E, H, I * b], w2 scales, input scales) on
    w13's device, b = 1 (fp8) or 2 (bf16): what torch.ops.megamoe.pack_weights returns for the same
    arguments, which it checks (this function assumes the shapes and dtypes checked:
    megamoe.prepare_weights does). The scales are [E, 2I/128, H/128] and [E, H/128, I/128] for
    fp8_block, [E, 2] (gate, up) and [E] for fp8_tensor, empty for bf16; the input scales are
    fp8_tensor's static activation scales [2] (input_scales), else empty. An fp8 checkpoint's
    scales may be per block, per row or per expert, in any of checkpoint_scales' shapes: fp8_tensor
    keeps a matrix's codes and scales where they are per expert, and quantizes any other (its values
    decoded) as one block per expert matrix, gate rows and up rows apart."""
    experts, two_i, hidden = w13.shape
    intermediate = two_i // 2
    device = w13.device
    fp8 = precision in ("fp8_block", "fp8_tensor")
    tensor = precision == "fp8_tensor"
    if not tensor and (w13_input_scale is not None or w2_input_scale is not None):
        raise ValueError(f"megamoe: input scales go with precision fp8_tensor (a per-tensor checkpoint's static "
                         f"activation scales); precision {precision} takes none")
    out_input_scales = input_scales(w13_input_scale, w2_input_scale, device) if tensor else \
        torch.empty(0, dtype=torch.float32, device=device)
    if w13.dtype == torch.float8_e4m3fn:  # any layout the op takes, in the form the packing below reads
        w13_scale = checkpoint_scales(w13_scale, "w13_scale", experts, two_i, hidden, gate_up=True, precision=precision)
        w2_scale = checkpoint_scales(w2_scale, "w2_scale", experts, hidden, intermediate, precision=precision)
    element_bytes = 1 if fp8 else 2
    out_w13 = torch.empty(experts, two_i, hidden * element_bytes, dtype=torch.uint8, device=device)
    out_w2 = torch.empty(experts, hidden, intermediate * element_bytes, dtype=torch.uint8, device=device)

    def empty_scales(rows: int, columns: int, parts: int) -> torch.Tensor:
        if tensor:
            shape = (experts, 2) if parts == 2 else (experts,)
        else:
            shape = (experts, rows // QUANT_BLOCK, columns // QUANT_BLOCK) if fp8 else (0,)
        return torch.empty(shape, dtype=torch.float32, device=device)

    out_w13_scales = empty_scales(two_i, hidden, 2)
    out_w2_scales = empty_scales(hidden, intermediate, 1)
    # fp8_tensor: a per-tensor checkpoint's matrices keep their codes and scales.
    fp8_codes = tensor and w13.dtype == torch.float8_e4m3fn
    kept = {"w13": per_tensor_scales(w13_scale, experts, 2) if fp8_codes else None,
            "w2": per_tensor_scales(w2_scale, experts, 1) if fp8_codes else None}
    sources = {"w13": (w13, w13_scale, 2), "w2": (w2, w2_scale, 1)}
    outputs = {"w13": (out_w13, out_w13_scales), "w2": (out_w2, out_w2_scales)}
    chunk = max(1, _CHUNK_ELEMENTS // (3 * intermediate * hidden))
    for first in range(0, experts, chunk):
        part = slice(first, min(first + chunk, experts))
        for name in ("w13", "w2"):
            weights, scale, parts = sources[name]
            out, out_scales = outputs[name]
            if kept[name] is not None:
                codes, scales = _codes(weights[part]), kept[name][part].to(device)
            else:
                values = _values(weights[part], None if scale is None else scale[part])
                if tensor:  # per expert matrix part, in the original row order
                    codes, scales = _quantize_tensors(values, parts)
                else:  # fp8_block's blocks are the packed matrix's
                    values = _interleave_gate_up(values) if name == "w13" else values
                    codes, scales = _quantize_blocks(values, scale_format) if fp8 else \
                        (values.to(torch.bfloat16).view(torch.uint8), None)
            if tensor and name == "w13":
                codes = _interleave_gate_up(codes)
            out[part] = codes
            if scales is not None:
                out_scales[part] = scales.reshape(out_scales[part].shape)
    return out_w13, out_w13_scales, out_w2, out_w2_scales, out_input_scales
