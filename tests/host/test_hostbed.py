"""The test bed itself, proven with plain paramiko (not specops), so a specops bug cannot hide a bed bug."""
import concurrent.futures
import dataclasses
import os
import pwd
import subprocess
import time
from pathlib import Path

import paramiko
import pytest
import yaml

from tests.helpers.fixtures_hosts import require_level
from tests.helpers.hostbed import REPO, loopback_sshd, write_inventory

PROJECT_PYTHON = str(REPO / ".venv" / "bin" / "python")  # the checkout under test


def connect(host, timeout=5.0) -> paramiko.SSHClient:
    client = paramiko.SSHClient()
    client.load_host_keys(host.known_hosts_path)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(host.address, host.port, host.user, key_filename=host.key_path, timeout=timeout,
                   banner_timeout=timeout, auth_timeout=timeout, look_for_keys=False, allow_agent=False)
    return client


def run(host, cmd, timeout=30.0) -> tuple[int, str, str]:
    with connect(host) as client:
        _, out, err = client.exec_command(cmd, timeout=timeout)
        return out.channel.recv_exit_status(), out.read().decode().strip(), err.read().decode().strip()


def test_loopback_root_and_ml(ssh_host, ml_host):
    assert run(ssh_host, "id -un")[1] == "root"
    assert run(ml_host, "id -un")[1] == "ml"
    for host in (ssh_host, ml_host):
        rc, out, _ = run(host, f'echo "$TMUX_TMPDIR"; touch {host.workdir}/ok && echo writable')
        assert (rc, out.splitlines()) == (0, [host.tmux_tmpdir, "writable"])


def test_loopback_key_is_this_hosts_only(ssh_host, tmp_path):
    """The bed's known_hosts is what makes RejectPolicy accept it; an empty one is refused."""
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        connect(dataclasses.replace(ssh_host, known_hosts_path=str(empty)))


def test_ml_sudo_is_limited(ml_host):
    rc, out, _ = run(ml_host, "sudo -n systemctl --version")
    assert rc == 0 and out.startswith("systemd ")
    rc, _, err = run(ml_host, "sudo -n id")
    assert rc != 0 and "password is required" in err


def test_ml_can_run_project_python(ml_host):
    """Later tests run the checkout's .venv/bin/python on the hosts as ml (its interpreter lives behind
    /root/.pyenv)."""
    rc, out, err = run(ml_host, f"{PROJECT_PYTHON} -c 'import sys, yaml; print(sys.prefix)' && ls {REPO}/remote")
    assert rc == 0, err
    assert Path(out.splitlines()[0]).resolve() == (REPO / ".venv").resolve()


def test_teardown_kills_what_the_host_started(tmp_path):
    """A detached tmux session (how runs are launched) dies with the bed; its dirs go too."""
    require_level("loopback")
    token = f"hostbed-orphan-{os.getpid()}-{time.monotonic_ns()}"
    alive = lambda: subprocess.run(["pgrep", "-f", token], capture_output=True).returncode == 0
    with loopback_sshd(tmp_path) as (_, ml):
        assert run(ml, f"tmux new-session -d -s t 'sleep 600; : {token}' && tmux ls")[0] == 0
        assert alive()
        assert os.path.exists(f"{ml.tmux_tmpdir}/tmux-{pwd.getpwnam('ml').pw_uid}")
    assert not alive()
    assert not os.path.exists(ml.workdir) and not os.path.exists(ml.tmux_tmpdir)


def test_netns_hosts_are_distinct(netns_trio):
    for host in netns_trio:
        rc, out, _ = run(host, "hostname; ip -4 -o addr show eth0; touch /tmp/mine-$(hostname); ls /tmp; ps -e | wc -l")
        hostname, addr, *tmp, nproc = out.splitlines()
        assert rc == 0 and hostname == host.name
        assert f" {host.address}/24 " in addr
        # private /tmp: only this host's file, and the checkout under test where CI cloned it under /tmp
        mirror = [REPO.relative_to("/tmp").parts[0]] if REPO.is_relative_to("/tmp") else []
        assert sorted(tmp) == sorted([f"mine-{host.name}", *mirror])
        assert int(nproc) < 10  # own pid namespace
        assert run(host, f"{PROJECT_PYTHON} -c 'print(42)'")[1] == "42"


def test_netns_hosts_answer_in_parallel(netns_trio):
    def timed(host):
        start = time.monotonic()
        rc, out, _ = run(host, "sleep 2; hostname")
        return rc, out, start, time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(len(netns_trio)) as pool:
        results = list(pool.map(timed, netns_trio))
    assert [(rc, out) for rc, out, _, _ in results] == [(0, h.name) for h in netns_trio]
    assert max(r[2] for r in results) < min(r[3] for r in results)  # all three were in flight at once


def test_cut_host_times_out_then_restores(netns_trio):
    host = netns_trio[0]
    host.cut()
    try:
        start = time.monotonic()
        with pytest.raises((TimeoutError, OSError, paramiko.SSHException)):
            connect(host, timeout=2)
        assert time.monotonic() - start < 10
        assert run(netns_trio[1], "hostname")[1] == netns_trio[1].name  # the others are unaffected
    finally:
        host.restore()
    assert run(host, "hostname")[1] == host.name


def test_systemd_machine(systemd_host):
    root, ml = systemd_host["root"], systemd_host["ml"]
    assert run(root, "cat /proc/1/comm")[1] == "systemd"
    assert run(root, "systemctl is-system-running") == (0, "running", "")
    assert run(ml, "sudo -n systemctl daemon-reload")[0] == 0
    rc, _, err = run(ml, "systemctl daemon-reload")
    assert rc != 0 and "Interactive authentication required" in err
    assert run(ml, f"{PROJECT_PYTHON} -c 'print(42)'")[1] == "42"


def test_write_inventory(tmp_path, netns_trio):
    path = write_inventory(tmp_path / "inventory.yaml", {"trio": netns_trio},
                           group_vars={"all": {"flavor": "cpu"}, "trio": {"python": PROJECT_PYTHON}},
                           host_vars={"node2": {"workdir": "/tmp/w"}})
    inv = yaml.safe_load(path.read_text())
    assert inv["all"]["vars"] == {"flavor": "cpu"}
    trio = inv["all"]["children"]["trio"]
    assert trio["vars"] == {"python": PROJECT_PYTHON}
    assert list(trio["hosts"]) == ["node1", "node2", "node3"]
    node2 = trio["hosts"]["node2"]
    assert node2["workdir"] == "/tmp/w" and node2["ansible_port"] == 22
    with open(node2["known_hosts"]) as f:
        assert f.read().split() == netns_trio[1].host_key_line.split()
    subprocess.run(netns_trio[1].ssh_argv("true"), check=True, timeout=30)  # the same key works for OpenSSH
