#!/usr/bin/env python3
"""The README's benchmark table, its expert-parallel figures and its comparison with PyTorch, from
the committed bench/results JSON (megamoe-bench --json, megamoe-ep-bench --json, python -m
megamoe.bench).

  python3 tools/readme_table.py --write   rewrite the table and the figures around it in README.md
  python3 tools/readme_table.py --check   exit 1 when README.md says something the JSON does not

The README quotes measurements; this keeps them the JSON's, never typed by hand.
"""
import argparse
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKLOADS = ["qwen35-a3b", "dsv3"]
TABLE_HEADER = "| workload | 1 token |"
# The README's comparison with PyTorch sits between these two lines, all of it written here.
TORCH_BEGIN = "<!-- from bench/results/torch-*.json by tools/readme_table.py -->"
TORCH_END = "<!-- end of the PyTorch comparison -->"


def load(workload):
    path = ROOT / "bench" / "results" / f"{workload}-fp8_block.json"
    records = sorted(json.loads(path.read_text()), key=lambda r: r["tokens"])
    if not records:
        sys.exit(f"{path}: no records")
    return records


def load_ep():
    path = ROOT / "bench" / "results" / "ep-dsv3-fp8_block.json"
    records = sorted(json.loads(path.read_text()), key=lambda r: r["tokens_per_rank"])
    if len(records) != 2:
        sys.exit(f"{path}: the README quotes a small and a large batch; the JSON has {len(records)} records")
    return records


def load_torch(results_dir=ROOT / "bench" / "results"):
    """{workload: python -m megamoe.bench's JSON} for each torch-<workload>.json there."""
    return {path.stem[len("torch-"):]: json.loads(path.read_text()) for path in sorted(results_dir.glob("torch-*.json"))}


def torch_block(results):
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
        lines += [f"![{workload}: µs per forward against tokens, log-log](bench/results/torch-{workload}.png)", "",
                  f"| {workload}: µs (× floor) | " + " | ".join(map(str, tokens)) + " |",
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
        lines += [f"{result['gpu']}, PyTorch {result['torch']}; floors from HBM reads at "
                  f"{result['hbm_read_bytes_per_s'] / 1e12:.2f} TB/s and torch._scaled_mm's dense E4M3 rate, "
                  f"{result['dense_fp8_flops_per_s'] / 1e12:.0f} TFLOP/s, measured in the same run.", ""]
    return lines[:-1]


def rewrite_torch_block(text, results):
    lines = text.split("\n")
    if lines.count(TORCH_BEGIN) != 1 or lines.count(TORCH_END) != 1:
        sys.exit(f"README.md: expected one line '{TORCH_BEGIN}' and one '{TORCH_END}'")
    start, end = lines.index(TORCH_BEGIN), lines.index(TORCH_END)
    if end < start:
        sys.exit(f"README.md: '{TORCH_END}' comes before '{TORCH_BEGIN}'")
    lines[start + 1:end] = torch_block(results)
    return "\n".join(lines)


def ep_substitutions(small, large):
    """The expert-parallel paragraph's figures; a group of whitespace keeps the README's line breaks."""
    def share_of_peer(r):
        return 2 * r["nvlink_bytes_each_way"] / ((r["dispatch_us"] + r["combine_us"]) * 1e-6) / (r["peer_copy_gbps"] * 1e9)
    sizes = f"{small['tokens_per_rank']} / {large['tokens_per_rank']}"
    return [
        (r"\([0-9]+ GB/s one-way peer copy, [0-9.]+ µs per cross-rank barrier",
         lambda m: f"({small['peer_copy_gbps']:.0f} GB/s one-way peer copy, {small['barrier_us']:.1f} µs per "
                   "cross-rank barrier"),
        (r"round trip takes [0-9.]+ µs at [0-9]+ tokens per rank \(goal 40\) and [0-9]+ µs at [0-9]+,",
         lambda m: f"round trip takes {small['round_trip_graph_us']:.1f} µs at {small['tokens_per_rank']} tokens per "
                   f"rank (goal 40) and {large['round_trip_graph_us']:.0f} µs at {large['tokens_per_rank']},"),
        (r"dispatch takes [0-9.]+ / [0-9.]+ µs and combine [0-9.]+ / [0-9.]+(\s+)µs at [0-9]+ / [0-9]+ tokens per "
         r"rank: [0-9]+% of the peer bandwidth at [0-9]+",
         lambda m: f"dispatch takes {small['dispatch_us']:.1f} / {large['dispatch_us']:.1f} µs and combine "
                   f"{small['combine_us']:.1f} / {large['combine_us']:.1f}{m.group(1)}µs at {sizes} tokens per rank: "
                   f"{share_of_peer(large) * 100:.0f}% of the peer bandwidth at {large['tokens_per_rank']}"),
        (r"The whole EP(\s+)forward \(dispatch, local experts, combine\) takes [0-9]+ / [0-9]+ µs against [0-9]+ / "
         r"[0-9]+ µs",
         lambda m: f"The whole EP{m.group(1)}forward (dispatch, local experts, combine) takes "
                   f"{small['ep_forward_us']:.0f} / {large['ep_forward_us']:.0f} µs against {small['baseline_us']:.0f} / "
                   f"{large['baseline_us']:.0f} µs"),
    ]


def us(value):
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def table(results):
    tokens = [r["tokens"] for r in results[WORKLOADS[0]]]
    if tokens[0] != 1:
        sys.exit(f"{WORKLOADS[0]}: the table's first column is one token; the JSON starts at {tokens[0]}")
    for w in WORKLOADS[1:]:
        if [r["tokens"] for r in results[w]] != tokens:
            sys.exit(f"{w}: token buckets differ from {WORKLOADS[0]}'s")
    lines = [TABLE_HEADER + " " + " | ".join(str(t) for t in tokens[1:]) + " |",
             "|" + "---|" * (len(tokens) + 1)]
    for w in WORKLOADS:
        rows = results[w]
        lines.append(f"| {w} µs (× floor) | " +
                     " | ".join(f"{us(r['median_us'])} ({r['median_us'] / r['floor_us']:.2f})" for r in rows) + " |")
        lines.append(f"| {w} baseline µs | " + " | ".join(us(r["baseline_us"]) for r in rows) + " |")
    return lines


def rewrite(text, results, ep):
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith(TABLE_HEADER)), None)
    if start is None:
        sys.exit("README.md: no benchmark table (a line starting with '| workload | 1 token |')")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    lines[start:end] = table(results)
    text = "\n".join(lines)

    records = [r for w in WORKLOADS for r in results[w]]
    hbm = max(r["hbm_read_bytes_per_s"] for r in records) / 1e12
    dense = [r["dense_flops_per_s"] / 1e12 for r in records]
    largest = results["dsv3"][-1]
    useful = largest["useful_flops"] / largest["median_us"] / 1e6
    share = useful / (largest["dense_flops_per_s"] / 1e12) * 100
    substitutions = [
        (r"HBM bandwidth \([0-9.]+ TB/s\)", f"HBM bandwidth ({hbm:.2f} TB/s)"),
        (r"8192³: [0-9]+-[0-9]+ TFLOP/s", f"8192³: {min(dense):.0f}-{max(dense):.0f} TFLOP/s"),
        (r"dsv3 at [0-9]+ tokens reaches [0-9]+ TFLOP/s of useful FP8 work, [0-9]+% of the dense rate",
         f"dsv3 at {largest['tokens']} tokens reaches {useful:.0f} TFLOP/s of useful FP8 work, {share:.0f}% of the "
         "dense rate"),
    ] + ep_substitutions(*ep)
    for pattern, replacement in substitutions:
        text, count = re.subn(pattern, replacement, text)
        if count != 1:
            sys.exit(f"README.md: expected one match of /{pattern}/, found {count}")
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args()
    readme = ROOT / "README.md"
    text = readme.read_text()
    wanted = rewrite_torch_block(rewrite(text, {w: load(w) for w in WORKLOADS}, load_ep()), load_torch())
    if args.write:
        readme.write_text(wanted)
        print("README.md: benchmark tables and figures written from bench/results")
        return 0
    if wanted != text:
        old, new = text.split("\n"), wanted.split("\n")
        for i, (a, b) in enumerate(zip(old, new)):
            if a != b:
                print(f"README.md:{i + 1}: says\n  {a}\nbut bench/results gives\n  {b}")
        print("run: python3 tools/readme_table.py --write")
        return 1
    print("README.md: benchmark tables and figures match bench/results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
