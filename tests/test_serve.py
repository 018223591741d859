"""`inv serve` and `inv tunnel` on real hosts.

- systemd: a booted systemd machine (nspawn), as the non-root `ml` user with sudo limited to
  systemctl/journalctl/install; the served process is tests/standin_vllm.py (a real vLLM cannot
  start inside the machine), started by the real unit with the real env file.
- tmux: real sshd hosts without systemd: a loopback host serving the stand-in (fast lifecycle
  checks), and a network-namespace host serving the tiny model with real vLLM.

Test hosts' venvs: the stand-in tests make <workdir>/venv/bin/python a shim that runs the
stand-in; the real-vLLM test makes <workdir>/venv a symlink to this repo's .venv (the test host
shares this filesystem), so the rendered command line is exactly what a deployed host runs.
"""

import http.client
import json
import os
import re
import secrets as pysecrets
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
from tests.hostbed import write_inventory
from tests.invoke_cli import inv
from tests.standin_vllm import HERE as STANDIN
from tests.vllm_proc import free_port

REPO = Path(__file__).resolve().parent.parent
AWKWARD = 'a b $HOME "q" \\x %n'  # must reach the process verbatim through unit and env file
PHASE = re.compile(r"(loading weights|weights loaded|engine initialised|starting API server|startup complete)")


def host_sh(host, cmd, input=None, check=True):
    done = subprocess.run(host.ssh_argv(cmd), input=input, capture_output=True, text=True, timeout=60)
    if check and done.returncode:
        raise AssertionError(f"{cmd!r} on {host.name} failed: {done.stderr}")
    return done.stdout


def shim(host, venv):
    """<venv>/bin/{python,vllm} → the stand-in, written over SSH (the host may have its own filesystem);
    and the model directory the stand-in "serves" (`inv serve` checks that it exists)."""
    text = f'#!/bin/sh\nexec /usr/bin/python3 {STANDIN} "$@"\n'
    for name in ("python", "vllm"):
        host_sh(host, f"mkdir -p '{venv}/bin' '{venv}/../models/standin' && cat >'{venv}/bin/{name}' && "
                      f"chmod 755 '{venv}/bin/{name}'", text)


@pytest.fixture
def api_key(tmp_path, monkeypatch):
    """A fresh API key in a private secrets file, the way a user keeps it."""
    key = "sk-" + pysecrets.token_hex(16)
    f = tmp_path / "secrets.env"
    f.write_text(f"VLLM_API_KEY={key}\n")
    f.chmod(0o600)
    monkeypatch.setenv("SPECOPS_SECRETS_FILE", str(f))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    return key


def outputs(*procs) -> str:
    return "".join(p.stdout + p.stderr for p in procs)


# ---------------------------------------------------------------- systemd (nspawn, non-root ml)

@pytest.fixture
def sysd(systemd_host, tmp_path):
    """(ml host, inventory writer, workdir) on the systemd machine; the service is removed afterwards."""
    ml, root = systemd_host["ml"], systemd_host["root"]
    workdir = f"{ml.workdir}/svc dir"
    shim(ml, f"{workdir}/venv")

    def inventory(**extra):
        env = {"STANDIN_LOAD_S": "1", "STANDIN_RECORD": f"{workdir}/record.json", "SPECOPS_TEST_AWKWARD": AWKWARD}
        vars_ = {"workdir": workdir, "flavor": "cpu", "model": "models/standin", "served_model_name": "standin",
                 "port": 8000, "python": "/usr/bin/python3", "vllm_args": ["--awkward", AWKWARD], "env": env}
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

def tmux_inventory(tmp_path, host, workdir, **extra):
    vars_ = {"workdir": workdir, "flavor": "cpu", "served_model_name": "standin", "port": free_port(),
             "python": "/usr/bin/python3", **extra}
    return write_inventory(tmp_path / "inventory.yaml", {"box": [host]}, host_vars={host.name: vars_})


def health(port) -> int | None:
    """/health's status, or None when no HTTP server answers (the freed port may even be another test's sshd)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return resp.status
    except (OSError, http.client.HTTPException):
        return None


def inventory_port(path) -> int:
    return int(re.search(r"^\s+port: (\d+)$", Path(path).read_text(), re.M).group(1))


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

        follow = subprocess.Popen([sys.executable, "-m", "invoke", "serve", "--on", ssh_host.name, "--logs", "--follow"],
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


HOST_GET = """
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=10)
    print(200)
except urllib.error.HTTPError as e:
    print(e.code)
"""


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


def test_real_vllm_under_tmux(tmp_path, netns_trio, tiny_model, api_key):
    """The tiny model served by real vLLM through `inv serve --wait`, then a model path that does not exist.

    On a network-namespace host: its own /proc (vLLM reads /proc/<pid>, which the loopback bed's
    pid namespace lacks), network, /tmp and /root. The venv is this repo's, through a symlink;
    the model is copied in over SSH."""
    node = netns_trio[0]
    workdir = f"{node.workdir}/my work"
    host_sh(node, f"rm -rf '{workdir}' && mkdir -p '{workdir}/models/tiny' '{workdir}/cache' '{workdir}/inductor' "
                  f"'{workdir}/tmp' && ln -s {REPO}/.venv '{workdir}/venv'")
    tar = subprocess.run(["tar", "-C", str(tiny_model), "-c", "."], capture_output=True, check=True).stdout
    subprocess.run(node.ssh_argv(f"tar -C '{workdir}/models/tiny' -x"), input=tar, check=True, timeout=60)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CACHE_ROOT": f"{workdir}/cache", "TORCHINDUCTOR_CACHE_DIR": f"{workdir}/inductor",
           "TMPDIR": f"{workdir}/tmp"}
    common = dict(served_model_name="tiny", reasoning_parser="qwen3", max_model_len=512, env=env,
                  vllm_args=["--enforce-eager", "--dtype", "float32"])
    path = tmux_inventory(tmp_path, node, workdir, model="models/tiny", **common)
    port = inventory_port(path)
    try:
        started = time.monotonic()
        served = inv("serve", "--on", node.name, "--wait", "--timeout", "300", inventory=path, timeout=400)
        assert served.returncode == 0, outputs(served)
        assert "tiny" in served.stdout and "512" in served.stdout and "ready_in" in served.stdout
        assert PHASE.search(served.stderr), served.stderr
        print(f"real vLLM ready after {time.monotonic() - started:.0f}s")
        # the key reached vLLM through the env file: without it, /v1/models is refused
        assert host_sh(node, f"/usr/bin/python3 - http://127.0.0.1:{port}/v1/models", HOST_GET).strip() == "401"

        status = inv("serve", "--on", node.name, "--status", "--json", inventory=path)
        row = json.loads(status.stdout)[0]  # model and max_model_len come from /v1/models, asked with the key
        assert row["state"] == "active (running)" and row["model"] == "tiny" and row["health"] == 200
        assert row["max_model_len"] == 512 and isinstance(row["running"], int)
        logs = inv("serve", "--on", node.name, "--logs", "--lines", "400", inventory=path)
        assert "Starting vLLM server" in logs.stdout

        # `inv generate` end to end against this host's own vLLM (key from the env file), then `inv pull`
        assert inv("deploy", "--on", node.name, "--no-deps", inventory=path).returncode == 0
        gen = inv("generate", "--on", node.name, "-n", "12", "--dataset", "examples/prompts.jsonl", "--name",
                  "gen-e2e", "--follow", "--", "--max-tokens", "300", inventory=path, timeout=600)
        assert gen.returncode == 0, outputs(gen)
        pulled = inv("pull", "--on", node.name, "--run", "gen-e2e", "--dest", tmp_path / "artifacts", inventory=path)
        assert pulled.returncode == 0, outputs(pulled)
        data = tmp_path / "artifacts" / "gen-e2e" / node.name / "data.jsonl"
        records = [json.loads(line) for line in data.read_text().splitlines()]
        assert len({r["id"] for r in records}) == len(records) == 12
        answers = [m for r in records for m in r["messages"] if m["role"] == "assistant"]
        assert answers and all(m.get("reasoning") and m.get("content") for m in answers)

        assert host_sh(node, f"stat -c '%a %U' '{workdir}/service/vllm.env'").strip() == "600 root"
        assert api_key not in host_sh(node, "ps -eo args")
        assert api_key not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert api_key not in outputs(served, status, logs)

        # a model path that is not there: refused before anything is written or started (issue 14, item 10)
        missing = tmux_inventory(tmp_path, node, workdir, model="models/no such model", **common)
        refused = inv("serve", "--on", node.name, "--wait", "--timeout", "300", inventory=missing)
        assert refused.returncode == 1, outputs(refused)
        assert f"the model {workdir}/models/no such model is not on the host" in refused.stdout
        assert "nothing was started" in refused.stdout
        assert host_sh(node, f"/usr/bin/python3 - http://127.0.0.1:{port}/health", HOST_GET).strip() == "200"
        # a directory that is no model: vLLM itself dies while starting, and that is noticed fast
        host_sh(node, f"mkdir -p '{workdir}/models/not a model'")
        broken = tmux_inventory(tmp_path, node, workdir, model="models/not a model", **common)
        started = time.monotonic()
        failed = inv("serve", "--on", node.name, "--wait", "--timeout", "300", inventory=broken, timeout=400)
        took = time.monotonic() - started
        assert failed.returncode == 1, outputs(failed)
        assert took < 120, f"took {took:.0f}s to notice"
        assert "died while starting" in failed.stdout and "last 50 log lines" in failed.stderr
        assert "not a model" in failed.stderr
        print(f"a broken model reported after {took:.0f}s")
    finally:
        inv("serve", "--on", node.name, "--stop", inventory=path)


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
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "tunnel", "--on", ssh_host.name, "--local-port", str(local)],
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
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "tunnel", "--on", ssh_host.name, "--local-port", str(local),
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
