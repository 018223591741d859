"""Many hosts as one, on real hosts: a group's generate run trains one draft across the
group (gloo torchrun between network-namespace hosts), a host cut mid-generate has its rows
re-planned onto the other, and a node that cannot reach the master fails in one line.

The hosts generate against the tiny model served by real vLLM (the session's `vllm_server`,
one server for the CPU's sake): each host reaches it at its own 127.0.0.1:PORT, where a plain
TCP relay forwards to the server through the test bed's bridge. Cutting a host's link cuts it
off the server as well as off SSH, as a dead host is.
"""
import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from specops import inventory as inventory_mod
from specops import runs
from specops.host import connect
from tests.helpers.hostbed import write_inventory
from tests.helpers.invoke_cli import inv
from tests.helpers.runs_bed import prepare
from tests.helpers.vllm_proc import free_port

RELAY = r"""
import socket, sys, threading
listen, port, target, tport = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
def pipe(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((listen, port))
server.listen(64)
while True:
    client, _ = server.accept()
    try:
        upstream = socket.create_connection((target, tport), timeout=5)
    except OSError:
        client.close()
        continue
    upstream.settimeout(None)
    for a, b in ((client, upstream), (upstream, client)):
        threading.Thread(target=pipe, args=(a, b), daemon=True).start()
"""
PORT = free_port()  # each host's "own vLLM" (the relay, inside the host's own network namespace)
GEN = ["--dataset", "examples/prompts.jsonl"]
GEN_EXTRA = ["--", "--max-tokens", "200", "--concurrency", "4", "--give-up-after", "900"]
TRAIN_EXTRA = ["--", "--lr", "1e-2", "--batch-tokens", "1024", "--max-len", "512", "--ttt-steps", "3", "--include-truncated"]


def sh(host, cmd, input=None, check=True, timeout=120):
    done = subprocess.run(host.ssh_argv(cmd), input=input, capture_output=True, timeout=timeout)
    if check and done.returncode:
        raise AssertionError(f"{cmd!r} on {host.name}: {done.stderr.decode()}")
    return done.stdout


@pytest.fixture(scope="module")
def bed(netns_trio, tiny_model, tmp_path_factory):
    """node1..node3 with deployed code, the checkout's venv, the tiny model and an env file with
    OMP_NUM_THREADS=1 (two shared cores); yields (hosts, the bridge's address on this side)."""
    tar = subprocess.run(["tar", "-C", str(tiny_model), "-c", "."], capture_output=True, check=True).stdout
    prepare(tmp_path_factory.mktemp("group"), netns_trio, group="trio")
    for node in netns_trio:
        w = node.workdir
        sh(node, f"mkdir -p {w}/models/tiny {w}/service && tar -C {w}/models/tiny -x", input=tar)
        sh(node, f"printf 'OMP_NUM_THREADS=1\\n' > {w}/service/vllm.env")
    return netns_trio, netns_trio[0].address.rsplit(".", 1)[0] + ".1"


@pytest.fixture(scope="module")
def served(bed, vllm_server):
    """The bed, each host reaching the session's real vLLM at its own 127.0.0.1:PORT (two relays:
    host -> the bridge address here -> the server's loopback port)."""
    nodes, bridge = bed
    upstream = subprocess.Popen([sys.executable, "-c", RELAY, bridge, str(vllm_server.port + 1), "127.0.0.1",
                                 str(vllm_server.port)], stdin=subprocess.DEVNULL)
    try:
        for node in nodes:
            w = node.workdir
            sh(node, f"cat > {w}/relay.py", input=RELAY.encode())
            sh(node, f"setsid nohup /usr/bin/python3 {w}/relay.py 127.0.0.1 {PORT} {bridge} {vllm_server.port + 1}"
                     f" </dev/null >/dev/null 2>&1 &")
        yield bed
    finally:
        upstream.kill()
        upstream.wait()


def inventory(tmp_path, hosts, **master_vars):
    vars = {"model": "models/tiny", "served_model_name": "tiny", "port": PORT}
    return write_inventory(tmp_path / "inventory.yaml", {"pair": hosts}, group_vars={"pair": vars},
                           host_vars={hosts[0].name: master_vars} if master_vars else None)


def live(path, node, run_id) -> bool:
    with connect(inventory_mod.load(path).select(node.name)[0]) as s:
        return runs.run_meta(s, run_id)["live"]


def wait_ended(node, run_id, timeout=600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = sh(node, f"cat {node.workdir}/runs/{run_id}/exit_code 2>/dev/null", check=False).decode().strip()
        if code:
            return int(code)
        time.sleep(1)
    raise AssertionError(f"{run_id} on {node.name} did not end within {timeout}s")


def lines(node, path):
    return [json.loads(x) for x in sh(node, f"cat {path}").decode().splitlines()]


def test_group_generate_then_group_train_gives_one_identical_draft(served, tmp_path):
    (node1, node2, _), _ = served
    path = inventory(tmp_path, [node1, node2])
    gen, train = f"gen-{uuid.uuid4().hex[:6]}", f"train-{uuid.uuid4().hex[:6]}"
    proc = inv("generate", "--on", "pair", "-n", "12", *GEN, "--name", gen, "--follow", *GEN_EXTRA,
               "--turns", "first", inventory=path, timeout=900)  # one answer a row: one sample a row
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {n.name: lines(n, f"{n.workdir}/runs/{gen}/data.jsonl") for n in (node1, node2)}
    assert len(rows["node1"]) == len(rows["node2"]) == 6  # sharded: each host has half the rows

    dest = tmp_path / "artifacts"
    started = time.monotonic()
    proc = inv("train", "--on", "pair", "--data", gen, "--name", train, "--dest", dest, *TRAIN_EXTRA,
               inventory=path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "merged.jsonl: 12 records" in proc.stdout
    status = inv("status", "--on", "pair", "--run", train, "--json", inventory=path)
    assert {r["host"]: r["runs"][0]["run"] for r in json.loads(status.stdout)} == {"node1": train, "node2": train}
    table = inv("status", "--on", "pair", "--run", train, inventory=path).stdout  # and one row for the whole job
    assert re.search(rf"^{train}\s+2\s", table, re.M), table
    codes = [wait_ended(n, train, timeout=900) for n in (node1, node2)]
    logs = [sh(n, f"tail -30 {n.workdir}/runs/{train}/log").decode() for n in (node1, node2)]
    assert codes == [0, 0], "\n".join(logs)
    print(f"group train took {time.monotonic() - started:.0f}s")

    drafts = [sh(n, f"sha256sum {n.workdir}/runs/{train}/draft/model.safetensors").split()[0] for n in (node1, node2)]
    assert drafts[0] == drafts[1]  # one job: the same weights exported on both nodes
    for node in (node1, node2):  # every rank trained on the same merged sample list, one epoch of it
        metrics = lines(node, f"{node.workdir}/runs/{train}/metrics.jsonl")
        assert {m["epoch"] for m in metrics} == {0}
        assert sum(m["samples"] for m in metrics) == 11  # every merged row but the one held out (5% of 12)
        meta = json.loads(sh(node, f"cat {node.workdir}/runs/{train}/meta.json"))
        assert f"{node.workdir}/data/{gen}/merged.jsonl" in meta["argv"]
        assert "--nnodes=2" in meta["argv"] and f"--node-rank={[node1, node2].index(node)}" in meta["argv"]
    evals = [lines(n, f"{n.workdir}/runs/{train}/evals.jsonl") for n in (node1, node2)]
    assert evals[0] == evals[1] and len(evals[0]) == 1 and evals[0][0]["kept"]  # one held-out figure, reduced
    data_line = next(json.loads(x.split(" ", 1)[1]) for x in sh(node1, f"cat {node1.workdir}/runs/{train}/log")
                     .decode().splitlines() if x.startswith("specops-progress") and '"stage":"data"' in x)
    assert (data_line["rows"], data_line["samples"]) == (12, 12)  # the merged data: every generated row


def test_a_host_cut_mid_generate_has_its_rows_finished_by_the_other(served, tmp_path):
    (node1, node2, _), _ = served
    path = inventory(tmp_path, [node1, node2])
    gen = f"gen-{uuid.uuid4().hex[:6]}"
    proc = inv("generate", "--on", "pair", "-n", "16", *GEN, "--name", gen,
               "--", "--max-tokens", "200", "--concurrency", "1", "--give-up-after", "900",
               inventory=path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data2 = f"{node2.workdir}/runs/{gen}/data.jsonl"
    deadline = time.monotonic() + 300
    while not sh(node2, f"cat {data2} 2>/dev/null", check=False).strip():  # node2 has done a row or more
        assert time.monotonic() < deadline, "node2 never finished a row"
        time.sleep(0.5)
    node2.cut()
    try:
        assert wait_ended(node1, gen, timeout=600) == 0
        env = {"SPECOPS_CONNECT_TIMEOUT": "3"}
        proc = inv("generate", "--on", "pair", "-n", "16", *GEN, "--name", gen, "--resume", "--follow",
                   *GEN_EXTRA, inventory=path, timeout=900, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "re-planned: node2" in proc.stdout and "node1 (now 0/2,1/2)" in proc.stdout, proc.stdout
        ids1 = [r["id"] for r in lines(node1, f"{node1.workdir}/runs/{gen}/data.jsonl")]
        assert len(ids1) == len(set(ids1)) == 16  # node1 finished every row, its own and node2's

        dest = tmp_path / "artifacts"
        pulled = inv("pull", "--on", "pair", "--run", gen, "--dest", dest, inventory=path, env=env)
        assert "node2: unreachable" in pulled.stdout, pulled.stdout
        merged = [json.loads(x)["id"] for x in (dest / gen / "merged.jsonl").read_text().splitlines()]
        assert sorted(merged) == sorted(ids1)
    finally:
        node2.restore()
    done_on_node2 = lines(node2, data2)
    assert done_on_node2  # node2 had finished rows of its own before it went: the merge keeps one copy of each
    inv("stop", gen, "--on", "node2", "--grace", "3", inventory=path)  # node2's own run, still trying its rows
    pulled = inv("pull", "--on", "pair", "--run", gen, "--dest", dest, inventory=path)
    merged = [json.loads(x)["id"] for x in (dest / gen / "merged.jsonl").read_text().splitlines()]
    assert sorted(merged) == sorted(ids1), pulled.stdout  # node2's copies of rows node1 also did: dropped


def test_a_node_that_cannot_reach_the_master_fails_in_one_line(bed, tmp_path):
    (node1, node2, _), bridge = bed
    nowhere = bridge.rsplit(".", 1)[0] + ".250"  # on the bridge's subnet, no host there
    path = inventory(tmp_path, [node1, node2], private_address=nowhere)
    data = f"{node2.workdir}/chat.jsonl"
    for node in (node1, node2):  # a data file on every node (a path, not a run: nothing to ship)
        rows = "".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+1?"},
                                                {"role": "assistant", "content": f"{i + 1}"}]}) + "\n"
                       for i in range(4))
        sh(node, f"cat > {data}", input=rows.encode())
    run_id = f"train-{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    proc = inv("train", "--on", "pair", "--data", data, "--name", run_id, "--rendezvous-timeout", "8",
               "--steps", "2", inventory=path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    try:
        code = wait_ended(node2, run_id, timeout=120)
        took = time.monotonic() - started
        log = sh(node2, f"cat {node2.workdir}/runs/{run_id}/log").decode()
        assert code == 2 and took < 8 + 60, (code, took, log)
        failure = [line for line in log.splitlines() if line.strip()]
        assert len(failure) == 1 and f"cannot reach the master at {nowhere}:" in failure[0], log
    finally:
        stopped = inv("stop", run_id, "--on", "pair", "--grace", "3", inventory=path, timeout=120)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert not live(path, node1, run_id) and not live(path, node2, run_id)


VLLM_ON_HOST = ("VLLM_CPU_KVCACHE_SPACE=1\nVLLM_ENABLE_V1_MULTIPROCESSING=0\nVLLM_HOST_IP=127.0.0.1\n"
                "VLLM_CACHE_ROOT={w}/cache\nTORCHINDUCTOR_CACHE_DIR={w}/inductor\nTMPDIR={w}/tmp\nOMP_NUM_THREADS=1\n")


def test_the_group_draft_accepts_like_a_single_host_one(served, tmp_path, tiny_model, trained_run_report,
                                                        heldout_prompts):
    """The tiny recipe over the group (300 generated rows, 300 steps on 2 nodes), measured by `inv eval` in
    real vLLM, against the single-host draft of the same recipe (test fixtures) measured the same way."""
    from tests.helpers.fixtures_train import TINY_RECIPE
    (node1, node2, _), _ = served
    path = write_inventory(tmp_path / "inventory.yaml", {"pair": [node1, node2]}, group_vars={"pair": {
        "model": "models/tiny", "served_model_name": "tiny", "port": PORT, "max_model_len": 512}})
    gen, train = f"gen-{uuid.uuid4().hex[:6]}", f"train-{uuid.uuid4().hex[:6]}"
    proc = inv("generate", "--on", "pair", *GEN, "--name", gen, "--follow", "--", "--max-tokens", "300",
               "--concurrency", "16", inventory=path, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = inv("train", "--on", "pair", "--data", gen, "--name", train, "--dest", tmp_path / "artifacts", "--follow",
               "--", *TINY_RECIPE, "--max-len", "512", inventory=path, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    w = node1.workdir
    sh(node1, f"mkdir -p {w}/cache {w}/inductor {w}/tmp && cat > {w}/service/vllm.env",
       input=VLLM_ON_HOST.format(w=w).encode())
    sh(node1, f"cat > {w}/heldout.jsonl", input=Path(heldout_prompts).read_bytes())
    proc = inv("eval", "--on", "node1", "--draft", train, "--prompts", f"{w}/heldout.jsonl", "-n", "30",
               "--dest", tmp_path / "artifacts", "--", "--no-baseline", inventory=path, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    group_al = json.loads(next((tmp_path / "artifacts").glob("eval-*/node1/report.json")).read_text())
    single_al = trained_run_report  # the same recipe on one host (test fixtures), measured the same way
    print(f"AL group {group_al['acceptance_length']} single {single_al['acceptance_length']}")
    assert group_al["acceptance_length"] > 2.0  # a random draft: ~1.0
    assert abs(group_al["acceptance_length"] - single_al["acceptance_length"]) < 0.5
