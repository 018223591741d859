#!/usr/bin/env python3
"""The steps of bench/gpu_check.sh that need Python: each prints one JSON line (its row of the table).

    python bench/gpu_check.py real-step [--steps 4] [--tokens 8192] [--batch 1]   (under torchrun --nproc-per-node 1)
    python bench/gpu_check.py kimi-target TINY_MODEL OUT
    python bench/gpu_check.py chat-rows OUT [--n 24]
    python bench/gpu_check.py serve-extract TARGET DATA OUT
    python bench/gpu_check.py attention-check
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "remote"))



def row(**fields):
    print(json.dumps(fields), flush=True)


def real_step(args):
    """NCCL (torchrun, process group as train.py starts it) training steps of a Kimi-width draft, with the
    trainer's own step (checkpointed TTT, the MLP skipped on prompt slots, lean objective, bf16 autocast,
    DDP, the metrics all-reduce on the model's device); tokens/s and peak torch.cuda.max_memory_allocated
    against the plan's figure."""
    import torch
    import torch.distributed as dist

    import train
    import train_plan
    from draft_model import DraftConfig, Eagle3Draft
    from ttt_objective import SoftCrossEntropy, target_distribution

    assert train.launched_by_torchrun(), "run under torchrun"
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", train.EXPANDABLE_SET_BY_MAIN)  # as train.main sets it
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    torch.cuda.set_device(device)
    dist.init_process_group(train.process_group_backend(True))
    B, T, k = args.batch, args.tokens, args.ttt_steps
    shape = train_plan.draft_shape(train_plan.text_config(str(ROOT / "bench" / "kimi-k2" / "config.json")), 32000)
    H, V, Vd = shape.hidden, shape.vocab, shape.draft_vocab
    gpu_gb = torch.cuda.get_device_properties(device).total_memory / 1e9
    if args.plan_batch:  # the batch train.py's --batch-tokens auto picks on this GPU, in samples of T tokens
        auto = train_plan.plan({}, shape=shape, gpus=1, gpu_gb=gpu_gb, ttt=k, batch_tokens="auto", max_len=T,
                               online=False, ddp=True)
        B = auto["batch_tokens"] // T
    c = DraftConfig(hidden_size=H, intermediate_size=shape.intermediate, num_attention_heads=shape.heads,
                    num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, vocab_size=V, draft_vocab_size=Vd,
                    aux_layer_ids=[2, 30, 58], max_position_embeddings=131072)
    vocab_ids = torch.arange(0, V, V // Vd)[:Vd].to(device)
    embed = (torch.randn(V, H, device=device) * 0.02).to(torch.bfloat16)
    draft = Eagle3Draft(c, embed, vocab_ids.cpu()).to(device)
    head = (torch.randn(V, H, device=device) * 0.02).to(torch.bfloat16)
    head_vd = head[vocab_ids]
    model = torch.nn.parallel.DistributedDataParallel(draft)
    if args.optimizer == "muon":  # its Newton-Schulz iterations in bf16 on every matrix: the cost to weigh
        from muon import MuonAdamW
        opt = MuonAdamW(draft.named_parameters(), muon_lr=0.02, adam_lr=1e-4)
    else:
        opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    in_vocab = torch.zeros(V, dtype=torch.bool, device=device)
    in_vocab[vocab_ids] = True
    ids = torch.randint(0, V, (B, T), device=device)
    aux = torch.randn(B, T, 3 * H, device=device, dtype=torch.bfloat16)
    last = torch.randn(B, T, H, device=device, dtype=torch.bfloat16)
    mask = torch.ones(B, T, dtype=torch.long, device=device)
    mask[:, : T // 4] = 0  # a prompt: its slots skip the MLP, as in train.py (index_select/index_add in bf16)
    torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        target_vd, target_top, _ = target_distribution(last, head, head_vd)
        objective = SoftCrossEntropy(draft, target_vd, target_top, mask, vocab_ids, in_vocab, 0.8)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            per_step = model(ids, aux, k, objective, used=objective.used_slots(k))
        loss = sum(r[0] for r in per_step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)
        opt.step()
        totals = torch.stack([loss.detach().float(), *[r[1].float() for r in per_step]])
        dist.all_reduce(totals)  # as train.py's metrics: on the model's device
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device)
    planned = train_plan.plan({}, shape=shape, gpus=1, gpu_gb=1e6, ttt=k, batch_tokens=B * T, max_len=T,
                              online=False, ddp=True)["peak_gb"] * 1e9
    steady = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    row(step=f"a: NCCL train, Kimi-width draft, {B}x{T} tokens, {args.optimizer}", ok=True, tokens=B * T, ttt_steps=k,
        s_per_step=round(steady, 3), tokens_per_s=round(B * T / steady), max_memory_allocated_gb=round(peak / 1e9, 2),
        plan_gb=round(planned / 1e9, 2), plan_over_measured=round(planned / peak, 3),
        gpu_gb=round(gpu_gb, 1),
        loss=round(totals[0].item(), 4), backend=dist.get_backend())
    train.leave_process_group()


def attention_check(args):
    """The diagonal attention's lse kernels on CUDA (flash under bf16, efficient under fp32) against
    plain matmuls, and its output and gradients against the dense-mask formulation."""
    import torch
    import torch.nn.functional as F

    from draft_model import causal_lse, causal_lse_math, ttt_attention

    worst = 0.0
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        B, nh, nkv, T, hd = 1, 8, 2, 300, 112
        q = torch.randn(B, nh, T, hd, device="cuda", dtype=dtype)
        k = torch.randn(B, nh, T, hd, device="cuda", dtype=dtype)
        lse = causal_lse(q, k, k)
        ref = causal_lse_math(q.float(), k.float())
        worst = max(worst, (lse - ref).abs().max().item())
        q = q.float().requires_grad_()
        cache = [(torch.randn(B, nkv, T, hd, device="cuda", requires_grad=True),
                  torch.randn(B, nkv, T, hd, device="cuda", requires_grad=True)) for _ in range(3)]
        out = ttt_attention(q, cache, nh // nkv)
        g = nh // nkv
        keys = torch.cat([c[0].repeat_interleave(g, 1) for c in cache], 2)
        values = torch.cat([c[1].repeat_interleave(g, 1) for c in cache], 2)
        mask = torch.cat([torch.ones(T, T, dtype=torch.bool, device="cuda").tril(),
                          *[torch.eye(T, dtype=torch.bool, device="cuda")] * 2], 1)
        dense = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        grads = torch.autograd.grad(out.sum(), [q, *cache[0]])
        dense_grads = torch.autograd.grad(dense.sum(), [q, *cache[0]])
        worst = max(worst, (out - dense).abs().max().item(),
                    *[(a - b).abs().max().item() for a, b in zip(grads, dense_grads)])
    row(step="attention kernels vs math (CUDA)", ok=worst < 0.05, max_abs_diff=round(worst, 5))
    return 0 if worst < 0.05 else 1


def kimi_target(args):
    """A 4-layer DeepSeek-V3 packaged as Kimi-K2 (model_type kimi_k2, its own config/tokenizer code): the
    extraction tests' target (tests/helpers/kimi.py)."""
    from tests.helpers import kimi

    out = kimi.build(args.tiny, args.out)
    row(step="kimi-shaped target", ok=True, path=str(out))


def chat_rows(args):
    with open(args.out, "w") as f:
        for i in range(args.n):
            answer = f"{i} + {i + 3} = {2 * i + 3}. Count on from {i}: " + " ".join(str(i + j) for j in range(1, 6))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i + 3}?"},
                                             {"role": "assistant", "content": answer}]}) + "\n")


def serve_extract(args):
    """`inv serve --extract`'s command line for a gpu host (stock ExampleHiddenStatesConnector), then extract.py."""
    from specops.inventory import Host
    from specops.service_spec import Extraction, vllm_argv

    out = Path(args.out)
    storage = out / "vllm-states"
    storage.mkdir(parents=True, exist_ok=True)
    host = Host("gpu1", ("gpu",), {"flavor": "gpu", "model": args.target, "vllm_args": ["--trust-remote-code"],
                                   "port": 8321})
    argv = vllm_argv(host, venv_python=sys.executable, model=args.target,
                     extract=Extraction((1, 2, 3, 4), str(storage), str(ROOT)))
    argv += ["--max-model-len", "1024", "--gpu-memory-utilization", "0.3", "--served-model-name", "ds"]
    log = open(out / "vllm.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (out / "vllm.log").read_text()[-2000:]
                row(step="b: serve --extract + extract.py", ok=False, error="vLLM did not come up", log=tail)
                return 1
            try:
                urllib.request.urlopen("http://127.0.0.1:8321/v1/models", timeout=2)
                break
            except OSError:
                time.sleep(2)
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, str(ROOT / "remote" / "extract.py"), "--endpoint", "http://127.0.0.1:8321",
                            "--storage", str(storage), "--data", args.data, "--out", str(out / "states"),
                            "--layers", "1,2,3", "--trust-remote-code"], capture_output=True, text=True, timeout=300)
        shards = sorted((out / "states").glob("shard-*.safetensors"))
        row(step="b: serve --extract + extract.py", ok=r.returncode == 0 and bool(shards), shards=len(shards),
            seconds=round(time.monotonic() - t0, 1), error=None if r.returncode == 0 else r.stderr[-1500:])
        return 0 if r.returncode == 0 and shards else 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("real-step")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192, help="per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--plan-batch", action="store_true", help="as many sequences as the plan's auto batch holds")
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    sub.add_parser("attention-check")
    p = sub.add_parser("kimi-target")
    p.add_argument("tiny")
    p.add_argument("out")
    p = sub.add_parser("chat-rows")
    p.add_argument("out")
    p.add_argument("--n", type=int, default=24)
    p = sub.add_parser("serve-extract")
    p.add_argument("target")
    p.add_argument("data")
    p.add_argument("out")
    args = ap.parse_args()
    return {"real-step": real_step, "attention-check": attention_check, "kimi-target": kimi_target,
            "chat-rows": chat_rows, "serve-extract": serve_extract}[args.cmd](args) or 0


if __name__ == "__main__":
    sys.exit(main())
