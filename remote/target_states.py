"""Where the trainer gets the target's hidden states from.

The draft needs, per token: the target's residual stream entering three layers
(the "aux" states, vLLM's layer-id convention: id k = the input of layer k,
0 = the token embeddings, L = the last layer's output before the final norm)
and the target's next-token distribution, which is final norm + lm_head of
the id-L state. A `TargetStates` source provides both, plus the frozen
embedding table the draft shares with the target.

`OnlineTargetStates` runs the frozen target (transformers) on each batch: no
state dumps on disk; `CachedTargetStates` keeps what it said of each sample in
memory for the next epochs (a CPU run). `states_from_shards.ShardTargetStates`
(states precomputed by vLLM into shards by remote/extract.py, for targets
transformers cannot hold) implements the same `TargetStates`.
"""
from dataclasses import dataclass
from typing import Protocol

import torch

from chat_render import load_pretrained


@dataclass
class TargetBatch:
    aux: torch.Tensor  # [B, T, 3H] the aux states, ascending ids, concatenated as vLLM's fc reads them
    last: torch.Tensor  # [B, T, H] id L: the last layer's output, before the final norm


class TargetStates(Protocol):
    config: object  # the target's transformers (text) config: sizes, vocab, RoPE, max positions
    aux_layer_ids: list[int]

    def embeddings(self) -> torch.Tensor:
        """[V, H] the target's token embeddings (the draft shares them, frozen)."""

    def states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sample_index: list[int]) -> TargetBatch:
        """The states of a right-padded batch [B, T] whose rows are samples `sample_index`."""

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """[B, T, V] the target's next-token logits from the id-L state (= normed(last) @ head_weight.T)."""

    def normed(self, last: torch.Tensor) -> torch.Tensor:
        """[B, T, H] the id-L state through the target's final norm."""

    head_weight: torch.Tensor  # [V, H] the target's lm_head (the trainer scores it a vocabulary chunk at a time)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default (2, L//2, L-3); for targets too shallow for it, three ids spread over [0, L]."""
    ids = [2, num_layers // 2, num_layers - 3]
    if ids == sorted(set(ids)) and ids[0] >= 0:
        return ids
    return [0, (num_layers + 1) // 2, num_layers]


def check_aux_layer_ids(ids: list[int], num_layers: int) -> None:
    """vLLM concatenates aux states in layer order and does not range-check ids (a bad one kills the engine)."""
    if len(ids) != 3 or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] > num_layers:
        raise ValueError(f"aux layer ids {ids}: need 3 distinct ascending ids in [0, {num_layers}]")


class OnlineTargetStates:
    """The target model itself, frozen, run under no_grad on each batch."""

    def __init__(self, path: str, aux_layer_ids: list[int] | None, device: torch.device, dtype: torch.dtype,
                 trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM

        model = load_pretrained(AutoModelForCausalLM, path, trust_remote_code, dtype=dtype)
        self.model = model.to(device).eval().requires_grad_(False)
        self.config = self.model.config.get_text_config()
        self.layers = self.model.base_model.layers
        n = len(self.layers)
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(n)
        check_aux_layer_ids(self.aux_layer_ids, n)
        self._captured: dict[int, torch.Tensor] = {}
        for k in self.aux_layer_ids:
            if k < n:
                self.layers[k].register_forward_pre_hook(self._capture_input(k), with_kwargs=True)
        self.layers[n - 1].register_forward_hook(self._capture_output(n))

    def _capture_input(self, k):
        def hook(module, args, kwargs):
            self._captured[k] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _capture_output(self, k):
        def hook(module, args, output):
            self._captured[k] = output[0] if isinstance(output, tuple) else output

        return hook

    def embeddings(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @torch.no_grad()
    def states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sample_index: list[int]) -> TargetBatch:
        """sample_index (which samples the rows are) is unused here; a precomputed source looks states up by it."""
        self._captured.clear()
        self.model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        last = self._captured[len(self.layers)]
        aux = torch.cat([self._captured[k] for k in self.aux_layer_ids], dim=-1)
        self._captured.clear()
        return TargetBatch(aux=aux, last=last)

    @torch.no_grad()
    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """[B, T, V]: the target's next-token logits from the id-L state (final norm + lm_head)."""
        return self.model.get_output_embeddings()(self.model.base_model.norm(last))

    @torch.no_grad()
    def normed(self, last: torch.Tensor) -> torch.Tensor:
        return self.model.base_model.norm(last)

    @property
    def head_weight(self) -> torch.Tensor:
        head = self.model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError("the target's lm_head has a bias: not supported by the trainer")
        return head.weight


class CachedTargetStates:
    """An online target whose states are kept per sample after its first pass, for a CPU run of several
    epochs: the same rows come back every epoch, and the frozen target says the same of them each time.

    On the demo's tiny target keeping them makes a CPU step 5% cheaper (0.158 -> 0.150 s), and the states
    of its 24000 rows take 3.9 GB. A batch whose samples are all kept is assembled from them; any other runs
    the target and keeps what it says of each sample (only while they fit in `budget_bytes`). A sample's
    states do not depend on the batch it came in (right padding, causal attention) beyond float rounding.
    Not for a GPU run: there the target's forward is cheap beside the draft's, and memory is the draft's.
    """

    def __init__(self, target: OnlineTargetStates, budget_bytes: int):
        self.target, self.budget_bytes, self.used_bytes = target, budget_bytes, 0
        self.config, self.aux_layer_ids, self.model = target.config, target.aux_layer_ids, target.model
        self.kept: dict[int, torch.Tensor] = {}  # sample index -> [n, 4H]: its aux states, then its id-L state

    def embeddings(self) -> torch.Tensor:
        return self.target.embeddings()

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        return self.target.logits(last)

    def normed(self, last: torch.Tensor) -> torch.Tensor:
        return self.target.normed(last)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.target.head_weight

    @torch.no_grad()
    def states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sample_index: list[int]) -> TargetBatch:
        lengths = attention_mask.sum(1).tolist()
        if all(i in self.kept for i in sample_index):
            H = self.config.hidden_size
            both = input_ids.new_zeros((*input_ids.shape, 4 * H), dtype=next(iter(self.kept.values())).dtype)
            for row, (i, n) in enumerate(zip(sample_index, lengths)):
                both[row, :n] = self.kept[i]
            return TargetBatch(aux=both[..., : 3 * H], last=both[..., 3 * H :])
        batch = self.target.states(input_ids, attention_mask, sample_index)
        both = torch.cat([batch.aux, batch.last], dim=-1)
        for row, (i, n) in enumerate(zip(sample_index, lengths)):
            size = n * both.shape[-1] * both.element_size()
            if i not in self.kept and self.used_bytes + size <= self.budget_bytes:
                self.kept[i] = both[row, :n].clone()
                self.used_bytes += size
        return batch
