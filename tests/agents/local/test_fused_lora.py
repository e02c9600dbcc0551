"""`frozen_weights_cast(fuse_adapters=True)`: a LoRA layer's base and adapter products as one bf16
matmul (`agents.local.fused_lora`), against peft's five steps and against the fp32 answer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cgym.agents.local.fused_lora import _Fused, fusable
from cgym.agents.local.precision import DTYPE_ENV, frozen_weights_cast
from transformers import AutoModelForCausalLM

from tests.agents.local.test_precision import _lora_loss_and_grads

pytest.importorskip("peft")


def lora_model(tiny_chat_model: Path) -> torch.nn.Module:
    from cgym.agents.local.lora import with_lora

    model = with_lora(AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32), 4)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # adapters that act
    return model


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def test_one_layer_matches_the_fp32_product_and_its_gradients() -> None:
    """The fused product and its three gradients equal fp32 math within bf16 rounding."""
    torch.manual_seed(0)
    x = torch.randn(2, 37, 64)
    weight, a, b, bias = torch.randn(48, 64) * 0.1, (torch.randn(8, 64) * 0.1).requires_grad_(), (torch.randn(48, 8) * 0.1).requires_grad_(), torch.randn(48)
    grad = torch.randn(2, 37, 48)
    x_low = x.bfloat16().requires_grad_()
    joined = torch.cat([weight, 2.0 * b.detach()], 1).bfloat16()
    y = _Fused.apply(x_low, a, b, joined, bias.bfloat16(), 2.0)
    y.backward(grad.bfloat16())

    x32 = x.clone().requires_grad_()
    a32, b32 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    want = x32 @ weight.t() + 2.0 * (x32 @ a32.t()) @ b32.t() + bias
    want.backward(grad)
    assert y.dtype == torch.bfloat16 and a.grad is not None and a.grad.dtype == torch.float32 and b.grad is not None
    assert relative(y.float(), want) < 1e-2
    assert relative(x_low.grad.float(), x32.grad) < 1e-2
    assert relative(a.grad, a32.grad) < 1e-2
    assert relative(b.grad, b32.grad) < 1e-2


def test_a_lora_model_fused_is_as_close_to_fp32_as_peft(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loss and adapter gradients of a bf16 LoRA pass with the layers fused: within bf16's
    reach of the fp32 pass, and no farther from it than peft's own bf16 pass; outside the block
    every layer runs peft's forward again."""
    model = lora_model(tiny_chat_model)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29, 3, 7, 11]])
    monkeypatch.setenv(DTYPE_ENV, "float32")
    exact = _lora_loss_and_grads(model, ids)
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    with frozen_weights_cast(model):
        peft = _lora_loss_and_grads(model, ids)
    with frozen_weights_cast(model, fuse_adapters=True) as layers:
        assert layers == 2 * 7 + 1  # two decoder layers' seven projections, and the tied LM head
        fused = _lora_loss_and_grads(model, ids)
    assert not any("forward" in vars(m) for m in model.modules())
    assert not torch.equal(fused[0], peft[0])  # another product: the sum rounds once
    assert abs(float(fused[0] - exact[0])) <= max(abs(float(peft[0] - exact[0])) * 2, 1e-3 * abs(float(exact[0])))
    for name, want in exact[1].items():
        assert relative(fused[1][name], want) < max(2 * relative(peft[1][name], want), 0.02), name


def test_the_joined_weight_follows_each_optimizer_step(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-place change of B (an optimizer step) reaches the next fused pass; A is read at every call."""
    model = lora_model(tiny_chat_model)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    with frozen_weights_cast(model, fuse_adapters=True):
        before = _lora_loss_and_grads(model, ids)[0]
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.add_(0.05)
        after_b = _lora_loss_and_grads(model, ids)[0]
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name:
                    param.mul_(1.5)
        after_a = _lora_loss_and_grads(model, ids)[0]
    with frozen_weights_cast(model):
        peft = _lora_loss_and_grads(model, ids)[0]
    assert not torch.equal(before, after_b) and not torch.equal(after_b, after_a)
    assert abs(float(after_a - peft)) < 1e-2 * abs(float(peft))


def test_layers_that_cannot_fuse_are_left_to_peft(tiny_chat_model: Path) -> None:
    """Dropout or a merged adapter: peft's forward."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32)
    dropped = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear"))
    assert not any(fusable(m) for m in dropped.modules())
    model = lora_model(tiny_chat_model)
    layer = next(m for m in model.modules() if hasattr(m, "base_layer"))
    assert sum(fusable(m) for m in model.modules()) == 2 * 7
    layer.merge()
    assert not fusable(layer) and sum(fusable(m) for m in model.modules()) == 2 * 7 - 1
