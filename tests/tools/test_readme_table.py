#!/usr/bin/env python3
"""tools/readme_table.py on made-up results shaped as the tools write them (megamoe-bench --json,
megamoe-ep-bench --json, python -m megamoe.bench): each file is recognized by its shape, the
cells are the records' figures, provenance says what the JSON records and what it does not, a
failed run says why, a second --write changes nothing and --check's comparison sees a changed
figure. Plain asserts; exits non-zero on the first failure."""
import importlib.util
import json
import pathlib
import sys
import tempfile

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "readme_table.py"
spec = importlib.util.spec_from_file_location("readme_table", TOOL)
readme_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme_table)


def torch_record(tokens, implementation, median_us, floor_us, error=None):
    return dict(workload="qwen35-a3b", tokens=tokens, implementation=implementation, floor_us=floor_us,
                gpu="NVIDIA H200", median_us=median_us, rel_err=None if error else 1e-3, error=error)


def torch_result():
    records = []
    for tokens, floor in ((1, 5.5), (16, 72.0), (2048, 190.25)):
        records += [torch_record(tokens, "megamoe fp8_block", floor * 1.5, floor),
                    torch_record(tokens, "torch bf16", floor * 4, floor)]
    records[-1] = torch_record(2048, "torch bf16", None, 190.25, error="out of memory")
    return dict(workload="qwen35-a3b", gpu="NVIDIA H200", torch="2.11.0", hbm_read_bytes_per_s=4.5e12,
                dense_fp8_flops_per_s=1.43e15, records=records)


def bench_record(workload, precision, tokens, median_us, floor_us, baseline_us, **extra):
    record = dict(workload=workload, precision=precision, tokens=tokens, gpu="NVIDIA H200", median_us=median_us,
                  floor_us=floor_us, floor_bound="hbm", touched_experts=8, weight_bytes=25e6, useful_flops=50e6,
                  hbm_read_bytes_per_s=4.5e12, dense_flops_per_s=1.44e15, dense_rate_source="cuBLASLt 8192^3",
                  baseline_us=baseline_us, baseline="grouped cuBLAS", rel_err=2.5e-3, combine="deterministic",
                  l2="scrubbed before each timed replay", breakdown=[])
    record.update(extra)
    return record


def bench_results(workload):
    return [bench_record(workload, "fp8_block", 16, 90.0, 72.0, 300.0),
            bench_record(workload, "fp8_block", 1, 25.0, 5.0, 100.0)]


def ep_records():
    common = dict(workload="dsv3", precision="fp8_block", ranks=2, peer_copy_gbps=400.0, barrier_us=4.5,
                  round_trip_graph="one graph", baseline="NCCL")
    return [dict(common, tokens_per_rank=4096, dispatch_us=200.0, combine_us=200.0, round_trip_graph_us=380.0,
                 ep_forward_us=5000.0, baseline_us=5000.0, nvlink_bytes_each_way=64e6),
            dict(common, tokens_per_rank=128, dispatch_us=25.0, combine_us=15.0, round_trip_graph_us=30.0,
                 ep_forward_us=1400.0, baseline_us=1400.0, nvlink_bytes_each_way=2e6),
            # A newer record: each direction's bytes of its own (FP8 rows out, bf16 partial sums back).
            dict(common, tokens_per_rank=512, dispatch_us=50.0, combine_us=50.0, round_trip_graph_us=90.0,
                 ep_forward_us=2000.0, baseline_us=2500.0, dispatch_bytes=10e6, combine_bytes=20e6)]


def ep_python_records():
    common = dict(workload="dsv3", precision="fp8_block", ranks=2, method="graphs of ten forwards",
                  ranks_share_one_gpu=False)
    return [dict(common, tokens_per_rank=128, launch="fused", forward_us=700.0),
            dict(common, tokens_per_rank=8, launch="staged", forward_us=600.0),
            dict(common, tokens_per_rank=128, launch="staged", forward_us=1400.0),
            dict(common, tokens_per_rank=8, launch="fused", forward_us=450.0)]


def write(folder, name, data):
    (folder / name).write_text(json.dumps(data))


def check_torch_block():
    with tempfile.TemporaryDirectory() as name:
        folder = pathlib.Path(name)
        write(folder, "torch-qwen35-a3b.json", torch_result())
        results = readme_table.load(folder).torch
    assert list(results) == ["qwen35-a3b"], results.keys()

    lines = readme_table.torch_block(results)
    assert lines[0] == "![qwen35-a3b: µs per forward against tokens, log-log](bench/results/torch-qwen35-a3b.png)"
    assert "| qwen35-a3b: µs (× floor) | 1 | 16 | 2048 |" in lines
    assert "| megamoe fp8_block | 8.2 (1.50) | 108.0 (1.50) | 285.4 (1.50) |" in lines, lines
    assert "| torch bf16 | 22.0 (4.00) | 288.0 (4.00) | failed |" in lines, lines
    assert "| floor | 5.5 | 72.0 | 190.2 |" in lines, lines
    assert "Failed: torch bf16 at 2048 tokens: out of memory." in lines, lines
    assert any("4.50 TB/s" in line and "1430 TFLOP/s" in line for line in lines), lines
    assert "Not measured on a GPU yet" in readme_table.torch_block({})[0]


def check_readme_block():
    with tempfile.TemporaryDirectory() as name:
        folder = pathlib.Path(name)
        for workload in readme_table.README_WORKLOADS:
            write(folder, f"{workload}-fp8_block.json", bench_results(workload))
        results = readme_table.load(folder)
    lines = readme_table.readme_block(results)
    header = "| tokens | " + " | ".join(f"{w}: megamoe µs (× floor) | baseline µs"
                                        for w in readme_table.README_WORKLOADS) + " |"
    assert lines[0] == header, lines
    assert lines[2] == "| 1 | 25.0 (5.00) | 100.0 | 25.0 (5.00) | 100.0 |", lines  # sorted by tokens
    assert lines[3] == "| 16 | 90.0 (1.25) | 300.0 | 90.0 (1.25) | 300.0 |", lines
    assert "4.50 TB/s" in lines[-1] and "1440 TFLOP/s" in lines[-1] and "grouped cuBLAS" in lines[-1], lines

    readme = "\n".join(["intro", readme_table.README_BEGIN, "stale", readme_table.README_END, "after"])
    written = readme_table.rewrite_block(readme, readme_table.README_BEGIN, readme_table.README_END, lines)
    assert "stale" not in written and written.endswith(readme_table.README_END + "\nafter")
    again = readme_table.rewrite_block(written, readme_table.README_BEGIN, readme_table.README_END, lines)
    assert again == written, "a second --write changes nothing"
    changed = written.replace("90.0 (1.25)", "91.0 (1.25)")
    assert readme_table.rewrite_block(changed, readme_table.README_BEGIN, readme_table.README_END, lines) != changed, \
        "--check must see a changed figure"
    try:
        readme_table.rewrite_block("no markers", readme_table.README_BEGIN, readme_table.README_END, lines)
    except SystemExit as e:
        assert "expected one line" in str(e)
    else:
        raise AssertionError("a README without the markers must be refused")

    with tempfile.TemporaryDirectory() as name:
        folder = pathlib.Path(name)
        write(folder, "qwen35-a3b-fp8_block.json", bench_results("qwen35-a3b"))
        try:
            readme_table.readme_block(readme_table.load(folder))
        except SystemExit as e:
            assert "dsv3-fp8_block.json" in str(e), e
        else:
            raise AssertionError("the README's table needs every workload it names")


def check_performance_page():
    with tempfile.TemporaryDirectory() as name:
        folder = pathlib.Path(name)
        write(folder, "qwen35-a3b-fp8_block.json", bench_results("qwen35-a3b"))
        breakdown = [dict(node="empty_kernel_graph", cumulative_us=3.8, added_us=0.0),
                     dict(node="route_and_count_kernel", cumulative_us=9.0, added_us=9.0)]
        write(folder, "qwen35-a3b-bf16.json",
              [bench_record("qwen35-a3b", "bf16", 1, 30.0, 10.0, 100.0, breakdown=breakdown,
                            date="2026-11-30", command="megamoe-bench --workload qwen35-a3b --precision bf16")])
        write(folder, "dsv3-fp8_block.json", bench_results("dsv3"))
        write(folder, "ep-dsv3-fp8_block.json", ep_records())
        write(folder, "ep-dsv3-fp8_block-fused.json",
              [dict(r, fused_forward_us=r["ep_forward_us"] / 2, tokens_per_rank=r["tokens_per_rank"] + 1)
               for r in ep_records()])
        write(folder, "ep-dsv3-fp8_block-python.json", ep_python_records())
        write(folder, "torch-qwen35-a3b.json", torch_result())
        results = readme_table.load(folder)
        assert sorted(results.bench) == [("dsv3", "fp8_block"), ("qwen35-a3b", "bf16"), ("qwen35-a3b", "fp8_block")]
        assert sorted(results.ep) == ["ep-dsv3-fp8_block", "ep-dsv3-fp8_block-fused"], results.ep
        assert list(results.ep_python) == ["ep-dsv3-fp8_block-python"] and list(results.torch) == ["qwen35-a3b"]
        page = readme_table.performance_page(results, folder)
        assert readme_table.performance_page(results, folder) == page, "the page is deterministic"
    lines = page.split("\n")

    # Sections in the named order: qwen35-a3b (fp8_block, then bf16), then dsv3.
    sections = [line for line in lines if line.startswith("### ")]
    assert sections[:3] == ["### qwen35-a3b, fp8_block", "### qwen35-a3b, bf16", "### dsv3, fp8_block"], sections
    assert sections[3:] == ["### qwen35-a3b", "### dsv3, fp8_block, 2 ranks", "### dsv3, fp8_block, 2 ranks",
                            "### dsv3, fp8_block, 2 ranks, from PyTorch"], sections
    # A record's cells: µs, × floor, floor (bound), useful TFLOP/s, weight TB/s, baseline, × baseline, error.
    assert "| 16 | 90.0 | 1.25 | 72.0 (hbm) | 0.6 | 0.28 | 300.0 | 0.30 | 2.5e-03 |" in lines, lines
    # Provenance: what the JSON records, and saying so where it records nothing.
    assert any("GPU NVIDIA H200; date 2026-11-30; command `megamoe-bench --workload qwen35-a3b --precision bf16`"
               in line for line in lines), lines
    assert any("date not recorded in the JSON; command not recorded in the JSON (written by `megamoe-bench --json`)"
               in line for line in lines), lines
    assert any(line.startswith("`") and "ep-dsv3-fp8_block.json`: GPU not recorded in the JSON" in line
               for line in lines), lines
    # The breakdown, where a record has one.
    assert "| route_and_count_kernel | 9.0 |" in lines, lines
    # Expert parallelism: sorted by tokens per rank; share of peer = (bytes out + bytes back) /
    # (dispatch + combine) / peer, an older record's one figure counting for both directions.
    ep_rows = [line for line in lines if line.startswith(("| 128 |", "| 512 |", "| 4096 |"))]
    assert ep_rows == ["| 128 | 30.0 | 25.0 | 15.0 | 25% | 2.0 / 2.0 | 1400 | 1400 | 1.00 |",
                       "| 512 | 90.0 | 50.0 | 50.0 | 75% | 10.0 / 20.0 | 2000 | 2500 | 0.80 |",
                       "| 4096 | 380.0 | 200.0 | 200.0 | 80% | 64.0 / 64.0 | 5000 | 5000 | 1.00 |",
                       "| 128 | 1400 | 700.0 | 0.50 |"], ep_rows
    # A run with the fused layer: its forward in a column of its own, beside the staged one's.
    assert "| 129 | 30.0 | 25.0 | 15.0 | 25% | 2.0 / 2.0 | 1400 | 700.0 | 1400 | 1.00 |" in lines, lines
    # From PyTorch: one row per token count, each launch's µs and their ratio.
    assert "| tokens per rank | staged µs | fused µs | fused / staged |" in lines, lines
    assert "| 8 | 600.0 | 450.0 | 0.75 |" in lines, lines
    assert any("Method: graphs of ten forwards." in line for line in lines), lines
    # The PyTorch plot is linked only where it exists, relative to docs/.
    assert not any("torch-qwen35-a3b.png" in line for line in lines), "no PNG was written"

    expect_refused("something-else.json", {"hello": 1}, "not a shape this tool knows",
                   "a file of an unknown shape must be refused, not skipped")
    expect_refused("ep-dsv3-fp8_block.json", [dict(r, ranks_share_one_gpu=True) for r in ep_records()],
                   "ranks sharing a GPU", "figures of ranks sharing a GPU must be refused: they are not NVLink's")


def expect_refused(file_name, data, message, why):
    """load() exits with `message` for a results folder holding only `data` as `file_name`."""
    with tempfile.TemporaryDirectory() as name:
        folder = pathlib.Path(name)
        write(folder, file_name, data)
        try:
            readme_table.load(folder)
        except SystemExit as e:
            assert message in str(e), e
        else:
            raise AssertionError(why)


def check_the_repository():
    """The committed README and docs/performance.md are what the committed JSON gives (the same
    comparison as --check), and the README keeps its block's markers."""
    texts = readme_table.wanted(readme_table.load(), readme_table.README.read_text())
    for path, text in texts.items():
        assert path.exists() and path.read_text() == text, f"{path}: run python3 tools/readme_table.py --write"


def main():
    check_torch_block()
    check_readme_block()
    check_performance_page()
    check_the_repository()
    print("tools/readme_table.py: README block, performance page and PyTorch comparison ok")


if __name__ == "__main__":
    sys.exit(main())
