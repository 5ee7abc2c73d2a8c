#!/usr/bin/env bash
# Run on the GPU machine after scripts/gpu_check.sh built build-gpu: times the forward for the
# token buckets of the workloads named in MEGAMOE_BENCH (default: qwen35-a3b:fp8_block) and writes
# one JSON per workload and precision to $OUT (copy them to bench/results/).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${OUT:-$root/gpu-logs}
mkdir -p "$out"
status=0
for item in ${MEGAMOE_BENCH:-qwen35-a3b:fp8_block}; do
  workload=${item%%:*}
  precision=${item##*:}
  echo "== megamoe-bench $workload $precision"
  "$root/build-gpu/megamoe-bench" --workload "$workload" --precision "$precision" \
    --json "$out/$workload-$precision.json" 2>&1 | tee -a "$out/bench.log" || status=1
done
exit $status
