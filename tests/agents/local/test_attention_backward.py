"""The attention backward kernel: the gradients of fp64 softmax attention on the same bf16 inputs,
within bf16 rounding of its products' inputs; the training pass's path through it; and None
(the flash kernel's backward) wherever it does not apply."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cgym.agents.local.attention_backward import attention_backward
from cgym.agents.local.decode_attention import KERNEL_ENV, available, block_attention

requires_kernel = pytest.mark.skipif(not available(), reason="no C compiler or no AVX512-BF16 here: the flash kernel runs")


def _inputs(batch: int, kv_heads: int, groups: int, q_len: int, prefix: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(B, H_kv, groups * q_len, 64) bf16 queries over a prefix every query sees and q_len causal
    own keys; the last row left-padded by a third of its own keys, its first queries pads."""
    torch.manual_seed(seed)
    keys = prefix + q_len
    q = torch.randn(batch, kv_heads, groups * q_len, 64).to(torch.bfloat16)
    k = (torch.randn(batch, kv_heads, keys, 64) * 1.5).to(torch.bfloat16)
    v = torch.randn(batch, kv_heads, keys, 64).to(torch.bfloat16)
    visible = torch.ones(batch, q_len, keys, dtype=torch.bool)
    visible[:, :, prefix:] = torch.arange(q_len)[:, None] >= torch.arange(q_len)[None]
    pad = q_len // 3
    visible[-1, :, prefix : prefix + pad] = False
    visible[-1, :pad] = False  # pad queries: they see no key at all
    return q, k, v, visible


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, grad: torch.Tensor, scale: float) -> list[torch.Tensor]:
    """The gradients of fp64 softmax attention on the same inputs (a query that sees nothing: 0)."""
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    groups = q.shape[2] // visible.shape[1]
    seen = visible.repeat(1, groups, 1)[:, None]
    weights = torch.softmax((exact[0] @ exact[1].transpose(-1, -2) * scale).masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
    (weights @ exact[2]).backward(grad.double())
    return [t.grad for t in exact]


@requires_kernel
@pytest.mark.parametrize(
    ("batch", "kv_heads", "groups", "q_len", "prefix"),
    [(1, 1, 1, 1, 0), (2, 3, 3, 37, 20), (1, 2, 3, 90, 301), (2, 1, 2, 150, 17)],  # the last two: more queries than one chunk's 256
)
def test_gradients_are_fp64_attentions_within_bf16_rounding(batch: int, kv_heads: int, groups: int, q_len: int, prefix: int) -> None:
    q, k, v, visible = _inputs(batch, kv_heads, groups, q_len, prefix)
    out, lse = block_attention(q, k, v, visible, 0.125)
    grad = torch.randn_like(out)
    got = attention_backward(q, k, v, grad, out, lse, visible, 0.125)
    assert got is not None
    for name, mine, want in zip("qkv", got, _reference(q, k, v, visible, grad, 0.125), strict=True):
        assert mine.dtype == torch.float32 and mine.shape == want.shape and mine.isfinite().all(), name
        error = float((mine.double() - want).abs().max() / want.abs().max().clamp_min(1.0))  # one key: dq is 0
        assert error < 1e-2, f"d{name}: {error:.2e} of its largest value"  # measured 1.1e-3 to 3.7e-3
    if batch > 1 and q_len > 2:
        assert (got[0][-1].view(kv_heads, groups, q_len, 64)[:, :, : q_len // 3] == 0).all()  # pad queries


@requires_kernel
def test_a_larger_workspace_serves_a_smaller_call() -> None:
    """The workspace kept from a large call is reused, offset to its alignment, for a small one."""
    for shape in [(2, 3, 3, 120, 200), (1, 1, 1, 3, 5), (2, 3, 3, 120, 200)]:
        q, k, v, visible = _inputs(*shape, seed=1)
        out, lse = block_attention(q, k, v, visible, 0.125)
        grad = torch.randn_like(out)
        got = attention_backward(q, k, v, grad, out, lse, visible, 0.125)
        assert got is not None
        for mine, want in zip(got, _reference(q, k, v, visible, grad, 0.125), strict=True):
            assert float((mine.double() - want).abs().max() / want.abs().max()) < 1e-2


@requires_kernel
@pytest.mark.parametrize("case", ["float32", "head_dim", "switched_off", "no_queries", "key_rows", "visibility"])
def test_no_kernel_where_it_does_not_apply(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, visible = _inputs(2, 3, 3, 8, 4)
    out, lse = block_attention(q, k, v, visible, 0.125)
    grad = torch.randn_like(out)
    if case == "float32":
        q, k, v = q.float(), k.float(), v.float()
    elif case == "head_dim":
        q, k, v, grad, out = (t[..., :32] for t in (q, k, v, grad, out))
    elif case == "switched_off":
        monkeypatch.setenv(KERNEL_ENV, "0")
    elif case == "no_queries":
        q, grad, out, lse = q[:, :, :0], grad[:, :, :0], out[:, :, :0], lse[:, :, :0]
    elif case == "key_rows":
        k, v = k[:1], v[:1]
    else:  # a visibility whose rows do not divide the queries
        visible = visible[:, :5]
    assert attention_backward(q, k, v, grad, out, lse, visible, 0.125) is None


@requires_kernel
def test_the_training_pass_attention_takes_it_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kv_cache.kernel_attention` under autograd: its backward is this kernel's, and agrees with
    the flash kernel's backward (the path it replaces) within bf16 rounding."""
    from cgym.agents.local import kv_cache

    calls: list[bool] = []
    real = kv_cache.attention_backward

    def counted(*args: Any) -> Any:
        got = real(*args)
        calls.append(got is not None)
        return got

    def gradients() -> list[torch.Tensor]:
        torch.manual_seed(5)
        q = torch.randn(2, 9, 30, 64).to(torch.bfloat16).requires_grad_()
        k = torch.randn(2, 3, 50, 64).to(torch.bfloat16).requires_grad_()
        v = torch.randn(2, 3, 50, 64).to(torch.bfloat16).requires_grad_()
        visible = (torch.arange(50)[None] <= torch.arange(30)[:, None] + 20)[None].repeat(2, 1, 1)
        out = kv_cache.kernel_attention(q, k, v, visible, 0.125)
        assert out is not None
        out.backward(torch.randn_like(out))
        return [t.grad for t in (q, k, v)]

    monkeypatch.setattr(kv_cache, "attention_backward", counted)
    mine = gradients()
    assert calls == [True]
    monkeypatch.setattr(kv_cache, "attention_backward", lambda *args: None)
    flash = gradients()
    for got, want in zip(mine, flash, strict=True):
        assert got.dtype == torch.bfloat16
        assert float((got.double() - want.double()).abs().max() / want.double().abs().max()) < 1e-2


@requires_kernel
def test_queries_that_see_scattered_key_blocks() -> None:
    """Prefix-tree visibility: each query sees the blocks of its own branch, with gaps between
    them, and the two batch rows see different ones. The blocks a query block sees are found once
    per batch row and taken two at a time, however far apart."""
    q, k, v, visible = _inputs(2, 3, 3, 70, 90, seed=2)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.rand(2, 70, (160 + 15) // 16, generator=generator) < 0.5  # (row, query, key block)
    visible &= ~hidden.repeat_interleave(16, dim=2)[:, :, :160]
    visible[:, :, :4] = True  # every query sees a key
    out, lse = block_attention(q, k, v, visible, 0.125)
    grad = torch.randn_like(out)
    got = attention_backward(q, k, v, grad, out, lse, visible, 0.125)
    assert got is not None
    for name, mine, want in zip("qkv", got, _reference(q, k, v, visible, grad, 0.125), strict=True):
        error = float((mine.double() - want).abs().max() / want.abs().max().clamp_min(1.0))
        assert error < 1e-2, f"d{name}: {error:.2e} of its largest value"
