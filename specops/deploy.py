"""`inv deploy`: put the project's deployable tree on a host, as a delta.

What travels (DEPLOY_SET): ``remote/`` (the scripts that do the GPU work), ``templates/``
(service files), ``requirements/`` (what `inv deps` installs) and ``examples/`` (the demo's
prompt file) — into ``<workdir>/code/``. Never ``.git``, venvs, caches, datasets,
checkpoints or anything ``.gitignore`` names. ``--delete`` prunes stale files inside
``code/`` only, and only a ``code/`` specops made (:mod:`specops.owned`: a user's own ``~/code``
is refused); run outputs live in ``<workdir>/runs`` and ``<workdir>/data``, out of reach.

rsync is used with the host's exact SSH settings (Session.rsync_location); when rsync is
missing here or there, files go over SFTP, comparing size and mtime so only changed
files are sent. ``code/VERSION`` records the git commit deployed (runs put it in their
meta.json).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import deps, fanout, owned, transfer
from .host import Session
from .shared import layout

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEPLOY_SET = ("remote", "templates", "requirements", "examples")
# A workdir's own folders are named too: a local host's workdir may be this checkout.
NEVER = (".git/", ".venv/", f"{layout.VENV}/", "__pycache__/", "*.pyc", ".cache/", ".pytest_cache/", f"{layout.DATA}/",
         f"{layout.RUNS}/", "artifacts/", "checkpoints/", "*.safetensors", "*.bin", "*.pt", "*.ckpt", "*.arrow",
         "*.parquet")


@dataclass
class SyncResult:
    files_changed: int
    bytes_sent: int
    seconds: float
    method: str
    changes: list[str]

    def row(self) -> dict:
        return {"method": self.method, "files_changed": self.files_changed,
                "bytes_sent": self.bytes_sent, "seconds": round(self.seconds, 2)}


def deploy(session: Session, *, root: Path = PROJECT_ROOT, delete: bool = True, dry_run: bool = False) -> SyncResult:
    """Sync the deployable tree to ``<workdir>/code``; returns what changed.

    The rsync path is one rsync process and nothing else (it creates the directory and
    carries VERSION), so a no-op deploy costs about what a raw no-op rsync costs.
    """
    start = time.monotonic()
    owned.claim(session, layout.CODE, write=not dry_run)  # --delete must never reach a directory it did not make
    with tempfile.TemporaryDirectory(prefix="specops-version-") as tmp:
        version = _version_file(root, Path(tmp))
        filters = [*[f"--exclude={p}" for p in NEVER], "--filter=:- .gitignore", f"--include=/{layout.VERSION}",
                   *[f"--include=/{d}/***" for d in DEPLOY_SET], "--exclude=*"]
        pushed = transfer.push_tree(session, layout.code_dir(session.workdir), [f"{root}/", str(version)], filters,
                                    lambda: {**deployable_files(root), layout.VERSION: version},
                                    delete=delete, dry_run=dry_run, rerun="rerun `inv deploy`", keep=(owned.MARK,))
    return SyncResult(len(pushed.changes), pushed.bytes_sent, time.monotonic() - start, pushed.method,
                      pushed.changes)


def _version_file(root: Path, tmp: Path) -> Path:
    """code/VERSION: the deployed git commit; its mtime is the commit's, so an unchanged
    version is never re-sent."""
    git = ["git", "-C", str(root)]
    described = subprocess.run(git + ["describe", "--always", "--dirty", "--abbrev=12"], capture_output=True, text=True)
    stamp = subprocess.run(git + ["log", "-1", "--format=%ct"], capture_output=True, text=True).stdout.strip()
    path = tmp / layout.VERSION
    path.write_text((described.stdout.strip() or "unknown") + "\n")
    os.utime(path, (int(stamp or 0), int(stamp or 0)))
    return path


def deployable_files(root: Path) -> dict[str, Path]:
    """The files deploy sends (relative path -> local path), honouring .gitignore via git."""
    listing = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "--", *DEPLOY_SET],
                             capture_output=True, text=True)
    if listing.returncode == 0:
        names = listing.stdout.splitlines()
    else:  # not a git checkout: walk the deploy set
        names = [str(p.relative_to(root)) for d in DEPLOY_SET if (root / d).is_dir()
                 for p in (root / d).rglob("*") if p.is_file()]
    return {n: root / n for n in sorted(names) if (root / n).is_file() and not _never(n)}


def _never(name: str) -> bool:
    parts = name.split("/")
    for pattern in NEVER:
        if pattern.endswith("/") and pattern[:-1] in parts[:-1]:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):
            return True
    return False


def on_hosts(hosts, *, dry_run: bool = False, delete: bool = True, check_deps: bool = True) -> int:
    """`inv deploy`: sync every host in parallel, one summary row each, then check their venvs."""
    outcomes = fanout.each(hosts, lambda s: _deploy_row(s, delete=delete, dry_run=dry_run))
    code = fanout.report(outcomes)
    if check_deps and not dry_run:
        synced = [o.host for o in outcomes if o.ok]
        code = max(code, deps.on_hosts(synced) if synced else 0)
    return code


def _deploy_row(session: Session, *, delete: bool, dry_run: bool) -> dict:
    result = deploy(session, delete=delete, dry_run=dry_run)
    if dry_run:
        for line in result.changes:
            print(f"{session.host.name}: would {line}")
    return result.row()
