"""`inv deploy` / `inv deps` on real sshd hosts: deltas, deletes, SFTP fallback, cut links; a single file
pushed whole (a group's merged data)."""

import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specops import deploy, deps, inventory, owned
from specops.errors import HostError
from specops.host import connect
from tests.helpers.hostbed import write_inventory
from tests.helpers.invoke_cli import REPO, inv


@pytest.fixture
def project(tmp_path):
    """A copy of the project's deployable tree, so tests can change files freely."""
    root = tmp_path / "project"
    for d in deploy.DEPLOY_SET:
        if (REPO / d).is_dir():
            shutil.copytree(REPO / d, root / d, ignore=shutil.ignore_patterns("__pycache__"))
    (root / ".gitignore").write_text("*.log\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)  # deploys come from a checkout
    return root


def _session(tmp_path, host, **host_vars):
    path = write_inventory(tmp_path / "inventory.yaml", {"test": [host]}, host_vars={host.name: host_vars})
    return path, inventory.load(path).select("test")[0]


def _expected(project: Path) -> dict:
    return {n: hashlib.sha256(p.read_bytes()).hexdigest() for n, p in deploy.deployable_files(project).items()}


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name not in ("VERSION", owned.MARK)}


@pytest.mark.parametrize("user", ["root", "ml"])
def test_deploy_delta_dry_run_and_delete(tmp_path, loopback, project, user):
    host = loopback[user]
    _, h = _session(tmp_path, host)
    code = Path(host.workdir) / "code"
    (project / "remote" / "debug.log").write_text("ignored by .gitignore")
    (project / "remote" / "__pycache__").mkdir()
    (project / "remote" / "__pycache__" / "x.pyc").write_bytes(b"cache")
    with connect(h) as s:
        first = deploy.deploy(s, root=project)
        assert first.method == "rsync" and first.files_changed == len(deploy.deployable_files(project)) + 1  # + VERSION
        assert not (code / "remote" / "debug.log").exists() and not (code / "remote" / "__pycache__").exists()
        assert (code / "VERSION").is_file()
        assert deploy.deploy(s, root=project).files_changed == 0

        target = project / "remote" / "generate.py" if (project / "remote/generate.py").exists() \
            else project / "remote" / "check_deps.py"
        target.write_text(target.read_text() + "\n# changed\n")
        dry = deploy.deploy(s, root=project, dry_run=True)
        assert [c.split()[-1] for c in dry.changes] == [str(target.relative_to(project))]
        assert (code / target.relative_to(project)).read_text() != target.read_text()  # nothing changed
        one = deploy.deploy(s, root=project)
        assert one.files_changed == 1 and one.bytes_sent < 4096  # a delta, not the whole tree
        assert (code / target.relative_to(project)).read_text() == target.read_text()

        runs, data = Path(host.workdir) / "runs/r1", Path(host.workdir) / "data"
        for d in (runs, data):
            d.mkdir(parents=True)
            (d / "keep.jsonl").write_text("{}\n")
        (code / "stale.txt").write_text("old")
        kept = deploy.deploy(s, root=project, delete=False)
        assert (code / "stale.txt").exists() and kept.files_changed == 0
        pruned = deploy.deploy(s, root=project)
        assert not (code / "stale.txt").exists() and pruned.files_changed == 1
        assert (runs / "keep.jsonl").exists() and (data / "keep.jsonl").exists()
    files = {p for p in _tree(code)}
    assert files == set(deploy.deployable_files(project))


def test_inv_deploy_reports_zero_on_noop(tmp_path, ssh_host):
    path, _ = _session(tmp_path, ssh_host)
    first = inv("deploy", "--on", "test", "--no-deps", inventory=path)
    assert first.returncode == 0, first.stdout + first.stderr
    again = inv("deploy", "--on", "test", "--no-deps", inventory=path)
    header, row = again.stdout.splitlines()[:2]
    assert row.split()[header.split().index("files_changed")] == "0", again.stdout


def test_sftp_fallback_when_host_has_no_rsync(tmp_path, netns_trio, project):
    node = netns_trio[1]  # its /root and /tmp are its own: give root a PATH without rsync
    _, h = _session(tmp_path, node)
    with connect(h) as s:
        s.sh("mkdir -p /tmp/norsync && for t in /usr/bin/*; do [ $(basename $t) = rsync ] || "
             "ln -sf $t /tmp/norsync/; done")
        s.write_file("/root/.bashrc", "export PATH=/tmp/norsync\n")
    try:
        with connect(h) as s:
            assert not s.sh("command -v rsync", check=False).ok
            first = deploy.deploy(s, root=project)
            assert first.method.startswith("sftp") and first.files_changed == len(deploy.deployable_files(project)) + 1  # + VERSION
            assert deploy.deploy(s, root=project).files_changed == 0
            (project / "remote" / "check_deps.py").write_text("# replaced\n")
            s.write_file(f"{s.workdir}/code/stale.txt", "old")
            again = deploy.deploy(s, root=project)
            assert again.files_changed == 2
            listing = s.sh(f"cd {s.workdir}/code && find . -type f ! -name VERSION ! -name {owned.MARK} "
                           f"-exec sha256sum {{}} +").stdout
        assert {l.split()[1][2:]: l.split()[0] for l in listing.splitlines()} == _expected(project)
    finally:
        with connect(h) as s:
            s.run(["rm", "-f", "/root/.bashrc"])


def test_cut_link_mid_deploy_then_rerun_converges(tmp_path, netns_trio, project):
    node = netns_trio[0]
    big = project / "remote" / "blobs"
    big.mkdir()
    for i in range(40):
        (big / f"blob{i:02d}.dat").write_bytes(os.urandom(1_000_000))
    _, h = _session(tmp_path, node, workdir="/root/work/space dir")
    errors = []

    def run():
        try:
            with connect(h) as s:
                deploy.deploy(s, root=project)
        except HostError as e:
            errors.append(str(e))

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    node.cut()
    t.join(timeout=90)
    node.restore()
    assert not t.is_alive()
    assert errors and "rerun `inv deploy`" in errors[0], errors
    for _ in range(20):  # the bridge relearns the restored link within a moment
        try:
            with connect(h) as s:
                s.run(["true"])
            break
        except HostError:
            time.sleep(0.5)
    with connect(h) as s:
        deploy.deploy(s, root=project)
        listing = s.sh(f"cd '{s.workdir}/code' && find . -type f ! -name VERSION ! -name {owned.MARK} "
                       f"-exec sha256sum {{}} +").stdout
    remote = {line.split()[1][2:]: line.split()[0] for line in listing.splitlines()}
    assert remote == _expected(project)


def test_deps_names_missing_package_and_fix_installs_it(tmp_path, ssh_host, project):
    (project / "requirements" / "remote.txt").write_text("six==1.16.0\n")
    (project / "requirements" / "cpu.txt").write_text("")
    _, h = _session(tmp_path, ssh_host, flavor="cpu", python=sys._base_executable)
    with connect(h) as s:
        deploy.deploy(s, root=project)
        with pytest.raises(HostError) as info:
            deps.check(s)
        message = str(info.value)
        assert "six missing (wanted ==1.16.0" in message and "--fix" in message
        row = deps.check(s, fix=True)
        assert row["packages"] == "1 ok"
        assert s.run([s.venv_python, "-c", "import six; print(six.__version__)"]).stdout.strip() == "1.16.0"


@pytest.mark.parametrize("rsync", [True, False])
def test_shipping_replaces_the_file_whole_over_rsync_or_sftp(tmp_path, ssh_host, monkeypatch, rsync):
    """The merged data reaches a node by rsync, or SFTP where rsync is missing here, renamed into place."""
    from specops import transfer
    if not rsync:
        monkeypatch.setattr(transfer, "local_rsync_available", lambda: False)
    path = write_inventory(tmp_path / "inventory.yaml", {"one": [ssh_host]})
    host = inventory.load(path).select("one")[0]
    local = tmp_path / "merged.jsonl"
    local.write_bytes(b'{"id": "a b $(x)"}\n' * 5000)
    target = f"{ssh_host.workdir}/data/gen 1/merged.jsonl"
    with connect(host) as s:
        assert transfer.push_file(s, str(local), target) == ("rsync" if rsync else "sftp (rsync missing)")
        local.write_bytes(b'{"id": "b"}\n')
        transfer.push_file(s, str(local), target)
    assert open(target, "rb").read() == b'{"id": "b"}\n'  # a loopback host shares this filesystem
    assert sorted(os.listdir(os.path.dirname(target))) == ["merged.jsonl"]
