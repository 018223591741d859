"""A fault-injecting HTTP proxy on 127.0.0.1, in front of a real server, for client tests.

    with FaultProxy(upstream_port, faults={"500": 0.2, "drop": 0.1, "hang": 0.05},
                    max_faults=20) as proxy:
        run_client(proxy.base_url)
    proxy.requests  # what the server was sent: [{"method", "path", "headers", "body", "fault", "at"}]

Faults apply to chat completions only (listing models always passes), drawn at random (seeded)
with the given probabilities until `max_faults` have been injected, so a run always finishes:
  "500"        answer HTTP 500 without asking the server
  "drop"       read the request, then close the connection without an answer
  "hang"       read the request and never answer (the client's timeout has to fire)
  "truncate"   ask the server, then send its head and half its body, and close
  "429"/"503"  answer that status, with `Retry-After: <retry_after>` when retry_after is set
  "echo-auth"  answer HTTP 400 whose message quotes the request's Authorization header
  "surrogate"  ask the server, then append a lone surrogate escape ("\\ud800") to the answer's content
`rules` [(marker, mode)] fault every chat request whose body contains `marker` (bytes or str) with
`mode`, every time and beyond `max_faults`: a row that always fails the same way.
Every request is recorded (headers lower-cased, body parsed as JSON), so a test can assert on
exactly what was sent.
One request per connection; the proxy runs its own event loop in a thread and stops itself after
`lifetime_s` seconds if the test forgets to. Standard library only.
"""
import asyncio
import json
import random
import threading
import time

FAULT_MODES = ("500", "drop", "hang", "truncate", "429", "503", "echo-auth", "surrogate")


class FaultProxy:
    def __init__(self, upstream_port, faults=None, max_faults=0, seed=0, lifetime_s=900, rules=(),
                 retry_after=None):
        self.rules = [(m.encode() if isinstance(m, str) else m, mode) for m, mode in rules]
        self.retry_after = retry_after
        unknown = (set(faults or {}) | {mode for _, mode in self.rules}) - set(FAULT_MODES)
        if unknown:
            raise ValueError(f"unknown fault modes {sorted(unknown)}; known: {FAULT_MODES}")
        self.upstream_port = upstream_port
        self.faults = dict(faults or {})
        self.max_faults = max_faults
        self.rng = random.Random(seed)
        self.lifetime_s = lifetime_s
        self.requests = []
        self.injected = {mode: 0 for mode in FAULT_MODES}
        self.port = None
        self._loop = self._thread = None
        self._ready = threading.Event()

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}"

    def chat_bodies(self):
        """Bodies of the chat completion requests the proxy received, in arrival order."""
        return [r["body"] for r in self.requests if r["path"].endswith("/chat/completions")]

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, name="faultproxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or self.port is None:
            raise RuntimeError("fault proxy did not start")
        return self

    def __exit__(self, *exc):
        if self._loop and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(30)

    def _run(self):
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._ready.set()
            self._loop.close()

    async def _serve(self):
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await asyncio.wait_for(self._stopping.wait(), self.lifetime_s)
        except asyncio.TimeoutError:
            pass
        server.close()
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()  # hung and in-progress connections
        await server.wait_closed()

    def _draw_fault(self, path, body=b""):
        if path.endswith("/chat/completions"):
            for marker, mode in self.rules:
                if marker in body:
                    self.injected[mode] += 1
                    return mode
        if not path.endswith("/chat/completions") or sum(self.injected.values()) >= self.max_faults:
            return None
        x = self.rng.random()
        for mode, p in self.faults.items():
            if x < p:
                self.injected[mode] += 1
                return mode
            x -= p
        return None

    async def _handle(self, reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = content_length(lines) or 0
            body = await reader.readexactly(length) if length else b""
            fault = self._draw_fault(path, body)
            headers = dict(h.split(":", 1) for h in lines[1:] if ":" in h)
            self.requests.append({
                "method": method, "path": path, "fault": fault, "at": time.monotonic(),
                "headers": {k.strip().lower(): v.strip() for k, v in headers.items()},
                "body": json.loads(body) if body else None})
            if fault in ANSWERED:
                writer.write(self._answer(fault, self.requests[-1]["headers"]))
                await writer.drain()
            elif fault in ("truncate", "surrogate"):
                writer.write(spoil(fault, await self._forward(lines, body)))
                await writer.drain()
            elif fault == "hang":
                while await reader.read(65536):  # until the client gives up and closes
                    pass
            elif fault is None:
                writer.write(await self._forward(lines, body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    def _answer(self, fault, headers):
        """The whole answer the proxy makes up for an answered fault, as bytes."""
        status, reason = ANSWERED[fault]
        message = "injected fault"
        if fault == "echo-auth":  # a server that quotes the request back, key and all
            message = f"bad request; you sent authorization: {headers.get('authorization')}"
        msg = json.dumps({"error": {"message": message, "type": reason}}).encode()
        extra = f"retry-after: {self.retry_after}\r\n" if self.retry_after and status in (429, 503) else ""
        return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n{extra}"
                f"connection: close\r\ncontent-length: {len(msg)}\r\n\r\n").encode() + msg

    async def _forward(self, lines, body):
        """The upstream's whole answer to the request, asked on a fresh connection."""
        kept = [h for h in lines[1:] if h and not h.lower().startswith(("connection:", "keep-alive"))]
        request = "\r\n".join([lines[0], *kept, "connection: close", "", ""]).encode("latin-1")
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            return (b"HTTP/1.1 502 Bad Gateway\r\nconnection: close\r\n"
                    b"content-length: 0\r\n\r\n")
        try:
            up_writer.write(request + body)
            await up_writer.drain()
            head = (await up_reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            length = content_length(head)
            rest = await (up_reader.readexactly(length) if length is not None else up_reader.read())
            # One request per connection: say so, or the client would reuse a closed connection.
            kept = [h for h in head if h and not h.lower().startswith(("connection:", "keep-alive"))]
            return "\r\n".join([*kept, "connection: close", "", ""]).encode("latin-1") + rest
        finally:
            up_writer.close()


ANSWERED = {"500": (500, "Internal Server Error"), "429": (429, "Too Many Requests"),
            "503": (503, "Service Unavailable"), "echo-auth": (400, "Bad Request")}


def spoil(fault, answer):
    """The upstream's answer cut in half after its head ("truncate"), or with a lone surrogate escape
    appended to its first choice's content ("surrogate": valid JSON, not valid UTF-8 text)."""
    head, _, body = answer.partition(b"\r\n\r\n")
    if fault == "truncate":
        return head + b"\r\n\r\n" + body[:len(body) // 2]
    reply = json.loads(body)
    message = reply["choices"][0]["message"]
    message["content"] = (message.get("content") or "") + "\ud800"
    body = json.dumps(reply).encode()  # ensure_ascii: the surrogate travels as the escape \ud800
    lines = [h for h in head.split(b"\r\n") if not h.lower().startswith(b"content-length:")]
    return b"\r\n".join([*lines, b"content-length: %d" % len(body)]) + b"\r\n\r\n" + body


def content_length(head_lines):
    """The Content-Length of an HTTP message head (its lines), or None."""
    return next((int(h.split(":", 1)[1]) for h in head_lines[1:]
                 if h.lower().startswith("content-length:")), None)
