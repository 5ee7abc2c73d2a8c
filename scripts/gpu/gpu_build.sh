# shellcheck shell=bash
# Sourced by the GPU-machine scripts (scripts/gpu/*.sh): sets root, out and build, and
# gpu_build LOG [TARGET ...] configures and builds every target there (or only the TARGETs) from the
# carried .deps (those machines have no network; MEGAMOE_TORCH=OFF leaves the PyTorch package out, for
# scripts/gpu/ab_prebuild.sh on a machine without PyTorch), appending to LOG; it returns non-zero (after
# printing the errors) on failure. note MESSAGE prints a line and keeps it for the summary that
# print_summary prints; build_or_stop LOG [TARGET ...] builds and, on failure, notes it, prints the
# summary and exits.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${OUT:-$root/gpu-logs}
build=$root/build-gpu
mkdir -p "$out"
export PATH="$PATH:/usr/local/cuda/bin"

gpu_build() {
  local log=$1
  shift
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
