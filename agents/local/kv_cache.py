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
from typing import Any, NamedTuple

import torch
from cgym.agents.local.attention_backward import attention_backward
from cgym.agents.local.cache_rows import compact_rows, gather_columns
from cgym.agents.local.decode_attention import FEW_QUERIES, HEAD_DIM, block_attention, own_attention
from cgym.agents.local.decode_attention import available as kernel_available
from cgym.agents.local.step_attention import PackedPrefix, pack_prefix, step_attention
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

SPARE = 256  # columns added beyond what an update needs when the buffer grows


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values are views of a (B, H, capacity, D) buffer."""

    def __init__(self, offset: int = 0, capacity: int = 0, first: FirstBuffers | None = None, index: int = 0) -> None:
        super().__init__()
        self.length = 0
        self.offset = offset  # leading columns held elsewhere (a shared prefix), counted in the length
        self.capacity = capacity  # columns the first buffer holds at least (a prefill fed in pieces)
        self._k: Tensor | None = None
        self._v: Tensor | None = None
        self._first = first  # where this layer's first buffers come from, shared with the cache's other layers
        self._index = index

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self._k is None or end > self._k.shape[-2]:
            self._grow(key_states, value_states, max(end + SPARE, self.capacity))
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
        taken = self._first.take(self._index, like_k, like_v, capacity) if self._first is not None and self._k is None else None
        self._first = None
        if taken is not None:
            self._k, self._v = taken
            return
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
        """Keep the rows `indices` (rows whose turn ended leave the batch), with the same room.
        Only the columns in use are copied: the room left for a turn's sampled ids is often
        most of a buffer (in a 100-episode eval, copying whole buffers took 1.7 s)."""
        if self._k is not None and self._v is not None:
            self._k, self._v = self._select(self._k, indices), self._select(self._v, indices)
            self._refresh()

    def kept_first(self, rows: int) -> None:
        """The buffers' first `rows` rows are the batch now (`keep_rows` moved them there)."""
        assert self._k is not None and self._v is not None
        self._k, self._v = self._k[:rows], self._v[:rows]
        self._refresh()

    def _select(self, buffer: Tensor, indices: Tensor) -> Tensor:
        kept = buffer.new_empty((len(indices), *buffer.shape[1:]))
        torch.index_select(buffer[:, :, : self.length], 0, indices, out=kept[:, :, : self.length])
        return kept

    def join(self, other: GrowingLayer, room: int) -> tuple[int, int]:
        """Take `other`'s rows below these (the same offset, heads and dims), both right-aligned
        at the longer length, with `room` columns to spare; the columns left of a shorter side
        are zeros, for a mask to hide. Returns the columns each side moved right by."""
        assert self._k is not None and self._v is not None and other._k is not None and other._v is not None
        assert self.offset == other.offset, "rows of different shared prefixes"
        length = max(self.length, other.length)
        moved = (length - self.length, length - other.length)
        self._k = _stacked(self._k, self.length, other._k, other.length, length + room)
        self._v = _stacked(self._v, self.length, other._v, other.length, length + room)
        self.length = length
        self._refresh()
        return moved

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


def _stacked(top: Tensor, top_length: int, bottom: Tensor, bottom_length: int, capacity: int) -> Tensor:
    """(b1 + b2, H, capacity, D): the used columns of two buffers' rows, right-aligned at the
    longer length, zeros to their left."""
    length = max(top_length, bottom_length)
    out = top.new_empty((top.shape[0] + bottom.shape[0], top.shape[1], capacity, top.shape[3]))
    for rows, buffer, used in ((slice(0, top.shape[0]), top, top_length), (slice(top.shape[0], None), bottom, bottom_length)):
        out[rows, :, : length - used] = 0
        out[rows, :, length - used : length] = buffer[:, :, :used]
    return out


class ReadOnlyLayer(DynamicLayer):
    """A `DynamicLayer` over fixed (B, H, P, D) keys/values that a pass reads and never extends:
    `update` returns them followed by the new columns and stores nothing, so a layer that runs
    twice (recomputed in the backward pass) sees the same cache both times."""

    def __init__(self, keys: Tensor, values: Tensor) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.device, self.is_initialized = keys.device, True

    def update(self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object) -> tuple[Tensor, Tensor]:
        return torch.cat([self.keys, key_states], -2), torch.cat([self.values, value_states], -2)


class ExtendingLayer(ReadOnlyLayer):
    """A `ReadOnlyLayer` that also keeps the new columns of its first update (`new_keys`,
    `new_values`): a pass that extends a fixed cache, whose keys/values later passes read, and
    that may run twice (recomputed) without extending it twice."""

    new_keys: Tensor | None = None
    new_values: Tensor | None = None

    def update(self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object) -> tuple[Tensor, Tensor]:
        if self.new_keys is None:
            self.new_keys, self.new_values = key_states, value_states
        return super().update(key_states, value_states)


class FirstPassLayer(DynamicLayer):
    """A layer for one pass over an empty cache: it keeps the keys/values of its first update and
    hands every update's back as they came, so the pass can run again (recomputed in the backward
    pass) and see an empty cache as the first run did."""

    def update(self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.keys, self.values = key_states, value_states
            self.device, self.is_initialized = key_states.device, True
        return key_states, value_states


def first_pass_cache(model: PreTrainedModel) -> DynamicCache | None:
    """A `DynamicCache` of `FirstPassLayer`s for `model`, or None where its layers are not all plain
    (e.g. sliding-window layers)."""
    cache = dynamic_cache(model)
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [FirstPassLayer() for _ in cache.layers]
    return cache


def read_only_cache(model: PreTrainedModel, keys: Sequence[Tensor], values: Sequence[Tensor]) -> DynamicCache:
    """A `DynamicCache` for `model` whose layers hold `keys`/`values` (one per layer) as `ReadOnlyLayer`s."""
    cache = dynamic_cache(model)
    cache.layers = [ReadOnlyLayer(k, v) for k, v in zip(keys, values, strict=True)]
    return cache


def extending_cache(model: PreTrainedModel, keys: Sequence[Tensor], values: Sequence[Tensor]) -> DynamicCache:
    """`read_only_cache` whose layers keep what one pass adds after `keys`/`values` (`ExtendingLayer`)."""
    cache = dynamic_cache(model)
    cache.layers = [ExtendingLayer(k, v) for k, v in zip(keys, values, strict=True)]
    return cache


def dynamic_cache(model: PreTrainedModel) -> DynamicCache:
    """transformers' `DynamicCache`, laid out for `model`'s layer types where the version can."""
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


class FirstBuffers:
    """The first key and value buffers of a cache's layers, as views of one allocation made when
    the first layer asks. A prefill's layers took theirs one at a time between the layers'
    temporaries, so the heap put each long-lived buffer where a temporary had been (every page
    of it touched) and the next temporaries on fresh pages: a 100-row eval's first prefill grew
    the process by ~1.3 GB. One block, taken before the temporaries, is touched only where keys
    are written."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.block: Tensor | None = None

    def take(self, index: int, like_k: Tensor, like_v: Tensor, capacity: int) -> tuple[Tensor, Tensor] | None:
        """Layer `index`'s (B, H, capacity, D) key and value buffers, or None where its keys are
        not like the first layer's (another shape, dtype or device: it allocates its own)."""
        shape = (*like_k.shape[:2], capacity, like_k.shape[-1])
        if like_v.shape[:2] + like_v.shape[3:] != like_k.shape[:2] + like_k.shape[3:] or like_v.dtype != like_k.dtype or like_v.device != like_k.device:
            return None
        if self.block is None:
            self.block = like_k.new_empty((self.layers, 2, *shape))
        if self.block.shape[2:] != shape or self.block.dtype != like_k.dtype or self.block.device != like_k.device:
            return None
        return self.block[index, 0], self.block[index, 1]


def growing_cache(model: PreTrainedModel, offset: int = 0, capacity: int = 0) -> DynamicCache:
    """A `DynamicCache` for `model` whose full-attention layers grow in place, each first buffer
    at least `capacity` columns wide (the layers' first buffers in one allocation, `FirstBuffers`);
    `offset` columns (a shared prefix served by `prefix_attention`) count in its length but are
    not stored."""
    cache = dynamic_cache(model)
    first = FirstBuffers(len(cache.layers))
    cache.layers = [GrowingLayer(offset, capacity, first, i) if type(layer) is DynamicLayer else layer for i, layer in enumerate(cache.layers)]
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


FOLDED_FROM = "cgym_folded_from"  # on a sampling copy (a LoRA model's folded one, a packed one): its source's version


def weights_version(model: torch.nn.Module) -> tuple[int, int]:
    """Changes whenever a parameter is modified in place (optimizer steps, `load_state_dict`)
    or replaced by new storage (`model.to(...)`). The sampler's copy of a model answers with its
    source's version: a LoRA model's folded copy may be allocated where the last one was freed,
    with the same pointers and counters, and would pass for it, and a packed copy's linear
    weights are not parameters at all."""
    folded = getattr(model, FOLDED_FROM, None)
    if folded is not None:
        return folded
    params = list(model.parameters())
    return sum(p._version for p in params), sum(p.data_ptr() for p in params)


# -- attention against a shared prefix ------------------------------------------------------
PREFIX_ATTENTION = "cgym_shared_prefix"


class _Prefix(NamedTuple):
    """A shared prefix's per-layer (1, H_kv, P, D) keys and values as given, in fp32 for the
    flash kernel, and packed for `step_attention` (None where it does not run); `steps` keeps
    what the one-call decode step derives from the prefix and the layers once per block
    (`layer_step.stack_step`: a sampling call's weights stay put while it is served)."""

    keys: list[Tensor]
    values: list[Tensor]
    wide_keys: list[Tensor]
    wide_values: list[Tensor]
    packed: list[PackedPrefix | None]
    steps: dict[tuple[int, ...], Any]


_PREFIX: ContextVar[_Prefix | None] = ContextVar("cgym_prefix_kv", default=None)
# The CPU flash-attention kernel, which also returns each query's log-sum-exp of scores: two
# attentions (over the prefix, over a row's own keys) then merge exactly. Private to PyTorch,
# hence looked up, with the concatenating path below wherever it is missing.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@contextmanager
def shared_prefix(keys: list[Tensor], values: list[Tensor]) -> Iterator[None]:
    """Within this block, attention layers of models set up with `use_prefix_attention` attend to
    these per-layer (1, H_kv, P, D) keys/values first; the cache holds only each row's own part."""
    if _FLASH_CPU is not None and keys and keys[0].device.type == "cpu":
        packed = [pack_prefix(k, v) for k, v in zip(keys, values, strict=True)]
        token = _PREFIX.set(_Prefix(keys, values, [k.float() for k in keys], [v.float() for v in values], packed, {}))
    else:
        token = _PREFIX.set(_Prefix(keys, values, keys, values, [None] * len(keys), {}))
    try:
        yield
    finally:
        _PREFIX.reset(token)


def use_prefix_attention(model: PreTrainedModel) -> bool:
    """Route `model`'s attention through `prefix_attention` (SDPA whenever no prefix is active,
    reading grouped kv heads in place on CPU). Returns False, leaving the model as it was, when
    it does not use SDPA-style attention."""
    global _sdpa
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation == PREFIX_ATTENTION and _sdpa is not None:
        return True
    if implementation not in ("sdpa", PREFIX_ATTENTION):
        return False
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _sdpa = sdpa_attention_forward
    ALL_ATTENTION_FUNCTIONS.register(PREFIX_ATTENTION, prefix_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PREFIX_ATTENTION, sdpa_mask)
    model.config._attn_implementation = PREFIX_ATTENTION
    return True


_sdpa: Any = None


def prefix_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any) -> tuple[Tensor, None]:
    """Attention of (B, H, q, D) queries over [shared prefix | each row's own keys]; returns
    (B, q, H, D) like transformers' attention functions.

    On CPU the prefix is read from its single copy: every row's queries go through one batch-1
    attention against it (no mask: every query sees the whole prefix), the rows' own keys
    through a second, and the two merge by their log-sum-exps, exactly. The prefix part reads
    the bf16 prefix where the C kernels run, else its fp32 copy for the flash kernel, made once
    per `shared_prefix` block; the own part runs in the
    cache's dtype, which saves casting every row's cached keys and values at every decode step
    (a 100-row decode step's own-key attention: 2.4 ms a layer in bf16, 3.8 ms with the casts).
    A decode step's few queries in bf16 take all of this in one call, the prefix packed once
    per block (`step_attention`).
    Elsewhere each row gets a copy of the prefix for SDPA.
    With no prefix active (the training pass) it is SDPA, through `grouped_attention` on CPU
    (in bf16, the C kernels' forward and the flash kernel's backward).
    """
    prefix = _PREFIX.get()
    if prefix is None:
        if query.device.type == "cpu" and query.shape[1] != key.shape[1] and attention_mask is not None:
            return grouped_attention(query, key, value, attention_mask, kwargs.get("scaling"), kwargs.get("dropout", 0.0)), None
        return _sdpa(module, query, key, value, attention_mask, **kwargs)
    layer = module.layer_idx
    if _FLASH_CPU is None or query.device.type != "cpu":
        prefix_k, prefix_v = prefix.keys[layer], prefix.values[layer]
        batch = query.shape[0]
        full_k = torch.cat([prefix_k.expand(batch, -1, -1, -1), key], 2)
        full_v = torch.cat([prefix_v.expand(batch, -1, -1, -1), value], 2)
        return _sdpa(module, query, full_k, full_v, attention_mask, **kwargs)
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    visible = _own_mask(attention_mask, query.shape[0], query.shape[2], key.shape[2], prefix.keys[layer].shape[2], query.device)
    if prefix.packed[layer] is not None:
        out = step_attention(query, prefix.packed[layer], key, value, visible, scale)  # a decode step, in one call
        if out is not None:
            return out, None
    low = kernel_available() and prefix.keys[layer].dtype == torch.bfloat16 and prefix.keys[layer].shape[-1] == HEAD_DIM  # the kernel reads the bf16 prefix
    prefix_k, prefix_v = (prefix.keys[layer], prefix.values[layer]) if low else (prefix.wide_keys[layer], prefix.wide_values[layer])
    out = split_attention(query, key, value, prefix_k, prefix_v, visible, scale)
    return out.to(query.dtype), None


_PAIRS: ContextVar[bool] = ContextVar("cgym_attention_on_pairs", default=False)


@contextmanager
def attention_on_pairs(on: bool = True) -> Iterator[None]:
    """Within the block, attention of fp32 queries on the CPU takes its products on bf16 pairs in
    the C kernels where they run, as it does under bf16 autocast: an fp32 training pass on a CPU
    without native bf16 (`precision.autocast`), whose attention the flash kernel otherwise ran in
    fp32 over every masked-out block. The rest of the pass stays fp32."""
    token = _PAIRS.set(on)
    try:
        yield
    finally:
        _PAIRS.reset(token)


def attention_pairs_on() -> bool:
    """Whether `attention_on_pairs` is in force here (what a recomputed layer must run under too)."""
    return _PAIRS.get()


def grouped_attention(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor, scale: float | None, dropout: float = 0.0) -> Tensor:
    """SDPA of (B, H, q, D) queries over (B, H_kv, S, D) keys with a mask, each kv head read by
    its H / H_kv query heads in place; (B, q, H, D) out.

    transformers repeats the kv heads (`repeat_kv`: a copy of every key and value per query
    head, then its backward) whenever a mask is given on CPU. With `enable_gqa` the CPU flash
    kernel reads each kv head for its group: in the GRPO training pass's shapes (4 rows, 570
    queries over 1,310 keys, bf16) attention forward plus backward took 10-17% less time in
    two microbenchmarks. In bf16 (a bf16 sampler's, or under bf16 autocast: the training pass)
    it goes to `kernel_attention` where the C kernels run, and so does fp32 under
    `attention_on_pairs`.
    """
    low = query.dtype == torch.bfloat16 or (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16) or _PAIRS.get()
    if low and dropout == 0.0 and attention_mask.dim() == 4 and attention_mask.shape[1] == 1:
        visible = attention_mask[:, 0] if attention_mask.dtype == torch.bool else attention_mask[:, 0] == 0
        scale = scale if scale is not None else query.shape[-1] ** -0.5
        out = kernel_attention(*(t.to(torch.bfloat16) for t in (query, key, value)), visible, scale)
        if out is not None:  # in the queries' dtype, as SDPA returns it (a bf16 sampler's next layer takes bf16)
            return out.to(query.dtype).transpose(1, 2).contiguous()
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def kernel_attention(query: Tensor, key: Tensor, value: Tensor, visible: Tensor, scale: float) -> Tensor | None:
    """Grouped-query attention of (B, H, q, D) bf16 queries over (B, H_kv, S, D) bf16 keys and
    values where `visible` ((B, q, S) bool) allows, in `decode_attention`'s C kernels; (B, H, q,
    D) fp32 out, and with gradients where the inputs want them: the CPU flash kernel's backward,
    in fp32, from the kernels' outputs and log-sum-exps. None where no kernel runs here.

    Under bf16 autocast the training pass gave SDPA fp32 queries and keys (rotated by fp32
    cosines) and ran it in fp32; here they are rounded to bf16 first, as the sampler's cache
    holds them. At the GRPO update's shapes (3 rows x 288 queries over 623 keys) the forward took
    5.7 ms against the flash kernel's 9.2, the backward 23.8 against 22.8, and a whole update
    2-4 s less (`benchmarks/RESULTS.md`).
    """
    batch, heads, q_len, dim = query.shape
    by_kv = query.detach().reshape(batch, key.shape[1], heads // key.shape[1] * q_len, dim)
    kernel = own_attention if by_kv.shape[2] <= FEW_QUERIES else block_attention
    wanted = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if wanted and _FLASH_CPU_BACKWARD is None:
        return None
    got = kernel(by_kv, key.detach(), value.detach(), visible, scale)
    if got is None:
        return None
    out, lse = got[0].view(batch, heads, q_len, dim), got[1].view(batch, heads, q_len)
    return _FlashBackward.apply(query, key, value, visible, out, lse, scale) if wanted else out


class _FlashBackward(torch.autograd.Function):
    """The attention output computed elsewhere, with the CPU flash kernel's backward."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor, visible: Tensor, out: Tensor, lse: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(query, key, value, visible, out, lse)
        ctx.scale = scale
        return out.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, visible, out, lse = ctx.saved_tensors
        batch, heads, q_len, dim = query.shape
        by_kv = (batch, key.shape[1], heads // key.shape[1] * q_len, dim)
        got = attention_backward(query.reshape(by_kv), key, value, grad.reshape(by_kv), out.reshape(by_kv), lse.reshape(by_kv[:3]), visible, ctx.scale)
        if got is not None:  # bf16 products in C (`attention_backward`)
            dq, dk, dv = got
            return dq.view(query.shape).to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None, None
        bias = torch.zeros((visible.shape[0], 1, *visible.shape[1:]), dtype=torch.float32).masked_fill_(~visible[:, None], float("-inf"))
        lse = lse.masked_fill(torch.isinf(lse), 0.0)  # a query that sees no key: every weight exp(-inf - 0) = 0
        dq, dk, dv = _FLASH_CPU_BACKWARD(grad.float().contiguous(), query.float(), key.float(), value.float(), out, lse, 0.0, False, attn_mask=bias, scale=ctx.scale)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None, None


def split_attention(query: Tensor, key: Tensor, value: Tensor, prefix_k: Tensor, prefix_v: Tensor, visible: Tensor, scale: float) -> Tensor:
    """Softmax attention of (B, H, q, D) queries over a (1, H_kv, P, D) prefix that every query
    sees and (B, H_kv, S, D) own keys where `visible` ((B, q, S) bool) allows; (B, q, H, D) out
    in fp32. The prefix part runs in the prefix's dtype, the own part in the keys' dtype (each
    kernel accumulates in fp32), and the merge in fp32. In bf16 both parts go to the C kernels
    of `decode_attention` where they run: a decode step's few queries to `own_attention`, more
    (a prefill, drafts, every row's queries over the prefix) to `block_attention`.

    Query head h reads kv head h // (H / H_kv) (grouped-query attention), so each kv head's
    queries are laid out along the query axis instead of copying keys and values per head.
    The two partial attentions merge as one interpolation: the own part's share of a query's
    softmax mass is sigmoid(lse_own - lse_prefix). A query that sees no own key (a pad) reads
    the last one, so its output stays finite, and gets a share of 0.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    by_kv = query.reshape(batch, kv_heads, groups * q_len, dim)  # (B, H_kv, g*q, D)
    folded = by_kv.transpose(0, 1).reshape(1, kv_heads, batch * groups * q_len, dim)  # (1, H_kv, B*g*q, D)
    kernel = block_attention(folded.to(prefix_k.dtype), prefix_k, prefix_v, None, scale) if prefix_k.dtype == torch.bfloat16 else None
    out_p, lse_p = kernel if kernel is not None else _FLASH_CPU(folded.to(prefix_k.dtype), prefix_k, prefix_v, scale=scale)
    out_p = out_p.float().reshape(kv_heads, batch, groups, q_len, dim).transpose(0, 1)  # (B, H_kv, g, q, D)
    lse_p = lse_p.reshape(kv_heads, batch, groups, q_len).transpose(0, 1)
    blind = ~visible.any(-1)  # (B, q)
    kernel = own_attention if groups * q_len <= FEW_QUERIES else block_attention  # a decode step's few queries, or more
    own = kernel(by_kv.to(key.dtype), key, value, visible, scale)
    if own is not None:
        out_o, lse_o = own
    else:
        bias = key.new_zeros((batch, 1, groups, q_len, visible.shape[-1])).masked_fill_(~visible[:, None, None], float("-inf"))
        bias[..., -1].masked_fill_(blind[:, None, None], 0.0)
        out_o, lse_o = _FLASH_CPU(by_kv.to(key.dtype), key, value, attn_mask=bias.view(batch, 1, groups * q_len, -1), scale=scale)
    share = torch.sigmoid(lse_o.reshape(batch, kv_heads, groups, q_len) - lse_p).masked_fill_(blind[:, None, None], 0.0)
    out = out_p.new_empty((batch, q_len, kv_heads, groups, dim))  # written in the layout returned
    torch.lerp(out_p, out_o.float().reshape(batch, kv_heads, groups, q_len, dim), share[..., None], out=out.permute(0, 2, 3, 1, 4))
    return out.view(batch, q_len, heads, dim)


def _growing_buffers(cache: Any) -> tuple[list[Tensor], int] | None:
    """Every layer's key and value buffers (k, v, k, v, ...) and their one length, where every
    layer of `cache` is a `GrowingLayer` holding buffers of one length; else None."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(isinstance(layer, GrowingLayer) and layer._k is not None and layer._v is not None for layer in layers):
        return None
    lengths = {layer.length for layer in layers}
    return ([b for layer in layers for b in (layer._k, layer._v)], lengths.pop()) if len(lengths) == 1 else None


def keep_rows(cache: Any, indices: Tensor) -> None:
    """`cache.batch_select_indices(indices)` (ascending rows): where every layer is a
    `GrowingLayer` of like buffers, the kept rows move down in place, every layer's in one C call
    (`cache_rows.compact_rows`), and the buffers keep their room; the rows after them stay
    allocated until a buffer grows."""
    found = _growing_buffers(cache)
    if found is not None and compact_rows(found[0], indices, found[1]):
        for layer in cache.layers:
            layer.kept_first(len(indices))
        return
    cache.batch_select_indices(indices)


def row_columns(cache: Any, row: int, columns: Tensor) -> tuple[list[Tensor], list[Tensor]] | None:
    """Row `row`'s keys and values at cache columns `columns` (below its length), every layer's
    copied into one block in one C call (`cache_rows.gather_columns`): each layer's (H, m, D),
    as `layer.keys[row][:, columns]` gives them. None where the layers are not all
    `GrowingLayer`s of like buffers and one length."""
    found = _growing_buffers(cache)
    if found is None or (columns.numel() and int(columns.max()) >= found[1]):
        return None
    block = gather_columns(found[0], row, columns)
    return None if block is None else (block[0::2], block[1::2])


def _own_mask(attention_mask: Tensor | None, batch: int, q_len: int, own: int, plen: int, device: torch.device) -> Tensor:
    """(B, q, S) which of a row's own keys each query sees: the given 4D mask's columns after the
    prefix, or plain causality where transformers left the mask out (no padding)."""
    if attention_mask is not None:
        mask = attention_mask[:, 0, :, plen : plen + own]
        return mask if mask.dtype == torch.bool else mask == 0
    rows = torch.arange(q_len, device=device)[:, None] + (own - q_len)
    return (torch.arange(own, device=device)[None] <= rows)[None].expand(batch, -1, -1)
