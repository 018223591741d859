"""Running one step on many hosts at once, with one result row per host.

A step is a function ``step(session) -> dict`` (the row's columns). Each host gets its
own thread and its own Session, so one slow or dead host never holds up the others;
every remote call inside a step carries a timeout, so every thread ends. A host that
fails gets a row with its error; the others' rows are still shown, and the caller
exits non-zero::

    $ inv hosts --on gpu
    host   status  os            python   gpus
    gpu1   ok      Ubuntu 22.04  3.11.9   8x H200 141GB
    gpu2   FAILED  gpu2: unreachable: connecting to 10.0.0.6 timed out after 10s
"""

from __future__ import annotations

import inspect
import io
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import untrusted
from .errors import SpecopsError
from .host import connect, hang_up_all
from .inventory import Host


@dataclass
class Outcome:
    host: Host
    row: dict = field(default_factory=dict)
    error: str | None = None
    exit_code: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


def each(hosts: list[Host], step: Callable[..., dict], *args, **kwargs) -> list[Outcome]:
    """Run ``step(session, *args, **kwargs)`` on every host in parallel; outcomes in host order.

    A step may take ``index=``/``count=`` (the host's place in the selection, for sharding)
    by accepting them as keyword arguments; they are passed when it declares them.
    """
    wants_shard = "index" in inspect.signature(step).parameters

    def one(i: int, host: Host) -> Outcome:
        extra = {"index": i, "count": len(hosts)} if wants_shard else {}
        try:
            with connect(host) as session:
                return Outcome(host, step(session, *args, **kwargs, **extra) or {})
        except SpecopsError as e:
            return Outcome(host, error=str(e), exit_code=e.exit_code)
        except Exception as e:  # an unexpected bug on one host must not hide the others' results
            return Outcome(host, error=f"{host.name}: internal error: {type(e).__name__}: {e}", exit_code=1)

    with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
        try:
            return list(pool.map(one, range(len(hosts)), hosts))
        except KeyboardInterrupt:
            # Ctrl-C reaches this thread only: the workers' commands end when their connections do
            # (a pty command with SIGHUP on its host), instead of the pool waiting for them.
            hang_up_all()
            raise


def report(outcomes: list[Outcome], *, as_json: bool = False, out=None) -> int:
    """Print one row per host (or JSON) and return the exit code: 0 only if all succeeded."""
    out = out or sys.stdout
    if as_json:
        doc = [{"host": o.host.name, "ok": o.ok, **({"error": o.error} if o.error else {}), **o.row}
               for o in outcomes]
        print(json.dumps(doc, indent=2, default=str), file=out)
    else:
        print_table([{"host": o.host.name, "status": "ok" if o.ok else "FAILED", **o.row}
                     if o.ok else {"host": o.host.name, "status": "FAILED", "error": o.error}
                     for o in outcomes], out=out)
    failed = [o for o in outcomes if not o.ok]
    return max((o.exit_code for o in failed), default=0)


def print_table(rows: list[dict], out=None) -> None:
    """Rows as a table with a column per key (first seen first), drawn with rich.

    On a terminal, rich fits it to the width (long cells wrap within their column, the header
    is bold); anywhere else every row is one line of plain text, columns two spaces apart, so
    scripts and CI logs can read it.
    """
    out = out or sys.stdout
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*(Text(_cell(r.get(c, ""))) for c in columns))  # Text: no markup read from cells
    console = Console(file=out, highlight=False, emoji=False)
    if console.is_terminal:
        console.print(table)
    else:
        plain = Console(file=io.StringIO(), width=1 << 20, highlight=False, emoji=False, color_system=None)
        with plain.capture() as captured:
            plain.print(table)
        for line in captured.get().splitlines():
            print(line.rstrip(), file=out)
    out.flush()


def _cell(value) -> str:
    """A value as table text; host text among it (errors, run ids, progress) cannot drive the terminal."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    return untrusted.clean(str(value))

