#!/usr/bin/env bash
# One device call for the patches here (README.md): each variant's layer tests and compute-sanitizer
# on a decode-sized case, then the A/B of all of them in both launches, two rounds. Before it, on
# the CPU machine, with main checked out and no patch applied (A is the tree as sent):
#   MEGAMOE_TORCH=OFF MEGAMOE_AB_TARGETS="megamoe-bench test_api_moe_layer" \
#     bash scripts/gpu/ab_prebuild.sh bench/pending/P1.patch [bench/pending/P2.patch ...]
# then, through the device tool with carry [".ab-prebuilt"], the same patches in the same order:
#   bash bench/pending/verify.sh bench/pending/P1.patch [bench/pending/P2.patch ...]
# (~3 min of tests a variant and ~5 min of A/B for two variants on one H100: give it the whole call.)
# Per variant (B1, B2, ..., or A where set), what the defaults below do not fit:
#   MEGAMOE_VERIFY_TESTS_B<i>      its layer tests' gtest filter
#   MEGAMOE_VERIFY_REPEAT_B<i>     --gtest_repeat for them (fresh seeds each repeat)
#   MEGAMOE_VERIFY_SANITIZED_B<i>  the case compute-sanitizer runs ("none": no sanitizer runs)
#   MEGAMOE_VERIFY_TESTS_A ...     the same for main's own binary (runs only where set)
# MEGAMOE_VERIFY_TEST_TIMEOUT_S (default 240): the seconds each variant's layer tests may take.
# MEGAMOE_VERIFY_LAUNCHES (default "per_stage single_kernel"; "" for no A/B), MEGAMOE_AB_CASES, and
# MEGAMOE_VERIFY_BUDGET_S (default 570): the seconds after which no A/B starts or runs on.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: verify.sh PATCH ..."; exit 2; }
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
v=/tmp/pending-verify; rm -rf $v; mkdir -p $v && tar -xJf .ab-prebuilt/variants.tar.xz -C $v || exit 1
default_tests='SingleKernelForward.*:Cases/MoeLayerVsReference.*small_fp8_block*:Cases/MoeLayerVsReference.*small_bf16_T7*:Cases/MoeLayerVsReference.*qwen35_a3b_fp8_block_T1:MoeLayer.TokenRowCopyMatchesThePoolBitForBit:MoeLayerDeterminism.*'
variants=()
[ -n "${MEGAMOE_VERIFY_TESTS_A:-}" ] && variants+=(A)
for ((i = 1; i <= $#; ++i)); do variants+=("B$i"); done
for name in "${variants[@]}"; do
  T=$(find "$v/$name" -name test_api_moe_layer -type f | head -1)
  [ -n "$T" ] || { echo "no $name test binary in .ab-prebuilt"; exit 1; }
  tests_var=MEGAMOE_VERIFY_TESTS_$name repeat_var=MEGAMOE_VERIFY_REPEAT_$name sanitized_var=MEGAMOE_VERIFY_SANITIZED_$name
  tests=${!tests_var:-$default_tests} repeat=${!repeat_var:-1}
  sanitized=${!sanitized_var:-Cases/MoeLayerVsReference.*small_fp8_block_T7_softmax}
  echo "== $name layer tests ($tests, $repeat time(s))"
  MEGAMOE_REQUIRE_GPU=1 timeout "${MEGAMOE_VERIFY_TEST_TIMEOUT_S:-240}" "$T" --gtest_filter="$tests" --gtest_repeat="$repeat" >"$OUT/tests-$name.log" 2>&1
  echo "rc $?, $(grep -c '^\[       OK \]' "$OUT/tests-$name.log") passed"
  grep -E -A8 'Failure' "$OUT/tests-$name.log" | head -40; grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests-$name.log" | sort | uniq -c
  [ "$sanitized" = none ] && continue
  for tool in memcheck racecheck synccheck; do
    MEGAMOE_REQUIRE_GPU=1 timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 "$T" --gtest_brief=1 \
      --gtest_filter="$sanitized" >"$OUT/sanitizer-$name-$tool.log" 2>&1
    echo "$tool rc $?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$name-$tool.log" | head -2
  done
  echo "$name checked at $(( $(date +%s) - t0 )) s"
done
export MEGAMOE_AB_PREBUILT=.ab-prebuilt MEGAMOE_AB_ROUNDS=2 \
  MEGAMOE_AB_CASES="${MEGAMOE_AB_CASES:-qwen35-a3b:1 qwen35-a3b:2 qwen35-a3b:16 qwen3-30b-a3b:1 dsv3:1}"
for launch in ${MEGAMOE_VERIFY_LAUNCHES-per_stage single_kernel}; do
  left=$(( ${MEGAMOE_VERIFY_BUDGET_S:-570} - ($(date +%s) - t0) )); [ "$left" -lt 30 ] && { echo "no time for $launch"; continue; }
  echo "== A/B --launch $launch ($left s left)"
  MEGAMOE_AB_ARGS="--launch $launch" timeout "$left" bash scripts/gpu/gpu_ab.sh "$@" 2>&1 | grep -A24 '== summary'
  mv "$OUT/ab.log" "$OUT/ab-$launch.log"
done
echo "total $(( $(date +%s) - t0 )) s"
# Eight files at most come back from $OUT: the logs travel packed (a failing test's seed was lost once).
bash scripts/gpu/pack_out.sh
