#!/usr/bin/env bash
# Run on a machine with two or more NVLink-connected GPUs (device kind nvidia-h200-x2), with
# .gpu-prebuilt (scripts/gpu/prebuild.sh) or .deps carried: builds (or unpacks), then runs the
# expert-parallel suites (CTest label gpu2) under megamoe-run, the single-GPU layer on every GPU of
# one process (and refusing calls while another GPU is current), and megamoe-ep-bench on dsv3 from decode to prefill (8 to 4096 tokens per rank) with
# each rank's timeline of one call, then again with the fused layer beside the staged one (with the
# fused kernel's role timeline), and the same layers timed from PyTorch (python -m megamoe.ep_bench).
# NVLink multicast stays off (megamoe-run sets NCCL_NVLS_ENABLE=0 and friends in every rank).
# shellcheck source-path=SCRIPTDIR
set -uo pipefail
# shellcheck source=gpu_build.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
nvidia-smi topo -m | tee "$out/topology.txt"
gpu_build "$out/build2.log" || exit 1
ctest --test-dir "$build" -L gpu2 --output-on-failure 2>&1 | tee "$out/gpu2.log"
# One process, every GPU, and a layer called while another GPU is current (the single-GPU suite
# skips both on one).
MEGAMOE_REQUIRE_GPU=1 "$build/tests/test_api_moe_layer" \
  --gtest_filter='MoeLayer.RunsOnEveryGpuOfOneProcess:MoeLayerFaults.CallsWhileAnotherDeviceIsCurrentAreRefused' 2>&1 |
  tee -a "$out/gpu2.log"
if [ -x "$build/megamoe-ep-bench" ]; then
  "$build/megamoe-run" -n 2 --timeout 540 -- "$build/megamoe-ep-bench" --workload dsv3 --tokens 8,128,512,4096 --timeline \
    --json "$out/ep-dsv3-fp8_block.json" 2>&1 | tee -a "$out/ep_bench.log"
  # The fused layer beside the staged one, in a run of its own (it stops at a y that differs).
  "$build/megamoe-run" -n 2 --timeout 540 -- "$build/megamoe-ep-bench" --workload dsv3 --tokens 8,128,512,4096 --fused --timeline \
    --json "$out/ep-dsv3-fp8_block-fused.json" 2>&1 | tee -a "$out/ep_bench.log"
  # FP8 partial sums, staged and fused, against the same NCCL baseline (its last column: their error).
  "$build/megamoe-run" -n 2 --timeout 540 -- "$build/megamoe-ep-bench" --workload dsv3 --tokens 128,4096 --fused \
    --partial-sums fp8 --json "$out/ep-dsv3-fp8_block-fused-fp8-partials.json" 2>&1 | tee -a "$out/ep_bench.log"
else
  echo "megamoe-ep-bench was not built (NCCL not found); see build2.log"
fi
# The staged and fused layers from PyTorch, each forward in CUDA graphs as a user replays them.
if [ -f "$build/python/megamoe/_megamoe_ops.so" ]; then
  PYTHONPATH=$root/python MEGAMOE_OPS_LIBRARY=$build/python/megamoe/_megamoe_ops.so \
    "$build/megamoe-run" -n 2 --timeout 540 -- python3 -m megamoe.ep_bench --workload dsv3 --tokens 8,128,512,4096 \
    --json "$out/ep-dsv3-fp8_block-python.json" 2>&1 | tee -a "$out/ep_bench.log"
else
  echo "the PyTorch ops library was not built (no PyTorch found); see build2.log" | tee -a "$out/ep_bench.log"
fi
