"""Shared fixtures, one module per area (tests/helpers/fixtures_<area>.py, listed in pytest_plugins below).

`--repeat N` runs each selected test N times, its module's fixtures (one vLLM, one host) shared:
the loop that tells a race fixed from a race missed by luck, e.g.
`pytest --repeat 10 tests/host/test_runs.py`.
"""
import os
import signal
import time

import pytest

from tests.helpers.capability import in_ci

# The whole suite's budget under CI=true: a slow creep fails the run when it happens, not at CI's hard
# limit. docs/test-suite.md keeps the measured wall times.
SUITE_BUDGET_S = float(os.environ.get("SPECOPS_SUITE_BUDGET_S", 55 * 60))
_STARTED = time.monotonic()

# A shell's `cmd &` starts cmd with SIGINT ignored, and children inherit that: the tests that press Ctrl-C
# on `inv logs --follow` or `inv tunnel` would then wait forever. A Python handler is reset to the
# default in every child, so Ctrl-C reaches them however the suite was started.
signal.signal(signal.SIGINT, signal.default_int_handler)

pytest_plugins = ["tests.helpers.fixtures_hosts", "tests.helpers.fixtures_vllm", "tests.helpers.fixtures_train"]


def pytest_addoption(parser):
    parser.addoption("--repeat", type=int, default=1, metavar="N", help="run each selected test N times")


@pytest.fixture
def _repeat(request):
    return request.param


def pytest_generate_tests(metafunc):
    times = metafunc.config.getoption("--repeat")
    if times > 1:
        metafunc.fixturenames.append("_repeat")
        metafunc.parametrize("_repeat", range(1, times + 1), indirect=True, ids=lambda i: f"run{i}")


def pytest_sessionfinish(session, exitstatus):
    took = time.monotonic() - _STARTED
    if in_ci() and took > SUITE_BUDGET_S and exitstatus == 0:
        session.config.get_terminal_writer().line(
            f"\nthe suite took {took / 60:.1f} min, over its budget of {SUITE_BUDGET_S / 60:.0f} min "
            f"(SPECOPS_SUITE_BUDGET_S): make the slowest tests faster (--durations lists them)", red=True)
        session.exitstatus = 1
