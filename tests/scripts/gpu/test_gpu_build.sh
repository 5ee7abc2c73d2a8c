#!/usr/bin/env bash
# scripts/gpu/gpu_build.sh with a prebuilt tree (scripts/gpu/prebuild.sh's .gpu-prebuilt): taken
# instead of a build where the sources hash as when it was packed, with CTest's interpreter made
# this machine's python3, unpacked once per hash; built as usual (configured afresh, the unpacked
# folder gone) where the sources changed or a binary is missing.
# shellcheck source-path=SCRIPTDIR
set -uo pipefail
script=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAILED: $1"; exit 1; }
OUT=$dir/out
# shellcheck source=../../../scripts/gpu/gpu_build.sh
source "$script"
root=$dir/tree build=$dir/tree/build-gpu log=$dir/build.log
mkdir -p "$root/src" "$root/.deps/cutlass/include/cute" && echo 'int x;' >"$root/src/a.cpp"
touch "$root/.deps/cutlass/include/cute/tensor.hpp"
cmake() { echo "cmake $*" >>"$dir/cmake_calls"; }  # stands in for the build

# A pack as prebuild.sh leaves it: two binaries that load anywhere, CTest's file naming the
# interpreter of the machine that built it.
pack() {
  local staging=$dir/staging
  rm -rf "$staging" "$root/.gpu-prebuilt" && mkdir -p "$staging/tests" "$root/.gpu-prebuilt"
  cp "$(type -P true)" "$staging/megamoe-bench"
  [ "${1:-}" = without_suite ] || cp "$(type -P true)" "$staging/tests/test_api_moe_layer"
  echo 'add_test(python.gpu "/elsewhere/.venv/bin/python" "-m" "pytest")' >"$staging/tests/CTestTestfile.cmake"
  tar -cJf "$root/.gpu-prebuilt/build-gpu.tar.xz" -C "$staging" . || fail "tar"
  source_hash "$root" >"$root/.gpu-prebuilt/source_hash"
  echo /elsewhere/.venv/bin/python >"$root/.gpu-prebuilt/python"
}

pack
gpu_build "$log" megamoe-bench || fail "gpu_build with a prebuilt tree of these sources"
[ ! -e "$dir/cmake_calls" ] || fail "built although the prebuilt tree fits: $(cat "$dir/cmake_calls")"
[ -x "$build/tests/test_api_moe_layer" ] || fail "not unpacked"
grep -q "\"$(command -v python3)\" \"-m\"" "$build/tests/CTestTestfile.cmake" ||
  fail "CTest's interpreter: $(cat "$build/tests/CTestTestfile.cmake")"
grep -q "build: prebuilt" "$log" || fail "no note of the prebuilt tree: $(cat "$log")"
# Unpacked once per hash: a second call keeps what is there.
echo marker >"$build/kept"
gpu_build "$log" || fail "a second gpu_build"
[ -f "$build/kept" ] || fail "unpacked again for the same sources"

# The sources changed: built as usual, in a folder without the unpacked tree.
echo 'int y;' >"$root/src/a.cpp"
gpu_build "$log" || fail "gpu_build after a change"
grep -q "built from other sources" "$log" || fail "no note of the changed sources: $(cat "$log")"
[ "$(grep -c '^cmake -S' "$dir/cmake_calls")" = 1 ] || fail "not configured: $(cat "$dir/cmake_calls")"
[ ! -e "$build/kept" ] && [ ! -e "$build/.prebuilt_source_hash" ] || fail "the unpacked tree stayed in the build folder"

# A pack without a binary the scripts run: built as usual.
rm -rf "$build" "$dir/cmake_calls"
pack without_suite
gpu_build "$log" || fail "gpu_build with an incomplete pack"
grep -q "test_api_moe_layer missing or does not load" "$log" || fail "no note of the missing binary: $(cat "$log")"
[ -s "$dir/cmake_calls" ] || fail "not built after an incomplete pack"
echo "gpu_build takes a prebuilt tree of the same sources and builds otherwise"
