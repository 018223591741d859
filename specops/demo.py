"""`inv demo`: the whole pipeline on this machine (the inventory's `local` host), no GPU, no hub.

Every stage calls the same functions the tasks call for a GPU host — deploy/deps, serve,
generate, train, eval, pull — so the demo exercises the real code paths, not a toy one.
The only demo-specific step is building the tiny reasoning model the local host serves, with
prompts of its domain (``remote/make_tiny_model.py``). Runs get fixed names (``demo-generate``, ``demo-train``,
``demo-eval``; ``demo-full-*`` for ``--full``), so a second `inv demo` reuses the model, the data and the
draft and finishes faster; ``--fresh`` starts those runs again.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import deploy, fanout, jobs, pull, runs, serve, watch
from .errors import SpecopsError
from .host import Session, connect
from .inventory import Host
from .shared import layout

TINY_MODEL_BUILD_TIMEOUT = 1800
TINY_PROMPTS = 24000  # rows of the tiny domain the demo can generate from (examples/ ships the first 300)
# The tiny draft's recipe: Muon for the hidden matrices, labels sharpened for greedy acceptance, an MLP 4x the
# target's, 2048-token batches from 24000 rows seen once or twice. docs/tiny-draft-recipe.md keeps what was
# measured to choose each flag, and what did not pay. On 2 cores compute binds (every first-token miss left is on
# a token the target itself is unsure of, and more steps still remove them), so the steps fill the 5-minute budget.
TINY_DRAFT_RECIPE = ["--lr", "1e-2", "--batch-tokens", "2048", "--ttt-steps", "3", "--warmup", "0.05",
                     "--draft-vocab", "256", "--max-len", "512", "--label-temperature", "0.2",
                     "--draft-intermediate", "1024", "--optimizer", "muon"]
TRAIN_STEPS = 3000  # a cap that no 2-core machine seen reaches in TRAIN_BUDGET_S: the budget ends the steps
TRAIN_BUDGET_S = 285  # seconds of steps (train.py --time-budget ends the cosine with them): 5 minutes, less start-up
HELD_OUT_ROWS = 400  # held out of training: train predicts and measures on them, eval measures them again


@dataclass(frozen=True)
class Size:
    """How much the demo does: rows generated, seconds of training steps, rows held out to measure on."""

    rows: int
    train_seconds: float
    held_out: int


# `inv demo --full`: the recipe's own figure (docs/tiny-draft-recipe.md), in about 15 minutes on 2 cores.
FULL = Size(rows=TINY_PROMPTS, train_seconds=TRAIN_BUDGET_S, held_out=HELD_OUT_ROWS)
# `inv demo`: every stage, a newcomer's first run; chosen by measurement (docs/tiny-draft-recipe.md, "Quick demo")
# so that a fresh machine's setup and the whole pipeline fit in 10 minutes.
QUICK = Size(rows=1500, train_seconds=45, held_out=150)


class Stages:
    """Times each stage and keeps its key figure for the summary table."""

    def __init__(self, out):
        self.out, self.rows = out, []

    def stage(self, name: str, body, run_id: str | None = None):
        print(f"\n=== {name} ===", file=self.out, flush=True)
        start = time.monotonic()
        figure = body()
        self.rows.append({"stage": name, "seconds": round(time.monotonic() - start, 1), "result": figure,
                          "run": run_id})
        return figure

    def summary(self, dest: str, host: str) -> list[dict]:
        """The rows, each run's with the path of its pulled report.html."""
        def report(run_id):
            path = Path(dest) / run_id / host / layout.REPORT_HTML if run_id else None
            return str(path) if path and path.is_file() else "-"
        return [{"stage": r["stage"], "seconds": r["seconds"], "result": r["result"], "report": report(r["run"])}
                for r in self.rows]


def pipeline(host: Host, *, rows: int = QUICK.rows, train_steps: int = TRAIN_STEPS,
             train_seconds: float = QUICK.train_seconds, held_out: int = QUICK.held_out, fresh: bool = False,
             dest: str = pull.ARTIFACTS, name: str = "demo", out=None) -> int:
    """Every stage on ``host`` (this machine); runs are ``NAME-generate``, ``NAME-train``, ``NAME-eval``."""
    out = out or sys.stdout
    if not host.is_local:
        raise SpecopsError(f"{host.name}: `inv demo` runs on this machine: pick a host with ansible_connection: "
                           f"local (the shipped inventory's `local` group)", exit_code=2)
    if min(rows, train_steps, train_seconds, held_out) <= 0 or held_out >= rows:
        raise SpecopsError(f"`inv demo` needs positive --rows, --train-steps, --train-seconds and --held-out, and fewer "
                           f"held-out rows (--held-out {held_out}) than rows (--rows {rows})", exit_code=2)
    stages = Stages(out)
    hosts = [host]
    run = {stage: f"{name}-{stage}" for stage in ("generate", "train", "eval")}

    def check(code: int, what: str) -> None:
        if code:
            raise SpecopsError(f"demo stopped at {what} (exit {code}); fix the error above and rerun `inv demo` "
                               f"(finished stages are reused)", exit_code=code)

    def check_ok(code: int, what: str) -> str:
        check(code, what)
        return "ok"

    stages.stage("deploy + deps", lambda: check_ok(deploy.on_hosts(hosts), "deploy + deps"))
    with connect(host) as session:
        stages.stage("tiny model", lambda: _tiny_model(session, out))
        prompts = _prompts_path(session)
    stages.stage("serve --wait", lambda: check_ok(serve.on_hosts(hosts, wait=True, timeout=900), "serve"))
    try:
        stages.stage("generate", lambda: _generate(hosts, run["generate"], prompts, rows, fresh, check, out),
                     run["generate"])
        stages.stage("train", lambda: _train(hosts, run, train_steps, train_seconds, held_out,
                                             min(0.25, held_out / rows), fresh, check, out), run["train"])
        stages.stage("eval", lambda: _eval(hosts, run, held_out, fresh, dest, check, out), run["eval"])
        stages.stage("pull", lambda: _pull(hosts, list(run.values()), dest, check, out))
    finally:
        stages.stage("stop service", lambda: check_ok(serve.on_hosts(hosts, stop_service=True), "stop"))
    print("\n=== summary ===", file=out)
    fanout.print_table(stages.summary(dest, host.name), out=out)
    print(f"total {sum(r['seconds'] for r in stages.rows):.0f} s; artifacts in {Path(dest).resolve()}/"
          f"({', '.join(run.values())})", file=out, flush=True)
    reports = [r["report"] for r in stages.summary(dest, host.name) if r["report"] != "-"]
    if reports:  # the demo ends with its reports: plots of the data, the training and the measurement
        print("reports (open in a browser; `inv report RUN` prints one's path):", file=out)
        for path in reports:
            print(f"  {Path(path).resolve().as_uri()}", file=out)
        out.flush()
    return 0


def _prompts_path(session: Session) -> str:
    return f"{jobs.model_path(session)}-prompts.jsonl"


def _tiny_model(session: Session, out) -> str:
    model, prompts = jobs.model_path(session), _prompts_path(session)
    written = session.run(["wc", "-l", prompts], check=False, timeout=30)  # a short file: an older demo's
    if not written.ok or int(written.stdout.split()[0]) < TINY_PROMPTS:
        session.run(jobs.script(session, "make_tiny_model.py") + ["--write-prompts", prompts,
                                                                  "--n-prompts", str(TINY_PROMPTS)], timeout=300)
    if session.run(["test", "-f", f"{model}/config.json"], check=False, timeout=30).ok:
        return f"reused {model}"
    print(f"building the tiny reasoning model into {model} (about 2 minutes on 2 cores)", file=out, flush=True)
    drawn = watch.DrawnOutput(session.host.name, out)
    try:
        session.run(jobs.script(session, "make_tiny_model.py") + [model], timeout=TINY_MODEL_BUILD_TIMEOUT,
                    hide=False, out_stream=drawn)
    finally:
        drawn.close()
    return f"built {model}"


def _finished(hosts, run_id: str) -> bool:
    """True when this run already succeeded on the host (so the demo reuses it)."""
    def probe(session: Session) -> dict:
        code = session.read_file(f"{runs.run_dir(session, run_id)}/{layout.EXIT_CODE}")
        return {"done": code is not None and code.strip() == b"0"}

    outcomes = fanout.each(hosts, probe)
    return all(o.ok and o.row["done"] for o in outcomes)


def _fresh_or_reuse(hosts, run_id: str, fresh: bool, out) -> bool:
    """Whether to start the run; with --fresh an old run directory is removed first."""
    if not fresh and _finished(hosts, run_id):
        print(f"reusing the finished run {run_id} (--fresh to redo it)", file=out, flush=True)
        return False

    def remove(session: Session) -> dict:  # --fresh, or what is left of a failed try
        session.run(["rm", "-rf", runs.run_dir(session, run_id)])
        return {}

    fanout.each(hosts, remove)
    return True


def _read_json(hosts, run_id: str, name: str) -> dict:
    with connect(hosts[0]) as session:
        data = session.read_file(f"{runs.run_dir(session, run_id)}/{name}")
    return json.loads(data) if data else {}


def _read_jsonl(hosts, run_id: str, name: str) -> list[dict]:
    with connect(hosts[0]) as session:
        data = session.read_file(f"{runs.run_dir(session, run_id)}/{name}")
    return [json.loads(line) for line in (data or b"").decode().splitlines() if line.strip()]


def _generate(hosts, run_id, prompts, rows, fresh, check, out) -> str:
    if _fresh_or_reuse(hosts, run_id, fresh, out):
        code = jobs.generate(hosts, n=rows, dataset=prompts, name=run_id,
                                follow=True, out=out, extra=["--max-tokens", "384", "--concurrency", "16"])
        check(code, "generate")
    stats = _read_json(hosts, run_id, layout.STATS)
    r = stats.get("rows", {})
    if not r.get("done"):
        check(1, f"generate: no row completed (see {layout.ERRORS}: inv pull --run {run_id})")
    return (f"{r.get('done')} rows ({r.get('errors', 0)} errors, {r.get('truncated', 0)} truncated), "
            f"{stats.get('out_tok_s')} output tok/s")


def _train(hosts, run, steps, seconds, held_out, val_fraction, fresh, check, out) -> str:
    """Training that measures its checkpoints in vLLM on the held-out rows (--eval-every) and keeps the best."""
    if _fresh_or_reuse(hosts, run["train"], fresh, out):
        code = jobs.train(hosts, data=[run["generate"]], steps=steps, name=run["train"], follow=True, out=out,
                             eval_every=max(1, steps // 2),
                             extra=[*TINY_DRAFT_RECIPE, "--time-budget", str(seconds),
                                    "--val-fraction", str(val_fraction), "--eval-n", str(held_out)])
        check(code, "train")
    kept = [e for e in _read_jsonl(hosts, run["train"], layout.EVALS) if e.get("kept")]
    if not kept:
        check(1, f"train: no evaluation recorded (no {layout.EVALS}: a run of an older specops? `inv demo --fresh`)")
    best = kept[-1]
    where = ""
    if all(isinstance(best.get(k), float) for k in ("val_acc_0_sure", "val_acc_0_unsure", "val_sure_share")):
        where = (f"; first-token accuracy {best['val_acc_0_sure']:.3f} where the target is sure of the token "
                 f"({best['val_sure_share']:.0%} of them), {best['val_acc_0_unsure']:.3f} where it is not")
    return (f"step {best['step']} kept: predicted AL {best.get('val_sim_al')} on held-out rows, "
            f"measured in vLLM {best.get('measured_al')}, after {best.get('train_s')} s of training steps{where}")


def _eval(hosts, run, n, fresh, dest, check, out) -> str:
    """The kept draft measured again, with the baseline for the speedup, on the rows train held out."""
    if _fresh_or_reuse(hosts, run["eval"], fresh, out):
        with connect(hosts[0]) as session:
            heldout = f"{runs.run_dir(session, run['train'])}/{layout.HELDOUT}"
        code = jobs.evaluate(hosts, draft=run["train"], prompts=heldout, n=n, name=run["eval"], dest=dest,
                                   out=out, extra=["--temperature", "0"])
        check(code, "eval")
    report = _read_json(hosts, run["eval"], layout.REPORT_JSON)
    return (f"measured acceptance length {report.get('acceptance_length')} (K=3, max 4.0; "
            f"{report.get('delivered_length')} tokens delivered a step) on {report.get('n')} held-out prompts, "
            f"speedup {report.get('speedup')}")


def _pull(hosts, run_ids, dest, check, out) -> str:
    for run_id in run_ids:
        check(pull.pull(hosts, run_id, dest=dest, out=out), f"pull {run_id}")
    return f"{Path(dest).resolve()}/{{{','.join(run_ids)}}}/{hosts[0].name}/"
