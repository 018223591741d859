#!/usr/bin/env python3
"""Which data makes the better draft: the target's own regenerated answers, or the dataset's?

    python bench/draft_data.py --target MODEL_DIR --regenerated GEN_DIR --original PROMPTS.jsonl \
        --heldout HELDOUT.jsonl [--out DIR] [-- extra train.py args]

Trains two drafts with the same budget (same train.py arguments, steps and seed): one on
generate's data.jsonl (the model's reasoning and answers), the baseline on the prompt file's
own "gpt" answers; then measures each one's acceptance length in a real vLLM (remote/eval.py,
greedy, held-out prompts) and prints both with their ratio.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REMOTE = Path(__file__).resolve().parent.parent / "remote"
RECIPE = ["--steps", "300", "--lr", "1e-2", "--batch-tokens", "2048", "--ttt-steps", "3", "--warmup", "0.05"]


def run(script, *args):
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    result = subprocess.run([sys.executable, str(REMOTE / script), *map(str, args)], env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{script} failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return result


def train_and_eval(name, data, args, out):
    run("train.py", "--target", args.target, "--data", data, "--out", out / name, *RECIPE, *args.extra)
    last = json.loads((out / name / "metrics.jsonl").read_text().splitlines()[-1])
    run("eval.py", "--target", args.target, "--draft", out / name / "draft", "--prompts", args.heldout,
        "--n", args.n, "--temperature", "0", "--no-baseline", "--max-model-len", "512", "--json", out / f"{name}.json")
    report = json.loads((out / f"{name}.json").read_text())
    return {"data": name, "train_loss": last["loss"], "train_sim_al": last["sim_al"],
            "acceptance_length": report["acceptance_length"], "per_position": report["per_position"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--regenerated", required=True, help="generate's output directory (data.jsonl)")
    ap.add_argument("--original", required=True, help="the prompt file with the dataset's own answers")
    ap.add_argument("--heldout", required=True, help="prompts neither draft trained on")
    ap.add_argument("--n", type=int, default=40, help="held-out prompts to evaluate on")
    ap.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    ap.add_argument("extra", nargs="*", help="more train.py arguments (after --)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="draft-data-"))
    rows = [train_and_eval("original", args.original, args, out), train_and_eval("regenerated", args.regenerated, args, out)]
    for row in rows:
        print(json.dumps(row), flush=True)
    print(f"acceptance length regenerated / original: "
          f"{rows[1]['acceptance_length'] / rows[0]['acceptance_length']:.3f} "
          f"({rows[1]['acceptance_length']} vs {rows[0]['acceptance_length']}); runs in {out}", flush=True)


if __name__ == "__main__":
    main()
