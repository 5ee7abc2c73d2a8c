#!/usr/bin/env bash
# scripts/gpu_variants.sh: an env: variant is A's tree and binaries run under its variables, and is
# never built; a patch variant is a patched copy, built in its own folder.
set -euo pipefail
script=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
root=$dir/tree log=$dir/ab.log
mkdir -p "$root/src" && echo 'int x;' >"$root/src/a.cpp"
printf -- '--- a/src/a.cpp\n+++ b/src/a.cpp\n@@ -1 +1 @@\n-int x;\n+int y;\n' >"$dir/change.patch"
source "$script"
gpu_build() { echo "$root" >>"$dir/built"; }  # stands in for the build; records each tree built
MEGAMOE_AB_SCRATCH=$dir/scratch build_variants "megamoe-bench" \
  env:MEGAMOE_TOKEN_TILE=32,MEGAMOE_FC1_ROW_COPY=1 "$dir/change.patch" env:MEGAMOE_TOKEN_TILE=64
fail() { echo "$1"; exit 1; }
[ "${names[*]}" = "A B1 B2 B3" ] || fail "names: ${names[*]}"
[ "${roots[1]}" = "$root" ] && [ "${roots[3]}" = "$root" ] || fail "an env: variant is not A's tree"
[ "${roots[2]}" = "$dir/scratch/B2" ] && grep -q 'int y' "$dir/scratch/B2/src/a.cpp" || fail "the patch variant"
[ "${envs[0]}" = "" ] && [ "${envs[2]}" = "" ] || fail "only env: variants carry variables"
[ "${envs[1]}" = "MEGAMOE_TOKEN_TILE=32 MEGAMOE_FC1_ROW_COPY=1" ] && [ "${envs[3]}" = "MEGAMOE_TOKEN_TILE=64" ] ||
  fail "envs: ${envs[1]} / ${envs[3]}"
[ "$(sort "$dir/built" | tr '\n' ' ')" = "$dir/scratch/B2 $root " ] || fail "built: $(tr '\n' ' ' <"$dir/built")"
[ "$(env ${envs[1]} sh -c 'echo $MEGAMOE_TOKEN_TILE,$MEGAMOE_FC1_ROW_COPY')" = "32,1" ] || fail "env ${envs[1]}"
echo "gpu_variants.sh: env: variants run A's binaries under their variables; patch variants are built"
