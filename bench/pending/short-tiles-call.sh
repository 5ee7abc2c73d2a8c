#!/usr/bin/env bash
# One device call for the two padding patches here (README.md): A = main, B1 =
# short-tiles-on-swapab.patch, B2 = short-and-mixed-tiles.patch. Before it, on the CPU machine,
# with main checked out and no patch applied:
#   MEGAMOE_TORCH=OFF MEGAMOE_AB_TARGETS="megamoe-bench test_api_moe_layer" \
#     bash scripts/gpu/ab_prebuild.sh bench/pending/short-tiles-on-swapab.patch bench/pending/short-and-mixed-tiles.patch
# then, through the device tool with carry [".ab-prebuilt"] (one H200; ~7-9 min with every case):
#   CALL_BUDGET_S=<seconds the call may take> bash bench/pending/short-tiles-call.sh
# Each patch variant's tokens-on-M layer tests (short tiles everywhere at small per-expert rows,
# mixed tiles at 300 small tokens and 96 skewed ones, CTA pairs, the single kernel against the five
# kernels), compute-sanitizer on B2's mixed and short tiles, then the layer at 2048 and 8192 tokens,
# one process per variant and case, the variants in turn, most telling cases first.
set -uo pipefail
t0=$(date +%s)
budget=${CALL_BUDGET_S:-540}
left() { echo $(( budget - ($(date +%s) - t0) )); }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
v=/tmp/short-tiles-call; rm -rf $v; mkdir -p $v && tar -xJf .ab-prebuilt/variants.tar.xz -C $v || exit 1
binary() { find "$v/$1" -name "$2" -type f | head -1; }
tests='Cases/MoeLayerTokensOnMVsReference.*small_*:Cases/MoeLayerWeightMulticast.*small_*:Cases/MoeLayerSingleKernelTokensOnM.*small_*:Cases/MoeLayerTokensOnMVsReference.*qwen3_30b_a3b_fp8_block_T2048:Cases/MoeLayerTokensOnMVsReference.*qwen35_a3b_fp8_tensor_T2048'
for variant in B1 B2; do
  echo "== $variant layer tests"
  MEGAMOE_REQUIRE_GPU=1 timeout 120 "$(binary $variant test_api_moe_layer)" --gtest_filter="$tests" >"$OUT/tests-$variant.log" 2>&1
  echo "rc $?, $(grep -c '^\[       OK \]' "$OUT/tests-$variant.log") passed"
  grep -E -A8 'Failure' "$OUT/tests-$variant.log" | head -30; grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests-$variant.log" | sort | uniq -c
done
sanitize() {  # tool, gtest filter
  local l; l=$(left); [ "$l" -lt 40 ] && { echo "no time for $1"; return; }
  MEGAMOE_REQUIRE_GPU=1 timeout 60 compute-sanitizer --tool "$1" --error-exitcode 9 "$(binary B2 test_api_moe_layer)" \
    --gtest_brief=1 --gtest_filter="$2" >"$OUT/sanitizer-$1.log" 2>&1
  echo "$1 rc $?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$1.log" | head -2
}
sanitized='Cases/MoeLayerTokensOnMVsReference.*small_fp8_block_T300_softmax:Cases/MoeLayerTokensOnMVsReference.*small_bf16_T96_softmax_skewed'
sanitize racecheck "$sanitized"
run() {  # name, then megamoe-bench arguments; every variant in turn
  local name=$1; shift
  for variant in A B1 B2; do
    local l; l=$(left); [ "$l" -lt 35 ] && { echo "no time for $variant $name"; return; }
    echo "== $variant $name ($l s left)"
    timeout "$l" "$(binary $variant megamoe-bench)" "$@" --launch per_stage --json "$OUT/$variant-$name.json" \
      >"$OUT/$variant-$name.log" 2>&1
    echo "rc $?"; grep -E '^ +[0-9]+ +\|' "$OUT/$variant-$name.log" | head -4
  done
}
run qwen35-a3b-fp8_block --workload qwen35-a3b --precision fp8_block --tokens 2048
run dsv3-fp8_block --workload dsv3 --precision fp8_block --tokens 2048,8192
run qwen3-30b-a3b-fp8_block --workload qwen3-30b-a3b --precision fp8_block --tokens 2048,8192
sanitize memcheck "$sanitized"
sanitize synccheck "$sanitized"
run qwen35-a3b-fp8_tensor --workload qwen35-a3b --precision fp8_tensor --tokens 2048,8192
run dsv3-fp8_tensor --workload dsv3 --precision fp8_tensor --tokens 8192
run qwen3-30b-a3b-fp8_tensor --workload qwen3-30b-a3b --precision fp8_tensor --tokens 8192
echo "total $(( $(date +%s) - t0 )) s"
# Eight files at most come back from $OUT: the JSON records travel in one archive, the logs packed.
mkdir -p "$OUT/json" && mv "$OUT"/*.json "$OUT/json/" 2>/dev/null; tar czf "$OUT/records.tar.gz" -C "$OUT" json && rm -r "$OUT/json"
bash scripts/gpu/pack_out.sh records.tar.gz
