"""specops deletes only what it made: every directory it writes under a workdir (code/, venv/, runs/,
data/, service/) carries a marker from its creation, and one without it is refused, untouched.

The bed: a loopback host whose workdir plays a user's home (`workdir: "~"`), holding the user's own
directories of those names. Before the fix `inv deploy` wiped a user's ~/code with rc 0.
"""

import dataclasses
import io
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from specops import deploy, deps, group, inventory, owned, runs, transfer
from specops import pull as pull_mod
from specops.errors import HostError, SpecopsError
from specops.host import connect
from specops.service_spec import Layout, Policy, render
from specops.supervisors import choose, host_facts
from tests.helpers.hostbed import write_inventory
from tests.helpers.invoke_cli import inv


def _bed(tmp_path, host, **host_vars):
    path = write_inventory(tmp_path / "inventory.yaml", {"bed": [host]}, host_vars={host.name: host_vars})
    return path, inventory.load(path).select("bed")[0]


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _plant(root: Path, files: dict) -> dict:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return _tree(root)


USERS_CODE = {
    "plain": {"notes.txt": "my thesis\n", "src/main.c": "int main;\n"},
    "a checkout of specops": {"VERSION": "x\n", "remote/run.sh": "mine\n", "requirements/remote.txt": "six\n",
                              ".git/HEAD": "ref: refs/heads/main\n"},
    "deploy's names and one more": {"VERSION": "x\n", "remote/run.sh": "mine\n", "thesis.tex": "\\begin\n"},
    "no VERSION": {"remote/run.sh": "mine\n", "templates/a.j2": "a\n"},
}


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize("method", ["rsync", "sftp"])
@pytest.mark.parametrize("case", sorted(USERS_CODE))
def test_deploy_refuses_a_code_directory_it_did_not_make(tmp_path, ssh_host, monkeypatch, case, method, dry_run):
    home = Path(ssh_host.workdir)
    before = _plant(home / "code", USERS_CODE[case])
    if method == "sftp":
        monkeypatch.setattr(transfer, "local_rsync_available", lambda: False)
    _, h = _bed(tmp_path, ssh_host)
    with connect(h) as s, pytest.raises(HostError) as info:
        deploy.deploy(s, dry_run=dry_run)
    message = str(info.value)
    assert f"{home}/code exists and was not made by specops" in message and "\n" not in message
    assert f"touch {home}/code/{owned.MARK}" in message and "workdir" in message
    assert _tree(home / "code") == before  # nothing deleted, nothing added (no marker either)


def test_inv_deploy_refusal_is_one_line_and_exit_1(tmp_path, ssh_host):
    home = Path(ssh_host.workdir)
    before = _plant(home / "code", USERS_CODE["plain"])
    path, _ = _bed(tmp_path, ssh_host, workdir=str(home))
    proc = inv("deploy", "--on", "bed", inventory=path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    failed = [line for line in proc.stdout.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and "was not made by specops" in failed[0], proc.stdout
    assert _tree(home / "code") == before and not (home / "venv").exists()


@pytest.mark.parametrize("method", ["rsync", "sftp"])
def test_deploy_owns_what_it_creates_and_keeps_the_marker(tmp_path, ssh_host, monkeypatch, method):
    if method == "sftp":
        monkeypatch.setattr(transfer, "local_rsync_available", lambda: False)
    _, h = _bed(tmp_path, ssh_host)
    code = Path(ssh_host.workdir) / "code"
    with connect(h) as s:
        deploy.deploy(s)
        assert (code / owned.MARK).is_file()
        (code / "stale.txt").write_text("old")
        again = deploy.deploy(s)
    assert not (code / "stale.txt").exists() and (code / owned.MARK).is_file()
    assert [c for c in again.changes if owned.MARK in c] == []


def test_an_older_specops_deployment_is_adopted_once_with_its_siblings(tmp_path, ssh_host):
    """A workdir an older specops deployed has no markers: its code/ holds only deploy's names and
    VERSION. Its code/, runs/, venv/ and service/ become specops's; stale code is pruned, runs kept."""
    home = Path(ssh_host.workdir)
    _plant(home / "code", {"VERSION": "old\n", "remote/gone.py": "x\n", "requirements/remote.txt": "six\n"})
    kept = _plant(home / "runs", {"gen-1/data.jsonl": '{"id": "a"}\n'})
    _plant(home / "service", {"vllm.env": "X=1\n"})
    _, h = _bed(tmp_path, ssh_host)
    with connect(h) as s:
        deploy.deploy(s)
    assert not (home / "code/remote/gone.py").exists() and (home / "code/remote/run.sh").is_file()
    for d in ("code", "runs", "service"):
        assert (home / d / owned.MARK).is_file(), d
    assert not (home / "venv").exists() and not (home / "data").exists()  # never made here: not created
    assert {k: v for k, v in _tree(home / "runs").items() if k != owned.MARK} == kept


def _foreign(home: Path, name: str) -> dict:
    return _plant(home / name, {"mine.txt": "the user's\n"})


def test_a_run_is_not_started_in_a_users_runs_directory(tmp_path, ssh_host):
    home = Path(ssh_host.workdir)
    _, h = _bed(tmp_path, ssh_host)
    with connect(h) as s:
        deploy.deploy(s)
        (home / "venv/bin").mkdir(parents=True)
        os.symlink(sys.executable, home / "venv/bin/python")
        before = _foreign(home, "runs")
        with pytest.raises(HostError, match=f"{home}/runs exists and was not made by specops"):
            runs.launch(s, "test", [s.venv_python, "-c", "pass"], run_id="r1")
        assert _tree(home / "runs") == before
        (home / "runs" / owned.MARK).write_text("")  # what the refusal tells the user to do
        assert runs.launch(s, "test", [s.venv_python, "-c", "pass"], run_id="r1") == "r1"
    assert (home / "runs/r1/cmd").is_file() and (home / "runs/r1/meta.json").is_file()


def test_serve_never_closes_or_writes_a_users_service_directory(tmp_path, ssh_host):
    home = Path(ssh_host.workdir)
    before = _foreign(home, "service")
    (home / "service").chmod(0o755)
    _, h = _bed(tmp_path, ssh_host)
    with connect(h) as s:
        layout = Layout(s.workdir)
        facts = host_facts(s, layout)
        sup = choose(s, facts, layout, "tmux", Policy())
        rendered = render(h, workdir=s.workdir, user=facts.user, venv_python=s.venv_python, model="/m",
                          secrets={"VLLM_API_KEY": "sk-x"})
        with pytest.raises(HostError, match=f"{home}/service exists and was not made by specops"):
            sup.write(rendered)
    assert _tree(home / "service") == before and stat.S_IMODE((home / "service").stat().st_mode) == 0o755


@pytest.mark.parametrize("fix", [False, True])
def test_deps_never_installs_into_a_users_venv(tmp_path, ssh_host, fix):
    """A venv/ specops did not make: neither `python -m venv` over it (no python in it) nor pip
    install/uninstall in it (a venv of the user's own)."""
    home = Path(ssh_host.workdir)
    _, h = _bed(tmp_path, ssh_host, flavor="cpu", python=sys._base_executable)
    with connect(h) as s:
        deploy.deploy(s)
        if fix:  # the user's own venv, with python: only --fix would write into it
            s.run([sys._base_executable, "-m", "venv", "--without-pip", str(home / "venv")], timeout=120)
        else:
            _foreign(home, "venv")
        before = _tree(home / "venv")
        with pytest.raises(HostError) as info:
            deps.check(s, fix=fix)
    if fix:
        assert "was not made by specops" in str(info.value), info.value
    else:
        assert f"{home}/venv exists and was not made by specops" in str(info.value)
    assert _tree(home / "venv") == before


def test_group_data_is_not_shipped_into_a_users_data_directory(tmp_path, ssh_host):
    home = Path(ssh_host.workdir)
    d = home / "runs" / "gen-1"
    d.mkdir(parents=True)
    (home / "runs" / owned.MARK).write_text("")
    (d / "data.jsonl").write_text('{"id": "a"}\n')
    (d / "meta.json").write_text(json.dumps({"kind": "generate"}))
    (d / "exit_code").write_text("0\n")
    pull_mod.manifest.write(str(d))
    before = _foreign(home, "data")
    _, h = _bed(tmp_path, ssh_host)
    out = io.StringIO()
    with pytest.raises(SpecopsError, match="did not reach every node"):
        group.ship_data([h], ["gen-1"], dest=str(tmp_path / "artifacts"), out=out)
    assert f"{home}/data exists and was not made by specops" in out.getvalue(), out.getvalue()
    assert _tree(home / "data") == before


@pytest.mark.parametrize("task", [("serve", "--status"), ("status",), ("deploy", "--no-deps")])
def test_two_entries_sharing_a_workdir_are_refused_before_any_host_is_touched(tmp_path, loopback, task):
    """The README's "GPUs 0-3 and 4-7 on one machine" with the per-entry workdir forgotten: the two
    entries fought over one service. Refused at load, naming both, whatever the task."""
    root = loopback["root"]
    twin = dataclasses.replace(root, name="loop-twin")
    path = write_inventory(tmp_path / "inventory.yaml", {"bed": [root, twin]},
                           host_vars={twin.name: {"port": 8001}})
    proc = inv(*task, "--on", "bed", inventory=path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = (proc.stdout + proc.stderr).strip()
    assert len(out.splitlines()) == 1 and f"'{root.name}' and 'loop-twin' are one machine" in out, out
    assert list(Path(root.workdir).iterdir()) == []  # nothing was written there
