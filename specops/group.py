"""Group training: one torchrun job across the hosts of a group, every rank on the same samples.

Host 0 of the selection is node rank 0 and the rendezvous master; the others
reach it at its ``private_address`` (default: the address SSH uses). Every node is started by
``remote/torchrun_node.py``, which first checks within a timeout that the master is reachable
(failing in one line that names the address, not a 10-minute hang in torchrun), then runs
torchrun with a static rendezvous. Before launch, :func:`ship_data` gives every node the same
merged data (see its docstring for why that and not an exchange between ranks).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from . import fanout, owned, pull, transfer
from .errors import SpecopsError
from .host import Session, quote
from .inventory import Host
from .shared import layout

RENDEZVOUS_TIMEOUT = 60  # seconds a node waits to reach the master before failing
JOIN_TIMEOUT = 900  # seconds torchrun's store waits for every node to join


# ---------------------------------------------------------------- group training

def master_address(host: Host) -> str:
    """Where the group's other nodes reach this host (the rendezvous master)."""
    if host.is_local:
        return "127.0.0.1"
    return host.vars.get("private_address") or host.address


_FREE_PORT = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"


def free_port(session: Session) -> int:
    """A TCP port free on the master now (torchrun binds it a moment later)."""
    r = session.run([session.venv_python, "-c", _FREE_PORT], timeout=30)
    return int(r.stdout.strip())


def node_argv(python: str, wrapper: str, script: str, script_args: list[str], *, nnodes: int, node_rank: int,
              nproc: int, master_addr: str, master_port: int, run_id: str,
              rendezvous_timeout: float = RENDEZVOUS_TIMEOUT, join_timeout: float = JOIN_TIMEOUT) -> list[str]:
    """One node's command: the reachability check, then torchrun (static rendezvous) running ``script``."""
    return [python, wrapper, "--master-addr", master_addr, "--master-port", str(master_port),
            "--node-rank", str(node_rank), "--timeout", f"{rendezvous_timeout:g}", "--",
            python, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
            f"--nproc-per-node={nproc}", f"--master-addr={master_addr}", f"--master-port={master_port}",
            f"--rdzv-id={run_id}", f"--rdzv-conf=timeout={int(join_timeout)}", script, *script_args]


# ---------------------------------------------------------------- one sample list for every rank

def shipped_path(session: Session, run_id: str) -> str:
    """Where a node keeps the merged data of generate run ``run_id`` (outside runs/: not a run's output)."""
    return layout.merged_data(session.workdir, run_id)


def local_data(local_run: Path) -> Path | None:
    """The pulled run's records, each id once: merged.jsonl of a sharded run, the one host's data.jsonl otherwise."""
    if (local_run / layout.MERGED).exists():
        return local_run / layout.MERGED
    singles = [p for p in local_run.glob(f"*/{layout.ROWS}")]
    return singles[0] if len(singles) == 1 else None


def ship_data(hosts: list[Host], run_ids: list[str], *, dest: str = pull.ARTIFACTS, out=None) -> None:
    """Give every node the same bytes to train on: pull each generate run from the group (verified,
    merged once by row id), then write the merged file to every node (:func:`shipped_path`).

    Every rank then renders the same samples in the same order, so the draft vocabulary, the
    step count and the batches agree without the trainer knowing how the rows were sharded.
    """
    out = out or sys.stdout
    for run_id in run_ids:
        rc = pull.pull(hosts, run_id, dest=dest, out=out)
        source = local_data(Path(dest) / run_id)
        if source is None:
            raise SpecopsError(f"cannot train the group on {run_id}: its rows are not all home and merged "
                               f"(inv pull output above{'; exit ' + str(rc) if rc else ''}); finish or re-plan the "
                               f"generate run (inv generate --name {run_id} --resume), then train again")
        digest, rows = hashlib.sha256(), 0
        with open(source, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
                rows += block.count(b"\n")

        def put(session: Session) -> dict:
            path = shipped_path(session, run_id)
            owned.claim(session, layout.DATA)
            have = session.sh(f"sha256sum {quote(path)} 2>/dev/null", check=False, timeout=600).stdout.split()
            same = have[:1] == [digest.hexdigest()]
            return {"data": run_id, "rows": rows,
                    "shipped": "no (same there)" if same else transfer.push_file(session, str(source), path)}

        rc = fanout.report(fanout.each(hosts, put), out=out)
        if rc:
            raise SpecopsError(f"cannot train the group on {run_id}: its merged data did not reach every node",
                               exit_code=rc)
