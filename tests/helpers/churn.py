"""Races made to happen: a second process churning files in a directory, and listings whose entries vanish
before the caller sees them (the vanishing-files tests)."""
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path


# Creates and deletes files named by argv[2:] patterns ({i} a counter) in argv[1], old mtime, until killed.
CHURN = r"""
import os, sys, time
root, patterns = sys.argv[1], sys.argv[2:]
i = 0
while True:
    made = []
    for k in range(200):
        for p in patterns:
            path = os.path.join(root, p.format(i=i * 200 + k))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(b"x" * 4096)
            os.utime(path, (1, 1))
            made.append(path)
    for path in made:
        try:
            os.remove(path)
            if os.path.dirname(path) != root:
                os.rmdir(os.path.dirname(path))
        except OSError:
            pass
    i += 1
"""


@contextlib.contextmanager
def churning(root: Path, *patterns: str):
    """A second process creating and deleting files under root while the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", CHURN, str(root), *patterns])
    try:
        deadline = time.monotonic() + 10
        while not any(root.rglob("*")) and time.monotonic() < deadline:  # churning has begun
            time.sleep(0.01)
        yield
    finally:
        proc.kill()
        proc.wait()


def repeat(times: int, fn) -> None:
    for _ in range(times):
        fn()


@contextlib.contextmanager
def vanishing_scandir(module):
    """module's os.scandir lists as usual, then deletes every file it listed before the caller sees it."""
    def listing(path):
        entries = list(os.scandir(path))
        for e in entries:
            os.remove(e.path)
        return iter(entries)

    original = module.os
    module.os = type(sys)("os_with_vanishing_scandir")
    module.os.__dict__.update(os.__dict__)
    module.os.scandir = listing
    try:
        yield
    finally:
        module.os = original


def plant(root: Path, names: list[str], old: bool = True) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for n in names:
        (root / n).write_bytes(b"y" * 100)
        if old:
            os.utime(root / n, (1, 1))
