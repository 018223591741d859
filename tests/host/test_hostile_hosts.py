"""Hostile hosts: a test host whose run directory, workdir or service directory the test
writes itself, the way someone else on a shared GPU box (or a compromised one) could.

What is checked: `inv pull` writes, verifies and deletes only inside DEST/<run>/<host>/ whatever the
host's manifest, file names, symlinks, meta.json or run directory names say (item 1); the env file's
secrets are private from the moment the file exists (item 2); an old rsync's argument splitting never
reaches the remote shell (item 4); `inv serve` on a host never deployed says what to run and starts
nothing (item 10).
"""

import dataclasses
import json
import os
import stat
import uuid
from pathlib import Path

import paramiko
import pytest

from specops import deploy, inventory, transfer
from specops import pull as pull_mod  # the module: `pull` here is this file's helper
from specops.host import connect
from specops.service_spec import Layout, Policy, render
from specops.supervisors import choose, host_facts
from tests.helpers.hostbed import write_inventory
from tests.helpers.invoke_cli import REPO, inv

NO_RSYNC_HERE = "sftp"  # PATH without rsync: the pull takes its SFTP fallback


def hostile_run(host, run_id: str, files: dict, entries: list, meta: str = '{"kind": "test"}') -> Path:
    """A finished run directory as the host shows it: `files` (name -> bytes or a Path to link to),
    meta.json, exit_code and a manifest.json listing `entries` verbatim."""
    d = Path(host.workdir) / "runs" / run_id
    d.mkdir(parents=True)
    for name, content in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            (d / name).symlink_to(content)
        else:
            (d / name).write_bytes(content)
    (d / "meta.json").write_text(meta)
    (d / "exit_code").write_text("0\n")
    (d / "manifest.json").write_text(json.dumps({"files": entries, "host_only": {"files": 0, "bytes": 0}}))
    return d


def entry(path: str, size: int = 1) -> dict:
    return {"path": path, "size": size, "sha256": "0" * 64}


def bed(tmp_path, host):
    return write_inventory(tmp_path / "inventory.yaml", {"bed": [host]})


def pull(path, dest, method, *args):
    env = {"PATH": "/nonexistent"} if method == NO_RSYNC_HERE else None
    return inv("pull", "--on", "bed", "--dest", dest, *args, inventory=path, env=env)


def no_symlinks_under(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_symlink()]


# ---------------------------------------------------------------- item 1: pull stays inside DEST/<run>/<host>/

@pytest.mark.parametrize("method", ["rsync", NO_RSYNC_HERE])
@pytest.mark.parametrize("case", ["absolute", "dotdot", "through a symlink"])
def test_pull_never_touches_a_file_outside_its_directory(tmp_path, ssh_host, method, case):
    """The manifest names a file on the laptop, outside DEST, with a hash it does not have: before the
    fix, verify called it damaged and the re-fetch deleted it."""
    victim = tmp_path / "outside" / "victim.txt"  # the loopback host shares this filesystem: the link resolves
    victim.parent.mkdir()
    victim.write_text("precious\n")
    dest = tmp_path / "artifacts"
    named = {"absolute": str(victim), "dotdot": "../../../outside/victim.txt",
             "through a symlink": "escape/victim.txt"}[case]
    files = {"data.jsonl": b'{"id": 1}\n', "escape": victim.parent, "passwd": Path("/etc/passwd")}
    hostile_run(ssh_host, "run-1", files, [entry(named)])
    proc = pull(bed(tmp_path, ssh_host), dest, method, "--run", "run-1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert victim.read_text() == "precious\n"
    assert "Traceback" not in proc.stdout + proc.stderr
    if case == "through a symlink":  # not a symlink here: the file is simply not in the copy
        assert "escape/victim.txt: missing" in proc.stdout, proc.stdout
    else:
        assert "not a relative path inside the run directory" in proc.stdout, proc.stdout
    local = dest / "run-1" / ssh_host.name
    assert (local / "data.jsonl").read_bytes() == b'{"id": 1}\n'
    assert no_symlinks_under(dest) == []  # nothing the host sent points anywhere


@pytest.mark.parametrize("method", ["rsync", NO_RSYNC_HERE])
def test_a_crafted_run_directory_name_is_not_a_run(tmp_path, ssh_host, method):
    """`inv pull` without RUN takes the newest run's name from the host. A directory named
    "x<newline>9999999999 .." made the newest run `..`: the whole workdir was copied beside DEST."""
    good = hostile_run(ssh_host, "good-1", {"data.jsonl": b'{"id": 1}\n'}, [])
    pull_mod.manifest.write(str(good))
    crafted = Path(ssh_host.workdir) / "runs" / "x\n9999999999 .."
    crafted.mkdir()
    (crafted / "meta.json").write_text("{}")
    (Path(ssh_host.workdir) / "meta.json").write_text("{}")  # what the crafted id `..` needs to be pulled
    dest = tmp_path / "dest" / "artifacts"
    proc = pull(bed(tmp_path, ssh_host), dest, method)
    assert not (dest.parent / ssh_host.name).exists(), "the workdir was copied beside DEST"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "good-1" in proc.stdout and (dest / "good-1" / ssh_host.name / "data.jsonl").exists()
    assert list(dest.iterdir()) == [dest / "good-1"]


@pytest.mark.parametrize("meta, expected", [
    ('{"shard": {"i": 0}}', "is not a shard spec"),
    ('{"shard": "3/2"}', "is not a shard spec"),
    ('["not", "an", "object"]', "meta.json is not a JSON object"),
    ("not json", "meta.json is not a JSON object"),
])
def test_meta_json_is_checked_before_it_is_used(tmp_path, ssh_host, meta, expected):
    hostile_run(ssh_host, "run-1", {"data.jsonl": b'{"id": 1}\n'}, [], meta=meta)
    proc = pull(bed(tmp_path, ssh_host), tmp_path / "artifacts", "rsync", "--run", "run-1")
    assert proc.returncode == 1 and expected in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stdout


# ---------------------------------------------------------------- item 2: secrets private from birth

@pytest.mark.parametrize("user", ["root", "ml"])
def test_env_file_is_born_private_in_a_private_directory(tmp_path, loopback, monkeypatch, user):
    """Watch the real SFTP flow: right after each file is created on the host (the loopback host
    shares this filesystem), record its mode and its directory's. Before the fix the env file was
    created 0644 (the server's umask) and chmod'ed after; the service directory stayed 0755."""
    host = loopback[user]
    births = {}
    real = paramiko.SFTPClient._request

    def watching(self, kind, *args):
        answer = real(self, kind, *args)
        if kind == paramiko.sftp.CMD_OPEN and ".tmp" in str(args[0]):
            path = str(args[0])
            births[Path(path).name] = (stat.S_IMODE(os.stat(path).st_mode),
                                       stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode))
        return answer

    monkeypatch.setattr(paramiko.SFTPClient, "_request", watching)
    path = bed(tmp_path, host)
    (h,) = inventory.load(path).select("bed")
    with connect(h) as session:
        layout = Layout(session.workdir)
        session.run(["mkdir", "-m", "755", "-p", layout.dir])  # as an older specops left it
        facts = host_facts(session, layout)
        sup = choose(session, facts, layout, "tmux", Policy())
        rendered = render(h, workdir=session.workdir, user=facts.user, venv_python=session.venv_python,
                          model="/models/m", secrets={"VLLM_API_KEY": "sk-born-private"})
        assert sup.write(rendered)
        env_births = [mode for name, mode in births.items() if name.startswith(".vllm.env.")]
        assert env_births == [(0o600, 0o700)], births
        assert stat.S_IMODE(os.stat(layout.env_file).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(layout.dir).st_mode) == 0o700
        assert os.stat(layout.env_file).st_uid == os.stat(layout.dir).st_uid == os.stat(host.workdir).st_uid
        # unchanged files are not rewritten, but a directory an older version left open is closed
        os.chmod(layout.dir, 0o755)
        births.clear()
        assert not sup.write(rendered) and not [name for name in births if name.startswith(".vllm.env.")]
        assert stat.S_IMODE(os.stat(layout.dir).st_mode) == 0o700


# ---------------------------------------------------------------- item 4: an old rsync's argument splitting

def test_an_old_rsyncs_argument_splitting_never_reaches_the_remote_shell(tmp_path, ssh_host):
    """RSYNC_OLD_ARGS=1 makes this rsync behave like one before 3.2.4 (macOS's, older distributions):
    remote paths go through the remote shell, so `$(...)` in a workdir ran there."""
    marks = [f"PWNED-{uuid.uuid4().hex[:8]}" for _ in range(3)]  # a leftover of another run cannot pass or fail this
    workdir = f"{ssh_host.workdir}/a b/$(touch {marks[0]})/`touch {marks[1]}`;touch {marks[2]}"
    path = write_inventory(tmp_path / "inventory.yaml", {"bed": [ssh_host]},
                           host_vars={ssh_host.name: {"workdir": workdir}})
    old = {"RSYNC_OLD_ARGS": "1"}
    proc = inv("deploy", "--on", "bed", "--no-deps", inventory=path, env=old)
    assert proc.returncode == 0 and "rsync" in proc.stdout, proc.stdout + proc.stderr
    assert (Path(workdir) / "code" / "remote" / "check_deps.py").is_file()
    run = hostile_run(dataclasses.replace(ssh_host, workdir=workdir), "run-1",
                      {"data.jsonl": b'{"id": 1}\n'}, [])
    pull_mod.manifest.write(str(run))
    proc = inv("pull", "--on", "bed", "--run", "run-1", "--dest", tmp_path / "artifacts", inventory=path, env=old)
    assert proc.returncode == 0 and "rsync" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "artifacts" / "run-1" / ssh_host.name / "data.jsonl").is_file()
    for where in (Path.home(), Path(ssh_host.workdir), Path(ssh_host.workdir) / "a b", REPO):
        assert not any((where / n).exists() for n in marks), where


def test_deploy_over_sftp_leaves_a_name_with_a_newline_alone(tmp_path, ssh_host):
    """The SFTP fallback lists code/ with `find`, one line per file: a name holding a newline (put
    there by someone else on the host) split a line and crashed the deploy."""
    code = Path(ssh_host.workdir) / "code"
    code.mkdir()
    (code / "odd\nname\t1\t2").write_text("not ours")
    (h,) = inventory.load(bed(tmp_path, ssh_host)).select("bed")
    with connect(h) as session:
        version = deploy._version_file(deploy.PROJECT_ROOT, tmp_path)
        files = {**deploy.deployable_files(deploy.PROJECT_ROOT), "VERSION": version}
        result = transfer._sftp_push(session, str(code), files, delete=True, dry_run=False)
    assert result.method.startswith("sftp") and (code / "remote" / "check_deps.py").is_file()
    assert (code / "odd\nname\t1\t2").read_text() == "not ours"


# ---------------------------------------------------------------- item 10: serve on a host never deployed

def test_serve_on_a_host_never_deployed_says_what_to_run(tmp_path, ssh_host):
    workdir = Path(ssh_host.workdir)
    path = write_inventory(tmp_path / "inventory.yaml", {"bed": [ssh_host]}, host_vars={ssh_host.name: {
        "flavor": "cpu", "model": "models/tiny", "supervisor": "tmux"}})
    proc = inv("serve", "--on", "bed", "--wait", "--timeout", "30", inventory=path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"no venv at {workdir}/venv (never deployed here?): run `inv deploy --on {ssh_host.name}`" in proc.stdout
    assert "nothing was started" in proc.stdout and "vLLM died" not in proc.stdout
    assert not (workdir / "service").exists()  # nothing written, nothing started

    (workdir / "venv" / "bin").mkdir(parents=True)  # a venv without vLLM
    os.symlink("/usr/bin/python3", workdir / "venv" / "bin" / "python")
    proc = inv("serve", "--on", "bed", inventory=path)
    assert proc.returncode == 1 and f"vLLM is not installed in {workdir}/venv: run `inv deps --on" in proc.stdout

    (workdir / "venv").rename(workdir / "venv.no-vllm")
    os.symlink(REPO / ".venv", workdir / "venv")  # vLLM is there; the model is not
    proc = inv("serve", "--on", "bed", inventory=path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"the model {workdir}/models/tiny is not on the host: copy it there" in proc.stdout
    assert not (workdir / "service").exists()
    lines = [line for line in proc.stdout.splitlines() if "FAILED" in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- hostile records: that host's error, one line

HOSTILE_DATA = {
    "data.jsonl is a directory": {"data.jsonl/part": b'{"id": "a"}\n'},
    "an id that is a list": {"data.jsonl": b'{"id": "a"}\n{"id": ["b"]}\n'},
    "an id that is an object": {"data.jsonl": b'{"id": {"x": 1}}\n'},
    "an id that is a number": {"data.jsonl": b'{"id": "a"}\n{"id": 5}\n'},
    "an id that is null": {"data.jsonl": b'{"id": null}\n'},
    "bytes that are not UTF-8": {"data.jsonl": b'{"id": "a"}\n{"id": "b\xff\xfe"}\n'},
    "a record that is a list": {"data.jsonl": b'["id", "a"]\n'},
}


@pytest.mark.parametrize("method", ["rsync", NO_RSYNC_HERE])
@pytest.mark.parametrize("case", sorted(HOSTILE_DATA))
def test_hostile_records_are_that_hosts_error_and_nothing_else_is_lost(tmp_path, loopback, method, case):
    """A sharded run whose second host wrote records no generate writes. Before the fix the merge
    crashed with a traceback (IsADirectoryError, UnicodeDecodeError, an unhashable id)."""
    good, bad = loopback["root"], loopback["ml"]
    for host, shard, files in ((good, "0/2", {"data.jsonl": b'{"id": "g1"}\n{"id": "g2"}\n'}),
                               (bad, "1/2", HOSTILE_DATA[case])):
        d = hostile_run(host, "gen-1", files, [], meta=json.dumps({"kind": "generate", "shard": shard}))
        for p in [d, *d.rglob("*")]:
            os.chown(p, *(lambda st: (st.st_uid, st.st_gid))(os.stat(host.workdir)))
        pull_mod.manifest.write(str(d))
    path = write_inventory(tmp_path / "inventory.yaml", {"bed": [good, bad]})
    dest = tmp_path / "artifacts"
    proc = pull(path, dest, method, "--run", "gen-1")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text
    assert "Traceback" not in text and "internal error" not in text, text
    blamed = [line for line in text.splitlines() if bad.name in line and "data.jsonl" in line]
    assert len(blamed) == 1, text
    assert not (dest / "gen-1" / "merged.jsonl").exists()
    assert (dest / "gen-1" / good.name / "data.jsonl").read_bytes() == b'{"id": "g1"}\n{"id": "g2"}\n'
    good_row = next(line for line in proc.stdout.splitlines() if line.startswith(good.name))
    assert " ok " in good_row, proc.stdout
