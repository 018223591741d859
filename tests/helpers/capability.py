"""The one rule for tests that need a real part (sshd, netns, nspawn, vLLM).

On a laptop a missing capability skips with a reason; under CI=true it fails,
because a skipped real-host test in CI hides a missing install step.
"""
import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(ok: bool, reason: str) -> None:
    """Skip (laptop) or fail (CI) when a needed capability is absent."""
    if ok:
        return
    if in_ci():
        pytest.fail(f"missing capability under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)
