"""specops tasks: flags in, one call to specops, a clear result out.  `inv --list`."""

import specops.deploy
import specops.deps
import specops.pull
import specops.serve
import specops.tunnel
from specops import demo as demo_mod, facts, fanout, group, inventory as inventory_mod, jobs, reports, runs, watch
from specops.cli import HOST_HELP, remainder, select_hosts, task
from specops.shared import layout


@task(help={**HOST_HELP, "json": "print JSON instead of a table"})
def hosts(c, on=None, inventory=None, json=False):
    """Check each host: reachable, OS, Python, free disk, GPUs, systemd, tmux, rsync."""
    return fanout.report(fanout.each(select_hosts(c, inventory, on), facts.probe), as_json=json)


@task(help={**HOST_HELP, "dry_run": "list what would change, change nothing",
            "delete": f"remove stale files inside <workdir>/{layout.CODE} (never {layout.RUNS}/ or {layout.DATA}/)",
            "deps": "check the host's venv afterwards (--no-deps to skip)"})
def deploy(c, on=None, inventory=None, dry_run=False, delete=True, deps=True):
    """Sync remote/, templates/, requirements/, examples/ to <workdir>/code (rsync; SFTP fallback)."""
    return specops.deploy.on_hosts(select_hosts(c, inventory, on), dry_run=dry_run, delete=delete, check_deps=deps)


@task(help={**HOST_HELP, "fix": "install what is missing or mismatched, then re-check"})
def deps(c, on=None, inventory=None, fix=False):
    """Check each host's venv (<workdir>/venv) against requirements/: packages, pip check, imports, GPUs."""
    return specops.deps.on_hosts(select_hosts(c, inventory, on), fix=fix)


RUN_HELP = "run id (as printed at launch; `inv status` lists them)"
# Invoke has no optional positional arguments: RUN is positional where it is required (logs, stop)
# and --run where it is optional (status, pull). `--run RUN` works for all four.


@task(help={**HOST_HELP, "run": RUN_HELP + "; default: the newest runs and all live ones",
            "last": "how many of the newest runs to list per host", "json": "print JSON instead of tables"})
def status(c, run=None, on=None, inventory=None, last: int = 10, json=False):
    """Per host: vLLM service, GPU use, and each run's state, age and latest progress line."""
    return watch.status(select_hosts(c, inventory, on), run, last=last, as_json=json)


@task(help={**HOST_HELP, "run": RUN_HELP, "lines": "how many last lines to show first",
            "follow": "keep printing until the run ends (Ctrl-C stops following, never the run)"})
def logs(c, run, on=None, inventory=None, follow=False, lines: int = 50):
    """A run's log from every selected host that has it (lines prefixed by host when several)."""
    return watch.logs(select_hosts(c, inventory, on), run, lines=lines, follow=follow)


@task(help={**HOST_HELP, "run": RUN_HELP, "grace": "seconds after SIGINT before SIGTERM (and after SIGTERM)"})
def stop(c, run, on=None, inventory=None, grace: float = 30):
    """Stop a run: SIGINT to its process group, SIGTERM after a grace period; exit code recorded, outputs kept."""
    return runs.stop_on(select_hosts(c, inventory, on), run, grace=grace)


@task(help={**HOST_HELP, "run": RUN_HELP + "; default: the newest run",
            "dest": "local directory for artifacts/<run-id>/<host>/"})
def pull(c, run=None, on=None, inventory=None, dest=specops.pull.ARTIFACTS):
    """Copy a run home from each host (rsync, resumable; SFTP fallback), verify its manifest, merge shards."""
    return specops.pull.pull(select_hosts(c, inventory, on), run, dest=dest)


@task(help={**HOST_HELP, "run": RUN_HELP, "dest": "local directory for artifacts/<run-id>/<host>/"})
def report(c, run, on=None, inventory=None, dest=specops.pull.ARTIFACTS):
    """Print the local path of the run's report.html (plots, self-contained), pulling the run first if needed."""
    return reports.locate(select_hosts(c, inventory, on), run, dest=dest)


@task(help={**HOST_HELP, "wait": "wait until /v1/models lists the model, showing the startup's progress",
            "timeout": "seconds --wait waits before giving up (exit 124); vLLM keeps starting",
            "restart": "restart even if the unit and env file are unchanged",
            "supervisor": "systemd or tmux (default: inventory `supervisor`, else the last used, else detect)",
            "stop": "stop the service (systemd: also disable it)",
            "status": "state, pid, uptime, model, /health, requests running",
            "logs": "print the service log (journalctl or the tmux log)",
            "follow": "with --logs: keep printing until Ctrl-C (which never stops the service)",
            "lines": "with --logs: how many last lines", "json": "print JSON instead of a table",
            "extract": "extraction mode: vLLM also writes the trainer's aux + last layer states (for `inv extract`)",
            "layers": "with --extract: aux layer ids a,b,c in vLLM's convention (default: the trainer's)"})
def serve(c, on=None, inventory=None, wait=False, timeout: float = 3600, restart=False, supervisor=None, stop=False,
          status=False, logs=False, follow=False, lines: int = 100, json=False, extract=False, layers=None):
    """Run vLLM as a supervised service (systemd, or tmux where there is none); idempotent."""
    return specops.serve.on_hosts(select_hosts(c, inventory, on), wait=wait, timeout=timeout, restart=restart,
                                 supervisor=supervisor, stop_service=stop, show_status=status, show_logs=logs,
                                 follow=follow, lines=lines, as_json=json, extract=extract, layers=layers)


@task(help={"on": "the host whose vLLM to reach", "inventory": HOST_HELP["inventory"],
            "local_port": "local port to listen on (default: the same as the remote port)",
            "remote_port": "the host's loopback port to reach (default: its vLLM's; e.g. 6006 for a TensorBoard)"})
def tunnel(c, on=None, inventory=None, local_port: int = None, remote_port: int = None):
    """Forward a local port to a host's 127.0.0.1 vLLM port over SSH and print the base URL; Ctrl-C closes."""
    return specops.tunnel.forward(select_hosts(c, inventory, on), local_port=local_port, remote_port=remote_port)


RUN_NAME_HELP = {"name": "run id to use (default: <kind>-<UTC yyyymmdd-hhmmss>)",
                 "resume": "continue the finished run --name (the script skips what is done)",
                 "follow": "stream the run's log until it ends (Ctrl-C stops following, never the run)"}


@task(help={**HOST_HELP, **RUN_NAME_HELP,
            "n": "rows to take from the dataset, counted before sharding (default 0: all of it)",
            "dataset": "hub name, host path, or a shipped file like examples/prompts.jsonl "
                       "(default: mlabonne/open-perfectblend)"})
def generate(c, n: int = 0, on=None, inventory=None, dataset=None, name=None, resume=False, follow=False):
    """Record the served model's own reasoning + answers for dataset prompts (a detached, sharded run).

    Extra flags for remote/generate.py go after `--`, e.g. `inv generate -n 100 -- --max-tokens 2048`.
    """
    hosts = select_hosts(c, inventory, on)
    return jobs.generate(hosts, n=n or None, dataset=dataset, name=name, resume=resume,
                         follow=follow, extra=remainder(), on=on)


@task(iterable=["data"],
      help={**HOST_HELP, **RUN_NAME_HELP, "data": f"generate run id (or {layout.ROWS} path on the host); repeatable",
            "steps": "optimizer steps", "epochs": "passes over the data (default 1)",
            "gpus": "torchrun processes per host (default: the inventory's `gpus`, else every GPU nvidia-smi lists)",
            "plan": "print the memory/speed plan on each host (its model's config.json, no weights) and exit",
            "eval_every": "every N steps score the held-out rows and, where a vLLM fits beside training, measure "
                          f"acceptance in it; the best checkpoint becomes {layout.DRAFT}/",
            "states": "extract run id (or shard directory on the host): train from vLLM's states, not the model",
            "stream": "with --states: consume shards while the extraction writes them, deleting each after use",
            "rendezvous_timeout": "group: seconds a node tries to reach the master before failing",
            "dest": "group: local directory where the --data runs are pulled and merged before shipping"})
def train(c, data=None, on=None, inventory=None, steps: int = None, epochs: float = None, gpus: int = 0, name=None,
          resume=False, follow=False, states=None, stream=False, rendezvous_timeout: float = group.RENDEZVOUS_TIMEOUT,
          dest=specops.pull.ARTIFACTS, plan=False, eval_every: int = 0):
    """Train an EAGLE-3 draft for the host's model (a detached run; exports <run>/draft for vLLM).

    Extra flags for remote/train.py go after `--`, e.g. `-- --draft-vocab 32000 --lr 1e-4`.
    """
    hosts = select_hosts(c, inventory, on)
    if plan:
        return jobs.train_plan(hosts, gpus=gpus, states=states, extra=remainder())
    return jobs.train(hosts, data=data, steps=steps, epochs=epochs, gpus=gpus, name=name, resume=resume,
                      follow=follow, extra=remainder(), on=on, states=states, stream=stream,
                      rendezvous_timeout=rendezvous_timeout, dest=dest, eval_every=eval_every)


@task(iterable=["data"],
      help={**HOST_HELP, **RUN_NAME_HELP, "data": f"generate run id (or {layout.ROWS} path on the host); repeatable",
            "layers": "aux layer ids a,b,c in vLLM's convention (default: the trainer's); as for serve --extract",
            "scratch_gb": "disk budget for the shards in GB: refused up front if the states need more",
            "stream": "a `train --states RUN --stream` consumes the shards; pause while the budget is full"})
def extract(c, data=None, on=None, inventory=None, layers=None, scratch_gb: float = None, stream=False, name=None,
            resume=False, follow=False):
    """Target hidden states from the host's vLLM (`inv serve --extract`) packed into shards for `train --states`.

    Extra flags for remote/extract.py go after `--`, e.g. `-- --concurrency 32 --shard-mb 4096`.
    """
    hosts = select_hosts(c, inventory, on)
    return jobs.extract(hosts, data=data, layers=layers, scratch_gb=scratch_gb,
                        stream=stream, name=name, resume=resume, follow=follow, extra=remainder(), on=on)


@task(name="eval", help={**HOST_HELP, "draft": "train run id (or a draft directory on the host)",
                         "prompts": "held-out prompts file (default: the shipped examples/prompts.jsonl)",
                         "n": jobs.EVAL["n"].help, "k": jobs.EVAL["k"].help, "name": RUN_NAME_HELP["name"],
                         "dest": "local directory for the pulled report"})
def eval_(c, draft, on=None, inventory=None, prompts="examples/prompts.jsonl", n: int = jobs.EVAL["n"].default,
          k: int = jobs.EVAL["k"].default, name=None,
          dest=specops.pull.ARTIFACTS):
    """Measure the draft's acceptance length in real vLLM on the host's own model; pull the report."""
    hosts = select_hosts(c, inventory, on)
    return jobs.evaluate(hosts, draft=draft, prompts=prompts, n=n, k=k, name=name, dest=dest,
                         extra=remainder(), on=on)


@task(help={"on": "the local host to run on (default: the `local` group)", "inventory": HOST_HELP["inventory"],
            "full": f"the full recipe: {demo_mod.FULL.rows} rows, {demo_mod.FULL.train_seconds:g} s of training, "
                    f"{demo_mod.FULL.held_out} held out (about 15 minutes on 2 cores once the model is built)",
            "rows": f"prompts to generate answers for (default: {demo_mod.QUICK.rows}; --full: {demo_mod.FULL.rows})",
            "train_steps": "draft training steps, at most",
            "train_seconds": f"seconds of training steps, at most (default: {demo_mod.QUICK.train_seconds:g}; "
                             f"--full: {demo_mod.FULL.train_seconds:g})",
            "held_out": f"rows held out of training, on which train and eval measure acceptance length (default: "
                        f"{demo_mod.QUICK.held_out}; --full: {demo_mod.FULL.held_out})",
            "fresh": "redo generate/train/eval even if finished runs exist", "dest": "where pulled artifacts go"})
def demo(c, on=None, inventory=None, full=False, rows: int = None, train_steps: int = demo_mod.TRAIN_STEPS,
         train_seconds: float = None, held_out: int = None, fresh=False, dest=specops.pull.ARTIFACTS):
    """The whole pipeline on this machine, CPU only: deps, tiny model, serve, generate, train, eval, pull."""
    (host,) = select_hosts(c, inventory, on or inventory_mod.DEFAULT_GROUP)[:1]
    size = demo_mod.FULL if full else demo_mod.QUICK
    def given(value, default):
        return default if value is None else value

    return demo_mod.pipeline(host, rows=given(rows, size.rows), train_steps=train_steps,
                             train_seconds=given(train_seconds, size.train_seconds), held_out=given(held_out, size.held_out),
                             fresh=fresh, dest=dest, name="demo-full" if full else "demo")
