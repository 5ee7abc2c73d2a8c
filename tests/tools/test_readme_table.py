#!/usr/bin/env python3
"""tools/readme_table.py's PyTorch comparison, on records shaped as python -m megamoe.bench writes
them: the cells are the records' figures, a failed run says why, and --check's comparison sees a
changed figure. Plain asserts; exits non-zero on the first failure."""
import importlib.util
import json
import pathlib
import sys
import tempfile

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "readme_table.py"
spec = importlib.util.spec_from_file_location("readme_table", TOOL)
readme_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme_table)


def record(tokens, implementation, median_us, floor_us, error=None):
    return dict(workload="qwen35-a3b", tokens=tokens, implementation=implementation, floor_us=floor_us,
                gpu="NVIDIA H200", median_us=median_us, rel_err=None if error else 1e-3, error=error)


def result():
    records = []
    for tokens, floor in ((1, 5.5), (16, 72.0), (2048, 190.25)):
        records += [record(tokens, "megamoe fp8_block", floor * 1.5, floor),
                    record(tokens, "torch bf16", floor * 4, floor)]
    records[-1] = record(2048, "torch bf16", None, 190.25, error="out of memory")
    return dict(workload="qwen35-a3b", gpu="NVIDIA H200", torch="2.11.0", hbm_read_bytes_per_s=4.5e12,
                dense_fp8_flops_per_s=1.43e15, records=records)


def main():
    with tempfile.TemporaryDirectory() as folder:
        (pathlib.Path(folder) / "torch-qwen35-a3b.json").write_text(json.dumps(result()))
        results = readme_table.load_torch(pathlib.Path(folder))
    assert list(results) == ["qwen35-a3b"], results.keys()

    lines = readme_table.torch_block(results)
    assert lines[0] == "![qwen35-a3b: µs per forward against tokens, log-log](bench/results/torch-qwen35-a3b.png)"
    assert "| qwen35-a3b: µs (× floor) | 1 | 16 | 2048 |" in lines
    assert "| megamoe fp8_block | 8.2 (1.50) | 108.0 (1.50) | 285.4 (1.50) |" in lines, lines
    assert "| torch bf16 | 22.0 (4.00) | 288.0 (4.00) | failed |" in lines, lines
    assert "| floor | 5.5 | 72.0 | 190.2 |" in lines, lines
    assert "Failed: torch bf16 at 2048 tokens: out of memory." in lines, lines
    assert any("4.50 TB/s" in line and "1430 TFLOP/s" in line for line in lines), lines

    readme = "\n".join(["intro", readme_table.TORCH_BEGIN, "stale", readme_table.TORCH_END, "after"])
    written = readme_table.rewrite_torch_block(readme, results)
    assert "stale" not in written and written.endswith(readme_table.TORCH_END + "\nafter")
    assert readme_table.rewrite_torch_block(written, results) == written, "a second --write changes nothing"
    changed = written.replace("22.0 (4.00)", "21.0 (4.00)")
    assert readme_table.rewrite_torch_block(changed, results) != changed, "--check must see a changed figure"
    empty = readme_table.rewrite_torch_block(readme, {})
    assert "Not measured on a GPU yet" in empty
    print("tools/readme_table.py: PyTorch comparison ok")


if __name__ == "__main__":
    sys.exit(main())
