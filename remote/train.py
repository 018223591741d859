#!/usr/bin/env python3
"""Train an EAGLE-3 draft for a target model and export it in the format vLLM loads.

    python remote/train.py --target PATH --data FILE_OR_DIR [--data ...] --out DIR [options]
    torchrun --nproc-per-node 2 remote/train.py ...   (DDP; each rank trains on its slice of the batches)
    python remote/train.py ... --states DIR [--stream]  (states vLLM computed: remote/extract.py)

Reads top to bottom: data (conversations rendered with the target's own chat
template, draft vocabulary), target states (the frozen target run online on
each batch, its states kept per sample after the first epoch on a CPU; or
with --states the shards vLLM wrote plus the target's head alone:
states_from_shards.py), draft, optimizer, the loop (training-time-test loss,
metrics, checkpoints), export. `main`, at the bottom, is that story as named
stages over a small explicit state: the flags (`Config`, frozen, every rule
between flags checked once), where this rank runs (`Place`), the samples
(`Data`), the networks (`Nets`), what the loop reads (`Run`) and what it
carries from step to step (`Tally`).

Writes only under --out: metrics.jsonl (one line per step), checkpoint.pt
(draft, optimizer, scheduler, RNG, step: `--resume` continues with the same
data order), draft/ (config.json, model.safetensors, README.md). Prints a
`specops-progress {json}` line every few seconds and at the end.
"""
import argparse
import dataclasses
import datetime
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import acceptance
import layout
import held_out as held_out_data
from chat_render import ChatRenderer, data_files, load_samples
from draft_model import DraftConfig, Eagle3Draft, export
from muon import MuonAdamW, muon_groups
from batching import cut_batches, held_out_rows, rank_batches, steps_in_epochs
from states_from_shards import ShardTargetStates, StatesError
import train_plan
from target_states import CachedTargetStates, OnlineTargetStates, TargetStates
from ttt_objective import SoftCrossEntropy, scored_slots, target_distribution
import report
from script import PROGRESS_EVERY_S, Refused, main_of, progress



def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


EXPANDABLE_SET_BY_MAIN = "expandable_segments:True"


def process_group_backend(use_cuda: bool) -> str:
    """NCCL takes CUDA tensors only: the group also gets gloo for whatever a collective sends from the CPU."""
    return "cpu:gloo,cuda:nccl" if use_cuda else "gloo"


def leave_process_group() -> None:
    """Destroy the process group once every rank is done with it, without deadlocking in gloo.

    Gloo's worker threads drop a finished collective's tensors after the caller's wait() has returned,
    and dropping a tensor that Python has seen takes the GIL. Destroying the group joins those threads
    while holding the GIL: a rank that reaches it straight from its last collective (every rank but 0,
    which writes the draft first) could hang there for ever (seen in CI, and in 1 launch of 16 on a loaded
    2-core host). The barrier lines the ranks up; the sleep releases the GIL so the workers finish first."""
    dist.barrier()
    time.sleep(0.2)
    dist.destroy_process_group()


# ---------------------------------------------------------------- flags and the run's config


def flag_parser() -> argparse.ArgumentParser:
    """Every flag with its default and help, in `--help`'s order; the rules between flags are Config.of's."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="target model (HF directory or name)")
    ap.add_argument("--data", action="append", help=f"{layout.ROWS}, messages jsonl, or a directory (required)")
    ap.add_argument("--out", help="run directory (required)")
    ap.add_argument("--plan", action="store_true", help="print the memory and speed plan from TARGET/config.json "
                                                        "(no weights read) and exit: 0 if it fits, 2 if not")
    ap.add_argument("--gpu-gb", type=float, help="memory per GPU for the plan (default: this machine's GPU)")
    ap.add_argument("--gpus", type=int, help="GPUs for --plan (default: torchrun's world size, else this machine's)")
    add_draft_flags(ap)
    add_schedule_flags(ap)
    add_eval_flags(ap)
    add_machine_flags(ap)
    return ap


def add_draft_flags(ap: argparse.ArgumentParser) -> None:
    """The draft's shape and what it learns."""
    ap.add_argument("--draft-heads", type=int,
                    help="draft attention heads, each as wide as the target's (default: the target's count)")
    ap.add_argument("--draft-kv-heads", type=int, help="draft kv heads (default: the target's, at most 8)")
    ap.add_argument("--draft-intermediate", type=int, help="draft MLP width (default: the target's intermediate_size)")
    ap.add_argument("--draft-vocab", type=int, default=32000, help="draft vocabulary size (capped at the target's)")
    ap.add_argument("--ttt-steps", type=int, default=7, help="training-time-test unroll length")
    ap.add_argument("--ttt-decay", type=float, default=0.8, help="loss weight decay per TTT step")
    ap.add_argument("--label-temperature", type=float, default=1.0,
                    help="softmax temperature of the target's logits the draft learns; below 1 sharpens them "
                         "toward the target's argmax, which is what greedy serving accepts")
    ap.add_argument("--max-len", type=int, default=4096, help="tokens per sample (longer ones are cut)")


def add_schedule_flags(ap: argparse.ArgumentParser) -> None:
    """How long, how fast, and with which optimizer."""
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=float, help="passes over the data (default 1)")
    length.add_argument("--steps", type=int, help="optimizer steps")
    ap.add_argument("--time-budget", type=float, metavar="SECONDS",
                    help="stop after this many seconds of training steps (evaluations and saves not counted), or "
                         "at --steps/--epochs if sooner; the learning-rate schedule runs on whichever runs out first, "
                         "so a slower machine trains fewer steps to the same end of its schedule")
    ap.add_argument("--lr", type=float, default=1e-4, help="AdamW's learning rate (with --optimizer muon: the "
                                                            "norms' and the head's)")
    ap.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                    help="muon: Muon for the draft's hidden matrices at --muon-lr, AdamW for the rest (remote/muon.py)")
    ap.add_argument("--muon-lr", type=float, default=0.02, help="Muon's learning rate (with --optimizer muon)")
    ap.add_argument("--no-shard-optimizer", action="store_true",
                    help="keep the whole optimizer state on every rank (default with several ranks: ZeRO-1, each "
                         "rank keeps its share of the moments and steps its share of the weights)")
    ap.add_argument("--head-init", choices=["target", "random"], default="target",
                    help="the draft's final norm and lm_head start as the target's (default) or at random")
    ap.add_argument("--warmup", type=float, default=0.03, help="fraction of steps with a linear warmup")
    ap.add_argument("--batch-tokens", default="auto",
                    help="padded tokens per batch per rank; auto (default): the largest the plan fits")
    ap.add_argument("--grad-clip", type=float, default=0.5)
    ap.add_argument("--aux-layers", help="a,b,c in vLLM's convention (id k = input of layer k; L = last output)")
    ap.add_argument("--save-every", type=int, default=1000, help="checkpoint every N steps (and at the end)")


def add_eval_flags(ap: argparse.ArgumentParser) -> None:
    """The held-out rows and the measurements made on them while training."""
    ap.add_argument("--val-fraction", type=float,
                    help="share of the data rows held out, never trained on: the predicted acceptance length "
                         "(val_sim_al) is measured on them (default 0.05, none with --stream; 0: none)")
    ap.add_argument("--eval-every", type=int, help="score the held-out rows every N steps (always at the end), "
                                                   f"keeping the best checkpoint as {layout.DRAFT}/")
    ap.add_argument("--eval-vllm", action="store_true",
                    help="at each eval also measure acceptance in a vLLM started next to training (remote/eval.py, "
                         f"greedy, on the held-out rows' prompts); the best measured checkpoint becomes {layout.DRAFT}/")
    ap.add_argument("--eval-arg", action="append", default=[],
                    help="extra argument for remote/eval.py, e.g. --max-model-len=512 or "
                         "--vllm-arg=--gpu-memory-utilization=0.2; repeat")
    ap.add_argument("--eval-timeout", type=float, default=1200, metavar="SECONDS",
                    help="a vLLM measurement that takes longer is stopped and recorded as failed; training goes on "
                         "and that checkpoint stays unmeasured (default 1200)")
    ap.add_argument("--eval-n", type=int, default=30, help="held-out prompts per vLLM measurement")
    ap.add_argument("--eval-k", type=int, default=3, help="num_speculative_tokens of that measurement")
    ap.add_argument("--eval-max-tokens", type=int, default=256,
                    help="max_tokens of the held-out requests, measured and predicted alike")


def add_machine_flags(ap: argparse.ArgumentParser) -> None:
    """Resuming, seeds, outputs, the device and the source of the target's states."""
    ap.add_argument("--resume", action="store_true", help=f"continue from OUT/{layout.CHECKPOINT}")
    ap.add_argument("--seed", type=int, default=0, help="the draft's initialization and the data order")
    ap.add_argument("--split-seed", type=int, default=0,
                    help="which rows --val-fraction holds out; apart from --seed so that runs differing in "
                         "seed are measured on the same rows")
    ap.add_argument("--no-tensorboard", action="store_true", help="write no TensorBoard event files into OUT")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="run the checkpoint's own config/tokenizer code (Kimi-K2), as vLLM's flag of that name")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--backend", choices=["auto", "gloo"], default="auto",
                    help="torchrun's process group: auto is NCCL for CUDA tensors (gloo beside it for CPU ones); gloo "
                         "with --device cuda lets two ranks share one GPU, which NCCL refuses (bench/gpu_check.sh)")
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="auto: bf16 on cuda, else fp32 with the draft MLP's matmuls in bf16 where the CPU "
                         "multiplies bf16 natively (AVX512-BF16, AMX)")
    ap.add_argument("--include-truncated", action="store_true", help="train on rows that hit max_tokens too")
    ap.add_argument("--states", help="target states from vLLM's shards in this directory (remote/extract.py --out) "
                                     "instead of running the target; --target then only supplies its head")
    ap.add_argument("--loader-workers", type=int, help="with --states: 0 reads each batch in the step's own thread; "
                                                        "more: one thread reads the next batch while the step runs, "
                                                        "into 2 reused buffers (default: 1, 0 with one CPU per rank)")
    ap.add_argument("--stream", action="store_true", help="with --states: train on shards as extraction writes "
                                                          "them, deleting each after its last use")


class ConfigError(ValueError):
    """Flags that contradict each other: argparse's one line and exit 2."""


POSITIVE = ("draft_vocab", "ttt_steps", "max_len", "batch_tokens", "save_every", "eval_every", "eval_n", "eval_k",
            "eval_max_tokens", "draft_heads", "draft_kv_heads", "draft_intermediate", "gpus")


@dataclass(frozen=True)
class Config:
    """The run as its flags ask for it, every rule between them checked (Config.of) and nothing changed after:
    the one value a later stage settles (the plan's --batch-tokens) makes a new Config (dataclasses.replace)."""
    target: str
    data: list[str] | None
    out: str | None
    plan: bool
    gpu_gb: float | None
    gpus: int | None
    draft_heads: int | None
    draft_kv_heads: int | None
    draft_intermediate: int | None
    draft_vocab: int
    ttt_steps: int
    ttt_decay: float
    label_temperature: float
    max_len: int
    epochs: float | None
    steps: int | None
    time_budget: float | None
    lr: float
    optimizer: str
    muon_lr: float
    no_shard_optimizer: bool
    head_init: str
    warmup: float
    batch_tokens: int | str  # "auto" until the plan settles it
    grad_clip: float
    aux_layers: list[int] | None
    save_every: int
    val_fraction: float
    eval_every: int | None
    eval_vllm: bool
    eval_arg: list[str]
    eval_timeout: float
    eval_n: int
    eval_k: int
    eval_max_tokens: int
    resume: bool
    seed: int
    split_seed: int
    no_tensorboard: bool
    trust_remote_code: bool
    device: str
    backend: str
    dtype: str
    include_truncated: bool
    states: str | None
    loader_workers: int | None
    stream: bool

    @classmethod
    def of(cls, flags: argparse.Namespace) -> "Config":
        """The config of parsed flags: numbers parsed, --val-fraction's default set; raises ConfigError with
        the first rule they break (in this order, which decides which line a user sees)."""
        a = argparse.Namespace(**vars(flags))
        if not a.plan and (not a.data or not a.out):
            raise ConfigError("--data and --out are required (or --plan)")
        if a.batch_tokens != "auto":
            try:
                a.batch_tokens = int(a.batch_tokens)
            except ValueError:
                raise ConfigError("--batch-tokens takes a number or auto") from None
        for name in POSITIVE:
            value = getattr(a, name)
            if value is not None and value != "auto" and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        if not a.label_temperature > 0:
            raise ConfigError("--label-temperature must be positive")
        if a.draft_heads and a.draft_kv_heads and a.draft_heads % a.draft_kv_heads:
            raise ConfigError("--draft-heads must be a multiple of --draft-kv-heads")
        if (a.steps is not None and a.steps < 1) or (a.epochs is not None and a.epochs <= 0):
            raise ConfigError("--steps/--epochs must be positive")
        if not a.eval_timeout > 0:
            raise ConfigError("--eval-timeout must be positive seconds")
        if a.time_budget is not None and a.time_budget <= 0:
            raise ConfigError("--time-budget must be positive seconds")
        if a.time_budget and a.stream:
            raise ConfigError("--stream deletes each shard after its last step: give it whole --epochs, not "
                              "--time-budget")
        if not 0 <= a.warmup < 1:
            raise ConfigError("--warmup is a fraction in [0, 1)")
        if a.stream and a.val_fraction:
            raise ConfigError("--stream holds nothing out (each shard is deleted after its last use): drop "
                              "--val-fraction")
        if a.val_fraction is None:
            a.val_fraction = 0.0 if a.stream else 0.05
        if not 0 <= a.val_fraction < 1:
            raise ConfigError("--val-fraction is a fraction in [0, 1)")
        if (a.eval_vllm or a.eval_every) and not a.val_fraction:
            raise ConfigError("--eval-every and --eval-vllm score the held-out rows: give --val-fraction > 0 (none "
                              "with --stream)")
        if a.stream and (not a.states or a.steps or (a.epochs or 1) != int(a.epochs or 1)):
            raise ConfigError("--stream goes with --states and whole --epochs (not --steps): each shard is read "
                              "epochs times")
        if a.aux_layers:
            try:
                a.aux_layers = [int(x) for x in a.aux_layers.split(",")]
            except ValueError:
                raise ConfigError("--aux-layers takes three integers, e.g. 2,16,29") from None
        return cls(**vars(a))

    def run_file(self, name: str) -> str:
        """A file or folder of the run directory, by its remote/layout.py name."""
        return os.path.join(self.out, name)


def parse_args(argv=None) -> Config:
    ap = flag_parser()
    try:
        return Config.of(ap.parse_args(argv))
    except ConfigError as e:
        ap.error(str(e))



# ---------------------------------------------------------------- data


def draft_vocab(samples, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` target ids seen most often on loss-masked tokens (ties: lower id), ascending."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        ids = s.ids[s.mask].long()
        counts.index_add_(0, ids, torch.ones_like(ids))
    order = sorted(range(vocab_size), key=lambda i: (-counts[i].item(), i))
    return torch.tensor(sorted(order[:size]), dtype=torch.long)


def state_cache_budget() -> int:
    """Bytes of target states a CPU run keeps: a quarter of the memory free when training starts."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError):
        return 0


def collate(samples, index: list[int], pad_id: int, device):
    """Right-padded input_ids, attention_mask and loss_mask, each [B, T]."""
    width = max(len(samples[i].ids) for i in index)
    ids = torch.full((len(index), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(index), width), dtype=torch.long)
    loss = torch.zeros((len(index), width), dtype=torch.long)
    for row, i in enumerate(index):
        n = len(samples[i].ids)
        ids[row, :n] = samples[i].ids
        attention[row, :n] = 1
        loss[row, :n] = samples[i].mask
    return ids.to(device), attention.to(device), loss.to(device)


# ---------------------------------------------------------------- objective


def step_autocast(device, bf16: bool):
    """The step's bf16 autocast, without its weight cache: a cached bf16 copy of a weight sums every TTT
    step's and loss chunk's gradient contribution in bf16 before its one fp32 accumulate; uncached, each
    use's contribution reaches the fp32 gradient on its own (tests/torch/test_bf16_gradients.py)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16, cache_enabled=False)


def simulated_acceptance(acc: list[float]) -> float:
    """1 (vLLM's bonus token) + expected accepted drafts in a chain: sum_j prod_{i<=j} acc_i."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total


# ---------------------------------------------------------------- run state


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions; without them oneDNN emulates bf16, slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def fingerprint(cfg, world: int, aux_ids, total_steps: int) -> dict:
    """What must not change between a run and its resume (else the data order or the model differ)."""
    files = [(os.path.abspath(p), os.path.getsize(p)) for p in data_files(cfg.data)]
    return {
        "target": cfg.target, "data": files, "seed": cfg.seed, "batch_tokens": cfg.batch_tokens,
        "max_len": cfg.max_len, "world_size": world, "ttt_steps": cfg.ttt_steps, "ttt_decay": cfg.ttt_decay,
        "label_temperature": cfg.label_temperature,
        "draft_vocab": cfg.draft_vocab, "aux_layer_ids": list(aux_ids), "total_steps": total_steps,
        "lr": cfg.lr, "warmup": cfg.warmup, "grad_clip": cfg.grad_clip, "dtype": cfg.dtype,
        "include_truncated": cfg.include_truncated, "val_fraction": cfg.val_fraction,
        "split_seed": cfg.split_seed, "time_budget": cfg.time_budget, "head_init": cfg.head_init,
        **({"optimizer": cfg.optimizer, "muon_lr": cfg.muon_lr} if cfg.optimizer != "adamw" else {}),
    }  # AdamW runs leave the optimizer out, so checkpoints from before --optimizer still resume


def rng_state(device) -> dict:
    """The generators this rank draws from: the CPU's, Python's, and its own GPU's alone (a resume may see
    fewer GPUs than the run that saved, e.g. with CUDA_VISIBLE_DEVICES narrowed to one)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda_device"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"], device)


def save_checkpoint(path, step, draft, opt_state, sched, vocab_ids, fp, metrics, best):
    tmp = path + ".tmp"
    torch.save({
        "step": step, "draft": draft.trainable_state_dict(), "optimizer": opt_state,
        "scheduler": sched.state_dict(), "rng": rng_state(vocab_ids.device), "vocab_ids": vocab_ids.cpu(),
        "fingerprint": fp, "metrics": metrics, "best": best,
    }, tmp)
    os.replace(tmp, path)


def read_checkpoint(path: str, fp: dict) -> tuple[dict | None, str | None]:
    """(checkpoint, None), (None, None) when there is none, or (None, why it cannot be resumed)."""
    if not os.path.exists(path):
        return None, None
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a torn or foreign file: every rank refuses with this line
        return None, (f"cannot read {path} ({str(e).splitlines()[0] if str(e) else type(e).__name__}): restore it, "
                      "or start afresh in another --out")
    changed = [k for k in fp if ckpt["fingerprint"].get(k) != fp[k]]
    if changed:
        return None, f"cannot resume {path}: changed since the run started: {', '.join(changed)}"
    return ckpt, None


def truncate_metrics(path: str, step: int) -> None:
    """Drop metric lines past the checkpoint (written by the interrupted run after its last save)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.endswith("\n") and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(keep)


def data_parallel(draft) -> torch.nn.Module:
    """DDP whose gradients are views into its all-reduce buckets: one copy of the gradients, not two."""
    return torch.nn.parallel.DistributedDataParallel(draft, gradient_as_bucket_view=True)


def make_optimizer(cfg, draft, sharded: bool) -> torch.optim.Optimizer:
    """AdamW, or Muon + AdamW; sharded: ZeRO-1, each rank keeping the moments of (and stepping) its share of
    the parameters, then broadcasting them: the same update, 1/world of the state per rank."""
    if cfg.optimizer == "muon":
        groups, cls, defaults = muon_groups(draft.named_parameters(), cfg.muon_lr, cfg.lr), MuonAdamW, {}
    else:
        groups = [p for p in draft.parameters() if p.requires_grad]
        cls, defaults = torch.optim.AdamW, {"lr": cfg.lr, "weight_decay": 0.0}
    if not sharded:
        return cls(groups, **defaults)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **defaults)


def optimizer_state(opt, writer_ranks: list[int]) -> dict | None:
    """The whole optimizer state on each writer rank (a collective when sharded: every rank calls it), else None."""
    if not hasattr(opt, "consolidate_state_dict"):
        return opt.state_dict()
    state = None
    for r in writer_ranks:
        opt.consolidate_state_dict(to=r)
        if dist.get_rank() == r:
            state = opt.state_dict()
    return state


def optimizer_card(cfg) -> str:
    return f"lr {cfg.lr}" if cfg.optimizer == "adamw" else f"Muon lr {cfg.muon_lr}, AdamW lr {cfg.lr}"


def model_card(cfg, target, stats, vocab_size, draft_vocab_size, aux_ids, step, metrics) -> str:
    acc = ", ".join(f"{metrics[k]:.3f}" for k in sorted(metrics) if k.startswith("acc_"))
    spec = json.dumps({"method": "eagle3", "model": "<this directory>", "num_speculative_tokens": 3})
    budget = f", time budget {cfg.time_budget:g} s" if cfg.time_budget else ""
    return f"""# EAGLE-3 draft for `{cfg.target}`

Trained by specops `remote/train.py` (one Llama decoder layer over three target hidden states;
embeddings are the target's, left out of this checkpoint).

| | |
|---|---|
| target | `{cfg.target}` ({target.config.num_hidden_layers} layers, hidden {target.config.hidden_size}) |
| data | {", ".join(f"`{p}`" for p in data_files(cfg.data))} |
| rows / samples / tokens | {stats["rows"]} / {stats["samples"]} / {stats["tokens"]} ({stats["loss_tokens"]} trained on) |
| steps | {step} (batch {cfg.batch_tokens} tokens, {optimizer_card(cfg)}, seed {cfg.seed}{budget}) |
| draft vocabulary | {draft_vocab_size} of {vocab_size} |
| aux layer ids (vLLM: input of layer k) | {aux_ids} |
| TTT | {cfg.ttt_steps} steps, decay {cfg.ttt_decay} |
| final loss | {metrics.get("loss", float("nan")):.4f} |
| accuracy per TTT step | {acc} |
| simulated acceptance length (last batch) | {metrics.get("sim_al", float("nan")):.3f} |
| predicted acceptance length (held-out rows) | {metrics.get("val_sim_al", "-")} |
| acceptance length measured in vLLM (K={cfg.eval_k}, greedy, held-out prompts) | {metrics.get("measured_al", "-")} |

Use: `python -m vllm.entrypoints.openai.api_server --model {cfg.target} --speculative-config '{spec}'`
"""


# ---------------------------------------------------------------- evaluation


TORCHRUN_ENV = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"}


def replace_dir(new: str, dest: str) -> None:
    """dest := new, never leaving dest missing for longer than one rename."""
    old = dest + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(dest):
        os.rename(dest, old)
    os.rename(new, dest)
    shutil.rmtree(old, ignore_errors=True)


def run_with_timeout(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str, str]:
    """(exit status, stdout, stderr) of cmd; status None when it ran past timeout and was killed with
    everything it started (its own session: a vLLM it left behind would keep its GPU memory)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = proc.communicate()
        return None, stdout, stderr


EVAL_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "eval.py")


def measure_in_vllm(cfg, draft_dir: str, prompts: str, step: int) -> dict:
    """remote/eval.py on this draft (greedy, no baseline): {"measured_al", "measured_delivered",
    "measured_per_position"}, or {"measured_error"} when the measurement failed (training goes on; that
    step cannot become draft/)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the measuring vLLM asks for free memory next to this process
    out = os.path.join(cfg.out, layout.EVALS_DIR, f"step-{step}")
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, EVAL_SCRIPT,
           "--target", cfg.target, "--draft", os.path.abspath(draft_dir), "--prompts", prompts,
           "--n", str(cfg.eval_n), "--k", str(cfg.eval_k), "--temperature", "0", "--no-baseline",
           "--max-tokens", str(cfg.eval_max_tokens),
           "--json", os.path.join(out, layout.REPORT_JSON), *cfg.eval_arg]
    # Not torchrun's variables: vLLM would take this rank's RANK/WORLD_SIZE/MASTER_* for its own group.
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == EXPANDABLE_SET_BY_MAIN:
        env.pop("PYTORCH_CUDA_ALLOC_CONF")  # the trainer's allocator setting: vLLM's KV connectors refuse it
    returncode, stdout, stderr = run_with_timeout(cmd, env, cfg.eval_timeout)
    with open(os.path.join(out, "eval.log"), "w") as f:
        f.write(stdout + stderr)
    if returncode is None:
        return {"measured_error": f"eval.py did not finish within --eval-timeout {cfg.eval_timeout:g}s and was "
                                  f"stopped (log: {out}/eval.log)"}
    if returncode:
        lines = (stderr or stdout).strip().splitlines()
        return {"measured_error": f"eval.py exit {returncode}: {lines[-1] if lines else ''} "
                                  f"(log: {out}/eval.log)"}
    with open(os.path.join(out, layout.REPORT_JSON)) as f:
        rep = json.load(f)
    return {"measured_al": rep["acceptance_length"], "measured_delivered": rep["delivered_length"],
            "measured_per_position": rep["per_position"]}


# ---------------------------------------------------------------- plan


def make_plan(cfg, use_cuda: bool, device, world: int) -> dict | None:
    """The plan for this run (train_plan.py); None when the target's config.json is not a local file
    (a hub name: then --batch-tokens must be a number)."""
    try:
        config = train_plan.text_config(cfg.target)
    except (OSError, ValueError) as e:
        if cfg.plan or cfg.batch_tokens == "auto":
            raise Refused(f"cannot plan: {cfg.target}/config.json: {getattr(e, 'strerror', None) or e} "
                          "(--plan and --batch-tokens auto read the target's config.json; pass a number)") from None
        return None
    if why := train_plan.rope_refusal(config):  # before anything loads: the plan reads config.json alone
        raise Refused(why)
    try:
        shape = train_plan.draft_shape(config, cfg.draft_vocab, cfg.draft_heads, cfg.draft_kv_heads,
                                       cfg.draft_intermediate)
    except KeyError as e:
        raise Refused(f"cannot plan: {cfg.target}/config.json has no {e}") from None
    if cfg.gpu_gb:
        gpu_gb = cfg.gpu_gb
    elif use_cuda:  # what is free now: another process on this GPU (a vLLM, a stray rank) holds the rest
        gpu_gb = torch.cuda.mem_get_info(device)[0] / 1e9
    elif cfg.plan:
        raise Refused("--plan on a machine without a GPU needs --gpu-gb (141 for an H200, 80 for an H100)")
    else:
        gpu_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9  # the CPU trains in RAM
    gpus = cfg.gpus or (world if launched_by_torchrun() else (torch.cuda.device_count() if use_cuda else 1)) or 1
    online = not cfg.states
    cpu = not (use_cuda or cfg.plan)
    return train_plan.plan(config, shape=shape, gpus=gpus, gpu_gb=gpu_gb, ttt=cfg.ttt_steps,
                           batch_tokens=cfg.batch_tokens, max_len=cfg.max_len, online=online,
                           target_bytes=train_plan.target_weight_bytes(cfg.target, config, 2 if use_cuda or cfg.plan
                                                                       else 4) if online else 0,
                           gpu_name=train_plan.gpu_name(gpu_gb), cpu=cpu,
                           optimizer=cfg.optimizer,
                           fp32=not cpu and cfg.dtype == "fp32",
                           ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or min(gpus, 8),
                           shard_optimizer=shards_optimizer(cfg, gpus))


def loader_workers(cfg, world: int) -> int:
    """0: the step reads its batch itself; 1: a reader thread reads the next one (train.py --loader-workers)."""
    if cfg.loader_workers is not None:
        return max(0, cfg.loader_workers)
    return 1 if (os.cpu_count() or 1) // max(1, world) > 1 else 0


def shards_optimizer(cfg, gpus: int) -> bool:
    """ZeRO-1 (each rank keeps its 1/world of the optimizer's state) wherever there is more than one rank."""
    return gpus > 1 and not cfg.no_shard_optimizer


# ---------------------------------------------------------------- the group
# Whatever a rank computes from its own machine (free memory, a checkpoint file, a clock) is agreed over the
# group before it shapes the loop: ranks that disagree run different step counts and hang in a collective.


def in_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def everyones(value) -> list:
    """Every rank's `value`, in rank order ([value] outside a process group)."""
    if not in_group():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def resolve_batch_tokens(cfg, memory_plan: dict) -> int:
    """The plan's batch (auto: the largest that fits on every rank: the smallest rank's), kept in
    OUT/train_plan.json: a resumed auto run cuts the batches the interrupted one cut, whatever GPU it resumes on."""
    path = cfg.run_file(layout.TRAIN_PLAN)
    resumed = cfg.batch_tokens == "auto" and cfg.resume and os.path.exists(path)
    if resumed:
        with open(path) as f:
            memory_plan = json.load(f)
    # The group's plan is its tightest rank's: every node records that one.
    group_plan = min(everyones(memory_plan), key=lambda p: p["batch_tokens"])
    if int(os.environ.get("LOCAL_RANK", 0)) == 0 and not resumed:
        os.makedirs(cfg.out, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(group_plan, f, indent=1)
        os.replace(path + ".tmp", path)
    return group_plan["batch_tokens"]


def agree_steps(total_steps: int) -> None:
    """Refuse unless every rank counts the same steps (before step 1: after it, a mismatch is a hang)."""
    counts = everyones((socket.gethostname(), total_steps))
    if len({n for _, n in counts}) > 1:
        rank, (host, n) = next((r, c) for r, c in enumerate(counts) if c[1] != counts[0][1])
        raise Refused(f"ranks disagree on the run's length: rank 0 counts {counts[0][1]} steps, rank {rank} on "
                      f"{host} {n}: every node needs the same --data files and flags")


def agree_start(local_step: int, local_error: str | None, ckpt_path: str) -> int:
    """The step every rank resumes at: refuse (every rank, one line) when a rank could not read its
    checkpoint or starts elsewhere than rank 0, naming that rank's node."""
    seen = everyones((socket.gethostname(), local_step, local_error))
    for rank, (host, _, error) in enumerate(seen):
        if error:
            raise Refused(f"node {host} (rank {rank}): {error}" if len(seen) > 1 else error)
    first = seen[0][1]
    for rank, (host, step, _) in enumerate(seen):
        if step != first:
            have = f"its {ckpt_path} is at step {step}" if step else f"it has no {ckpt_path}"
            raise Refused(f"cannot resume: node {host} (rank {rank}) would start at step {step} where rank 0 "
                          f"resumes at {first} ({have}): give every node the same checkpoint, or start afresh")
    return first


def group_max(value: float, device) -> float:
    """The group's largest `value` (a rank's clock becomes the slowest rank's), on the model's device."""
    if not in_group():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# ---------------------------------------------------------------- the stages, in the order main runs them


@dataclass(frozen=True)
class Place:
    """Where this process trains: its rank in the group, its device, the dtype of the frozen target tensors."""
    world: int
    rank: int
    local_rank: int
    use_cuda: bool
    device: torch.device
    distributed: bool
    bf16: bool
    dtype: torch.dtype

    @property
    def writer(self) -> bool:
        """One writer per host: multi-node runs keep a full copy on every node."""
        return self.local_rank == 0


def take_place(cfg: Config) -> Place:
    """This rank's device (CUDA's allocator set before its first allocation) and, under torchrun, the group."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise Refused("--device cuda, but torch sees no CUDA device")
    # Rank i on GPU i; more ranks than GPUs (--backend gloo) share them round the table.
    device = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}" if use_cuda else "cpu")
    if use_cuda and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        # Before the first CUDA allocation. Here, not at import: a process that imports this module would
        # pass it to every vLLM it starts. At a batch near the plan's, the default allocator's fragmentation
        # (10.7 GiB reserved but free on an H200, Kimi width) turned a step that fits into an OOM.
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SET_BY_MAIN
    if use_cuda:
        torch.cuda.set_device(device)
    if use_cuda and cfg.eval_vllm and not any("gpu-memory-utilization" in a for a in cfg.eval_arg):
        raise Refused("--eval-vllm on a GPU starts a vLLM next to training: say how much GPU memory it may take, "
                      "e.g. --eval-arg=--vllm-arg=--gpu-memory-utilization=0.2")
    distributed = launched_by_torchrun()
    if distributed:  # even at world size 1: a one-GPU machine then runs the NCCL path the 8-GPU job runs
        # Ranks wait for rank 0's vLLM measurement in a collective: its timeout must outlast --eval-timeout.
        wait = max(1800.0, cfg.eval_timeout + 600) if cfg.eval_vllm else 1800.0
        backend = "gloo" if cfg.backend == "gloo" else process_group_backend(use_cuda)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=wait))
    bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and use_cuda)
    return Place(world=world, rank=rank, local_rank=local_rank, use_cuda=use_cuda, device=device,
                 distributed=distributed, bf16=bf16, dtype=torch.bfloat16 if bf16 else torch.float32)


def print_plan(memory_plan: dict) -> int:
    """--plan: the plan as one JSON line and as a table; exit 0 if it fits, 2 if not."""
    print(json.dumps(memory_plan, separators=(",", ":")))
    print(train_plan.table(memory_plan))
    return 0 if memory_plan["fits"] else 2


def settle_plan(cfg: Config, memory_plan: dict | None) -> Config:
    """Refuse a run that would overwrite another or cannot fit; the config with the group's batch."""
    if os.path.exists(cfg.run_file(layout.CHECKPOINT)) and not cfg.resume:
        raise Refused(f"{cfg.out} already holds a run ({layout.CHECKPOINT}): pass --resume or another --out")
    if memory_plan is None:
        return cfg
    if not memory_plan["fits"]:
        raise Refused(memory_plan["reason"] + " (remote/train.py --plan shows the whole plan)")
    cfg = dataclasses.replace(cfg, batch_tokens=resolve_batch_tokens(cfg, memory_plan))
    progress(stage="plan", **{k: memory_plan[k] for k in (
        "batch_tokens", "largest_batch_tokens", "peak_gb", "gpu_gb", "activation_bytes_per_token",
        "trainable_params", "tokens_per_s")})
    return cfg


def open_outputs(cfg: Config, place: Place):
    """OUT, and the TensorBoard writer of metrics.jsonl's scalars there (`tensorboard --logdir`), or None."""
    os.makedirs(cfg.out, exist_ok=True)
    if not place.writer or cfg.no_tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise Refused("the tensorboard package is missing: run `inv deps --fix` (or pass --no-tensorboard)") from None
    return SummaryWriter(cfg.out)


@dataclass
class Data:
    """The samples (the target's own token stream, loss on its outputs) and which of them train or score."""
    renderer: ChatRenderer
    samples: list  # training samples, then (load_held_out) the held-out ones
    stats: dict
    held_out: set  # row numbers never trained on
    held_out_records: list  # those rows as read
    untrained: set  # those rows and every row asking the same prompt
    train_index: list[int]
    val_index: list[int] = dataclasses.field(default_factory=list)

    @property
    def pad_id(self) -> int:
        tok = self.renderer.tok
        return tok.pad_token_id if tok.pad_token_id is not None else 0


def load_data(cfg: Config) -> Data:
    """The rows rendered with the target's chat template; held out: whole rows never trained on (nor any row
    asking the same prompt), where the acceptance length serving will see is predicted."""
    try:
        renderer = ChatRenderer.from_pretrained(cfg.target, cfg.trust_remote_code)
        samples, stats = load_samples(renderer, cfg.data, cfg.max_len, cfg.include_truncated)
    except (OSError, ValueError) as e:
        raise Refused(str(e)) from None
    if not samples:
        raise Refused(f"no trainable samples in {cfg.data} ({stats})")
    held_out = held_out_rows(stats["rows"], cfg.val_fraction, cfg.split_seed)
    held_out_records, untrained = held_out_data.records(cfg.data, held_out) if held_out else ([], set())
    train_index = [i for i, s in enumerate(samples) if s.row not in untrained]
    if not train_index:
        raise Refused(f"no trainable sample in {cfg.data} outside the held-out rows ({stats}): "
                      "lower --val-fraction")
    progress(stage="data", **stats, held_out_rows=len(held_out), same_prompt_rows=len(untrained - held_out))
    return Data(renderer, samples, stats, held_out, held_out_records, untrained, train_index)


def load_target(cfg: Config, place: Place, data: Data):
    """(target, stream): the frozen target run online, or its states precomputed by vLLM (remote/extract.py)
    and its head alone; stream: with --stream, the order in which shards arrive, are trained on and deleted."""
    if cfg.stream and place.world > 1:
        raise Refused("--stream trains on one process: drop torchrun, or train from finished shards")
    stream = None
    try:
        target: TargetStates
        if cfg.states:
            target = ShardTargetStates(cfg.target, cfg.states, cfg.aux_layers, data.samples, place.device,
                                       place.dtype, stream=cfg.stream, trust_remote_code=cfg.trust_remote_code)
            if cfg.stream:
                stream = target.stream_schedule([len(s.ids) for s in data.samples], cfg.batch_tokens, cfg.seed,
                                                int(cfg.epochs or 1))
        else:
            target = OnlineTargetStates(cfg.target, cfg.aux_layers, place.device, place.dtype, cfg.trust_remote_code)
            if not place.use_cuda:  # a CPU run's epochs ask the same rows again: keep what the target said of them
                target = CachedTargetStates(target, state_cache_budget())
    except (OSError, ValueError) as e:
        raise Refused(str(e)) from None
    return target, stream


def load_held_out(cfg: Config, place: Place, data: Data, target) -> None:
    """data.val_index: with the target at hand, its greedy continuations of the held-out prompts (what eval.py's
    greedy requests will produce, held_out.py), added to the samples; with --states, the rows as recorded.
    The rows' prompts go to OUT/heldout.jsonl, eval.py's prompts."""
    if place.writer and data.held_out_records and not os.path.exists(cfg.run_file(layout.HELDOUT)):
        held_out_data.write_rows(data.held_out_records, cfg.run_file(layout.HELDOUT))
    if cfg.states:
        data.val_index = [i for i, s in enumerate(data.samples) if s.row in data.held_out]
    else:
        replay = held_out_data.greedy_samples(target.model, data.renderer, data.held_out_records, cfg.eval_n,
                                              cfg.eval_max_tokens, cfg.max_len, place.device, cfg.ttt_steps - 1)
        data.val_index = list(range(len(data.samples), len(data.samples) + len(replay)))
        data.samples += replay
    progress(stage="held-out", rows=len(data.held_out), samples=len(data.val_index),
             source="recorded rows" if cfg.states else "the target's greedy continuations")


def count_steps(cfg: Config, place: Place, data: Data, stream) -> int:
    """The run's length in optimizer steps, agreed by every rank."""
    train_lengths = [len(data.samples[i].ids) for i in data.train_index]
    if stream:
        total_steps = stream.total_steps
    elif cfg.steps:
        total_steps = cfg.steps
    else:
        total_steps = steps_in_epochs(train_lengths, cfg.batch_tokens, cfg.seed, place.world, cfg.epochs or 1)
    if total_steps < 1:
        raise Refused(f"{len(data.samples)} samples make fewer batches than ranks ({place.world}): "
                      "lower --batch-tokens")
    agree_steps(total_steps)
    return total_steps


def sharded(cfg: Config, place: Place) -> bool:
    return place.distributed and shards_optimizer(cfg, place.world)


def run_fingerprint(cfg: Config, place: Place, target, total_steps: int) -> dict:
    """fingerprint, and how the optimizer was kept and where the states came from."""
    fp = fingerprint(cfg, place.world, target.aux_layer_ids, total_steps)
    if sharded(cfg, place):  # a checkpoint keeps the gathered whole state either way; say how it was trained
        fp["shard_optimizer"] = True
    if cfg.states:
        fp.update(states=os.path.abspath(cfg.states), stream=cfg.stream)
    return fp


def open_checkpoint(cfg: Config, fp: dict) -> tuple[dict | None, int]:
    """(checkpoint or None, the step every rank starts at)."""
    ckpt_path = cfg.run_file(layout.CHECKPOINT)
    ckpt, why_not = read_checkpoint(ckpt_path, fp) if cfg.resume else (None, None)
    return ckpt, agree_start(ckpt["step"] if ckpt else 0, why_not, ckpt_path)


@dataclass(frozen=True)
class Nets:
    """The frozen target, the draft that learns, and the draft vocabulary: its target ids, a mask of them over
    the target's vocabulary, and the target's head restricted to them."""
    target: TargetStates
    draft: Eagle3Draft
    vocab_ids: torch.Tensor
    in_vocab: torch.Tensor
    head_vd: torch.Tensor


def build_draft(cfg: Config, place: Place, data: Data, target, ckpt: dict | None) -> Nets:
    """The draft, seeded by --seed, over the checkpoint's vocabulary or the training data's commonest ids; its
    final norm and head start as the target's unless --head-init random or it resumes."""
    V = target.config.vocab_size
    if ckpt is not None:
        vocab_ids = ckpt["vocab_ids"]
    else:
        vocab_ids = draft_vocab([data.samples[i] for i in data.train_index], V, min(cfg.draft_vocab, V))
    torch.manual_seed(cfg.seed)
    config = DraftConfig.from_target(target.config, len(vocab_ids), target.aux_layer_ids, heads=cfg.draft_heads,
                                     kv_heads=cfg.draft_kv_heads, intermediate=cfg.draft_intermediate)
    draft = Eagle3Draft(config, target.embeddings().to(place.device, place.dtype), vocab_ids).to(place.device)
    # A demo step 17% faster, measured alternating with fp32 step by step (docs/tiny-draft-recipe.md)
    draft.midlayer.mlp.bf16_matmuls = cfg.dtype == "auto" and not place.use_cuda and cpu_multiplies_bf16()
    vocab_ids = vocab_ids.to(place.device)
    in_vocab = torch.zeros(V, dtype=torch.bool, device=place.device)
    in_vocab[vocab_ids] = True
    head_vd = target.head_weight[vocab_ids]  # the target's head over the draft vocabulary, once
    if ckpt is None and cfg.head_init == "target":
        # The draft's last hidden state stands in for the target's at the next position: start its final
        # norm and head as the target's (the norm's effective scale is what it makes of an rms-1 input).
        with torch.no_grad():
            H = target.config.hidden_size
            ones = torch.ones(1, 1, H, device=place.device, dtype=head_vd.dtype)
            draft.norm.weight.copy_(target.normed(ones).flatten())
            draft.lm_head.weight.copy_(head_vd)
    return Nets(target, draft, vocab_ids, in_vocab, head_vd)


@dataclass
class Tally:
    """What the loop carries from step to step and a checkpoint keeps."""
    train_s: float = 0.0  # the steps' own seconds, evaluations and saves left out, which --time-budget runs on
    metrics: dict = dataclasses.field(default_factory=dict)  # the last step's row
    best: dict | None = None  # the evaluated step draft/ holds, and its score


def lr_factor(step: int, total_steps: int, warmup: float, time_budget: float | None, train_s: float) -> float:
    """Linear warmup, then cosine to zero; with --time-budget over the share of the run done: of its steps,
    or of its seconds if further on."""
    if time_budget:
        done = max(step / total_steps, train_s / time_budget)
        if done < warmup:
            return (done + 1 / total_steps) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (done - warmup) / (1 - warmup))))
    warmup_steps = math.ceil(warmup * total_steps)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / max(1, total_steps - warmup_steps)))


def make_schedule(cfg: Config, opt, total_steps: int, tally: Tally):
    # A lambda, not a partial: LambdaLR's state_dict then keeps no state of it, as checkpoints always had.
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: lr_factor(step, total_steps, cfg.warmup, cfg.time_budget, tally.train_s))


def resume(cfg: Config, place: Place, nets: Nets, opt, sched, ckpt: dict, start_step: int, total_steps: int,
           tally: Tally) -> None:
    """The checkpoint's draft, optimizer, schedule, RNG and tally; the metric lines past it dropped."""
    missing, unexpected = nets.draft.load_state_dict(ckpt["draft"], strict=False)
    if unexpected or set(missing) != {"embed_tokens.weight", "draft_to_target"}:
        raise Refused(f"{cfg.run_file(layout.CHECKPOINT)}: draft tensors do not match (missing {missing}, "
                      f"unexpected {unexpected})")
    opt.load_state_dict(ckpt["optimizer"])
    sched.load_state_dict(ckpt["scheduler"])
    set_rng_state(ckpt["rng"], place.device)
    tally.metrics, tally.best = ckpt["metrics"], ckpt.get("best")
    if place.writer:
        truncate_metrics(cfg.run_file(layout.METRICS), start_step)
        truncate_metrics(cfg.run_file(layout.EVALS), start_step)
    progress(stage="resume", step=start_step, steps=total_steps)


def batch_source(cfg: Config, place: Place, data: Data, target, stream, start_step: int, total_steps: int):
    """(epoch, sample indices, payload) per step from start_step on: this rank's batches in the seed's order, or
    the stream's; with --states read ahead by DataLoader workers into pinned memory while the GPU steps."""
    if stream:
        batches = stream.batches(start_step)
    else:
        train_lengths = [len(data.samples[i].ids) for i in data.train_index]
        batches = ((epoch, [data.train_index[j] for j in batch])
                   for epoch, batch in rank_batches(train_lengths, cfg.batch_tokens, cfg.seed, place.rank,
                                                    place.world))
        for _ in range(start_step):
            next(batches)
    if not cfg.states:
        return ((epoch, index, None) for epoch, index in batches)
    schedule = [next(batches) for _ in range(start_step, total_steps)]
    try:
        return iter(target.loader(schedule, data.samples, loader_workers(cfg, place.world), pin=place.use_cuda))
    except StatesError as e:
        raise Refused(str(e)) from None


def keep_states_again(cfg: Config, place: Place, data: Data, target, start_step: int) -> None:
    """Kept states are what each sample's first-epoch batch computed (another batch's padding rounds them
    otherwise): a resumed run keeps them again from those batches, so it ends on the uninterrupted run's weights."""
    if not (start_step and isinstance(target, CachedTargetStates)):
        return
    train_lengths = [len(data.samples[i].ids) for i in data.train_index]
    first = rank_batches(train_lengths, cfg.batch_tokens, cfg.seed, place.rank, place.world)
    for _, (epoch, batch) in zip(range(start_step), first):
        if epoch > 0:
            break
        index = [data.train_index[j] for j in batch]
        target.states(*collate(data.samples, index, data.pad_id, place.device)[:2], index)


@dataclass(frozen=True)
class Run:
    """Everything the loop reads and nothing it changes (that is the Tally)."""
    cfg: Config
    place: Place
    data: Data
    nets: Nets
    model: torch.nn.Module  # the draft, in DDP when distributed
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    stream: object  # --stream's schedule, or None
    start_step: int
    total_steps: int
    writer_ranks: list[int]  # each needs the whole optimizer state
    fp: dict
    tensorboard: object  # a SummaryWriter, or None


# ---------------------------------------------------------------- one step, and the evaluation


def forward(run: Run, net, index, payload=None, certainty=False):
    """One batch through the target's states and the draft's TTT steps: (objective, per-step
    (loss, correct, counted), input_ids, attention, loss_mask). certainty: the objective keeps the
    target's probability of its argmax too (validation's split of the hits)."""
    cfg, place, nets = run.cfg, run.place, run.nets
    input_ids, attention, loss_mask = collate(run.data.samples, index, run.data.pad_id, place.device)
    try:
        states = nets.target.states(input_ids, attention, index, payload) if payload else \
            nets.target.states(input_ids, attention, index)
    except StatesError as e:  # a shard the loader could not read: its one line, not a traceback
        raise Refused(str(e)) from None
    target_vd, target_top, target_top_p = target_distribution(nets.target.normed(states.last),
                                                              nets.target.head_weight, nets.head_vd,
                                                              with_top_p=certainty)
    if cfg.label_temperature != 1.0:
        target_vd = target_vd / cfg.label_temperature
    # Recompute each TTT step and loss chunk in backward on a GPU, where memory binds; a CPU host keeps
    # their tensors (train_plan counts them so: recompute=False) and saves 40% of the step's time
    # (demo: 0.24 -> 0.16 s for the steps, 0.152 -> 0.140 s more for the loss chunks).
    objective = SoftCrossEntropy(nets.draft, target_vd, target_top, loss_mask, nets.vocab_ids, nets.in_vocab,
                                 cfg.ttt_decay, recompute=place.use_cuda, target_top_p=target_top_p)
    with step_autocast(place.device, place.bf16):
        per_step = net(input_ids, states.aux, cfg.ttt_steps, objective, checkpoint=place.use_cuda,
                       used=objective.used_slots(cfg.ttt_steps))
    return objective, per_step, input_ids, attention, loss_mask


@torch.no_grad()
def validate(run: Run) -> dict:
    """Accuracy per step and the predicted acceptance length (vLLM's walk) on the held-out rows."""
    k, device, samples = run.cfg.ttt_steps, run.place.device, run.data.samples
    sums = torch.zeros(2 * k + 2, dtype=torch.float64, device=device)
    certainty = torch.zeros(4, dtype=torch.float64, device=device)  # acceptance.hits_by_certainty's sums
    lengths = [len(s.ids) for s in samples]
    for index in cut_batches(run.data.val_index, lengths, run.cfg.batch_tokens)[run.place.rank::run.place.world]:
        objective, _, input_ids, _, loss_mask = forward(run, run.nets.draft, index, certainty=True)
        # accuracy on the answers; the replay's tokens past the stop are scored for the walk alone
        answer = acceptance.answer_mask(loss_mask, [len(samples[j].ids) for j in index],
                                        [samples[j].tail for j in index])
        scored = [scored_slots(answer, i) for i in range(k)]
        sums[:k] += torch.stack([(objective.hit_maps[i] & scored[i]).sum() for i in range(k)]).double()
        sums[k : 2 * k] += torch.stack([scored[i].sum() for i in range(k)]).double()
        sums[2 * k :] += torch.tensor(acceptance.batch_chains(objective, input_ids, loss_mask, k, answer)[2:],
                                      dtype=torch.float64, device=device)
        certainty += torch.tensor(acceptance.hits_by_certainty(objective.hit_maps[0], scored[0],
                                                               objective.target_top_p), dtype=torch.float64,
                                  device=device)
    if run.place.distributed:
        dist.all_reduce(sums)
        dist.all_reduce(certainty)
    acc = (sums[:k] / sums[k : 2 * k].clamp(min=1)).tolist()
    sure_hits, sure, unsure_hits, unsure = certainty.tolist()
    return {"val_sim_al": round(sums[2 * k].item() / max(1.0, sums[2 * k + 1].item()), 4),
            **{f"val_acc_{i}": round(a, 4) for i, a in enumerate(acc)},
            # where the first draft token misses: on tokens the target is sure of, or on its own coin flips
            "val_acc_0_sure": round(sure_hits / max(1.0, sure), 4),
            "val_acc_0_unsure": round(unsure_hits / max(1.0, unsure), 4),
            "val_sure_share": round(sure / max(1.0, sure + unsure), 4)}


def export_draft(run: Run, path: str, step: int, figures: dict) -> None:
    nets = run.nets
    export(nets.draft, path, run.place.dtype,
           model_card(run.cfg, nets.target, run.data.stats, nets.target.config.vocab_size, len(nets.vocab_ids),
                      nets.target.aux_layer_ids, step, figures))


def evaluate(run: Run, tally: Tally, step: int) -> dict:
    """Held-out figures (and vLLM's measurement with --eval-vllm) of the draft as it is now, with the
    seconds of training steps that made it; the best so far is exported as OUT/draft (scored by the
    measurement when there is one, else val_sim_al)."""
    cfg, place = run.cfg, run.place
    figures = {**validate(run), "train_s": round(tally.train_s, 2)}  # as the metrics row it joins
    candidate = cfg.run_file(layout.DRAFT + ".candidate")
    if place.writer:
        export_draft(run, candidate, step, figures)
    if cfg.eval_vllm:
        measured = measure_in_vllm(cfg, candidate, cfg.run_file(layout.HELDOUT), step) if place.rank == 0 else {}
        if place.distributed:  # every node keeps the same best: rank 0's measurement, through gloo (CPU)
            box = [measured]
            dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))  # gloo: no NCCL timeout
            measured = box[0]
        figures.update(measured)
        score = measured.get("measured_al")
    else:
        score = figures["val_sim_al"]
    best = tally.best
    better = best is None or (score is not None and (best["score"] is None or score > best["score"]))
    if better:
        tally.best = {"step": step, "score": score}
    if place.writer:
        if better:
            replace_dir(candidate, cfg.run_file(layout.DRAFT))
        else:
            shutil.rmtree(candidate)
        with open(cfg.run_file(layout.EVALS), "a") as f:
            f.write(json.dumps({"step": step, **figures, "kept": better}) + "\n")
    progress(stage="eval", step=step, **figures, best_step=tally.best["step"])
    return figures


def train_step(run: Run, index, payload) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on this batch; (totals, chains) summed over the group: totals are the loss, the
    hits and scored slots per TTT step, the loss tokens the draft vocabulary covers, the loss tokens, the
    batch's tokens and samples; chains are acceptance.batch_chains' sums."""
    device, k = run.place.device, run.cfg.ttt_steps
    objective, per_step, input_ids, attention, loss_mask = forward(run, run.model, index, payload)
    loss = sum(r[0] for r in per_step)
    correct, counted = torch.stack([r[1] for r in per_step]), torch.stack([r[2] for r in per_step])
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(run.nets.draft.parameters(), run.cfg.grad_clip)
    run.opt.step()

    loss_ids = input_ids[loss_mask.bool()]  # how much of the batch's loss tokens the draft vocabulary covers
    totals = torch.cat([loss.detach().float().view(1), correct.float(), counted.float(),
                        run.nets.in_vocab[loss_ids].float().sum().view(1),
                        torch.tensor([float(loss_ids.numel())], device=device),
                        attention.sum().float().view(1), torch.tensor([float(len(index))], device=device)])
    if run.place.distributed:
        dist.all_reduce(totals)  # on the model's device: the group's NCCL side refuses CPU tensors
    totals = totals.cpu()
    chains = torch.tensor(acceptance.batch_chains(objective, input_ids, loss_mask, k), dtype=torch.float64,
                          device=device)
    if run.place.distributed:
        dist.all_reduce(chains)
    return totals, chains


def step_metrics(run: Run, step: int, epoch, totals, chains, step_s: float, train_s: float) -> dict:
    """metrics.jsonl's row for the step just taken (step counts from 0)."""
    k = run.cfg.ttt_steps
    acc = (totals[1 : 1 + k] / totals[1 + k : 1 + 2 * k].clamp(min=1)).tolist()
    covered, loss_tokens = totals[-4].item(), totals[-3].item()
    tokens, batch_samples = int(totals[-2]), int(totals[-1])
    metrics = {"step": step + 1, "epoch": epoch, "loss": round(totals[0].item() / run.place.world, 5),
               **{f"acc_{i}": round(a, 4) for i, a in enumerate(acc)},
               "sim_al": round(chains[2].item() / max(1.0, chains[3].item()), 4),  # acceptance.py: vLLM's walk
               "sim_al_anchors": round(chains[0].item() / max(1.0, chains[1].item()), 4),
               "sim_al_indep": round(simulated_acceptance(acc), 4),
               "tokens_per_s": round(tokens / step_s, 1), "train_s": round(train_s, 2),
               "lr": run.sched.get_last_lr()[0], "tokens": tokens, "samples": batch_samples}
    metrics["vocab_coverage"] = round(covered / max(1.0, loss_tokens), 4)
    return metrics


def record(run: Run, metrics: dict, step: int) -> None:
    """The step's row into metrics.jsonl and TensorBoard (the writer rank of each host)."""
    if not run.place.writer:
        return
    with open(run.cfg.run_file(layout.METRICS), "a") as f:
        f.write(json.dumps(metrics) + "\n")
    for key, value in metrics.items() if run.tensorboard else ():
        if key not in ("step", "epoch") and isinstance(value, (int, float)):
            run.tensorboard.add_scalar(f"train/{key}", value, step + 1)


def steps_and_eta(run: Run, steps_done: int, wall_s: float, train_s: float) -> tuple[int, float]:
    """The steps the run will end at and the seconds left: with --time-budget, by the pace so far."""
    eta = (run.total_steps - steps_done) * wall_s / (steps_done - run.start_step)
    budget = run.cfg.time_budget
    if not budget or train_s <= 0:
        return run.total_steps, eta
    expected = min(run.total_steps, round(steps_done * budget / train_s))
    return max(expected, steps_done), min(eta, max(0.0, budget - train_s))


def save_if_due(run: Run, tally: Tally, step: int, last: bool, evaluated: bool) -> None:
    """A checkpoint every --save-every steps, at the end, after an evaluation, and before --stream deletes
    a shard; the decision is alike on every rank (gathering a sharded optimizer's state is a collective)."""
    shard_done = run.stream is not None and run.stream.checkpoint_due(step + 1)  # its shard may go after a save
    if not ((step + 1) % run.cfg.save_every == 0 or last or shard_done or evaluated):
        return
    opt_state = optimizer_state(run.opt, run.writer_ranks)
    if run.place.writer:
        save_checkpoint(run.cfg.run_file(layout.CHECKPOINT), step + 1, run.nets.draft, opt_state, run.sched,
                        run.nets.vocab_ids, run.fp, tally.metrics, tally.best)
        if run.stream:
            run.stream.saved(step + 1)


def train_loop(run: Run, tally: Tally, batches) -> int:
    """Steps from start_step until total_steps or --time-budget; returns the last step taken."""
    cfg = run.cfg
    t0 = last_print = time.monotonic()
    tokens_seen = 0
    final_step = run.start_step
    for step in range(run.start_step, run.total_steps):
        if cfg.time_budget and tally.train_s >= cfg.time_budget:  # a resumed run that had spent its budget
            break
        step_t0 = time.monotonic()
        epoch, index, payload = next(batches)
        totals, chains = train_step(run, index, payload)
        tokens_seen += int(totals[-2])
        # The slowest rank's step: every rank's records and its --time-budget stop then agree.
        step_s = group_max(time.monotonic() - step_t0, run.place.device)
        tally.train_s += step_s
        run.sched.step()
        last = step + 1 == run.total_steps or bool(cfg.time_budget and tally.train_s >= cfg.time_budget)
        metrics = step_metrics(run, step, epoch, totals, chains, step_s, tally.train_s)
        evaluated = bool(run.data.val_index) and (last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0))
        if evaluated:
            metrics.update(evaluate(run, tally, step + 1))
        tally.metrics = metrics
        record(run, metrics, step)
        now = time.monotonic()
        if now - last_print > PROGRESS_EVERY_S or last:
            last_print = now
            steps, eta = (step + 1, 0.0) if last else steps_and_eta(run, step + 1, now - t0, tally.train_s)
            progress(stage="train", step=step + 1, steps=steps, epoch=epoch, loss=metrics["loss"],
                     acc_0=metrics["acc_0"], sim_al=metrics["sim_al"], tok_s=round(tokens_seen / (now - t0), 1),
                     lr=metrics["lr"], eta_s=round(eta))
            if run.place.writer:
                report.refresh(cfg.out, "train")
        save_if_due(run, tally, step, last, evaluated)
        final_step = step + 1
        if last:
            break
    return final_step


def finish(run: Run, tally: Tally, final_step: int) -> None:
    """Export the last step's draft, unless evaluations kept their best as draft/ already; leave the group."""
    cfg, metrics = run.cfg, tally.metrics
    if run.place.writer:
        if not run.data.val_index:
            export_draft(run, cfg.run_file(layout.DRAFT), final_step, metrics)
        if run.tensorboard:
            run.tensorboard.close()
        report.finish(cfg.out, "train")
    if run.place.distributed:
        leave_process_group()
    best = tally.best
    progress(stage="done", steps=final_step, loss=metrics.get("loss"), acc_0=metrics.get("acc_0"),
             sim_al=metrics.get("sim_al"), val_sim_al=metrics.get("val_sim_al"),
             measured_al=metrics.get("measured_al"), draft_step=best["step"] if best else final_step,
             train_s=metrics.get("train_s"), draft=cfg.run_file(layout.DRAFT))


# ---------------------------------------------------------------- main


def main(argv=None):
    cfg = parse_args(argv)
    place = take_place(cfg)
    memory_plan = make_plan(cfg, place.use_cuda, place.device, place.world)  # config.json alone: before any load
    if cfg.plan:
        return print_plan(memory_plan)
    cfg = settle_plan(cfg, memory_plan)
    tensorboard = open_outputs(cfg, place)
    data = load_data(cfg)
    target, stream = load_target(cfg, place, data)
    load_held_out(cfg, place, data, target)
    total_steps = count_steps(cfg, place, data, stream)
    fp = run_fingerprint(cfg, place, target, total_steps)
    ckpt, start_step = open_checkpoint(cfg, fp)
    nets = build_draft(cfg, place, data, target, ckpt)
    opt = make_optimizer(cfg, nets.draft, sharded(cfg, place))
    writer_ranks = [r for r, w in enumerate(everyones(place.writer)) if w]
    tally = Tally()
    sched = make_schedule(cfg, opt, total_steps, tally)
    if ckpt is not None:
        resume(cfg, place, nets, opt, sched, ckpt, start_step, total_steps, tally)
    model = data_parallel(nets.draft) if place.distributed else nets.draft
    batches = batch_source(cfg, place, data, target, stream, start_step, total_steps)
    keep_states_again(cfg, place, data, target, start_step)
    run = Run(cfg, place, data, nets, model, opt, sched, stream, start_step, total_steps, writer_ranks, fp,
              tensorboard)
    tally.train_s = tally.metrics.get("train_s", 0.0)  # carried on past a resume
    final_step = train_loop(run, tally, batches)
    finish(run, tally, final_step)


if __name__ == "__main__":
    main_of(main, "train.py")
