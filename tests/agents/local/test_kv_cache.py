"""GrowingLayer behaves like transformers' DynamicLayer, without copying the cache per step;
split attention over a shared prefix equals attention over each row's copy of it."""

from __future__ import annotations

import pytest
import torch
from cgym.agents.local.kv_cache import _FLASH_CPU, SPARE, FirstBuffers, GrowingLayer, split_attention
from transformers.cache_utils import DynamicLayer


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


def test_a_caches_layers_take_their_first_buffers_from_one_block() -> None:
    """Every layer's first keys and values are views of one allocation, each its own part of it
    (and the same values as layers with their own buffers); a layer whose keys differ in shape
    allocates its own; a layer that outgrows its part moves to a buffer of its own."""
    torch.manual_seed(0)
    first = FirstBuffers(3)
    shared = [GrowingLayer(0, 12, first, i) for i in range(3)]
    alone = [GrowingLayer(0, 12) for _ in range(3)]
    ks = [(torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)) for _ in range(3)]
    for a, b, (k, v) in zip(shared, alone, ks, strict=True):
        for got, want in zip(a.update(k, v), b.update(k, v), strict=True):
            assert torch.equal(got, want)
    assert first.block is not None and first.block.shape == (3, 2, 2, 2, 5 + SPARE, 4)  # the room a first update leaves
    storages = {layer._k.untyped_storage().data_ptr() for layer in shared} | {layer._v.untyped_storage().data_ptr() for layer in shared}
    assert storages == {first.block.untyped_storage().data_ptr()}
    assert len({layer._k.data_ptr() for layer in shared} | {layer._v.data_ptr() for layer in shared}) == 6  # each its own part
    assert all(torch.equal(layer.keys, k) and torch.equal(layer.values, v) for layer, (k, v) in zip(shared, ks, strict=True))
    block = FirstBuffers(2)
    top, odd = GrowingLayer(0, 12, block, 0), GrowingLayer(0, 12, block, 1)
    top.update(torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4))
    odd.update(torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4))  # three heads, not two: its own buffer
    assert block.block is not None and odd._k.untyped_storage().data_ptr() != block.block.untyped_storage().data_ptr() and odd.keys.shape == (2, 3, 5, 4)
    shared[0].update(torch.randn(2, 2, SPARE + 1, 4), torch.randn(2, 2, SPARE + 1, 4))  # past its room: a buffer of its own
    assert shared[0]._k.untyped_storage().data_ptr() != first.block.untyped_storage().data_ptr()
    assert torch.equal(shared[0].keys[:, :, :5], ks[0][0]) and torch.equal(shared[1].keys, ks[1][0])


def test_a_decode_step_writes_in_place() -> None:
    layer = GrowingLayer()
    layer.update(torch.randn(2, 2, 10, 4), torch.randn(2, 2, 10, 4))
    buffer = layer.keys.untyped_storage().data_ptr()
    for _ in range(5):
        layer.update(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    assert layer.keys.untyped_storage().data_ptr() == buffer and layer.get_seq_length() == 15
    kept = layer.keys[1:].clone()
    layer.batch_select_indices(torch.tensor([1]))  # a row leaves: the other keeps its room
    buffer = layer.keys.untyped_storage().data_ptr()
    layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    assert layer.keys.untyped_storage().data_ptr() == buffer
    torch.testing.assert_close(layer.keys[:, :, :15], kept)


def reference_attention(query, key, value, prefix_k, prefix_v, visible, scale):
    """Each row's own copy of the prefix, kv heads repeated per query head, one masked softmax."""
    batch, heads, q_len, _ = query.shape
    groups = heads // key.shape[1]
    keys = torch.cat([prefix_k.expand(batch, -1, -1, -1), key], 2).repeat_interleave(groups, 1)
    values = torch.cat([prefix_v.expand(batch, -1, -1, -1), value], 2).repeat_interleave(groups, 1)
    seen = torch.cat([torch.ones(batch, q_len, prefix_k.shape[2], dtype=torch.bool), visible], 2)
    scores = (query @ keys.transpose(-1, -2) * scale).masked_fill(~seen[:, None], float("-inf"))
    return (scores.softmax(-1) @ values).transpose(1, 2)  # (B, q, H, D)


@pytest.mark.skipif(_FLASH_CPU is None, reason="this PyTorch has no CPU flash-attention kernel")
@pytest.mark.parametrize("q_len", [1, 5], ids=["decode", "prefill"])
def test_split_attention_matches_a_copied_prefix(q_len: int) -> None:
    torch.manual_seed(0)
    batch, heads, kv_heads, plen, own, dim = 3, 6, 2, 7, 9, 8
    query = torch.randn(batch, heads, q_len, dim)
    key, value = torch.randn(batch, kv_heads, own, dim), torch.randn(batch, kv_heads, own, dim)
    prefix_k, prefix_v = torch.randn(1, kv_heads, plen, dim), torch.randn(1, kv_heads, plen, dim)
    causal = torch.arange(own)[None] <= torch.arange(q_len)[:, None] + (own - q_len)  # (q, S)
    visible = causal[None].repeat(batch, 1, 1)
    visible[1, :, :4] = False  # row 1 is left-padded by 4
    if q_len > 1:
        visible[2, 0] = False  # a pad query: sees only the prefix
    got = split_attention(query, key, value, prefix_k, prefix_v, visible, dim**-0.5)
    want = reference_attention(query, key, value, prefix_k, prefix_v, visible, dim**-0.5)
    assert got.shape == (batch, q_len, heads, dim)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the sampler's case: queries and own keys in bf16 (the cache's dtype), the prefix's fp32 copy
    low = [t.bfloat16() for t in (query, key, value)]
    got = split_attention(*low, prefix_k, prefix_v, visible, dim**-0.5)
    want = reference_attention(*(t.float() for t in low), prefix_k, prefix_v, visible, dim**-0.5)
    assert got.dtype == torch.float32 and not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)  # bf16 rounding of the own part: ~3e-3 here


def test_grouped_attention_matches_repeated_kv_heads_with_gradients() -> None:
    """The training pass's attention (no shared prefix, a padding mask) reads each kv head for its
    query heads in place; values and gradients equal SDPA over repeated kv heads."""
    from cgym.agents.local.kv_cache import grouped_attention

    torch.manual_seed(0)
    batch, heads, kv_heads, q_len, keys, dim = 2, 6, 2, 5, 9, 8
    causal = torch.arange(keys)[None] <= torch.arange(q_len)[:, None] + (keys - q_len)
    mask = causal[None, None].repeat(batch, 1, 1, 1)
    mask[1, ..., :3] = False  # row 1 is left-padded by 3
    inputs = [torch.randn(batch, heads, q_len, dim), torch.randn(batch, kv_heads, keys, dim), torch.randn(batch, kv_heads, keys, dim)]
    ours = [t.clone().requires_grad_() for t in inputs]
    theirs = [t.clone().requires_grad_() for t in inputs]
    got = grouped_attention(*ours, mask, dim**-0.5)
    q, k, v = theirs
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask).transpose(1, 2)
    assert got.shape == (batch, q_len, heads, dim)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    weights = torch.randn_like(want)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
