"""`inv pull` of a run directory another process is writing, over rsync, SFTP and a local copy: what
vanished between listing and copy is skipped, the rest arrives (the walks without a host
are in tests/unit/test_vanishing_files.py)."""
import contextlib
import os

import pytest

from specops import inventory, transfer
from specops.host import connect
from tests.helpers.churn import churning, plant, repeat
from tests.helpers.hostbed import write_inventory


def _session_host(tmp_path, ssh_host, local: bool):
    extra = {"ansible_connection": "local", "workdir": str(tmp_path / "wd")} if local else {}
    path = write_inventory(tmp_path / "inventory.yaml", {"bed": [ssh_host]},
                           host_vars={ssh_host.name: extra})
    return inventory.load(path).select("bed")[0]


@pytest.mark.parametrize("method", ["rsync", "sftp", "copy"])
def test_pull_of_a_run_directory_that_is_being_written(tmp_path, ssh_host, method, monkeypatch):
    """A live run creates and deletes temporaries while `inv pull` copies its directory."""
    host = _session_host(tmp_path, ssh_host, local=method == "copy")
    if method != "rsync":
        monkeypatch.setattr(transfer, "local_rsync_available", lambda: False)
    run = tmp_path / "run"
    plant(run, ["data.jsonl", "meta.json"], old=False)
    with connect(host) as session, churning(run, "tmp-{i}.part", "sub{i}/x.bin"):
        pulls = []
        repeat(3, lambda: pulls.append(
            transfer.pull_dir(session, str(run), str(tmp_path / f"dest{len(pulls)}"), exclude=("*.lock",))))
    assert method in pulls[0].method
    for k in range(len(pulls)):
        assert (tmp_path / f"dest{k}" / "data.jsonl").read_bytes() == b"y" * 100


def test_sftp_pull_skips_files_deleted_after_listing(tmp_path, ssh_host, monkeypatch):
    """Certain: every file vanishes between the SFTP listing and its copy."""
    host = _session_host(tmp_path, ssh_host, local=False)
    monkeypatch.setattr(transfer, "local_rsync_available", lambda: False)
    run = tmp_path / "run"
    plant(run, ["a.tmp", "b.tmp"], old=False)
    with connect(host) as session:
        sftp = session.sftp()
        real = sftp.listdir_attr

        def listdir_then_delete(path):
            entries = real(path)
            for e in entries:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(path, e.filename))
            return entries

        monkeypatch.setattr(sftp, "listdir_attr", listdir_then_delete)
        monkeypatch.setattr(session, "sftp", lambda: sftp)
        pulled = transfer.pull_dir(session, str(run), str(tmp_path / "dest"))
    assert pulled.files == 0 and not any((tmp_path / "dest").iterdir())
