"""`inv deploy`: put the project's deployable tree on a host, as a delta.

What travels (DEPLOY_SET): ``remote/`` (the scripts that do the GPU work), ``templates/``
(service files), ``requirements/`` (what `inv deps` installs) and ``examples/`` (the demo's
prompt file) — into ``<workdir>/code/``. Never ``.git``, venvs, caches, datasets,
checkpoints or anything ``.gitignore`` names. ``--delete`` prunes stale files inside
``code/`` only; run outputs live in ``<workdir>/runs`` and ``<workdir>/data``, out of reach.

rsync is used with the host's exact SSH settings (Session.rsync_location); when rsync is
missing here or there, files go over SFTP, comparing size and mtime so only changed
files are sent. ``code/VERSION`` records the git commit deployed (runs put it in their
meta.json).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import deps, fanout
from .errors import HostError
from .host import Session, local_rsync_available, quote

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEPLOY_SET = ("remote", "templates", "requirements", "examples")
NEVER = (".git/", ".venv/", "venv/", "__pycache__/", "*.pyc", ".cache/", ".pytest_cache/", "data/", "runs/",
         "artifacts/", "checkpoints/", "*.safetensors", "*.bin", "*.pt", "*.ckpt", "*.arrow", "*.parquet")
RSYNC_IO_TIMEOUT = 30


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
    dest = f"{session.workdir}/code"
    with tempfile.TemporaryDirectory(prefix="specops-version-") as tmp:
        version = _version_file(root, Path(tmp))
        result = None
        if local_rsync_available():
            try:
                result = _rsync(session, root, version, dest, delete=delete, dry_run=dry_run)
            except _NoRemoteRsync:
                pass
        if result is None:
            result = _sftp(session, root, version, dest, delete=delete, dry_run=dry_run)
    result.seconds = time.monotonic() - start
    return result


class _NoRemoteRsync(Exception):
    pass


def _rsync(session: Session, root: Path, version: Path, dest: str, *, delete: bool, dry_run: bool) -> SyncResult:
    extra, target = session.rsync_location(dest + "/")
    argv = ["rsync", "-rlpt", "--mkpath", "--compress", "--itemize-changes", "--stats", f"--timeout={RSYNC_IO_TIMEOUT}",
            *[f"--exclude={p}" for p in NEVER], "--filter=:- .gitignore", "--include=/VERSION",
            *[f"--include=/{d}/***" for d in DEPLOY_SET], "--exclude=*", *extra]
    if delete:
        argv += ["--delete", "--delete-excluded"]
    if dry_run:
        argv.append("--dry-run")
    argv += [f"{root}/", str(version), target]
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        if proc.returncode == 127 or "rsync: command not found" in proc.stderr or "rsync: not found" in proc.stderr:
            raise _NoRemoteRsync()
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise HostError(f"{session.host.name}: rsync failed (exit {proc.returncode}): {last} — "
                        f"nothing is lost; rerun `inv deploy` to converge")
    changes = [line for line in proc.stdout.splitlines() if re.match(r"^(\*deleting|[<>ch.]f)", line)
               and not line.startswith(".f ")]
    sent = re.search(r"Total bytes sent: ([\d,.]+)", proc.stdout)
    return SyncResult(len(changes), int(re.sub(r"[,.]", "", sent.group(1))) if sent else 0, 0.0, "rsync", changes)


def _version_file(root: Path, tmp: Path) -> Path:
    """code/VERSION: the deployed git commit; its mtime is the commit's, so an unchanged
    version is never re-sent."""
    git = ["git", "-C", str(root)]
    described = subprocess.run(git + ["describe", "--always", "--dirty", "--abbrev=12"], capture_output=True, text=True)
    stamp = subprocess.run(git + ["log", "-1", "--format=%ct"], capture_output=True, text=True).stdout.strip()
    path = tmp / "VERSION"
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


def _sftp(session: Session, root: Path, version: Path, dest: str, *, delete: bool, dry_run: bool) -> SyncResult:
    """The fallback: compare size+mtime with one remote `find`, upload the differences."""
    local = {**deployable_files(root), "VERSION": version}
    listing = session.sh(f"cd {quote(dest)} 2>/dev/null && find . -type f -printf '%P\\t%s\\t%T@\\n' || true",
                         timeout=60).stdout
    remote = {}
    for line in listing.split("\n"):
        fields = line.split("\t")
        if len(fields) == 3 and fields[1].isdigit() and re.fullmatch(r"\d+(\.\d*)?", fields[2]):
            remote[fields[0]] = (int(fields[1]), int(float(fields[2])))
        # else: a name holding a tab or a newline, which deploy never sends: not ours, left alone
    stats = {}
    for n, p in local.items():
        try:
            stats[n] = p.stat()
        except FileNotFoundError:  # deleted here since the listing (an editor's temporary): not sent
            pass
    local = {n: p for n, p in local.items() if n in stats}
    send = [n for n in local if remote.get(n) != (stats[n].st_size, int(stats[n].st_mtime))]
    stale = [n for n in remote if n not in local] if delete else []
    changes = [f">f {n}" for n in send] + [f"*deleting {n}" for n in stale]
    sent = sum(stats[n].st_size for n in send)
    if not dry_run:
        sftp = session.sftp()
        session.run(["mkdir", "-p", dest, *sorted({os.path.dirname(f"{dest}/{n}") for n in send})], timeout=60)
        for n in send:
            target = f"{dest}/{n}"
            try:
                sftp.put(str(local[n]), target)
                st = local[n].stat()
                sftp.utime(target, (st.st_atime, st.st_mtime))
                sftp.chmod(target, st.st_mode & 0o777)
            except OSError as e:
                raise HostError(f"{session.host.name}: SFTP upload of {n} failed: {e} — rerun `inv deploy` "
                                f"to converge") from None
        if stale:
            session.run(["rm", "-f", "--", *[f"{dest}/{n}" for n in stale]], timeout=60)
    return SyncResult(len(changes), sent, 0.0, "sftp (rsync missing)", changes)


def run(hosts, *, dry_run: bool = False, delete: bool = True, check_deps: bool = True) -> int:
    """`inv deploy`: sync every host in parallel, one summary row each, then check their venvs."""
    outcomes = fanout.each(hosts, lambda s: _deploy_row(s, delete=delete, dry_run=dry_run))
    code = fanout.report(outcomes)
    if check_deps and not dry_run:
        synced = [o.host for o in outcomes if o.ok]
        code = max(code, deps.run(synced) if synced else 0)
    return code


def _deploy_row(session: Session, *, delete: bool, dry_run: bool) -> dict:
    result = deploy(session, delete=delete, dry_run=dry_run)
    if dry_run:
        for line in result.changes:
            print(f"{session.host.name}: would {line}")
    return result.row()
