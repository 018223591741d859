"""What the draft is trained to match, computed without the tensors that do not fit at scale.

At Kimi-K2's shape (vocab 163840, draft vocab 32000, 16k tokens a batch) the plain
objective holds the target's full-vocabulary logits (5.4 GB in bf16) and, for each of the
k TTT steps, fp32 logits and log-softmax over the draft vocabulary kept for backward
(~2 MB a token). Here instead:

- `target_distribution`: the target's logits over the draft vocabulary only (its head's
  Vd rows), and its full-vocabulary argmax and that argmax's probability, found chunk by chunk
  of the vocabulary;
- `SoftCrossEntropy`: the per-step loss over the loss-masked tokens only, in chunks of
  rows, each chunk recomputed in backward on a GPU: no [T, Vd] fp32 tensor outlives its chunk.

The numbers are the plain objective's (train.py's docstring of the loss says which), to
rounding; tests/unit/test_train_parts.py checks loss and gradients against it.
"""
import torch
import torch.utils.checkpoint

CE_CHUNK_BYTES = 256 * 2**20  # one fp32 [rows, Vd] tensor of a loss chunk
VOCAB_CHUNK = 16384  # target vocabulary columns scored at a time for the argmax


def ce_chunk_rows(draft_vocab: int, chunk_bytes: int = CE_CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // (4 * draft_vocab))


@torch.no_grad()
def target_distribution(normed: torch.Tensor, head: torch.Tensor, head_vd: torch.Tensor,
                        vocab_chunk: int = VOCAB_CHUNK, with_top_p: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """normed [B, T, H] (the target's final-normed last state), head [V, H], head_vd = head[vocab_ids].

    Returns (logits over the draft vocabulary [B, T, Vd], argmax over the whole vocabulary [B, T], and
    with_top_p the target's own probability of that argmax [B, T] fp32, else None); ties go to the lower
    id, as torch.argmax does. Peak: one [B, T, vocab_chunk] block (with_top_p: and its fp32 exponentials,
    which training steps do not pay for: validation alone asks).
    """
    logits_vd = normed @ head_vd.T
    best_val = best_idx = lse = None
    for a in range(0, head.shape[0], vocab_chunk):
        logits = normed @ head[a : a + vocab_chunk].T
        val, idx = logits.max(-1)
        idx, chunk_lse = idx + a, logits.float().logsumexp(-1) if with_top_p else None
        if best_val is None:
            best_val, best_idx, lse = val, idx, chunk_lse
        else:
            better = val > best_val
            best_val, best_idx = torch.where(better, val, best_val), torch.where(better, idx, best_idx)
            lse = torch.logaddexp(lse, chunk_lse) if with_top_p else None
    return logits_vd, best_idx, (best_val.float() - lse).exp() if with_top_p else None


def scored_slots(loss_mask: torch.Tensor, i: int) -> torch.Tensor:
    """[B, T] bool: the slots step i scores (slot t predicts token t+2+i: scored where that token has loss)."""
    T = loss_mask.shape[1]
    n = max(T - 2 - i, 0)
    mask = torch.zeros_like(loss_mask, dtype=torch.bool)
    mask[:, :n] = loss_mask[:, 2 + i : 2 + i + n]
    return mask


class SoftCrossEntropy:
    """The TTT objective for one batch, called by the draft once per step inside that step's checkpoint.

    Step i's slot t predicts token t+2+i: its target distribution is the softmax over the draft vocab
    of the target's logits at position t+1+i, its target argmax the full-vocab one there. Loss on
    tokens with loss_mask whose target argmax is in the draft vocab, weighted decay^i and averaged over
    them; accuracy (draft argmax == target argmax) counted on every loss-masked token.
    __call__ returns (weighted loss, correct, counted) for step i.
    """

    def __init__(self, draft, target_vd, target_top, loss_mask, vocab_ids, in_vocab, decay: float,
                 chunk_rows: int | None = None, recompute: bool = True, target_top_p: torch.Tensor | None = None):
        """recompute: each chunk's logits are recomputed in backward, not kept (a GPU's memory binds; on a
        CPU, where the TTT steps keep their tensors too, keeping them saves the head's second pass).
        target_top_p [B, T]: the target's probability of its argmax, kept for validation's split of the hits
        (acceptance.hits_by_certainty); the loss does not use it."""
        self.draft, self.decay, self.recompute = draft, decay, recompute
        B, T, Vd = target_vd.shape
        self.T, self.Vd = T, Vd
        self.target_vd = target_vd.reshape(B * T, Vd)
        self.target_top = target_top.reshape(B * T)
        self.target_top_p = target_top_p
        self.loss_mask, self.vocab_ids, self.in_vocab = loss_mask.bool(), vocab_ids, in_vocab
        self.chunk_rows = chunk_rows or ce_chunk_rows(Vd)
        self.hit_maps, self.valid_maps = {}, {}  # step i -> [B, T] bool per slot (acceptance.py's chains)

    def scored(self, i: int) -> torch.Tensor:
        return scored_slots(self.loss_mask, i)

    def used_slots(self, steps: int) -> list[torch.Tensor]:
        """Per step i, the [B, T] bool slots whose step-i output matters: scored at step i or later (a slot's
        output feeds only its own slot's next step). Prompt and padding slots are the rest."""
        used, later = [], torch.zeros_like(self.loss_mask)
        for i in reversed(range(steps)):
            later = later | self.scored(i)
            used.append(later)
        return used[::-1]

    def __call__(self, i: int, hidden: torch.Tensor):
        B, T, H = hidden.shape
        mask = self.scored(i)
        b, t = mask.nonzero(as_tuple=True)
        rows = b * T + t  # this step's slot t ...
        targets = rows + 1 + i  # ... is scored against the target at position t+1+i
        keep = self.in_vocab[self.target_top[targets]]
        flat = hidden.reshape(B * T, H)
        ce_sum = hidden.new_zeros((), dtype=torch.float32)
        hits = []
        for a in range(0, len(rows), self.chunk_rows):
            part = slice(a, a + self.chunk_rows)
            chunk = (rows[part], targets[part], keep[part])
            ce, hit = torch.utils.checkpoint.checkpoint(self._chunk, flat, *chunk, use_reentrant=False) \
                if self.recompute else self._chunk(flat, *chunk)
            ce_sum = ce_sum + ce
            hits.append(hit)
        hit_rows = torch.cat(hits) if hits else rows.new_zeros(0, dtype=torch.bool)
        correct = hit_rows.sum()
        # Overwritten, not appended: the draft's checkpoint calls this again in backward, same values.
        self.hit_maps[i] = torch.zeros(B * T, dtype=torch.bool, device=hidden.device).index_fill_(
            0, rows[hit_rows], True).view(B, T)
        self.valid_maps[i] = torch.zeros(B * T, dtype=torch.bool, device=hidden.device).index_fill_(
            0, rows, True).view(B, T)
        return self.decay**i * ce_sum / keep.sum().clamp(min=1), correct, mask.sum()

    def _chunk(self, flat, rows, targets, keep):
        log_q = self.draft.lm_head(self.draft.norm(flat.index_select(0, rows))).float().log_softmax(-1)
        p = self.target_vd[targets].float().softmax(-1)
        ce = -(p * log_q).sum(-1)
        hit = self.vocab_ids[log_q.argmax(-1)] == self.target_top[targets]  # per row: acceptance.py's chains
        return (ce * keep).sum(), hit
