"""megamoe.layer (prepare_weights, fused_moe, MegaMoE) against the MoE layer written plainly in
PyTorch, on fresh random data: the named workloads' shapes at several token counts, CUDA-graph
capture and replay, torch.compile, and the errors bad inputs raise. Outputs are checked against
unquantized fp32 math: tightly for bf16, loosely for fp8_block and fp8_tensor (their quantization
error), and tightly against the reference that quantizes as megamoe does."""

import dataclasses
import math

import pytest
import torch

import megamoe
from checkpoints import SCALE_KINDS, decoded, quantized
from conftest import SEED
from megamoe.layer import ids_as_int32, ids_through_expert_map
from megamoe.workloads import WORKLOADS
from moe_reference import (calibrated_input_scales, moe_reference, quantize_rows_per_128, relative_l2,
                           route_deepseek, route_softmax)

# Relative L2 error bounds, as the C++ suite's (tests/api/test_moe_layer.cpp). Tight: against the
# reference that quantizes as megamoe does (bf16: the rounding of the slot rows and y, 2.4e-3
# seen on H200; fp8_block: the device's fp32 FC1 output moves a few values and block amaxes
# across E4M3 rounding steps; fp8_tensor: the same through one scale per tensor, and its
# mainloops accumulate over the whole K without per-block promotion, which Hopper's FP8 tensor
# cores do with fewer bits than fp32: a long tail, docs/decisions.md#fp8-tensor-error-bound).
# Loose: against unquantized math (fp8_block quantizes weights, x and FC1's output: ~6.3% seen;
# fp8_tensor with one scale per tensor, static ones calibrated on other tokens: the C++ suite's 0.12).
TIGHT = {"bf16": 4e-3, "fp8_block": 2e-2, "fp8_tensor": 4e-2}
LOOSE = {"bf16": 1e-2, "fp8_block": 0.1, "fp8_tensor": 0.12}
# The seed of the tokens fp8_tensor's static activation scales are calibrated on (no test's own).
CALIBRATION_SEED = 4242


class Problem:
    """Random weights of one workload in the vLLM layout, on the GPU, and their prepared form.
    fp8_tensor layers take static activation scales (input_scales "static": calibrated on other
    tokens, as a checkpoint's are, and given one per expert, of which the layer takes the largest)
    or compute them each forward ("dynamic")."""

    def __init__(self, workload: str, precision: str, device: torch.device, weights: str = "normal",
                 max_tokens: int = 4096, input_scales: str = "static"):
        w = WORKLOADS[workload]
        experts, top_k, hidden, intermediate = w.experts, w.top_k, w.hidden, w.intermediate
        generator = torch.Generator(device=device).manual_seed(SEED + sum(map(ord, workload + precision + weights)))

        def draw(*shape):
            # Standard deviation 1 / sqrt(fan-in); "uniform" as the C++ suite draws; "graded" scales
            # expert e by 2^(e mod 4), so that a scale taken from the wrong expert costs O(1).
            fan_in = shape[-1]
            drawn = torch.empty(*shape, dtype=torch.bfloat16, device=device)
            for expert in range(shape[0]):  # in fp32 an expert at a time: dsv3's whole w13 is 28 GiB
                if weights == "uniform":
                    values = (torch.rand(*shape[1:], device=device, generator=generator) * 2 - 1) * math.sqrt(3.0)
                else:
                    values = torch.randn(*shape[1:], device=device, generator=generator)
                grade = 2.0 ** (expert % 4) if weights == "graded" else 1.0
                drawn[expert] = values * (grade / math.sqrt(fan_in))
            return drawn

        self.w13 = draw(experts, 2 * intermediate, hidden)
        self.w2 = draw(experts, hidden, intermediate)
        self.top_k = top_k
        self.bias = None
        self.routing = w.routing
        if isinstance(w.routing, megamoe.DeepseekRouting):
            self.bias = torch.rand(experts, device=device, generator=generator) * 0.1 - 0.05
            self.routing = dataclasses.replace(w.routing, e_score_correction_bias=self.bias)
        # fp8_tensor's static scales: (fc1_input_scale, fc2_input_scale) as the layer holds them
        # (None: dynamic), and prepare_weights' arguments that give them.
        self.input_scales = None
        self.scale_arguments = {}
        if precision == "fp8_tensor" and input_scales == "static":
            x, logits = self.inputs(1024, seed=CALIBRATION_SEED)
            fc1_scale, fc2_scale = calibrated_input_scales(x, self.w13, self.w2, self.route(logits)[0])
            self.input_scales = (fc1_scale, fc2_scale)
            spread = torch.rand(experts, device=device, generator=generator) * 0.5 + 0.5  # (0.5, 1]
            w13_input_scale, w2_input_scale = fc1_scale * spread, fc2_scale * spread.flip(0)
            w13_input_scale[experts // 3], w2_input_scale[experts // 2] = fc1_scale, fc2_scale  # the largest
            self.scale_arguments = dict(w13_input_scale=w13_input_scale, w2_input_scale=w2_input_scale)
        self.weights = megamoe.prepare_weights(self.w13, self.w2, top_k=top_k, precision=precision,
                                               routing=self.routing, max_tokens=max_tokens, device=device,
                                               **self.scale_arguments)

    def route(self, logits: torch.Tensor):
        r = self.routing
        if isinstance(r, megamoe.DeepseekRouting):
            return route_deepseek(logits, self.top_k, r.n_group, r.topk_group, r.routed_scaling_factor, r.renormalize,
                                  self.bias)
        return route_softmax(logits, self.top_k, r.renormalize)

    def inputs(self, tokens: int, seed: int):
        generator = torch.Generator(device=self.w13.device).manual_seed(SEED + seed)
        x = torch.randn(tokens, self.w13.shape[2], device=self.w13.device, generator=generator).to(torch.bfloat16)
        logits = torch.randn(tokens, self.w13.shape[0], device=self.w13.device, generator=generator)
        return x, logits


_problems = {}


def problem(workload: str, precision: str, device: torch.device, weights: str = "normal",
            input_scales: str = "static") -> Problem:
    """One problem alive at a time: dsv3's weights alone are 22 GB in bf16."""
    key = (workload, precision, weights, input_scales)
    if key not in _problems:
        _problems.clear()
        torch.cuda.empty_cache()
        _problems[key] = Problem(workload, precision, device, weights, input_scales=input_scales)
    return _problems[key]


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


CASES = [(w, p, t, "normal") for w in ("qwen35-a3b", "qwen3-30b-a3b") for p in ("bf16", "fp8_block")
         for t in (1, 7, 128, 1000)]
CASES += [("dsv3", "fp8_block", t, "normal") for t in (1, 7, 128, 1000)]
CASES += [("qwen35-a3b", "fp8_block", t, "uniform") for t in (7, 1000)]
CASES += [("qwen35-a3b", "fp8_tensor", t, "normal") for t in (1, 7, 128, 1000)]  # static scales
CASES += [("qwen35-a3b", p, 128, "graded") for p in ("fp8_block", "fp8_tensor")]


@pytest.mark.gpu
@pytest.mark.parametrize("workload,precision,tokens,weights", CASES)
def test_matches_plain_pytorch(hopper, workload, precision, tokens, weights):
    p = problem(workload, precision, hopper, weights)
    x, logits = p.inputs(tokens, seed=tokens)
    y = megamoe.fused_moe(x, p.weights, logits)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert torch.isfinite(y).all()
    ids, weights = p.route(logits)
    expected = moe_reference(x, p.w13, p.w2, ids, weights, precision, input_scales=p.input_scales)
    tight = relative_l2(y, expected)
    loose = relative_l2(y, moe_reference(x, p.w13, p.w2, ids, weights))
    print(f"relative L2 error: {tight:.3e} against the quantizing reference, {loose:.3e} against unquantized math")
    assert tight < TIGHT[precision], f"relative L2 error {tight:.3e} against the quantizing reference"
    assert loose < LOOSE[precision], f"relative L2 error {loose:.3e} against unquantized math"
    # The same routing passed as ids (the reference's weights, within ~1e-6 of the kernel's).
    y_ids = megamoe.fused_moe(x, p.weights, topk_ids=ids, topk_weights=weights)
    error = relative_l2(y_ids, expected)
    assert error < TIGHT[precision], f"precomputed ids: relative L2 error {error:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 128, 1000])
def test_fp8_tensor_dynamic_scales_match_plain_pytorch(hopper, tokens):
    """fp8_tensor without a checkpoint's activation scales: the layer computes x's and FC2's input
    scale on the GPU each forward, from this forward's tokens."""
    p = problem("qwen35-a3b", "fp8_tensor", hopper, input_scales="dynamic")
    assert p.weights.input_scales == "dynamic" and "input_scales='dynamic'" in repr(p.weights)
    x, logits = p.inputs(tokens, seed=tokens)
    y = megamoe.fused_moe(x, p.weights, logits)
    assert y.shape == x.shape and torch.isfinite(y).all()
    ids, weights = p.route(logits)
    expected = moe_reference(x, p.w13, p.w2, ids, weights, "fp8_tensor")
    tight = relative_l2(y, expected)
    loose = relative_l2(y, moe_reference(x, p.w13, p.w2, ids, weights))
    print(f"relative L2 error: {tight:.3e} against the quantizing reference, {loose:.3e} against unquantized math")
    assert tight < TIGHT["fp8_tensor"], f"relative L2 error {tight:.3e} against the quantizing reference"
    assert loose < LOOSE["fp8_tensor"], f"relative L2 error {loose:.3e} against unquantized math"
    # The scales follow the tokens: x ten times larger gives (about) ten times y, not a saturated one.
    y_large = megamoe.fused_moe((x.float() * 10).to(torch.bfloat16), p.weights, logits)
    expected_large = moe_reference((x.float() * 10).to(torch.bfloat16), p.w13, p.w2, ids, weights, "fp8_tensor")
    assert relative_l2(y_large, expected_large) < TIGHT["fp8_tensor"]


@pytest.mark.gpu
def test_fp8_tensor_static_scales_are_the_largest_given(hopper):
    """The checkpoint's per-expert activation scales: the layer takes the largest of each, and the
    output changes when they change (a scale the layer ignored would not)."""
    p = problem("qwen35-a3b", "fp8_tensor", hopper)
    assert p.weights.input_scales == "from_checkpoint"
    x, logits = p.inputs(300, seed=23)
    ids, weights = p.route(logits)
    y = megamoe.fused_moe(x, p.weights, logits)
    assert relative_l2(y, moe_reference(x, p.w13, p.w2, ids, weights, "fp8_tensor", input_scales=p.input_scales)) \
        < TIGHT["fp8_tensor"]
    fc1_scale, fc2_scale = p.input_scales
    one_per_layer = megamoe.prepare_weights(p.w13, p.w2, top_k=p.top_k, precision="fp8_tensor", routing=p.routing,
                                            max_tokens=512, w13_input_scale=fc1_scale.reshape(1),
                                            w2_input_scale=fc2_scale)
    assert torch.equal(megamoe.fused_moe(x, one_per_layer, logits), y)
    coarser = megamoe.prepare_weights(p.w13, p.w2, top_k=p.top_k, precision="fp8_tensor", routing=p.routing,
                                      max_tokens=512, w13_input_scale=fc1_scale * 4, w2_input_scale=fc2_scale * 4)
    y_coarser = megamoe.fused_moe(x, coarser, logits)
    assert not torch.equal(y_coarser, y)
    expected = moe_reference(x, p.w13, p.w2, ids, weights, "fp8_tensor", input_scales=(fc1_scale * 4, fc2_scale * 4))
    assert relative_l2(y_coarser, expected) < TIGHT["fp8_tensor"]
    # The whole forward as one persistent kernel gives the five kernels' bits (static scales).
    single = megamoe.prepare_weights(p.w13, p.w2, top_k=p.top_k, precision="fp8_tensor", routing=p.routing,
                                     max_tokens=512, w13_input_scale=fc1_scale.reshape(1), w2_input_scale=fc2_scale,
                                     launch="single_kernel")
    for tokens in (1, 7, 300):
        assert torch.equal(megamoe.fused_moe(x[:tokens], single, logits[:tokens]),
                           megamoe.fused_moe(x[:tokens], one_per_layer, logits[:tokens])), tokens


@pytest.mark.gpu
def test_batches_beyond_max_tokens_run_in_passes(hopper):
    p = problem("qwen35-a3b", "fp8_block", hopper)
    small = megamoe.prepare_weights(p.w13, p.w2, top_k=p.top_k, precision="fp8_block", routing=p.routing,
                                    max_tokens=48)
    x, logits = p.inputs(130, seed=11)  # passes of 48, 48 and 34 tokens
    ids, weights = p.route(logits)
    expected = moe_reference(x, p.w13, p.w2, ids, weights, "fp8_block")
    for y in (megamoe.fused_moe(x, small, logits), megamoe.fused_moe(x, small, topk_ids=ids, topk_weights=weights)):
        assert y.shape == x.shape
        assert relative_l2(y, expected) < TIGHT["fp8_block"]
        for rows in (slice(0, 48), slice(48, 96), slice(96, 130)):  # every pass, not only the whole
            assert relative_l2(y[rows], expected[rows]) < TIGHT["fp8_block"]


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_runs_are_bit_identical(hopper, deterministic):
    p = problem("qwen35-a3b", "fp8_block", hopper)
    x, logits = p.inputs(1000, seed=5)
    first = megamoe.fused_moe(x, p.weights, logits, deterministic=deterministic)
    ids, weights = p.route(logits)
    assert relative_l2(first, moe_reference(x, p.w13, p.w2, ids, weights, "fp8_block")) < TIGHT["fp8_block"]
    if deterministic:
        for _ in range(10):
            assert torch.equal(megamoe.fused_moe(x, p.weights, logits), first)


@pytest.mark.gpu
def test_cuda_graph_replays_what_eager_computes(hopper):
    p = problem("qwen35-a3b", "fp8_block", hopper)
    x, logits = p.inputs(128, seed=1)
    static_x, static_logits = x.clone(), logits.clone()
    megamoe.fused_moe(static_x, p.weights, static_logits)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = megamoe.fused_moe(static_x, p.weights, static_logits)
    for seed in (2, 3):
        x, logits = p.inputs(128, seed=seed)
        static_x.copy_(x)
        static_logits.copy_(logits)
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, megamoe.fused_moe(x, p.weights, logits))


class _Block(torch.nn.Module):
    """A model's MoE block around MegaMoE: the router's Linear, the experts, a residual."""

    def __init__(self, experts: megamoe.MegaMoE, gate: torch.Tensor):
        super().__init__()
        self.experts = experts
        self.gate = torch.nn.Parameter(gate, requires_grad=False)

    def forward(self, hidden_states):
        router_logits = torch.nn.functional.linear(hidden_states.float(), self.gate)
        return hidden_states + self.experts(hidden_states, router_logits)


@pytest.mark.gpu
def test_torch_compile_traces_the_op(hopper):
    p = problem("qwen35-a3b", "bf16", hopper)
    experts = megamoe.MegaMoE.from_weights(p.weights)
    gate = torch.randn(p.w13.shape[0], p.w13.shape[2], device=hopper) / math.sqrt(p.w13.shape[2])
    block = _Block(experts, gate)
    compiled = torch.compile(block, fullgraph=True)
    for tokens in (16, 300):
        x, _ = p.inputs(tokens, seed=tokens)
        hidden = x.view(1, tokens, -1)
        eager = block(hidden)  # also settles the layer's routing, which a compiled call does not switch
        assert torch.equal(compiled(hidden), eager)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,input_scales", [("bf16", "static"), ("fp8_block", "static"),
                                                    ("fp8_tensor", "static"), ("fp8_tensor", "dynamic")])
def test_host_and_device_packing_give_the_same_layer(hopper, precision, input_scales):
    p = problem("qwen35-a3b", precision, hopper, input_scales=input_scales)  # packed on the GPU (megamoe.packing)
    scales = {name: t.cpu() for name, t in p.scale_arguments.items()}
    on_host = megamoe.prepare_weights(p.w13.cpu(), p.w2.cpu(), top_k=p.top_k, precision=precision,
                                      routing=p.routing, max_tokens=256, **scales)  # the C++ packer
    assert on_host.input_scales == p.weights.input_scales
    x, logits = p.inputs(200, seed=13)
    assert torch.equal(megamoe.fused_moe(x, on_host, logits), megamoe.fused_moe(x, p.weights, logits))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", SCALE_KINDS)
def test_fp8_checkpoints_with_expert_pair_or_channel_scales(hopper, kind):
    p = problem("qwen35-a3b", "fp8_block", hopper)
    (w13, w13_scale), (w2, w2_scale) = quantized(p.w13, kind, gate_up=True), quantized(p.w2, kind)
    layer = megamoe.prepare_weights(w13, w2, w13_scale=w13_scale, w2_scale=w2_scale, top_k=p.top_k,
                                    routing=p.routing, max_tokens=256)
    x, logits = p.inputs(200, seed=17)
    y = megamoe.fused_moe(x, layer, logits)
    ids, weights = p.route(logits)
    w13_values, w2_values = decoded(w13, w13_scale, kind, gate_up=True), decoded(w2, w2_scale, kind)
    error = relative_l2(y, moe_reference(x, w13_values, w2_values, ids, weights, "fp8_block"))
    print(f"{kind} scales: relative L2 error {error:.3e} against the quantizing reference")
    assert error < TIGHT["fp8_block"]
    assert relative_l2(y, moe_reference(x, p.w13, p.w2, ids, weights)) < LOOSE["fp8_block"]
    # Packed on the host (megamoe.packing on the CPU for channel scales, else the C++ packer).
    on_host = megamoe.prepare_weights(w13.cpu(), w2.cpu(), w13_scale=w13_scale.cpu(), w2_scale=w2_scale.cpu(),
                                      top_k=p.top_k, routing=p.routing, max_tokens=256)
    assert torch.equal(megamoe.fused_moe(x, on_host, logits), y)


@pytest.mark.gpu
@pytest.mark.parametrize("w13_scales", ["pair", "expert"])
@pytest.mark.parametrize("input_scales", ["static", "dynamic"])
def test_a_vllm_per_tensor_checkpoint(hopper, w13_scales, input_scales):
    """vLLM's per-tensor fp8 checkpoint: w13_weight [E, 2I, H] and w2_weight [E, H, I] E4M3,
    w13_weight_scale [E, 2] (gate, up) or [E], w2_weight_scale [E], and w13_input_scale and
    w2_input_scale [E] (static) or none (vLLM's activation_scheme "dynamic"). Its codes are kept,
    so the reference takes the decoded checkpoint as it is."""
    p = problem("qwen35-a3b", "fp8_tensor", hopper)  # its calibrated static scales, one per expert
    (w13, w13_scale), (w2, w2_scale) = quantized(p.w13, w13_scales, gate_up=True), quantized(p.w2, "expert")
    experts = p.w13.shape[0]
    assert w13.dtype == torch.float8_e4m3fn
    assert w13_scale.shape == ((experts, 2) if w13_scales == "pair" else (experts,))
    static = input_scales == "static"
    arguments = dict(p.scale_arguments) if static else {}
    layer = megamoe.prepare_weights(w13, w2, w13_scale=w13_scale, w2_scale=w2_scale, top_k=p.top_k,
                                    precision="fp8_tensor", routing=p.routing, max_tokens=256, **arguments)
    assert layer.input_scales == ("from_checkpoint" if static else "dynamic")
    x, logits = p.inputs(200, seed=19)
    y = megamoe.fused_moe(x, layer, logits)
    assert torch.isfinite(y).all()
    ids, weights = p.route(logits)
    w13_values = decoded(w13, w13_scale, w13_scales, gate_up=True)
    w2_values = decoded(w2, w2_scale, "expert")
    expected = moe_reference(x, w13_values, w2_values, ids, weights, "fp8_tensor",
                             input_scales=p.input_scales if static else None, quantized_weights=True)
    error = relative_l2(y, expected)
    print(f"{w13_scales} w13 scales, {input_scales} input scales: relative L2 error {error:.3e} against the "
          f"quantizing reference")
    assert error < TIGHT["fp8_tensor"]
    assert relative_l2(y, moe_reference(x, p.w13, p.w2, ids, weights)) < LOOSE["fp8_tensor"]
    # Packed on the host by the C++ packer: the same layer.
    on_host = megamoe.prepare_weights(w13.cpu(), w2.cpu(), w13_scale=w13_scale.cpu(), w2_scale=w2_scale.cpu(),
                                      top_k=p.top_k, precision="fp8_tensor", routing=p.routing, max_tokens=256,
                                      **{name: t.cpu() for name, t in arguments.items()})
    assert torch.equal(megamoe.fused_moe(x, on_host, logits), y)


@pytest.mark.gpu
def test_megamoe_module_keeps_the_input_shape(hopper):
    p = problem("qwen35-a3b", "bf16", hopper)
    module = megamoe.MegaMoE(p.w13, p.w2, top_k=p.top_k, precision="bf16", routing=p.routing, max_tokens=64)
    x, logits = p.inputs(6, seed=11)
    y = module(x.view(2, 3, -1), logits.view(2, 3, -1))
    assert y.shape == (2, 3, p.w13.shape[2])
    assert torch.equal(y.view(6, -1), megamoe.fused_moe(x, p.weights, logits))


@pytest.mark.gpu
def test_routing_can_change_between_calls(hopper):
    p = problem("qwen35-a3b", "bf16", hopper)
    x, logits = p.inputs(64, seed=7)
    softmax = megamoe.fused_moe(x, p.weights, logits)
    bias = torch.linspace(-0.05, 0.05, p.w13.shape[0])
    grouped = megamoe.DeepseekRouting(n_group=8, topk_group=4, routed_scaling_factor=2.5, e_score_correction_bias=bias)
    y = megamoe.fused_moe(x, p.weights, logits, routing=grouped)
    ids, weights = route_deepseek(logits, p.top_k, 8, 4, 2.5, True, bias.to(hopper))
    assert relative_l2(y, moe_reference(x, p.w13, p.w2, ids, weights, "bf16")) < TIGHT["bf16"]
    assert torch.equal(megamoe.fused_moe(x, p.weights, logits, routing=p.routing), softmax)
    # A routing the layer cannot take is refused with an empty batch too (which launches nothing).
    short_bias = megamoe.DeepseekRouting(n_group=8, topk_group=4, e_score_correction_bias=bias[:-1])
    for tokens in (0, 3):
        with pytest.raises(ValueError, match="e_score_correction_bias"):
            megamoe.fused_moe(x[:tokens], p.weights, logits[:tokens], routing=short_bias)
    # And one past the kernels' limits (valid for the spec: 64 groups of 4 experts).
    too_many_groups = megamoe.DeepseekRouting(n_group=64, topk_group=2, e_score_correction_bias=bias)
    for tokens in (0, 3):
        with pytest.raises(NotImplementedError, match="n_group=64 exceeds the 32 the routing kernel holds"):
            megamoe.fused_moe(x[:tokens], p.weights, logits[:tokens], routing=too_many_groups)


@pytest.mark.gpu
def test_unrouted_and_invalid_ids(hopper):
    p = problem("qwen35-a3b", "bf16", hopper)
    x, logits = p.inputs(32, seed=9)
    ids, weights = p.route(logits)
    ids[:, p.top_k // 2:] = -1  # not routed here: contributes nothing
    expected = moe_reference(x, p.w13, p.w2, ids, weights, "bf16")
    bad = ids.long()
    bad[0, -1] = p.w13.shape[0]  # out of range: counted, contributes nothing
    bad[1, -1] = bad[1, 0]       # a duplicate: likewise
    unused = next(e for e in range(p.w13.shape[0]) if e not in ids[2].tolist())
    bad[2, -1] = 2**32 + unused  # beyond int32: likewise, not wrapped onto expert `unused`
    p.weights.invalid_routing_ids()
    y = megamoe.fused_moe(x, p.weights, topk_ids=bad, topk_weights=weights)
    assert p.weights.invalid_routing_ids() == 3
    assert relative_l2(y, expected) < TIGHT["bf16"]


@pytest.mark.gpu
def test_global_ids_through_an_expert_map(hopper):
    """vLLM's expert parallelism: this layer holds the even global experts of twice as many."""
    p = problem("qwen35-a3b", "bf16", hopper)
    E = p.w13.shape[0]
    x, logits = p.inputs(40, seed=21)
    local, weights = p.route(logits)
    local[:, ::3] = -1  # held by another rank
    expert_map = torch.full((2 * E,), -1, dtype=torch.int32, device=hopper)
    expert_map[0::2] = torch.arange(E, dtype=torch.int32, device=hopper)
    odd = torch.randint(0, E, local.shape, device=hopper) * 2 + 1
    global_ids = torch.where(local >= 0, 2 * local, odd)
    expected = megamoe.fused_moe(x, p.weights, topk_ids=local, topk_weights=weights)
    p.weights.invalid_routing_ids()
    y = megamoe.fused_moe(x, p.weights, topk_ids=global_ids, topk_weights=weights, expert_map=expert_map)
    assert torch.equal(y, expected)
    assert p.weights.invalid_routing_ids() == 0


@pytest.mark.gpu
def test_bad_calls_raise_before_any_kernel(hopper):
    p = problem("qwen35-a3b", "bf16", hopper)
    x, logits = p.inputs(8, seed=3)
    E = p.w13.shape[0]
    with pytest.raises(TypeError, match="bfloat16"):
        megamoe.fused_moe(x.float(), p.weights, logits)
    with pytest.raises(ValueError, match=r"x must be \[8, 2048\]"):
        megamoe.fused_moe(x[:, :1024].contiguous(), p.weights, logits)
    with pytest.raises(ValueError, match="contiguous"):
        megamoe.fused_moe(torch.cat([x, x], dim=1)[:, ::2], p.weights, logits)
    with pytest.raises(ValueError, match="must be on cuda"):
        megamoe.fused_moe(x.cpu(), p.weights, logits)
    with pytest.raises(ValueError, match="router_logits must be"):
        megamoe.fused_moe(x, p.weights, logits[:, : E // 2].contiguous())
    with pytest.raises(ValueError, match="not both"):
        megamoe.fused_moe(x, p.weights, logits, topk_ids=torch.zeros(8, p.top_k, dtype=torch.int32, device=hopper),
                          topk_weights=torch.zeros(8, p.top_k, device=hopper))
    with pytest.raises(ValueError, match="go together"):
        megamoe.fused_moe(x, p.weights, topk_ids=torch.zeros(8, p.top_k, dtype=torch.int32, device=hopper))
    with pytest.raises(TypeError, match="int32 or int64"):
        megamoe.fused_moe(x, p.weights, topk_ids=torch.zeros(8, p.top_k, device=hopper),
                          topk_weights=torch.zeros(8, p.top_k, device=hopper))
    ids = torch.zeros(8, p.top_k, dtype=torch.int32, device=hopper)
    routed = dict(topk_ids=ids, topk_weights=torch.zeros(8, p.top_k, device=hopper))
    with pytest.raises(TypeError, match="expert_map must be int32 or int64"):
        megamoe.fused_moe(x, p.weights, **routed, expert_map=torch.zeros(2 * E, device=hopper))
    with pytest.raises(ValueError, match="expert_map is on cpu"):
        megamoe.fused_moe(x, p.weights, **routed, expert_map=torch.zeros(2 * E, dtype=torch.int32))
    with pytest.raises(ValueError, match="fewer than the layer's"):
        megamoe.fused_moe(x, p.weights, **routed, expert_map=torch.zeros(E - 1, dtype=torch.int32, device=hopper))
    with pytest.raises(ValueError, match="expert_map maps topk_ids"):
        megamoe.fused_moe(x, p.weights, logits, expert_map=torch.zeros(2 * E, dtype=torch.int32, device=hopper))
    # The ops themselves check as well (an op called without the Python layer).
    small = megamoe.prepare_weights(p.w13, p.w2, top_k=p.top_k, precision="bf16", max_tokens=4)
    softmax = megamoe.routing.op_arguments(megamoe.SoftmaxRouting())
    with pytest.raises(ValueError, match="max_tokens"):
        torch.ops.megamoe.forward(small._handle, x, logits, None, None, True, *softmax)
    with pytest.raises(TypeError, match="BFloat16"):
        torch.ops.megamoe.forward(p.weights._handle, x.half(), logits, None, None, True, *softmax)
    with pytest.raises(ValueError, match="no layer with handle"):
        torch.ops.megamoe.forward(10**9, x, logits, None, None, True, *softmax)
    with pytest.raises(ValueError, match="precomputed routing takes topk_ids"):
        torch.ops.megamoe.forward(p.weights._handle, x, logits, None, None, True,
                                  *megamoe.routing.op_arguments(megamoe.PrecomputedRouting()))
    with pytest.raises(NotImplementedError, match="top_k"):
        megamoe.prepare_weights(p.w13, p.w2, top_k=64, precision="bf16", max_tokens=4)
    # Nothing above left a kernel behind that failed.
    torch.cuda.synchronize()


def test_prepare_weights_checks_its_arguments():
    """Runs without a GPU: every check comes before the weights are packed or uploaded."""
    w13 = torch.zeros(4, 256, 128, dtype=torch.bfloat16)
    w2 = torch.zeros(4, 128, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"w2 must be \[E, H, I\] = \[4, 128, 128\]"):
        megamoe.prepare_weights(w13, w2[:, :64], top_k=2)
    with pytest.raises(ValueError, match="3 dimensions"):
        megamoe.prepare_weights(w13[0], w2, top_k=2)
    with pytest.raises(ValueError, match="even second dimension"):
        megamoe.prepare_weights(w13[:, :255], w2, top_k=2)
    with pytest.raises(TypeError, match="share a dtype"):
        megamoe.prepare_weights(w13, w2.float(), top_k=2)
    with pytest.raises(TypeError, match="bfloat16, float32 or float8_e4m3fn"):
        megamoe.prepare_weights(w13.half(), w2.half(), top_k=2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        megamoe.prepare_weights(w13.tolist(), w2, top_k=2)
    with pytest.raises(ValueError, match="precision"):
        megamoe.prepare_weights(w13, w2, top_k=2, precision="fp8")
    with pytest.raises(ValueError, match="scale_format"):
        megamoe.prepare_weights(w13, w2, top_k=2, scale_format="e8m0")
    with pytest.raises(ValueError, match="top_k"):
        megamoe.prepare_weights(w13, w2, top_k=5)
    with pytest.raises(ValueError, match="max_tokens"):
        megamoe.prepare_weights(w13, w2, top_k=2, max_tokens=0)
    with pytest.raises(ValueError, match="routing"):
        megamoe.prepare_weights(w13, w2, top_k=2, routing="sigmoid")
    with pytest.raises(ValueError, match="float8_e4m3fn weights only"):
        megamoe.prepare_weights(w13, w2, top_k=2, w13_scale=torch.ones(4, 2, 1))
    with pytest.raises(ValueError, match="multiple of 128"):
        megamoe.prepare_weights(w13[:, :, :64].contiguous(), w2[:, :64].contiguous(), top_k=2)
    with pytest.raises(ValueError, match="n_group"):
        megamoe.prepare_weights(w13, w2, top_k=2, routing=megamoe.DeepseekRouting(n_group=3, topk_group=1))
    fp8_w13, fp8_w2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"need w13_scale: one scale per 128 x 128 block \[4, 2, 1\]"):
        megamoe.prepare_weights(fp8_w13, fp8_w2, top_k=2)
    with pytest.raises(ValueError, match=r"w2_scale must hold one scale per 128 x 128 block \[4, 1, 1\]"):
        megamoe.prepare_weights(fp8_w13, fp8_w2, top_k=2, w13_scale=torch.ones(4, 2, 1), w2_scale=torch.ones(4, 2, 1))
    with pytest.raises(TypeError, match="w2_scale must be a torch.Tensor"):
        megamoe.prepare_weights(fp8_w13, fp8_w2, top_k=2, w13_scale=torch.ones(4), w2_scale=[1.0] * 4)
    # A bad scale is named with its index in the caller's tensor, and its value as the packers read it.
    with pytest.raises(ValueError, match=r"w2_scale\[0, 0\] = -1.0: scales must be finite and positive"):
        megamoe.prepare_weights(fp8_w13, fp8_w2, top_k=2, w13_scale=torch.ones(4, 2), w2_scale=-torch.ones(4, 128))
    with pytest.raises(ValueError, match=r"w13_scale\[0, 0, 0\] = 0.0: scales must be finite and positive"):
        megamoe.prepare_weights(fp8_w13, fp8_w2, top_k=2, w13_scale=torch.zeros(4, 2, 1), w2_scale=torch.ones(4, 1, 1))
    with pytest.raises(ValueError, match=r"w13_scale\[2\] = inf: scales must be finite and positive"):
        megamoe.prepare_weights(fp8_w13, fp8_w2, top_k=2, w2_scale=torch.ones(4),
                                w13_scale=torch.tensor([1.0, 1.0, 1e300, 1.0], dtype=torch.float64))
    # A finite scale whose 448 x is past float32's range: the GPU packer packed NaN codes and an inf
    # block scale from it (the host packer refused only a code that overflowed); refused by name.
    with pytest.raises(ValueError, match=r"w2_scale\[1\] = .*: a scale past 7.6e\+35 .* decodes a weight to inf"):
        megamoe.prepare_weights(fp8_w13, fp8_w2, top_k=2, w13_scale=torch.ones(4),
                                w2_scale=torch.tensor([1.0, 1e36, 1.0, 1.0]))
    # Integer scales were taken as numbers: uint8 exponent bytes 127 became scales of 127.
    with pytest.raises(TypeError, match=r"w13_scale must be a floating-point tensor \(float32 scales\), not "
                                        r"torch.uint8"):
        megamoe.prepare_weights(fp8_w13, fp8_w2, top_k=2, w13_scale=torch.full((4, 2, 1), 127, dtype=torch.uint8),
                                w2_scale=torch.ones(4, 1, 1))
    with pytest.raises(TypeError, match=r"w2_scale must be a floating-point tensor .*, not torch.int32"):
        megamoe.prepare_weights(fp8_w13, fp8_w2, top_k=2, w13_scale=torch.ones(4),
                                w2_scale=torch.ones(4, dtype=torch.int32))
    # Weights made on the meta device (never loaded) hold no values.
    with pytest.raises(ValueError, match="w13 is on the meta device"):
        megamoe.prepare_weights(w13.to("meta"), w2.to("meta"), top_k=2)
    with pytest.raises(ValueError, match="w2_scale is on the meta device"):
        megamoe.prepare_weights(fp8_w13, fp8_w2, top_k=2, w13_scale=torch.ones(4),
                                w2_scale=torch.ones(4, device="meta"))
    with pytest.raises(ValueError, match="w13_input_scale is on the meta device"):
        megamoe.prepare_weights(w13, w2, top_k=2, precision="fp8_tensor", w13_input_scale=torch.ones(1, device="meta"),
                                w2_input_scale=torch.ones(1))
    # The kernels' own limits (README: E <= 512, top_k <= 32, n_group <= 32) come before the device too.
    many = dict(w13=torch.zeros(1, 256, 128, dtype=torch.bfloat16).expand(520, 256, 128),
                w2=torch.zeros(1, 128, 128, dtype=torch.bfloat16).expand(520, 128, 128))
    with pytest.raises(NotImplementedError, match="num_experts=520 exceeds the 512 the routing kernel holds"):
        megamoe.prepare_weights(**many, top_k=2)
    sixty_four = dict(w13=many["w13"][:64], w2=many["w2"][:64])
    with pytest.raises(NotImplementedError, match="top_k=33 exceeds the 32 slots per token the kernels hold"):
        megamoe.prepare_weights(**sixty_four, top_k=33)
    with pytest.raises(NotImplementedError, match="n_group=64 exceeds the 32 the routing kernel holds"):
        megamoe.prepare_weights(**sixty_four, top_k=2, routing=megamoe.DeepseekRouting(n_group=64, topk_group=2))
    with pytest.raises(TypeError, match="deterministic must be a bool, not str 'fast'"):
        megamoe.MegaMoE(w13, w2, top_k=2, deterministic="fast")


@pytest.mark.parametrize("arguments, error, message", [
    # Sizes the C++ layer takes as int: refused with the limit, never wrapped (2**32 + 16 was a layer of 16).
    (dict(max_tokens=2**32 + 16), ValueError, r"max_tokens=4294967312 must be in \[1, 16777216\]"),
    (dict(max_tokens=2**31), ValueError, r"max_tokens=2147483648 must be in \[1, 16777216\]"),
    (dict(max_tokens=-5), ValueError, r"max_tokens=-5 must be in \[1, 16777216\]"),
    (dict(top_k=2**32 + 2), ValueError, r"top_k=4294967298 is out of range: it must be in \[1, 2147483647\]"),
    (dict(max_tokens=8.0), TypeError, "max_tokens must be an int"),
    (dict(top_k=True), TypeError, "top_k must be an int"),
    # The planner's choices a caller may fix, checked by the library's own rules.
    (dict(token_tile=48), ValueError, "options.token_tile=48 must be 16, 32, 64 or 128"),
    (dict(fc1_token_rows="copy"), ValueError, "fc1_token_rows must be 'auto', 'pool' or 'row_copy'"),
    (dict(fc1_token_rows="row_copy", precision="bf16"), ValueError, "needs precision fp8_block or fp8_tensor"),
    (dict(num_sms=-1), ValueError, "num_sms=-1 is out of range"),
    (dict(launch="fused"), ValueError, "launch must be 'auto', 'per_stage' or 'single_kernel'"),
    (dict(launch="single_kernel", fc1_token_rows="row_copy"), ValueError, "reads FC1's rows from the pool"),
    (dict(launch=1), TypeError, "launch must be a str"),
    # None is the planner's choice; a falsy value of another type was taken for it.
    (dict(token_tile=False), TypeError, "token_tile must be an int, not bool False"),
    (dict(token_tile=0.0), TypeError, "token_tile must be an int, not float 0.0"),
    (dict(num_sms=""), TypeError, "num_sms must be an int, not str ''"),
    (dict(device="cpu"), ValueError, "device must be a CUDA device"),
    (dict(device=3.5), TypeError, "device must be a torch.device, str or int"),
    # -1 reached the op as its own "current device".
    (dict(device=-1), ValueError, r"device=-1 is no CUDA device index: it must be >= 0"),
    (dict(routing=5), TypeError, "routing must be .*, not int 5"),
    (dict(routing=None), TypeError, "routing must be .*, not NoneType None"),
    (dict(routing=megamoe.DeepseekRouting(routed_scaling_factor=-1.0)), ValueError,
     "routed_scaling_factor=-1 must be finite and > 0"),
    # The input scales' check read precision first: "precision None takes none", a ValueError.
    (dict(precision=None, w13_input_scale=torch.ones(1), w2_input_scale=torch.ones(1)), TypeError,
     "precision must be a str, not NoneType None"),
])
def test_prepare_weights_refuses_out_of_range_values(arguments, error, message):
    """Runs without a GPU: the ops' checks, before anything is packed."""
    w13 = torch.zeros(4, 256, 128, dtype=torch.bfloat16)
    w2 = torch.zeros(4, 128, 128, dtype=torch.bfloat16)
    arguments = dict(dict(top_k=2), **arguments)
    with pytest.raises(error, match=message):
        megamoe.prepare_weights(w13, w2, **arguments)


@pytest.mark.parametrize("dtype, bad", [(torch.bfloat16, float("nan")), (torch.float32, float("inf")),
                                        (torch.float32, -float("inf")), (torch.float8_e4m3fn, float("nan"))])
def test_prepare_weights_refuses_weights_that_are_not_finite(monkeypatch, dtype, bad):
    """Runs without a GPU: a NaN spoiled its whole fp8 block on the GPU packer and one code on the
    host packer; refused (after the cheap checks) with the first bad element named, expert by expert."""
    from megamoe import packing

    monkeypatch.setattr(packing, "_CHUNK_ELEMENTS", 256 * 128)  # one expert at a time: the index counts on
    w13 = torch.full((4, 256, 128), 0.5).to(dtype)
    w2 = torch.full((4, 128, 128), 0.5).to(dtype)
    scales = dict(w13_scale=torch.ones(4), w2_scale=torch.ones(4)) if dtype == torch.float8_e4m3fn else {}
    poisoned = w2.clone()
    poisoned[2, 7, 5] = bad
    with pytest.raises(ValueError, match=rf"w2\[2, 7, 5\] = {bad}: weights must be finite"):
        megamoe.prepare_weights(w13, poisoned, top_k=2, **scales)
    with pytest.raises(ValueError, match="top_k=5 must be in"):  # the cheap checks first
        megamoe.prepare_weights(w13, poisoned, top_k=5, **scales)


def test_finite_weights_whose_sum_overflows_are_taken():
    """The finiteness check reads a sum first; a sum past float32's range is no NaN or inf weight."""
    from megamoe import packing

    large = torch.full((2, 256, 128), 3e38)
    packing.require_finite_weights(large, "w13")
    large[1, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"w13\[1, 0, 0\] = inf: weights must be finite"):
        packing.require_finite_weights(large, "w13")


def test_create_layer_refuses_sizes_that_would_wrap():
    """Runs without a GPU: torch.ops.megamoe called directly checks its int64 arguments itself."""
    empty, scales = torch.empty(0, dtype=torch.uint8), torch.empty(0)
    spec = [4, 128, 128, 2, "bf16", "fp32", "softmax", False, 1, 1, 1.0, None]
    with pytest.raises(ValueError, match=r"num_experts=4294967300 is out of range"):
        torch.ops.megamoe.create_layer(empty, scales, empty, scales, scales, 2**32 + 4, *spec[1:], 16, 0, "auto", 0, "auto", 0)
    with pytest.raises(ValueError, match=r"max_tokens=4294967312 must be in"):
        torch.ops.megamoe.create_layer(empty, scales, empty, scales, scales, *spec, 2**32 + 16, 0, "auto", 0, "auto", 0)
    with pytest.raises(ValueError, match=r"n_group=-1 is out of range"):
        torch.ops.megamoe.check_layer(4, 128, 128, 2, "bf16", "fp32", "deepseek_grouped", True, -1, 1, 1.0, None, 16,
                                      0, "auto", 0, "auto")
    with pytest.raises(NotImplementedError, match="top_k=40 exceeds the 32 slots"):
        torch.ops.megamoe.create_layer(empty, scales, empty, scales, scales, 64, 128, 128, 40, *spec[4:], 16, 0, "auto",
                                       0, "auto", 0)


def test_int64_ids_beyond_int32_stay_invalid():
    ids = torch.tensor([[3, -1, 2**32 + 3, -(2**32) + 5, 2**31, 7]])
    assert ids_as_int32(ids).tolist() == [[3, -1, -2, -2, -2, 7]]
    narrow = torch.tensor([[3, -1, 300]], dtype=torch.int32)
    assert torch.equal(ids_as_int32(narrow), narrow)


def test_expert_map_takes_global_ids_to_the_layers():
    expert_map = torch.tensor([-1, 0, -1, 1, 5])  # 5: outside a 2-expert layer, flagged by the kernels
    ids = torch.tensor([[1, 3, 0, -1, 7, 4, -5]])
    assert ids_through_expert_map(ids, expert_map).tolist() == [[0, 1, -1, -1, -2, 5, -2]]
    assert ids_through_expert_map(ids.int(), expert_map.int()).dtype == torch.int64


def test_fused_moe_wants_prepared_weights():
    with pytest.raises(TypeError, match="prepare_weights"):
        megamoe.fused_moe(torch.zeros(1, 128, dtype=torch.bfloat16), object(), torch.zeros(1, 4))


def test_reference_quantization_is_megamoes():
    """The reference's E4M3 codes (no GPU needed): 0.1845703125 in a block of amax 3.0625 scales to
    exactly 27, a tie between 26 and 28 that megamoe rounds to even (28). The factor must be an
    IEEE division: PyTorch's `448 / amax` multiplies by a reciprocal and lands just below 27."""
    block = torch.zeros(1, 128)
    block[0, 0], block[0, 1] = 3.0625, 0.1845703125
    quantized = quantize_rows_per_128(block)
    assert quantized[0, 0].item() == 3.0625
    assert quantized[0, 1].item() == 28 * 3.0625 / 448


def test_weights_are_shared_by_copies_and_not_pickled():
    """Runs without a GPU (the handle names no layer, and destroying it is a no-op)."""
    import copy
    import pickle

    weights = megamoe.MoeWeights(handle=-1, num_experts=4, top_k=2, hidden=128, intermediate=128,
                                 precision="bf16", scale_format="fp32", routing=megamoe.SoftmaxRouting(),
                                 max_tokens=8, device=torch.device("cuda", 0))
    assert copy.deepcopy(weights) is weights and copy.copy(weights) is weights
    module = megamoe.MegaMoE.from_weights(weights)
    assert copy.deepcopy(module).weights is weights
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(weights)


def stand_in_layer(monkeypatch, passes):
    """Weights on the CPU whose op is a stand-in: it appends each pass's rows to `passes` and
    returns x plus the pass's first routing column (logits, or weights plus ids), so a row that met
    another row's routing shows."""
    import types

    from megamoe import layer

    def forward(handle, x, router_logits, topk_ids, topk_weights, deterministic, *routing):
        assert routing[0] == ("softmax" if router_logits is not None else "precomputed")
        routing = router_logits if router_logits is not None else topk_weights + topk_ids
        assert x.shape[0] == routing.shape[0] <= 8 and x.is_contiguous() and routing.is_contiguous()
        passes.append(x.shape[0])
        return x + routing[:, :1].to(x.dtype)

    monkeypatch.setattr(layer, "ops", types.SimpleNamespace(forward=forward))
    return megamoe.MoeWeights(handle=None, num_experts=4, top_k=2, hidden=128, intermediate=128,
                              precision="bf16", scale_format="fp32", routing=megamoe.SoftmaxRouting(),
                              max_tokens=8, device=torch.device("cpu"))


def test_a_batch_beyond_max_tokens_is_cut_into_aligned_passes(monkeypatch):
    """Runs without a GPU, through a stand-in op."""
    passes = []
    weights = stand_in_layer(monkeypatch, passes)
    x = torch.randn(21, 128).to(torch.bfloat16)
    logits = torch.arange(21 * 4, dtype=torch.float32).reshape(21, 4)
    assert torch.equal(megamoe.fused_moe(x, weights, logits), x + logits[:, :1].to(torch.bfloat16))
    assert passes == [8, 8, 5]
    passes.clear()
    ids = torch.zeros(21, 2, dtype=torch.int64)
    topk_weights = torch.rand(21, 2)
    y = megamoe.fused_moe(x, weights, topk_ids=ids, topk_weights=topk_weights)
    assert torch.equal(y, x + topk_weights[:, :1].to(torch.bfloat16)) and passes == [8, 8, 5]
    passes.clear()
    assert megamoe.fused_moe(x[:8], weights, logits[:8]).shape == (8, 128) and passes == [8]


def test_megamoe_module_passes_ids_and_expert_map_through(monkeypatch):
    """Runs without a GPU, through a stand-in op: [..., k] ids, global ones mapped to the layer's."""
    weights = stand_in_layer(monkeypatch, [])
    module = megamoe.MegaMoE.from_weights(weights)
    x = torch.randn(2, 3, 128).to(torch.bfloat16)
    global_ids = torch.tensor([[4, 5], [6, 7], [5, 4], [7, 6], [4, 6], [5, 7]]).view(2, 3, 2)
    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3])  # this layer holds global experts 4..7
    topk_weights = torch.zeros(2, 3, 2)
    y = module(x, topk_ids=global_ids, topk_weights=topk_weights, expert_map=expert_map)
    assert y.shape == x.shape
    assert torch.equal(y, x + (global_ids[..., :1] - 4).to(torch.bfloat16))


def test_fused_moe_and_the_module_check_their_own_arguments(monkeypatch):
    """Runs without a GPU, through a stand-in op: what fused_moe passes on is what was meant."""
    weights = stand_in_layer(monkeypatch, [])
    x = torch.randn(6, 128).to(torch.bfloat16)
    logits = torch.randn(6, 4)
    # None, or a string, reached the op as its bool: None ran the fast (atomic) combine.
    for bad in (None, "fast"):
        with pytest.raises(TypeError, match=f"deterministic must be a bool, not {type(bad).__name__}"):
            megamoe.fused_moe(x, weights, logits, deterministic=bad)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        megamoe.MegaMoE.from_weights(weights, deterministic="no")
    with pytest.raises(TypeError, match="weights must come from megamoe.prepare_weights, not object"):
        megamoe.MegaMoE.from_weights(object())
    # The module's tokens: routing of another leading shape was taken row by row, another token's.
    module = megamoe.MegaMoE.from_weights(weights)
    hidden = x.view(2, 3, 128)
    with pytest.raises(ValueError, match=r"router_logits must be \[2, 3, 4\] or \[6, 4\] for hidden_states "
                                         r"\[2, 3, 128\], got \[3, 2, 4\]"):
        module(hidden, logits.view(3, 2, 4))
    with pytest.raises(ValueError, match=r"topk_ids must be \[2, 3, 2\] or \[6, 2\]"):
        module(hidden, topk_ids=torch.zeros(3, 2, 2, dtype=torch.int32), topk_weights=torch.zeros(2, 3, 2))
    with pytest.raises(ValueError, match=r"router_logits must be \[6, 4\] for hidden_states \[6, 128\], got "
                                         r"\[6, 1, 4\]"):
        module(x, logits.view(6, 1, 4))
    with pytest.raises(TypeError, match="hidden_states must be a torch.Tensor, not list"):
        module(x.tolist(), logits)
    with pytest.raises(ValueError, match=r"hidden_states must be \[..., 128\], got \[\]"):
        module(torch.tensor(1.0, dtype=torch.bfloat16), logits)
    # Another hidden size was reported for x as flattened ([6, 64]); a last dimension of 0 failed
    # inside reshape, with PyTorch's RuntimeError.
    with pytest.raises(ValueError, match=r"hidden_states must be \[..., 128\], got \[2, 3, 64\]"):
        module(torch.zeros(2, 3, 64, dtype=torch.bfloat16), logits.view(2, 3, 4))
    with pytest.raises(ValueError, match=r"hidden_states must be \[..., 128\], got \[6, 0\]"):
        module(torch.zeros(6, 0, dtype=torch.bfloat16), logits)
    # The call's own precomputed routing was blamed on the weights ("prepared for precomputed routing").
    with pytest.raises(ValueError, match=r"routing=PrecomputedRouting\(\) takes topk_ids and topk_weights; with "
                                         r"router_logits pass routing=SoftmaxRouting"):
        megamoe.fused_moe(x, weights, logits, routing="precomputed")
    weights.routing = megamoe.PrecomputedRouting()
    with pytest.raises(ValueError, match="these weights were prepared for precomputed routing; with router_logits"):
        megamoe.fused_moe(x, weights, logits)
    weights.routing = megamoe.SoftmaxRouting()
    # Both forms a model passes stay accepted: the same leading shape, and flat [T, E].
    assert module(hidden, logits.view(2, 3, 4)).shape == hidden.shape
    assert torch.equal(module(hidden, logits), module(hidden, logits.view(2, 3, 4)))


def test_forward_has_a_fake_implementation():
    """What torch.compile traces with (no GPU needed: fake CUDA tensors, and no layer is looked up)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 128, dtype=torch.bfloat16, device="cuda")
        y = torch.ops.megamoe.forward(-1, x, torch.empty(5, 16, device="cuda"), None, None, True,
                                      *megamoe.routing.op_arguments(megamoe.SoftmaxRouting()))
    assert y.shape == x.shape and y.dtype == torch.bfloat16 and y.device == x.device
