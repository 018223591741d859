"""remote/generate.py as a subprocess, and the prompt and output files the tests around it read and write."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATE = ROOT / "remote" / "generate.py"
PROMPTS = ROOT / "examples" / "prompts.jsonl"
RUN_TIMEOUT = 600  # seconds; generous on purpose
LEAN = ["--concurrency", "8", "--max-tokens", "200"]  # the tiny server's context is 512 tokens


def generate(*args, env=None, timeout=RUN_TIMEOUT):
    return subprocess.run([sys.executable, str(GENERATE), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def start_generate(*args, log):
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, str(GENERATE), *map(str, args)],
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def prompt_rows(n=None, multi_turn=False):
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    if multi_turn:
        rows = [r for r in rows if sum(t["from"] == "human" for t in r["conversations"]) > 1]
    return rows[:n]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def complete_lines(path):
    return path.read_bytes().count(b"\n") if path.exists() else 0


def assert_exactly_once(out, ids):
    """data.jsonl: every line complete and parsable, each of `ids` exactly once, nothing else."""
    raw = (out / "data.jsonl").read_bytes()
    assert raw.endswith(b"\n")
    got = [r["id"] for r in jsonl(out / "data.jsonl")]
    assert sorted(got) == sorted(ids)


def user_turns(row):
    return sum(t["from"] == "human" for t in row["conversations"])


def wait_for_lines(path, n, proc, timeout=RUN_TIMEOUT):
    deadline = time.monotonic() + timeout
    while complete_lines(path) < n:
        assert proc.poll() is None, f"generator exited ({proc.returncode}) before {n} rows"
        assert time.monotonic() < deadline, f"fewer than {n} rows after {timeout} s"
        time.sleep(0.05)


def jsonl_complete(path):
    """The records of the complete lines (a crash may leave a torn last one)."""
    raw = path.read_bytes()
    return [json.loads(line) for line in raw[:raw.rfind(b"\n") + 1].splitlines()]


def padded_rows(n, pad):
    return [{"id": f"r{i}", "pad": "x" * pad, "conversations": [
        {"from": "human", "value": f"What is {i} + 1?"}]} for i in range(n)]
