"""Run a function on N CPU ranks of one gloo group (spawned processes), each writing a JSON result."""
import json
import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, out, fn, fn_args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *fn_args)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def on_ranks(world: int, out, fn, *fn_args) -> list:
    """fn(rank, world, *fn_args) on each of `world` ranks; their JSON-able results in rank order."""
    mp.spawn(_rank, args=(world, free_port(), str(out), fn, fn_args), nprocs=world, join=True)
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
