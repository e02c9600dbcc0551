"""Recomputed layers: the same log-probs and gradients, fewer activations kept, each layer run twice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cgym.agents.local.kernels import available as kernels_available
from cgym.agents.local.kv_cache import attention_on_pairs
from cgym.agents.local.sampling import sequence_logprobs, shared_head
from cgym.trainer.recompute import decoder_layers, recomputed_layers
from transformers import AutoConfig, AutoModelForCausalLM


def _batch(rows: int = 3, width: int = 60, shared: int = 20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 500, (rows, width), generator=generator)
    ids[:, :shared] = ids[0, :shared]
    mask = torch.zeros(rows, width - 1)
    mask[:, shared + 5 :] = 1
    return ids, torch.ones_like(ids), mask


def _pass(model_dir: Path, *, recompute: bool, path: str, lora: bool = False) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Log-probs, the flat gradient, bytes kept for the backward pass, attention calls."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ids, attention, mask = _batch(shared=45 if path == "group" else 20)
    if path == "group":  # a head of 20 columns, 25 more shared by the rows, a target among them
        mask[:, 30] = 1
    kept, calls = [0], [0]
    hooks = [layer.self_attn.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for layer in decoder_layers(model)]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept[0] += tensor.numel() * tensor.element_size()
        return tensor

    with recomputed_layers(model) if recompute else torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        head = shared_head(model, ids[0, :20]) if path in ("head", "group") else None
        logp = sequence_logprobs(model, ids, attention, mask=mask, head=head, share_prefix=path in ("prefix", "group"))
    (logp * mask).sum().backward()
    if head is not None:
        head.backward()
    for hook in hooks:
        hook.remove()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return logp.detach() * mask, grads, kept[0], calls[0]


@pytest.mark.parametrize("path", ["plain", "prefix", "head", "group"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_recomputed_layers_give_the_same_gradients_from_fewer_kept_activations(tiny_chat_model: Path, path: str, lora: bool) -> None:
    plain_lp, plain_grad, plain_kept, plain_calls = _pass(tiny_chat_model, recompute=False, path=path, lora=lora)
    lp, grad, kept, calls = _pass(tiny_chat_model, recompute=True, path=path, lora=lora)
    assert plain_grad.abs().sum() > 0
    torch.testing.assert_close(lp, plain_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, plain_grad, atol=1e-6, rtol=1e-5)
    assert calls == 2 * plain_calls  # every attention ran again in the backward pass
    assert kept < plain_kept / 2


def test_layers_are_restored_after_the_block(tiny_chat_model: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model)
    with recomputed_layers(model) as covered:
        assert covered == len(decoder_layers(model)) == model.config.num_hidden_layers
        assert all("forward" in vars(layer) for layer in decoder_layers(model))
    assert not any("forward" in vars(layer) for layer in decoder_layers(model))
    with recomputed_layers(torch.nn.Linear(2, 2)) as covered:
        assert covered == 0


@pytest.mark.skipif(not kernels_available(), reason="no AVX-512 or no C compiler here: attention stays in fp32")
def test_a_recomputed_layer_runs_the_attention_its_forward_ran(tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `attention_on_pairs` (an fp32 pass on a CPU without native bf16) attention runs in
    the C kernels on bf16 pairs; the backward pass's recomputation must run it so too, or it
    recomputes another function than the forward ran and the gradients drift."""
    from cgym.agents.local import kv_cache

    config = AutoConfig.from_pretrained(tiny_chat_model)
    config.update({"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 256})
    calls = [0]
    real = kv_cache.kernel_attention

    def counted(*args: object) -> object:
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(kv_cache, "kernel_attention", counted)
    ids, attention, mask = _batch()
    attention[1, :7] = 0  # a padded row: the pass takes a mask
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        calls[0] = 0
        with attention_on_pairs(), recomputed_layers(model) if recompute else torch.enable_grad():
            logp = sequence_logprobs(model, ids, attention, mask=mask)
        (logp * mask).sum().backward()
        results.append((calls[0], torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    (plain_calls, plain_grad), (calls_again, grad) = results
    assert plain_calls == config.num_hidden_layers and calls_again == 2 * plain_calls
    torch.testing.assert_close(grad, plain_grad, atol=1e-6, rtol=1e-5)
