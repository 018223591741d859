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

from . import deploy, fanout, group, pull, runs, serve, untrusted, urls, watch
from . import plan as plans
from .errors import SpecopsError
from .host import Session, connect, quote
from .service_spec import Layout
from .shared import layout, remote_module

TORCHRUN_PORT = 29517
EVAL = remote_module("job_specs").EVAL  # eval.py's --n and --k, as the host script defines them


def code(session: Session, rel: str) -> str:
    return layout.code_file(session.workdir, rel)


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
    """A relative path to a file this project ships is read from the deployed copy (code/); anything
    else is a host path or a hub dataset name, passed as is."""
    if not dataset.startswith(("/", "~")) and (deploy.PROJECT_ROOT / dataset).is_file():
        return code(session, dataset)
    return session.path(dataset) if dataset.startswith("~") else dataset


def is_run_id(value: str) -> bool:
    """``--data``/``--states`` name a run (an id: no '/' and no '.') or a path on the host."""
    return bool(runs.RUN_ID.match(value))


def run_output(session: Session, value: str, leaf: str) -> str:
    """``RUN`` (a run id) → ``<workdir>/runs/RUN/<leaf>``; a path stays a path."""
    if is_run_id(value):
        return f"{runs.run_dir(session, runs.check_run_id(value))}/{leaf}"
    return session.path(value)


# ---------------------------------------------------------------- generate

def generate_argv(session: Session, *, n=None, dataset=None, out=".", part=None, extra=()) -> list[str]:
    """remote/generate.py's command on this host; ``part``: its shard of the group's rows (the plan's, last,
    so it wins over one passed after ``--``)."""
    a = ["--endpoint", endpoint_url(session), "--model", serve.served_name(session)]
    a += (["--dataset", dataset_arg(session, dataset)] if dataset else []) + (["--n", str(n)] if n else [])
    a += ["--context-tokens", str(session.host.max_model_len)] if session.host.max_model_len else []
    return script(session, "generate.py") + a + ["--out", out, *extra] + (["--shard", part] if part else [])


NOTE = "generate: note: "  # a line remote/generate.py --check prints for the user to read at launch


def generate(hosts, *, n=None, dataset=None, name=None, resume=False, follow=False, extra=(), on=None,
             out=None) -> int:
    """Check each host's server and dataset, then start one sharded generate run per host."""

    def preflight(session: Session) -> dict:
        # like the run itself, read the key from the service's env file (never a command line)
        # a resume without --dataset checks the dataset the run recorded (its input.json), as the run reads it
        where = runs.run_dir(session, runs.check_run_id(name)) if resume and name else "/nonexistent"
        argv = generate_argv(session, n=n, dataset=dataset, out=where, extra=["--check"])
        env_file = Layout(session.workdir).env_file
        r = session.sh(shlex.join(["bash", code(session, "remote/with_env.sh"), env_file, *argv]), check=False,
                       timeout=300)
        if not r.ok:
            why = (r.stderr.strip() or r.stdout.strip() or f"exit {r.exit_code}").splitlines()[-1]
            raise SpecopsError(f"{session.host.name}: not ready to generate: {why}")
        notes = [line.removeprefix(NOTE) for line in r.stdout.splitlines() if line.startswith(NOTE)]
        for note in notes[:1]:  # said once per host, at launch (a short dataset: --n takes all of it)
            print(f"{session.host.name}: {untrusted.clean(note)[:300]}", file=out or sys.stdout, flush=True)
        return {}

    if resume and len(hosts) > 1:  # the group's recorded plan; rows of hosts that do not answer go to those that do
        hosts, plan = replan_generate(hosts, runs.check_run_id(name or ""), preflight, out=out)
    else:
        checked = fanout.each(hosts, preflight)
        if any(not o.ok for o in checked):
            return fanout.report(checked, out=out)
        plan = plans.first_plan([h.name for h in hosts])

    def argv(session: Session, index: int, count: int) -> list[str]:
        return generate_argv(session, n=n, dataset=dataset, part=plan.get(session.host.name), extra=extra)

    run_id, rc = runs.launch_on(hosts, "generate", argv, name=name, resume=resume, plan=plan, on=on, out=out)
    if rc == 0 and follow:
        rc = watch.logs(hosts, run_id, follow=True, lines=5, out=out)
    return rc


def replan_generate(hosts, run_id: str, preflight, out=None) -> tuple[list, dict]:
    """`inv generate --resume --on GROUP`: (hosts to relaunch, the run's new plan).

    The plan is the one the run recorded (meta.json, newest copy among the hosts that answer).
    A host that does not answer, or cannot generate now (its preflight fails), is gone: its rows
    are split among the answering hosts whose run has ended (:func:`specops.plan.replan`); a host
    whose run is still going keeps its rows and is left alone.
    """
    out = out or sys.stdout
    if not run_id:
        raise SpecopsError("--resume needs the run id to continue (--name RUN)", exit_code=2)
    states = fanout.each(hosts, runs.run_meta, run_id)
    answered = {o.host.name: o.row for o in states if o.ok}
    if not answered:
        fanout.report(states, out=out)
        raise SpecopsError(f"no host of {run_id} answers: nothing to resume", exit_code=1)
    newest = max(answered.values(), key=lambda r: r["meta"].get("started", ""))["meta"]
    plan = newest.get("plan") or plans.first_plan([h.name for h in hosts])
    running = [h for h, r in answered.items() if r["live"]]
    ready = {o.host.name for o in fanout.each([h for h in hosts if h.name in answered and h.name not in running],
                                             preflight) if o.ok}
    heirs = [h.name for h in hosts if h.name in ready and h.name in plan]
    gone = [h for h in plan if h not in ready and h not in running]
    new_plan = plans.replan({h: s for h, s in plan.items() if h not in running}, heirs) if heirs else {}
    if gone and not heirs:
        raise SpecopsError(f"{run_id}: {', '.join(gone)} cannot generate and no other host of the run is free to take "
                           f"their rows{' (still running: ' + ', '.join(running) + ')' if running else ''}",
                           exit_code=1)
    new_plan.update({h: plan[h] for h in running})
    for h in gone:
        print(f"re-planned: {h} does not answer or cannot generate; its rows ({plan[h]}) go to "
              f"{', '.join(f'{x} (now {new_plan[x]})' for x in heirs)}", file=out)
    for h in running:
        print(f"{h}: run {run_id} is still running; it keeps its rows ({plan[h]})", file=out)
    return [h for h in hosts if h.name in heirs], new_plan


# ---------------------------------------------------------------- extract

def extract_argv(session: Session, *, data, layers=None, scratch_gb=None, stream=False, extra=()) -> list[str]:
    """remote/extract.py's command on the serving host: its vLLM, the storage vLLM writes states to."""
    a = ["--endpoint", endpoint_url(session), "--model", serve.served_name(session),
         "--storage", Layout(session.workdir).states_dir, "--target", model_path(session), "--out", "."]
    for d in data:
        a += ["--data", run_output(session, d, layout.ROWS)]
    a += (["--layers", layers] if layers else []) + (["--scratch-gb", str(scratch_gb)] if scratch_gb else [])
    return script(session, "extract.py") + a + (["--stream"] if stream else []) + trust_remote_code(session) \
        + list(extra)


def extract(hosts, *, data, layers=None, scratch_gb=None, stream=False, name=None, resume=False, follow=False,
            extra=(), on=None, out=None) -> int:
    """Target hidden states from the host's own vLLM (served with ``inv serve --extract``) into shards.

    Runs on the serving host: vLLM writes per-request files there, which the run packs and removes.
    """
    if not data:
        data = [newest_generate_run(hosts[0], "extracting states for", out)]
    if len(hosts) != 1:
        raise SpecopsError(f"extract runs on one serving host; --on selects {len(hosts)}", exit_code=2)

    def argv(session: Session, index: int, count: int) -> list[str]:
        return extract_argv(session, data=data, layers=layers, scratch_gb=scratch_gb, stream=stream, extra=extra)

    run_id, rc = runs.launch_on(hosts, "extract", argv, name=name, resume=resume, on=on, out=out)
    if rc == 0 and follow:
        rc = watch.logs(hosts, run_id, follow=True, lines=5, out=out)
    return rc


# ---------------------------------------------------------------- train

def train_argv(session: Session, index: int, count: int, *, data, nproc: int, grouped: bool = False, states=None,
               stream=False, steps=None, epochs=None, eval_every=0, extra=(), master=None, port=TORCHRUN_PORT,
               run_id=None, rendezvous_timeout=group.RENDEZVOUS_TIMEOUT) -> list[str]:
    """remote/train.py's command on host ``index`` of ``count``: plain Python for one host without GPUs,
    torchrun with one process per GPU (``nproc``) otherwise, behind the master check in a group."""
    a = ["--target", model_path(session), "--out", "."]
    for d in data:
        a += ["--data", group.shipped_path(session, d) if grouped and is_run_id(d)
              else run_output(session, d, layout.ROWS)]
    if states:
        a += ["--states", run_output(session, states, ".")] + (["--stream"] if stream else [])
    a += (["--steps", str(steps)] if steps else []) + (["--epochs", str(epochs)] if epochs else [])
    if eval_every:
        a += ["--eval-every", str(eval_every)] + measure_beside_training(session.host)
    a += trust_remote_code(session) + list(extra)
    if count == 1 and not nproc:
        return script(session, "train.py") + a
    if grouped:
        return group.node_argv(session.venv_python, code(session, "remote/torchrun_node.py"),
                               code(session, "remote/train.py"), a, nnodes=count, node_rank=index,
                               nproc=nproc or 1, master_addr=master, master_port=port, run_id=run_id,
                               rendezvous_timeout=rendezvous_timeout)
    launcher = [session.venv_python, "-m", "torch.distributed.run", f"--nnodes={count}", f"--node-rank={index}",
                f"--nproc-per-node={nproc or 1}", f"--master-addr={master}", f"--master-port={port}"]
    return launcher + [code(session, "remote/train.py")] + a


def measure_beside_training(host) -> list[str]:
    """train.py's flags for measuring checkpoints in a vLLM beside training, shaped like the host's own
    server: always on a CPU host; on a GPU host only with the inventory's train_eval_gpu_share."""
    if host.flavor == "gpu" and not host.train_eval_gpu_share:
        return []
    share = [f"--gpu-memory-utilization={host.train_eval_gpu_share}"] if host.flavor == "gpu" else []
    return ["--eval-vllm"] + [f"--eval-arg={a}" for a in eval_server_args(host, share)]


def eval_server_args(host, vllm_extra=()) -> list[str]:
    """eval.py's flags that start its servers like the host's own (parallelism, context, vllm_args)."""
    shape = (["--tensor-parallel-size", str(host.tp)] if host.tp > 1 else []) + [str(a) for a in host.vllm_args]
    return [*([f"--max-model-len={host.max_model_len}"] if host.max_model_len else []),
            *[f"--vllm-arg={a}" for a in [*shape, *vllm_extra]]]


def train(hosts, *, data, steps=None, epochs=None, name=None, resume=False, follow=False, gpus=0, extra=(),
          on=None, out=None, states=None, stream=False, eval_every=0,
          rendezvous_timeout=group.RENDEZVOUS_TIMEOUT, dest=pull.ARTIFACTS) -> int:
    """One training run; several hosts = one torchrun job across them (node rank i = host i, host 0 the
    master; :mod:`specops.group`). A group trains on the generate runs' merged data, shipped to every node.

    ``states``: an extract run (or a directory on the host) whose shards replace the online
    target; ``stream``: consume them while the extraction is still writing them."""
    if not data:
        data = [newest_generate_run(hosts[0], "training on", out)]
    if stream and not states:
        raise SpecopsError("--stream goes with --states EXTRACT_RUN", exit_code=2)
    grouped = len(hosts) > 1  # one sample list for every rank: the merged data, shipped to every node
    if grouped:
        group.ship_data(hosts, [d for d in data if is_run_id(d)], dest=dest, out=out)
    checked = fanout.each(hosts, train_preflight, data=data, states=states, grouped=grouped)
    if any(not o.ok for o in checked):
        return fanout.report(checked, out=out)
    if grouped:
        with connect(hosts[0]) as master_session:
            port = group.free_port(master_session)
    master = group.master_address(hosts[0])

    def argv(session: Session, index: int, count: int) -> list[str]:
        return train_argv(session, index, count, data=data, nproc=gpus or host_gpu_count(session), grouped=grouped,
                          states=states, stream=stream, steps=steps, epochs=epochs, eval_every=eval_every,
                          extra=extra, master=master,
                          port=port if grouped else TORCHRUN_PORT, run_id=run_id,
                          rendezvous_timeout=rendezvous_timeout)

    run_id = runs.check_run_id(name or runs.new_run_id("train"))
    run_id, rc = runs.launch_on(hosts, "train", argv, name=run_id, resume=resume, on=on, out=out)
    if rc == 0 and follow:
        rc = watch.logs(hosts, run_id, follow=True, lines=5, out=out)
    return rc


def train_preflight(session: Session, *, data, states=None, grouped: bool = False) -> dict:
    """Before a GPU-hour is spent: the target is a model directory (its config.json), every --data
    file and the --states directory are on the host (one round trip). Without this a wrong path
    fails only inside the run, with a hint about another flag."""
    target = model_path(session)
    wanted = [("-f", f"{target}/config.json", None)]
    wanted += [("-f", group.shipped_path(session, d) if grouped and is_run_id(d)
                else run_output(session, d, layout.ROWS), d) for d in data]
    wanted += [("-d", run_output(session, states, "."), states)] if states else []
    script = "".join(f"[ {test} {quote(path)} ] || echo {i}\n" for i, (test, path, _) in enumerate(wanted))
    r = session.sh(script, check=False, timeout=60)
    missing = [int(x) for x in r.stdout.split() if x.isdigit() and int(x) < len(wanted)]
    if missing:
        raise SpecopsError(f"{session.host.name}: {_missing(*wanted[missing[0]], states)}; nothing was started")
    if not r.ok:
        raise SpecopsError(f"{session.host.name}: cannot check the model and data paths: {r.stderr.strip()}")
    return {}


def _missing(test: str, path: str, given: str | None, states: str | None) -> str:
    if given is None:
        return (f"the target model has no config.json at {path} (not a model directory, or not on this host): "
                f"set `model` in the inventory to the checkpoint's directory")
    if given == states and test == "-d":
        return f"--states {states}: no directory {path} on the host (an extract run id, or a directory of shards)"
    if is_run_id(given):
        return (f"--data {given}: no {path} on the host (no such run here, or not a generate run that wrote "
                f"data: inv status --run {given})")
    return f"--data {given}: no file {path} on the host"


# The runs on a host that ended with exit code 0 and were launched as generate runs, as "finished-at name".
_SUCCEEDED_GENERATE = """
cd {runs} 2>/dev/null || exit 0
for d in */; do d=${{d%/}}
  [ "$(cat "$d/{L.EXIT_CODE}" 2>/dev/null)" = 0 ] && grep -qF '"kind": "generate"' "$d/{L.META}" 2>/dev/null &&
    printf '%s %s\\n' "$(stat -c %Y "$d/{L.EXIT_CODE}")" "$d"
done
"""


def newest_generate_run(host, doing: str, out=None) -> str:
    """The data of a bare `inv train` (or extract): the host's newest generate run that succeeded, said at launch."""
    with connect(host) as session:
        listed = session.sh(_SUCCEEDED_GENERATE.format(L=layout, runs=quote(runs.runs_dir(session))), timeout=60).stdout
    found = [line.split(" ", 1) for line in listed.splitlines() if " " in line]
    found = [(int(t), rid) for t, rid in found if t.isdigit() and is_run_id(rid)]
    if not found:
        raise SpecopsError(f"{host.name}: no finished generate run to use: run `inv generate` first, or pass "
                           f"--data RUN (a generate run id) or a {layout.ROWS} path", exit_code=2)
    newest = max(found)[1]
    print(f"{doing} {newest}, the newest finished generate run on {host.name} (--data RUN picks another)",
          file=out or sys.stdout, flush=True)
    return newest


def host_gpu_count(session: Session) -> int:
    """The GPUs a run on this host gets: the inventory's `gpus` list, else what nvidia-smi lists (0: none)."""
    if session.host.gpus:
        return len([g for g in str(session.host.gpus).split(",") if g.strip()])
    r = session.sh("nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true", check=False)
    try:
        return int(r.stdout.strip() or 0)
    except ValueError:
        return 0


def train_plan(hosts, *, gpus=0, states=None, extra=(), out=None) -> int:
    """``inv train --plan``: remote/train.py --plan on each host (its model's config.json, its GPUs); prints
    each plan, exit 2 if any does not fit."""
    out = out or sys.stdout
    rc = 0
    for host in hosts:
        with connect(host) as session:
            argv = script(session, "train.py") + ["--plan", "--target", model_path(session)]
            n = gpus or host_gpu_count(session)
            argv += (["--gpus", str(n)] if n else []) + (["--states", "."] if states else [])
            r = session.run(argv + trust_remote_code(session) + list(extra), check=False, timeout=600)
        print(f"== {host.name}", file=out)
        print((r.stdout + r.stderr).rstrip(), file=out)
        rc = max(rc, r.exit_code)
    return rc


# ---------------------------------------------------------------- eval

def eval_argv(session: Session, *, draft, prompts="examples/prompts.jsonl", n=EVAL["n"].default,
              k=EVAL["k"].default, extra=()) -> list[str]:
    """remote/eval.py's command; its servers are started like the host's own (eval_server_args)."""
    return script(session, "eval.py") + [
        "--target", model_path(session), "--draft", run_output(session, draft, layout.DRAFT),
        "--prompts", dataset_arg(session, prompts), "--n", str(n), "--k", str(k), "--json", layout.REPORT_JSON,
        *eval_server_args(session.host), *extra]


def evaluate(hosts, *, draft, prompts="examples/prompts.jsonl", n=EVAL["n"].default, k=EVAL["k"].default, name=None,
             dest=pull.ARTIFACTS, extra=(), on=None, out=None) -> int:
    """Measure a draft's acceptance length on each host's own target; waits, pulls, prints the report."""
    out = out or sys.stdout

    def argv(session: Session, index: int, count: int) -> list[str]:
        return eval_argv(session, draft=draft, prompts=prompts, n=n, k=k, extra=extra)

    run_id, rc = runs.launch_on(hosts, "eval", argv, name=name, on=on, out=out)
    if rc:
        return rc
    rc = watch.logs(hosts, run_id, follow=True, lines=5, out=out)
    rc = max(rc, pull.pull(hosts, run_id, dest=dest, out=out))
    reports = {}
    for host in hosts:
        path = Path(dest) / run_id / host.name / layout.REPORT_JSON
        if path.exists():
            reports[host.name] = json.loads(path.read_text())
    fanout.print_table([{"host": h, "acceptance_length": r.get("acceptance_length"),
                         "delivered_length": r.get("delivered_length"),
                         "per_position": " ".join(f"{p:.2f}" for p in r.get("per_position", [])),
                         "tokens_per_s": _fmt_tps(r.get("tokens_per_s")), "speedup": r.get("speedup")}
                        for h, r in reports.items()], out=out)
    return rc


def _fmt_tps(value) -> str:
    if isinstance(value, dict):
        return " / ".join(f"{k} {v:.0f}" for k, v in value.items() if isinstance(v, (int, float)))
    return "-" if value is None else str(value)
