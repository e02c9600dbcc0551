"""A decode step's attention in one call: fp64 attention over [prefix | own keys] on the same bf16
inputs, rounded once to bf16 (within one bf16 step); the split path's result within that; and
no kernel (None) wherever it does not apply."""

from __future__ import annotations

import pytest
import torch
from cgym.agents.local.decode_attention import KERNEL_ENV, available
from cgym.agents.local.kv_cache import split_attention
from cgym.agents.local.step_attention import DRAFT_QUERIES, drafting, pack_prefix, step_attention

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler or no AVX2 here: the split path runs")


def _inputs(batch: int, steps: int, prefix: int, own: int, *, heads: int = 9, kv_heads: int = 3) -> tuple[torch.Tensor, ...]:
    """Queries as the lean layer hands them over (a strided view of the fused projection's
    output), prefix keys (batch 1), own keys in a cache buffer with spare room, a visibility."""
    torch.manual_seed(prefix * 7 + own)
    fused = torch.randn(batch, steps, heads + 2 * kv_heads, 64).to(torch.bfloat16)
    query = fused[:, :, :heads].transpose(1, 2)
    prefix_k, prefix_v = ((torch.randn(1, kv_heads, prefix, 64) * 2).to(torch.bfloat16) for _ in range(2))
    key, value = ((torch.randn(batch, kv_heads, own + 40, 64) * 2).to(torch.bfloat16)[:, :, :own] for _ in range(2))
    visible = torch.rand(batch, steps, own) > 0.3
    return query, prefix_k, prefix_v, key, value, visible


def _reference(
    query: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """fp64 attention over the concatenated keys, every query seeing the prefix: (B, T, H, D)."""
    batch, heads, steps, _ = query.shape
    group = heads // key.shape[1]
    keys = torch.cat([prefix_k.expand(batch, -1, -1, -1), key], 2).double().repeat_interleave(group, 1)
    values = torch.cat([prefix_v.expand(batch, -1, -1, -1), value], 2).double().repeat_interleave(group, 1)
    seen = torch.cat([torch.ones(batch, steps, prefix_k.shape[2], dtype=torch.bool), visible], 2)[:, None]
    scores = (query.double() @ keys.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
    return (torch.softmax(scores, -1).nan_to_num(0.0) @ values).transpose(1, 2)


def _within_one_bf16_step(got: torch.Tensor, exact: torch.Tensor) -> None:
    """Each output within one bf16 step of the exact value rounded, give or take the fp32 sums'
    own error where terms cancel (an output near 0)."""
    rounded = exact.to(torch.bfloat16).double()
    step = torch.exp2(torch.floor(torch.log2(rounded.abs().clamp(min=1e-30))) - 7)
    assert got.dtype == torch.bfloat16
    assert bool(((got.double() - rounded).abs() <= step * 1.01 + 2e-5).all())
    assert float((got.double() == rounded).double().mean()) > 0.99  # rounded once, not twice


@pytest.mark.parametrize(("batch", "prefix", "own"), [(1, 250, 100), (32, 250, 1), (5, 7, 33), (2, 16, 16), (100, 269, 17), (3, 1, 300)])
def test_one_call_is_fp64_attention_rounded_once(batch: int, prefix: int, own: int) -> None:
    query, prefix_k, prefix_v, key, value, visible = _inputs(batch, 1, prefix, own)
    packed = pack_prefix(prefix_k, prefix_v)
    assert packed is not None and packed.length == prefix
    got = step_attention(query, packed, key, value, visible, 0.125)
    assert got is not None and got.shape == (batch, 1, 9, 64)
    exact = _reference(query, prefix_k, prefix_v, key, value, visible, 0.125)
    _within_one_bf16_step(got, exact)
    split = split_attention(query, key, value, prefix_k, prefix_v, visible, 0.125)  # the path it replaces
    _within_one_bf16_step(got, split.double())


def test_no_prefix_and_a_query_that_sees_nothing() -> None:
    query, prefix_k, prefix_v, key, value, visible = _inputs(3, 1, 0, 17)
    visible[0] = False
    got = step_attention(query, None, key, value, visible, 0.125)
    assert got is not None and bool((got[0] == 0).all())
    _within_one_bf16_step(got[1:], _reference(query, prefix_k, prefix_v, key, value, visible, 0.125)[1:])


@pytest.mark.parametrize(
    ("batch", "steps", "heads", "kv_heads", "own"),
    [(4, 2, 4, 2, 20), (5, 5, 9, 3, 89), (2, 16, 3, 3, 300), (3, 3, 6, 3, 7), (3, 6, 9, 3, 50), (2, 21, 9, 3, 130)],
)
def test_drafted_ids_of_a_row_and_their_own_keys_packed(batch: int, steps: int, heads: int, kv_heads: int, own: int) -> None:
    """More than `FEW_QUERIES` queries a row and kv head (a row's last id and its drafts, times a
    group's heads): the row's own keys are packed as the prefix's are; above sixteen the queries
    go sixteen at a time (18 and 63 here)."""
    query, prefix_k, prefix_v, key, value, visible = _inputs(batch, steps, 40, own, heads=heads, kv_heads=kv_heads)
    visible[0, 0] = False  # a query that sees only the prefix
    with drafting():  # over sixteen only in a step that checks drafts
        got = step_attention(query, pack_prefix(prefix_k, prefix_v), key, value, visible, 0.3)
    assert got is not None
    _within_one_bf16_step(got, _reference(query, prefix_k, prefix_v, key, value, visible, 0.3))


def test_a_strided_visibility_for_few_queries() -> None:
    query, prefix_k, prefix_v, key, value, visible = _inputs(3, 1, 20, 30)
    wide = torch.zeros(3, 1, 60, dtype=torch.bool)
    wide[..., ::2] = visible
    got = step_attention(query, pack_prefix(prefix_k, prefix_v), key, value, wide[..., ::2], 0.125)
    assert got is not None
    _within_one_bf16_step(got, _reference(query, prefix_k, prefix_v, key, value, visible, 0.125))


@pytest.mark.parametrize("case", ["many_queries", "many_drafts", "strided_drafts", "float32", "head_dim", "gradients", "switched_off", "mask_dtype"])
def test_no_kernel_where_it_does_not_apply(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    query, prefix_k, prefix_v, key, value, visible = _inputs(2, 1, 20, 10)
    packed = pack_prefix(prefix_k, prefix_v)
    if case == "many_queries":
        query, _, _, key, value, visible = _inputs(2, 6, 20, 10)  # 3 heads a group x 6 ids: 18 > 16 outside `drafting`
    elif case == "many_drafts":
        query, _, _, key, value, visible = _inputs(2, DRAFT_QUERIES // 3 + 1, 20, 10)
        with drafting():
            assert step_attention(query, packed, key, value, visible, 0.125) is None
    elif case == "strided_drafts":
        query, _, _, key, value, visible = _inputs(2, 2, 20, 10)  # packed own keys read contiguous visibility
        visible = torch.zeros(2, 2, 20, dtype=torch.bool)[..., ::2]
    elif case == "float32":
        query = query.float()
        assert pack_prefix(prefix_k.float(), prefix_v.float()) is None
    elif case == "head_dim":
        query, key, value = query[..., :32], key[..., :32], value[..., :32]
        assert pack_prefix(prefix_k[..., :32], prefix_v[..., :32]) is None
    elif case == "gradients":
        query = query.detach().requires_grad_()
    elif case == "switched_off":
        monkeypatch.setenv(KERNEL_ENV, "0")
        assert pack_prefix(prefix_k, prefix_v) is None
    elif case == "mask_dtype":
        visible = visible.float()
    assert step_attention(query, packed, key, value, visible, 0.125) is None


@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_few_queries_give_each_query_the_bits_it_gets_among_many(group: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One to four queries a row and kv head take loops of their own (sums in registers, queries
    widened once without AVX512-BF16); each query's sums run in the order of the loop for any
    number, so a decode step's outputs are those of the same queries among more."""
    import cgym.agents.local.step_attention as module

    query, prefix_k, prefix_v, key, value, visible = _inputs(5, 1, 100, 300, heads=3 * group, kv_heads=3)
    # The outputs are bf16, which hides an fp32 sum's last bits: here the prefix's values are
    # +-4096 and small parts in turn, under equal weights (its keys 0), so that partial sums
    # near 4096 round the small parts, differently in another order, and the small total shows it. The own keys'
    # sums are held to the same order through `own_attention`'s fp32 outputs (test_decode_attention).
    prefix_k, visible = torch.zeros_like(prefix_k), torch.zeros_like(visible)  # and no own key seen
    big = torch.tensor([4096.0, 0.0, -4096.0, 0.0]).repeat(25).view(1, 1, 100, 1)  # keys 0, 2, 4, ...: +-4096 in turn
    prefix_v = torch.where(big != 0, big, torch.randn(prefix_v.shape) / 1024).to(torch.bfloat16)  # the odd keys: parts below fp32's step at 4096
    prefix = pack_prefix(prefix_k, prefix_v)
    few = step_attention(query, prefix, key, value, visible, 0.125)
    monkeypatch.setattr(module, "FEW_QUERIES", 16)  # more queries read the keys one at a time too
    copies = 4 // group + 1  # group x copies > 4 queries a row and kv head: the loops for any number
    many = step_attention(torch.cat([query] * copies, 2), prefix, key, value, torch.cat([visible] * copies, 1), 0.125)
    assert few is not None and many is not None
    assert all(torch.equal(few[:, 0], many[:, step]) for step in range(copies))


@pytest.mark.parametrize("threads", [1, 3, 5])
def test_any_number_of_threads_gives_the_same_bits(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows are shared out (`kernels.FOR_UNITS`): with more threads than cores, a thread done with
    its own rows takes another's; every (row, kv head) is still computed once, the same way."""
    query, prefix_k, prefix_v, key, value, visible = _inputs(37, 2, 40, 50)
    packed = pack_prefix(prefix_k, prefix_v)
    two = step_attention(query, packed, key, value, visible, 0.125)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert two is not None and torch.equal(step_attention(query, packed, key, value, visible, 0.125), two)


def test_queries_past_sixteen_get_the_bits_they_get_sixteen_or_fewer_at_a_time() -> None:
    """A row's 3 heads x 10 ids (30 queries: sixteen, then fourteen, mixing heads and ids
    differently) give each query the bits of two calls of 5 ids (15 queries each)."""
    query, prefix_k, prefix_v, key, value, visible = _inputs(4, 10, 70, 90)
    prefix = pack_prefix(prefix_k, prefix_v)
    with drafting():
        whole = step_attention(query, prefix, key, value, visible, 0.2)
    halves = [step_attention(query[:, :, part].contiguous(), prefix, key, value, visible[:, part].contiguous(), 0.2) for part in (slice(0, 5), slice(5, 10))]
    assert whole is not None and all(half is not None for half in halves)
    assert torch.equal(whole, torch.cat(halves, 1))
