"""Log-probs of target ids under `log_softmax(logits / T)`, one fused autograd step per row.

A loss pass scores a few hundred columns against SmolLM2's 49,152-token vocabulary. Written as
`gather - logsumexp` on an fp32 copy of the logits, autograd keeps that fp32 copy for the
backward pass and takes several passes over it (the gather's zero-filled gradient, the
logsumexp's exp and product, the division's, the cast back). Its gradient is known in closed
form, `d/dlogits [logit_t / T - logsumexp(logits / T)] = (onehot_t - softmax(logits / T)) / T`,
so the backward pass here builds it in one fp32 buffer, and only the logits themselves (bf16
under autocast: half the bytes) are kept.

For bf16 logits on a CPU that runs `agents.local.kernels`, both passes are one C loop per row:
the forward reads the bf16 row twice (max, then the sum of exps) and writes nothing of its size,
the backward writes the bf16 gradient directly. The fp32 copies those passes made (~50 MB per
row of 263 columns, each new) took ~50-75 ms a row on the 2-core machine. fp32 logits (an fp32
training pass's, where the CPU has no native bf16) take the same loops, compiled for fp32.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

import torch
from cgym.agents.local.kernels import C_HEADER, compiled, enabled
from torch import Tensor

_SOURCE = r"""
#ifdef FP32_LOGITS /* the same loops over fp32 logits, and an fp32 gradient */
typedef float logit;
#define LOAD(p, m) _mm512_maskz_loadu_ps(m, p)
#define VALUE(x) (x)
#define STORE(p, m, w) _mm512_mask_storeu_ps(p, m, w)
#define NARROW(f) (f)
#else
typedef uint16_t logit;
#define LOAD(p, m) load_bf16(p, m)
#define VALUE(x) bf16_value(x)
#define STORE(p, m, w) _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(w))
#define NARROW(f) to_bf16(f)
#endif

static inline uint16_t to_bf16(float f) { /* round to nearest even, as PyTorch casts */
    uint32_t bits; memcpy(&bits, &f, 4);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Row r of (K, V) logits x (rows xs apart): lse[r] = log sum_v exp(x[r, v] inv_t), and
   picked[r] = x[r, target[r]] inv_t - lse[r]. */
void row_logprobs(const logit *x, const int64_t *target, float *lse, float *picked,
                  long K, long V, long xs, float inv_t, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < K; r++) {
        const logit *row = x + r * xs;
        const __m512 scale = _mm512_set1_ps(inv_t);
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (long v = 0; v < V; v += 16) {
            __mmask16 m = lanes(V - v);
            top = _mm512_mask_max_ps(top, m, top, _mm512_mul_ps(LOAD(row + v, m), scale));
        }
        float peak = _mm512_reduce_max_ps(top);
        __m512 high = _mm512_set1_ps(peak), sum = _mm512_setzero_ps();
        for (long v = 0; v < V; v += 16) {
            __mmask16 m = lanes(V - v);
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, exp_neg(_mm512_fmsub_ps(LOAD(row + v, m), scale, high))));
        }
        lse[r] = peak + logf(_mm512_reduce_add_ps(sum));
        picked[r] = VALUE(row[target[r]]) * inv_t - lse[r];
    }
}

/* The gradient of picked with respect to x, times grad: out[r, v] = bf16(grad[r] inv_t
   (onehot(target[r])[v] - exp(x[r, v] inv_t - lse[r]))), rows os apart. */
void row_logprobs_backward(const logit *x, const int64_t *target, const float *lse, const float *grad,
                           logit *out, long K, long V, long xs, long os, float inv_t, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < K; r++) {
        const logit *row = x + r * xs;
        logit *dst = out + r * os;
        const __m512 scale = _mm512_set1_ps(inv_t), low = _mm512_set1_ps(lse[r]), weight = _mm512_set1_ps(-grad[r] * inv_t);
        for (long v = 0; v < V; v += 16) {
            __mmask16 m = lanes(V - v);
            __m512 w = _mm512_mul_ps(exp_neg(_mm512_fmsub_ps(LOAD(row + v, m), scale, low)), weight);
            STORE(dst + v, m, w);
        }
        long t = target[r];
        float p = expf(VALUE(row[t]) * inv_t - lse[r]);
        dst[t] = NARROW(-p * grad[r] * inv_t + grad[r] * inv_t);
    }
}
"""


@cache
def _library(dtype: torch.dtype = torch.bfloat16) -> ctypes.CDLL | None:
    """The kernels for bf16 or for fp32 logits (the training pass's where it runs in fp32)."""
    fp32 = dtype == torch.float32
    lib = compiled(C_HEADER + ("#define FP32_LOGITS\n" if fp32 else "") + _SOURCE, "row_logprobs_fp32" if fp32 else "row_logprobs")
    if lib is None:
        return None
    lib.row_logprobs.restype = lib.row_logprobs_backward.restype = None
    lib.row_logprobs.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_float, ctypes.c_int]
    lib.row_logprobs_backward.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 4 + [ctypes.c_float, ctypes.c_int]
    return lib


def _kernel_for(logits: Tensor) -> ctypes.CDLL | None:
    """The C kernels where they take these (K, V) logits: bf16 or fp32 on the CPU, rows contiguous."""
    if logits.dtype not in (torch.bfloat16, torch.float32) or logits.device.type != "cpu" or logits.dim() != 2 or logits.stride(-1) != 1 or not enabled():
        return None
    return _library(logits.dtype)


class _RowLogprobs(torch.autograd.Function):
    """(K, V) logits, (K,) targets, temperature -> (K,) log-probs in fp32."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
        ctx.temperature = temperature
        lib = _kernel_for(logits)
        if lib is not None:
            targets = targets.to(torch.int64).contiguous()
            rows, width = logits.shape
            lse, picked = torch.empty(rows), torch.empty(rows)
            lib.row_logprobs(logits.data_ptr(), targets.data_ptr(), lse.data_ptr(), picked.data_ptr(), rows, width, logits.stride(0), 1.0 / temperature, torch.get_num_threads())
            ctx.save_for_backward(logits, targets, lse)
            return picked
        scaled = _scaled_fp32(logits, temperature)
        lse = torch.logsumexp(scaled, dim=-1)
        ctx.save_for_backward(logits, targets, lse)
        return scaled.gather(-1, targets[:, None]).squeeze(-1) - lse

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        logits, targets, lse = ctx.saved_tensors
        inverse = 1.0 / ctx.temperature
        lib = _kernel_for(logits)
        if lib is not None:
            grad = grad.float().contiguous()
            out = torch.empty_like(logits, memory_format=torch.contiguous_format)
            rows, width = logits.shape
            lib.row_logprobs_backward(logits.data_ptr(), targets.data_ptr(), lse.data_ptr(), grad.data_ptr(), out.data_ptr(), rows, width, logits.stride(0), out.stride(0), inverse, torch.get_num_threads())
            return out, None, None
        out = _scaled_fp32(logits, ctx.temperature)
        out.sub_(lse[:, None]).exp_().mul_(grad[:, None] * -inverse)  # -softmax * grad / T
        out.scatter_add_(-1, targets[:, None], grad[:, None] * inverse)  # + onehot * grad / T
        return out.to(logits.dtype), None, None


def _scaled_fp32(logits: Tensor, temperature: float) -> Tensor:
    """A new fp32 tensor holding `logits / temperature` (never the logits themselves)."""
    out = logits.to(torch.float32, copy=True)
    return out.mul_(1.0 / temperature) if temperature != 1.0 else out


def target_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """(B, K, V) logits and (B, K) target ids -> (B, K) fp32 log-probs of the targets under
    `log_softmax(logits / temperature)`. Differentiable; one row's fp32 copy of the logits exists
    at a time, in the forward and in the backward pass.

    The rows come from `unbind`, whose backward stacks the rows' gradients into one new tensor;
    indexing `logits[b]` would give each row's gradient as a zero-filled (B, K, V) tensor, summed
    across rows (a 3-row chunk of 306 kept columns, forward and backward: 105-166 ms against 138-348 ms,
    bit-identical)."""
    rows = zip(logits.unbind(0), targets.unbind(0))
    return torch.stack([_RowLogprobs.apply(row, target, temperature) for row, target in rows])
