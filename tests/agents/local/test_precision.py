"""bf16 where the CPU has it: the sampling copy, its log-prob agreement, and the fp32 fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cgym.agents.base import Conversation
from cgym.agents.local import kernels, precision
from cgym.agents.local.hf import HFPolicy
from cgym.agents.local.kv_cache import attention_pairs_on, weights_version
from cgym.agents.local.precision import DTYPE_ENV, SamplingWeights, autocast, compute_dtype, cpu_has_bf16, native_bf16, sampling_dtype
from cgym.agents.local.sampling import sequence_logprobs
from cgym.agents.options import SamplingOptions
from transformers import AutoModelForCausalLM, AutoTokenizer

# bf16 keeps 8 bits of mantissa: on the tiny model the sampler's and the autocast training pass's
# log-probs of the same tokens agree to within this (SmolLM2: up to ~0.2 nats, see the README).
BF16_ATOL = 0.25


def _conversation() -> Conversation:
    return Conversation([{"role": "system", "content": "You write JSON reports."}, {"role": "user", "content": "Report customer 7."}])


ICE_LAKE = "fpu sse2 avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bitalg avx512_vpopcntdq"


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        (ICE_LAKE, False),  # oneDNN calls bf16 supported here, and emulates it at a fifth of fp32's rate
        (ICE_LAKE + " avx512_bf16", True),  # Cooper Lake, Zen 4
        (ICE_LAKE + " amx_bf16 amx_tile", True),  # Sapphire Rapids
        ("", False),
    ],
)
def test_bf16_counts_as_native_only_with_its_instructions(flags: str, native: bool) -> None:
    assert native_bf16(frozenset(flags.split())) is native


def test_a_cpu_without_bf16_instructions_computes_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DTYPE_ENV, raising=False)
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(ICE_LAKE.split()))
    precision.cpu_has_bf16.cache_clear()
    try:
        assert compute_dtype() == torch.float32
    finally:
        precision.cpu_has_bf16.cache_clear()


def test_a_llama_samples_in_bf16_where_the_kernels_run_without_native_bf16(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Training stays fp32 there; a family the kernels do not run, or `CGYM_DTYPE=float32`,
    samples in fp32 too."""
    monkeypatch.delenv(DTYPE_ENV, raising=False)
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    monkeypatch.setattr(precision, "samples_lean", lambda model: model.config.model_type == "qwen2")
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model)  # a Qwen2
    assert compute_dtype() == torch.float32 and sampling_dtype(model) == torch.bfloat16
    weights = SamplingWeights(model)
    assert weights.separate and next(weights.get().parameters()).dtype == torch.bfloat16
    with autocast(model):  # training: fp32, attention on bf16 pairs where the kernels run
        assert not torch.is_autocast_enabled("cpu") and attention_pairs_on() == kernels.available()
    monkeypatch.setattr(precision, "samples_lean", lambda model: False)
    assert sampling_dtype(model) == torch.float32 and SamplingWeights(model).get() is model
    monkeypatch.setattr(precision, "samples_lean", lambda model: True)
    monkeypatch.setenv(DTYPE_ENV, "float32")
    assert sampling_dtype(model) == torch.float32
    with autocast(model):
        assert not attention_pairs_on()


def test_fp32_fallback_uses_the_model_itself(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DTYPE_ENV, "float32")
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model)
    assert compute_dtype() == torch.float32
    weights = SamplingWeights(model)
    assert not weights.separate and weights.get() is model
    assert not torch.is_autocast_enabled("cpu") and type(autocast(model)).__name__ == "nullcontext"


@pytest.mark.skipif(not cpu_has_bf16() and not kernels.available(), reason="no native bf16 and no kernels here")
def test_bf16_sampling_agrees_with_the_training_pass(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model)
    policy = HFPolicy(model, AutoTokenizer.from_pretrained(tiny_chat_model), sampling=SamplingOptions(max_new_tokens=24, seed=0))
    conv = _conversation()
    policy.act([conv])
    sampler = policy.sampling_weights.get()
    assert sampler is not model and next(sampler.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32  # master weights stay fp32
    ids = torch.tensor([conv.token_ids])
    with torch.no_grad(), autocast(model):
        trained = sequence_logprobs(model, ids, torch.ones_like(ids))[0]
    mask = torch.tensor(conv.loss_mask[1:], dtype=torch.bool)
    stored = torch.tensor(conv.logprobs[1:])
    diff = (trained[mask] - stored[mask]).abs()
    assert mask.any() and float(diff.max()) < BF16_ATOL
    assert abs(float(torch.exp(trained[mask] - stored[mask]).mean()) - 1.0) < 0.05


@pytest.mark.skipif(not cpu_has_bf16() and not kernels.available(), reason="no native bf16 and no kernels here")
def test_the_sampling_copy_follows_weight_updates(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model)
    weights = SamplingWeights(model)
    assert weights.separate
    first = weights.get()
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    again = weights.get()
    assert again is first  # refreshed in place, not rebuilt
    torch.testing.assert_close(again.model.embed_tokens.weight.float(), model.model.embed_tokens.weight, atol=0.05, rtol=0.01)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_lora_models_sampling_copy_is_plain_with_the_adapters_folded_in(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Sampling a LoRA-wrapped model runs a plain model in the compute dtype (no adapter matmuls
    per decode step, in fp32 too) that follows the adapters as they train."""
    pytest.importorskip("peft")
    from cgym.agents.local.lora import with_lora

    monkeypatch.setenv(DTYPE_ENV, str(dtype).removeprefix("torch."))
    model = with_lora(AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32), 4)
    weights = SamplingWeights(model)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    versions = []
    for _ in range(2):  # as built, and after the adapters moved
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.add_(0.05)
            expected = model(input_ids=ids).logits
        copy = weights.get()
        assert copy is not model and not any("lora" in name for name, _ in copy.named_parameters())
        assert next(copy.parameters()).dtype == dtype
        tolerance = {"atol": 0.1, "rtol": 0.05} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
        with torch.no_grad():
            torch.testing.assert_close(copy(input_ids=ids).logits.float(), expected, **tolerance)
        assert weights_version(copy) == weights_version(model)  # the caches key on the source's version
        versions.append(weights_version(copy))
        assert weights.get() is copy  # the same version: the same copy, not folded again
    assert versions[0] != versions[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_lora_models_sampling_copy_is_refolded_in_place_bit_for_bit(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """After the adapters train, the sampling copy is the same object holding what a copy folded
    afresh would hold: every packed weight, bias and parameter equal to the bit."""
    pytest.importorskip("peft")
    from cgym.agents.local.lora import with_lora

    monkeypatch.setenv(DTYPE_ENV, str(dtype).removeprefix("torch."))
    torch.manual_seed(0)
    model = with_lora(AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32), 4)
    weights = SamplingWeights(model)
    copy = weights.get()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.05)
        model.base_model.model.model.norm.weight.add_(0.5)  # a weight that is not adapted moves too
    refreshed = weights.get()
    fresh = SamplingWeights(model).get()
    assert refreshed is copy and weights_version(refreshed) == weights_version(model)
    mine, theirs = _held(refreshed), _held(fresh)
    assert mine.keys() == theirs.keys() and len(mine) > 10
    assert all(torch.equal(mine[key], theirs[key]) for key in theirs), [key for key in theirs if not torch.equal(mine[key], theirs[key])]


def _held(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a sampling copy computes with: parameters, buffers, packed weights, biases."""
    held = {name: t for name, t in model.state_dict().items()}
    for name, module in model.named_modules():
        for attr in ("packed", "bias", "wide_bias", "weight"):
            value = module.__dict__.get(attr)
            if isinstance(value, torch.Tensor):
                held[f"{name}.{attr}"] = value.to_dense() if value.is_mkldnn else value  # oneDNN's packed layout
    return held


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_folding_without_a_copy_first_gives_the_merged_model_bit_for_bit(tiny_chat_model: Path, dtype: torch.dtype) -> None:
    """`folded` builds what `merged(model).to(dtype)` builds (every weight and buffer, the tied LM
    head still tied) without copying the wrapped model, and leaves it as it was."""
    pytest.importorskip("peft")
    from cgym.agents.local.lora import folded, merged, with_lora

    model = with_lora(AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32), 4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.05)
    before = {name: param.clone() for name, param in model.named_parameters()}
    expected, got = merged(model).to(dtype), folded(model, dtype)
    assert type(got) is type(expected) and not any("lora" in name for name in got.state_dict())
    assert got.state_dict().keys() == expected.state_dict().keys()
    assert all(torch.equal(got.state_dict()[k], v) for k, v in expected.state_dict().items())
    assert all(torch.equal(got.get_buffer(k), v) for k, v in expected.named_buffers())
    assert got.lm_head.weight is got.model.embed_tokens.weight  # tied, as in the model
    assert all(torch.equal(param, before[name]) for name, param in model.named_parameters())
    assert all(p.data_ptr() != q.data_ptr() for p in got.parameters() for q in model.parameters())


def _lora_loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with autocast(model):
        logp = sequence_logprobs(model, ids, torch.ones_like(ids))
    loss = -logp.sum()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def test_frozen_weights_cast_once_give_the_same_loss_and_gradients(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A LoRA model's frozen layers read one bf16 copy of their weights under autocast: the loss
    and the adapters' gradients are bit for bit autocast's own, and the layers read the copy
    made at entry (a change of the fp32 weight inside the block does not reach them)."""
    pytest.importorskip("peft")
    from cgym.agents.local.lora import with_lora
    from cgym.agents.local.precision import frozen_weights_cast

    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    model = with_lora(AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32), 4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # adapters that act, so their input casts matter
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])
    plain = _lora_loss_and_grads(model, ids)
    flags = [vars(m).get("cast_input_dtype_enabled", "unset") for m in model.modules()]
    with frozen_weights_cast(model) as layers:
        assert layers == 2 * 7 + 1  # two decoder layers' seven projections, and the tied LM head
        cast = _lora_loss_and_grads(model, ids)
        base = next(m.base_layer for m in model.modules() if hasattr(m, "base_layer"))
        kept = base.weight.detach().clone()
        with torch.no_grad():
            base.weight.mul_(2.0)
        assert torch.equal(_lora_loss_and_grads(model, ids)[0], cast[0])
        with torch.no_grad():
            base.weight.copy_(kept)
    assert torch.equal(plain[0], cast[0])
    assert plain[1].keys() == cast[1].keys() and all(torch.equal(plain[1][k], cast[1][k]) for k in plain[1])
    # afterwards every layer reads its own weights again, and the adapters cast their input as before
    assert not any("forward" in vars(m) for m in model.modules())
    assert [vars(m).get("cast_input_dtype_enabled", "unset") for m in model.modules()] == flags
    with torch.no_grad():
        base.weight.mul_(2.0)
    assert not torch.equal(_lora_loss_and_grads(model, ids)[0], plain[0])


def test_frozen_weights_cast_changes_nothing_in_fp32_or_full_fine_tuning(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cgym.agents.local.precision import frozen_weights_cast

    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32)
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    with frozen_weights_cast(model) as layers:  # every weight trains
        assert layers == 0
    monkeypatch.setenv(DTYPE_ENV, "float32")
    model.requires_grad_(False)
    with frozen_weights_cast(model) as layers:  # fp32 compute: no autocast to serve
        assert layers == 0 and not any("forward" in vars(m) for m in model.modules())


def test_a_computing_in_block_sets_the_compute_dtype_and_the_env_still_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    from cgym.agents.local.precision import computing_in

    monkeypatch.delenv(DTYPE_ENV, raising=False)
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    assert compute_dtype() == torch.bfloat16
    with computing_in(torch.float32):
        assert compute_dtype() == torch.float32 and not precision.kernels_in_fp32()  # as CGYM_DTYPE=float32 sets it
        monkeypatch.setenv(DTYPE_ENV, "bfloat16")
        assert compute_dtype() == torch.bfloat16  # the user's word
        monkeypatch.delenv(DTYPE_ENV)
    assert compute_dtype() == torch.bfloat16
