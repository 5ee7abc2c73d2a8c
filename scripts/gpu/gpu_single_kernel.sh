#!/usr/bin/env bash
# Run on the GPU machine (device tool, .deps carried): the single-kernel forward's checks and
# numbers in one call. Builds the layer suite and megamoe-bench; runs the single-kernel tests;
# compute-sanitizer memcheck, racecheck and synccheck over the single kernel; megamoe-bench with
# each launch (--breakdown: the graph cut per node, and the single kernel's role timeline), one
# JSON per workload and launch into $OUT; last (the longest) the layer suite's reference cases,
# each of which also compares the single kernel's output with the five kernels'; a summary at the
# end.
#   MEGAMOE_SK_WORKLOADS  workload:tokens,... items (default qwen35-a3b:1,16,128,512,1024,2048 dsv3:1,16;
#                         empty: no benchmark)
#   MEGAMOE_SK_LAYER_FILTER  the layer suite's cases (default every one)
#   MEGAMOE_SK_SANITIZE=0    skips the sanitizers
# shellcheck source-path=SCRIPTDIR
set -uo pipefail
# shellcheck source=gpu_build.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
export MEGAMOE_REQUIRE_GPU=1
status=0

start=$(date +%s)
build_or_stop "$out/build.log" test_api_moe_layer megamoe-bench
note "build: ok in $(( $(date +%s) - start )) s (spills: $(grep -ci 'bytes spill' "$out/build.log"))"

layer=$build/tests/test_api_moe_layer
run_suite() {  # name filter
  local begin log=$out/$1.log
  begin=$(date +%s)
  "$layer" --gtest_filter="$2" >"$log" 2>&1 || status=1
  note "$1: $(grep -c '^\[       OK \]' "$log") passed, $(grep -c '^\[  FAILED  \]' "$log") failed lines ($(( $(date +%s) - begin )) s)"
  grep -E "Failure|Expected|Which is|evaluates to|MEGAMOE_TEST_SEED" "$log" | head -20
}
run_suite single_kernel 'SingleKernel*'

if [ "${MEGAMOE_SK_SANITIZE:-1}" != 0 ]; then
  sanitize_filter='SingleKernelForward.DeviceTokenCountAndBadIds:Cases/MoeLayerVsReference.MatchesCpuReference/small_fp8_block_T7_softmax:Cases/MoeLayerVsReference.MatchesCpuReference/small_bf16_T128_grouped_fast:Cases/MoeLayerVsReference.MatchesCpuReference/qwen35_a3b_fp8_block_T1'
  for tool in memcheck racecheck synccheck; do
    begin=$(date +%s)
    compute-sanitizer --tool "$tool" --error-exitcode 3 "$layer" --gtest_brief=1 --gtest_filter="$sanitize_filter" \
      >"$out/sanitize-$tool.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || status=1
    note "compute-sanitizer $tool: exit $rc, $(grep -E 'SUMMARY' "$out/sanitize-$tool.log" | tail -1) ($(( $(date +%s) - begin )) s)"
    grep -m3 -E "^========= (Barrier|Invalid|Race|Error)" "$out/sanitize-$tool.log"
  done
fi

for item in ${MEGAMOE_SK_WORKLOADS-qwen35-a3b:1,16,128,512,1024,2048 dsv3:1,16}; do
  workload=${item%%:*}
  tokens=${item##*:}
  for launch in per_stage single_kernel; do
    "$build/megamoe-bench" --workload "$workload" --tokens "$tokens" --launch "$launch" --breakdown \
      --json "$out/$workload-$launch.json" >"$out/bench-$workload-$launch.log" 2>&1 || status=1
    note "megamoe-bench $workload --launch $launch (µs per token count, L2 scrubbed):"
    while read -r line; do note "    $line"; done < <(grep -E '^ +[0-9]+ \|' "$out/bench-$workload-$launch.log" | awk -F'|' '{print $1 "|" $2 "|" $4}')
  done
done
cat "$out"/bench-*.log >"$out/bench.log" 2>/dev/null && rm -f "$out"/bench-*.log
# Last, since it is the longest (the named workloads' weights are generated on the CPU).
run_suite layer_suite "${MEGAMOE_SK_LAYER_FILTER:-Cases/MoeLayerVsReference.*}"
print_summary
exit $status
