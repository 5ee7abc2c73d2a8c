#!/usr/bin/env bash
# scripts/gpu/gpu_build.sh with a prebuilt tree (scripts/gpu/prebuild.sh's .gpu-prebuilt): taken
# instead of a build where the sources hash as when it was packed (Python's caches aside), with
# CTest's interpreter made this machine's python3, unpacked once per pack; built as usual
# (configured afresh, the unpacked folder gone) where the sources changed, a binary the scripts run
# is missing, a library does not load (the ops library's PyTorch libraries are looked up in this
# machine's PyTorch), or the pack was built against another PyTorch.
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
# A stand-in PyTorch for python3 (whether or not this machine has one): its version, its folder, and
# a library in it that the packed ops library links without a run path to it (as the real one's
# names the building machine's PyTorch), so that it loads here only through that folder.
mkdir -p "$dir/site/torch/lib" && echo '__version__ = "0.1-stand-in"' >"$dir/site/torch/__init__.py"
export PYTHONPATH=$dir/site${PYTHONPATH:+:$PYTHONPATH}
c++ -shared -fPIC -o "$dir/site/torch/lib/libstandin.so" -x c++ - <<<'int standin() { return 1; }' ||
  fail "building the stand-in library"
c++ -shared -fPIC -o "$dir/ops.so" -x c++ - -L"$dir/site/torch/lib" -lstandin <<<'int standin(); int ops() { return standin(); }' ||
  fail "building the stand-in ops library"

# A pack as prebuild.sh leaves it: the binaries the scripts run (ones that load anywhere), CTest's
# file naming the interpreter of the machine that built it (a path whose dots are no pattern), the
# PyTorch version of this machine's python3.
pack() {
  local staging=$dir/staging binary
  rm -rf "$staging" "$root/.gpu-prebuilt" && mkdir -p "$staging/tests" "$staging/python/megamoe" "$root/.gpu-prebuilt"
  cp "$dir/ops.so" "$staging/python/megamoe/_megamoe_ops.so"
  for binary in megamoe-bench megamoe-run tests/comm_ep_layer_rank tests/test_api_moe_layer; do
    [ "${1:-}" = without_suite ] && [ "$binary" = tests/test_api_moe_layer ] && continue
    cp "$(type -P true)" "$staging/$binary"
  done
  echo 'add_test(python.gpu "/elsewhere/.venv/bin/python3.11" "-m" "pytest")' >"$staging/tests/CTestTestfile.cmake"
  echo 'add_test(other "/elsewhere/.venv/bin/python3x11")' >>"$staging/tests/CTestTestfile.cmake"
  tar -cJf "$root/.gpu-prebuilt/build-gpu.tar.xz" -C "$staging" . || fail "tar"
  source_hash "$root" >"$root/.gpu-prebuilt/source_hash"
  echo /elsewhere/.venv/bin/python3.11 >"$root/.gpu-prebuilt/python"
  torch_version >"$root/.gpu-prebuilt/torch"
}

pack
gpu_build "$log" megamoe-bench || fail "gpu_build with a prebuilt tree of these sources"
[ ! -e "$dir/cmake_calls" ] || fail "built although the prebuilt tree fits: $(cat "$dir/cmake_calls")"
[ -x "$build/tests/test_api_moe_layer" ] || fail "not unpacked"
grep -q "\"$(command -v python3)\" \"-m\"" "$build/tests/CTestTestfile.cmake" &&
  grep -q "python3x11" "$build/tests/CTestTestfile.cmake" ||
  fail "CTest's interpreter: $(cat "$build/tests/CTestTestfile.cmake")"
grep -q "build: prebuilt" "$log" || fail "no note of the prebuilt tree: $(cat "$log")"
# Unpacked once per hash: a second call keeps what is there.
echo marker >"$build/kept"
gpu_build "$log" || fail "a second gpu_build"
[ -f "$build/kept" ] || fail "unpacked again for the same sources"

# Python's caches do not travel: they change nothing.
mkdir -p "$root/tests/__pycache__" && echo cache >"$root/tests/__pycache__/x.pyc"
gpu_build "$log" || fail "gpu_build beside Python's caches"
[ -f "$build/kept" ] || fail "a Python cache made the pack stale"
# The sources changed: built as usual, in a folder without the unpacked tree.
echo 'int y;' >"$root/src/a.cpp"
gpu_build "$log" || fail "gpu_build after a change"
grep -q "built from other sources than these (stale)" "$log" || fail "no note of the changed sources: $(cat "$log")"
[ "$(grep -c '^cmake -S' "$dir/cmake_calls")" = 1 ] || fail "not configured: $(cat "$dir/cmake_calls")"
[ ! -e "$build/kept" ] && [ ! -e "$build/.prebuilt_pack" ] || fail "the unpacked tree stayed in the build folder"

# A pack without a binary the scripts run: built as usual.
rm -rf "$build" "$dir/cmake_calls"
pack without_suite
gpu_build "$log" || fail "gpu_build with an incomplete pack"
grep -q "tests/test_api_moe_layer is missing" "$log" || fail "no note of the missing binary: $(cat "$log")"
[ -s "$dir/cmake_calls" ] || fail "not built after an incomplete pack"
[ ! -e "$build/.prebuilt_pack" ] || fail "the incomplete pack stayed in the build folder"

# A pack whose ops library needs what this machine's PyTorch lacks: refused, built as usual.
rm -rf "$build" "$dir/cmake_calls"
pack
mv "$dir/site/torch/lib/libstandin.so" "$dir/standin.so.away"
gpu_build "$log" || fail "gpu_build with a pack that does not load"
grep -q "python/megamoe/_megamoe_ops.so does not load here" "$log" && [ -s "$dir/cmake_calls" ] ||
  fail "taken although the ops library does not load: $(cat "$log")"
mv "$dir/standin.so.away" "$dir/site/torch/lib/libstandin.so"

# A pack built against another PyTorch: built as usual.
rm -rf "$build" "$dir/cmake_calls"
pack
echo 0.0.0 >"$root/.gpu-prebuilt/torch"
gpu_build "$log" || fail "gpu_build with a pack of another PyTorch"
grep -q "built against PyTorch 0.0.0" "$log" && [ -s "$dir/cmake_calls" ] || fail "taken with another PyTorch"
echo "gpu_build takes a prebuilt tree of the same sources and builds otherwise"
