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

/* Row u of (U, V) logits x (rows xs apart): lse[u] = log sum_v exp(x[u, v] inv_t); then pick k
   scores row row_of[k]: picked[k] = x[row_of[k], target[k]] inv_t - lse[row_of[k]]. */
void row_logprobs(const logit *x, const int64_t *row_of, const int64_t *target, float *lse, float *picked,
                  long U, long K, long V, long xs, float inv_t, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < U; r++) {
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
    }
    for (long k = 0; k < K; k++) {
        long r = row_of[k];
        picked[k] = VALUE(x[r * xs + target[k]]) * inv_t - lse[r];
    }
}

/* The gradient of the picks with respect to x. Row u's picks, merged by target, are entries
   first[u] .. first[u + 1] - 1 of (target, weight); total[u] is the sum of their weights:
   out[u, v] = inv_t (sum of row u's weights on target v - total[u] exp(x[u, v] inv_t - lse[u])),
   in the logits' dtype, rows os apart. */
void row_logprobs_backward(const logit *x, const float *lse, const float *total, const int64_t *first,
                           const int64_t *target, const float *weight, logit *out,
                           long U, long V, long xs, long os, float inv_t, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < U; r++) {
        const logit *row = x + r * xs;
        logit *dst = out + r * os;
        const __m512 scale = _mm512_set1_ps(inv_t), low = _mm512_set1_ps(lse[r]), each = _mm512_set1_ps(-total[r] * inv_t);
        for (long v = 0; v < V; v += 16) {
            __mmask16 m = lanes(V - v);
            __m512 w = _mm512_mul_ps(exp_neg(_mm512_fmsub_ps(LOAD(row + v, m), scale, low)), each);
            STORE(dst + v, m, w);
        }
        for (long e = first[r]; e < first[r + 1]; e++) {
            long t = target[e];
            float p = expf(VALUE(row[t]) * inv_t - lse[r]);
            dst[t] = NARROW(-p * total[r] * inv_t + weight[e] * inv_t);
        }
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
    lib.row_logprobs.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 4 + [ctypes.c_float, ctypes.c_int]
    lib.row_logprobs_backward.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_long] * 4 + [ctypes.c_float, ctypes.c_int]
    return lib


def _kernel_for(logits: Tensor) -> ctypes.CDLL | None:
    """The C kernels where they take these (K, V) logits: bf16 or fp32 on the CPU, rows contiguous."""
    if logits.dtype not in (torch.bfloat16, torch.float32) or logits.device.type != "cpu" or logits.dim() != 2 or logits.stride(-1) != 1 or not enabled():
        return None
    return _library(logits.dtype)


class _Picks:
    """Which logit row each pick scores, and the picks merged by (row, target): the backward
    pass sums a row's weights in a fixed order (`index_add_` runs serially on the CPU), so
    picks that share a row give the same gradient bits on any number of threads."""

    def __init__(self, row_of: Tensor, targets: Tensor, rows: int, width: int) -> None:
        self.row_of, self.rows = row_of, rows
        pairs, self.pair_of = torch.unique(row_of * width + targets, return_inverse=True)  # sorted: grouped by row
        self.pair_rows, self.pair_targets = pairs // width, pairs % width
        counts = torch.bincount(self.pair_rows, minlength=rows)
        self.first = torch.cat([counts.new_zeros(1), counts.cumsum(0)])

    def sums(self, grad: Tensor) -> tuple[Tensor, Tensor]:
        """(per-row total, per-pair weight) of the picks' gradient."""
        total = grad.new_zeros(self.rows).index_add_(0, self.row_of, grad)
        return total, grad.new_zeros(len(self.pair_rows)).index_add_(0, self.pair_of, grad)


class _RowLogprobs(torch.autograd.Function):
    """(U, V) logits, (K,) targets, (K,) logit row of each target, temperature -> (K,) log-probs in fp32."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, row_of: Tensor, temperature: float) -> Tensor:
        ctx.temperature = temperature
        targets, row_of = targets.to(torch.int64).contiguous(), row_of.to(torch.int64).contiguous()
        summed = row_log_sum_exps(logits, row_of, targets, temperature)
        if summed is not None:
            lse, picked = summed
            ctx.save_for_backward(logits, lse, targets, row_of)
            return picked
        scaled = _scaled_fp32(logits, temperature)
        lse = torch.logsumexp(scaled, dim=-1)
        ctx.save_for_backward(logits, lse, targets, row_of)
        return scaled[row_of, targets] - lse[row_of]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        logits, lse, targets, row_of = ctx.saved_tensors
        picks = _Picks(row_of, targets, *logits.shape)
        inverse = 1.0 / ctx.temperature
        total, weight = picks.sums(grad.float().contiguous())
        lib = _kernel_for(logits)
        if lib is not None:
            out = torch.empty_like(logits, memory_format=torch.contiguous_format)
            rows, width = logits.shape
            lib.row_logprobs_backward(
                logits.data_ptr(), lse.data_ptr(), total.data_ptr(), picks.first.data_ptr(), picks.pair_targets.data_ptr(), weight.data_ptr(), out.data_ptr(),
                rows, width, logits.stride(0), out.stride(0), inverse, torch.get_num_threads(),
            )  # fmt: skip
            return out, None, None, None
        out = _scaled_fp32(logits, ctx.temperature)
        out.sub_(lse[:, None]).exp_().mul_(total[:, None] * -inverse)  # -softmax * grad / T
        out.index_put_((picks.pair_rows, picks.pair_targets), weight * inverse, accumulate=True)  # + onehot * grad / T; each (row, target) once
        return out.to(logits.dtype), None, None, None


def row_log_sum_exps(logits: Tensor, rows: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor] | None:
    """For (U, V) logits: each row's `logsumexp(logits / temperature)` (U,) and the log-probs of
    (K,) `targets` in (K,) logit `rows` (K,), in one pass of the C kernel, no gradient; None
    where it does not take the logits."""
    lib = _kernel_for(logits)
    if lib is None:
        return None
    row_of, target = rows.to(torch.int64).contiguous(), targets.to(torch.int64).contiguous()
    lse, picked = torch.empty(logits.shape[0]), torch.empty(len(target))
    lib.row_logprobs(
        logits.data_ptr(), row_of.data_ptr(), target.data_ptr(), lse.data_ptr(), picked.data_ptr(),
        logits.shape[0], len(target), logits.shape[1], logits.stride(0), 1.0 / temperature, torch.get_num_threads(),
    )  # fmt: skip
    return lse, picked


def _scaled_fp32(logits: Tensor, temperature: float) -> Tensor:
    """A new fp32 tensor holding `logits / temperature` (never the logits themselves)."""
    out = logits.to(torch.float32, copy=True)
    return out.mul_(1.0 / temperature) if temperature != 1.0 else out


def target_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0, *, rows: Tensor | None = None) -> Tensor:
    """(B, K, V) logits and (B, K) target ids -> (B, K) fp32 log-probs of the targets under
    `log_softmax(logits / temperature)`. Differentiable; one row's fp32 copy of the logits exists
    at a time, in the forward and in the backward pass.

    With `rows` (B, K), target k is scored against logit row `rows[b, k]` of (B, U, V) logits:
    a prefix tree's node that several picks share is run through the head once, and its
    gradient gathered from theirs in a fixed order (an indexed copy's backward pass adds
    repeated rows with atomic adds whose order, on two threads, differs from run to run).

    The rows come from `unbind`, whose backward stacks the rows' gradients into one new tensor;
    indexing `logits[b]` would give each row's gradient as a zero-filled (B, K, V) tensor, summed
    across rows (a 3-row chunk of 306 kept columns, forward and backward: 105-166 ms against 138-348 ms,
    bit-identical)."""
    if rows is None:
        rows = torch.arange(targets.shape[1], device=targets.device).expand_as(targets)
    if rows.shape != targets.shape or (rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < logits.shape[1])):
        raise ValueError(f"rows {tuple(rows.shape)} must match targets {tuple(targets.shape)} and index the logits' {logits.shape[1]} rows")
    batch = zip(logits.unbind(0), targets.unbind(0), rows.unbind(0))
    return torch.stack([_RowLogprobs.apply(row, target, row_of, temperature) for row, target, row_of in batch])
