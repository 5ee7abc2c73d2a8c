"""Precision fp8_tensor (vLLM's per-tensor FP8 checkpoints) without a GPU: both packers
(megamoe.packing and the C++ one behind torch.ops.megamoe.pack_weights) give the same bytes for
every kind of checkpoint, keep a per-tensor checkpoint's codes and scales bit for bit, take the
largest of the static activation scales (or none: dynamic), and refuse bad arguments, as do
prepare_weights (its checks before the device's), the ops and prepare_ep_weights. The layer itself
runs in test_layer.py (GPU)."""

import pytest
import torch

import megamoe
from checkpoints import SCALE_KINDS, decoded, quantized
from conftest import SEED
from megamoe import packing
from moe_reference import (calibrated_input_scales, moe_reference, quantize_per_tensor, quantize_tensor_expert,
                           relative_l2, route_softmax, tensor_scale)

E, H, I = 4, 256, 128
OPS = torch.ops.megamoe


def generator(salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + salt)


def values(salt: int):
    """Fresh random w13 [E, 2I, H] and w2 [E, H, I] (float32), rows of different magnitudes, and
    the gate and up halves of w13 apart, so that their scales differ."""
    g = generator(salt)
    w13 = torch.randn(E, 2 * I, H, generator=g) * (0.01 + torch.rand(E, 2 * I, 1, generator=g))
    w13[:, I:] *= 3.0
    w2 = torch.randn(E, H, I, generator=g) * (0.01 + torch.rand(E, 1, 1, generator=g))
    return w13, w2


def input_scale_values(salt: int, count: int):
    """Static activation scales as a checkpoint holds them: `count` positive values each."""
    g = generator(salt)
    return torch.rand(count, generator=g) * 0.05 + 0.001, torch.rand(count, generator=g) * 0.005 + 0.0001


def both_packers(w13, w2, w13_scale=None, w2_scale=None, w13_input_scale=None, w2_input_scale=None):
    """The C++ packer's tensors, checked to equal megamoe.packing's for the same arguments."""
    expected = OPS.pack_weights(w13, w2, w13_scale, w2_scale, w13_input_scale, w2_input_scale, "fp8_tensor", "fp32")
    actual = packing.pack_weights(w13, w2, "fp8_tensor", "fp32", w13_scale, w2_scale, w13_input_scale,
                                  w2_input_scale)
    assert len(actual) == len(expected) == 5
    for name, a, e in zip(("w13", "w13 scales", "w2", "w2 scales", "input scales"), actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, (name, a.shape, e.shape, a.dtype, e.dtype)
        assert torch.equal(a, e), f"{name}: {(a != e).sum().item()} of {a.numel()} differ"
    assert expected[0].shape == (E, 2 * I, H) and expected[1].shape == (E, 2)
    assert expected[2].shape == (E, H, I) and expected[3].shape == (E,)
    return expected


def deinterleaved(packed_w13: torch.Tensor) -> torch.Tensor:
    """Packed w13 rows (gate[0:8], up[0:8], gate[8:16], ...) back in the vLLM order."""
    experts, two_i, hidden = packed_w13.shape
    pairs = packed_w13.reshape(experts, two_i // 16, 2, 8, hidden)
    return torch.cat([pairs[:, :, 0].reshape(experts, two_i // 2, hidden),
                      pairs[:, :, 1].reshape(experts, two_i // 2, hidden)], dim=1)


def decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Packed E4M3 bytes [e, R, C] times one scale per row range: scales [e, parts]."""
    experts, rows, _ = codes.shape
    per_row = scales.repeat_interleave(rows // scales.shape[1], dim=1).unsqueeze(-1)
    return codes.view(torch.float8_e4m3fn).float() * per_row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_values_are_quantized_per_expert_matrix(dtype):
    w13, w2 = values(1)
    # An element that scales to within an ulp of a rounding step (27, between 26 and 28) in the
    # gate rows of expert 0, whose amax is 3.0625: where a reciprocal multiply differs.
    w13[0, :I] *= 3.0 / w13[0, :I].abs().max()
    w13[0, 0, 0], w13[0, 0, 1] = 3.0625, 0.1845703125
    w13, w2 = w13.to(dtype), w2.to(dtype)
    packed = both_packers(w13, w2)
    w13_codes, w13_scales, w2_codes, w2_scales, input_scales = packed
    assert input_scales.shape == (0,), "without input scales the layer computes them (dynamic)"
    # Each matrix its own block: scale amax / 448, its largest element at the largest code.
    gate, up = w13[:, :I].float(), w13[:, I:].float()
    for name, got, matrix in (("gate", w13_scales[:, 0], gate), ("up", w13_scales[:, 1], up),
                              ("w2", w2_scales, w2.float())):
        amax = matrix.abs().amax(dim=(1, 2))
        assert torch.equal(got, amax / torch.full_like(amax, 448.0)), name
    assert not torch.equal(w13_scales[:, 0], w13_scales[:, 1])
    decoded13 = decode(deinterleaved(w13_codes), w13_scales)
    for e in range(E):
        expected13, expected2 = quantize_tensor_expert(w13[e], w2[e])
        assert torch.equal(decoded13[e], expected13), e
        assert torch.equal(decode(w2_codes[e:e + 1], w2_scales[e:e + 1, None])[0], expected2), e
    # Within E4M3's rounding (3 mantissa bits: half a step is 1/16 relative) of the values.
    assert ((decoded13 - w13.float()).abs() <= w13.float().abs() / 16 + w13_scales.amax() / 2**9).all()


@pytest.mark.parametrize("kind", SCALE_KINDS)
def test_checkpoints_of_each_scale_kind(kind):
    w13, w2 = values(2)
    (w13_codes, w13_scale), (w2_codes, w2_scale) = quantized(w13, kind, gate_up=True), quantized(w2, kind)
    # The checkpoint's scales as given, and as prepare_weights hands them to the packers.
    forms = [(w13_scale, w2_scale),
             (packing.checkpoint_scales(w13_scale, "w13_scale", E, 2 * I, H, gate_up=True, precision="fp8_tensor"),
              packing.checkpoint_scales(w2_scale, "w2_scale", E, H, I, precision="fp8_tensor"))]
    packs = [both_packers(w13_codes, w2_codes, *scales) for scales in forms]
    for pack in packs[1:]:
        for a, b in zip(pack, packs[0]):
            assert torch.equal(a, b)
    w13_packed, w13_scales, w2_packed, w2_scales, _ = packs[0]
    if kind == "channel":
        # Re-quantized from the decoded values, one block per expert matrix.
        from_values = both_packers(decoded(w13_codes, w13_scale, kind, gate_up=True), decoded(w2_codes, w2_scale, kind))
        for a, b in zip(packs[0], from_values):
            assert torch.equal(a, b)
        return
    # Per expert or per (expert, gate or up): the checkpoint's own codes and scales, bit for bit.
    assert torch.equal(deinterleaved(w13_packed), w13_codes.view(torch.uint8))
    assert torch.equal(w2_packed, w2_codes.view(torch.uint8))
    assert torch.equal(w13_scales, w13_scale if kind == "pair" else w13_scale.unsqueeze(1).expand(E, 2))
    assert torch.equal(w2_scales, w2_scale)


def vllm_checkpoint(salt: int, w13_scale_shape: str):
    """A vLLM per-tensor fp8 checkpoint's MoE layer: w13_weight [E, 2I, H] and w2_weight [E, H, I]
    float8_e4m3fn, w13_weight_scale [E, 2] (gate, up: as loaded, before vLLM merges them) or [E],
    w2_weight_scale [E], w13_input_scale and w2_input_scale [E] (one per expert, as saved)."""
    w13, w2 = values(salt)
    if w13_scale_shape == "[E, 2]":
        w13_weight, w13_weight_scale = quantized(w13, "pair", gate_up=True)
    else:
        w13_weight, w13_weight_scale = quantized(w13, "expert")
    w2_weight, w2_weight_scale = quantized(w2, "expert")
    w13_input_scale, w2_input_scale = input_scale_values(salt, E)
    return dict(w13_weight=w13_weight, w13_weight_scale=w13_weight_scale, w2_weight=w2_weight,
                w2_weight_scale=w2_weight_scale, w13_input_scale=w13_input_scale, w2_input_scale=w2_input_scale)


@pytest.mark.parametrize("w13_scale_shape", ["[E, 2]", "[E]"])
def test_a_vllm_per_tensor_checkpoint_keeps_its_codes(w13_scale_shape):
    c = vllm_checkpoint(3, w13_scale_shape)
    w13_codes, w13_scales, w2_codes, w2_scales, input_scales = both_packers(
        c["w13_weight"], c["w2_weight"], c["w13_weight_scale"], c["w2_weight_scale"], c["w13_input_scale"],
        c["w2_input_scale"])
    assert torch.equal(deinterleaved(w13_codes), c["w13_weight"].view(torch.uint8))
    assert torch.equal(w2_codes, c["w2_weight"].view(torch.uint8))
    w13_scale = c["w13_weight_scale"]
    assert torch.equal(w13_scales, w13_scale if w13_scale.dim() == 2 else torch.stack([w13_scale, w13_scale], 1))
    assert torch.equal(w2_scales, c["w2_weight_scale"])
    expected = torch.stack([c["w13_input_scale"].max(), c["w2_input_scale"].max()])
    assert torch.equal(input_scales, expected)
    # Interleaved by 8: the packed rows 8..15 of expert 1 are its up rows 0..7.
    assert torch.equal(w13_codes[1, 8:16], c["w13_weight"][1, I:I + 8].view(torch.uint8))


def test_block_scaled_checkpoints_are_requantized_per_expert_matrix():
    """DeepSeek-V3-style 128 x 128 block scales: the decoded values, one block per matrix."""
    w13, w2 = values(4)
    checkpoint = []
    for w in (w13, w2):
        blocks = w.reshape(E, w.shape[1] // 128, 128, w.shape[2] // 128, 128)
        amax = blocks.abs().amax(dim=(2, 4), keepdim=True)
        scale = amax / torch.full_like(amax, 448.0)
        codes = (blocks * (torch.ones_like(scale) / scale)).to(torch.float8_e4m3fn).reshape(w.shape)
        checkpoint.append((codes, scale.reshape(E, w.shape[1] // 128, w.shape[2] // 128)))
    (w13_codes, w13_scale), (w2_codes, w2_scale) = checkpoint
    packed = both_packers(w13_codes, w2_codes, w13_scale, w2_scale)
    w13_values = (w13_codes.float().reshape(E, 2 * I // 128, 128, H // 128, 128)
                  * w13_scale.reshape(E, 2 * I // 128, 1, H // 128, 1)).reshape(E, 2 * I, H)
    w2_values = (w2_codes.float().reshape(E, H // 128, 128, I // 128, 128)
                 * w2_scale.reshape(E, H // 128, 1, I // 128, 1)).reshape(E, H, I)
    for a, b in zip(packed, both_packers(w13_values, w2_values)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shapes", [((), ()), ((1,), (1,)), ((E,), (E,)), ((E, 1), (E, 1)), ((1,), (E,)),
                                    ((E,), ())])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_static_input_scales_are_the_largest_given(shapes, dtype):
    w13, w2 = values(5)
    g = generator(5)
    scales = [(torch.rand(shape, generator=g) * 0.1 + 0.001).to(dtype) for shape in shapes]
    input_scales = both_packers(w13, w2, None, None, *scales)[4]
    assert input_scales.dtype == torch.float32
    assert torch.equal(input_scales, torch.stack([scales[0].float().max(), scales[1].float().max()]))
    # The weights pack the same with or without them.
    for a, b in zip(both_packers(w13, w2)[:4], both_packers(w13, w2, None, None, *scales)[:4]):
        assert torch.equal(a, b)


def test_other_precisions_have_no_input_scales():
    w13, w2 = values(6)
    for precision, scale_shapes in (("bf16", ((0,), (0,))), ("fp8_block", ((E, 2, 2), (E, 2, 1)))):
        expected = OPS.pack_weights(w13, w2, None, None, None, None, precision, "fp32")
        actual = packing.pack_weights(w13, w2, precision, "fp32")
        assert len(expected) == len(actual) == 5
        for a, b in zip(actual, expected):
            assert torch.equal(a, b)
        assert expected[4].shape == (0,) and expected[4].dtype == torch.float32
        assert (expected[1].shape, expected[3].shape) == scale_shapes


BAD_SCALES = [0.0, -0.01, float("nan"), float("inf"), 1e-40]  # 1e-40: a float32 subnormal


@pytest.mark.parametrize("bad", BAD_SCALES)
def test_input_scales_must_be_positive_normal_floats(bad):
    w13, w2 = values(7)
    good, other = input_scale_values(7, E)
    broken = good.clone()
    broken[2] = bad
    message = r"w13_input_scale\[2\] = .*: activation scales must be positive normal floats"
    with pytest.raises(ValueError, match=message):
        OPS.pack_weights(w13, w2, None, None, broken, other, "fp8_tensor", "fp32")
    with pytest.raises(ValueError, match=message):
        packing.pack_weights(w13, w2, "fp8_tensor", "fp32", None, None, broken, other)
    with pytest.raises(ValueError, match=message):
        megamoe.prepare_weights(w13, w2, top_k=2, precision="fp8_tensor", w13_input_scale=broken,
                                w2_input_scale=other)
    with pytest.raises(ValueError, match=r"w2_input_scale\[0\] = .*positive normal floats"):
        megamoe.prepare_weights(w13, w2, top_k=2, precision="fp8_tensor", w13_input_scale=good,
                                w2_input_scale=torch.tensor(bad))


@pytest.mark.parametrize("given", ["w13_input_scale", "w2_input_scale"])
def test_one_input_scale_without_the_other_is_refused(given):
    w13, w2 = values(8)
    scale = input_scale_values(8, 1)[0]
    missing = "w2_input_scale" if given == "w13_input_scale" else "w13_input_scale"
    message = f"go together .* or neither .*; {missing} is missing"
    pair = (scale, None) if given == "w13_input_scale" else (None, scale)
    with pytest.raises(ValueError, match=message):
        OPS.pack_weights(w13, w2, None, None, *pair, "fp8_tensor", "fp32")
    with pytest.raises(ValueError, match=message):
        packing.pack_weights(w13, w2, "fp8_tensor", "fp32", None, None, *pair)
    with pytest.raises(ValueError, match=message):
        megamoe.prepare_weights(w13, w2, top_k=2, precision="fp8_tensor", **{given: scale})


@pytest.mark.parametrize("precision", ["fp8_block", "bf16"])
def test_input_scales_go_with_fp8_tensor_only(precision):
    w13, w2 = values(9)
    scales = input_scale_values(9, E)
    with pytest.raises(ValueError, match="input scales go with precision fp8_tensor"):
        OPS.pack_weights(w13, w2, None, None, *scales, precision, "fp32")
    with pytest.raises(ValueError, match="input scales go with precision fp8_tensor"):
        packing.pack_weights(w13, w2, precision, "fp32", None, None, *scales)
    with pytest.raises(ValueError, match="go with precision fp8_tensor"):
        megamoe.prepare_weights(w13, w2, top_k=2, precision=precision, w13_input_scale=scales[0],
                                w2_input_scale=scales[1])
    with pytest.raises(ValueError, match="go with precision fp8_tensor"):
        megamoe.prepare_weights(w13, w2, top_k=2, precision=precision, w13_input_scale=scales[0])


def test_bad_shapes_are_refused():
    w13, w2 = values(10)
    (w13_codes, w13_scale), (w2_codes, w2_scale) = quantized(w13, "pair", gate_up=True), quantized(w2, "expert")
    fp8 = dict(top_k=2, precision="fp8_tensor")
    three = torch.rand(E, 3) + 0.01
    with pytest.raises(ValueError, match=r"w13_scale must be .* got \[4, 3\]"):
        OPS.pack_weights(w13_codes, w2_codes, three, w2_scale, None, None, "fp8_tensor", "fp32")
    with pytest.raises(ValueError, match=r"w13_scale must hold .* got \[4, 3\]"):
        megamoe.prepare_weights(w13_codes, w2_codes, w13_scale=three, w2_scale=w2_scale, **fp8)
    pair = torch.rand(E, 2) + 0.01  # a pair is w13's only
    with pytest.raises(ValueError, match=r"w2_scale must be .* got \[4, 2\]"):
        OPS.pack_weights(w13_codes, w2_codes, w13_scale, pair, None, None, "fp8_tensor", "fp32")
    with pytest.raises(ValueError, match=r"w2_scale must hold .* got \[4, 2\]"):
        megamoe.prepare_weights(w13_codes, w2_codes, w13_scale=w13_scale, w2_scale=pair, **fp8)
    with pytest.raises(ValueError, match=r"w13_scale\[0, 0\] = -.*: scales must be finite and positive"):
        megamoe.prepare_weights(w13_codes, w2_codes, w13_scale=-w13_scale, w2_scale=w2_scale, **fp8)
    with pytest.raises(ValueError, match="finite and positive"):
        OPS.pack_weights(w13_codes, w2_codes, w13_scale, w2_scale * float("nan"), None, None, "fp8_tensor", "fp32")
    for shape in [(E, 2), (2,), (E + 1,), (1, E)]:
        scales = torch.rand(shape) + 0.01, torch.rand(E) + 0.01
        with pytest.raises(ValueError, match=r"w13_input_scale must hold one activation scale per layer"):
            OPS.pack_weights(w13, w2, None, None, *scales, "fp8_tensor", "fp32")
        with pytest.raises(ValueError, match=r"w13_input_scale must hold one activation scale per layer"):
            megamoe.prepare_weights(w13, w2, w13_input_scale=scales[0], w2_input_scale=scales[1], **fp8)
    with pytest.raises(TypeError, match="w2_input_scale must be a floating-point tensor"):
        OPS.pack_weights(w13, w2, None, None, torch.ones(1), torch.ones(1, dtype=torch.int32), "fp8_tensor", "fp32")
    with pytest.raises(TypeError, match="w2_input_scale must be a floating-point tensor"):
        megamoe.prepare_weights(w13, w2, w13_input_scale=torch.ones(1), w2_input_scale=torch.ones(1, dtype=torch.int32),
                                **fp8)
    with pytest.raises(TypeError, match="w13_input_scale must be a torch.Tensor"):
        megamoe.prepare_weights(w13, w2, w13_input_scale=0.01, w2_input_scale=torch.ones(1), **fp8)


def test_the_precision_and_layer_checks_know_fp8_tensor():
    w13, w2 = values(11)
    listed = r"precision must be 'bf16', 'fp8_block' or 'fp8_tensor', not 'fp8'"
    with pytest.raises(ValueError, match=listed):
        megamoe.prepare_weights(w13, w2, top_k=2, precision="fp8")
    with pytest.raises(ValueError, match=listed):
        OPS.pack_weights(w13, w2, None, None, None, None, "fp8", "fp32")
    assert "fp8_tensor" in megamoe.layer.PRECISIONS
    with pytest.raises(ValueError, match="scale_format=ue8m0 only applies to precision fp8_block"):
        megamoe.prepare_weights(w13, w2, top_k=2, precision="fp8_tensor", scale_format="ue8m0")
    with pytest.raises(ValueError, match="launch='single_kernel' with precision 'fp8_tensor' takes static activation"):
        megamoe.prepare_weights(w13, w2, top_k=2, precision="fp8_tensor", launch="single_kernel")
    # fp8_tensor's layer description itself passes the op's checks (only the device is left).
    OPS.check_layer(E, H, I, 2, "fp8_tensor", "fp32", "softmax", True, 1, 1, 1.0, None, 16, 0, "auto", 0, "auto")


def packed_fp8_tensor():
    """Packed fp8_tensor tensors of E experts, H = 256, I = 128 (what create_layer copies)."""
    w13, w2 = values(12)
    return OPS.pack_weights(w13, w2, None, None, *input_scale_values(12, 1), "fp8_tensor", "fp32")


def test_create_layer_checks_the_input_scales_before_the_device():
    w13, w13_scales, w2, w2_scales, input_scales = packed_fp8_tensor()
    spec = [E, H, I, 2, "fp8_tensor", "fp32", "softmax", True, 1, 1, 1.0, None, 16, 0, "auto", 0, "auto", 0]
    with pytest.raises(ValueError, match=r"input_scales must hold \(fc1_input_scale, fc2_input_scale\) \[2\]"):
        OPS.create_layer(w13, w13_scales, w2, w2_scales, torch.ones(3), *spec)
    with pytest.raises(TypeError, match="packed input_scales must be Float"):
        OPS.create_layer(w13, w13_scales, w2, w2_scales, input_scales.double(), *spec)
    with pytest.raises(ValueError, match="packed w2_scales must be contiguous with 4 elements"):
        OPS.create_layer(w13, w13_scales, w2, w13_scales, input_scales, *spec)
    bf16 = [E, H, I, 2, "bf16", "fp32", "softmax", True, 1, 1, 1.0, None, 16, 0, "auto", 0, "auto", 0]
    w13_bf16, empty, w2_bf16, _, _ = OPS.pack_weights(*values(12), None, None, None, None, "bf16", "fp32")
    with pytest.raises(ValueError, match="packed input_scales go with precision fp8_tensor"):
        OPS.create_layer(w13_bf16, empty, w2_bf16, empty, input_scales, *bf16)


def test_expert_parallelism_runs_fp8_tensor_staged_only():
    """fp8_tensor is taken staged (each owner encodes the bf16 rows it receives: ep_two_ranks.py runs
    it on a GPU) and refused fused, by prepare_ep_weights and by the op, before any rendezvous."""
    w13, w2 = values(13)
    with pytest.raises(NotImplementedError, match="an fp8_tensor layer runs staged"):
        megamoe.prepare_ep_weights(w13, w2, num_experts=2 * E, top_k=2, precision="fp8_tensor", rank=0, world_size=2,
                                   rendezvous_dir="/nowhere", launch="fused")
    w13_codes, w13_scales, w2_codes, w2_scales, input_scales = packed_fp8_tensor()
    with pytest.raises(NotImplementedError, match="an fp8_tensor layer runs staged"):
        OPS.create_ep_layer(w13_codes, w13_scales, w2_codes, w2_scales, input_scales, 2 * E, H, I, 2, "fp8_tensor",
                            "fp32", 16, "/nowhere", 0, 2, 0, "automatic", "bf16", "cuda_ipc", "fused")
    with pytest.raises(ValueError, match="token_rows='fp8' needs precision fp8_block"):
        OPS.create_ep_layer(w13_codes, w13_scales, w2_codes, w2_scales, input_scales, 2 * E, H, I, 2, "fp8_tensor",
                            "fp32", 16, "/nowhere", 0, 2, 0, "fp8", "bf16", "cuda_ipc", "staged")
    with pytest.raises(ValueError, match=r"input_scales must hold \(fc1_input_scale, fc2_input_scale\) \[2\]"):
        OPS.create_ep_layer(w13_codes, w13_scales, w2_codes, w2_scales, torch.ones(3), 2 * E, H, I, 2, "fp8_tensor",
                            "fp32", 16, "/nowhere", 0, 2, 0, "automatic", "bf16", "cuda_ipc", "staged")


def test_weights_show_their_precision_and_input_scales():
    weights = megamoe.MoeWeights(handle=-1, num_experts=E, top_k=2, hidden=H, intermediate=I, precision="fp8_tensor",
                                 scale_format="fp32", routing=megamoe.SoftmaxRouting(), input_scales="dynamic",
                                 max_tokens=8, device=torch.device("cuda", 0))
    assert weights.input_scales == "dynamic"
    assert "precision='fp8_tensor', input_scales='dynamic'" in repr(weights)
    bf16 = megamoe.MoeWeights(handle=-1, num_experts=E, top_k=2, hidden=H, intermediate=I, precision="bf16",
                              scale_format="fp32", routing=megamoe.SoftmaxRouting(), max_tokens=8,
                              device=torch.device("cuda", 0))
    assert bf16.input_scales is None and "input_scales" not in repr(bf16)


def test_reference_activation_rounding():
    """The reference's per-tensor rounding (moe_reference.quantize_per_tensor): E4M3 with
    saturation at +-448 (PyTorch's own cast gives NaN from 480 up), and a dynamic scale from the
    finite values only, at least 1e-4 / 448."""
    scale = torch.tensor(0.5)
    v = torch.tensor([0.0, 1.0, -3.3, 224.0, 300.0, -1000.0, 0.001])
    out = quantize_per_tensor(v, scale)
    assert out[:4].tolist() == [0.0, 1.0, -3.25, 224.0]
    assert out[4].item() == 224.0 and out[5].item() == -224.0  # saturated: 448 * 0.5
    assert out[6].item() == 2**-9 * 0.5  # the smallest subnormal code, 0.002 rounded
    x = torch.randn(64, 128, generator=generator(14))
    x[3, 5] = float("inf")
    x[7, 1] = float("nan")
    amax = x[x.isfinite()].abs().max()  # after the poisoning: either cell may have held the max
    assert torch.equal(tensor_scale(x), amax / torch.tensor(448.0))
    assert torch.equal(tensor_scale(torch.zeros(4)), torch.tensor(1e-4) / torch.tensor(448.0))


def test_reference_quantizes_as_the_packer_and_stays_near_the_plain_math():
    """moe_reference's fp8_tensor path on the CPU: its weight quantization is the packers' (the
    same output from the packed bytes decoded), its static scales calibrated on x itself are x's
    dynamic one, and the result stays within the GPU suite's loose bound of unquantized math."""
    w13, w2 = values(15)
    w13, w2 = w13 * 0.05, w2 * 0.05
    g = generator(15)
    x = torch.randn(24, H, generator=g).to(torch.bfloat16)
    ids, weights = route_softmax(torch.randn(24, E, generator=g), 2, True)
    w13_codes, w13_scales, w2_codes, w2_scales, _ = packing.pack_weights(w13, w2, "fp8_tensor")
    w13_packed = decode(deinterleaved(w13_codes), w13_scales)
    w2_packed = decode(w2_codes, w2_scales.unsqueeze(1))
    dynamic = moe_reference(x, w13, w2, ids, weights, "fp8_tensor")
    assert torch.equal(moe_reference(x, w13_packed, w2_packed, ids, weights, "fp8_tensor", quantized_weights=True),
                       dynamic)
    s1, s2 = calibrated_input_scales(x, w13, w2, ids)
    assert torch.equal(s1, tensor_scale(x))
    static = moe_reference(x, w13, w2, ids, weights, "fp8_tensor", input_scales=(s1, s2))
    exact = moe_reference(x, w13, w2, ids, weights)
    assert relative_l2(static, exact) < 0.12 and relative_l2(dynamic, exact) < 0.12
    # Apart by two roundings' noise: FC1's output in bf16 first, and its scale from quantized math.
    assert 0 < relative_l2(static, dynamic) < 0.1
    # A static scale other than the one calibrated moves the codes, and the output with them.
    assert relative_l2(moe_reference(x, w13, w2, ids, weights, "fp8_tensor", input_scales=(s1 * 1.3, s2)), static) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["values", "vllm [E, 2]", "vllm [E]", "channel"])
def test_the_same_bytes_packed_on_the_gpu(hopper, source):
    """megamoe.packing on the GPU (prepare_weights' path for CUDA weights) against the C++ packer."""
    if source.startswith("vllm"):
        c = vllm_checkpoint(16, source[5:])
        arguments = [c["w13_weight"], c["w2_weight"], c["w13_weight_scale"], c["w2_weight_scale"], c["w13_input_scale"],
                     c["w2_input_scale"]]
    elif source == "channel":
        w13, w2 = values(16)
        (w13_codes, w13_scale), (w2_codes, w2_scale) = quantized(w13, "channel", gate_up=True), quantized(w2, "channel")
        arguments = [w13_codes, w2_codes, w13_scale.unsqueeze(-1), w2_scale.unsqueeze(-1), None, None]
    else:
        arguments = [*(w.to(torch.bfloat16) for w in values(16)), None, None, *input_scale_values(16, 1)]
    expected = OPS.pack_weights(*arguments, "fp8_tensor", "fp32")
    on_gpu = [None if t is None else t.to(hopper) for t in arguments]
    actual = packing.pack_weights(on_gpu[0], on_gpu[1], "fp8_tensor", "fp32", *on_gpu[2:])
    assert all(t.is_cuda for t in actual), "packing.pack_weights left its device"
    for name, a, e in zip(("w13", "w13 scales", "w2", "w2 scales", "input scales"), actual, expected):
        assert a.shape == e.shape and torch.equal(a.cpu(), e), name
