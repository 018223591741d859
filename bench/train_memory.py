#!/usr/bin/env python3
"""Activation memory per token of one EAGLE-3 training step, before (the plain step) and after (the lean one;
"cpu": the lean one without recomputing TTT steps, as train.py runs it on a CPU host).

    python bench/train_memory.py [--ttt-steps 7] [--tokens 1024] [--scales 64,32]

What a GPU would show, measured on the CPU: each figure is the peak memory (VmPeak) of a fresh
process running one step (forward, loss, backward) at T tokens and at 2T tokens, the
difference over T: weights, optimizer and the interpreter cancel, what is left is what
the step keeps per token. Shapes are Kimi-K2's draft (H 7168, I 18432, 64 heads of 112,
8 kv heads, Vd 32000) with every width divided by a scale; the per-token bytes are linear
in the widths, so two scales extrapolate to scale 1 (the real draft, fp32 here). The
plan's figure (remote/train_plan.py, the same shape and dtype) stands beside each row.
The plain step's dense [T, k*T] mask adds bytes per token that grow with T, on top.
"""
import argparse
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "remote"))
from draft_model import DraftConfig, Eagle3Draft  # noqa: E402
from train_plan import DraftShape, draft_shape, step_activation_bytes, text_config  # noqa: E402
from ttt_objective import SoftCrossEntropy, target_distribution  # noqa: E402

# glibc keeps freed heap memory, and after one big free serves blocks up to 32 MB from the heap:
# a fixed mmap threshold hands every tensor's memory back when it is freed, so the peak is peak use
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
CHUNK_ROWS = 128  # loss rows per chunk at reduced widths (2097 at Kimi's Vd 32000)
# the draft train.py shapes for Kimi-K2 at the default draft vocabulary (train_plan's rule, one home)
KIMI = dataclasses.asdict(draft_shape(text_config(str(ROOT / "bench" / "kimi-k2" / "config.json")), 32000))


def scaled(scale: int) -> dict:
    """Kimi's draft with widths / scale (heads kept at least 2, the kv groups as in the real shape)."""
    heads = max(2, KIMI["heads"] // scale)
    return {"hidden": KIMI["hidden"] // scale, "intermediate": KIMI["intermediate"] // scale, "heads": heads,
            "kv_heads": max(1, heads // 8), "head_dim": max(8, KIMI["head_dim"] * KIMI["heads"] // scale // heads),
            "draft_vocab": KIMI["draft_vocab"] // scale, "vocab": KIMI["vocab"] // scale}


def one_step(shape: dict, tokens: int, ttt: int, impl: str) -> None:
    """Build, run one training step, print the peak memory (bytes) as JSON: the child process's job."""
    torch.manual_seed(0)
    H, V, Vd = shape["hidden"], shape["vocab"], shape["draft_vocab"]
    c = DraftConfig(hidden_size=H, intermediate_size=shape["intermediate"], num_attention_heads=shape["heads"],
                    num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], vocab_size=V,
                    draft_vocab_size=Vd, aux_layer_ids=[2, 30, 58], max_position_embeddings=2 * tokens)
    vocab_ids = torch.arange(0, V, V // Vd)[:Vd]
    draft = Eagle3Draft(c, torch.randn(V, H) * 0.02, vocab_ids)
    in_vocab = torch.zeros(V, dtype=torch.bool)
    in_vocab[vocab_ids] = True
    input_ids = torch.randint(0, V, (1, tokens))
    aux, last = torch.randn(1, tokens, 3 * H), torch.randn(1, tokens, H)
    head = torch.randn(V, H) * 0.02
    loss_mask = torch.ones(1, tokens, dtype=torch.long)
    if impl == "before":
        from tests.helpers.plain_step import reference_step
        loss, _, _ = reference_step(draft, input_ids, aux, ttt, last @ head.T, loss_mask, vocab_ids, in_vocab, 0.8)
    else:
        # chunks in the real shape's regime (16k tokens: many loss chunks, 10 vocab chunks), so that they
        # cost bytes per step, not per token, as at scale
        target_vd, target_top, _ = target_distribution(last, head, head[vocab_ids], vocab_chunk=V // 10)
        objective = SoftCrossEntropy(draft, target_vd, target_top, loss_mask, vocab_ids, in_vocab, 0.8,
                                     chunk_rows=CHUNK_ROWS, recompute=impl == "after")  # as train.py: CPU keeps
        loss = sum(r[0] for r in draft(input_ids, aux, ttt, objective, checkpoint=impl == "after"))
    loss.backward()
    # the peak of the address space, not of RSS: under memory pressure the kernel drops the interpreter's
    # file-backed pages, and a peak RSS taken while importing torch can then hide the step's (seen in CI);
    # with the mmap threshold above, every tensor is its own mapping, so the peak size is the peak use
    status = Path("/proc/self/status").read_text()
    print(json.dumps({"peak": int(re.search(r"VmPeak:\s+(\d+) kB", status).group(1)) * 1024}))


def peak_bytes(shape: dict, tokens: int, ttt: int, impl: str) -> int:
    cmd = [sys.executable, __file__, "--one", json.dumps({"shape": shape, "tokens": tokens, "ttt": ttt, "impl": impl})]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", **MALLOC})
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def measured_bytes_per_token(shape: dict, tokens: int, ttt: int, impl: str) -> float:
    """(peak memory at 2T - peak memory at T) / T."""
    return (peak_bytes(shape, 2 * tokens, ttt, impl) - peak_bytes(shape, tokens, ttt, impl)) / tokens


def planned_bytes_per_token(shape: dict, tokens: int, ttt: int, act_bytes: int = 4, reduced: bool = True,
                            recompute: bool = True) -> float:
    """The plan's figure for the same measurement: (plan(2T) - plan(T)) / T, fp32 as on the CPU."""
    s = DraftShape(hidden=shape["hidden"], intermediate=shape["intermediate"], heads=shape["heads"],
                   kv_heads=shape["kv_heads"], head_dim=shape["head_dim"], draft_vocab=shape["draft_vocab"],
                   vocab=shape["vocab"], aux=3)
    chunks = {"chunk_rows": CHUNK_ROWS, "vocab_chunk": shape["vocab"] // 10, "recompute": recompute} if reduced \
        else {"recompute": recompute}
    a = step_activation_bytes(s, 2 * tokens, ttt, act_bytes, **chunks) - step_activation_bytes(s, tokens, ttt, act_bytes, **chunks)
    return a / tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=1024, help="T (each figure runs T and 2T)")
    ap.add_argument("--scales", default="56,28", help="width divisors measured (two or more)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        job = json.loads(args.one)
        return one_step(job["shape"], job["tokens"], job["ttt"], job["impl"])
    scales = [int(s) for s in args.scales.split(",")]
    rows = {}
    for impl in ("before", "after", "cpu"):
        for scale in scales:
            shape = scaled(scale)
            got = measured_bytes_per_token(shape, args.tokens, args.ttt_steps, impl)
            rows[(impl, scale)] = got
            planned = planned_bytes_per_token(shape, args.tokens, args.ttt_steps, recompute=impl == "after") \
                if impl != "before" else None
            print(json.dumps({"impl": impl, "scale": scale, "hidden": shape["hidden"], "tokens": args.tokens,
                              "measured_bytes_per_token": round(got),
                              "plan_bytes_per_token": round(planned) if planned else None}), flush=True)
    # per-token bytes are a + b / scale: extrapolate the two smallest scales to scale 1
    lo, hi = sorted(scales)[:2]
    print(f"\nKimi-shaped draft (H 7168, I 18432, Vd 32000), k={args.ttt_steps}, fp32, extrapolated from "
          f"widths / {hi} and / {lo} at T={args.tokens}:")
    print(f"{'step':<8} {'bytes/token':>12} {'GB at 16k tokens':>17}")
    full = {}
    for impl in ("before", "after"):
        b = (rows[(impl, lo)] - rows[(impl, hi)]) / (1 / lo - 1 / hi)
        a = rows[(impl, lo)] - b / lo
        full[impl] = a + b
        print(f"{impl:<8} {full[impl]:>12.0f} {full[impl] * 16384 / 1e9:>17.1f}")
    plan = planned_bytes_per_token(KIMI, 8192, args.ttt_steps, reduced=False)  # its chunks' regime: T >> chunk
    print(f"{'plan':<8} {plan:>12.0f} {plan * 16384 / 1e9:>17.1f}   (remote/train_plan.py, fp32)")
    print(f"after/before = {full['after'] / full['before']:.3f}")


if __name__ == "__main__":
    main()
