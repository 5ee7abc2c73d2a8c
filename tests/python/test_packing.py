"""megamoe.packing (PyTorch, any device) against the C++ packer (torch.ops.megamoe.pack_weights,
host): the same bytes for every input dtype, precision and scale format, packed on the CPU and,
on a Hopper machine, on the GPU (fp8_tensor's own checkpoints and input scales:
test_fp8_tensor.py)."""

import pytest
import torch

import megamoe  # noqa: F401  (loads torch.ops.megamoe)
from checkpoints import SCALE_KINDS, decoded, quantized
from megamoe import packing

E, H, I = 3, 256, 128


def checkpoint(generator: torch.Generator):
    """A DeepSeek-V3-style fp8 checkpoint: codes with one amax / 448 scale per 128 x 128 block."""
    w13 = torch.randn(E, 2 * I, H, generator=generator) * 0.05
    w2 = torch.randn(E, H, I, generator=generator) * 0.05
    out = []
    for w in (w13, w2):
        blocks = w.reshape(E, w.shape[1] // 128, 128, w.shape[2] // 128, 128)
        amax = blocks.abs().amax(dim=(2, 4), keepdim=True)
        codes = (blocks * (torch.full_like(amax, 448.0) / amax)).to(torch.float8_e4m3fn)
        out += [codes.reshape(w.shape), (amax / torch.full_like(amax, 448.0)).reshape(E, w.shape[1] // 128, -1)]
    return out[0], out[2], out[1], out[3]


def weights(source: str):
    """w13, w2, w13_scale, w2_scale on the CPU, as bf16, fp32 or an fp8 checkpoint."""
    generator = torch.Generator().manual_seed(7)
    if source == "fp8_checkpoint":
        return checkpoint(generator)
    dtype = torch.bfloat16 if source == "bf16" else torch.float32
    w13 = torch.randn(E, 2 * I, H, generator=generator).to(dtype) * 0.05
    w2 = torch.randn(E, H, I, generator=generator).to(dtype) * 0.05
    # A bf16-valued element that scales to exactly a rounding tie (27 between 26 and 28, in the
    # block whose amax is 3.0625): the case a reciprocal multiply gets wrong.
    w13[0, 0, 0], w13[0, 0, 1] = 3.0625, 0.1845703125
    return w13, w2, None, None


def assert_same_bytes(actual, expected):
    assert len(actual) == len(expected) == 5
    for name, a, e in zip(("w13", "w13 scales", "w2", "w2 scales", "input scales"), actual, expected):
        a = a.cpu()
        assert a.shape == e.shape and a.dtype == e.dtype, name
        assert torch.equal(a, e), f"{name}: {(a != e).sum().item()} of {a.numel()} differ"


SOURCES = pytest.mark.parametrize("source", ["bf16", "fp32", "fp8_checkpoint"])
FORMATS = pytest.mark.parametrize("precision,scale_format",
                                  [("bf16", "fp32"), ("fp8_block", "fp32"), ("fp8_block", "ue8m0"),
                                   ("fp8_tensor", "fp32")])


@SOURCES
@FORMATS
def test_the_same_bytes_as_the_host_packer(source, precision, scale_format):
    w13, w2, w13_scale, w2_scale = weights(source)
    expected = torch.ops.megamoe.pack_weights(w13, w2, w13_scale, w2_scale, None, None, precision, scale_format)
    assert_same_bytes(packing.pack_weights(w13, w2, precision, scale_format, w13_scale, w2_scale), expected)


@pytest.mark.gpu
@SOURCES
@FORMATS
def test_the_same_bytes_packed_on_the_gpu(hopper, source, precision, scale_format):
    w13, w2, w13_scale, w2_scale = weights(source)
    expected = torch.ops.megamoe.pack_weights(w13, w2, w13_scale, w2_scale, None, None, precision, scale_format)
    on_gpu = [None if t is None else t.to(hopper) for t in (w13, w2, w13_scale, w2_scale)]
    actual = packing.pack_weights(on_gpu[0], on_gpu[1], precision, scale_format, on_gpu[2], on_gpu[3])
    assert all(t.is_cuda for t in actual), "packing.pack_weights left its device"
    assert_same_bytes(actual, expected)


# intermediate 192 (bf16 layers take multiples of 64): a 128-row block straddles gate and up.
@pytest.mark.parametrize("kind", SCALE_KINDS)
@pytest.mark.parametrize("precision,scale_format,intermediate",
                         [("bf16", "fp32", 128), ("fp8_block", "fp32", 128), ("fp8_block", "ue8m0", 128),
                          ("bf16", "fp32", 192)])
def test_expert_pair_and_channel_scales_pack_as_their_decoded_values(kind, precision, scale_format, intermediate):
    generator = torch.Generator().manual_seed(11)
    w13 = torch.randn(E, 2 * intermediate, H, generator=generator) * torch.rand(E, 2 * intermediate, 1, generator=generator)
    w2 = torch.randn(E, H, intermediate, generator=generator) * 0.05
    (w13_codes, w13_scale), (w2_codes, w2_scale) = quantized(w13, kind, gate_up=True), quantized(w2, kind)
    w13_values, w2_values = decoded(w13_codes, w13_scale, kind, gate_up=True), decoded(w2_codes, w2_scale, kind)
    expected = torch.ops.megamoe.pack_weights(w13_values, w2_values, None, None, None, None, precision, scale_format)
    scales = [packing.checkpoint_scales(w13_scale, "w13_scale", E, 2 * intermediate, H, gate_up=True),
              packing.checkpoint_scales(w2_scale, "w2_scale", E, H, intermediate)]
    assert_same_bytes(packing.pack_weights(w13_codes, w2_codes, precision, scale_format, *scales), expected)
    assert_same_bytes(torch.ops.megamoe.pack_weights(w13_codes, w2_codes, *scales, None, None, precision, scale_format), expected)
    # The checkpoint's own shapes ([E], [E, 2], [E, rows]) pack the same in both packers.
    raw = (w13_scale, w2_scale)
    assert_same_bytes(packing.pack_weights(w13_codes, w2_codes, precision, scale_format, *raw), expected)
    assert_same_bytes(torch.ops.megamoe.pack_weights(w13_codes, w2_codes, *raw, None, None, precision, scale_format),
                      expected)
    # Per-expert and gate/up scales become block scales where each block lies whole in one scale's
    # span (w13's 2I rows, or each half of them for a pair), rows otherwise, as channel scales are.
    w13_blocks = (kind == "expert" and 2 * intermediate % 128 == 0) or (kind == "pair" and intermediate % 128 == 0)
    assert packing.row_scaled(scales[0], 2 * intermediate) != w13_blocks
    assert packing.row_scaled(scales[1], H) != (kind != "channel" and intermediate % 128 == 0)


def test_checkpoint_scales_take_every_layout_of_the_same_scales():
    scale = torch.rand(E) + 0.5
    block = packing.checkpoint_scales(scale, "w2_scale", E, H, I)
    assert block.shape == (E, H // 128, I // 128) and torch.equal(block, scale.view(E, 1, 1).expand_as(block))
    for shape in [(E, 1), (E, 1, 1)]:
        assert torch.equal(packing.checkpoint_scales(scale.view(shape), "w2_scale", E, H, I), block)
    per_row = torch.rand(E, H)
    assert torch.equal(packing.checkpoint_scales(per_row, "w2_scale", E, H, I), per_row.unsqueeze(-1))
    assert torch.equal(packing.checkpoint_scales(per_row.unsqueeze(-1), "w2_scale", E, H, I), per_row.unsqueeze(-1))
    pair = torch.tensor([[1.0, 2.0]]).expand(E, 2)
    gate_up = packing.checkpoint_scales(pair, "w13_scale", E, 2 * I, H, gate_up=True)
    assert gate_up.shape == (E, 2 * I // 128, H // 128)
    assert (gate_up[:, : I // 128] == 1.0).all() and (gate_up[:, I // 128:] == 2.0).all()
    with pytest.raises(ValueError, match=r"per expert \(\[E\], \[E, 1\], \[E, 1, 1\]\) or per output channel"):
        packing.checkpoint_scales(pair, "w2_scale", E, H, I)  # a pair is w13's only
    with pytest.raises(ValueError, match=r"w13_scale must hold .* got \[3, 5\]"):
        packing.checkpoint_scales(torch.ones(E, 5), "w13_scale", E, 2 * I, H, gate_up=True)


@pytest.mark.parametrize("dtype,name", [(torch.uint8, "Byte"), (torch.int32, "Int"), (torch.bool, "Bool")])
def test_the_host_packer_refuses_scales_that_are_not_floating_point(dtype, name):
    """Integer scales were converted as numbers: a checkpoint's uint8 exponents 127 packed as
    scales 127 times too large, without a word."""
    w13, w2, w13_scale, w2_scale = checkpoint(torch.Generator().manual_seed(3))
    bad = torch.ones(E, dtype=dtype)
    with pytest.raises(TypeError, match=rf"w13_scale must be a floating-point tensor \(float32 scales\), not {name}"):
        torch.ops.megamoe.pack_weights(w13, w2, bad, w2_scale, None, None, "fp8_block", "fp32")
    with pytest.raises(TypeError, match="w2_scale must be a floating-point tensor"):
        torch.ops.megamoe.pack_weights(w13, w2, w13_scale, bad, None, None, "fp8_tensor", "fp32")
