"""Shared fixtures, one module per area (tests/fixtures_<area>.py).

`--repeat N` runs each selected test N times, its module's fixtures (one vLLM, one host) shared:
the loop that tells a race fixed from a race missed by luck (issue 18), e.g.
`pytest --repeat 10 tests/host/test_runs.py`.
"""
import signal

import pytest

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
