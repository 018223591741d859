#!/usr/bin/env python3
"""Which data makes the better draft: the target's own regenerated answers, or the dataset's?

    .venv/bin/python bench/draft_data.py --target MODEL_DIR --regenerated DATA.jsonl --original PROMPTS.jsonl \
        [--seed S] [--out DIR] [-- more train.py args]

Trains two drafts with the demo's recipe and budget (specops/demo.py: the same train.py arguments,
seconds of steps and seed): one on generate's data.jsonl (the model's reasoning and answers), the
baseline on the prompt file's own answers. Both files are first cut to the rows they share, in the
prompt file's order, so both runs hold out the same prompts. Each draft is then measured in a real
vLLM on those prompts, against what the target itself answers there (train.py --eval-vllm, greedy,
the local inventory host's server flags), and the two are printed with their ratio.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from specops import inventory  # noqa: E402
from specops.demo import HELD_OUT_ROWS, TINY_DRAFT_RECIPE, TRAIN_BUDGET_S, TRAIN_STEPS  # noqa: E402
from specops.jobs import eval_server_args  # noqa: E402


def shared_rows(original: Path, regenerated: Path, out: Path) -> int:
    """Both files cut to the ids they share, in the original's order; returns how many rows."""
    by_id = {json.loads(line)["id"]: line for line in regenerated.open() if line.strip()}
    kept_original, kept_regenerated = [], []
    for line in original.open():
        if line.strip() and (row_id := json.loads(line)["id"]) in by_id:
            kept_original.append(line)
            kept_regenerated.append(by_id[row_id])
    (out / "original.jsonl").write_text("".join(kept_original))
    (out / "regenerated.jsonl").write_text("".join(kept_regenerated))
    return len(kept_original)


def train_and_measure(name: str, rows: int, args, out: Path) -> dict:
    host = inventory.load(ROOT / "inventory.yaml").select("local")[0]
    argv = [sys.executable, str(ROOT / "remote" / "train.py"), "--target", args.target,
            "--data", str(out / f"{name}.jsonl"), "--out", str(out / name), *TINY_DRAFT_RECIPE,
            "--steps", str(TRAIN_STEPS), "--time-budget", str(TRAIN_BUDGET_S),
            "--val-fraction", str(HELD_OUT_ROWS / rows), "--eval-n", str(HELD_OUT_ROWS), "--seed", str(args.seed),
            "--eval-vllm", *[f"--eval-arg={a}" for a in eval_server_args(host)], "--no-tensorboard", *args.extra]
    with open(out / f"{name}.log", "w") as log:
        if subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"train.py on the {name} data failed: see {out / f'{name}.log'}")
    evals = [json.loads(line) for line in (out / name / "evals.jsonl").read_text().splitlines()]
    best = [e for e in evals if e.get("kept")][-1]
    return {"data": name, "step": best["step"], "train_s": best["train_s"], "predicted_al": best["val_sim_al"],
            "measured_al": best["measured_al"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the model directory that generated --regenerated")
    ap.add_argument("--regenerated", required=True, type=Path, help="generate's data.jsonl")
    ap.add_argument("--original", required=True, type=Path, help="the prompt file with the dataset's own answers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    ap.add_argument("extra", nargs="*", help="more train.py arguments (after --)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="draft-data-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = shared_rows(args.original, args.regenerated, out)
    if rows <= HELD_OUT_ROWS:
        sys.exit(f"only {rows} rows are in both files: need more than the {HELD_OUT_ROWS} held out")
    results = [train_and_measure(name, rows, args, out) for name in ("original", "regenerated")]
    for result in results:
        print(json.dumps(result), flush=True)
    original, regenerated = (r["measured_al"] for r in results)
    print(f"acceptance length measured in vLLM, regenerated / original: {regenerated / original:.3f} "
          f"({regenerated} vs {original}; {rows} rows, {HELD_OUT_ROWS} held out; runs in {out})", flush=True)


if __name__ == "__main__":
    main()
