"""`inv generate`, `inv extract`, `inv train`, `inv eval`: the GPU work, launched on hosts as detached runs.

Each job is an argv for a script in ``remote/`` (deployed to ``<workdir>/code``), built per
host from its inventory settings and started through :mod:`specops.runs`, so every job has
the same run directory, logs, status, stop and pull. A run's outputs land in its run
directory (``--out .``), which is how a later job names them: ``inv train --data RUN``
reads ``runs/RUN/data.jsonl``; ``inv train --states RUN`` reads the shards of an extract run;
``inv eval --draft RUN`` loads ``runs/RUN/draft``.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from . import artifacts, fanout, runs, service, urls, watch
from .errors import SpecopsError
from .host import Session, quote
from .servicefiles import Layout

DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
TORCHRUN_PORT = 29517


def code(session: Session, rel: str) -> str:
    return f"{session.workdir}/code/{rel}"


def script(session: Session, name: str) -> list[str]:
    return [session.venv_python, code(session, f"remote/{name}")]


def endpoint_url(session: Session) -> str:
    """The host's own vLLM, as seen from the host (jobs run there, next to it)."""
    return urls.server_url(session.host.bind, session.host.port)


def model_path(session: Session) -> str:
    if not session.host.model:
        raise SpecopsError(f"{session.host.name}: no `model` in the inventory for this host", exit_code=2)
    return session.path(session.host.model)


def trust_remote_code(session: Session) -> list[str]:
    """Scripts that read the checkpoint (tokenizer, config) trust its own code when the host's vLLM does."""
    return ["--trust-remote-code"] if "--trust-remote-code" in session.host.vllm_args else []


def dataset_arg(session: Session, dataset: str) -> str:
    """A relative data file is one the project ships (deployed under code/); anything else is a
    host path or a hub dataset name, passed as is."""
    if dataset.endswith(DATA_FILE_SUFFIXES) and not dataset.startswith(("/", "~")):
        return code(session, dataset)
    return session.path(dataset) if dataset.startswith("~") else dataset


def run_output(session: Session, value: str, leaf: str) -> str:
    """``RUN`` (a run id) → ``<workdir>/runs/RUN/<leaf>``; a path stays a path."""
    if "/" not in value and not value.endswith(DATA_FILE_SUFFIXES):
        return f"{runs.run_dir(session, runs.check_run_id(value))}/{leaf}"
    return session.path(value)


# ---------------------------------------------------------------- generate

def generate(hosts, *, n=None, dataset=None, name=None, resume=False, follow=False, extra=(), on=None,
             out=None) -> tuple[str | None, int]:
    """Check each host's server and dataset, then start one sharded generate run per host."""
    extra = list(extra)

    def args(session: Session) -> list[str]:
        a = ["--endpoint", endpoint_url(session), "--model", service.served_name(session)]
        if dataset:
            a += ["--dataset", dataset_arg(session, dataset)]
        return a + (["--n", str(n)] if n else [])

    def preflight(session: Session) -> dict:
        # like the run itself, read the key from the service's env file (never a command line)
        argv = script(session, "generate.py") + args(session) + ["--out", "/nonexistent", "--check"]
        env_file = Layout(session.workdir).env_file
        r = session.sh(f"set -a; [ -r {quote(env_file)} ] && . {quote(env_file)}; set +a; exec {shlex.join(argv)}",
                       check=False, timeout=300)
        if not r.ok:
            why = (r.stderr.strip() or r.stdout.strip() or f"exit {r.exit_code}").splitlines()[-1]
            raise SpecopsError(f"{session.host.name}: not ready to generate: {why}")
        return {}

    checked = fanout.each(hosts, preflight)
    if any(not o.ok for o in checked):
        return None, fanout.report(checked, out=out)
    run_id, rc = runs.launch_on(hosts, "generate", lambda s, i, k: script(s, "generate.py") + args(s)
                                + ["--out", ".", *extra], name=name, resume=resume, shard=True, on=on, out=out)
    if rc == 0 and follow:
        rc = watch.logs(hosts, run_id, follow=True, lines=5, out=out)
    return run_id, rc


# ---------------------------------------------------------------- extract

def extract(hosts, *, data, layers=None, scratch_gb=None, stream=False, name=None, resume=False, follow=False,
            extra=(), on=None, out=None) -> tuple[str | None, int]:
    """Target hidden states from the host's own vLLM (served with ``inv serve --extract``) into shards.

    Runs on the serving host: vLLM writes per-request files there, which the run packs and removes.
    """
    if not data:
        raise SpecopsError("--data RUN (a generate run id) or a data.jsonl path is required", exit_code=2)
    if len(hosts) != 1:
        raise SpecopsError(f"extract runs on one serving host; --on selects {len(hosts)}", exit_code=2)

    def argv(session: Session, index: int, count: int) -> list[str]:
        a = ["--endpoint", endpoint_url(session), "--model", service.served_name(session),
             "--storage", Layout(session.workdir).states_dir, "--target", model_path(session), "--out", "."]
        for d in data:
            a += ["--data", run_output(session, d, "data.jsonl")]
        a += (["--layers", layers] if layers else []) + (["--scratch-gb", str(scratch_gb)] if scratch_gb else [])
        return script(session, "extract.py") + a + (["--stream"] if stream else []) + trust_remote_code(session) \
            + list(extra)

    run_id, rc = runs.launch_on(hosts, "extract", argv, name=name, resume=resume, on=on, out=out)
    if rc == 0 and follow:
        rc = watch.logs(hosts, run_id, follow=True, lines=5, out=out)
    return run_id, rc


# ---------------------------------------------------------------- train

def train(hosts, *, data, steps=None, epochs=None, name=None, resume=False, follow=False, gpus=0, extra=(),
          on=None, out=None, states=None, stream=False) -> tuple[str | None, int]:
    """One training run; several hosts = one torchrun job across them (rank i = host i).

    ``states``: an extract run (or a directory on the host) whose shards replace the online
    target; ``stream``: consume them while the extraction is still writing them."""
    if not data:
        raise SpecopsError("--data RUN (a generate run id) or a data.jsonl path is required", exit_code=2)
    if stream and not states:
        raise SpecopsError("--stream goes with --states EXTRACT_RUN", exit_code=2)
    master = hosts[0].address if not hosts[0].is_local else "127.0.0.1"

    def argv(session: Session, index: int, count: int) -> list[str]:
        a = ["--target", model_path(session), "--out", "."]
        for d in data:
            a += ["--data", run_output(session, d, "data.jsonl")]
        if states:
            a += ["--states", run_output(session, states, ".")] + (["--stream"] if stream else [])
        a += (["--steps", str(steps)] if steps else []) + (["--epochs", str(epochs)] if epochs else [])
        a += trust_remote_code(session)
        if count == 1 and not gpus:
            return script(session, "train.py") + a + list(extra)
        launcher = [session.venv_python, "-m", "torch.distributed.run", f"--nnodes={count}",
                    f"--node-rank={index}", f"--nproc-per-node={gpus or 1}", f"--master-addr={master}",
                    f"--master-port={TORCHRUN_PORT}"]
        return launcher + [code(session, "remote/train.py")] + a + list(extra)

    run_id, rc = runs.launch_on(hosts, "train", argv, name=name, resume=resume, on=on, out=out)
    if rc == 0 and follow:
        rc = watch.logs(hosts, run_id, follow=True, lines=5, out=out)
    return run_id, rc


# ---------------------------------------------------------------- eval

def evaluate(hosts, *, draft, prompts="examples/prompts.jsonl", n=100, k=3, name=None, dest="artifacts", extra=(),
             on=None, out=None) -> tuple[str | None, int, dict]:
    """Measure a draft's acceptance length on each host's own target; waits, pulls, prints the report."""
    out = out or sys.stdout

    def argv(session: Session, index: int, count: int) -> list[str]:
        host = session.host  # eval's servers are started like the host's own: parallelism, context, vllm_args
        shape = (["--tensor-parallel-size", str(host.tp)] if host.tp > 1 else []) + [str(a) for a in host.vllm_args]
        return script(session, "eval.py") + [
            "--target", model_path(session), "--draft", run_output(session, draft, "draft"),
            "--prompts", dataset_arg(session, prompts), "--n", str(n), "--k", str(k), "--json", "report.json",
            *(["--max-model-len", str(host.max_model_len)] if host.max_model_len else []),
            *[f"--vllm-arg={a}" for a in shape], *extra]

    run_id, rc = runs.launch_on(hosts, "eval", argv, name=name, on=on, out=out)
    if rc:
        return run_id, rc, {}
    rc = watch.logs(hosts, run_id, follow=True, lines=5, out=out)
    rc = max(rc, artifacts.pull(hosts, run_id, dest=dest, out=out))
    reports = {}
    for host in hosts:
        path = Path(dest) / run_id / host.name / "report.json"
        if path.exists():
            reports[host.name] = json.loads(path.read_text())
    fanout.print_table([{"host": h, "acceptance_length": r.get("acceptance_length"),
                         "per_position": " ".join(f"{p:.2f}" for p in r.get("per_position", [])),
                         "tokens_per_s": _fmt_tps(r.get("tokens_per_s")), "speedup": r.get("speedup")}
                        for h, r in reports.items()], out=out)
    return run_id, rc, reports


def _fmt_tps(value) -> str:
    if isinstance(value, dict):
        return " / ".join(f"{k} {v:.0f}" for k, v in value.items() if isinstance(v, (int, float)))
    return "-" if value is None else str(value)
