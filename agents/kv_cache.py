"""KV caches for sampling on CPU: a layer that grows in place, and a reusable shared prefix.

transformers' `DynamicLayer` appends with `torch.cat`, which copies the whole cache at every
decode step: with SmolLM2's ~800-token prompts that copy was 59% of a decode step on 2 cores.
`GrowingLayer` keeps keys and values in a buffer with spare room and writes each new column in
place. `PrefixCache` keeps the keys and values of the prompt prefix that every episode of an
env shares (system prompt and tool schemas), so it is computed once per weights version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

SPARE = 256  # columns added beyond what an update needs when the buffer grows


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values are views of a (B, H, capacity, D) buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self._k: Tensor | None = None
        self._v: Tensor | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self._k is None or end > self._k.shape[-2]:
            self._grow(key_states, value_states, end + SPARE)
        assert self._k is not None and self._v is not None and self._k.shape[0] == key_states.shape[0], "batch size changed"
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self._refresh()
        return self.keys, self.values

    def fill(self, keys: Tensor, values: Tensor, capacity: int) -> None:
        """Start from given (B, H, T, D) keys/values, with room for `capacity` columns in all."""
        self.is_initialized, self.device, self.length = True, keys.device, 0
        self._k = self._v = None
        self._grow(keys, values, max(capacity, keys.shape[-2]))
        self.update(keys, values)

    def _grow(self, like_k: Tensor, like_v: Tensor, capacity: int) -> None:
        batch, heads, _, dim = like_k.shape
        k = like_k.new_empty((batch, heads, capacity, dim))
        v = like_v.new_empty((batch, heads, capacity, like_v.shape[-1]))
        if self._k is not None and self._v is not None and self.length:
            k[:, :, : self.length] = self._k[:, :, : self.length]
            v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = k, v

    def _refresh(self) -> None:
        assert self._k is not None and self._v is not None
        self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: Tensor) -> None:
        if self._k is not None and self._v is not None:
            self._k, self._v = self._k[indices], self._v[indices]
            self._refresh()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._k is not None and self._v is not None:
            self._k, self._v = self._k.repeat_interleave(repeats, 0), self._v.repeat_interleave(repeats, 0)
            self._refresh()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)
        if self._k is not None:
            self._refresh()

    def reset(self) -> None:
        self.length, self._k, self._v = 0, None, None
        super().reset()


def growing_cache(model: PreTrainedModel) -> DynamicCache:
    """A `DynamicCache` for `model` whose full-attention layers grow in place."""
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@dataclass
class PrefixEntry:
    ids: tuple[int, ...]
    keys: list[Tensor]  # per layer, (1, H, T, D)
    values: list[Tensor]
    version: tuple[int, int]


class PrefixCache:
    """Keys and values of one shared prompt prefix, kept across sampling calls.

    An entry is valid only for the weights it was computed with: `weights_version` sums the
    parameters' in-place version counters, which every optimizer step bumps.
    """

    def __init__(self) -> None:
        self.entry: PrefixEntry | None = None

    def lookup(self, model: PreTrainedModel, prefix: Sequence[int]) -> int:
        """How many leading ids of `prefix` the stored entry already covers."""
        entry = self.entry
        if entry is None or entry.version != weights_version(model):
            return 0
        n = 0
        for a, b in zip(entry.ids, prefix):
            if a != b:
                break
            n += 1
        return n

    def store(self, model: PreTrainedModel, ids: Sequence[int], cache: DynamicCache) -> None:
        layers = [layer for layer in cache.layers if layer.is_initialized]
        self.entry = PrefixEntry(tuple(ids), [layer.keys.clone() for layer in layers], [layer.values.clone() for layer in layers], weights_version(model))


def weights_version(model: torch.nn.Module) -> tuple[int, int]:
    """Changes whenever a parameter is modified in place (optimizer steps, `load_state_dict`)
    or replaced by new storage (`model.to(...)`)."""
    params = list(model.parameters())
    return sum(p._version for p in params), sum(p.data_ptr() for p in params)
