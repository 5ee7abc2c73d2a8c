#!/usr/bin/env bash
# Run on the GPU machine (device tool, .deps carried) to compare changes against the tree as sent,
# in one session on one GPU: variant A is this tree, variant B1, B2, ... a copy of it with the
# patch given as the 1st, 2nd, ... argument applied (`git diff main > change.patch` on a checkout
# of main; patches travel as untracked files). Builds every variant, then times each with
# megamoe-bench --breakdown at each of MEGAMOE_AB_TOKENS (default "1 16 128 2048") for
# MEGAMOE_AB_WORKLOAD (default qwen35-a3b), the variants in turn at each token count, so that drift
# in the GPU's state affects all alike. Writes ab.log to $OUT and prints per-node times.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: gpu_ab.sh CHANGE.patch [CHANGE.patch ...]"; exit 2; }
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
log=$out/ab.log
workload=${MEGAMOE_AB_WORKLOAD:-qwen35-a3b}
precision=${MEGAMOE_AB_PRECISION:-fp8_block}

gpu_build "$log" || { echo "A: build failed" | tee -a "$log"; exit 1; }
names=(A)
benches=("$build/megamoe-bench")
scratch=$(mktemp -d)
for i in $(seq 1 $#); do
  patch_file=$(realpath "${!i}")
  variant=$scratch/B$i
  cp -r "$root" "$variant" && rm -rf "$variant/build-gpu"
  (cd "$variant" && patch -p1 --quiet <"$patch_file") || { echo "B$i: $patch_file does not apply" | tee -a "$log"; exit 1; }
  root=$variant build=$variant/build-gpu gpu_build "$log" || { echo "B$i: build failed" | tee -a "$log"; exit 1; }
  echo "B$i = A + $(basename "$patch_file")" | tee -a "$log"
  names+=("B$i")
  benches+=("$variant/build-gpu/megamoe-bench")
done

status=0
for tokens in ${MEGAMOE_AB_TOKENS:-1 16 128 2048}; do
  for v in "${!names[@]}"; do
    echo "== ${names[$v]}: $workload $precision, $tokens tokens, L2 scrubbed" | tee -a "$log"
    "${benches[$v]}" --workload "$workload" --precision "$precision" --tokens "$tokens" --breakdown >"$log.part" 2>&1 ||
      status=1
    grep -E '^\s+[0-9]+ [a-z_0-9]+ +\+|^\s+[0-9]+ \||error|Error' "$log.part" | tee -a "$log"
    rm -f "$log.part"
  done
done
exit $status
