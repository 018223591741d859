#!/usr/bin/env python3
"""Can the shard reader keep up with the step? Tokens/s of `train.py --states`'s loader against the step's.

    python bench/states_loader.py [--hidden 1024] [--tokens 8192] [--batches 12] [--workers 0,2]

Writes synthetic shards (states_dir.write_shard: the extraction's own format, 4 layers of
bf16 states) under a temporary directory, then measures, in one run on this machine:
- the loader: states_from_shards' DataLoader over the batches, with each --workers count
  (0 = read in the training thread), what the training loop receives;
- the step: the lean training step (bench/train_step.py's) at the same hidden size and
  batch, fp32 on the CPU.
The figure that matters is loader tokens/s / step tokens/s: above 1, the step never waits.
On a GPU the step is ~100x faster than here; the loader's figure is the CPU's either way.
"""
import argparse
import json
import os
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "remote"))
import states_dir  # noqa: E402
from chat_render import Sample  # noqa: E402
from draft_model import DraftConfig, Eagle3Draft  # noqa: E402
from batching import cut_batches  # noqa: E402
from states_from_shards import ShardTargetStates  # noqa: E402
from ttt_objective import SoftCrossEntropy  # noqa: E402


def synthetic_source(root: str, hidden: int, samples: list, per_shard: int) -> ShardTargetStates:
    """Shards of random states for `samples`, and a ShardTargetStates over them without a target
    (the loader needs only the plan and the shards)."""
    layers = [2, 30, 58, 61]
    plan_shards = []
    for k, first in enumerate(range(0, len(samples), per_shard)):
        part = list(range(first, min(first + per_shard, len(samples))))
        states = [torch.randn(len(samples[i].ids), len(layers), hidden, dtype=torch.bfloat16) for i in part]
        states_dir.write_shard(root, k, part, states, [samples[i].ids for i in part], [samples[i].mask for i in part],
                                 layers, "bf16")
        plan_shards.append({"first": part[0], "count": len(part), "tokens": sum(len(samples[i].ids) for i in part)})
    source = ShardTargetStates.__new__(ShardTargetStates)
    source.dir, source.stream, source.timeout = root, False, 60
    source.plan = {"layers": layers, "hidden_size": hidden, "shards": plan_shards, "samples": len(samples)}
    source.owner = states_dir.shard_of(source.plan)
    source._open = OrderedDict()
    return source


def loader_rate(source, schedule, samples, workers: int) -> float:
    start, tokens = time.perf_counter(), 0
    for _, index, payload in source.loader(schedule, samples, workers, pin=False):
        assert "states" in payload, payload
        tokens += sum(len(samples[i].ids) for i in index)
    return tokens / (time.perf_counter() - start)


def step_rate(hidden: int, tokens: int, ttt: int) -> float:
    """The lean step at this width (I = 2.5 H, heads of 128, Vd 4096), one batch of `tokens`, fp32 CPU."""
    heads = max(1, hidden // 128)
    c = DraftConfig(hidden_size=hidden, intermediate_size=int(2.5 * hidden), num_attention_heads=heads,
                    num_key_value_heads=max(1, heads // 4), head_dim=hidden // heads, vocab_size=4096,
                    draft_vocab_size=4096, aux_layer_ids=[2, 30, 58], max_position_embeddings=tokens)
    draft = Eagle3Draft(c, torch.randn(4096, hidden) * 0.02, torch.arange(4096))
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, 4096, (1, tokens))
    aux, target_vd = torch.randn(1, tokens, 3 * hidden), torch.randn(1, tokens, 4096)
    mask, vocab, in_vocab = torch.ones(1, tokens, dtype=torch.long), torch.arange(4096), torch.ones(4096, dtype=torch.bool)

    def step():
        objective = SoftCrossEntropy(draft, target_vd, target_vd.argmax(-1), mask, vocab, in_vocab, 0.8)
        loss = sum(r[0] for r in draft(ids, aux, ttt, objective))
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()
    start = time.perf_counter()
    step()
    return tokens / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=8192, help="padded tokens per batch")
    ap.add_argument("--sample-len", type=int, default=1024)
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--ttt-steps", type=int, default=3)
    args = ap.parse_args()
    n = args.batches * args.tokens // args.sample_len
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, 4096, (args.sample_len - (i % 7) * 16,), generator=g, dtype=torch.int32),
                      torch.ones(args.sample_len - (i % 7) * 16, dtype=torch.bool)) for i in range(n)]
    with tempfile.TemporaryDirectory() as root:
        source = synthetic_source(root, args.hidden, samples, per_shard=16)
        order = torch.randperm(n, generator=g).tolist()
        schedule = [(0, b) for b in cut_batches(order, [len(s.ids) for s in samples], args.tokens)]
        rows = {f"loader_workers_{w}": loader_rate(source, schedule, samples, int(w)) for w in args.workers.split(",")}
    rows["step"] = step_rate(args.hidden, args.tokens, args.ttt_steps)
    print(json.dumps({"hidden": args.hidden, "batch_tokens": args.tokens, "cpus": os.cpu_count(),
                      **{k: round(v) for k, v in rows.items()}}))
    for k, v in rows.items():
        if k != "step":
            print(f"{k}: {v:,.0f} tokens/s = {v / rows['step']:.1f}x the step's {rows['step']:,.0f} tokens/s")


if __name__ == "__main__":
    main()
