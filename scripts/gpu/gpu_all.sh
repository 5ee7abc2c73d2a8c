#!/usr/bin/env bash
# The whole single-GPU job in one device call (carry .deps): build, every suite, compute-sanitizer,
# SASS checks (gpu_check.sh), then the benchmarks (gpu_bench.sh; MEGAMOE_BENCH picks the
# workloads). Writes at most 8 files to $OUT: build.log, tests.log, sanitize.log, sass.txt,
# bench.log and one JSON per benchmarked workload (three by default).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export MEGAMOE_BENCH=${MEGAMOE_BENCH:-"qwen35-a3b:fp8_block qwen35-a3b:bf16 dsv3:fp8_block"}
bash "$here/gpu_check.sh" | tail -20
check=${PIPESTATUS[0]}
bash "$here/gpu_bench.sh" 2>&1 | grep -v '^\s*\[' | grep -E '^\s+[0-9]+ \||megamoe-bench|HBM|baseline|wrote'
bench=${PIPESTATUS[0]}
echo "gpu_check exit $check, gpu_bench exit $bench"
[ "$check" -eq 0 ] && [ "$bench" -eq 0 ]
