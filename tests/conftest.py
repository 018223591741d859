"""Shared fixtures, one module per area (tests/fixtures_<area>.py)."""
pytest_plugins = ["tests.fixtures_hosts", "tests.fixtures_vllm", "tests.fixtures_train"]
