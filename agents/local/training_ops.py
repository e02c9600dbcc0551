"""RMSNorm, the MLP's SiLU gate and the rotary embedding in one C pass each, forward and backward,
for training passes in fp32 and the fp32 parts of bf16-autocast ones.

An fp32 training pass (a CPU without native bf16 trains in fp32) ran each of SmolLM2's 61 norms
as six PyTorch ops forward (square, mean, add, rsqrt, two products) and about a dozen backward,
and each MLP's `silu(gate) * up` as two forward and five backward, every op a full pass over
its rows and a new tensor. Here each is one loop over its rows, forward and backward, from the
formulas:

- the norm `y = w (x r)`, `r = 1 / sqrt(mean(x^2) + eps)`, keeps `x` and `r`; its gradient is
  `dx = r g - x r^3 mean(g x)` with `g = w dy`. The weight must be frozen (LoRA's base model):
  a norm whose weight trains keeps transformers' forward.
- the gate `h = silu(a) u`, `silu(a) = a s`, `s = 1 / (1 + e^-a)`, keeps `a` and `u`;
  `du = dh silu(a)`, `da = dh u s (1 + a (1 - s))`.

Each product is rounded as PyTorch rounds it, but the sum of squares runs in another order and
the sigmoid's exp is the kernels' own (`kernels.C_HEADER`), so outputs and gradients differ from
PyTorch's in the last bits (`tests/agents/local/test_training_ops.py` holds them to it). On fp32
rows on the CPU only, where the kernels run; anything else takes transformers' forward. That
includes a pass under bf16 autocast (a CPU with native bf16), whose norms read the fp32 residual
stream, and there the norm runs in fp32 as autocast leaves it; its gates take bf16 and stay
PyTorch's. With the rotations below, that took a SmolLM2 GRPO update (LoRA, 4 x 8 ApiReport
episodes) on the 2-core AVX512-BF16 machine a median 0.42 s faster than PyTorch's ops, faster in
9 of 10 alternated pairs of ~10 s (`benchmarks/RESULTS.md`).

The rotary embedding of the queries and keys (transformers' `apply_rotary_pos_emb`: a product,
a negated and concatenated half, another product and a sum, each a new tensor, and as many
backward) goes to `lean_layers.rotated`, whose C pass gives the same values. Under bf16 autocast
the queries and keys are bf16 and the tables fp32, which PyTorch's ops promote to fp32: they go
to the C pass widened, the same outputs, and their gradient summed in fp32 and rounded to bf16
once (PyTorch rounds each of its two products' gradients to bf16 and adds them in bf16).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import cache, partial
from typing import Any

import torch
from cgym.agents.local.instances import replaced
from cgym.agents.local.kernels import C_HEADER, compiled, enabled
from cgym.agents.local.lean_layers import SILU, rotated
from torch import Tensor, nn

NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm")  # `w * (x * rsqrt(mean(x^2) + eps))`, as `lean_layers` reads them
MLPS = ("LlamaMLP", "Qwen2MLP")  # `down(act(gate(x)) * up(x))`
ATTENTIONS = ("LlamaAttention", "Qwen2Attention")  # their modules' `apply_rotary_pos_emb(q, k, cos, sin)` is `x cos + rotate_half(x) sin`

_SOURCE = (
    C_HEADER
    + r"""
/* the sum of a row's squares, sixteen lanes then across them */
static inline float squares(const float *x, long dim) {
    __m512 sum = _mm512_setzero_ps();
    for (long i = 0; i < dim; i += 16) {
        __m512 v = _mm512_maskz_loadu_ps(lanes(dim - i), x + i);
        sum = _mm512_fmadd_ps(v, v, sum);
    }
    return _mm512_reduce_add_ps(sum);
}

/* y[r] = w * (x[r] * rstd[r]), rstd[r] = 1 / sqrt(mean(x[r]^2) + eps) */
void norm_forward(const float *x, const float *w, float *y, float *rstd, long rows, long dim, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim >= 65536)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float inv = 1.0f / sqrtf(squares(xr, dim) / (float)dim + eps);
        rstd[r] = inv;
        __m512 scale = _mm512_set1_ps(inv);
        for (long i = 0; i < dim; i += 16) {
            __mmask16 m = lanes(dim - i);
            __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + i), scale);
            _mm512_mask_storeu_ps(y + r * dim + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + i), v));
        }
    }
}

/* dx[r] = rstd g - x rstd^3 mean(g x), g = w dy[r] */
void norm_backward(const float *x, const float *w, const float *rstd, const float *dy, float *dx, long rows, long dim, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim >= 65536)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * dim, *dr = dy + r * dim;
        __m512 dot = _mm512_setzero_ps();
        for (long i = 0; i < dim; i += 16) {
            __mmask16 m = lanes(dim - i);
            __m512 g = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + i), _mm512_maskz_loadu_ps(m, dr + i));
            dot = _mm512_fmadd_ps(g, _mm512_maskz_loadu_ps(m, xr + i), dot);
        }
        float inv = rstd[r];
        __m512 a = _mm512_set1_ps(inv), b = _mm512_set1_ps(inv * inv * inv * _mm512_reduce_add_ps(dot) / (float)dim);
        for (long i = 0; i < dim; i += 16) {
            __mmask16 m = lanes(dim - i);
            __m512 g = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + i), _mm512_maskz_loadu_ps(m, dr + i));
            _mm512_mask_storeu_ps(dx + r * dim + i, m, _mm512_fnmadd_ps(_mm512_maskz_loadu_ps(m, xr + i), b, _mm512_mul_ps(g, a)));
        }
    }
}

/* s = 1 / (1 + e^-a) from e = e^-|a| (exp_neg's range): 1 / (1 + e) for a >= 0, e / (1 + e) below */
static inline __m512 sigmoid(__m512 a) {
    __m512 e = exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(a)));
    __mmask16 negative = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
}

/* h = silu(a) u over n values */
void gate_forward(const float *a, const float *u, float *h, long n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 65536)
    for (long i = 0; i < n; i += 16) {
        __mmask16 m = lanes(n - i);
        __m512 x = _mm512_maskz_loadu_ps(m, a + i);
        _mm512_mask_storeu_ps(h + i, m, _mm512_mul_ps(_mm512_mul_ps(x, sigmoid(x)), _mm512_maskz_loadu_ps(m, u + i)));
    }
}

/* da = dh u s (1 + a (1 - s)), du = dh silu(a) */
void gate_backward(const float *a, const float *u, const float *dh, float *da, float *du, long n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 65536)
    for (long i = 0; i < n; i += 16) {
        __mmask16 m = lanes(n - i);
        __m512 x = _mm512_maskz_loadu_ps(m, a + i), s = sigmoid(x), d = _mm512_maskz_loadu_ps(m, dh + i);
        __m512 one = _mm512_set1_ps(1.0f);
        __m512 slope = _mm512_mul_ps(s, _mm512_fmadd_ps(x, _mm512_sub_ps(one, s), one));
        _mm512_mask_storeu_ps(da + i, m, _mm512_mul_ps(_mm512_mul_ps(d, _mm512_maskz_loadu_ps(m, u + i)), slope));
        _mm512_mask_storeu_ps(du + i, m, _mm512_mul_ps(d, _mm512_mul_ps(x, s)));
    }
}
"""
)


@cache
def _built() -> ctypes.CDLL | None:
    lib = compiled(_SOURCE, "training_ops")
    if lib is None:
        return None
    for name in ("norm_forward", "norm_backward", "gate_forward", "gate_backward"):
        getattr(lib, name).restype = None
    lib.norm_forward.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_float, ctypes.c_int]
    lib.norm_backward.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 2 + [ctypes.c_int]
    lib.gate_forward.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long, ctypes.c_int]
    lib.gate_backward.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long, ctypes.c_int]
    return lib


def _library() -> ctypes.CDLL | None:
    """The kernels; None where they are off (`CGYM_DECODE_KERNEL=0`) or cannot be built."""
    return _built() if enabled() else None


def _plain(*tensors: Tensor) -> bool:
    """Whether the kernels take these: contiguous fp32 on the CPU. Under CPU autocast as well: no
    op of the norm or the gate is on its lists, so on fp32 rows they run in fp32 there too (a
    bf16-autocast pass's norms read the fp32 residual stream)."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        lib = _built()
        assert lib is not None
        dim = x.shape[-1]
        y, rstd = torch.empty_like(x), x.new_empty(x.numel() // dim)
        lib.norm_forward(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rstd.data_ptr(), rstd.numel(), dim, eps, torch.get_num_threads())
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        lib = _built()
        assert lib is not None
        x, weight, rstd = ctx.saved_tensors
        grad = grad.contiguous()
        dx = torch.empty_like(x)
        lib.norm_backward(x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), grad.data_ptr(), dx.data_ptr(), rstd.numel(), x.shape[-1], torch.get_num_threads())
        return dx, None, None


class _Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:
        lib = _built()
        assert lib is not None
        out = torch.empty_like(gate)
        lib.gate_forward(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), torch.get_num_threads())
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        lib = _built()
        assert lib is not None
        gate, up = ctx.saved_tensors
        grad = grad.contiguous()
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        lib.gate_backward(gate.data_ptr(), up.data_ptr(), grad.data_ptr(), d_gate.data_ptr(), d_up.data_ptr(), gate.numel(), torch.get_num_threads())
        return d_gate, d_up


def rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """`norm(x)` for an RMSNorm of `NORMS`: in the kernels where they take it (a frozen fp32
    weight, contiguous fp32 rows), else its own forward."""
    weight = norm.weight
    if _library() is None or weight.requires_grad or weight.shape != x.shape[-1:] or not _plain(x, weight):
        return type(norm).forward(norm, x)
    return _Norm.apply(x, weight, float(norm.variance_epsilon))


def gated(gate: Tensor, up: Tensor) -> Tensor:
    """`silu(gate) * up`, in the kernels where they take it."""
    if _library() is None or gate.shape != up.shape or not _plain(gate, up):
        return nn.functional.silu(gate) * up
    return _Gate.apply(gate, up)


def _mlp_forward(mlp: nn.Module, x: Tensor) -> Tensor:
    return mlp.down_proj(gated(mlp.gate_proj(x), mlp.up_proj(x)))


def _rotary_embedding(
    original: Callable[..., tuple[Tensor, Tensor]], q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *args: Any, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """transformers' `apply_rotary_pos_emb` for (B, H, T, D) queries and keys by (B, T, D) `cos`
    and `sin`, through `rotated` (its C pass where it fits, PyTorch's ops otherwise: the same
    values); any other call (another layout, more arguments) goes to `original`."""
    if args or kwargs or q.dim() != 4 or cos.dim() != 3:
        return original(q, k, cos, sin, *args, **kwargs)
    if q.dtype == k.dtype != cos.dtype == sin.dtype == torch.promote_types(q.dtype, cos.dtype):
        # bf16 queries and keys (a bf16-autocast pass's projections) by fp32 tables: PyTorch's ops
        # promote them to fp32, so widened they give the same outputs, their gradient rounded once
        q, k = q.to(cos.dtype), k.to(cos.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return rotated(q, cos, sin), rotated(k, cos, sin)


@contextmanager
def fused_training_ops(model: nn.Module) -> Iterator[int]:
    """Within the block, `model`'s RMSNorms (`NORMS`) and SiLU-gated MLPs (`MLPS`) run through
    `rms_norm` and `gated`, and its attentions' (`ATTENTIONS`) rotary embedding through
    `rotated`. Yields how many modules and rotary functions that covers (0 where the kernels do
    not run). The rotary function is its modeling module's, replaced there for the block (the
    attention's forward looks it up at each call): any model of that family in the process gets
    the C pass meanwhile, with the same values."""
    if _library() is None:
        yield 0
        return
    families = {type(m).__module__ for m in model.modules() if type(m).__name__ in ATTENTIONS}
    rotaries = [module for module in (sys.modules.get(name) for name in sorted(families)) if callable(getattr(module, "apply_rotary_pos_emb", None))]
    norms = [m for m in model.modules() if type(m).__name__ in NORMS and hasattr(m, "variance_epsilon")]
    mlps = [
        m
        for m in model.modules()
        if type(m).__name__ in MLPS and type(getattr(m, "act_fn", None)).__name__ in SILU and all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))
    ]
    with ExitStack() as stack:
        count = stack.enter_context(replaced(norms, "forward", lambda norm: partial(rms_norm, norm)))
        count += stack.enter_context(replaced(mlps, "forward", lambda mlp: partial(_mlp_forward, mlp)))
        count += stack.enter_context(replaced(rotaries, "apply_rotary_pos_emb", lambda module: partial(_rotary_embedding, module.apply_rotary_pos_emb)))
        yield count
