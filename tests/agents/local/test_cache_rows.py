"""Cache rows moved in place and a row's columns gathered, every buffer in one C call: the same
bytes as PyTorch's index_select and advanced indexing, and nothing done where it does not apply."""

from __future__ import annotations

import pytest
import torch
from cgym.agents.local import cache_rows, kv_cache
from cgym.agents.local.cache_rows import compact_rows, gather_columns
from transformers import DynamicCache

pytestmark = pytest.mark.skipif(cache_rows._library() is None, reason="no C compiler or no AVX-512 here: PyTorch moves the rows")


def _buffers(n: int = 6, rows: int = 9, heads: int = 3, cap: int = 40, dim: int = 64) -> list[torch.Tensor]:
    torch.manual_seed(n + rows)
    return [torch.randn(rows, heads, cap, dim).to(torch.bfloat16) for _ in range(n)]


@pytest.mark.parametrize("keep", [[0, 2, 3, 7], [1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2], [8], []])
def test_kept_rows_move_down_in_place(keep: list[int]) -> None:
    buffers = _buffers()
    before = [b.clone() for b in buffers]
    rows = torch.tensor(keep, dtype=torch.long)
    assert compact_rows(buffers, rows, 25)
    for now, then in zip(buffers, before, strict=True):
        assert torch.equal(now[: len(keep), :, :25], then[rows, :, :25])  # the used columns of the kept rows
        assert torch.equal(now[len(keep) :], then[len(keep) :])  # the rows after them untouched


@pytest.mark.parametrize("case", ["descending", "repeated", "past_the_rows", "negative", "shapes", "strided", "too_long"])
def test_no_move_where_it_does_not_apply(case: str) -> None:
    buffers, rows, length = _buffers(), torch.tensor([0, 3, 5]), 10
    if case == "descending":
        rows = torch.tensor([5, 3])
    elif case == "repeated":
        rows = torch.tensor([2, 2])
    elif case == "past_the_rows":
        rows = torch.tensor([1, 9])
    elif case == "negative":
        rows = torch.tensor([-1, 2])
    elif case == "shapes":
        buffers[3] = buffers[3][:, :, :30].contiguous()
    elif case == "strided":
        buffers[2] = torch.randn(9, 3, 64, 40).to(torch.bfloat16).transpose(2, 3)
    elif case == "too_long":
        length = 41
    before = [b.clone() for b in buffers]
    assert not compact_rows(buffers, rows, length)
    assert all(torch.equal(now, then) for now, then in zip(buffers, before, strict=True))


@pytest.mark.parametrize("columns", [[0, 1, 2, 3], [3, 5, 6, 9, 39], [7], []])
def test_a_rows_columns_gathered_into_one_block(columns: list[int]) -> None:
    buffers = _buffers()
    cols = torch.tensor(columns, dtype=torch.long)
    got = gather_columns(buffers, 4, cols)
    assert got is not None and len(got) == len(buffers)
    for part, buffer in zip(got, buffers, strict=True):
        assert torch.equal(part, buffer[4][:, cols])
    assert gather_columns(buffers, 9, cols) is None  # no such row
    assert gather_columns(buffers, 4, torch.tensor([40])) is None  # no such column


def test_a_growing_cache_keeps_rows_and_gives_columns_as_pytorch_does() -> None:
    """`keep_rows` and `row_columns` over a cache of `GrowingLayer`s: what `batch_select_indices`
    and indexing the layers' keys and values give."""

    def cache() -> DynamicCache:
        torch.manual_seed(1)
        c = DynamicCache()
        c.layers = [kv_cache.GrowingLayer(0, 20) for _ in range(4)]
        for layer in range(4):
            c.update(torch.randn(6, 3, 11, 64).to(torch.bfloat16), torch.randn(6, 3, 11, 64).to(torch.bfloat16), layer)
        return c

    moved, copied = cache(), cache()
    rows = torch.tensor([1, 2, 4])
    kv_cache.keep_rows(moved, rows)
    copied.batch_select_indices(rows)
    columns = torch.tensor([0, 2, 3, 10])
    block = kv_cache.row_columns(moved, 1, columns)
    assert block is not None
    for layer, (a, b) in enumerate(zip(moved.layers, copied.layers, strict=True)):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(block[0][layer], b.keys[1][:, columns]) and torch.equal(block[1][layer], b.values[1][:, columns])
    assert kv_cache.row_columns(moved, 1, torch.tensor([11])) is None  # past the length
