"""A lean layer's decode step in one C call: the output, the cache and the samples of the layer
run op by op, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cgym.agents.local import layer_step, lean_layers
from cgym.agents.local.lean_layers import sampling_model
from cgym.agents.local.packed import packable
from cgym.agents.local.sampling import sample_batch
from cgym.agents.options import SamplingOptions
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

pytestmark = [
    pytest.mark.skipif(not packable(nn.Linear(2, 2).to(torch.bfloat16)), reason="this PyTorch has no oneDNN packed linear"),
    pytest.mark.skipif(
        layer_step._library() is None or lean_layers._library() is None,
        reason="no AVX-512 or no C compiler here: the layers run op by op",
    ),
]

SIZES = {"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 256, "initializer_range": 0.3}


def _lean(tiny_chat_model: Path, kind: str) -> nn.Module:
    """A lean bf16 Qwen2 (biased query, key and value) or Llama with 64-wide heads, weights sharp
    enough that a last-bit difference changes what is sampled."""
    config = AutoConfig.from_pretrained(tiny_chat_model)
    config.update(SIZES)
    if kind == "llama":
        config = LlamaConfig(**{**config.to_dict(), "model_type": "llama", "attention_bias": False})
    torch.manual_seed(0)
    return sampling_model(AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval().requires_grad_(False))


def _sample(model: nn.Module, temperature: float, draft_tokens: int) -> list:
    head = [1 + 4 * i for i in range(20)]  # shared by every row: served once, as `step_attention` reads it
    prompts = [[*head, 25, 29], [*head, 40, 44, 48, 52, 56, 60], [*head, 7]]  # own tails, left-padded to the longest
    params = SamplingOptions(temperature=temperature, max_new_tokens=40)
    return sample_batch(model, prompts, params=params, stop_ids={0}, pad_id=0, generator=torch.Generator().manual_seed(3), draft_tokens=draft_tokens)


@pytest.mark.parametrize(("kind", "temperature", "draft_tokens"), [("qwen2", 0.0, 4), ("qwen2", 1.0, 0), ("llama", 1.0, 4), ("llama", 0.0, 0)])
def test_one_call_a_step_samples_what_the_layers_op_by_op_sample(
    tiny_chat_model: Path, kind: str, temperature: float, draft_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen2 steps a layer a call, Llama the whole stack of layers in one (its model's forward)."""
    model = _lean(tiny_chat_model, kind)
    ran: list[str] = []

    def counted(name: str, real: object) -> object:
        def call(*args: object) -> object:
            out = real(*args)  # type: ignore[operator]
            ran.extend([name] if out is not None else [])
            return out

        return call

    monkeypatch.setattr("cgym.agents.local.lean_layers.decode_step", counted("layer", layer_step.decode_step))
    monkeypatch.setattr("cgym.agents.local.lean_layers.stack_step", counted("stack", layer_step.stack_step))
    fast = _sample(model, temperature, draft_tokens)
    assert ran.count("stack" if kind == "llama" else "layer") > 10, "the one-call steps ran"
    for name in ("decode_step", "stack_step"):
        monkeypatch.setattr(f"cgym.agents.local.lean_layers.{name}", lambda *args: None)
    assert fast == _sample(model, temperature, draft_tokens)


def test_a_layers_plan_follows_every_address_it_holds(tiny_chat_model: Path) -> None:
    """The plan a layer keeps points at its weights and the prompt's packed keys and values; a new
    prompt (or new weights) comes in new tensors, one of which may land where an old one was:
    every address is checked, or a step would read a freed prompt's values."""
    from cgym.agents.local.step_attention import PackedPrefix

    layer, norms = _lean(tiny_chat_model, "llama").model.layers[0], lean_layers._library()
    keys = torch.zeros((1, 512), dtype=torch.int32)
    first, second = (PackedPrefix(keys, torch.zeros((1, 16, 64)), 16) for _ in range(2))  # the same keys tensor, other values
    assert layer_step._plan(layer, first, norms).prefix_values == first.values.data_ptr()
    assert layer_step._plan(layer, second, norms).prefix_values == second.values.data_ptr()
    assert layer_step._plan(layer, second, norms) is layer_step._plan(layer, second, norms)  # kept while nothing moved
    down = layer.mlp.down_proj
    down.load(torch.ones(down.out_features, down.in_features), None)  # new weights, packed anew
    assert layer_step._plan(layer, second, norms).down == down.packed.data_ptr()


def test_a_model_prepared_twice_steps_as_once(tiny_chat_model: Path) -> None:
    """`sampling_model` on a model it already prepared leaves its body's forward as it was."""
    model = _lean(tiny_chat_model, "llama")
    body = type(model.model)
    assert sampling_model(model) is model and type(model.model) is body
    assert _sample(model, 0.0, 4)


def test_a_step_whose_attention_finds_no_room_runs_op_by_op(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention kernel answers -1 where it cannot have its scratch: the one-call step then
    answers None before the cache's length moves, the layers run op by op over the columns it
    wrote, and the samples are theirs."""
    import ctypes

    no_room = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: -1)  # the attention's every call: no memory for its scratch
    real = layer_step._kernels
    monkeypatch.setattr(layer_step, "_kernels", lambda norms: (*real(norms)[:4], ctypes.cast(no_room, ctypes.c_void_p).value))
    stepped: list[bool] = []

    def counted(*args: object) -> object:
        out = layer_step.stack_step(*args)  # type: ignore[arg-type]
        stepped.append(out is not None)
        return out

    monkeypatch.setattr("cgym.agents.local.lean_layers.stack_step", counted)
    got = _sample(_lean(tiny_chat_model, "llama"), 0.0, 0)
    assert stepped and not any(stepped), "every one-call step declined"
    monkeypatch.setattr("cgym.agents.local.lean_layers.stack_step", lambda *args: None)
    assert got == _sample(_lean(tiny_chat_model, "llama"), 0.0, 0)


def test_a_few_greedy_rows_check_long_drafts_in_the_one_call_step(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three greedy rows draft `LONG_DRAFT_TOKENS` ids a step: 3 query heads x 21 ids, over the
    sixteen a step takes outside `drafting`, still run in one call, with the samples of the
    layers op by op."""
    from cgym.agents.local.lookup import LONG_DRAFT_TOKENS

    model = _lean(tiny_chat_model, "llama")
    widths: list[int] = []

    def counted(layers: object, hidden: torch.Tensor, *args: object) -> object:
        out = layer_step.stack_step(layers, hidden, *args)  # type: ignore[arg-type]
        widths.extend([hidden.shape[1]] if out is not None else [])
        return out

    monkeypatch.setattr("cgym.agents.local.lean_layers.stack_step", counted)
    fast = _sample(model, 0.0, 4)
    assert LONG_DRAFT_TOKENS + 1 in widths
    monkeypatch.setattr("cgym.agents.local.lean_layers.stack_step", lambda *args: None)
    assert fast == _sample(model, 0.0, 4)


def test_a_blocks_plans_are_found_once_and_new_weights_get_new_ones(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampling call finds each layer's plan on its first step and keeps it for the others; the
    next call, after new weights are packed, steps with them: its samples are the layers' op by op."""
    model = _lean(tiny_chat_model, "llama")
    layers = len(model.model.layers)
    found: list[int] = []
    real = layer_step._plan
    monkeypatch.setattr(layer_step, "_plan", lambda *args: found.append(1) or real(*args))
    first = _sample(model, 1.0, 0)
    assert len(found) == layers  # forty ids a row, one plan a layer
    down = model.model.layers[-1].mlp.down_proj
    down.load(torch.randn(down.out_features, down.in_features) * 0.3, None)  # new weights, packed anew
    stepped = _sample(model, 1.0, 0)
    monkeypatch.setattr("cgym.agents.local.lean_layers.stack_step", lambda *args: None)
    assert stepped == _sample(model, 1.0, 0) != first
