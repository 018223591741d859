"""remote/generate.py against a hostile server and hostile dataset files: one bad reply or one bad
line costs its row, never the run; a dataset in no shape generate reads fails the run in one line.

The hostile server is a small HTTP server written here, in front of the real vLLM: it answers the
rows marked HOSTILE:<kind> itself, wrongly, and passes every other request through unchanged.
"""
import http.server
import json
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from tests.test_generate import LEAN, generate, jsonl, ok, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "remote"))

from chat_render import normalise  # noqa: E402
from datasets_io import prompt_chunks, row_messages  # noqa: E402


def completion(message, usage=None):
    return {"id": "x", "object": "chat.completion", "model": "tiny",
            "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
            "usage": usage or {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


# kind -> (content type, body) the hostile server answers a row marked HOSTILE:<kind> with
HOSTILE_REPLIES = {
    "not-json": ("application/json", b"<html>502 Bad Gateway</html>"),
    "text-plain": ("text/plain", b"upstream reset"),
    "content-number": ("application/json", completion({"role": "assistant", "content": 42})),
    "content-list": ("application/json", completion({"role": "assistant", "content": [{"type": "text"}]})),
    "message-string": ("application/json", completion("hello")),
    "usage-strings": ("application/json", completion(
        {"role": "assistant", "content": "A"}, {"prompt_tokens": "5", "completion_tokens": "3"})),
    "reasoning-object": ("application/json", completion(
        {"role": "assistant", "content": "A", "reasoning": {"text": "R"}})),
    "no-choices": ("application/json", {"object": "chat.completion", "choices": []}),
}


class HostileServer:
    """Passes requests to `upstream` unless the last message says HOSTILE:<kind>; then answers wrongly."""

    def __init__(self, upstream):
        self.upstream, self.hostile_answers = upstream, 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                owner.forward(self, None)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                text = json.loads(body)["messages"][-1]["content"]
                kind = text.split("HOSTILE:", 1)[1].split()[0] if "HOSTILE:" in text else None
                if kind is None:
                    return owner.forward(self, body)
                owner.hostile_answers += 1
                content_type, reply = HOSTILE_REPLIES[kind]
                owner.answer(self, 200, content_type,
                             reply if isinstance(reply, bytes) else json.dumps(reply).encode())

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def forward(self, handler, body):
        request = urllib.request.Request(self.upstream + handler.path, data=body, method=handler.command,
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            self.answer(handler, r.status, r.headers["content-type"], r.read())

    @staticmethod
    def answer(handler, status, content_type, body):
        handler.send_response(status)
        handler.send_header("content-type", content_type)
        handler.send_header("content-length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_each_bad_reply_is_a_failed_attempt_of_its_row_and_resume_goes_on(vllm_server, tmp_path):
    good = [{"id": f"good-{i}", "prompt": q} for i, q in enumerate(("What is 2 + 3?", "Is 9 odd?"))]
    hostile = [{"id": kind, "prompt": f"HOSTILE:{kind} What is 1 + 1?"} for kind in HOSTILE_REPLIES]
    prompts, out = write_jsonl(tmp_path / "p.jsonl", hostile[:4] + good + hostile[4:]), tmp_path / "out"
    with HostileServer(vllm_server.base_url) as server:
        runs = [generate("--endpoint", server.base_url, "--dataset", prompts, "--out", out,
                         "--max-retries", 1, *LEAN, *resume) for resume in ([], ["--resume"])]
    for result in runs:
        ok(result)
        assert "Traceback" not in result.stderr
        assert sorted(r["id"] for r in jsonl(out / "data.jsonl")) == ["good-0", "good-1"]
        errors = {e["id"]: e for e in jsonl(out / "errors.jsonl")}
        assert sorted(errors) == sorted(HOSTILE_REPLIES)
        for e in errors.values():
            assert e["error"].startswith("malformed reply: ") and e["attempts"] == 2, e  # retried once
    assert server.hostile_answers == 2 * 2 * len(HOSTILE_REPLIES)
    assert errors["usage-strings"]["error"] == 'malformed reply: usage.prompt_tokens is "5", not a token count'
    assert errors["reasoning-object"]["error"] == "malformed reply: message.reasoning is dict, not a string"
    stats = json.loads((out / "stats.json").read_text())
    assert stats["outcome"] == "completed" and stats["rows"]["done_before"] == 2


def padded_rows(n, pad):
    return [{"id": f"r{i}", "pad": "x" * pad, "conversations": [
        {"from": "human", "value": f"What is {i} + 1?"}]} for i in range(n)]


UNPARSABLE = '{"id": "torn", "prompt": "Wh\n["a", "list"]\n{"id": "last", "prompt": "Is 4 even?"}\n'


@pytest.mark.parametrize("tail, more_ids, more_errors", [
    ("", [], []),  # the "Couldn't cast array of type string to List(...)" case alone
    (UNPARSABLE, ["last"], [("7", "line is not valid JSON"), ("8", "row is list, not an object")]),
], ids=["type-change", "unparsable-lines"])
def test_a_bad_line_after_the_first_read_chunk_is_its_rows_error_and_resume_goes_on(
        vllm_server, tmp_path, tail, more_ids, more_errors):
    # `datasets`' JSON reader fixes the column types from its first ~1 MB; a later row whose
    # conversations is a string then failed the whole stream (and every resume at the same place).
    rows = padded_rows(4, 400_000) + [
        {"id": "string-conversation", "pad": "", "conversations": "What is 2 + 2?"},
        {"id": "after", "pad": "", "conversations": [{"from": "human", "value": "What is 3 + 3?"}]}]
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out"
    write_jsonl(prompts, rows)
    with open(prompts, "a") as f:
        f.write(tail)
    for resume in ([], ["--resume"]):
        result = ok(generate("--endpoint", vllm_server.base_url, "--dataset", prompts, "--out", out,
                             *LEAN, *resume))
        assert "Traceback" not in result.stderr
        assert sorted(r["id"] for r in jsonl(out / "data.jsonl")) == sorted(
            ["after", "r0", "r1", "r2", "r3", *more_ids])
        errors = sorted((e["line"], e["error"]) for e in jsonl(out / "errors.jsonl"))
        assert [(line.rsplit(":", 1)[1], error.split(" (")[0]) for line, error in errors] == [
            ("5", "conversation is str, not a list"), *more_errors]
        assert {line.rsplit(":", 1)[0] for line, _ in errors} == {str(prompts)}
    assert json.loads((out / "stats.json").read_text())["rows"]["done_before"] == 5 + len(more_ids)


def test_a_directory_of_json_files_is_read_line_by_line_too(tmp_path):
    from datasets_io import open_rows

    # A directory went through `datasets` with its default 10 MB chunks: the bad row comes after them.
    (tmp_path / "data").mkdir()
    rows = padded_rows(30, 400_000) + [{"id": "bad", "pad": "", "conversations": "What is 2 + 2?"}]
    write_jsonl(tmp_path / "data" / "train-0.jsonl", rows)
    write_jsonl(tmp_path / "data" / "train-1.jsonl", [{"id": "next-file", "prompt": "Is 5 odd?"}])
    write_jsonl(tmp_path / "data" / "test.jsonl", [{"id": "other-split", "prompt": "Is 6 odd?"}])
    read = [(where.rsplit("/", 1)[1], row["id"]) for where, row in open_rows(str(tmp_path))]
    assert read == [*((f"train-0.jsonl:{i + 1}", f"r{i}") for i in range(30)), ("train-0.jsonl:31", "bad"),
                    ("train-1.jsonl:1", "next-file")]
    with pytest.raises(Exception, match=r"has no split 'validation' \(it has train, test\)"):
        open_rows(str(tmp_path), "validation")


@pytest.mark.parametrize("rows, seen", [
    ([{"text": "hello", "label": 1}, {"text": "bye", "label": 0}], '{"text": str, "label": int}'),
    ([{"messages": [{"speaker": "me", "says": "hi"}]}] * 3, '{"messages": [{"speaker", "says"}]}'),
])
def test_a_dataset_in_no_shape_generate_reads_fails_in_one_line(tmp_path, rows, seen):
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    for check in ([], ["--check"]):  # --check is inv generate's preflight: it refuses at launch
        result = generate("--endpoint", "http://127.0.0.1:9", "--model", "tiny", "--dataset", prompts,
                          "--out", tmp_path / "out", *check)
        assert result.returncode == 2, result
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"generate: none of the first {len(rows)} rows of {prompts} is a "
                               'conversation generate reads: expected OpenAI {"messages": [{"role", '
                               '"content"}]}, ShareGPT {"conversations": [{"from", "value"}]} or '
                               '[{"role", "content"}], or {"prompt": str}; saw ' + seen), line
        assert f"({prompts}:1: " in line
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["outcome"] == "bad dataset"


SHAPES = {
    "openai": {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                            {"role": "assistant", "content": "A", "reasoning": "R"}]},
    "sharegpt": {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                   {"from": "gpt", "value": "A", "reasoning": "R"}]},
    "specforge": {"conversations": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                                    {"role": "assistant", "content": "A", "reasoning_content": "R"}]},
    "aliases": {"messages": [{"role": "developer", "content": "S"}, {"role": "user", "content": "Q"},
                             {"role": "model", "content": "A", "reasoning": "R"}]},
}


@pytest.mark.parametrize("shape", SHAPES)
def test_generator_and_trainer_read_the_same_shapes_the_same_way(shape):
    expected = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A", "reasoning": "R"}]
    assert normalise(SHAPES[shape]) == expected
    assert prompt_chunks(row_messages(SHAPES[shape])) == [expected[:2]]


@pytest.mark.parametrize("record, reason", [
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning": 7}]},
     "message 1 reasoning is int, not a string"),
    ({"messages": [{"role": "user", "content": ["Q"]}, {"role": "assistant", "content": "A"}]},
     "message 0 content is list, not a string"),
    ({"messages": [{"role": "tool", "content": "Q"}, {"role": "assistant", "content": "A"}]},
     'message 0 has unknown role "tool"'),
    (["not", "an", "object"], "row is list, not an object"),
])
def test_generator_and_trainer_refuse_the_same_rows_with_the_same_reason(record, reason):
    for read in (normalise, row_messages):
        with pytest.raises(ValueError) as refused:
            read(record)
        assert str(refused.value) == reason
