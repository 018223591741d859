"""`inv serve`: vLLM as a supervised service on each host, and waiting until it really serves.

    serve(session)   render the files, put them in place, start or restart only when they
                     changed (or on --restart); an active, unchanged service is left alone
    wait_ready(...)  follow the startup from the host until /v1/models lists the model:
                     live progress from the log, fail within seconds if vLLM dies, exit 124
                     at the deadline
    stop / status / logs

The watching runs on the host (remote/service_probe.py, sent inline, stdlib only): one
command streams state, HTTP answers and new log lines back, so a remote host's
127.0.0.1 port needs no tunnel and each answer reaches us within one poll interval.
"""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

from . import fanout, urls
from . import secrets as secrets_mod
from .errors import SpecopsError
from .host import Session, connect, quote
from .progress import Display, Startup
from .service_spec import LOOPBACK, Extraction, Layout, Policy, render
from .shared import layout
from .supervisors import choose, host_facts

PROBE_SOURCE = (Path(__file__).resolve().parent.parent / "remote" / "service_probe.py").read_text()
TAIL_LINES = 50


def serve(session: Session, *, supervisor: str | None = None, restart: bool = False, wait: bool = False,
          timeout: float = 3600, secrets: dict[str, str], policy: Policy = Policy(), live: bool | None = None,
          out=None, extract: bool = False, layers: str | None = None) -> dict:
    """Bring the host's vLLM service to the rendered state; with ``wait``, until it serves.

    ``extract``: serve in extraction mode (hidden states of the trainer's layers, or ``layers``)."""
    started = time.monotonic()
    host, layout = session.host, Layout(session.workdir)
    if not host.model:
        raise SpecopsError(f"{host.name}: no `model` in the inventory: set it to the model's directory on the host")
    preflight(session, extract=extract)
    facts = host_facts(session, layout)
    sup = choose(session, facts, layout, supervisor, policy)
    rendered = render(host, workdir=session.workdir, user=facts.user, venv_python=session.venv_python,
                      model=session.path(host.model), secrets=secrets, policy=policy,
                      extract=extraction(session, layers) if extract else None)
    if facts.last and facts.last != sup.name:
        _stop_previous(session, facts, layout, policy, out)
    changed = sup.write(rendered)
    running = sup.running()
    if running and not changed and not restart:
        action = "unchanged: already active, not restarted"
    else:
        sup.start(restart=running)
        action = ("restarted (" + ("files changed" if changed else "--restart") + ")") if running else "started"
    row = {"supervisor": sup.name, "action": action}
    if wait:
        row.update(wait_ready(session, sup, timeout=timeout, secrets=secrets, started=started, live=live, out=out))
    return row


_PREFLIGHT = """
[ -x {venv}/bin/python ] || exit 20
[ -x {venv}/bin/vllm ] || exit 21
[ -e {model} ] || exit 22
[ {extract} = no ] || [ -f {code}/remote/extract.py ] || exit 23
"""


def preflight(session: Session, *, extract: bool = False) -> None:
    """Before anything is written or started: the venv, vLLM in it and the model are there (one round
    trip). Without this a host never deployed starts a service that dies in a second, blaming vLLM."""
    host, model = session.host, session.path(session.host.model)
    venv = layout.venv_dir(session.workdir)  # pip installs vllm's console script with it, on either flavor
    r = session.sh(_PREFLIGHT.format(venv=quote(venv), model=quote(model), extract="yes" if extract else "no",
                                     code=quote(layout.code_dir(session.workdir))), check=False, timeout=60)
    problem = {
        20: f"no venv at {venv} (never deployed here?): run `inv deploy --on {host.name}`, which creates it",
        21: f"vLLM is not installed in {venv}: run `inv deps --on {host.name} --fix`",
        22: f"the model {model} is not on the host: copy it there, or set `model` in the inventory to where it is",
        23: f"no deployed code in {layout.code_dir(session.workdir)} (--extract needs it): run `inv deploy --on {host.name}`",
    }.get(r.exit_code)
    if problem:
        raise SpecopsError(f"{host.name}: {problem}; nothing was started")
    if not r.ok:
        detail = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
        raise SpecopsError(f"{host.name}: cannot check the venv and model (exit {r.exit_code}): {detail}")


def extraction(session: Session, layers: str | None) -> Extraction:
    """The layers to extract for the host's model, by the rule the trainer uses (remote/extract.py
    asks remote/target_states.py), so the ids vLLM writes are the ids the draft config gets."""
    host = session.host
    argv = [session.venv_python, layout.code_file(session.workdir, "remote/extract.py"), "--target", session.path(host.model),
            "--print-layers"] + (["--layers", layers] if layers else [])
    r = session.run(argv, check=False, timeout=300)
    if not r.ok:
        why = (r.stderr.strip() or r.stdout.strip() or f"exit {r.exit_code}").splitlines()[-1]
        raise SpecopsError(f"{host.name}: --extract: {why}", exit_code=2)
    ids = json.loads(r.stdout.strip().splitlines()[-1])["layers"]
    return Extraction(tuple(ids), Layout(session.workdir).states_dir, layout.code_dir(session.workdir))


def _stop_previous(session, facts, layout, policy, out) -> None:
    """Switching supervisors: the old one must let go of the port first."""
    old = choose(session, facts, layout, facts.last, policy)
    if old.running():
        print(f"{session.host.name}: stopping the {old.name} service first (switching supervisor)",
              file=out or sys.stderr, flush=True)
        old.stop()


def served_name(session: Session) -> str:
    host = session.host
    return host.served_model_name or session.path(host.model)


def wait_ready(session: Session, sup, *, timeout: float, secrets: dict[str, str], started: float | None = None,
               live: bool | None = None, out=None) -> dict:
    """Follow the startup until the model is listed; the ready row, or SpecopsError (124 at the deadline)."""
    host = session.host
    started = started or time.monotonic()
    display = Display(host.name, out=out, live=live)
    startup, seen = Startup(), {"health": "down"}
    end: dict = {}

    def on_message(msg: dict) -> None:
        for line in msg.get("log", []):
            startup.feed(line)
        if "health" in msg:
            seen["health"] = str(msg["health"]) if msg["health"] else "down"
        if {"ready", "dead", "timeout"} & msg.keys():
            end.update(msg)
        display.update(startup, seen["health"])

    config = sup.probe_config(served_name(session), timeout=timeout, tail_lines=TAIL_LINES)
    session.run([host.python, "-c", PROBE_SOURCE, "watch", json.dumps(config)], hide="err",
                out_stream=JsonLines(on_message), timeout=timeout + 60)
    display.finish()
    elapsed = time.monotonic() - started
    more = f"inv serve --logs --on {host.name}   (on the host: {sup.log_command(200, follow=False)})"
    if "ready" in end:
        return {"endpoint": endpoint(session), "model": end["ready"]["id"],
                "max_model_len": end["ready"].get("max_model_len"), "ready_in": f"{elapsed:.1f}s"}
    if "dead" in end:
        print_tail(session.host.name, end.get("tail", ""), secrets, out=out)
        raise SpecopsError(f"{host.name}: vLLM died while starting (now {end['dead']['state']}) after "
                           f"{elapsed:.0f}s; its last {TAIL_LINES} log lines are above. More: {more}")
    if "timeout" in end:
        raise SpecopsError(f"{host.name}: not serving after {timeout:g}s: last seen {startup.describe()}, "
                           f"/health {seen['health']}; it keeps starting in the background. More: {more}",
                           exit_code=124)
    raise SpecopsError(f"{host.name}: the readiness probe ended without a verdict; run with --status")


def endpoint(session: Session) -> str:
    host = session.host
    if LOOPBACK.match(host.bind) and not host.is_local:
        return f"http://127.0.0.1:{host.port}/v1 on {host.name} (inv tunnel --on {host.name})"
    return urls.server_url(host.bind, host.port, host_address=None if host.is_local else host.address, path="/v1")


def print_tail(host_name: str, text: str, secrets: dict[str, str], out=None) -> None:
    """The log's last lines, as a terminal would show them (progress bars collapsed), secrets redacted."""
    out = out or sys.stderr
    print(f"--- {host_name}: last {TAIL_LINES} log lines ---", file=out)
    for line in text.splitlines():
        print(secrets_mod.redact(line.split("\r")[-1] or line, secrets), file=out)
    print("---", file=out, flush=True)


def stop(session: Session, *, supervisor: str | None = None, policy: Policy = Policy()) -> dict:
    layout = Layout(session.workdir)
    sup = choose(session, host_facts(session, layout), layout, supervisor, policy)
    was_running = sup.running()
    sup.stop()
    return {"supervisor": sup.name, "action": "stopped" if was_running else "was not running"}


def status(session: Session, *, supervisor: str | None = None, policy: Policy = Policy()) -> dict:
    """State, pid, uptime, model, /health and requests running, as seen on the host."""
    layout = Layout(session.workdir)
    sup = choose(session, host_facts(session, layout), layout, supervisor, policy)
    config = sup.probe_config(served_name(session) if session.host.model else "")
    raw = session.run([session.host.python, "-c", PROBE_SOURCE, "status", json.dumps(config)], timeout=60).stdout
    st = json.loads(raw.strip().splitlines()[-1])
    model = st.get("model") or {}
    return {"supervisor": sup.name, "name": layout.unit_name if sup.name == "systemd" else layout.name,
            "state": st["state"], "pid": st.get("pid"), "uptime": _duration(st.get("uptime_s")),
            "model": model.get("id"), "max_model_len": model.get("max_model_len"),
            "health": st.get("health") or "down", "running": st.get("running")}


def logs(session: Session, *, supervisor: str | None = None, lines: int = 100, follow: bool = False,
         secrets: dict[str, str], prefix: str = "", out=None, policy: Policy = Policy()) -> None:
    """Print the service log (journalctl or the tmux log); with ``follow``, until Ctrl-C, which ends
    only the following (the pty carries Ctrl-C to the remote tail; the service is untouched)."""
    layout = Layout(session.workdir)
    sup = choose(session, host_facts(session, layout), layout, supervisor, policy)
    sink = Redacting(out or sys.stdout, secrets, prefix)
    try:
        session.sh(sup.log_command(lines, follow), check=False, pty=follow, hide=False, out_stream=sink,
                   timeout=None if follow else 120)
    except KeyboardInterrupt:
        pass
    sink.finish()


def _duration(seconds) -> str | None:
    if seconds is None:
        return None
    d, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return (f"{d}d" if d else "") + (f"{h}h" if d or h else "") + f"{m}m{s:02d}s"


class JsonLines(io.TextIOBase):
    """A write-only stream that hands each complete JSON line to ``handle`` (others are ignored)."""

    def __init__(self, handle):
        self.handle, self.buffer = handle, ""

    def write(self, text: str) -> int:
        self.buffer += text
        *lines, self.buffer = self.buffer.split("\n")
        for line in lines:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict):
                self.handle(msg)
        return len(text)


class Redacting(io.TextIOBase):
    """Line-buffered pass-through that replaces secret values, optionally prefixing each line."""

    def __init__(self, out, secrets: dict[str, str], prefix: str = ""):
        self.out, self.secrets, self.prefix, self.buffer = out, secrets, prefix, ""

    def write(self, text: str) -> int:
        self.buffer += text
        *lines, self.buffer = self.buffer.split("\n")
        for line in lines:
            self.out.write(self.prefix + secrets_mod.redact(line, self.secrets) + "\n")
        self.out.flush()
        return len(text)

    def finish(self) -> None:
        if self.buffer:
            self.out.write(self.prefix + secrets_mod.redact(self.buffer, self.secrets) + "\n")
            self.buffer = ""
        self.out.flush()


def on_hosts(hosts, *, wait=False, timeout=3600.0, restart=False, supervisor=None, stop_service=False,
        show_status=False, show_logs=False, follow=False, lines=100, as_json=False, extract=False,
        layers=None) -> int:
    """`inv serve` on the selected hosts, in parallel, one result row each; the exit code."""
    if sum([stop_service, show_status, show_logs]) > 1:
        raise SpecopsError("choose one of --stop, --status, --logs", exit_code=2)
    if follow and not show_logs:
        raise SpecopsError("--follow goes with --logs", exit_code=2)
    if layers and not extract:
        raise SpecopsError("--layers goes with --extract", exit_code=2)
    if supervisor not in (None, "systemd", "tmux"):
        raise SpecopsError(f"--supervisor {supervisor!r}: expected systemd or tmux", exit_code=2)
    if show_logs:
        return _logs_on(hosts, supervisor=supervisor, lines=lines, follow=follow)
    if stop_service:
        return fanout.report(fanout.each(hosts, stop, supervisor=supervisor), as_json=as_json)
    if show_status:
        return fanout.report(fanout.each(hosts, status, supervisor=supervisor), as_json=as_json)
    secrets = secrets_mod.load()
    live = None if len(hosts) == 1 else False  # one updating line only makes sense for one host
    return fanout.report(fanout.each(hosts, serve, supervisor=supervisor, restart=restart, wait=wait,
                                     timeout=timeout, secrets=secrets, live=live, extract=extract, layers=layers),
                         as_json=as_json)


def _logs_on(hosts, *, supervisor, lines, follow) -> int:
    if follow and len(hosts) > 1:
        raise SpecopsError("--follow takes one host: pass --on HOST", exit_code=2)
    secrets = secrets_mod.load()
    for host in hosts:
        with connect(host) as session:
            logs(session, supervisor=supervisor, lines=lines, follow=follow, secrets=secrets,
                 prefix=f"{host.name}: " if len(hosts) > 1 else "")
    return 0
