"""Detached runs on real sshd hosts: launch, status, logs, stop, pull.

Payloads are small Python programs run with the host's venv Python (a symlink to the project's
venv); the code they need on the host is put there by the real `deploy`.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specops import runs
from specops.errors import HostError, SpecopsError
from specops.host import connect
from tests.helpers.invoke_cli import REPO, inv
from tests.helpers.runs_bed import prepare, python, run_row, start, wait_for

# Prints a progress line per record, then writes data.jsonl with this shard's ids.
# argv: N_RECORDS SECONDS_PER_RECORD [--shard I/K] [--resume]
SHARDED_WRITER = """
import json, sys, time
n, pause = int(sys.argv[1]), float(sys.argv[2])
i, k = map(int, sys.argv[sys.argv.index("--shard") + 1].split("/")) if "--shard" in sys.argv else (0, 1)
mine = [r for r in range(n) if r % k == i]
with open("data.jsonl", "a") as f:
    for done, r in enumerate(mine, 1):
        f.write(json.dumps({"id": f"row-{r}", "shard": i}) + "\\n")
        f.flush()
        print("specops-progress " + json.dumps({"done": done, "total": len(mine)}), flush=True)
        time.sleep(pause)
"""


def remote(host, script):
    with connect(host) as s:
        return s.sh(script).stdout


def test_run_survives_disconnect_and_succeeds(tmp_path, ssh_host):
    path, [host] = prepare(tmp_path, [ssh_host])
    with connect(host) as s:  # the host's env file: its secret reaches the run, never a command line
        s.write_file(f"{s.workdir}/service/vllm.env", "SPECOPS_TEST_SECRET=s3cr3t-value\n", 0o600)
    code = ("import os, sys, time\nwhile not os.path.exists('go'): time.sleep(0.1)\n"
            "open('seen', 'w').write(os.environ.get('SPECOPS_TEST_SECRET', '')"
            " + '|' + repr(sys.stdin.read())); print('specops-progress {\"done\": 1}')")
    run_id = start([host], code)  # launch_on has closed its connection when it returns
    assert run_row(host, run_id)["state"] == "running"
    proc = inv("status", "--run", run_id, "--on", "bed", inventory=path)
    assert proc.returncode == 0 and "running" in proc.stdout, proc.stdout + proc.stderr
    (Path(host.workdir) / "runs" / run_id / "go").touch()  # the run ends when the test says so
    row = wait_for(host, run_id, {"succeeded", "failed"})
    assert (row["state"], row["exit"], row["progress"]) == ("succeeded", 0, {"done": 1})
    d = Path(host.workdir) / "runs" / run_id  # a loopback host shares this filesystem
    assert (d / "seen").read_text() == "s3cr3t-value|''"  # env file sourced, stdin is /dev/null
    assert (d / "exit_code").read_text() == "0\n"
    assert "s3cr3t" not in (d / "cmd").read_text() + (d / "meta.json").read_text()
    meta = json.loads((d / "meta.json").read_text())
    assert meta["kind"] == "test" and meta["host"] == host.name and meta["code_version"]
    assert (d / "cmd").read_text().startswith(f"{host.workdir}/venv/bin/python -c ")
    manifest = {f["path"]: f for f in json.loads((d / "manifest.json").read_text())["files"]}
    assert {"cmd", "meta.json", "log", "exit_code", "seen"} <= set(manifest)
    proc = inv("status", "--run", run_id, "--on", "bed", "--json", inventory=path)
    assert proc.returncode == 0 and json.loads(proc.stdout)[0]["runs"][0]["state"] == "succeeded"


def test_failing_command_shows_failed_and_its_code(tmp_path, ssh_host):
    path, [host] = prepare(tmp_path, [ssh_host])
    run_id = start([host], "import sys; print('boom', file=sys.stderr); sys.exit(3)")
    assert wait_for(host, run_id, {"failed"})["exit"] == 3
    proc = inv("status", "--run", run_id, "--on", "bed", inventory=path)
    assert proc.returncode == 1 and "failed" in proc.stdout
    proc = inv("logs", run_id, "--on", "bed", inventory=path)
    assert proc.returncode == 0 and proc.stdout == "boom\n"


def test_killed_tmux_session_shows_lost(tmp_path, ssh_host):
    path, [host] = prepare(tmp_path, [ssh_host])
    run_id = start([host], "import time; time.sleep(60)")
    with connect(host) as s:
        s.run(["tmux", "kill-session", "-t", runs.tmux_session(s, run_id)])
    row = wait_for(host, run_id, {"lost", "failed", "succeeded"})
    assert (row["state"], row["exit"]) == ("lost", None)
    assert inv("status", "--run", run_id, "--on", "bed", inventory=path).returncode == 1


def test_stop_records_the_exit_code_and_keeps_outputs(tmp_path, ssh_host):
    path, [host] = prepare(tmp_path, [ssh_host])
    polite = start([host], "import time; open('partial', 'w').write('kept'); time.sleep(60)")
    stubborn = start([host], "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)",
                     name="stubborn")
    wait_for(host, polite, {"running"})
    proc = inv("stop", polite, "--on", "bed", inventory=path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (run_row(host, polite)["state"], run_row(host, polite)["exit"]) == ("failed", 130)  # died of SIGINT
    assert (Path(host.workdir) / "runs" / polite / "partial").read_text() == "kept"
    started = time.monotonic()
    proc = inv("stop", stubborn, "--on", "bed", "--grace", "1", inventory=path)
    assert proc.returncode == 0 and time.monotonic() - started < 15, proc.stdout + proc.stderr
    assert run_row(host, stubborn)["exit"] == 143  # SIGINT ignored, SIGTERM after the grace period


def test_logs_follow_ends_when_the_run_ends(tmp_path, ssh_host):
    path, [host] = prepare(tmp_path, [ssh_host])
    run_id = start([host], "import time\nfor i in range(8):\n    print('line', i, flush=True); time.sleep(0.4)")
    started = time.monotonic()
    proc = inv("logs", run_id, "--on", "bed", "--follow", inventory=path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"line {i}" for i in range(8)]
    assert f"run {run_id} succeeded (exit 0)" in proc.stderr
    assert 2 < time.monotonic() - started < 30
    proc = inv("logs", run_id, "--on", "bed", "--lines", "2", inventory=path)
    assert proc.stdout.splitlines() == ["line 6", "line 7"]


def test_ctrl_c_stops_following_never_the_run(tmp_path, ssh_host):
    path, [host] = prepare(tmp_path, [ssh_host])
    run_id = start([host], "import time; print('started', flush=True); time.sleep(60)")
    env = {**os.environ, "SPECOPS_INVENTORY": str(path), "SPECOPS_SSH_CONFIG": "none", "PYTHONUNBUFFERED": "1"}
    follow = subprocess.Popen([sys.executable, "-m", "specops", "logs", run_id, "--on", "bed", "--follow"], cwd=REPO,
                              env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        assert follow.stdout.readline() == "started\n"
        follow.send_signal(signal.SIGINT)
        _, err = follow.communicate(timeout=30)
    finally:
        follow.kill()
    assert follow.returncode == 130 and f"run {run_id} goes on" in err
    assert run_row(host, run_id)["state"] == "running"


def test_double_launch_is_refused_and_resume_continues(tmp_path, ssh_host):
    _, [host] = prepare(tmp_path, [ssh_host])
    run_id = start([host], SHARDED_WRITER, 4, 0.5, name="once")
    with connect(host) as s, pytest.raises(HostError, match="run once is live on .*inv logs once --follow"):
        runs.launch(s, "test", ["true"], run_id=run_id)
    wait_for(host, run_id, {"succeeded"})
    with connect(host) as s:
        with pytest.raises(HostError, match="already exists .*exit code 0.*--resume"):
            runs.launch(s, "test", ["true"], run_id=run_id)
        runs.launch(s, "test", python(SHARDED_WRITER, 2, 0)(s, 0, 1), run_id=run_id, resume=True)
    wait_for(host, run_id, {"succeeded"})
    d = Path(host.workdir) / "runs" / run_id
    assert (d / "cmd").read_text().rstrip().endswith(" 2 0 --resume")
    assert (d / "log").read_text().count("specops-progress") == 4 + 2  # the log goes on


def test_two_workdirs_on_one_host_keep_their_runs_apart(tmp_path, ssh_host):
    """Same host, same user, same run id, two workdirs (two inventory entries): two runs."""
    other = dataclasses.replace(ssh_host, name=ssh_host.name + "-b", workdir=ssh_host.workdir + "/b")
    path, [a, b] = prepare(tmp_path, [ssh_host, other])
    waiting = "import os, time\nwhile not os.path.exists('go'): time.sleep(0.1)"
    for host in (a, b):
        start([host], waiting, name="same")
    assert run_row(a, "same")["state"] == run_row(b, "same")["state"] == "running"
    proc = inv("stop", "same", "--on", b.name, "--grace", "2", inventory=path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert run_row(b, "same")["state"] != "running" and run_row(a, "same")["state"] == "running"
    (Path(a.workdir) / "runs" / "same" / "go").touch()
    wait_for(a, "same", {"succeeded"})
    with pytest.raises(SpecopsError, match="taken by the vLLM service"):
        runs.check_run_id("vllm")


def test_sharded_runs_on_three_hosts_with_a_cut_link(tmp_path, netns_trio):
    path, hosts = prepare(tmp_path, netns_trio, group="trio")
    run_id = start(hosts, SHARDED_WRITER, 30, 1.0, sharded=True, on="trio")  # ~10 s per shard
    meta = [json.loads(remote(h, f"cat {h.workdir}/runs/{run_id}/meta.json")) for h in hosts]
    assert [m["shard"] for m in meta] == ["0/3", "1/3", "2/3"]
    env = {"SPECOPS_CONNECT_TIMEOUT": "3"}
    cut = netns_trio[1]
    cut.cut()
    try:
        started = time.monotonic()
        proc = inv("status", "--on", "trio", "--json", inventory=path, env=env)
        assert time.monotonic() - started < 3 + 10
        assert proc.stdout, proc.stderr
        rows = {r["host"]: r for r in json.loads(proc.stdout)}
        assert proc.returncode == 1
        assert not rows["node2"]["ok"] and "unreachable" in rows["node2"]["error"]
        for name in ("node1", "node3"):  # the hosts are the module's: earlier tests' runs are listed too
            [mine] = [r for r in rows[name]["runs"] if r["run"] == run_id] if rows[name]["ok"] else [None]
            assert mine["state"] == "running" and mine["progress"]["total"] == 10
        for host in (hosts[0], hosts[2]):
            wait_for(host, run_id, {"succeeded"})
        dest = tmp_path / "artifacts"
        proc = inv("pull", "--run", run_id, "--on", "trio", "--dest", dest, inventory=path, env=env)
        assert proc.returncode == 1
        assert "merged.jsonl not written: shards missing from node2" in proc.stdout
        assert (dest / run_id / "node1" / "data.jsonl").exists() and (dest / run_id / "node3" / "data.jsonl").exists()
        assert not (dest / run_id / "merged.jsonl").exists()
    finally:
        cut.restore()
    wait_for(hosts[1], run_id, {"succeeded"})
    proc = inv("pull", "--run", run_id, "--on", "trio", "--dest", dest, inventory=path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = [json.loads(line)["id"] for line in (dest / run_id / "merged.jsonl").read_text().splitlines()]
    assert sorted(ids) == sorted(f"row-{r}" for r in range(30))


def test_pull_verifies_the_manifest(tmp_path, ssh_host):
    path, [host] = prepare(tmp_path, [ssh_host])
    run_id = start([host], SHARDED_WRITER, 5, 0)
    wait_for(host, run_id, {"succeeded"})
    dest = tmp_path / "artifacts"
    local = dest / run_id / host.name / "data.jsonl"
    assert inv("pull", "--on", "bed", "--dest", dest, inventory=path).returncode == 0  # RUN defaults to the newest
    flip_one_byte(local)  # damaged here: the next pull fetches it afresh
    proc = inv("pull", "--run", run_id, "--on", "bed", "--dest", dest, inventory=path)
    assert proc.returncode == 0 and "re-fetched data.jsonl" in proc.stdout, proc.stdout
    flip_one_byte(Path(host.workdir) / "runs" / run_id / "data.jsonl")  # damaged on the host, after its manifest
    local.unlink()
    proc = inv("pull", "--run", run_id, "--on", "bed", "--dest", dest, inventory=path)
    assert proc.returncode == 1
    assert "integrity check failed" in proc.stdout and "data.jsonl: sha256 mismatch" in proc.stdout


def test_pull_refuses_to_merge_duplicate_ids(tmp_path, ssh_host, ml_host):
    """Two shards that both wrote the same rows (a sharding bug): no merged.jsonl, and the ids named."""
    path, hosts = prepare(tmp_path, [ssh_host, ml_host])
    run_id = start(hosts, "import json; open('data.jsonl', 'w').write(''.join(json.dumps({'id': f'row-{r}'}) + '\\n'"
                          " for r in range(3)))", sharded=True)
    for host in hosts:
        wait_for(host, run_id, {"succeeded"})
    dest = tmp_path / "artifacts"
    proc = inv("pull", "--run", run_id, "--on", "bed", "--dest", dest, inventory=path)
    assert proc.returncode == 1
    assert "merged.jsonl not written: 3 duplicate ids across shards: row-0, row-1, row-2" in proc.stdout
    assert not (dest / run_id / "merged.jsonl").exists()


def test_pull_over_sftp_when_rsync_is_missing_here(tmp_path, ssh_host):
    path, [host] = prepare(tmp_path, [ssh_host])
    run_id = start([host], SHARDED_WRITER, 50, 0)
    wait_for(host, run_id, {"succeeded"})
    dest = tmp_path / "artifacts"
    source = (Path(host.workdir) / "runs" / run_id / "data.jsonl").read_bytes()
    partial = dest / run_id / host.name / ".data.jsonl.partial"  # an interrupted earlier copy
    partial.parent.mkdir(parents=True)
    partial.write_bytes(source[:100])
    proc = inv("pull", "--run", run_id, "--on", "bed", "--dest", dest, inventory=path, env={"PATH": str(tmp_path)})
    assert proc.returncode == 0 and "sftp (rsync missing)" in proc.stdout, proc.stdout + proc.stderr
    assert (dest / run_id / host.name / "data.jsonl").read_bytes() == source and not partial.exists()


@pytest.mark.parametrize("method", ["rsync", "sftp"])
def test_pull_leaves_state_shards_on_the_host(tmp_path, ssh_host, method):
    """An extract run's shards (terabytes for a large target) are counted in its manifest, not hashed,
    and stay on the host; everything else comes home verified."""
    path, [host] = prepare(tmp_path, [ssh_host])
    code = ("import os\nfor k in range(3): open(f'shard-{k:05d}.safetensors', 'wb').write(os.urandom(1000))\n"
            "open('plan.json', 'w').write('{}')")
    run_id = start([host], code)
    wait_for(host, run_id, {"succeeded"})
    on_host = Path(host.workdir) / "runs" / run_id
    manifest = json.loads((on_host / "manifest.json").read_text())
    assert manifest["host_only"] == {"files": 3, "bytes": 3000}
    assert "plan.json" in {f["path"] for f in manifest["files"]}
    assert not [f for f in manifest["files"] if f["path"].startswith("shard-")]
    dest = tmp_path / "artifacts"
    env = {"PATH": str(tmp_path)} if method == "sftp" else None
    proc = inv("pull", "--run", run_id, "--on", "bed", "--dest", dest, inventory=path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert method in proc.stdout and "3 state shards, 3 kB" in proc.stdout, proc.stdout
    local = dest / run_id / host.name
    assert (local / "plan.json").read_text() == "{}" and not list(local.glob("shard-*"))
    assert len(list(on_host.glob("shard-*.safetensors"))) == 3


def flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    st = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: rsync's quick check sees nothing
