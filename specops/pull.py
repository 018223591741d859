"""`inv pull`: bring a run home from every host that ran it, verified.

    artifacts/<run-id>/<host>/        the run directory as the host has it (rsync --partial; SFTP fallback)
    artifacts/<run-id>/merged.jsonl   a sharded run's data.jsonl records from all its hosts, each id once

A host decides what is in its run directory, never where a pull writes: the run id it reports
(the newest run) passes the same check as one typed here, meta.json's shard must be a shard spec,
and every path in the manifest must lie inside DEST/<run-id>/<host>/ (specops.transfer's rules)
before anything there is read or deleted. A manifest that names anything else fails the row.

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

import json
import os
import sys
from pathlib import Path

from . import fanout, transfer, untrusted
from . import plan as plans
from .errors import HostError, SpecopsError
from .host import Session, quote
from .inventory import Host
from .runs import LIVE_PID, RUN_ID, check_run_id, run_dir, runs_dir, tmux_session
from .service_spec import SERVICE
from .shared import layout, remote_module

MERGED = layout.MERGED

manifest = remote_module("manifest")  # the one definition of a run's manifest, shared with the hosts

_PROBE = """
d={dir}
[ -f "$d/{L.META}" ] || exit 12
pid=$(live_pid {session}); printf '%s\\n' "${{pid:-0}}"
printf '%s\\n' "$(head -c 32 "$d/{L.EXIT_CODE}" 2>/dev/null | tr -d '\\n')"
cat "$d/{L.META}"
"""

_NEWEST = """
cd {runs} 2>/dev/null || exit 0
for m in */{L.META}; do stat --printf '%Y %n\\0' -- "$m" 2>/dev/null; done
"""


ARTIFACTS = "artifacts"  # where pulled runs land on this machine: DEST/<run>/<host>/ (every --dest default)


def pull(hosts: list[Host], run_id: str | None = None, dest: str = ARTIFACTS, out=None) -> int:
    """`inv pull`: copy and verify the run from each host, then merge a sharded run's records."""
    out = out or sys.stdout
    run_id = check_run_id(run_id or newest_run(hosts))  # one read back from a host is checked the same
    outcomes = fanout.each(hosts, pull_host, run_id, dest)
    code = fanout.report(outcomes, out=out)
    code = max(code, merge_shards(Path(dest) / run_id, outcomes, out))
    ended_badly = [o for o in outcomes if o.ok and not o.row["state"].startswith(("succeeded", "running"))]
    for o in ended_badly:  # a copy verified is not a run that worked: never let "ok" say so
        print(f"{run_id} {o.row['state']} on {o.host.name}; its files are pulled for a look, not for use", file=out)
    return max(code, 1 if ended_badly else 0)


def pull_host(session: Session, run_id: str, dest: str) -> dict:
    """Copy one host's run directory to DEST/<run-id>/<host>/ and check it against the run's manifest."""
    name = session.host.name
    d = run_dir(session, run_id)
    probe = _PROBE.format(L=layout, dir=quote(d), session=quote(tmux_session(session, run_id)))
    r = session.sh(LIVE_PID + probe, check=False, timeout=30)
    if r.exit_code == 12:
        raise HostError(f"no run {run_id} on {name}")
    if not r.ok:
        raise HostError(f"{name}: cannot read run {run_id}: {r.stderr.strip()}")
    pid, _, rest = r.stdout.partition("\n")
    code, _, meta_text = rest.partition("\n")
    shard = shard_of(meta_text, f"{name}: {run_id}/{layout.META}")
    local = Path(dest) / run_id / name
    pulled = transfer.pull_dir(session, d, str(local), exclude=manifest.HOST_ONLY)
    running = pid.strip() != "0"
    verified = "no (still running)" if running else "yes"
    problems = [] if running else verify(local)
    if problems:  # a copy damaged here is fetched afresh, once; damage on the host stays and fails
        damaged = [path for path in listed(local) if any(line.startswith(f"{path}: ") for line in problems)]
        for rel in damaged:
            path = transfer.inside(local, rel)
            if path.is_file():
                path.unlink()
        pulled.files += transfer.pull_dir(session, d, str(local), exclude=manifest.HOST_ONLY).files
        problems = verify(local)
        verified = f"yes (re-fetched {', '.join(damaged)})"
    if problems:
        raise HostError(f"{name}: integrity check failed for {local}: {'; '.join(problems)}")
    row = {"run": run_id, "shard": shard or "-", "state": run_state(running, code, local),
           "method": pulled.method, "files": pulled.files, "verified": verified}
    left = {} if running else manifest.read(str(local)).get("host_only")
    if isinstance(left, dict) and all(isinstance(left.get(k), int) for k in ("files", "bytes")) and left["files"]:
        row["left on host"] = f"{left['files']} state shards, {decimal_size(left['bytes'])}"
    return row


def run_state(running: bool, code: str, local: Path) -> str:
    """The run's own outcome, beside the copy's: "succeeded", "running", "lost", or "failed (exit N)"
    with the run's one-line account of why (its stats.json's "failure", read from the copy)."""
    code = code.strip()
    exit_code = int(code) if code.lstrip("-").isdigit() and len(code) < 12 else None
    if exit_code is None:
        return "running" if running else "lost"
    if exit_code == 0:
        return "succeeded"
    try:
        stats = json.loads((local / layout.STATS).read_bytes()) if (local / layout.STATS).is_file() else None
    except (OSError, ValueError):
        stats = None
    why = stats.get("failure") if isinstance(stats, dict) else None
    why = untrusted.clean(" ".join(why.split())[:300], untrusted.known_secrets()) if isinstance(why, str) else ""
    return f"failed (exit {exit_code})" + (f": {why}" if why else "")


def shard_of(meta_text: str, what: str) -> str | None:
    """The run's shard spec ("I/K", several joined by ",") from its meta.json; None for an unsharded
    run; HostError if the host wrote anything else (the merge trusts it to say whose rows are whose)."""
    try:
        meta = json.loads(meta_text)
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        raise HostError(f"{what} is not a JSON object; this run directory was not written by specops")
    shard = meta.get("shard")
    if shard is None:
        return None
    try:
        plans.parse_spec(shard)
    except SpecopsError:
        raise HostError(f"{what}: shard {shard!r:.60} is not a shard spec (I/K with 0 <= I < K, several joined by ',')")
    return shard


def decimal_size(n: int) -> str:
    for unit, factor in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= factor:
            return f"{n / factor:.3g} {unit}"
    return f"{n} B"


def verify(local_dir: Path) -> list[str]:
    """Problems of a pulled copy against its manifest, one line per file (empty: all good).
    HostError if the manifest names a path outside the copy: nothing is checked or deleted then."""
    for rel in listed(local_dir):
        transfer.inside(local_dir, rel)
    return manifest.verify(str(local_dir))


def listed(local_dir: Path) -> list:
    """The paths the copy's manifest lists (as the host wrote them: check before use)."""
    try:
        entries = manifest.read(str(local_dir))["files"]
    except (OSError, ValueError):
        return []  # manifest.verify says what is wrong with it
    return [e.get("path") for e in entries if isinstance(e, dict)]


def newest_run(hosts: list[Host]) -> str:
    """The run started last on any of these hosts (for `inv pull` without RUN)."""

    def newest(session: Session) -> dict:
        """NUL-separated `MTIME RUN/meta.json` records: a name with a newline cannot forge one. A
        directory whose name is no run id is not a specops run and is passed over."""
        found = {}
        for record in session.sh(_NEWEST.format(L=layout, runs=quote(runs_dir(session))), timeout=30).stdout.split("\0"):
            mtime, _, path = record.partition(" ")
            run = path.removesuffix(f"/{layout.META}")
            if mtime.isdigit() and path.endswith(f"/{layout.META}") and RUN_ID.match(run) and run != SERVICE:
                found = max(found, {"mtime": int(mtime), "run": run}, key=lambda row: row.get("mtime", -1))
        return found

    found = [o.row for o in fanout.each(hosts, newest) if o.ok and o.row]
    if not found:
        raise SpecopsError(f"no runs on {', '.join(h.name for h in hosts)} (or unreachable); name one: inv pull RUN")
    return max(found, key=lambda row: row["mtime"])["run"]


def merge_shards(local_run: Path, outcomes: list[fanout.Outcome], out) -> int:
    """Write merged.jsonl for a sharded run once the finished, verified hosts own every row between
    them (their shard specs, :mod:`specops.plan`); the exit code. After a re-plan, the hosts that
    took a gone host's rows are enough, and a row both finished is kept once."""
    shards = {o.host.name: o.row["shard"] for o in outcomes if o.ok and o.row["shard"] != "-"}
    if not shards:
        return 0
    done = {h: plans.parse_spec(s) for h, s in shards.items()
            if not next(o for o in outcomes if o.host.name == h).row["verified"].startswith("no")}
    holes, overlap, modulus = plans.covered(list(done.values()))
    if holes:
        missing = [o.host.name for o in outcomes if not o.ok]
        running = [h for h in shards if h not in done]
        if missing:
            print(f"{MERGED} not written: shards missing from {', '.join(missing)}; pull again when "
                  f"{'it is' if len(missing) == 1 else 'they are'} back (or re-plan their rows: "
                  f"inv generate --name {local_run.name} --resume)", file=out)
            return 1
        if running:
            print(f"{MERGED} not written: the run is still running on {', '.join(running)}", file=out)
            return 0
        shown = ", ".join(f"{r}/{modulus}" for r in holes[:10])
        print(f"{MERGED} not written: rows {shown} of the plan were not pulled (pull with --on the whole group)",
              file=out)
        return 1
    parts = [local_run / host / layout.ROWS for host in done]
    if not any(p.exists() for p in parts):
        return 0
    try:
        records, twice = merge_jsonl(parts, local_run / MERGED, keep_first=overlap)
    except SpecopsError as e:
        print(f"error: {e}", file=out)
        return e.exit_code
    again = f" ({twice} rows finished by two hosts of a re-planned run: kept once)" if twice else ""
    print(f"{MERGED}: {records} records from {len(parts)} hosts{again} -> {local_run / MERGED}", file=out)
    return 0


def merge_jsonl(parts: list[Path], target: Path, keep_first: bool = False) -> tuple[int, int]:
    """Concatenate JSONL files whose records carry a string "id"; (records, duplicates dropped).

    SpecopsError, naming the part and the line, on anything generate never writes (a part that is
    not a file, bytes that are not UTF-8, a line that is not a JSON object with a string id), or on
    a duplicate id unless ``keep_first`` (the parts' shards overlap after a re-plan: the first copy
    is kept)."""
    seen: set = set()
    duplicates: list = []
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        with open(tmp, "w") as merged:
            for part in parts:
                for rid, line in jsonl_records(part):
                    if rid in seen:
                        duplicates.append(rid)
                        if keep_first:
                            continue
                    seen.add(rid)
                    merged.write(line if line.endswith("\n") else line + "\n")
        if duplicates and not keep_first:
            shown = ", ".join(map(str, duplicates[:10])) + (f" and {len(duplicates) - 10} more"
                                                          if len(duplicates) > 10 else "")
            raise SpecopsError(f"{target.name} not written: {len(duplicates)} duplicate ids across shards: {shown}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return len(seen), len(duplicates)


def jsonl_records(part: Path):
    """(id, line) for each record of a pulled data.jsonl; SpecopsError naming the file and the line at
    the first one that is not what generate writes (the host wrote it: it is data, never trusted)."""
    if not part.exists():
        raise SpecopsError(f"{part}: missing; every shard must have written its {layout.ROWS}")
    if not part.is_file():
        raise SpecopsError(f"{part}: not a file; a run's {layout.ROWS} is a file of JSON lines")
    with open(part, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SpecopsError(f"{part}: line {number} is not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                                   f"column {e.start + 1})") from None
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict) or "id" not in record:
                raise SpecopsError(f"{part}: line {number} is not a JSON record with an id")
            if not isinstance(record["id"], str):
                raise SpecopsError(f"{part}: line {number}: its id is {type(record['id']).__name__} "
                                   f"{json.dumps(record['id'])[:40]}, not a string (generate writes string ids)")
            yield record["id"], line
