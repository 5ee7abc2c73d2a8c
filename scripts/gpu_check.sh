#!/usr/bin/env bash
# Run on the GPU machine (device tool), from the repository root, with .deps carried along:
# builds from the carried CUTLASS and GoogleTest copies (that machine has no network), runs every
# test suite with the GPU suites required, checks the SASS of the kernels, runs compute-sanitizer
# over the GPU suites, and prints a short summary last. Logs go to $OUT (or ./gpu-logs).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${OUT:-$root/gpu-logs}
build=$root/build-gpu
mkdir -p "$out"
export PATH="$PATH:/usr/local/cuda/bin"
export MEGAMOE_REQUIRE_GPU=1
summary=()
note() { summary+=("$1"); echo "== $1"; }

[ -f "$root/.deps/cutlass/include/cute/tensor.hpp" ] || { echo "missing .deps/cutlass: run scripts/deps.sh here and carry .deps"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
nvcc --version | tail -2 | tee -a "$out/gpu.txt"
cmake --version | head -1 | tee -a "$out/gpu.txt"

if cmake -S "$root" -B "$build" -G Ninja -DMEGAMOE_REQUIRE_CUDA=ON >"$out/configure.log" 2>&1 &&
   cmake --build "$build" --parallel "$(nproc)" >"$out/build.log" 2>&1; then
  note "build: ok ($(grep -c 'warning' "$out/build.log") warnings, spills: $(grep -ci 'spill' "$out/build.log"))"
else
  tail -40 "$out/configure.log" "$out/build.log"
  note "build: FAILED"
  printf '%s\n' "${summary[@]}"
  exit 1
fi

ctest --test-dir "$build" --output-on-failure --parallel 8 >"$out/ctest.log" 2>&1
status=$?
grep -E "tests passed|Failed|\*\*\*" "$out/ctest.log" | tail -15
note "ctest (cpu + gpu suites): $(grep -E 'tests passed' "$out/ctest.log") (exit $status)"

for exe in "$build"/tests/test_kernels_*; do
  [ -x "$exe" ] || continue
  name=$(basename "$exe")
  "$exe" --gtest_brief=1 >"$out/$name.log" 2>&1
  note "$name: $(grep -E 'PASSED|FAILED|SKIPPED' "$out/$name.log" | tr '\n' ' ')"
  for tool in memcheck racecheck synccheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 3 "$exe" --gtest_brief=1 >"$out/$name.$tool.log" 2>&1
    note "  compute-sanitizer $tool: exit $? ($(grep -E 'SUMMARY' "$out/$name.$tool.log" | tail -1))"
  done
done

sass="$out/sass.txt"
cuobjdump --dump-sass "$build/libmegamoe_kernels.a" >"$sass" 2>&1
note "SASS: $(grep -c 'HGMMA' "$sass") HGMMA, $(grep -c 'UTMALDG' "$sass") UTMALDG, $(grep -cE 'LDL|STL' "$sass") local-memory ops"

echo
echo "================ summary ================"
printf '%s\n' "${summary[@]}"
exit $status
