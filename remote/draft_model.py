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
steps 1..i (vLLM's draft KV cache holds the same): one masked SDPA call over
all steps' keys, so no T x T score tensor is kept where a fused kernel exists.

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
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


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
    def from_target(cls, target, draft_vocab_size: int, aux_layer_ids: list[int]) -> "DraftConfig":
        """Shape the draft like one layer of the target (a transformers config)."""
        heads = target.num_attention_heads
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target, "num_key_value_heads", None) or heads,
            head_dim=getattr(target, "head_dim", None) or target.hidden_size // heads,
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


def ttt_mask(T: int, steps: int, device) -> torch.Tensor:
    """[T, steps*T] bool: slot t sees step 0's keys at positions <= t, then its own slot in each later step."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    own = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal, *[own] * (steps - 1)], dim=1)


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
        """x [B, T, 2H]; cos/sin [B, T, hd]; ttt_cache: (k, v) of earlier TTT steps, appended to."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        groups = self.nh // self.nkv
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        ttt_cache.append((k, v))
        keys = torch.cat([kj for kj, _ in ttt_cache], dim=2)  # [B, nh, (i+1)T, hd]
        values = torch.cat([vj for _, vj in ttt_cache], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=ttt_mask(T, len(ttt_cache), x.device))
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        if c.hidden_act != "silu":
            raise ValueError(f"draft MLP supports hidden_act 'silu' only, target has {c.hidden_act!r}")
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The decoder layer, as vLLM's Eagle3 LlamaDecoderLayer (layer 0, norm after residual) computes it."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, embeds, hidden, cos, sin, ttt_cache):
        """Returns the pre-norm output hidden state [B, T, H] (what vLLM feeds to the next draft step)."""
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        residual = residual + self.self_attn(x, cos, sin, ttt_cache)
        return residual + self.mlp(self.post_attention_layernorm(residual))


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
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.data.copy_(target_embeddings)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target", draft_to_target.long().clone())
        self.rotary = LlamaRotaryEmbedding(c.llama_config())

    def forward(self, input_ids, aux_hidden, ttt_steps: int) -> list[torch.Tensor]:
        """input_ids [B, T] target ids; aux_hidden [B, T, 3H]. Returns ttt_steps x logits [B, T, Vd].

        Step i's slot t predicts token t+2+i; slots past the end read token id 0 (callers mask them).
        """
        B, T = input_ids.shape
        hidden = self.fc(aux_hidden)
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        ttt_cache, logits = [], []
        for i in range(ttt_steps):
            next_ids = F.pad(input_ids[:, 1 + i :], (0, 1 + i), value=0)[:, :T]  # token t+1+i at slot t
            cos, sin = self.rotary(hidden, positions + i)
            hidden = self.midlayer(self.embed_tokens(next_ids), hidden, cos, sin, ttt_cache)
            logits.append(self.lm_head(self.norm(hidden)))
        return logits

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

