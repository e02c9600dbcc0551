"""The decode-step attention kernel: the softmax attention of fp64 arithmetic on the same bf16
inputs, within fp32 rounding; the flash path's results within its bf16 rounding; and no kernel
(None, the caller's own path) wherever it does not apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from cgym.agents.local import decode_attention, kernels
from cgym.agents.local.decode_attention import KERNEL_ENV, available, block_attention, own_attention
from cgym.agents.local.kv_cache import split_attention

requires_kernel = pytest.mark.skipif(not available(), reason="no C compiler or no AVX2 here: the flash kernel runs")


def _forget_builds() -> None:
    """Drop this process's loaded kernels, so the next call builds or finds them again."""
    kernels.compiled.cache_clear()
    decode_attention._library.cache_clear()


def _counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[bool]:
    """Replace `kv_cache`'s kernel `name` by one that records, per call, whether it ran (not None)."""
    from cgym.agents.local import kv_cache

    real = getattr(kv_cache, name)
    calls: list[bool] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(kv_cache, name, counted)
    return calls


def _inputs(batch: int, queries: int, q_len: int, keys: int, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    q = torch.randn(batch, 3, queries, 64).to(torch.bfloat16)
    k = (torch.randn(batch, 3, keys, 64) * 2).to(torch.bfloat16)
    v = torch.randn(batch, 3, keys, 64).to(torch.bfloat16)
    visible = torch.rand(batch, q_len, keys) > 0.3  # padding and causality alike: any pattern
    return q, k, v, visible


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 softmax attention, query m reading visibility row m % q."""
    rows = visible.repeat(1, q.shape[2] // visible.shape[1], 1)[:, None]  # (B, 1, M, S)
    scores = (q.double() @ k.double().transpose(-1, -2) * scale).masked_fill(~rows, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v.double(), lse


@requires_kernel
@pytest.mark.parametrize(("batch", "queries", "q_len", "keys"), [(1, 3, 1, 1), (7, 3, 1, 37), (100, 3, 1, 220), (4, 15, 5, 300), (3, 16, 16, 17)])
def test_the_kernel_is_fp64_attention_within_fp32_rounding(batch: int, queries: int, q_len: int, keys: int) -> None:
    q, k, v, visible = _inputs(batch, queries, q_len, keys)
    visible[0] = False  # a row that sees nothing (a pad): lse -inf, output 0
    got = own_attention(q, k, v, visible, 0.125)
    assert got is not None
    out, lse = got
    ref_out, ref_lse = _reference(q, k, v, visible, 0.125)
    seen = ~torch.isinf(ref_lse)
    assert torch.isinf(lse[~seen]).all() and (lse[~seen] < 0).all() and (out[~seen] == 0).all()
    torch.testing.assert_close(out.double()[seen], ref_out[seen], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double()[seen], ref_lse[seen], atol=2e-5, rtol=1e-5)


@requires_kernel
def test_strided_keys_as_a_growing_cache_holds_them() -> None:
    """A cache keeps keys in a buffer with room to grow: the kernel reads the strided view."""
    q, k, v, visible = _inputs(5, 6, 2, 40)
    room_k = torch.zeros(5, 3, 64, 64, dtype=torch.bfloat16)
    room_v = torch.zeros(5, 3, 64, 64, dtype=torch.bfloat16)
    room_k[:, :, :40], room_v[:, :, :40] = k, v
    strided = own_attention(q, room_k[:, :, :40], room_v[:, :, :40], visible, 0.2)
    packed = own_attention(q, k, v, visible, 0.2)
    assert strided is not None and packed is not None
    assert torch.equal(strided[0], packed[0]) and torch.equal(strided[1], packed[1])


@requires_kernel
@pytest.mark.parametrize("queries", [1, 3, 4])
def test_a_key_scores_the_same_sixteen_at_a_time_as_alone(queries: int) -> None:
    """A row's keys are scored sixteen at a time, the last S % 16 one at a time. Each key copied
    past the last sixteen, and each copy alone visible: the log-sum-exp is then that key's score,
    and it must come out the same bits from either loop (and from key t's lane, not another's)."""
    torch.manual_seed(3)
    q = torch.randn(2, 3, queries, 64).to(torch.bfloat16)
    k = (torch.randn(2, 3, 33, 64) * 2).to(torch.bfloat16)
    v = torch.randn(2, 3, 33, 64).to(torch.bfloat16)
    for t in range(32):
        k[:, :, 32] = k[:, :, t]
        alone = torch.zeros(2, 1, 33, dtype=torch.bool)
        alone[:, :, t] = True
        in_block = own_attention(q, k, v, alone, 0.125)
        alone[:, :, t], alone[:, :, 32] = False, True
        one_by_one = own_attention(q, k, v, alone, 0.125)
        assert in_block is not None and one_by_one is not None
        assert torch.equal(in_block[1], one_by_one[1]), t


@requires_kernel
@pytest.mark.parametrize(("batch", "q_len", "prefix", "own"), [(12, 1, 300, 90), (100, 1, 269, 220), (6, 5, 50, 31)])
def test_split_attention_with_the_kernel_matches_the_flash_path(batch: int, q_len: int, prefix: int, own: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole decode attention (prefix part, own part, merge) with and without the kernel:
    they differ by the flash kernel's rounding of its weights to bf16, and the kernel is the
    closer of the two to fp64."""
    torch.manual_seed(1)
    query = torch.randn(batch, 9, q_len, 64).to(torch.bfloat16)
    key = torch.randn(batch, 3, own, 64).to(torch.bfloat16)
    value = torch.randn(batch, 3, own, 64).to(torch.bfloat16)
    prefix_k = torch.randn(1, 3, prefix, 64)
    prefix_v = torch.randn(1, 3, prefix, 64)
    visible = torch.ones(batch, q_len, own, dtype=torch.bool)
    visible[:, :, : own // 3] = torch.rand(batch, 1, own // 3) > 0.5  # left padding
    visible[0] = False  # a pad row
    with_kernel = split_attention(query, key, value, prefix_k, prefix_v, visible, 0.125)
    monkeypatch.setenv(KERNEL_ENV, "0")
    flash = split_attention(query, key, value, prefix_k, prefix_v, visible, 0.125)
    torch.testing.assert_close(with_kernel, flash, atol=2e-2, rtol=2e-2)
    # fp64 reference over [prefix | own]
    keys = torch.cat([prefix_k.double().expand(batch, -1, -1, -1), key.double()], 2).repeat_interleave(3, 1)
    values = torch.cat([prefix_v.double().expand(batch, -1, -1, -1), value.double()], 2).repeat_interleave(3, 1)
    sees = torch.cat([torch.ones(batch, q_len, prefix, dtype=torch.bool), visible], 2)[:, None]
    scores = (query.double() @ keys.transpose(-1, -2) * 0.125).masked_fill(~sees, float("-inf"))
    ref = (torch.softmax(scores, -1) @ values).transpose(1, 2)  # (B, q, H, D)
    assert (with_kernel.double() - ref).abs().max() <= (flash.double() - ref).abs().max() + 1e-6


def _spoiled(case: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, ...]:
    """Inputs changed as `case` says, for the cases no kernel takes (others come back as given)."""
    if case == "float32":
        q, k, v = q.float(), k.float(), v.float()
    elif case == "head_dim":
        q, k, v = q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous()
    elif case == "gradients":
        q.requires_grad_(True)
    elif case == "switched_off":
        monkeypatch.setenv(KERNEL_ENV, "0")
    elif case == "no_keys":
        k, v, visible = k[:, :, :0], v[:, :, :0], visible[:, :, :0]
    return q, k, v, visible


@pytest.mark.parametrize(
    "case",
    ["float32", "many_queries", "head_dim", "gradients", "switched_off", "no_keys"],
)
def test_no_kernel_where_it_does_not_apply(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, visible = _spoiled(case, *_inputs(2, 3, 1, 8), monkeypatch)
    if case == "many_queries":  # a prefill
        q = torch.randn(2, 3, 64, 64).to(torch.bfloat16)
        visible = torch.ones(2, 64, 8, dtype=torch.bool)
    assert own_attention(q, k, v, visible, 0.125) is None


def test_no_compiler_means_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    _forget_builds()
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    try:
        assert not available()
        q, k, v, visible = _inputs(2, 3, 1, 8)
        assert own_attention(q, k, v, visible, 0.125) is None
    finally:
        _forget_builds()


def test_a_cache_that_is_a_file_means_no_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cgym.agents.pretrained import CACHE_ENV

    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("")
    _forget_builds()
    monkeypatch.setenv(CACHE_ENV, str(not_a_folder))
    try:
        assert not available()
    finally:
        _forget_builds()


@requires_kernel
def test_the_kernel_is_built_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cgym.agents.pretrained import CACHE_ENV

    _forget_builds()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    try:
        assert available()
        built = list((tmp_path / "kernels").glob("own_attention_*.so"))
        assert len(built) == 1
        _forget_builds()
        assert available() and list((tmp_path / "kernels").glob("*")) == built
    finally:
        _forget_builds()


@requires_kernel
def test_a_bf16_policy_samples_through_the_kernel_as_exactly_as_through_flash(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model with 64-wide heads (the fixture's are 16 wide and never reach the kernel), random
    weights sharp enough that attention decides the next id, sampled in bf16 behind the shared
    system prompt: its decode steps go through the kernel, and the sampled ids' log-probs match an
    fp32 pass over the same ids as closely as the flash path's do. (A kernel with its scale off
    by 3x measured 5.6 nats off on average here; either path, ~0.07.)"""
    from cgym.agents.base import Conversation
    from cgym.agents.local.hf import HFPolicy
    from cgym.agents.local.precision import DTYPE_ENV
    from cgym.agents.local.sampling import sequence_logprobs
    from cgym.agents.options import SamplingOptions
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    config = AutoConfig.from_pretrained(tiny_chat_model)
    config.update({"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 256, "initializer_range": 0.3})
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    steps = _counted(monkeypatch, "step_attention")
    blocks = _counted(monkeypatch, "block_attention")
    for switch in ("1", "0"):
        monkeypatch.setenv(KERNEL_ENV, switch)
        steps.clear()
        blocks.clear()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
        policy = HFPolicy(model, tokenizer, sampling=SamplingOptions(temperature=1.0, max_new_tokens=24, seed=0))
        convs = [
            Conversation([{"role": "system", "content": "You write JSON reports for the customers."}, {"role": "user", "content": f"Report customer {i}."}])
            for i in (3, 40, 7)
        ]
        policy.act(convs)
        assert any(steps) == (switch == "1")  # on: decode steps reached the one-call kernel; off: none did
        assert any(blocks) == (switch == "1")  # and the prefills and the shared prompt's part the block kernel
        fp32 = model.float()
        gaps = []
        for conv in convs:
            ids = torch.tensor([conv.token_ids])
            sampled = torch.tensor(conv.loss_mask[1:], dtype=torch.bool)
            with torch.no_grad():
                exact = sequence_logprobs(fp32, ids, torch.ones_like(ids))[0]
            gaps.append((exact - torch.tensor(conv.logprobs[1:]))[sampled].abs())
        gap = torch.cat(gaps)
        assert gap.numel() >= 30 and float(gap.mean()) < 0.15 and float(gap.max()) < 1.0, (switch, float(gap.mean()), float(gap.max()))


@requires_kernel
@pytest.mark.parametrize(
    ("batch", "queries", "q_len", "keys"),
    [(1, 1, 1, 1), (1, 300, 100, 269), (3, 27, 9, 50), (2, 45, 15, 33), (4, 8, 8, 16), (100, 15, 5, 17)],
)
def test_the_block_kernel_is_fp64_attention_within_fp32_rounding(batch: int, queries: int, q_len: int, keys: int) -> None:
    """Any number of queries (short last blocks of 8), keys not a multiple of 16, blind queries."""
    q, k, v, visible = _inputs(batch, queries, q_len, keys)
    visible[0, 0] = False  # a query that sees nothing (a pad): lse -inf, output 0
    got = block_attention(q, k, v, visible, 0.125)
    assert got is not None
    out, lse = got
    ref_out, ref_lse = _reference(q, k, v, visible, 0.125)
    seen = ~torch.isinf(ref_lse)
    assert (~seen).any() and torch.isinf(lse[~seen]).all() and (lse[~seen] < 0).all() and (out[~seen] == 0).all()
    torch.testing.assert_close(out.double()[seen], ref_out[seen], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double()[seen], ref_lse[seen], atol=2e-5, rtol=1e-5)


@requires_kernel
def test_the_block_kernel_never_reads_a_key_block_that_no_query_of_a_block_sees() -> None:
    """A prefix tree's visibility leaves whole blocks of sixteen keys unseen by a block of eight
    queries, inside the span of those it sees: their weights and values are never read (a NaN
    value there stays out of every output), and the rest is fp64 attention within fp32 rounding."""
    q, k, v, _ = _inputs(2, 48, 48, 96, seed=1)
    visible = torch.rand(2, 48, 96) > 0.5  # keys 0-15 and 80-95: seen in part by every query
    visible[:, :, 16:80] = False
    visible[:, :24, 16:32] = True  # keys 16-31 seen by queries 0-23 only, 48-79 by 24-47 only
    visible[:, 24:, 48:80] = torch.rand(2, 24, 32) > 0.3
    clean = v.clone()
    clean[:, :, 32:48] = 0.0  # keys 32-47: seen by no query
    spoiled = clean.clone()
    spoiled[:, :, 32:48] = float("nan")
    got, ref = block_attention(q, k, spoiled, visible, 0.125), block_attention(q, k, clean, visible, 0.125)
    assert got is not None and ref is not None
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    ref_out, ref_lse = _reference(q, k, clean, visible, 0.125)
    torch.testing.assert_close(got[0].double(), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got[1].double(), ref_lse, atol=2e-5, rtol=1e-5)


@requires_kernel
def test_the_block_kernel_reads_one_shared_prefix_for_every_row() -> None:
    """Keys and values of batch 1 (a shared prefix) serve every row, with no visibility given:
    the same results as a copy per row that every query sees, and as strided copies."""
    q, k, v, _ = _inputs(4, 21, 7, 40)
    shared = block_attention(q, k[:1], v[:1], None, 0.2)
    copies = block_attention(q, k[:1].repeat(4, 1, 1, 1), v[:1].repeat(4, 1, 1, 1), torch.ones(4, 7, 40, dtype=torch.bool), 0.2)
    room_k = torch.zeros(4, 3, 64, 64, dtype=torch.bfloat16)
    room_v = torch.zeros(4, 3, 64, 64, dtype=torch.bfloat16)
    room_k[:, :, :40], room_v[:, :, :40] = k[:1], v[:1]
    strided = block_attention(q, room_k[:, :, :40], room_v[:, :, :40], None, 0.2)
    assert shared is not None and copies is not None and strided is not None
    for other in (copies, strided):
        assert torch.equal(shared[0], other[0]) and torch.equal(shared[1], other[1])
    ref_out, _ = _reference(q, k[:1].expand(4, -1, -1, -1), v[:1].expand(4, -1, -1, -1), torch.ones(4, 7, 40, dtype=torch.bool), 0.2)
    torch.testing.assert_close(shared[0].double(), ref_out, atol=2e-5, rtol=1e-4)


@requires_kernel
@pytest.mark.parametrize(("batch", "q_len", "prefix", "own"), [(4, 40, 269, 60), (3, 5, 50, 31), (100, 1, 269, 220)])
def test_split_attention_with_a_bf16_prefix_is_closer_to_fp64_than_flash(
    batch: int, q_len: int, prefix: int, own: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sampler's prefill and decode steps behind a bf16 shared prompt: the block kernel for
    the prompt's part (and a prefill's own part), against the flash path on the prompt's fp32
    copy; within bf16 rounding of each other, and the kernels' the closer to fp64."""
    torch.manual_seed(2)
    query = torch.randn(batch, 9, q_len, 64).to(torch.bfloat16)
    key = torch.randn(batch, 3, own, 64).to(torch.bfloat16)
    value = torch.randn(batch, 3, own, 64).to(torch.bfloat16)
    prefix_k = (torch.randn(1, 3, prefix, 64) * 2).to(torch.bfloat16)
    prefix_v = torch.randn(1, 3, prefix, 64).to(torch.bfloat16)
    causal = torch.arange(own)[None] <= torch.arange(q_len)[:, None] + (own - q_len)
    visible = causal[None].repeat(batch, 1, 1)
    visible[0, :, : own // 2] = False  # left padding
    with_kernel = split_attention(query, key, value, prefix_k, prefix_v, visible, 0.125)
    monkeypatch.setenv(KERNEL_ENV, "0")
    flash = split_attention(query, key, value, prefix_k.float(), prefix_v.float(), visible, 0.125)
    torch.testing.assert_close(with_kernel, flash, atol=2e-2, rtol=2e-2)
    keys = torch.cat([prefix_k.double().expand(batch, -1, -1, -1), key.double()], 2).repeat_interleave(3, 1)
    values = torch.cat([prefix_v.double().expand(batch, -1, -1, -1), value.double()], 2).repeat_interleave(3, 1)
    sees = torch.cat([torch.ones(batch, q_len, prefix, dtype=torch.bool), visible], 2)[:, None]
    scores = (query.double() @ keys.transpose(-1, -2) * 0.125).masked_fill(~sees, float("-inf"))
    ref = (torch.softmax(scores, -1) @ values).transpose(1, 2)
    assert (with_kernel.double() - ref).abs().max() <= (flash.double() - ref).abs().max() + 1e-6


@pytest.mark.parametrize("case", ["float32", "head_dim", "gradients", "switched_off", "no_keys", "key_rows", "no_queries"])
def test_no_block_kernel_where_it_does_not_apply(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, visible = _spoiled(case, *_inputs(2, 24, 8, 8), monkeypatch)
    if case == "key_rows":  # neither one shared copy nor one per row
        k, v = torch.cat([k, k[:1]]), torch.cat([v, v[:1]])
    elif case == "no_queries":
        q = q[:, :, :0]
    assert block_attention(q, k, v, visible, 0.125) is None


@requires_kernel
@pytest.mark.parametrize(("batch", "q_len", "keys"), [(3, 40, 90), (2, 1, 33)])
def test_kernel_attention_gradients_are_fp64_attentions_within_bf16_rounding(batch: int, q_len: int, keys: int) -> None:
    """The training pass's attention: the kernels' forward, the flash kernel's backward from their
    outputs and log-sum-exps. Queries that see no key (pads) get zero gradients, not NaNs."""
    from cgym.agents.local.kv_cache import kernel_attention

    torch.manual_seed(3)
    q = torch.randn(batch, 9, q_len, 64).to(torch.bfloat16).requires_grad_()
    k = (torch.randn(batch, 3, keys, 64) * 2).to(torch.bfloat16).requires_grad_()
    v = torch.randn(batch, 3, keys, 64).to(torch.bfloat16).requires_grad_()
    visible = (torch.arange(keys)[None] <= torch.arange(q_len)[:, None] + (keys - q_len))[None].repeat(batch, 1, 1)
    visible[0, :, :5] = False  # left padding
    visible[-1, -1] = False  # a pad query
    grad = torch.randn(batch, 9, q_len, 64)
    out = kernel_attention(q, k, v, visible, 0.125)
    assert out is not None and out.dtype == torch.float32
    out.backward(grad)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    scores = exact[0] @ exact[1].repeat_interleave(3, 1).transpose(-1, -2) * 0.125
    ref = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), -1).nan_to_num(0.0) @ exact[2].repeat_interleave(3, 1)
    ref.backward(grad.double())
    torch.testing.assert_close(out.detach().double(), ref.detach(), atol=2e-5, rtol=1e-4)
    for got, want in zip((q.grad, k.grad, v.grad), (t.grad for t in exact), strict=True):
        assert got is not None and want is not None and got.isfinite().all()
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1e-2)  # gradients come back in bf16
    assert (q.grad[-1, :, -1] == 0).all()  # the pad query


@requires_kernel
def test_a_bf16_training_pass_reaches_the_kernels_and_matches_the_flash_path(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A padded batch through a model with 64-wide heads under bf16 autocast, with gradients (the
    GRPO loss pass's path): the attention goes through the block kernel, and the log-probs and
    weight gradients match the flash path's within bf16 rounding."""
    from cgym.agents.local import kv_cache
    from cgym.agents.local.precision import DTYPE_ENV, autocast
    from cgym.agents.local.sampling import sequence_logprobs
    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    config = AutoConfig.from_pretrained(tiny_chat_model)
    config.update({"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 256})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    kv_cache.use_prefix_attention(model)
    ids = torch.randint(3, 500, (3, 40))
    attention = torch.ones_like(ids)
    attention[1, 30:] = 0  # right padding, as `pack` lays rows out
    attention[2, 25:] = 0
    calls = _counted(monkeypatch, "block_attention")
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv(KERNEL_ENV, switch)
        model.zero_grad(set_to_none=True)
        calls.clear()
        with autocast(model):
            logp = sequence_logprobs(model, ids, attention)
        (logp * attention[:, 1:]).sum().backward()
        assert any(calls) == (switch == "1")
        results.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (kernel_lp, kernel_grads), (flash_lp, flash_grads) = results
    kept = attention[:, 1:].bool()
    torch.testing.assert_close(kernel_lp[kept], flash_lp[kept], atol=5e-2, rtol=0)
    assert kernel_grads.keys() == flash_grads.keys()
    for name, grad in kernel_grads.items():
        scale = float(flash_grads[name].abs().max()) + 1e-6
        assert float((grad - flash_grads[name]).abs().max()) <= 0.1 * scale, name


@requires_kernel
def test_a_bf16_policy_without_a_shared_prompt_samples_through_the_kernels(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that share no system prompt have no prefix part: their padded prefill and decode steps
    take grouped attention with a mask, through the kernels, in a bf16 sampler whose packed
    linear layers take bf16 only (the kernels' fp32 output is cast back, as SDPA's would be)."""
    from cgym.agents.base import Conversation
    from cgym.agents.local.hf import HFPolicy
    from cgym.agents.local.precision import DTYPE_ENV
    from cgym.agents.options import SamplingOptions
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    config = AutoConfig.from_pretrained(tiny_chat_model)
    config.update({"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 256})
    calls = _counted(monkeypatch, "kernel_attention")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    policy = HFPolicy(model, AutoTokenizer.from_pretrained(tiny_chat_model), sampling=SamplingOptions(temperature=1.0, max_new_tokens=12, seed=0))
    convs = [Conversation([{"role": "user", "content": text}]) for text in ("Report customer 3.", "Which orders did customer 40 place in the last week?")]
    policy.act(convs)
    assert any(calls)
    assert all(any(conv.loss_mask) for conv in convs)  # each row sampled ids


@requires_kernel
@pytest.mark.parametrize("queries", [1, 2, 3, 4])
def test_few_queries_give_each_query_the_fp32_bits_it_gets_among_many(queries: int) -> None:
    """One to four queries a (row, head) take loops of their own (sums in registers; without
    AVX512-BF16 the queries widened once); each query's sums run in the same order as among more
    queries, so its fp32 output and log-sum-exp are those it gets among them."""
    q, k, v, visible = _inputs(3, queries, 1, 150, seed=queries)
    q = (q.float() * 3).to(torch.bfloat16)  # large scores: a score's last bits move its weight
    v = (v.float() * torch.exp(3 * torch.randn(v.shape))).to(torch.bfloat16)  # sums that cancel: their order shows
    few = own_attention(q, k, v, visible, 0.125)
    copies = 4 // queries + 1  # more than four queries: the loops for any number
    many = own_attention(torch.cat([q] * copies, 2), k, v, visible, 0.125)
    assert few is not None and many is not None
    for step in range(copies):
        rows = slice(step * queries, (step + 1) * queries)
        assert torch.equal(few[0], many[0][:, :, rows]) and torch.equal(few[1], many[1][:, :, rows])


@requires_kernel
@pytest.mark.parametrize("threads", [1, 3, 5])
def test_the_block_kernel_gives_the_same_bits_on_any_number_of_threads(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Query blocks are shared out (`kernels.FOR_UNITS`): a thread done with its own takes
    another's from the back, repacking that row's keys; each block is still computed once."""
    q, k, v, visible = _inputs(9, 45, 15, 70)
    two = block_attention(q, k, v, visible, 0.125)
    shared = block_attention(q, k[:1], v[:1], None, 0.125)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert two is not None and shared is not None
    for got, want in ((block_attention(q, k, v, visible, 0.125), two), (block_attention(q, k[:1], v[:1], None, 0.125), shared)):
        assert got is not None and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
