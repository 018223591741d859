"""ZeRO-1 (train.py's default with several ranks) against the unsharded optimizer, on CPU ranks over gloo:
the same DDP draft and batches, N steps each way, then the whole optimizer state gathered as a checkpoint
keeps it and a fresh sharded optimizer loaded from it steps on. Loss and weights equal to rounding."""
import sys
import types

import pytest

from tests.helpers.fixtures_train import REMOTE
from tests.torch.group_bed import on_ranks

STEPS, MORE = 4, 2


def train_both_ways(rank, world, optimizers, ckpt):
    return {optimizer: one_optimizer(rank, optimizer, f"{ckpt}.{optimizer}") for optimizer in optimizers}


def one_optimizer(rank, optimizer, ckpt):
    sys.path.insert(0, str(REMOTE))
    import torch
    import torch.distributed as dist

    import train
    from draft_model import DraftConfig, Eagle3Draft
    from ttt_objective import SoftCrossEntropy, target_distribution

    H, V, Vd, B, T = 64, 256, 48, 2, 24
    c = DraftConfig(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    vocab_size=V, draft_vocab_size=Vd, aux_layer_ids=[0, 1, 2], max_position_embeddings=256)
    args = types.SimpleNamespace(optimizer=optimizer, lr=3e-3, muon_lr=0.02)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches, as rank_batches deals them
    batches = [(torch.randint(0, V, (B, T), generator=g), torch.randn(B, T, 3 * H, generator=g),
                torch.randn(B, T, H, generator=g)) for _ in range(STEPS + MORE)]
    torch.manual_seed(0)
    embed, head, vocab_ids = torch.randn(V, H), torch.randn(V, H) * 0.3, torch.randperm(V)[:Vd].sort().values
    in_vocab = torch.zeros(V, dtype=torch.bool)
    in_vocab[vocab_ids] = True

    def run(sharded, steps, state=None, start=None):
        torch.manual_seed(1)
        draft = Eagle3Draft(c, embed, vocab_ids)
        if start is not None:
            draft.load_state_dict(start)
        model = train.data_parallel(draft)
        opt = train.make_optimizer(args, draft, sharded)
        if state is not None:
            opt.load_state_dict(state)
        losses = []
        for ids, aux, normed in steps:
            target_vd, top, _ = target_distribution(normed, head, head[vocab_ids])
            objective = SoftCrossEntropy(draft, target_vd, top, torch.ones(B, T, dtype=torch.long), vocab_ids,
                                         in_vocab, 0.8, recompute=False)
            loss = sum(r[0] for r in model(ids, aux, 3, objective))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)
            opt.step()
            total = loss.detach().view(1)
            dist.all_reduce(total)
            losses.append(total.item())
        return draft, opt, losses

    plain, plain_opt, plain_losses = run(False, batches)
    sharded, sharded_opt, sharded_losses = run(True, batches[:STEPS])
    state = train.optimizer_state(sharded_opt, [0])  # what rank 0 (the writer) checkpoints
    if rank == 0:
        torch.save({"optimizer": state, "draft": sharded.state_dict()}, ckpt)
    dist.barrier()
    saved = torch.load(ckpt, weights_only=False)
    resumed, _, resumed_losses = run(True, batches[STEPS:], saved["optimizer"], saved["draft"])
    moments = sum(t.numel() for s in sharded_opt.optim.state.values() for t in s.values() if torch.is_tensor(t))
    return {
        "plain": plain_losses, "sharded": sharded_losses + resumed_losses,
        "max_weight_diff": max((a - b).abs().max().item() for a, b in zip(plain.parameters(), resumed.parameters())),
        "weight_scale": max(a.abs().max().item() for a in plain.parameters() if a.requires_grad),
        "moments_here": moments, "trainable": sum(p.numel() for p in plain.parameters() if p.requires_grad),
    }


@pytest.mark.parametrize("world, optimizers", [(2, ["adamw", "muon"]), (4, ["adamw"])])
def test_zero1_trains_as_the_unsharded_optimizer_and_resumes_from_its_gathered_state(tmp_path, world, optimizers):
    by_rank = on_ranks(world, tmp_path, train_both_ways, optimizers, str(tmp_path / "ckpt.pt"))
    for optimizer in optimizers:
        check([r[optimizer] for r in by_rank], optimizer, world)


def check(results, optimizer, world):
    for r in results:
        assert len(r["sharded"]) == len(r["plain"])
        for a, b in zip(r["plain"], r["sharded"]):
            assert abs(a - b) <= 1e-5 * abs(a), (r["plain"], r["sharded"])
        assert r["max_weight_diff"] <= 1e-5 * r["weight_scale"], r
    # each rank held only its share of the optimizer's state
    assert all(0 < r["moments_here"] < r["trainable"] * (2 if optimizer == "adamw" else 1.5) for r in results)
    assert sum(r["moments_here"] for r in results) <= 2 * results[0]["trainable"] + 16 * world
