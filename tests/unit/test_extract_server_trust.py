"""What an extraction server answers is input: the file it names is read and then deleted, so
only a request file directly inside the configured storage is accepted (a hostile server).

The hostile server is a small HTTP server in the test that answers like vLLM but names files
of its choosing; the victims are real files that must survive.
"""
import http.server
import json
import os
import sys
import threading

import pytest

from tests.helpers.fixtures_train import REMOTE

sys.path.insert(0, str(REMOTE))
import extract  # noqa: E402


class Hostile(http.server.BaseHTTPRequestHandler):
    answer: object = None

    def log_message(self, *args):
        pass

    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({"data": [{"id": "m", "root": "/nowhere", "max_model_len": 64}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(self.server.answer)


@pytest.fixture
def hostile_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def _answer(path):
    return {"choices": [{"text": "x"}], "kv_transfer_params": {"hidden_states_path": path}}


@pytest.mark.parametrize("where", ["outside", "climbing", "relative", "not-safetensors", "not-a-string", "no-dict"])
def test_a_server_cannot_make_extraction_delete_files_outside_its_storage(tmp_path, hostile_server, where):
    storage, home = tmp_path / "storage", tmp_path / "home"
    storage.mkdir(), home.mkdir()
    victim = home / "draft.safetensors"
    victim.write_bytes(b"precious")
    (home / "draft.safetensors.lock").write_bytes(b"")
    old = home / "old.safetensors"  # what a sweep of the wrong directory would take
    old.write_bytes(b"also precious")
    os.utime(old, (1, 1))
    hostile_server.answer = {
        "outside": _answer(str(victim)),
        "climbing": _answer(f"{storage}/../home/draft.safetensors"),
        "relative": _answer("home/draft.safetensors"),
        "not-safetensors": _answer(f"{storage}/x.json"),
        "not-a-string": _answer(["/etc/passwd"]),
        "no-dict": ["kv_transfer_params"],
    }[where]
    url = f"http://127.0.0.1:{hostile_server.server_address[1]}"
    source = extract.EndpointSource(url, None, timeout=5, concurrency=1, storage=str(storage))
    with pytest.raises(extract.Refused) as refused:
        source._one([1, 2, 3])
    source.close()
    assert "\n" not in str(refused.value) and ("hidden_states_path" in str(refused.value))
    assert victim.read_bytes() == b"precious" and old.read_bytes() == b"also precious"
    assert (home / "draft.safetensors.lock").exists()


def test_request_file_rule():
    assert extract.request_file("/s/cmpl-1-0.safetensors", "/s", "u") == "/s/cmpl-1-0.safetensors"
    assert extract.request_file("/s//cmpl-1-0.safetensors", "/s", "u") == "/s/cmpl-1-0.safetensors"
    for bad in ("/s/sub/a.safetensors", "/s/../a.safetensors", "/t/a.safetensors", "/s/a.lock", "s/a.safetensors", 7):
        with pytest.raises(extract.Refused):
            extract.request_file(bad, "/s", "u")
