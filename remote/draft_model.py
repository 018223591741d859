"""The EAGLE-3 draft: one Llama decoder layer that guesses the target's next tokens.

It reads two things per position t: the embedding of token t+1 (the target's own,
frozen embedding table) and `fc` of three of the target's hidden states at t
(low, middle, high layers). Its one decoder layer attends over [norm(embed);
norm(fused)] (2H wide), and `lm_head` scores a reduced draft vocabulary of Vd
ids (`d2t` maps draft id i to target id i + d2t[i]).

Training-time test (TTT): step 0 runs on the target's states; step i > 0 feeds
the previous step's output hidden state back in place of the target's, one
token further on, exactly as vLLM chains draft tokens at inference. Slot t of
step i is at position t + i, embeds token t+1+i and predicts token t+2+i; it
attends to step 0's keys at positions <= t and to its own slot's keys from
steps 1..i (vLLM's draft KV cache holds the same). That is the "diagonal"
formulation: a causal attention over step 0 (a fused kernel, no mask tensor)
merged by log-sum-exp with i per-slot scores, so no k*T-wide key set and no
dense mask exist, and memory stays linear in T.

Work: a slot's output feeds only its own slot's next step, so slots no step
scores from here on (prompts, padding: a third of the demo's tokens) skip the
MLP, the layer's widest part; their keys and values, which later slots attend
to, are still computed. The loss and gradients are exactly those of every slot.

Memory at scale (a 7168-wide draft, 16k tokens): each TTT step runs under
activation checkpointing and hands its output to an `objective` inside the
checkpoint, so across steps only each step's output state and its keys/values
are kept; the objective (train.py's soft cross-entropy) never keeps [T, Vd]
logits either. The frozen embedding table keeps the dtype it is given (bf16
on a GPU).

The module attributes are named as vLLM's LlamaForCausalLMEagle3 checkpoint
names them, so `export` is the state dict minus the frozen embeddings.

Shapes: B batch, T tokens, H hidden (= the target's), V target vocab, Vd draft
vocab, nh/nkv heads, hd head dim, I MLP width.
"""
import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from script import Refused
from train_plan import draft_shape, rope_refusal


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    hidden_act: str = "silu"

    @classmethod
    def from_target(cls, target, draft_vocab_size: int, aux_layer_ids: list[int], heads: int | None = None,
                    kv_heads: int | None = None, intermediate: int | None = None) -> "DraftConfig":
        """Shape the draft from the target (a transformers config): train_plan.draft_shape's rule, so the
        plan and the run agree (the target's layer, at most 8 kv heads, unless the flags say otherwise)."""
        if why := rope_refusal(target.to_dict()):
            raise Refused(why)
        shape = draft_shape(target.to_dict(), draft_vocab_size, heads, kv_heads, intermediate)
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=shape.intermediate,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=list(aux_layer_ids),
            max_position_embeddings=target.max_position_embeddings,
            rms_norm_eps=getattr(target, "rms_norm_eps", 1e-6),
            rope_parameters=dict(target.rope_parameters),
            hidden_act=getattr(target, "hidden_act", "silu"),
        )

    def llama_config(self) -> LlamaConfig:
        """The transformers view of the draft layer (for RoPE and the exported config.json)."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=1,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            hidden_act=self.hidden_act,
            tie_word_embeddings=False,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def causal_lse(q, k, v) -> torch.Tensor:
    """[B, nh, T] fp32 log-sum-exp of the causal attention scores (no grad), from the fused kernels."""
    with torch.no_grad():
        try:
            if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
                return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[1].float()
            if q.device.type == "cuda":
                lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[1]
                return lse[..., : q.shape[-2]].float()
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[1].float()
        except (RuntimeError, NotImplementedError):  # a kernel that refuses the shape: plain math, in query chunks
            return causal_lse_math(q, k)


def causal_lse_math(q, k, chunk: int = 1024) -> torch.Tensor:
    """causal_lse by matmuls, `chunk` queries at a time (the reference the kernels are checked against)."""
    T, scale = q.shape[-2], q.shape[-1] ** -0.5
    out = []
    for a in range(0, T, chunk):
        s = (q[..., a : a + chunk, :].float() @ k.float().transpose(-1, -2)) * scale
        rows = torch.arange(a, min(a + chunk, T), device=q.device)
        s = s.masked_fill(torch.arange(T, device=q.device) > rows[:, None], float("-inf"))
        out.append(s.logsumexp(-1))
    return torch.cat(out, dim=-1)


def causal_attention_lse(q, k, v, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(causal SDPA [B, nh, T, hd], its log-sum-exp [B, nh, T] fp32 without grad). A CPU's flash kernel
    returns both from one call and meets query heads with their kv head itself (a demo step's forward and
    backward: 2.4% faster); elsewhere the lse is a second, gradient-free call on repeated kv heads."""
    if q.device.type == "cpu":
        try:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
            return out, lse.detach().float()
        except (RuntimeError, NotImplementedError):  # dtypes the kernel refuses: the general path
            pass
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
    expand = (lambda t: t.repeat_interleave(groups, dim=1)) if groups > 1 else (lambda t: t)
    return out, causal_lse(q.detach(), expand(k.detach()), expand(v.detach()))


def ttt_attention(q, cache: list, groups: int) -> torch.Tensor:
    """Slot t of step i = len(cache)-1 attends to step 0's keys at positions <= t and to its own slot in
    steps 1..i. q [B, nh, T, hd]; cache: (k, v) [B, nkv, T, hd] per step so far. Returns [B, nh, T, hd].

    Step 0's part is one causal SDPA (flash on a GPU); the i diagonal scores are merged with it through
    its log-sum-exp. The kernels give no gradient for the lse, so it carries a surrogate with the exact
    one: d lse/dq = scale * P K and d lse/dK = scale * P^T q (P the causal attention), which is what
    `scale * rowsum(q * SDPA(q', K', K))` differentiates to with q' and K' held constant. Query heads
    meet their kv head by broadcasting (no repeated copies of k and v are kept for backward).
    """
    B, nh, T, hd = q.shape
    k0, v0 = cache[0]
    if len(cache) == 1:
        return F.scaled_dot_product_attention(q, k0, v0, is_causal=True, enable_gqa=groups > 1)
    o0, lse0 = causal_attention_lse(q, k0, v0, groups)
    scale = hd**-0.5
    qd, k0d = q.detach(), k0.detach()
    pk = F.scaled_dot_product_attention(qd, k0d, k0, is_causal=True, enable_gqa=groups > 1)
    surrogate = scale * (q.float() * pk.float()).sum(-1)
    lse0 = lse0 + (surrogate - surrogate.detach())
    qg = q.float().view(B, -1, groups, T, hd)  # [B, nkv, groups, T, hd]
    diag = [scale * (qg * kj.float().unsqueeze(2)).sum(-1).view(B, nh, T) for kj, _ in cache[1:]]
    w = torch.stack([lse0, *diag], dim=-1).softmax(-1).view(B, -1, groups, T, len(cache))
    out = w[..., :1] * o0.float().view(B, -1, groups, T, hd)
    for j, (_, vj) in enumerate(cache[1:], start=1):
        out = out + w[..., j : j + 1] * vj.float().unsqueeze(2)
    return out.view(B, nh, T, hd).to(o0.dtype)


class Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H-wide [embed; fused] input."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, ttt_cache: list):
        """x [B, T, 2H]; cos/sin [B, T, hd]; ttt_cache: (k, v) of earlier TTT steps (not changed).
        Returns (out [B, T, H], k, v): this step's keys and values [B, nkv, T, hd], for later steps."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = ttt_attention(q, [*ttt_cache, (k, v)], self.nh // self.nkv)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd)), k, v


class MLP(nn.Module):
    """The layer's widest part. With ``bf16_matmuls`` (train.py sets it on a CPU that multiplies bf16
    natively) an fp32 draft's three matmuls run in bf16, at about twice fp32's speed there; the weights,
    their gradients and the output stay fp32."""

    BF16_ROW_MULTIPLE = 64  # oneDNN compiles a bf16 kernel per row count and keeps 1024: batches bring hundreds

    def __init__(self, c: DraftConfig):
        super().__init__()
        if c.hidden_act != "silu":
            raise ValueError(f"draft MLP supports hidden_act 'silu' only, target has {c.hidden_act!r}")
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.bf16_matmuls = False

    def forward(self, x):
        if not (self.bf16_matmuls and x.dtype == torch.float32):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        rows = x.shape[:-1].numel()  # padded to a multiple, or the kernel is recompiled nearly every step
        flat = F.pad(x.reshape(rows, -1), (0, 0, 0, -rows % self.BF16_ROW_MULTIPLE)).bfloat16()
        h = F.silu(F.linear(flat, self.gate_proj.weight.bfloat16())) * F.linear(flat, self.up_proj.weight.bfloat16())
        return F.linear(h, self.down_proj.weight.bfloat16())[:rows].float().view(*x.shape[:-1], -1)


class MidLayer(nn.Module):
    """The decoder layer, as vLLM's Eagle3 LlamaDecoderLayer (layer 0, norm after residual) computes it."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, embeds, hidden, cos, sin, ttt_cache, rows=None):
        """Returns (the pre-norm output hidden state [B, T, H] (what vLLM feeds to the next draft step), k, v).

        rows: the flat slot indices (into B*T) whose output is used: the MLP runs on those only, and
        the other slots' outputs lack it (None: every slot)."""
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn, k, v = self.self_attn(x, cos, sin, ttt_cache)
        residual = residual + attn
        if rows is None:
            return residual + self.mlp(self.post_attention_layernorm(residual)), k, v
        flat = residual.reshape(-1, residual.shape[-1])
        out = flat.index_add(0, rows, self.mlp(self.post_attention_layernorm(flat.index_select(0, rows))).to(flat.dtype))
        return out.view_as(residual), k, v


class Eagle3Draft(nn.Module):
    def __init__(self, config: DraftConfig, target_embeddings: torch.Tensor, draft_to_target: torch.Tensor):
        """target_embeddings [V, H] (kept frozen); draft_to_target [Vd] int64: the target id of each draft id."""
        super().__init__()
        c = config
        if target_embeddings.shape != (c.vocab_size, c.hidden_size):
            raise ValueError(f"target embeddings {tuple(target_embeddings.shape)} != ({c.vocab_size}, {c.hidden_size})")
        if draft_to_target.shape != (c.draft_vocab_size,):
            raise ValueError(f"draft vocab map has {draft_to_target.numel()} ids, config says {c.draft_vocab_size}")
        self.config = c
        # the target's own table, frozen, in the dtype it comes in (bf16 on a GPU: 2.3 GB for Kimi-K2, not 4.7)
        self.embed_tokens = nn.Embedding.from_pretrained(target_embeddings.detach(), freeze=True)
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target", draft_to_target.long().clone())
        self.rotary = LlamaRotaryEmbedding(c.llama_config())

    def forward(self, input_ids, aux_hidden, ttt_steps: int, objective=None, checkpoint: bool = True,
                used=None) -> list:
        """input_ids [B, T] target ids; aux_hidden [B, T, 3H]. Returns ttt_steps x objective(i, hidden),
        hidden [B, T, H] being step i's pre-norm output; the default objective gives (logits [B, T, Vd],).
        used: per step, the [B, T] bool slots whose output the objective (or a later step) reads;
        the others skip the MLP (see MidLayer). None: all slots are exact.

        Step i's slot t predicts token t+2+i; slots past the end read token id 0 (callers mask them).
        With `checkpoint` (and grad enabled) each step, objective included, is recomputed in backward:
        between steps only its output state, keys and values, and the objective's outputs are kept.
        """
        B, T = input_ids.shape
        objective = objective or (lambda i, h: (self.lm_head(self.norm(h)),))
        hidden = self.fc(aux_hidden)
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        ttt_cache, results = [], []
        for i in range(ttt_steps):
            def step(hidden, *cache, i=i):
                next_ids = F.pad(input_ids[:, 1 + i :], (0, 1 + i), value=0)[:, :T]  # token t+1+i at slot t
                cos, sin = self.rotary(hidden, positions + i)
                pairs = list(zip(cache[0::2], cache[1::2]))
                rows = None if used is None else used[i].flatten().nonzero().squeeze(1)
                out, k, v = self.midlayer(self.embed_tokens(next_ids), hidden, cos, sin, pairs, rows)
                return (out, k, v, *objective(i, out))

            flat = [t for kv in ttt_cache for t in kv]
            if checkpoint and torch.is_grad_enabled():
                hidden, k, v, *result = torch.utils.checkpoint.checkpoint(step, hidden, *flat, use_reentrant=False)
            else:
                hidden, k, v, *result = step(hidden, *flat)
            ttt_cache.append((k, v))
            results.append(tuple(result))
        return results

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen target embeddings and the derived buffers."""
        return {k: v for k, v in self.state_dict().items() if k not in ("embed_tokens.weight", "draft_to_target")}


# ---------------------------------------------------------------- export

LAYER_TENSORS = (
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
)


def expected_tensor_names(c: DraftConfig) -> set[str]:
    """What vLLM's LlamaForCausalLMEagle3 loader needs, and nothing else.

    d2t/t2d only for a reduced draft vocab: with Vd == V vLLM has no
    draft_id_to_target_id parameter and refuses a checkpoint that carries d2t.
    """
    names = {"fc.weight", "norm.weight", "lm_head.weight", *LAYER_TENSORS}
    if c.draft_vocab_size < c.vocab_size:
        names |= {"d2t", "t2d"}
    return names


def export_tensors(draft: Eagle3Draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint tensors; raises ValueError unless the name set is exactly the expected one."""
    c = draft.config
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in draft.trainable_state_dict().items()}
    if c.draft_vocab_size < c.vocab_size:
        ids = draft.draft_to_target.cpu()
        tensors["d2t"] = ids - torch.arange(c.draft_vocab_size)
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    check_tensor_names(set(tensors), c)
    return tensors


def check_tensor_names(names: set[str], c: DraftConfig) -> None:
    expected = expected_tensor_names(c)
    if names != expected:
        raise ValueError(
            "draft export refused: tensor names differ from LlamaForCausalLMEagle3's "
            f"(missing {sorted(expected - names)}, unexpected {sorted(names - expected)})"
        )


def export_config(c: DraftConfig, dtype: torch.dtype) -> dict:
    """config.json for vLLM: a one-layer Llama plus the EAGLE-3 fields (aux ids in vLLM's convention).

    RoPE goes in both spellings: `rope_parameters` (transformers 5) and `rope_theta`/`rope_scaling`
    (what older stacks read; a draft with the wrong RoPE loads fine and accepts little).
    """
    cfg = c.llama_config().to_diff_dict()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # Llama's defaults, not the target's: the draft never stops
        cfg.pop(key, None)
    rope = dict(c.rope_parameters)
    cfg["rope_theta"] = rope.get("rope_theta")
    cfg["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    cfg.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        draft_vocab_size=c.draft_vocab_size,
        target_hidden_size=c.hidden_size,
        torch_dtype=str(dtype).removeprefix("torch."),
        dtype=str(dtype).removeprefix("torch."),
        norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=list(c.aux_layer_ids),
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids), "use_aux_hidden_state": True},
    )
    return cfg


def export(draft: Eagle3Draft, out_dir: str, dtype: torch.dtype = torch.float32, card: str = "") -> None:
    """Write out_dir/{config.json, model.safetensors, README.md} in the format vLLM loads as EAGLE-3."""
    tensors = export_tensors(draft, dtype)
    os.makedirs(out_dir, exist_ok=True)
    # Each file is written beside its place and renamed into it: a reader (vLLM loading the draft,
    # `inv pull`, a later export replacing a better checkpoint) never sees a torn file.
    weights = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, weights + ".tmp", metadata={"format": "pt"})
    os.replace(weights + ".tmp", weights)
    for name, text in (("config.json", json.dumps(export_config(draft.config, dtype), indent=2)), ("README.md", card)):
        path = os.path.join(out_dir, name)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)

