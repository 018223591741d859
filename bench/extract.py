#!/usr/bin/env python3
"""Extraction throughput against plain prefill, and what the states cost on disk.

    python bench/extract.py --target MODEL_DIR --data FILE [--rows 300] [--concurrency 16]
        [--vllm-kwargs JSON] [--layers a,b,c]

Baseline, measured in the same run on the same machine: the same samples, rendered the same
way, sent to a plain vllm.LLM as prompt-only requests (max_tokens 1), in the same groups of
--concurrency. Then the same with extract_hidden_states + the connector (vLLM's own cost:
the files are written, never read), and remote/extract.py end to end (files read and
removed, bf16 shards written and fsynced). Each runs in its own process; the figures
exclude engine start-up. Prints tokens/s for both, their ratio, bytes/token, and
the disk that 10k samples x 8k tokens need on a 7168-wide target (3 aux layers + L), with
and without --stream.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REMOTE = ROOT / "remote"
CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}

PREFILL = """
import json, sys, time
sys.path.insert(0, {remote!r})
import extract

def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    args = extract.parse_args({argv!r})
    samples, _ = extract.render_samples(args.target, args)
    configs = {{}}
    if {connector!r}:  # the engine with extract_hidden_states + the connector writing files (left unread)
        from vllm.platforms import current_platform
        aux, layers = extract.layer_ids(extract.text_config(args.target), args.layers)
        configs = extract.vllm_configs(layers, {storage!r}, cpu=current_platform.is_cpu())
    llm = LLM(model=args.target, **configs, **args.vllm_kwargs)
    params = SamplingParams(max_tokens=1, temperature=0)
    start = time.monotonic()
    for i in range(0, len(samples), args.concurrency):
        llm.generate([TokensPrompt(prompt_token_ids=s.ids.tolist()) for s in samples[i:i + args.concurrency]],
                     params, use_tqdm=False)
    print("PREFILL", json.dumps({{"tokens": sum(len(s.ids) for s in samples), "s": time.monotonic() - start}}))

if __name__ == "__main__":
    main()
"""


def last_progress(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("specops-progress ")]
    return json.loads(lines[-1].removeprefix("specops-progress "))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--layers")
    ap.add_argument("--vllm-kwargs", default=json.dumps({"dtype": "bfloat16", "enforce_eager": True,
                                                        "max_model_len": 2048}))
    args = ap.parse_args()
    env = {**os.environ, **(CPU_ENV if not os.path.exists("/dev/nvidia0") else {})}
    with tempfile.TemporaryDirectory(prefix="bench-extract-") as tmp:
        data = Path(tmp) / "data.jsonl"
        data.write_text("".join(Path(args.data).read_text().splitlines(keepends=True)[:args.rows]))
        common = ["--target", args.target, "--data", str(data), "--concurrency", str(args.concurrency),
                  "--vllm-kwargs", args.vllm_kwargs] + (["--layers", args.layers] if args.layers else [])

        def prefill_tok_s(connector: bool) -> float:
            script = PREFILL.format(remote=str(REMOTE), argv=common + ["--out", str(Path(tmp) / "unused")],
                                    connector=connector, storage=str(Path(tmp) / "requests"))
            r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                               cwd=tmp)
            if r.returncode:
                sys.exit(f"prefill (connector {connector}) failed:\n{r.stderr[-3000:]}")
            figures = json.loads(r.stdout.split("PREFILL ", 1)[1].splitlines()[0])
            return figures["tokens"] / figures["s"]

        plain = prefill_tok_s(False)
        engine = prefill_tok_s(True)

        out = Path(tmp) / "states"
        started = time.monotonic()
        r = subprocess.run([sys.executable, str(REMOTE / "extract.py"), *common, "--out", str(out)],
                           capture_output=True, text=True, env=env)
        if r.returncode:
            sys.exit(f"extraction failed:\n{r.stderr[-3000:]}")
        done = last_progress(r.stdout)
        plan = json.loads((out / "plan.json").read_text())
        on_disk = sum(p.stat().st_size for p in out.glob("shard-*.safetensors"))

    per_token = on_disk / plan["tokens"]
    big = (len(plan["aux_layer_ids"]) + 1) * 7168 * 2 + 9  # bytes/token: 3 aux layers + L, bf16, + ids and mask
    tokens = 10_000 * 8192
    shard = 64 * 8192 * big  # a 64-sample shard of 8k-token samples
    print(f"target {plan['target']}: {plan['samples']} samples, {plan['tokens']} tokens, layers {plan['layers']}, "
          f"hidden {plan['hidden_size']}")
    print(f"plain prefill                   {plain:10.1f} tokens/s")
    print(f"prefill + hidden-states writes  {engine:10.1f} tokens/s   ({engine / plain:.2f} of plain prefill)")
    print(f"extract.py end to end           {done['tok_s']:10.1f} tokens/s   ({done['tok_s'] / plain:.2f} of plain "
          f"prefill; files read, packed, fsynced; whole run incl. start-up {time.monotonic() - started:.0f} s)")
    print(f"bytes/token        {per_token:10.1f}   (planned {plan['bytes_per_token']}: "
          f"{len(plan['layers'])} layers x {plan['hidden_size']} x 2 + 9)")
    print(f"10k samples x 8k tokens on a 7168-wide target: {big} bytes/token -> {tokens * big / 1e12:.2f} TB "
          f"without --stream; with --stream the spool peaks at its --scratch-gb, which must hold epochs x one "
          f"shard (+ requests in flight): e.g. 64-sample shards = {shard / 1e9:.1f} GB each, 1 epoch -> "
          f"--scratch-gb {2 * shard / 1e9:.0f} holds one being trained on and one being written")


if __name__ == "__main__":
    main()
