#!/usr/bin/env bash
# Run on the GPU machine (device tool, .deps carried): the PyTorch face end to end. Builds the ops
# library, runs the Python GPU suite, both examples (examples/fused_moe.py; examples/hf_qwen3_moe.py
# in bf16 and fp8_block) and `python -m megamoe.bench` for the workloads in MEGAMOE_TORCH_BENCH
# (default qwen35-a3b; "all" for the three), writing its JSON and plots to $OUT (copy them to
# bench/results/, then `python3 tools/readme_table.py --write` puts them in the README). Prints a
# short summary last.
# shellcheck source-path=SCRIPTDIR
set -uo pipefail
# shellcheck source=gpu_build.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
export MEGAMOE_REQUIRE_GPU=1
status=0

build_or_stop "$out/build.log" megamoe_torch_ops
note "build: ok"
export PYTHONPATH=$root/python MEGAMOE_OPS_LIBRARY=$build/python/megamoe/_megamoe_ops.so

start=$(date +%s)
python -m pytest -p no:cacheprovider -rA -m gpu "$root/tests/python" >"$out/pytest.log" 2>&1 || status=1
note "pytest (gpu): $(grep -E ' in [0-9.]+s' "$out/pytest.log" | tail -1 | tr -d '=') ($(( $(date +%s) - start )) s)"
grep -E "^(FAILED|ERROR) |^E  " "$out/pytest.log" | head -20

run_example() {
  local log=$out/$1.log
  shift
  if python "$@" >"$log" 2>&1; then
    note "$(basename "$1") ${*:2}: ok; $(tail -1 "$log")"
  else
    status=1
    note "$(basename "$1") ${*:2}: FAILED ($(tail -1 "$log"))"
  fi
}
run_example fused_moe "$root/examples/fused_moe.py"
run_example hf_bf16 "$root/examples/hf_qwen3_moe.py" --precision bf16
run_example hf_fp8 "$root/examples/hf_qwen3_moe.py" --precision fp8_block

start=$(date +%s)
if python -m megamoe.bench --workload "${MEGAMOE_TORCH_BENCH:-qwen35-a3b}" --out "$out" >"$out/bench.log" 2>&1; then
  note "megamoe.bench: ok ($(( $(date +%s) - start )) s)"
else
  status=1
  note "megamoe.bench: FAILED ($(tail -1 "$out/bench.log"))"
fi
grep -vE "it/s\]|s/it\]" "$out/bench.log" | tail -30

echo
print_summary
exit $status
