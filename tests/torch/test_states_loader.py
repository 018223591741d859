"""The --states loader's host memory is bounded by the batch, not by how many read ahead: on a synthetic
shard set, with workers asked for, the memory the loader holds (anonymous and shared, this process and
any children) stays within its LOADER_BATCHES batches, and every batch comes back intact."""
import os
import sys
import time

import torch

from tests.helpers.fixtures_train import ROOT, REMOTE

sys.path.insert(0, str(REMOTE))
sys.path.insert(0, str(ROOT / "bench"))
import states_from_shards  # noqa: E402
from batching import cut_batches  # noqa: E402
from chat_render import Sample  # noqa: E402
from states_loader import synthetic_source  # noqa: E402

HIDDEN, TOKENS, SAMPLE_LEN = 256, 4096, 512


def held_bytes(pid: int) -> int:
    """Anonymous + shared-memory resident bytes of pid (a DataLoader's /dev/shm batches count here)."""
    total = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) * 1024
    except OSError:
        pass
    return total


def family_bytes() -> int:
    pids = [os.getpid()]
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return sum(held_bytes(p) for p in pids)


def test_the_loader_holds_at_most_its_batches_whatever_the_workers(tmp_path):
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, 4096, (SAMPLE_LEN,), generator=g, dtype=torch.int32),
                      torch.ones(SAMPLE_LEN, dtype=torch.bool)) for _ in range(10 * TOKENS // SAMPLE_LEN)]
    source = synthetic_source(str(tmp_path), HIDDEN, samples, per_shard=16)
    schedule = [(0, b) for b in cut_batches(list(range(len(samples))), [SAMPLE_LEN] * len(samples), TOKENS)]
    batch_bytes = TOKENS * 4 * HIDDEN * 2
    before = family_bytes()
    peak, seen = 0, 0
    for _, index, payload in source.loader(schedule, samples, 4, pin=False):
        time.sleep(0.15)  # a slow step: whatever reads ahead has filled up
        peak = max(peak, family_bytes() - before)
        for row in (0, len(index) - 1):  # intact at both ends of the batch
            assert torch.equal(payload["states"][row], source.shard(source.owner[index[row]]).states(index[row]))
        seen += 1
    assert seen == len(schedule)
    # the loader's own buffers, plus one batch of slack for allocator variance and the rows checked above
    bound = (states_from_shards.LOADER_BATCHES + 1) * batch_bytes
    assert peak <= bound, f"held {peak / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB"


def test_a_loader_that_the_host_cannot_hold_is_refused_in_one_line(tmp_path, monkeypatch):
    samples = [Sample(torch.zeros(64, dtype=torch.int32), torch.ones(64, dtype=torch.bool)) for _ in range(4)]
    source = synthetic_source(str(tmp_path), 32, samples, per_shard=4)
    monkeypatch.setattr(states_from_shards, "free_ram_bytes", lambda: 1000)
    try:
        source.loader([(0, [0, 1])], samples, 2, pin=False)
    except states_from_shards.StatesError as e:
        assert "host RAM" in str(e) and "\n" not in str(e)
    else:
        raise AssertionError("not refused")
