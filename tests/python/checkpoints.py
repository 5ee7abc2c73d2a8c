"""FP8 checkpoints of given weights, with one scale per expert, per (expert, gate or up half) as
vLLM holds them before merging, or per output channel (FP8-dynamic checkpoints): codes that are the
values over their scale, scales amax / 448 over their span."""

import torch

SCALE_KINDS = ("expert", "pair", "channel")


def quantized(values: torch.Tensor, kind: str, gate_up: bool = False):
    """(E4M3 codes, float32 scales) of [E, R, C] values; "pair" splits w13's rows (gate_up) into
    its gate and up halves, and is "expert" for w2."""
    experts, rows, _ = values.shape
    values = values.float()
    if kind == "channel":
        scale = values.abs().amax(dim=2) / 448.0  # [E, R]
        per_row = scale
    elif kind == "pair" and gate_up:
        scale = values.reshape(experts, 2, rows // 2, -1).abs().amax(dim=(2, 3)) / 448.0  # [E, 2]
        per_row = scale.repeat_interleave(rows // 2, dim=1)
    else:
        scale = values.abs().amax(dim=(1, 2)) / 448.0  # [E]
        per_row = scale.unsqueeze(1).expand(experts, rows)
    codes = (values / per_row.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return codes, scale


def decoded(codes: torch.Tensor, scale: torch.Tensor, kind: str, gate_up: bool = False) -> torch.Tensor:
    """The float32 values a checkpoint of quantized() holds (code times its scale)."""
    experts, rows, _ = codes.shape
    if kind == "channel":
        per_row = scale
    elif kind == "pair" and gate_up:
        per_row = scale.repeat_interleave(rows // 2, dim=1)
    else:
        per_row = scale.unsqueeze(1).expand(experts, rows)
    return codes.float() * per_row.unsqueeze(-1)
