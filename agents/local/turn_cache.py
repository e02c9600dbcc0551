"""Each conversation's keys and values kept from one turn to the next.

A multi-turn episode's ledger only grows: the next prompt is the last prompt, the sampled turn
and the env's reply. Without a cache every turn prefills the whole conversation again; with
`TurnCache` a turn prefills only what was appended since the last one (on SqlQuery medium the
tool results make most of a prompt). An entry is used only where it is still exact: the same
weights version and the same leading ids; anything else is a miss and is recomputed.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass

from cgym.agents.local.kv_cache import weights_version
from torch import Tensor
from transformers import PreTrainedModel


@dataclass
class TurnEntry:
    """Keys/values of `ids`, the conversation's ids from position `start` (the batch's shared
    prefix, held elsewhere, ends there); per layer (H, len(ids), D)."""

    start: int
    ids: tuple[int, ...]
    keys: list[Tensor]
    values: list[Tensor]
    version: tuple[int, int]
    size: int  # bytes of keys and values


@dataclass(frozen=True)
class Reuse:
    """What a row reuses: keys/values of its ids [start, end), per layer (H, end - start, D)."""

    end: int
    keys: list[Tensor]
    values: list[Tensor]


class TurnCache:
    """Per-conversation keys/values between sampling calls, keyed by the caller's conversation
    keys. `take` hands a call's entries out; `put` stores a row's keys/values after its turn,
    unless the entries would pass `max_bytes` (that row's next turn is then recomputed);
    `keep_only` forgets the conversations that left, so memory stays one batch's worth."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.entries: dict[Hashable, TurnEntry] = {}
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.reused_tokens = 0
        self.skipped = 0  # entries not stored for want of room

    def take(self, model: PreTrainedModel, keys: Sequence[Hashable], prompts: Sequence[Sequence[int]], start: int) -> list[Reuse | None]:
        """For each prompt, the keys/values of its ids from `start` that its stored entry covers
        (at least one id of the prompt is always left to compute), or None. The entries of
        `keys` leave the cache; `put` stores them anew."""
        version = weights_version(model)
        reuse = [_reuse(self._pop(key), prompt, start, version) for key, prompt in zip(keys, prompts, strict=True)]
        self.hits += sum(r is not None for r in reuse)
        self.reused_tokens += sum(r.end - start for r in reuse if r is not None)
        return reuse

    def put(
        self,
        model: PreTrainedModel,
        key: Hashable,
        start: int,
        ids: Sequence[int],
        keys: list[Tensor],
        values: list[Tensor],
        version: tuple[int, int] | None = None,
    ) -> None:
        """Store a row's keys/values of `ids` from `start`; `version` is `weights_version(model)`
        where the caller has it (it walks every parameter: once for a call's rows)."""
        self._pop(key)
        size = sum(t.numel() * t.element_size() for t in (*keys, *values))
        if self.max_bytes is not None and self.bytes + size > self.max_bytes:
            self.skipped += 1
            return
        self.entries[key] = TurnEntry(start, tuple(ids), keys, values, weights_version(model) if version is None else version, size)
        self.bytes += size

    def forget(self, key: Hashable) -> None:
        """Forget one conversation (it ended)."""
        self._pop(key)

    def keep_only(self, keys: Collection[Hashable]) -> None:
        """Forget every conversation not in `keys`."""
        for key in [k for k in self.entries if k not in keys]:
            self._pop(key)

    def _pop(self, key: Hashable) -> TurnEntry | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry


def _reuse(entry: TurnEntry | None, prompt: Sequence[int], start: int, version: tuple[int, int]) -> Reuse | None:
    if entry is None or entry.version != version or entry.start > start:
        return None
    end = min(entry.start + len(entry.ids), len(prompt) - 1)
    if end <= start or tuple(prompt[entry.start : end]) != entry.ids[: end - entry.start]:
        return None
    cut = slice(start - entry.start, end - entry.start)
    return Reuse(end, [k[:, cut] for k in entry.keys], [v[:, cut] for v in entry.values])
