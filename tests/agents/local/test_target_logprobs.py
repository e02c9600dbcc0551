"""The fused target log-probs against the plain `gather - logsumexp` they replace."""

from __future__ import annotations

import pytest
import torch
from cgym.agents.local.target_logprobs import target_logprobs


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled = logits.float() / temperature
    return scaled.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_plain_log_softmax(dtype: torch.dtype, temperature: float) -> None:
    torch.manual_seed(0)
    base = (torch.randn(3, 7, 50) * 4).to(dtype)
    targets = torch.randint(0, 50, (3, 7))
    weights = torch.randn(3, 7)
    results = []
    for fn in (_reference, target_logprobs):
        logits = base.clone().requires_grad_()
        out = fn(logits, targets, temperature)
        (out * weights).sum().backward()
        results.append((out.detach(), logits.grad))
    (want, want_grad), (got, got_grad) = results
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert got_grad.dtype == dtype
    # the gradient is rounded to the logits' dtype either way; in fp32 the C loop's exp is within a few ulps of PyTorch's
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (0, 8e-3)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=rtol, atol=atol)


def test_a_row_broadcast_to_several_targets_sums_their_gradients() -> None:
    """`sequence_logprobs` scores a batch-1 shared pass's logits for every row through `expand`."""
    torch.manual_seed(1)
    logits = torch.randn(1, 4, 20, requires_grad=True)
    targets = torch.randint(0, 20, (3, 4))
    target_logprobs(logits.expand(3, -1, -1), targets).sum().backward()
    fused = logits.grad.clone()
    logits.grad = None
    _reference(logits.expand(3, -1, -1), targets, 1.0).sum().backward()
    torch.testing.assert_close(fused, logits.grad, rtol=0, atol=1e-6)


def test_the_backward_pass_keeps_the_logits_not_an_fp32_copy() -> None:
    """What autograd holds between the passes: the bf16 logits (2 bytes a value), not a 4-byte copy."""
    logits = torch.randn(2, 5, 30, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        target_logprobs(logits, torch.zeros(2, 5, dtype=torch.long))
    big = [t for t in saved if t.numel() >= 5 * 30]
    assert big and all(t.dtype == torch.bfloat16 for t in big), [(t.dtype, tuple(t.shape)) for t in saved]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_c_kernel_takes_rows_and_matches_the_pytorch_path(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """bf16 logits (a bf16 training pass's) and fp32 ones (an fp32 pass's) go through the C loop
    where it builds (a vocabulary that is not a multiple of 16, a temperature): the log-probs
    within fp32 rounding of PyTorch's, the gradients within one step of the logits' dtype; with
    the kernels off, PyTorch's path."""
    from cgym.agents.local import target_logprobs as module
    from cgym.agents.local.kernels import KERNEL_ENV

    torch.manual_seed(2)
    base = (torch.randn(2, 33, 1007) * 4).to(dtype)
    targets = torch.randint(0, 1007, (2, 33))
    weights = torch.randn(2, 33)
    if module._kernel_for(base[0]) is None:
        pytest.skip("no C compiler or no AVX512-BF16 here: the PyTorch path runs")
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv(KERNEL_ENV, switch)
        assert (module._kernel_for(base[0]) is not None) == (switch == "1")
        logits = base.clone().requires_grad_()
        out = target_logprobs(logits, targets, 0.7)
        (out * weights).sum().backward()
        results.append((out.detach(), logits.grad))
    (kernel, kernel_grad), (plain, plain_grad) = results
    torch.testing.assert_close(kernel, plain, rtol=0, atol=2e-5)
    assert kernel_grad.dtype == dtype
    tolerance = (8e-3, 1e-6) if dtype == torch.bfloat16 else (1e-5, 1e-7)
    torch.testing.assert_close(kernel_grad.float(), plain_grad.float(), rtol=tolerance[0], atol=tolerance[1])
    assert not module._kernel_for(base[0].double()) and not module._kernel_for(base[0][:, ::2])  # fp64, or strided rows


@pytest.mark.parametrize("kernels", ["1", "0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_targets_that_share_a_logit_row_score_and_sum_as_the_repeated_rows_would(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, kernels: str) -> None:
    """A prefix tree's node that several picks score is run through the head once: `rows` maps
    each target to its logit row. Repeated (row, target) pairs and several targets on one row
    give the values and gradients of the logits repeated row by row."""
    from cgym.agents.local.kernels import KERNEL_ENV

    monkeypatch.setenv(KERNEL_ENV, kernels)
    torch.manual_seed(3)
    base = (torch.randn(1, 4, 1007) * 4).to(dtype)
    rows = torch.tensor([[0, 0, 0, 1, 2, 2, 3, 0]])
    targets = torch.tensor([[5, 5, 9, 1006, 7, 8, 0, 5]])
    weights = torch.randn(1, 8)
    results = []
    for shared in (True, False):
        logits = base.clone().requires_grad_()
        out = target_logprobs(logits, targets, 0.7, rows=rows) if shared else _reference(logits[:, rows[0]], targets, 0.7)
        (out * weights).sum().backward()
        results.append((out.detach(), logits.grad))
    (got, got_grad), (want, want_grad) = results
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    assert got_grad.dtype == dtype
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (0, 8e-3)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=rtol, atol=atol)


def test_a_row_the_picks_share_sums_their_gradients_in_pick_order() -> None:
    """The bits do not depend on threads or timing: a row's picks are added in their order (an
    indexed copy's backward adds repeated rows with atomic adds, in a different order run to run)."""
    torch.manual_seed(4)
    logits = torch.randn(1, 2, 64, requires_grad=True)
    rows, targets = torch.tensor([[1, 0, 1, 1]]), torch.tensor([[3, 3, 3, 9]])
    weights = torch.tensor([[1e8, 0.5, -1e8, 0.25]])  # an order-sensitive sum: (1e8 + -1e8) + 0.25 != 1e8 + (-1e8 + 0.25)
    (target_logprobs(logits, targets, rows=rows) * weights).sum().backward()
    total = (weights[0, 0] + weights[0, 2]) + weights[0, 3]
    assert total == 0.25 and (weights[0, 0] + (weights[0, 2] + weights[0, 3])) != total
    softmax = torch.softmax(logits.detach()[0, 1], -1)
    want = -total * softmax
    want[3] += weights[0, 0] + weights[0, 2]
    want[9] += weights[0, 3]
    torch.testing.assert_close(logits.grad[0, 1], want, rtol=1e-5, atol=1e-6)


def test_rows_that_do_not_index_the_logits_are_refused() -> None:
    logits = torch.randn(1, 3, 10)
    with pytest.raises(ValueError, match="rows"):
        target_logprobs(logits, torch.zeros(1, 2, dtype=torch.long), rows=torch.tensor([[0, 3]]))
    with pytest.raises(ValueError, match="rows"):
        target_logprobs(logits, torch.zeros(1, 2, dtype=torch.long), rows=torch.tensor([[0]]))
