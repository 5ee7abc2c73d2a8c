#!/usr/bin/env python3
"""The README's results table and docs/performance.md, from the committed bench/results JSON
(megamoe-bench --json, megamoe-ep-bench --json, python -m megamoe.bench).

  python3 tools/readme_table.py --write   rewrite the README's results block and docs/performance.md
  python3 tools/readme_table.py --check   exit 1 when either says something the JSON does not

The README and the performance page quote measurements; this keeps them the JSON's, never typed by
hand. Each file of bench/results is recognized by its shape (which tool wrote it); a file of
another shape is an error, so that a new tool's results are taught here rather than ignored.
"""
import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
PERFORMANCE = ROOT / "docs" / "performance.md"

# The README's one table: megamoe fp8_block on these workloads, per token bucket.
README_WORKLOADS = ["qwen35-a3b", "dsv3"]
README_PRECISION = "fp8_block"
# The README's results sit between these two lines, all of it written here.
README_BEGIN = "<!-- results: written by tools/readme_table.py from bench/results; do not edit by hand -->"
README_END = "<!-- end of results -->"

# Order of the sections on the performance page; workloads and precisions not named here follow,
# sorted by name.
WORKLOAD_ORDER = ["qwen35-a3b", "qwen3-30b-a3b", "dsv3"]
PRECISION_ORDER = ["fp8_block", "fp8_tensor", "fp8_tensor (dynamic activation scales)", "bf16"]
NOT_RECORDED = "not recorded in the JSON"


class Results:
    """bench/results, by tool: megamoe-bench's {(workload, precision): records by tokens},
    megamoe-ep-bench's {file stem: records by tokens per rank}, python -m megamoe.bench's
    {workload: result}, and every file's path relative to the repository."""

    def __init__(self):
        self.bench = {}
        self.ep = {}
        self.ep_python = {}
        self.torch = {}
        self.paths = {}


def load(results_dir=RESULTS):
    results = Results()
    for path in sorted(results_dir.glob("*.json")):
        data = json.loads(path.read_text())
        try:
            shown = path.relative_to(ROOT).as_posix()
        except ValueError:
            shown = path.name
        if isinstance(data, dict) and isinstance(data.get("records"), list):
            if not data["records"]:
                sys.exit(f"{path}: no records")
            results.torch[data["workload"]] = data
            results.paths[("torch", data["workload"])] = shown
        elif isinstance(data, list) and data and all("tokens_per_rank" in r for r in data):
            if any(r.get("ranks_share_one_gpu") for r in data):
                sys.exit(f"{path}: taken by ranks sharing a GPU (megamoe-run --one-gpu): time-sliced ranks, not "
                         "NVLink's figures; they do not belong in bench/results")
            if all("launch" in r and "forward_us" in r for r in data):  # python -m megamoe.ep_bench
                results.ep_python[path.stem] = sorted(data, key=lambda r: (r["tokens_per_rank"], r["launch"]))
                results.paths[("ep_python", path.stem)] = shown
            else:
                results.ep[path.stem] = sorted(data, key=lambda r: r["tokens_per_rank"])
                results.paths[("ep", path.stem)] = shown
        elif isinstance(data, list) and data and all("tokens" in r and "median_us" in r for r in data):
            # fp8_tensor with dynamic activation scales is a section of its own.
            keys = {(r["workload"], r["precision"] + (" (dynamic activation scales)"
                                                      if r.get("input_scales") == "dynamic" else ""))
                    for r in data}
            if len(keys) != 1:
                sys.exit(f"{path}: records of several workloads or precisions: {sorted(keys)}")
            key = keys.pop()
            if key in results.bench:
                sys.exit(f"{path}: a second file for {key[0]} {key[1]}")
            results.bench[key] = sorted(data, key=lambda r: r["tokens"])
            results.paths[("bench",) + key] = shown
        else:
            sys.exit(f"{path}: not a shape this tool knows (megamoe-bench, megamoe-ep-bench, python -m "
                     "megamoe.bench or python -m megamoe.ep_bench JSON); teach tools/readme_table.py to render it")
    return results


def ordered(names, order):
    return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))


def us(value):
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def rate(values, unit, scale, digits=0):
    """A rate over records: one figure, or the range when the records differ at `digits`."""
    low, high = (f"{v / scale:.{digits}f}" for v in (min(values), max(values)))
    return f"{high} {unit}" if low == high else f"{low}-{high} {unit}"


def recorded(items, field):
    """The distinct values of `field` in the records (or result), or NOT_RECORDED."""
    values = list(dict.fromkeys(str(item[field]) for item in items if item.get(field) not in (None, "")))
    return "; ".join(values) if values else NOT_RECORDED


def provenance(items, tool, path):
    command = recorded(items, "command")
    command = f"`{command}`" if command != NOT_RECORDED else f"{NOT_RECORDED} (written by `{tool}`)"
    return f"`{path}`: GPU {recorded(items, 'gpu')}; date {recorded(items, 'date')}; command {command}."


# ------------------------------------------------------------------------------- the README block

def readme_block(results):
    """The README's table: megamoe fp8_block on README_WORKLOADS per token bucket, µs (× floor),
    beside the unfused baseline of the same run, then the run's GPU and rates."""
    missing = [w for w in README_WORKLOADS if (w, README_PRECISION) not in results.bench]
    if missing:
        sys.exit(f"bench/results: the README's table needs {', '.join(f'{w}-{README_PRECISION}.json' for w in missing)}")
    runs = {w: {r["tokens"]: r for r in results.bench[(w, README_PRECISION)]} for w in README_WORKLOADS}
    tokens = sorted(set().union(*runs.values()))
    header = "| tokens | " + " | ".join(f"{w}: megamoe µs (× floor) | baseline µs" for w in README_WORKLOADS) + " |"
    lines = [header, "|---|" + "---|---|" * len(README_WORKLOADS)]
    for t in tokens:
        cells = []
        for w in README_WORKLOADS:
            r = runs[w].get(t)
            cells += ["not run", "not run"] if r is None else [
                f"{us(r['median_us'])} ({r['median_us'] / r['floor_us']:.2f})", us(r["baseline_us"])]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    records = [r for w in README_WORKLOADS for r in runs[w].values()]
    baselines = recorded(records, "baseline")
    lines += ["", f"{recorded(records, 'gpu')}, {README_PRECISION}, {recorded(records, 'combine')} combine, L2 "
              f"{recorded(records, 'l2')}; floors from HBM reads at {rate([r['hbm_read_bytes_per_s'] for r in records], 'TB/s', 1e12, 2)} "
              f"and a dense rate of {rate([r['dense_flops_per_s'] for r in records], 'TFLOP/s', 1e12)}, both measured in "
              f"the same run; baseline: {baselines}, measured in the same run. Every workload, precision and "
              "comparison: [docs/performance.md](docs/performance.md)."]
    return lines


def rewrite_block(text, begin, end, block, name="README.md"):
    """`text` with the lines between the `begin` and `end` lines replaced by `block`."""
    lines = text.split("\n")
    if lines.count(begin) != 1 or lines.count(end) != 1:
        sys.exit(f"{name}: expected one line '{begin}' and one '{end}'")
    start, stop = lines.index(begin), lines.index(end)
    if stop < start:
        sys.exit(f"{name}: '{end}' comes before '{begin}'")
    lines[start + 1:stop] = block
    return "\n".join(lines)


# -------------------------------------------------------------------------- the performance page

def bench_section(key, records, path):
    workload, precision = key
    lines = [f"### {workload}, {precision}", "",
             provenance(records, "megamoe-bench --json", path) + " Measured in the same run: HBM reads at "
             f"{rate([r['hbm_read_bytes_per_s'] for r in records], 'TB/s', 1e12, 2)}, a dense rate of "
             f"{rate([r['dense_flops_per_s'] for r in records], 'TFLOP/s', 1e12)} ({recorded(records, 'dense_rate_source')}). "
             f"{recorded(records, 'combine').capitalize()} combine; L2 {recorded(records, 'l2')}. Baseline: "
             f"{recorded(records, 'baseline')}.", "",
             "| tokens | megamoe µs | × floor | floor µs (bound) | useful TFLOP/s | weight TB/s | baseline µs | "
             "× baseline | rel. error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        tflops = r["useful_flops"] / r["median_us"] / 1e6
        weight_tbs = r["weight_bytes"] / r["median_us"] / 1e6
        lines.append(f"| {r['tokens']} | {us(r['median_us'])} | {r['median_us'] / r['floor_us']:.2f} | "
                     f"{us(r['floor_us'])} ({r.get('floor_bound', '?')}) | {tflops:.1f} | {weight_tbs:.2f} | "
                     f"{us(r['baseline_us'])} | {r['median_us'] / r['baseline_us']:.2f} | {r['rel_err']:.1e} |")
    nodes = list(dict.fromkeys(n["node"] for r in records for n in r.get("breakdown") or []))
    if nodes:
        with_breakdown = [r for r in records if r.get("breakdown")]
        lines += ["", "Where the time goes (`--breakdown`: µs each node adds to the captured graph; the first "
                  "includes the launch of an empty graph):", "",
                  "| node | " + " | ".join(f"{r['tokens']} tokens" for r in with_breakdown) + " |",
                  "|---|" + "---|" * len(with_breakdown)]
        for node in nodes:
            cells = []
            for r in with_breakdown:
                found = [n for n in r["breakdown"] if n["node"] == node]
                cells.append(us(found[0]["added_us"]) if found else "")
            lines.append(f"| {node} | " + " | ".join(cells) + " |")
    return lines


def torch_block(results, image_prefix="bench/results/", results_dir=None, paths=None):
    """The lines of the PyTorch comparison: per workload its plot, a table of µs (× floor) per
    implementation and token count, what failed and why, and the run's GPU and floors."""
    if not results:
        return ["Not measured on a GPU yet: `python -m megamoe.bench` writes `bench/results/torch-<workload>.json`",
                "and a plot beside it, and `python3 tools/readme_table.py --write` puts them here."]
    lines = []
    for workload, result in results.items():
        records = result["records"]
        if not records:
            sys.exit(f"torch-{workload}.json: no records")
        tokens = sorted({r["tokens"] for r in records})
        implementations = list(dict.fromkeys(r["implementation"] for r in records))
        by = {(r["tokens"], r["implementation"]): r for r in records}
        floors = {r["tokens"]: r["floor_us"] for r in records}
        if paths is not None:
            lines += [f"### {workload}", ""]
        if results_dir is None or (results_dir / f"torch-{workload}.png").exists():
            lines += [f"![{workload}: µs per forward against tokens, log-log]({image_prefix}torch-{workload}.png)", ""]
        lines += [f"| {workload}: µs (× floor) | " + " | ".join(map(str, tokens)) + " |",
                  "|" + "---|" * (len(tokens) + 1)]
        failures = []
        for implementation in implementations:
            cells = []
            for t in tokens:
                r = by.get((t, implementation))
                if r is None:
                    cells.append("not run")
                elif r["median_us"] is None:
                    cells.append("failed")
                    failures.append(f"{implementation} at {t} tokens: {r['error']}")
                else:
                    cells.append(f"{us(r['median_us'])} ({r['median_us'] / floors[t]:.2f})")
            lines.append(f"| {implementation} | " + " | ".join(cells) + " |")
        lines.append("| floor | " + " | ".join(us(floors[t]) for t in tokens) + " |")
        lines.append("")
        lines += [f"Failed: {failure}." for failure in failures]
        run = f"{result['gpu']}, PyTorch {result['torch']}"
        if paths is not None:
            run = provenance([result], "python -m megamoe.bench", paths[("torch", workload)]) + f" PyTorch {result['torch']}"
        lines += [f"{run}; floors from HBM reads at {result['hbm_read_bytes_per_s'] / 1e12:.2f} TB/s and "
                  f"torch._scaled_mm's dense E4M3 rate, {result['dense_fp8_flops_per_s'] / 1e12:.0f} TFLOP/s, "
                  "measured in the same run.", ""]
    return lines[:-1]


def ep_section(name, records, path):
    # Older records carry one figure for both directions (bf16 rows out, bf16 partial sums back).
    def out_bytes(r):
        return r.get("dispatch_bytes", r.get("nvlink_bytes_each_way"))

    def back_bytes(r):
        return r.get("combine_bytes", r.get("nvlink_bytes_each_way"))

    def share_of_peer(r):
        # Token rows out (FP8 rows are smaller; older records sent bf16 rows), partial sums back.
        moved = out_bytes(r) + back_bytes(r)
        return moved / ((r["dispatch_us"] + r["combine_us"]) * 1e-6) / (r["peer_copy_gbps"] * 1e9)
    first = records[0]
    # megamoe-ep-bench --fused: the fused layer's forward beside the staged one, in every record.
    fused = all("fused_forward_us" in r for r in records)
    lines = [f"### {first['workload']}, {first['precision']}, {first['ranks']} ranks", "",
             provenance(records, "megamoe-run -n RANKS -- megamoe-ep-bench --json", path) +
             f" Measured in the same run: NVLink peer copy {rate([r['peer_copy_gbps'] for r in records], 'GB/s', 1)} "
             f"one way, {rate([r['barrier_us'] for r in records], 'µs', 1, 1)} per cross-rank barrier. Round trip: "
             f"{recorded(records, 'round_trip_graph')}. Baseline: {recorded(records, 'baseline')}.", "",
             "| tokens per rank | round trip µs (one graph) | dispatch µs | combine µs | share of peer bandwidth "
             "(phases) | NVLink MB out / back | EP forward µs |" + (" fused forward µs |" if fused else "") +
             " baseline µs | × baseline |",
             "|---|---|---|---|---|---|---|" + ("---|" if fused else "") + "---|---|"]
    for r in records:
        fused_cell = f" {us(r['fused_forward_us'])} |" if fused else ""
        lines.append(f"| {r['tokens_per_rank']} | {us(r['round_trip_graph_us'])} | {us(r['dispatch_us'])} | "
                     f"{us(r['combine_us'])} | {share_of_peer(r) * 100:.0f}% | "
                     f"{out_bytes(r) / 1e6:.1f} / {back_bytes(r) / 1e6:.1f} | "
                     f"{us(r['ep_forward_us'])} |{fused_cell} {us(r['baseline_us'])} | "
                     f"{r['ep_forward_us'] / r['baseline_us']:.2f} |")
    lines += ["", "Dispatch and combine are timed phase by phase (a device barrier and an event before each, which "
              "adds launch and drain time outside the kernels); the round trip as a serving engine replays it, both "
              "phases in one CUDA graph, slowest rank."]
    return lines


def ep_python_section(records, path):
    """python -m megamoe.ep_bench: each launch's forward from PyTorch, the slowest rank's µs."""
    first = records[0]
    launches = [launch for launch in ("staged", "fused") if any(r["launch"] == launch for r in records)]
    by_tokens = {}
    for r in records:
        by_tokens.setdefault(r["tokens_per_rank"], {})[r["launch"]] = r["forward_us"]
    both = launches == ["staged", "fused"]
    lines = [f"### {first['workload']}, {first['precision']}, {first['ranks']} ranks, from PyTorch", "",
             provenance(records, "megamoe-run -n RANKS -- python -m megamoe.ep_bench --json", path) +
             f" Method: {recorded(records, 'method')}.", "",
             "| tokens per rank |" + "".join(f" {launch} µs |" for launch in launches) +
             (" fused / staged |" if both else ""),
             "|---|" + "---|" * (len(launches) + both)]
    for tokens in sorted(by_tokens):
        figures = by_tokens[tokens]
        cells = "".join(f" {us(figures[launch])} |" if launch in figures else " – |" for launch in launches)
        ratio = (f" {figures['fused'] / figures['staged']:.2f} |" if both and len(figures) == 2 else
                 " – |" if both else "")
        lines.append(f"| {tokens} |{cells}{ratio}")
    return lines


def performance_page(results, results_dir=RESULTS):
    lines = ["# Performance", "",
             "<!-- written by tools/readme_table.py from bench/results/*.json: do not edit by hand -->", "",
             "Every figure on this page is a record of `bench/results/`, rendered by `python3 tools/readme_table.py "
             "--write`; `--check` (CTest `tools.readme_table.matches_results`) fails when the page and the JSON differ. "
             "How the figures are taken: [decisions.md](decisions.md#benchmark-method). Each run's session, command "
             "and purpose: the lab notebook, [bench/NOTES.md](../bench/NOTES.md).", "",
             "## The layer against its floor and an unfused baseline", "",
             "`megamoe-bench` on one GPU: median µs of CUDA-graph replays; the floor is the larger of the touched "
             "experts' weight bytes over the HBM read rate and the useful FLOPs over the dense rate (hbm or compute "
             "bound); useful TFLOP/s excludes padding; weight TB/s is the touched experts' bytes over the time; the "
             "relative error is against the CPU reference that quantizes as the kernels do.", ""]
    if not results.bench:
        lines += ["No `megamoe-bench` results yet.", ""]
    for workload in ordered({w for w, _ in results.bench}, WORKLOAD_ORDER):
        for precision in ordered({p for w, p in results.bench if w == workload}, PRECISION_ORDER):
            key = (workload, precision)
            lines += bench_section(key, results.bench[key], results.paths[("bench",) + key]) + [""]
    lines += ["## Against PyTorch", "",
              "`python -m megamoe.bench`: megamoe against the same layer written with PyTorch alone (routing, a sort "
              "into expert order, `torch._grouped_mm` in bf16 or `torch._scaled_grouped_mm` on row-scaled E4M3, "
              "SwiGLU, `index_add_`), each one CUDA graph in one process, µs (× floor).", ""]
    torch = {w: results.torch[w] for w in ordered(results.torch, WORKLOAD_ORDER)}
    lines += torch_block(torch, "../bench/results/", results_dir, results.paths) + [""]
    lines += ["## Expert parallelism", "",
              "`megamoe-ep-bench` under `megamoe-run`: the staged expert-parallel layer (and the fused one where "
              "a run recorded it) against a staged NCCL baseline measured in the same run; `python -m "
              "megamoe.ep_bench`: the same layers timed from PyTorch.", ""]
    if not results.ep:
        lines += ["No `megamoe-ep-bench` results yet.", ""]
    for name in sorted(results.ep):
        lines += ep_section(name, results.ep[name], results.paths[("ep", name)]) + [""]
    for name in sorted(results.ep_python):
        lines += ep_python_section(results.ep_python[name], results.paths[("ep_python", name)]) + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


# ----------------------------------------------------------------------------------------- main

def wanted(results, readme_text, results_dir=RESULTS):
    """{path: the text it should have}."""
    return {README: rewrite_block(readme_text, README_BEGIN, README_END, readme_block(results)),
            PERFORMANCE: performance_page(results, results_dir)}


def report_difference(path, old, new):
    name = path.relative_to(ROOT).as_posix()
    if old is None:
        print(f"{name}: missing")
        return
    for i, (a, b) in enumerate(zip(old.split("\n"), new.split("\n"))):
        if a != b:
            print(f"{name}:{i + 1}: says\n  {a}\nbut bench/results gives\n  {b}")
            return
    print(f"{name}: its length differs from what bench/results gives")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args()
    texts = wanted(load(), README.read_text())
    if args.write:
        for path, text in texts.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        print("README.md and docs/performance.md: written from bench/results")
        return 0
    stale = [path for path, text in texts.items() if (path.read_text() if path.exists() else None) != text]
    for path in stale:
        report_difference(path, path.read_text() if path.exists() else None, texts[path])
    if stale:
        print("run: python3 tools/readme_table.py --write")
        return 1
    print("README.md and docs/performance.md: match bench/results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
