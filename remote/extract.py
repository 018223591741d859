#!/usr/bin/env python3
"""Target hidden states from vLLM, packed into shards the trainer reads (`train.py --states DIR`).

    python remote/extract.py (--endpoint URL --storage DIR | --target PATH) --data FILE_OR_DIR [--data ...] --out DIR
        [--layers a,b,c] [--scratch-gb N] [--stream] [--resume] [--dtype bf16|fp32]
    python remote/extract.py --target PATH [--layers a,b,c] --print-layers

For targets transformers cannot hold next to a trainer: vLLM (which serves them) computes
the states. Each conversation is rendered exactly as the trainer renders it (its own
`load_samples`: same token ids, same loss mask), sent to vLLM as a prompt-only request
(token ids, max_tokens 1) with the `extract_hidden_states` speculative method and the
hidden-states connector, which writes one safetensors file per request. Those files are
read (waiting on their .lock, with a timeout), removed, and packed into bf16 shards
(see states_dir.py): the three aux layers (vLLM's ids: id k = the input of layer k)
plus layer L (the last layer's output before the final norm, from which the trainer
computes the target's distribution).

  --endpoint URL   a running `inv serve --extract` server on this host (the files it
                   writes must be readable here); the model path comes from /v1/models
                   unless --target is given.
  --target PATH    the offline vllm.LLM API in this process (--vllm-kwargs for its options).

Disk: the estimate (tokens x layers x H x 2 bytes) is checked against --scratch-gb and the
free disk before anything starts, and refused with the figure if either is smaller. With
--stream the trainer consumes shards as they appear (train.py --states DIR --stream) and
deletes them; extraction then waits while the directory would exceed --scratch-gb.

Resumable and exactly once: the plan (which samples go in which shard) is fixed in
plan.json; a shard file exists only when complete; --resume writes the missing ones.
Request files a killed run left are removed by the next run (offline: all of OUT/requests;
a server's storage: those older than --timeout, which no live reader still waits for).
Prints `specops-progress {json}` every few seconds and at the end.
"""
import argparse
import concurrent.futures
import contextlib
import fcntl
import json
import os
import shutil
import time
import urllib.error
import urllib.request

import torch

import layout
import states_dir as shards
from chat_render import ChatRenderer, data_files, load_samples
from target_states import check_aux_layer_ids, default_aux_layer_ids
import report
from vllm_extraction import vllm_configs
from script import PROGRESS_EVERY_S, Refused, main_of, progress

HERE = os.path.dirname(os.path.abspath(__file__))
# vLLM's DeepSeek-V2/V3 family (Kimi-K2 included) has no residual stream before layer 0:
# asking for id 0 kills the engine on its first request.
NO_LAYER_ZERO = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = ap.add_argument_group("source of the states (one of, or both: --target names the model files)")
    source.add_argument("--endpoint", help="a vLLM serving with extract_hidden_states, e.g. http://127.0.0.1:8000")
    source.add_argument("--target", help="target model directory (offline vllm.LLM unless --endpoint)")
    ap.add_argument("--model", help="with --endpoint: the served model id (default: the only one listed)")
    ap.add_argument("--storage", help="with --endpoint: the server's shared_storage_path (inv serve --extract: "
                    f"<workdir>/{layout.SERVICE}/{layout.HIDDEN_STATES}); request files named outside it are refused")
    ap.add_argument("--data", action="append", help=f"{layout.ROWS}, messages jsonl, or a directory")
    ap.add_argument("--out", help="directory for plan.json, index.json and the shards")
    ap.add_argument("--layers", help="aux layer ids a,b,c in vLLM's convention (default: the trainer's)")
    ap.add_argument("--max-len", type=int, default=4096, help="tokens per sample (as train.py --max-len)")
    ap.add_argument("--include-truncated", action="store_true", help="as train.py --include-truncated")
    ap.add_argument("--dtype", choices=sorted(shards.DTYPES), default="bf16", help="dtype of the packed states")
    ap.add_argument("--scratch-gb", type=float, help="disk budget for the shards, in GB (1e9 bytes)")
    ap.add_argument("--stream", action="store_true",
                    help="a trainer consumes and deletes shards as they appear: wait while the budget is full")
    ap.add_argument("--shard-mb", type=float, default=1024, help="target shard size in MB (streaming: <= budget/4)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    ap.add_argument("--timeout", type=float, default=600, help="seconds for one request and its states file")
    ap.add_argument("--vllm-kwargs", default="{}", help="offline: JSON of extra vllm.LLM arguments")
    ap.add_argument("--resume", action="store_true", help="continue the extraction in --out")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="run the checkpoint's own tokenizer code (Kimi-K2), as vLLM's flag of that name")
    ap.add_argument("--print-layers", action="store_true",
                    help="print the layer ids to serve with (JSON) for --target and --layers, and exit")
    args = ap.parse_args(argv)
    if args.print_layers:
        if not args.target:
            ap.error("--print-layers needs --target")
        return args
    if not (args.endpoint or args.target):
        ap.error("give --endpoint URL or --target PATH")
    if not args.data or not args.out:
        ap.error("--data and --out are required")
    if args.endpoint and not args.storage:
        ap.error("--endpoint needs --storage DIR: the server's shared_storage_path, where it writes the states")
    if args.stream and not args.scratch_gb:
        ap.error("--stream needs --scratch-gb (the spool's budget)")
    for name in ("max_len", "concurrency", "timeout", "shard_mb", "scratch_gb"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    try:
        args.vllm_kwargs = json.loads(args.vllm_kwargs)
        assert isinstance(args.vllm_kwargs, dict)
    except (ValueError, AssertionError):
        ap.error("--vllm-kwargs takes a JSON object")
    return args


# ---------------------------------------------------------------- the target and its layers


def text_config(target: str) -> dict:
    """The target's (text) config.json as a dict, without importing its model code."""
    try:
        with open(os.path.join(target, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise Refused(f"{target}: cannot read config.json ({e})") from None
    inner = config.get("text_config") or config.get("language_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def layer_ids(config: dict, aux_text: str | None, served: str | None = None) -> tuple[list[int], list[int]]:
    """(aux ids, ids to extract = aux + L, ascending and distinct: vLLM returns them in layer order).

    served: the ids a server started by `inv serve --extract` writes (SPECOPS_EXTRACT_LAYERS, from
    the service's env file, which runs source): the default, and what --layers must agree with.
    """
    n = config["num_hidden_layers"]
    try:
        served_ids = [int(x) for x in served.split(",")] if served else None
        if aux_text:
            aux = [int(x) for x in aux_text.split(",")]
        else:
            aux = served_ids[:3] if served_ids else default_aux_layer_ids(n)
        check_aux_layer_ids(aux, n)
    except ValueError as e:
        raise Refused(f"--layers: {e}") from None
    layers = sorted(set(aux) | {n})
    if served_ids and served_ids != layers:
        raise Refused(f"the server writes the states of layers {served_ids}; --layers {aux_text} needs {layers}: "
                      f"serve with `inv serve --extract --layers {aux_text}` or drop --layers")
    if 0 in layers and config.get("model_type") in NO_LAYER_ZERO:
        raise Refused(f"layer id 0 (the embeddings) cannot be extracted from a {config['model_type']} target in "
                      f"vLLM (no residual stream before layer 0): pass --layers with ids in [1, {n}]")
    return aux, layers


# ---------------------------------------------------------------- the states of one request


def take_states_file(path: str, timeout: float):
    """Wait until vLLM has written `path` (its .lock released), load it, remove both files.

    vLLM's own reader blocks on the lock forever; a dead writer must not hang a run.
    """
    from safetensors.torch import load_file

    lock, deadline = path + ".lock", time.monotonic() + timeout
    while True:
        try:
            with open(lock) as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    if os.path.exists(path):
                        break
                except BlockingIOError:
                    pass
        except FileNotFoundError:
            if os.path.exists(path):  # written without a lock (use_synchronization_lock off)
                break
        if time.monotonic() > deadline:
            raise Refused(f"no hidden states at {path} after {timeout:g}s (extraction must run on the serving "
                          f"host, and the server must have been started with the hidden-states connector)")
        time.sleep(0.01)
    tensors = load_file(path)
    for p in (path, lock):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass
    return tensors


def sweep_stale(storage: str, older_than_s: float) -> int:
    """Remove request files no live reader still waits for (each gives up after its timeout): what a
    killed extraction left in a server's storage, up to GBs a request for a large target.

    The storage is shared with vLLM and other readers, which create, rename and delete files in
    it all the time: an entry listed a moment ago may be gone when it is stat'ed or removed, and
    that is its normal life, not an error.
    """
    cutoff, removed = time.time() - older_than_s, 0
    for entry in os.scandir(storage):
        if not entry.name.endswith((".safetensors", ".safetensors.lock")):
            continue
        try:
            if entry.stat().st_mtime < cutoff:
                os.remove(entry.path)
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def request_file(path, storage: str, url: str) -> str:
    """The server's answer names a file this run reads and then deletes (with its .lock): accept only
    a request file directly inside the storage the server was configured with, never a path that
    climbs out of it, so a wrong or hostile server cannot make the extraction delete anything else."""
    if (not isinstance(path, str) or not os.path.isabs(path) or ".." in path.split("/")
            or os.path.dirname(os.path.normpath(path)) != storage or not path.endswith(".safetensors")):
        raise Refused(f"{url} answered hidden_states_path {str(path)[:200]!r}: not a request file directly in "
                      f"{storage} (--storage: the server's shared_storage_path)")
    return os.path.normpath(path)


class EndpointSource:
    """A running vLLM server: POST /v1/completions with the token ids, max_tokens 1."""

    def __init__(self, url: str, model: str | None, timeout: float, concurrency: int, storage: str):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.headers = {"Content-Type": "application/json"}
        if os.environ.get("VLLM_API_KEY"):  # from the host's env file: never on a command line
            self.headers["Authorization"] = "Bearer " + os.environ["VLLM_API_KEY"]
        listed = self._get("/v1/models").get("data", [])
        chosen = [m for m in listed if model is None or m.get("id") == model]
        if not chosen or (model is None and len(chosen) > 1):
            raise Refused(f"{self.url}: serves {[m.get('id') for m in listed]}; pass --model to choose one")
        self.model, self.root, self.max_model_len = chosen[0]["id"], chosen[0].get("root"), chosen[0].get("max_model_len")
        self.pool = concurrent.futures.ThreadPoolExecutor(concurrency)
        self.storage = os.path.normpath(os.path.abspath(storage))
        self.swept = False  # the storage is swept once, when the first answer shows the server writes there

    def _get(self, path: str) -> dict:
        request = urllib.request.Request(self.url + path, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return json.load(r)
        except (OSError, ValueError) as e:
            raise Refused(f"{self.url}{path}: {e}") from None

    def _one(self, ids: list[int]) -> str:
        body = json.dumps({"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0}).encode()
        request = urllib.request.Request(self.url + "/v1/completions", data=body, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as r:
                answer = json.load(r)
        except urllib.error.HTTPError as e:
            raise Refused(f"{self.url}: HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from None
        except (OSError, ValueError) as e:
            raise Refused(f"{self.url}: {e}") from None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        path = params.get("hidden_states_path") if isinstance(params, dict) else None
        if not path:
            raise Refused(f"{self.url} returned no hidden_states_path: serve it with `inv serve --extract`")
        path = request_file(path, self.storage, self.url)
        if not self.swept:
            self.swept = True
            if removed := sweep_stale(self.storage, self.timeout):
                progress(stage="swept", storage=self.storage, stale_request_files=removed)
        return take_states_file(path, self.timeout)

    def states(self, prompts: list[list[int]]):
        """Yields (position in prompts, tensors) as requests finish, files already removed."""
        futures = {self.pool.submit(self._one, ids): i for i, ids in enumerate(prompts)}
        for future in concurrent.futures.as_completed(futures):
            yield futures[future], future.result()

    def close(self):
        self.pool.shutdown(cancel_futures=True)


class OfflineSource:
    """vllm.LLM in this process, writing per-request files under OUT/requests/."""

    def __init__(self, target: str, layers: list[int], storage: str, kwargs: dict, timeout: float):
        # The default multi-process engine writes the files by itself; the in-process one only
        # while something keeps stepping it.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))
        from vllm import LLM, SamplingParams
        from vllm.platforms import current_platform

        self.timeout = timeout
        self.params = SamplingParams(max_tokens=1, temperature=0)
        configs = vllm_configs(layers, storage, cpu=current_platform.is_cpu())
        self.llm = LLM(model=target, **configs, **kwargs)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    def states(self, prompts: list[list[int]]):
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], self.params,
                                    use_tqdm=False)
        for i, out in enumerate(outputs):
            yield i, take_states_file(out.kv_transfer_params["hidden_states_path"], self.timeout)

    def close(self):
        self.llm = None


def request_states(source, samples, sample_ids, plan, concurrency) -> list:
    """Each sample's states [T, n_layers, H] in the pack dtype, asked `concurrency` at a time (so the
    per-request files on disk stay few), checked to be for the tokens sent and of the planned shape."""
    states = [None] * len(samples)
    for group in range(0, len(samples), concurrency):
        part = samples[group: group + concurrency]
        for i, tensors in source.states([torch.as_tensor(s.ids).tolist() for s in part]):
            got, s = tensors["hidden_states"], sample_ids[group + i]
            if not torch.equal(tensors["token_ids"], torch.as_tensor(part[i].ids).to(torch.int64)):
                raise Refused(f"sample {s}: vLLM's states are for other tokens than were sent")
            if got.shape[1:] != (len(plan["layers"]), plan["hidden_size"]):
                raise Refused(f"vLLM returned states of shape {tuple(got.shape)} per request, expected "
                              f"[T, {len(plan['layers'])}, {plan['hidden_size']}] for layers {plan['layers']}: "
                              f"serve with the same --layers (inv serve --extract)")
            states[group + i] = got.to(shards.DTYPES[plan["dtype"]])
    return states


def wait_for_space(out_dir: str, need: int, budget: int, k: int) -> None:
    """Streaming: block until `need` more bytes fit in the spool's budget (the trainer deletes shards)."""
    last = time.monotonic()
    while shards.spool_bytes(out_dir) + need > budget:
        if time.monotonic() - last > PROGRESS_EVERY_S:
            last = time.monotonic()
            progress(stage="waiting for space", shard=k, spool_bytes=shards.spool_bytes(out_dir),
                     scratch_bytes=budget)
        time.sleep(0.05)


# ---------------------------------------------------------------- the plan


def render_samples(target: str, args):
    """The trainer's samples, by the trainer's own code: extraction and training cut the same tokens."""
    try:
        renderer = ChatRenderer.from_pretrained(target, args.trust_remote_code)
        samples, stats = load_samples(renderer, args.data, args.max_len, args.include_truncated)
    except (OSError, ValueError) as e:
        raise Refused(str(e)) from None
    if not samples:
        raise Refused(f"no trainable samples in {args.data} ({stats})")
    return samples, stats


def make_plan(args, target, config, aux, layers, samples) -> dict:
    H = config["hidden_size"]
    per_token = shards.bytes_per_token(len(layers), H, args.dtype)
    transient = 0
    shard_tokens = int(args.shard_mb * 1e6 // per_token)
    if args.stream:
        # Per-request files in flight (fp32 at worst) count against the budget too; a shard may
        # take a quarter of what is left, so a trainer can hold a few while the next is written.
        longest = max(len(s.ids) for s in samples)
        transient = args.concurrency * longest * len(layers) * H * 4 if not args.endpoint else 0
        shard_tokens = min(shard_tokens, int((args.scratch_gb * 1e9 - transient) / 4 // per_token))
        if shard_tokens < max(len(s.ids) for s in samples):
            raise Refused(f"--scratch-gb {args.scratch_gb:g} cannot hold even one sample's states in a streaming "
                          f"spool ({per_token} bytes/token, longest sample {longest} tokens, "
                          f"{transient / 1e9:.3g} GB of request files in flight)")
    lengths = [len(s.ids) for s in samples]
    return {
        "format": shards.FORMAT, "target": os.path.abspath(target) if os.path.exists(target) else target,
        "model_type": config.get("model_type"), "num_layers": config["num_hidden_layers"], "hidden_size": H,
        "aux_layer_ids": aux, "layers": layers, "dtype": args.dtype, "bytes_per_token": per_token,
        "data": [[os.path.abspath(p), os.path.getsize(p)] for p in data_files(args.data)],
        "max_len": args.max_len, "include_truncated": args.include_truncated,
        "samples": len(samples), "tokens": sum(lengths), "samples_digest": shards.samples_digest(samples),
        "stream": args.stream, "scratch_bytes": int(args.scratch_gb * 1e9) if args.scratch_gb else None,
        "transient_bytes": transient, "shards": shards.plan_shards(lengths, max(1, shard_tokens)),
    }


def check_budget(args, plan, todo: list[int]) -> None:
    """Refuse before any work when the states cannot fit (not streaming)."""
    need = sum(plan["shards"][k]["tokens"] for k in todo) * plan["bytes_per_token"]
    free = shutil.disk_usage(args.out).free
    budget = plan["scratch_bytes"]
    what = (f"{need / 1e9:.3f} GB of states ({sum(plan['shards'][k]['tokens'] for k in todo)} tokens x "
            f"{len(plan['layers'])} layers x {plan['hidden_size']} x {shards.DTYPES[plan['dtype']].itemsize} bytes)")
    if budget is not None and need > budget:
        raise Refused(f"needs {what}, more than --scratch-gb {args.scratch_gb:g}: raise it, or use --stream "
                      f"with a trainer consuming the shards")
    if need > free:
        raise Refused(f"needs {what}, but {args.out} has {free / 1e9:.3f} GB free: free space, or use --stream")


# ---------------------------------------------------------------- main


def main(argv=None):
    args = parse_args(argv)
    if args.print_layers:
        aux, layers = layer_ids(text_config(args.target), args.layers)
        print(json.dumps({"aux_layer_ids": aux, "layers": layers}))
        return

    os.makedirs(args.out, exist_ok=True)
    plan_path = os.path.join(args.out, shards.PLAN)
    if os.path.exists(plan_path) and not args.resume:
        raise Refused(f"{args.out} already holds an extraction (plan.json): pass --resume or another --out")
    lock = open(os.path.join(args.out, ".lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise Refused(f"{args.out}: another extraction is writing here") from None
    for name in os.listdir(args.out):  # a shard being written when a previous run died
        if name.endswith(".tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(args.out, name))
    # vLLM's files for requests a dead run never took: only this run (it holds the lock) writes here.
    shutil.rmtree(os.path.join(args.out, "requests"), ignore_errors=True)

    source = None
    if args.endpoint:
        source = EndpointSource(args.endpoint, args.model, args.timeout, args.concurrency, args.storage)
        target = args.target or source.root
        if not target or not os.path.isdir(target):
            raise Refused(f"{args.endpoint} serves {target!r}, not a directory here: pass --target PATH")
    else:
        target = args.target
    config = text_config(target)
    aux, layers = layer_ids(config, args.layers, os.environ.get("SPECOPS_EXTRACT_LAYERS") if args.endpoint else None)
    samples, stats = render_samples(target, args)
    progress(stage="data", **stats)
    plan = make_plan(args, target, config, aux, layers, samples)
    old = shards.read_json(plan_path)
    if old is not None:
        changed = [k for k in plan if k != "target" and old.get(k) != plan[k]]
        if changed:
            raise Refused(f"cannot resume {args.out}: changed since it started: {', '.join(changed)}")
    else:
        shards.write_json(plan_path, plan)
    done = shards.done_shards(args.out, plan)
    todo = [k for k in range(len(plan["shards"])) if k not in done]
    if not args.stream:
        check_budget(args, plan, todo)
    longest = max(len(s.ids) for s in samples)

    index_path = os.path.join(args.out, shards.INDEX)
    index = shards.read_json(index_path) or {"shards": {}, "peak_spool_bytes": 0}
    for k in done - {int(k) for k in index["shards"]}:  # written, but the index update was lost
        index["shards"][str(k)] = {**plan["shards"][k], "bytes": None}
    tokens_done = 0
    try:
        if source is None and todo:
            source = OfflineSource(target, layers, os.path.join(os.path.abspath(args.out), "requests"),
                                   {"trust_remote_code": args.trust_remote_code, **args.vllm_kwargs}, args.timeout)
        t0 = last = time.monotonic()
        if source is not None and source.max_model_len and source.max_model_len <= longest:
            raise Refused(f"vLLM's max_model_len {source.max_model_len} is too short for the longest sample "
                          f"({longest} tokens + 1): serve with a larger --max-model-len or lower --max-len")
        left = sum(plan["shards"][k]["tokens"] for k in todo)
        for k in todo:
            spec = plan["shards"][k]
            if args.stream:
                wait_for_space(args.out, spec["tokens"] * plan["bytes_per_token"] + plan["transient_bytes"],
                               plan["scratch_bytes"], k)
            ids = list(range(spec["first"], spec["first"] + spec["count"]))
            states = request_states(source, [samples[s] for s in ids], ids, plan, args.concurrency)
            size = shards.write_shard(args.out, k, ids, states, [samples[s].ids for s in ids],
                                      [samples[s].mask for s in ids], layers, args.dtype)
            index["peak_spool_bytes"] = max(index["peak_spool_bytes"], shards.spool_bytes(args.out))
            index["shards"][str(k)] = {**spec, "bytes": size, "written_at": round(time.time(), 1)}
            shards.write_json(index_path, index)
            tokens_done += spec["tokens"]
            left -= spec["tokens"]
            now = time.monotonic()
            if now - last > PROGRESS_EVERY_S or not left:
                last = now
                rate = tokens_done / (now - t0)
                progress(stage="extract", shards_done=len(index["shards"]), shards=len(plan["shards"]),
                         tokens_done=tokens_done, tok_s=round(rate, 1), eta_s=round(left / rate) if rate else None,
                         spool_bytes=shards.spool_bytes(args.out))
                report.refresh(args.out, "extract")
        elapsed = time.monotonic() - t0 if todo else 0
    finally:
        if source is not None:
            source.close()
    index["complete"] = len(index["shards"]) == len(plan["shards"])
    shards.write_json(index_path, index)
    progress(stage="done", shards=len(plan["shards"]), samples=plan["samples"], tokens=plan["tokens"],
             bytes_per_token=plan["bytes_per_token"], peak_spool_bytes=index["peak_spool_bytes"],
             tok_s=round(tokens_done / elapsed, 1) if tokens_done else None)
    report.finish(args.out, "extract")


if __name__ == "__main__":
    main_of(main, "extract.py")
