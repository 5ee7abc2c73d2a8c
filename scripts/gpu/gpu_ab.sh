#!/usr/bin/env bash
# Run on the GPU machine (device tool, .deps carried) to compare changes against the tree as sent,
# in one session on one GPU (variants: patches or flags:ARGS, scripts/gpu/gpu_variants.sh). Builds
# megamoe-bench of every variant (or takes it prebuilt: scripts/gpu/ab_prebuild.sh), then times each
# (a flags: variant with its extra arguments) with megamoe-bench
# --breakdown for each WORKLOAD:TOKENS of MEGAMOE_AB_CASES (default "qwen35-a3b:1 qwen35-a3b:16
# qwen35-a3b:128 qwen35-a3b:2048"), the variants in turn for each case, so that drift in the GPU's
# state affects all alike. MEGAMOE_AB_ROUNDS=R (default 1) repeats each case's turn R times, each
# run a process of its own: a large batch's layer time moves by a few percent between processes
# (30 us at 8192 tokens: docs/decisions.md#benchmark-method), more than many changes are worth. Writes ab.log
# to $OUT, prints per-node times, and ends with a summary table of one line per case and variant:
# the round with the median layer time, and the range over the rounds. With MEGAMOE_AB_TESTS set
# (a gtest filter of the layer suite), every patch variant also runs those GPU tests, so that a
# wrong variant shows before a full gpu_check.sh is spent on it (a flags: variant runs A's tests,
# whose options are its own). MEGAMOE_AB_ARGS (e.g. "--launch single_kernel") goes to every
# variant's bench command, before a flags: variant's options (which win where both set one).
# shellcheck source-path=SCRIPTDIR
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: gpu_ab.sh CHANGE.patch|flags:--OPTION[=VALUE][,...] ..."; exit 2; }
# shellcheck source=gpu_build.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
log=$out/ab.log
: >"$log"  # this run's alone: the summary below reads the whole file (a second run in one call mixed in the first's)
precision=${MEGAMOE_AB_PRECISION:-fp8_block}

# shellcheck source=gpu_variants.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_variants.sh"
# shellcheck source=gpu_clocks.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_clocks.sh"
target_list=megamoe-bench
[ -n "${MEGAMOE_AB_TESTS:-}" ] && target_list+=" test_api_moe_layer"
build_variants "$target_list" "$@"
benches=()
for v in "${!names[@]}"; do benches+=("${roots[$v]}/build-gpu/megamoe-bench"); done

status=0
rounds=${MEGAMOE_AB_ROUNDS:-1}
for case in ${MEGAMOE_AB_CASES:-qwen35-a3b:1 qwen35-a3b:16 qwen35-a3b:128 qwen35-a3b:2048}; do
  workload=${case%%:*} tokens=${case##*:}
  for ((round = 1; round <= rounds; ++round)); do
    for v in "${!names[@]}"; do
      echo "== ${names[$v]}: $workload $precision, $tokens tokens, L2 scrubbed, round $round of $rounds" | tee -a "$log"
      clock_sampling_start "$log.clocks"
      # shellcheck disable=SC2086  # a flags: variant's arguments and MEGAMOE_AB_ARGS, one word each
      # A flags: variant's own options come last, so that they win over MEGAMOE_AB_ARGS.
      "${benches[$v]}" --workload "$workload" --precision "$precision" --tokens "$tokens" --breakdown \
        ${MEGAMOE_AB_ARGS:-} ${flags[$v]} >"$log.part" 2>&1 || status=1
      clock_sampling_stop
      # Node increments, the table line, and the single kernel's role timeline (first / last).
      grep -E '^\s+[0-9]+ [a-z_0-9]+ +\+|^\s+[0-9]+ \||empty kernel| first .* last |error|Error' "$log.part" | tee -a "$log"
      clock_summary "$log.clocks" | tee -a "$log"
      rm -f "$log.part" "$log.clocks"
    done
  done
done
if [ -n "${MEGAMOE_AB_TESTS:-}" ]; then
  for v in "${!names[@]}"; do
    [ -n "${flags[$v]}" ] && continue  # A's binary: A's tests
    echo "== ${names[$v]}: layer tests $MEGAMOE_AB_TESTS" | tee -a "$log"
    MEGAMOE_REQUIRE_GPU=1 "${roots[$v]}/build-gpu/tests/test_api_moe_layer" --gtest_brief=1 \
      --gtest_filter="$MEGAMOE_AB_TESTS" >"$log.part" 2>&1 || status=1
    grep -E '^\[  (PASSED|FAILED) |Failure|error' "$log.part" | head -20 | tee -a "$log"
    rm -f "$log.part"
  done
fi
# Last, the table a reader wants: one line per case and variant, each node's increment as
# --breakdown cuts the graph (single-GPU forward: router, gather, FC1, FC2, combine), the whole
# layer and its ratio to the floor, of the round whose layer time is the median; with several
# rounds, their range.
summary=$(awk '
  /^== [A-Za-z0-9]+: .* tokens, / { variant = $2; sub(":", "", variant); workload = $3; tokens = $5; nodes = ""; next }
  /^ +[0-9] [a-z_0-9]+ +\+/ { nodes = nodes sprintf(" %8s", $4); next }
  /^ +[0-9]+ \|/ {
    key = workload SUBSEP tokens SUBSEP variant
    if (!(key in runs)) order[++keys] = key
    r = ++runs[key]
    layer[key, r] = $3; ratio[key, r] = $7; node[key, r] = nodes
  }
  END {
    for (i = 1; i <= keys; ++i) {
      key = order[i]; n = runs[key]
      for (a = 1; a <= n; ++a) rank[a] = a
      for (a = 1; a <= n; ++a)
        for (b = a + 1; b <= n; ++b)
          if (layer[key, rank[b]] + 0 < layer[key, rank[a]] + 0) { t = rank[a]; rank[a] = rank[b]; rank[b] = t }
      m = rank[int((n + 1) / 2)]
      split(key, k, SUBSEP)
      range = n > 1 ? sprintf(" | %s-%s", layer[key, rank[1]], layer[key, rank[n]]) : ""
      printf "%-14s %6s %-3s |%s | %8s | %5s%s\n", k[1], k[2], k[3], node[key, m], layer[key, m], ratio[key, m], range
    }
  }' "$log")
{
  echo "== summary (us): workload, tokens, variant | node increments | layer | x floor$([ "$rounds" -gt 1 ] && echo " | layer range over $rounds rounds")"
  echo "$summary"
} | tee -a "$log"
exit $status
