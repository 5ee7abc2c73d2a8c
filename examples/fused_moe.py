"""The README's Python usage as a complete program: prepare vLLM-layout weights, call fused_moe
eagerly, through MegaMoE, and from a CUDA graph. Needs a Hopper GPU and the megamoe package."""

import sys

import torch

import megamoe

if not torch.cuda.is_available():
    sys.exit("examples/fused_moe.py needs a Hopper GPU (sm_90); PyTorch sees no CUDA device")
E, k, H, I = 128, 8, 2048, 768  # qwen3-30b-a3b's experts, top-k, hidden and intermediate sizes
torch.manual_seed(0)
w13 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16, device="cuda") / H**0.5  # gate rows, then up rows
w2 = torch.randn(E, H, I, dtype=torch.bfloat16, device="cuda") / I**0.5
weights = megamoe.prepare_weights(w13, w2, top_k=k, precision="fp8_block",
                                  routing=megamoe.SoftmaxRouting(renormalize=True), max_tokens=4096)

x = torch.randn(64, H, dtype=torch.bfloat16, device="cuda")
router_logits = torch.randn(64, E, device="cuda")
y = megamoe.fused_moe(x, weights, router_logits)  # [64, H] bf16

# As a module over the same weights, and captured in a CUDA graph.
experts = megamoe.MegaMoE.from_weights(weights)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    y_graph = experts(x, router_logits)
graph.replay()

# The same routing chosen by the caller: ids [T, k] (-1: not routed here) and their weights. After
# the capture: a call that switches between logits and ids re-routes the layer, which no capture
# can contain (megamoe says so if one tries).
topk_weights, topk_ids = torch.topk(torch.softmax(router_logits, dim=-1), k)
topk_weights /= topk_weights.sum(dim=-1, keepdim=True)
y_ids = megamoe.fused_moe(x, weights, topk_ids=topk_ids, topk_weights=topk_weights)

start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(100):
    graph.replay()
end.record()
torch.cuda.synchronize()
print(f"{weights}\n64 tokens: {start.elapsed_time(end) * 10:.1f} us per graph replay (mean of 100, L2 warm); "
      f"graph equals eager: {torch.equal(y_graph, y)}; ids and logits agree to "
      f"{((y_ids.float() - y.float()).norm() / y.float().norm()).item():.1e} (relative L2)")
