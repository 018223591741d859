"""How well remote/generate.py keeps servers busy, next to the way common scripts do it, in one run.

    python bench/generate_client.py [--window 10] [--rss-rows 100000]

The instrument is bench/openai_stub.py: a server that answers every request after a fixed latency
L with at most C requests served at once, so the best any client can do is known exactly (C/L
requests/s) and whatever falls short of it is the client's own doing. Figures:
  1. one endpoint, L = 2 s, C = 256: requests/s served in steady state, as a ratio of C/L;
  2. two endpoints, L = 1 s and 3 s, C = 64 each: rows/s as a ratio of 64/1 + 64/3;
  3. both again for a baseline written the common way: a thread pool calling the synchronous OpenAI
     client, rows assigned to endpoints round-robin;
  4. client CPU-ms per request, and peak RSS while streaming --rss-rows prompts.
"Served in steady state" is each stub's busy slot-time in a window that starts once the first
requests have come back and ends when the client sends its last row, divided by L: it counts
partly served requests fractionally, so waves of completions do not skew it.
"""
import argparse
import concurrent.futures
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
GENERATE = os.path.join(HERE, "..", "remote", "generate.py")
STUB = os.path.join(HERE, "openai_stub.py")


class Stub:
    """An openai_stub.py process; stopped on exit."""

    def __init__(self, latency, concurrency):
        self.latency, self.concurrency = latency, concurrency

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, STUB, "--port", "0", "--latency", str(self.latency),
                                      "--concurrency", str(self.concurrency)],
                                     stdout=subprocess.PIPE, text=True)
        self.url = "http://127.0.0.1:" + self.proc.stdout.readline().split()[1]
        return self

    def served(self):
        with urllib.request.urlopen(self.url + "/stats", timeout=60) as r:
            return json.load(r)["served"]

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait()


def steady_rate(stubs):
    """(requests/s served in the steady-state window, bound) over several stubs."""
    served = {s: s.served() for s in stubs}
    begin = min(start for s in stubs for _, start, _ in served[s]) + max(s.latency for s in stubs)
    end = max(arrival for s in stubs for arrival, _, _ in served[s])
    if end - begin < 1:
        raise SystemExit(f"steady-state window too short ({end - begin:.2f} s): raise --window")
    busy = {s: sum(max(0.0, min(b, end) - max(a, begin)) for _, a, b in served[s]) for s in stubs}
    rate = sum(busy[s] / s.latency for s in stubs) / (end - begin)
    return rate, sum(s.concurrency / s.latency for s in stubs)


def write_prompts(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i}", "source": "bench", "conversations": [
                {"from": "human", "value": f"Question {i}: what is {i} plus {i}?"}]}) + "\n")


def run_ours(stubs, concurrency, prompts, n, out):
    """Run generate.py; returns (seconds of CPU it used, peak RSS in MB)."""
    cmd = [sys.executable, GENERATE, "--dataset", prompts, "--n", str(n), "--out", out,
           "--model", "stub", "--concurrency", str(concurrency), "--max-tokens", "64"]
    for s in stubs:
        cmd += ["--endpoint", s.url]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"generate.py exited {proc.returncode}")
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def run_baseline(stubs, workers, prompts, n, out):
    """The common way: load the rows, a thread pool, one sync client per endpoint, row i to
    endpoint i mod E. Returns seconds of CPU used (this process runs nothing else meanwhile)."""
    from openai import OpenAI

    clients = [OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0) for s in stubs]
    with open(prompts) as f:
        rows = [json.loads(line) for line in itertools.islice(f, n)]
    lock = threading.Lock()

    def one(i, sink):
        row = rows[i]
        messages = [{"role": "user", "content": row["conversations"][0]["value"]}]
        reply = clients[i % len(clients)].chat.completions.create(
            model="stub", messages=messages, max_tokens=64)
        message = reply.choices[0].message
        record = {"id": row["id"], "messages": messages + [{
            "role": "assistant", "content": message.content,
            "reasoning": getattr(message, "reasoning", None)}]}
        with lock:
            sink.write(json.dumps(record) + "\n")

    cpu = time.process_time()
    with open(out, "w") as sink, concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(one, i, sink) for i in range(n)]:
            future.result()
    return time.process_time() - cpu


def scenario(name, specs, window, tmp):
    """Ours and the baseline against fresh stubs of the given (latency, concurrency) specs."""
    bound = sum(c / lat for lat, c in specs)
    n = int(bound * (window + 2 * max(lat for lat, _ in specs) + 1))
    prompts = os.path.join(tmp, f"prompts-{n}.jsonl")
    write_prompts(prompts, n)
    results = {}
    for who in ("ours", "baseline"):
        stubs = [Stub(lat, c) for lat, c in specs]
        for s in stubs:
            s.__enter__()
        try:
            if who == "ours":
                cpu, _ = run_ours(stubs, specs[0][1], prompts, n, os.path.join(tmp, f"{name}-ours"))
            else:
                cpu = run_baseline(stubs, sum(c for _, c in specs), prompts, n,
                                   os.path.join(tmp, f"{name}-baseline.jsonl"))
            rate, _ = steady_rate(stubs)
        finally:
            for s in stubs:
                s.__exit__()
        results[who] = (rate, cpu, n)
    return bound, results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=float, default=10.0,
                    help="seconds of steady state measured per run (longer: steadier figures)")
    ap.add_argument("--rss-rows", type=int, default=100_000, help="prompts streamed for peak RSS")
    args = ap.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        # Startup CPU (imports, opening the dataset), so per-request CPU can leave it out.
        write_prompts(os.path.join(tmp, "one.jsonl"), 1)
        with Stub(0, 1) as s:
            startup_cpu, _ = run_ours([s], 1, os.path.join(tmp, "one.jsonl"), 1,
                                      os.path.join(tmp, "startup"))
        one = scenario("one", [(2.0, 256)], args.window, tmp)
        two = scenario("two", [(1.0, 64), (3.0, 64)], args.window, tmp)
        write_prompts(os.path.join(tmp, "many.jsonl"), args.rss_rows)
        with Stub(0, 256) as s:
            rss_started = time.monotonic()
            rss_cpu, rss_mb = run_ours([s], 64, os.path.join(tmp, "many.jsonl"), args.rss_rows,
                                       os.path.join(tmp, "many"))
            rss_wall = time.monotonic() - rss_started

    print(f"{'':44}{'bound':>10}{'generate.py':>22}{'baseline':>22}")
    for label, (bound, r) in (("1. one endpoint, L=2s, C=256 (req/s)", one),
                              ("2. L=1s + L=3s, C=64 each (rows/s)", two)):
        ours, base = r["ours"][0], r["baseline"][0]
        print(f"{label:44}{bound:10.1f}{ours:13.1f} ({ours / bound:.3f}){base:13.1f} "
              f"({base / bound:.3f})")
    rate, cpu, n = one[1]["ours"]
    base_cpu_ms = 1000 * one[1]["baseline"][1] / one[1]["baseline"][2]
    print(f"{'client CPU-ms/request (scenario 1)':44}{'':10}"
          f"{1000 * (cpu - startup_cpu) / n:22.2f}{base_cpu_ms:22.2f}")
    print(f"{'  generate.py startup CPU (s)':44}{'':10}{startup_cpu:22.2f}")
    print(f"{f'peak RSS, {args.rss_rows} prompts streamed (MB)':44}{'':10}{rss_mb:22.0f}")
    print(f"{'  that run: CPU-ms/request, wall (s)':44}{'':10}"
          f"{1000 * (rss_cpu - startup_cpu) / args.rss_rows:16.2f}, {rss_wall:.0f}")
    print(f"bench wall time: {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
