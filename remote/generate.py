#!/usr/bin/env python3
"""Ask a served model to answer dataset prompts, and record its own reasoning and answers.

    python remote/generate.py --endpoint http://127.0.0.1:8000 [--endpoint URL ...] --out DIR
        [--dataset mlabonne/open-perfectblend | FILE.jsonl|.json|.parquet] [--split train]
        [--n N] [--shard I/K] [--shuffle --seed S] [--model NAME] [--concurrency 64]
        [--max-tokens 8192] [--temperature T] [--top-p P] [--timeout 1800] [--max-retries 8]
        [--turns all|first] [--enable-thinking|--disable-thinking] [--api-key-env VLLM_API_KEY]
        [--give-up-after 600] [--drop-truncated] [--min-success 0.5] [--resume]

A draft model learns best from the target's own outputs, so every assistant turn of a dataset row
is regenerated in order, sending back the model's own earlier answers (content only: earlier
reasoning is never sent). Each finished row is one line of DIR/data.jsonl:

    {"id", "source", "messages": [{"role", "content", "reasoning"?}], "truncated",
     "turns": [{"finish_reason", "usage": {...}, "latency_s", "endpoint", "ended_at"}], "model", "params"}

Exactly once: a row is appended only when all its turns are done; re-running into the same DIR
skips the ids already there (a crash's torn last line is cut off) and retries the rest, including
rows in errors.jsonl. Rows sharing an id (the same prompt, when ids are hashes) are generated once.
A row whose turn was cut by --max-tokens ends there and is marked truncated. Memory stays flat:
rows stream in, and only as many are held as there are request slots (plus the set of done ids).

A reply that is not a well-typed chat completion (text that is not valid UTF-8 included) is a
failed attempt of its row, retried like a 5xx and then recorded in errors.jsonl; a dataset line that
does not parse is its row's error there. Every failure of a request counts against its row, a dropped
connection too once the server is seen to answer (other rows succeed, or it lists its models):
only a server that is down is not the row's fault. The run's dataset and split are recorded in
input.json: a resume reads them again (another --dataset is refused), and ids are strings or
integers, never both in one run (the first id's type holds; 5 and "5" never name one row).
Known secrets (--api-key-env's value, VLLM_API_KEY, HF_TOKEN) never reach a file or the log.

Exit codes: 0 done, at least --min-success of the rows in data.jsonl (the rest in errors.jsonl),
1 the dataset failed mid-way, 2 bad input (arguments, dataset, output directory, an endpoint that
refuses to list its models, or a dataset none of whose first 256 rows is in a shape read here),
3 every endpoint failed for --give-up-after seconds, 4 fewer than --min-success of the rows
succeeded (one line names the commonest error; stats.json's "failure" says the same),
130/143 interrupted by SIGINT/SIGTERM. Completed rows are kept in every case. A progress line
`specops-progress {json}` goes to stdout every few seconds.
"""
import argparse
import asyncio
import collections
import gc
import itertools
import json
import os
import re
import signal
import sys
import time

from conversations import SHAPES, shape_of, short
from datasets_io import (DatasetError, RowError, UnreadableRow, given_id, id_type, open_rows, prompt_chunks,
                         row_id, row_messages, shard_size, take_shard)
from endpoints import EndpointPool, Failure, backoff_s, classify
import layout
import report
from run_files import LONE_SURROGATE, RunDirError, RunFiles, Unwritable, read_input, record_bytes
from script import PROGRESS_EVERY_S, RedactingStream, Secrets, progress, shard_spec

ROW_RETRY_BASE_S, ROW_RETRY_CAP_S = 1.0, 60.0
DEFAULT_DATASET, DEFAULT_SPLIT = "mlabonne/open-perfectblend", "train"
READ_BATCH = 256  # rows per hop to the reader thread; the first batch decides the shape
START_RAMP_S = 1.0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", action="append", required=True, metavar="URL",
                    help="server base URL, http://host:port or .../v1; repeat for several")
    ap.add_argument("--model", help="served model name (default: the first one /v1/models lists)")
    ap.add_argument("--dataset", help=f"hub dataset name, or a local .jsonl/.json/.parquet file or "
                    f"directory (default: the run's own on a resume, else {DEFAULT_DATASET})")
    ap.add_argument("--split", help=f"default: the run's own on a resume, else {DEFAULT_SPLIT}")
    ap.add_argument("--n", type=positive_int, help="use the first N rows (counted before sharding)")
    ap.add_argument("--shard", type=shard_arg, default=((0, 1),), metavar="I/K",
                    help="take the rows whose index mod K == I (several I/K joined by ',': any of them)")
    ap.add_argument("--shuffle", action="store_true", help="shuffle rows (buffered, seeded)")
    ap.add_argument("--seed", type=int, default=0, help="shuffle seed")
    ap.add_argument("--out", required=True, metavar="DIR", help="output directory")
    ap.add_argument("--concurrency", type=positive_int, default=64,
                    help="requests in flight per endpoint")
    ap.add_argument("--max-tokens", type=positive_int, default=8192)
    ap.add_argument("--context-tokens", type=positive_int,
                    help="the served model's max_model_len, where known: a --max-tokens that does not fit below it "
                         "is not sent, and vLLM gives each answer what its prompt leaves of the context")
    ap.add_argument("--temperature", type=float, help="default: the server's (generation_config)")
    ap.add_argument("--top-p", type=float, help="default: the server's (generation_config)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    ap.add_argument("--max-retries", type=int, default=8,
                    help="retries of a request after a timeout, 408/409/429 or 5xx")
    ap.add_argument("--give-up-after", type=float, default=600.0, metavar="SECONDS",
                    help="stop (exit 3) when every endpoint has failed for this long")
    ap.add_argument("--turns", choices=["all", "first"], default="all",
                    help="regenerate every assistant turn, or only the first")
    thinking = ap.add_mutually_exclusive_group()
    thinking.add_argument("--enable-thinking", dest="enable_thinking", action="store_const",
                          const=True, help="send chat_template_kwargs.enable_thinking=true")
    thinking.add_argument("--disable-thinking", dest="enable_thinking", action="store_const",
                          const=False, help="send chat_template_kwargs.enable_thinking=false")
    ap.add_argument("--api-key-env", default="VLLM_API_KEY", metavar="VAR",
                    help="environment variable holding the API key (never pass the key itself)")
    ap.add_argument("--drop-truncated", action="store_true",
                    help=f"keep rows cut by --max-tokens out of {layout.ROWS} (they go to {layout.ERRORS})")
    ap.add_argument("--min-success", type=share, default=0.5, metavar="SHARE",
                    help=f"fail (exit 4) when less than this share of the rows is in {layout.ROWS} at the "
                         "end (0 to 1; default 0.5)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run in DIR (required to exist); plain re-runs resume too")
    ap.add_argument("--check", action="store_true",
                    help="only check that the dataset opens and every endpoint lists the model; write nothing")
    return ap.parse_args(argv)


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def share(text):
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def shard_arg(text):
    try:
        return shard_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def sampling_params(args):
    """The parameters sent with every request, as recorded in each record's `params`."""
    fits = args.context_tokens is None or args.max_tokens < args.context_tokens  # else every request is a 400
    params = {"max_tokens": args.max_tokens} if fits else {}
    if args.temperature is not None:
        params["temperature"] = args.temperature
    if args.top_p is not None:
        params["top_p"] = args.top_p
    if args.enable_thinking is not None:
        params["chat_template_kwargs"] = {"enable_thinking": args.enable_thinking}
    return params


class Malformed(Failure):
    """A reply that is not the chat completion the API promises. Another attempt may well get a good
    one (a proxy's hiccup, a server bug on one batch), so it is retried like a 5xx, then recorded."""

    def __init__(self, why):
        super().__init__("retryable", f"malformed reply: {why}")


def split_reasoning(message):
    """(reasoning, content) of a reply's message (JSON), whitespace exactly as the model wrote it.

    Reasoning parsers put the thinking in `reasoning` (vLLM since late 2025) or `reasoning_content`
    (before); without a parser it is inline in the content as <think>...</think>.
    Raises Malformed when either is there but not a string.
    """
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise Malformed(f"message.content is {type(content).__name__}, not a string")
    for field in ("reasoning", "reasoning_content"):
        if message.get(field) is not None:
            if not isinstance(message[field], str):
                raise Malformed(f"message.{field} is {type(message[field]).__name__}, not a string")
            return message[field], content
    if content and "</think>" in content:
        head, _, answer = content.partition("</think>")
        return head.split("<think>", 1)[-1], answer
    return None, content


def check_text(**texts):
    """Malformed for the first of texts (name=str or None) that is not valid UTF-8 text: a lone
    surrogate arrives as a valid JSON escape ("\\ud800") but cannot be written as UTF-8."""
    for name, text in texts.items():
        if text and LONE_SURROGATE.search(text):
            raise Malformed(f"{name} is not valid UTF-8 text (a lone surrogate)")


def read_reply(reply):
    """(reasoning, content, finish_reason, usage) of a chat completion, every field checked for the
    type the API gives it: nothing the server sends can crash the run or reach data.jsonl wrongly typed."""
    if not isinstance(reply, dict):
        raise Malformed(f"the body is {type(reply).__name__}, not a JSON object")
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise Malformed(f"no choices[0] object in {json.dumps(reply)[:200]}")
    message, finish_reason = choices[0].get("message"), choices[0].get("finish_reason")
    if not isinstance(message, dict):
        raise Malformed(f"choices[0].message is {type(message).__name__}, not an object")
    if finish_reason is not None and not isinstance(finish_reason, str):
        raise Malformed(f"finish_reason is {type(finish_reason).__name__}, not a string")
    reasoning, content = split_reasoning(message)
    check_text(**{"message.reasoning": reasoning, "message.content": content, "finish_reason": finish_reason})
    return reasoning, content, finish_reason, usage(reply.get("usage"))


class Stats:
    """Counters for progress lines and stats.json."""

    def __init__(self, total):
        self.start = time.monotonic()
        self.total = total  # rows in the shard; None until known
        self.done_before = self.completed = self.errors = self.malformed = self.duplicates = 0
        self.truncated = self.dropped = self.empty = 0
        self.requests = self.failed_attempts = 0
        self.prompt_tokens = self.completion_tokens = self.reasoning_tokens = 0
        self.error_kinds = collections.Counter()  # an error with its numbers blanked -> rows
        self.error_example = {}  # that key -> the first error text seen with it

    def failed_row(self, error):
        """Tally one row's error, so the run can name its commonest kind (row-specific numbers aside)."""
        key = re.sub(r"\d+", "#", error)
        self.error_kinds[key] += 1
        self.error_example.setdefault(key, error)

    def commonest_error(self):
        """{"error": an example, "rows": how many rows failed that way}, or None without errors."""
        if not self.error_kinds:
            return None
        key, rows = self.error_kinds.most_common(1)[0]
        return {"error": self.error_example[key], "rows": rows}

    def failure(self, min_success):
        """The one line saying why the run failed for want of rows, or None if enough succeeded.

        Rows settled without a record count against it (errors, malformed, dropped as truncated);
        rows done by an earlier run count for it. A shard with no rows at all has not failed."""
        done = self.done_before + self.completed
        failed = self.errors + self.malformed + self.dropped
        if not failed or done >= min_success * (done + failed):
            return None
        common = self.commonest_error()
        return (f"only {done} of {done + failed} rows succeeded (less than --min-success {min_success:g}); "
                f"commonest error ({common['rows']} rows): {common['error']}")

    def finished(self):
        """Rows of the shard settled so far, this run or before."""
        return (self.done_before + self.completed + self.errors + self.malformed
                + self.duplicates + self.dropped)

    def progress(self, in_flight):
        wall = time.monotonic() - self.start
        rows_s = self.completed / wall if wall else 0.0
        eta = None
        if self.total is not None:
            left = max(0, self.total - self.finished())
            eta = 0 if not left else round(left / rows_s) if rows_s else None
        return {"done": self.done_before + self.completed, "total": self.total,
                "rows_s": round(rows_s, 3), "req_s": round(self.requests / wall, 3) if wall else 0.0,
                "out_tok_s": round(self.completion_tokens / wall, 1) if wall else 0.0,
                "eta_s": eta, "errors": self.errors + self.malformed, "truncated": self.truncated,
                "empty": self.empty, "retries": self.failed_attempts, "in_flight": in_flight}

    def summary(self, pool, outcome, failure=None):
        wall = time.monotonic() - self.start
        return {
            "outcome": outcome, "failure": failure, "commonest_error": self.commonest_error(),
            "wall_s": round(wall, 3),
            "rows": {"total": self.total, "done": self.done_before + self.completed,
                     "done_before": self.done_before, "completed": self.completed,
                     "errors": self.errors, "malformed": self.malformed,
                     "duplicates": self.duplicates, "truncated": self.truncated,
                     "dropped_truncated": self.dropped, "empty_answers": self.empty},
            "requests": {"completed": self.requests, "failed_attempts": self.failed_attempts},
            "tokens": {"prompt": self.prompt_tokens, "completion": self.completion_tokens,
                       "reasoning": self.reasoning_tokens},
            "rows_s": round(self.completed / wall, 3), "req_s": round(self.requests / wall, 3),
            "out_tok_s": round(self.completion_tokens / wall, 1),
            "endpoints": {e.url: {"requests": e.requests, "failed": e.failed}
                          for e in pool.endpoints},
        }


class Generator:
    """Turns dataset rows into records; many rows are in flight at once, sharing the endpoints."""

    def __init__(self, args, pool, files, stats, model):
        self.args, self.pool, self.files, self.stats, self.model = args, pool, files, stats, model
        self.params = sampling_params(args)

    async def ask(self, messages):
        """One assistant turn: (reasoning, content, finish_reason, usage, latency_s, endpoint URL).

        Retried as the failure allows; raises Failure when out of retries or on a fatal one.
        Every failure counts against the row, except a connection failure while the server is down.
        """
        counted = attempts = 0
        while True:
            endpoint = await self.pool.acquire()
            attempts += 1
            started = time.monotonic()
            try:
                # The raw JSON, not the SDK's typed path: `reasoning` is no declared field there, and
                # typing every request and reply costs more CPU than the rest of the client together.
                reply = await endpoint.client.post(
                    "/chat/completions", cast_to=dict,
                    body={"model": self.model, "messages": messages, **self.params})
                answer = read_reply(reply)
            except Exception as e:
                failure = classify(e)
                await self.pool.release(endpoint, failure)
                failure.attempts = attempts
                if failure.kind == "fatal":
                    raise failure from None
                self.stats.failed_attempts += 1
                if failure.kind == "connection" and not await row_to_blame(endpoint, started):
                    continue  # the server is down: the endpoint rests, the row is not charged
                counted += 1
                if counted > self.args.max_retries:
                    raise failure from None
                await asyncio.sleep(backoff_s(counted, ROW_RETRY_BASE_S, ROW_RETRY_CAP_S))
                continue
            latency = time.monotonic() - started
            await self.pool.release(endpoint)
            return (*answer, latency, endpoint.url)

    def row_failed(self, rid, where, error, attempts=None, status=None, turn=None):
        """Record a row that produced no record (errors.jsonl, with its dataset line when known)."""
        self.stats.errors += 1
        self.stats.failed_row(error)
        line = {"line": where} if where else {}
        self.files.add_error({"id": rid, "error": error, "attempts": attempts, "status": status,
                              "turn": turn, **line})

    async def run_row(self, rid, where, source, chunks):
        """Generate every turn of one row, then append it (or its error) in one write."""
        sent, messages, turns, truncated = [], [], [], False
        for chunk in chunks:
            sent += chunk
            messages += chunk
            try:
                reasoning, content, finish_reason, use, latency, url = await self.ask(sent)
            except Failure as f:
                return self.row_failed(rid, where, str(f), f.attempts, f.status, len(turns))
            messages.append({"role": "assistant", "content": content, "reasoning": reasoning})
            sent.append({"role": "assistant", "content": content or ""})
            turns.append({"finish_reason": finish_reason, "usage": use,
                          "latency_s": round(latency, 3), "endpoint": url, "ended_at": round(time.time(), 3)})
            self.count_turn(turns[-1]["usage"], content, finish_reason)
            if finish_reason == "length":  # later turns would build on a cut-off answer
                truncated = True
                break
        if truncated:
            self.stats.truncated += 1
            if self.args.drop_truncated:
                self.stats.dropped += 1
                self.stats.failed_row("truncated at --max-tokens (dropped)")
                self.files.add_error({"id": rid, "error": "truncated at --max-tokens (dropped)",
                                      "attempts": None, "status": None, "turn": len(turns) - 1})
                return
        try:
            self.files.add_record({"id": rid, "source": source, "messages": messages,
                                   "truncated": truncated, "turns": turns,
                                   "model": self.model, "params": self.params})
        except Unwritable as e:
            return self.row_failed(rid, where, f"not kept: {e}", turn=len(turns) - 1)
        self.stats.completed += 1

    def count_turn(self, use, content, finish_reason):
        s = self.stats
        s.requests += 1
        s.prompt_tokens += use["prompt_tokens"] or 0
        s.completion_tokens += use["completion_tokens"] or 0
        s.reasoning_tokens += use["reasoning_tokens"] or 0
        if finish_reason != "length" and not (content or "").strip():
            s.empty += 1


async def row_to_blame(endpoint, started):
    """Whether a connection failure of a request sent at `started` is its row's doing: the server
    answered something since (another row's request, or a model listing asked now). A server that
    is down answers neither, and its rows wait for it uncharged."""
    return endpoint.answered_at > started or await endpoint.answers()


def usage(u):
    """The token counts of a reply's usage object (any may be missing: None; Malformed if not a count)."""
    u = {} if u is None else u
    details = u.get("completion_tokens_details") if isinstance(u, dict) else None
    if not isinstance(u, dict) or not isinstance(details or {}, dict):
        raise Malformed(f"usage is not an object: {json.dumps(u)[:100]}")
    counts = {"prompt_tokens": u.get("prompt_tokens"), "completion_tokens": u.get("completion_tokens"),
              "reasoning_tokens": (details or {}).get("reasoning_tokens")}
    for name, count in counts.items():
        if count is not None and (type(count) is not int or count < 0):
            raise Malformed(f"usage.{name} is {json.dumps(count)[:40]}, not a token count")
    return counts


def model_ids(page):
    """The model names a /v1/models answer lists: those that are strings (a malformed answer lists none)."""
    data = getattr(page, "data", None)
    return [m.id for m in data if isinstance(getattr(m, "id", None), str)] if isinstance(data, list) else []


async def discover_model(pool, give_up_after):
    """The first model the endpoints list, asked again with backoff until give_up_after."""
    deadline = time.monotonic() + give_up_after
    for attempt in itertools.count(1):
        for endpoint in pool.endpoints:
            try:
                listed = model_ids(await endpoint.client.models.list(timeout=30))
                if listed:
                    return listed[0]
                last = f"{endpoint.url} lists no model"
            except Exception as e:
                failure = classify(e)
                last = f"{endpoint.url}: {failure}"
                if failure.kind == "fatal":  # e.g. 401: asking again will not help
                    raise Failure("fatal", f"cannot list models ({last})") from None
        if time.monotonic() > deadline:
            raise Failure("connection", f"no endpoint listed a model ({last})")
        await asyncio.sleep(backoff_s(attempt, 1.0, 15.0))


async def until_stopped(awaitable, stop):
    """Await `awaitable` unless `stop` is set first, in which case cancel it and return None."""
    task = asyncio.ensure_future(awaitable)
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


EXIT_CODES = {None: 0, "dataset failed": 1, "bad endpoint": 2, "bad dataset": 2, "gave up": 3,
              "too few succeeded": 4, "interrupted": 130, "terminated": 143}


class IdTypes:
    """One id type per run: the first given id's, kept in input.json so every resume holds to it.
    A row whose id is of the other type is refused, so that 5 and "5" never name one row."""

    def __init__(self, files, record):
        self.files, self.record = files, record

    def check(self, row):
        """RowError for a row whose id is not a string or integer, or not of the run's type."""
        given = given_id(row)
        if given is None:
            return
        kind, run_kind = id_type(given), self.record.get("id_type")
        if run_kind is None:
            self.record["id_type"] = kind
            self.files.write_input(self.record)
        elif kind != run_kind:
            raise RowError(f"id {short(given)} is {'an' if kind == 'integer' else 'a'} {kind}, but this "
                           f"run's ids are {run_kind}s (mixing them is refused: 5 and \"5\" would be one row)")


def row_refusal(rid, row, chunks, secrets):
    """Why a row's own text cannot be sent and kept (not UTF-8, a known secret in it), or None."""
    try:
        record_bytes({"id": rid, "source": row.get("source"),
                      "messages": [m for chunk in chunks for m in chunk]}, secrets)
    except Unwritable as e:
        return str(e)
    return None


def row_chunks(row):
    """The row's prompt chunks (see prompt_chunks); RowError when it has none to give."""
    if isinstance(row, UnreadableRow):
        raise row
    return prompt_chunks(row_messages(row))


def shape_refusal(dataset, rows):
    """None if any of rows [(index, where, row)] is usable, else the one line that refuses the
    dataset: the shapes read, and the shape of the first row with why it is refused."""
    first = None
    for index, where, row in rows:
        try:
            row_chunks(row)
            return None
        except RowError as e:
            first = first or (where or f"row {index}", row, e)
    where, row, error = first
    seen = "a line that is not JSON" if isinstance(row, UnreadableRow) else shape_of(row)
    return (f"none of the first {len(rows)} rows of {dataset} is a conversation generate reads: "
            f"expected {SHAPES}; saw {seen} ({where}: {error})")


async def run(args, files, rows, total, input_record):
    """Feed rows to workers until the dataset ends, a signal comes, or every endpoint is dead."""
    pool = EndpointPool(args.endpoint, args.concurrency,
                        os.environ.get(args.api_key_env) or "EMPTY", args.timeout)
    stats, id_types = Stats(total), IdTypes(files, input_record)
    stop, outcome = asyncio.Event(), {"why": None}

    def stop_because(why):
        outcome["why"] = outcome["why"] or why
        stop.set()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop_because, "interrupted")
    loop.add_signal_handler(signal.SIGTERM, stop_because, "terminated")

    async def monitor():
        next_progress = time.monotonic() + PROGRESS_EVERY_S
        while True:
            await asyncio.sleep(0.5)
            if not stop.is_set() and pool.all_failing_for() >= args.give_up_after:
                print(f"generate: every endpoint has failed for {args.give_up_after:g} s; "
                      f"stopping", file=sys.stderr, flush=True)
                stop_because("gave up")
            if time.monotonic() >= next_progress:
                next_progress += PROGRESS_EVERY_S
                progress(**stats.progress(pool.in_flight))
                files.write_stats(stats.summary(pool, "running"))
                report.refresh(args.out, "generate")

    def refuse(where, row, why, rid=None):
        error = {"id": rid or row_id(row), "error": why, "attempts": 0, "status": None, "turn": None}
        files.add_error({**error, "line": where} if where else error)
        stats.malformed += 1
        stats.failed_row(why)

    def admit(where, row, seen):
        """The work item for a row, or None when it is malformed, done already or a duplicate."""
        try:
            chunks = row_chunks(row)
            id_types.check(row)
        except RowError as e:
            return refuse(where, row, str(e))
        rid = row_id(row, chunks)
        if rid not in files.done_ids and (why := row_refusal(rid, row, chunks, files.secrets)):
            return refuse(where, row, why, rid)
        if rid in files.done_ids:
            stats.done_before += 1
        elif rid in seen:
            stats.duplicates += 1
        else:
            seen.add(rid)
            return rid, where, row.get("source"), chunks if args.turns == "all" else chunks[:1]
        return None

    async def produce(queue, workers):
        seen, read, batches = set(), 0, iter(lambda: list(itertools.islice(rows, READ_BATCH)), [])
        try:
            while batch := await asyncio.to_thread(next, batches, []):
                read += len(batch)
                for _, where, row in batch:
                    if item := admit(where, row, seen):
                        await queue.put(item)
                if stats.malformed == read == len(batch):  # not one row of the first batch is usable
                    print(f"generate: {shape_refusal(args.dataset, batch)}", file=sys.stderr, flush=True)
                    outcome["why"] = "bad dataset"
                    break
            else:
                stats.total = read  # now known exactly, even if --n was more than the dataset has
        except DatasetError as e:
            print(f"generate: {e}", file=sys.stderr, flush=True)
            outcome["why"] = "dataset failed"  # rows already in flight still finish
        for _ in range(workers):
            await queue.put(None)

    async def work(queue, generator, index):
        # Workers start spread over START_RAMP_S: a fixed-latency server otherwise answers all
        # of them in one burst per cycle, forever, and each burst waits on the client's CPU.
        await asyncio.sleep(START_RAMP_S * index / pool.slots)
        while item := await queue.get():
            await generator.run_row(*item)

    monitor_task = asyncio.create_task(monitor())
    try:
        model = args.model or await until_stopped(discover_model(pool, args.give_up_after), stop)
        if model:
            generator = Generator(args, pool, files, stats, model)
            queue = asyncio.Queue(maxsize=pool.slots)
            await until_stopped(asyncio.gather(produce(queue, pool.slots),
                                               *(work(queue, generator, i) for i in range(pool.slots))),
                                stop)
    except Failure as e:
        print(f"generate: {e}; check the endpoints or pass --model", file=sys.stderr, flush=True)
        outcome["why"] = "gave up" if e.kind == "connection" else "bad endpoint"
    finally:
        monitor_task.cancel()
        await pool.close()
    failure = stats.failure(args.min_success) if outcome["why"] is None else None
    if failure:
        print(f"generate: {failure}", file=sys.stderr, flush=True)
        outcome["why"] = "too few succeeded"
    progress(**stats.progress(0))
    files.write_stats(stats.summary(pool, outcome["why"] or "completed", failure))
    report.finish(args.out, "generate")
    return EXIT_CODES[outcome["why"]]


async def check_endpoints(args):
    """--check: one /v1/models per endpoint, so a launch fails fast instead of inside a detached run."""
    pool = EndpointPool(args.endpoint, 1, os.environ.get(args.api_key_env) or "EMPTY", 30)
    try:
        for endpoint in pool.endpoints:
            try:
                listed = model_ids(await endpoint.client.models.list(timeout=30))
            except Exception as e:
                return fail(f"{endpoint.url} does not answer ({classify(e)}); is the server up (inv serve --status)?")
            if args.model and args.model not in listed:
                return fail(f"{endpoint.url} serves {', '.join(listed) or 'no model'}, not {args.model}")
        print(f"generate: ok: dataset {args.dataset} opens; {len(pool.endpoints)} endpoint(s) answer", flush=True)
        return 0
    finally:
        await pool.close()


def fail(message):
    print(f"generate: {message}", file=sys.stderr, flush=True)
    return 2


def dataset_identity(name):
    """How input.json names a dataset: a local path resolved (so ./p.jsonl and /abs/p.jsonl are one),
    anything else (a hub name) as given."""
    return os.path.realpath(name) if os.path.exists(name) else name


def input_of(args):
    """(the input record this run holds to, None) or (None, the one line refusing it).

    A resume (or a plain re-run into the directory) reads the dataset and split the run recorded,
    unless given again; another dataset would append rows the run never had, so it is refused."""
    recorded = read_input(args.out)  # --check too: a resume's launch checks the dataset the run will read
    args.dataset = args.dataset or (recorded or {}).get("dataset") or DEFAULT_DATASET
    args.split = args.split or (recorded or {}).get("split") or DEFAULT_SPLIT
    record = {"dataset": dataset_identity(args.dataset), "split": args.split}
    if recorded is None:
        return {**record, "id_type": None}, None
    if (recorded.get("dataset"), recorded.get("split")) != (record["dataset"], record["split"]):
        return None, (f"{args.out} holds a run of {short(recorded.get('dataset'), 200)} (split "
                      f"{short(recorded.get('split'))}), not {short(record['dataset'], 200)} (split "
                      f"{short(record['split'])}): resume it with its own dataset, or start another run")
    return {**record, "id_type": recorded.get("id_type")}, None


def main(argv=None):
    args = parse_args(argv)
    secrets = Secrets(names=(args.api_key_env,))
    # Everything the log gets passes here: an error body that quotes the API key is shown redacted.
    sys.stdout, sys.stderr = RedactingStream(sys.stdout, secrets), RedactingStream(sys.stderr, secrets)
    os.umask(0o077)  # what this run writes (report.html too) is its user's alone
    if args.resume and not os.path.exists(os.path.join(args.out, layout.ROWS)):
        return fail(f"--resume: {args.out} holds no {layout.ROWS} to resume")
    input_record, refusal = input_of(args)
    if refusal:
        return fail(refusal)
    try:
        rows = take_shard(open_rows(args.dataset, args.split, args.seed if args.shuffle else None),
                          args.n, args.shard)
        if args.check:
            if refusal := shape_refusal(args.dataset, list(itertools.islice(rows, READ_BATCH))):
                return fail(refusal)
            if args.n and (found := sum(1 for _ in itertools.islice(open_rows(args.dataset, args.split), args.n))) < args.n:
                # said at launch, not discovered in the run's stats: a short dataset is a surprise to the user
                print(f"generate: note: the dataset has {found} rows: --n {args.n} takes all {found}", flush=True)
            return asyncio.run(check_endpoints(args))
        files = RunFiles(args.out, secrets)
    except (DatasetError, RunDirError) as e:
        return fail(e)
    files.write_input(input_record)
    if files.torn_bytes:
        print(f"generate: cut off a torn last line of {layout.ROWS} ({files.torn_bytes} bytes)",
              file=sys.stderr, flush=True)
    # The imports leave ~1M long-lived objects; without this each full GC pass rescans them all,
    # a pause long enough to bunch up hundreds of requests.
    gc.freeze()
    try:
        return asyncio.run(run(args, files, rows, shard_size(args.n, args.shard) if args.n else None,
                               input_record))
    finally:
        files.close()


if __name__ == "__main__":
    sys.exit(main())
