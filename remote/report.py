"""report.html: what a run did, for a person, in one file that opens anywhere.

generate, train, eval and extract each write ``report.html`` into their run directory at the
end (:func:`finish`), and long runs rewrite it every few minutes (:func:`refresh`). The page is
self-contained: its plots are PNGs inline (``data:`` URIs), with no script, stylesheet, font or
image from elsewhere, so it opens after `inv pull` on a laptop with no network, and a host
cannot make a browser fetch anything. It is drawn from the run's own files only:

    generate  stats.json, data.jsonl, errors.jsonl  rows done/failed/truncated, reasoning and answer
                                                    lengths (tokens), finish reasons, per-endpoint tok/s
    train     metrics.jsonl, evals.jsonl            loss, accuracy per position, acceptance length (simulated,
                                                    held-out, measured in vLLM), learning rate, tokens/s, draft vocab coverage
    eval      report.json                           acceptance length and per position per temperature,
                                                    tokens/s with and without the draft
    extract   plan.json, index.json                 samples and bytes written against the disk budget

By hand: ``python report.py RUN_DIR [--kind KIND]`` (the kind is read from meta.json).
Self-contained like every script here; matplotlib is imported only when a page is drawn.
"""
import argparse
import base64
import html
import io
import json
import os
import socket
import subprocess
import sys
import time

import layout

REFRESH_EVERY_S = 300
KINDS = ("generate", "train", "eval", "extract")


# ---------------------------------------------------------------- reading a run

def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def read_jsonl(path):
    """The JSON objects of a JSONL file; a torn or foreign line is skipped (the run may be writing it)."""
    try:
        f = open(path, errors="replace")
    except OSError:
        return
    with f:
        for line in f:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                yield obj


def num(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---------------------------------------------------------------- drawing

def figure(ncols=1, width=6.0, height=3.0):
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    fig = Figure(figsize=(width * ncols if ncols > 1 else width, height), dpi=100, layout="constrained")
    axes = fig.subplots(1, ncols)
    for ax in (axes if ncols > 1 else [axes]):
        ax.grid(True, alpha=0.3)
    return fig, axes


def png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode()


class Page:
    """Sections of key figures (tables), plots and notes, rendered to one HTML document."""

    def __init__(self, title: str, subtitle: str):
        self.title, self.subtitle, self.parts = title, subtitle, []

    def table(self, rows: list, header=None):
        head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header) if header else ""
        body = "".join("<tr>" + "".join(f"<td>{html.escape(show(c))}</td>" for c in row) + "</tr>" for row in rows)
        self.parts.append(f"<table>{'<tr>' + head + '</tr>' if head else ''}{body}</table>")

    def plot(self, fig, caption: str):
        self.parts.append(f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{png(fig)}">'
                          f"<figcaption>{html.escape(caption)}</figcaption></figure>")

    def note(self, text: str):
        self.parts.append(f'<p class="note">{html.escape(text)}</p>')

    def render(self) -> str:
        return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'">
<title>{html.escape(self.title)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em auto; max-width: 86em; padding: 0 1em; color: #222; }}
h1 {{ font-size: 1.4em; margin-bottom: 0; }} .sub {{ color: #666; margin-top: .3em; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
td, th {{ border-bottom: 1px solid #ddd; padding: .25em .8em; text-align: left; }}
figure {{ display: inline-block; margin: .5em 1em .5em 0; vertical-align: top; }}
figcaption {{ color: #444; font-size: .9em; }} .note {{ color: #8a4b00; }}
</style></head><body>
<h1>{html.escape(self.title)}</h1><p class="sub">{html.escape(self.subtitle)}</p>
{chr(10).join(self.parts)}
</body></html>
"""


def show(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def size(n) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


# ---------------------------------------------------------------- generate

def generate_page(run_dir: str, page: Page, source=None) -> None:
    stats = read_json(os.path.join(run_dir, layout.STATS), {})
    errors = sum(1 for _ in read_jsonl(os.path.join(run_dir, layout.ERRORS)))
    reasoning, answer, finish, ends, rows, truncated = [], [], {}, {}, 0, 0
    for rec in read_jsonl(os.path.join(run_dir, layout.ROWS)):
        rows += 1
        truncated += bool(rec.get("truncated"))
        for turn in rec.get("turns") or []:
            if not isinstance(turn, dict):
                continue
            use = turn.get("usage") if isinstance(turn.get("usage"), dict) else {}
            done, thought = use.get("completion_tokens"), use.get("reasoning_tokens")
            if num(thought):
                reasoning.append(thought)
            if num(done):
                answer.append(done - (thought if num(thought) else 0))
            reason = str(turn.get("finish_reason"))
            finish[reason] = finish.get(reason, 0) + 1
            if num(turn.get("ended_at")) and num(done):
                ends.setdefault(str(turn.get("endpoint")), []).append((turn["ended_at"], done))
    r = stats.get("rows", {})
    page.table([["outcome", stats.get("outcome", "running")], ["rows done", rows],
                [f"rows failed ({layout.ERRORS})", errors], ["rows truncated (kept)", truncated],
                ["rows in the shard", r.get("total")], ["wall time", f"{stats['wall_s']:.0f} s" if num(stats.get("wall_s")) else None],
                ["rows/s", stats.get("rows_s")], ["output tokens/s", stats.get("out_tok_s")],
                ["failed attempts (retried)", (stats.get("requests") or {}).get("failed_attempts")]])

    fig, (a, b) = figure(2)
    a.bar(["done", "failed", "truncated"], [rows, errors, truncated], color=["#4c9a2a", "#c0392b", "#e69f00"])
    a.set_title("rows")
    names = sorted(finish, key=lambda k: -finish[k])
    b.bar(names, [finish[k] for k in names], color="#3b75af")
    b.set_title("finish reasons (assistant turns)")
    page.plot(fig, "Rows done, failed and truncated; why each answer ended")

    if answer:
        fig, (a, b) = figure(2)
        if reasoning:
            a.hist(reasoning, bins=40, color="#8e6bbf")
        a.set_title("reasoning length (tokens)")
        a.set_xlabel("tokens per turn")
        b.hist(answer, bins=40, color="#3b75af")
        b.set_title("answer length (tokens)")
        b.set_xlabel("tokens per turn")
        page.plot(fig, "Reasoning and answer lengths")
        if not reasoning:
            page.note("The server reported no reasoning token counts (usage.reasoning_tokens).")

    if ends:
        start = min(t for pts in ends.values() for t, _ in pts)
        span = max(t for pts in ends.values() for t, _ in pts) - start
        width = max(1.0, span / 40)
        fig, ax = figure(width=9)
        for url, pts in sorted(ends.items()):
            bins = {}
            for t, n in pts:
                k = int((t - start) // width)
                bins[k] = bins.get(k, 0) + n
            xs = list(range(int(span // width) + 1))
            ax.plot([(k + 0.5) * width for k in xs], [bins.get(k, 0) / width for k in xs], marker=".", label=url)
        ax.set_xlabel("seconds since the first answer")
        ax.set_ylabel("output tokens/s")
        ax.legend(fontsize="small")
        page.plot(fig, f"Throughput per endpoint over time ({width:.0f} s bins)")


# ---------------------------------------------------------------- train

def train_page(run_dir: str, page: Page, source=None) -> None:
    rows = [m for m in read_jsonl(os.path.join(run_dir, layout.METRICS)) if num(m.get("step"))]
    if not rows:
        page.note(f"No training step recorded yet ({layout.METRICS} is empty).")
        return
    last = rows[-1]
    accs = sorted((k for k in last if k.startswith("acc_") and k[4:].isdigit()), key=lambda k: int(k[4:]))
    rates = [m["tokens_per_s"] for m in rows if num(m.get("tokens_per_s"))]
    evals = [e for e in read_jsonl(os.path.join(run_dir, layout.EVALS)) if num(e.get("step"))]
    kept = [e for e in evals if e.get("kept")]
    best = kept[-1] if kept else {}
    page.table([["steps", last["step"]], ["loss", last.get("loss")],
                ["accuracy per position", " ".join(f"{last[k]:.3f}" for k in accs)],
                ["simulated acceptance length (this step's batch)", last.get("sim_al")],
                [f"{layout.DRAFT}/ is the checkpoint of step", best.get("step", last["step"])],
                ["its predicted acceptance length (held-out rows)", best.get("val_sim_al")],
                ["its acceptance length measured in vLLM", best.get("measured_al")],
                ["the tokens a verification step delivered there (stops trimmed)", best.get("measured_delivered")],
                ["its first-token accuracy where the target is sure of the token (p ≥ 0.9), and elsewhere", certainty(best)],
                ["seconds of training steps that made it", best.get("train_s")],
                ["draft vocabulary coverage of the loss tokens", last.get("vocab_coverage")],
                ["tokens/s (median step)", sorted(rates)[len(rates) // 2] if rates else None]])
    steps = [m["step"] for m in rows]

    def curve(key, title, ylabel, color="#3b75af", smoothed=False):
        ys = [m.get(key) for m in rows]
        pts = [(s, y) for s, y in zip(steps, ys) if num(y)]
        if not pts:
            return
        fig, ax = figure()
        ax.plot(*zip(*pts), color=color, alpha=0.35 if smoothed and len(pts) > 20 else 1.0)
        if smoothed and len(pts) > 20:
            ax.plot([s for s, _ in pts], smooth([y for _, y in pts]), color=color)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        page.plot(fig, title)

    curve("loss", "Loss (light: per step; dark: smoothed)", "loss", smoothed=True)
    fig, ax = figure()
    for k in accs:
        ax.plot(steps, smooth([m.get(k) or 0.0 for m in rows]) if len(rows) > 20 else [m.get(k) for m in rows],
                label=f"position {int(k[4:])}")
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.legend(fontsize="small")
    page.plot(fig, "Accuracy per draft position (smoothed)")
    fig, ax = figure()
    ax.plot(steps, [m.get("sim_al") for m in rows], color="#4c9a2a", alpha=0.35, label="training batch")
    for key, label, marker in (("val_sim_al", "predicted, held-out rows", "o"), ("measured_al", "measured in vLLM", "s")):
        pts = [(e["step"], e[key]) for e in evals if num(e.get(key))]
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens per draft")
    ax.legend(fontsize="small")
    page.plot(fig, "Acceptance length: simulated on each batch, predicted on held-out rows, measured in vLLM")
    curve("lr", "Learning rate", "lr", color="#8e6bbf")
    curve("tokens_per_s", "Training throughput", "tokens/s", color="#e69f00", smoothed=True)
    curve("vocab_coverage", "Draft vocabulary's coverage of the batch's loss tokens", "fraction", color="#c0392b")


def certainty(figures: dict) -> str | None:
    """Where the held-out misses are (train.py's validation): on tokens the target is sure of, or elsewhere."""
    sure, unsure, share = (figures.get(k) for k in ("val_acc_0_sure", "val_acc_0_unsure", "val_sure_share"))
    if not all(num(v) for v in (sure, unsure, share)):
        return None
    return f"{sure:.3f} on {share:.0%} of the tokens; {unsure:.3f} on the other {1 - share:.0%}"


def smooth(values):
    """A centred moving average over about 1/25 of the curve (no lag, unlike an EMA)."""
    half = max(1, len(values) // 50)
    return [sum(values[max(0, i - half): i + half + 1]) / len(values[max(0, i - half): i + half + 1])
            for i in range(len(values))]


# ---------------------------------------------------------------- eval

def eval_page(run_dir: str, page: Page, source=None) -> None:
    rep = read_json(source or os.path.join(run_dir, layout.REPORT_JSON))
    if not isinstance(rep, dict) or not rep.get("runs"):
        page.note(f"No measurement yet ({layout.REPORT_JSON} is missing).")
        return
    runs = rep["runs"]
    page.table([[str(r.get("temperature")), r.get("acceptance_length"), r.get("delivered_length"),
                 " ".join(f"{p:.2f}" for p in r.get("per_position") or []), r.get("tokens_per_s"),
                 r.get("baseline_tokens_per_s"), r.get("speedup")] for r in runs],
               header=["temperature", "acceptance length", "delivered length", "acceptance per position",
                       "tok/s with draft", "tok/s without", "speedup"])
    page.note(f"k = {rep.get('k')} speculative tokens (acceptance length at most {(rep.get('k') or 0) + 1}), "
              f"{rep.get('n')} prompts, max_tokens {rep.get('max_tokens')}. The acceptance length is vLLM's "
              f"(it counts drafts accepted past a stop, before the output is trimmed there); the delivered "
              f"length is the output tokens a verification step gave the user.")
    labels = [f"T={r.get('temperature')}" for r in runs]
    fig, (a, b) = figure(2)
    for label, r in zip(labels, runs):
        pp = r.get("per_position") or []
        a.plot(range(1, len(pp) + 1), pp, marker="o", label=label)
    a.set_ylim(0, 1)
    a.set_xlabel("draft position")
    a.set_title("acceptance per position")
    a.legend(fontsize="small")
    b.bar(labels, [r.get("acceptance_length") or 0 for r in runs], color="#4c9a2a")
    b.set_title("acceptance length")
    page.plot(fig, "Acceptance, greedy and sampled")
    fig, ax = figure()
    xs = range(len(runs))
    ax.bar([x - 0.2 for x in xs], [r.get("tokens_per_s") or 0 for r in runs], 0.4, label="with the draft")
    ax.bar([x + 0.2 for x in xs], [r.get("baseline_tokens_per_s") or 0 for r in runs], 0.4, label="without")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize="small")
    page.plot(fig, "Throughput with and without the draft")


# ---------------------------------------------------------------- extract

def extract_page(run_dir: str, page: Page, source=None) -> None:
    plan = read_json(os.path.join(run_dir, "plan.json"), {})
    index = read_json(os.path.join(run_dir, "index.json"), {})
    shards = sorted(((s.get("written_at"), s) for s in (index.get("shards") or {}).values()
                     if isinstance(s, dict)), key=lambda p: p[0] or 0)
    budget = plan.get("scratch_bytes")
    written = sum(s.get("bytes") or 0 for _, s in shards)
    page.table([["samples", f"{sum(s.get('count', 0) for _, s in shards):,} of {plan.get('samples', 0):,}"],
                ["shards", f"{len(shards)} of {len(plan.get('shards') or [])}"],
                ["bytes written", size(written)], ["disk budget (--scratch-gb)", size(budget) if budget else "none"],
                ["peak spool on disk", size(index.get("peak_spool_bytes") or 0)],
                ["streaming (shards deleted after training)", plan.get("stream")]])
    timed = [(t, s) for t, s in shards if num(t)]
    if not timed:
        page.note("No shard written yet." if not shards else "Shards carry no write times.")
        return
    t0 = timed[0][0]
    top = max(written, budget or 0, index.get("peak_spool_bytes") or 0)
    scale, unit = next(((f, u) for f, u in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")) if top >= f), (1, "B"))
    xs, samples, cumulative, n, b = [], [], [], 0, 0
    for t, s in timed:
        n, b = n + s.get("count", 0), b + (s.get("bytes") or 0)
        xs.append(t - t0)
        samples.append(n)
        cumulative.append(b / scale)
    fig, (a, c) = figure(2)
    a.step(xs, samples, where="post", color="#3b75af")
    a.set_xlabel("seconds since the first shard")
    a.set_title("samples extracted")
    c.step(xs, cumulative, where="post", color="#e69f00",
           label="written (all shards)" + (": streaming deletes each after training" if plan.get("stream") else ""))
    if budget:
        c.axhline(budget / scale, color="#c0392b", linestyle="--", label="disk budget")
    if index.get("peak_spool_bytes"):
        c.axhline(index["peak_spool_bytes"] / scale, color="#4c9a2a", linestyle=":", label="peak on disk")
    c.set_xlabel("seconds since the first shard")
    c.set_ylabel(unit)
    c.set_title("bytes against the disk budget")
    c.legend(fontsize="small")
    page.plot(fig, "Samples and bytes written over time")


PAGES = {"generate": generate_page, "train": train_page, "eval": eval_page, "extract": extract_page}


# ---------------------------------------------------------------- writing

def heading(kind: str, run_dir: str, meta: dict, when: str) -> tuple[str, str]:
    """(title, subtitle) from what is known: a run launched by specops has its id, host and start in
    meta.json; a script run by hand into a directory has none, and the page says where it was drawn
    instead of showing a placeholder."""
    run = meta.get("run_id")
    title = f"{kind} run {run}" if isinstance(run, str) and run else f"{kind} run in {os.path.abspath(run_dir)}"
    host = meta.get("host") if isinstance(meta.get("host"), str) and meta.get("host") else socket.gethostname()
    started = meta.get("started")
    return title, " · ".join([f"host {host}", *([f"started {started}"] if isinstance(started, str) and started else []),
                              f"report drawn {when}"])


def write(run_dir: str, kind: str | None = None, source: str | None = None) -> str:
    """Draw the run's report into RUN_DIR/report.html (replaced atomically); returns its path.
    ``source``: eval's JSON report when it is not RUN_DIR/report.json."""
    meta = read_json(os.path.join(run_dir, layout.META), {})
    kind = kind or meta.get("kind")
    if kind not in PAGES:
        raise ValueError(f"no report for a run of kind {kind!r} (one of {', '.join(KINDS)})")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    page = Page(*heading(kind, run_dir, meta, when))
    PAGES[kind](run_dir, page, source)
    path = os.path.join(run_dir, layout.REPORT_HTML)
    with open(path + ".tmp", "w") as f:
        f.write(page.render())
    os.replace(path + ".tmp", path)
    return path


def finish(run_dir: str, kind: str, source: str | None = None) -> None:
    """The end-of-run report; a report that cannot be drawn is one line in the log, never a failed run."""
    try:
        write(run_dir, kind, source)
    except Exception as e:  # a view of the run must not fail the run
        print(f"report.py: no {layout.REPORT_HTML} for {run_dir}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


_child, _last = None, 0.0


def refresh(run_dir: str, kind: str, every: float = REFRESH_EVERY_S) -> None:
    """Redraw report.html in a child process at most every ``every`` seconds: it never blocks the run
    (reading a large data.jsonl takes a while), and one is drawn at a time."""
    global _child, _last
    now = time.monotonic()
    if now - _last < every or (_child is not None and _child.poll() is None):
        return
    _last = now
    try:
        _child = subprocess.Popen([sys.executable, os.path.abspath(__file__), run_dir, "--kind", kind],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    except OSError as e:
        print(f"report.py: cannot refresh {layout.REPORT_HTML}: {e}", file=sys.stderr, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=f"Draw a run's {layout.REPORT_HTML} from its files.")
    ap.add_argument("run_dir")
    ap.add_argument("--kind", choices=KINDS, help=f"default: {layout.META}'s kind")
    args = ap.parse_args(argv)
    try:
        print(write(args.run_dir, args.kind))
    except ValueError as e:
        print(f"report.py: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
