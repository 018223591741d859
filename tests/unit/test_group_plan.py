"""Many hosts as one, without hosts: row plans and re-plans, the merge, the group's torchrun argv,
and the trainer's epoch covering every sample once whatever the world size."""
import json
import random
import sys
from pathlib import Path

import pytest

from specops import fanout, group, jobs, pull
from specops import plan as plans
from specops.errors import SpecopsError
from specops.inventory import Host

REMOTE = Path(__file__).resolve().parents[2] / "remote"
sys.path.insert(0, str(REMOTE))
from datasets_io import take_shard  # noqa: E402
from generate import parse_args as generate_args  # noqa: E402


def owners(plan: dict, n: int) -> dict[int, list[str]]:
    """Row index -> the hosts that take it, as generate.py itself selects rows from its --shard."""
    taken: dict[int, list[str]] = {i: [] for i in range(n)}
    for host, spec in plan.items():
        shard = generate_args(["--endpoint", "http://x", "--out", "o", "--shard", spec]).shard
        for index, _, _ in take_shard(((None, r) for r in range(n)), n, shard):
            taken[index].append(host)
    return taken


def test_first_plan_then_replans_keep_every_row_owned_once():
    first = plans.first_plan(["a", "b", "c"])
    assert first == {"a": "0/3", "b": "1/3", "c": "2/3"}
    assert all(len(h) == 1 for h in owners(first, 50).values())
    second = plans.replan(first, ["a", "c"])  # b is gone: its rows split between a and c
    assert second == {"a": "0/3,1/6", "c": "2/3,4/6"}
    taken = owners(second, 50)
    assert all(len(h) == 1 for h in taken.values())
    assert {i for i, h in taken.items() if h != owners(first, 50)[i]} == {i for i in range(50) if i % 3 == 1}
    third = plans.replan(second, ["c"])  # then a goes too: c takes all
    assert all(h == ["c"] for h in owners(third, 50).values())
    assert plans.covered([plans.parse_spec(s) for s in third.values()])[:2] == ([], False)


def test_covered_finds_holes_and_overlaps():
    specs = [plans.parse_spec(s) for s in ("0/3,1/6", "2/3")]
    holes, overlap, modulus = plans.covered(specs)
    assert (holes, overlap, modulus) == ([4], False, 6)  # 4/6 went to the host that is missing here
    assert plans.covered(specs + [plans.parse_spec("1/3")])[:2] == ([], True)  # the gone host came back
    assert plans.rows_in(plans.parse_spec("0/3,1/6"), 12) == 4 + 2


@pytest.mark.parametrize("bad", ["3/3", "a/2", "1", "0/2,", "-1/2"])
def test_a_bad_spec_is_refused(bad):
    with pytest.raises(SpecopsError, match="shard spec"):
        plans.parse_spec(bad)


def write(path: Path, ids) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i}) + "\n" for i in ids))
    return path


def outcome(name, shard, verified="yes", error=None):
    h = Host(name=name, groups=("g",), vars={})
    return fanout.Outcome(h, error=error) if error else fanout.Outcome(h, {"shard": shard, "verified": verified})


def test_merge_after_a_replan_keeps_each_row_once_and_needs_no_gone_host(tmp_path, capsys):
    run = tmp_path / "gen"
    write(run / "a" / "data.jsonl", ["r0", "r2", "r1", "r3"])  # a took b's rows after b went
    write(run / "b" / "data.jsonl", ["r1"])  # b had finished r1 before it went
    gone = [outcome("a", "0/2,1/2"), outcome("b", None, error="b: unreachable")]
    assert pull.merge_shards(run, gone, sys.stdout) == 0
    assert [json.loads(x)["id"] for x in (run / "merged.jsonl").read_text().splitlines()] == ["r0", "r2", "r1", "r3"]
    back = [outcome("a", "0/2,1/2"), outcome("b", "1/2")]  # b is back: the copy it made is dropped
    assert pull.merge_shards(run, back, sys.stdout) == 0
    assert sorted(json.loads(x)["id"] for x in (run / "merged.jsonl").read_text().splitlines()) == \
        ["r0", "r1", "r2", "r3"]
    assert "1 rows finished by two hosts" in capsys.readouterr().out


def test_merge_refuses_duplicates_between_disjoint_shards_and_names_missing_hosts(tmp_path, capsys):
    run = tmp_path / "gen"
    write(run / "a" / "data.jsonl", ["r0", "r1"])
    write(run / "b" / "data.jsonl", ["r1"])
    assert pull.merge_shards(run, [outcome("a", "0/2"), outcome("b", "1/2")], sys.stdout) == 1
    assert "1 duplicate ids across shards: r1" in capsys.readouterr().out
    assert pull.merge_shards(run, [outcome("a", "0/2"), outcome("b", None, error="x")], sys.stdout) == 1
    assert "shards missing from b" in capsys.readouterr().out
    assert not (run / "merged.jsonl").exists()


# ---------------------------------------------------------------- group training

def host(name, **vars):
    return Host(name=name, groups=("g",), vars={"ansible_host": f"203.0.113.{len(name)}", **vars})


def test_the_master_is_reached_at_its_private_address():
    assert group.master_address(host("a")) == "203.0.113.1"
    assert group.master_address(host("a", private_address="10.0.0.1")) == "10.0.0.1"
    assert group.master_address(host("a", ansible_connection="local")) == "127.0.0.1"


def test_node_argv_checks_the_master_then_runs_torchrun_with_a_static_rendezvous():
    argv = group.node_argv("/w/venv/bin/python", "/w/code/remote/torchrun_node.py", "/w/code/remote/train.py",
                           ["--out", "."], nnodes=3, node_rank=2, nproc=8, master_addr="10.0.0.1", master_port=41000,
                           run_id="train-1", rendezvous_timeout=20)
    cut = argv.index("--")
    assert argv[:cut] == ["/w/venv/bin/python", "/w/code/remote/torchrun_node.py", "--master-addr", "10.0.0.1",
                          "--master-port", "41000", "--node-rank", "2", "--timeout", "20"]
    assert argv[cut + 1:] == ["/w/venv/bin/python", "-m", "torch.distributed.run", "--nnodes=3", "--node-rank=2",
                              "--nproc-per-node=8", "--master-addr=10.0.0.1", "--master-port=41000",
                              "--rdzv-id=train-1", f"--rdzv-conf=timeout={group.JOIN_TIMEOUT}",
                              "/w/code/remote/train.py", "--out", "."]


def test_a_group_trains_on_the_shipped_merged_data():
    session = type("S", (), {"workdir": "/w", "host": host("a")})()
    assert group.shipped_path(session, "gen-1") == "/w/data/gen-1/merged.jsonl"
    assert jobs.is_run_id("gen-1") and not jobs.is_run_id("/data/x.jsonl") and not jobs.is_run_id("x.jsonl")


# ---------------------------------------------------------------- one epoch, every sample once

@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_sample_once_per_epoch_at_any_world_size(world):
    import batching
    rng = random.Random(world)
    for trial in range(20):
        lengths = [rng.randint(10, 400) for _ in range(rng.randint(world * 2, 40))]
        steps = batching.steps_in_epochs(lengths, 1024, trial, world, 1)
        ranks = [batching.rank_batches(lengths, 1024, trial, r, world) for r in range(world)]
        seen = [i for _ in range(steps) for r in ranks for i in next(r)[1]]
        assert sorted(seen) == list(range(len(lengths))), (world, trial)
        assert next(ranks[0])[0] == 1  # the next batch is the next epoch's: nothing of epoch 0 left over


def test_node_wrapper_runs_the_command_once_the_masters_host_answers(tmp_path):
    """A refusal is an answer (the master's torchrun may not listen yet): the wrapper execs the command,
    with gloo pinned to the interface that routes to the master."""
    import socket
    import subprocess
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: a refusal
    done = subprocess.run([sys.executable, str(REMOTE / "torchrun_node.py"), "--master-addr", "127.0.0.1",
                           "--master-port", str(port), "--node-rank", "1", "--timeout", "5", "--",
                           "sh", "-c", 'echo "ran with $GLOO_SOCKET_IFNAME"'],
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert (done.returncode, done.stdout) == (0, "ran with lo\n"), done.stderr
