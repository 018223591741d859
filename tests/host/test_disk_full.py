"""A run that fills its disk records how it ended: exit_code (written into space the wrapper reserved
at the start) and disk_full, so `inv status` says "disk full". Before the fix the run was "lost", its
log empty and no exit code written."""

import pytest

from specops.host import connect
from tests.helpers.invoke_cli import inv
from tests.helpers.runs_bed import prepare, start, wait_for

FILL = """
import sys
with open("data.jsonl", "w") as f:
    while True:
        f.write("x" * 65536)
        f.flush()
"""


@pytest.mark.parametrize("size", ["256k", "1m"])
def test_a_run_that_fills_the_disk_says_disk_full(tmp_path, ssh_host, size):
    path, [host] = prepare(tmp_path, [ssh_host])
    with connect(host) as s:  # the sshd's own mount namespace: the tmpfs is the host's, not this machine's
        s.run(["mkdir", "-p", f"{s.workdir}/runs"])
        s.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", f"{s.workdir}/runs"])
    try:
        run_id = start([host], FILL, name="fill-1")
        row = wait_for(host, run_id, {"succeeded", "failed", "lost"}, timeout=60)
        assert row["state"] == "failed" and row["exit"] not in (None, 0), row
        proc = inv("status", "--on", "bed", "--run", run_id, inventory=path)
        line = next(line for line in proc.stdout.splitlines() if run_id in line)
        assert "failed" in line and "disk full on the host" in line, proc.stdout
        assert proc.returncode == 1
    finally:
        with connect(host) as s:
            s.run(["umount", f"{s.workdir}/runs"], check=False)
