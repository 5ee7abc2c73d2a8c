#!/usr/bin/env bash
# One device call for bench/pending/fc2-weights-after-fc1.patch (README here). Before it, on the
# CPU machine, with main checked out and the patch NOT applied (A is the tree as sent):
#   MEGAMOE_TORCH=OFF MEGAMOE_AB_TARGETS="megamoe-bench test_api_moe_layer" \
#     bash scripts/gpu/ab_prebuild.sh bench/pending/fc2-weights-after-fc1.patch
# then run this through the device tool with carry [".ab-prebuilt"] (~8 min on one H100): B1's
# layer tests, compute-sanitizer on a decode-sized case, then the A/B in both launches, two rounds.
set -uo pipefail
t0=$(date +%s)
patch_file=bench/pending/fc2-weights-after-fc1.patch
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
v=/tmp/pending-verify; rm -rf $v; mkdir -p $v && tar -xJf .ab-prebuilt/variants.tar.xz -C $v || exit 1
T=$(find $v/B1 -name test_api_moe_layer -type f | head -1)
[ -n "$T" ] || { echo "no B1 test binary in .ab-prebuilt"; exit 1; }
echo "== B1 layer tests"
MEGAMOE_REQUIRE_GPU=1 timeout 240 "$T" \
  --gtest_filter='SingleKernelForward.*:Cases/MoeLayerVsReference.*small_fp8_block*:Cases/MoeLayerVsReference.*small_bf16_T7*:Cases/MoeLayerVsReference.*qwen35_a3b_fp8_block_T1:MoeLayerDeterminism.*' \
  >"$OUT/tests-B1.log" 2>&1
echo "rc $?, $(grep -c '^\[       OK \]' "$OUT/tests-B1.log") passed"
grep -E '^\[  (PASSED|FAILED) |FAILED  \]|Failure|rror' "$OUT/tests-B1.log" | head -12
for tool in memcheck racecheck synccheck; do
  MEGAMOE_REQUIRE_GPU=1 timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 "$T" --gtest_brief=1 \
    --gtest_filter='Cases/MoeLayerVsReference.*small_fp8_block_T7_softmax' >"$OUT/sanitizer-$tool.log" 2>&1
  echo "$tool rc $?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | head -2
done
echo "tests and sanitizers done at $(( $(date +%s) - t0 )) s"
export MEGAMOE_AB_PREBUILT=.ab-prebuilt MEGAMOE_AB_ROUNDS=2 \
  MEGAMOE_AB_CASES="qwen35-a3b:1 qwen35-a3b:2 qwen35-a3b:16 qwen3-30b-a3b:1 dsv3:1"
for launch in per_stage single_kernel; do
  left=$(( 570 - ($(date +%s) - t0) )); [ "$left" -lt 30 ] && { echo "no time for $launch"; continue; }
  echo "== A/B --launch $launch ($left s left)"
  MEGAMOE_AB_ARGS="--launch $launch" timeout "$left" bash scripts/gpu/gpu_ab.sh "$patch_file" 2>&1 | grep -A16 '== summary'
  cp "$OUT/ab.log" "$OUT/ab-$launch.log"
done
echo "total $(( $(date +%s) - t0 )) s"
