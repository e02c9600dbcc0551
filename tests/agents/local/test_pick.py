"""Picking ids from bf16 logits in one C pass per row: torch's argmax and log-softmax for greedy
rows, draws that follow the softmax for sampled ones, and PyTorch's path wherever it does not run."""

from __future__ import annotations

import pytest
import torch
from cgym.agents.local import sampling
from cgym.agents.local.decode_attention import KERNEL_ENV
from cgym.agents.local.pick import _library, pick_rows
from cgym.agents.options import SamplingOptions

pytestmark = pytest.mark.skipif(_library() is None, reason="no C compiler or no AVX512-BF16 here: PyTorch picks")


@pytest.mark.parametrize("vocab", [49152, 37, 1])
def test_greedy_rows_get_torchs_argmax_and_log_softmax(vocab: int) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(9, vocab) * 3).to(torch.bfloat16)
    if vocab > 20:
        logits[3, 5] = logits[3, 17] = 30.0  # a tie: the first id, as torch.argmax
    got = pick_rows(logits, 0.0, None)
    assert got is not None
    ids, logp = got
    assert torch.equal(ids, logits.float().argmax(-1))
    want = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None]).squeeze(1)
    torch.testing.assert_close(logp, want, atol=5e-5, rtol=0)


def test_sampled_rows_follow_the_softmax_at_their_temperature() -> None:
    weights = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, *[-40.0] * 30])  # 35 ids: two blocks, a short one
    logits = weights.to(torch.bfloat16).expand(100_000, -1).contiguous()
    got = pick_rows(logits, 0.7, torch.Generator().manual_seed(1))
    assert got is not None
    ids, logp = got
    expected = torch.softmax(logits[0].float() / 0.7, -1)
    frequency = torch.bincount(ids, minlength=35).double() / len(ids)
    assert float((frequency - expected).abs().max()) < 0.005  # ~4 standard errors at 100,000 draws
    assert int(ids.max()) < 5  # an id of weight e^-57 is never drawn
    torch.testing.assert_close(logp, torch.log_softmax(logits[0].float() / 0.7, -1)[ids], atol=1e-5, rtol=0)


def test_the_same_generator_state_draws_the_same_ids() -> None:
    logits = (torch.randn(16, 500) * 2).to(torch.bfloat16)
    first, second = (pick_rows(logits, 1.0, torch.Generator().manual_seed(7)) for _ in range(2))
    assert first is not None and second is not None and torch.equal(first[0], second[0])
    third = pick_rows(logits, 1.0, torch.Generator().manual_seed(8))
    assert third is not None and not torch.equal(first[0], third[0])


@pytest.mark.parametrize("case", ["float32", "strided", "switched_off"])
def test_no_kernel_where_it_does_not_apply(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(4, 64).to(torch.bfloat16)
    if case == "float32":
        logits = logits.float()
    elif case == "strided":
        logits = logits[:, ::2]
    else:
        monkeypatch.setenv(KERNEL_ENV, "0")
    assert pick_rows(logits, 1.0, None) is None


def test_the_sampler_picks_here_unless_top_p_trims_the_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []

    def spy(*args: object) -> object:
        out = pick_rows(*args)  # type: ignore[arg-type]
        calls.append(out is not None)
        return out

    monkeypatch.setattr(sampling, "pick_rows", spy)
    logits = (torch.randn(3, 300) * 2).to(torch.bfloat16)
    ids, logp = sampling._pick(logits, SamplingOptions(temperature=1.0), torch.Generator().manual_seed(0))
    assert calls == [True] and ids.shape == logp.shape == (3,)
    calls.clear()
    ids, logp = sampling._pick(logits, SamplingOptions(temperature=1.0, top_p=0.5), torch.Generator().manual_seed(0))
    assert calls == [] and ids.shape == (3,)
