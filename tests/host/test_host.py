"""The host module against real sshd hosts: keys verified, arguments quoted, cut links bounded."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from specops import inventory
from specops.errors import HostError
from specops.host import connect
from tests.helpers.hostbed import write_inventory
from tests.helpers.invoke_cli import inv


def _hosts(tmp_path, hosts, **host_vars):
    path = write_inventory(tmp_path / "inventory.yaml", {"test": hosts},
                           host_vars={h.name: host_vars for h in hosts})
    return path, inventory.load(path)


def test_connect_and_run_as_root_and_ml(tmp_path, ssh_host, ml_host):
    path, inv_ = _hosts(tmp_path, [ssh_host, ml_host])
    for host, user in zip(inv_.select("test"), ("root", "ml")):
        with connect(host) as s:
            assert s.run(["id", "-un"]).stdout.strip() == user
            assert s.workdir.startswith("/")
    proc = inv("hosts", "--on", "test", "--json", inventory=path)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["ok"] for r in rows] == [True, True] and all(r["tmux"] and r["rsync"] for r in rows)


def test_unknown_host_key_is_refused_with_its_fingerprint_and_a_fix_that_works(tmp_path, ssh_host):
    """The line shows the key's fingerprint as `ssh-keygen -l` prints it (to compare out of band), and
    its suggested command works where the known_hosts file's folder does not exist yet."""
    missing = tmp_path / "fresh-home" / ".ssh" / "known_hosts"
    path, _ = _hosts(tmp_path, [ssh_host], known_hosts=str(missing))
    proc = inv("hosts", "--on", "test", inventory=path)
    assert proc.returncode != 0
    line = proc.stdout.strip().splitlines()[-1]
    assert "host key for [127.0.0.1]:" in line and "is unknown" in line and "Traceback" not in proc.stdout + proc.stderr
    pub = tmp_path / "host_key.pub"
    pub.write_text(ssh_host.host_key_line.split(" ", 1)[1] + "\n")
    fingerprint = subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True,
                                 check=True).stdout.split()[1]
    assert f"ssh-ed25519 key {fingerprint}" in line
    fix = line.split("then: ", 1)[1]
    subprocess.run(["bash", "-c", fix], check=True, capture_output=True)
    assert oct(missing.parent.stat().st_mode & 0o777) == "0o700"
    assert inv("hosts", "--on", "test", inventory=path).returncode == 0


def test_changed_host_key_is_refused(tmp_path, ssh_host):
    other = tmp_path / "other_key"
    os.system(f"ssh-keygen -q -t ed25519 -N '' -f {other}")
    kind, key = Path(f"{other}.pub").read_text().split()[:2]
    forged = tmp_path / "forged_known_hosts"
    forged.write_text(f"[127.0.0.1]:{ssh_host.port} {kind} {key}\n")
    path, _ = _hosts(tmp_path, [ssh_host], known_hosts=str(forged))
    proc = inv("hosts", "--on", "test", inventory=path)
    assert proc.returncode != 0 and "has CHANGED" in proc.stdout and "ssh-keygen -R" in proc.stdout


def test_hostile_workdir_is_data_not_code(tmp_path, ssh_host, ml_host):
    for host in (ssh_host, ml_host):
        workdir = f"{host.workdir}/a b/$(touch PWNED)/`touch PWNED2`;touch PWNED3"
        path, inv_ = _hosts(tmp_path, [host], workdir=workdir)
        proc = inv("deploy", "--on", "test", "--no-deps", inventory=path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert (Path(workdir) / "code" / "remote" / "check_deps.py").is_file()
        proc = inv("hosts", "--on", "test", inventory=path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        home = Path(os.path.expanduser(f"~{host.user}"))
        for where in (home, Path(host.workdir), Path(host.workdir) / "a b"):
            assert not any((where / n).exists() for n in ("PWNED", "PWNED2", "PWNED3")), where


def test_cut_link_fails_within_timeout(tmp_path, netns_trio):
    node = netns_trio[0]
    _, inv_ = _hosts(tmp_path, [node])
    (host,) = inv_.select("test")
    with connect(host) as s:
        assert s.run(["hostname"]).stdout.strip() == node.name
        node.cut()
        try:
            start = time.monotonic()
            with pytest.raises(HostError) as info:
                s.run(["sleep", "1"], timeout=4)
            assert time.monotonic() - start < 15
            assert node.name in str(info.value) or "test" in str(info.value)
        finally:
            node.restore()


def test_unreachable_host_fails_within_connect_timeout(tmp_path, netns_trio):
    node = netns_trio[1]
    path, _ = _hosts(tmp_path, [node])
    node.cut()
    try:
        start = time.monotonic()
        proc = inv("hosts", "--on", "test", inventory=path, env={"SPECOPS_CONNECT_TIMEOUT": "3"})
        elapsed = time.monotonic() - start
    finally:
        node.restore()
    assert proc.returncode == 1
    assert f"{node.name}: unreachable: connecting to {node.address} timed out after 3s" in proc.stdout
    assert elapsed < 20


def test_three_hosts_in_parallel_one_row_each(tmp_path, netns_trio):
    path = write_inventory(tmp_path / "inventory.yaml", {"trio": netns_trio})
    proc = inv("hosts", "--on", "trio", "--json", inventory=path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["host"] for r in json.loads(proc.stdout)] == [h.name for h in netns_trio]
    # one host down: the others still answer, the exit code says something failed
    netns_trio[2].cut()
    try:
        proc = inv("hosts", "--on", "trio", inventory=path, env={"SPECOPS_CONNECT_TIMEOUT": "3"})
    finally:
        netns_trio[2].restore()
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1
    assert sum(" ok " in line for line in lines) == 2 and any("FAILED" in line for line in lines)


def test_parallel_sessions_do_not_serialise(tmp_path, netns_trio):
    """Three 2-second commands on three hosts take about 2 s, not 6 s."""
    _, inv_ = _hosts(tmp_path, netns_trio)
    from specops import fanout

    start = time.monotonic()
    outcomes = fanout.each(inv_.select("test"), lambda s: {"out": s.run(["sleep", "2"]).exit_code})
    assert all(o.ok for o in outcomes)
    assert time.monotonic() - start < 5.5
