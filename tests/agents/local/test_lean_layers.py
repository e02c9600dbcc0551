"""The sampler's lean Llama layers: the same logits and samples as transformers' layers, bit for
bit on CPUs with native bf16; fused weights that follow the trainer's; other layers untouched."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from cgym.agents.local import lean_layers
from cgym.agents.local.kernels import AVX512, KERNEL_ENV, cpu_flags
from cgym.agents.local.lean_layers import fits, is_lean, sampling_model
from cgym.agents.local.packed import FusedLinear, PackedLinear, pack_linears, packable
from cgym.agents.local.precision import DTYPE_ENV, SamplingWeights, cpu_has_bf16
from cgym.agents.local.sampling import sample_batch
from cgym.agents.options import SamplingOptions
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

pytestmark = [
    pytest.mark.skipif(not packable(nn.Linear(2, 2).to(torch.bfloat16)), reason="this PyTorch has no oneDNN packed linear"),
    pytest.mark.skipif(
        not cpu_has_bf16() and lean_layers._library() is None, reason="no native bf16 and no kernels here: the packed layers' sums may differ from F.linear's"
    ),
]


SIZES = {"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 256, "initializer_range": 0.3}


def _model(tiny_chat_model: Path, kind: str = "qwen2") -> nn.Module:
    """A bf16 Qwen2 (the tiny model's family: biased query, key and value projections) or Llama,
    with 64-wide heads (the attention kernels' size) and weights sharp enough that small
    differences change the sampled ids."""
    config = AutoConfig.from_pretrained(tiny_chat_model)
    config.update(SIZES)
    if kind == "llama":
        config = LlamaConfig(**{**config.to_dict(), "model_type": "llama", "attention_bias": False})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval().requires_grad_(False)


def _pair(tiny_chat_model: Path, kind: str = "qwen2") -> tuple[nn.Module, nn.Module]:
    """The same weights as transformers' layers (linear layers packed) and as lean layers."""
    model = _model(tiny_chat_model, kind)
    return pack_linears(copy.deepcopy(model)), sampling_model(model)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_lean_layers_replace_every_layers_projections(tiny_chat_model: Path, kind: str) -> None:
    plain, lean = _pair(tiny_chat_model, kind)
    assert type(plain.model.layers[0]).__name__.lower().startswith(kind)
    for layer in lean.model.layers:
        assert is_lean(layer) and isinstance(layer, type(plain.model.layers[0]))
        assert isinstance(layer.self_attn.qkv_proj, FusedLinear) and layer.self_attn.qkv_proj.widths == [192, 64, 64]
        assert isinstance(layer.mlp.gate_up_proj, FusedLinear) and layer.mlp.gate_up_proj.widths == [256, 256]
        assert not any(hasattr(layer.self_attn, name) for name in ("q_proj", "k_proj", "v_proj"))
        assert isinstance(layer.self_attn.o_proj, PackedLinear) and isinstance(layer.mlp.down_proj, PackedLinear)
    # the 600-word head stays plain only where oneDNN packs no bf16 weights (AVX2 alone)
    plain_left = [] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else ["lm_head"]
    assert [name for name, module in lean.named_modules() if type(module) is nn.Linear] == plain_left
    assert not any(is_lean(layer) for layer in plain.model.layers)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_a_lean_model_gives_the_same_logits_with_padding_and_through_the_cache(tiny_chat_model: Path, kind: str) -> None:
    plain, lean = _pair(tiny_chat_model, kind)
    ids = torch.tensor([[0, 0, 5, 9, 13, 17, 21], [2, 6, 10, 14, 18, 22, 26]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    with torch.no_grad():
        assert torch.equal(lean(input_ids=ids, attention_mask=mask).logits, plain(input_ids=ids, attention_mask=mask).logits)
        caches = [model(input_ids=ids[:, :5], attention_mask=mask[:, :5], use_cache=True).past_key_values for model in (plain, lean)]
        steps = [model(input_ids=ids[:, 5:], attention_mask=mask, cache=cache, use_cache=True).logits for model, cache in zip((plain, lean), caches)]
    assert torch.equal(steps[0], steps[1])


@pytest.mark.parametrize(("kind", "temperature"), [("qwen2", 0.0), ("qwen2", 1.0), ("llama", 1.0)])
def test_a_lean_model_samples_the_same_ids_and_logprobs(tiny_chat_model: Path, kind: str, temperature: float) -> None:
    plain, lean = _pair(tiny_chat_model, kind)
    prompts = [[1, 5, 9, 13, 17, 21, 25, 29], [1, 5, 9, 13, 17, 21, 40, 44, 48], [1, 5, 9, 13, 17, 21, 7]]  # a shared head, own tails
    params = SamplingOptions(temperature=temperature, max_new_tokens=24)
    runs = [sample_batch(model, prompts, params=params, stop_ids={0}, pad_id=0, generator=torch.Generator().manual_seed(3)) for model in (plain, lean)]
    if AVX512 <= cpu_flags():
        assert runs[0] == runs[1]
    else:  # PyTorch sums 8 lanes at a time here, the kernels' norm 16: its rare last-bit differences show
        assert [sample.ids for sample in runs[0]] == [sample.ids for sample in runs[1]]
        assert all(abs(a - b) <= 1e-2 for one, other in zip(*runs, strict=True) for a, b in zip(one.logprobs, other.logprobs, strict=True))
    assert sum(len(sample.ids) for sample in runs[0]) >= 30


def test_a_policys_turns_over_a_shared_prompt_are_the_same(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy's path: the system prompt's keys shared by all rows, the attention kernels,
    turns continued from the turn cache."""
    from cgym.agents.base import Conversation
    from cgym.agents.local.hf import HFPolicy
    from transformers import AutoTokenizer

    monkeypatch.setenv(DTYPE_ENV, "bfloat16")  # the policy samples from the model it is given
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    turns = []
    for model in _pair(tiny_chat_model):
        policy = HFPolicy(model, tokenizer, sampling=SamplingOptions(temperature=1.0, max_new_tokens=16, seed=0))
        convs = [
            Conversation([{"role": "system", "content": "You write JSON reports for the customers."}, {"role": "user", "content": f"Report customer {i}."}])
            for i in (3, 40, 7)
        ]
        first = policy.act(convs)
        for conv, turn in zip(convs, first, strict=True):
            conv.messages += [{"role": "assistant", "content": turn.text}, {"role": "user", "content": "Now the summary."}]
        second = policy.act(convs)
        assert policy.turn_cache is not None and policy.turn_cache.hits == len(convs)
        turns.append([(turn.token_ids, turn.logprobs) for turn in (*first, *second)])
    assert turns[0] == turns[1]


def test_the_samplers_copy_is_lean_and_its_fused_weights_follow_the_trainers(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    master = _model(tiny_chat_model).float()
    weights = SamplingWeights(master)
    copy_ = weights.get()
    assert isinstance(copy_.model.layers[0].self_attn.qkv_proj, FusedLinear)
    with torch.no_grad():
        for name, param in master.named_parameters():
            if name.endswith(("k_proj.weight", "up_proj.weight")):  # a middle part of each fused layer
                param.mul_(-1.5)
    assert weights.get() is copy_
    fresh = pack_linears(copy.deepcopy(master).to(torch.bfloat16))
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        assert torch.equal(copy_(input_ids=ids).logits, fresh(input_ids=ids).logits)


def test_a_dropped_copys_layers_go_with_it_without_the_garbage_collector(tiny_chat_model: Path) -> None:
    """No layer refers to itself (a bound forward would): a LoRA trainer folds a new copy at every
    optimizer step, and each old one's weights must go when it is dropped."""
    import gc
    import weakref

    lean = sampling_model(_model(tiny_chat_model))
    layer = weakref.ref(lean.model.layers[0])
    gc.disable()
    try:
        del lean
        assert layer() is None
    finally:
        gc.enable()


def test_other_layers_keep_their_forward(tiny_chat_model: Path) -> None:
    qwen3 = _model(tiny_chat_model)
    for layer in qwen3.model.layers:
        layer.self_attn.q_norm = nn.Identity()  # a structure the lean forward does not reproduce
    assert not any(fits(layer) for layer in qwen3.model.layers)
    sampling_model(qwen3)
    assert not any(is_lean(layer) for layer in qwen3.model.layers) and isinstance(qwen3.model.layers[0].self_attn.q_proj, PackedLinear)
    other = _model(tiny_chat_model)
    other.config.model_type = "qwen2_moe"  # a family not listed
    sampling_model(other)
    assert not any(is_lean(layer) for layer in other.model.layers)
    fp32 = _model(tiny_chat_model).float()
    assert sampling_model(fp32) is fp32 and type(fp32.model.layers[0].self_attn.q_proj) is nn.Linear


def test_a_fused_layer_with_some_biases_and_the_wrong_shapes() -> None:
    torch.manual_seed(0)
    parts = [nn.Linear(32, 48, bias=True).to(torch.bfloat16), nn.Linear(32, 16, bias=False).to(torch.bfloat16)]
    fused = FusedLinear(("a", "b"), parts)
    x = torch.randn(5, 32).to(torch.bfloat16)
    with torch.no_grad():
        first, second = fused(x).split(fused.widths, dim=-1)
        assert torch.equal(first, PackedLinear(parts[0].weight, parts[0].bias)(x))
        assert torch.equal(second, PackedLinear(parts[1].weight, None)(x))
    with pytest.raises(ValueError, match=r"\[48, 48\]"):
        fused.load_parts([parts[0], parts[0]])
    assert "parts=a+b" in repr(fused)


def _torch_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    wide = x.float()
    return norm.weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)


@pytest.mark.skipif(lean_layers._library() is None, reason="no C compiler or no AVX512-BF16 here: the PyTorch ops run")
def test_the_norm_kernel_is_transformers_norm_within_its_sums_order(tiny_chat_model: Path) -> None:
    norm = _model(tiny_chat_model).model.layers[0].input_layernorm
    torch.manual_seed(0)
    norm.weight.copy_(torch.randn(192))  # not the ones it starts from: the scaling's rounding shows
    for rows in (1, 7, 3000):  # one thread, and several
        x = (torch.randn(rows, 192) * 3).to(torch.bfloat16)
        got, want = lean_layers._rms_norm(x, norm), _torch_norm(x, norm)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        assert float((got == want).double().mean()) > 0.999
        # a normalised value one bf16 step apart, then scaled and rounded: at most two steps
        torch.testing.assert_close(got.float(), want.float(), atol=0.0, rtol=2**-6)


@pytest.mark.skipif(lean_layers._library() is None, reason="no C compiler or no AVX512-BF16 here: the PyTorch ops run")
def test_the_rotation_kernel_is_bit_for_bit_the_rotary_embedding() -> None:
    torch.manual_seed(0)
    batch, steps, heads, kv_heads, dim = 3, 5, 9, 3, 64
    fused = torch.randn(batch, steps, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
    cos, sin = (torch.randn(batch, steps, dim).to(torch.bfloat16) for _ in range(2))
    rotated = fused.clone()
    assert lean_layers._rotate_in_place(rotated, cos, sin, heads + kv_heads)
    for start, count in ((0, heads), (heads, kv_heads)):
        part = fused[..., start * dim : (start + count) * dim].view(batch, steps, count, dim).transpose(1, 2)
        got = rotated[..., start * dim : (start + count) * dim].view(batch, steps, count, dim).transpose(1, 2)
        assert torch.equal(got, lean_layers.rotated(part, cos.unsqueeze(1), sin.unsqueeze(1)))
    assert torch.equal(rotated[..., (heads + kv_heads) * dim :], fused[..., (heads + kv_heads) * dim :])  # the values untouched
    assert not lean_layers._rotate_in_place(fused.float(), cos.float(), sin.float(), heads)


@pytest.mark.skipif(lean_layers._library() is None, reason="no C compiler or no AVX512-BF16 here: the PyTorch ops run")
def test_the_gate_kernel_is_silu_times_up_within_its_exps() -> None:
    torch.manual_seed(0)
    for rows in (1, 3000):
        gate_up = (torch.randn(rows, 2 * 256) * 4).to(torch.bfloat16)
        gate, up = gate_up.chunk(2, dim=-1)
        got, want = lean_layers._gated(gate_up), nn.functional.silu(gate) * up
        assert got.shape == want.shape and float((got == want).double().mean()) > 0.999
        torch.testing.assert_close(got.float(), want.float(), atol=1e-30, rtol=2**-6)


def test_switched_off_the_layers_run_pytorch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KERNEL_ENV, "0")
    fused = torch.randn(1, 1, 3 * 64).to(torch.bfloat16)
    cos, sin = (torch.randn(1, 1, 64).to(torch.bfloat16) for _ in range(2))
    assert lean_layers._library() is None and not lean_layers._rotate_in_place(fused, cos, sin, 2)


@pytest.mark.skipif(lean_layers._library() is None, reason="no C compiler or no AVX-512 here: PyTorch rotates")
@pytest.mark.parametrize(("batch", "heads", "length", "shared"), [(1, 9, 37, False), (2, 3, 5, True), (3, 2, 70, False)])
def test_the_fp32_rotary_embedding_gives_pytorchs_values_and_gradients(batch: int, heads: int, length: int, shared: bool) -> None:
    """In one C pass each way: every output and input gradient equal to PyTorch's ops on the same
    strided queries (a fused projection's view). The values are chosen so that one fused
    multiply-add in place of a product and a sum changes some of them."""
    torch.manual_seed(length)
    x = torch.randn(batch, length, heads + 5, 64)[:, :, :heads].transpose(1, 2)
    cos, sin = (torch.randn(1 if shared else batch, 1, length, 64) for _ in range(2))
    assert lean_layers._Rotary.fits(x, cos, sin)
    fused, plain = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    half = 32
    expected = plain * cos + torch.cat((-plain[..., half:], plain[..., :half]), dim=-1) * sin
    got = lean_layers.rotated(fused, cos, sin)
    grad = torch.randn_like(got)
    got.backward(grad)
    expected.backward(grad)
    assert torch.equal(got, expected) and torch.equal(fused.grad, plain.grad)


def test_rotary_embeddings_the_kernel_does_not_take_run_pytorchs_ops() -> None:
    x = torch.randn(1, 2, 3, 64)
    cos, sin = torch.randn(1, 1, 3, 64), torch.randn(1, 1, 3, 64)
    for args in (
        (x.double(), cos.double(), sin.double()),
        (x[..., :48], cos[..., :48], sin[..., :48]),
        (x, cos.transpose(2, 3).contiguous().transpose(2, 3), sin),
    ):
        assert not lean_layers._Rotary.fits(*args)
        assert torch.allclose(
            lean_layers.rotated(*args),
            args[0] * args[1] + torch.cat((-args[0][..., args[0].shape[-1] // 2 :], args[0][..., : args[0].shape[-1] // 2]), -1) * args[2],
        )
