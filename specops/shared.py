"""Modules of ``remote/`` that the laptop shares with the hosts, loaded from the tree deploy ships.

They are stdlib only, so one definition serves both sides (a run's manifest, vLLM's extraction
configs) without this package importing the remote scripts' dependencies.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

REMOTE = Path(__file__).resolve().parent.parent / "remote"


def remote_module(name: str):
    """remote/NAME.py as a module of its own (``specops_remote_NAME``)."""
    spec = importlib.util.spec_from_file_location(f"specops_remote_{name}", REMOTE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
