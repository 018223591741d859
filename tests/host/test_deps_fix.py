"""`inv deps --fix` shows pip's output as it comes (one `host: line` each) and Ctrl-C stops the install
on the host too. Before the fix nothing was printed for the whole install, and Ctrl-C left pip running
on the host (no terminal: nothing told it the user had gone)."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.hostbed import write_inventory
from tests.helpers.invoke_cli import REPO


@pytest.fixture
def silent_index():
    """A package index that accepts connections and never answers: pip waits on it for minutes."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held = []

    def accept():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}/simple"
    server.close()
    for conn in held:
        conn.close()


def _bed(tmp_path, host, requirements: str):
    work = Path(host.workdir)
    req = work / "code" / "requirements"
    req.mkdir(parents=True)
    (work / "code" / "remote").mkdir()
    shutil.copy(REPO / "remote" / "check_deps.py", work / "code" / "remote")
    (req / "remote.txt").write_text(requirements)
    (req / "cpu.txt").write_text("")
    os.chown(work / "code", os.stat(work).st_uid, os.stat(work).st_gid)
    return write_inventory(tmp_path / "inventory.yaml", {"bed": [host]},
                           host_vars={host.name: {"flavor": "cpu", "python": sys._base_executable}})


def _pips(workdir: str) -> list[str]:
    """Processes of this machine (the loopback host's pid namespace is inside it) running the bed's pip."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"{workdir}/venv/bin/python -m pip" in cmd:
            found.append(f"{proc.name}: {cmd}")
    return found


@pytest.mark.parametrize("user", ["root", "ml"])
def test_ctrl_c_stops_the_remote_pip_and_its_output_was_shown(tmp_path, loopback, silent_index, user):
    host = loopback[user]
    path = _bed(tmp_path, host, "six==1.16.0\n")
    env = {**os.environ, "SPECOPS_INVENTORY": str(path), "SPECOPS_SSH_CONFIG": "none", "PYTHONUNBUFFERED": "1"}
    first = subprocess.run([sys.executable, "-m", "specops", "deps", "--on", "bed"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)  # makes the venv, finds six missing
    assert first.returncode == 1 and "six missing" in first.stdout, first.stdout + first.stderr
    (Path(host.workdir) / "venv" / "pip.conf").write_text(f"[global]\nindex-url = {silent_index}\n")
    proc = subprocess.Popen([sys.executable, "-m", "specops", "deps", "--on", "bed", "--fix"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    reader = threading.Thread(target=lambda: seen.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 90
    while not _pips(host.workdir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pips(host.workdir), "pip never started: " + "".join(seen)
    deadline = time.monotonic() + 20
    while not any(silent_index in line for line in seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    finally:
        proc.kill()
    reader.join(timeout=5)
    text = "".join(seen)
    assert [line for line in seen if line.startswith(f"{host.name}: ") and silent_index in line], text
    deadline = time.monotonic() + 10
    while _pips(host.workdir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pips(host.workdir) == [], text
