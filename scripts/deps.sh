#!/usr/bin/env bash
# Installs everything megamoe builds with, idempotently; CI calls it on a fresh machine.
#   - cmake, ninja, g++ and GoogleTest sources from Debian's packages (when missing)
#   - CUTLASS/CuTe headers from the pip package nvidia-cutlass into .deps/cutlass/include
#   - a copy of the GoogleTest sources in .deps/googletest, so the GPU machine (no network)
#     can build the tests from what travels with the working tree
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
deps="$root/.deps"
cutlass_version=4.2.0.0

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v g++ >/dev/null || missing+=(g++)
command -v python3 >/dev/null || missing+=(python3 python3-pip)
[ -f /usr/src/googletest/CMakeLists.txt ] || missing+=(googletest)
if [ ${#missing[@]} -gt 0 ]; then
  echo "[deps] installing Debian packages: ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then sudo=sudo; else sudo=; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

mkdir -p "$deps"
if [ "$(cat "$deps/cutlass/VERSION" 2>/dev/null)" != "$cutlass_version" ]; then
  echo "[deps] installing CUTLASS/CuTe headers (pip nvidia-cutlass==$cutlass_version)"
  staging=$(mktemp -d)
  trap 'rm -rf "$staging"' EXIT
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$staging" \
    "nvidia-cutlass==$cutlass_version"
  headers="$staging/cutlass_library/source/include"
  if [ ! -f "$headers/cute/tensor.hpp" ] || [ ! -f "$headers/cutlass/cutlass.h" ]; then
    echo "[deps] error: the nvidia-cutlass wheel carries no C++ headers at cutlass_library/source/include" >&2
    exit 1
  fi
  rm -rf "$deps/cutlass"
  mkdir -p "$deps/cutlass"
  cp -r "$headers" "$deps/cutlass/include"
  echo "$cutlass_version" > "$deps/cutlass/VERSION"
fi

# The Python package (python/) builds against the python3 on PATH's PyTorch, and its tests run
# under pytest (with matplotlib for the benchmark's plot, transformers for the Hugging Face
# example's layout check): PyPI's torch 2.11 is the CUDA 13.0 build the GPU machines carry.
# scikit-build-core is the build backend of `pip install --no-build-isolation .` (pyproject.toml).
# MEGAMOE_TORCH=OFF skips them all (CMake then skips the package too).
if [ "${MEGAMOE_TORCH:-AUTO}" != OFF ] &&
  ! python3 -c "import torch, pytest, numpy, matplotlib, transformers, scikit_build_core" 2>/dev/null; then
  echo "[deps] installing PyTorch 2.11 (CUDA 13.0 build), pytest, numpy, matplotlib, transformers and" \
    "scikit-build-core with pip"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "torch==2.11.0" pytest numpy \
    matplotlib "transformers>=5" "scikit-build-core>=0.10"
fi

if [ ! -f "$deps/googletest/CMakeLists.txt" ]; then
  cp -r /usr/src/googletest "$deps/googletest"
fi
echo "[deps] ready: cutlass $(cat "$deps/cutlass/VERSION"), googletest at .deps/googletest"
