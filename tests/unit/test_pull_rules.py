"""The rules a pull enforces on what a host names (paths, file names, shard specs) and the rsync it will
use, without a host. With real hosts: tests/host/test_hostile_hosts.py."""
import os

import pytest

from specops import host as host_mod
from specops import pull, transfer
from specops.errors import HostError


def test_pull_rules_without_a_host(tmp_path):
    """The rules themselves (specops.transfer), host-free: every path a host names is checked."""
    (tmp_path / "sub").mkdir()
    assert transfer.inside(tmp_path, "sub/data.jsonl") == tmp_path / "sub" / "data.jsonl"
    for bad in ["/etc/passwd", "../x", "sub/../../x", "", "a//b", "./a", "a/", None, 7, ["a"]]:
        with pytest.raises(HostError, match="not a relative path inside the run directory"):
            transfer.inside(tmp_path, bad)
    (tmp_path / "link").symlink_to("/etc")
    with pytest.raises(HostError, match="is a symlink"):
        transfer.inside(tmp_path, "link/passwd")
    assert [transfer.plain_name(n) for n in ("a.json", ".hidden", "..", ".", "", "a/b", "a\0b")] == \
        [True, True, False, False, False, False, False]
    assert pull.shard_of('{"shard": "0/3,4/6"}', "m") == "0/3,4/6"
    assert pull.shard_of('{"kind": "train"}', "m") is None
    for meta in ['{"shard": "1/1"}', '{"shard": "0/3,"}', '{"shard": 3}', '{"shard": "' + "0/9," * 300 + '0/9"}']:
        with pytest.raises(HostError, match="not a shard spec"):
            pull.shard_of(meta, "m")


def test_an_rsync_that_cannot_protect_arguments_is_not_used(tmp_path, monkeypatch):
    """rsync 2.6.9 (macOS's) has no -s: specops must not hand it a remote path at all (SFTP instead).
    Its --help, as that version prints it, on PATH in place of this machine's rsync."""
    old = tmp_path / "rsync"
    old.write_text("#!/bin/sh\necho 'rsync  version 2.6.9  protocol version 29'\n"
                   "echo ' -r, --recursive             recurse into directories'\nexit 0\n")
    old.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not host_mod.local_rsync_available()
    monkeypatch.setenv("PATH", os.path.dirname(host_mod.shutil.which("rsync", path=os.defpath) or "/usr/bin/rsync"))
    assert host_mod.local_rsync_available()
