#!/usr/bin/env bash
# The device calls that finish tail-tiles.patch (README.md here). Before them, on the CPU machine,
# with main checked out and no patch applied:
#   MEGAMOE_TORCH=OFF MEGAMOE_AB_TARGETS="megamoe-bench test_api_moe_layer" \
#     bash scripts/gpu/ab_prebuild.sh bench/pending/tail-tiles.patch
# then, through the device tool with carry [".ab-prebuilt"] (one H200 wanted), two calls on the
# same warm machine, each guarded by CALL_BUDGET_S (seconds the call may take):
#   CALL_BUDGET_S=560 bash bench/pending/tail-tiles-call.sh checks   # ~9 min
#   CALL_BUDGET_S=580 bash bench/pending/tail-tiles-call.sh round2   # ~9 min
# A = main, B1 = main + the patch. `checks`: B1's layer suite on the small shape and its named
# tests, then the suites' other test shapes (beside the sanitizers), compute-sanitizer memcheck,
# synccheck and racecheck on tailed and 128-row cases, fp8_tensor's dynamic tailed cases over
# fresh seeds (the tight bound's tail), then round 1 of the layer at --token-tile 160 and 128 (B1)
# and 128 (A), one process each, with fp8_block on A (issue 34's ratio). `round2`: the rest of B1's
# layer suite (the named workloads), then round 1 again with --breakdown, fp8_block on B1 (the
# default tile's operands moved to views), and main's five kernels against its single kernel at 1 / 16 / 128 tokens (issue 30's H200 figures).
set -uo pipefail
part=${1:?checks or round2}
t0=$(date +%s)
budget=${CALL_BUDGET_S:-480}
left() { echo $(( budget - ($(date +%s) - t0) )); }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
v=/tmp/tail-tiles-call
[ -d $v/B1 ] || { mkdir -p $v && tar -xJf .ab-prebuilt/variants.tar.xz -C $v; } || exit 1
binary() { find "$v/$1" -name "$2" -type f | head -1; }
sanitize() {  # tool
  local l; l=$(left); [ "$l" -lt 60 ] && { echo "no time for $1"; return; }
  MEGAMOE_REQUIRE_GPU=1 timeout 100 compute-sanitizer --tool "$1" --error-exitcode 9 "$(binary B1 test_api_moe_layer)" \
    --gtest_brief=1 --gtest_filter='Shapes/*ragged64_bf16_T128_softmax:Cases/MoeLayerTailedTile.*small_fp8_tensor_T600_softmax:Cases/MoeLayerTailedTile.*small_bf16_T1100_grouped:Cases/MoeLayerTokensOnMVsReference.*small_fp8_block_T65_softmax:Cases/MoeLayerVsReference.*small_fp8_tensor_T7_softmax' \
    >"$OUT/sanitizer-$1.log" 2>&1
  echo "$1 rc $?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$OUT/sanitizer-$1.log" | head -3
}
run() {  # variant, tile, name, megamoe-bench arguments; LAUNCH (default per_stage)
  local variant=$1 tile=$2 name=$3; shift 3
  local l; l=$(left); [ "$l" -lt 35 ] && { echo "no time for $variant $tile $name"; return; }
  echo "== $variant tile $tile $name ($l s left)"
  timeout "$l" "$(binary "$variant" megamoe-bench)" "$@" --launch "${LAUNCH:-per_stage}" --token-tile "$tile" \
    --json "$OUT/$variant-$tile-$name.json" >"$OUT/$variant-$tile-$name.log" 2>&1
  echo "rc $?"; grep -E '^ +[0-9]+ +\|' "$OUT/$variant-$tile-$name.log" | head -3
}
round() {  # round number, megamoe-bench's extra arguments
  local round=$1; shift
  run B1 160 dsv3-fp8_tensor-"$round" --workload dsv3 --precision fp8_tensor --tokens 8192 "$@"
  run B1 128 dsv3-fp8_tensor-"$round" --workload dsv3 --precision fp8_tensor --tokens 8192 "$@"
  run A 128 dsv3-fp8_tensor-"$round" --workload dsv3 --precision fp8_tensor --tokens 8192 "$@"
  for variant_tile in "B1 160" "B1 128" "A 128"; do
    # shellcheck disable=SC2086
    run $variant_tile qwen3-30b-a3b-fp8_tensor-"$round" --workload qwen3-30b-a3b --precision fp8_tensor --tokens 2048,8192 "$@"
  done
  # issue 34's ratio: fp8_block in the same call
  run A 128 dsv3-fp8_block-"$round" --workload dsv3 --precision fp8_block --tokens 8192 "$@"
  run A 128 qwen3-30b-a3b-fp8_block-"$round" --workload qwen3-30b-a3b --precision fp8_block --tokens 2048,8192 "$@"
}
if [ "$part" = checks ]; then
  echo "== B1 layer suite: the small shape's cases (tailed, tokens-on-M, swapAB, single kernel), the named tests"
  MEGAMOE_REQUIRE_GPU=1 timeout 220 "$(binary B1 test_api_moe_layer)" \
    --gtest_filter='Cases/MoeLayerTailedTile.*:Cases/*.*small_*:MoeLayer.*' >"$OUT/tests-B1.log" 2>&1
  echo "rc $?, $(grep -c '^\[       OK \]' "$OUT/tests-B1.log") passed, $(( $(date +%s) - t0 )) s"
  grep -E -A6 'Failure' "$OUT/tests-B1.log" | head -40; grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests-B1.log" | sort | uniq -c
  # The other test shapes (part-filled channel tiles, few experts, top_k 1 and 2) beside the
  # sanitizers and the seeds (they check bits, not time), finished before the benchmarks.
  MEGAMOE_REQUIRE_GPU=1 timeout 400 "$(binary B1 test_api_moe_layer)" --gtest_filter='Shapes/*' \
    >"$OUT/tests-B1-shapes.log" 2>&1 &
  shapes=$!
  sanitize memcheck
  sanitize synccheck
  sanitize racecheck
  # fp8_tensor's dynamic tailed cases over fresh run seeds: how often the tight bound fails
  # (its output is the 128-row tile's bit for bit, which the same test checks).
  echo "== dynamic fp8_tensor seeds"
  seeds=0 failed=0
  while [ "$(left)" -gt 300 ] && [ $seeds -lt 40 ]; do
    seeds=$((seeds + 1))
    MEGAMOE_TEST_SEED=$((1000 + seeds)) MEGAMOE_REQUIRE_GPU=1 timeout 60 "$(binary B1 test_api_moe_layer)" \
      --gtest_filter='Cases/MoeLayerTailedTile.*dynamic' --gtest_output=xml:/tmp/seed.xml >"$OUT/seed.log" 2>&1 || {
      failed=$((failed + 1)); grep -E 'actual|Which is|MEGAMOE_TEST_SEED' "$OUT/seed.log" | head -4 >>"$OUT/seeds-failed.log"; }
    grep -oE 'max_normalized_vs_reference="[0-9.e-]+"|name="max_normalized_vs_reference" value="[0-9.e-]+"|rel_l2_vs_reference="[0-9.e-]+"|name="rel_l2_vs_reference" value="[0-9.e-]+"' \
      /tmp/seed.xml | grep -oE '[0-9][0-9.e-]*"$' | tr -d '"' | paste -sd' ' | sed "s/^/seed $((1000 + seeds)): /" >>"$OUT/seeds.log"
  done
  echo "seeds $seeds, runs failed $failed (rel_l2 and max_normalized per case in seeds.log)"
  head -20 "$OUT/seeds-failed.log" 2>/dev/null
  sort -k4 -g "$OUT/seeds.log" 2>/dev/null | tail -3
  wait $shapes
  echo "== B1 test shapes: $(grep -c '^\[       OK \]' "$OUT/tests-B1-shapes.log") passed"
  grep -E -A6 'Failure' "$OUT/tests-B1-shapes.log" | head -30; grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests-B1-shapes.log" | sort | uniq -c
  round 1
else
  # The rest of B1's layer suite (the named workloads through every tile), two shards side by side
  # (most of its time is the CPU reference), beside nothing else: run first, then the benches.
  echo "== B1 layer suite, the named workloads"
  for shard in 0 1; do
    GTEST_SHARD_INDEX=$shard GTEST_TOTAL_SHARDS=2 MEGAMOE_REQUIRE_GPU=1 timeout 300 "$(binary B1 test_api_moe_layer)" \
      --gtest_filter='-Cases/MoeLayerTailedTile.*:Cases/*.*small_*:Shapes/*:MoeLayer.*' >"$OUT/tests-B1-named-$shard.log" 2>&1 &
  done
  wait
  cat "$OUT"/tests-B1-named-*.log >"$OUT/tests-B1-named.log" && rm "$OUT"/tests-B1-named-*.log
  echo "$(grep -c '^\[       OK \]' "$OUT/tests-B1-named.log") passed, $(( $(date +%s) - t0 )) s"
  grep -E -A6 'Failure' "$OUT/tests-B1-named.log" | head -40; grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests-B1-named.log" | sort | uniq -c
  round 2 --breakdown
  run B1 128 dsv3-fp8_block --workload dsv3 --precision fp8_block --tokens 8192
  # The small buckets on B1 (its swapAB code changed: tile_subtiles, the shared fragment helper)
  # beside main's, then issue 30's H200 figures: main's five kernels against its single kernel.
  run B1 auto qwen35-a3b-fp8_block-per_stage --workload qwen35-a3b --precision fp8_block --tokens 1,16,128 --breakdown
  for launch in per_stage single_kernel; do
    LAUNCH=$launch run A auto qwen35-a3b-fp8_block-$launch --workload qwen35-a3b --precision fp8_block --tokens 1,16,128 --breakdown
  done
fi
echo "total $(( $(date +%s) - t0 )) s"
# Eight files at most come back from $OUT: the JSON records travel in one archive, the logs packed.
mkdir -p "$OUT/json" && mv "$OUT"/*.json "$OUT/json/" 2>/dev/null; tar czf "$OUT/records.tar.gz" -C "$OUT" json && rm -r "$OUT/json"
bash scripts/gpu/pack_out.sh records.tar.gz
