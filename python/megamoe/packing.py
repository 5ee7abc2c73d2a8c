"""Packs vLLM-layout expert weights into megamoe's layout with PyTorch operations, on whatever
device the weights are: the same bytes as the C++ packer (torch.ops.megamoe.pack_weights, which
runs on the host), seconds instead of minutes for a large layer on the GPU.

The layout (include/megamoe/weights.hpp): w13's rows interleaved by 8 (gate[0:8], up[0:8],
gate[8:16], ...), w2's in order; fp8_block: E4M3 codes with one float32 scale per 128 x 128 block
of the packed matrix, amax / 448 (at least 1e-4 / 448), or with scale_format "ue8m0" the next
power of two at or above it; bf16: the values rounded to bf16. Every division is one of two
tensors, as the C++ packer's are (a Python number over a tensor multiplies by a reciprocal, which
can move a product across an E4M3 rounding tie).
"""

from typing import Optional, Tuple

import torch

E4M3_MAX = 448.0
MIN_BLOCK_AMAX = 1e-4
QUANT_BLOCK = 128
# Experts packed at a time: bounds the float32 temporaries to ~1 GiB.
_CHUNK_ELEMENTS = 1 << 28


def checkpoint_scales(scale: torch.Tensor, name: str, experts: int, rows: int, columns: int,
                      gate_up: bool = False) -> torch.Tensor:
    """The float32 scales of an fp8 checkpoint's [E, rows, columns] codes, as both packers take
    them: per 128 x 128 block, [E, ceil(rows/128), ceil(columns/128)] (DeepSeek-V3's
    weight_scale_inv), as given; per output channel, [E, rows] or [E, rows, 1] (FP8-dynamic
    checkpoints), as [E, rows, 1]; per expert, [E], [E, 1] or [E, 1, 1], and for w13 (gate_up)
    [E, 2], gate then up, as vLLM holds per-tensor scales before merging them: as blocks where every
    128 x 128 block lies in one scale's span, else as rows (both exact)."""
    block = (experts, -(-rows // QUANT_BLOCK), -(-columns // QUANT_BLOCK))
    shape = tuple(scale.shape)
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
    return scales is not None and scales.shape[-2] == rows


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


def pack_weights(w13: torch.Tensor, w2: torch.Tensor, precision: str, scale_format: str = "fp32",
                 w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None):
    """(w13 bytes [E, 2I, H * b], w13 scales [E, 2I/128, H/128], w2 bytes [E, H, I * b], w2 scales
    [E, H/128, I/128]) on w13's device, b = 1 (fp8_block) or 2 (bf16, whose scales are empty):
    what torch.ops.megamoe.pack_weights returns for the same arguments, which it checks (this
    function assumes them checked: megamoe.prepare_weights does). An fp8 checkpoint's scales may
    be per block or per row (checkpoint_scales)."""
    experts, two_i, hidden = w13.shape
    intermediate = two_i // 2
    device = w13.device
    fp8 = precision == "fp8_block"
    element_bytes = 1 if fp8 else 2
    out_w13 = torch.empty(experts, two_i, hidden * element_bytes, dtype=torch.uint8, device=device)
    out_w2 = torch.empty(experts, hidden, intermediate * element_bytes, dtype=torch.uint8, device=device)

    def empty_scales(rows: int, columns: int) -> torch.Tensor:
        shape = (experts, rows // QUANT_BLOCK, columns // QUANT_BLOCK) if fp8 else (0,)
        return torch.empty(shape, dtype=torch.float32, device=device)

    out_w13_scales = empty_scales(two_i, hidden)
    out_w2_scales = empty_scales(hidden, intermediate)
    chunk = max(1, _CHUNK_ELEMENTS // (3 * intermediate * hidden))
    for first in range(0, experts, chunk):
        part = slice(first, min(first + chunk, experts))
        packed = {
            "w13": _interleave_gate_up(_values(w13[part], None if w13_scale is None else w13_scale[part])),
            "w2": _values(w2[part], None if w2_scale is None else w2_scale[part]),
        }
        for name, out, out_scales in (("w13", out_w13, out_w13_scales), ("w2", out_w2, out_w2_scales)):
            if fp8:
                codes, scales = _quantize_blocks(packed[name], scale_format)
                out[part] = codes
                out_scales[part] = scales
            else:
                out[part] = packed[name].to(torch.bfloat16).view(torch.uint8)
    return out_w13, out_w13_scales, out_w2, out_w2_scales
