"""Run `inv TASK ...` the way a user does (`python -m specops` is the venv's `inv`): a subprocess in the repo,
against a test inventory."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def inv(*args, inventory, timeout=120, env=None, **kwargs) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "SPECOPS_INVENTORY": str(inventory), "SPECOPS_SSH_CONFIG": "none",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "specops", *map(str, args)], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kwargs)
