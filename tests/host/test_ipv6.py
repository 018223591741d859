"""A host whose ansible_host is an IPv6 literal (an sshd listening on [::1] only): deploy, a single
file pushed whole and pull all go over rsync. Before the fix rsync read `root@::1:/path` as daemon
syntax (`::` is rsync's module separator) and every transfer failed."""

import json
from pathlib import Path

import pytest

from specops import deploy, inventory, transfer
from specops import pull as pull_mod
from specops.host import connect
from tests.helpers.hostbed import write_inventory
from tests.helpers.invoke_cli import inv


def _inventory(tmp_path, host, **host_vars):
    return write_inventory(tmp_path / "inventory.yaml", {"v6": [host]}, host_vars={host.name: host_vars})


@pytest.mark.parametrize("workdir", ["plain", "a b"])
def test_deploy_and_pull_over_ipv6_use_rsync(tmp_path, ipv6_host, workdir):
    work = Path(ipv6_host.workdir) / workdir
    path = _inventory(tmp_path, ipv6_host, workdir=str(work))
    proc = inv("deploy", "--on", "v6", "--no-deps", inventory=path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " rsync " in proc.stdout and (work / "code/remote/run.sh").is_file(), proc.stdout

    d = work / "runs" / "gen-1"
    d.mkdir(parents=True)
    (d / "data.jsonl").write_text('{"id": "a"}\n')
    (d / "meta.json").write_text(json.dumps({"kind": "generate"}))
    (d / "exit_code").write_text("0\n")
    pull_mod.manifest.write(str(d))
    proc = inv("pull", "--on", "v6", "--run", "gen-1", "--dest", tmp_path / "artifacts", inventory=path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " rsync " in proc.stdout and " yes" in proc.stdout, proc.stdout
    assert (tmp_path / "artifacts/gen-1" / ipv6_host.name / "data.jsonl").read_text() == '{"id": "a"}\n'


def test_rsync_location_brackets_an_ipv6_literal_and_a_file_goes_whole(tmp_path, ipv6_host):
    (host,) = inventory.load(_inventory(tmp_path, ipv6_host)).select("v6")
    local = tmp_path / "merged.jsonl"
    local.write_text('{"id": "x"}\n')
    target = f"{ipv6_host.workdir}/data/gen-1/merged.jsonl"
    with connect(host) as s:
        assert s.rsync_location("/p")[1] == "root@[::1]:/p"
        assert transfer.push_file(s, str(local), target) == "rsync"
        assert deploy.deploy(s, dry_run=True).method == "rsync"
    assert Path(target).read_text() == '{"id": "x"}\n'
