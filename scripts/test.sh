#!/usr/bin/env bash
# For users and CI: builds everything this machine can build (the CUDA targets whenever nvcc is
# found; the Python package's ops library when there is a PyTorch to build it against, see
# scripts/deps.sh) and runs the tests: the CPU suites (label cpu) always, the GPU suites where GPUs
# are visible (label gpu: one, gpu2: two). Missing build tools are installed first (deps.sh says
# what). Ends with a summary per label: passed, failed, skipped, and which tests did not run and why.
# Exits non-zero when the build or a test fails.
#   MEGAMOE_BUILD_DIR   build folder (default: build)
#   MEGAMOE_CMAKE_ARGS  extra arguments for the configure step
#   MEGAMOE_TORCH       AUTO (default), ON or OFF: the Python package, as in scripts/deps.sh
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${MEGAMOE_BUILD_DIR:-$root/build}

# shellcheck source=deps.sh
source "$root/scripts/deps.sh" --
configure=("-DMEGAMOE_TORCH=$deps_torch")
[ -n "$deps_python" ] && configure+=("-DPython3_EXECUTABLE=$deps_python")
# shellcheck disable=SC2086  # MEGAMOE_CMAKE_ARGS is a list of arguments
cmake --no-warn-unused-cli -S "$root" -B "$build" -G Ninja "${configure[@]}" ${MEGAMOE_CMAKE_ARGS:-}
cmake --build "$build" --parallel "$(nproc)"

# What runs here: the GPU suites only where GPUs are; the Python suites only under a pytest.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
select=()
declare -A not_run_why=()
if ((gpus == 0)); then
  select=(-L '^cpu$')
  not_run_why[gpu]="no GPU visible (nvidia-smi -L lists none); they run on a Hopper machine"
  not_run_why[gpu2]=${not_run_why[gpu]}
elif ((gpus == 1)); then
  select=(-LE '^gpu2$')
  not_run_why[gpu2]="they take two GPUs, one is visible"
fi
python_why=""
if [ -n "$deps_suites_note" ] && [ "$deps_torch" = ON ]; then
  select+=(-E '^python\.')
  python_why=$deps_suites_note
fi
if ((gpus == 0)); then
  echo "[test] no GPU visible: running the CPU suites (label cpu); the GPU suites run on a Hopper machine"
fi

junit=$build/Testing/megamoe-junit.xml
rm -f "$junit"
status=0
ctest --test-dir "$build" "${select[@]}" --output-on-failure --parallel "$(nproc)" --output-junit "$junit" ||
  status=$?

# ---- Summary: each label's tests against their outcomes in the JUnit report (run: passed, fail,
# notrun: skipped); a test the report lacks did not run, for its label's reason.
# Each line "STATUS<tab>NAME"; gtest's parameterized names hold spaces and XML-escaped <, >.
outcomes=$(sed -n 's/.*<testcase name="\([^"]*\)".* status="\([a-z]*\)".*/\2\t\1/p' "$junit" 2>/dev/null |
  sed "s/&lt;/</g; s/&gt;/>/g; s/&quot;/\"/g; s/&apos;/'/g; s/&amp;/\\&/g" || true)
list_tests() { ctest --test-dir "$build" -N "$@" | sed -n 's/^ *Test *#[0-9]*: //p'; }
# summarize NAME WHY CTEST_SELECTION...: one line for the selected tests (those of a label), and one
# for each reason some did not run: WHY (the label's, when it was not selected), python_why.
summarize() {
  local name=$1 why=$2
  shift 2
  list_tests "$@" | awk -v name="$name" -v why="$why" -v python_why="$python_why" '
    NR == FNR { tab = index($0, "\t"); if (tab) status[substr($0, tab + 1)] = substr($0, 1, tab - 1); next }
    function joined(names, n,    i, out) {
      for (i = 1; i <= n; ++i) out = out (i > 1 ? ", " : "") names[i]
      return out
    }
    # "Suite.* (n)" for a group of names that differ only after their last dot, else the name.
    function groups(names, n,    i, g, key, count, order, k, out) {
      k = 0
      for (i = 1; i <= n; ++i) {
        g = names[i]; sub(/\.[^.]*$/, "", g)
        if (!(g in count)) { order[++k] = g; key[g] = names[i] }
        ++count[g]
      }
      for (i = 1; i <= k; ++i)
        out = out (i > 1 ? ", " : "") (count[order[i]] > 1 ? order[i] ".* (" count[order[i]] ")" : key[order[i]])
      return out
    }
    function say(text) { printf "  %-5s %s\n", (said++ ? "" : name), text }
    {
      outcome = ($0 in status) ? status[$0] : "absent"
      if (outcome == "run") ++passed
      else if (outcome == "fail") failed[++nf] = $0
      else if (outcome == "notrun") skipped[++ns] = $0
      else if (why == "" && python_why != "" && $0 ~ /^python\./) py[++npy] = $0
      else absent[++nabsent] = $0
    }
    END {
      if (passed + nf + ns > 0)
        say(sprintf("%d passed, %d failed, %d skipped", passed, nf, ns) \
            (nf ? "; FAILED: " joined(failed, nf) : "") (ns ? "; skipped: " joined(skipped, ns) : ""))
      if (nabsent) say(nabsent " did not run, " (why == "" ? "not selected" : why) ": " groups(absent, nabsent))
      if (npy) say(npy " did not run, " python_why ": " groups(py, npy))
    }' <(echo "$outcomes") -
}
echo
echo "[test] summary ($build)"
mapfile -t labels < <(ctest --test-dir "$build" --print-labels | sed -n 's/^  //p')
for label in "${labels[@]}"; do
  summarize "$label" "${not_run_why[$label]:-}" -L "^$label\$"
done
if ((gpus == 0)); then
  summarize "other" "they have no label (only label cpu runs here)" -LE '.'
else
  summarize "other" "" -LE '.'
fi
if [ "$deps_torch" = OFF ]; then
  echo "  the Python package's suites (pytest: python.cpu, python.gpu, python.gpu2; the wheel's install test)" \
    "are not built: $deps_python_note"
fi
if ((status == 0)); then
  echo "[test] every test that ran passed"
else
  echo "[test] FAILED (ctest exit $status)"
fi
exit $status
