#!/usr/bin/env bash
# The single-GPU job in one device call (carry .deps): build, every suite, SASS checks
# (gpu_check.sh, within 330 s of its own budget: MEGAMOE_CHECK_BUDGET_S), then the benchmarks
# (gpu_bench.sh; MEGAMOE_BENCH picks the workloads). compute-sanitizer does not fit beside them in
# one call: run `MEGAMOE_CHECK_STEPS=sanitizers bash scripts/gpu/gpu_check.sh` in another.
# Writes at most 8 files to $OUT: build.log, tests.log, sass.txt, sass_by_source.txt, bench.log
# and one JSON per benchmarked workload (three by default).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export MEGAMOE_BENCH=${MEGAMOE_BENCH:-"qwen35-a3b:fp8_block qwen35-a3b:bf16 dsv3:fp8_block"}
MEGAMOE_CHECK_STEPS=${MEGAMOE_CHECK_STEPS:-tests python ep example sass} \
  MEGAMOE_CHECK_BUDGET_S=${MEGAMOE_CHECK_BUDGET_S:-330} bash "$here/gpu_check.sh" | tail -20
check=${PIPESTATUS[0]}
bash "$here/gpu_bench.sh" 2>&1 | grep -v '^\s*\[' | grep -E '^\s+[0-9]+ \||megamoe-bench|HBM|baseline|wrote'
bench=${PIPESTATUS[0]}
echo "gpu_check exit $check, gpu_bench exit $bench"
[ "$check" -eq 0 ] && [ "$bench" -eq 0 ]
