"""RMSNorm, the SiLU gate and the rotary embedding in one C pass each (`training_ops`):
transformers' outputs and gradients within fp32 rounding (the rotary embedding's exactly), and
transformers' own forward wherever the kernels do not apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cgym.agents.local import training_ops
from cgym.agents.local.precision import DTYPE_ENV, autocast
from cgym.agents.local.sampling import sequence_logprobs
from cgym.agents.local.training_ops import fused_training_ops, gated, rms_norm
from cgym.trainer.recompute import recomputed_layers
from transformers import AutoModelForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRMSNorm

pytestmark = pytest.mark.skipif(training_ops._library() is None, reason="the C kernels do not run here")

IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29], [2, 6, 10, 14, 18, 22, 26, 30]])


def _norm(width: int, trained: bool = False) -> LlamaRMSNorm:
    torch.manual_seed(0)
    norm = LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    norm.weight.requires_grad_(trained)
    return norm


def _forward_backward(fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward(torch.linspace(-2.0, 2.0, out.numel()).view(out.shape))
    return out.detach(), [leaf.grad for leaf in leaves]


def _float64(fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return _forward_backward(fn, *(x.double() for x in inputs))


@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 7, 576), (1, 300, 64), (3, 5, 40)])  # 40: a last block of 8 lanes
def test_the_norm_and_its_gradient_match_transformers_within_fp32_rounding(shape: tuple[int, ...]) -> None:
    norm = _norm(shape[-1])
    x = torch.randn(shape) * 3
    ours, (our_dx,) = _forward_backward(lambda t: rms_norm(norm, t), x)
    theirs, (their_dx,) = _forward_backward(norm, x)
    exact, (exact_dx,) = _float64(lambda t: norm.weight.double() * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)), x)
    # as close to the float64 answer as transformers' own fp32 ops, give or take a rounding
    assert (ours.double() - exact).abs().max() <= 2 * (theirs.double() - exact).abs().max() + 1e-6
    assert (our_dx.double() - exact_dx).abs().max() <= 2 * (their_dx.double() - exact_dx).abs().max() + 1e-6
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_dx, their_dx, rtol=1e-5, atol=1e-5)


def test_a_norm_whose_weight_trains_or_rows_not_contiguous_keep_transformers_forward() -> None:
    strided = torch.randn(2, 64, 3).transpose(1, 2)
    for norm, x in ((_norm(64, trained=True), torch.randn(2, 3, 64)), (_norm(64), strided)):
        assert torch.equal(rms_norm(norm, x), norm(x))
    trained = _norm(64, trained=True)
    rms_norm(trained, torch.randn(2, 3, 64, requires_grad=True)).sum().backward()
    assert trained.weight.grad is not None  # the weight's gradient is transformers' to give


@pytest.mark.parametrize("shape", [(1, 1536), (5, 17), (2, 3, 64)])
def test_the_gate_and_its_gradients_match_silu_times_up_within_fp32_rounding(shape: tuple[int, ...]) -> None:
    torch.manual_seed(1)
    gate, up = torch.randn(shape) * 5, torch.randn(shape)
    gate.view(-1)[:4] = torch.tensor([-100.0, -88.0, 0.0, 100.0])  # past exp's range either way, and zero
    ours, our_grads = _forward_backward(gated, gate, up)
    theirs, their_grads = _forward_backward(lambda a, u: torch.nn.functional.silu(a) * u, gate, up)
    exact, exact_grads = _float64(lambda a, u: torch.nn.functional.silu(a) * u, gate, up)
    assert torch.isfinite(ours).all() and all(torch.isfinite(g).all() for g in our_grads)
    assert (ours.double() - exact).abs().max() <= 2 * (theirs.double() - exact).abs().max() + 1e-6
    for mine, other, truth in zip(our_grads, their_grads, exact_grads, strict=True):
        assert (mine.double() - truth).abs().max() <= 2 * (other.double() - truth).abs().max() + 1e-6
        torch.testing.assert_close(mine, other, rtol=1e-5, atol=1e-5)


def test_under_autocast_fp32_rows_take_the_kernels_and_bf16_ones_pytorchs() -> None:
    """Autocast leaves the norm's and the gate's ops in their inputs' dtype: fp32 rows (the
    residual stream a bf16-autocast pass normalises) get the kernels' fp32 answer, bf16 ones
    (its gates) PyTorch's ops."""
    norm, x = _norm(64), torch.randn(2, 3, 64)
    gate, up = torch.randn(4, 32), torch.randn(4, 32)
    calls = {"norm": 0, "gate": 0}
    outside = rms_norm(norm, x), gated(gate, up)
    with pytest.MonkeyPatch.context() as patch, torch.autocast("cpu", dtype=torch.bfloat16):
        patch.setattr(training_ops._Norm, "apply", _counting(training_ops._Norm.apply, calls, "norm"))
        patch.setattr(training_ops._Gate, "apply", _counting(training_ops._Gate.apply, calls, "gate"))
        inside = rms_norm(norm, x), gated(gate, up)
        theirs = norm(x)
        half_gate, half_up = gate.bfloat16(), up.bfloat16()
        assert torch.equal(gated(half_gate, half_up), torch.nn.functional.silu(half_gate) * half_up)
    assert calls == {"norm": 1, "gate": 1}
    assert all(torch.equal(a, b) for a, b in zip(inside, outside, strict=True))
    assert theirs.dtype == torch.float32  # transformers' norm under autocast: fp32 too
    torch.testing.assert_close(inside[0], theirs, rtol=1e-5, atol=1e-5)


def test_bf16_queries_by_fp32_tables_rotate_as_pytorch_promotes_them() -> None:
    """A bf16-autocast pass's rotary embedding: bf16 queries and keys, fp32 cos and sin. The C
    pass takes them widened: the same outputs bit for bit, and gradients as close to float64's
    as PyTorch's (which rounds each product's gradient to bf16 before adding them)."""
    torch.manual_seed(2)
    q, k = torch.randn(2, 4, 7, 64).bfloat16(), torch.randn(2, 2, 7, 64).bfloat16()
    angles = torch.randn(1, 7, 64)
    cos, sin = angles.cos(), angles.sin()
    original = modeling_llama.apply_rotary_pos_emb
    calls = {"rotary": 0}

    def run(fn, wide: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        leaves = [(t.double() if wide else t.clone()).requires_grad_(True) for t in (q, k)]
        tables = (cos.double(), sin.double()) if wide else (cos, sin)
        outs = fn(*leaves, *tables)
        sum((out * torch.linspace(-2.0, 2.0, out.numel(), dtype=out.dtype).view(out.shape)).sum() for out in outs).backward()
        return [out.detach() for out in outs], [leaf.grad for leaf in leaves]

    with pytest.MonkeyPatch.context() as patch:
        from cgym.agents.local import lean_layers

        patch.setattr(lean_layers._Rotary, "apply", _counting(lean_layers._Rotary.apply, calls, "rotary"))
        ours, our_grads = run(lambda a, b, c, s: training_ops._rotary_embedding(original, a, b, c, s))
    assert calls == {"rotary": 2}
    theirs, their_grads = run(original)
    _, exact_grads = run(original, wide=True)
    assert all(out.dtype == torch.float32 for out in ours)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    for mine, other, truth in zip(our_grads, their_grads, exact_grads, strict=True):
        assert mine.dtype == torch.bfloat16
        assert (mine.double() - truth).abs().max() <= (other.double() - truth).abs().max()


def test_a_model_under_the_block_gives_its_loss_and_lora_gradients_within_rounding(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("peft")
    from cgym.agents.local.lora import with_lora

    monkeypatch.setenv(DTYPE_ENV, "float32")
    torch.manual_seed(0)
    model = with_lora(AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32), 4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)

    def loss_and_grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with autocast(model):
            loss = -sequence_logprobs(model, IDS, torch.ones_like(IDS)).sum()
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}

    plain_loss, plain_grads = loss_and_grads()
    with fused_training_ops(model), recomputed_layers(model):  # the layers run again in the backward pass, through the kernels
        recomputed_loss, recomputed_grads = loss_and_grads()
    torch.testing.assert_close(recomputed_loss, plain_loss, rtol=1e-5, atol=1e-4)
    for name, grad in recomputed_grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    calls = {"norm": 0, "gate": 0}
    monkeypatch.setattr(training_ops._Norm, "apply", _counting(training_ops._Norm.apply, calls, "norm"))
    monkeypatch.setattr(training_ops._Gate, "apply", _counting(training_ops._Gate.apply, calls, "gate"))
    with fused_training_ops(model) as count:
        assert count == 2 * 2 + 1 + 2 + 1  # two layers' two norms, the final norm, two MLPs, Llama's rotary function
        loss, grads = loss_and_grads()
    assert calls == {"norm": 5, "gate": 2}  # every one ran in the kernels
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-4)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    calls.update(norm=0, gate=0)
    assert torch.equal(loss_and_grads()[0], plain_loss)  # the block gave the forwards back
    assert calls == {"norm": 0, "gate": 0}


def _counting(apply, calls: dict[str, int], key: str):
    def counted(*args):
        calls[key] += 1
        return apply(*args)

    return counted


def test_the_rotary_embedding_under_the_block_is_transformers_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A LoRA model with 64-wide heads (the C pass's): under the block each layer rotates its
    queries and keys in `lean_layers`' C pass, and the loss and every gradient are the same bits
    as transformers' rotary embedding gives (the norms and gates left as transformers runs them);
    after it, Llama's modeling module holds its own function again."""
    pytest.importorskip("peft")
    from cgym.agents.local import lean_layers

    model = _llama_lora_with_wide_heads()

    def loss_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = -sequence_logprobs(model, IDS, torch.ones_like(IDS)).sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    original = modeling_llama.apply_rotary_pos_emb
    plain_loss, plain_grads = loss_and_grads()
    calls = {"rotary": 0}
    monkeypatch.setattr(lean_layers._Rotary, "apply", _counting(lean_layers._Rotary.apply, calls, "rotary"))
    monkeypatch.setattr(training_ops, "NORMS", ())
    monkeypatch.setattr(training_ops, "MLPS", ())
    with fused_training_ops(model) as count:
        assert count == 1
        loss, grads = loss_and_grads()
        q, k, cos, sin = torch.randn(1, 2, 5, 64), torch.randn(1, 1, 5, 64), torch.randn(1, 5, 64), torch.randn(1, 5, 64)
        by_keyword = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # transformers' own function takes it
        assert all(torch.equal(a, b) for a, b in zip(by_keyword, original(q, k, cos, sin), strict=True))
    assert calls["rotary"] == 2 * 2  # each layer's queries and keys
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(grads, plain_grads, strict=True))
    assert modeling_llama.apply_rotary_pos_emb is original


def test_under_bf16_autocast_the_norms_and_rotations_run_in_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A LoRA model's pass under bf16 autocast (a CPU with native bf16): under the block its
    norms (fp32 rows) and its rotations (bf16 queries and keys, widened) run in the C passes and
    its gates (bf16) as PyTorch's; the loss and every LoRA gradient are plain autocast's
    within rounding."""
    pytest.importorskip("peft")
    from cgym.agents.local import lean_layers

    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    model = _llama_lora_with_wide_heads()

    def loss_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with autocast(model):
            loss = -sequence_logprobs(model, IDS, torch.ones_like(IDS)).sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    plain_loss, plain_grads = loss_and_grads()
    calls = {"norm": 0, "gate": 0, "rotary": 0}
    monkeypatch.setattr(training_ops._Norm, "apply", _counting(training_ops._Norm.apply, calls, "norm"))
    monkeypatch.setattr(training_ops._Gate, "apply", _counting(training_ops._Gate.apply, calls, "gate"))
    monkeypatch.setattr(lean_layers._Rotary, "apply", _counting(lean_layers._Rotary.apply, calls, "rotary"))
    with fused_training_ops(model):
        loss, grads = loss_and_grads()
    assert calls == {"norm": 2 * 2 + 1, "gate": 0, "rotary": 2 * 2}
    torch.testing.assert_close(loss, plain_loss, rtol=1e-3, atol=1e-3)
    for mine, theirs in zip(grads, plain_grads, strict=True):
        assert (mine - theirs).norm() <= 0.02 * theirs.norm() + 1e-6


def _llama_lora_with_wide_heads() -> torch.nn.Module:
    """A two-layer Llama with 64-wide heads (the rotary C pass's) and rank-4 LoRA adapters
    that act (peft starts B at zero)."""
    from cgym.agents.local.lora import with_lora
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    model = with_lora(LlamaForCausalLM(config), 4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return model
