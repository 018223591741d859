"""remote/generate.py against a hostile server and hostile dataset files: one bad reply or one bad
line costs its row, never the run; a dataset in no shape generate reads fails the run in one line.

The hostile server is a small HTTP server written here, in front of the real vLLM: it answers the
rows marked HOSTILE:<kind> itself, wrongly, and passes every other request through unchanged.
"""
import http.server
import json
import threading
import urllib.request

import pytest

from tests.helpers.generate_cli import LEAN, generate, jsonl, ok, padded_rows, write_jsonl


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
                         "--max-retries", 1, "--min-success", 0.2, *LEAN, *resume)  # 2 of 10 rows are good
                for resume in ([], ["--resume"])]
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
