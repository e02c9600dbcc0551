"""Batched sampling with a KV cache, and training-style token log-probs, for any causal LM.

`sample_batch` decodes a whole batch of prompts at once: left padding, an attention mask and
position ids counted from each row's first real token, so a row's log-probs do not depend on
what it was batched with (up to float rounding). Rows that stop are dropped from the batch (and
from the cache), and the loop ends when every row is done. `sequence_logprobs` is the matching
forward pass over stored ids that a trainer uses to recompute (and differentiate) those log-probs.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from cgym.agents.local.joins import Follow, Joins, Request
from cgym.agents.local.kv_cache import (
    GrowingLayer,
    PrefixCache,
    dynamic_cache,
    extending_cache,
    first_pass_cache,
    growing_cache,
    keep_rows,
    read_only_cache,
    row_columns,
    shared_prefix,
    use_prefix_attention,
    weights_version,
)
from cgym.agents.local.lookup import LOOKUP_TOKENS, PromptLookup, draft_length, lookup_rows
from cgym.agents.local.pick import pick_rows
from cgym.agents.local.step_attention import drafting
from cgym.agents.local.target_logprobs import row_log_sum_exps, target_logprobs
from cgym.agents.local.turn_cache import Reuse, TurnCache
from cgym.agents.options import SamplingOptions
from torch import Tensor
from transformers import PreTrainedModel


@dataclass(frozen=True)
class Sample:
    """One row's sampled ids and their log-probs; `stopped` means the last id is a stop id."""

    ids: list[int]
    logprobs: list[float]
    stopped: bool


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """(B, T) 0/1 mask -> (B, T) positions counting real tokens from 0 (pads get 0 or the last)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def sequence_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    temperature: float = 1.0,
    *,
    mask: Tensor | None = None,
    share_prefix: bool = True,
    head: SharedHead | None = None,
) -> Tensor:
    """(B, T) ids -> (B, T-1) log-probs of `input_ids[:, 1:]` under `log_softmax(logits / T)`.

    Works with left or right padding (positions come from the mask); values at padded targets
    are meaningless and must be masked by the caller. Differentiable. The (T, V) log-softmax is
    never materialised: each row takes `logit[target] - logsumexp(logits)` and moves on.
    A temperature <= 0 (greedy sampling) means 1, as in `sample_batch`.

    `mask` ((B, T-1), nonzero where a log-prob is wanted) limits the LM head to the target
    columns some row needs; the other columns come back as 0. With `share_prefix`, leading
    columns that every row shares (same ids, no padding: a system prompt, a group's prompt) go
    through the model once and reach the other rows through the KV cache; the result is the same
    up to float rounding, and so are the gradients. A `head` (from `shared_head`) is a prefix
    already run for the whole batch: the rows attend to it and only their columns after it run;
    with `share_prefix`, the columns after it that every row shares (a GRPO group's task prompt,
    and the turns its rows took alike) run once too.
    """
    scale = temperature if temperature > 0 else 1.0
    use_prefix_attention(model)  # grouped kv heads in place (CPU), as when sampling
    columns = None if mask is None else mask.bool().any(0)  # (T-1,) columns to compute
    cache = head.cache_for(model, input_ids, attention_mask, columns) if head is not None else None
    shared = shared_prefix_len(input_ids, attention_mask) if share_prefix else 0
    if shared - (head.length if head is not None else 0) >= MIN_SHARED_PREFIX and _forward_kwargs(model)[1]:
        return _prefix_shared_logprobs(model, input_ids, attention_mask, shared, columns, scale, head=head)
    if head is not None:
        tail, values = _tail_logprobs(model, input_ids, attention_mask, cache, head.length, columns, scale)
        return _scatter_columns(values, tail, input_ids.shape[1] - 1)
    positions = position_ids_from_mask(attention_mask)
    kept = _kept_columns(columns, 0, input_ids.shape[1] - 1, model)
    kwargs = {} if kept is None else {"logits_to_keep": kept}
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        use_cache=False,
        **kwargs,
    ).logits  # (B, T, V), or (B, K, V) for the kept columns
    if kept is None:
        return target_logprobs(logits[:, :-1], input_ids[:, 1:], scale)
    return _scatter_columns(target_logprobs(logits, input_ids[:, 1:][:, kept], scale), kept, input_ids.shape[1] - 1)


MIN_SHARED_PREFIX = 16  # shorter shared prefixes are not worth a second forward call
# A prefill runs its new ids in pieces of this many columns: the attention's masks grow as
# rows x queries x keys, and one 26-row prefill of whole 5,000-token ApiReport hard
# conversations (a turn the turn cache could not hold) would build masks of several GB per layer.
PREFILL_PIECE = 512


def shared_prefix_len(input_ids: Tensor, attention_mask: Tensor) -> int:
    """Number of leading columns where every row has the same id and no padding (0 for B = 1,
    and never all T columns, so at least one column is left for the rows themselves)."""
    if input_ids.shape[0] < 2:
        return 0
    same = (input_ids == input_ids[:1]).all(0) & attention_mask.bool().all(0)  # (T,)
    return min(int(same.long().cumprod(0).sum()), input_ids.shape[1] - 1)


def _prefix_shared_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    shared: int,
    columns: Tensor | None,
    scale: float,
    head: SharedHead | None = None,
) -> Tensor:
    """`sequence_logprobs` with the columns every row shares, [start, shared), run once (batch 1)
    and broadcast through the KV cache; `start` is 0, or the end of a `head` already run for the
    batch, which that pass reads. Hidden state h predicts target h, so targets [start, shared)
    come from the shared pass (each row gathers its own: the last one's is the first id where the
    rows differ) and the rest from the batched pass."""
    batch, width = input_ids.shape
    start = head.length if head is not None else 0
    # the shared pass and the tail's may each run twice (recomputed layers): caches that do not grow
    first = extending_cache(model, head.keys, head.values) if head is not None else first_pass_cache(model)
    cache = first if first is not None else dynamic_cache(model)
    kept = _kept_columns(columns, start, shared, model)
    kept = kept if kept is not None else torch.arange(start, shared, device=input_ids.device)
    out = model(
        input_ids=input_ids[:1, start:shared],  # unpadded: positions follow the cache's length
        use_cache=True,
        logits_to_keep=kept - start,
        **{_forward_kwargs(model)[0]: cache},
    )
    shared_lp = target_logprobs(out.logits.expand(batch, -1, -1), input_ids[:, 1:][:, kept], scale)  # (B, K0)
    if head is not None:
        keys = [torch.cat([k, layer.new_keys], 2) for k, layer in zip(head.keys, cache.layers, strict=True)]
        values = [torch.cat([v, layer.new_values], 2) for v, layer in zip(head.values, cache.layers, strict=True)]
        cache = read_only_cache(model, [k.expand(batch, -1, -1, -1) for k in keys], [v.expand(batch, -1, -1, -1) for v in values])
    elif first is not None:
        cache = read_only_cache(model, *([x.expand(batch, -1, -1, -1) for x in kv] for kv in _layer_kv(first)))
    else:
        cache.batch_repeat_interleave(batch)
    tail, tail_lp = _tail_logprobs(model, input_ids, attention_mask, cache, shared, columns, scale)
    return _scatter_columns(torch.cat([shared_lp, tail_lp], 1), torch.cat([kept, tail]), width - 1)


def _tail_logprobs(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, cache: Any, start: int, columns: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """The wanted target columns in [start, T-1) and their (B, K) log-probs, from one pass over
    ids [start, T) that attends to the `start` columns already in `cache`."""
    width = input_ids.shape[1]
    tail = _kept_columns(columns, start, width - 1, model)
    tail = tail if tail is not None else torch.arange(start, width - 1, device=input_ids.device)
    out = model(
        input_ids=input_ids[:, start:],
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask)[:, start:],
        use_cache=True,
        logits_to_keep=tail - start,
        **{_forward_kwargs(model)[0]: cache},
    )
    return tail, target_logprobs(out.logits, input_ids[:, 1:][:, tail], scale)


@dataclass
class SharedHead:
    """Keys/values of the leading ids that every row of a training batch shares (the system
    prompt and tool schemas), run once, batch 1, for all of its micro-batches.

    Micro-batches read detached copies (`keys`, `values`) whose gradients add up across them;
    `backward()` then sends the sum through the head's pass once. The gradients are those of
    running the head in every micro-batch, for one head pass per optimizer step.
    """

    ids: Tensor  # (P,)
    keys: list[Tensor]  # per layer (1, H_kv, P, D): what the micro-batches read
    values: list[Tensor]
    outputs: list[Tensor]  # the head pass's keys then values, in its autograd graph

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])

    def cache_for(self, model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, columns: Tensor | None) -> Any:
        """A read-only cache holding the head once per row of (B, T) `input_ids`, which must start with it."""
        length, batch = self.length, input_ids.shape[0]
        if input_ids.shape[1] <= length or not bool((input_ids[:, :length] == self.ids).all() and attention_mask[:, :length].all()):
            raise ValueError("every row must start with the shared head's ids, unpadded, and go on after them")
        if columns is None or bool(columns[:length].any()):
            raise ValueError("targets inside a shared head cannot be scored: pass a mask that wants none of them")
        return read_only_cache(model, [k.expand(batch, -1, -1, -1) for k in self.keys], [v.expand(batch, -1, -1, -1) for v in self.values])

    def backward(self) -> None:
        """Backpropagate the gradients the micro-batches left on the head's keys/values."""
        pairs = [(out, leaf.grad) for out, leaf in zip(self.outputs, self.keys + self.values, strict=True) if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])


def shared_head(model: PreTrainedModel, ids: Tensor) -> SharedHead | None:
    """Run the (P,) `ids` through `model` once (with autograd where enabled) as a `SharedHead`;
    None for a model whose LM head cannot be skipped or whose cache is not plain per layer."""
    cache = first_pass_cache(model)
    if not _forward_kwargs(model)[1] or cache is None:
        return None
    model(input_ids=ids[None], use_cache=True, logits_to_keep=1, **{_forward_kwargs(model)[0]: cache})
    keys, values = _layer_kv(cache)
    outputs = keys + values
    leaves = [out.detach().requires_grad_(out.requires_grad) for out in outputs]
    n = len(cache.layers)
    return SharedHead(ids, leaves[:n], leaves[n:], outputs)


def _layer_kv(cache: Any) -> tuple[list[Tensor], list[Tensor]]:
    """A cache's keys and values, one tensor per layer each."""
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def _kept_columns(columns: Tensor | None, start: int, stop: int, model: PreTrainedModel) -> Tensor | None:
    """Indices in [start, stop) of the wanted target columns, or None for "all of them"
    (also when the model cannot skip positions in its LM head)."""
    if columns is None or not _forward_kwargs(model)[1]:
        return None
    return columns[start:stop].nonzero().squeeze(1) + start


def _scatter_columns(values: Tensor, columns: Tensor, width: int) -> Tensor:
    """(B, K) values at `columns` -> (B, width), zeros elsewhere (differentiable)."""
    if values.shape[1] == width:
        return values
    return values.new_zeros(values.shape[0], width).index_copy(1, columns, values)


@torch.inference_mode()
def sample_batch(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    params: SamplingOptions,
    stop_ids: Collection[int],
    pad_id: int,
    generator: torch.Generator | None = None,
    prefix_cache: PrefixCache | None = None,
    share_prefix: bool = True,
    turn_cache: TurnCache | None = None,
    turn_keys: Sequence[Hashable] | None = None,
    draft_tokens: int = LOOKUP_TOKENS,
) -> list[Sample]:
    """Sample one continuation per prompt, stopping each row at a stop id or max_new_tokens.

    Log-probs are those of `log_softmax(logits / temperature)` (temperature 1 when greedy); the
    top-p filter changes which tokens can be drawn but is not reflected in the stored log-probs.
    The leading ids that every prompt shares are run once, with batch 1, and reach every row
    through the KV cache (rows are laid out `[shared | left padding | own ids | sampled]`);
    `prefix_cache` keeps that prefix's keys and values for the next call with the same weights.
    `turn_cache` keeps each row's keys and values under its `turn_keys` entry (a conversation's
    key), so the row's next call prefills only the ids appended since; rows are then laid out
    `[shared | padding | cached ids | padding | new ids | sampled]`.
    Once few rows are left, each step drafts up to `draft_tokens` ids per row by prompt lookup
    (`PromptLookup`) and checks them in one forward (`accept_drafts`): greedy ids are those of
    one-at-a-time decoding up to float rounding, sampled ids follow the same distribution (0
    turns drafting off).
    """
    if not prompts:
        return []
    if turn_keys is not None and len(turn_keys) != len(prompts):
        raise ValueError(f"{len(turn_keys)} turn keys for {len(prompts)} prompts")
    run = _open(model, prompts, turn_keys if turn_cache is not None else None, turn_cache, prefix_cache, share_prefix, draft_tokens)
    with run.context:
        return _decode(model, run.prompts, run.head, run.served, params, stop_ids, pad_id, generator, run.rows, run.lookup)


@torch.inference_mode()
def sample_turns(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    keys: Sequence[Hashable],
    follow: Follow,
    *,
    params: SamplingOptions,
    stop_ids: Collection[int],
    pad_id: int,
    bytes_per_token: int,
    budget: int,
    generator: torch.Generator | None = None,
    prefix_cache: PrefixCache | None = None,
    turn_cache: TurnCache | None = None,
    draft_tokens: int = LOOKUP_TOKENS,
    waiting: Sequence[Request] = (),
) -> list[Request]:
    """Sample a turn for each prompt, and the turns that follow, continuously batched: when a
    row's turn ends, `follow(key, sample)` hears it and may hand back the next prompt of that
    conversation (or of another in its place), which joins the running batch (`agents.local.joins`:
    when, and which). `keys` are the conversations' keys in `follow` and in `turn_cache`.
    `waiting` turns join as those that follow do (e.g. those past the first batch's budget).
    Returns the follow-up turns that could not join (those that do not start with the batch's
    shared head, or all of them where the cache cannot take rows in: a model whose shared head
    is not served apart, or one with sliding-window layers), for another call."""
    if len(keys) != len(prompts):
        raise ValueError(f"{len(keys)} keys for {len(prompts)} prompts")
    if not prompts:
        return []
    run = _open(model, prompts, list(keys), turn_cache, prefix_cache, True, draft_tokens)
    head_ids = tuple(run.prompts[0][: run.start])
    joins = Joins(follow, head_ids, bytes_per_token, budget, params.max_new_tokens)
    for request in waiting:
        joins.wait(request)
    with run.context:
        _decode(model, run.prompts, run.head, run.served, params, stop_ids, pad_id, generator, run.rows, run.lookup, joins, run.keys)
    return joins.waiting + joins.left_over


@dataclass
class _Run:
    """A sampling call's set-up: its prompts (joined turns append theirs), the shared head and
    whether it is served apart, the link to the turn cache, the drafter."""

    prompts: list[Sequence[int]]
    keys: list[Hashable]
    head: tuple[list[Tensor], list[Tensor]] | None
    served: bool
    start: int  # where each row's own ids begin (0 without a head)
    rows: _TurnRows | None
    lookup: PromptLookup | None
    context: AbstractContextManager[object]


def _open(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    keys: list[Hashable] | None,
    turn_cache: TurnCache | None,
    prefix_cache: PrefixCache | None,
    share_prefix: bool,
    draft_tokens: int,
) -> _Run:
    if min(len(p) for p in prompts) == 0:
        raise ValueError("cannot sample from an empty prompt")
    owned = list(prompts)
    shared = common_prefix_len(owned) if share_prefix else 0
    head = _prefix_cache_kv(model, owned[0][:shared], prefix_cache) if shared >= MIN_SHARED_PREFIX else None
    served = head is not None and use_prefix_attention(model)
    start = shared if head is not None else 0
    rows = _TurnRows(turn_cache, keys, owned, start, served) if turn_cache is not None and keys is not None else None
    lookup = PromptLookup(owned, draft_tokens) if draft_tokens > 0 else None
    context = shared_prefix(*head) if served and head else nullcontext()
    return _Run(owned, keys if keys is not None else [], head, served, start, rows, lookup, context)


@dataclass
class _TurnRows:
    """A call's link to the turn cache: which entry each row reads and writes."""

    cache: TurnCache
    keys: Sequence[Hashable]
    prompts: Sequence[Sequence[int]]
    start: int  # where each row's own ids begin (the shared head ends)
    served: bool  # the head is outside the batch cache (offset columns)

    def save(self, model: PreTrainedModel, cache: Any, mask: Tensor, local: Tensor, rows: Tensor, out_ids: Tensor, fed: Tensor) -> None:
        """Store rows' keys/values of their prompt and first `fed` sampled ids; `mask` covers
        the cache's columns, `local` are the rows' indices in the live batch (cache, mask),
        `rows` their original indices. Ids fed past those (drafts after a stop id) are left out."""
        offset = self.start if self.served else 0
        version = weights_version(model)
        for i, row, n in zip(local.tolist(), rows.tolist(), fed.tolist()):
            ids = list(self.prompts[row][self.start :]) + out_ids[row, :n].tolist()
            columns = mask[i, self.start :].nonzero().squeeze(1)[: len(ids)] + (self.start - offset)
            block = row_columns(cache, i, columns)
            if block is None:
                block = [layer.keys[i][:, columns] for layer in cache.layers], [layer.values[i][:, columns] for layer in cache.layers]
            self.cache.put(model, self.keys[row], self.start, ids, *block, version)


@dataclass
class _Batch:
    """The rows decoding together: `active` holds each one's request (its index in the call's
    prompts); the cache, and a mask whose first `width` columns it fills (room after); each
    row's position of its next id."""

    cache: Any
    mask: Tensor
    width: int
    active: Tensor
    next_pos: Tensor

    def keep(self, rows: Tensor) -> None:
        self.active, self.next_pos, self.mask = self.active[rows], self.next_pos[rows], self.mask[rows]
        keep_rows(self.cache, rows)

    def join(self, other: _Batch, room: int) -> None:
        """Take `other`'s rows (the same head, served apart) below these, right-aligned."""
        offset = self.width - self.cache.layers[0].length  # leading columns held outside the cache
        moved = [mine.join(theirs, room) for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True)][0]
        masks = [_shifted(batch.mask[:, : batch.width], offset, shift, room) for batch, shift in zip((self, other), moved)]
        self.mask, self.width = torch.cat(masks), max(self.width, other.width)
        self.active, self.next_pos = torch.cat([self.active, other.active]), torch.cat([self.next_pos, other.next_pos])


def _shifted(mask: Tensor, offset: int, shift: int, room: int) -> Tensor:
    """(b, W) mask with `shift` masked columns put in after its first `offset`, and `room` after."""
    rows = mask.shape[0]
    return torch.cat([mask[:, :offset], mask.new_zeros((rows, shift)), mask[:, offset:], mask.new_ones((rows, room))], 1)


def _decode(
    model: PreTrainedModel,
    prompts: list[Sequence[int]],
    head: tuple[list[Tensor], list[Tensor]] | None,
    served: bool,
    params: SamplingOptions,
    stop_ids: Collection[int],
    pad_id: int,
    generator: torch.Generator | None,
    rows: _TurnRows | None = None,
    lookup: PromptLookup | None = None,
    joins: Joins | None = None,
    keys: list[Hashable] | None = None,
) -> list[Sample]:
    device = model.device
    steps = params.max_new_tokens
    reuse = rows.cache.take(model, rows.keys, prompts, rows.start) if rows is not None else None
    cache, mask, logits, next_pos = _prefill(model, prompts, head, served, steps, pad_id, reuse)
    del reuse  # the taken entries, copied into the cache: free them before the rows save anew
    growing = all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    if rows is not None and not growing:
        rows = None  # e.g. sliding-window layers: not laid out for per-row reuse
    joinable = joins is not None and growing and (served or head is None)  # a copied head would move

    out = _Outputs.empty(len(prompts), steps, pad_id, stop_ids, device)
    batch = _Batch(cache, mask, mask.shape[1] - steps, torch.arange(len(prompts), device=device), next_pos)
    tok, lp = _pick(logits, params, generator)  # (b,), (b,)
    new_ids, new_lp, emit = tok[:, None], lp[:, None], torch.ones_like(tok)
    while True:
        kept, done = out.record(batch.active, new_ids, new_lp, emit)
        tok = new_ids.gather(1, (kept - 1).clamp(min=0)[:, None]).squeeze(1)  # each row's last id, not yet fed
        if bool(done.any()):
            finished = batch.active[done]
            if rows is not None:
                rows.save(model, batch.cache, batch.mask[:, : batch.width], done.nonzero().squeeze(1), finished, out.ids, out.count[finished] - 1)
            if joins is not None and keys is not None:
                for request in finished.tolist():
                    joins.hear(keys[request], out.sample(request))
            keep = (~done).nonzero().squeeze(1)
            if keep.numel() == 0 and not (joinable and joins is not None and joins.waiting):
                break
            batch.keep(keep)
            tok = tok[keep]
        if joinable and joins is not None and keys is not None:
            tok = _join(model, batch, tok, joins.take(len(batch.active), batch.width), prompts, keys, out, rows, head, served, steps, pad_id)
        width = batch.width
        drafts = None
        if lookup is not None and len(batch.active) <= lookup_rows(params.temperature):
            emitted = {row: out.ids[row, : out.count[row]].tolist() for row in batch.active.tolist()}
            drafts = lookup.propose(emitted, draft_length(len(emitted), params.temperature, lookup.tokens), repeat=params.temperature == 0)
        fed = tok[:, None] if drafts is None else torch.cat([tok[:, None], drafts.to(device)], 1)  # (b, n)
        n = fed.shape[1]
        if width + n > batch.mask.shape[1]:
            batch.mask = torch.cat([batch.mask, batch.mask.new_ones((batch.mask.shape[0], max(n, steps)))], 1)
        batch.mask[:, width : width + n] = 1
        positions = batch.next_pos + torch.arange(n, device=device)
        if drafts is None:
            tok, lp = _pick(_next_logits(model, fed, batch.mask[:, : width + n], positions, batch.cache), params, generator)
            new_ids, new_lp, emit = tok[:, None], lp[:, None], torch.ones_like(tok)
        else:
            new_ids, new_lp, emit = _check_drafts(model, fed, batch.mask[:, : width + n], positions, batch.cache, params, generator)
            batch.mask[:, width : width + n] = torch.arange(n, device=device) < emit[:, None]  # rejected drafts: masked out
        batch.next_pos = batch.next_pos + emit[:, None]
        batch.width += n
    return _collect(out.ids.cpu(), out.logprobs.cpu(), out.count.cpu(), out.stopped.cpu())


def _join(
    model: PreTrainedModel,
    batch: _Batch,
    tok: Tensor,
    chosen: list[Request],
    prompts: list[Sequence[int]],
    keys: list[Hashable],
    out: _Outputs,
    rows: _TurnRows | None,
    head: tuple[list[Tensor], list[Tensor]] | None,
    served: bool,
    steps: int,
    pad_id: int,
) -> Tensor:
    """Put `chosen` turns into the batch; returns each row's id to feed next. A joining row's
    prompt runs now but for its last id, which goes in with the batch's next step, as the last
    sampled id of the other rows does: its first id is then drawn with theirs."""
    if not chosen:
        return tok
    first = len(prompts)
    prompts.extend(request.prompt for request in chosen)
    keys.extend(request.key for request in chosen)
    out.grow(len(chosen))
    leading = [request.prompt[:-1] for request in chosen]
    reuse = rows.cache.take(model, [request.key for request in chosen], leading, rows.start) if rows is not None else None
    cache, mask, _, next_pos = _prefill(model, leading, head, served, steps, pad_id, reuse)
    del reuse
    device = tok.device
    joining = _Batch(cache, mask, mask.shape[1] - steps, torch.arange(first, len(prompts), device=device), next_pos)
    last = torch.tensor([request.prompt[-1] for request in chosen], dtype=tok.dtype, device=device)
    if len(batch.active) == 0:
        batch.cache, batch.mask, batch.width, batch.active, batch.next_pos = joining.cache, joining.mask, joining.width, joining.active, joining.next_pos
        return last
    batch.join(joining, steps)
    return torch.cat([tok, last])


@dataclass
class _Outputs:
    """Each row's emitted ids and their log-probs, as rows emit one id or several per step."""

    ids: Tensor  # (B, steps)
    logprobs: Tensor  # (B, steps)
    count: Tensor  # (B,) ids emitted
    stopped: Tensor  # (B,) ended on a stop id
    stop: Tensor  # the stop ids

    @classmethod
    def empty(cls, batch: int, steps: int, pad_id: int, stop_ids: Collection[int], device: torch.device) -> _Outputs:
        return cls(
            torch.full((batch, steps), pad_id, dtype=torch.long, device=device),
            torch.zeros((batch, steps), dtype=torch.float32, device=device),
            torch.zeros(batch, dtype=torch.long, device=device),
            torch.zeros(batch, dtype=torch.bool, device=device),
            torch.tensor(sorted(stop_ids), dtype=torch.long, device=device),
        )

    def grow(self, rows: int) -> None:
        """Room for `rows` more requests (turns that join); columns past a row's count are never read."""
        self.ids = torch.cat([self.ids, self.ids.new_zeros((rows, self.ids.shape[1]))])
        self.logprobs = torch.cat([self.logprobs, self.logprobs.new_zeros((rows, self.logprobs.shape[1]))])
        self.count = torch.cat([self.count, self.count.new_zeros(rows)])
        self.stopped = torch.cat([self.stopped, self.stopped.new_zeros(rows)])

    def sample(self, row: int) -> Sample:
        n = int(self.count[row])
        return Sample(self.ids[row, :n].tolist(), self.logprobs[row, :n].tolist(), bool(self.stopped[row]))

    def record(self, active: Tensor, new_ids: Tensor, new_lp: Tensor, emit: Tensor) -> tuple[Tensor, Tensor]:
        """Write each live row's first `emit` of its (b, n) new ids, up to and including its first
        stop id and within `steps`; returns how many each row kept and which rows are done."""
        n, steps = new_ids.shape[1], self.ids.shape[1]
        place = self.count[active, None] + torch.arange(n, device=new_ids.device)  # (b, n) output columns
        hit = torch.isin(new_ids, self.stop) & (place < steps)
        first_stop = torch.where(hit.any(1), hit.long().argmax(1) + 1, n + 1)  # n + 1: none
        kept = torch.minimum(torch.minimum(emit, first_stop), steps - self.count[active])  # (b,)
        written = torch.arange(n, device=new_ids.device) < kept[:, None]
        rows = active[:, None].expand(-1, n)[written]
        self.ids[rows, place[written]] = new_ids[written]
        self.logprobs[rows, place[written]] = new_lp[written]
        self.count[active] += kept
        stopped = first_stop <= kept
        self.stopped[active[stopped]] = True
        return kept, stopped | (self.count[active] >= steps)


def _check_drafts(
    model: PreTrainedModel, fed: Tensor, mask: Tensor, positions: Tensor, cache: Any, params: SamplingOptions, generator: torch.Generator | None
) -> tuple[Tensor, Tensor, Tensor]:
    """One forward over (b, n) ids, each row's last id then n - 1 drafts; `accept_drafts` picks
    what each row emits."""
    with drafting():  # a few rows' long drafts take the one-call step too
        logits = _next_logits(model, fed, mask, positions, cache, every=True)
    return accept_drafts(logits, fed[:, 1:], params, generator)


def accept_drafts(logits: Tensor, drafts: Tensor, params: SamplingOptions, generator: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor]:
    """Which of (b, n - 1) drafted ids to keep, given the (b, n, V) logits after a row's last
    id and after each draft. Returns (b, n) ids, their log-probs and how many to emit per row:
    the kept drafts, then one id picked after them (the rest of a row's ids are filler).

    Greedy keeps the drafts that match the argmax before them, then the argmax after the last
    one kept: the ids of one-at-a-time decoding. Sampled rows run speculative sampling with a
    draft that puts all its mass on one id (Leviathan et al. 2023; Chen et al. 2023): draft d
    after position j is kept with probability p_j(d); the first one rejected is replaced by a
    draw from p_j without d, renormalised, and when all are kept one more id is drawn from the
    last position. Every emitted id then follows the distribution one-at-a-time sampling draws
    from (`p` with temperature and top-p applied), though from different random numbers.
    """
    rows, n = torch.arange(drafts.shape[0], device=drafts.device), drafts.shape[1] + 1
    # bf16 logits (the sampler's packed model's) without top-p take the C kernels: `pick_rows`
    # for argmaxes and draws, `row_log_sum_exps` for the positions' log-sum-exps
    flat = logits.view(-1, logits.shape[-1]) if logits.dtype == torch.bfloat16 and logits.is_contiguous() else None
    if params.temperature == 0:
        picked = pick_rows(flat, 0.0, None) if flat is not None else None
        if picked is None:
            logp = _distribution(logits, params)[0]
            ids = logp.argmax(-1)  # (b, n)
            picked = ids, logp.gather(-1, ids[..., None]).squeeze(-1)
        ids, logp = picked[0].view(drafts.shape[0], n), picked[1].view(drafts.shape[0], n)
        kept = (drafts == ids[:, :-1]).long().cumprod(1).sum(1)  # (b,)
        return ids, logp, kept + 1
    at = torch.arange(drafts.numel() + len(rows), device=drafts.device).view(len(rows), n)
    sums = row_log_sum_exps(flat, at[:, :-1].reshape(-1), drafts.reshape(-1), params.temperature) if flat is not None and params.top_p == 1.0 else None
    if sums is None:
        logp, allowed = _distribution(logits, params)
        p_draft = (allowed[:, :-1].gather(-1, drafts[..., None]).squeeze(-1) - allowed[:, :-1].logsumexp(-1)).exp()  # (b, n - 1)
    else:
        lse, drafted = sums
        p_draft = drafted.view(len(rows), n - 1).exp()
    kept = (torch.rand(p_draft.shape, generator=generator, device=p_draft.device) < p_draft).long().cumprod(1).sum(1)
    last = allowed[rows, kept] if sums is None else flat[at[rows, kept]]  # (b, V): where each row draws its next id, a copy
    rejected = (kept < n - 1).nonzero().squeeze(1)
    last[rejected, drafts[rejected, kept[rejected]]] = float("-inf")
    drawn = pick_rows(last, params.temperature, generator) if sums is not None else None
    if drawn is None and sums is not None:  # no room for the kernel's scratch
        last = torch.log_softmax(last.float() / params.temperature, -1)
    ids = torch.cat([drafts, drafts[:, :1]], 1).to(torch.int64)
    ids[rows, kept] = drawn[0] if drawn is not None else _gumbel_argmax(last, generator)
    if sums is None:
        return ids, logp.gather(-1, ids[..., None]).squeeze(-1), kept + 1
    return ids, (flat.gather(1, ids.view(-1, 1)).squeeze(1).float() / params.temperature - lse).view(len(rows), n), kept + 1


def common_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    """Leading ids that all prompts share, leaving each prompt at least one id of its own."""
    first, limit = prompts[0], min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


def _prefill(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    head: tuple[list[Tensor], list[Tensor]] | None,
    served: bool,
    steps: int,
    pad_id: int,
    reuse: Sequence[Reuse | None] | None = None,
) -> tuple[Any, Tensor, Tensor, Tensor]:
    """Fill the cache with the prompts after the shared `head`; returns (cache, (B, W + steps)
    mask, (B, V) logits of each row's last prompt position, (B, 1) position of the first sampled
    token). A `served` head stays outside the cache (`prefix_attention` reads its one copy);
    otherwise every row gets a copy of it. A row's `reuse` (its ids up to `end`, from a turn
    cache) goes into the cache as it is, right-aligned, and only the ids after it run now.
    Rows with the same prompt and reuse run once and are copied."""
    device, batch = model.device, len(prompts)
    first, copies = _distinct_rows(prompts, reuse)
    copies = copies.to(device)
    if len(first) < batch:  # a GRPO group's first turn: the same prompt 8 times
        cache, mask, logits, next_pos = _prefill(model, [prompts[i] for i in first], head, served, steps, pad_id, None if reuse is None else [reuse[i] for i in first])
        cache.batch_select_indices(copies)
        return cache, mask[copies], logits[copies], next_pos[copies]
    start = head[0][0].shape[2] if head is not None else 0
    own = [r.end - start if r is not None else 0 for r in reuse or [None] * batch]
    suffix_ids, suffix_mask = _left_pad([p[start + n :] for p, n in zip(prompts, own)], pad_id, steps, device)  # (B, S), (B, S + steps)
    cached_keys, cached_values, cached_mask = _right_aligned(reuse, own, device)  # per layer (B, H, C, D); (B, C)
    cache = growing_cache(model, offset=start if served else 0, capacity=suffix_mask.shape[1])
    copied = head is not None and not served  # every row gets a copy of the head
    blocks_k = [k.expand(batch, -1, -1, -1) for k in head[0]] if copied and head else []
    blocks_v = [v.expand(batch, -1, -1, -1) for v in head[1]] if copied and head else []
    if cached_keys:
        blocks_k = [torch.cat([a, b], 2) for a, b in zip(blocks_k, cached_keys)] if blocks_k else cached_keys
        blocks_v = [torch.cat([a, b], 2) for a, b in zip(blocks_v, cached_values)] if blocks_v else cached_values
    if blocks_k:
        capacity = blocks_k[0].shape[2] + suffix_mask.shape[1]
        for layer, k, v in zip(cache.layers, blocks_k, blocks_v):
            layer.fill(k, v, capacity)
    mask = torch.cat([cached_mask, suffix_mask], 1)
    if head is not None:
        mask = torch.cat([torch.ones((batch, start), dtype=torch.long, device=device), mask], 1)
    width = mask.shape[1] - steps
    positions = position_ids_from_mask(mask[:, :width])
    suffix_positions = positions[:, start + cached_mask.shape[1] :]
    length = suffix_ids.shape[1]
    for lo in range(0, length, PREFILL_PIECE):  # the last piece's logits are the ones returned
        hi = min(lo + PREFILL_PIECE, length)
        logits = _next_logits(model, suffix_ids[:, lo:hi], mask[:, : width - length + hi], suffix_positions[:, lo:hi], cache)
    return cache, mask, logits, positions[:, -1:] + 1


def _distinct_rows(prompts: Sequence[Sequence[int]], reuse: Sequence[Reuse | None] | None) -> tuple[list[int], Tensor]:
    """The first row of each distinct (prompt, reused length), and (B,) which of them each row is."""
    place: dict[tuple[tuple[int, ...], int], int] = {}
    first, copies = [], []
    for row, prompt in enumerate(prompts):
        taken = reuse[row] if reuse is not None else None
        key = (tuple(prompt), taken.end if taken is not None else -1)
        if key not in place:
            place[key] = len(first)
            first.append(row)
        copies.append(place[key])
    return first, torch.tensor(copies, dtype=torch.long)


def _right_aligned(reuse: Sequence[Reuse | None] | None, own: list[int], device: torch.device) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """Rows' reused keys/values as per-layer (B, H, C, D) blocks, each row right-aligned (zeros,
    masked out, on its left), and their (B, C) mask; C = the longest reuse (0: empty lists)."""
    width = max(own, default=0)
    mask = torch.zeros((len(own), width), dtype=torch.long, device=device)
    if not width or reuse is None:
        return [], [], mask
    like = next(r for r in reuse if r is not None)
    keys = [k.new_zeros((len(own), k.shape[0], width, k.shape[2])) for k in like.keys]
    values = [v.new_zeros((len(own), v.shape[0], width, v.shape[2])) for v in like.values]
    for row, (r, n) in enumerate(zip(reuse, own)):
        if r is None or not n:
            continue
        mask[row, width - n :] = 1
        for layer in range(len(keys)):
            keys[layer][row, :, width - n :] = r.keys[layer]
            values[layer][row, :, width - n :] = r.values[layer]
    return keys, values, mask


def _prefix_cache_kv(model: PreTrainedModel, prefix: Sequence[int], prefix_cache: PrefixCache | None) -> tuple[list[Tensor], list[Tensor]]:
    """Per-layer (1, H, len(prefix), D) keys and values of `prefix`, from `prefix_cache` where
    it covers them; the rest is computed now and stored back."""
    store = prefix_cache if prefix_cache is not None else PrefixCache()
    known = store.lookup(model, prefix)
    cache = growing_cache(model)
    if known:
        entry = store.entry
        assert entry is not None
        for layer, k, v in zip(cache.layers, entry.keys, entry.values):
            layer.fill(k[:, :, :known], v[:, :, :known], len(prefix))
    if known < len(prefix):
        ids = torch.tensor([list(prefix[known:])], dtype=torch.long, device=model.device)
        positions = torch.arange(known, len(prefix), device=model.device)[None]
        _next_logits(model, ids, torch.ones((1, len(prefix)), dtype=torch.long, device=model.device), positions, cache)
    if store.entry is None or tuple(prefix) != store.entry.ids or known < len(prefix):
        store.store(model, prefix, cache)  # the newest shared prefix replaces the stored one
    layers = [layer for layer in cache.layers if layer.is_initialized]
    return [layer.keys for layer in layers], [layer.values for layer in layers]


def _left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, steps: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Left-padded (B, L) ids and a (B, L + steps) mask whose generated columns are already 1."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.ones((len(prompts), width + steps), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, : width - len(prompt)] = 0
    return ids.to(device), mask.to(device)


def _pick(
    logits: Tensor, params: SamplingOptions, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """(b, V) logits -> sampled ids (b,) and their log-probs (b,): in one C pass per row where it
    runs (`pick.pick_rows`: bf16 logits, no top-p), else through `_distribution`."""
    if params.temperature == 0 or params.top_p == 1.0:
        picked = pick_rows(logits, params.temperature, generator)
        if picked is not None:
            return picked
    logp, allowed = _distribution(logits, params)
    tok = logp.argmax(-1) if params.temperature == 0 else _gumbel_argmax(allowed, generator)
    return tok, logp.gather(-1, tok[:, None]).squeeze(1)


def _distribution(logits: Tensor, params: SamplingOptions) -> tuple[Tensor, Tensor]:
    """(..., V) logits -> the log-probs stored for sampled ids (`log_softmax(logits /
    temperature)`, temperature 1 when greedy) and the unnormalised log-weights ids are drawn
    from (those log-probs with top-p applied)."""
    logp = torch.log_softmax(logits.float() / (params.temperature or 1.0), dim=-1)
    allowed = logp if params.temperature == 0 or params.top_p == 1.0 else _top_p_mask(logp, params.top_p)
    return logp, allowed


def _gumbel_argmax(logp: Tensor, generator: torch.Generator | None) -> Tensor:
    """One draw per row from (b, V) log-probs as argmax(logp + Gumbel noise): exact, and cheaper
    than `torch.multinomial` on CPU."""
    noise = torch.rand(logp.shape, generator=generator, device=logp.device).log_().neg_().log_()
    return (logp - noise).argmax(-1)


def _top_p_mask(logp: Tensor, top_p: float) -> Tensor:
    """-inf outside the smallest set of top tokens whose mass reaches top_p (the top one stays)."""
    sorted_lp, order = logp.sort(dim=-1, descending=True)
    probs = sorted_lp.exp()
    mass_before = probs.cumsum(-1) - probs
    sorted_lp = sorted_lp.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.empty_like(logp).scatter_(-1, order, sorted_lp)


def _next_logits(
    model: PreTrainedModel, ids: Tensor, mask: Tensor, positions: Tensor, cache: Any, *, every: bool = False
) -> Tensor:
    """One forward step through the cache; returns the last position's logits (b, V), or with
    `every` each position's (b, T, V)."""
    kwargs = {_forward_kwargs(model)[0]: cache}
    if _forward_kwargs(model)[1]:
        kwargs["logits_to_keep"] = 0 if every else last_column(ids)
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs
    )
    return out.logits if every else out.logits[:, -1]


def last_column(ids: Tensor) -> int | Tensor:
    """`logits_to_keep` for the last position of (b, T) ids.

    For T > 1 an index tensor, not the int 1: transformers slices `hidden[:, -1:]`, a view
    strided across rows, and the LM head's matmul on a non-contiguous 3-D input expands the
    (V, D) weight to every row. With SmolLM2 that copied 1.8 GB per prefill of 32 rows and took
    2.3 s in bf16 (14 ms from a contiguous input). Indexing gathers the rows contiguously.
    """
    if ids.shape[1] == 1:
        return 1
    return torch.tensor([ids.shape[1] - 1], device=ids.device)


def _forward_kwargs(model: PreTrainedModel) -> tuple[str, bool]:
    """(name of the cache argument, whether `logits_to_keep` exists) for this model.

    A wrapper that forwards its keyword arguments (peft's `PeftModel` takes `**kwargs` and passes
    them to the model it wraps) is read through: the wrapped model's signature decides.
    """
    get_base_model = getattr(model, "get_base_model", None)
    inner = get_base_model() if callable(get_base_model) else model
    return _signature_kwargs(type(inner))


@cache
def _signature_kwargs(model_cls: type) -> tuple[str, bool]:
    params = inspect.signature(model_cls.forward).parameters
    cache_name = "cache" if "cache" in params else "past_key_values"
    return cache_name, "logits_to_keep" in params


def _collect(out_ids: Tensor, out_lp: Tensor, lengths: Tensor, stopped: Tensor) -> list[Sample]:
    samples = []
    for row in range(out_ids.shape[0]):
        n = int(lengths[row])
        samples.append(
            Sample(out_ids[row, :n].tolist(), out_lp[row, :n].tolist(), bool(stopped[row]))
        )
    return samples
