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
# path and content.
source_hash() {
  (cd "$1" && find CMakeLists.txt cmake include src tools tests examples python/CMakeLists.txt python/csrc \
    -type f 2>/dev/null | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-40)
}

# Where the prebuilt tree's binaries look for what they load on this machine: CUDA's runtime (their
# run path names the building machine's folder) and NVSHMEM's host library (opened by name when the
# path recorded at build time is not here), from the python3 that holds PyTorch.
prebuilt_library_path() {
  local nvshmem
  nvshmem=$(python3 -c 'import os, nvidia.nvshmem as n; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null)
  export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/cuda/lib${nvshmem:+:$nvshmem}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# Unpacks $root/.gpu-prebuilt/build-gpu.tar.xz into the build folder (once per source hash) and returns 0
# where it holds binaries of these sources that load here; otherwise says why in LOG and returns 1.
# CTest's files name the interpreter the building machine's ops library was built against: they get
# this machine's python3 instead.
take_prebuilt_tree() {
  local log=$1 prebuilt_tree=$root/.gpu-prebuilt hash
  [ -f "$prebuilt_tree/build-gpu.tar.xz" ] || return 1
  hash=$(source_hash "$root")
  if [ "$hash" != "$(cat "$prebuilt_tree/source_hash" 2>/dev/null)" ]; then
    echo "prebuilt tree: built from other sources; building here" | tee -a "$log"
    return 1
  fi
  if [ "$(cat "$build/.prebuilt_source_hash" 2>/dev/null)" != "$hash" ]; then
    rm -rf "$build" && mkdir -p "$build" && tar -xJf "$prebuilt_tree/build-gpu.tar.xz" -C "$build" || {
      echo "prebuilt tree: does not unpack; building here" | tee -a "$log"
      rm -rf "$build"
      return 1
    }
    local recorded here
    recorded=$(cat "$prebuilt_tree/python" 2>/dev/null) here=$(command -v python3)
    if [ -n "$recorded" ] && [ -n "$here" ] && [ "$recorded" != "$here" ]; then
      find "$build" -name CTestTestfile.cmake -exec sed -i "s|$recorded|$here|g" {} +
    fi
    echo "$hash" >"$build/.prebuilt_source_hash"
  fi
  prebuilt_library_path
  local binary
  for binary in "$build"/megamoe-bench "$build"/tests/test_api_moe_layer; do
    if [ ! -x "$binary" ] || ldd "$binary" | grep -q "not found"; then
      echo "prebuilt tree: $(basename "$binary") missing or does not load here; building here" | tee -a "$log"
      rm -rf "$build"
      return 1
    fi
  done
  echo "build: prebuilt ($(cat "$prebuilt_tree/build_report" 2>/dev/null), sources $hash)" | tee -a "$log"
}

gpu_build() {
  local log=$1
  shift
  take_prebuilt_tree "$log" && return 0
  # An unpacked tree holds no build state of this machine's: configure afresh.
  [ -f "$build/.prebuilt_source_hash" ] && rm -rf "$build"
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
