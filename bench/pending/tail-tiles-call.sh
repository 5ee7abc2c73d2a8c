#!/usr/bin/env bash
# The device call that finishes tail-tiles.patch (README.md here). Before it, on the CPU machine,
# with main checked out and no patch applied:
#   MEGAMOE_TORCH=OFF MEGAMOE_AB_TARGETS="megamoe-bench test_api_moe_layer" \
#     bash scripts/gpu/ab_prebuild.sh bench/pending/tail-tiles.patch
# then, through the device tool with carry [".ab-prebuilt"] (one H200 wanted; ~9 min: give it a whole call, its steps stop at CALL_BUDGET_S):
#   CALL_BUDGET_S=<seconds the call may take> bash bench/pending/tail-tiles-call.sh
# A = main, B1 = main + the patch. B1's tests (the tailed tile bit for bit against the 128-row
# tile, the 128-row tile's own cases after the subtile views, fp8_block's named 8192 case among
# them, the single kernel's small cases), compute-sanitizer memcheck, synccheck and racecheck on
# tailed and 128-row cases, then two rounds of the layer at --token-tile 160 and 128 (B1) and 128
# (A), one process each (the second with --breakdown), fp8_block on A in both rounds (issue 34's
# ratio) and on B1 (the default tile's operands moved to views), and main's five kernels against
# its single kernel at 1 / 16 / 128 tokens (issue 30's H200 figures).
set -uo pipefail
t0=$(date +%s)
budget=${CALL_BUDGET_S:-480}
left() { echo $(( budget - ($(date +%s) - t0) )); }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
v=/tmp/tail-tiles-call; rm -rf $v; mkdir -p $v && tar -xJf .ab-prebuilt/variants.tar.xz -C $v || exit 1
binary() { find "$v/$1" -name "$2" -type f | head -1; }
tests='Cases/MoeLayerTailedTile.*:Cases/MoeLayerTokensOnMVsReference.*small_*:Cases/MoeLayerTokensOnMVsReference.*qwen3_30b_a3b_fp8_block_T8192:Cases/MoeLayerSingleKernelTokensOnM.*small_*'
echo "== B1 layer tests"
MEGAMOE_REQUIRE_GPU=1 timeout 240 "$(binary B1 test_api_moe_layer)" --gtest_filter="$tests" >"$OUT/tests-B1.log" 2>&1
echo "rc $?, $(grep -c '^\[       OK \]' "$OUT/tests-B1.log") passed"
grep -E -A6 'Failure' "$OUT/tests-B1.log" | head -30; grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests-B1.log" | sort | uniq -c
sanitize() {  # tool
  local l; l=$(left); [ "$l" -lt 40 ] && { echo "no time for $1"; return; }
  MEGAMOE_REQUIRE_GPU=1 timeout 90 compute-sanitizer --tool "$1" --error-exitcode 9 "$(binary B1 test_api_moe_layer)" \
    --gtest_brief=1 --gtest_filter='Cases/MoeLayerTailedTile.*small_fp8_tensor_T600_softmax:Cases/MoeLayerTailedTile.*small_bf16_T1100_grouped:Cases/MoeLayerTokensOnMVsReference.*small_fp8_block_T65_softmax' \
    >"$OUT/sanitizer-$1.log" 2>&1
  echo "$1 rc $?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$1.log" | head -2
}
sanitize memcheck
sanitize synccheck
sanitize racecheck
run() {  # variant, tile, name, megamoe-bench arguments; LAUNCH (default per_stage)
  local variant=$1 tile=$2 name=$3; shift 3
  local l; l=$(left); [ "$l" -lt 35 ] && { echo "no time for $variant $tile $name"; return; }
  echo "== $variant tile $tile $name ($l s left)"
  timeout "$l" "$(binary "$variant" megamoe-bench)" "$@" --launch "${LAUNCH:-per_stage}" --token-tile "$tile" \
    --json "$OUT/$variant-$tile-$name.json" >"$OUT/$variant-$tile-$name.log" 2>&1
  echo "rc $?"; grep -E '^ +[0-9]+ +\|' "$OUT/$variant-$tile-$name.log" | head -3
}
for round in 1 2; do
  extra=(); [ $round = 2 ] && extra=(--breakdown)  # round 2: where the time goes, per kernel
  run B1 160 dsv3-fp8_tensor-$round --workload dsv3 --precision fp8_tensor --tokens 8192 "${extra[@]}"
  run B1 128 dsv3-fp8_tensor-$round --workload dsv3 --precision fp8_tensor --tokens 8192 "${extra[@]}"
  run A 128 dsv3-fp8_tensor-$round --workload dsv3 --precision fp8_tensor --tokens 8192 "${extra[@]}"
  for variant_tile in "B1 160" "B1 128" "A 128"; do
    # shellcheck disable=SC2086
    run $variant_tile qwen3-30b-a3b-fp8_tensor-$round --workload qwen3-30b-a3b --precision fp8_tensor --tokens 2048,8192 "${extra[@]}"
  done
  # issue 34's ratio: fp8_block in the same call (B1 at 128 shows the subtile views cost it nothing)
  run A 128 dsv3-fp8_block-$round --workload dsv3 --precision fp8_block --tokens 8192 "${extra[@]}"
  run A 128 qwen3-30b-a3b-fp8_block-$round --workload qwen3-30b-a3b --precision fp8_block --tokens 2048,8192 "${extra[@]}"
done
run B1 128 dsv3-fp8_block --workload dsv3 --precision fp8_block --tokens 8192
# issue 30's H200 figures: main's five kernels against its single kernel at small batches
for launch in per_stage single_kernel; do
  LAUNCH=$launch run A auto qwen35-a3b-fp8_block-$launch --workload qwen35-a3b --precision fp8_block --tokens 1,16,128
done
echo "total $(( $(date +%s) - t0 )) s"
# Eight files at most come back from $OUT: the JSON records travel in one archive, the logs packed.
mkdir -p "$OUT/json" && mv "$OUT"/*.json "$OUT/json/" 2>/dev/null; tar czf "$OUT/records.tar.gz" -C "$OUT" json && rm -r "$OUT/json"
bash scripts/gpu/pack_out.sh records.tar.gz
