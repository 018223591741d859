"""Two nodes (torchrun --nnodes 2, one CPU rank each, gloo) whose clocks run at different speeds write the
same records: every figure in a node's metrics.jsonl and evals.jsonl is the group's, so the two copies are
equal line for line. The second node's clock runs 1.6x fast, as a slower or busier host's would read."""
import json
import os
import socket
import subprocess
import sys

from tests.helpers.fixtures_train import REMOTE, chat_rows

WARP = """
import os, runpy, sys, time
if os.environ.get("RANK") == "1":
    real = time.monotonic
    start = real()
    time.monotonic = lambda: start + 1.6 * (real() - start)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_with_different_clocks_write_the_same_records(tiny_model, tmp_path):
    warp = tmp_path / "warp.py"
    warp.write_text(WARP)
    data = chat_rows(tmp_path / "chat.jsonl", n=16)
    port = free_port()
    nodes = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), str(warp),
               str(REMOTE / "train.py"), "--target", str(tiny_model), "--data", str(data),
               "--out", str(tmp_path / f"node{node}"), "--steps", "4", "--batch-tokens", "512", "--ttt-steps", "2",
               "--val-fraction", "0.2", "--eval-every", "2", "--eval-max-tokens", "16", "--eval-n", "2",
               "--no-tensorboard"]
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    logs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    for name in ("metrics.jsonl", "evals.jsonl"):
        a, b = ((tmp_path / f"node{n}" / name).read_text().splitlines() for n in (0, 1))
        assert len(a) == (4 if name == "metrics.jsonl" else 2)
        assert a == b, f"{name}:\n{a}\n{b}"
    assert all(json.loads(line)["train_s"] > 0 for line in a)
