#!/usr/bin/env python3
"""What one lent GPU must show of the trainer's CUDA/NCCL path, in one command of at most 8 minutes.

    bench/gpu_check.sh --prepare DIR        on any CPU host: the carried inputs (tiny model, its state
                                            shards, chat rows: a few MB) into DIR
    bench/gpu_check.sh --dry-run [DIR]      here, in CI: every step's files and flags checked, nothing run
    bench/gpu_check.sh DIR [--out OUTDIR]   on the GPU: every step, one JSON row each into OUTDIR (default
                                            $OUT) as it finishes, its log beside it; a table; exit 1 on failure

The lent machine has PyTorch with CUDA, transformers, safetensors, numpy, no vLLM and no network, one
command of at most 10 minutes: so nothing here installs, serves or downloads, the steps' limits add up to
BUDGET_S, and a step that would pass the deadline is recorded as not run rather than started.

Steps (each a subcommand of this file, printing its rows):
  env            GPU, torch, CUDA, memory free at start
  sdpa           which SDPA kernels the draft's shapes get: bf16/fp32, 64 heads over 8 kv and 8 over 8, head 112
  bf16-grads     the bf16-autocast step's gradients against an fp64 step's (train.step_autocast)
  attention      the diagonal attention's lse kernels and gradients against the dense mask
  real-width     torchrun, NCCL: the Kimi-width step at 3 batch sizes (AdamW) and one (Muon): peak
                 allocated/reserved against the plan (ratio), tokens/s, and the reserve measured against
                 train_plan.RESERVE_GB
  loader         the --states loader at Kimi width: host RAM held against its bound, /dev/shm, tokens/s
  resume         torchrun --nproc-per-node 1 (NCCL) train.py --states on the tiny target: killed after a
                 checkpoint, resumed, its metrics equal to an uninterrupted run's
  gloo-pair      two ranks on the one GPU over gloo with CUDA tensors (NCCL refuses two ranks on one device):
                 --batch-tokens auto agreed, ZeRO-1, both nodes' records equal
  plan           the plan for Kimi-K2 on 8 of this GPU
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "remote"))

BUDGET_S = 470  # of the lent machine's 10-minute command: the rest is start-up and copying results back
KIMI = ROOT / "bench" / "kimi-k2" / "config.json"
TINY_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
TRAIN_FLAGS = ["--batch-tokens", "512", "--ttt-steps", "2", "--lr", "1e-2", "--val-fraction", "0.1",
               "--eval-max-tokens", "16", "--eval-n", "4", "--no-tensorboard"]


def row(**fields):
    print(json.dumps(fields), flush=True)


# ---------------------------------------------------------------- the steps, in one place


def steps(inputs: Path, work: Path) -> list[tuple[str, int, list[str]]]:
    """(name, limit in seconds, argv) of every step, in order; their limits sum to BUDGET_S at most."""
    me = [sys.executable, str(Path(__file__))]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    return [
        ("env", 15, me + ["env"]),
        ("sdpa", 35, me + ["sdpa"]),
        ("bf16-grads", 35, me + ["bf16-grads"]),
        ("attention", 25, me + ["attention"]),
        ("real-width", 140, torchrun + [str(Path(__file__)), "real-width", "--tokens", "4096", "--batches", "1,2,4"]),
        ("loader", 50, me + ["loader", "--work", str(work / "loader")]),
        ("resume", 90, me + ["resume", str(inputs), "--work", str(work / "resume")]),
        ("gloo-pair", 55, me + ["gloo-pair", str(inputs), "--work", str(work / "gloo")]),
        ("plan", 15, me + ["plan"]),
    ]


def train_argv(inputs: Path, out: Path, *extra: str) -> list[str]:
    """remote/train.py on the carried tiny target and its state shards."""
    return [str(ROOT / "remote" / "train.py"), "--target", str(inputs / "tiny"), "--data", str(inputs / "chat.jsonl"),
            "--states", str(inputs / "states"), "--out", str(out), *TRAIN_FLAGS, *extra]


RESUME_FLAGS = ["--steps", "200", "--save-every", "20", "--device", "cuda"]
GLOO_FLAGS = ["--steps", "6", "--eval-every", "3", "--device", "cuda", "--backend", "gloo"]


# ---------------------------------------------------------------- driver


def run_all(args) -> int:
    inputs, out = Path(args.inputs).resolve(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/specops-gpu-check"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    missing = missing_inputs(inputs)
    if missing:
        print(f"gpu_check: {inputs} lacks {missing[0]}: run bench/gpu_check.sh --prepare {inputs} first", file=sys.stderr)
        return 2
    rows_path = out / "rows.jsonl"
    deadline = time.monotonic() + BUDGET_S
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'remote'}", "OMP_NUM_THREADS": "4", "HF_HUB_OFFLINE": "1"}
    with open(rows_path, "w") as rows:
        for name, limit, argv in steps(inputs, work):
            left = deadline - time.monotonic()
            if left < min(limit, 20):
                record(rows, {"step": name, "ok": False, "not_run": f"{left:.0f} s left of {BUDGET_S}"})
                continue
            record(rows, *run_step(name, argv, min(limit, left), out / f"{name}.log", env))
    return table(rows_path)


def run_step(name: str, argv: list[str], limit: float, log: Path, env: dict) -> list[dict]:
    """The step's rows (its JSON lines), or one row saying how it failed."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    seconds = round(time.monotonic() - t0, 1)
    lines = log.read_text(errors="replace").splitlines()
    found = []
    for line in lines:
        if line.startswith("{"):
            try:
                found.append({"step": name, **json.loads(line), "seconds": seconds})
            except json.JSONDecodeError:
                pass
    if found and (rc == 0 or (rc is not None and any(r.get("ok") is False for r in found))):
        return found  # the step said how it went
    why = "timed out" if rc is None else f"exit {rc}" if rc else "no result row"
    tail = [line for line in lines if line.strip()][-1:] or [""]
    return found + [{"step": name, "ok": False, "error": f"{why} after {seconds} s: {tail[0][-300:]}",
                     "log": log.name, "seconds": seconds}]


def record(rows, *found: dict) -> None:
    for r in found:
        rows.write(json.dumps(r) + "\n")
        rows.flush()
        print(json.dumps(r), flush=True)


def table(rows_path: Path) -> int:
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    print()
    for r in rows:
        rest = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("step", "ok", "check") and v is not None)
        state = {True: "ok  ", False: "FAIL"}.get(r.get("ok"), "--  ")
        print(f"{state}  {r['step']:<11} {r.get('check', ''):<44} {rest}")
    failed = [r for r in rows if r.get("ok") is False]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} rows ok; rows: {rows_path}")
    return 1 if failed else 0


def missing_inputs(inputs: Path) -> list[str]:
    need = [f"tiny/{f}" for f in TINY_FILES] + ["chat.jsonl", "states/plan.json", "states/shard-00000.safetensors"]
    return [n for n in need if not (inputs / n).exists()]


def dry_run(args) -> int:
    """Every step's argv parsed by the parser that will read it, and every file it names present."""
    import train

    inputs = Path(args.inputs or "/nonexistent-inputs").resolve()
    work = Path("/tmp/specops-gpu-check")
    problems = []
    total = 0
    parser = subcommand_parser()
    for name, limit, argv in steps(inputs, work):
        total += limit
        script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        for path in argv[: script + 1]:
            if path.endswith(".py") and not Path(path).exists():
                problems.append(f"{name}: {path} missing")
        try:
            parser.parse_args(argv[script + 1:])
        except SystemExit:
            problems.append(f"{name}: {' '.join(argv[script + 1:])} does not parse")
        print(f"{name:<11} {limit:>4} s  {' '.join(Path(a).name if '/' in a else a for a in argv[script:])}")
    for extra in (RESUME_FLAGS, GLOO_FLAGS):
        argv = train_argv(inputs, work / "run", *extra)
        try:
            train.parse_args(argv[1:])
        except SystemExit:
            problems.append(f"train.py {' '.join(extra)} does not parse")
    for path in (ROOT / "remote" / "train.py", KIMI, ROOT / "remote" / "make_tiny_model.py"):
        if not path.exists():
            problems.append(f"{path} missing")
    if args.inputs:
        problems += [f"{inputs}: {m} missing (--prepare)" for m in missing_inputs(inputs)]
        size = sum(p.stat().st_size for p in inputs.rglob("*") if p.is_file())
        print(f"inputs: {inputs}, {size / 2**20:.1f} MiB")
    if total > BUDGET_S:
        problems.append(f"step limits add up to {total} s, more than BUDGET_S {BUDGET_S}")
    print(f"total: at most {total} s of steps ({BUDGET_S} s budget)")
    for p in problems:
        print(f"PROBLEM  {p}")
    print("dry run: " + ("ok" if not problems else "FAILED"))
    return 1 if problems else 0


# ---------------------------------------------------------------- --prepare (on a CPU)


def prepare(args) -> int:
    """The carried inputs: the tiny target (copied from the test suite's build, else built), chat rows,
    and the states vLLM would extract for them, computed here with transformers and written as
    remote/extract.py writes them (plan.json + shards), so `train.py --states` reads them unchanged."""
    import torch

    import states_dir as shards
    from chat_render import ChatRenderer, load_samples
    from target_states import OnlineTargetStates

    out = Path(args.dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    tiny = out / "tiny"
    if not (tiny / "model.safetensors").exists():
        built = tiny_model_build()
        if built:
            shutil.copytree(built, tiny, dirs_exist_ok=True)
        else:
            subprocess.run([sys.executable, str(ROOT / "remote" / "make_tiny_model.py"), str(tiny)], check=True)
    write_chat_rows(out / "chat.jsonl", 48)
    renderer = ChatRenderer.from_pretrained(str(tiny), False)
    samples, _ = load_samples(renderer, [str(out / "chat.jsonl")], 4096, False)
    target = OnlineTargetStates(str(tiny), None, torch.device("cpu"), torch.float32, False)
    L, H = target.config.num_hidden_layers, target.config.hidden_size
    aux = list(target.aux_layer_ids)
    layers = aux + [L]
    states_out = out / "states"
    shutil.rmtree(states_out, ignore_errors=True)
    states_out.mkdir()
    per_shard = 16
    plan_shards = []
    for k, first in enumerate(range(0, len(samples), per_shard)):
        part = list(range(first, min(first + per_shard, len(samples))))
        rows = []
        for i in part:
            ids = samples[i].ids.long().view(1, -1)
            got = target.states(ids, torch.ones_like(ids), [i])
            rows.append(torch.cat([got.aux.view(1, ids.shape[1], len(aux), H), got.last.unsqueeze(2)], 2)[0])
        shards.write_shard(str(states_out), k, part, rows, [samples[i].ids for i in part],
                           [samples[i].mask for i in part], layers, "bf16")
        plan_shards.append({"first": part[0], "count": len(part), "tokens": sum(len(samples[i].ids) for i in part)})
    plan = {"format": shards.FORMAT, "target": str(tiny), "model_type": target.config.model_type, "num_layers": L,
            "hidden_size": H, "aux_layer_ids": aux, "layers": layers, "dtype": "bf16",
            "bytes_per_token": shards.bytes_per_token(len(layers), H, "bf16"),
            "data": [[str(out / "chat.jsonl"), (out / "chat.jsonl").stat().st_size]], "max_len": 4096,
            "include_truncated": False, "samples": len(samples), "tokens": sum(len(s.ids) for s in samples),
            "samples_digest": shards.samples_digest(samples), "stream": False, "scratch_bytes": None,
            "transient_bytes": 0, "shards": plan_shards}
    (states_out / shards.PLAN).write_text(json.dumps(plan))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(json.dumps({"prepared": str(out), "mib": round(size / 2**20, 2), "samples": len(samples),
                      "seconds": round(time.monotonic() - t0, 1)}))
    return 0


def tiny_model_build() -> Path | None:
    """The test suite's tiny model, where it was built (tests/helpers/fixtures_vllm.py's cache path)."""
    try:
        from tests.helpers.fixtures_vllm import tiny_model_dir
    except ImportError:
        return None
    path = tiny_model_dir()
    return path if (path / "model.safetensors").exists() else None


def write_chat_rows(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            answer = f"{i} + {i + 3} = {2 * i + 3}. Count on from {i}: " + " ".join(str(i + j) for j in range(1, 6))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i + 3}?"},
                                             {"role": "assistant", "content": answer}]}) + "\n")


# ---------------------------------------------------------------- the GPU steps


def env_step(args) -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    row(check="GPU and software", ok=torch.cuda.is_available(), gpu=torch.cuda.get_device_name(),
        torch=torch.__version__, cuda=torch.version.cuda, free_gb=round(free / 1e9, 2), total_gb=round(total / 1e9, 2))
    return 0


def sdpa_step(args) -> int:
    """Each SDPA backend tried alone on the draft's attention shapes; the default call's peak memory beside
    the math kernel's [B, heads, T, T] fp32 scores tells which one it took."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    T, hd = 4096, 112
    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        for heads, kv in ((64, 8), (8, 8)):
            q = torch.randn(1, heads, T, hd, device="cuda", dtype=dtype)
            k, v = (torch.randn(1, kv, T, hd, device="cuda", dtype=dtype) for _ in range(2))
            runs = []
            for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                            SDPBackend.MATH):
                try:
                    with sdpa_kernel(backend):
                        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv < heads)
                    runs.append(backend.name.lower())
                except RuntimeError:
                    pass
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv < heads)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - base
            scores = heads * T * T * 4
            lean = extra < scores / 4
            # bf16 must get a lean kernel; fp32 + GQA is what train_plan.dtype_refusal refuses
            expect_lean = dtype == torch.bfloat16 or kv == heads
            ok &= lean or not expect_lean
            row(check=f"SDPA {str(dtype)[6:]} {heads}/{kv} heads x {hd}", ok=lean or not expect_lean,
                backends_that_run=runs, default_extra_gb=round(extra / 1e9, 3),
                math_scores_gb=round(scores / 1e9, 3), default_is_lean=lean)
    return 0 if ok else 1


def bf16_grads_step(args) -> int:
    """The trainer's bf16 autocast step (no weight cache) at hidden 1024 on CUDA, against fp64."""
    import torch

    import train
    from draft_model import DraftConfig, Eagle3Draft
    from ttt_objective import SoftCrossEntropy, target_distribution

    torch.manual_seed(0)
    H, V, Vd, B, T = 1024, 8192, 2048, 1, 1024
    c = DraftConfig(hidden_size=H, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2,
                    head_dim=128, vocab_size=V, draft_vocab_size=Vd, aux_layer_ids=[0, 1, 2],
                    max_position_embeddings=4096)
    vocab_ids = torch.randperm(V)[:Vd].sort().values.cuda()
    draft = Eagle3Draft(c, torch.randn(V, H) * 0.02, vocab_ids.cpu()).cuda()
    in_vocab = torch.zeros(V, dtype=torch.bool, device="cuda")
    in_vocab[vocab_ids] = True
    ids = torch.randint(0, V, (B, T), device="cuda")
    aux, normed = torch.randn(B, T, 3 * H, device="cuda"), torch.randn(B, T, H, device="cuda")
    head, mask = torch.randn(V, H, device="cuda") * 0.05, torch.ones(B, T, dtype=torch.long, device="cuda")

    def grads(dtype, bf16):
        d = draft.to(dtype)
        d.zero_grad(set_to_none=True)
        tvd, top, _ = target_distribution(normed.to(dtype), head.to(dtype), head[vocab_ids].to(dtype))
        objective = SoftCrossEntropy(d, tvd, top, mask, vocab_ids, in_vocab, 0.8, chunk_rows=128)
        with train.step_autocast(torch.device("cuda"), bf16):
            per_step = d(ids, aux.to(dtype), 7, objective, checkpoint=True)
        sum(r[0] for r in per_step).backward()
        return {n: p.grad.double().clone() for n, p in d.named_parameters() if p.requires_grad}

    reference = grads(torch.float64, False)
    got = grads(torch.float32, True)
    errors = {n: ((got[n] - g).norm() / g.norm()).item() for n, g in reference.items() if g.norm() > 0}
    worst = max(errors.values())
    row(check="bf16 step gradients vs fp64 (relative)", ok=worst < 0.02, worst=round(worst, 5),
        lm_head=round(errors["lm_head.weight"], 5), tolerance=0.02)
    return 0 if worst < 0.02 else 1


def attention_step(args) -> int:
    """The diagonal attention's lse kernels on CUDA against plain matmuls, and its output and gradients
    against the dense-mask formulation."""
    import torch
    import torch.nn.functional as F

    from draft_model import causal_lse, causal_lse_math, ttt_attention

    worst = 0.0
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        B, nh, nkv, T, hd = 1, 8, 2, 300, 112
        q = torch.randn(B, nh, T, hd, device="cuda", dtype=dtype)
        k = torch.randn(B, nh, T, hd, device="cuda", dtype=dtype)
        worst = max(worst, (causal_lse(q, k, k) - causal_lse_math(q.float(), k.float())).abs().max().item())
        q = q.float().requires_grad_()
        cache = [(torch.randn(B, nkv, T, hd, device="cuda", requires_grad=True),
                  torch.randn(B, nkv, T, hd, device="cuda", requires_grad=True)) for _ in range(3)]
        out = ttt_attention(q, cache, nh // nkv)
        g = nh // nkv
        keys = torch.cat([c[0].repeat_interleave(g, 1) for c in cache], 2)
        values = torch.cat([c[1].repeat_interleave(g, 1) for c in cache], 2)
        mask = torch.cat([torch.ones(T, T, dtype=torch.bool, device="cuda").tril(),
                          *[torch.eye(T, dtype=torch.bool, device="cuda")] * 2], 1)
        dense = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        grads = torch.autograd.grad(out.sum(), [q, *cache[0]])
        dense_grads = torch.autograd.grad(dense.sum(), [q, *cache[0]])
        worst = max(worst, (out - dense).abs().max().item(),
                    *[(a - b).abs().max().item() for a, b in zip(grads, dense_grads)])
    row(check="diagonal attention vs dense mask (CUDA)", ok=worst < 0.05, max_abs_diff=round(worst, 5))
    return 0 if worst < 0.05 else 1


def real_width_step(args) -> int:
    """Under torchrun (NCCL, as train.py starts it): the trainer's step on a Kimi-width draft at each batch
    size, with train.py's DDP, optimizer and autocast: peak allocated and reserved against the plan, and
    the reserve (CUDA context + NCCL + allocator slack) against train_plan.RESERVE_GB."""
    import types

    import torch
    import torch.distributed as dist

    import train
    import train_plan
    from draft_model import DraftConfig, Eagle3Draft
    from ttt_objective import SoftCrossEntropy, target_distribution

    assert train.launched_by_torchrun(), "run under torchrun"
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", train.EXPANDABLE_SET_BY_MAIN)  # as train.main sets it
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    torch.cuda.set_device(device)
    dist.init_process_group(train.process_group_backend(True))
    T, k = args.tokens, 7
    shape = train_plan.draft_shape(train_plan.text_config(str(KIMI)), 32000)
    H, V, Vd = shape.hidden, shape.vocab, shape.draft_vocab
    c = DraftConfig(hidden_size=H, intermediate_size=shape.intermediate, num_attention_heads=shape.heads,
                    num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, vocab_size=V, draft_vocab_size=Vd,
                    aux_layer_ids=[2, 30, 58], max_position_embeddings=131072)
    vocab_ids = torch.arange(0, V, V // Vd)[:Vd].to(device)
    embed = (torch.randn(V, H, device=device) * 0.02).to(torch.bfloat16)
    with device:  # initialised on the GPU: a billion parameters take a CPU tens of seconds
        draft = Eagle3Draft(c, embed, vocab_ids.cpu())
    draft.to(device)
    head = (torch.randn(V, H, device=device) * 0.02).to(torch.bfloat16)
    head_vd = head[vocab_ids]
    model = train.data_parallel(draft)
    opt = train.make_optimizer(types.SimpleNamespace(optimizer="adamw", lr=1e-4, muon_lr=0.02), draft, False)
    in_vocab = torch.zeros(V, dtype=torch.bool, device=device)
    in_vocab[vocab_ids] = True
    failed = 0
    for B, optimizer in [(int(b), "adamw") for b in args.batches.split(",")] + [(2, "muon")]:
        if optimizer == "muon":  # its Newton-Schulz iterations in bf16 on every matrix: the cost to weigh
            del opt
            torch.cuda.empty_cache()
            opt = train.make_optimizer(types.SimpleNamespace(optimizer="muon", lr=1e-4, muon_lr=0.02), draft, False)
        ids = torch.randint(0, V, (B, T), device=device)
        aux = torch.randn(B, T, 3 * H, device=device, dtype=torch.bfloat16)
        last = torch.randn(B, T, H, device=device, dtype=torch.bfloat16)
        mask = torch.ones(B, T, dtype=torch.long, device=device)
        mask[:, : T // 4] = 0  # a prompt: its slots skip the MLP, as in train.py
        torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            target_vd, target_top, _ = target_distribution(last, head, head_vd)
            objective = SoftCrossEntropy(draft, target_vd, target_top, mask, vocab_ids, in_vocab, 0.8)
            with train.step_autocast(device, True):
                per_step = model(ids, aux, k, objective, checkpoint=True, used=objective.used_slots(k))
            loss = sum(r[0] for r in per_step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)
            opt.step()
            totals = torch.stack([loss.detach().float(), *[r[1].float() for r in per_step]])
            dist.all_reduce(totals)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        free, total = torch.cuda.mem_get_info(device)
        context = total - free - torch.cuda.memory_reserved(device)  # CUDA context, kernels, NCCL's buffers
        planned = train_plan.plan({}, shape=shape, gpus=1, gpu_gb=1e6, ttt=k, batch_tokens=B * T, max_len=T,
                                  online=False, optimizer=optimizer)["peak_gb"] * 1e9
        reserve = context + reserved - allocated
        ok = allocated <= planned * 1.05 and reserve <= train_plan.RESERVE_GB * 1e9
        failed += not ok
        row(check=f"Kimi-width step, {B}x{T} tokens, {optimizer} (NCCL)", ok=ok, tokens_per_s=round(B * T / times[-1]),
            max_allocated_gb=round(allocated / 1e9, 2), max_reserved_gb=round(reserved / 1e9, 2),
            plan_gb=round(planned / 1e9, 2), plan_over_allocated=round(planned / allocated, 3),
            context_gb=round(context / 1e9, 2), reserve_measured_gb=round(reserve / 1e9, 2),
            reserve_planned_gb=train_plan.RESERVE_GB, loss=round(totals[0].item(), 3))
    train.leave_process_group()
    return 1 if failed else 0


def family_bytes(pid: int) -> int:
    """Anonymous + shared-memory resident bytes of pid and its children."""
    total = 0
    pids = [pid]
    try:
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def loader_step(args) -> int:
    """The --states loader at Kimi width (H 7168, 4 stored layers, bf16), pinned, into the GPU: host RAM
    held against LOADER_BATCHES batches, /dev/shm untouched, tokens/s."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import states_from_shards
    from batching import cut_batches
    from chat_render import Sample
    from states_loader import synthetic_source

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    H, tokens, length = 7168, 4096, 1024
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, 4096, (length,), generator=g, dtype=torch.int32),
                      torch.ones(length, dtype=torch.bool)) for _ in range(6 * tokens // length)]
    source = synthetic_source(str(work), H, samples, per_shard=4)
    source.device, source.dtype = torch.device("cuda"), torch.bfloat16
    source.aux_pos, source.last_pos = [0, 1, 2], 3
    schedule = [(0, b) for b in cut_batches(list(range(len(samples))), [length] * len(samples), tokens)]
    shm_before = shutil.disk_usage("/dev/shm").used if os.path.isdir("/dev/shm") else 0
    before, peak, t0 = family_bytes(os.getpid()), 0, time.perf_counter()
    for _, index, payload in source.loader(schedule, samples, 1, pin=True):
        ids = torch.zeros(len(index), length, dtype=torch.long)
        batch = source.states(ids, torch.ones_like(ids), index, payload)
        torch.cuda.synchronize()
        del batch
        peak = max(peak, family_bytes(os.getpid()) - before)
    rate = len(schedule) * tokens / (time.perf_counter() - t0)
    shm = (shutil.disk_usage("/dev/shm").used if os.path.isdir("/dev/shm") else 0) - shm_before
    batch_bytes = tokens * 4 * H * 2
    bound = states_from_shards.LOADER_BATCHES * batch_bytes
    ok = peak <= bound * 1.5 and shm < batch_bytes
    row(check="--states loader at Kimi width (pinned)", ok=ok, host_peak_gb=round(peak / 1e9, 3),
        bound_gb=round(bound / 1e9, 3), dev_shm_used_gb=round(shm / 1e9, 3), tokens_per_s=round(rate),
        dev_shm_size_gb=round(shutil.disk_usage("/dev/shm").total / 1e9, 2) if os.path.isdir("/dev/shm") else None)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


def torchrun(nproc: int, argv: list[str], log: Path, env=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *argv]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})


def metric_rows(run: Path) -> list[dict]:
    drop = {"tokens_per_s", "train_s", "lr"}  # clocks (and, with --time-budget, what follows them): runs' differ
    return [{k: v for k, v in json.loads(line).items() if k not in drop}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def largest_difference(a: list[dict], b: list[dict]) -> float:
    """The largest relative difference of any figure between two runs' metrics (CUDA's atomics in backward
    make bitwise equality too strict a bar)."""
    worst = 0.0 if len(a) == len(b) else float("inf")
    for x, y in zip(a, b):
        for key in x.keys() | y.keys():
            u, v = x.get(key), y.get(key)
            if isinstance(u, (int, float)) and isinstance(v, (int, float)):
                worst = max(worst, abs(u - v) / max(abs(u), abs(v), 1e-6))
            elif u != v:
                worst = float("inf")
    return worst


def resume_step(args) -> int:
    """train.py under torchrun --nproc-per-node 1 (NCCL) from the carried shards: whole; then killed after its
    first checkpoint and resumed; the same metrics line for line."""
    import torch

    inputs, work = Path(args.inputs), Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    whole, cut = work / "whole", work / "cut"
    if torchrun(1, train_argv(inputs, whole, *RESUME_FLAGS), work / "whole.log").wait(timeout=300):
        row(check="train.py whole run (NCCL)", ok=False, log=(work / "whole.log").read_text()[-1500:])
        return 1
    proc = torchrun(1, train_argv(inputs, cut, *RESUME_FLAGS), work / "cut.log")
    while proc.poll() is None and not (cut / "checkpoint.pt").exists():
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # torchrun stops its worker (its own session: a killpg would miss it)
    proc.wait(timeout=60)
    at = torch.load(cut / "checkpoint.pt", weights_only=False)["step"] if (cut / "checkpoint.pt").exists() else None
    if torchrun(1, train_argv(inputs, cut, *RESUME_FLAGS, "--resume"), work / "resume.log").wait(timeout=300):
        row(check="train.py resumed run (NCCL)", ok=False, log=(work / "resume.log").read_text()[-1500:])
        return 1
    a, b = metric_rows(whole), metric_rows(cut)
    worst = largest_difference(a, b)
    ok = worst <= 1e-3 and at is not None and 0 < at < 200
    row(check="train.py --states: kill, resume = whole (NCCL)", ok=ok, killed_at_step=at, steps=len(b),
        bitwise_equal=a == b, largest_relative_difference=worst)
    return 0 if ok else 1


def gloo_pair_step(args) -> int:
    """Two ranks on the one GPU over gloo (CUDA tensors), as two nodes (torchrun --nnodes 2, each its own
    --out): the group's agreements (batch, steps, start, clock), ZeRO-1, the two nodes' records equal."""
    inputs, work = Path(args.inputs), Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               *train_argv(inputs, work / f"node{node}", *GLOO_FLAGS)]
        procs.append(subprocess.Popen(cmd, stdout=open(work / f"node{node}.log", "w"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
    codes = [p.wait(timeout=300) for p in procs]
    if any(codes):
        row(check="two ranks over gloo on one GPU", ok=False, exit_codes=codes,
            log=(work / f"node{codes.index(max(codes))}.log").read_text()[-1500:])
        return 1
    same = {name: (work / "node0" / name).read_text() == (work / "node1" / name).read_text()
            for name in ("metrics.jsonl", "evals.jsonl", "train_plan.json")}
    batch = json.loads((work / "node0" / "train_plan.json").read_text())["batch_tokens"]
    row(check="two ranks over gloo on one GPU: records equal", ok=all(same.values()), same=same, batch_tokens=batch)
    return 0 if all(same.values()) else 1


def plan_step(args) -> int:
    r = subprocess.run([sys.executable, str(ROOT / "remote" / "train.py"), "--plan", "--target", str(KIMI.parent),
                        "--states", "-", "--gpus", "8"], capture_output=True, text=True, timeout=60)
    if not r.stdout.startswith("{"):
        row(check="plan: Kimi-K2 on 8 of this GPU", ok=False, error=r.stderr.strip()[-500:])
        return 1
    p = json.loads(r.stdout.splitlines()[0])
    row(check="plan: Kimi-K2 on 8 of this GPU (free memory)", ok=p["fits"], gpu_gb=p["gpu_gb"],
        batch_tokens=p["batch_tokens"], peak_gb=p["peak_gb"], optimizer_gb=p["optimizer_gb"],
        loader_host_gb_per_node=p["loader_host_gb_per_node"], tokens_per_s=p["tokens_per_s"])
    return 0


# ---------------------------------------------------------------- command line


SUBCOMMANDS = {"env": env_step, "sdpa": sdpa_step, "bf16-grads": bf16_grads_step, "attention": attention_step,
               "real-width": real_width_step, "loader": loader_step, "resume": resume_step,
               "gloo-pair": gloo_pair_step, "plan": plan_step}


def subcommand_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gpu_check.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("env", "sdpa", "bf16-grads", "attention", "plan"):
        sub.add_parser(name)
    p = sub.add_parser("real-width")
    p.add_argument("--tokens", type=int, default=4096, help="per sequence")
    p.add_argument("--batches", default="1,2,4", help="sequences per step, one measurement each")
    p = sub.add_parser("loader")
    p.add_argument("--work", required=True)
    for name in ("resume", "gloo-pair"):
        p = sub.add_parser(name)
        p.add_argument("inputs")
        p.add_argument("--work", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("dir")
    p = sub.add_parser("run")
    p.add_argument("inputs")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out")
    p = sub.add_parser("dry-run")
    p.add_argument("inputs", nargs="?")
    return ap


def main() -> int:
    args = subcommand_parser().parse_args()
    if args.cmd == "prepare":
        return prepare(args)
    if args.cmd == "run":
        return run_all(args)
    if args.cmd == "dry-run":
        return dry_run(args)
    return SUBCOMMANDS[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
