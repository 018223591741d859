"""What every remote script shares: the one-line refusal and the machine progress line.

A script raises :class:`Refused` for bad input or state; :func:`main_of` turns it into one line on
stderr and exit code 2, never a traceback. :func:`progress` prints the ``specops-progress {json}``
line that the laptop's watcher (specops.progress) reads from the run's log.
"""
import json
import os
import sys

PROGRESS_PREFIX = "specops-progress "
PROGRESS_EVERY_S = 5.0  # seconds between progress lines while a script works


class Refused(Exception):
    """Bad input or state: one line on stderr, exit 2."""


def progress(**fields) -> None:
    """One machine line (rank 0 only, under torchrun)."""
    if int(os.environ.get("RANK", 0)) != 0:
        return
    print(PROGRESS_PREFIX + json.dumps(fields, separators=(",", ":")), flush=True)


def main_of(main, name: str) -> None:
    """Run a script's ``main()``: its return value is the exit code, a :class:`Refused` is one line."""
    try:
        sys.exit(main())
    except Refused as e:
        print(f"{name}: {e}", file=sys.stderr)
        sys.exit(2)
