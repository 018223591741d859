#!/usr/bin/env bash
# What a lent GPU (one H200, minutes at a time, registries only) must show, unattended, in <= 8 minutes:
#
#   0. install vllm (CUDA) + requirements/remote.txt into .venv-gpu, unless a Python with CUDA torch and vllm is there;
#      where neither is possible (a lent machine that reaches no package index), the steps that need vLLM
#      are listed as "not run" and everything torch alone can check still runs
#   1. the tiny model (remote/make_tiny_model.py) and a tiny Kimi-K2-shaped target (DeepSeek-V3 MLA + MoE)
#   2. the diagonal attention's CUDA kernels (flash/efficient lse) against plain matmuls and the dense mask
#   3. (a) torchrun --nproc-per-node 1, NCCL: the trainer's step on a real-width draft (H 7168, Vd 32000,
#      T 8192, 7 TTT steps; AdamW, then Muon: its Newton-Schulz cost), then at the batch the plan picks for this
#      GPU: tokens/s,
#      torch.cuda.max_memory_allocated against the plan;
#      and remote/train.py itself under torchrun on the tiny target (process group, DDP, metrics all-reduce,
#      --time-budget's per-step clock all-reduce MAX of a CUDA float64 through NCCL (600 s: it never binds),
#      greedy held-out replay, --eval-vllm: a vLLM measuring checkpoints beside the NCCL job)
#   4. (b) vLLM serving the Kimi-shaped target in extraction mode with the stock ExampleHiddenStatesConnector
#      (inv serve --extract's command line for a gpu host), remote/extract.py against it
#   5. (c) remote/eval.py of the step-3 draft at temperature 0 and 0.7
#   One table at the end; exit 1 if any step failed.
#
#   bench/gpu_check.sh --dry-run    lists the steps and checks every file they need (no GPU needed)
#   GPU_CHECK_TINY=DIR              use this tiny model (e.g. the demo's .specops/local/models/tiny-reasoner)
#                                   instead of building one (minutes of CPU on a lent machine)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${GPU_CHECK_WORK:-/tmp/specops-gpu-check}
NEEDS=(remote/train.py remote/train_plan.py remote/draft_model.py remote/ttt_objective.py remote/muon.py remote/held_out.py remote/acceptance.py
       remote/extract.py remote/eval.py remote/make_tiny_model.py remote/states_dir.py bench/gpu_check.py bench/kimi-k2/config.json
       requirements/gpu.txt requirements/remote.txt specops/service_spec.py tests/helpers/kimi.py)
STEPS=("install" "models" "attention" "train" "extract" "eval")

if [[ "${1:-}" == "--dry-run" ]]; then
    printf 'steps: %s\n' "${STEPS[*]}"
    missing=0
    for f in "${NEEDS[@]}"; do
        if [[ -f "$f" ]]; then echo "ok       $f"; else echo "MISSING  $f"; missing=1; fi
    done
    py=$(command -v python3)
    [[ -x .venv/bin/python ]] && py=.venv/bin/python
    "$py" -m py_compile bench/gpu_check.py remote/train.py remote/train_plan.py remote/draft_model.py \
        remote/ttt_objective.py remote/muon.py remote/held_out.py remote/acceptance.py || missing=1
    "$py" remote/train.py --plan --target bench/kimi-k2 --states - --gpu-gb 141 --gpus 1 >/dev/null || missing=1
    bash -n "$0" || missing=1
    [[ $missing == 0 ]] && echo "dry run: ok" || echo "dry run: FAILED"
    exit $missing
fi

mkdir -p "$WORK"
ROWS="$WORK/rows.jsonl"
: > "$ROWS"
failed=0
row() { echo "$1" >> "$ROWS"; echo "$1"; }
step() {  # step NAME TIMEOUT_S CMD...: a row whether it passes or not
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    if timeout "$limit" "$@" > "$WORK/$name.log" 2>&1; then
        grep '^{' "$WORK/$name.log" >> "$ROWS" || row "{\"step\": \"$name\", \"ok\": true, \"seconds\": $((SECONDS - t0))}"
    else
        failed=1
        row "{\"step\": \"$name\", \"ok\": false, \"seconds\": $((SECONDS - t0)), \"log\": \"$WORK/$name.log\"}"
        tail -20 "$WORK/$name.log"
    fi
}

# 0. install
PY=python3
VLLM=1
if ! $PY -c 'import torch, vllm; assert torch.cuda.is_available()' 2>/dev/null; then
    if $PY -c 'import urllib.request as u; u.urlopen("https://pypi.org/simple/vllm/", timeout=5)' 2>/dev/null; then
        PY=$ROOT/.venv-gpu/bin/python
        if ! [[ -x $PY ]] || ! $PY -c 'import torch, vllm' 2>/dev/null; then
            step install 330 bash -c "python3 -m venv $ROOT/.venv-gpu && $PY -m pip install -q -r requirements/gpu.txt -r requirements/remote.txt && $PY -m pip install -q -e . --no-deps"
        fi
    else
        VLLM=0
        row '{"step": "install", "ok": null, "not_run": "vLLM is not installed here and no package index answers: the vLLM steps (b, c, --eval-vllm) are not run"}'
    fi
fi
export OMP_NUM_THREADS=8 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$WORK/gpu.txt"

# 1. models
if [[ -n "${GPU_CHECK_TINY:-}" ]]; then
    rm -rf "$WORK/tiny" && cp -r "$GPU_CHECK_TINY" "$WORK/tiny"
    $PY remote/make_tiny_model.py --write-prompts "$WORK/prompts.jsonl" --n-prompts 60 > /dev/null
else
    step tiny 240 $PY remote/make_tiny_model.py "$WORK/tiny" --write-prompts "$WORK/prompts.jsonl" --n-prompts 60
fi
[[ $VLLM == 1 ]] && step kimi 120 $PY bench/gpu_check.py kimi-target "$WORK/tiny" "$WORK/kimi"
$PY bench/gpu_check.py chat-rows "$WORK/chat.jsonl" --n 48

# 2. attention kernels
step attention 120 $PY bench/gpu_check.py attention-check

# 3. (a) NCCL training: real width, then train.py itself on the tiny target (its draft is step 5's)
step real_width 240 $PY -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_check.py real-step \
    --steps 4 --tokens 8192
step real_width_muon 240 $PY -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_check.py \
    real-step --steps 4 --tokens 8192 --optimizer muon
step plan_batch 240 $PY -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_check.py real-step \
    --steps 2 --tokens 4096 --plan-batch
rm -rf "$WORK/run"
EVAL_VLLM=(--eval-vllm --eval-arg=--max-model-len=1024 --eval-arg=--vllm-arg=--gpu-memory-utilization=0.3)
[[ $VLLM == 1 ]] || EVAL_VLLM=()
step train_tiny 300 $PY -m torch.distributed.run --standalone --nproc-per-node 1 remote/train.py \
    --target "$WORK/tiny" --data "$WORK/chat.jsonl" --out "$WORK/run" --steps 200 --lr 1e-2 --ttt-steps 3 \
    --optimizer muon --batch-tokens 2048 --val-fraction 0.1 --eval-every 100 --time-budget 600 "${EVAL_VLLM[@]}"
[[ $VLLM == 1 && -f "$WORK/run/evals.jsonl" ]] && $PY -c 'import json,sys; e=[json.loads(l) for l in open(sys.argv[1])]; print(json.dumps({"step": "a: vLLM beside NCCL training (predicted vs measured AL)", "ok": all("measured_al" in x for x in e), "evals": [{k: x.get(k) for k in ("step", "val_sim_al", "measured_al", "measured_error")} for x in e]}))' "$WORK/run/evals.jsonl" >> "$ROWS"
$PY remote/train.py --plan --target bench/kimi-k2 --states - --gpus 8 > "$WORK/plan.txt" && head -1 "$WORK/plan.txt" \
    | $PY -c 'import json,sys; p=json.load(sys.stdin); print(json.dumps({"step": "plan: Kimi-K2 on 8 of this GPU", "ok": p["fits"], "batch_tokens": p["batch_tokens"], "peak_gb": p["peak_gb"], "tokens_per_s": p["tokens_per_s"]}))' >> "$ROWS"

# 4. (b) extraction through vLLM with the stock connector
rm -rf "$WORK/extract"
[[ $VLLM == 1 ]] && step extract 300 $PY bench/gpu_check.py serve-extract "$WORK/kimi" "$WORK/chat.jsonl" "$WORK/extract"

# 5. (c) acceptance in vLLM at temperature 0 and 0.7
[[ $VLLM == 1 ]] && step eval 300 $PY remote/eval.py --target "$WORK/tiny" --draft "$WORK/run/draft" --prompts "$WORK/prompts.jsonl" \
    --n 30 --temperature 0 --temperature 0.7 --max-model-len 1024 --json "$WORK/eval.json" \
    --vllm-arg=--gpu-memory-utilization=0.3
[[ -f "$WORK/eval.json" ]] && $PY -c 'import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps({"step": "c: eval (AL per temperature)", "ok": True, "speedup": r.get("speedup"), "runs": [{k: x.get(k) for k in ("temperature", "acceptance_length", "per_position")} for x in r.get("runs", [])]}))' "$WORK/eval.json" >> "$ROWS"

echo
$PY - "$ROWS" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for r in rows:
    rest = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("step", "ok", "log", "error") and v is not None)
    print(f"{ {True: 'ok  ', False: 'FAIL', None: 'NOT RUN'}[r.get('ok')]}  {r['step']:<40} {rest}")
sys.exit(0 if all(r.get("ok") is not False for r in rows) else 1)
EOF
table=$?
exit $(( failed || table ))
