"""Pre-packed linear layers for the bf16 sampler: the same products as `F.linear`, the same
samples, weights that follow the trainer's, and no packing where it does not apply."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from cgym.agents.local.kv_cache import weights_version
from cgym.agents.local.packed import PackedLinear, is_packed, pack_linears, packable
from cgym.agents.local.precision import DTYPE_ENV, SamplingWeights, cpu_has_bf16
from cgym.agents.local.sampling import sample_batch
from cgym.agents.options import SamplingOptions
from torch import nn
from transformers import AutoModelForCausalLM


def _bf16_model(path: Path) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval().requires_grad_(False)


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit for bit where the CPU has native bf16 (both sides run oneDNN's bf16 kernel); within
    bf16 rounding elsewhere, where `F.linear` may take another kernel."""
    if cpu_has_bf16():
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)


requires_packing = pytest.mark.skipif(not packable(nn.Linear(2, 2).to(torch.bfloat16)), reason="this PyTorch has no oneDNN packed linear")
requires_onednn_bf16 = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN packs no bf16 weights on this CPU (AVX2 alone)")


@requires_packing
@pytest.mark.parametrize("shape", [(1, 96), (12, 96), (3, 7, 96), (2, 1, 96), (100, 96)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_layer_computes_what_f_linear_does(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(shape).to(torch.bfloat16)
    packed = PackedLinear(linear.weight, linear.bias)
    with torch.no_grad():
        _same(packed(x), linear(x))
        _same(packed(x.transpose(0, -1).contiguous().transpose(0, -1)), linear(x))  # strided input


@requires_packing
def test_a_packed_layer_loads_new_weights_and_refuses_the_wrong_shape() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(32, 48).to(torch.bfloat16)
    packed = PackedLinear(linear.weight, linear.bias)
    fp32 = nn.Linear(32, 48)  # the trainer's master weights: cast on load
    packed.load(fp32.weight, fp32.bias)
    x = torch.randn(5, 32).to(torch.bfloat16)
    with torch.no_grad():
        _same(packed(x), fp32.to(torch.bfloat16)(x))
    with pytest.raises(ValueError, match="48 layer"):
        packed.load(torch.zeros(32, 32), None)


@requires_packing
def test_a_packed_model_gives_the_same_logits_and_samples(tiny_chat_model: Path) -> None:
    plain = _bf16_model(tiny_chat_model)
    packed = pack_linears(copy.deepcopy(plain))
    assert is_packed(packed) and not is_packed(plain)
    # every layer packs; only where oneDNN cannot reorder bf16 (AVX2 alone) does the 600-word head,
    # a shape this project's kernel does not take, stay plain
    reorders = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert [name for name, module in packed.named_modules() if type(module) is nn.Linear] == ([] if reorders else ["lm_head"])
    # the LM head is tied to the embeddings: the embedding keeps the weight, the head packs it
    assert packed.get_input_embeddings().weight.data_ptr() != 0 and (isinstance(packed.lm_head, PackedLinear) or not reorders)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25], [2, 6, 10, 14, 18, 22, 26]])
    with torch.no_grad():
        _same(packed(input_ids=ids).logits, plain(input_ids=ids).logits)
    prompts = [[1, 5, 9, 13], [2, 6, 10, 14, 18, 22], [3, 7]]
    for params in (SamplingOptions(temperature=0.0, max_new_tokens=12), SamplingOptions(temperature=1.0, max_new_tokens=12, seed=3)):
        runs = [sample_batch(model, prompts, params=params, stop_ids={0}, pad_id=0, generator=torch.Generator().manual_seed(3)) for model in (plain, packed)]
        if cpu_has_bf16():
            assert runs[0] == runs[1]
        else:
            assert [s.ids[:1] for s in runs[0]] == [s.ids[:1] for s in runs[1]]


def _kernels_run() -> bool:
    from cgym.agents.local.packed import _library

    return _library() is not None


def _kernel() -> Any:
    from cgym.agents.local.packed import _library

    return _library()


@requires_packing
@pytest.mark.skipif(not _kernels_run(), reason="this project's C kernels do not run here")
@pytest.mark.parametrize("rows", [1, 5, 7, 333])
@pytest.mark.parametrize("bias", [True, False])
def test_the_pair_kernel_rounds_the_exact_sum_once(rows: int, bias: bool) -> None:
    """Blocks of 16 outputs, pairs of inputs, rows five at a time (and a short last block): each
    output is the exact sum of its bf16 products (and bias) rounded once to bf16, give or take
    the fp32 accumulator's last bits."""
    torch.manual_seed(rows)
    linear = nn.Linear(96, 80, bias=bias).to(torch.bfloat16)  # 5 blocks: a group of 4, and 1
    layer = PackedLinear(linear.weight, linear.bias)
    assert layer.pairs
    x = torch.randn(rows, 96).to(torch.bfloat16)
    exact = x.double() @ linear.weight.double().t() + (linear.bias.double() if bias else 0)
    with torch.no_grad():
        out = layer(x).double()
    assert bool(((out - exact).abs() <= exact.abs() * 2**-8 + 1e-5).all())  # half a bf16 step, and fp32's
    assert layer(x[:, None]).shape == (rows, 1, 80)


@requires_packing
@pytest.mark.skipif(not _kernels_run(), reason="this project's C kernels do not run here")
def test_the_pair_kernel_gives_a_row_the_same_bits_in_any_batch() -> None:
    """Tiles of five rows, a short last tile of its own rows, rows widened from 3 rows and the
    widened panel from 96 (1,024 at a time): a row's output does not depend on which rows share
    its call."""
    torch.manual_seed(3)
    linear = nn.Linear(250, 1040).to(torch.bfloat16)
    layer = PackedLinear(linear.weight, linear.bias)
    x = (torch.randn(1100, 250) * torch.randn(1100, 250).mul(3).exp()).to(torch.bfloat16)  # magnitudes far apart: another order would change the rounding
    with torch.no_grad():
        whole = layer(x).view(torch.int16)  # widened 1,024 rows at a time, then 76
        for start, rows in [(0, 1), (3, 2), (7, 3), (11, 4), (0, 6), (20, 7), (2, 13), (1, 48), (5, 55), (1000, 100), (30, 255), (40, 300)]:
            assert torch.equal(layer(x[start : start + rows]).view(torch.int16), whole[start : start + rows]), (start, rows)


@requires_packing
@pytest.mark.skipif(not _kernels_run() or not hasattr(_kernel(), "pair_linear_wide"), reason="no emulated bf16 pair kernel here (native AVX512-BF16, or none)")
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 12, 47, 48, 53, 200, 256])
@pytest.mark.parametrize("bias", [True, False])
def test_the_widened_pair_kernel_gives_the_same_bits_as_the_pair_products(rows: int, bias: bool) -> None:
    """Without AVX512-BF16, many rows take weights widened once into a panel, and a few rows are
    widened themselves with the weights widened pair by pair: the same products summed in the
    same order as the pair-at-a-time loop, so the same bits, on every tile shape (rows not a
    multiple of 5 or 6, a last group of one block, inputs not a multiple of 16)."""
    lib = _kernel()
    torch.manual_seed(rows)
    linear = nn.Linear(250, 1040, bias=bias).to(torch.bfloat16)  # 125 pairs; 65 blocks: 16 groups of 4, and 1
    layer = PackedLinear(linear.weight, linear.bias)
    x = (torch.randn(rows, 250) * torch.randn(rows, 250).mul(3).exp()).to(torch.bfloat16)  # magnitudes far apart: an order changes the rounding

    def run(name: str, threads: int = 2) -> torch.Tensor:
        out = torch.full((rows, 1040), float("nan"), dtype=torch.bfloat16)
        getattr(lib, name)(x.data_ptr(), layer.packed.data_ptr(), layer.wide_bias.data_ptr() if bias else None, out.data_ptr(), rows, 250, 1040, threads)
        return out.view(torch.int16)

    outs = {name: run(name) for name in ("pair_linear_dot", "pair_linear_wide", "pair_linear_rows", "pair_linear")}
    assert torch.equal(outs["pair_linear_wide"], outs["pair_linear_dot"])
    for name, threads in itertools.product(("pair_linear_dot", "pair_linear_wide", "pair_linear_rows"), (1, 3, 5)):
        # more threads than cores: a thread done with its share takes from the others' (`take_unit`)
        assert torch.equal(run(name, threads), outs["pair_linear_dot"]), (name, threads)
    assert torch.equal(outs["pair_linear_rows"], outs["pair_linear_dot"])
    assert torch.equal(outs["pair_linear"], outs["pair_linear_dot"])
    exact = x.double() @ linear.weight.double().t() + (linear.bias.double() if bias else 0)
    scale = x.double().abs() @ linear.weight.double().abs().t()  # the fp32 sums' rounding grows with it
    assert bool(((outs["pair_linear"].view(torch.bfloat16).double() - exact).abs() <= exact.abs() * 2**-8 + scale * 1e-5 + 1e-5).all())


@requires_packing
@requires_onednn_bf16
def test_shapes_and_settings_the_pair_kernel_does_not_take_keep_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    odd = nn.Linear(96, 40).to(torch.bfloat16)  # 40 outputs: not blocks of 16
    assert not PackedLinear(odd.weight, odd.bias).pairs
    x = torch.randn(3, 96).to(torch.bfloat16)
    with torch.no_grad():
        _same(PackedLinear(odd.weight, odd.bias)(x), odd(x))
    monkeypatch.setenv("CGYM_DECODE_KERNEL", "0")
    even = nn.Linear(96, 48).to(torch.bfloat16)
    assert not PackedLinear(even.weight, even.bias).pairs


def test_fp32_and_parameterless_models_are_left_plain(tiny_chat_model: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32)
    assert not packable(model) and pack_linears(model) is model and not is_packed(model)
    assert not packable(nn.Identity())


@requires_packing
@pytest.mark.skipif(not cpu_has_bf16() and not _kernels_run(), reason="no native bf16 and no kernels here")
def test_the_samplers_copy_is_packed_and_follows_the_trainers_weights(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 master weights, full fine-tuning: the bf16 copy is packed once, then refreshed in
    place after each update, packed layers included."""
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32)
    weights = SamplingWeights(model)
    first = weights.get()
    assert is_packed(first) and not is_packed(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "proj" in name:  # linear layers, and the rest left alone
                param.mul_(1.5)
    again = weights.get()
    assert again is first and weights_version(again) == weights_version(model)  # what the caches compare
    fresh = pack_linears(copy.deepcopy(model).to(torch.bfloat16))
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, fresh(input_ids=ids).logits)
        assert not torch.equal(again(input_ids=ids).logits, _bf16_model(tiny_chat_model)(input_ids=ids).logits)


@requires_packing
@pytest.mark.skipif(not cpu_has_bf16() and not _kernels_run(), reason="no native bf16 and no kernels here")
def test_a_lora_models_folded_copy_is_packed_and_its_base_left_alone(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("peft")
    from cgym.agents.local.lora import merged, with_lora

    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    model = with_lora(AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32), 4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.05)
    base = {name: param.clone() for name, param in model.named_parameters() if "lora" not in name}
    folded = SamplingWeights(model).get()
    assert is_packed(folded) and not is_packed(model)
    assert all(torch.equal(param, base[name]) for name, param in model.named_parameters() if "lora" not in name)
    plain = merged(model).to(torch.bfloat16).eval()
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        _same(folded(input_ids=ids).logits, plain(input_ids=ids).logits)


@requires_packing
@pytest.mark.skipif(not cpu_has_bf16() and not _kernels_run(), reason="no native bf16 and no kernels here")
def test_an_inference_only_policy_samples_from_its_own_packed_model(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`cgym eval`'s policies (`load_policy`) pack the model they load, in place; a policy loaded
    to be trained keeps its plain weights; both sample the same turns."""
    from cgym.agents.base import Conversation
    from cgym.agents.local.hf import HFPolicy
    from cgym.agents.spec import load_policy

    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    greedy = SamplingOptions(temperature=0.0, max_new_tokens=16, seed=0)
    trainable = HFPolicy.from_pretrained(tiny_chat_model, sampling=greedy)
    evaluated = load_policy(f"hf:{tiny_chat_model}", greedy)
    assert isinstance(evaluated, HFPolicy) and is_packed(evaluated.model) and evaluated.sampling_weights.get() is evaluated.model
    assert not is_packed(trainable.model) and any(p.requires_grad for p in trainable.model.parameters())
    turns = []
    for policy in (trainable, evaluated):
        conv = Conversation([{"role": "system", "content": "You write JSON reports."}, {"role": "user", "content": "Report customer 7."}])
        turns.append(policy.act([conv])[0])
    assert turns[0].token_ids == turns[1].token_ids
