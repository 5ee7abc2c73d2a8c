"""megamoe.packing (PyTorch, any device) against the C++ packer (torch.ops.megamoe.pack_weights,
host): the same bytes for every input dtype, precision and scale format (on the CPU; the GPU
suite packs on the device and checks the layer's output)."""

import pytest
import torch

import megamoe  # noqa: F401  (loads torch.ops.megamoe)
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


@pytest.mark.parametrize("source", ["bf16", "fp32", "fp8_checkpoint"])
@pytest.mark.parametrize("precision,scale_format", [("bf16", "fp32"), ("fp8_block", "fp32"), ("fp8_block", "ue8m0")])
def test_the_same_bytes_as_the_host_packer(source, precision, scale_format):
    generator = torch.Generator().manual_seed(7)
    if source == "fp8_checkpoint":
        w13, w2, w13_scale, w2_scale = checkpoint(generator)
    else:
        dtype = torch.bfloat16 if source == "bf16" else torch.float32
        w13 = torch.randn(E, 2 * I, H, generator=generator).to(dtype) * 0.05
        w2 = torch.randn(E, H, I, generator=generator).to(dtype) * 0.05
        # A bf16-valued element that scales to exactly a rounding tie (27 between 26 and 28, in the
        # block whose amax is 3.0625): the case a reciprocal multiply gets wrong.
        w13[0, 0, 0], w13[0, 0, 1] = 3.0625, 0.1845703125
        w13_scale = w2_scale = None
    expected = torch.ops.megamoe.pack_weights(w13, w2, w13_scale, w2_scale, precision, scale_format)
    actual = packing.pack_weights(w13, w2, precision, scale_format, w13_scale, w2_scale)
    for name, a, e in zip(("w13", "w13 scales", "w2", "w2 scales"), actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        assert torch.equal(a, e), f"{name}: {(a != e).sum().item()} of {a.numel()} differ"
