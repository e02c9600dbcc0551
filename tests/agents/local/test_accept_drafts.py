"""accept_drafts: which drafted ids a step keeps, greedy and sampled.

Sampled rows run speculative sampling against a one-id draft. Its promise is about
distributions: each emitted id follows the distribution one-at-a-time sampling draws from. The
tests check that on many rows with the same logits and a fixed seed (so they cannot flake): a
tally per position, against the softmax it should match.
"""

from __future__ import annotations

import pytest
import torch
from cgym.agents.local import sampling
from cgym.agents.local.pick import _library as pick_library
from cgym.agents.local.sampling import accept_drafts
from cgym.agents.options import SamplingOptions

ROWS = 60_000
# (n, V) logits after a row's last id and after each of its two drafts
LOGITS = torch.tensor([[2.0, 0.5, 0.0, -1.0, 1.0], [0.0, 1.0, 1.2, -0.5, 0.3], [0.2, 0.2, 1.5, 0.0, -2.0]])
DRAFTS = [0, 2]  # p_0(0) is about 0.6, p_1(2) about 0.4: every branch sees thousands of rows


# fp32 logits take PyTorch's ops; bf16 ones, as the sampler's packed model gives them, the C kernels
# (`pick_rows`, `row_log_sum_exps`) where they run here
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(pick_library() is None, reason="the C kernels do not run here"))]


def _run(
    params: SamplingOptions, logits: torch.Tensor = LOGITS, drafts: list[int] = DRAFTS, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = logits.to(dtype).expand(ROWS, -1, -1).contiguous()
    return accept_drafts(rows, torch.tensor([drafts]).expand(ROWS, -1), params, torch.Generator().manual_seed(0))


def _tally(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids, minlength=vocab).double() / len(ids)


def _target(logits: torch.Tensor, params: SamplingOptions) -> torch.Tensor:
    """The distribution one-at-a-time sampling draws from: softmax at the temperature, then
    the top-p set renormalised."""
    p = torch.softmax(logits.double() / params.temperature, -1)
    if params.top_p < 1.0:
        order = p.argsort(descending=True)
        before = p[order].cumsum(0) - p[order]
        p = p.clone()
        p[order[before >= params.top_p]] = 0
        p /= p.sum()
    return p


def _assert_each_id_follows_its_distribution(params: SamplingOptions, dtype: torch.dtype) -> None:
    ids, logprobs, emit = _run(params, dtype=dtype)
    logits = LOGITS.to(dtype).float()  # the values the rows hold
    vocab = LOGITS.shape[1]
    first_kept = ids[:, 0] == DRAFTS[0]
    both_kept = first_kept & (ids[:, 1] == DRAFTS[1])
    assert set(emit.tolist()) == {1, 2, 3}
    assert bool((emit[~first_kept] == 1).all()) and bool((emit[first_kept & ~both_kept] == 2).all()) and bool((emit[both_kept] == 3).all())
    # the first id follows p_0; after a kept draft the next follows p_1, after both p_2
    for position, rows in ((0, torch.ones(ROWS, dtype=torch.bool)), (1, first_kept), (2, both_kept)):
        torch.testing.assert_close(_tally(ids[rows, position], vocab), _target(logits[position], params), atol=0.015, rtol=0)
    expected = torch.log_softmax(logits / params.temperature, -1)  # stored log-probs: temperature only, as `_pick`
    for position in range(3):
        rows = emit > position
        torch.testing.assert_close(logprobs[rows, position], expected[position][ids[rows, position]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampled_drafts_keep_the_distribution_of_one_id_at_a_time(dtype: torch.dtype) -> None:
    _assert_each_id_follows_its_distribution(SamplingOptions(temperature=1.0), dtype)
    _assert_each_id_follows_its_distribution(SamplingOptions(temperature=0.7), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampled_drafts_keep_the_top_p_distribution(dtype: torch.dtype) -> None:
    params = SamplingOptions(temperature=1.0, top_p=0.7)
    _assert_each_id_follows_its_distribution(params, dtype)
    outside = int(_target(LOGITS[0], params).argmin())  # an id the top-p set leaves out
    ids, _, emit = _run(params, drafts=[outside, 2], dtype=dtype)
    assert bool((emit == 1).all()) and not bool((ids[:, 0] == outside).any())


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_sure_draft_is_always_kept(dtype: torch.dtype) -> None:
    logits = LOGITS.clone()
    logits[0] = torch.tensor([0.0, -1e4, -1e4, -1e4, -1e4])  # all of p_0's mass on id 0
    ids, _, emit = _run(SamplingOptions(temperature=1.0), logits=logits, dtype=dtype)
    assert bool((ids[:, 0] == 0).all()) and bool((emit >= 2).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_keeps_the_drafts_that_match_the_argmax(dtype: torch.dtype) -> None:
    logits = torch.stack([LOGITS, LOGITS]).to(dtype)  # argmax: 0, then 2, then 2
    ids, logprobs, emit = accept_drafts(logits, torch.tensor([[0, 2], [0, 1]]), SamplingOptions(temperature=0.0), None)
    assert ids.tolist() == [[0, 2, 2], [0, 2, 2]] and emit.tolist() == [3, 2]
    torch.testing.assert_close(logprobs[0], torch.log_softmax(logits[0].float(), -1)[[0, 1, 2], [0, 2, 2]])


def _kernel_calls(monkeypatch: pytest.MonkeyPatch, pick_rows_answers: bool = True) -> dict[str, int]:
    """Count `accept_drafts`' calls into the C kernels (`pick_rows` answering None when told to)."""
    calls = {"pick_rows": 0, "row_log_sum_exps": 0}
    picks, sums = sampling.pick_rows, sampling.row_log_sum_exps

    def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None):
        calls["pick_rows"] += 1
        return picks(logits, temperature, generator) if pick_rows_answers or temperature == 0 else None

    def summed(*args):
        calls["row_log_sum_exps"] += 1
        return sums(*args)

    monkeypatch.setattr(sampling, "pick_rows", pick)
    monkeypatch.setattr(sampling, "row_log_sum_exps", summed)
    return calls


@pytest.mark.skipif(pick_library() is None, reason="the C kernels do not run here")
def test_bf16_logits_are_checked_in_the_kernels_and_others_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _kernel_calls(monkeypatch)
    drafts = torch.tensor([DRAFTS])
    for temperature in (0.0, 0.7):
        accept_drafts(LOGITS[None].bfloat16(), drafts, SamplingOptions(temperature=temperature), torch.Generator().manual_seed(0))
    assert calls == {"pick_rows": 2, "row_log_sum_exps": 1}  # the greedy argmaxes; the sampled log-sum-exps and draw
    for logits, rows in ((LOGITS[None], drafts), (LOGITS[None].bfloat16().expand(2, -1, -1), drafts.expand(2, -1))):  # fp32; not contiguous
        for temperature in (0.0, 0.7):
            accept_drafts(logits, rows, SamplingOptions(temperature=temperature), torch.Generator().manual_seed(0))
    accept_drafts(LOGITS[None].bfloat16(), drafts, SamplingOptions(temperature=0.7, top_p=0.7), None)  # top-p
    assert calls == {"pick_rows": 2, "row_log_sum_exps": 1}  # PyTorch's ops each time


@pytest.mark.skipif(pick_library() is None, reason="the C kernels do not run here")
def test_without_room_for_the_pick_kernel_the_next_id_is_a_gumbel_draw_from_the_same_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _kernel_calls(monkeypatch, pick_rows_answers=False)
    _assert_each_id_follows_its_distribution(SamplingOptions(temperature=0.7), torch.bfloat16)
    assert calls == {"pick_rows": 1, "row_log_sum_exps": 1}  # still the kernels' draft check, then the Gumbel draw
