"""A lean decoder layer's decode step in one C call: the same kernels, without Python between them.

A decode step of a few rows runs every layer's dozen small ops one after another, and on the
2-core AVX512-BF16 machine the Python and PyTorch calls around the C kernels cost as much as a
third of a one-row step of SmolLM2 (16.8 ms, of which ~5.5 ms outside the kernels: wrappers,
views, argument checks, the cache's slice assignments). Here one call runs a whole layer: the
norm, the fused query-key-value product, the rotation, the new keys and values written into the
cache, the step's attention over the shared prompt and the row's own keys, the output product
and its residual, the second norm, gate and up, the gated SiLU, down and its residual. Each part
is the kernel `lean_forward` calls for it (reached through its address), with the same inputs,
and the residuals are rounded to bf16 as PyTorch adds bf16, so the layer's output and the cache
are bit for bit those of `lean_forward` (`tests/agents/local/test_layer_step.py`).

It runs where every one of those kernels would: bf16 lean layers with packed projections, a
shared prefix packed for `step_attention`, the cache's growing buffer with room for the step, and
few enough queries per row. Anywhere else `decode_step` answers None and the layer runs as before.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cache
from typing import Any

import torch
from cgym.agents.local import kv_cache, packed, step_attention
from cgym.agents.local.decode_attention import FEW_QUERIES, HEAD_DIM
from cgym.agents.local.kernels import C_HEADER, compiled, enabled
from torch import Tensor, nn

_SOURCE = (
    C_HEADER
    + r"""
typedef void (*norm_fn)(const uint16_t *, const uint16_t *, uint16_t *, long, long, float, int);
typedef void (*linear_fn)(const uint16_t *, const uint32_t *, const float *, uint16_t *, long, long, long, int);
typedef void (*rotate_fn)(uint16_t *, const uint16_t *, const uint16_t *, long, long, long, long, int);
typedef void (*gated_fn)(const uint16_t *, uint16_t *, long, long, int);
typedef int (*attention_fn)(const uint16_t *, const uint32_t *, const float *, const uint16_t *, const uint16_t *, const uint8_t *,
                             uint16_t *, long, long, long, long, long, long, long, long, long, long, long, long, long, long, long,
                             long, long, long, long, long, long, long, float, int);

/* What a layer's step reads that stays put through a sampling call (`Plan` in Python). */
typedef struct {
    norm_fn norm;
    linear_fn linear;
    rotate_fn rotate;
    gated_fn gated;
    attention_fn attention;
    const uint16_t *norm1, *norm2;
    float eps1, eps2;
    const uint32_t *qkv, *o, *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    long hidden, heads, kv_heads, head_dim, inter;
    float scale;
    const uint32_t *prefix_keys;
    const float *prefix_values;
    long prefix_length;
} Plan;

/* h <- bf16(h + x), count values (a multiple of 16), each sum rounded to nearest even as PyTorch adds bf16 */
static void add_rounded(uint16_t *h, const uint16_t *x, long count) {
    for (long i = 0; i < count; i += 16) {
        __m512 sum = _mm512_add_ps(load_bf16(h + i, lanes(16)), load_bf16(x + i, lanes(16)));
        _mm256_storeu_si256((__m256i *)(h + i), (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

/* out (B x T rows of `hidden`) = the layer applied to h, for T new ids a row at cache columns
   [length, length + T) of ck / cv (B, kv heads, capacity, D; strides given), which this writes;
   `visible` (B, T, length + T) says which of a row's own keys each query sees. `scratch` holds
   B T (3 hidden + (heads + 2 kv heads) D + heads D + 3 inter) bf16. Answers 0, or -1 where the
   attention found no memory for its scratch: then out is not the layer's, and the cache's
   columns past `length` hold this step's keys and values only up to this layer. */
static int layer_step(const Plan *p, const uint16_t *h, uint16_t *out, long B, long T, const uint16_t *cos, const uint16_t *sin,
                uint16_t *ck, uint16_t *cv, long ksb, long ksh, long kss, long vsb, long vsh, long vss, long length,
                const uint8_t *visible, long isb, long ist, long iss, long few, uint16_t *scratch, int threads) {
    long R = B * T, E = p->hidden, D = p->head_dim, H = p->heads, Hk = p->kv_heads, I = p->inter;
    long W = (H + 2 * Hk) * D;
    uint16_t *normed = scratch, *qkv = normed + R * E, *att = qkv + R * W, *o = att + R * H * D;
    uint16_t *gu = o + R * E, *g = gu + R * 2 * I, *down = g + R * I;
    if (out != h) memcpy(out, h, sizeof(uint16_t) * R * E);
    p->norm(out, p->norm1, normed, R, E, p->eps1, threads);
    p->linear(normed, p->qkv, p->qkv_bias, qkv, R, E, W, threads);
    p->rotate(qkv, cos, sin, R, W, H + Hk, D, threads);
    for (long b = 0; b < B; b++)
        for (long t = 0; t < T; t++)
            for (long j = 0; j < Hk; j++) {
                const uint16_t *row = qkv + (b * T + t) * W;
                memcpy(ck + b * ksb + j * ksh + (length + t) * kss, row + (H + j) * D, sizeof(uint16_t) * D);
                memcpy(cv + b * vsb + j * vsh + (length + t) * vss, row + (H + Hk + j) * D, sizeof(uint16_t) * D);
            }
    if (p->attention(qkv, p->prefix_keys, p->prefix_values, ck, cv, visible, att, B, Hk, H / Hk, T, p->prefix_length, length + T,
                     T * W, D, W, ksb, ksh, kss, vsb, vsh, vss, isb, ist, iss, T * H * D, H * D, D, few, p->scale, threads))
        return -1;
    p->linear(att, p->o, p->o_bias, o, R, H * D, E, threads);
    add_rounded(out, o, R * E);
    p->norm(out, p->norm2, normed, R, E, p->eps2, threads);
    p->linear(normed, p->gate_up, p->gate_up_bias, gu, R, E, 2 * I, threads);
    p->gated(gu, g, R, I, threads);
    p->linear(g, p->down, p->down_bias, down, R, I, E, threads);
    add_rounded(out, down, R * E);
    return 0;
}

/* n layers in turn (`plans`), each over its own cache buffers ck[l], cv[l] (the same strides and
   length in every layer), the first reading h and every one writing out; 0, or -1 from the first
   layer that could not step (`layer_step`) */
int stack_step(const Plan *const *plans, long n, const uint16_t *h, uint16_t *out, long B, long T, const uint16_t *cos, const uint16_t *sin,
                uint16_t *const *ck, uint16_t *const *cv, long ksb, long ksh, long kss, long vsb, long vsh, long vss, long length,
                const uint8_t *visible, long isb, long ist, long iss, long few, uint16_t *scratch, int threads) {
    for (long l = 0; l < n; l++)
        if (layer_step(plans[l], l ? out : h, out, B, T, cos, sin, ck[l], cv[l], ksb, ksh, kss, vsb, vsh, vss, length, visible, isb, ist, iss, few,
                       scratch, threads))
            return -1;
    return 0;
}
"""
)


class Plan(ctypes.Structure):
    """The C `Plan`: kernel addresses, a layer's weights, its shapes, and the packed prefix."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("norm", "linear", "rotate", "gated", "attention", "norm1", "norm2")),
        ("eps1", ctypes.c_float),
        ("eps2", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in ("qkv", "o", "gate_up", "down", "qkv_bias", "o_bias", "gate_up_bias", "down_bias")),
        *((name, ctypes.c_long) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter")),
        ("scale", ctypes.c_float),
        ("prefix_keys", ctypes.c_void_p),
        ("prefix_values", ctypes.c_void_p),
        ("prefix_length", ctypes.c_long),
    ]


def decode_step(
    layer: nn.Module, hidden: Tensor, attention_mask: Tensor | None, cache: Any, position_embeddings: tuple[Tensor, Tensor] | None, norms: ctypes.CDLL | None
) -> Tensor | None:
    """`layer`'s output for a decode step's (B, T, hidden) states, its new keys and values written
    into `cache`, in one C call; None (nothing done) wherever `lean_forward` would run other code.
    `norms`: the lean layers' library (norm, rotation, gated SiLU), which calls this."""
    return stack_step([layer], hidden, attention_mask, cache, position_embeddings, norms)


def stack_step(
    layers: Sequence[nn.Module],
    hidden: Tensor,
    attention_mask: Tensor | None,
    cache: Any,
    position_embeddings: tuple[Tensor, Tensor] | None,
    norms: ctypes.CDLL | None,
) -> Tensor | None:
    """`decode_step` through consecutive `layers` (a model's, all of them: the model-level step,
    `lean_layers.lean_model_forward`) in one C call, or None (nothing done) unless every layer can.
    Where a layer's attention finds no memory for its scratch, None too: the cache's length stays,
    and the columns past it that the layers before wrote are written again by the run op by op."""
    lib = _library()
    if lib is None or norms is None or torch.is_grad_enabled() or position_embeddings is None or cache is None or not layers:
        return None
    prefix = kv_cache._PREFIX.get()
    if prefix is None or kv_cache._FLASH_CPU is None or layers[0].self_attn.config._attn_implementation != kv_cache.PREFIX_ATTENTION:
        return None
    shape = _shape(layers[0])
    batch, steps, width = hidden.shape
    cos, sin = position_embeddings
    if shape is None or not (
        hidden.dtype == cos.dtype == sin.dtype == torch.bfloat16
        and hidden.is_contiguous()
        and width % 16 == 0
        and shape[0] // shape[1] * steps <= step_attention.query_limit()
        and cos.shape == sin.shape == (batch, steps, shape[2])
        and cos.is_contiguous()
        and sin.is_contiguous()
    ):
        return None
    heads, kv_heads, dim, inter = shape
    over = _over_prefix(layers, prefix, shape, norms)
    if over is None:
        return None
    indices, plans, plength = over
    caches = getattr(cache, "layers", ())
    owns = [caches[i] if i < len(caches) else None for i in indices]
    first = owns[0]
    if not isinstance(first, kv_cache.GrowingLayer) or first._k is None or first._v is None:
        return None
    length, strides = first.length, (*first._k.stride(), *first._v.stride())
    if not all(_room(layer, own, shape, batch, steps, length, strides) for layer, own in zip(layers, owns, strict=True)):
        return None
    visible = kv_cache._own_mask(attention_mask, batch, steps, length + steps, plength, hidden.device)
    if not (
        visible.dtype == torch.bool
        and visible.shape == (batch, steps, length + steps)
        and (heads // kv_heads * steps <= FEW_QUERIES or visible.stride(-1) == 1)
    ):
        return None
    scratch = torch.empty(batch * steps * (3 * width + (heads + 2 * kv_heads) * dim + heads * dim + 3 * inter), dtype=torch.bfloat16)
    out = torch.empty_like(hidden)
    addresses = ctypes.c_void_p * len(layers)
    failed = lib.stack_step(
        addresses(*[ctypes.addressof(plan) for plan in plans]), len(layers), hidden.data_ptr(), out.data_ptr(), batch, steps, cos.data_ptr(), sin.data_ptr(),
        addresses(*[own._k.data_ptr() for own in owns]), addresses(*[own._v.data_ptr() for own in owns]), *strides[:3], *strides[4:7], length,
        visible.data_ptr(), *visible.stride(), FEW_QUERIES, scratch.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:  # an attention without room for its scratch: the cache's length stays, so the columns written go unread
        return None
    for own in owns:
        own.length = length + steps
        own._refresh()
    return out


def _shape(layer: nn.Module) -> tuple[int, int, int, int] | None:
    """(query heads, kv heads, head size, MLP width) of a lean layer whose projections are all
    packed for the pair kernel with the standard fused layout and sizes the kernels take, or None.
    Kept on the layer: none of it changes when new weights are packed."""
    if "_cgym_step_shape" not in layer.__dict__:
        attn, mlp = layer.self_attn, layer.mlp
        heads, kv_heads, dim = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
        projections = (getattr(attn, "qkv_proj", None), attn.o_proj, getattr(mlp, "gate_up_proj", None), mlp.down_proj)
        fits = (
            dim == HEAD_DIM
            and heads % kv_heads == 0
            and all(isinstance(p, packed.PackedLinear) and p.pairs for p in projections)
            and attn.qkv_proj.widths == [heads * dim, kv_heads * dim, kv_heads * dim]
            and mlp.gate_up_proj.out_features % 32 == 0
        )
        layer.__dict__["_cgym_step_shape"] = (heads, kv_heads, dim, mlp.gate_up_proj.out_features // 2) if fits else None
    return layer.__dict__["_cgym_step_shape"]


def _over_prefix(layers: Sequence[nn.Module], prefix: kv_cache._Prefix, shape: tuple[int, ...], norms: ctypes.CDLL) -> tuple[list[int], list[Plan], int] | None:
    """The layers' cache indices, their `Plan`s over the served prefix and its length, or None
    where a layer's prompt is not packed or the layers' prompts differ in length. Found on a
    block's first step and kept on the prefix (`kv_cache._Prefix.steps`) for its others: while a
    prefix is served (one sampling call) no weight moves, and its plans, checked address by
    address on the first step, hold. That saves ~1 ms of Python a step (SmolLM2's 30 layers)."""
    key = tuple(map(id, layers))
    if key not in prefix.steps:
        indices = [layer.self_attn.layer_idx for layer in layers]
        packs = [prefix.packed[i] for i in indices]
        lengths = {prefix.keys[i].shape[2] for i in indices}
        fits = len(lengths) == 1 and all(pack is not None and pack.keys.shape[0] == shape[1] for pack in packs)
        prefix.steps[key] = (indices, [_plan(layer, pack, norms) for layer, pack in zip(layers, packs, strict=True)], lengths.pop()) if fits else None  # type: ignore[arg-type]
    return prefix.steps[key]


def _room(layer: nn.Module, own: Any, shape: tuple[int, ...], batch: int, steps: int, length: int, strides: tuple[int, ...]) -> bool:
    """Whether `layer` (of the first layer's `shape`) steps here too: a growing cache buffer of
    the same length and layout as the first layer's, with room for `steps`."""
    k, v = getattr(own, "_k", None), getattr(own, "_v", None)
    return (
        _shape(layer) == shape
        and isinstance(own, kv_cache.GrowingLayer)
        and k is not None
        and v is not None
        and own.is_initialized
        and own.length == length
        and (*k.stride(), *v.stride()) == strides
        and k.shape[:2] == v.shape[:2] == (batch, shape[1])
        and length + steps <= min(k.shape[2], v.shape[2])
        and strides[3] == strides[7] == 1
        and k.dtype == v.dtype == torch.bfloat16
    )


def _plan(layer: nn.Module, prefix: step_attention.PackedPrefix, norms: ctypes.CDLL) -> Plan:
    """`layer`'s `Plan` over `prefix`, kept on the layer while every address in it stays (new
    weights or a new prefix come in new tensors; one may land where an old one was, so all of
    them are compared, not some)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    addresses = (
        norm1.weight.data_ptr(),
        norm2.weight.data_ptr(),
        qkv.packed.data_ptr(),
        o.packed.data_ptr(),
        gate_up.packed.data_ptr(),
        down.packed.data_ptr(),
        *[None if p.wide_bias is None else p.wide_bias.data_ptr() for p in (qkv, o, gate_up, down)],
        prefix.keys.data_ptr(),
        prefix.values.data_ptr(),
        prefix.length,
    )
    kept = layer.__dict__.get("_cgym_step_plan")
    if kept is not None and kept[0] == addresses:
        return kept[1]
    heads, kv_heads, dim, inter = _shape(layer) or (0, 0, 0, 0)
    plan = Plan(
        *_kernels(norms), *addresses[:2], norm1.variance_epsilon, norm2.variance_epsilon, *addresses[2:10],
        o.out_features, heads, kv_heads, dim, inter, attn.scaling, *addresses[10:],
    )  # fmt: skip
    layer.__dict__["_cgym_step_plan"] = (addresses, plan)  # what it points at is held by the layer and the prefix
    return plan


def _kernels(norms: ctypes.CDLL) -> tuple[int, ...]:
    """The addresses of the kernels a layer step calls, in `Plan`'s order (`norms`: the lean
    layers' library)."""
    pairs, attention = packed._library(), step_attention._library()
    assert pairs is not None and attention is not None
    return tuple(ctypes.cast(f, ctypes.c_void_p).value or 0 for f in (norms.rms_norm, pairs.pair_linear, norms.rotate, norms.gated, attention.step_attention))


def _library() -> ctypes.CDLL | None:
    """The layer-step kernel, where it and every kernel it calls run; None where they are off
    (`CGYM_DECODE_KERNEL=0`) or cannot be built."""
    return _built() if enabled() else None


@cache
def _built() -> ctypes.CDLL | None:
    if packed._library() is None or step_attention._library() is None:
        return None
    lib = compiled(_SOURCE, "layer_step")
    if lib is None:
        return None
    lib.stack_step.restype = ctypes.c_int
    lib.stack_step.argtypes = (
        [ctypes.c_void_p, ctypes.c_long]
        + [ctypes.c_void_p] * 2
        + [ctypes.c_long] * 2
        + [ctypes.c_void_p] * 4
        + [ctypes.c_long] * 7
        + [ctypes.c_void_p]
        + [ctypes.c_long] * 4
        + [ctypes.c_void_p, ctypes.c_int]
    )
    return lib
