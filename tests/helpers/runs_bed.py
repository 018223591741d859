"""Detached runs on the test hosts: deployed code, a venv, small Python payloads, waiting for a state."""

import time

from specops import deploy, inventory, runs, watch
from specops.host import connect
from specops.plan import first_plan
from tests.helpers.hostbed import write_inventory
from tests.helpers.invoke_cli import REPO

PROJECT_VENV = str(REPO / ".venv")  # the checkout under test; the test hosts see it


def prepare(tmp_path, hosts, group="bed"):
    """An inventory for the bed hosts, each with the deployed code and a venv; returns (path, [Host])."""
    path = write_inventory(tmp_path / "inventory.yaml", {group: hosts})
    selected = inventory.load(path).select(group)
    for host in selected:
        with connect(host) as s:
            deploy.deploy(s)
            s.run(["ln", "-sfn", PROJECT_VENV, f"{s.workdir}/venv"])
    return path, selected


def python(code, *args, plan=None):
    """A run's command; with ``plan``, each host gets ``--shard`` its part, as jobs.generate hands it."""
    def argv(s, i, k):
        part = (plan or {}).get(s.host.name)
        return [s.venv_python, "-c", code, *map(str, args)] + (["--shard", part] if part else [])
    return argv


def start(hosts, code, *args, name=None, sharded=False, **kwargs):
    plan = first_plan([h.name for h in hosts]) if sharded else None
    run_id, exit_code = runs.launch_on(hosts, "test", python(code, *args, plan=plan), name=name, plan=plan, **kwargs)
    assert exit_code == 0
    return run_id


def run_row(host, run_id):
    with connect(host) as s:
        found = watch.host_status(s, run_id)["runs"]
    return found[0] if found else None


def wait_for(host, run_id, states, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = run_row(host, run_id)
        if row and row["state"] in states:
            return row
        time.sleep(0.2)
    raise AssertionError(f"{host.name}: {run_id} never reached {states}; last seen {row}")
