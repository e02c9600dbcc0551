"""The backward pass of the training pass's attention, in one C kernel with bf16 dot products.

The GRPO update's attention runs forward in `decode_attention.block_attention` and went back
through PyTorch's CPU flash kernel, in fp32 on fp32 copies of the bf16 queries, keys and
values, with the visibility given as an additive mask: it computed every masked-out product (half
of a row's causal part) and was the update's largest cost after the matmuls (5.8 of 33 s on the
2-core AVX512-BF16 machine, `benchmarks/RESULTS.md`).

Here each of the five products of the backward pass (scores, the gradient's product with the
values, and the gradients of queries, keys and values) is taken with AVX512-BF16's `vdpbf16ps`,
bf16 pairs multiplied exactly and summed in fp32, as FlashAttention's GPU kernels round the
softmax weights and their gradients to bf16 before the last three products. Sixteen keys a
block, blocks a query block sees none of are skipped. Which blocks a block of queries sees is
found once per batch row before the passes, not once per head inside pass 1: every head's
queries read the same visibility rows, and rereading them for each head (two megabytes of bytes
under a SmolLM2 update's prefix trees, for each of three heads) was a fifth of the kernel's time
(ad hoc `bwd_v2.py` on one micro-batch's eight captured calls, 2-core AVX512-BF16 EPYC: 18.6
against 14.7 ms a call, the same bits; `benchmarks/RESULTS.md`). Two passes per kv head:

1. query blocks over key blocks, two key blocks at a time as in the forward kernel
   (`score_and_dp`: `block_products`' sums, over keys and values at once): the scores again
   (bit for bit the forward kernel's), the weights `p = exp(score - lse)`, `dp = dO . v`,
   `ds = p (dp - delta)` with `delta = dO . O`; the query gradient `scale * sum_s ds k_s`;
   `p` and `ds` kept, a 128-byte tile for each block of four queries and sixteen keys.
2. key blocks over query pairs: `dV = sum_m p dO_m` and `dK = scale * sum_m ds q_m`, their
   accumulators in registers.

Built for AVX2 (`agents.local.avx2`), pass 1 takes one key block's scores, then its dp, so that
four queries' accumulators fit AVX2's 16 registers: the same sums, a median 0.82-0.85 of the time
(2-core Zen 3, 4 rows x 3 kv heads x 2,610 queries over 870 causal keys, ad hoc `ab_ab.py`).
Doing the same to the query gradient's loop (a quarter of the head at a time) changed nothing
(0.99-1.00) and was not kept.

It answers None where the kernels do not run (`kernels.compiled`, `CGYM_DECODE_KERNEL=0`, another
head size); the caller keeps the flash kernel.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from cgym.agents.local.decode_attention import ATTENTION_C, HEAD_DIM
from cgym.agents.local.kernels import C_HEADER, aligned, compiled, enabled
from torch import Tensor

_SOURCE = (
    C_HEADER
    + ATTENTION_C
    + r"""
#define BQ 4 /* queries a block in the first pass */
#define BK 4 /* keys a block in the second pass */

/* n rows of D bf16 as pairs of rows: out[i * D + d] = row 2i's element d | row 2i+1's << 16
   (zero past n), for `rows` rows */
static void pair_rows(const uint16_t *x, long n, long rows, uint32_t *out) {
    for (long i = 0; i < rows / 2; i++)
        for (int c = 0; c < 4; c++) {
            __m512i lo = 2 * i < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + 2 * i * D + 16 * c))) : _mm512_setzero_si512();
            __m512i hi = 2 * i + 1 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + (2 * i + 1) * D + 16 * c))) : _mm512_setzero_si512();
            _mm512_store_si512(out + i * D + 16 * c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
}

#define TILE 32 /* u32s a tile: p or ds of BQ queries for sixteen keys, as pairs of queries */

/* Four queries' bf16 values for sixteen keys (x[r] lane t: query r, key t) as one 128-byte
   tile: key t's (q0 | q1 << 16, q2 | q3 << 16) at tile + 2t. Whole lines: scattered over
   sixteen rows of a transposed layout, these stores were a third of pass 1 */
static inline void store_tile(const __m256i x[4], uint32_t *tile) {
    __m256i a = _mm256_unpacklo_epi16(x[0], x[1]), b = _mm256_unpackhi_epi16(x[0], x[1]);
    __m256i c = _mm256_unpacklo_epi16(x[2], x[3]), d = _mm256_unpackhi_epi16(x[2], x[3]);
    /* keys 0-1 | 8-9, 2-3 | 10-11, 4-5 | 12-13, 6-7 | 14-15 (low lane | high lane) */
    __m256i k01 = _mm256_unpacklo_epi32(a, c), k23 = _mm256_unpackhi_epi32(a, c);
    __m256i k45 = _mm256_unpacklo_epi32(b, d), k67 = _mm256_unpackhi_epi32(b, d);
    _mm256_store_si256((__m256i *)tile, _mm256_permute2x128_si256(k01, k23, 0x20));
    _mm256_store_si256((__m256i *)(tile + 8), _mm256_permute2x128_si256(k45, k67, 0x20));
    _mm256_store_si256((__m256i *)(tile + 16), _mm256_permute2x128_si256(k01, k23, 0x31));
    _mm256_store_si256((__m256i *)(tile + 24), _mm256_permute2x128_si256(k45, k67, 0x31));
}

/* The scores (queries qr over packed keys kb) and dp (dO rows orow over packed values vb) of
   `two` key blocks in one loop: block_products' sums in its order, twice as many independent
   ones in flight */
static inline __attribute__((always_inline)) void score_and_dp(const uint32_t *const kb[2], const uint32_t *const vb[2], const uint32_t *const *qr,
                                                               const uint32_t *const *orow, float (*qw)[D], float (*ow)[D], const int two,
                                                               __m512 sc[2][QB], __m512 dp[2][QB]) {
#ifndef __AVX512F__ /* AVX2 (16 registers, each vector two): a block's scores, then its dp, so that
                        the accumulators stay in registers; block_products' sums, in its order */
    for (int b = 0; b < two; b++) {
        block_products(kb + b, qr, qw, BQ, 1, sc + b);
        block_products(vb + b, orow, ow, BQ, 1, dp + b);
    }
#else
    for (int b = 0; b < two; b++)
        for (int r = 0; r < BQ; r++) sc[b][r] = dp[b][r] = _mm512_setzero_ps();
    for (int i = 0; i < 32; i++) {
        __m512i kv[2], vv[2];
        for (int b = 0; b < two; b++) kv[b] = _mm512_load_si512(kb[b] + i * 16), vv[b] = _mm512_load_si512(vb[b] + i * 16);
#ifdef __AVX512BF16__
        (void)qw, (void)ow;
        for (int r = 0; r < BQ; r++) {
            __m512bh x = (__m512bh)_mm512_set1_epi32((int)qr[r][i]), y = (__m512bh)_mm512_set1_epi32((int)orow[r][i]);
            for (int b = 0; b < two; b++) {
                sc[b][r] = _mm512_dpbf16_ps(sc[b][r], x, (__m512bh)kv[b]);
                dp[b][r] = _mm512_dpbf16_ps(dp[b][r], y, (__m512bh)vv[b]);
            }
        }
#else
        (void)qr, (void)orow;
        __m512 khi[2], klo[2], vhi[2], vlo[2];
        for (int b = 0; b < two; b++) khi[b] = bf16_hi(kv[b]), klo[b] = bf16_lo(kv[b]), vhi[b] = bf16_hi(vv[b]), vlo[b] = bf16_lo(vv[b]);
        for (int r = 0; r < BQ; r++) {
            __m512 qodd = _mm512_set1_ps(qw[r][2 * i + 1]), qeven = _mm512_set1_ps(qw[r][2 * i]);
            __m512 oodd = _mm512_set1_ps(ow[r][2 * i + 1]), oeven = _mm512_set1_ps(ow[r][2 * i]);
            for (int b = 0; b < two; b++) {
                sc[b][r] = _mm512_fmadd_ps(qeven, klo[b], _mm512_fmadd_ps(qodd, khi[b], sc[b][r]));
                dp[b][r] = _mm512_fmadd_ps(oeven, vlo[b], _mm512_fmadd_ps(oodd, vhi[b], dp[b][r]));
            }
        }
#endif
    }
#endif
}

#define QC 256 /* queries a chunk at most: p and ds are kept for one chunk at a time */

/* the key blocks a block of BQ queries sees, in order, and which of their keys each query sees:
   found once per batch row (`lives`), not once per head, from its (qlen, S) visibility bytes */
typedef struct { uint16_t j, mask[BQ]; } live_t; /* j < 65,536: `attention_backward` takes S < 2^20 */
typedef struct { long count; live_t seen[]; } lives_t;

typedef struct {
    long blocks, sp, mp, qblocks, half, qc, lsize;
    long vp, ki, qi, oi, delta, flags, pt, st, unit; /* offsets in a unit's workspace (u32), and its size */
} plan_t;

/* Sizes for M queries over S keys, and where a unit's parts lie in its workspace: packed keys
   and values, key pairs, query and dO pairs, delta, the seen-block flags, then the p and ds kept
   for a chunk of qc queries */
static plan_t plan(long M, long S) {
    plan_t p;
    p.blocks = (S + 15) / 16;
    p.sp = p.blocks * 16;
    p.mp = (M + BQ - 1) / BQ * BQ;
    p.qblocks = p.mp / BQ;
    p.half = p.mp / 2;
    p.qc = p.mp < QC ? p.mp : QC;
    p.vp = p.blocks * 512;
    p.ki = p.vp + p.blocks * 512;
    p.qi = p.ki + p.sp / 2 * D;
    p.oi = p.qi + p.half * D;
    p.delta = p.oi + p.half * D;
    p.flags = p.delta + (p.mp + 15) / 16 * 16;
    p.pt = p.flags + (p.qblocks * p.blocks + 63) / 64 * 16;
    p.st = p.pt + p.blocks * (p.qc / BQ) * TILE;
    p.unit = (p.st + p.blocks * (p.qc / BQ) * TILE + 15) / 16 * 16;
    p.lsize = (sizeof(lives_t) + p.blocks * sizeof(live_t) + 63) / 64 * 16;
    return p;
}

/* The workspace (u32) `attention_backward` needs for B x H units of M queries over S keys */
long attention_backward_workspace(long B, long H, long M, long S) { plan_t p = plan(M, S); return B * H * p.unit + B * p.qblocks * p.lsize; }

/* Gradients of softmax attention (B x H units of M contiguous bf16 queries over S keys and
   values, D = 64) from the output's gradient dout (bf16), the forward's fp32 outputs and
   log-sum-exps; query m of a unit reads visibility row m % qlen of its batch row ((B, qlen, S)
   bytes). dq (B, H, M, D), dk and dv (B, H, S, D) are written in fp32. `work` holds
   `attention_backward_workspace` u32s, 64-byte aligned. */
void attention_backward(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *dout,
                        const float *out, const float *lse, const uint8_t *visible,
                        float *dq, float *dk, float *dv, long B, long H, long M, long S, long qlen,
                        float scale, uint32_t *work, int threads) {
    plan_t pl = plan(M, S);
    long units = B * H, blocks = pl.blocks, sp = pl.sp, qblocks = pl.qblocks, qc = pl.qc, kblocks = sp / BK;
#define KP(n) (work + (n) * pl.unit)
#define VP(n) (KP(n) + pl.vp)
#define KI(n) (KP(n) + pl.ki)
#define QI(n) (KP(n) + pl.qi)
#define OI(n) (KP(n) + pl.oi)
#define DELTA(n) ((float *)(KP(n) + pl.delta))
#define FLAGS(n) ((uint8_t *)(KP(n) + pl.flags))
#define PT(n) (KP(n) + pl.pt)
#define ST(n) (KP(n) + pl.st)
#define LIVES(b, qb) ((lives_t *)(work + units * pl.unit + ((b) * qblocks + (qb)) * pl.lsize))
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long n = 0; n < units; n++) { /* packing: keys and values sixteen to a vector, pairs of rows */
            const uint16_t *kn = k + n * S * D, *vn = v + n * S * D, *qn = q + n * M * D, *on = dout + n * M * D;
            pack_keys(kn, S, D, KP(n));
            pack_keys(vn, S, D, VP(n));
            pair_rows(kn, S, sp, KI(n));
            pair_rows(qn, M, pl.mp, QI(n));
            pair_rows(on, M, pl.mp, OI(n));
            memset(FLAGS(n), 0, qblocks * blocks);
            for (long m = 0; m < pl.mp; m++) {
                __m512 sum = _mm512_setzero_ps();
                if (m < M)
                    for (int c = 0; c < 4; c++)
                        sum = _mm512_fmadd_ps(load_bf16(on + m * D + 16 * c, 0xffff), _mm512_loadu_ps(out + (n * M + m) * D + 16 * c), sum);
                DELTA(n)[m] = _mm512_reduce_add_ps(sum);
            }
        }
        /* each query block's seen key blocks, once for every unit of its batch row */
#pragma omp for schedule(static)
        for (long item = 0; item < B * qblocks; item++) {
            long b = item / qblocks, qb = item % qblocks, m0 = qb * BQ, rows = M - m0 < BQ ? M - m0 : BQ;
            const uint8_t *seen[BQ];
            for (int r = 0; r < BQ; r++) seen[r] = visible + (b * qlen + (m0 + (r < rows ? r : rows - 1)) % qlen) * S;
            lives_t *lives = LIVES(b, qb);
            long count = 0;
            for (long j = 0; j < blocks; j++) {
                __mmask16 live[BQ];
                if (!block_live(seen, 0, rows, S, j, live)) continue; /* a block none sees is never read in pass 2 */
                lives->seen[count].j = (uint16_t)j;
                for (int r = 0; r < BQ; r++) lives->seen[count].mask[r] = r < rows ? live[r] : 0; /* a short block's repeats weigh nothing */
                count++;
            }
            lives->count = count;
        }
        for (long c0 = 0; c0 < pl.mp; c0 += qc) {
            long cblocks = (pl.mp - c0 < qc ? pl.mp - c0 : qc) / BQ, cq = c0 / BQ;
            /* pass 1: per block of BQ queries, the key blocks they see */
#pragma omp for schedule(dynamic, 4)
            for (long item = 0; item < units * cblocks; item++) {
                long n = item / cblocks, qb = cq + item % cblocks, m0 = qb * BQ, b = n / H;
                long rows = M - m0 < BQ ? M - m0 : BQ; /* >= 1: mp rounds M up by less than BQ */
                const uint32_t *qr[BQ], *orow[BQ];
                float qw[BQ][D] __attribute__((aligned(64))), ow[BQ][D] __attribute__((aligned(64)));
                __m512 low[BQ], mid[BQ], acc[BQ][4];
                for (int r = 0; r < BQ; r++) {
                    long m = m0 + (r < rows ? r : rows - 1); /* a short block repeats its last query, never written */
                    qr[r] = (const uint32_t *)(q + (n * M + m) * D);
                    orow[r] = (const uint32_t *)(dout + (n * M + m) * D);
                    low[r] = _mm512_set1_ps(lse[n * M + m]);
                    mid[r] = _mm512_set1_ps(DELTA(n)[m]);
                    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
#ifndef __AVX512BF16__
                    for (int c = 0; c < 4; c++) {
                        _mm512_store_ps(qw[r] + 16 * c, load_bf16((const uint16_t *)qr[r] + 16 * c, 0xffff));
                        _mm512_store_ps(ow[r] + 16 * c, load_bf16((const uint16_t *)orow[r] + 16 * c, 0xffff));
                    }
#endif
                }
                const lives_t *lives = LIVES(b, qb);
                for (long e = 0; e < lives->count; e += 2) { /* two seen key blocks a pass */
                    long seen_blocks[2], two = lives->count - e < 2 ? 1 : 2;
                    __mmask16 live[2][BQ];
                    for (int t = 0; t < two; t++) {
                        seen_blocks[t] = lives->seen[e + t].j;
                        for (int r = 0; r < BQ; r++) live[t][r] = lives->seen[e + t].mask[r];
                    }
                    __m512 sc[2][QB], dp[2][QB];
                    const uint32_t *kb[2], *vb[2];
                    for (int t = 0; t < two; t++) kb[t] = KP(n) + seen_blocks[t] * 512, vb[t] = VP(n) + seen_blocks[t] * 512;
                    if (two == 2)
                        score_and_dp(kb, vb, qr, orow, qw, ow, 2, sc, dp);
                    else
                        score_and_dp(kb, vb, qr, orow, qw, ow, 1, sc, dp);
                    for (int t = 0; t < two; t++) {
                        long j = seen_blocks[t];
                        FLAGS(n)[qb * blocks + j] = 1;
                        __m256i pb[BQ], sl[BQ];
                        for (int r = 0; r < BQ; r++) {
                            __m512 p = _mm512_maskz_mov_ps(live[t][r], exp_neg(_mm512_fmsub_ps(sc[t][r], _mm512_set1_ps(scale), low[r])));
                            __m512 ds = _mm512_mul_ps(p, _mm512_sub_ps(dp[t][r], mid[r]));
                            pb[r] = (__m256i)_mm512_cvtneps_pbh(p);
                            sl[r] = (__m256i)_mm512_cvtneps_pbh(ds);
                        }
                        store_tile(pb, PT(n) + (j * (qc / BQ) + qb - cq) * TILE);
                        store_tile(sl, ST(n) + (j * (qc / BQ) + qb - cq) * TILE);
                        const uint32_t *kpair = KI(n) + j * 8 * D;
                        uint32_t dsr[BQ][8] __attribute__((aligned(64)));
                        for (int r = 0; r < BQ; r++) _mm256_store_si256((__m256i *)dsr[r], sl[r]);
                        for (int i = 0; i < 8; i++) { /* dq += ds k over the block's key pairs */
                            __m512bh k0 = (__m512bh)_mm512_load_si512(kpair + i * D), k1 = (__m512bh)_mm512_load_si512(kpair + i * D + 16);
                            __m512bh k2 = (__m512bh)_mm512_load_si512(kpair + i * D + 32), k3 = (__m512bh)_mm512_load_si512(kpair + i * D + 48);
                            for (int r = 0; r < BQ; r++) {
                                __m512bh x = (__m512bh)_mm512_set1_epi32((int)dsr[r][i]);
                                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, k0);
                                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, k1);
                                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], x, k2);
                                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], x, k3);
                            }
                        }
                    }
                }
                for (int r = 0; r < rows; r++)
                    for (int c = 0; c < 4; c++) _mm512_storeu_ps(dq + (n * M + m0 + r) * D + 16 * c, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(scale)));
            }
            /* pass 2: per block of BK keys, the chunk's query pairs whose blocks see them */
#pragma omp for schedule(dynamic, 4)
            for (long item = 0; item < units * kblocks; item++) {
                long n = item / kblocks, s0 = (item % kblocks) * BK, j = s0 / 16;
                if (s0 >= S) continue;
                for (int which = 0; which < 2; which++) { /* dv from p and dO, then dk from ds and q */
                    const uint32_t *weights = which ? ST(n) : PT(n), *rowsi = which ? QI(n) : OI(n);
                    __m512 acc[BK][4];
                    for (int t = 0; t < BK; t++)
                        for (int c = 0; c < 4; c++) acc[t][c] = _mm512_setzero_ps();
                    for (long qb = cq; qb < cq + cblocks; qb++) {
                        if (!FLAGS(n)[qb * blocks + j]) continue;
                        const uint32_t *tile = weights + (j * (qc / BQ) + qb - cq) * TILE + (s0 % 16) * 2;
                        for (int pair = 0; pair < BQ / 2; pair++) {
                            const uint32_t *x = rowsi + (qb * BQ / 2 + pair) * D;
                            __m512bh x0 = (__m512bh)_mm512_load_si512(x), x1 = (__m512bh)_mm512_load_si512(x + 16);
                            __m512bh x2 = (__m512bh)_mm512_load_si512(x + 32), x3 = (__m512bh)_mm512_load_si512(x + 48);
                            for (int t = 0; t < BK; t++) {
                                __m512bh y = (__m512bh)_mm512_set1_epi32((int)tile[2 * t + pair]);
                                acc[t][0] = _mm512_dpbf16_ps(acc[t][0], y, x0);
                                acc[t][1] = _mm512_dpbf16_ps(acc[t][1], y, x1);
                                acc[t][2] = _mm512_dpbf16_ps(acc[t][2], y, x2);
                                acc[t][3] = _mm512_dpbf16_ps(acc[t][3], y, x3);
                            }
                        }
                    }
                    float *target = which ? dk : dv;
                    __m512 times = _mm512_set1_ps(which ? scale : 1.0f);
                    for (int t = 0; t < BK && s0 + t < S; t++)
                        for (int c = 0; c < 4; c++) {
                            float *at = target + (n * S + s0 + t) * D + 16 * c;
                            __m512 x = _mm512_mul_ps(acc[t][c], times);
                            _mm512_storeu_ps(at, c0 ? _mm512_add_ps(_mm512_loadu_ps(at), x) : x);
                        }
                }
            }
        }
    }
}
"""
)


@cache
def _library() -> ctypes.CDLL | None:
    lib = compiled(_SOURCE, "attention_backward")
    if lib is None:
        return None
    lib.attention_backward.restype = None
    lib.attention_backward.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_long] * 5 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    lib.attention_backward_workspace.restype = ctypes.c_long
    lib.attention_backward_workspace.argtypes = [ctypes.c_long] * 4
    return lib


_workspace: list[Tensor] = []  # kept between calls: a fresh one is new pages, and faulting them in cost more than the products


def _work(size: int) -> Tensor:
    """A 64-byte aligned u32 workspace of at least `size` (the largest asked for so far)."""
    if not _workspace or _workspace[0].numel() < size + 16:
        _workspace[:] = [torch.empty(size + 16, dtype=torch.int32)]
    return aligned(_workspace[0])


def attention_backward(
    query: Tensor, key: Tensor, value: Tensor, grad: Tensor, out: Tensor, lse: Tensor, visible: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Gradients of (B, H_kv, M, D) queries, (B, H_kv, S, D) keys and values (bf16, D =
    `HEAD_DIM`) for attention where `visible` ((B, q, S) bool, query m reading row m % q)
    allows, given the output's gradient `grad` and the forward's fp32 output `out` (both (B,
    H_kv, M, D)) and log-sum-exps `lse` ((B, H_kv, M); -inf for a query that sees no key):
    (dq, dk, dv) in fp32. None where the kernel does not run here."""
    batch, heads, queries, dim = query.shape
    keys = key.shape[2]
    if (
        not enabled()
        or dim != HEAD_DIM
        or query.device.type != "cpu"
        or not query.dtype == key.dtype == value.dtype == torch.bfloat16
        or key.shape != (batch, heads, keys, dim)
        or value.shape != key.shape
        or grad.shape != query.shape
        or out.shape != query.shape
        or lse.shape != query.shape[:3]
        or visible.shape != (batch, visible.shape[1], keys)
        or visible.shape[1] == 0
        or queries % visible.shape[1]
        or queries == 0
        or keys == 0
        or keys >= 2**20  # key blocks are numbered in 16 bits
    ):
        return None
    lib = _library()
    if lib is None:
        return None
    q, k, v = (t.detach().contiguous() for t in (query, key, value))
    dout = grad.detach().to(torch.bfloat16).contiguous()
    out, lse = out.detach().float().contiguous(), lse.detach().float().contiguous()
    seen = visible.to(torch.uint8).contiguous()
    dq = torch.empty(query.shape, dtype=torch.float32)
    dk, dv = torch.empty(key.shape, dtype=torch.float32), torch.empty(key.shape, dtype=torch.float32)
    work = _work(lib.attention_backward_workspace(batch, heads, queries, keys))
    lib.attention_backward(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), out.data_ptr(), lse.data_ptr(), seen.data_ptr(),
        dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), batch, heads, queries, keys, visible.shape[1],
        scale, work.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return dq, dk, dv
