"""megamoe.bench's parts that need no GPU: the PyTorch baseline's routing, expert order and bf16
pipeline (torch._grouped_mm runs on the CPU), its fp8 pipeline's shapes and strides (on the meta
device, where torch._scaled_grouped_mm checks what its CUDA kernels check), the floors, the table
and the plot."""

import json

import pytest
import torch

from megamoe import bench
from megamoe.routing import DeepseekRouting, SoftmaxRouting
from megamoe.workloads import Workload
from moe_reference import moe_reference, relative_l2, route_deepseek, route_softmax

SMALL = Workload(16, 4, 256, 128, SoftmaxRouting(renormalize=True), "small")
SMALL_GROUPED = Workload(16, 4, 256, 128, DeepseekRouting(n_group=4, topk_group=2, routed_scaling_factor=2.5), "small")


def test_routing_is_the_references():
    logits = torch.randn(50, 16)
    ids, weights = bench.route(logits, SMALL, None)
    expected_ids, expected_weights = route_softmax(logits, 4, renormalize=True)
    assert torch.equal(ids.int(), expected_ids)
    assert torch.allclose(weights, expected_weights, rtol=1e-5)
    bias = torch.rand(16) * 0.1
    ids, weights = bench.route(logits, SMALL_GROUPED, bias)
    expected_ids, expected_weights = route_deepseek(logits, 4, 4, 2, 2.5, True, bias)
    assert torch.equal(ids.sort(dim=-1).values.int(), expected_ids.sort(dim=-1).values)
    assert torch.allclose(weights.sort(dim=-1).values, expected_weights.sort(dim=-1).values, rtol=1e-5)


@pytest.mark.parametrize("align", [1, 16])
def test_expert_order_places_every_slot_in_its_experts_segment(align):
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(37)])
    order, rows, ends, capacity = bench.expert_order(ids, 16, align)
    flat = ids.flatten()
    assert sorted(order.tolist()) == list(range(flat.numel()))
    assert len(set(rows.tolist())) == rows.numel() and rows.max().item() < capacity
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), ends[:-1]])
    assert ((starts % align) == 0).all() and ((ends % align) == 0).all()
    expert_of_row = flat[order]
    assert ((rows >= starts[expert_of_row]) & (rows < ends[expert_of_row])).all()


def test_bf16_pipeline_computes_the_layer():
    w13 = torch.randn(16, 256, 256) / 16
    w2 = torch.randn(16, 256, 128) / 11.3
    x = torch.randn(40, 256).to(torch.bfloat16)
    logits = torch.randn(40, 16)
    y = bench.TorchMoe(w13, w2, SMALL, None, fp8=False)(x, logits)
    ids, weights = route_softmax(logits, 4, renormalize=True)
    expected = moe_reference(x, w13.to(torch.bfloat16), w2.to(torch.bfloat16), ids, weights, "bf16")
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert relative_l2(y, expected) < 1e-2


def test_fp8_pipeline_passes_the_grouped_gemms_checks():
    meta = torch.device("meta")
    w13 = torch.empty(16, 256, 256, device=meta)
    w2 = torch.empty(16, 256, 128, device=meta)
    layer = bench.TorchMoe(w13, w2, SMALL, None, fp8=True)
    assert layer.w13.dtype == torch.float8_e4m3fn and layer.w13_scale.shape == (16, 256)
    y = layer(torch.empty(40, 256, dtype=torch.bfloat16, device=meta), torch.empty(40, 16, device=meta))
    assert y.shape == (40, 256) and y.dtype == torch.bfloat16


def test_weights_quantized_an_expert_at_a_time_as_in_one_piece():
    weights = (torch.randn(5, 64, 96) * torch.rand(5, 64, 1) * 10).to(torch.bfloat16)
    codes, scales = bench.quantize_expert_rows(weights)
    whole_codes, whole_scales = bench.quantize_rows(weights)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (5, 64)
    assert torch.equal(codes.view(torch.uint8), whole_codes.view(torch.uint8))
    assert torch.equal(scales, whole_scales)
    assert relative_l2(codes.float() * scales.unsqueeze(-1), weights.float()) < 0.05


def test_random_weights_are_bf16_with_variance_one_over_columns():
    generator = torch.Generator().manual_seed(3)
    weights = bench.random_weights(4, 128, 400, generator)
    assert weights.dtype == torch.bfloat16 and weights.shape == (4, 128, 400)
    assert weights.float().var().item() == pytest.approx(1 / 400, rel=0.05)
    assert not torch.equal(weights[0], weights[1])


def test_floor_is_the_larger_of_bytes_and_flops():
    ids = torch.tensor([[0, 1], [1, 2]])
    workload = Workload(4, 2, 256, 128, SoftmaxRouting(), "tiny")
    bytes_floor = 3 * 3 * 256 * 128 / 1e12 * 1e6
    assert bench.floor_us(workload, ids, 1e12, 1e30) == pytest.approx(bytes_floor)
    flops_floor = 2.0 * 4 * 3 * 256 * 128 / 1e9 * 1e6
    assert bench.floor_us(workload, ids, 1e30, 1e9) == pytest.approx(flops_floor)


def test_table_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    records = [dict(workload="small", tokens=t, implementation=i, floor_us=10.0 * t, gpu="test GPU",
                    median_us=None if i == "torch fp8" else 12.0 * t * (n + 1), rel_err=1e-3, error=None)
               for t in (1, 16, 128) for n, i in enumerate(bench.IMPLEMENTATIONS)]
    bench.print_table("small", records)
    out = capsys.readouterr().out
    assert "not run" in out and "12.0" in out
    path = tmp_path / "plot.png"
    bench.write_plot(path, "small", records)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(records)


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench.main(["--tokens", "1,x"])
    with pytest.raises(SystemExit):
        bench.main(["--tokens", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--workload", "nope"])
