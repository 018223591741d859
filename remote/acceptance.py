"""The acceptance length vLLM would measure, predicted from each training anchor's own chain of hits.

vLLM's EAGLE-3 proposer drafts k tokens from one anchor; the target accepts them in order until the
first miss, plus one bonus token of its own. The old figure, 1 + sum_j prod_{i<=j} acc_i, multiplied
per-step accuracies as if misses were independent and counted step i on tokens whose context in
training (the data's token) is not the context serving gives (the draft's own, accepted token).
Here each anchor (a slot t with all k steps loss-masked) gets its chain:

    hit_i  = the draft's step-i argmax equals the target's argmax (token t+2+i), and, for i >= 1,
             the token step i is fed (the data's token t+1+i) is the target's argmax there, i.e. what
             vLLM would have fed after accepting step i-1;
    length = 1 + sum_j prod_{i<=j} hit_i,

and the prediction averages them the way vLLM does (:func:`walk`): not over every anchor, but along
the walk serving takes through each answer. Token c (the answer's first) comes from the prefill; the
first draft is anchored at slot c-1; a draft anchored at t yields L[t] tokens (accepted + bonus) and the
next is anchored at t + L[t], so the anchor after a miss is the hard spot itself, and an easy run is
visited once, not at every slot. vLLM's AL is tokens / drafts along that walk. At the answer's end
vLLM counts a draft's tokens past the stop token as accepted when they match what the target would
say next (vllm/v1/core/sched/scheduler.py counts acceptances before check_stop trims the output; the
demo's measurement holds ~1.6 such tokens per answer, never delivered). Where the samples carry what
the target says past the stop (held_out.py's replay: ``answer`` is the loss mask without those tails)
the last draft is scored against it; elsewhere a chain reaching the end counts full.
The mean over all anchors (``sim_al_anchors``) is kept for comparison: where misses
cluster (the digits of a number) it is the higher of the two. Pure torch, no project imports.
"""
import torch


def chain_lengths(hits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """hits, valid [k, N] bool (step i's hit and whether step i was scored, per anchor slot).

    Returns the accepted length (bonus included) of each anchor scored at every step, shape [M].
    """
    anchors = valid.all(0)
    run = hits[:, anchors].long().cumprod(0)  # run[j] = 1 while every step up to j hit
    return 1.0 + run.sum(0).float()


def expected_length(lengths: torch.Tensor) -> float:
    return float(lengths.float().mean()) if lengths.numel() else float("nan")


def follows_target(input_ids: torch.Tensor, target_top: torch.Tensor, k: int) -> torch.Tensor:
    """[k, B, T] bool: at slot t, step i's fed token (data token t+1+i) is the target's argmax at t+i.

    Step 0 is fed the verified token itself, which serving has too: always True.
    """
    B, T = input_ids.shape
    out = torch.zeros(k, B, T, dtype=torch.bool, device=input_ids.device)
    out[0] = True
    for i in range(1, k):
        n = max(T - 1 - i, 0)
        out[i, :, :n] = input_ids[:, 1 + i : 1 + i + n] == target_top[:, i : i + n]
    return out


def answer_mask(loss_mask: torch.Tensor, lengths: list[int], tails: list[int]) -> torch.Tensor:
    """loss_mask [B, T] without each row's last tails[b] tokens (of its lengths[b]): the answers alone."""
    answer = loss_mask.clone()
    for b, (n, tail) in enumerate(zip(lengths, tails)):
        answer[b, n - tail : n] = False
    return answer


def walk(lengths: torch.Tensor, loss_mask: torch.Tensor) -> tuple[int, int]:
    """(tokens, drafts) along vLLM's greedy walk through each run of loss tokens (one answer).

    lengths [B, T]: the chain length of a draft anchored at each slot (1 + hits until the first miss;
    steps past the answer's end count as hits where they were not scored, as vLLM counts them);
    loss_mask [B, T]: the answers.
    """
    tokens = drafts = 0
    lengths, mask = lengths.long().cpu(), loss_mask.int().cpu()
    edges = torch.diff(torch.nn.functional.pad(mask, (1, 1)), dim=1)  # +1 where an answer starts, -1 after it ends
    for b in range(mask.shape[0]):
        starts, stops = (edges[b] == 1).nonzero().flatten().tolist(), (edges[b] == -1).nonzero().flatten().tolist()
        row = lengths[b].tolist()
        for start, stop in zip(starts, stops):
            produced, anchor = 1, start - 1  # the answer's first token is the prefill's
            while produced < stop - start and anchor >= 0:
                step = row[anchor]
                tokens, drafts, produced, anchor = tokens + step, drafts + 1, produced + step, anchor + step
    return tokens, drafts


def batch_chains(objective, input_ids: torch.Tensor, loss_mask: torch.Tensor, k: int,
                 answer: torch.Tensor | None = None) -> tuple[float, ...]:
    """(sum of every anchor's accepted length, number of anchors, tokens and drafts along vLLM's walk) for
    one batch, from the hit maps the objective recorded (objective.hit_maps / valid_maps: [B, T] per step).
    answer: the walk's answers where the loss mask also covers tokens past their stop (default: it)."""
    hits = torch.stack([objective.hit_maps[i] for i in range(k)])
    valid = torch.stack([objective.valid_maps[i] for i in range(k)])
    hits = hits & follows_target(input_ids, objective.target_top.view(input_ids.shape), k)
    lengths = chain_lengths(hits.flatten(1), valid.flatten(1))
    tokens, drafts = walk(1 + (hits | ~valid).long().cumprod(0).sum(0), loss_mask if answer is None else answer)
    return float(lengths.sum()), float(lengths.numel()), float(tokens), float(drafts)


SURE = 0.9  # the target's probability of its own argmax at or above which a token counts as one it is sure of


def hits_by_certainty(hits: torch.Tensor, scored: torch.Tensor, target_top_p: torch.Tensor) -> tuple[float, ...]:
    """(hits, slots) where the target is sure of the token guessed, then (hits, slots) where it is not.

    hits, scored [B, T] bool: step 0's hits and scored slots (slot t guesses the target's argmax at t+1);
    target_top_p [B, T]: the target's probability of its argmax at each position. A draft that misses
    where the target is sure is missing the easy part; where the target hesitates between tokens, its
    argmax turns on details of its own next layers, which the draft learns last (a demo draft: 1.000 where
    sure, 84% of its tokens, and 0.856 where not after 1500 steps, 0.886 after 4500).
    """
    sure = torch.zeros_like(scored)
    sure[:, :-1] = target_top_p[:, 1:] >= SURE
    sure, unsure = scored & sure, scored & ~sure
    return (float((hits & sure).sum()), float(sure.sum()), float((hits & unsure).sum()), float(unsure.sum()))
