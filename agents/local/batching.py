"""Which conversations sample together: chunks of similar length whose keys/values fit a budget.

A batch's KV cache is as wide as its longest row, for every row. On ApiReport hard, where a turn
that lists orders adds ~850 tokens and others add ~100, 16 rows at temperature 1.0 held
16 x 4,613 columns by turn 7 (the median row 2,859: over a third of it padding), a turn took
88 s, and 64 such rows outgrew this project's 24 GB machine. Sorting rows by length and cutting the batch where a row is
under half the chunk's longest, or where the chunk's padded cache would pass the byte budget,
bounds both the padding (under half of any chunk) and the memory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from cgym.envs.errors import ConfigError
from transformers import PretrainedConfig

LENGTH_RATIO = 2  # a row shorter than 1 / LENGTH_RATIO of its chunk's longest starts a new chunk


def kv_bytes_per_token(config: PretrainedConfig, itemsize: int) -> int:
    """Bytes one token's keys and values take over all layers, at `itemsize` bytes a number."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * itemsize


def kv_budgets() -> tuple[int, int]:
    """(one chunk's padded cache, the turn cache) in bytes: an eighth and a quarter of the
    machine's physical memory (3 and 6 GB on 24 GB), or `CGYM_KV_BUDGET_GB` GB and twice that."""
    override = os.environ.get("CGYM_KV_BUDGET_GB")
    if not override:
        batch = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
        return batch, 2 * batch
    try:
        gigabytes = float(override)
    except ValueError:
        gigabytes = -1.0
    if not gigabytes > 0:
        raise ConfigError(f"CGYM_KV_BUDGET_GB={override!r}: give a positive number of GB, e.g. 2.5")
    return int(gigabytes * 1e9), int(2 * gigabytes * 1e9)


def length_chunks(lengths: Sequence[int], *, room: int, bytes_per_token: int, budget: int) -> list[list[int]]:
    """Row indices in chunks, longest rows first. A chunk's rows are within `LENGTH_RATIO` of its
    longest, and its padded cache (rows x (longest + `room`) x `bytes_per_token`) stays within
    `budget`; a row that alone passes the budget gets a chunk of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    chunks: list[list[int]] = []
    for row in order:
        if chunks:
            chunk = chunks[-1]
            longest = lengths[chunk[0]]
            fits = (len(chunk) + 1) * (longest + room) * bytes_per_token <= budget
            if fits and lengths[row] * LENGTH_RATIO >= longest:
                chunk.append(row)
                continue
        chunks.append([row])
    return chunks
