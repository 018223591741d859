"""The EAGLE-3 training step as the trainer first computed it (commit 6c53909), kept as the reference.

Plain and memory-hungry on purpose: the target's full-vocabulary logits, every TTT step's
draft logits kept for backward, attention over the k*T concatenated keys with a dense mask,
no checkpointing. tests/unit/test_train_parts.py checks the trainer's lean step against it (loss,
accuracy counts, gradients); bench/train_memory.py measures both.
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "remote"))
from draft_model import rotate_half  # noqa: E402


def reference_step(draft, input_ids, aux, steps, target_logits, loss_mask, vocab_ids, in_vocab, decay):
    """The step as the trainer first computed it (commit 6c53909), written plainly: the target's full-vocab
    logits, every step's draft logits kept, attention over the k*T concatenated keys with a dense mask."""
    m, a = draft.midlayer, draft.midlayer.self_attn
    B, T = input_ids.shape
    hidden = draft.fc(aux)
    positions = torch.arange(T).expand(B, T)
    cache, logits = [], []
    for i in range(steps):
        next_ids = F.pad(input_ids[:, 1 + i:], (0, 1 + i), value=0)[:, :T]
        cos, sin = draft.rotary(hidden, positions + i)
        x = torch.cat([m.input_layernorm(draft.embed_tokens(next_ids)), m.hidden_norm(hidden)], dim=-1)
        q = a.q_proj(x).view(B, T, a.nh, a.hd).transpose(1, 2)
        k = a.k_proj(x).view(B, T, a.nkv, a.hd).transpose(1, 2)
        v = a.v_proj(x).view(B, T, a.nkv, a.hd).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        g = a.nh // a.nkv
        cache.append((k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)))
        mask = torch.cat([torch.ones(T, T, dtype=torch.bool).tril(), *[torch.eye(T, dtype=torch.bool)] * i], dim=1)
        out = F.scaled_dot_product_attention(q, torch.cat([c[0] for c in cache], 2), torch.cat([c[1] for c in cache], 2),
                                             attn_mask=mask)
        residual = hidden + a.o_proj(out.transpose(1, 2).reshape(B, T, a.nh * a.hd))
        hidden = residual + m.mlp(m.post_attention_layernorm(residual))
        logits.append(draft.lm_head(draft.norm(hidden)))
    target_top, target_vd = target_logits.argmax(-1), target_logits[..., vocab_ids]
    loss, correct, counted = torch.zeros(()), [], []
    for i, lg in enumerate(logits):
        n = T - 2 - i
        mask = loss_mask[:, 2 + i:2 + i + n].bool()
        top = target_top[:, 1 + i:1 + i + n]
        keep = mask & in_vocab[top]
        log_q = lg[:, :n].float().log_softmax(-1)
        ce = -(target_vd[:, 1 + i:1 + i + n].float().softmax(-1) * log_q).sum(-1)
        loss = loss + decay**i * (ce * keep).sum() / keep.sum().clamp(min=1)
        correct.append(((vocab_ids[log_q.argmax(-1)] == top) & mask).sum())
        counted.append(mask.sum())
    return loss, torch.stack(correct), torch.stack(counted)
