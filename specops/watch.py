"""Watching runs: `inv status` (hosts and their runs at a glance) and `inv logs` (a run's output).

Both only read what a run leaves in its directory and what tmux says (see specops/runs.py),
so they work the same for a run started a minute or a week ago, from any machine::

    $ inv status --on gpu
    host  status  service                      gpu                   error
    gpu1  ok      active (running), health ok  8x 97% 1061/1128 GiB
    gpu2  FAILED                                                     gpu2: unreachable: connecting to ...
    host  run                       state    exit  age    progress
    gpu1  generate-20261202-130501  running  -     1h02m  5200/10000 rows (52%) · 1.4 rows/s · ETA 1h02m

`logs --follow` polls the log once a second over the open connection (a bounded command
each time, so a cut link ends it with an error instead of a hang) and stops when the run
ends; Ctrl-C stops the following, never the run. The run's machine progress lines
(``specops-progress {json}``) become one progress line per host (specops.progress), live on a
terminal; everything a host wrote is cleaned before it is shown (specops.untrusted).
"""

from __future__ import annotations

import base64
import json
import sys
import threading
from dataclasses import dataclass

from . import fanout, progress, serve, untrusted
from .errors import HostError, SpecopsError
from .host import Session, connect, quote
from .inventory import Host
from .runs import LIVE_PID, check_run_id, run_dir, runs_dir, state, tmux_session
from .service_spec import Layout
from .shared import layout

STATUS_TIMEOUT = 30
DISK_FULL = "disk full on the host: free space there, then continue it with --resume"
POLL_S = 1.0
CHUNK = 4 << 20  # most log bytes fetched per poll
PLAIN_PROGRESS_EVERY = 30  # seconds between a host's progress lines when the output is not a terminal

# ---------------------------------------------------------------- status

_STATUS = """
runs={runs}; named={named}; prefix={prefix}
printf 'now\\t%s\\n' "$(date +%s)"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=utilization.gpu,memory.used,memory.total --format=csv,noheader,nounits 2>/dev/null \\
    | sed 's/^/gpu\\t/'
fi
if [ -n "$named" ]; then ids=$named; else
  ids=$( {{ ls -1t "$runs"/*/{L.META} 2>/dev/null | head -n {last} | while IFS= read -r m; do
             basename "$(dirname "$m")"; done
           tmux list-sessions -F '#{{session_name}}' 2>/dev/null | sed -n "s/^$prefix-//p"; }} | sort -u)
fi
for id in $ids; do
  d="$runs/$id"; started=$(stat -c %Y "$d/{L.META}" 2>/dev/null) || continue  # gone since listed
  progress=$(tail -c 65536 "$d/{L.LOG}" 2>/dev/null | grep -ao 'specops-progress {{.*}}' | tail -n 1)
  code=$(head -c 32 "$d/{L.EXIT_CODE}" 2>/dev/null)
  why=; case $code in ''|0) ;; *) why=$(head -c 65536 "$d/{L.STATS}" 2>/dev/null | base64 -w0);; esac
  [ -e "$d/{L.DISK_FULL}" ] && why=$(printf '%s' {disk_full_why} | base64 -w0)  # remote/run.sh: the disk filled up
  printf 'run\\t%s\\t%s\\t%s\\t%s\\t%s\\t%s\\n' "$id" "$(live_pid "$prefix-$id")" "$code" \\
    "$started" "${{progress#specops-progress }}" "$why"
done
"""

def host_status(session: Session, run_id: str | None = None, last: int = 10) -> dict:
    """One host's service state, GPU use and runs (the named one, else the newest + all live ones)."""
    script = _STATUS.format(L=layout, runs=quote(runs_dir(session)), named=quote(run_id or ""), last=int(last),
                            disk_full_why=quote(json.dumps({"failure": DISK_FULL})),
                            prefix=quote(Layout(session.workdir).prefix))
    out = session.sh(LIVE_PID + script, timeout=STATUS_TIMEOUT).stdout
    now, gpus, runs = 0, [], []
    for line in out.splitlines():
        kind, _, rest = line.partition("\t")
        fields = rest.split("\t")
        if kind == "now":
            now = int(fields[0])
        elif kind == "gpu":
            try:
                gpus.append([float(x) for x in fields[0].split(",")])
            except ValueError:  # "[N/A]" (e.g. MIG): nothing to add up
                pass
        elif kind == "run":
            rid, pid, code, started, progress, why = (fields + [""] * 6)[:6]
            exit_code = int(code) if code.strip().lstrip("-").isdigit() else None
            runs.append({"run": rid, "state": state(bool(pid), exit_code), "exit": exit_code,
                         "age_s": now - int(started), "progress": _progress(progress), "why": failure_of(why)})
    if any(r["progress"] or r["why"] for r in runs):  # the host's text: no escapes, no secrets
        secrets = untrusted.known_secrets(session)
        for r in runs:
            r["progress"] = _cleaned(r["progress"], secrets)
            r["why"] = r["why"] and untrusted.clean(r["why"], secrets)
    runs.sort(key=lambda r: r["age_s"], reverse=True)
    return {"service": service_state(session), "gpu": describe_gpu_use(gpus), "runs": runs}


def failure_of(encoded: str) -> str | None:
    """A failed run's own account of why (its stats.json's "failure": one line), from the base64 the
    status script sends; None when there is none or it is not what a run writes (the host's data)."""
    try:
        stats = json.loads(base64.b64decode(encoded, validate=True)) if encoded else None
    except ValueError:
        return None
    why = stats.get("failure") if isinstance(stats, dict) else None
    if not isinstance(why, str):
        return None
    return " ".join(why.split())[:300] or None


def service_state(session: Session) -> str:
    """'active (running), health ok' - from specops.serve, which knows both supervisors."""
    try:
        st = serve.status(session)
    except SpecopsError as e:
        return f"unknown ({e})"
    return f"{st['state']}, health {st['health']}"


def status(hosts: list[Host], run_id: str | None = None, *, last: int = 10, as_json: bool = False,
           out=None) -> int:
    """`inv status`: print hosts and runs; non-zero if a host failed or the named run failed/was lost."""
    out = out or sys.stdout
    if run_id:
        check_run_id(run_id)
    outcomes = fanout.each(hosts, host_status, run_id, last)
    local_secrets = untrusted.known_secrets()
    for o in outcomes:  # a host's error may quote what the host printed
        o.error = o.error and untrusted.clean_lines(o.error, local_secrets)
    found = [(o.host.name, r) for o in outcomes if o.ok for r in o.row["runs"]]
    if as_json:
        print(json.dumps([{"host": o.host.name, "ok": o.ok, **({"error": o.error} if o.error else o.row)}
                          for o in outcomes], indent=2), file=out)
    else:
        fanout.print_table([{"host": o.host.name, "status": "ok", "service": o.row["service"], "gpu": o.row["gpu"]}
                            if o.ok else {"host": o.host.name, "status": "FAILED", "error": o.error}
                            for o in outcomes], out=out)
        if found:
            fanout.print_table([{"host": name, "run": r["run"], "state": r["state"], "exit": r["exit"],
                                 "age": progress.duration(r["age_s"]),
                                 "progress": r.get("why") or progress.describe(r["progress"])[0]}
                                for name, r in found], out=out)
        if group_rows := across_hosts(found):
            fanout.print_table(group_rows, out=out)
    if run_id and not found and all(o.ok for o in outcomes):
        raise SpecopsError(f"no run {run_id} on {', '.join(h.name for h in hosts)}")
    code = 1 if any(not o.ok for o in outcomes) else 0
    if run_id and any(r["state"] in ("failed", "lost") for _, r in found):
        code = 1
    return code


SUMMED = ("done", "total", "rows_s", "req_s", "errors", "failed", "truncated", "tok_s", "out_tok_s")


def across_hosts(found: list[tuple[str, dict]]) -> list[dict]:
    """One row per run that spans several hosts (a sharded generate, a group's torchrun job): how
    many hosts, their states together, and the run's progress as one: counts and rates of the
    shards summed, the slowest ETA; a figure only one host prints (rank 0's loss) is that host's."""
    by_run: dict[str, list[dict]] = {}
    for _, r in found:
        by_run.setdefault(r["run"], []).append(r)
    rows = []
    for run, members in by_run.items():
        if len(members) < 2:
            continue
        states = [r["state"] for r in members]
        together = {s: states.count(s) for s in dict.fromkeys(states)}
        reports = [r["progress"] for r in members if isinstance(r["progress"], dict)]
        merged: dict = {}
        for report in reports:
            for key, value in report.items():
                if key in SUMMED and isinstance(value, (int, float)) and isinstance(merged.get(key, 0), (int, float)):
                    merged[key] = merged.get(key, 0) + value
                elif key == "eta_s" and isinstance(value, (int, float)):
                    merged[key] = max(value, merged.get(key) or 0)
                elif key != "stage":
                    merged.setdefault(key, value)
        if len({report.get("stage") for report in reports}) == 1:  # "done" only when every host is done
            merged["stage"] = reports[0].get("stage")
        rows.append({"run": run, "hosts": len(members),
                     "state": states[0] if len(together) == 1 else ", ".join(f"{n} {s}" for s, n in together.items()),
                     "progress (all hosts)": progress.describe(merged or None)[0]})
    return rows


def describe_gpu_use(gpus: list[list[float]]) -> str:
    """'8x 97% 1061/1128 GiB' (mean utilisation, memory used/total over all GPUs) or 'none'."""
    if not gpus:
        return "none"
    util = sum(g[0] for g in gpus) / len(gpus)
    used, total = sum(g[1] for g in gpus) / 1024, sum(g[2] for g in gpus) / 1024
    return f"{len(gpus)}x {util:.0f}% {used:.0f}/{total:.0f} GiB"


def _progress(text: str):
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text  # a torn or foreign line: show it as it is


def _cleaned(value, secrets):
    """Every string in a parsed progress line (keys included) through :func:`untrusted.clean`."""
    if isinstance(value, str):
        return untrusted.clean(value, secrets)
    if isinstance(value, dict):
        return {_cleaned(k, secrets): _cleaned(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_cleaned(v, secrets) for v in value]
    return value


# ---------------------------------------------------------------- logs

# One poll: the run's liveness (read first, so that once the run is seen ended the log read
# after it is complete), then the log size, then up to CHUNK bytes from the offset, base64.
_POLL = """
d={dir}; s={session}; off={offset}
[ -d "$d" ] || exit 12
pid=$(live_pid "$s"); code=$(cat "$d/{L.EXIT_CODE}" 2>/dev/null)
size=$(stat -c %s "$d/{L.LOG}" 2>/dev/null || echo 0)
if [ "$off" = tail ]; then off=$((size - $(tail -n {lines} "$d/{L.LOG}" 2>/dev/null | wc -c))); fi
[ "$off" -le "$size" ] || off=0
printf '%s %s %s\\n' "$off" "${{pid:-0}}" "${{code:--}}"
tail -c +$((off + 1)) "$d/{L.LOG}" 2>/dev/null | head -c {chunk} | base64 -w0
"""


@dataclass
class Poll:
    offset: int  # where the bytes start
    data: bytes
    alive: bool
    exit_code: int | None

    @property
    def ended(self) -> bool:
        return self.exit_code is not None or not self.alive


def poll_log(session: Session, run_id: str, offset: int | None, lines: int = 50) -> Poll | None:
    """The log bytes from ``offset`` (None: from the start of the last ``lines`` lines); None if no such run."""
    script = _POLL.format(L=layout, dir=quote(run_dir(session, run_id)), session=quote(tmux_session(session, run_id)),
                          offset="tail" if offset is None else int(offset), lines=int(lines), chunk=CHUNK)
    r = session.sh(LIVE_PID + script, check=False, timeout=STATUS_TIMEOUT)
    if r.exit_code == 12:
        return None
    if not r.ok:
        raise HostError(f"{session.host.name}: reading the log of {run_id} failed: {r.stderr.strip()}")
    head, _, body = r.stdout.partition("\n")
    off, pid, code = head.split()
    return Poll(int(off), base64.b64decode(body.strip()), pid != "0", None if code == "-" else int(code))


class _Printer:
    """Turns each host's log bytes into what a person reads, through a :class:`progress.Board`:
    whole lines, cleaned (:mod:`specops.untrusted`), prefixed with the host name when several
    hosts are shown; machine progress lines become the host's progress line instead. Thread-safe."""

    def __init__(self, prefixed: bool, board: progress.Board):
        self.prefixed, self.board, self.lock = prefixed, board, board.lock
        self.partial: dict[str, bytes] = {}
        self.secrets: dict[str, list] = {}  # per host: the secrets to redact
        self.stage: dict[str, object] = {}

    def feed(self, host: str, data: bytes, final: bool = False) -> None:
        buf = self.partial.get(host, b"") + data
        *lines, rest = buf.split(b"\n")
        if final and rest:
            lines, rest = lines + [rest], b""
        self.partial[host] = rest
        prefix = f"{host}| " if self.prefixed else ""
        with self.lock:
            for line in lines:
                text = untrusted.clean(line.decode("utf-8", "replace"), self.secrets.get(host))
                m = progress.MACHINE_LINE.search(text)
                if not m:
                    if progress.MACHINE_PREFIX not in text:  # else a torn machine line: for tools, not a person
                        self.board.print(prefix + text)
                    continue
                parsed = _progress(m.group(1))
                if not isinstance(parsed, dict):  # a torn machine line: for tools, not for a person
                    continue
                if text[:m.start()].strip():  # e.g. a bar the script drew before it, without a newline
                    self.board.print(prefix + text[:m.start()].rstrip())
                parsed = _cleaned(parsed, self.secrets.get(host))
                described, fraction = progress.describe(parsed)
                stage, self.stage[host] = self.stage.get(host), parsed.get("stage")
                self.board.set(host, described, fraction, changed=stage != parsed.get("stage"))


class DrawnOutput:
    """A command's output drawn for a person, as `inv logs --follow` draws a run's log: a file-like
    object to hand a foreground command as its ``out_stream`` (the demo's model build, say), whose
    machine progress lines become one live line and whose other lines print above it."""

    def __init__(self, host: str, out=None):
        self.host, self.board = host, progress.Board(out, every=PLAIN_PROGRESS_EVERY)
        self.printer = _Printer(False, self.board)

    def write(self, text: str) -> int:
        self.printer.feed(self.host, text.encode())
        return len(text)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.printer.feed(self.host, b"", final=True)
        self.board.close()


def logs(hosts: list[Host], run_id: str, *, lines: int = 50, follow: bool = False, out=None) -> int:
    """`inv logs`: the run's log from every selected host that has it.

    With ``follow``, keeps printing until the run has ended on every host, then returns 0 if it
    succeeded everywhere, 1 otherwise; Ctrl-C returns 130 and leaves the run alone.
    """
    check_run_id(run_id)
    out = out or sys.stdout
    board = progress.Board(out, live=None if follow else False, every=PLAIN_PROGRESS_EVERY)
    printer = _Printer(len(hosts) > 1, board)
    stop = threading.Event()
    results: dict[str, Poll] = {}
    errors: dict[str, str] = {}

    def watch(host: Host) -> None:
        try:
            with connect(host) as session:
                printer.secrets[host.name] = untrusted.known_secrets(session)
                offset = None
                while True:
                    poll = poll_log(session, run_id, offset, lines)
                    if poll is None:
                        break
                    printer.feed(host.name, poll.data)
                    offset = poll.offset + len(poll.data)
                    results[host.name] = poll
                    if not follow or (poll.ended and len(poll.data) < CHUNK):
                        break
                    if len(poll.data) < CHUNK and stop.wait(POLL_S):
                        break
                printer.feed(host.name, b"", final=True)
        except SpecopsError as e:
            errors[host.name] = str(e)
            with printer.lock:
                print(f"error: {untrusted.clean_lines(str(e), printer.secrets.get(host.name))}", file=sys.stderr)

    threads = [threading.Thread(target=watch, args=(h,), daemon=True) for h in hosts]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)
    except KeyboardInterrupt:
        stop.set()
        for t in threads:
            t.join()
        board.close()
        print(f"stopped following; run {run_id} goes on (`inv stop {run_id}` stops it)", file=sys.stderr)
        return 130
    board.close()
    if not results and not errors:
        raise SpecopsError(f"no run {run_id} on {', '.join(h.name for h in hosts)}")
    if not follow:
        return 1 if errors else 0
    states = {name: state(p.alive, p.exit_code) for name, p in results.items()}
    for name, s in states.items():
        code = results[name].exit_code
        print(f"{name}: run {run_id} {s}" + (f" (exit {code})" if code is not None else ""), file=sys.stderr)
    return 0 if not errors and all(s == "succeeded" for s in states.values()) else 1
