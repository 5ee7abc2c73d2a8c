#!/usr/bin/env bash
# Installs dependencies, builds everything (the CUDA targets too whenever nvcc is found) and runs
# the tests: the CPU suites always, the GPU suites as well when a GPU is visible.
#   MEGAMOE_BUILD_DIR   build folder (default: build)
#   MEGAMOE_CMAKE_ARGS  extra arguments for the configure step
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${MEGAMOE_BUILD_DIR:-$root/build}
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"

"$root/scripts/deps.sh"
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -G Ninja ${MEGAMOE_CMAKE_ARGS:-}
cmake --build "$build" --parallel "$(nproc)"

labels=()
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "[test] no GPU visible: running the CPU suites (label cpu); GPU suites run on a Hopper machine"
  labels=(-L cpu)
fi
ctest --test-dir "$build" "${labels[@]}" --output-on-failure --parallel "$(nproc)"
