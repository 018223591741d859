"""What a training run will cost, from the target's config.json alone, before a GPU-hour is spent.

    python remote/train.py --plan --target DIR [--gpu-gb 141] [--gpus 8] [--batch-tokens N|auto]

Per GPU: the trainable draft (fp32 master weights, gradients, which DDP's all-reduce buckets hold
(gradient_as_bucket_view), the optimizer's state, sharded over the ranks by ZeRO-1, autocast's bf16
weight copies), the frozen tensors (the target's embedding, and its
final norm + lm_head for the loss: the shard path loads those alone; the online path the
whole target), and the activations of one step, which grow with the batch's tokens.

Activations are counted tensor by tensor from what the lean step (draft_model.py,
ttt_objective.py) keeps: per token, the inputs (ids, the aux and last states, the target's
logits over the draft vocabulary) and, for each TTT step, its output state, keys and values
(the step itself is checkpointed); plus one step's recomputed activations while its backward
runs (its saved tensors, and their gradients: BACKWARD_FACTOR, measured on the CPU). On a CPU host,
where memory does not bind and skipping the recompute saves a third of the step, no step is recomputed and
every step's saved tensors are counted. The
loss chunks (on a GPU) and vocabulary chunks cost a fixed amount, not per token. tests/torch/test_memory_plan.py checks
the per-token figure against the peak RSS of real steps at a reduced width (within 25 %). On CUDA the
count is scaled by CUDA_ACTIVATION_FACTOR, measured on an H200 by bench/gpu_check.sh.

Speed: FLOPs of forward + backward + the checkpoint's recomputation, at an assumed
sustained rate per GPU (ASSUMED_TFLOPS, stated in the output): a plan, not a promise.
"""
import json
import os
from dataclasses import asdict, dataclass

GIB = 2**30
LOADER_BATCHES = 2  # as states_from_shards.py (which imports torch; this module does not)
BACKWARD_FACTOR = 1.0  # one step's peak while its backward runs / the saved tensors counted below (CPU, fp32)
# Memory a GPU's free figure at start does not leave to the step: this process's CUDA context and
# kernels (~0.5-1 GB), NCCL's communicator buffers (grow with ranks and channels: ~1-2 GB at 8 ranks),
# and what the caching allocator holds but cannot hand out. A plan figure until bench/gpu_check.sh's
# real-width rows measure it (reserve_measured_gb: the context plus reserved - allocated) on a lent GPU;
# the plan subtracts it from the memory free when the run starts (train.py), not from the card's total.
RESERVE_GB = 3.0
# Measured on an H200 (bench/gpu_check.py's real-width step, then named real-step: Kimi width, TTT 7, bf16 autocast, 8/16/31 x 4096 tokens):
# peak torch.cuda.max_memory_allocated grows 0.981 MB per token where the tensor count below gives 0.810.
# Which bf16-autocast tensors the count misses is not pinned down yet, so the count is scaled, not guessed at.
CUDA_ACTIVATION_FACTOR = 1.21
ACTIVATION_MARGIN = 1.10  # and a batch must fit with this much headroom on top (other shapes, allocator variance)
ASSUMED_TFLOPS = {"H200": 400.0, "H100": 400.0, "default": 300.0}  # sustained bf16 on this step's matmuls
CE_CHUNK_BYTES = 256 * 2**20  # as ttt_objective.py
VOCAB_CHUNK = 16384
CPU_AUTO_BATCH = 16384  # --batch-tokens auto on a CPU (RAM would allow whole data sets in one batch)


@dataclass
class DraftShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    draft_vocab: int
    vocab: int
    aux: int = 3

    def trainable_params(self) -> int:
        H, Q, K = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = 2 * H * (Q + 2 * K) + Q * H
        return self.aux * H * H + attention + 3 * H * self.intermediate + self.draft_vocab * H + 4 * H


def text_config(path: str) -> dict:
    """The target's config.json (its text part for multimodal checkpoints such as Kimi-K2.5)."""
    file = path if path.endswith(".json") else os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    return config.get("text_config") or config


# The RoPE scalings the draft trains with (transformers) exactly as vLLM serves them: held equal at positions
# 0..8192 by tests/vllm/test_rotary_matches_vllm.py. Another type could load in vLLM and accept little
# (dynamic NTK rescales past the trained length on one side only; longrope picks its factors by another
# rule), so a target that carries one is refused before training.
SERVED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_refusal(config: dict) -> str | None:
    """Why the draft cannot carry this target's RoPE into vLLM, or None when it can."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict) or (rope and all(isinstance(v, dict) for v in rope.values())):
        kind = "per-layer parameters" if isinstance(rope, dict) else repr(rope)[:60]
    else:
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind in SERVED_ROPE_TYPES:
            return None
    return (f"the target's RoPE scaling {kind!r} is not one the draft can train as vLLM serves it (supported: "
            f"{', '.join(SERVED_ROPE_TYPES)}); its draft would load and accept little")


def draft_shape(config: dict, draft_vocab: int, heads=None, kv_heads=None, intermediate=None) -> DraftShape:
    """The draft's shape: the flags where given, else draft_defaults. Heads keep the target's head_dim
    whatever their count: serving's attention kernels take the head sizes of the models they serve, and
    hidden_size // heads need not be one (the tiny target's 128 // 8 = 16, which vLLM's CPU attention
    refuses: "Unsupported CPU attention configuration: head_dim=16")."""
    d = draft_defaults(config)
    heads = heads or d["heads"]
    return DraftShape(hidden=config["hidden_size"], intermediate=intermediate or d["intermediate"], heads=heads,
                      kv_heads=kv_heads or min(d["kv_heads"], heads), head_dim=d["head_dim"],
                      draft_vocab=min(draft_vocab, config["vocab_size"]), vocab=config["vocab_size"])


def draft_defaults(config: dict) -> dict:
    """One layer shaped like the target's, with at most 8 kv heads: for Kimi-K2 (64 heads of 112, MLP
    18432) ~0.96B trainable parameters at Vd 32000, within the public Kimi drafts' ~1B; a target with
    fewer kv heads (the tiny one: 2) keeps its own shape exactly."""
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    # An MLA target's head_dim, where its config class writes one (transformers' DeepseekV3Config: 64), is
    # the rope part of a query head, not a head's width: the plan (config.json) and the run (the config
    # object) would size the draft apart.
    mla = config.get("kv_lora_rank") is not None
    return {"heads": heads, "kv_heads": min(kv, 8), "intermediate": config["intermediate_size"],
            "head_dim": (None if mla else config.get("head_dim")) or config["hidden_size"] // heads}


def step_activation_bytes(s: DraftShape, tokens: int, ttt: int, act: int = 2, states: int = None,
                          frozen: int = None, chunk_rows: int = None, vocab_chunk: int = VOCAB_CHUNK,
                          recompute: bool = True) -> int:
    """Peak activation bytes of one step at `tokens` tokens. act: bytes of an autocast activation
    (2 under bf16, 4 on the CPU's fp32); states/frozen: bytes of the target's states and logits
    (default: act). Norm statistics and the attention merge are fp32 either way. recompute: each TTT
    step is checkpointed (one step's saved tensors live at a time), else every step's are kept."""
    states = states or act
    frozen = frozen or act
    H, I, Vd = s.hidden, s.intermediate, s.draft_vocab
    Q, K = s.heads * s.head_dim, s.kv_heads * s.head_dim
    # kept for the whole step, per token
    inputs = 3 * 8 + (s.aux + 1) * H * states + Vd * frozen + 8  # ids/masks, aux + last states, target logits, argmax
    per_ttt_step = (H + 2 * K) * act + 2 * 8 + 1  # output state, k, v; the loss's row indexes
    kept = inputs + H * act + ttt * per_ttt_step  # + fc's output
    cache_grads = ttt * 2 * K * act  # gradients of the earlier steps' keys and values, held during backward
    # one step's saved tensors (recomputed under its checkpoint), per token
    fp32 = 3 * H + 2 * H + H + 3 * Q  # normed embed/hidden/residual, cat, post-norm output; merge inputs
    half = H + 3 * Q + 2 * K + 2 * Q + Q + H + 4 * I  # embeds, q/rot/rope, k/rot, SDPA outs, o_proj input, MLP
    step = (fp32 * 4 + half * act) * BACKWARD_FACTOR
    if not recompute:  # every step's saved tensors, which hold its output state, keys and values counted above
        step = ttt * step - ttt * (H + 2 * K) * act
    rows = chunk_rows or max(1, CE_CHUNK_BYTES // (4 * Vd))
    loss_chunk = 5 * min(rows, tokens) * Vd * 4  # logits, log-softmax, softmax, product, gradient: fixed size
    if not recompute:  # nor is the loss: every step's rows keep their log-softmax, target softmax and head input
        loss_chunk += ttt * tokens * (2 * Vd + 3 * H) * 4
    step_phase = (kept + cache_grads + step) * tokens + loss_chunk
    # before the forward: the target's logits a vocabulary chunk at a time, next to the inputs
    target_phase = (inputs + min(vocab_chunk, s.vocab) * 4) * tokens
    return int(max(step_phase, target_phase))


def optimizer_state_bytes(shape: DraftShape, optimizer: str = "adamw") -> int:
    """fp32 state of the optimizer: AdamW's two moments per parameter; Muon's one momentum per hidden matrix
    parameter (fc, attention, MLP), AdamW's two for the rest (norms, lm_head)."""
    P = shape.trainable_params()
    if optimizer != "muon":
        return 2 * 4 * P
    rest = shape.draft_vocab * shape.hidden + 4 * shape.hidden  # lm_head, the norms
    return 4 * (P - rest) + 2 * 4 * rest


def loader_bytes(shape: DraftShape, tokens: int, stored: int = 2) -> int:
    """Host RAM the --states loader holds per rank: LOADER_BATCHES (states_from_shards.py) batches of the
    stored states (aux + last layer, bf16) at `tokens` padded tokens."""
    return LOADER_BATCHES * tokens * (shape.aux + 1) * shape.hidden * stored


def dtype_refusal(shape: DraftShape, fp32_on_gpu: bool) -> str | None:
    """fp32 attention with fewer kv heads than heads gets neither of SDPA's lean CUDA kernels (flash takes
    bf16/fp16, memory-efficient has no GQA): the math kernel keeps [B, heads, T, T] fp32 scores per call."""
    if fp32_on_gpu and shape.kv_heads < shape.heads:
        return (f"--dtype fp32 on CUDA with {shape.heads} heads over {shape.kv_heads} kv heads falls to SDPA's math "
                "kernel ([batch, heads, T, T] fp32 scores per call, not planned): use --dtype bf16 (or auto), or "
                "--draft-kv-heads equal to --draft-heads")
    return None


def plan(config: dict, *, shape: DraftShape, gpus: int, gpu_gb: float, ttt: int, batch_tokens, max_len: int,
         online: bool, target_bytes: int = 0, gpu_name: str = "default", cpu: bool = False,
         optimizer: str = "adamw", fp32: bool = False, ranks_per_node: int | None = None,
         shard_optimizer: bool = False) -> dict:
    """The plan as a dict (the JSON line); batch_tokens: an int, or "auto" for the largest that fits.
    gpu_gb: memory per GPU the run may use (train.py: what is free at start). shard_optimizer: ZeRO-1
    over `gpus` ranks. fp32: fp32 activations on a GPU."""
    act = 4 if cpu or fp32 else 2
    P = shape.trainable_params()
    weights = P * 4 + P * 2 * (not cpu and not fp32)  # fp32 master + autocast's bf16 copies
    moments = optimizer_state_bytes(shape, optimizer) / (gpus if shard_optimizer else 1)
    optimizer_bytes = moments + P * 4  # the optimizer's state, grads (DDP's buckets: train.py makes them the grads)
    frozen = shape.vocab * shape.hidden * act  # embedding
    if online:
        frozen_what = "whole target (online)"
        frozen += target_bytes
    else:
        frozen_what = "embedding + final norm + lm_head (--states)"
        frozen += shape.vocab * shape.hidden * act + shape.draft_vocab * shape.hidden * act
    budget = gpu_gb * 1e9 - RESERVE_GB * 1e9
    fixed = weights + optimizer_bytes + frozen
    factor = 1.0 if cpu else CUDA_ACTIVATION_FACTOR
    recompute = not cpu  # train.py recomputes TTT steps in backward on a GPU only (see there)

    def activations(tokens):
        return factor * step_activation_bytes(shape, tokens, ttt, act, recompute=recompute)

    per_token = (activations(2 * max_len) - activations(max_len)) / max_len

    def fits(tokens):
        return fixed + ACTIVATION_MARGIN * activations(tokens) <= budget

    largest = 0
    if fits(max_len):
        lo, hi = max_len, max_len
        while fits(hi * 2) and hi < 2**24:
            lo, hi = hi * 2, hi * 2
        hi *= 2
        while hi - lo > 256:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        largest = max(max_len, lo // 256 * 256)  # rounded to 256 tokens, never below the one sample that fits
    chosen = (min(largest, CPU_AUTO_BATCH) if cpu else largest) if batch_tokens == "auto" else int(batch_tokens)
    tokens = max(chosen, max_len)  # a sample longer than the batch is a batch of its own
    wrong_dtype = None if cpu else dtype_refusal(shape, fp32)
    ok = chosen > 0 and fits(tokens) and not wrong_dtype
    per_node = ranks_per_node or min(gpus, 8)
    peak = fixed + activations(tokens)
    tflops = ASSUMED_TFLOPS.get(gpu_name, ASSUMED_TFLOPS["default"])
    flops = step_flops_per_token(shape, ttt, max_len)
    return {
        "fits": ok, "gpus": gpus, "gpu_gb": gpu_gb, "draft": asdict(shape), "trainable_params": P,
        "ttt_steps": ttt, "max_len": max_len, "recompute": recompute,
        "weights_gb": round(weights / 1e9, 2), "optimizer_gb": round(optimizer_bytes / 1e9, 2),
        "optimizer": optimizer, "shard_optimizer": shard_optimizer,
        "frozen_gb": round(frozen / 1e9, 2), "frozen": frozen_what,
        "activation_bytes_per_token": round(per_token), "reserve_gb": RESERVE_GB,
        "activation_margin": ACTIVATION_MARGIN,
        "batch_tokens": chosen, "largest_batch_tokens": largest,
        "peak_gb": round(peak / 1e9, 2),
        "assumed_tflops_per_gpu": tflops, "flops_per_token": round(flops),
        "tokens_per_s": round(gpus * tflops * 1e12 / flops),
        "loader_host_gb_per_rank": round(loader_bytes(shape, tokens) / 1e9, 2) if not online else 0.0,
        "loader_host_gb_per_node": round(per_node * loader_bytes(shape, tokens) / 1e9, 2) if not online else 0.0,
        "ranks_per_node": per_node,
        "reason": None if ok else wrong_dtype or refusal(largest, chosen, max_len, fixed, budget, target_bytes,
                                                          online),
    }


def step_flops_per_token(s: DraftShape, ttt: int, seq: int) -> float:
    """Forward x (1 + 2 backward + 1 recompute) of every TTT step, attention over half the sequence on average."""
    H, Q, K = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    matmuls = 2 * (2 * H * (Q + 2 * K) + Q * H + 3 * H * s.intermediate + H * s.draft_vocab)
    attention = 2 * 2 * Q * seq / 2 * 2  # o0 and the lse surrogate: two causal attentions
    return 4 * ttt * (matmuls + attention) + 2 * 2 * s.aux * H * H + 2 * H * s.vocab


def refusal(largest, chosen, max_len, fixed, budget, target_bytes, online) -> str:
    if online and fixed > budget:
        return (f"does not fit: the target ({target_bytes / 1e9:.1f} GB) next to the draft needs {fixed / 1e9:.1f} GB "
                f"of the {budget / 1e9:.1f} GB usable per GPU: let vLLM compute its states (inv serve --extract, "
                "inv extract) and train from them with --states")
    if fixed > budget:
        return (f"does not fit: weights, optimizer and frozen tensors alone need {fixed / 1e9:.1f} GB of the "
                f"{budget / 1e9:.1f} GB usable per GPU: use bigger GPUs, or a smaller draft (--draft-intermediate, "
                "--draft-heads, --draft-kv-heads, --draft-vocab)")
    if largest < max_len:
        return (f"does not fit: one {max_len}-token sample needs more than the {(budget - fixed) / 1e9:.1f} GB "
                "left for activations: lower --max-len or --ttt-steps")
    return f"--batch-tokens {chosen} does not fit: at most {largest} (or --batch-tokens auto)"


def table(p: dict) -> str:
    d = p["draft"]
    rows = [
        ("draft", f"H {d['hidden']}, {d['heads']} heads x {d['head_dim']} ({d['kv_heads']} kv), MLP "
                  f"{d['intermediate']}, Vd {d['draft_vocab']}: {p['trainable_params'] / 1e9:.2f}B trainable"),
        ("weights (fp32 + bf16 copy)", f"{p['weights_gb']:.1f} GB"),
        ("grads + " + ("Muon/AdamW" if p["optimizer"] == "muon" else "AdamW")
         + (" (sharded over ranks)" if p["shard_optimizer"] else ""), f"{p['optimizer_gb']:.1f} GB"),
        ("frozen: " + p["frozen"], f"{p['frozen_gb']:.1f} GB"),
        ("activations per token", f"{p['activation_bytes_per_token'] / 1e6:.3f} MB (TTT {p['ttt_steps']} steps)"),
        ("batch tokens per GPU", f"{p['batch_tokens']} (largest that fits: {p['largest_batch_tokens']})"),
        ("peak per GPU", f"{p['peak_gb']:.1f} of {p['gpu_gb']:g} GB ({p['reserve_gb']:g} GB reserved, batch chosen "
                         f"with {round(100 * (p['activation_margin'] - 1))} % headroom on activations)"),
        ("--states loader host RAM", f"{p['loader_host_gb_per_rank']:.1f} GB per rank, "
                                     f"{p['loader_host_gb_per_node']:.1f} GB per node of {p['ranks_per_node']}"),
        ("tokens/s", f"{p['tokens_per_s']} on {p['gpus']} GPUs at an assumed "
                     f"{p['assumed_tflops_per_gpu']:g} TFLOP/s each"),
        ("fits", "yes" if p["fits"] else f"NO: {p['reason']}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def target_weight_bytes(path: str, config: dict, act: int = 2) -> int:
    """What the online path's target takes on each GPU: its parameters at the run's dtype, counted from
    config.json (dense layers, MoE experts, embeddings), or its weight files' size if larger. Reads no weights."""
    H, L, V = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    I = config.get("intermediate_size", 4 * H)
    experts = config.get("n_routed_experts") or config.get("num_experts") or config.get("num_local_experts") or 0
    dense_layers = min(L, config.get("first_k_dense_replace", 0 if experts else L))
    moe = (L - dense_layers) * (experts + (config.get("n_shared_experts") or 0)) * 3 * H * (
        config.get("moe_intermediate_size") or I)
    params = L * 4 * H * H + dense_layers * 3 * H * I + moe + 2 * V * H
    files = 0
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = int(json.load(f).get("metadata", {}).get("total_size") or 0)
    elif os.path.isdir(path):
        files = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return max(params * act, files)


def gpu_name(total_gb: float) -> str:
    return "H200" if total_gb > 100 else "H100" if total_gb > 60 else "default"
