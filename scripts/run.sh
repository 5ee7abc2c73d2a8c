#!/usr/bin/env bash
# Installs dependencies, builds, and runs megamoe-bench (default: qwen35-a3b, fp8_block).
# Arguments are passed to megamoe-bench, e.g. scripts/run.sh --workload dsv3 --precision bf16
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${MEGAMOE_BUILD_DIR:-$root/build}
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"

"$root/scripts/deps.sh" >&2
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -G Ninja ${MEGAMOE_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" --parallel "$(nproc)" --target megamoe-bench >/dev/null
exec "$build/megamoe-bench" "$@"
