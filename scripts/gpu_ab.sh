#!/usr/bin/env bash
# Run on the GPU machine (device tool, .deps carried) to compare a change against the tree as sent,
# in one session on one GPU: A is this tree, B is a copy of it with the patch $1 applied
# (`git diff main > change.patch` on a checkout of main; the patch travels as an untracked file).
# Builds both, then times both with megamoe-bench --breakdown at each of MEGAMOE_AB_TOKENS
# (default "1 16 128 2048") for MEGAMOE_AB_WORKLOAD (default qwen35-a3b), alternating A and B so
# that drift in the GPU's state affects both. Writes ab.log to $OUT; prints per-node times last.
set -uo pipefail
patch_file=$(realpath "${1:?usage: gpu_ab.sh CHANGE.patch}")
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
log=$out/ab.log
workload=${MEGAMOE_AB_WORKLOAD:-qwen35-a3b}
precision=${MEGAMOE_AB_PRECISION:-fp8_block}

b_root=$(mktemp -d)/b
cp -r "$root" "$b_root" && rm -rf "$b_root/build-gpu"
(cd "$b_root" && patch -p1 --quiet <"$patch_file") || { echo "patch does not apply" | tee -a "$log"; exit 1; }

gpu_build "$log" || { echo "A: build failed" | tee -a "$log"; exit 1; }
a_bench=$build/megamoe-bench
root=$b_root build=$b_root/build-gpu gpu_build "$log" || { echo "B: build failed" | tee -a "$log"; exit 1; }
b_bench=$b_root/build-gpu/megamoe-bench

status=0
for tokens in ${MEGAMOE_AB_TOKENS:-1 16 128 2048}; do
  for side in A B; do
    exe=$a_bench
    [ "$side" = B ] && exe=$b_bench
    echo "== $side: $workload $precision, $tokens tokens, L2 scrubbed" | tee -a "$log"
    "$exe" --workload "$workload" --precision "$precision" --tokens "$tokens" --breakdown >"$log.part" 2>&1 || status=1
    grep -E '^\s+[0-9]+ [a-z_0-9]+ +\+|^\s+[0-9]+ \||error|Error' "$log.part" | tee -a "$log"
    rm -f "$log.part"
  done
done
exit $status
