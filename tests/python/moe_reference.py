"""The MoE layer written plainly in PyTorch (fp32 math on unquantized weights): what the tests
compare megamoe with. Routing follows megamoe's conventions (src/ref/routing.cpp): DeepSeek scores
are computed in double and rounded to float, group scores are the sum of a group's two best."""

import torch

from megamoe import packing
from megamoe.bench import relative_l2  # noqa: F401  (the suites' error measure, the benchmark's too)


def route_softmax(logits: torch.Tensor, top_k: int, renormalize: bool):
    probabilities = torch.softmax(logits.double(), dim=-1)
    weights, ids = torch.topk(probabilities, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.int(), weights.float()


def route_deepseek(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int, routed_scaling_factor: float,
                   renormalize: bool, bias: torch.Tensor):
    tokens, experts = logits.shape
    scores = torch.sigmoid(logits.double()).float()
    choice = (scores.double() + bias.double()).float()
    groups = choice.view(tokens, n_group, experts // n_group)
    per_group = min(2, experts // n_group)
    group_scores = groups.topk(per_group, dim=-1).values.double().sum(dim=-1).float()
    kept = group_scores.topk(topk_group, dim=-1).indices
    mask = torch.zeros(tokens, n_group, dtype=torch.bool, device=logits.device).scatter_(1, kept, True)
    eligible = choice.masked_fill(~mask.repeat_interleave(experts // n_group, dim=1), float("-inf"))
    ids = eligible.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids).double()
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids.int(), (weights * routed_scaling_factor).float()


def _quantized(values: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """values as their E4M3 codes times the block scale; amax broadcasts over each block. The
    scale and factor are megamoe.packing's (amax / 448, at least 1e-4 / 448, by IEEE divisions of
    two tensors), which tests/python/test_packing.py holds to the C++ packer's bytes."""
    scale, factor = packing.block_scales(amax.float(), "fp32")
    return (values * factor).to(torch.float8_e4m3fn).float() * scale


def quantize_rows_per_128(values: torch.Tensor) -> torch.Tensor:
    """[T, C] fp32 through one scale per token per 128 channels (activations, FC1's output)."""
    blocks = values.float().reshape(values.shape[0], -1, 128)
    return _quantized(blocks, blocks.abs().amax(dim=-1, keepdim=True)).reshape(values.shape)


def quantize_expert(w13: torch.Tensor, w2: torch.Tensor):
    """One expert's weights as prepare_weights(precision="fp8_block") stores them, dequantized, in
    the vLLM layout: w2 [H, I] in 128 x 128 blocks; w13 [2I, H] in the blocks of its packed form,
    where a block holds 64 gate rows and the 64 up rows of the same channels (the packing
    interleaves them by 8 for SwiGLU)."""
    two_i, hidden = w13.shape
    intermediate = two_i // 2
    gate = w13[:intermediate].float().reshape(intermediate // 64, 64, hidden // 128, 128)
    up = w13[intermediate:].float().reshape(intermediate // 64, 64, hidden // 128, 128)
    amax = torch.maximum(gate.abs().amax(dim=(1, 3), keepdim=True), up.abs().amax(dim=(1, 3), keepdim=True))
    w13_q = torch.cat([_quantized(gate, amax).reshape(intermediate, hidden),
                       _quantized(up, amax).reshape(intermediate, hidden)])
    blocks = w2.float().reshape(hidden // 128, 128, intermediate // 128, 128)
    w2_q = _quantized(blocks, blocks.abs().amax(dim=(1, 3), keepdim=True)).reshape(hidden, intermediate)
    return w13_q, w2_q


def tensor_scale(values: torch.Tensor) -> torch.Tensor:
    """fp8_tensor's scale of a whole tensor, as the device computes a dynamic one (and the C++
    reference, quant::tensor_scale): amax / 448 of its finite values, the amax at least 1e-4, by an
    IEEE division of two tensors."""
    magnitudes = values.float().abs()
    amax = torch.where(torch.isfinite(magnitudes), magnitudes, torch.zeros_like(magnitudes)).amax()
    return packing.block_scales(amax, "fp32")[0]


def quantize_per_tensor(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values through fp8_tensor's activation rounding: e4m3(v * (1 / scale)), saturating at
    +-448 as megamoe's encoder does, decoded times scale. 1 / scale is an IEEE division
    (quant::tensor_factor), not PyTorch's reciprocal of a Python number."""
    scale = scale.float()
    factor = torch.ones_like(scale) / scale
    codes = (values.float() * factor).clamp(-packing.E4M3_MAX, packing.E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.float() * scale


def quantize_tensor_expert(w13: torch.Tensor, w2: torch.Tensor):
    """One expert's weights as prepare_weights(precision="fp8_tensor") stores weights it
    quantizes (not a per-tensor checkpoint's, whose codes it keeps), dequantized: w13's gate rows,
    its up rows and w2 each one block with scale amax / 448."""
    intermediate = w13.shape[0] // 2
    gate, up, w2 = w13[:intermediate].float(), w13[intermediate:].float(), w2.float()
    return (torch.cat([_quantized(gate, gate.abs().amax()), _quantized(up, up.abs().amax())]),
            _quantized(w2, w2.abs().amax()))


def calibrated_input_scales(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor):
    """Static fp8_tensor activation scales for tokens like x routed by ids, as a checkpoint's
    calibration finds them (and the C++ reference's calibrate_input_scales): tensor_scale of x,
    and of the unquantized SwiGLU output of every routed slot. 0-dim float32 tensors."""
    intermediate = w2.shape[2]
    fc2_amax = torch.zeros((), dtype=torch.float32, device=x.device)
    for expert in torch.unique(ids[ids >= 0]).tolist():
        rows, _ = (ids == expert).nonzero(as_tuple=True)
        h = x[rows].float() @ w13[expert].float().t()
        activated = torch.nn.functional.silu(h[:, :intermediate]) * h[:, intermediate:]
        fc2_amax = torch.maximum(fc2_amax, activated.abs().amax())
    return tensor_scale(x), tensor_scale(fc2_amax)


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  precision: str = "unquantized", input_scales=None, quantized_weights: bool = False) -> torch.Tensor:
    """y [T, H] fp32: sum over a token's slots of weight * (silu(gate) * up) @ w2[e]^T, where
    [gate | up] = x @ w13[e]^T; ids of -1 contribute nothing. precision "unquantized" is the plain
    math; "bf16" rounds the SwiGLU output to bf16 as the kernels do between FC1 and FC2;
    "fp8_block" quantizes as megamoe does: weights (quantize_expert), x and the SwiGLU output per
    token per 128 channels. "fp8_tensor" quantizes the weights per expert matrix
    (quantize_tensor_expert; quantized_weights: they are a per-tensor checkpoint's decoded values,
    kept as they are), and x and the SwiGLU output each with one scale (quantize_per_tensor):
    input_scales' static (fc1_input_scale, fc2_input_scale), or with None dynamic ones as the
    device computes them each forward: tensor_scale of x over every token, and of the SwiGLU output
    of every routed slot, which the device stores in bf16 and encodes from there (static scales
    encode the fp32 SwiGLU output)."""
    intermediate = w2.shape[2]
    tensor = precision == "fp8_tensor"
    activation_cast = {"unquantized": lambda a: a, "bf16": lambda a: a.to(torch.bfloat16).float(),
                       "fp8_block": quantize_rows_per_128, "fp8_tensor": lambda a: a}[precision]
    if precision == "fp8_block":
        x = quantize_rows_per_128(x)
    if tensor:
        x = quantize_per_tensor(x, tensor_scale(x) if input_scales is None else input_scales[0])
    y = torch.zeros(x.shape[0], w13.shape[2], dtype=torch.float32, device=x.device)

    def expert_weights(expert: int):
        w13_e, w2_e = w13[expert].float(), w2[expert].float()
        if precision == "fp8_block":
            return quantize_expert(w13_e, w2_e)
        if tensor and not quantized_weights:
            return quantize_tensor_expert(w13_e, w2_e)
        return w13_e, w2_e

    def fc2(rows: torch.Tensor, slots: torch.Tensor, activated: torch.Tensor, w2_e: torch.Tensor):
        out = activated @ w2_e.t()
        y.index_add_(0, rows, out * weights[rows, slots].float().unsqueeze(1))

    fc1 = []  # fp8_tensor: (expert, rows, slots, SwiGLU output), for FC2 once every routed row has one
    for expert in torch.unique(ids[ids >= 0]).tolist():
        rows, slots = (ids == expert).nonzero(as_tuple=True)
        w13_e, w2_e = expert_weights(expert)
        h = x[rows].float() @ w13_e.t()
        activated = activation_cast(torch.nn.functional.silu(h[:, :intermediate]) * h[:, intermediate:])
        if not tensor:
            fc2(rows, slots, activated, w2_e)
        elif input_scales is None:
            fc1.append((expert, rows, slots, activated.to(torch.bfloat16).float()))
        else:
            fc2(rows, slots, quantize_per_tensor(activated, input_scales[1]), w2_e)
    if fc1:
        # A dynamic scale of FC2's input covers every routed row: known once FC1 has run for all.
        fc2_scale = tensor_scale(torch.cat([activated.reshape(-1) for _, _, _, activated in fc1]))
        for expert, rows, slots, activated in fc1:
            fc2(rows, slots, quantize_per_tensor(activated, fc2_scale), expert_weights(expert)[1])
    return y
