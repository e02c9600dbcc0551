"""GrowingLayer behaves like transformers' DynamicLayer, without copying the cache per step."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from agents.kv_cache import SPARE, GrowingLayer


def test_growing_layer_matches_dynamic_layer() -> None:
    torch.manual_seed(0)
    grow, plain = GrowingLayer(), DynamicLayer()
    kv = lambda b, t: (torch.randn(b, 2, t, 4), torch.randn(b, 2, t, 4))
    for step, (b, t) in enumerate([(3, 7), (3, 1), (3, 1), (3, SPARE + 5), (3, 1)]):
        k, v = kv(b, t)
        for got, want in zip(grow.update(k, v), plain.update(k, v), strict=True):
            torch.testing.assert_close(got, want)
        if step == 2:
            keep = torch.tensor([0, 2])
            grow.batch_select_indices(keep)
            plain.batch_select_indices(keep)
            grow.batch_repeat_interleave(2)
            plain.batch_repeat_interleave(2)
            grow.batch_select_indices(torch.tensor([0, 1, 3]))
            plain.batch_select_indices(torch.tensor([0, 1, 3]))
    assert grow.get_seq_length() == plain.get_seq_length() == 7 + 2 + SPARE + 5 + 1
    grow.crop(-3)
    plain.crop(-3)
    torch.testing.assert_close(grow.keys, plain.keys)


def test_a_decode_step_writes_in_place() -> None:
    layer = GrowingLayer()
    layer.update(torch.randn(2, 2, 10, 4), torch.randn(2, 2, 10, 4))
    buffer = layer.keys.untyped_storage().data_ptr()
    for _ in range(5):
        layer.update(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    assert layer.keys.untyped_storage().data_ptr() == buffer and layer.get_seq_length() == 15
