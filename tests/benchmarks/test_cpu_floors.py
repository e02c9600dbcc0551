"""The FLOP accounting behind the compute floors: every forward is counted, once, by phase."""

from __future__ import annotations

import pytest
import torch
from cgym.benchmarks.cpu_floors import counting_flops, exp_rate_per_s, figure, forward_exps, forward_flops
from cgym.trainer.tiny import build_tiny
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    corpus = [f"row {i} value {i * 7}" for i in range(100)]
    path = build_tiny(tmp_path_factory.mktemp("tiny"), corpus, vocab_size=300, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, max_positions=128)
    return AutoModelForCausalLM.from_pretrained(path)


def test_forward_flops_is_linear_in_rows_and_grows_with_keys(model: torch.nn.Module) -> None:
    one = forward_flops(model, 1, 1, 10, 1)
    assert forward_flops(model, 4, 1, 10, 1) == pytest.approx(4 * one)
    assert forward_flops(model, 1, 1, 20, 1) > one
    body = sum(p.numel() for p in model.parameters()) - model.config.vocab_size * model.config.hidden_size
    assert one > 2 * body  # the body, plus attention and the LM head


def test_a_packed_copy_counts_the_flops_of_the_model_it_copies(model: torch.nn.Module) -> None:
    """The sampler's packed copy holds its linear weights outside `parameters()`: counted all the same."""
    import copy

    from cgym.agents.local.packed import is_packed, pack_linears, packable

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    if not packable(bf16):
        pytest.skip("this PyTorch has no oneDNN packed linear")
    packed = pack_linears(copy.deepcopy(bf16))
    assert is_packed(packed)
    assert forward_flops(packed, 3, 5, 40, 2) == forward_flops(bf16, 3, 5, 40, 2) == forward_flops(model, 3, 5, 40, 2)


def test_counting_splits_inference_from_training_and_restores_forward(model: torch.nn.Module) -> None:
    cls = type(model)
    original = cls.forward
    ids = torch.randint(0, model.config.vocab_size, (3, 8))
    with counting_flops(cls) as count:
        with torch.inference_mode():
            model(input_ids=ids)
        model(input_ids=ids).logits.sum().backward()
    assert cls.forward is original
    assert count.tokens == {"inference": 24, "training": 24}
    assert count.training == pytest.approx(3 * count.inference)
    row = figure(2.0, count, peak_gflops=100.0)
    assert row["floor_s"] == pytest.approx(count.total / 1e11, abs=0.01)
    assert row["distance"] == pytest.approx(2.0 / (count.total / 1e11), rel=0.05)
    # exps: a forward's, and the backward recomputes them
    assert count.exps == pytest.approx(3 * forward_exps(model, 3, 8, 8))
    with_exp = figure(2.0, count, peak_gflops=100.0, exps_per_s=1e3)
    assert with_exp["floor_with_exp_s"] == pytest.approx(with_exp["floor_s"] + count.exps / 1e3, abs=0.01)


def test_frozen_weights_count_a_backward_of_one_forward(model: torch.nn.Module) -> None:
    """LoRA: the base's weights get no gradient, so a training forward costs 2x, not 3x."""
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    with counting_flops(type(model), weight_gradients=False) as count:
        with torch.inference_mode():
            model(input_ids=ids)
        model(input_ids=ids).logits.sum().backward()
    assert count.training == pytest.approx(2 * count.inference)


def test_forward_exps_counts_each_query_head_layer_and_key_seen(model: torch.nn.Module) -> None:
    cfg = model.config
    assert forward_exps(model, 2, 1, 10) == 2 * cfg.num_attention_heads * cfg.num_hidden_layers * 10
    assert forward_exps(model, 1, 4, 4) == cfg.num_attention_heads * cfg.num_hidden_layers * (1 + 2 + 3 + 4)  # causal
    assert exp_rate_per_s(size=2**16, repeats=2) > 1e6


def test_a_given_4d_mask_counts_the_keys_each_query_sees(model: torch.nn.Module) -> None:
    """A prefix tree's pass sees its nodes' ancestors only: attention is counted from its mask."""
    from cgym.agents.local.prefix_tree import prefix_tree

    tree = prefix_tree([[5, 6, 7, 8], [5, 6, 9, 10], [4, 11]])
    visible = tree.visible()
    with counting_flops(type(model)) as count, torch.inference_mode():
        model(input_ids=torch.tensor(tree.ids)[None], attention_mask=visible[None, None], position_ids=torch.tensor(tree.depth)[None])
    seen = float(visible.sum()) / len(tree)  # (1 + 2 + 3 + 4 + 3 + 4 + 1 + 2) / 8 = 2.5
    assert seen == 2.5
    assert count.exps == pytest.approx(forward_exps(model, 1, 8, 8, seen)) and count.exps < forward_exps(model, 1, 8, 8)
    assert count.inference == pytest.approx(forward_flops(model, 1, 8, 8, 8, seen))


def test_counting_keeps_the_signature_the_fast_paths_read(model: torch.nn.Module) -> None:
    """The sampler and the loss pass choose `logits_to_keep` and shared prompts from the forward's
    signature; counting must not hide it, or the benchmark times slower code than it names."""
    import inspect

    from cgym.agents.local.sampling import _forward_kwargs, _signature_kwargs

    cls = type(model)
    plain = set(inspect.signature(cls.forward).parameters)
    _signature_kwargs.cache_clear()
    with counting_flops(cls):
        assert set(inspect.signature(cls.forward).parameters) == plain
        assert _forward_kwargs(model)[1], "logits_to_keep must stay visible"
    _signature_kwargs.cache_clear()
