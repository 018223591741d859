"""`inv report RUN`: where a run's report.html is on this machine, pulled first if it is not here.

Every generate, train, eval and extract run draws ``report.html`` in its run directory
(remote/report.py: plots inline, nothing fetched, so it opens offline). ``inv pull`` brings
it home with the rest of the run; this task prints its path, one line per host, on stdout,
so that ``xdg-open "$(inv report RUN --on h200-a)"`` works::

    $ inv report train-20261202-120000 --on gpu
    /home/me/specops/artifacts/train-20261202-120000/gpu1/report.html
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import pull
from .errors import SpecopsError
from .inventory import Host
from .runs import check_run_id
from .shared import layout


def local_path(dest: str, run_id: str, host: Host) -> Path:
    return (Path(dest) / run_id / host.name / layout.REPORT_HTML).resolve()


def locate(hosts: list[Host], run_id: str, *, dest: str = pull.ARTIFACTS, out=None) -> int:
    """Print each host's local report path; a run not here yet (or still running) is pulled first,
    its pull table going to stderr. Non-zero when a host has no report."""
    out = out or sys.stdout
    check_run_id(run_id)
    code = 0
    missing = [h for h in hosts if not local_path(dest, run_id, h).is_file()]
    if missing:
        code = pull.pull(missing, run_id, dest=dest, out=sys.stderr)
    found = [h for h in hosts if local_path(dest, run_id, h).is_file()]
    for host in found:
        print(local_path(dest, run_id, host), file=out)
    out.flush()
    absent = [h.name for h in hosts if h not in found]
    if absent and not code:
        w = "<workdir>"
        raise SpecopsError(f"run {run_id} has no {layout.REPORT_HTML} on {', '.join(absent)} (a run from before "
                           f"reports, or one that has not drawn it yet): redraw it on the host with "
                           f"`{layout.venv_python(w)} {layout.code_file(w, 'remote/report.py')} "
                           f"{layout.runs_dir(w)}/{run_id}`")
    return code or (1 if absent else 0)
