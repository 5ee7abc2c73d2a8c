"""examples/hf_qwen3_moe.py passes a Qwen3-MoE block's fused experts to megamoe as they are: that
transformers' layout (gate_up_proj [E, 2I, H], gate rows then up rows; down_proj [E, H, I]) and
its routing are the layer megamoe computes. Checked on the CPU against the reference the GPU
suite uses; skipped where transformers is not installed."""

import pytest
import torch

from moe_reference import moe_reference, relative_l2, route_softmax

transformers = pytest.importorskip("transformers")


def test_a_qwen3_moe_block_is_the_layer_megamoe_computes():
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=256, intermediate_size=512,
                                         moe_intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=128, num_experts=8, num_experts_per_tok=2,
                                         norm_topk_prob=True)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    model.set_experts_implementation("eager")
    block = model.model.layers[0].mlp
    x = torch.randn(24, config.hidden_size)
    with torch.no_grad():
        expected = block(x.unsqueeze(0))[0]
        ids, weights = route_softmax(torch.nn.functional.linear(x, block.gate.weight), config.num_experts_per_tok,
                                     renormalize=config.norm_topk_prob)
        actual = moe_reference(x, block.experts.gate_up_proj, block.experts.down_proj, ids, weights)
    assert relative_l2(actual, expected) < 1e-5
