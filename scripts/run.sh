#!/usr/bin/env bash
# For users: builds megamoe-bench and runs it (default: qwen35-a3b, fp8_block). Arguments go to
# megamoe-bench, e.g. scripts/run.sh --workload dsv3 --precision bf16.
#   With a GPU visible: builds the CUDA bench (in build/, configured as test.sh does) and times the
#   forward for each token bucket.
#   Without one, or with --cpu: builds only what the CPU reference needs (in build-cpu/: no CUDA, no
#   CUTLASS, no Python, no tests) and runs it on a reduced problem.
# Missing build tools are installed first (scripts/deps.sh says what). The build's progress goes to
# stderr, megamoe-bench's report to stdout.
#   MEGAMOE_BUILD_DIR   build folder (default: build, or build-cpu for the CPU run)
#   MEGAMOE_CMAKE_ARGS  extra arguments for the configure step
#   MEGAMOE_TORCH       the GPU build's Python package, as in scripts/deps.sh (default AUTO)
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

cpu=0
why="--cpu"
if ! nvidia-smi -L >/dev/null 2>&1; then
  cpu=1
  why="no GPU visible"
fi
for arg in "$@"; do
  [ "$arg" = --cpu ] && cpu=1
done

if ((cpu)); then
  # shellcheck source=deps.sh
  source "$root/scripts/deps.sh" --cpu-only
  build=${MEGAMOE_BUILD_DIR:-$root/build-cpu}
  configure=(-DMEGAMOE_ENABLE_CUDA=OFF -DMEGAMOE_TORCH=OFF -DMEGAMOE_BUILD_TESTS=OFF)
  what="the CPU reference only ($why)"
else
  # shellcheck source=deps.sh
  source "$root/scripts/deps.sh" --
  build=${MEGAMOE_BUILD_DIR:-$root/build}
  configure=("-DMEGAMOE_TORCH=$deps_torch")
  [ -n "$deps_python" ] && configure+=("-DPython3_EXECUTABLE=$deps_python")
  what="the CUDA bench"
fi

echo "[run] configuring $build for $what" >&2
mkdir -p "$build"
# shellcheck disable=SC2086  # MEGAMOE_CMAKE_ARGS is a list of arguments
if ! cmake --no-warn-unused-cli -S "$root" -B "$build" -G Ninja "${configure[@]}" ${MEGAMOE_CMAKE_ARGS:-} \
  >"$build/configure.log" 2>&1; then
  cat "$build/configure.log" >&2
  echo "[run] the configure step failed (log: $build/configure.log)" >&2
  exit 1
fi
echo "[run] building megamoe-bench" >&2
cmake --build "$build" --parallel "$(nproc)" --target megamoe-bench >&2
exec "$build/megamoe-bench" "$@"
