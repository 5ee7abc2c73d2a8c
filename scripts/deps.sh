#!/usr/bin/env bash
# What megamoe builds and tests with, for users and CI: finds what is already there, installs only
# what is missing and says what before it does. run.sh and test.sh source it (its decisions are then
# left in the deps_* variables below); run on its own it prints them. Idempotent.
#   scripts/deps.sh [--cpu-only] [--dry-run]
#     --cpu-only  only what a CPU build of megamoe-bench needs (cmake, ninja, g++): no GoogleTest,
#                 no CUTLASS, no Python (run.sh on a machine without a GPU)
#     --dry-run   say what would be installed or downloaded and what is decided; change nothing
#   MEGAMOE_TORCH  the Python package (torch.ops.megamoe) and its suites:
#     AUTO (default)  built against a PyTorch that is already there, a CUDA 13 build of 2.11 or later
#                     in the python3 on PATH (used as it is: nothing is installed into it) or else in
#                     the project's .venv; without one they are skipped, saying how to get them
#     ON              the same, but without one .venv is created with PyTorch 2.11 from PyPI
#     OFF             skipped
# Each only where missing:
#   - Debian packages (apt-get; through sudo when not root): cmake, ninja-build, g++, googletest, and
#     python3-venv when .venv is to be created
#   - CUTLASS/CuTe headers, when nvcc is found: the wheel nvidia-cutlass, downloaded with pip (into
#     no interpreter) and unpacked into .deps/cutlass/include
#   - a copy of GoogleTest in .deps/googletest, so that the GPU machines (no network) build the
#     tests from what travels with the working tree
#   - .venv (ignored by git), a virtual environment of the python3 on PATH: with PyTorch and the test
#     tooling under MEGAMOE_TORCH=ON; bare when only a pip is needed and that python3 has none
# It never installs into the user's interpreter, so never replaces an installed torch or transformers.
set -euo pipefail
deps_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
deps_dir=$deps_root/.deps
deps_venv=$deps_root/.venv
deps_cutlass_version=4.2.0.0
deps_torch_pin=2.11.0
deps_torch_size="about 3 GB to download, 5 GB in .venv"
# The test tooling .venv gets with PyTorch: pytest runs the suites; numpy, matplotlib (the bench's
# plot) and transformers (the Hugging Face layout check) serve cases that skip without them;
# scikit-build-core builds the wheel (tests/consumer/pip_wheel.sh).
deps_tools=(pytest numpy matplotlib "transformers>=5" "scikit-build-core>=0.10")

deps_cpu_only=0
deps_dry_run=0
for deps_arg in "$@"; do
  case $deps_arg in
    --cpu-only) deps_cpu_only=1 ;;
    --dry-run) deps_dry_run=1 ;;
    --) ;;
    *) echo "usage: scripts/deps.sh [--cpu-only] [--dry-run]" >&2; exit 2 ;;
  esac
done
deps_mode=${MEGAMOE_TORCH:-AUTO}
deps_mode=${deps_mode^^}
case $deps_mode in
  AUTO | ON | OFF) ;;
  *) echo "[deps] MEGAMOE_TORCH is '$MEGAMOE_TORCH'; it takes AUTO, ON or OFF" >&2; exit 2 ;;
esac

# The decisions, for run.sh and test.sh:
deps_python=""        # the interpreter CMake is given (-DPython3_EXECUTABLE); empty: none found
deps_torch=OFF        # whether the Python package is built (-DMEGAMOE_TORCH)
deps_python_note=""   # why it is not, when it is not
deps_suites_note=""   # why its pytest suites cannot run although it is built (no pytest there)

deps_say() { echo "[deps] $*" >&2; }
# deps_join SEPARATOR ITEM...: the items joined by SEPARATOR.
deps_join() {
  local separator=$1 out=${2:-} item
  shift 2 || shift
  for item; do out+=$separator$item; done
  echo "$out"
}
# Says what is about to happen and returns 0, or, with --dry-run, what would, and returns 1.
deps_will() {
  if ((deps_dry_run)); then
    deps_say "would: $*"
    return 1
  fi
  deps_say "$*"
}

if [ -d /usr/local/cuda/bin ] && [[ ":$PATH:" != *:/usr/local/cuda/bin:* ]]; then
  export PATH="$PATH:/usr/local/cuda/bin"
fi
deps_nvcc=0
if ((!deps_cpu_only)) && command -v nvcc >/dev/null; then deps_nvcc=1; fi

# Prints "TORCH CUDA MISSING" for interpreter $1: its torch's version ("none" without one), the CUDA
# version it was built for ("none" for a CPU build) and the test tooling it lacks ("-": none).
deps_probe() {
  "$1" - 2>/dev/null <<'EOF' || echo "none none -"
import importlib.util
missing = [m for m in ("pytest", "numpy", "matplotlib", "transformers", "scikit_build_core")
           if importlib.util.find_spec(m) is None]
try:
    import torch
    version, cuda = torch.__version__, torch.version.cuda or "none"
except Exception:  # no torch, or one that does not import
    version, cuda = "none", "none"
print(version, cuda, ",".join(missing) or "-")
EOF
}

# Whether torch $1, built for CUDA $2, is one the ops library builds against: CUDA 13, 2.11 or later.
deps_torch_fits() {
  local version=${1%%+*} major minor
  major=${version%%.*}
  minor=${version#*.}
  minor=${minor%%.*}
  [[ ($2 == 13 || $2 == 13.*) && $major =~ ^[0-9]+$ && $minor =~ ^[0-9]+$ ]] || return 1
  ((major > 2 || (major == 2 && minor >= 11)))
}

deps_describe() {
  if [ "$1" = none ]; then
    echo "no torch"
  elif [ "$2" = none ]; then
    echo "torch $1, a CPU build"
  else
    echo "torch $1 for CUDA $2"
  fi
}

# The pip spellings of the tooling modules in $1 (comma-separated).
deps_tool_specs() {
  local module
  for module in ${1//,/ }; do
    case $module in
      transformers) echo "transformers>=5" ;;
      scikit_build_core) echo "scikit-build-core>=0.10" ;;
      *) echo "$module" ;;
    esac
  done
}

deps_path_python=$(command -v python3 || true)
deps_venv_python=""
[ -x "$deps_venv/bin/python" ] && deps_venv_python=$deps_venv/bin/python
deps_make_venv=0      # create .venv
deps_venv_why=""      # for what
deps_venv_torch=0     # install PyTorch and the tooling into .venv
deps_venv_tools=""    # install these tooling modules into .venv (it has PyTorch)
deps_torch_line=""

# ---- PyTorch: which interpreter the Python package builds against, if any
if ((deps_cpu_only)); then
  deps_python_note="a CPU-only build"
elif [ "$deps_mode" = OFF ]; then
  deps_python_note="MEGAMOE_TORCH=OFF"
elif ((!deps_nvcc)); then
  if [ "$deps_mode" = ON ]; then
    deps_say "MEGAMOE_TORCH=ON, but nvcc is not found (on PATH or in /usr/local/cuda/bin): the ops library" \
      "is CUDA code; install the CUDA 13 toolkit"
    exit 1
  fi
  deps_python_note="no nvcc: the CUDA targets, the ops library among them, are not built"
else
  deps_seen=()
  for deps_candidate in "$deps_path_python" "$deps_venv_python"; do
    [ -n "$deps_candidate" ] || continue
    # A python3 on PATH inside .venv (an activated .venv) is .venv's: probed once.
    [ "$deps_candidate" = "$deps_venv_python" ] && [[ $deps_path_python == "$deps_venv"/* ]] && continue
    read -r deps_v deps_c deps_missing < <(deps_probe "$deps_candidate")
    if deps_torch_fits "$deps_v" "$deps_c"; then
      deps_python=$deps_candidate
      deps_torch=ON
      deps_torch_line="$deps_candidate ($(deps_describe "$deps_v" "$deps_c")): the Python package builds against it"
      break
    fi
    deps_seen+=("$deps_candidate: $(deps_describe "$deps_v" "$deps_c")")
  done
  [ -n "$deps_venv_python" ] || deps_seen+=("no .venv")
  deps_seen_text=$(deps_join "; " "${deps_seen[@]}")
  if [ "$deps_torch" = ON ]; then
    if [ "$deps_missing" != - ]; then
      if [[ $deps_python == "$deps_venv"/* ]]; then
        deps_venv_tools=$deps_missing  # ours: completed below
      else
        deps_lacking=${deps_missing//,/ }
        deps_lacking=${deps_lacking//_/-}  # pip's names
        if [[ ,$deps_missing, == *,pytest,* ]]; then
          # shellcheck disable=SC2034  # read by test.sh
          deps_suites_note="no pytest in $deps_python (nothing is installed into it: pip install pytest there to run them)"
          deps_say "$deps_python lacks $deps_lacking: the Python suites (pytest) do not run; nothing is installed" \
            "into it (pip install $deps_lacking there to run them)"
        else
          deps_say "$deps_python lacks $deps_lacking: the cases that need them skip; nothing is installed into it" \
            "(pip install $deps_lacking there to run them)"
        fi
      fi
    fi
  elif [ "$deps_mode" = ON ]; then
    deps_make_venv=1
    deps_venv_torch=1
    deps_venv_why="for PyTorch"
  else
    deps_python_note="no PyTorch to build against ($deps_seen_text; it takes a CUDA 13 build of 2.11 or later)"
    deps_torch_line="none to build against ($deps_seen_text): the Python package and its suites are skipped;"
    deps_torch_line+=" MEGAMOE_TORCH=ON ./scripts/test.sh creates .venv with PyTorch $deps_torch_pin ($deps_torch_size)"
  fi
fi

# ---- CUTLASS: wanted where nvcc is; any pip downloads the wheel (pip download installs nothing)
deps_cutlass_wanted=0
deps_pip_python=""
if ((deps_nvcc)) && [ "$(cat "$deps_dir/cutlass/VERSION" 2>/dev/null)" != "$deps_cutlass_version" ]; then
  deps_cutlass_wanted=1
  if [ -n "$deps_venv_python" ] || ((deps_make_venv)); then
    deps_pip_python=$deps_venv/bin/python
  elif [ -n "$deps_path_python" ] && "$deps_path_python" -m pip --version >/dev/null 2>&1; then
    deps_pip_python=$deps_path_python
  else
    deps_make_venv=1
    deps_venv_why="for its pip, which downloads the CUTLASS wheel"
    deps_pip_python=$deps_venv/bin/python
  fi
fi

# ---- Debian packages
deps_packages=()
command -v cmake >/dev/null || deps_packages+=(cmake)
command -v ninja >/dev/null || deps_packages+=(ninja-build)
command -v g++ >/dev/null || deps_packages+=(g++)
command -v xz >/dev/null || deps_packages+=(xz-utils)  # the GPU scripts' prebuilt packs (and their test)
if ((!deps_cpu_only)) && [ ! -f "$deps_dir/googletest/CMakeLists.txt" ] && [ ! -f /usr/src/googletest/CMakeLists.txt ]; then
  deps_packages+=(googletest)
fi
if ((deps_make_venv)) && [ -z "$deps_venv_python" ]; then
  if [ -z "$deps_path_python" ]; then
    deps_packages+=(python3 python3-venv)
  elif ! "$deps_path_python" -c "import ensurepip, venv" 2>/dev/null; then
    deps_packages+=(python3-venv)  # Debian's python3 makes virtual environments only with it
  fi
fi
if ((${#deps_packages[@]})); then
  if ! command -v apt-get >/dev/null; then
    deps_say "missing: ${deps_packages[*]} (Debian's names); install them with this system's package manager"
    exit 1
  fi
  deps_sudo=()
  deps_how=""
  if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null; then
      deps_say "missing Debian packages: ${deps_packages[*]}; install them as root (apt-get install ${deps_packages[*]})"
      exit 1
    fi
    deps_sudo=(sudo)
    deps_how=" with sudo (you are not root)"
  fi
  if deps_will "installing Debian packages$deps_how: ${deps_packages[*]}"; then
    "${deps_sudo[@]}" apt-get update -qq
    "${deps_sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      "${deps_packages[@]}" >&2
  fi
  deps_path_python=$(command -v python3 || true)
fi

# ---- .venv: the project's own virtual environment, for PyTorch or for a pip
if ((deps_make_venv)) && [ -z "$deps_venv_python" ]; then
  if deps_will "creating .venv, a virtual environment of ${deps_path_python:-python3} $deps_venv_why (ignored by git)"; then
    "$deps_path_python" -m venv "$deps_venv" || {
      rm -rf "$deps_venv"
      deps_say "error: $deps_path_python -m venv failed (on Debian/Ubuntu it needs the package python3-venv)"
      exit 1
    }
  fi
  deps_venv_python=$deps_venv/bin/python
fi
if ((deps_venv_torch)); then
  if deps_will "MEGAMOE_TORCH=ON and no PyTorch to build against ($deps_seen_text): downloading PyTorch" \
    "$deps_torch_pin (the CUDA 13.0 build, from PyPI; $deps_torch_size) and ${deps_tools[*]} into .venv"; then
    "$deps_venv_python" -m pip install --disable-pip-version-check "torch==$deps_torch_pin" "${deps_tools[@]}" >&2
    read -r deps_v deps_c deps_missing < <(deps_probe "$deps_venv_python")
    if ! deps_torch_fits "$deps_v" "$deps_c"; then
      deps_say "error: .venv has $(deps_describe "$deps_v" "$deps_c") after the install, not a CUDA 13 build"
      exit 1
    fi
    deps_torch_line="$deps_venv_python ($(deps_describe "$deps_v" "$deps_c")): the Python package builds against it"
  else
    deps_torch_line="$deps_venv_python, once PyTorch $deps_torch_pin is in: the Python package would build against it"
  fi
  deps_python=$deps_venv_python
  deps_torch=ON
fi
if [ -n "$deps_venv_tools" ]; then
  mapfile -t deps_specs < <(deps_tool_specs "$deps_venv_tools")
  if deps_will "installing ${deps_specs[*]} into .venv (it has PyTorch but not them)"; then
    "$deps_venv_python" -m pip install --quiet --disable-pip-version-check "${deps_specs[@]}" >&2
  fi
fi

# ---- CUTLASS/CuTe headers
if ((deps_cutlass_wanted)); then
  if deps_will "downloading the CUTLASS/CuTe headers (the wheel nvidia-cutlass==$deps_cutlass_version, 6 MB," \
    "with the pip of $deps_pip_python, into no interpreter) to .deps/cutlass"; then
    deps_staging=$deps_dir/.staging
    rm -rf "$deps_staging"
    mkdir -p "$deps_staging"
    "$deps_pip_python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --dest "$deps_staging" "nvidia-cutlass==$deps_cutlass_version" >&2
    deps_wheels=("$deps_staging"/nvidia_cutlass-*.whl)
    "$deps_pip_python" -m zipfile -e "${deps_wheels[0]}" "$deps_staging/wheel"
    deps_headers=$deps_staging/wheel/cutlass_library/source/include
    if [ ! -f "$deps_headers/cute/tensor.hpp" ] || [ ! -f "$deps_headers/cutlass/cutlass.h" ]; then
      deps_say "error: the nvidia-cutlass wheel carries no C++ headers at cutlass_library/source/include"
      exit 1
    fi
    rm -rf "$deps_dir/cutlass"
    mkdir -p "$deps_dir/cutlass"
    mv "$deps_headers" "$deps_dir/cutlass/include"
    echo "$deps_cutlass_version" >"$deps_dir/cutlass/VERSION"
    rm -rf "$deps_staging"
  fi
fi

# ---- GoogleTest sources, to travel with the working tree
if ((!deps_cpu_only)) && [ ! -f "$deps_dir/googletest/CMakeLists.txt" ]; then
  if deps_will "copying /usr/src/googletest to .deps/googletest"; then
    mkdir -p "$deps_dir"
    cp -r /usr/src/googletest "$deps_dir/googletest"
  fi
fi

# ---- What was decided
# The interpreter CMake is given even without the Python package, so that it does not settle on
# another one (its CPU tests of tools/ run under it).
[ -n "$deps_python" ] || deps_python=$deps_path_python
deps_ready=("cmake $(cmake --version 2>/dev/null | head -1 | awk '{print $3}')")
if ((deps_nvcc)); then
  deps_ready+=("nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')")
  deps_ready+=("CUTLASS $(cat "$deps_dir/cutlass/VERSION" 2>/dev/null || echo "$deps_cutlass_version (not yet)") in .deps/cutlass")
elif ((!deps_cpu_only)); then
  deps_ready+=("no nvcc: CPU targets only")
fi
((deps_cpu_only)) || deps_ready+=("GoogleTest in .deps/googletest")
deps_say "ready: $(deps_join ", " "${deps_ready[@]}")"
if ((!deps_cpu_only)); then
  deps_say "PyTorch: ${deps_torch_line:-$deps_python_note: the Python package and its suites are skipped}"
fi
