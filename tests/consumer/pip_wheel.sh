#!/usr/bin/env bash
# pip_wheel.sh SOURCE_DIR WORK_DIR PYTHON: builds the Python package the way the README installs it
# (pip, scikit-build-core, no build isolation), installs the wheel into a scratch folder and runs
# the package's CPU suite against that installed copy rather than the source tree. WORK_DIR/build
# keeps the wheel's CMake build, so a rerun rebuilds only what changed.
set -euo pipefail
src=$1 work=$2 python=$3
# scripts/deps.sh installs scikit-build-core into .venv (MEGAMOE_TORCH=ON); a machine set up otherwise (the GPU machines, which
# have no network) skips this test, except in CI (CI=true), where a skip would hide a missing step.
if ! "$python" -c "import scikit_build_core" 2>/dev/null; then
  echo "pip_wheel: $python has no scikit-build-core (MEGAMOE_TORCH=ON scripts/deps.sh installs it into .venv)"
  [ "${CI:-}" = true ] && exit 1
  exit 77
fi
pip=("$python" -m pip --disable-pip-version-check --quiet)
rm -rf "$work/wheel" "$work/site"
"${pip[@]}" wheel --no-build-isolation --no-deps --wheel-dir "$work/wheel" \
  --config-settings=build-dir="$work/build" "$src"
wheels=("$work"/wheel/megamoe-*.whl)
"${pip[@]}" install --root-user-action=ignore --no-deps --target "$work/site" "${wheels[0]}"

# The suite must import the installed package and its ops library, not the source tree's.
cd "$work"
export PYTHONPATH="$work/site"
unset MEGAMOE_OPS_LIBRARY
"$python" -c "
import pathlib, sys, megamoe, megamoe._ops
site = pathlib.Path('$work/site').resolve()
for path in (megamoe.__file__, megamoe._ops._library_path()):
    if site not in pathlib.Path(path).resolve().parents:
        sys.exit(f'megamoe was imported from {path}, outside the installed wheel ({site})')
print('installed wheel:', '${wheels[0]##*/}', 'ops library:', megamoe._ops._library_path().name)
"
"$python" -m pytest -q -p no:cacheprovider -m "not gpu" "$src/tests/python"
