"""Swaps the MoE blocks of a small, randomly initialized Qwen3-MoE model (Hugging Face
transformers, config built here, nothing downloaded) for megamoe, and shows that the blocks and
the model's logits still match the original. Needs a Hopper GPU, transformers >= 5 and megamoe.

    python examples/hf_qwen3_moe.py [--precision bf16|fp8_block]
"""

import argparse
import sys

import torch
from torch import nn
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import megamoe


class MegaMoEBlock(nn.Module):
    """A Qwen3MoeSparseMoeBlock on megamoe: the block's own router computes the logits, megamoe
    routes, runs the experts and combines. transformers keeps the experts fused as vLLM does
    (gate_up_proj [E, 2I, H], gate rows then up rows; down_proj [E, H, I]), so they pass as they
    are."""

    def __init__(self, block: Qwen3MoeSparseMoeBlock, precision: str, max_tokens: int):
        super().__init__()
        self.gate = block.gate
        self.experts = megamoe.MegaMoE(
            block.experts.gate_up_proj.detach(), block.experts.down_proj.detach(), top_k=block.gate.top_k,
            routing=megamoe.SoftmaxRouting(renormalize=block.gate.norm_topk_prob), precision=precision,
            max_tokens=max_tokens)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = nn.functional.linear(hidden_states, self.gate.weight)
        y = self.experts(hidden_states.to(torch.bfloat16), router_logits.float())
        return y.to(hidden_states.dtype)


def relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=megamoe.layer.PRECISIONS, default="bf16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("examples/hf_qwen3_moe.py needs a Hopper GPU (sm_90); PyTorch sees no CUDA device")

    # hidden and moe_intermediate sizes are multiples of 128, as fp8_block's scale blocks need.
    config = Qwen3MoeConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                            num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1)
    torch.manual_seed(0)
    # float32, so that the original's routing sees the same logits megamoe gets (bf16 logits tie),
    # with transformers' plain loop over the experts.
    model = Qwen3MoeForCausalLM(config).to("cuda", torch.float32).eval()
    model.set_experts_implementation("eager")
    input_ids = torch.randint(0, config.vocab_size, (2, 96), device="cuda")

    # The original: the model's logits, and what each MoE block got and gave.
    moe_layers = [layer for layer in model.model.layers if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)]
    seen = {}
    hooks = [layer.mlp.register_forward_hook(lambda module, inputs, output: seen.__setitem__(module, (inputs[0], output)))
             for layer in moe_layers]
    with torch.no_grad():
        expected_logits = model(input_ids).logits
    for hook in hooks:
        hook.remove()

    # What rounding to the kernels' formats costs against float32 experts: on this model the test
    # suite's quantizing reference (tests/python/moe_reference.py) is off by ~0.4% in bf16 and
    # ~6.3% in fp8_block. A wrong layout or routing gives errors near 100%.
    bound = {"bf16": 1e-2, "fp8_block": 0.15}[args.precision]
    mismatched = []
    with torch.no_grad():
        for index, layer in enumerate(moe_layers):
            block_input, block_output = seen[layer.mlp]
            layer.mlp = MegaMoEBlock(layer.mlp, args.precision, max_tokens=input_ids.numel())
            error = relative_l2(layer.mlp(block_input), block_output)
            print(f"MoE block {index}: megamoe against the original, relative L2 {error:.2e} (bound {bound:.0e})")
            if not error < bound:
                mismatched.append(index)
        logits = model(input_ids).logits
    print(f"model logits ({args.precision} experts against float32 ones): relative L2 "
          f"{relative_l2(logits, expected_logits):.2e}; same next token at "
          f"{(logits.argmax(-1) == expected_logits.argmax(-1)).float().mean().item():.1%} of positions")
    if mismatched:
        sys.exit(f"MoE blocks {mismatched} do not match the original within {bound:.0e}")


if __name__ == "__main__":
    main()
