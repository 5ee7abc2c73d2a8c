#!/usr/bin/env bash
# Run on the GPU machine (device tool, .deps carried): builds megamoe-bench (nothing to do after
# scripts/gpu/gpu_check.sh), times the forward for the token buckets of the workloads named in
# MEGAMOE_BENCH (default: qwen35-a3b:fp8_block) and writes one JSON per workload and precision to
# $OUT (copy them to bench/results/). After each, the SM clock while the GPU was busy and how often
# its software power cap was active (gpu_clocks.sh), so that records taken at different clocks
# are not compared as if they were alike.
# shellcheck source-path=SCRIPTDIR
set -uo pipefail
# shellcheck source=gpu_build.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
# shellcheck source=gpu_clocks.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_clocks.sh"
gpu_build "$out/build.log" megamoe-bench || exit 1
status=0
for item in ${MEGAMOE_BENCH:-qwen35-a3b:fp8_block}; do
  workload=${item%%:*}
  precision=${item##*:}
  echo "== megamoe-bench $workload $precision" | tee -a "$out/bench.log"
  clock_sampling_start "$out/clocks-$workload-$precision.csv"
  "$build/megamoe-bench" --workload "$workload" --precision "$precision" \
    --json "$out/$workload-$precision.json" 2>&1 | tee -a "$out/bench.log" || status=1
  clock_sampling_stop
  clock_summary "$out/clocks-$workload-$precision.csv" | tee -a "$out/bench.log"
done
exit $status
