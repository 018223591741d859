"""bench/gpu_check.sh before a GPU is spent on it: --prepare builds the carried inputs on this CPU (a few MB,
within the lent machine's 64 MiB), and --dry-run checks every step's files and flags against the parsers
that will read them (a renamed train.py flag fails here, not on the GPU), within the 8-minute budget."""
import os
import subprocess

from tests.helpers.fixtures_train import ROOT


def test_prepare_then_dry_run(tiny_model, tmp_path):
    env = {**os.environ, "SPECOPS_TINY_MODEL": str(tiny_model)}
    inputs = tmp_path / "inputs"
    prepared = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--prepare", str(inputs)],
                              capture_output=True, text=True, timeout=300, env=env)
    assert prepared.returncode == 0, prepared.stdout[-2000:] + prepared.stderr[-2000:]
    size = sum(p.stat().st_size for p in inputs.rglob("*") if p.is_file())
    assert size < 16 * 2**20
    dry = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", str(inputs)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert dry.returncode == 0 and dry.stdout.splitlines()[-1] == "dry run: ok", dry.stdout + dry.stderr
    assert "total: at most" in dry.stdout
    assert "PROBLEM" not in dry.stdout
