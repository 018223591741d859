"""A stand-in for a vLLM server where a real one cannot run (inside the nspawn machine, in benchmarks).

It takes vLLM's command line (either `python -m vllm.entrypoints.openai.api_server --model M ...`
or `vllm serve M ...`), prints vLLM's startup log lines (shard progress with \\r, weights loaded,
engine init, server start), then answers /health, /v1/models (bearer VLLM_API_KEY from the
environment, like vLLM) and /metrics. SIGTERM ends it. Stdlib only: any python3 runs it.

Install it as a host's "venv" with :func:`install_shim`. Knobs, from the environment (the
inventory's `env`, so they travel through the rendered env file like any vLLM setting):
  STANDIN_LOAD_S     seconds of "loading" before it listens (default 1)
  STANDIN_DIE_AT_S   exit 1 this many seconds after starting (to test death detection)
  STANDIN_RECORD     write {"argv", "pid", "has_api_key", "cwd", "hf_hub_offline"} here as JSON (never the key)
  STANDIN_READY_FILE write time.time() here the moment /v1/models can answer
  STANDIN_DIED_FILE  write time.time() here just before dying on STANDIN_DIE_AT_S
"""
import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).resolve()


def install_shim(venv_dir, python="/usr/bin/python3") -> None:
    """Make ``venv_dir/bin/python`` and ``venv_dir/bin/vllm`` start this stand-in."""
    bin_dir = Path(venv_dir) / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ("python", "vllm"):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {python} {HERE} "$@"\n')
        shim.chmod(0o755)


def log(msg):
    print(f"(APIServer pid={os.getpid()}) INFO {time.strftime('%m-%d %H:%M:%S')} [standin.py] {msg}", flush=True)


def parse(argv):
    if argv[:1] == ["-m"]:
        argv = argv[2:]
    elif argv[:1] == ["serve"]:
        argv = ["--model", argv[1]] + argv[2:]
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name")
    p.add_argument("--max-model-len", type=int, default=4096)
    args, _unknown = p.parse_known_args(argv)
    return args


def main():
    started = time.time()
    args = parse(sys.argv[1:])
    name = args.served_model_name or args.model
    key = os.environ.get("VLLM_API_KEY")
    if os.environ.get("STANDIN_RECORD"):
        Path(os.environ["STANDIN_RECORD"]).write_text(json.dumps(
            {"argv": sys.argv[1:], "pid": os.getpid(), "has_api_key": bool(key), "cwd": os.getcwd(),
             "hf_hub_offline": os.environ.get("HF_HUB_OFFLINE")}))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    die_at = os.environ.get("STANDIN_DIE_AT_S")
    if die_at:
        threading.Thread(target=die_later, args=(started + float(die_at),), daemon=True).start()

    log(f"Initializing a V1 LLM engine (stand-in) with config: model='{args.model}'")
    log(f"Starting to load model {args.model}...")
    load_s, shards = float(os.environ.get("STANDIN_LOAD_S", "1")), 4
    for k in range(shards + 1):
        sys.stderr.write(f"\rLoading safetensors checkpoint shards: {100 * k // shards:3d}% Completed | {k}/{shards} "
                         f"[00:00<00:00]")
        sys.stderr.flush()
        if k < shards:
            time.sleep(load_s / shards)
    sys.stderr.write("\n")
    log(f"Loading weights took {load_s:.2f} seconds")
    log("init engine (profile, create kv cache, warmup model) took 0.01 s")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                return self.answer(200, b"", "text/plain")
            if self.path == "/metrics":
                return self.answer(200, f'vllm:num_requests_running{{model_name="{name}"}} 0.0\n'.encode(),
                                   "text/plain")
            if self.path == "/v1/models":
                if key and self.headers.get("Authorization") != f"Bearer {key}":
                    return self.answer(401, b'{"error": "Unauthorized"}')
                body = {"object": "list", "data": [{"id": name, "object": "model", "root": args.model,
                                                    "max_model_len": args.max_model_len}]}
                return self.answer(200, json.dumps(body).encode())
            self.answer(404, b'{"detail": "Not Found"}')

        def answer(self, code, body, ctype="application/json"):
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    log(f"Starting vLLM server on http://{args.host}:{args.port}")
    if os.environ.get("STANDIN_READY_FILE"):
        Path(os.environ["STANDIN_READY_FILE"]).write_text(repr(time.time()))
    print("INFO:     Application startup complete.", flush=True)
    server.serve_forever()


def die_later(when):
    time.sleep(max(0.0, when - time.time()))
    if os.environ.get("STANDIN_DIED_FILE"):
        Path(os.environ["STANDIN_DIED_FILE"]).write_text(repr(time.time()))
    print("ERROR stand-in: simulated crash (STANDIN_DIE_AT_S)", flush=True)
    os._exit(1)


if __name__ == "__main__":
    main()
