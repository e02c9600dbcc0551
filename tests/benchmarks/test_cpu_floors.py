"""The FLOP accounting behind the compute floors: every forward is counted, once, by phase."""

from __future__ import annotations

import pytest
import torch
from cgym.benchmarks.cpu_floors import (
    Call,
    FlopCount,
    attention_flops,
    counting_flops,
    exp_rate_per_s,
    figure,
    forward_exps,
    forward_flops,
    phases,
    read_gb_per_s,
    weights,
)
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
    # and the bytes a forward reads: 2 a weight in bf16, packed or not, 4 in fp32
    assert weights(packed).bytes == weights(bf16).bytes == weights(model).bytes // 2


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


def test_a_block_reads_each_models_weights_once(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """Walking a model's modules costs milliseconds a call (~0.9 s of a GRPO step at SmolLM2's
    size under LoRA): the count reads them once per block and model, and counts every call."""
    import copy

    from cgym.benchmarks import cpu_floors

    read: list[int] = []
    monkeypatch.setattr(cpu_floors, "weights", lambda m: read.append(id(m)) or weights(m))
    other = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 4))
    with counting_flops(type(model)) as count, torch.inference_mode():
        for _ in range(3):
            model(input_ids=ids)
            other(input_ids=ids)
    assert sorted(read) == sorted([id(model), id(other)])
    assert len(count.calls) == 6 and count.inference == pytest.approx(6 * forward_flops(model, 2, 4, 4, 4))


def test_frozen_weights_count_the_gradients_of_their_inputs_only(model: torch.nn.Module) -> None:
    """LoRA: the base's weights get no gradient of their own, so their backward costs one
    forward, not two; attention's backward still takes two (queries, keys and values are
    activations), and a trained weight (an adapter) still counts both of its gradients."""
    import copy

    frozen = copy.deepcopy(model).requires_grad_(False)
    adapter = frozen.model.layers[0].mlp.down_proj.weight.requires_grad_(True)
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    with counting_flops(type(frozen)) as count:
        with torch.inference_mode():
            frozen(input_ids=ids)
        frozen(input_ids=ids).logits.sum().backward()
    assert adapter.grad is not None
    assert count.training == pytest.approx(2 * count.inference + attention_flops(frozen, 2, 5, 5) + 2 * adapter.numel() * 10)


def test_the_roofline_takes_each_call_at_its_slower_bound() -> None:
    """A call of many FLOPs is bound by the matmul peak, one that reads much by memory."""
    count = FlopCount(inference=5e9, calls=[Call(0.0, 1e9, 1e9), Call(1.0, 4e9, 1e8)])
    assert count.roofline_s(peak_gflops=100.0, read_gb_per_s=10.0) == pytest.approx(0.1 + 0.04)
    row = figure(0.28, count, peak_gflops=100.0, exps_per_s=None, read_gb_per_s=10.0)
    assert row["roofline_s"] == pytest.approx(0.14) and row["distance_to_roofline"] == pytest.approx(2.0)
    assert row["floor_s"] == pytest.approx(0.05)
    assert read_gb_per_s(size=2**20, repeats=2) > 0.1


def test_a_step_splits_into_its_rollout_and_its_update() -> None:
    """The forwards that began before the rollout ended are the rollout's; the rest the update's."""
    count = FlopCount(inference=1e9, training=4e9, calls=[Call(0.5, 1e9, 0.0), Call(1.5, 4e9, 0.0)])
    assert count.flops_before(1.0) == 1e9
    row = {"step_time_s": 3.0, "rollout_time_s": 1.0, "rollout_tflops": count.flops_before(1.0) / 1e12}
    split = phases(row, count, peak_gflops=4.0)
    assert split["rollout"] == {"seconds": 1.0, "tflops": 0.001, "effective_gflops": 1.0, "of_peak": 0.25}
    assert split["update"] == {"seconds": 2.0, "tflops": 0.004, "effective_gflops": 2.0, "of_peak": 0.5}


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


def test_a_run_keeps_the_best_peak_and_shows_both_readings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rate is taken against the better of the peaks read before and after the work; the
    JSON also keeps both readings, so a host whose speed moved during the run shows it."""
    import cgym.benchmarks.cpu_floors as floors
    import cgym.trainer.embedded as embedded

    readings = iter([100.0, 300.0, 120.0, 250.0])  # bf16 then fp32, before the work and after it
    monkeypatch.setattr(floors, "peak_dtypes", lambda: (torch.bfloat16, torch.float32))
    monkeypatch.setattr(floors, "matmul_peak_gflops", lambda dtype: next(readings))
    monkeypatch.setattr(floors, "exp_rate_per_s", lambda: 1e9)
    monkeypatch.setattr(floors, "read_gb_per_s", lambda: 10.0)
    monkeypatch.setattr(floors, "greedy_eval", lambda *args: (2.0, FlopCount(inference=6e11, exps=1e6, calls=[Call(0.0, 6e11, 1e8)]), 0.5))
    monkeypatch.setattr(embedded, "prepare_models", lambda model: None)
    result = floors.run("unused", steps=0, episodes=1)
    assert result["matmul_peak_gflops"] == {"bfloat16": 120.0, "float32": 300.0}
    assert result["matmul_peak_before_after_gflops"] == {"bfloat16": [100.0, 120.0], "float32": [300.0, 250.0]}


@pytest.mark.parametrize(
    ("flags", "dtypes"),
    [("avx2 fma f16c", ["float32"]), ("avx2 fma f16c avx512f avx512bw avx512vl", ["bfloat16", "float32"])],
    ids=["avx2-alone", "avx-512"],
)
def test_a_cpu_without_bf16_or_avx512_reads_the_fp32_peak_alone(monkeypatch: pytest.MonkeyPatch, flags: str, dtypes: list[str]) -> None:
    import cgym.benchmarks.cpu_floors as floors

    monkeypatch.setenv("CGYM_DTYPE", "float32")
    monkeypatch.setattr(floors, "cpu_flags", lambda: frozenset(flags.split()))
    assert [str(d).removeprefix("torch.") for d in floors.peak_dtypes()] == dtypes
