#!/usr/bin/env bash
# scripts/gpu/gpu_check.sh's time budget and steps, with stand-ins for the GPU machine's tools and
# suites: a suite that outlasts the budget is cut there and named in the summary, the steps after
# it are named as not started, and the script still ends with its summary, failed; within the
# budget the same steps pass; a shard of the layer suite reaches that suite alone; an unknown step,
# a shard that is not I/N or a budget that is not seconds is refused before anything runs.
set -euo pipefail
scripts=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
tree=$dir/tree bin=$dir/bin
mkdir -p "$tree/scripts/gpu" "$tree/.deps/cutlass/include/cute" "$tree/build-gpu/tests" "$bin"
cp "$scripts/gpu_check.sh" "$scripts/gpu_build.sh" "$tree/scripts/gpu/"
touch "$tree/.deps/cutlass/include/cute/tensor.hpp"
stub() { printf '#!/usr/bin/env bash\n%s\n' "$2" >"$1" && chmod +x "$1"; }
for tool in nvidia-smi nvcc cmake; do stub "$bin/$tool" 'echo stand-in'; done
stub "$bin/ctest" 'echo "100% tests passed, 0 tests failed out of 3"'
stub "$bin/compute-sanitizer" 'echo "========= ERROR SUMMARY: 0 errors"'
# shellcheck disable=SC2016  # expanded by the stubs
stub "$tree/build-gpu/tests/test_kernels_fast" 'echo "[       OK ] Fast.Case (1 ms) shard ${GTEST_SHARD_INDEX:-none}"'
# The layer suite sleeps as long as the file beside it says.
# shellcheck disable=SC2016
stub "$tree/build-gpu/tests/test_api_moe_layer" 'echo "[       OK ] Layer.Case (2 ms) shard ${GTEST_SHARD_INDEX:-none} of ${GTEST_TOTAL_SHARDS:-none}"
exec sleep "$(cat "$0.sleep")"'
fail() { echo "$1"; echo "--- output:"; cat "$dir/out.txt"; exit 1; }
check() {  # BUDGET_S STEPS SLEEP_S [SHARD]: runs the script, its output in out.txt, its status in rc
  echo "$3" >"$tree/build-gpu/tests/test_api_moe_layer.sleep"
  rm -rf "$dir/logs"
  set +e
  PATH="$bin:$PATH" OUT=$dir/logs MEGAMOE_CHECK_BUDGET_S=$1 MEGAMOE_CHECK_STEPS=$2 MEGAMOE_LAYER_SHARD=${4:-} \
    bash "$tree/scripts/gpu/gpu_check.sh" >"$dir/out.txt" 2>&1
  rc=$?
  set -e
}

start=$(date +%s)
check 22 "tests sanitizers" 120
took=$(( $(date +%s) - start ))
[ "$rc" -eq 1 ] || fail "a cut suite: exit $rc, expected 1"
[ "$took" -lt 40 ] || fail "a budget of 22 s took $took s"
summary=$(sed -n '/=== summary ===/,$p' "$dir/out.txt")
grep -q "test_kernels_fast: 1 tests passed, 0 failed lines" <<<"$summary" || fail "the suite before the cut"
grep -q "left unfinished: test_api_moe_layer (cut); compute-sanitizer memcheck test_kernels_fast (not started);" \
  <<<"$summary" || fail "the summary does not name what the budget cut and what it never started"
[ "$(tail -1 "$dir/out.txt" | grep -c 'left unfinished')" -eq 1 ] || fail "the budget's note is not the summary's last line"

check 60 "tests sanitizers" 0
[ "$rc" -eq 0 ] || fail "within the budget: exit $rc"
! grep -q "unfinished" "$dir/out.txt" || fail "within the budget something is named unfinished"
[ "$(sed -n '/=== summary ===/,$p' "$dir/out.txt" | grep -c 'compute-sanitizer .*: exit 0')" -eq 6 ] || fail "three tools over two suites"

check 60 tests 0 1/2
[ "$rc" -eq 0 ] || fail "a shard: exit $rc"
grep -q "Layer.Case (2 ms) shard 1 of 2" "$dir/logs/tests.log" || fail "the layer suite was not given its shard"
grep -q "Fast.Case (1 ms) shard none" "$dir/logs/tests.log" || fail "the shard reached another suite"
for shard in 2/2 1 a/3; do
  check 60 tests 0 "$shard"
  [ "$rc" -eq 2 ] || fail "MEGAMOE_LAYER_SHARD=$shard: exit $rc"
  ! grep -q "build: ok" "$dir/out.txt" || fail "a bad shard is refused before the build"
done

for budget in abc 0 -5; do
  check "$budget" tests 0
  [ "$rc" -eq 2 ] || fail "MEGAMOE_CHECK_BUDGET_S=$budget: exit $rc"
  ! grep -q "build: ok" "$dir/out.txt" || fail "a bad budget is refused before the build"
done

check 60 "tests sanitise" 0
[ "$rc" -eq 2 ] || fail "an unknown step: exit $rc"
grep -q "unknown step 'sanitise'" "$dir/out.txt" || fail "an unknown step is not named"
! grep -q "build: ok" "$dir/out.txt" || fail "an unknown step is refused before the build"
echo "gpu_check.sh budget and steps: ok"
