"""One version number: python/megamoe/_version.py holds it, and megamoe.__version__, the wheel's
metadata (pyproject.toml reads the file through scikit-build-core) and CMake's project version say
the same."""

import importlib.metadata
import os
import pathlib
import re

import pytest

import megamoe

ROOT = pathlib.Path(__file__).resolve().parents[2]
VERSION_FILE = "python/megamoe/_version.py"


def file_version():
    text = (ROOT / VERSION_FILE).read_text()
    # The one form every reader parses: CMake's regex, scikit-build-core's and Python's own.
    match = re.search(r'^__version__ = "([0-9]+\.[0-9]+\.[0-9]+)"$', text, re.MULTILINE)
    assert match, f'{VERSION_FILE} holds no line __version__ = "X.Y.Z"'
    return match.group(1)


def test_package_version_is_the_files():
    assert megamoe.__version__ == file_version()


def test_pyproject_takes_the_version_from_the_file():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    with open(ROOT / "pyproject.toml", "rb") as f:
        pyproject = tomllib.load(f)
    assert "version" not in pyproject["project"], "a second version number in pyproject.toml"
    assert "version" in pyproject["project"].get("dynamic", [])
    assert pyproject["tool"]["scikit-build"]["metadata"]["version"] == {
        "provider": "scikit_build_core.metadata.regex",
        "input": VERSION_FILE,
    }


def test_scikit_build_core_reads_the_files_version(monkeypatch):
    regex = pytest.importorskip("scikit_build_core.metadata.regex")
    monkeypatch.chdir(ROOT)  # the provider's input is relative to the project
    assert str(regex.dynamic_metadata("version", {"input": VERSION_FILE})) == file_version()


def test_installed_metadata_agrees():
    """Where megamoe is imported from an installed wheel (tests/consumer/pip_wheel.sh)."""
    try:
        dist = importlib.metadata.distribution("megamoe")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megamoe is imported from the source tree, not an installed wheel")
    installed = pathlib.Path(dist.locate_file("megamoe/__init__.py")).resolve()
    if installed != pathlib.Path(megamoe.__file__).resolve():
        pytest.skip(f"the installed megamoe ({installed}) is not the one imported ({megamoe.__file__})")
    assert dist.version == file_version()


def test_cmake_project_version_agrees():
    """Where CTest runs the suite, against the ops library of a CMake build (tests/CMakeLists.txt)."""
    library = os.environ.get("MEGAMOE_OPS_LIBRARY")
    cache = pathlib.Path(library).resolve().parents[2] / "CMakeCache.txt" if library else None
    if cache is None or not cache.is_file():
        pytest.skip("not run from a CMake build (no MEGAMOE_OPS_LIBRARY beside a CMakeCache.txt)")
    match = re.search(r"^CMAKE_PROJECT_VERSION:STATIC=(.*)$", cache.read_text(), re.MULTILINE)
    assert match and match.group(1) == file_version()
