"""What a starting vLLM is doing, read from its log, and a display of it while `inv serve --wait` waits.

A 22-minute load is bearable when you can see it move. :class:`Startup` turns vLLM's log lines
into a phase and, where the log gives one, a percentage::

    Loading safetensors checkpoint shards:  34% Completed | 17/50   → loading weights 34% (17/50)
    Loading weights took 812.3 seconds                              → weights loaded
    init engine (profile, create kv cache, warmup model) took 95 s  → engine initialised
    Application startup complete.                                   → startup complete

:class:`Display` shows it: one line rewritten in place on a terminal, otherwise a line per
phase change and a heartbeat line every ``every`` seconds (logs and CI stay readable).
Percentages within a phase show on the live line and in the heartbeat lines.
"""

from __future__ import annotations

import re
import sys
import time

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
    """Live progress of one host's startup, on ``out`` (stderr: stdout keeps the results)."""

    def __init__(self, host: str, *, out=None, live: bool | None = None, every: float = 15):
        self.host, self.out, self.every = host, out or sys.stderr, every
        self.live = self.out.isatty() if live is None else live
        self.started = time.monotonic()
        self._last_line = 0.0
        self._last_phase: str | None = None
        self._last_text = ""

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def update(self, startup: Startup, health: str) -> None:
        text = f"{self.host}: {self.elapsed():5.0f}s  {startup.describe()}  (/health: {health})"
        if self.live:
            self.out.write("\r\033[K" + text)
            self.out.flush()
        elif startup.phase != self._last_phase or time.monotonic() - self._last_line >= self.every:
            print(text, file=self.out, flush=True)
            self._last_line, self._last_phase = time.monotonic(), startup.phase
        self._last_text = text

    def finish(self) -> None:
        """End the live line so whatever is printed next starts on its own line."""
        if self.live and self._last_text:
            self.out.write("\n")
            self.out.flush()
