"""Progress a person reads: one live line per host, drawn with rich, or plain periodic lines.

Runs print machine lines, ``specops-progress {"done":87,"total":200,"rows_s":13.955,…}``, into
their log: tools read those (`inv status --json`, tests). A person watching (`inv logs --follow`,
`--follow` on a launch, `inv demo`, `inv serve --wait`) reads them through :func:`describe`::

    gpu1  ━━━━━━━━━━━━━╸━━━━━━━━━━  87/200 rows (44%) · 14.0 rows/s · 1,640 tok/s · ETA 8s · 2 errors
    gpu2  ━━━━━━━━━━━━━━━━━━━━━━━━  step 300/300 (100%) · loss 1.234 · acc0 0.61 · sim AL 2.31 · …

:class:`Board` holds those lines: on a terminal they are redrawn in place (rich's Live) below
the log lines printed above them; anywhere else (a pipe, CI) a host's line is printed when it
changes phase, at most every ``every`` seconds, and once more at the end, so logs stay short.

A 22-minute vLLM load is bearable when you can see it move too. :class:`Startup` turns vLLM's
log lines into a phase and, where the log gives one, a percentage, which :class:`Display` shows::

    Loading safetensors checkpoint shards:  34% Completed | 17/50   → loading weights 34% (17/50)
    Loading weights took 812.3 seconds                              → weights loaded
    init engine (profile, create kv cache, warmup model) took 95 s  → engine initialised
    Application startup complete.                                   → startup complete
"""

from __future__ import annotations

import re
import sys
import threading
import time

from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from .shared import layout

MACHINE_PREFIX = "specops-progress {"
MACHINE_LINE = re.compile(r"specops-progress (\{.*\})\s*$")


# ---------------------------------------------------------------- run progress, in words

def duration(seconds) -> str:
    """'12s', '3m05s', '1h02m', '2d03h'."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def size(n) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def _num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(done, total, form: str) -> str:
    if _num(total) and total:
        return f"{form.format(f'{done}/{total}')} ({100 * done / total:.0f}%)"
    return form.format(done)


# Figures in the order they are shown; each formats its value, or returns None to leave it out.
_FIGURES = {
    "steps": lambda v: f"{v} steps",
    "loss": lambda v: f"loss {v:.3f}",
    "acc_0": lambda v: f"acc0 {v:.2f}",
    "sim_al": lambda v: f"sim AL {v:.2f}",
    "val_sim_al": lambda v: f"predicted AL {v:.2f} (held out)",
    "measured_al": lambda v: f"measured AL {v:.2f} (vLLM)",
    "best_step": lambda v: f"{layout.DRAFT}/ = step {v}",
    "train_s": lambda v: f"{duration(v)} of steps",
    "acceptance_length": lambda v: f"acceptance length {v:.2f}",
    "speedup": lambda v: f"speedup {v:.2f}x",
    "rows_s": lambda v: f"{v:.1f} rows/s",
    "out_tok_s": lambda v: f"{v:,.0f} tok/s",
    "tok_s": lambda v: f"{v:,.0f} tok/s",
    "lr": lambda v: f"lr {v:.1e}",
    "spool_bytes": lambda v: f"spool {size(v)}",
    "eta_s": lambda v: f"ETA {duration(v)}",
    "errors": lambda v: f"{v} errors" if v else None,
    "truncated": lambda v: f"{v} truncated" if v else None,
    "retries": lambda v: f"{v} retries" if v else None,
}
_COUNTS = [("done", "total", "{} rows"), ("step", "steps", "step {}"), ("shards_done", "shards", "{} shards")]
_QUIET = {"req_s", "in_flight", "empty", "epoch", "tokens_done", "draft", "acc_1", "acc_2", "acc_3", "val_acc_0",
          "val_acc_1", "val_acc_2", "val_acc_3", "val_acc_0_sure", "val_acc_0_unsure", "val_sure_share",
          "measured_per_position", "measured_delivered", "draft_step"}


def describe(progress) -> tuple[str, float | None]:
    """A progress line in words and the fraction done (None when unknown)::

        >>> describe({"done": 87, "total": 200, "rows_s": 13.955, "eta_s": 8, "errors": 0})
        ('87/200 rows (44%) · 14.0 rows/s · ETA 8s', 0.435)
    """
    if not isinstance(progress, dict):
        return (str(progress) if progress else "-"), None
    parts, fraction, left = [], None, dict(progress)
    stage = left.pop("stage", None)
    if stage not in (None, "train", "extract"):
        parts.append(str(stage))
    for done_key, total_key, form in _COUNTS:
        if _num(left.get(done_key)):
            done, total = left.pop(done_key), left.pop(total_key, None)
            parts.append(_count(done, total, form))
            if _num(total) and total:
                fraction = min(1.0, done / total)
            break
    for key, show in _FIGURES.items():
        value = left.pop(key, None)
        if _num(value) and (text := show(value)):
            parts.append(text)
    parts += [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in left.items()
              if k not in _QUIET and v is not None]
    if stage == "done":
        fraction = 1.0
    return " · ".join(parts) or "-", fraction


# ---------------------------------------------------------------- one line per host

class Board:
    """One progress line per host on ``out``, with log lines printed above them; thread-safe.

    ``live`` (default: ``out`` is a terminal that can move its cursor) redraws the lines in place;
    otherwise :meth:`set` prints a host's line when ``changed`` says its phase moved or ``every``
    seconds after its last one, and :meth:`close` prints each line whose latest text is unprinted.
    """

    def __init__(self, out=None, *, live: bool | None = None, every: float = 30):
        self.out, self.every = out or sys.stdout, every
        self.console = Console(file=self.out, highlight=False, soft_wrap=True, emoji=False)
        if live is None:
            live = self.console.is_terminal and not self.console.is_dumb_terminal
        self.live = live
        self.lines: dict[str, tuple[str, float | None]] = {}
        self.printed: dict[str, tuple[float, str]] = {}  # host: (when, text) of its last plain line
        self.lock = threading.RLock()
        self._live: Live | None = None
        self._stale = False

    def print(self, text: str) -> None:
        """A log line, above the progress lines (``text`` must already be clean: see specops.untrusted)."""
        with self.lock:
            if self._live:
                if self._stale:  # rich redraws its last refreshed lines under a print: bring them up to date
                    self._live.refresh()
                    self._stale = False
                self.console.print(Text(text), soft_wrap=True)
            else:
                print(text, file=self.out)
                self.out.flush()

    def set(self, host: str, text: str, fraction: float | None = None, *, changed: bool = False) -> None:
        with self.lock:
            self.lines[host] = (text, fraction)
            if self.live:
                if self._live is None:
                    self._live = Live(self._render(), console=self.console, refresh_per_second=4,
                                      redirect_stdout=False, redirect_stderr=False)
                    self._live.start()
                else:
                    self._live.update(self._render())  # drawn by rich's refresh thread, 4 times a second
                    self._stale = True
                return
            when, last = self.printed.get(host, (0.0, None))
            if text != last and (changed or last is None or time.monotonic() - when >= self.every):
                self._plain(host)

    def close(self) -> None:
        """Leave the final lines on screen (live) or print those not printed yet (plain)."""
        with self.lock:
            if self._live:
                self._live.update(self._render())
                self._live.stop()
                self._live = None
            elif not self.live:
                for host, (text, _) in self.lines.items():
                    if self.printed.get(host, (0, None))[1] != text:
                        self._plain(host)

    def _plain(self, host: str) -> None:
        text = self.lines[host][0]
        print(f"{host}: {text}", file=self.out)
        self.out.flush()
        self.printed[host] = (time.monotonic(), text)

    def _render(self) -> Table:
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column(width=24, no_wrap=True)
        grid.add_column()
        for host, (text, fraction) in self.lines.items():
            bar = ProgressBar(total=1.0, completed=fraction, width=24) if fraction is not None else Text("")
            grid.add_row(host, bar, Text(text))
        return grid


# ---------------------------------------------------------------- vLLM's startup

# (pattern, phase); the percentage and k/n come from the named groups when present.
PHASES = [
    (re.compile(r"Initializing a V1 LLM engine|Waiting for init message"), "engine init"),
    (re.compile(r"Starting to load model"), "loading model"),
    (re.compile(r"Loading safetensors checkpoint shards:\s*(?P<pct>\d+)% Completed \| (?P<of>\d+/\d+)"),
     "loading weights"),
    (re.compile(r"Loading weights took|Model loading took"), "weights loaded"),
    (re.compile(r"Capturing CUDA graphs[^:]*:\s*(?P<pct>\d+)%"), "capturing CUDA graphs"),
    (re.compile(r"init engine \(profile, create kv cache, warmup model\) took"), "engine initialised"),
    (re.compile(r"Starting vLLM (API )?server"), "starting API server"),
    (re.compile(r"Application startup complete"), "startup complete"),
]


class Startup:
    """The latest startup phase seen in the log (phases only move forward)."""

    def __init__(self):
        self.phase: str | None = None
        self.pct: int | None = None
        self.of: str | None = None
        self._rank = -1

    def feed(self, line: str) -> bool:
        """Read one log line; True if it moved the phase or its percentage."""
        for rank, (pattern, phase) in enumerate(PHASES):
            m = pattern.search(line)
            if m and rank >= self._rank:
                groups = m.groupdict()
                new = (phase, int(groups["pct"]) if groups.get("pct") else None, groups.get("of"))
                changed = new != (self.phase, self.pct, self.of)
                self.phase, self.pct, self.of = new
                self._rank = rank
                return changed
        return False

    def describe(self) -> str:
        if self.phase is None:
            return "starting"
        pct = f" {self.pct}%" if self.pct is not None else ""
        of = f" ({self.of})" if self.of else ""
        return f"{self.phase}{pct}{of}"


class Display:
    """Live progress of one host's startup on ``out`` (stderr: stdout keeps the results): a
    :class:`Board` line, plain lines at each phase change and every ``every`` seconds."""

    def __init__(self, host: str, *, out=None, live: bool | None = None, every: float = 15):
        self.host = host
        self.board = Board(out or sys.stderr, live=live, every=every)
        self.live = self.board.live
        self.started = time.monotonic()
        self._last_phase: str | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def update(self, startup: Startup, health: str) -> None:
        text = f"{self.elapsed():5.0f}s  {startup.describe()}  (/health: {health})"
        fraction = startup.pct / 100 if startup.pct is not None else None
        self.board.set(self.host, text, fraction, changed=startup.phase != self._last_phase)
        self._last_phase = startup.phase

    def finish(self) -> None:
        """End the live line so whatever is printed next starts on its own line."""
        self.board.close()
