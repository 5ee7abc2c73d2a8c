#!/usr/bin/env bash
# Run on the GPU machine (device tool, .deps carried): builds megamoe-bench (nothing to do after
# scripts/gpu/gpu_check.sh), then shows where a forward's time goes.
# (1) The graph breakdown (megamoe-bench --breakdown) at each of MEGAMOE_DIAG_TOKENS (default
#     "1 128") for each L2 mode in MEGAMOE_DIAG_L2 (default "scrubbed warm"): what each kernel
#     costs, and what cold caches add to it.
# (2) Nsight Compute on the forward's kernels at MEGAMOE_DIAG_NCU_TOKENS (default 1; "" skips):
#     speed of light (DRAM / L2 / SM throughput, the SM clock and the elapsed cycles: under the
#     GPU's power cap a large batch's GEMMs lose clock, docs/decisions.md#large-batch-gemm-time),
#     memory workload and warp stall reasons (cycles
#     per issued instruction, averaged over all warps, spinning producers included), caches
#     flushed before each kernel. MEGAMOE_DIAG_NCU_KERNELS narrows the kernels (a regex).
# (3) With MEGAMOE_DIAG_NCU_SOURCE=1, also the full Nsight Compute set with source counters for the
#     first launch of each kernel, exported per SASS line (ncu-source.csv: instructions executed and
#     warp stall samples per line) next to the report (ncu-full.ncu-rep).
# MEGAMOE_DIAG_PRECISION (default fp8_block) and MEGAMOE_DIAG_ARGS (more megamoe-bench options, e.g.
# "--token-tile 128 --weight-multicast") apply to every run. Writes diagnose.log and ncu.log to $OUT
# (or ./gpu-logs).
# shellcheck source-path=SCRIPTDIR
set -uo pipefail
# shellcheck source=gpu_build.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
gpu_build "$out/build.log" megamoe-bench || exit 1
bench=$build/megamoe-bench
workload=${MEGAMOE_DIAG_WORKLOAD:-qwen35-a3b}
precision=${MEGAMOE_DIAG_PRECISION:-fp8_block}
read -ra extra <<<"${MEGAMOE_DIAG_ARGS:-}"
run_args=(--workload "$workload" --precision "$precision" "${extra[@]}")
log=$out/diagnose.log
status=0

for tokens in ${MEGAMOE_DIAG_TOKENS:-1 128}; do
  for l2 in ${MEGAMOE_DIAG_L2:-scrubbed warm}; do
    flag=()
    [ "$l2" = warm ] && flag=(--warm-l2)
    echo "== $workload $precision ${extra[*]}, $tokens tokens, L2 $l2" | tee -a "$log"
    "$bench" "${run_args[@]}" --tokens "$tokens" --breakdown "${flag[@]}" >"$log.part" 2>&1 || status=1
    grep -E '^\s+[0-9]+ [a-z_0-9]+ +\+|^\s+[0-9]+ \||empty kernel' "$log.part" | tee -a "$log"
    rm -f "$log.part"
  done
done

ncu_tokens=${MEGAMOE_DIAG_NCU_TOKENS-1}
[ -n "$ncu_tokens" ] || exit $status
kernels=${MEGAMOE_DIAG_NCU_KERNELS:-route_and_count|gather_quantize|grouped_gemm|combine_kernel}
echo "== ncu at $ncu_tokens tokens (caches flushed before each kernel): $kernels" | tee -a "$log"
ncu --cache-control all --clock-control none --launch-count 4 -k "regex:$kernels" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --metrics 'regex:smsp__average_warps_issue_stalled_(long_scoreboard|barrier|wait|short_scoreboard|math_pipe_throttle|no_instruction|sleeping|membar|lg_throttle|mio_throttle|branch_resolving|dispatch_stall|selected)_per_issue_active\.ratio' \
  "$bench" "${run_args[@]}" --tokens "$ncu_tokens" >"$out/ncu.log" 2>&1 || status=1
grep -E '^  [a-z].*\(|Duration|SM Frequency|Elapsed Cycles|Throughput|Busy|Hit Rate|Warp Cycles Per|stalled|Bandwidth' "$out/ncu.log" |
  sed -E 's/<.*>\(T2\)/<...>/; s/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | tee -a "$log"
if [ "${MEGAMOE_DIAG_NCU_SOURCE:-0}" = 1 ]; then
  echo "== ncu full set with source counters at $ncu_tokens tokens: $kernels" | tee -a "$log"
  ncu --cache-control all --clock-control none --set full --import-source yes --launch-count 3 -k "regex:$kernels" \
    -f -o "$out/ncu-full" "$bench" "${run_args[@]}" --tokens "$ncu_tokens" >>"$out/ncu.log" 2>&1 || status=1
  ncu --import "$out/ncu-full.ncu-rep" --page source --csv >"$out/ncu-source.csv" 2>>"$out/ncu.log" || status=1
  ncu --import "$out/ncu-full.ncu-rep" --page details --csv >"$out/ncu-details.csv" 2>>"$out/ncu.log" || status=1
  echo "   $(wc -l <"$out/ncu-source.csv") source lines, $(wc -l <"$out/ncu-details.csv") detail lines" | tee -a "$log"
fi
exit $status
