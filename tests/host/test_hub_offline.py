"""HF_HUB_OFFLINE is the vLLM service's (its model is a local path), not the runs': generate's default
dataset is a hub name. Before the fix the env file every run sources carried HF_HUB_OFFLINE=1, so a
hub dataset could not be fetched and the error did not say why. A user who sets it in the inventory's
env (an air-gapped host) gets it everywhere, and the dataset error names it and the fix."""

import json
import time
from pathlib import Path

import pytest

from specops import inventory, runs
from specops.host import connect
from tests.helpers.invoke_cli import REPO, inv
from tests.helpers.runs_bed import wait_for
from tests.helpers.serve_bed import outputs, tmux_inventory
from tests.host.test_serve import shim

PAYLOAD = ("import os, sys; sys.path.insert(0, sys.argv[1]); print('offline=' + repr(os.environ.get('HF_HUB_OFFLINE')));"
           "import datasets_io\ntry: datasets_io.open_rows('specops-test/no-such-dataset')\n"
           "except datasets_io.DatasetError as e: print('error=' + str(e))")


@pytest.mark.parametrize("user_env", [{}, {"HF_HUB_OFFLINE": "1"}])
def test_the_service_is_offline_and_runs_are_not_unless_the_user_says(tmp_path, ssh_host, api_key, user_env):
    workdir = f"{ssh_host.workdir}/w"
    shim(ssh_host, f"{workdir}/venv")
    record = Path(workdir, "record.json")
    path = tmux_inventory(tmp_path, ssh_host, workdir, model="models/standin",
                          env={"STANDIN_LOAD_S": "0", "STANDIN_RECORD": str(record), **user_env})
    try:
        served = inv("serve", "--on", ssh_host.name, "--wait", "--timeout", "60", inventory=path)
        assert served.returncode == 0, outputs(served)
        assert json.loads(record.read_text())["hf_hub_offline"] == "1"  # the model never waits on the hub
        (host,) = inventory.load(path).select(ssh_host.name)
        with connect(host) as s:
            s.run(["mkdir", "-p", f"{workdir}/code/remote"])
            for name in ("run.sh", "with_env.sh", "manifest.py"):
                s.run(["cp", str(Path(__file__).resolve().parents[2] / "remote" / name), f"{workdir}/code/remote/"])
            run_id = runs.launch(s, "test", [str(REPO / ".venv/bin/python"), "-c", PAYLOAD,
                                             str(Path(__file__).resolve().parents[2] / "remote")], run_id="r1")
        wait_for(host, run_id, {"succeeded", "failed"}, timeout=120)
        log = Path(workdir, "runs", "r1", "log").read_text()
        if user_env:
            assert "offline='1'" in log and "HF_HUB_OFFLINE is set on this host" in log, log
            assert "drop HF_HUB_OFFLINE from the inventory's env" in log
        else:
            assert "offline=None" in log and "HF_HUB_OFFLINE" not in log.split("offline=None", 1)[1], log
    finally:
        inv("serve", "--on", ssh_host.name, "--stop", inventory=path)
