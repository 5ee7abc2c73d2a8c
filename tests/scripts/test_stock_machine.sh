#!/usr/bin/env bash
# scripts/run.sh and scripts/deps.sh on a stock machine, whose python3 is a system interpreter that
# refuses pip installs (PEP 668) and has no PyTorch. In a copy of the tree:
#   - `run.sh --cpu` builds the CPU reference, showing the build's progress, runs it, and calls no
#     Python at all;
#   - deps.sh (MEGAMOE_TORCH=AUTO) skips the Python package, saying so and how to get it;
#   - deps.sh --dry-run decides, against stand-in torch modules: a user's CUDA 13 torch >= 2.11 is
#     built against as it is; a CPU build, or an older one, is not; MEGAMOE_TORCH=ON would create
#     .venv with PyTorch 2.11; OFF skips;
# and none of them installs into that interpreter or creates .venv.
# The interpreter is Debian's /usr/bin/python3 where it is marked EXTERNALLY-MANAGED and has no
# torch, else a fresh virtual environment (pip ignores the marker inside one); either runs behind a
# python3 on PATH that refuses `pip install` into itself as PEP 668 does, and logs every call.
#   test_stock_machine.sh SOURCE_DIR WORK_DIR
set -euo pipefail
src=$1 work=$2
rm -rf "$work"
mkdir -p "$work/tree" "$work/bin"
tree=$work/tree log=$work/python3.log
fail() { echo "FAILED: $*"; exit 1; }

# The tree as a clone has it, with the .deps that test.sh installed, so that nothing is downloaded.
shopt -s dotglob nullglob
for entry in "$src"/*; do
  case ${entry##*/} in build* | .venv | .git | gpu-logs | .ab-prebuilt) continue ;; esac
  [[ $work/ == "$entry"/* || -f $entry/CMakeCache.txt ]] && continue  # a build folder, this test's among them
  cp -a "$entry" "$tree/"
done
shopt -u dotglob nullglob

base=/usr/bin/python3
stdlib=$("$base" -c 'import sysconfig; print(sysconfig.get_path("stdlib"))' 2>/dev/null || true)
if [ ! -f "$stdlib/EXTERNALLY-MANAGED" ] || "$base" -c 'import torch' 2>/dev/null; then
  python3 -m venv --without-pip "$work/base"
  base=$work/base/bin/python3
fi
cat >"$work/bin/python3" <<EOF
#!/bin/sh
# A stock system python3: refuses pip installs into itself (PEP 668) and logs every call.
echo "\$*" >>"$log"
case " \$* " in
  *" -m pip "*" install "*)
    case " \$* " in
      *" --target"* | *" --prefix"* | *" --root "*) ;;
      *) echo "REFUSED \$*" >>"$log"; echo "error: externally-managed-environment" >&2; exit 1 ;;
    esac ;;
esac
exec "$base" "\$@"
EOF
chmod +x "$work/bin/python3"
export PATH="$work/bin:$PATH" MEGAMOE_TORCH=AUTO
unset MEGAMOE_BUILD_DIR MEGAMOE_CMAKE_ARGS VIRTUAL_ENV PYTHONPATH
site_listing() {
  "$base" -c 'import site; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' |
    while read -r dir; do if [ -d "$dir" ]; then ls -a "$dir"; fi; done | sha1sum
}
before=$(site_listing)
: >"$log"
nvcc=0
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then nvcc=1; fi

# run.sh --cpu: the CPU build alone, with progress, and no Python.
start=$(date +%s)
"$tree/scripts/run.sh" --cpu --workload qwen35-a3b --tokens 2 --experts 16 >"$work/run.out" 2>"$work/run.err" ||
  { cat "$work/run.err"; fail "run.sh --cpu exited non-zero"; }
grep -q "rel. L2 error vs unquantized" "$work/run.out" || fail "run.sh printed no CPU reference figures"
if ! grep -q "for the CPU reference only" "$work/run.err" || ! grep -qE '^\[[0-9]+/[0-9]+\] ' "$work/run.err"; then
  cat "$work/run.err"
  fail "run.sh did not show its build (CPU only) and its progress"
fi
[ ! -s "$log" ] || fail "run.sh --cpu called python3: $(cat "$log")"
echo "run.sh --cpu: built the CPU reference and ran it without Python ($(($(date +%s) - start)) s)"

# deps.sh as test.sh runs it (where what it needs is here already: it installs nothing from Debian).
if [ -f /usr/src/googletest/CMakeLists.txt ] || [ -f "$tree/.deps/googletest/CMakeLists.txt" ]; then
  if ((nvcc)) && [ ! -f "$tree/.deps/cutlass/VERSION" ]; then
    echo "deps.sh: not run (no .deps/cutlass in $src to copy; it would download it)"
  else
    "$tree/scripts/deps.sh" 2>"$work/deps.err" || { cat "$work/deps.err"; fail "deps.sh exited non-zero"; }
    grep -q "the Python package and its suites are skipped" "$work/deps.err" ||
      { cat "$work/deps.err"; fail "deps.sh did not skip the Python package"; }
    ((!nvcc)) || grep -q "MEGAMOE_TORCH=ON ./scripts/test.sh creates .venv" "$work/deps.err" ||
      { cat "$work/deps.err"; fail "deps.sh did not say how to get the Python package"; }
    echo "deps.sh: $(grep 'PyTorch:' "$work/deps.err")"
  fi
fi

# deps.sh --dry-run against stand-in torch modules (where nvcc is: without it no torch is looked at).
stub() {  # stub DIR VERSION CUDA
  mkdir -p "$1/torch"
  printf '__version__ = "%s"\n\n\nclass version:\n    cuda = %s\n' "$2" "$3" >"$1/torch/__init__.py"
}
decide() {  # decide STUB_DIR MEGAMOE_TORCH: deps.sh --dry-run's output
  PYTHONPATH=$1 MEGAMOE_TORCH=$2 "$tree/scripts/deps.sh" --dry-run 2>&1 || echo "exit $?"
}
expect() {  # expect OUTPUT TEXT WHAT
  grep -qF -- "$2" <<<"$1" || { echo "$1"; fail "$3: no '$2'"; }
}
if ((nvcc)); then
  stub "$work/cuda13" "2.11.0+cu130" '"13.0"'
  stub "$work/cpu" "2.11.0+cpu" None
  stub "$work/old" "2.9.1+cu130" '"13.0"'
  expect "$(decide "$work/cuda13" AUTO)" "PyTorch: $work/bin/python3 (torch 2.11.0+cu130 for CUDA 13.0): the Python package builds against it" \
    "a user's CUDA 13 torch"
  out=$(decide "$work/cpu" AUTO)
  expect "$out" "none to build against ($work/bin/python3: torch 2.11.0+cpu, a CPU build; no .venv)" "a CPU torch"
  expect "$out" "the Python package and its suites are skipped" "a CPU torch"
  expect "$(decide "$work/old" AUTO)" "none to build against ($work/bin/python3: torch 2.9.1+cu130 for CUDA 13.0" "torch 2.9"
  out=$(decide "$work/cpu" ON)
  expect "$out" "would: creating .venv" "MEGAMOE_TORCH=ON"
  expect "$out" "downloading PyTorch 2.11.0 (the CUDA 13.0 build, from PyPI;" "MEGAMOE_TORCH=ON"
  expect "$(decide "$work/cuda13" OFF)" "PyTorch: MEGAMOE_TORCH=OFF: the Python package and its suites are skipped" "OFF"
  echo "deps.sh --dry-run: a user's CUDA 13 torch used as it is; CPU and old builds passed over; ON would make .venv"
fi

# Nothing went into the interpreter, and no .venv was made.
! grep -q '^REFUSED' "$log" || fail "a pip install into python3 was tried: $(grep '^REFUSED' "$log")"
[ "$(site_listing)" = "$before" ] || fail "the interpreter's site-packages changed"
[ ! -e "$tree/.venv" ] || fail ".venv was created"
echo "nothing installed into $base (behind $work/bin/python3); no .venv"
