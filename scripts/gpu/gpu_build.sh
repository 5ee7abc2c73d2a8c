# shellcheck shell=bash
# Sourced by the GPU-machine scripts (scripts/gpu/*.sh): sets root, out and build, and
# gpu_build LOG [TARGET ...] configures and builds every target there (or only the TARGETs) from the
# carried .deps (those machines have no network; MEGAMOE_TORCH=OFF leaves the PyTorch package out, for
# scripts/gpu/ab_prebuild.sh on a machine without PyTorch), appending to LOG; it returns non-zero (after
# printing the errors) on failure. note MESSAGE prints a line and keeps it for the summary that
# print_summary prints; build_or_stop LOG [TARGET ...] builds and, on failure, notes it, prints the
# summary and exits.
# With .gpu-prebuilt carried (scripts/gpu/prebuild.sh filled it on a machine without a GPU), gpu_build
# takes the whole build folder from there instead of building, where it was built from these
# sources and its binaries load here: take_prebuilt_tree.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${OUT:-$root/gpu-logs}
build=$root/build-gpu
mkdir -p "$out"
export PATH="$PATH:/usr/local/cuda/bin"

# What the binaries are built from: every file of the source folders (and of the ops library's), by
# path and content; Python's caches aside, which do not travel to the GPU machine.
source_hash() {
  (cd "$1" && find CMakeLists.txt cmake include src tools tests examples python/CMakeLists.txt python/csrc \
    -name __pycache__ -prune -o -type f ! -name '*.pyc' -print 2>/dev/null | LC_ALL=C sort | xargs sha1sum |
    sha1sum | cut -c1-40)
}

# The PyTorch version of the python3 on PATH ("none" without one).
torch_version() {
  python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none
}

# Where the prebuilt tree's binaries look for what they load on this machine: CUDA's runtime (their
# run path names the building machine's folder), NVSHMEM's host library (opened by name when the
# path recorded at build time is not here), from the python3 that holds PyTorch, and PyTorch's own
# libraries (the ops library's run path names the building machine's .venv), after the caller's.
prebuilt_library_path() {
  local nvshmem torch_lib
  nvshmem=$(python3 -c 'import os, nvidia.nvshmem as n; print(os.path.join(list(n.__path__)[0], "lib"))' \
    2>/dev/null)
  # python3's PyTorch is the one `import torch` loads before the ops library: last, so that it
  # shadows nothing the caller put first.
  torch_lib=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)
  export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/cuda/lib${nvshmem:+:$nvshmem}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}${torch_lib:+:$torch_lib}"
}

# Says in LOG why the prebuilt tree is not taken, removes what was unpacked of it, returns 1.
refuse_prebuilt_tree() {
  echo "prebuilt tree: $2; building here (carry .deps, or rerun scripts/gpu/prebuild.sh where it was made)" |
    tee -a "$1"
  [ -f "$build/.prebuilt_pack" ] && rm -rf "$build"
  return 1
}

# Unpacks $root/.gpu-prebuilt/build-gpu.tar.xz into the build folder (once per pack) and returns 0
# where it holds binaries of these sources, built against this machine's PyTorch, that all load
# here; otherwise says why in LOG and returns 1. CTest's files name the interpreter the ops library
# was built against on the building machine: they get this machine's python3 instead.
take_prebuilt_tree() {
  local log=$1 prebuilt_tree=$root/.gpu-prebuilt pack hash
  [ -f "$prebuilt_tree/build-gpu.tar.xz" ] || return 1
  hash=$(source_hash "$root")
  if [ "$hash" != "$(cat "$prebuilt_tree/source_hash" 2>/dev/null)" ]; then
    refuse_prebuilt_tree "$log" "built from other sources than these (stale)"
    return 1
  fi
  if [ "$(torch_version)" != "$(cat "$prebuilt_tree/torch" 2>/dev/null)" ]; then
    refuse_prebuilt_tree "$log" "built against PyTorch $(cat "$prebuilt_tree/torch" 2>/dev/null), here $(torch_version)"
    return 1
  fi
  pack=$(sha1sum "$prebuilt_tree/build-gpu.tar.xz" | cut -c1-40)
  if [ "$(cat "$build/.prebuilt_pack" 2>/dev/null)" != "$pack" ]; then
    rm -rf "$build" && mkdir -p "$build"
    if ! tar -xJf "$prebuilt_tree/build-gpu.tar.xz" -C "$build"; then
      rm -rf "$build"
      refuse_prebuilt_tree "$log" "does not unpack"
      return 1
    fi
    echo "$pack" >"$build/.prebuilt_pack"
    local recorded here
    recorded=$(cat "$prebuilt_tree/python" 2>/dev/null) here=$(command -v python3)
    if [ -n "$recorded" ] && [ -n "$here" ] && [ "$recorded" != "$here" ]; then
      # As literal text (the recorded path's dots are no pattern).
      find "$build" -name CTestTestfile.cmake -exec python3 -c '
import sys
recorded, here = sys.argv[1:3]
for name in sys.argv[3:]:
    with open(name) as f:
        text = f.read()
    with open(name, "w") as f:
        f.write(text.replace(recorded, here))
' "$recorded" "$here" {} +
    fi
  fi
  prebuilt_library_path
  local binary
  while IFS= read -r binary; do
    if ldd "$binary" 2>/dev/null | grep -q "not found"; then
      refuse_prebuilt_tree "$log" "${binary#"$build"/} does not load here"
      return 1
    fi
  done < <(find "$build" -type f \( -perm -u+x -o -name '*.so' \) ! -name '*.cmake')
  for binary in megamoe-bench tests/test_api_moe_layer tests/comm_ep_layer_rank megamoe-run; do
    [ -x "$build/$binary" ] || { refuse_prebuilt_tree "$log" "$binary is missing"; return 1; }
  done
  echo "build: prebuilt ($(cat "$prebuilt_tree/build_report" 2>/dev/null), sources $hash)" | tee -a "$log"
}

gpu_build() {
  local log=$1
  shift
  take_prebuilt_tree "$log" && return 0
  local targets=()
  [ $# -gt 0 ] && targets=(--target "$@")
  if [ ! -f "$root/.deps/cutlass/include/cute/tensor.hpp" ]; then
    echo "missing .deps/cutlass: run scripts/deps.sh here and carry .deps" | tee -a "$log"
    return 1
  fi
  if cmake -S "$root" -B "$build" -G Ninja -DMEGAMOE_REQUIRE_CUDA=ON -DMEGAMOE_TORCH="${MEGAMOE_TORCH:-ON}" >>"$log" 2>&1 &&
     cmake --build "$build" --parallel "$(nproc)" "${targets[@]}" >>"$log" 2>&1; then
    return 0
  fi
  grep -E "error|FAILED" "$log" | head -40
  return 1
}

summary=()
note() {
  summary+=("$1")
  echo "== $1"
}
print_summary() {
  echo "================ summary ================"
  printf '%s\n' "${summary[@]}"
}
build_or_stop() {
  if ! gpu_build "$@"; then
    note "build: FAILED"
    print_summary
    exit 1
  fi
}
