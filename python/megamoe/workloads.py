"""The named workloads (src/plan/workloads.cpp): the MoE layers megamoe is measured on."""

from dataclasses import dataclass

from megamoe.routing import DeepseekRouting, Routing, SoftmaxRouting


@dataclass(frozen=True)
class Workload:
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    routing: Routing
    description: str


WORKLOADS = {
    "qwen35-a3b": Workload(256, 8, 2048, 512, SoftmaxRouting(renormalize=True), "Qwen3.5-A3B-like"),
    "qwen3-30b-a3b": Workload(128, 8, 2048, 768, SoftmaxRouting(renormalize=True), "Qwen3-30B-A3B"),
    "dsv3": Workload(256, 8, 7168, 2048,
                     DeepseekRouting(n_group=8, topk_group=4, routed_scaling_factor=2.5, renormalize=True),
                     "DeepSeek-V3 routed experts"),
}
