#!/usr/bin/env bash
# Run on a machine with two or more NVLink-connected GPUs (device kind nvidia-h200-x2), with .deps
# carried: builds, then runs the expert-parallel suites (CTest label gpu2) under megamoe-run.
# NVLink multicast stays off (megamoe-run sets NCCL_NVLS_ENABLE=0 and friends in every rank).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${OUT:-$root/gpu-logs}
build=$root/build-gpu
mkdir -p "$out"
export PATH="$PATH:/usr/local/cuda/bin"
nvidia-smi topo -m | tee "$out/topology.txt"
cmake -S "$root" -B "$build" -G Ninja -DMEGAMOE_REQUIRE_CUDA=ON >"$out/build2.log" 2>&1 &&
  cmake --build "$build" --parallel "$(nproc)" >>"$out/build2.log" 2>&1 || { grep -E "error|FAILED" "$out/build2.log" | head -40; exit 1; }
ctest --test-dir "$build" -L gpu2 --output-on-failure 2>&1 | tee "$out/gpu2.log"
if [ -x "$build/megamoe-ep-bench" ]; then
  "$build/megamoe-run" -n 2 --timeout 540 -- "$build/megamoe-ep-bench" --workload dsv3 --tokens 128,4096 \
    --json "$out/ep-dsv3-fp8_block.json" 2>&1 | tee -a "$out/ep_bench.log"
else
  echo "megamoe-ep-bench was not built (NCCL not found); see build2.log"
fi
