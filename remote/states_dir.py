"""Target hidden states on disk: the directory remote/extract.py writes and the trainer reads.

    plan.json                   what the directory will hold, fixed before the first shard:
                                layer ids, hidden size, dtype, the samples (count, digest of their
                                token ids + loss masks), and which samples go in which shard
    shard-00000.safetensors     one per planned shard, complete or absent (written to a .tmp
                                name, then renamed): see `Shard`
    index.json                  the shards written so far (rewritten atomically after each)
    shard-00000.consumed        left by a streaming trainer when it deleted the shard after its
                                last use, so a resumed extraction does not write it again

A shard holds the states of consecutive samples (sample i = the i-th sample the trainer's
renderer makes from the data), concatenated along the token axis:

    hidden_states  [N, n_layers, H]  bf16 (or fp32), layer ids ascending as in plan["layers"]
    token_ids      int64 [N]         the tokens the states were computed on
    loss_mask      uint8 [N]         1 on the target's own output tokens
    sample_ids     int64 [S]         which samples, ascending
    offsets        int64 [S + 1]     sample k is rows offsets[k]:offsets[k+1]

A shard exists exactly when it is complete, and which samples it holds is fixed by the
plan, so a crash (even kill -9) at any point leaves a directory that resuming completes
with every sample exactly once. Stdlib + torch + safetensors only.
"""
import hashlib
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PLAN = "plan.json"
INDEX = "index.json"
FORMAT = 1
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
EXTRA_BYTES_PER_TOKEN = 8 + 1  # token id + loss mask, beside the states


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def consumed_name(k: int) -> str:
    return f"shard-{k:05d}.consumed"


def bytes_per_token(n_layers: int, hidden_size: int, dtype: str) -> int:
    return n_layers * hidden_size * DTYPES[dtype].itemsize + EXTRA_BYTES_PER_TOKEN


def samples_digest(samples) -> str:
    """sha256 over every sample's token ids and loss mask, in order: the trainer and the extractor
    agree on it exactly when they rendered the same samples."""
    h = hashlib.sha256()
    for s in samples:  # ids and mask: lists or tensors
        h.update(torch.as_tensor(s.ids).to(torch.int64).numpy().tobytes())
        h.update(torch.as_tensor(s.mask).to(torch.uint8).numpy().tobytes())
        h.update(b"\n")
    return h.hexdigest()


def plan_shards(lengths: list[int], max_shard_tokens: int) -> list[dict]:
    """Consecutive samples cut into shards of at most max_shard_tokens tokens (one sample may exceed it)."""
    shards, first, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if tokens and tokens + n > max_shard_tokens:
            shards.append({"first": first, "count": i - first, "tokens": tokens})
            first, tokens = i, 0
        tokens += n
    if tokens:
        shards.append({"first": first, "count": len(lengths) - first, "tokens": tokens})
    return shards


# ---------------------------------------------------------------- writing


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(out_dir: str, k: int, sample_ids: list[int], states: list[torch.Tensor], token_ids: list,
                loss_masks: list, layers: list[int], dtype: str) -> int:
    """Write shard k atomically (tmp, fsync, rename); returns its size in bytes. token_ids and
    loss_masks: one list or tensor per sample."""
    lengths = [len(t) for t in token_ids]
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    tensors = {
        "hidden_states": torch.cat(states).to(DTYPES[dtype]).contiguous(),
        "token_ids": torch.cat([torch.as_tensor(t).to(torch.int64) for t in token_ids]),
        "loss_mask": torch.cat([torch.as_tensor(m).to(torch.uint8) for m in loss_masks]),
        "sample_ids": torch.tensor(sample_ids, dtype=torch.int64),
        "offsets": offsets,
    }
    path = os.path.join(out_dir, shard_name(k))
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"format": str(FORMAT), "shard": str(k), "layers": json.dumps(layers)})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(out_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return os.path.getsize(path)


def spool_bytes(out_dir: str) -> int:
    """Bytes under out_dir now: shards, a shard being written, per-request files not yet packed."""
    total = 0
    for parent, _, names in os.walk(out_dir):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(parent, name))
            except FileNotFoundError:  # deleted meanwhile (packed, or consumed by the trainer)
                pass
    return total


def done_shards(out_dir: str, plan: dict) -> set[int]:
    """Shards written (present, listed in the index, or consumed by a streaming trainer)."""
    done = set()
    index = read_json(os.path.join(out_dir, INDEX)) or {}
    done |= {int(k) for k in index.get("shards", {})}
    for k in range(len(plan["shards"])):
        if os.path.exists(os.path.join(out_dir, shard_name(k))) or os.path.exists(
                os.path.join(out_dir, consumed_name(k))):
            done.add(k)
    return done


def read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------- reading


class Shard:
    """One shard, memory-mapped: per-sample rows are read on demand, never the whole file."""

    def __init__(self, path: str):
        self.path = path
        self._file = safe_open(path, framework="pt")
        self.sample_ids = self._file.get_tensor("sample_ids").tolist()
        self.offsets = self._file.get_tensor("offsets").tolist()
        self.layers = json.loads(self._file.metadata()["layers"])
        self._row = {s: k for k, s in enumerate(self.sample_ids)}
        self._states = self._file.get_slice("hidden_states")
        self._ids = self._file.get_slice("token_ids")
        self._mask = self._file.get_slice("loss_mask")

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._row

    def rows(self, sample_id: int) -> tuple[int, int]:
        k = self._row[sample_id]
        return self.offsets[k], self.offsets[k + 1]

    def states(self, sample_id: int) -> torch.Tensor:
        """[T, n_layers, H] in the stored dtype."""
        a, b = self.rows(sample_id)
        return self._states[a:b]

    def token_ids(self, sample_id: int) -> torch.Tensor:
        a, b = self.rows(sample_id)
        return self._ids[a:b]

    def loss_mask(self, sample_id: int) -> torch.Tensor:
        a, b = self.rows(sample_id)
        return self._mask[a:b]

    def close(self) -> None:
        self._states = self._ids = self._mask = self._file = None


def shard_of(plan: dict) -> list[int]:
    """Sample index -> shard number, from the plan."""
    owner = [0] * plan["samples"]
    for k, s in enumerate(plan["shards"]):
        owner[s["first"]: s["first"] + s["count"]] = [k] * s["count"]
    return owner
