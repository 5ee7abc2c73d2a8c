"""megamoe: a whole Mixture-of-Experts layer (routing, FC1 gate+up, SwiGLU, FC2, weighted combine)
on NVIDIA Hopper GPUs, as PyTorch custom ops (torch.ops.megamoe.*).

    import megamoe
    weights = megamoe.prepare_weights(w13, w2, top_k=8, precision="fp8_block")  # vLLM layout
    y = megamoe.fused_moe(x, weights, router_logits)

Expert-parallel across the GPUs of one node (one process per GPU): prepare_ep_weights and
ep_fused_moe (megamoe.expert_parallel).
"""

from megamoe._version import __version__
from megamoe.expert_parallel import EpMoeWeights, ep_fused_moe, prepare_ep_weights
from megamoe.layer import MegaMoE, MoeWeights, fused_moe, prepare_weights
from megamoe.routing import DeepseekRouting, PrecomputedRouting, SoftmaxRouting

__all__ = [
    "DeepseekRouting",
    "EpMoeWeights",
    "MegaMoE",
    "MoeWeights",
    "PrecomputedRouting",
    "SoftmaxRouting",
    "ep_fused_moe",
    "fused_moe",
    "prepare_ep_weights",
    "prepare_weights",
]
