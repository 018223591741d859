"""Shared fixtures, one module per area (tests/fixtures_<area>.py).

`--repeat N` runs each selected test N times in a row, its module's fixtures (one vLLM, one host) shared:
the loop that tells a race fixed from a race missed by luck (issue 18), e.g.
`pytest --repeat 10 tests/test_runs.py`.
"""
pytest_plugins = ["tests.fixtures_hosts", "tests.fixtures_vllm", "tests.fixtures_train"]


def pytest_addoption(parser):
    parser.addoption("--repeat", type=int, default=1, metavar="N", help="run each selected test N times in a row")


def pytest_collection_modifyitems(config, items):
    times = config.getoption("--repeat")
    if times > 1:
        items[:] = [item for item in items for _ in range(times)]
