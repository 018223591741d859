"""Target states read from shards that vLLM computed (remote/extract.py), for `train.py --states DIR`.

The `TargetStates` the online source gives the trainer (see target_states.py), for
targets that transformers cannot hold next to a trainer:

- the aux states and the id-L state of each sample, read from the shards (memory-mapped,
  only the rows of the batch);
- the target's next-token logits, computed from the id-L state through the target's final
  norm and lm_head, which are loaded alone from its safetensors files (`load_tensors_alone`:
  no layer weights are ever read);
- the frozen embedding table, loaded the same way.

The trainer renders the data itself, exactly as the extractor did; the plan's digest of
every sample's token ids and loss mask proves they agree, and each batch's token ids are
checked against the shard's.

Streaming (`--stream`): `StreamSchedule` trains on shards as they appear in the spool
directory and deletes each once its last epoch's batches are behind a checkpoint. The
order is a pure function of the plan, the seed and the epochs, so `--resume` replays it.
"""
import json
import math
import os
import queue
import threading
import time
from collections import OrderedDict

import torch
from safetensors import safe_open

import states_dir as shards
from batching import grouped_batches, shuffled
from chat_render import load_pretrained
from script import progress
from target_states import TargetBatch

OPEN_SHARDS = 64  # memory-mapped shard handles kept open
# Batches of states the loader holds on the host, whatever else is configured: the one the step copies
# from and the one read ahead. At Kimi width one rank's batch is GBs; a count of batches in flight that grew
# with worker processes (each also crossing /dev/shm, then copied into pinned memory) exhausted a node's RAM.
LOADER_BATCHES = 2
READS = threading.Lock()  # shard handles are shared by the reader thread and the step's own reads (validation)
PROGRESS_EVERY_S = 30.0
NORM_NAMES = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight")
EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
               "language_model.model.embed_tokens.weight")
HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")


class StatesError(ValueError):
    """The shards cannot serve this training run; the message is one line for the user."""


def safetensors_files(target: str) -> dict[str, str]:
    """Tensor name -> file, from model.safetensors.index.json or the single model.safetensors."""
    index = os.path.join(target, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return {name: os.path.join(target, file) for name, file in json.load(f)["weight_map"].items()}
    single = os.path.join(target, "model.safetensors")
    if not os.path.exists(single):
        raise StatesError(f"{target}: no model.safetensors(.index.json): the head is read from safetensors files")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def load_tensors_alone(target: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Just these tensors from the target's safetensors files (a 1T-parameter target costs its head only)."""
    where = safetensors_files(target)
    out = {}
    for name in names:
        with safe_open(where[name], framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def first_present(names: tuple[str, ...], available, what: str, target: str) -> str:
    for name in names:
        if name in available:
            return name
    raise StatesError(f"{target}: no {what} tensor (looked for {', '.join(names)})")


class TargetHead:
    """The target's final RMSNorm and lm_head, alone: id-L state -> next-token logits."""

    def __init__(self, target: str, config, device, dtype):
        if str(getattr(config, "model_type", "")).startswith("gemma"):
            raise StatesError("gemma's norm (1 + weight) is not supported by the shard trainer")
        available = safetensors_files(target)
        norm = first_present(NORM_NAMES, available, "final norm", target)
        embed = first_present(EMBED_NAMES, available, "embedding", target)
        head = embed if getattr(config, "tie_word_embeddings", False) else first_present(
            HEAD_NAMES, available, "lm_head", target)
        tensors = load_tensors_alone(target, sorted({norm, embed, head}))
        self.eps = getattr(config, "rms_norm_eps", 1e-6)
        self.norm = tensors[norm].to(device, dtype)
        self.lm_head = tensors[head].to(device, dtype)  # [V, H]
        self.embed = tensors[embed]  # [V, H], handed to the draft (which keeps its own frozen copy)

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """As transformers' RMSNorm (fp32 statistics, weight times the normed input) then lm_head."""
        return self.normed(last) @ self.lm_head.T

    def normed(self, last: torch.Tensor) -> torch.Tensor:
        x = last.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm * x.to(last.dtype)


def wait_for(path: str, timeout: float, what: str) -> None:
    """Streaming: the extraction writes `path` when it gets to it; say so while waiting."""
    start = last = time.monotonic()
    while not os.path.exists(path):
        now = time.monotonic()
        if now - start > timeout:
            raise StatesError(f"no {what} ({path}) after {timeout:g}s: is the extraction running?")
        if now - last > PROGRESS_EVERY_S:
            last = now
            progress(stage="waiting for states", waited_s=round(now - start), **{"for": what})
        time.sleep(0.2)


class ShardTargetStates:
    """The TargetStates interface of target_states.py, served from an extraction directory."""

    def __init__(self, target: str, states_dir: str, aux_layer_ids, samples, device, dtype,
                 stream: bool = False, timeout: float = 3600, trust_remote_code: bool = False):
        from transformers import AutoConfig

        self.dir, self.stream, self.timeout = states_dir, stream, timeout
        if stream:
            wait_for(os.path.join(states_dir, shards.PLAN), timeout, "extraction plan")
        plan = shards.read_json(os.path.join(states_dir, shards.PLAN))
        if plan is None:
            raise StatesError(f"{states_dir}: no plan.json: not an extraction directory (remote/extract.py --out)")
        self.plan = plan
        self.config = load_pretrained(AutoConfig, target, trust_remote_code).get_text_config()
        L, H = self.config.num_hidden_layers, self.config.hidden_size
        if (plan["num_layers"], plan["hidden_size"]) != (L, H):
            raise StatesError(f"{states_dir} holds states of a {plan['num_layers']}-layer, {plan['hidden_size']}-wide "
                              f"target; {target} has {L} layers, hidden {H}")
        if aux_layer_ids and list(aux_layer_ids) != plan["aux_layer_ids"]:
            raise StatesError(f"--aux-layers {list(aux_layer_ids)} but {states_dir} holds aux ids "
                              f"{plan['aux_layer_ids']} (extract again with --layers, or drop --aux-layers)")
        if len(samples) != plan["samples"] or shards.samples_digest(samples) != plan["samples_digest"]:
            raise StatesError(f"{states_dir} was extracted from other samples ({plan['samples']} samples, rendered "
                              f"from {[d[0] for d in plan['data']]} with max_len {plan['max_len']}); this run "
                              f"renders {len(samples)}: use the same --data, --max-len and --include-truncated")
        if not stream:
            missing = [k for k in range(len(plan["shards"]))
                       if not os.path.exists(os.path.join(states_dir, shards.shard_name(k)))]
            if missing:
                raise StatesError(f"{states_dir}: {len(missing)} of {len(plan['shards'])} shards missing (first: "
                                  f"{shards.shard_name(missing[0])}): finish the extraction (--resume) or use --stream")
        self.aux_layer_ids = plan["aux_layer_ids"]
        self.aux_pos = [plan["layers"].index(k) for k in self.aux_layer_ids]
        self.last_pos = plan["layers"].index(L)
        self.owner = shards.shard_of(plan)
        self.device, self.dtype = device, dtype
        self.head = TargetHead(target, self.config, device, dtype)
        self._open: OrderedDict[int, shards.Shard] = OrderedDict()

    def embeddings(self) -> torch.Tensor:
        return self.head.embed

    def shard(self, k: int) -> shards.Shard:
        if k not in self._open:
            path = os.path.join(self.dir, shards.shard_name(k))
            if self.stream:
                wait_for(path, self.timeout, f"shard {k}")
            self._open[k] = shards.Shard(path)
            if len(self._open) > OPEN_SHARDS:
                self._open.popitem(last=False)[1].close()
        self._open.move_to_end(k)
        return self._open[k]

    def release(self, k: int) -> None:
        """Close shard k, mark it consumed (a resumed extraction skips it) and delete it."""
        if k in self._open:
            self._open.pop(k).close()
        open(os.path.join(self.dir, shards.consumed_name(k)), "w").close()
        try:
            os.remove(os.path.join(self.dir, shards.shard_name(k)))
        except FileNotFoundError:
            pass

    @torch.no_grad()
    def states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sample_index: list[int],
               payload: dict | None = None) -> TargetBatch:
        """payload: the batch as `loader` read it ahead; without one, read here (the training thread)."""
        if payload is None:
            lengths = attention_mask.sum(1).tolist()
            payload = read_batch(self, sample_index, input_ids.shape[1],
                                 [input_ids[r, : int(n)].tolist() for r, n in enumerate(lengths)])
        if payload.get("error"):
            raise StatesError(payload["error"])
        got = payload["states"]
        B, T, _, H = got.shape
        got = got.to(self.device, non_blocking=True)
        if got.is_cuda and payload["states"].is_pinned():  # the loader refills this buffer once the copy is done
            payload["copied"] = torch.cuda.Event()
            payload["copied"].record()
        got = got.to(self.dtype)
        aux = got[:, :, self.aux_pos].reshape(B, T, len(self.aux_pos) * H)
        return TargetBatch(aux=aux, last=got[:, :, self.last_pos])

    def loader(self, batches: list, samples, workers: int, pin: bool):
        """Yields (epoch, sample indexes, payload) for `batches` [(epoch, indexes)]. workers 0: each batch
        read in this thread when asked for; else one reader thread reads the next batch while the step runs,
        into LOADER_BATCHES reused buffers (pinned with pin): host memory is bounded by the batch, not by
        how many read ahead. Raises StatesError when this host's free RAM cannot hold those buffers."""
        if not workers:
            return (batch + (read_batch(self, batch[1], width(samples, batch[1]), ids_of(samples, batch[1])),)
                    for batch in batches)
        return ReadAhead(self, batches, samples, pin)
    @torch.no_grad()
    def logits(self, last: torch.Tensor) -> torch.Tensor:
        return self.head.logits(last)

    @torch.no_grad()
    def normed(self, last: torch.Tensor) -> torch.Tensor:
        return self.head.normed(last)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.head.lm_head

    def stream_schedule(self, lengths, batch_tokens: int, seed: int, epochs: int) -> "StreamSchedule":
        plan = self.plan
        if plan["scratch_bytes"]:
            biggest = max(s["tokens"] for s in plan["shards"]) * plan["bytes_per_token"]
            if epochs * biggest + plan["transient_bytes"] > plan["scratch_bytes"]:
                raise StatesError(f"--epochs {epochs} keeps {epochs} shards of up to {biggest / 1e9:.3g} GB in the "
                                  f"spool at once: more than its budget {plan['scratch_bytes'] / 1e9:.3g} GB "
                                  f"(lower --epochs, or extract with a smaller --shard-mb)")
        return StreamSchedule(self, lengths, batch_tokens, seed, epochs)


def width(samples, index: list[int]) -> int:
    return max(len(samples[i].ids) for i in index)


def ids_of(samples, index: list[int]) -> list[list[int]]:
    return [samples[i].ids.tolist() for i in index]


def read_batch(source: "ShardTargetStates", sample_index: list[int], width: int, expected_ids,
               out: torch.Tensor | None = None) -> dict:
    """The stored states of a batch, right-padded to [B, width, n_layers, H] in the stored dtype (in the
    front of `out`, a flat buffer, where given); the token ids in the shards are checked against the
    batch's. An error comes back as a message, for the step to raise in the training thread."""
    L, H = len(source.plan["layers"]), source.plan["hidden_size"]
    got = None
    with READS:
        for row, s in enumerate(sample_index):
            shard = source.shard(source.owner[s])
            stored = shard.states(s)
            if got is None:
                shape = (len(sample_index), width, L, H)
                got = torch.zeros(shape, dtype=stored.dtype) if out is None else \
                    out[: math.prod(shape)].view(shape).zero_()
            n = stored.shape[0]
            if shard.token_ids(s).tolist() != list(expected_ids[row][:n]) or n != len(expected_ids[row]):
                return {"error": f"sample {s}: the tokens in {shard.path} differ from the batch's"}
            got[row, :n] = stored
        if source.stream:  # a streamed shard may be deleted once trained on: hold no handle past the batch
            for k in list(source._open):
                source._open.pop(k).close()
    return {"states": got}


def loader_bytes(batches: list, samples, plan: dict) -> int:
    """Host bytes the read-ahead loader holds: LOADER_BATCHES buffers as big as the schedule's largest batch."""
    itemsize = shards.DTYPES[plan.get("dtype", "bf16")].itemsize
    biggest = max((len(index) * width(samples, index) for _, index in batches), default=0)
    return LOADER_BATCHES * biggest * len(plan["layers"]) * plan["hidden_size"] * itemsize


def free_ram_bytes() -> int:
    """RAM this host can still give (MemAvailable), or 0 if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class ReadAhead:
    """One reader thread filling LOADER_BATCHES reused buffers in schedule order; iterating yields
    (epoch, sample indexes, payload). A buffer goes back to the reader when the step asks for the next
    batch (and, on a GPU, once its copy to the device has finished)."""

    def __init__(self, source: "ShardTargetStates", batches: list, samples, pin: bool):
        self.source, self.batches, self.samples = source, batches, samples
        need = loader_bytes(batches, samples, source.plan)
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # this host's ranks each hold as much, all at once
        free = free_ram_bytes()
        if free and need * ranks > free:
            raise StatesError(f"the --states loader needs {need / 1e9:.3g} GB of host RAM per rank ({LOADER_BATCHES} "
                              f"batches of states), {need * ranks / 1e9:.3g} GB for this host's {ranks}, and "
                              f"{free / 1e9:.3g} GB is free: lower --batch-tokens or free memory")
        elements = need // LOADER_BATCHES // self._dtype().itemsize
        self.free: queue.Queue = queue.Queue()
        self.ready: queue.Queue = queue.Queue()
        for _ in range(LOADER_BATCHES if batches else 0):
            self.free.put(torch.empty(elements, dtype=self._dtype(), pin_memory=pin))
        self.thread = threading.Thread(target=self._read, name="states-reader", daemon=True)
        self.thread.start()

    def _dtype(self) -> torch.dtype:
        return shards.DTYPES[self.source.plan.get("dtype", "bf16")]

    def _read(self):
        for epoch, index in self.batches:
            buffer = self.free.get()
            try:
                payload = read_batch(self.source, index, width(self.samples, index), ids_of(self.samples, index),
                                     out=buffer)
            except Exception as e:  # noqa: BLE001 - raised in the training thread, with its message
                payload = {"error": f"reading the states of samples {index[:4]}...: {e}"}
            self.ready.put((epoch, index, payload, buffer))

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        held = None
        for _ in self.batches:
            epoch, index, payload, buffer = self.ready.get()
            if held is not None:
                self._give_back(*held)
            held = (payload, buffer)
            yield epoch, index, payload

    def _give_back(self, payload: dict, buffer: torch.Tensor) -> None:
        if payload.get("copied") is not None:
            payload["copied"].synchronize()
        self.free.put(buffer)


class StreamSchedule:
    """Training order over a spool that never holds more than `epochs` shards for the trainer.

    Round r trains on the shards r-E+1 .. r (E = epochs), shuffled together and cut into batches of
    like length as an epoch is (batching.grouped_batches): every shard is
    in E consecutive rounds, so every sample is seen E times, as in E epochs; shard r-E+1 is
    not needed after round r. The trainer saves a checkpoint at the end of each such round
    (`checkpoint_due`), and only then are the shards it finished deleted (`saved`): a crash
    never loses states a resume still needs.
    """

    def __init__(self, source: ShardTargetStates, lengths, batch_tokens: int, seed: int, epochs: int):
        self.source = source
        plan_shards = source.plan["shards"]
        S, E = len(plan_shards), epochs
        self.steps: list[list[int]] = []
        self.last_step = [0] * S  # steps done when shard k is finished with
        for r in range(S + E - 1):
            window = range(max(0, r - E + 1), min(r, S - 1) + 1)
            index = [i for k in window for i in range(plan_shards[k]["first"],
                                                        plan_shards[k]["first"] + plan_shards[k]["count"])]
            self.steps += grouped_batches([index[j] for j in shuffled(len(index), seed, r)], lengths, batch_tokens,
                                          seed, r)
            if r - E + 1 >= 0:
                self.last_step[r - E + 1] = len(self.steps)
        self.total_steps = len(self.steps)
        self.samples = len(lengths)
        self._released = set()

    def batches(self, start_step: int):
        """(epoch, sample indexes) from start_step on; epoch = passes over the data completed so far."""
        self.saved(start_step)  # a crash may have come between a checkpoint and its deletions
        seen = sum(len(b) for b in self.steps[:start_step])
        for batch in self.steps[start_step:]:
            yield seen // self.samples, batch
            seen += len(batch)

    def checkpoint_due(self, steps_done: int) -> bool:
        return steps_done in self.last_step

    def saved(self, steps_done: int) -> None:
        """A checkpoint covers the first steps_done steps: delete the shards no later step needs."""
        for k, last in enumerate(self.last_step):
            if last <= steps_done and k not in self._released:
                self.source.release(k)
                self._released.add(k)
