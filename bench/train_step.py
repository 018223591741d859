#!/usr/bin/env python3
"""Tokens/s of one EAGLE-3 training step (TTT forward, loss, backward, AdamW), with random target states.

    python bench/train_step.py [--device cpu|cuda] [--dtype fp32|bf16] [--budget-s 120] [--only tiny|real]
                               [--prompt-fraction 0.36]

Two shapes: the demo's draft (H 128, I 1024, Vd 256) and one sized like a real draft
(H 4096, I 14336, 32/8 heads, Vd 32000, seq 2048). The target model is left out: its states
and logits are random tensors of the right shapes, so the figure is the trainer's own cost.
The baseline, measured in the same run on the same device and dtype, is a plain matmul of the
draft's MLP shape: the step's model FLOP/s as a fraction of it says how far the step is from
what this device does at best. Each shape runs for at most --budget-s seconds (at least one
step after one warm-up step); on CPU the real shape runs one TTT step (seven take ~7x longer).

Each sequence starts with a prompt (--prompt-fraction of it, no loss: the demo's data has 36%),
and the step runs twice, as the trainer does (slots no step scores skip the MLP) and with every
slot computed: `skip_speedup` is the second's time over the first's. On a CPU in fp32 it runs a
third time with the MLP's matmuls in bf16 (what train.py does where the CPU multiplies bf16
natively): `bf16_mlp_speedup` is the fp32 step's time over that one's.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "remote"))
from draft_model import DraftConfig, Eagle3Draft  # noqa: E402
from ttt_objective import SoftCrossEntropy  # noqa: E402

SHAPES = {
    # name: (H, I, heads, kv heads, head dim, Vd, batch, seq)
    "tiny": (128, 1024, 4, 2, 32, 256, 8, 256),  # the demo's draft: MLP 1024, draft vocab 256
    "real": (4096, 14336, 32, 8, 128, 32000, 1, 2048),
}


def step_flops(c: DraftConfig, tokens: int, seq: int, ttt: int) -> float:
    """Model FLOPs of forward + backward (3x forward): the matmuls, plus attention over the TTT cache."""
    H, hd = c.hidden_size, c.head_dim
    per_token = (2 * H * (c.num_attention_heads + 2 * c.num_key_value_heads) * hd  # q/k/v on 2H
                 + c.num_attention_heads * hd * H + 3 * H * c.intermediate_size + H * c.draft_vocab_size)
    forward = 2 * tokens * (per_token * ttt + 3 * H * H)  # + fc, once
    forward += sum(4 * tokens * (seq / 2 + i) * c.num_attention_heads * hd for i in range(ttt))
    return 3 * forward


def matmul_rate(n: int, k: int, m: int, device, dtype, budget_s: float = 5.0) -> float:
    """Baseline: FLOP/s of a plain [n,k] x [k,m] matmul on this device and dtype."""
    a, b = torch.randn(n, k, device=device, dtype=dtype), torch.randn(k, m, device=device, dtype=dtype)
    a @ b
    sync(device)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget_s or runs < 2:
        a @ b
        sync(device)
        runs += 1
    return 2 * n * k * m * runs / (time.perf_counter() - start)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(name, device, dtype, budget_s, ttt, prompt_fraction):
    H, I, nh, nkv, hd, Vd, B, T = SHAPES[name]
    c = DraftConfig(hidden_size=H, intermediate_size=I, num_attention_heads=nh, num_key_value_heads=nkv,
                    head_dim=hd, vocab_size=Vd, draft_vocab_size=Vd, aux_layer_ids=[2, 16, 29],
                    max_position_embeddings=T, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    torch.manual_seed(0)
    draft = Eagle3Draft(c, torch.randn(Vd, H) * 0.02, torch.arange(Vd)).to(device)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    input_ids = torch.randint(0, Vd, (B, T), device=device)
    aux = torch.randn(B, T, 3 * H, device=device, dtype=dtype)
    target_vd = torch.randn(B, T, Vd, device=device, dtype=dtype)
    target_top = target_vd.argmax(-1)
    loss_mask = torch.ones(B, T, dtype=torch.long, device=device)
    loss_mask[:, : int(prompt_fraction * T)] = 0
    vocab_ids, in_vocab = torch.arange(Vd, device=device), torch.ones(Vd, dtype=torch.bool, device=device)

    def step(skip_unused):
        objective = SoftCrossEntropy(draft, target_vd, target_top, loss_mask, vocab_ids, in_vocab, 0.8)
        used = objective.used_slots(ttt) if skip_unused else None
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = sum(r[0] for r in draft(input_ids, aux, ttt, objective, used=used))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)
        opt.step()
        sync(device)

    def seconds_per_step(skip_unused):
        step(skip_unused)  # warm-up: allocations, optimizer state
        steps, start = 0, time.perf_counter()
        while steps < 1 or time.perf_counter() - start < budget_s:
            step(skip_unused)
            steps += 1
        return (time.perf_counter() - start) / steps, steps

    seconds, steps = seconds_per_step(True)
    every_slot, _ = seconds_per_step(False)
    tokens = B * T
    flops = step_flops(c, tokens, T, ttt) / every_slot  # the FLOPs counted are every slot's
    base = matmul_rate(tokens, H, I, device, dtype)
    row = {"shape": name, "H": H, "Vd": Vd, "batch": B, "seq": T, "ttt_steps": ttt, "steps": steps,
            "s_per_step": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
            "model_gflops": round(flops / 1e9, 1), "matmul_gflops": round(base / 1e9, 1),
            "ratio_to_matmul": round(flops / base, 3), "prompt_fraction": prompt_fraction,
            "skip_speedup": round(every_slot / seconds, 3)}
    if device.type == "cpu" and dtype == torch.float32:
        draft.midlayer.mlp.bf16_matmuls = True
        row["bf16_mlp_speedup"] = round(seconds / seconds_per_step(True)[0], 3)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--budget-s", type=float, default=60.0, help="seconds of timed steps per shape")
    ap.add_argument("--ttt-steps", type=int, help="default: 7, or 1 for the real shape on CPU")
    ap.add_argument("--only", choices=sorted(SHAPES))
    ap.add_argument("--prompt-fraction", type=float, default=0.36, help="share of each sequence with no loss")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    print(f"device {args.device} ({torch.get_num_threads()} threads), {args.dtype}", flush=True)
    for name in [args.only] if args.only else list(SHAPES):
        ttt = args.ttt_steps or (1 if name == "real" and device.type == "cpu" else 7)
        print(bench(name, device, dtype, args.budget_s, ttt, args.prompt_fraction), flush=True)


if __name__ == "__main__":
    main()
