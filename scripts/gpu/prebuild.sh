#!/usr/bin/env bash
# Run here, on a machine without a GPU but with nvcc, .deps and the project's .venv (a CUDA build of
# PyTorch: the ops library is built against it): builds every target as gpu_build builds it on the
# GPU machine (in build-gpu, from scratch) and packs what the GPU scripts run there (the
# executables, the ops library, the kernels library the SASS check reads, CTest's files), with the
# hash of the sources they were built from, into .gpu-prebuilt/ (ignored by git). A device call that
# carries ".gpu-prebuilt" (not .deps: nothing is compiled there) takes them instead of building,
# where the sources still hash the same (gpu_build.sh, take_prebuilt_tree): the device minutes a
# build takes there (70-140 s a call, bench/NOTES.md) go to the work instead.
# The paths inside are this checkout's: the GPU machine runs the same path (/work/main).
# shellcheck source-path=SCRIPTDIR
set -uo pipefail
# shellcheck source=gpu_build.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
log=$out/prebuild.log
: >"$log"
if [ -x "$root/.venv/bin/python" ]; then
  export PATH="$root/.venv/bin:$PATH"  # the interpreter CMake builds the ops library against
fi
python=$(command -v python3)
prebuilt=$root/.gpu-prebuilt
rm -rf "$prebuilt" "$build"  # built afresh: nothing from an earlier configuration or pack
start=$(date +%s)
hash=$(source_hash "$root")  # before the build: a source changed during it makes the pack stale
MEGAMOE_TORCH=ON gpu_build "$log" || { echo "prebuild: the build failed ($log)"; exit 1; }
echo "built in $(( $(date +%s) - start )) s" | tee -a "$log"
# GoogleTest's test lists, made here (listing needs no GPU): with them newer than their binaries,
# CTest there does not run the discovery script, whose path is this machine's CMake's.
ctest --test-dir "$build" -N >>"$log" 2>&1 || { echo "prebuild: ctest could not list the tests ($log)"; exit 1; }
# Everything but what only a further build would read: objects, CMake's and ninja's state, the
# fetched sources of the dependencies.
mapfile -t files < <(cd "$build" && find . -type f ! -name '*.o' ! -name '*.o.d' ! -name '.ninja_*' \
  ! -name build.ninja ! -name CMakeCache.txt ! -path '*/CMakeFiles/*' ! -path './_deps/*-src/*' \
  ! -path './_deps/*-subbuild/*' | LC_ALL=C sort)
mkdir -p "$prebuilt"
tar -cJf "$prebuilt/build-gpu.tar.xz" -C "$build" "${files[@]}" || exit 1
echo "$hash" >"$prebuilt/source_hash"
echo "$python" >"$prebuilt/python"
torch_version >"$prebuilt/torch"  # the ops library's: the GPU machine's must be the same
# What the compiler said, for the GPU scripts' summaries (there the build log has no compile).
echo "$(grep -c 'warning' "$log") warnings, spills: $(grep -ci 'spill' "$log")" >"$prebuilt/build_report"
echo "$(du -h "$prebuilt/build-gpu.tar.xz" | cut -f1) in $prebuilt (${#files[@]} files, sources $hash);" \
  "carry \".gpu-prebuilt\" (instead of .deps): the GPU scripts take it while the sources hash the same" |
  tee -a "$log"
