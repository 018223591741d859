"""Glue between Invoke tasks and specops: host selection and clean user errors."""

from __future__ import annotations

import functools
import sys

import invoke

from . import inventory
from .errors import SpecopsError


def task(*args, **kwargs):
    """``invoke.task`` whose SpecopsErrors become one line on stderr and an exit code."""

    def decorate(body):
        @functools.wraps(body)
        def wrapper(c, *a, **kw):
            try:
                code = body(c, *a, **kw)
            except SpecopsError as e:
                raise invoke.Exit(f"error: {e}", code=e.exit_code) from None
            if code:
                raise invoke.Exit(code=code)

        return invoke.task(*args, **kwargs)(wrapper)

    return decorate


def select_hosts(c, inventory_path: str | None, on: str | None):
    """The hosts for ``--on`` (default: invoke.yaml's specops.on, else the 'local' group)."""
    inv = inventory.load(inventory_path or c.config.get("specops", {}).get("inventory"))
    return inv.select(on or c.config.get("specops", {}).get("on"))


HOST_HELP = {
    "on": "host or group to act on (default: invoke.yaml specops.on, else 'local')",
    "inventory": "inventory file (default: $SPECOPS_INVENTORY or inventory.yaml)",
}


def remainder() -> list[str]:
    """Arguments after ``--`` on the command line, token for token (passed on to a remote script).

    Invoke keeps only a space-joined string of them, which loses quoting; argv does not.
    """
    return sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
