"""Directory walks against a directory another process is writing (vanishing files).
Pull, which needs a host, is in tests/host/test_vanishing_files_pull.py.

A file listed a moment ago may be gone when it is stat'ed, opened or removed: vLLM's request
files and locks, a live run's temporaries, a streaming trainer's consumed shards. Each walk
that specops does over such a directory must skip what vanished and go on.

Two kinds of test, both failing on the code before the fix:
- certain: the walk's own listing call is wrapped so that every entry it lists is deleted before
  the walk looks at it (the race's outcome forced, on every entry);
- live: a second process creates and deletes files in the directory as fast as it can while the
  walk runs a fixed number of times, as vLLM or a run does.
"""

import json
import os
import sys

from tests.helpers.churn import churning, plant, repeat, vanishing_scandir
from tests.helpers.fixtures_train import REMOTE

sys.path.insert(0, str(REMOTE))
import extract  # noqa: E402  (remote/ scripts import their siblings by name)
import manifest  # noqa: E402
import states_dir  # noqa: E402


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
