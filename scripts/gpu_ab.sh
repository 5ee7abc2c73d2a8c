#!/usr/bin/env bash
# Run on the GPU machine (device tool, .deps carried) to compare changes against the tree as sent,
# in one session on one GPU (variants: scripts/gpu_variants.sh). Builds megamoe-bench of every
# variant (or takes it prebuilt: scripts/ab_prebuild.sh), then times each with megamoe-bench
# --breakdown for each WORKLOAD:TOKENS of MEGAMOE_AB_CASES (default "qwen35-a3b:1 qwen35-a3b:16
# qwen35-a3b:128 qwen35-a3b:2048"), the variants in turn for each case, so that drift in the GPU's
# state affects all alike. Writes ab.log to $OUT, prints per-node times, and ends with a summary
# table of one line per case and variant. With MEGAMOE_AB_TESTS set (a gtest filter of the layer
# suite), every variant also runs those GPU tests, so that a wrong variant shows before a full
# gpu_check.sh is spent on it.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: gpu_ab.sh CHANGE.patch [CHANGE.patch ...]"; exit 2; }
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
log=$out/ab.log
precision=${MEGAMOE_AB_PRECISION:-fp8_block}

source "$(dirname "${BASH_SOURCE[0]}")/gpu_variants.sh"
targets=megamoe-bench
[ -n "${MEGAMOE_AB_TESTS:-}" ] && targets+=" test_api_moe_layer"
build_variants "$targets" "$@"
benches=()
for v in "${!names[@]}"; do benches+=("${roots[$v]}/build-gpu/megamoe-bench"); done

status=0
for case in ${MEGAMOE_AB_CASES:-qwen35-a3b:1 qwen35-a3b:16 qwen35-a3b:128 qwen35-a3b:2048}; do
  workload=${case%%:*} tokens=${case##*:}
  for v in "${!names[@]}"; do
    echo "== ${names[$v]}: $workload $precision, $tokens tokens, L2 scrubbed" | tee -a "$log"
    "${benches[$v]}" --workload "$workload" --precision "$precision" --tokens "$tokens" --breakdown >"$log.part" 2>&1 ||
      status=1
    grep -E '^\s+[0-9]+ [a-z_0-9]+ +\+|^\s+[0-9]+ \||empty kernel|error|Error' "$log.part" | tee -a "$log"
    rm -f "$log.part"
  done
done
if [ -n "${MEGAMOE_AB_TESTS:-}" ]; then
  for v in "${!names[@]}"; do
    echo "== ${names[$v]}: layer tests $MEGAMOE_AB_TESTS" | tee -a "$log"
    MEGAMOE_REQUIRE_GPU=1 "${roots[$v]}/build-gpu/tests/test_api_moe_layer" --gtest_brief=1 \
      --gtest_filter="$MEGAMOE_AB_TESTS" >"$log.part" 2>&1 || status=1
    grep -E '^\[  (PASSED|FAILED) |Failure|error' "$log.part" | head -20 | tee -a "$log"
    rm -f "$log.part"
  done
fi
# Last, the table a reader wants: one line per case and variant, each node's increment as
# --breakdown cuts the graph (single-GPU forward: router, gather, FC1, FC2, combine), then the
# whole layer and its ratio to the floor.
summary=$(awk '
  /^== [A-Za-z0-9]+: .* tokens, / { variant = $2; sub(":", "", variant); workload = $3; tokens = $5; nodes = ""; next }
  /^ +[0-9] [a-z_0-9]+ +\+/ { nodes = nodes sprintf(" %8s", $4); next }
  /^ +[0-9]+ \|/ { printf "%-14s %6s %-3s |%s | %8s | %5s\n", workload, tokens, variant, nodes, $3, $7 }' "$log")
{
  echo "== summary (us): workload, tokens, variant | node increments | layer | x floor"
  echo "$summary"
} | tee -a "$log"
exit $status
