"""What the GPU path decides before a GPU is touched, checked host-free: the plan's memory source (free,
not total), fp32 with grouped-query attention refused on CUDA, Muon's state and ZeRO-1's share counted as
they are, the --eval-vllm timeout, the bound GPU's RNG alone, and NCCL's interface beside gloo's."""
import json
import os
import subprocess
import sys
import time
import types

import torch

from tests.helpers.fixtures_train import REMOTE, ROOT, run_script

sys.path.insert(0, str(REMOTE))
import train  # noqa: E402
import train_plan  # noqa: E402

KIMI = ROOT / "bench" / "kimi-k2"


def kimi_shape(**flags):
    return train_plan.draft_shape(train_plan.text_config(str(KIMI)), 32000, **flags)


def kimi_plan(**kw):
    shape = kw.pop("shape", None) or kimi_shape()
    return train_plan.plan({}, shape=shape, gpus=kw.pop("gpus", 8), gpu_gb=kw.pop("gpu_gb", 141), ttt=7,
                           batch_tokens="auto", max_len=4096, online=False, **kw)


def test_the_plan_budgets_the_memory_free_at_start_not_the_cards_total(monkeypatch):
    """Another process on the GPU (a vLLM, a stray rank) holds part of it: the plan sees what is left."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60e9, 141e9))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(
        total_memory=141e9, name="H200"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = train.parse_args(["--target", str(KIMI), "--states", "x", "--data", "d", "--out", "o"])
    p = train.make_plan(args, True, torch.device("cuda:0"), 1)
    assert p["gpu_gb"] == 60.0
    assert p["peak_gb"] <= 60 - p["reserve_gb"]
    assert train_plan.RESERVE_GB > 0


def test_fp32_with_grouped_query_attention_on_cuda_is_refused_in_one_line(tmp_path):
    gqa = kimi_plan(fp32=True)
    assert not gqa["fits"] and "SDPA" in gqa["reason"] and "--dtype bf16" in gqa["reason"]
    assert kimi_plan(fp32=True, shape=kimi_shape(kv_heads=64))["fits"] is not None  # MHA: planned, not refused
    assert "SDPA" not in (kimi_plan(fp32=True, shape=kimi_shape(kv_heads=64))["reason"] or "")
    assert kimi_plan()["fits"]  # bf16: fits
    r = run_script("train.py", "--plan", "--target", KIMI, "--states", "x", "--gpu-gb", 141, "--gpus", 8,
                   "--dtype", "fp32", check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "SDPA" in json.loads(r.stdout.splitlines()[0])["reason"]


def test_muons_state_is_counted_as_muons_and_zero1_shares_it_over_the_ranks():
    shape = kimi_shape()
    P = shape.trainable_params()
    head_and_norms = shape.draft_vocab * shape.hidden + 4 * shape.hidden
    adamw, muon = kimi_plan(gpus=8), kimi_plan(gpus=8, optimizer="muon")
    saved = (adamw["optimizer_gb"] - muon["optimizer_gb"]) * 1e9
    assert abs(saved - 4 * (P - head_and_norms)) < 0.02e9  # one momentum, not two moments, per hidden weight
    sharded = kimi_plan(gpus=8, shard_optimizer=True)
    assert abs((adamw["optimizer_gb"] - sharded["optimizer_gb"]) * 1e9 - 8 * P * 7 / 8) < 0.02e9
    assert sharded["largest_batch_tokens"] > adamw["largest_batch_tokens"]


def test_the_plan_reports_the_loaders_host_ram_per_rank_and_per_node():
    p = kimi_plan(ranks_per_node=8)
    per_rank = 2 * p["batch_tokens"] * 4 * 7168 * 2 / 1e9  # two batches of bf16 aux + last states
    assert abs(p["loader_host_gb_per_rank"] - per_rank) < 0.01
    assert abs(p["loader_host_gb_per_node"] - 8 * per_rank) < 0.1
    assert "loader host RAM" in train_plan.table(p)


def test_a_vllm_measurement_past_its_timeout_is_a_recorded_failure_and_kills_what_it_started(tmp_path,
                                                                                             monkeypatch):
    script = tmp_path / "slow_eval.py"
    pidfile = tmp_path / "child.pid"
    script.write_text("import subprocess, sys, time\n"
                      f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
                      "print('starting vLLM', flush=True)\ntime.sleep(60)\n")
    monkeypatch.setattr(train, "EVAL_SCRIPT", str(script), raising=False)
    args = train.parse_args(["--target", "t", "--data", "d", "--out", str(tmp_path), "--eval-vllm",
                             "--eval-timeout", "8"])  # room for the stand-in to start on a loaded machine
    measured = train.measure_in_vllm(args, str(tmp_path / "draft"), str(tmp_path / "p.jsonl"), 5)
    assert set(measured) == {"measured_error"} and "--eval-timeout 8" in measured["measured_error"]
    assert "starting vLLM" in (tmp_path / "evals" / "step-5" / "eval.log").read_text()
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10  # SIGKILL lands asynchronously: the grandchild (a vLLM) dies, or is a zombie
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child}/status") as f:
                if "zombie" in f.read():
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the measurement's child {child} outlived its --eval-timeout")


def test_the_checkpoint_keeps_the_bound_gpus_rng_alone(monkeypatch):
    """A resume with fewer visible GPUs than the run that saved must still load: one generator, this rank's."""
    def every_gpu():
        raise AssertionError("read every GPU's generator")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", every_gpu)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", every_gpu)
    calls = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": calls.append(("get", str(device))) or
                        torch.zeros(8, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": calls.append(("set", str(device))))
    device = torch.device("cuda:3")
    state = train.rng_state(device)
    train.set_rng_state(state, device)
    assert calls == [("get", "cuda:3"), ("set", "cuda:3")]


def test_the_node_sets_nccls_interface_beside_gloos():
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    out = subprocess.run([sys.executable, str(REMOTE / "torchrun_node.py"), "--master-addr", "127.0.0.1",
                          "--master-port", "1", "--node-rank", "0", "--", "env"], capture_output=True, text=True,
                         env=env, timeout=60).stdout
    seen = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert seen.get("GLOO_SOCKET_IFNAME") and seen.get("NCCL_SOCKET_IFNAME") == seen["GLOO_SOCKET_IFNAME"]
