"""KV caches for sampling on CPU: a layer that grows in place, and a reusable shared prefix.

transformers' `DynamicLayer` appends with `torch.cat`, which copies the whole cache at every
decode step: with SmolLM2's ~800-token prompts that copy was 59% of a decode step on 2 cores.
`GrowingLayer` keeps keys and values in a buffer with spare room and writes each new column in
place. `PrefixCache` keeps the keys and values of the prompt prefix that every episode of an
env shares (system prompt and tool schemas), so it is computed once per weights version.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

SPARE = 256  # columns added beyond what an update needs when the buffer grows


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values are views of a (B, H, capacity, D) buffer."""

    def __init__(self, offset: int = 0) -> None:
        super().__init__()
        self.length = 0
        self.offset = offset  # leading columns held elsewhere (a shared prefix), counted in the length
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
        return self.offset + self.length

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


def dynamic_cache(model: PreTrainedModel) -> DynamicCache:
    """transformers' `DynamicCache`, laid out for `model`'s layer types where the version can."""
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


def growing_cache(model: PreTrainedModel, offset: int = 0) -> DynamicCache:
    """A `DynamicCache` for `model` whose full-attention layers grow in place; `offset` columns
    (a shared prefix served by `prefix_attention`) count in its length but are not stored."""
    cache = dynamic_cache(model)
    cache.layers = [GrowingLayer(offset) if type(layer) is DynamicLayer else layer for layer in cache.layers]
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


# -- attention against a shared prefix ------------------------------------------------------
PREFIX_ATTENTION = "cgym_shared_prefix"
# per layer: keys as (H_kv, D, P) fp32, values as (H_kv, P, D) fp32, and both as given (1, H_kv, P, D)
_PREFIX: ContextVar[tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]] | None] = ContextVar("cgym_prefix_kv", default=None)


@contextmanager
def shared_prefix(keys: list[Tensor], values: list[Tensor]) -> Iterator[None]:
    """Within this block, attention layers of models set up with `use_prefix_attention` attend to
    these per-layer (1, H_kv, P, D) keys/values first; the cache holds only each row's own part."""
    prepared = ([k[0].float().transpose(1, 2).contiguous() for k in keys], [v[0].float().contiguous() for v in values], keys, values)
    token = _PREFIX.set(prepared)
    try:
        yield
    finally:
        _PREFIX.reset(token)


def use_prefix_attention(model: PreTrainedModel) -> bool:
    """Route `model`'s attention through `prefix_attention` (SDPA whenever no prefix is active).
    Returns False, leaving the model as it was, when it does not use SDPA-style attention."""
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", PREFIX_ATTENTION):
        return False
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    global _sdpa
    _sdpa = sdpa_attention_forward
    ALL_ATTENTION_FUNCTIONS.register(PREFIX_ATTENTION, prefix_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PREFIX_ATTENTION, sdpa_mask)
    model.config._attn_implementation = PREFIX_ATTENTION
    return True


_sdpa: Any = None


def prefix_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any) -> tuple[Tensor, None]:
    """Attention of (B, H, q, D) queries over [shared prefix | each row's own keys].

    In a decode step the prefix's scores are one matmul per kv head against its single copy (no
    per-row copy of it to read), the rows' own part a batched matmul, one softmax over both:
    exact, and on SmolLM2 with its 800-token prompt the attention that dominated a step goes
    away. Returns (B, q, H, D) like transformers' attention functions.
    """
    prefix = _PREFIX.get()
    if prefix is None:
        return _sdpa(module, query, key, value, attention_mask, **kwargs)
    if query.shape[2] > 1:  # a prefill: SDPA's fused kernel over per-row copies beats the split scores
        batch, i = query.shape[0], module.layer_idx
        full_k = torch.cat([prefix[2][i].expand(batch, -1, -1, -1), key], 2)
        full_v = torch.cat([prefix[3][i].expand(batch, -1, -1, -1), value], 2)
        return _sdpa(module, query, full_k, full_v, attention_mask, **kwargs)
    pk_t, pv = prefix[0][module.layer_idx], prefix[1][module.layer_idx]  # (H_kv, D, P), (H_kv, P, D)
    batch, heads, q_len, dim = query.shape
    kv_heads = pk_t.shape[0]
    n = heads // kv_heads * q_len  # queries per kv head and row
    scale = kwargs.get("scaling") or dim**-0.5
    own_mask = _own_mask(attention_mask, batch, q_len, key.shape[2], pk_t.shape[2], query.device)  # (B, q, S) bool
    qg = query.float().reshape(batch, kv_heads, n, dim)  # (B, H_kv, n, D)
    s_prefix = torch.matmul(qg.transpose(0, 1).reshape(kv_heads, batch * n, dim), pk_t).mul_(scale)  # (H_kv, B*n, P)
    s_own = torch.matmul(qg, key.float().transpose(-1, -2)).mul_(scale)  # (B, H_kv, n, S)
    m = own_mask[:, None, None].expand(-1, kv_heads, heads // kv_heads, -1, -1).reshape(s_own.shape)
    s_own.masked_fill_(~m, float("-inf"))
    top = torch.maximum(s_prefix.amax(-1).reshape(kv_heads, batch, n).transpose(0, 1), s_own.amax(-1))  # (B, H_kv, n)
    e_prefix = s_prefix.sub_(top.transpose(0, 1).reshape(kv_heads, batch * n, 1)).exp_()
    e_own = s_own.sub_(top[..., None]).exp_()
    total = e_prefix.sum(-1).reshape(kv_heads, batch, n).transpose(0, 1) + e_own.sum(-1)  # (B, H_kv, n)
    out = torch.matmul(e_prefix, pv).reshape(kv_heads, batch, n, dim).transpose(0, 1) + torch.matmul(e_own, value.float())
    out = (out / total[..., None]).reshape(batch, heads, q_len, dim)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _own_mask(attention_mask: Tensor | None, batch: int, q_len: int, own: int, plen: int, device: torch.device) -> Tensor:
    """(B, q, S) which of a row's own keys each query sees: the given 4D mask's columns after the
    prefix, or plain causality where transformers left the mask out (no padding)."""
    if attention_mask is not None:
        mask = attention_mask[:, 0, :, plen : plen + own]
        return mask if mask.dtype == torch.bool else mask == 0
    rows = torch.arange(q_len, device=device)[:, None] + (own - q_len)
    return (torch.arange(own, device=device)[None] <= rows)[None].expand(batch, -1, -1)
