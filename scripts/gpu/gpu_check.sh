#!/usr/bin/env bash
# Run on the GPU machine (device tool), from the repository root, with .gpu-prebuilt (the build
# done beforehand on a machine without a GPU: scripts/gpu/prebuild.sh) or .deps carried along:
# unpacks that build, or builds from the carried CUTLASS and GoogleTest copies (that machine has no
# network), runs every test suite with the GPU suites required (the expert-parallel ones with their
# ranks sharing this GPU), checks the SASS of the kernels, runs compute-sanitizer over the GPU
# suites, and prints a short summary last. Logs go to $OUT (or ./gpu-logs).
#
# The whole check takes longer than one device call may (the sanitizers are most of it), so it
# runs within a time budget, MEGAMOE_CHECK_BUDGET_S seconds from its start (default 540: the call's
# 600 less what returning the logs takes). Each step runs under `timeout` with the seconds left; a
# step the budget cuts or never reaches is named in the summary, which always comes. The steps run
# in this order, uninstrumented ones first: tests (the CPU suites but the install tests, the kernel
# suites and the layer suite), python, ep, example, sass, sanitizers; MEGAMOE_CHECK_STEPS (default all of them) picks
# some, e.g. "sanitizers" in a second call after a first one ran the rest.
# shellcheck source-path=SCRIPTDIR
set -uo pipefail
# shellcheck source=gpu_build.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
export MEGAMOE_REQUIRE_GPU=1

budget=${MEGAMOE_CHECK_BUDGET_S:-540}
if [[ ! $budget =~ ^[1-9][0-9]*$ ]]; then
  echo "gpu_check.sh: MEGAMOE_CHECK_BUDGET_S='$budget' is not a number of seconds"
  exit 2
fi
deadline=$(( $(date +%s) + budget ))
all_steps="tests python ep example sass sanitizers"
steps=" ${MEGAMOE_CHECK_STEPS:-$all_steps} "
for step in $steps; do
  [[ " $all_steps " == *" $step "* ]] || { echo "gpu_check.sh: unknown step '$step' in MEGAMOE_CHECK_STEPS ($all_steps)"; exit 2; }
done
wanted() { [[ $steps == *" $1 "* ]]; }
status=0
unfinished=()
# bounded WHAT COMMAND...: runs COMMAND with the budget's seconds left; its status, 124 or 137 where
# the budget cut it, 125 where too little was left to start it (WHAT then goes into the summary).
bounded() {
  local what=$1 left=$(( deadline - $(date +%s) )) rc
  shift
  if [ "$left" -lt 20 ]; then
    unfinished+=("$what (not started)")
    return 125
  fi
  timeout --kill-after=5 "$left" "$@"
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then unfinished+=("$what (cut)"); fi
  return $rc
}
finish() {
  if [ ${#unfinished[@]} -gt 0 ]; then
    status=1
    note "time budget ($budget s) left unfinished: $(printf '%s; ' "${unfinished[@]}")"
  fi
  echo
  print_summary
  exit $status
}

# GPU suites run as one process each (their fixtures cache large weights across cases).
# MEGAMOE_GPU_FILTER narrows the layer suite; MEGAMOE_SANITIZE_FILTER picks the cases the
# sanitizers run (they are slow). The default set includes a named workload at 128 tokens (the
# device-count test), whose FP8 GEMM reuses its pipeline stages: racecheck found a hazard there
# that the small cases, one tile per CTA, never reach; qwen35-a3b at one token, the real
# shapes on the one-block router path; and fp8_tensor's dynamic scales in both GEMM layouts (the
# amax atomics, the x-amax kernel's last block, the encoding pass).
layer_filter=${MEGAMOE_GPU_FILTER:-*}
# MEGAMOE_LAYER_SHARD=I/N runs the I-th of N shares of the layer suite (GoogleTest's sharding), for
# a suite that with the build does not fit in one call.
layer_shard=()
if [ -n "${MEGAMOE_LAYER_SHARD:-}" ]; then
  if [[ ! $MEGAMOE_LAYER_SHARD =~ ^([0-9]+)/([1-9][0-9]*)$ ]] || [ "${BASH_REMATCH[1]}" -ge "${BASH_REMATCH[2]}" ]; then
    echo "gpu_check.sh: MEGAMOE_LAYER_SHARD='$MEGAMOE_LAYER_SHARD' is not I/N with 0 <= I < N"
    exit 2
  fi
  layer_shard=(env GTEST_SHARD_INDEX="${BASH_REMATCH[1]}" GTEST_TOTAL_SHARDS="${BASH_REMATCH[2]}")
fi
sanitize_filter=${MEGAMOE_SANITIZE_FILTER:-*small_fp8_block_T7_softmax*:Shapes/*ragged64_bf16_T128_softmax:Shapes/*ragged_fp8_block_T1000_softmax:*small_bf16_T128_grouped_fast*:MoeLayer.BadRouting*:Sm90*:*DeviceTokenCount*:*qwen35_a3b_fp8_block_T1:*small_fp8_tensor_T7_softmax_dynamic:MoeLayerTokensOnMVsReference*small_fp8_tensor_T65_softmax_dynamic}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$out/build.log"
nvcc --version | tail -2 | tee -a "$out/build.log"
cmake --version | head -1 | tee -a "$out/build.log"

build_or_stop "$out/build.log"
if grep -q '^build: prebuilt' "$out/build.log"; then
  note "$(grep '^build: prebuilt' "$out/build.log" | tail -1)"
else
  note "build: ok ($(grep -c 'warning' "$out/build.log") warnings, spills: $(grep -ci 'spill' "$out/build.log"))"
fi

suites=()
for exe in "$build"/tests/test_kernels_* "$build"/tests/test_api_moe_layer; do
  [ -x "$exe" ] && suites+=("$exe")
done

if wanted tests; then
  # Without the install tests (a pip wheel built from scratch, a find_package consumer): CI runs
  # them, and here they took the whole budget before any GPU suite ran.
  bounded "ctest (cpu suites)" ctest --test-dir "$build" -L cpu -E '^tools\.install\.' --output-on-failure --parallel 8 \
    >>"$out/build.log" 2>&1 || status=1
  note "ctest (cpu suites): $(grep -E 'tests passed' "$out/build.log") (exit $status)"
  for exe in "${suites[@]}"; do
    name=$(basename "$exe")
    filter='*' shard=()
    [ "$name" = test_api_moe_layer ] && filter=$layer_filter shard=("${layer_shard[@]}")
    start=$(date +%s)
    bounded "$name" "${shard[@]}" "$exe" --gtest_filter="$filter" >"$out/$name.log" 2>&1 || status=1
    note "$name: $(grep -c '^\[       OK \]' "$out/$name.log") tests passed, $(grep -c '^\[  FAILED  \]' "$out/$name.log") failed lines ($(( $(date +%s) - start )) s)"
    # Where the suite's time goes (most of it is the CPU reference and weight generation).
    while read -r ms test; do
      [ "$ms" -ge 1000 ] && note "    slowest: $test $(( ms / 1000 )) s"
    done < <(grep -E '^\[       OK \]' "$out/$name.log" | sed -E 's/.*OK \] (.*) \(([0-9]+) ms\)/\2 \1/' | sort -rn | head -3)
    grep -E "Failure|error|Expected|Which is|evaluates to|actual|MEGAMOE_TEST_SEED" "$out/$name.log" | head -30
    cat "$out/$name.log" >>"$out/tests.log" && rm "$out/$name.log"
  done
fi

# The Python package's GPU suite (pytest, through CTest for its environment; --verbose keeps
# pytest's own summary line for the note).
if wanted python; then
  start=$(date +%s)
  bounded "python.gpu" ctest --test-dir "$build" -R '^python\.gpu$' --verbose >"$out/python.log" 2>&1 || status=1
  note "python (pytest, gpu): $(grep -E ' in [0-9.]+s' "$out/python.log" | tail -1 | tr -d '=') ($(( $(date +%s) - start )) s)"
  cat "$out/python.log" >>"$out/tests.log" && rm "$out/python.log"
fi

# Expert parallelism with the ranks sharing this GPU (megamoe-run --one-gpu), and a stalled rank.
if wanted ep; then
  start=$(date +%s)
  bounded "expert parallelism on one GPU" ctest --test-dir "$build" -R '^(comm\.ep_layer\..*one_gpu|python\.ep_.*one_gpu|tools\.megamoe_ep_bench\..*one_gpu)$' \
    --output-on-failure >"$out/ep.log" 2>&1 || status=1
  # The NVSHMEM backend's tests exist only where CMake found NVSHMEM (MEGAMOE_NVSHMEM=AUTO): say so.
  nvshmem_tests=$(ctest --test-dir "$build" -N -R 'nvshmem' | grep -c 'Test *#')
  note "expert parallelism on one GPU: $(grep -E 'tests passed' "$out/ep.log") ($(( $(date +%s) - start )) s; $nvshmem_tests of them on NVSHMEM$( ((nvshmem_tests > 0)) || echo ': NVSHMEM not found at configure time'))"
  cat "$out/ep.log" >>"$out/tests.log" && rm "$out/ep.log"
fi

# The README's usage as a program: it must run as written.
if wanted example; then
  if bounded "megamoe-example-forward" "$build/megamoe-example-forward" >>"$out/tests.log" 2>&1; then
    note "megamoe-example-forward: ok ($(grep -E 'us per graph replay' "$out/tests.log" | tail -1))"
  else
    status=1
    note "megamoe-example-forward: FAILED (see tests.log)"
  fi
fi

if wanted sass; then
  sass="$out/sass.txt"
  cuobjdump --dump-sass "$build/libmegamoe_kernels.a" >"$sass" 2>&1
  note "SASS: $(grep -cE 'HGMMA|QGMMA' "$sass") wgmma (HGMMA bf16, QGMMA fp8), $(grep -c 'UTMALDG' "$sass") UTMALDG, $(grep -cE 'LDL|STL' "$sass") local-memory ops"
  # ptxas 13.0 pairs such an offset (with or without an immediate after it) with an odd descriptor
  # register, which the GPU refuses (docs/decisions.md#cpasync-with-an-l2-policy); the combine
  # probe runs the share in a kernel of its own, where ptxas has chosen that form before.
  probe_sass=$out/sass_combine_probe.txt
  cuobjdump --dump-sass "$build/megamoe-combine-probe" >"$probe_sass" 2>&1
  uniform_offsets=$(cat "$sass" "$probe_sass" | grep -cE 'LDGSTS[^;]*\[R[0-9]+\+UR[0-9]+')
  note "SASS: $uniform_offsets cp.async (LDGSTS) with a uniform shared offset in the kernels and the combine probe (must be 0)"
  [ "$uniform_offsets" -eq 0 ] || status=1
  # Code size by source file: with the L2 scrubbed a one-shot path's instructions come from HBM
  # (docs/decisions.md#h200-facts).
  by_source=$out/sass_by_source.txt
  python3 "$root/scripts/sass_by_source.py" "$build/libmegamoe_kernels.a" --kernel route_and_count_kernel \
    --kernel sm90_moe_single_kernel --top 12 >"$by_source" 2>&1
  note "SASS by source file in sass_by_source.txt: router $(grep -m1 route_and_count "$by_source" | grep -oE '[0-9]+ instructions'), single kernel $(grep -m1 sm90_moe_single_kernel "$by_source" | grep -oE '[0-9]+ instructions') (first instantiation)"
fi

wanted sanitizers || finish
for exe in "${suites[@]}"; do
  name=$(basename "$exe")
  for tool in memcheck racecheck synccheck; do
    log="$out/sanitize.log"
    echo "==== $tool $name" >>"$log"
    bounded "compute-sanitizer $tool $name" compute-sanitizer --tool "$tool" --error-exitcode 3 "$exe" --gtest_brief=1 \
      --gtest_filter="$sanitize_filter" >"$log.part" 2>&1
    rc=$?
    cat "$log.part" >>"$log"
    # Host-only suites (layout structs) make no CUDA call; the sanitizer then exits 255.
    if [ $rc -ne 0 ] && grep -q "terminated before first instrumented API call" "$log.part"; then
      rm -f "$log.part"
      note "  compute-sanitizer $tool, $name: not applicable (no CUDA calls)"
      continue
    fi
    rm -f "$log.part"
    [ $rc -eq 0 ] || status=1
    note "  compute-sanitizer $tool, $name: exit $rc ($(grep -E 'SUMMARY' "$log" | tail -1))"
  done
done

# The fault suite under memcheck (the soak aside: 10,000 calls are too many under the tool), and a
# stalled expert-parallel rank with every process instrumented.
# The suite provokes failed allocations on purpose (the test checks their errors), so API errors
# are not the tool's to report; and the tool serializes kernels, so the forward beside a kernel
# holding the SMs waits for that kernel and is left to the uninstrumented run above.
bounded "compute-sanitizer memcheck, fault suite" compute-sanitizer --tool memcheck --report-api-errors no \
  --error-exitcode 3 "$build/tests/test_api_moe_layer" --gtest_brief=1 \
  --gtest_filter='MoeLayerFaults.*:-MoeLayerFaults.SoakOfTenThousandCalls:MoeLayerFaults.ForwardBesideKernelsHoldingMostSms' \
  >"$out/sanitize-faults.log" 2>&1 || status=1
note "compute-sanitizer memcheck, fault suite: $(grep -E 'ERROR SUMMARY' "$out/sanitize-faults.log" | tail -1)"
bounded "compute-sanitizer memcheck, stalled rank" compute-sanitizer --tool memcheck --target-processes all \
  --error-exitcode 3 "$build/megamoe-run" -n 2 --one-gpu --timeout 600 -- "$build/tests/comm_ep_layer_rank" \
  --iterations 1 --hang --barrier-timeout-ms 3000 >"$out/sanitize-ep.log" 2>&1 || status=1
note "compute-sanitizer memcheck, stalled rank: $(grep -c 'ERROR SUMMARY: 0 errors' "$out/sanitize-ep.log") processes clean, $(grep -c 'ok after the stalled peer' "$out/sanitize-ep.log") reported"
# Two ranks' forwards with every layer variant the rank test builds (FP8 and bf16 token rows, FP8
# partial sums; with --fused the layer under test runs as one launch a rank),
# every process instrumented. The fused forward's cross-rank waits give up after 10 s at most:
# slowed down a hundredfold by the tool, a short call keeps them well inside.
for tool in memcheck racecheck; do
  for fused in "" --fused; do
    log="$out/sanitize-ep-$tool${fused:+-fused}.log"
    tokens=64
    [ -n "$fused" ] && tokens=16
    bounded "compute-sanitizer $tool, two ranks${fused:+, fused}" compute-sanitizer --tool "$tool" \
      --target-processes all --error-exitcode 3 "$build/megamoe-run" -n 2 --one-gpu --timeout 600 -- \
      "$build/tests/comm_ep_layer_rank" --iterations 2 --tokens "$tokens" $fused >"$log" 2>&1 || status=1
    note "compute-sanitizer $tool, two ranks${fused:+, fused}: $(grep -hE '(ERROR|RACECHECK) SUMMARY' "$log" | sort | uniq -c | tr -s ' \n' ' ')($(grep -c 'rank [01] ok' "$log") ranks ok)"
  done
done
cat "$out/sanitize-faults.log" "$out/sanitize-ep.log" "$out"/sanitize-ep-*.log >>"$out/sanitize.log" &&
  rm "$out/sanitize-faults.log" "$out/sanitize-ep.log" "$out"/sanitize-ep-*.log
finish
