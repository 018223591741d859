"""Watching runs as a person does: what `inv logs` and `inv status` put on the terminal.

A hostile host is a real test host whose run directory the test writes; what reaches the
user's terminal must not drive it (escape sequences) nor show a secret.
"""

import json
import os
import re
from pathlib import Path

from tests.helpers.hostbed import write_inventory
from tests.helpers.invoke_cli import inv
from tests.helpers.runs_bed import prepare, start, wait_for

os.environ["SPECOPS_SSH_CONFIG"] = "none"

LAPTOP_TOKEN = "hf_laptop5ecret0123"  # in this machine's environment
HOST_TOKEN = "hostsecret-4567-abc"  # only in the host's service env file
# Anything that would act on a terminal: C0 but tab/newline, DEL, C1, bidi overrides.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

HOSTILE_LOG = (
    b"step 1 ok\n"
    b"\x1b[2J\x1b[Hscreen cleared\n"  # clear the screen, cursor home
    b"\x1b]52;c;ZWNobyBvd25lZA==\x07clipboard set\n"  # OSC 52: set the clipboard
    b"\x1b]0;fake title\x1b\\title set\n"  # OSC 0 ended by ST
    b"\xc2\x9b2Jc1 csi\n"  # the 8-bit CSI, as UTF-8
    b"\x1bcreset\n"  # ESC c: full terminal reset
    b"token " + LAPTOP_TOKEN.encode() + b" and " + HOST_TOKEN.encode() + b"\n"
    b"split " + LAPTOP_TOKEN[:5].encode() + b"\x1b[0m" + LAPTOP_TOKEN[5:].encode() + b"\n"
    b"tqdm 10%\rtqdm 100%\n"
    b"\xe2\x80\xaereversed\n"  # RIGHT-TO-LEFT OVERRIDE
    b'specops-progress {"done": 3, "total": 9, "note": "\\u001b[2J' + LAPTOP_TOKEN.encode() + b'"}\n'
)
SHOWN = ["step 1 ok", "screen cleared", "clipboard set", "title set", "c1 csi", "reset",
         "token <HF_TOKEN> and <HF_TOKEN>", "split <HF_TOKEN>", "tqdm 100%", "reversed",
         "{host}: 3/9 rows (33%) · note=<HF_TOKEN>"]  # the progress line, in words


def hostile_run(host, run_id: str, log: bytes) -> Path:
    d = Path(host.workdir) / "runs" / run_id  # a loopback host shares this filesystem
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"run_id": run_id, "kind": "test"}))
    (d / "log").write_bytes(log)
    (d / "exit_code").write_text("0\n")
    service = Path(host.workdir) / "service"
    service.mkdir(exist_ok=True)
    (service / "vllm.env").write_text(f"VLLM_PORT='8000'\nHF_TOKEN='{HOST_TOKEN}'\n")
    (service / "vllm.env").chmod(0o600)
    return d


def assert_safe(text: str) -> None:
    assert not CONTROL.search(text), f"control character reached the terminal: {CONTROL.findall(text)!r}"
    assert LAPTOP_TOKEN not in text and HOST_TOKEN not in text and LAPTOP_TOKEN[5:] not in text


def test_logs_and_status_never_pass_escapes_or_secrets_from_a_hostile_run(tmp_path, ssh_host):
    path = write_inventory(tmp_path / "inventory.yaml", {"bed": [ssh_host]})
    hostile_run(ssh_host, "hostile", HOSTILE_LOG)
    hostile_run(ssh_host, "named\x1b[2J", b"x\n")  # a run id the host made up, listed by `inv status`
    env = {"HF_TOKEN": LAPTOP_TOKEN, "SPECOPS_SECRETS_FILE": str(tmp_path / "none.env")}

    for args in (["logs", "hostile"], ["logs", "hostile", "--follow"]):
        proc = inv(*args, "--on", "bed", inventory=path, env=env)
        assert proc.returncode == 0, proc.stderr
        assert_safe(proc.stdout + proc.stderr)
        assert proc.stdout.splitlines() == [line.format(host=ssh_host.name) for line in SHOWN]

    proc = inv("status", "--on", "bed", inventory=path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert_safe(proc.stdout + proc.stderr)
    assert re.search(r"hostile\s+succeeded.*3/9 rows \(33%\) · note=<HF_TOKEN>", proc.stdout), proc.stdout
    assert re.search(r"named\s+succeeded", proc.stdout), proc.stdout

    proc = inv("status", "--run", "hostile", "--on", "bed", "--json", inventory=path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert_safe(proc.stdout)  # JSON escapes controls itself; the secret is redacted in the value
    assert json.loads(proc.stdout)[0]["runs"][0]["progress"] == {"done": 3, "total": 9, "note": "<HF_TOKEN>"}


# Prints N log lines, each followed by a progress line, PAUSE seconds apart.
PROGRESS_WRITER = """
import json, sys, time
n, pause = int(sys.argv[1]), float(sys.argv[2])
for done in range(1, n + 1):
    print(f"log line {done}", flush=True)
    print("specops-progress " + json.dumps({"done": done, "total": n, "rows_s": 2.0, "eta_s": n - done}), flush=True)
    time.sleep(pause)
"""


def test_logs_follow_piped_shows_progress_in_words_never_machine_lines(tmp_path, ssh_host):
    path, [host] = prepare(tmp_path, [ssh_host])
    run_id = start([host], PROGRESS_WRITER, 6, 0)
    wait_for(host, run_id, {"succeeded"})
    proc = inv("logs", run_id, "--on", "bed", "--follow", inventory=path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "specops-progress" not in proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line for line in lines if line.startswith("log line")] == [f"log line {i}" for i in range(1, 7)]
    assert lines[-1] == f"{host.name}: 6/6 rows (100%) · 2.0 rows/s · ETA 0s", proc.stdout
    assert len(lines) <= 6 + 2  # the first and the final progress line at most, not one per machine line


def test_logs_follow_on_a_terminal_redraws_one_live_line(tmp_path, ssh_host):
    path, [host] = prepare(tmp_path, [ssh_host])
    # 12 s of run: `inv logs` must attach while it is live (on a slow CPU its start took over the 4 s 0.5 s gave)
    run_id = start([host], PROGRESS_WRITER, 8, 1.5)
    raw = run_in_pty(["logs", run_id, "--on", "bed", "--follow"], path)
    text = raw.decode("utf-8", "replace")
    assert "specops-progress" not in text
    assert "\r\x1b[2K" in text  # rich moves back over the live line and erases it before each redraw
    shown = re.findall(r"(\d)/8 rows", text)
    assert len(set(shown)) >= 3 and shown[-1] == "8", shown  # the same line, redrawn as the run moves
    for i in range(1, 9):  # log lines are printed above the live line, once each
        assert text.count(f"log line {i}\r\n") == 1, text


def run_in_pty(args, inventory, timeout=60) -> bytes:
    """`inv ARGS` with stdout and stderr on a pseudo-terminal (120x30, TERM=xterm); everything it wrote."""
    import fcntl
    import pty
    import struct
    import subprocess
    import sys
    import termios
    import time

    from tests.helpers.invoke_cli import REPO

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    env = {**os.environ, "SPECOPS_INVENTORY": str(inventory), "SPECOPS_SSH_CONFIG": "none", "TERM": "xterm",
           "PYTHONUNBUFFERED": "1"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "specops", *args], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        proc.kill() if proc.poll() is None else None
        proc.wait()
        os.close(master)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks)
