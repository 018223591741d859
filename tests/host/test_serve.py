"""`inv serve` and `inv tunnel` on real hosts.

- systemd: a booted systemd machine (nspawn), as the non-root `ml` user with sudo limited to
  systemctl/journalctl/install; the served process is tests/helpers/standin_vllm.py (a real vLLM cannot
  start inside the machine), started by the real unit with the real env file.
- tmux: a loopback sshd host without systemd serving the stand-in (fast lifecycle checks); a real vLLM
  under tmux is tests/vllm/test_serve_vllm.py.

Test hosts' venvs: <workdir>/venv/bin/python is a shim that runs the stand-in, so the rendered command
line is exactly what a deployed host runs.
"""

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from specops.service_spec import Layout
from tests.helpers.hostbed import write_inventory
from tests.helpers.invoke_cli import REPO, inv
from tests.helpers.standin_vllm import HERE as STANDIN
from tests.helpers.serve_bed import PHASE, host_sh, inventory_port, outputs, tmux_inventory
from tests.helpers.vllm_proc import free_port

AWKWARD = 'a b $HOME "q" \\x %n'  # must reach the process verbatim through unit and env file


def shim(host, venv):
    """<venv>/bin/{python,vllm} → the stand-in, written over SSH (the host may have its own filesystem);
    and the model directory the stand-in "serves" (`inv serve` checks that it exists)."""
    text = f'#!/bin/sh\nexec /usr/bin/python3 {STANDIN} "$@"\n'
    for name in ("python", "vllm"):
        host_sh(host, f"mkdir -p '{venv}/bin' '{venv}/../models/standin' && cat >'{venv}/bin/{name}' && "
                      f"chmod 755 '{venv}/bin/{name}'", text)


# ---------------------------------------------------------------- systemd (nspawn, non-root ml)

@pytest.fixture
def sysd(systemd_host, tmp_path):
    """(ml host, inventory writer, workdir) on the systemd machine; the service is removed afterwards."""
    ml, root = systemd_host["ml"], systemd_host["root"]
    workdir = f"{ml.workdir}/svc dir"
    shim(ml, f"{workdir}/venv")
    port = free_port()  # one for the fixture: a changed port is a changed unit, which serve restarts

    def inventory(**extra):
        env = {"STANDIN_LOAD_S": "1", "STANDIN_RECORD": f"{workdir}/record.json", "SPECOPS_TEST_AWKWARD": AWKWARD}
        vars_ = {"workdir": workdir, "flavor": "cpu", "model": "models/standin", "served_model_name": "standin",
                 "port": port, "python": "/usr/bin/python3", "vllm_args": ["--awkward", AWKWARD], "env": env}
        vars_.update(extra)
        return write_inventory(tmp_path / "inventory.yaml", {"gpu": [ml]}, host_vars={ml.name: vars_})

    yield ml, inventory, workdir
    host_sh(root, "for u in $(systemctl list-unit-files 'specops-*-vllm.service' --no-legend | cut -d' ' -f1); do "
                  "systemctl disable --now \"$u\"; rm -f \"/etc/systemd/system/$u\"; done; systemctl daemon-reload; "
                  "systemctl reset-failed 'specops-*-vllm.service'", check=False)


def unit(workdir) -> str:
    return Layout(workdir).unit_name


def main_pid(root, workdir) -> int:
    return int(host_sh(root, f"systemctl show -p MainPID --value {unit(workdir)}").strip())


def test_systemd_serve_is_idempotent_restarts_on_change_and_stops(sysd, systemd_host, api_key):
    ml, inventory, workdir = sysd
    root = systemd_host["root"]
    path = inventory()
    first = inv("serve", "--on", ml.name, "--wait", "--timeout", "60", inventory=path)
    assert first.returncode == 0, outputs(first)
    assert "systemd" in first.stdout and "started" in first.stdout and "standin" in first.stdout
    pid = main_pid(root, workdir)
    assert pid > 0 and host_sh(root, f"systemctl is-active {unit(workdir)}").strip() == "active"

    # the unit ran exactly the rendered command line, in the workdir, with the env file's values
    record = json.loads(host_sh(ml, f"cat '{workdir}/record.json'"))
    assert record["argv"][-2:] == ["--awkward", AWKWARD] and record["cwd"] == workdir
    assert record["argv"][:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model", f"{workdir}/models/standin"]
    assert record["has_api_key"] and record["pid"] == pid
    assert host_sh(ml, f"tr '\\0' '\\n' </proc/{pid}/environ | grep ^SPECOPS_TEST_AWKWARD=").strip() == \
        "SPECOPS_TEST_AWKWARD=" + AWKWARD

    again = inv("serve", "--on", ml.name, "--wait", "--timeout", "60", inventory=path)
    assert again.returncode == 0 and "unchanged" in again.stdout, outputs(again)
    assert main_pid(root, workdir) == pid

    changed = inv("serve", "--on", ml.name, "--wait", "--timeout", "60", inventory=inventory(max_model_len=1024))
    assert changed.returncode == 0 and "restarted (files changed)" in changed.stdout, outputs(changed)
    assert main_pid(root, workdir) != pid and "1024" in changed.stdout

    status = inv("serve", "--on", ml.name, "--status", "--json", inventory=path)
    row = json.loads(status.stdout)[0]
    assert row["state"] == "active (running)" and row["model"] == "standin" and row["health"] == 200
    assert row["running"] == 0 and row["pid"] == main_pid(root, workdir)

    logs = inv("serve", "--on", ml.name, "--logs", "--lines", "30", inventory=path)
    assert logs.returncode == 0 and "Starting vLLM server" in logs.stdout, outputs(logs)

    # security: the key is only in the 0600 env file owned by the service user
    assert host_sh(root, f"stat -c '%a %U' '{workdir}/service/vllm.env'").strip() == "600 ml"
    assert api_key in host_sh(root, f"cat '{workdir}/service/vllm.env'")
    assert api_key not in host_sh(root, f"cat {Layout(workdir).unit_path}")
    assert api_key not in host_sh(root, "ps -eo args")
    stop = inv("serve", "--on", ml.name, "--stop", inventory=path)
    assert stop.returncode == 0 and "stopped" in stop.stdout, outputs(stop)
    assert host_sh(root, f"systemctl is-active {unit(workdir)}", check=False).strip() == "inactive"
    assert api_key not in outputs(first, again, changed, status, logs, stop)


def test_two_workdirs_on_one_machine_are_two_services_that_leave_each_other_alone(sysd, systemd_host, api_key):
    """Two servers on one machine (say GPUs 0-3 and 4-7), each with its workdir and port."""
    ml, inventory, first = sysd
    root = systemd_host["root"]
    second = f"{ml.workdir}/second"
    shim(ml, f"{second}/venv")
    a = inv("serve", "--on", ml.name, "--wait", "--timeout", "60", inventory=inventory())
    assert a.returncode == 0, outputs(a)
    pid = main_pid(root, first)
    b = inv("serve", "--on", ml.name, "--wait", "--timeout", "60", inventory=inventory(workdir=second, port=8001))
    assert b.returncode == 0 and "started" in b.stdout, outputs(b)
    status = inv("serve", "--on", ml.name, "--status", "--json", inventory=inventory(workdir=second, port=8001))
    assert unit(first) != unit(second) == json.loads(status.stdout)[0]["name"], outputs(status)
    assert main_pid(root, second) > 0 and main_pid(root, first) == pid  # the first load was not wasted
    stop = inv("serve", "--on", ml.name, "--stop", inventory=inventory(workdir=second, port=8001))
    assert stop.returncode == 0, outputs(stop)
    assert host_sh(root, f"systemctl is-active {unit(second)}", check=False).strip() == "inactive"
    assert host_sh(root, f"systemctl is-active {unit(first)}").strip() == "active" and main_pid(root, first) == pid


def test_systemd_death_during_start_fails_fast_with_the_log_tail(sysd, api_key):
    ml, inventory, _ = sysd
    started = time.monotonic()
    proc = inv("serve", "--on", ml.name, "--wait", "--timeout", "120",
               inventory=inventory(env={"STANDIN_LOAD_S": "30", "STANDIN_DIE_AT_S": "2"}))
    assert proc.returncode == 1, outputs(proc)
    assert time.monotonic() - started < 15
    assert "died while starting" in proc.stdout and "inv serve --logs" in proc.stdout
    assert "simulated crash" in proc.stderr and "last 50 log lines" in proc.stderr


def test_missing_sudo_rule_is_one_clear_line(sysd, systemd_host, api_key):
    ml, inventory, _ = sysd
    root = systemd_host["root"]
    host_sh(root, "mv /etc/sudoers.d/specops-ml /root/specops-ml.sudoers")
    try:
        proc = inv("serve", "--on", ml.name, inventory=inventory())
    finally:
        host_sh(root, "mv /root/specops-ml.sudoers /etc/sudoers.d/specops-ml")
    assert proc.returncode == 1
    assert "NOPASSWD" in proc.stdout and "/usr/bin/systemctl" in proc.stdout and "sudo -n install" in proc.stdout
    assert "Traceback" not in outputs(proc)


# ---------------------------------------------------------------- tmux (sshd host without systemd)


def health(port) -> int | None:
    """/health's status, or None when no HTTP server answers (the freed port may even be another test's sshd)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return resp.status
    except (OSError, http.client.HTTPException):
        return None


def test_tmux_serve_lifecycle_and_logs_follow(tmp_path, ssh_host, api_key):
    # the loopback host shares this machine's files and network, but not its pid namespace:
    # the stand-in's recorded pid is compared with itself, and liveness is checked over HTTP
    workdir = f"{ssh_host.workdir}/my work"
    shim(ssh_host, f"{workdir}/venv")
    path = tmux_inventory(tmp_path, ssh_host, workdir, model="models/standin",
                          env={"STANDIN_LOAD_S": "1", "STANDIN_RECORD": f"{workdir}/record.json"})
    port = inventory_port(path)
    recorded_pid = lambda: json.loads(Path(workdir, "record.json").read_text())["pid"]  # noqa: E731
    try:
        first = inv("serve", "--on", ssh_host.name, "--wait", "--timeout", "60", inventory=path)
        assert first.returncode == 0 and "tmux" in first.stdout and "started" in first.stdout, outputs(first)
        assert PHASE.search(first.stderr)
        pid = recorded_pid()
        again = inv("serve", "--on", ssh_host.name, inventory=path)
        assert "unchanged" in again.stdout and recorded_pid() == pid, outputs(again)
        restarted = inv("serve", "--on", ssh_host.name, "--restart", "--wait", inventory=path)
        assert "restarted (--restart)" in restarted.stdout and recorded_pid() != pid, outputs(restarted)

        follow = subprocess.Popen([sys.executable, "-m", "specops", "serve", "--on", ssh_host.name, "--logs", "--follow"],
                                  cwd=REPO, env={**os.environ, "SPECOPS_INVENTORY": str(path),
                                                 "SPECOPS_SSH_CONFIG": "none"},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert follow.stdout.readline(), "no log output"
        time.sleep(0.5)
        follow.send_signal(signal.SIGINT)  # Ctrl-C: ends the following only
        assert follow.wait(timeout=15) == 0
        assert health(port) == 200, "Ctrl-C on --logs --follow must not stop the service"

        stop = inv("serve", "--on", ssh_host.name, "--stop", inventory=path)
        assert stop.returncode == 0 and "stopped" in stop.stdout, outputs(stop)
        assert health(port) is None
        assert api_key not in outputs(first, again, restarted, stop)
    finally:
        inv("serve", "--on", ssh_host.name, "--stop", inventory=path)


def test_deadline_exits_124_with_what_was_last_seen(tmp_path, ssh_host, api_key):
    workdir = f"{ssh_host.workdir}/slow"
    shim(ssh_host, f"{workdir}/venv")
    path = tmux_inventory(tmp_path, ssh_host, workdir, model="models/standin", env={"STANDIN_LOAD_S": "60"})
    try:
        proc = inv("serve", "--on", ssh_host.name, "--wait", "--timeout", "3", inventory=path)
        assert proc.returncode == 124, outputs(proc)
        assert "not serving after 3s: last seen loading weights" in proc.stdout
        assert "keeps starting in the background" in proc.stdout
    finally:
        inv("serve", "--on", ssh_host.name, "--stop", inventory=path)


def test_tunnel_reaches_the_hosts_loopback_port(tmp_path, ssh_host):
    class Hello(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"hello through the tunnel")

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hello)  # the loopback host shares this network
    threading.Thread(target=server.serve_forever, daemon=True).start()
    path = tmux_inventory(tmp_path, ssh_host, ssh_host.workdir, port=server.server_address[1])
    local = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specops", "tunnel", "--on", ssh_host.name, "--local-port", str(local)],
                            cwd=REPO, env={**os.environ, "SPECOPS_INVENTORY": str(path), "SPECOPS_SSH_CONFIG": "none"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"http://127.0.0.1:{local}/v1"), line or proc.stderr.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{local}/", timeout=10) as resp:
            assert resp.read() == b"hello through the tunnel"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0
    finally:
        proc.kill()
        server.shutdown()


def test_tunnel_reaches_a_tensorboard_on_the_host(tmp_path, ssh_host):
    """A real TensorBoard on the host's loopback, over a run's event files, read through `inv tunnel
    --remote-port`: the scalars a train run writes, seen from here without pulling. The tunnel is
    opened, and used once, before TensorBoard listens (as a user may while a service starts): that
    connection fails at once, and the tunnel still serves the next ones (Fabric's forwarder died there)."""
    from torch.utils.tensorboard import SummaryWriter

    logdir = Path(ssh_host.workdir) / "runs" / "train-tb" / "tensorboard"
    with SummaryWriter(str(logdir)) as writer:
        for step, loss in enumerate([3.0, 2.5, 2.0]):
            writer.add_scalar("train/loss", loss, step)
    board_port, local = free_port(), free_port()
    path = tmux_inventory(tmp_path, ssh_host, ssh_host.workdir)
    proc = subprocess.Popen([sys.executable, "-m", "specops", "tunnel", "--on", ssh_host.name, "--local-port", str(local),
                             "--remote-port", str(board_port)],
                            cwd=REPO, env={**os.environ, "SPECOPS_INVENTORY": str(path), "SPECOPS_SSH_CONFIG": "none"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    board = None
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"http://127.0.0.1:{local}/ "), line or proc.stderr.read()
        url = f"http://127.0.0.1:{local}/data/plugin/scalars/scalars?run=train-tb/tensorboard&tag=train/loss"
        started = time.monotonic()
        with pytest.raises(OSError):  # nothing listens on the host's port yet
            urllib.request.urlopen(url, timeout=20)
        assert time.monotonic() - started < 10  # refused, not left hanging
        board = subprocess.Popen([str(Path(sys.executable).parent / "tensorboard"), "--logdir",
                                  str(logdir.parent.parent), "--port", str(board_port)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline, seen = time.monotonic() + 90, None
        while time.monotonic() < deadline:  # TensorBoard answers once it has started and read the logdir
            try:
                with urllib.request.urlopen(url, timeout=20) as resp:
                    seen = [round(value, 3) for _, _, value in json.loads(resp.read())]
                if len(seen) == 3:
                    break
            except OSError:  # not up yet
                pass
            time.sleep(0.5)
        assert seen == [3.0, 2.5, 2.0], (seen, board.poll(), proc.poll())
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0
    finally:
        proc.kill()
        if board:
            board.kill()
            board.wait()
