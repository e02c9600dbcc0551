"""LoRA layers in fewer products (`lean_adapters`): in fp32 the adapter joins the base product in
one `addmm`, with peft's bits; under bf16 autocast a layer multiplies by its folded weight, the
sampler's bits; peft's own forward everywhere else."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cgym.agents.local.precision import DTYPE_ENV, autocast
from cgym.agents.local.sampling import sequence_logprobs
from transformers import AutoModelForCausalLM

pytest.importorskip("peft")

from cgym.agents.local.lora import lean_adapters, with_lora  # noqa: E402  (after peft is known to be here)

IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29], [2, 6, 10, 14, 18, 22, 26, 30]])


def _lora_model(tiny_chat_model: Path, alpha_over_r: float = 2.0) -> torch.nn.Module:
    torch.manual_seed(0)
    model = with_lora(AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32), 4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # peft starts B at zero: adapters that act
    for module in model.modules():
        if hasattr(module, "lora_A"):
            module.scaling = {name: alpha_over_r for name in module.scaling}
    return model


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with autocast(model):
        loss = -sequence_logprobs(model, IDS, torch.ones_like(IDS)).sum()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def _layer_graph(model: torch.nn.Module) -> set[str]:
    """The autograd node names of one adapted layer's output, two steps back."""
    layer = next(m for m in model.modules() if hasattr(m, "lora_A"))
    out = layer(torch.randn(3, layer.in_features))
    names, frontier = set(), [out.grad_fn]
    for _ in range(2):
        names |= {type(node).__name__ for node in frontier if node is not None}
        frontier = [nxt for node in frontier if node is not None for nxt, _ in node.next_functions]
    return names


def test_adapters_summed_in_one_product_give_peft_bits_in_fp32(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DTYPE_ENV, "float32")
    model = _lora_model(tiny_chat_model)
    plain = _loss_and_grads(model)
    assert "AddmmBackward0" not in _layer_graph(model)
    with lean_adapters(model) as layers:
        assert layers == 2 * 7  # two decoder layers' seven projections (the tied head has no adapter)
        assert "AddmmBackward0" in _layer_graph(model)  # the adapter's sum is one product, not peft's three passes
        lean = _loss_and_grads(model)
    assert torch.equal(plain[0], lean[0])
    assert plain[1].keys() == lean[1].keys() and all(torch.equal(plain[1][k], lean[1][k]) for k in plain[1])
    assert not any("forward" in vars(m) for m in model.modules())  # peft's forward again after the block


def test_adapter_sum_goes_into_the_base_product_in_place(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No copy of the base product: the adapter's product is added into it (`addmm_`), where an
    out-of-place `addmm` copies the full-size output first (inside the op: no `copy_` to see)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    monkeypatch.setenv(DTYPE_ENV, "float32")
    model = _lora_model(tiny_chat_model)
    layer = next(m for m in model.modules() if hasattr(m, "lora_A"))
    x = torch.randn(2, 5, layer.in_features, requires_grad=True)
    with lean_adapters(model), Ops() as ops:
        out = layer(x)
    assert out.shape == (2, 5, layer.out_features)
    assert ops.names.count("addmm_") == 1 and "copy_" not in ops.names and "clone" not in ops.names
    seen: list[torch.Tensor] = []
    layer.base_layer.register_forward_hook(lambda module, args, output: seen.append(output))
    with lean_adapters(model), Ops() as ops:
        layer(x)
    assert "addmm_" not in ops.names and not torch.equal(seen[0], out)  # a hook holds the base product: peft's forward, which leaves it whole
    with torch.no_grad():
        assert torch.equal(out, layer(x))  # peft's forward, bit for bit


def test_a_hook_on_every_module_keeps_the_base_product_whole(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A global forward hook (`register_module_forward_hook`) sees every base layer's output
    too: with one registered, the layers take peft's forward and the output it holds stays the
    base product."""
    from torch.nn.modules.module import register_module_forward_hook

    monkeypatch.setenv(DTYPE_ENV, "float32")
    model = _lora_model(tiny_chat_model)
    layer = next(m for m in model.modules() if hasattr(m, "lora_A"))
    x = torch.randn(2, 5, layer.in_features)
    with torch.no_grad():
        base = layer.base_layer(x)
    seen: list[torch.Tensor] = []
    handle = register_module_forward_hook(lambda module, args, output: seen.append(output) if module is layer.base_layer else None)
    try:
        with lean_adapters(model), torch.no_grad():
            out = layer(x)
    finally:
        handle.remove()
    assert len(seen) == 1 and torch.equal(seen[0], base) and not torch.equal(out, base)


def test_another_scale_rounds_at_most_differently(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """alpha / r not a power of two: one rounding fewer than peft's, so close, not bit for bit."""
    monkeypatch.setenv(DTYPE_ENV, "float32")
    model = _lora_model(tiny_chat_model, alpha_over_r=1 / 3)
    plain = _loss_and_grads(model)
    with lean_adapters(model):
        lean = _loss_and_grads(model)
    assert torch.allclose(plain[0], lean[0], rtol=1e-5, atol=1e-5)
    assert all(torch.allclose(plain[1][k], lean[1][k], rtol=1e-4, atol=1e-6) for k in plain[1])


def test_under_bf16_autocast_a_layer_multiplies_by_the_samplers_folded_weight(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The update's forward scores the policy that sampled: a LoRA model under bf16 autocast gives
    the log-probabilities of its folded copy (`merged`) under autocast, bit for bit, each layer's
    folded weight the sampler's (`folded`) bit for bit, and a new one after the adapters change."""
    from cgym.agents.local.lora import folded, merged

    model = _lora_model(tiny_chat_model)
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    mask = torch.ones_like(IDS)
    adapters = [param for param in model.parameters() if param.requires_grad]
    copies = [merged(model)]  # folded in fp32, outside autocast, as the sampler's copy is
    with torch.no_grad():
        for param in adapters:
            param.mul_(0.5)
        copies.append(merged(model))
        for param in adapters:
            param.mul_(2.0)
    with torch.no_grad(), autocast(model):
        peft = sequence_logprobs(model, IDS, mask)
        with lean_adapters(model) as layers:
            assert layers == 2 * 7
            lean = sequence_logprobs(model, IDS, mask)
            for param in adapters:
                param.mul_(0.5)  # an optimizer step, in place: the folded weights must follow
            moved = sequence_logprobs(model, IDS, mask)
        for param in adapters:
            param.mul_(2.0)
        folded_copy, moved_copy = (sequence_logprobs(copy, IDS, mask) for copy in copies)
    assert torch.equal(moved, moved_copy)
    assert torch.equal(lean, folded_copy) and not torch.equal(moved, lean)
    assert not torch.equal(lean, peft)  # peft rounds its three products apart
    sampler = dict(folded(model, torch.bfloat16).named_modules())
    with lean_adapters(model):
        layer = next(m for m in model.modules() if hasattr(m, "lora_A"))
        weights = vars(layer)["forward"].args[1]
        name = next(n for n, m in model.get_base_model().named_modules() if m is layer)
        weight, bias = weights.of(layer, "default", torch.bfloat16)
        assert torch.equal(weight, sampler[name].weight) and torch.equal(bias, sampler[name].bias)


def test_under_bf16_autocast_the_gradients_are_as_close_to_fp32_as_pefts(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _lora_model(tiny_chat_model)
    monkeypatch.setenv(DTYPE_ENV, "float32")
    exact = _loss_and_grads(model)
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    peft = _loss_and_grads(model)
    with lean_adapters(model):
        lean = _loss_and_grads(model)
    assert lean[1].keys() == exact[1].keys()

    def error(grads: dict[str, torch.Tensor]) -> float:
        return max(float((grads[k] - exact[1][k]).norm() / exact[1][k].norm()) for k in exact[1])

    assert error(lean[1]) < 0.05 and error(lean[1]) < 2 * error(peft[1])
    assert abs(float(lean[0] - exact[0])) < 0.05 * abs(float(exact[0]))
    assert all(param.grad is None for param in model.parameters() if not param.requires_grad)  # the base takes none


def test_bf16_autocast_with_dropout_a_hook_or_disabled_adapters_takes_pefts_forward(tiny_chat_model: Path) -> None:
    model = _lora_model(tiny_chat_model)
    layer = next(m for m in model.modules() if hasattr(m, "lora_A"))
    x = torch.randn(3, layer.in_features)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        peft = layer(x)
        with lean_adapters(model):
            assert not torch.equal(layer(x), peft)  # folded: rounds apart from peft
            with model.disable_adapter():
                assert torch.equal(layer(x), layer.get_base_layer()(x))
            handle = layer.base_layer.register_forward_hook(lambda module, args, output: None)
            assert torch.equal(layer(x), peft)
            handle.remove()
            layer.lora_dropout["default"] = torch.nn.Dropout(0.0)
            assert torch.equal(layer(x), peft)


def test_dora_layers_take_pefts_forward(tiny_chat_model: Path) -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32), LoraConfig(r=4, use_dora=True, target_modules="all-linear")
    )
    layer = next(m for m in model.modules() if hasattr(m, "lora_A"))
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.05)
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        plain = layer(x)
        with lean_adapters(model):
            assert torch.equal(layer(x), plain)
    with lean_adapters(model):
        assert "AddmmBackward0" not in _layer_graph(model)


def test_a_folded_layers_base_makes_no_cast_copy_of_its_weight(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `frozen_weights_cast` too, a layer that multiplies by its folded weight never calls
    its base layer, whose bf16 copy is then never made (one copy of the weights, not two); the
    tied LM head still reads its own."""
    from cgym.agents.local.precision import frozen_weights_cast

    model = _lora_model(tiny_chat_model)
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    with frozen_weights_cast(model), lean_adapters(model):
        _loss_and_grads(model)
        casts = {
            name: vars(module)["forward"].args[1].weights
            for name, module in model.named_modules()
            if "forward" in vars(module) and name.endswith(("base_layer", "lm_head"))
        }
    assert len(casts) == 2 * 7 + 1
    assert all((copy is None) == name.endswith("base_layer") for name, copy in casts.items())
