"""Watching runs as a person does: what `inv logs` and `inv status` put on the terminal.

A hostile host is a real test host whose run directory the test writes; what reaches the
user's terminal must not drive it (escape sequences) nor show a secret.
"""

import json
import os
import re
from pathlib import Path

from specops import untrusted
from tests.hostbed import write_inventory
from tests.invoke_cli import inv

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
         'specops-progress {"done": 3, "total": 9, "note": "\\u001b[2J<HF_TOKEN>"}']


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
        assert proc.stdout.splitlines() == SHOWN

    proc = inv("status", "--on", "bed", inventory=path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert_safe(proc.stdout + proc.stderr)
    assert re.search(r"hostile\s+succeeded.*done=3 total=9 note=<HF_TOKEN>", proc.stdout), proc.stdout
    assert re.search(r"named\s+succeeded", proc.stdout), proc.stdout

    proc = inv("status", "--run", "hostile", "--on", "bed", "--json", inventory=path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert_safe(proc.stdout)  # JSON escapes controls itself; the secret is redacted in the value
    assert json.loads(proc.stdout)[0]["runs"][0]["progress"] == {"done": 3, "total": 9, "note": "<HF_TOKEN>"}


def test_clean_keeps_text_and_drops_what_acts_on_a_terminal():
    assert untrusted.clean("a\tb \x1b[31mred\x1b[0m \x07\x08x\x7f") == "a\tb red x"
    assert untrusted.clean("\x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\") == "link"  # OSC 8 hyperlink
    assert untrusted.clean("torn \x1b]52;c;AAAA") == "torn "  # an unterminated OSC eats the rest
    assert untrusted.clean("crlf\r") == "crlf" and untrusted.clean("\r") == ""
    assert untrusted.clean("key=abcdef ab", [("A", "ab"), ("B", "abcdef")]) == "key=<B> <A>"
