"""Detached runs: a command started on a host that outlives the SSH connection.

A run is one command in a detached tmux session ``specops-<workdir hash>-<run-id>`` on each host it was
started on (the same run id everywhere). Everything about it lives in
``<workdir>/runs/<run-id>/``, which is also the command's working directory (``--out .``); its
files (cmd, meta.json, log, exit_code, manifest.json, and each script's outputs) are named in
remote/layout.py. A run's state comes from those files and tmux alone:

    running    its tmux session is alive and no exit code is recorded yet
    succeeded  exit_code is 0          failed  exit_code is anything else
    lost       no tmux session and no exit code (session killed, host rebooted)

Launching::

    $ inv generate --on gpu -n 10000
    host  status  run                       shard
    gpu1  ok      generate-20261202-130501  0/2
    gpu2  ok      generate-20261202-130501  1/2
    watch it:  inv status --on gpu --run generate-20261202-130501
               inv logs --on gpu --run generate-20261202-130501 --follow
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from datetime import datetime, timezone
from typing import Callable

from . import fanout, owned
from .errors import HostError, SpecopsError
from .host import Session, quote
from .inventory import Host
from .shared import layout
from .service_spec import SERVICE, Layout

# tmux forbids '.' and ':' in session names; \Z, as $ would let a trailing newline through
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,99}\Z")

# Shell helper shared by every remote snippet that asks tmux about a run: the pid of the live
# pane of session $1 (the wrapper, leader of the run's process group), or nothing. A pane that
# is dead but kept (a user's remain-on-exit) counts as gone.
LIVE_PID = """live_pid() { tmux list-panes -s -t "=$1" -F '#{pane_dead} #{pane_pid}' 2>/dev/null | awk '$1 == 0 {print $2; exit}'; }"""


def new_run_id(kind: str) -> str:
    return f"{kind}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"


def check_run_id(run_id: str) -> str:
    if not RUN_ID.match(run_id):
        raise SpecopsError(f"run id {run_id!r}: use letters, digits, '-' and '_' only (at most 100)", exit_code=2)
    if run_id == SERVICE:
        raise SpecopsError(f"run id {run_id!r} is taken by the vLLM service's tmux session; choose another",
                           exit_code=2)
    return run_id


def tmux_session(session: Session, run_id: str) -> str:
    return f"{Layout(session.workdir).prefix}-{run_id}"


def runs_dir(session: Session) -> str:
    return layout.runs_dir(session.workdir)


def run_dir(session: Session, run_id: str) -> str:
    return f"{runs_dir(session)}/{run_id}"


def state(alive: bool, exit_code: int | None) -> str:
    if exit_code is not None:
        return "succeeded" if exit_code == 0 else "failed"
    return "running" if alive else "lost"


# ---------------------------------------------------------------- launching

_LAUNCH = """
d={dir}; s={session}
if [ -n "$(live_pid "$s")" ]; then exit 10; fi
if [ -e "$d" ] && [ {resume} = no ]; then cat "$d/{L.EXIT_CODE}" 2>/dev/null; exit 11; fi
if [ ! -e "$d" ] && [ {resume} = yes ]; then exit 12; fi
[ -f {wrapper} ] || exit 13
[ -x {python} ] || exit 14
command -v tmux >/dev/null || exit 15
{claim}
umask 077  # a run's files (replies, errors, logs) are its user's alone
mkdir -p "$d" && chmod 700 "$d" && cd "$d" && rm -f {L.EXIT_CODE} {L.MANIFEST} || exit 16
printf '%s\\n' {cmd} >{L.CMD} && printf '%s\\n' {meta} >{L.META} || exit 16
tmux kill-session -t "=$s" 2>/dev/null  # a finished session kept by remain-on-exit
tmux new-session -d -s "$s" -c "$d" {pane}
"""


def launch(session: Session, kind: str, argv: list[str], *, run_id: str | None = None, resume: bool = False,
           env_file: str | None = None, plan: dict | None = None) -> str:
    """Start ``argv`` as a detached run on this host and return its run id.

    ``argv[0]`` should be absolute (e.g. ``session.venv_python``): a run has no login shell.
    ``plan`` ({host name: its shard spec}, see :mod:`specops.plan`) is recorded in meta.json, so any
    host of the group can tell who owns which rows; ``argv`` already carries this host's part, as its
    script spells it. ``resume`` relaunches the finished run ``run_id``
    with ``--resume`` appended. The host's env file (default ``<workdir>/service/vllm.env``) is
    sourced by the wrapper, so secrets never reach a command line.

    Raises HostError when the run is live already (naming it, to attach to), when ``run_id``
    exists and ``resume`` is not set (or the reverse), or when code or venv are not deployed.
    """
    if resume and not run_id:
        raise SpecopsError("--resume needs the run id to continue (--name RUN)", exit_code=2)
    run_id = check_run_id(run_id or new_run_id(kind))
    argv = [str(a) for a in argv]
    if resume and "--resume" not in argv:
        argv.append("--resume")
    name, d = session.host.name, run_dir(session, run_id)
    code_dir = layout.code_dir(session.workdir)
    version = session.read_file(f"{code_dir}/{layout.VERSION}")
    meta = {"run_id": run_id, "kind": kind, "host": name, "argv": argv, "shard": (plan or {}).get(name),
            **({"plan": plan} if plan else {}), "resume": resume,
            "code_version": version.decode().strip() if version else None,
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    wrapper = f"{code_dir}/remote/run.sh"
    env_file = env_file or Layout(session.workdir).env_file
    pane = shlex.join(["exec", "bash", wrapper, d, session.venv_python, env_file])
    script = _LAUNCH.format(L=layout, claim=owned.claim_line(session, layout.RUNS), dir=quote(d),
                            session=quote(tmux_session(session, run_id)),
                            resume="yes" if resume else "no", wrapper=quote(wrapper),
                            python=quote(session.venv_python), cmd=quote(shlex.join(argv)),
                            meta=quote(json.dumps(meta)), pane=quote(pane))
    r = session.sh(LIVE_PID + owned.FUNCTIONS + script, check=False, timeout=60)
    if problem := owned.refusal(session, r.exit_code, r.stderr):
        raise problem
    refusals = {
        10: f"run {run_id} is live on {name}; watch it with `inv logs {run_id} --follow` or stop it with "
            f"`inv stop {run_id}`",
        11: f"run {run_id} already exists on {name} ({_ended(r.stdout)}); continue it with --resume or choose "
            f"another --name",
        12: f"no run {run_id} on {name} to resume",
        13: f"specops code is not deployed on {name} ({wrapper} missing): run `inv deploy`",
        14: f"no venv on {name} ({session.venv_python} missing): run `inv deps --fix`",
        15: f"tmux is not installed on {name}: runs need it (apt-get install tmux)",
        16: f"cannot write the run directory {d} on {name}: {r.stderr.strip()}",
    }
    if r.exit_code in refusals:
        raise HostError(refusals[r.exit_code])
    if not r.ok:
        raise HostError(f"{name}: tmux could not start run {run_id}: {(r.stderr or r.stdout).strip()}")
    return run_id


def _ended(exit_code_text: str) -> str:
    text = exit_code_text.strip()
    return f"ended with exit code {text}" if text else "lost or never started"


def launch_on(hosts: list[Host], kind: str, build_argv: Callable[[Session, int, int], list[str]], *,
              name: str | None = None, resume: bool = False, plan: dict | None = None, on: str | None = None,
              env_file: str | None = None, out=None) -> tuple[str, int]:
    """Start one run per host, in parallel, all with the same run id; returns (run id, exit code).

    ``build_argv(session, index, count)`` gives each host's command (index/count: the host's
    place in the selection, e.g. torchrun's node rank). The command runs in its run directory,
    so ``--out .`` puts outputs there. ``plan``, {host name: its shard spec} (:mod:`specops.plan`), is
    recorded with each host's run; ``build_argv`` hands each host its part. Prints one row per host,
    then the commands to watch the run.
    """
    out = out or sys.stdout
    run_id = check_run_id(name or new_run_id(kind))
    plan = plan or {}

    def start(session: Session, index: int, count: int) -> dict:
        part = plan.get(session.host.name)
        launch(session, kind, build_argv(session, index, count), run_id=run_id, resume=resume,
               env_file=env_file, plan=plan or None)
        return {"run": run_id, "shard": part or "-"}

    code = fanout.report(fanout.each(hosts, start), out=out)
    args = (f"--on {on} " if on else "") + f"--run {run_id}"
    if code == 0:
        print(f"watch it:  inv status {args}\n"
              f"           inv logs {args} --follow\n"
              f"stop it:   inv stop {args}\n"
              f"fetch it:  inv pull {args}", file=out)
    return run_id, code


_META = """
d={dir}
[ -f "$d/{L.META}" ] || exit 12
pid=$(live_pid {session}); printf '%s\\n' "${{pid:-0}}"
cat "$d/{L.META}"
"""


def run_meta(session: Session, run_id: str) -> dict:
    """{"live": whether the run's tmux pane is alive, "meta": its meta.json}; HostError if there is no such run."""
    r = session.sh(LIVE_PID + _META.format(L=layout, dir=quote(run_dir(session, run_id)),
                                          session=quote(tmux_session(session, run_id))), check=False, timeout=30)
    if r.exit_code == 12:
        raise HostError(f"no run {run_id} on {session.host.name}")
    if not r.ok:
        raise HostError(f"{session.host.name}: cannot read run {run_id}: {r.stderr.strip()}")
    pid, _, meta = r.stdout.partition("\n")
    return {"live": pid.strip() != "0", "meta": json.loads(meta)}


# ---------------------------------------------------------------- stopping

_STOP = """
d={dir}; s={session}
[ -d "$d" ] || exit 12
pid=$(live_pid "$s")
if [ -z "$pid" ]; then cat "$d/{L.EXIT_CODE}" 2>/dev/null; exit 0; fi
ended() {{ i=0; while [ ! -f "$d/{L.EXIT_CODE}" ] && [ -n "$(live_pid "$s")" ] && [ $i -lt {ticks} ]; do
  sleep 0.1; i=$((i + 1)); done; [ -f "$d/{L.EXIT_CODE}" ] || [ -z "$(live_pid "$s")" ]; }}
kill -INT -- "-$pid" 2>/dev/null
ended || {{ kill -TERM -- "-$pid" 2>/dev/null; ended; }} || exit 13
cat "$d/{L.EXIT_CODE}" 2>/dev/null
"""


def stop(session: Session, run_id: str, grace: float = 30) -> dict:
    """SIGINT to the run's process group, SIGTERM after ``grace`` seconds; outputs are kept.

    Returns the row for the host: the run's state and exit code (the wrapper records it).
    """
    name = session.host.name
    script = _STOP.format(L=layout, dir=quote(run_dir(session, run_id)), session=quote(tmux_session(session, run_id)),
                          ticks=int(grace * 10))
    r = session.sh(LIVE_PID + script, check=False, timeout=2 * grace + 60)
    if r.exit_code == 12:
        raise HostError(f"no run {run_id} on {name}")
    if r.exit_code == 13:
        raise HostError(f"run {run_id} on {name} ignored SIGINT and SIGTERM for {grace:g}s each; it is still "
                        f"running (its process group is led by the tmux pane of {tmux_session(session, run_id)})")
    if not r.ok:
        raise HostError(f"{name}: stopping {run_id} failed: {(r.stderr or r.stdout).strip()}")
    text = r.stdout.strip()
    exit_code = int(text) if text.lstrip("-").isdigit() else None
    return {"run": run_id, "state": state(False, exit_code), "exit_code": exit_code}


def stop_on(hosts: list[Host], run_id: str, grace: float = 30) -> int:
    """`inv stop`: stop the run on every selected host; one row each."""
    return fanout.report(fanout.each(hosts, stop, check_run_id(run_id), grace))
