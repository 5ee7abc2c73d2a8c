"""megamoe under careless or hostile use from Python, on a Hopper GPU: threads sharing a layer,
CUDA graphs against later calls with other settings, failed allocations, absent devices and
integer limits. None may fault the GPU, change a result silently, or leave the process less usable
than it was. (The C++ suite, tests/api/test_moe_layer_faults.cpp, adds other kernels holding SMs
and a soak of 10,000 calls.)"""

import threading

import pytest
import torch

import megamoe
from test_layer import problem


@pytest.mark.gpu
def test_threads_sharing_weights_and_a_stream(hopper):
    p = problem("qwen35-a3b", "fp8_block", hopper)
    cases = [p.inputs(tokens, seed=40 + tokens) for tokens in (1, 16, 100, 300)]
    alone = [megamoe.fused_moe(x, p.weights, logits) for x, logits in cases]
    results = [[] for _ in cases]
    errors = []

    def calls(i):
        try:
            x, logits = cases[i]
            for _ in range(100):
                results[i].append(megamoe.fused_moe(x, p.weights, logits))
        except Exception as e:  # noqa: BLE001: reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=calls, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert errors == []
    for i, expected in enumerate(alone):
        assert all(torch.equal(y, expected) for y in results[i]), f"thread {i} computed another result"


@pytest.mark.gpu
def test_a_graph_replays_the_routing_it_captured(hopper):
    p = problem("qwen35-a3b", "fp8_block", hopper)
    x, logits = p.inputs(64, seed=50)
    bias_a = torch.linspace(-0.05, 0.05, p.w13.shape[0])
    bias_b = bias_a.flip(0) * 3
    routing_a = megamoe.DeepseekRouting(n_group=8, topk_group=4, routed_scaling_factor=2.5, e_score_correction_bias=bias_a)
    routing_b = megamoe.DeepseekRouting(n_group=8, topk_group=4, routed_scaling_factor=2.5, e_score_correction_bias=bias_b)
    with_a = megamoe.fused_moe(x, p.weights, logits, routing=routing_a)  # uploads bias a, outside the capture
    with_b = megamoe.fused_moe(x, p.weights, logits, routing=routing_b)
    assert not torch.equal(with_a, with_b), "the two biases must route differently for the test to mean anything"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = megamoe.fused_moe(x, p.weights, logits, routing=routing_a)
    # Calls with other settings after the capture: another bias, and the layer's own softmax.
    assert torch.equal(megamoe.fused_moe(x, p.weights, logits, routing=routing_b), with_b)
    megamoe.fused_moe(x, p.weights, logits)
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, with_a)


@pytest.mark.gpu
def test_a_new_bias_inside_a_capture_is_refused_and_the_process_goes_on(hopper):
    p = problem("qwen35-a3b", "fp8_block", hopper)
    x, logits = p.inputs(8, seed=51)
    unseen = megamoe.DeepseekRouting(n_group=8, topk_group=4, routed_scaling_factor=1.0,
                                     e_score_correction_bias=torch.rand(p.w13.shape[0]) * 0.01)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="before capturing"):
        with torch.cuda.graph(graph):
            megamoe.fused_moe(x, p.weights, logits, routing=unseen)
    y = megamoe.fused_moe(x, p.weights, logits, routing=unseen)  # outside a capture it is uploaded
    torch.cuda.synchronize()
    assert torch.isfinite(y.float()).all()


@pytest.mark.gpu
def test_a_failed_allocation_leaves_the_process_as_it_was(hopper):
    hidden = 7168
    w13 = torch.randn(16, 512, hidden, device=hopper).to(torch.bfloat16) / 100
    w2 = torch.randn(16, hidden, 256, device=hopper).to(torch.bfloat16) / 100
    # Free device memory as the driver counts it, less what PyTorch's caching allocator keeps for
    # reuse (blocks that prepare_weights' own tensors left behind are no leak of megamoe's).
    def free_memory():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]

    free_before = free_memory()
    for _ in range(8):  # a leak per refusal adds up past the tolerance below
        with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
            megamoe.prepare_weights(w13, w2, top_k=4, max_tokens=2**24)  # a workspace of ~1.9 TB
    # The next unrelated operation works, and the failed layers hold no device memory.
    assert torch.ones(1000, device=hopper).sum().item() == 1000
    free_after = free_memory()
    assert abs(free_after - free_before) < 64 << 20
    weights = megamoe.prepare_weights(w13, w2, top_k=4, max_tokens=16)
    x = torch.randn(3, hidden, device=hopper).to(torch.bfloat16)
    assert torch.isfinite(megamoe.fused_moe(x, weights, torch.randn(3, 16, device=hopper)).float()).all()


@pytest.mark.gpu
def test_absent_devices_are_refused_by_name(hopper):
    p = problem("qwen35-a3b", "bf16", hopper)
    absent = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"device cuda:{absent} does not exist: this process sees {absent} CUDA"):
        megamoe.prepare_weights(p.w13, p.w2, top_k=8, precision="bf16", device=f"cuda:{absent}")
    for index in (absent, -2):
        with pytest.raises(ValueError, match=f"device cuda:{index} does not exist"):
            torch.ops.megamoe.check_device(index)
    assert torch.ops.megamoe.check_device(-1) == torch.cuda.current_device()
    # The op called directly checks the device after its other arguments (packed bf16 weights of
    # 4 experts, H = I = 128).
    w13, w2, scales = torch.zeros(4, 256, 256, dtype=torch.uint8), torch.zeros(4, 128, 256, dtype=torch.uint8), torch.empty(0)
    with pytest.raises(ValueError, match="does not exist"):
        torch.ops.megamoe.create_layer(w13, scales, w2, scales, scales, 4, 128, 128, 2, "bf16", "fp32", "softmax",
                                       False, 1, 1, 1.0, None, 16, 0, "auto", 0, "auto", absent)


@pytest.mark.gpu
def test_planner_options_leave_the_output_unchanged(hopper):
    p = problem("qwen35-a3b", "fp8_block", hopper)
    x, logits = p.inputs(300, seed=52)
    expected = megamoe.fused_moe(x, p.weights, logits)
    for options in (dict(token_tile=16), dict(token_tile=64), dict(fc1_token_rows="pool"),
                    dict(fc1_token_rows="row_copy"), dict(num_sms=5), dict(launch="single_kernel"),
                    dict(launch="per_stage")):
        weights = megamoe.prepare_weights(p.w13, p.w2, top_k=p.top_k, precision="fp8_block", routing=p.routing,
                                          max_tokens=512, **options)
        assert weights.options == options
        assert torch.equal(megamoe.fused_moe(x, weights, logits), expected), options
