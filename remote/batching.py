"""Which samples train together: the seeded order of each epoch (or streaming round), cut into batches.

Every order is a pure function of the seed and the epoch, so a resumed run, every rank of a job
and every node of a group replay exactly the same batches without telling each other.
"""
import torch

HELD_OUT_ROUND = 1_000_003  # the "epoch" of the held-out draw: no training epoch reaches it
POOL = 1024  # samples sorted by length together before batches are cut


def shuffled(n: int, seed: int, epoch: int) -> list[int]:
    """0..n-1 in the order of this seed and epoch (or streaming round): the one seed rule."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def held_out_rows(n_rows: int, fraction: float, seed: int) -> set[int]:
    """The data rows kept out of training (whole rows, so no turn of a held-out conversation is trained on):
    round(fraction * n_rows) of them, at least one when fraction > 0 and there are two rows, chosen by the seed."""
    if fraction <= 0 or n_rows < 2:
        return set()
    n = min(n_rows - 1, max(1, round(fraction * n_rows)))
    return set(shuffled(n_rows, seed, HELD_OUT_ROUND)[:n])


def cut_batches(index: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive samples into batches of <= batch_tokens padded tokens (as the trainer cuts an epoch)."""
    batches, batch, width = [], [], 0
    for i in index:
        if batch and max(width, lengths[i]) * (len(batch) + 1) > batch_tokens:
            batches.append(batch)
            batch, width = [], 0
        batch.append(i)
        width = max(width, lengths[i])
    return batches + [batch] if batch else batches


def grouped_batches(order: list[int], lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """``order`` cut into batches of samples of like length, in a seeded order of batches. Each pool of
    POOL consecutive samples is sorted by length before it is cut: a batch pads to its longest sample,
    and randomly mixed lengths make a third or more of every batch padding, computed and thrown away."""
    batches = []
    for start in range(0, len(order), POOL):
        pool = sorted(order[start:start + POOL], key=lambda i: lengths[i])
        batches += cut_batches(pool, lengths, batch_tokens)
    return [batches[j] for j in shuffled(len(batches), seed, epoch)]


def epoch_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Sample indices per batch for one epoch: a seeded shuffle cut into batches of <= batch_tokens padded tokens."""
    return grouped_batches(shuffled(len(lengths), seed, epoch), lengths, batch_tokens, seed, epoch)


def world_batches(batches: list[list[int]], world: int) -> list[list[int]]:
    """The epoch's batches made a multiple of the world size, so the ranks, stepping in lockstep,
    use every one (every sample once per epoch): the batch with the most samples is halved until
    the count divides. Only when every batch is a single sample can a remainder be left over."""
    batches = [list(b) for b in batches]
    while len(batches) % world:
        largest = max(range(len(batches)), key=lambda j: (len(batches[j]), -j))
        if len(batches[largest]) < 2:
            break
        b = batches[largest]
        batches[largest:largest + 1] = [b[:len(b) // 2], b[len(b) // 2:]]
    return batches


def rank_batches(lengths, batch_tokens, seed, rank, world):
    """This rank's (epoch, batch) sequence, epoch after epoch: a pure function of its arguments,
    so a resumed run sees exactly the batches the interrupted one would have."""
    epoch = 0
    while True:
        batches = world_batches(epoch_batches(lengths, batch_tokens, seed, epoch), world)
        per_rank = len(batches) // world  # ranks step in lockstep (world_batches leaves no remainder but singles')
        for batch in batches[rank::world][:per_rank]:
            yield epoch, batch
        epoch += 1


def steps_in_epochs(lengths, batch_tokens, seed, world, epochs: float) -> int:
    def per_rank(epoch):
        return len(world_batches(epoch_batches(lengths, batch_tokens, seed, epoch), world)) // world

    steps, whole = 0, int(epochs)
    for epoch in range(whole):
        steps += per_rank(epoch)
    if epochs > whole:
        steps += int((epochs - whole) * per_rank(whole))
    return steps
