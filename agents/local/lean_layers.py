"""Llama and Qwen2 decoder layers in fewer, larger ops, for the sampler's packed bf16 copy.

A decode step of a few rows is dominated by what a layer does around its arithmetic: the
transformers layer makes a dozen module calls and dozens of small tensor ops, and on the 2-core
AVX512-BF16 machine that cost about as much as reading the weights (a 1-row step of SmolLM2
took ~33 ms, its linear layers ~15). Here one function runs the layer: the query, key and value
projections as one packed layer, gate and up as another (`packed.FusedLinear`), and the norms,
rotary embedding and residuals inline, each op as transformers computes it, so the outputs are
the same bit for bit (`tests/agents/local/test_lean_layers.py`). Where the C kernels run
(`agents.local.kernels`), each norm, the rotation of the queries and keys, and the gate's SiLU
are one call each: the rotation bit for bit, the norm up to the order of its sum of squares, the
SiLU up to its exp. A 1-row decode step of SmolLM2 took 22.8 ms (25.6 with those as PyTorch
ops, 33 through transformers' layers).

Only for inference, on layers whose structure is the Llama layer's exactly (`fits`); any other
layer keeps its own forward. `sampling_model` prepares a bf16 copy: lean layers where they fit,
every other linear layer packed.
"""

from __future__ import annotations

import ctypes
from functools import cache, partial
from typing import Any

import torch
from cgym.agents.local.kernels import C_HEADER, compiled, enabled
from cgym.agents.local.layer_step import decode_step, stack_step
from cgym.agents.local.packed import FusedLinear, pack_linears, packable, pairs_run
from cgym.agents.local.step_attention import query_limit
from torch import Tensor, nn
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
SILU = ("SiLU", "SiLUActivation")  # torch's and transformers' module for `F.silu`
MODEL_TYPES = ("llama", "qwen2")  # configurations whose decoder layer `lean_forward` reproduces
STACKED = ("llama",)  # and whose model's forward `lean_model_forward` reproduces (Qwen2 masks by layer type)


def sampling_model(model: nn.Module) -> nn.Module:
    """`model` (in place) ready for sampling where it is `packable`: its Llama and Qwen2 decoder
    layers lean, its other linear layers packed. Returned as it is elsewhere."""
    if not packable(model):
        return model
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in MODEL_TYPES:
        layers = _decoder_layers(model)
        for layer in layers:
            if fits(layer):
                make_lean(layer)
        if model_type in STACKED and layers and all(is_lean(layer) for layer in layers) and not is_lean(model.model):
            model.model.__class__ = _lean_model_class(type(model.model))
    return pack_linears(model)


def samples_lean(model: nn.Module) -> bool:
    """Whether `model` is of a family whose bf16 sampler runs this project's kernels here (a Llama
    or Qwen2, on a CPU the kernels build for). Checked on the family, not the layers, so that a
    LoRA-wrapped model answers as its folded copy will."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in MODEL_TYPES and _library() is not None and pairs_run()


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
    layer.__class__ = _lean_class(type(layer))


def is_lean(layer: nn.Module) -> bool:
    """Whether `layer` runs `lean_forward` (or a model's body `lean_model_forward`)."""
    return getattr(type(layer), "lean", False) is True


@cache
def _lean_class(cls: type) -> type:
    """`cls` with `lean_forward` as its forward. A subclass, not a method bound on each layer:
    that would be a reference from the layer to itself, and a dropped sampler copy's layers
    (a LoRA model folds a new one per optimizer step) would then wait for the garbage collector
    with all their weights (a medium GRPO step peaked at 5.25 GB that way, 5.04 GB without)."""
    return type(f"Lean{cls.__name__}", (cls,), {"forward": lean_forward, "lean": True, "__module__": __name__})


@cache
def _lean_model_class(cls: type) -> type:
    """`cls` (a Llama model's body) with `lean_model_forward` as its forward; `cls` stays its parent's."""
    return type(f"Lean{cls.__name__}", (cls,), {"forward": lean_model_forward, "lean": True, "parent": cls, "__module__": __name__})


def lean_model_forward(
    self: nn.Module,
    input_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    cache: Any = None,
    inputs_embeds: Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs: Any,
) -> Any:
    """`LlamaModel.forward`, with a decode step's layers all in one C call where
    `layer_step.stack_step` runs them: the same embedding, mask, rotary tables and final norm, and
    the layers' outputs bit for bit. Anything else (a prefill, gradients, outputs asked of the
    layers) is the parent's forward."""
    config = self.config
    parent = partial(type(self).parent.forward, self)
    plain = (
        input_ids is None
        or inputs_embeds is not None
        or cache is None
        or position_ids is None
        or bool(kwargs)
        or torch.is_grad_enabled()
        or config.output_hidden_states
        or config.output_attentions
        or input_ids.shape[1] * (config.num_attention_heads // config.num_key_value_heads) > query_limit()
    )
    if not plain:
        hidden = self.embed_tokens(input_ids)
        mask = create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache, position_ids=position_ids)
        out = stack_step(list(self.layers)[: config.num_hidden_layers], hidden, mask, cache, self.rotary_emb(hidden, position_ids=position_ids), _library())
        if out is not None:
            return BaseModelOutputWithPast(last_hidden_state=self.norm(out), cache=cache)
        input_ids, inputs_embeds = None, hidden  # embedded already: the parent takes it from here
    return parent(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)


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
    its projections fused; Qwen2's, which differs only in passing its attention's sliding window.
    A decode step against a shared prompt runs in one C call where it can (`layer_step`)."""
    stepped = decode_step(self, hidden_states, attention_mask, cache, position_embeddings, _library())
    if stepped is not None:
        return stepped
    attn, mlp = self.self_attn, self.mlp
    batch, length, _ = hidden_states.shape
    normed = _rms_norm(hidden_states, self.input_layernorm)
    qkv = attn.qkv_proj(normed)
    assert position_embeddings is not None, "Llama layers are given their rotary embeddings"
    in_place = _rotate_in_place(qkv, *position_embeddings, (qkv.shape[-1] - attn.qkv_proj.widths[-1]) // attn.head_dim)
    q, k, v = qkv.split(attn.qkv_proj.widths, dim=-1)
    q = q.view(batch, length, -1, attn.head_dim).transpose(1, 2)
    k = k.view(batch, length, -1, attn.head_dim).transpose(1, 2)
    v = v.view(batch, length, -1, attn.head_dim).transpose(1, 2)
    if not in_place:
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        q, k = rotated(q, cos, sin), rotated(k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, None)
    if hasattr(attn, "sliding_window"):
        kwargs["sliding_window"] = attn.sliding_window
    out, _ = attention(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
    hidden_states = hidden_states + attn.o_proj(out.reshape(batch, length, -1))
    return hidden_states + mlp.down_proj(_gated(mlp.gate_up_proj(_rms_norm(hidden_states, self.post_attention_layernorm))))


def _rms_norm(x: Tensor, norm: nn.Module) -> Tensor:
    """`LlamaRMSNorm`: normalised in fp32, rounded to the input's dtype, then scaled. In one C
    call for bf16 rows where the kernels run: the same steps, the sum of squares in another
    order (a rare last-bit difference where a value sits at a rounding boundary)."""
    lib = _library() if x.dtype == norm.weight.dtype == torch.bfloat16 and x.shape[-1] % 16 == 0 and x.is_contiguous() and x.device.type == "cpu" else None
    if lib is not None:
        out = torch.empty_like(x)
        lib.rms_norm(
            x.data_ptr(), norm.weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], norm.variance_epsilon, torch.get_num_threads()
        )
        return out
    wide = x.float()
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * wide.to(x.dtype)


def rotated(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotary embedding of (B, H, T, D) `x`: `x * cos + rotate_half(x) * sin`. In fp32 on the
    CPU, in one C pass forward and one backward (`_Rotary`), the same roundings as PyTorch's ops."""
    if _Rotary.fits(x, cos, sin):
        return _Rotary.apply(x, cos, sin)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Rotary(torch.autograd.Function):
    """`rotated` for fp32 (B, H, T, D) `x` (rows of D contiguous) by (B or 1, 1, T, D) `cos`
    and `sin`. PyTorch's form makes four tensors forward (the product, the negated half, the
    concatenation, the second product) and as many backward; a training pass of SmolLM2 ran it
    for 30 layers' queries and keys (~0.2 s of an update's 15-18 s on 2 cores). Each output is
    `round(x c) + round(r s)` as PyTorch rounds it, the products kept apart (no fused
    multiply-add); the gradient `round(g c) + round(rotate_half^T(g) s)`, the sum autograd
    forms from the same two products: the same values."""

    @staticmethod
    def fits(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
        return (
            x.dtype == cos.dtype == sin.dtype == torch.float32
            and x.device.type == "cpu"
            and x.dim() == cos.dim() == 4
            and x.shape[-1] % 32 == 0
            and cos.shape == sin.shape
            and cos.shape[0] in (1, x.shape[0])
            and cos.shape[1] == 1
            and cos.shape[2:] == x.shape[2:]
            and x.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
            and cos.stride() == sin.stride()
            and _library() is not None
        )

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotary(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        cos, sin = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return _rotary(grad, cos, sin, backward=True), None, None


def _rotary(x: Tensor, cos: Tensor, sin: Tensor, *, backward: bool) -> Tensor:
    """One C pass of `_Rotary`: its output, or (backward) the gradient of its input from the
    output's gradient `x`; laid out as `x` is."""
    lib = _library()
    assert lib is not None
    out = torch.empty_like(x)
    batch, heads, length, dim = x.shape
    lib.rotary(
        x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), batch, heads, length, dim, *x.stride()[:3], *out.stride()[:3],
        cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(2), int(backward), torch.get_num_threads(),
    )  # fmt: skip
    return out


def _gated(gate_up: Tensor) -> Tensor:
    """`silu(gate) * up` from the fused projection's [gate | up] output, each rounded to bf16 as
    PyTorch rounds them; in one C call for bf16 where the kernels run (its sigmoid's exp is not
    PyTorch's: a rare last-bit difference)."""
    gate, up = gate_up.chunk(2, dim=-1)
    lib = _library() if gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous() and gate_up.shape[-1] % 32 == 0 and gate_up.device.type == "cpu" else None
    if lib is None:
        return nn.functional.silu(gate) * up
    out = gate.new_empty(gate.shape)
    lib.gated(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // gate_up.shape[-1], gate.shape[-1], torch.get_num_threads())
    return out


def _rotate_in_place(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int) -> bool:
    """Rotate the first `heads` heads (the queries' and keys') of each (B, T) row of a fused
    projection's output in place, by (B, T, D) `cos` and `sin`, in one C call: bit for bit
    `rotated`, each product and the sum rounded to bf16 as PyTorch rounds them. False (nothing
    done) where the kernel does not run."""
    head_dim = cos.shape[-1]
    lib = _library()
    fits = (
        lib is not None
        and qkv.dtype == cos.dtype == sin.dtype == torch.bfloat16
        and head_dim % 32 == 0
        and qkv.is_contiguous()
        and cos.shape == sin.shape == (*qkv.shape[:-1], head_dim)
        and cos.is_contiguous()
        and sin.is_contiguous()
        and qkv.device.type == "cpu"
        and heads * head_dim <= qkv.shape[-1]
    )
    if fits:
        lib.rotate(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), qkv.numel() // qkv.shape[-1], qkv.shape[-1], heads, head_dim, torch.get_num_threads())
    return fits


_SOURCE = (
    C_HEADER
    + r"""
/* out = x c + rotate_half(x) s over fp32 (B, H, T, D) rows (strides in floats, D contiguous)
   by (B or 1, T, D) c and s (cb = 0: one for every row); backward: out = g c + rotate_half^T(g) s,
   the gradient of x from the output's g. Each product rounded apart, then the sum. */
#ifdef __AVX512F__
static inline __m512 apart(__m512 x) { __asm__("" : "+v"(x)); return x; } /* no multiply-add across it */
#else
static inline __m512 apart(__m512 x) { __asm__("" : "+x"(x.lo), "+x"(x.hi)); return x; }
#endif
static inline __m512 negated(__m512 x) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000))); }
void rotary(const float *x, const float *cos, const float *sin, float *out, long B, long H, long T, long D,
            long xb, long xh, long xt, long ob, long oh, long ot, long cb, long ct, int backward, int threads) {
    long half = D / 2;
#pragma omp parallel for collapse(3) schedule(static) num_threads(threads) if (B * H * T * D >= 65536)
    for (long b = 0; b < B; b++)
        for (long h = 0; h < H; h++)
            for (long t = 0; t < T; t++) {
                const float *xr = x + b * xb + h * xh + t * xt, *c = cos + b * cb + t * ct, *s = sin + b * cb + t * ct;
                float *o = out + b * ob + h * oh + t * ot;
                for (long i = 0; i < half; i += 16) {
                    __m512 lo = _mm512_loadu_ps(xr + i), hi = _mm512_loadu_ps(xr + half + i);
                    __m512 c_lo = _mm512_loadu_ps(c + i), c_hi = _mm512_loadu_ps(c + half + i);
                    __m512 s_lo = _mm512_loadu_ps(s + i), s_hi = _mm512_loadu_ps(s + half + i);
                    /* forward: lo c_lo + (-hi) s_lo, hi c_hi + lo s_hi; backward: lo c_lo + hi s_hi, hi c_hi - lo s_lo */
                    __m512 to_lo = apart(_mm512_mul_ps(hi, backward ? s_hi : s_lo)), to_hi = apart(_mm512_mul_ps(lo, backward ? s_lo : s_hi));
                    if (backward) to_hi = negated(to_hi);
                    else to_lo = negated(to_lo);
                    _mm512_storeu_ps(o + i, _mm512_add_ps(apart(_mm512_mul_ps(lo, c_lo)), to_lo));
                    _mm512_storeu_ps(o + half + i, _mm512_add_ps(apart(_mm512_mul_ps(hi, c_hi)), to_hi));
                }
            }
}

static inline __m512 widen(__m256i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)); }
static inline __m256i narrow(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); } /* to bf16, nearest even */

/* out[r] = w * bf16(x[r] * 1 / sqrt(mean(x[r]^2) + eps)), each product rounded to bf16 */
void rms_norm(const uint16_t *x, const uint16_t *w, uint16_t *out, long rows, long dim, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim >= 65536)
    for (long r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        __m512 sum = _mm512_setzero_ps();
        for (long i = 0; i < dim; i += 16) {
            __m512 v = widen(_mm256_loadu_si256((const __m256i *)(xr + i)));
            sum = _mm512_fmadd_ps(v, v, sum);
        }
        float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(sum) / (float)dim + eps);
        __m512 f = _mm512_set1_ps(scale);
        for (long i = 0; i < dim; i += 16) {
            __m512 y = widen(narrow(_mm512_mul_ps(widen(_mm256_loadu_si256((const __m256i *)(xr + i))), f)));
            __m512 g = widen(_mm256_loadu_si256((const __m256i *)(w + i)));
            _mm256_storeu_si256((__m256i *)(out + r * dim + i), narrow(_mm512_mul_ps(g, y)));
        }
    }
}

/* out[r] = bf16(bf16(silu(g)) * u) for row r = [g | u] of 2 * half: silu(g) = g / (1 + e^-g) */
void gated(const uint16_t *gate_up, uint16_t *out, long rows, long half, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * half >= 65536)
    for (long r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * half, *u = g + half;
        for (long i = 0; i < half; i += 16) {
            __m512 x = widen(_mm256_loadu_si256((const __m256i *)(g + i)));
            /* e^-x for x >= 0 from exp_neg; for x < 0, silu(x) = x e^x / (1 + e^x) */
            __m512 e = exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
            __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
            __m512 one = _mm512_set1_ps(1.0f);
            __m512 numerator = _mm512_mask_mul_ps(x, negative, x, e);
            __m512 silu = _mm512_div_ps(numerator, _mm512_add_ps(one, e));
            __m512 y = _mm512_mul_ps(widen(narrow(silu)), widen(_mm256_loadu_si256((const __m256i *)(u + i))));
            _mm256_storeu_si256((__m256i *)(out + r * half + i), narrow(y));
        }
    }
}

/* For each of `rows` rows of `width`, its first `heads` heads of D: x <- bf16(bf16(x * cos) +
   bf16(rotate_half(x) * sin)), rotate_half(x) = (-x[D/2:], x[:D/2]); cos, sin: one row of D per row */
void rotate(uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, long rows, long width, long heads, long D, int threads) {
    long half = D / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * heads >= 2048)
    for (long r = 0; r < rows; r++) {
        const uint16_t *c = cos + r * D, *s = sin + r * D;
        for (long h = 0; h < heads; h++) {
            uint16_t *x = qkv + r * width + h * D;
            for (long i = 0; i < half; i += 16) {
                __m512 lo = widen(_mm256_loadu_si256((const __m256i *)(x + i)));
                __m512 hi = widen(_mm256_loadu_si256((const __m256i *)(x + half + i)));
                __m512 c_lo = widen(_mm256_loadu_si256((const __m256i *)(c + i))), c_hi = widen(_mm256_loadu_si256((const __m256i *)(c + half + i)));
                __m512 s_lo = widen(_mm256_loadu_si256((const __m256i *)(s + i))), s_hi = widen(_mm256_loadu_si256((const __m256i *)(s + half + i)));
                __m512 new_lo = _mm512_add_ps(widen(narrow(_mm512_mul_ps(lo, c_lo))), widen(narrow(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi), s_lo))));
                __m512 new_hi = _mm512_add_ps(widen(narrow(_mm512_mul_ps(hi, c_hi))), widen(narrow(_mm512_mul_ps(lo, s_hi))));
                _mm256_storeu_si256((__m256i *)(x + i), narrow(new_lo));
                _mm256_storeu_si256((__m256i *)(x + half + i), narrow(new_hi));
            }
        }
    }
}
"""
)


def _library() -> ctypes.CDLL | None:
    """The norm and rotation kernels; None where they are off (`CGYM_DECODE_KERNEL=0`) or cannot be built."""
    return _built() if enabled() else None


@cache
def _built() -> ctypes.CDLL | None:
    lib = compiled(_SOURCE, "lean_layers")
    if lib is None:
        return None
    lib.rms_norm.restype = lib.rotate.restype = lib.gated.restype = None
    lib.gated.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2 + [ctypes.c_int]
    lib.rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_float, ctypes.c_int]
    lib.rotate.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 4 + [ctypes.c_int]
    lib.rotary.restype = None
    lib.rotary.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 12 + [ctypes.c_int] * 2
    return lib


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []
