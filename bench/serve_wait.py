"""How fast `inv serve --wait` notices readiness and death, against the stand-in server's own clock.

    .venv/bin/python bench/serve_wait.py [--rounds 5]

The served process is tests/helpers/standin_vllm.py under the tmux supervisor (the real code path:
rendered files, supervise.sh, the host-side probe), on the local host and, when this machine
can start one (root), a loopback sshd host. Each round:

- ready: the stand-in "loads" for 2 s and writes time.time() the moment /v1/models can answer;
  we time how long after that `serve(..., wait=True)` returns. Baseline, same round: a poller
  in this process hitting /v1/models every 20 ms (the best any poller could do).
  Target: ≤ 2 s.
- death: the stand-in exits 1 two seconds into a 30 s load, writing time.time() just before;
  we time how long after that `serve --wait` fails. Target: ≤ 5 s.
"""

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specops import inventory, serve  # noqa: E402
from specops.errors import SpecopsError  # noqa: E402
from specops.host import connect  # noqa: E402
from tests.helpers.hostbed import loopback_sshd, missing_capability, write_inventory  # noqa: E402
from tests.helpers.standin_vllm import install_shim  # noqa: E402
from tests.helpers.vllm_proc import free_port  # noqa: E402


def poll_until_listed(port: int, name: str, stop: threading.Event, seen: list) -> None:
    while not stop.is_set():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as resp:
                if any(m["id"] == name for m in json.load(resp)["data"]):
                    seen.append(time.time())
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.02)


def one_round(make_host, scratch: Path, kind: str, number: int) -> tuple[float, float | None]:
    """(specops latency, baseline latency or None) for one ready/death round, in seconds.

    Each round serves a new model name, so the poller cannot mistake the previous round's server."""
    stamp = scratch / f"{kind}.time"
    stamp.unlink(missing_ok=True)
    if kind == "ready":
        env = {"STANDIN_LOAD_S": "2", "STANDIN_READY_FILE": str(stamp)}
    else:
        env = {"STANDIN_LOAD_S": "30", "STANDIN_DIE_AT_S": "2", "STANDIN_DIED_FILE": str(stamp)}
    name = f"standin-{kind}-{number}"
    host = make_host(env, name)
    with connect(host) as session:  # connecting is not timed: only what follows the stand-in's stamp
        stop, seen = threading.Event(), []
        poller = threading.Thread(target=poll_until_listed, args=(host.port, name, stop, seen), daemon=True)
        poller.start()
        try:
            serve.serve(session, restart=True, wait=True, timeout=60, secrets={}, live=False, out=io.StringIO())
            outcome = "ready"
        except SpecopsError:
            outcome = "death"
        returned = time.time()
    stop.set()
    poller.join()
    if outcome != kind:
        raise SystemExit(f"expected {kind}, got {outcome}")
    truth = float(stamp.read_text())
    return returned - truth, (seen[0] - truth if seen else None)


def bench(label: str, make_host, scratch: Path, rounds: int) -> None:
    try:
        for kind, target in (("ready", 2.0), ("death", 5.0)):
            ours, base = [], []
            for number in range(rounds):
                o, b = one_round(make_host, scratch, kind, number)
                ours.append(o)
                if b is not None:
                    base.append(b)
            line = (f"{label:6} {kind:6} --wait: median {statistics.median(ours):.2f} s, "
                    f"max {max(ours):.2f} s (target <= {target:g} s)")
            if base:
                line += f"; 20 ms direct poller: median {statistics.median(base):.2f} s"
            print(line, flush=True)
    finally:
        with connect(make_host({}, "standin")) as session:
            serve.stop(session)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    os.environ["SPECOPS_SSH_CONFIG"] = "none"
    with tempfile.TemporaryDirectory(prefix="serve-wait-bench-") as tmp:
        tmp = Path(tmp)
        os.environ["TMUX_TMPDIR"] = str(tmp)  # a private tmux server for the local host
        workdir = tmp / "local work"
        install_shim(workdir / "venv")
        (workdir / "models" / "standin").mkdir(parents=True)  # `inv serve` checks the model is there
        port = free_port()

        def local_host(env, name):
            here = {"ansible_connection": "local", "workdir": str(workdir), "flavor": "cpu",
                    "model": "models/standin", "served_model_name": name, "port": port, "python": "/usr/bin/python3", "env": env}
            path = tmp / "local.yaml"
            path.write_text(yaml.safe_dump({"all": {"children": {"local": {"hosts": {"here": here}}}}}))
            return inventory.load(path).select("here")[0]

        bench("local", local_host, tmp, rounds)
        if missing_capability("loopback"):
            print(f"ssh       skipped: {missing_capability('loopback')}")
            return
        with loopback_sshd(tmp / "sshd", users=("root",)) as (ssh,):
            ssh_workdir = f"{ssh.workdir}/ssh work"
            install_shim(Path(ssh_workdir) / "venv")  # the loopback host shares this filesystem
            (Path(ssh_workdir) / "models" / "standin").mkdir(parents=True)
            ssh_port = free_port()

            def ssh_host(env, name):
                path = write_inventory(tmp / "ssh.yaml", {"bench": [ssh]}, host_vars={ssh.name: {
                    "workdir": ssh_workdir, "flavor": "cpu", "model": "models/standin", "served_model_name": name,
                    "port": ssh_port,
                    "python": "/usr/bin/python3", "env": env}})
                return inventory.load(path).select(ssh.name)[0]

            bench("ssh", ssh_host, tmp, rounds)


if __name__ == "__main__":
    main()
