"""A run that ended with a non-zero exit code failed, whatever else is true: `inv status` says so with
the run's own one-line account (stats.json's "failure"), and `inv pull` - with or without a run id -
says the run it copied failed instead of a bare "ok". The host's files are read as data: a stats.json
that is no JSON object, or whose failure is no string, only loses the account."""

import json
from pathlib import Path

import pytest

from specops import pull as pull_mod
from tests.helpers.hostbed import write_inventory
from tests.helpers.invoke_cli import inv

WHY = "3 of 10 rows succeeded (min 50%); commonest error (7 rows): HTTP 400: bad request"
STATS = {
    "the run's account": (json.dumps({"failure": WHY, "completed": 3}).encode(), WHY),
    "no stats.json": (None, None),
    "a list": (b'["failure"]', None),
    "a failure that is no string": (b'{"failure": {"x": 1}}', None),
    "bytes that are not UTF-8": (b'{"failure": "\xff\xfe"}', None),
    "escapes in the account": (json.dumps({"failure": "bad \x1b[2Jthing"}).encode(), "bad thing"),
}


def _run(host, run_id, exit_code, stats):
    d = Path(host.workdir) / "runs" / run_id
    d.mkdir(parents=True)
    (d / "data.jsonl").write_text('{"id": "a"}\n')
    (d / "meta.json").write_text(json.dumps({"kind": "generate"}))
    (d / "exit_code").write_text(f"{exit_code}\n")
    if stats is not None:
        (d / "stats.json").write_bytes(stats)
    pull_mod.manifest.write(str(d))


@pytest.mark.parametrize("case", sorted(STATS))
def test_status_and_pull_say_a_run_failed(tmp_path, ssh_host, case):
    stats, why = STATS[case]
    _run(ssh_host, "gen-1", 4, stats)
    path = write_inventory(tmp_path / "inventory.yaml", {"bed": [ssh_host]})
    status = inv("status", "--on", "bed", inventory=path)
    row = next(line for line in status.stdout.splitlines() if "gen-1" in line)
    assert " failed " in row and " 4 " in row, status.stdout
    if why:
        assert why in row, status.stdout
    assert "Traceback" not in status.stdout + status.stderr and "\x1b" not in status.stdout

    proc = inv("pull", "--on", "bed", "--dest", tmp_path / "artifacts", inventory=path)  # no run id: the newest
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in text and "\x1b" not in text, text
    said = [line for line in proc.stdout.splitlines() if line.startswith("gen-1 failed (exit 4)")]
    assert len(said) == 1 and ssh_host.name in said[0], proc.stdout
    if why:
        assert why in said[0]
    assert (tmp_path / "artifacts/gen-1" / ssh_host.name / "data.jsonl").is_file()  # pulled all the same


def test_a_run_that_succeeded_pulls_with_exit_0(tmp_path, ssh_host):
    _run(ssh_host, "gen-1", 0, json.dumps({"failure": None}).encode())
    path = write_inventory(tmp_path / "inventory.yaml", {"bed": [ssh_host]})
    proc = inv("pull", "--on", "bed", "--dest", tmp_path / "artifacts", inventory=path)
    assert proc.returncode == 0 and "succeeded" in proc.stdout and "failed" not in proc.stdout, proc.stdout
