"""An instant OpenAI-compatible chat server with a fixed latency: the instrument for measuring a
client's own cost, since the real server's speed is not the client's to measure.

    python bench/openai_stub.py --port 0 --latency 2 --concurrency 256

Every chat completion answers after exactly --latency seconds with the same small reply (a
`reasoning` field, like vLLM with a reasoning parser). At most --concurrency requests are served at
once, like a server's batch limit; more wait their turn. GET /stats returns when each request arrived,
and when its service started and ended (time.time()), so a benchmark can measure the rate served
in a window it chooses. Prints "listening PORT" once it accepts connections.
Standard library only; one process, one event loop.
"""
import argparse
import asyncio
import json
import time

REPLY = json.dumps({
    "id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "stub",
    "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "\n\nThe answer is 42.",
        "reasoning": "\nThe question asks for the answer.\n"}}],
    "usage": {"prompt_tokens": 20, "completion_tokens": 16, "total_tokens": 36,
              "completion_tokens_details": {"reasoning_tokens": 9}},
}).encode()
MODELS = json.dumps({"object": "list", "data": [
    {"id": "stub", "object": "model", "owned_by": "stub", "max_model_len": 4096}]}).encode()


class Stub:
    def __init__(self, latency, concurrency):
        self.latency = latency
        self.slots = asyncio.Semaphore(concurrency)
        self.served = []  # (arrival, start, end) of every request served, time.time()

    async def handle(self, reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *headers = head.decode("latin-1").split("\r\n")
                method, path, _ = request_line.split(" ", 2)
                length = next((int(h.split(":", 1)[1]) for h in headers
                               if h.lower().startswith("content-length:")), 0)
                if length:
                    await reader.readexactly(length)
                status, body = await self.answer(method, path)
                writer.write(b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (status, len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def answer(self, method, path):
        if path.endswith("/chat/completions") and method == "POST":
            arrival = time.time()
            async with self.slots:
                start = time.time()
                await asyncio.sleep(self.latency)
            self.served.append((arrival, start, time.time()))
            return 200, REPLY
        if path.endswith("/models"):
            return 200, MODELS
        if path == "/stats":
            return 200, json.dumps({"served": self.served}).encode()
        return 404, b'{"error": "not found"}'


async def serve(port, latency, concurrency):
    stub = Stub(latency, concurrency)
    server = await asyncio.start_server(stub.handle, "127.0.0.1", port, backlog=4096)
    print("listening", server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port")
    ap.add_argument("--latency", type=float, default=1.0, help="seconds per request")
    ap.add_argument("--concurrency", type=int, default=256, help="requests served at once")
    args = ap.parse_args()
    try:
        asyncio.run(serve(args.port, args.latency, args.concurrency))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
