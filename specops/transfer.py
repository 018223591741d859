"""Moving files between here and a host: rsync with the host's exact SSH settings, SFTP fallback.

The one module that moves files: :func:`push_tree` (deploy's code tree), :func:`push_file`
(one file, e.g. a group's merged data), :func:`pull_dir` (a run coming home).

rsync is preferred (delta transfer, ``--partial`` so an interrupted copy resumes where it
stopped). When rsync is missing here or on the host, files travel over the session's SFTP
channel instead, skipping those already complete (same size and mtime) and continuing an
interrupted copy from its end. Either way the caller verifies what arrived (runs write a
manifest; see remote/manifest.py).

What a host sends is not trusted to say where it goes. The rules, all here:

* a pull writes only under its local directory: every path a host names (a manifest entry,
  an SFTP listing) goes through :func:`inside` or :func:`plain_name` before anything here is
  written, read or deleted under it — no absolute path, no ``..``, no way through a symlink;
* nothing a host sends becomes a symlink here (rsync without ``-l``, SFTP and the local copy
  take regular files only), so no pulled name can point outside the directory;
* file modes from the host are narrowed by this process's umask, never widened
  (rsync without ``-p``; SFTP masks them);
* remote paths never meet the remote shell (rsync ``-s``, see :meth:`Session.rsync_location`).
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .errors import HostError
from .host import Session, local_rsync_available, quote

RSYNC_IO_TIMEOUT = 60  # seconds without progress before rsync gives up (a cut link)
RSYNC_VANISHED = 24  # rsync's exit code when source files vanished during the copy
_FILE = "file:"  # rsync's --out-format prefix for what it transferred (its own notes have none)
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once, at import, before any thread could create a file


def plain_name(name) -> bool:
    """One entry of a directory listing: a name, not a path ('', '.', '..', '/' or NUL)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def inside(root, rel) -> Path:
    """``root/rel`` if ``rel`` is a plain relative path ("draft/config.json") that stays inside
    root and passes through no symlink here; HostError otherwise (a host that names "/etc/x",
    "../x" or "link/x" has said something no run says)."""
    parts = rel.split("/") if isinstance(rel, str) else None
    if not parts or not all(plain_name(p) for p in parts):
        raise HostError(f"the host named {rel!r:.120} as a file of the run: not a relative path inside the "
                        f"run directory; refusing it (nothing here was written or deleted for it)")
    path = Path(root)
    for part in parts:
        path = path / part
        if path.is_symlink():
            raise HostError(f"{path} is a symlink; a pulled run never holds one (remove it and pull again)")
    return path


@dataclass
class Pulled:
    method: str  # "rsync", "sftp (rsync missing)" or "copy" (a local host without rsync)
    files: int  # files transferred (not those already up to date)


def host_has_rsync(session: Session) -> bool:
    return session.sh("command -v rsync", check=False, timeout=30).ok


def pull_dir(session: Session, remote_dir: str, local_dir: str, exclude: tuple[str, ...] = ()) -> Pulled:
    """Copy remote_dir's contents into local_dir (created if needed); HostError if the copy fails.

    Files already present are updated, never deleted; a rerun after an interruption resumes.
    Files whose names match a glob in `exclude` stay where they are.
    """
    os.makedirs(local_dir, exist_ok=True)
    if local_rsync_available() and host_has_rsync(session):
        return _rsync(session, remote_dir, local_dir, exclude)
    if session.host.is_local:
        return _copy(remote_dir, local_dir, exclude)
    return _sftp(session, remote_dir, local_dir, exclude)


def _copy(src_dir: str, local_dir: str, exclude: tuple[str, ...]) -> Pulled:
    """A local host without rsync: copy file by file, skipping what a live run deletes meanwhile."""
    copied = 0
    for parent, dirs, names in os.walk(src_dir):
        rel = os.path.relpath(parent, src_dir)
        os.makedirs(local_dir if rel == "." else inside(local_dir, rel), exist_ok=True)
        for name in names:
            src = os.path.join(parent, name)
            if any(fnmatch.fnmatch(name, p) for p in exclude) or os.path.islink(src):
                continue
            target = inside(local_dir, name if rel == "." else f"{rel}/{name}")
            try:
                shutil.copy2(src, target)
                copied += 1
            except FileNotFoundError:  # vanished after the listing
                pass
    return Pulled("copy", copied)


def _rsync(session: Session, remote_dir: str, local_dir: str, exclude: tuple[str, ...]) -> Pulled:
    extra, source = session.rsync_location(remote_dir.rstrip("/") + "/")
    # -rt, not -a: no symlinks (-l), no modes (-p), no owners from the host; see the module docstring
    argv = ["rsync", "-rt", "--partial", f"--out-format={_FILE}%n", f"--timeout={RSYNC_IO_TIMEOUT}",
            *[f"--exclude={pattern}" for pattern in exclude], *extra, source, local_dir.rstrip("/") + "/"]
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    # 24: "some files vanished before they could be transferred" -- a live run deleting its
    # temporaries; what vanished is not part of the run (the manifest decides what is).
    if proc.returncode not in (0, RSYNC_VANISHED):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise HostError(f"{session.host.name}: rsync of {remote_dir} failed (exit {proc.returncode}): {last}; "
                        f"rerun to resume")
    return Pulled("rsync", sum(1 for line in proc.stdout.splitlines()
                               if line.startswith(_FILE) and not line.endswith("/")))


def _sftp(session: Session, remote_dir: str, local_dir: str, exclude: tuple[str, ...]) -> Pulled:
    sftp = session.sftp()
    sent = 0
    try:
        pending = [""]
        while pending:
            rel = pending.pop()
            os.makedirs(inside(local_dir, rel) if rel else local_dir, exist_ok=True)
            try:
                listing = sftp.listdir_attr(f"{remote_dir}/{rel}" if rel else remote_dir)
            except FileNotFoundError:
                if not rel:
                    raise
                continue  # a subdirectory removed after its parent was listed
            for entry in listing:
                if not plain_name(entry.filename):
                    raise HostError(f"{session.host.name}: the SFTP server listed {entry.filename!r:.120} in "
                                    f"{remote_dir}/{rel}, which is not a file name; refusing the copy")
                child = f"{rel}/{entry.filename}" if rel else entry.filename
                if stat.S_ISDIR(entry.st_mode):
                    pending.append(child)
                elif stat.S_ISREG(entry.st_mode) and not any(fnmatch.fnmatch(entry.filename, p) for p in exclude):
                    try:
                        sent += _sftp_file(sftp, f"{remote_dir}/{child}", str(inside(local_dir, child)), entry)
                    except FileNotFoundError:  # deleted on the host after the listing (a live run's temporary)
                        pass
    except OSError as e:
        raise HostError(f"{session.host.name}: SFTP copy of {remote_dir} failed: {e}; rerun to resume") from None
    return Pulled("sftp (rsync missing)", sent)


def _sftp_file(sftp, remote_path: str, local_path: str, attrs) -> int:
    """Bring one file up to date; 1 if bytes moved.

    Bytes land in a hidden ``.NAME.partial`` renamed into place when complete, so an interrupted
    copy is continued from its end on the next pull and a complete-looking file is never a torn one.
    """
    if os.path.exists(local_path):
        have = os.stat(local_path)
        if have.st_size == attrs.st_size and int(have.st_mtime) == attrs.st_mtime:
            return 0
    partial = os.path.join(os.path.dirname(local_path), f".{os.path.basename(local_path)}.partial")
    offset = os.path.getsize(partial) if os.path.exists(partial) else 0
    if offset > attrs.st_size:
        offset = 0
    with sftp.open(remote_path, "rb") as src, open(partial, "ab" if offset else "wb") as dst:
        src.seek(offset)
        src.prefetch(attrs.st_size)
        shutil.copyfileobj(src, dst, 1 << 20)
    os.chmod(partial, attrs.st_mode & 0o777 & ~_UMASK)
    os.utime(partial, (attrs.st_atime, attrs.st_mtime))
    os.replace(partial, local_path)
    return 1


def push_file(session: Session, local_path: str, remote_path: str) -> str:
    """Copy one local file to remote_path on the host (parents created), replacing it whole; the method.

    rsync where both sides have it (resumable with --partial; it renames into place when done),
    else SFTP into a temporary name renamed into place: a reader never sees half a file.
    """
    parent = os.path.dirname(remote_path)
    if session.host.is_local:
        os.makedirs(parent, exist_ok=True)
        tmp = f"{remote_path}.partial"
        shutil.copyfile(local_path, tmp)
        os.replace(tmp, remote_path)
        return "copy"
    session.run(["mkdir", "-p", parent], timeout=30)
    if local_rsync_available() and host_has_rsync(session):
        extra, target = session.rsync_location(remote_path)
        proc = subprocess.run(["rsync", "-t", "--partial", f"--timeout={RSYNC_IO_TIMEOUT}", *extra, local_path,
                               target], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if proc.returncode:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise HostError(f"{session.host.name}: rsync to {remote_path} failed (exit {proc.returncode}): {last}; "
                            f"rerun to resume")
        return "rsync"
    sftp = session.sftp()
    tmp = f"{parent}/.{os.path.basename(remote_path)}.partial"
    try:
        sftp.put(local_path, tmp)
        sftp.posix_rename(tmp, remote_path)
    except OSError as e:
        raise HostError(f"{session.host.name}: cannot write {remote_path} over SFTP: {e}") from None
    return "sftp (rsync missing)"


@dataclass
class Pushed:
    method: str  # "rsync" or "sftp (rsync missing)"
    changes: list[str]  # rsync's itemized lines: ">f NAME" sent, "*deleting NAME" removed
    bytes_sent: int


class _NoRemoteRsync(Exception):
    pass


def push_tree(session: Session, dest: str, rsync_sources: list[str], rsync_filters: list[str], files, *,
              delete: bool, dry_run: bool, rerun: str = "rerun", keep: tuple[str, ...] = ()) -> Pushed:
    """Make ``dest`` on the host hold a local tree; HostError if it fails (a rerun converges).

    rsync sends ``rsync_sources`` through ``rsync_filters`` (one process, nothing else: a no-op
    costs what a raw rsync costs). Without rsync here or on the host, ``files()`` (relative
    name -> local path, the same set) goes over SFTP: sizes and mtimes compared with one
    remote ``find``, the differences uploaded. ``delete`` removes what the tree no longer has, but
    never the top-level names in ``keep`` (the ownership marker, :mod:`specops.owned`).
    """
    if local_rsync_available():
        try:
            protect = [f"--filter=P /{name}" for name in keep]
            return _rsync_push(session, dest, rsync_sources, [*protect, *rsync_filters], delete=delete,
                               dry_run=dry_run, rerun=rerun)
        except _NoRemoteRsync:
            pass
    return _sftp_push(session, dest, files(), delete=delete, dry_run=dry_run, rerun=rerun, keep=keep)


def _rsync_push(session: Session, dest: str, sources: list[str], filters: list[str], *, delete: bool,
                dry_run: bool, rerun: str) -> Pushed:
    extra, target = session.rsync_location(dest + "/")
    argv = ["rsync", "-rlpt", "--mkpath", "--compress", "--itemize-changes", "--stats",
            f"--timeout={RSYNC_IO_TIMEOUT}", *filters, *extra]
    if delete:
        argv += ["--delete", "--delete-excluded"]
    if dry_run:
        argv.append("--dry-run")
    proc = subprocess.run([*argv, *sources, target], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        if proc.returncode == 127 or "rsync: command not found" in proc.stderr or "rsync: not found" in proc.stderr:
            raise _NoRemoteRsync()
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise HostError(f"{session.host.name}: rsync to {dest} failed (exit {proc.returncode}): {last} — "
                        f"nothing is lost; {rerun} to converge")
    changes = [line for line in proc.stdout.splitlines() if re.match(r"^(\*deleting|[<>ch.]f)", line)
               and not line.startswith(".f ")]
    sent = re.search(r"Total bytes sent: ([\d,.]+)", proc.stdout)
    return Pushed("rsync", changes, int(re.sub(r"[,.]", "", sent.group(1))) if sent else 0)


def _sftp_push(session: Session, dest: str, local: dict, *, delete: bool, dry_run: bool,
               rerun: str = "rerun", keep: tuple[str, ...] = ()) -> Pushed:
    listing = session.sh(f"cd {quote(dest)} 2>/dev/null && find . -type f -printf '%P\\t%s\\t%T@\\n' || true",
                         timeout=60).stdout
    remote = {}
    for line in listing.split("\n"):
        fields = line.split("\t")
        if len(fields) == 3 and fields[1].isdigit() and re.fullmatch(r"\d+(\.\d*)?", fields[2]):
            remote[fields[0]] = (int(fields[1]), int(float(fields[2])))
        # else: a name holding a tab or a newline, which a pushed tree never has: not ours, left alone
    stats = {}
    for n, p in local.items():
        try:
            stats[n] = os.stat(p)
        except FileNotFoundError:  # deleted here since the listing (an editor's temporary): not sent
            pass
    local = {n: p for n, p in local.items() if n in stats}
    send = [n for n in local if remote.get(n) != (stats[n].st_size, int(stats[n].st_mtime))]
    stale = [n for n in remote if n not in local and n not in keep] if delete else []
    changes = [f">f {n}" for n in send] + [f"*deleting {n}" for n in stale]
    if not dry_run:
        sftp = session.sftp()
        session.run(["mkdir", "-p", dest, *sorted({os.path.dirname(f"{dest}/{n}") for n in send})], timeout=60)
        for n in send:
            target = f"{dest}/{n}"
            try:
                sftp.put(str(local[n]), target)
                st = os.stat(local[n])
                sftp.utime(target, (st.st_atime, st.st_mtime))
                sftp.chmod(target, st.st_mode & 0o777)
            except OSError as e:
                raise HostError(f"{session.host.name}: SFTP upload of {n} failed: {e} — {rerun} to converge") from None
        if stale:
            session.run(["rm", "-f", "--", *[f"{dest}/{n}" for n in stale]], timeout=60)
    return Pushed("sftp (rsync missing)", changes, sum(stats[n].st_size for n in send))
