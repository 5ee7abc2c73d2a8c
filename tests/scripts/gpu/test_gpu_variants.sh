#!/usr/bin/env bash
# scripts/gpu/gpu_variants.sh: a flags: variant is A's tree and binaries run with extra bench
# arguments, and is never built; a patch variant is a patched copy (without A's build folders or
# .venv), built in its own folder, and a reused scratch folder gets a fresh copy; a flags: argument
# that is not options is refused.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
script=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
root=$dir/tree log=$dir/ab.log
mkdir -p "$root/src" "$root/.venv" "$root/build-gpu" && echo 'int x;' >"$root/src/a.cpp"
printf -- '--- a/src/a.cpp\n+++ b/src/a.cpp\n@@ -1 +1 @@\n-int x;\n+int y;\n' >"$dir/change.patch"
# shellcheck source=../../../scripts/gpu/gpu_variants.sh
source "$script"
gpu_build() { echo "$root" >>"$dir/built"; }  # stands in for the build; records each tree built
MEGAMOE_AB_SCRATCH=$dir/scratch build_variants "megamoe-bench" \
  flags:--token-tile=32,--fc1-token-rows=row_copy "$dir/change.patch" "flags:--token-tile 64"
fail() { echo "$1"; exit 1; }
[ "${names[*]}" = "A B1 B2 B3" ] || fail "names: ${names[*]}"
[ "${roots[1]}" = "$root" ] && [ "${roots[3]}" = "$root" ] || fail "a flags: variant is not A's tree"
[ "${roots[2]}" = "$dir/scratch/B2" ] && grep -q 'int y' "$dir/scratch/B2/src/a.cpp" || fail "the patch variant"
[ ! -e "$dir/scratch/B2/.venv" ] && [ ! -e "$dir/scratch/B2/build-gpu" ] || fail "the patch variant copied .venv or build-gpu"
[ "${flags[0]}" = "" ] && [ "${flags[2]}" = "" ] || fail "only flags: variants carry arguments"
[ "${flags[1]}" = "--token-tile=32 --fc1-token-rows=row_copy" ] && [ "${flags[3]}" = "--token-tile 64" ] ||
  fail "flags: ${flags[1]} / ${flags[3]}"
[ "$(sort "$dir/built" | tr '\n' ' ')" = "$dir/scratch/B2 $root " ] || fail "built: $(tr '\n' ' ' <"$dir/built")"
# shellcheck disable=SC2086  # as the A/B scripts append them
[ "$(printf '<%s>' ${flags[3]})" = "<--token-tile><64>" ] || fail "flags ${flags[3]} split as $(printf '<%s>' ${flags[3]})"
# A second call with the same scratch folder (two A/Bs in one device call) patches a fresh copy
# and keeps the variant's build folder; a patch that adds a file is what a stale copy cannot take
# twice.
printf -- '--- /dev/null\n+++ b/src/b.cpp\n@@ -0,0 +1 @@\n+int z;\n' >"$dir/new_file.patch"
MEGAMOE_AB_SCRATCH=$dir/scratch3 build_variants "megamoe-bench" "$dir/new_file.patch" || fail "a first patch variant"
mkdir -p "$dir/scratch3/B1/build-gpu" && echo kept >"$dir/scratch3/B1/build-gpu/object"
(MEGAMOE_AB_SCRATCH=$dir/scratch3 build_variants "megamoe-bench" "$dir/new_file.patch") || fail "a reused scratch folder"
grep -q 'int z' "$dir/scratch3/B1/src/b.cpp" && grep -q kept "$dir/scratch3/B1/build-gpu/object" || fail "reuse"
# A different patch in the same folder: a file only the first one changed is back as in A, and newer
# than anything built before, so the build cannot keep that patch's object of it.
(MEGAMOE_AB_SCRATCH=$dir/scratch4 build_variants "megamoe-bench" "$dir/change.patch") || fail "a patch of a.cpp"
mkdir -p "$dir/scratch4/B1/build-gpu" && sleep 1 && touch "$dir/scratch4/B1/build-gpu/a.o" && sleep 1
(MEGAMOE_AB_SCRATCH=$dir/scratch4 build_variants "megamoe-bench" "$dir/new_file.patch") || fail "a second patch"
grep -q 'int x' "$dir/scratch4/B1/src/a.cpp" && grep -q 'int z' "$dir/scratch4/B1/src/b.cpp" || fail "the second copy"
[ "$dir/scratch4/B1/src/a.cpp" -nt "$dir/scratch4/B1/build-gpu/a.o" ] || fail "a.cpp as in A is older than the first patch's a.o"
for bad in flags: flags:32 'flags:--routing=*'; do
  if (MEGAMOE_AB_SCRATCH=$dir/scratch2 build_variants "megamoe-bench" "$bad") >/dev/null 2>&1; then
    fail "$bad was taken"
  fi
done
grep -q "B1: 'flags:32' is not flags:--OPTION" "$log" || fail "no message for flags:32: $(cat "$log")"
echo "gpu_variants.sh: flags: variants run A's binaries with their arguments; patch variants are built"
