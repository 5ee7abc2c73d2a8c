"""pytest setup for the Python package's tests: the `gpu` marker, and a fixture that skips (or,
with MEGAMOE_REQUIRE_GPU=1, fails) where no Hopper GPU is visible. CTest runs these suites with
PYTHONPATH at python/ and MEGAMOE_OPS_LIBRARY at the built ops library (tests/CMakeLists.txt)."""

import os
import random

import pytest
import torch

# Fresh random data each run; MEGAMOE_TEST_SEED=<n> replays a run (pytest prints the seed).
SEED = int(os.environ.get("MEGAMOE_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return f"MEGAMOE_TEST_SEED={SEED}"


def pytest_terminal_summary(terminalreporter):
    # Also under -q (CTest's runs), which leaves out the header.
    terminalreporter.write_line(f"MEGAMOE_TEST_SEED={SEED} replays this run's random data")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a Hopper GPU (sm_90)")


@pytest.fixture(scope="session")
def hopper():
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA device visible"
    elif torch.cuda.get_device_capability() != (9, 0):
        reason = f"{torch.cuda.get_device_name()} is not a Hopper GPU (sm_90)"
    if reason is not None:
        if os.environ.get("MEGAMOE_REQUIRE_GPU") == "1":
            pytest.fail(f"MEGAMOE_REQUIRE_GPU=1, but {reason}")
        pytest.skip(reason)
    return torch.device("cuda", torch.cuda.current_device())
