"""Llama and Qwen2 decoder layers in fewer, larger ops, for the sampler's packed bf16 copy.

A decode step of a few rows is dominated by what a layer does around its arithmetic: the
transformers layer runs ~13 module calls and ~60 small tensor ops, and on the 2-core
AVX512-BF16 machine that cost about as much as reading the weights (a 1-row step of SmolLM2
took ~30 ms, its linear layers ~15). Here one function runs the layer: the query, key and value
projections as one packed layer, gate and up as another (`packed.FusedLinear`), and the norms,
rotary embedding and residuals inline, each op as transformers computes it, so the outputs are
the same bit for bit (`tests/agents/local/test_lean_layers.py`).

Only for inference, on layers whose structure is the Llama layer's exactly (`fits`); any other
layer keeps its own forward. `sampling_model` prepares a bf16 copy: lean layers where they fit,
every other linear layer packed.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
from cgym.agents.local.packed import FusedLinear, pack_linears, packable
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
SILU = ("SiLU", "SiLUActivation")  # torch's and transformers' module for `F.silu`
MODEL_TYPES = ("llama", "qwen2")  # configurations whose decoder layer `lean_forward` reproduces


def sampling_model(model: nn.Module) -> nn.Module:
    """`model` (in place) ready for sampling where it is `packable`: its Llama and Qwen2 decoder
    layers lean, its other linear layers packed. Returned as it is elsewhere."""
    if not packable(model):
        return model
    if getattr(getattr(model, "config", None), "model_type", None) in MODEL_TYPES:
        for layer in _decoder_layers(model):
            if fits(layer):
                make_lean(layer)
    return pack_linears(model)


def fits(layer: nn.Module) -> bool:
    """Whether `layer` is a Llama (or Qwen2) decoder layer with plain linear projections and SiLU."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, name, None) for name in ("input_layernorm", "post_attention_layernorm")]
    return (
        attn is not None
        and mlp is not None
        and all(type(getattr(attn, name, None)) is nn.Linear for name in (*QKV, "o_proj"))
        and all(type(getattr(mlp, name, None)) is nn.Linear for name in (*GATE_UP, "down_proj"))
        and type(getattr(mlp, "act_fn", None)).__name__ in SILU
        and all(norm is not None and hasattr(norm, "variance_epsilon") and isinstance(getattr(norm, "weight", None), Tensor) for norm in norms)
        and not any(hasattr(attn, name) for name in ("q_norm", "k_norm"))
    )


def make_lean(layer: nn.Module) -> None:
    """Fuse `layer`'s projections into packed layers and give it `lean_forward` (in place)."""
    attn, mlp = layer.self_attn, layer.mlp
    attn.qkv_proj = FusedLinear(QKV, [getattr(attn, name) for name in QKV])
    mlp.gate_up_proj = FusedLinear(GATE_UP, [getattr(mlp, name) for name in GATE_UP])
    for module, names in ((attn, QKV), (mlp, GATE_UP)):
        for name in names:
            delattr(module, name)
    layer.forward = MethodType(lean_forward, layer)  # the instance's, over the class's


def lean_forward(
    self: nn.Module,
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    cache: Any = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[Tensor, Tensor] | None = None,
    **kwargs: Any,
) -> Tensor:
    """The Llama decoder layer's forward (`LlamaDecoderLayer.forward` and what it calls), with
    its projections fused; Qwen2's, which differs only in passing its attention's sliding window."""
    attn, mlp = self.self_attn, self.mlp
    batch, length, _ = hidden_states.shape
    normed = _rms_norm(hidden_states, self.input_layernorm)
    q, k, v = attn.qkv_proj(normed).split(attn.qkv_proj.widths, dim=-1)
    q = q.view(batch, length, -1, attn.head_dim).transpose(1, 2)
    k = k.view(batch, length, -1, attn.head_dim).transpose(1, 2)
    v = v.view(batch, length, -1, attn.head_dim).transpose(1, 2)
    assert position_embeddings is not None, "Llama layers are given their rotary embeddings"
    cos, sin = (t.unsqueeze(1) for t in position_embeddings)
    q, k = _rotated(q, cos, sin), _rotated(k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, None)
    if hasattr(attn, "sliding_window"):
        kwargs["sliding_window"] = attn.sliding_window
    out, _ = attention(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
    hidden_states = hidden_states + attn.o_proj(out.reshape(batch, length, -1))
    gate, up = mlp.gate_up_proj(_rms_norm(hidden_states, self.post_attention_layernorm)).chunk(2, dim=-1)
    return hidden_states + mlp.down_proj(nn.functional.silu(gate) * up)


def _rms_norm(x: Tensor, norm: nn.Module) -> Tensor:
    """`LlamaRMSNorm`: normalised in fp32, rounded to the input's dtype, then scaled."""
    wide = x.float()
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * wide.to(x.dtype)


def _rotated(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotary embedding of (B, H, T, D) `x`: `x * cos + rotate_half(x) * sin`."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []
