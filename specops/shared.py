"""Modules of ``remote/`` that the laptop shares with the hosts, loaded from the tree deploy ships.

They are stdlib only, so one definition serves both sides (the workdir's and a run directory's file
names, a run's manifest, vLLM's extraction configs) without this package importing the remote
scripts' dependencies.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

REMOTE = Path(__file__).resolve().parent.parent / "remote"
# Shared modules import these siblings by bare name, as every script does on a host (where remote/ is
# the script's own folder); here each is lent under that name while a shared module loads, so the
# laptop's own import namespace never gains a top-level ``layout``.
SIBLINGS = ("layout",)


def remote_module(name: str):
    """remote/NAME.py as a module of its own (``specops_remote_NAME``)."""
    lent = {sibling: _sibling(sibling) for sibling in SIBLINGS if sibling != name}
    saved = {sibling: sys.modules.get(sibling) for sibling in lent}
    spec = importlib.util.spec_from_file_location(f"specops_remote_{name}", REMOTE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.update(lent)
    try:
        spec.loader.exec_module(module)
    finally:
        for sibling, before in saved.items():
            if before is None:
                sys.modules.pop(sibling, None)
            else:
                sys.modules[sibling] = before
    return module


@functools.cache
def _sibling(name: str):
    return remote_module(name)


layout = _sibling("layout")  # every file and folder name of a workdir and a run directory
