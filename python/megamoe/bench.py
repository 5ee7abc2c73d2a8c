"""python -m megamoe.bench: megamoe against the MoE layer a PyTorch user writes without it, per
named workload and token count, in one process on one GPU.

Implementations, all routing from the same router logits and timed the same way (a CUDA graph of
one forward, the median of --replays replays, each after a read of twice the L2 size so that
the weights stream from HBM as they do between a model's layers):
  megamoe fp8_block, megamoe bf16;
  torch bf16: softmax/top-k routing, a sort into expert order, torch._grouped_mm for FC1 and FC2,
    SwiGLU and an index_add_ combine;
  torch fp8: the same with torch._scaled_grouped_mm on E4M3 weights and activations with one
    scale per row (per token, per output channel).
Floors (docs/design.md#measuring, measured in the same run): the touched experts' fp8 weight bytes
over the HBM read bandwidth, and the useful FLOPs over torch._scaled_mm's dense E4M3 rate; the
larger.
Prints a table per workload, writes bench/results/torch-<workload>.json and a log-log plot of
latency against tokens (PNG) beside it.
"""

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

import megamoe
from megamoe import packing
from megamoe.routing import DeepseekRouting
from megamoe.workloads import SHAPE_FORM, WORKLOADS, Workload, find_workload

DEFAULT_TOKENS = (1, 16, 128, 512, 2048, 8192)
IMPLEMENTATIONS = ("megamoe fp8_block", "megamoe bf16", "torch bf16", "torch fp8")


# ------------------------------------------------------------------ the PyTorch baselines

def route(logits: torch.Tensor, workload: Workload, bias: Optional[torch.Tensor]):
    """(ids [T, k] int64, weights [T, k] float32) as a model's router computes them."""
    k = workload.top_k
    r = workload.routing
    if isinstance(r, DeepseekRouting):
        scores = torch.sigmoid(logits.float())
        choice = scores + bias
        tokens, experts = choice.shape
        groups = choice.view(tokens, r.n_group, experts // r.n_group)
        group_scores = groups.topk(min(2, experts // r.n_group), dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(r.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask.repeat_interleave(experts // r.n_group, dim=1), float("-inf"))
        ids = choice.topk(k, dim=-1).indices
        weights = scores.gather(1, ids)
        if r.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * r.routed_scaling_factor
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    if r.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def expert_order(ids: torch.Tensor, experts: int, align: int):
    """Where each (token, slot) goes in an expert-contiguous layout whose segments are padded to
    `align` rows, without a host synchronization (so a CUDA graph can hold it): (slot of each
    sorted position, its row in the layout, the segments' end offsets as int32, the layout's
    rows, an upper bound that does not depend on the routing)."""
    flat = ids.flatten()
    sorted_ids, order = torch.sort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(0)
    rank = torch.arange(flat.numel(), device=ids.device) - (counts.cumsum(0) - counts)[sorted_ids]
    rows = (ends - padded)[sorted_ids] + rank
    capacity = flat.numel() + (align - 1) * experts
    return order, rows, ends.to(torch.int32), capacity


def quantize_rows(values: torch.Tensor):
    """E4M3 codes with one float32 scale per row (the last dimension), megamoe's block scaling
    with a row as the block: (codes, scales)."""
    scale, factor = packing.block_scales(values.abs().amax(dim=-1, keepdim=True).float(), "fp32")
    return (values.float() * factor).to(torch.float8_e4m3fn), scale.squeeze(-1)


def quantize_expert_rows(weights: torch.Tensor):
    """quantize_rows of [E, N, K] weights one expert at a time: a whole layer's float32 copy
    (30 GB for dsv3's w13) would not fit beside the layers the sweep holds."""
    codes = torch.empty(weights.shape, dtype=torch.float8_e4m3fn, device=weights.device)
    scales = torch.empty(weights.shape[:-1], dtype=torch.float32, device=weights.device)
    for expert in range(weights.shape[0]):
        codes[expert], scales[expert] = quantize_rows(weights[expert])
    return codes, scales


def random_weights(experts: int, rows: int, columns: int, generator: torch.Generator) -> torch.Tensor:
    """[experts, rows, columns] bfloat16 normal weights with variance 1 / columns, drawn one expert
    at a time in float32 (bounding the temporaries, as quantize_expert_rows does)."""
    out = torch.empty(experts, rows, columns, dtype=torch.bfloat16, device=generator.device)
    for expert in range(experts):
        out[expert] = torch.randn(rows, columns, device=generator.device, generator=generator) / math.sqrt(columns)
    return out


class TorchMoe:
    """The MoE layer in plain PyTorch: routing, expert order, two grouped GEMMs, SwiGLU, combine.
    fp8: E4M3 with row scales through torch._scaled_grouped_mm; else bf16 through
    torch._grouped_mm. `align` pads each expert's rows to a multiple (PyTorch 2.11's grouped GEMMs
    take any group size, pytorch/pytorch#155466; older ones wanted 16)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, workload: Workload, bias: Optional[torch.Tensor],
                 fp8: bool, align: int = 1):
        self.workload, self.bias, self.fp8, self.align = workload, bias, fp8, align
        if fp8:
            # [E, N, K] row-major codes, multiplied as their [E, K, N] column-major transposes.
            self.w13, self.w13_scale = quantize_expert_rows(w13)
            self.w2, self.w2_scale = quantize_expert_rows(w2)
        else:
            self.w13, self.w2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
            self.w13_scale = self.w2_scale = None

    def _grouped(self, a: torch.Tensor, w: torch.Tensor, w_scale: Optional[torch.Tensor], offsets: torch.Tensor):
        if self.fp8:
            codes, scale = quantize_rows(a)
            return torch._scaled_grouped_mm(codes, w.transpose(1, 2), scale, w_scale, offs=offsets,
                                            out_dtype=torch.bfloat16)
        return torch._grouped_mm(a, w.transpose(1, 2), offs=offsets)

    def __call__(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape
        k, intermediate = self.workload.top_k, self.workload.intermediate
        ids, weights = route(logits, self.workload, self.bias)
        order, rows, offsets, capacity = expert_order(ids, self.workload.experts, self.align)
        token = order // k
        gathered = x.new_zeros(capacity, hidden)
        gathered[rows] = x[token]
        h = self._grouped(gathered, self.w13, self.w13_scale, offsets)
        activated = (torch.nn.functional.silu(h[:, :intermediate].float()) * h[:, intermediate:].float())
        out = self._grouped(activated.to(torch.bfloat16), self.w2, self.w2_scale, offsets)
        contributions = out[rows].float() * weights.flatten()[order].unsqueeze(1)
        y = torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device).index_add_(0, token, contributions)
        return y.to(torch.bfloat16)


# ------------------------------------------------------------------ measuring

def time_in_graph(forward: Callable[[], torch.Tensor], replays: int, scrub: torch.Tensor) -> float:
    """Median µs of `replays` replays of a CUDA graph of forward(), each after a reduction over
    `scrub` (twice the L2 size) evicts L2; forward() runs once eagerly first. The scrub only
    reads: dirty lines left by a write would be written back inside the timed replay (measured:
    ~15 µs more for a weight-streaming layer), which megamoe-bench's BufferReader avoids the same
    way."""
    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for _ in range(3):
        graph.replay()
    for start, end in zip(starts, ends):
        scrub.amax()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def seconds_per_call(call: Callable[[], object], calls: int) -> List[float]:
    """Seconds each of `calls` eager calls of call() took on the GPU, one after another."""
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return times


def measure_read_bandwidth() -> float:
    """Bytes per second the fastest of 10 float32 sums over 8 GiB reads: the HBM read bandwidth,
    as PyTorch's best reduction sees it (on an H200, 4.46 TB/s; a 2 GiB amax reached 4.40 and a
    bf16 amax 3.51). The fastest, not the median: a floor is the best the hardware showed, and the
    median of 2 GiB amaxes varied 4.09-4.36 TB/s between runs. megamoe's TMA weight stream reads
    a little faster still (~4.55 TB/s), so a layer at its floor can show x floor just under 1."""
    source = torch.rand(1 << 31, device="cuda")
    bandwidth = source.numel() * source.element_size() / min(seconds_per_call(source.sum, 10))
    del source
    torch.cuda.empty_cache()
    return bandwidth


def measure_dense_fp8_rate(n: int = 8192) -> float:
    """FLOP/s of the fastest of 20 torch._scaled_mm on n x n x n E4M3 operands with tensor-wide
    scales, the first 5 taken as warm-up (the fastest, as for the bandwidth)."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device="cuda")
    times = seconds_per_call(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), 20)
    return 2.0 * n**3 / min(times[5:])


def floor_us(workload: Workload, ids: torch.Tensor, read_bandwidth: float, dense_rate: float) -> float:
    """The larger of the touched experts' fp8 weights over the bandwidth and the useful FLOPs over
    the dense rate, in µs."""
    touched = torch.unique(ids).numel()
    weight_bytes = touched * 3 * workload.hidden * workload.intermediate
    flops = 2.0 * ids.numel() * 3 * workload.hidden * workload.intermediate
    return max(weight_bytes / read_bandwidth, flops / dense_rate) * 1e6


def relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300)).item()


# ------------------------------------------------------------------ reporting

def print_table(name: str, records: List[dict]) -> None:
    tokens = sorted({r["tokens"] for r in records})
    by = {(r["tokens"], r["implementation"]): r for r in records}
    print(f"\n{name}: median µs of a CUDA-graph replay, L2 evicted (relative L2 error against torch bf16)")
    header = f"{'tokens':>7} | {'floor':>8} | " + " | ".join(f"{i:>22}" for i in IMPLEMENTATIONS)
    print(header)
    print("-" * len(header))
    for t in tokens:
        cells = []
        for implementation in IMPLEMENTATIONS:
            r = by.get((t, implementation))
            if r is None or r["median_us"] is None:
                cells.append(f"{'not run':>22}")
            else:
                cells.append(f"{r['median_us']:>10.1f} ({r['rel_err']:.1e})".rjust(22))
        print(f"{t:>7} | {by[(t, IMPLEMENTATIONS[0])]['floor_us']:>8.1f} | " + " | ".join(cells))


def write_plot(path: Path, name: str, records: List[dict]) -> None:
    """Latency against tokens, log-log, one line per implementation and the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for implementation in IMPLEMENTATIONS:
        points = sorted((r["tokens"], r["median_us"]) for r in records
                        if r["implementation"] == implementation and r["median_us"] is not None)
        if points:
            axes.plot(*zip(*points), marker="o", label=implementation)
    floor = sorted({(r["tokens"], r["floor_us"]) for r in records})
    axes.plot(*zip(*floor), linestyle="--", color="black", label="floor (fp8 weights, dense fp8 rate)")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("tokens")
    axes.set_ylabel("µs per forward (CUDA graph, L2 evicted)")
    axes.set_title(f"MoE layer, {name}, {records[0]['gpu']}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


class Progress:
    """tqdm where it is installed, else a line per step on stderr."""

    def __init__(self, total: int):
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="run", file=sys.stderr)
        except ImportError:
            self.bar, self.done, self.total = None, 0, total

    def step(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description(text)
            self.bar.update(1)
        else:
            self.done += 1
            print(f"[{self.done}/{self.total}] {text}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------ the sweep

def bench_workload(name: str, tokens: List[int], replays: int, read_bandwidth: float, dense_rate: float,
                   progress: Progress) -> List[dict]:
    w = find_workload(name)
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    w13 = random_weights(w.experts, 2 * w.intermediate, w.hidden, generator)
    w2 = random_weights(w.experts, w.hidden, w.intermediate, generator)
    bias, routing = None, w.routing
    if isinstance(w.routing, DeepseekRouting):
        bias = torch.rand(w.experts, device=device, generator=generator) * 0.1 - 0.05
        routing = dataclasses.replace(w.routing, e_score_correction_bias=bias)
    layers: Dict[str, Callable] = {}
    for precision in ("fp8_block", "bf16"):
        weights = megamoe.prepare_weights(w13, w2, top_k=w.top_k, precision=precision, routing=routing,
                                          max_tokens=max(tokens), device=device)
        layers[f"megamoe {precision}"] = lambda x, logits, weights=weights: megamoe.fused_moe(x, weights, logits)
    layers["torch bf16"] = TorchMoe(w13, w2, w, bias, fp8=False)
    layers["torch fp8"] = TorchMoe(w13, w2, w, bias, fp8=True)
    scrub = torch.rand(2 * torch.cuda.get_device_properties(device).L2_cache_size // 4, device=device)

    records = []
    for t in tokens:
        x = torch.randn(t, w.hidden, device=device, generator=generator).to(torch.bfloat16)
        logits = torch.randn(t, w.experts, device=device, generator=generator)
        ids, _ = route(logits, w, bias)
        floor = floor_us(w, ids, read_bandwidth, dense_rate)
        with torch.no_grad():
            expected = layers["torch bf16"](x, logits)
        for implementation in IMPLEMENTATIONS:
            forward = layers[implementation]
            record = dict(workload=name, tokens=t, implementation=implementation, floor_us=floor,
                          gpu=torch.cuda.get_device_name(device), median_us=None, rel_err=None, error=None)
            try:
                with torch.no_grad():
                    record["rel_err"] = relative_l2(forward(x, logits), expected)
                    record["median_us"] = time_in_graph(lambda: forward(x, logits), replays, scrub)
            except RuntimeError as e:  # e.g. a baseline kernel this GPU or build does not have
                record["error"] = str(e).splitlines()[0]
                torch.cuda.synchronize()
            records.append(record)
            progress.step(f"{name} {t} tokens {implementation}")
    return records


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megamoe.bench", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--workload", default="all",
                        help=f"{', '.join(WORKLOADS)}, all (default), or a layer of your own shape, {SHAPE_FORM}")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                        help="comma-separated token counts (default %(default)s)")
    parser.add_argument("--replays", type=int, default=100, help="CUDA-graph replays per measurement")
    parser.add_argument("--out", type=Path, default=Path("bench/results"),
                        help="folder for torch-<workload>.json and .png (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens must be comma-separated integers, not {args.tokens!r}")
    if not tokens or min(tokens) < 1:
        parser.error("--tokens must be positive")
    if args.replays < 1:
        parser.error("--replays must be positive")
    if args.workload != "all":
        try:
            find_workload(args.workload)
        except ValueError as e:
            parser.error(f"--workload: {e}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("megamoe.bench needs a Hopper GPU (sm_90)", file=sys.stderr)
        return 2
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    args.out.mkdir(parents=True, exist_ok=True)

    read_bandwidth = measure_read_bandwidth()
    dense_rate = measure_dense_fp8_rate()
    print(f"{torch.cuda.get_device_name()}: HBM read {read_bandwidth / 1e12:.2f} TB/s, dense E4M3 "
          f"{dense_rate / 1e12:.0f} TFLOP/s (torch._scaled_mm 8192^3); torch {torch.__version__}", file=sys.stderr)
    progress = Progress(len(names) * len(tokens) * len(IMPLEMENTATIONS))
    for name in names:
        records = bench_workload(name, tokens, args.replays, read_bandwidth, dense_rate, progress)
        torch.cuda.empty_cache()
        result = dict(workload=name, gpu=records[0]["gpu"], torch=torch.__version__,
                      hbm_read_bytes_per_s=read_bandwidth, dense_fp8_flops_per_s=dense_rate, records=records)
        json_path = args.out / f"torch-{name}.json"
        json_path.write_text(json.dumps(result, indent=1) + "\n")
        write_plot(args.out / f"torch-{name}.png", name, records)
        print_table(name, records)
        print(f"wrote {json_path} and {json_path.with_suffix('.png')}")
    progress.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
