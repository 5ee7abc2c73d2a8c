#!/usr/bin/env bash
# The expert-parallel A/B: run on a machine with two NVLink-connected GPUs (device kind
# nvidia-h200-x2, .deps carried), with the variants of scripts/gpu/gpu_variants.sh (a flags:
# variant's arguments go to megamoe-ep-bench). Every patch variant runs the two-GPU tests (CTest
# label gpu2) first, then every variant megamoe-ep-bench on dsv3 at MEGAMOE_AB_TOKENS
# tokens per rank (default 128,4096), the variants in turn for MEGAMOE_AB_ROUNDS rounds (default
# 2) so that drift affects all alike, each run writing its JSON (ep.VARIANT.rROUND.json) next to
# ab2.log in $OUT. MEGAMOE_AB_EP_ARGS adds arguments to every bench run (e.g. --timeline).
# shellcheck source-path=SCRIPTDIR
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: gpu2_ab.sh CHANGE.patch|flags:--OPTION[=VALUE][,...] ..."; exit 2; }
# shellcheck source=gpu_build.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
log=$out/ab2.log
# shellcheck source=gpu_variants.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_variants.sh"
build_variants "megamoe-run megamoe-ep-bench comm_ep_layer_rank" "$@"

status=0
for v in "${!names[@]}"; do
  [ -n "${flags[$v]}" ] && continue  # A's binaries: A's tests
  echo "== ${names[$v]}: two-GPU tests" | tee -a "$log"
  ctest --test-dir "${roots[$v]}/build-gpu" -L gpu2 --output-on-failure >"$log.part" 2>&1 || status=1
  grep -E 'Passed|Failed|tests passed|megamoe:|Failure' "$log.part" | head -20 | tee -a "$log"
  rm -f "$log.part"
done
for round in $(seq 1 "${MEGAMOE_AB_ROUNDS:-2}"); do
  for v in "${!names[@]}"; do
    echo "== ${names[$v]}: megamoe-ep-bench dsv3, round $round" | tee -a "$log"
    build=${roots[$v]}/build-gpu
    # shellcheck disable=SC2086  # word lists: the extra arguments, the variant's flags
    "$build/megamoe-run" -n 2 --timeout 300 -- "$build/megamoe-ep-bench" --workload dsv3 \
      --tokens "${MEGAMOE_AB_TOKENS:-128,4096}" --json "$out/ep.${names[$v]}.r$round.json" ${MEGAMOE_AB_EP_ARGS:-} \
      ${flags[$v]} >"$log.part" 2>&1 || status=1
    grep -E '^\[rank 0\] ' "$log.part" | tee -a "$log"
    rm -f "$log.part"
  done
done
exit $status
