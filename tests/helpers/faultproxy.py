"""A fault-injecting HTTP proxy on 127.0.0.1, in front of a real server, for client tests.

    with FaultProxy(upstream_port, faults={"500": 0.2, "drop": 0.1, "hang": 0.05},
                    max_faults=20) as proxy:
        run_client(proxy.base_url)
    proxy.requests  # what the server was sent: [{"method", "path", "headers", "body", "fault"}]

Faults apply to chat completions only (listing models always passes), drawn at random (seeded)
with the given probabilities until `max_faults` have been injected, so a run always finishes:
  "500"   answer HTTP 500 without asking the server
  "drop"  read the request, then close the connection without an answer
  "hang"  read the request and never answer (the client's timeout has to fire)
Every request is recorded (headers lower-cased, body parsed as JSON), so a test can assert on
exactly what was sent.
One request per connection; the proxy runs its own event loop in a thread and stops itself after
`lifetime_s` seconds if the test forgets to. Standard library only.
"""
import asyncio
import json
import random
import threading

FAULT_MODES = ("500", "drop", "hang")


class FaultProxy:
    def __init__(self, upstream_port, faults=None, max_faults=0, seed=0, lifetime_s=900):
        unknown = set(faults or {}) - set(FAULT_MODES)
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

    def _draw_fault(self, path):
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
            fault = self._draw_fault(path)
            headers = dict(h.split(":", 1) for h in lines[1:] if ":" in h)
            self.requests.append({
                "method": method, "path": path, "fault": fault,
                "headers": {k.strip().lower(): v.strip() for k, v in headers.items()},
                "body": json.loads(body) if body else None})
            if fault == "500":
                msg = b'{"error": {"message": "injected fault", "type": "InternalServerError"}}'
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: "
                             b"application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(msg), msg))
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


def content_length(head_lines):
    """The Content-Length of an HTTP message head (its lines), or None."""
    return next((int(h.split(":", 1)[1]) for h in head_lines[1:]
                 if h.lower().startswith("content-length:")), None)
