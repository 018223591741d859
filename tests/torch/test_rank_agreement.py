"""Whatever a rank computes from its own machine is agreed over the group before it shapes the loop
(two CPU ranks over gloo): --batch-tokens auto on GPUs with different free memory, the step count, and the
resume step; a disagreement is refused on every rank in one line naming the node."""
import socket
import sys
import types

from tests.helpers.fixtures_train import REMOTE, ROOT
from tests.torch.group_bed import on_ranks

KIMI = ROOT / "bench" / "kimi-k2"


def agree(rank, world, out):
    sys.path.insert(0, str(REMOTE))
    import torch

    import train
    from script import Refused

    free_gb = 141 if rank == 0 else 80  # a node with H100s beside one with H200s
    torch.cuda.mem_get_info = lambda device=None: (free_gb * 1e9, free_gb * 1e9)
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=free_gb * 1e9)
    args = train.parse_args(["--target", str(KIMI), "--states", "x", "--data", "d", "--out", f"{out}/run"])
    plan = train.make_plan(args, True, torch.device("cuda:0"), world)
    result = {"own_batch": plan["batch_tokens"], "batch": train.resolve_batch_tokens(args, plan)}

    def refusal(call):
        try:
            return call()
        except Refused as e:
            return f"refused: {e}"

    result["steps"] = refusal(lambda: train.agree_steps(100 - rank))
    result["same_steps"] = refusal(lambda: train.agree_steps(100))
    result["start"] = refusal(lambda: train.agree_start(40 if rank == 0 else 0, None, "run/checkpoint.pt"))
    result["unreadable"] = refusal(lambda: train.agree_start(0, "cannot read run/checkpoint.pt" if rank else None,
                                                             "run/checkpoint.pt"))
    result["resumed"] = refusal(lambda: train.agree_start(40, None, "run/checkpoint.pt"))
    return result


def test_ranks_agree_or_refuse_in_one_line_naming_the_node(tmp_path):
    r0, r1 = on_ranks(2, tmp_path, agree, str(tmp_path))
    host = socket.gethostname()
    assert r0["own_batch"] > r1["own_batch"]  # the plans differ...
    assert r0["batch"] == r1["batch"] == r1["own_batch"]  # ...the run takes the smaller, on both
    for r in (r0, r1):
        assert r["steps"].startswith("refused: ") and f"rank 1 on {host}" in r["steps"], r["steps"]
        assert r["same_steps"] is None
        assert f"node {host} (rank 1) would start at step 0 where rank 0 resumes at 40" in r["start"], r["start"]
        assert r["unreadable"] == f"refused: node {host} (rank 1): cannot read run/checkpoint.pt"
        assert r["resumed"] == 40
        assert all("\n" not in str(v) for v in r.values())
