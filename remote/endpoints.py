"""The OpenAI-compatible servers remote/generate.py talks to, and what to do when one fails.

One AsyncOpenAI client per endpoint, at most `concurrency` requests in flight on each. A request goes
to the endpoint with the fewest requests in flight, so a fast server takes more of the work than a
slow one instead of both being held to the slow one's pace.

An endpoint that fails (connection refused or dropped, timeout, 408/409/429/5xx) is put on probation:
one request at a time until one succeeds. After a connection-level failure it also rests for an
exponentially growing, jittered while, so a dead server is probed, not hammered. A 429 or 503 that
says `Retry-After` rests that endpoint (only) that long, capped at RETRY_AFTER_CAP_S. The pool knows
how long every endpoint has been failing, which is what lets the caller give up cleanly.
"""
import asyncio
import email.utils
import importlib
import random
import time

import openai

RETRYABLE_STATUS = {408, 409, 429}
ENDPOINT_REST_BASE_S, ENDPOINT_REST_CAP_S = 0.5, 15.0
# A server may ask for any pause; one that asks for an hour must not stall the run for an hour.
RETRY_AFTER_CAP_S = 60.0


def api_base(url):
    """`http://host:port` or `http://host:port/v1` → the client's base URL (ending in /v1)."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def backoff_s(attempt, base, cap):
    """Exponential backoff with jitter: a random wait in [d/2, d], d = min(cap, base * 2^(attempt-1))."""
    d = min(cap, base * 2 ** (attempt - 1))
    return random.uniform(d / 2, d)


class Failure(Exception):
    """A request that did not produce a completion.

    kind: "connection" (refused, reset, dropped: says nothing about the row), "retryable"
    (timeout, 408/409/429/5xx, a reply that is not a chat completion) or "fatal" (any other 4xx:
    retrying won't help).
    """

    def __init__(self, kind, message, status=None, retry_after=None):
        super().__init__(message)
        self.kind, self.status, self.attempts, self.retry_after = kind, status, None, retry_after


def retry_after_s(headers, now=None):
    """Seconds a 429/503's `retry-after-ms` or `Retry-After` (seconds, or an HTTP date) asks to wait,
    capped at RETRY_AFTER_CAP_S; None when it asks nothing readable."""
    try:
        if (ms := headers.get("retry-after-ms")) is not None:
            seconds = float(ms) / 1000
        elif (value := headers.get("retry-after")) is None:
            return None
        elif value.strip().replace(".", "", 1).isdigit():
            seconds = float(value)
        else:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - (now or time.time())
    except (TypeError, ValueError, OverflowError):
        return None
    return min(RETRY_AFTER_CAP_S, max(0.0, seconds)) if seconds == seconds else None  # NaN: unreadable


def classify(e):
    """Map an exception of a request (the SDK's, or a Failure of its reply) to a Failure."""
    if isinstance(e, Failure):
        return e
    if isinstance(e, openai.APITimeoutError):
        return Failure("retryable", "timeout")
    if isinstance(e, openai.APIConnectionError):
        cause = e.__cause__ or e
        return Failure("connection", f"connection error: {type(cause).__name__}: {cause}"[:300])
    if isinstance(e, openai.APIStatusError):
        status = e.status_code
        kind = "retryable" if status in RETRYABLE_STATUS or status >= 500 else "fatal"
        wait = retry_after_s(e.response.headers) if status in (429, 503) else None
        return Failure(kind, f"HTTP {status}: {' '.join(str(e.message).split())}"[:300], status, wait)
    if isinstance(e, openai.OpenAIError):  # e.g. an answer that does not parse
        return Failure("fatal", f"{type(e).__name__}: {e}"[:300])
    if isinstance(e, ValueError):  # the SDK parsing a body sent as application/json that is not JSON
        return Failure("retryable", f"malformed reply: the body is not JSON ({e})"[:300])
    raise e


class Endpoint:
    """One server: its client, its slots, and how it has been doing."""

    def __init__(self, url, concurrency, api_key, timeout):
        self.url = api_base(url)
        self.concurrency = concurrency
        self.client = openai.AsyncOpenAI(base_url=self.url, api_key=api_key, timeout=timeout,
                                         max_retries=0, http_client=http_client(concurrency, timeout))
        self.in_flight = 0
        self.failures = 0  # consecutive; 0 = healthy
        self.failing_since = None  # monotonic time of the first failure in the current run of them
        self.rest_until = 0.0
        self.answered_at = 0.0  # monotonic time of the latest answer (a completion or a 4xx)
        self.requests = self.failed = 0  # totals, for stats

    def takes_one_more(self, now):
        limit = 1 if self.failures else self.concurrency
        return self.in_flight < limit and now >= self.rest_until

    async def answers(self):
        """Whether the server answers a model listing now: it is up, whatever a request just met."""
        try:
            await self.client.models.list(timeout=10)
            return True
        except Exception:
            return False


def http_client(concurrency, timeout):
    """The SDK's HTTP client over aiohttp where the SDK offers it (its httpx pool scans every
    connection on every request: at 256 in flight that costs more CPU than everything else
    together), else its default httpx client; either with room to keep every connection alive."""
    base = next(c for c in openai.DefaultAsyncHttpxClient.__mro__ if c.__name__ == "AsyncClient")
    httpx = importlib.import_module(base.__module__.split(".")[0])  # httpx, or the fork newer SDKs use
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    try:
        return openai.DefaultAioHttpClient(timeout=timeout, limits=limits)
    except (AttributeError, RuntimeError):  # an older SDK, or its aiohttp extra not installed
        return openai.DefaultAsyncHttpxClient(timeout=timeout, limits=limits)


class EndpointPool:
    """Hands out endpoint slots, fewest-in-flight first, and tracks endpoint health."""

    def __init__(self, urls, concurrency, api_key, timeout):
        self.endpoints = [Endpoint(u, concurrency, api_key, timeout) for u in urls]
        self.changed = asyncio.Condition()

    @property
    def slots(self):
        return sum(e.concurrency for e in self.endpoints)

    @property
    def in_flight(self):
        return sum(e.in_flight for e in self.endpoints)

    async def acquire(self):
        """Wait for a free slot; returns its endpoint (give it back with release)."""
        async with self.changed:
            while True:
                now = time.monotonic()
                free = [e for e in self.endpoints if e.takes_one_more(now)]
                if free:
                    chosen = min(free, key=lambda e: e.in_flight)
                    chosen.in_flight += 1
                    return chosen
                resting = [e.rest_until - now for e in self.endpoints if e.rest_until > now]
                try:
                    await asyncio.wait_for(self.changed.wait(), min(resting) if resting else None)
                except asyncio.TimeoutError:
                    pass

    async def release(self, endpoint, failure=None):
        """Give the slot back; `failure` is the Failure the request ended with, or None."""
        async with self.changed:
            endpoint.in_flight -= 1
            endpoint.requests += 1
            was_failing = endpoint.failures > 0
            if failure is None or failure.kind == "fatal":  # it answered: it is alive
                endpoint.failures, endpoint.failing_since = 0, None
                endpoint.answered_at = time.monotonic()
            else:
                endpoint.failed += 1
                endpoint.failures += 1
                endpoint.failing_since = endpoint.failing_since or time.monotonic()
                if failure.kind == "connection":
                    endpoint.rest_until = time.monotonic() + backoff_s(
                        endpoint.failures, ENDPOINT_REST_BASE_S, ENDPOINT_REST_CAP_S)
                if failure.retry_after is not None:
                    endpoint.rest_until = max(endpoint.rest_until, time.monotonic() + failure.retry_after)
            # A recovered endpoint opens all its slots at once; otherwise one slot came free.
            if was_failing and not endpoint.failures:
                self.changed.notify_all()
            else:
                self.changed.notify()

    def all_failing_for(self):
        """Seconds every endpoint has been failing (0 while any one is healthy)."""
        if any(e.failing_since is None for e in self.endpoints):
            return 0.0
        return time.monotonic() - max(e.failing_since for e in self.endpoints)

    async def close(self):
        for e in self.endpoints:
            await e.client.close()
