"""Directory walks against a directory another process is writing (issue: vanishing files).

A file listed a moment ago may be gone when it is stat'ed, opened or removed: vLLM's request
files and locks, a live run's temporaries, a streaming trainer's consumed shards. Each walk
that specops does over such a directory must skip what vanished and go on.

Two kinds of test, both failing on the code before the fix:
- certain: the walk's own listing call is wrapped so that every entry it lists is deleted before
  the walk looks at it (the race's outcome forced, on every entry);
- live: a second process creates and deletes files in the directory as fast as it can while the
  walk runs many times (bounded in time), as vLLM or a run does.
"""

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specops import inventory
from specops import transfer
from specops.host import connect
from tests.fixtures_train import REMOTE
from tests.hostbed import write_inventory

sys.path.insert(0, str(REMOTE))
import extract  # noqa: E402  (remote/ scripts import their siblings by name)
import manifest  # noqa: E402
import states_dir  # noqa: E402

os.environ["SPECOPS_SSH_CONFIG"] = "none"

# Creates and deletes files named by argv[2:] patterns ({i} a counter) in argv[1], old mtime, until killed.
CHURN = r"""
import os, sys, time
root, patterns = sys.argv[1], sys.argv[2:]
i = 0
while True:
    made = []
    for k in range(200):
        for p in patterns:
            path = os.path.join(root, p.format(i=i * 200 + k))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(b"x" * 4096)
            os.utime(path, (1, 1))
            made.append(path)
    for path in made:
        try:
            os.remove(path)
            if os.path.dirname(path) != root:
                os.rmdir(os.path.dirname(path))
        except OSError:
            pass
    i += 1
"""


@contextlib.contextmanager
def churning(root: Path, *patterns: str):
    """A second process creating and deleting files under root while the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", CHURN, str(root), *patterns])
    try:
        deadline = time.monotonic() + 10
        while not any(root.rglob("*")) and time.monotonic() < deadline:  # churning has begun
            time.sleep(0.01)
        yield
    finally:
        proc.kill()
        proc.wait()


def repeat(times: int, fn) -> None:
    for _ in range(times):
        fn()


@contextlib.contextmanager
def vanishing_scandir(module):
    """module's os.scandir lists as usual, then deletes every file it listed before the caller sees it."""
    def listing(path):
        entries = list(os.scandir(path))
        for e in entries:
            os.remove(e.path)
        return iter(entries)

    original = module.os
    module.os = type(sys)("os_with_vanishing_scandir")
    module.os.__dict__.update(os.__dict__)
    module.os.scandir = listing
    try:
        yield
    finally:
        module.os = original


def plant(root: Path, names: list[str], old: bool = True) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for n in names:
        (root / n).write_bytes(b"y" * 100)
        if old:
            os.utime(root / n, (1, 1))


# ---------------------------------------------------------------- the sweep of vLLM's shared storage


def test_sweep_skips_request_files_that_vanish_after_listing(tmp_path):
    plant(tmp_path, [f"cmpl-{i}.safetensors" for i in range(5)] + [f"cmpl-{i}.safetensors.lock" for i in range(5)])
    with vanishing_scandir(extract):
        assert extract.sweep_stale(str(tmp_path), older_than_s=60) == 0
    assert not any(tmp_path.iterdir())


def test_sweep_survives_a_live_writer(tmp_path):
    storage = tmp_path / "vllm-states"
    storage.mkdir()
    plant(storage, ["keep-me.txt"])
    with churning(storage, "cmpl-{i}.safetensors", "cmpl-{i}.safetensors.lock"):
        repeat(50, lambda: extract.sweep_stale(str(storage), older_than_s=60))
    assert (storage / "keep-me.txt").exists()


# ---------------------------------------------------------------- a run directory's manifest


def test_manifest_leaves_out_files_that_vanish_after_listing(tmp_path, monkeypatch):
    plant(tmp_path, ["data.jsonl", "shard-00000.safetensors"], old=False)
    listed = manifest.files_under

    def listing_then_vanishing(root):
        rels = list(listed(root))
        for rel in rels:
            os.remove(os.path.join(root, rel))
        return iter(rels)

    monkeypatch.setattr(manifest, "files_under", listing_then_vanishing)
    manifest.write(str(tmp_path))
    doc = json.loads((tmp_path / "manifest.json").read_text())
    assert doc == {"files": [], "host_only": {"files": 0, "bytes": 0}}


def test_manifest_of_a_directory_a_streaming_trainer_is_emptying(tmp_path):
    """An extract run's manifest is written while `train --stream` deletes its shards."""
    plant(tmp_path, ["plan.json", "index.json"], old=False)
    with churning(tmp_path, "shard-{i:05d}.safetensors", "shard-{i:05d}.safetensors.tmp", "log{i}.jsonl"):
        repeat(20, lambda: manifest.write(str(tmp_path)))
    doc = json.loads((tmp_path / "manifest.json").read_text())
    assert {"plan.json", "index.json"} <= {f["path"] for f in doc["files"]}
    assert manifest.verify(str(tmp_path)) == [] or all(p.endswith(": missing") for p in manifest.verify(str(tmp_path)))


def test_spool_size_survives_a_live_writer(tmp_path):
    with churning(tmp_path, "requests/cmpl-{i}.safetensors", "shard-{i:05d}.safetensors.tmp"):
        repeat(50, lambda: states_dir.spool_bytes(str(tmp_path)))


# ---------------------------------------------------------------- pull of a live run, every transport


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
