"""`inv train` checks on the host, before launching, that the target is a model directory and that
every --data file and the --states directory exist: one line naming the path, nothing started. Before
the fix each launched a run that failed inside, with a hint about another flag."""

import json
from pathlib import Path

import pytest

from tests.helpers.hostbed import write_inventory
from tests.helpers.invoke_cli import inv


def _bed(tmp_path, host):
    work = Path(host.workdir)
    (work / "models/tiny").mkdir(parents=True)
    (work / "runs/gen-1").mkdir(parents=True)
    (work / "runs/gen-1/data.jsonl").write_text('{"id": "a"}\n')
    (work / "runs/ext-1").mkdir()
    (work / "my.jsonl").write_text('{"id": "a"}\n')
    return write_inventory(tmp_path / "inventory.yaml", {"bed": [host]},
                           host_vars={host.name: {"model": "models/tiny", "flavor": "cpu"}}), work


CASES = {
    "a model directory without config.json": (["--data", "gen-1"], False, "has no config.json at {w}/models/tiny"),
    "no model directory": (["--data", "gen-1"], "gone", "has no config.json at {w}/models/tiny"),
    "a run id that is not there": (["--data", "gen-2"], True, "--data gen-2: no {w}/runs/gen-2/data.jsonl"),
    "the second of two runs": (["--data", "gen-1", "--data", "gen-3"], True, "--data gen-3: no {w}/runs/gen-3"),
    "a path that is not there": (["--data", "{w}/nope.jsonl"], True, "no file {w}/nope.jsonl on the host"),
    "states that are not there": (["--data", "gen-1", "--states", "ext-2"], True, "--states ext-2: no directory"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_train_refuses_before_launch(tmp_path, ssh_host, case):
    path, work = _bed(tmp_path, ssh_host)
    args, config, expected = CASES[case]
    if config is True:
        (work / "models/tiny/config.json").write_text(json.dumps({"model_type": "qwen3"}))
    elif config == "gone":
        (work / "models/tiny").rmdir()
    before = sorted(p.name for p in (work / "runs").iterdir())
    proc = inv("train", "--on", "bed", *[a.format(w=work) for a in args], inventory=path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in text, text
    failed = [line for line in text.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and expected.format(w=work) in failed[0] and "nothing was started" in failed[0], text
    assert sorted(p.name for p in (work / "runs").iterdir()) == before  # no run directory made


@pytest.mark.parametrize("args", [["--data", "gen-1"], ["--data", "{w}/my.jsonl", "--states", "ext-1"]])
def test_train_with_everything_in_place_passes_the_preflight(tmp_path, ssh_host, args):
    path, work = _bed(tmp_path, ssh_host)
    (work / "models/tiny/config.json").write_text("{}")
    proc = inv("train", "--on", "bed", *[a.format(w=work) for a in args], inventory=path)
    assert proc.returncode == 1 and "specops code is not deployed" in proc.stdout, proc.stdout + proc.stderr
