"""`inv pull`: bring a run home from every host that ran it, verified.

    artifacts/<run-id>/<host>/        the run directory as the host has it (rsync --partial; SFTP fallback)
    artifacts/<run-id>/merged.jsonl   a sharded run's data.jsonl records from all its hosts, each id once

A copy is trusted only when it matches the manifest the run wrote when it ended
(remote/manifest.py --verify). Files that do not match are fetched afresh once (a copy
damaged here heals); a file that still differs (damaged on the host, or in transit) fails
that host's row, naming the file. A run still in progress is copied as it stands, unverified.
An unreachable host fails its row while the others are still pulled; pulling again later
resumes, and completes the merge once every shard is home::

    $ inv pull --on trio generate-20261202-130501
    host   status  run                       shard  method  files  verified
    node1  ok      generate-20261202-130501  0/3    rsync   7      yes
    node2  FAILED  node2: unreachable: connecting to 10.231.1.12 timed out after 10s
    node3  ok      generate-20261202-130501  2/3    rsync   7      yes
    merged.jsonl not written: shards missing from node2; pull again when it is back
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from . import fanout, transfer
from .errors import HostError, SpecopsError
from .host import Session, quote
from .inventory import Host
from .runs import LIVE_PID, check_run_id, run_dir, runs_dir, tmux_session

MERGED = "merged.jsonl"


def _load_manifest_module():
    """remote/manifest.py, the one definition of a run's manifest, shared with the hosts (stdlib only)."""
    path = Path(__file__).resolve().parent.parent / "remote" / "manifest.py"
    spec = importlib.util.spec_from_file_location("specops_run_manifest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


manifest = _load_manifest_module()

_PROBE = """
d={dir}
[ -f "$d/meta.json" ] || exit 12
pid=$(live_pid {session}); printf '%s\\n' "${{pid:-0}}"
cat "$d/meta.json"
"""

_NEWEST = """
for m in {runs}/*/meta.json; do stat -c '%Y %n' "$m" 2>/dev/null; done | sort -n | tail -n 1
"""


def pull(hosts: list[Host], run_id: str | None = None, dest: str = "artifacts", out=None) -> int:
    """`inv pull`: copy and verify the run from each host, then merge a sharded run's records."""
    out = out or sys.stdout
    run_id = check_run_id(run_id) if run_id else newest_run(hosts)
    outcomes = fanout.each(hosts, pull_host, run_id, dest)
    code = fanout.report(outcomes, out=out)
    return max(code, merge_shards(Path(dest) / run_id, outcomes, out))


def pull_host(session: Session, run_id: str, dest: str) -> dict:
    """Copy one host's run directory to DEST/<run-id>/<host>/ and check it against the run's manifest."""
    name = session.host.name
    d = run_dir(session, run_id)
    probe = _PROBE.format(dir=quote(d), session=quote(tmux_session(session, run_id)))
    r = session.sh(LIVE_PID + probe, check=False, timeout=30)
    if r.exit_code == 12:
        raise HostError(f"no run {run_id} on {name}")
    if not r.ok:
        raise HostError(f"{name}: cannot read run {run_id}: {r.stderr.strip()}")
    pid, _, meta_text = r.stdout.partition("\n")
    meta = json.loads(meta_text)
    local = Path(dest) / run_id / name
    pulled = transfer.pull_dir(session, d, str(local), exclude=manifest.HOST_ONLY)
    running = pid.strip() != "0"
    verified = "no (still running)" if running else "yes"
    problems = [] if running else verify(local)
    if problems:  # a copy damaged here is fetched afresh, once; damage on the host stays and fails
        damaged = [line.split(": ", 1)[0] for line in problems]
        for rel in damaged:
            (local / rel).unlink(missing_ok=True)
        pulled.files += transfer.pull_dir(session, d, str(local), exclude=manifest.HOST_ONLY).files
        problems = verify(local)
        verified = f"yes (re-fetched {', '.join(damaged)})"
    if problems:
        raise HostError(f"{name}: integrity check failed for {local}: {'; '.join(problems)}")
    row = {"run": run_id, "shard": meta.get("shard") or "-", "method": pulled.method, "files": pulled.files,
           "verified": verified}
    left = manifest.read(str(local)).get("host_only", {}) if not running else {}
    if left.get("files"):
        row["left on host"] = f"{left['files']} state shards, {decimal_size(left['bytes'])}"
    return row


def decimal_size(n: int) -> str:
    for unit, factor in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= factor:
            return f"{n / factor:.3g} {unit}"
    return f"{n} B"


def verify(local_dir: Path) -> list[str]:
    """Problems of a pulled copy against its manifest, one line per file (empty: all good)."""
    return manifest.verify(str(local_dir))


def newest_run(hosts: list[Host]) -> str:
    """The run started last on any of these hosts (for `inv pull` without RUN)."""

    def newest(session: Session) -> dict:
        line = session.sh(_NEWEST.format(runs=quote(runs_dir(session))), timeout=30).stdout.strip()
        mtime, _, path = line.partition(" ")
        return {"mtime": int(mtime), "run": Path(path).parent.name} if line else {}

    found = [o.row for o in fanout.each(hosts, newest) if o.ok and o.row]
    if not found:
        raise SpecopsError(f"no runs on {', '.join(h.name for h in hosts)} (or unreachable); name one: inv pull RUN")
    return max(found, key=lambda row: row["mtime"])["run"]


def merge_shards(local_run: Path, outcomes: list[fanout.Outcome], out) -> int:
    """Write merged.jsonl for a sharded run once every shard is home and verified; the exit code."""
    shards = {o.host.name: o.row["shard"] for o in outcomes if o.ok and o.row["shard"] != "-"}
    if not shards:
        return 0
    missing = [o.host.name for o in outcomes if not o.ok]
    if missing:
        print(f"{MERGED} not written: shards missing from {', '.join(missing)}; pull again when "
              f"{'it is' if len(missing) == 1 else 'they are'} back", file=out)
        return 1
    running = [o.host.name for o in outcomes if o.row["verified"].startswith("no")]
    if running:
        print(f"{MERGED} not written: the run is still running on {', '.join(running)}", file=out)
        return 0
    count = int(next(iter(shards.values())).split("/")[1])
    index = {int(s.split("/")[0]): host for host, s in shards.items()}
    absent = sorted(set(range(count)) - set(index))
    if absent:
        print(f"{MERGED} not written: shards {', '.join(map(str, absent))} of {count} were not pulled "
              f"(pull with --on the whole group)", file=out)
        return 1
    parts = [local_run / index[i] / "data.jsonl" for i in range(count)]
    if not any(p.exists() for p in parts):
        return 0
    try:
        records = merge_jsonl(parts, local_run / MERGED)
    except SpecopsError as e:
        print(f"error: {e}", file=out)
        return e.exit_code
    print(f"{MERGED}: {records} records from {count} shards -> {local_run / MERGED}", file=out)
    return 0


def merge_jsonl(parts: list[Path], target: Path) -> int:
    """Concatenate JSONL files whose records carry an "id"; SpecopsError on a duplicate or a bad line."""
    seen: set = set()
    duplicates: list = []
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        with open(tmp, "w") as merged:
            for part in parts:
                if not part.exists():
                    raise SpecopsError(f"{part}: missing; every shard must have written its data.jsonl")
                with open(part) as f:
                    for number, line in enumerate(f, 1):
                        try:
                            rid = json.loads(line)["id"]
                        except (ValueError, KeyError, TypeError):
                            raise SpecopsError(f"{part}: line {number} is not a JSON record with an id") from None
                        if rid in seen:
                            duplicates.append(rid)
                        seen.add(rid)
                        merged.write(line if line.endswith("\n") else line + "\n")
        if duplicates:
            shown = ", ".join(map(str, duplicates[:10])) + (f" and {len(duplicates) - 10} more"
                                                          if len(duplicates) > 10 else "")
            raise SpecopsError(f"{target.name} not written: {len(duplicates)} duplicate ids across shards: {shown}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return len(seen)
