"""The sampler's attention over bf16 keys, in two small C kernels: a decode step's few queries, and many.

In a decode step every row has a few queries per kv head (the query heads of its group, times
one id, or a few with drafted ids) over its own cached keys. PyTorch's CPU flash-attention kernel
spends that time on per-(row, head) set-up, not arithmetic: on the 2-core AVX512-BF16 machine,
100 rows x 3 kv heads x 3 queries over ~220 keys took 2.1-2.5 ms a layer where reading the keys
takes ~0.1 ms, more than a third of a 100-row decode step (`benchmarks/RESULTS.md`).
`own_attention` reads each key and value row once for all of its head's queries, takes the dot
products with AVX512-BF16's `vdpbf16ps` (bf16 pairs multiplied exactly, summed in fp32), keeps
the softmax weights in fp32 (the flash kernel rounds them to bf16 before they meet the values),
and returns each query's log-sum-exp, as the flash kernel does, for `kv_cache.split_attention`
to merge with the shared prefix's part.

`block_attention` is the same attention for many queries: a prefill's rows over their own keys,
and every row's queries over the shared system prompt. It lays sixteen keys across a vector's
lanes, so that a block of eight queries gets sixteen scores each from 32 `vdpbf16ps` with no
horizontal sums, and reads the prompt's bf16 keys once for all rows. It scores two key blocks at a
time, so that each query element read from memory feeds both: that read, not the products, bound
the loop (2-core Ice Lake: the whole kernel 1.1-1.3x as fast, `benchmarks/RESULTS.md`). Against the flash kernel on
fp32 copies (2 cores): 100 rows' 101-id prefill over a 269-id prompt 27 against 48 ms a layer,
its own part (303 queries a row over 188 keys, causal) 20 against 50 ms. Built for AVX2
(`agents.local.avx2`: 16 registers, each vector two of them), a block is four queries and key
blocks go one at a time, so that the accumulators stay in registers; each score is the same sum.

They are built on first use (`agents.local.kernels`). Without a compiler, on a CPU without
AVX2, or where the build fails, both answer None and the caller keeps the flash kernel.
`CGYM_DECODE_KERNEL=0` turns them off.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from cgym.agents.local.kernels import C_HEADER, KERNEL_ENV, compiled, enabled
from torch import Tensor

__all__ = ["ATTENTION_C", "FEW_QUERIES", "HEAD_DIM", "KERNEL_ENV", "MAX_QUERIES", "available", "block_attention", "enabled", "own_attention"]
MAX_QUERIES = 16  # per row and kv head (query heads per kv head x new ids): decode steps and drafts
# Up to this many queries per row and kv head `own_attention` is the faster kernel, above it
# `block_attention` (2 cores, 8-100 rows over 220-300 keys: 3 queries 0.57 against 0.87 ms,
# 6 queries 0.15 against 0.13 ms, 15 drafted ones 0.29 against 0.19 ms)
FEW_QUERIES = 4
HEAD_DIM = 64  # the kernel's head size (SmolLM2, Qwen2.5-0.5B, Llama-3.2-1B); others keep flash

# The attention kernels' shared C: packing keys and values, scoring queries against them (many at
# a time against packed keys, or one key at a time), the softmax weights, and weighing the values.
ATTENTION_C = r"""
#define D 64
#define MASKED (-1e30f)
#ifdef __AVX512F__
#define QB 8
#else
#define QB 4 /* AVX2: a block's accumulators in halves, 8 of its 16 registers (8 queries spilled) */
#endif
#define KEYS_AHEAD 16 /* a row's own keys or values fetched this many rows ahead: a decode step's weights have evicted them */

/* the two 64-byte lines of the row KEYS_AHEAD rows past x (rows `stride` elements apart) */
static inline void fetch_ahead(const uint16_t *x, long stride) {
    _mm_prefetch((const char *)(x + KEYS_AHEAD * stride), _MM_HINT_T0);
    _mm_prefetch((const char *)(x + KEYS_AHEAD * stride + 32), _MM_HINT_T0);
}

/* n keys sixteen to a vector: kp gets blocks x 32 x 16 dwords, lane = key, one pair of
   dimensions per vector (zero past n) */
static void pack_keys(const uint16_t *k, long n, long kss, uint32_t *kp) {
    long blocks = (n + 15) / 16;
    memset(kp, 0, sizeof(uint32_t) * blocks * 512);
    for (long s = 0; s < n; s++) {
        fetch_ahead(k + s * kss, kss);
        const uint32_t *ks = (const uint32_t *)(k + s * kss);
        uint32_t *dst = kp + (s / 16) * 512 + (s % 16);
        for (int i = 0; i < 32; i++) dst[i * 16] = ks[i];
    }
}

/* n value rows widened to fp32: vf gets a width x D block (zero past n) */
static void widen_values(const uint16_t *v, long n, long vss, long width, float *vf) {
    memset(vf + n * D, 0, sizeof(float) * (width - n) * D);
    for (long s = 0; s < n; s++) {
        const uint16_t *vs = v + s * vss;
        fetch_ahead(vs, vss);
        for (int c = 0; c < 4; c++) {
            __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vs + 16 * c)));
            _mm512_storeu_ps(vf + s * D + 16 * c, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
        }
    }
}

/* Which of block j's sixteen keys (of n) each of `rows` queries sees (seen[m]: a row of n
   visibility bytes, or seen NULL: every key), and whether any of them sees one */
static inline __attribute__((always_inline)) int block_live(const uint8_t **seen, long m0, long rows, long n, long j, __mmask16 *live) {
    long left = n - j * 16;
    __mmask16 inside = lanes(left);
    int any = 0;
    for (int r = 0; r < rows; r++) {
        live[r] = inside;
        if (seen) {
            const uint8_t *row = seen[m0 + r] + j * 16;
            __m128i bytes = left >= 16 ? _mm_loadu_si128((const __m128i *)row) : _mm_maskz_loadu_epi8(inside, row);
            live[r] &= _mm_test_epi8_mask(bytes, bytes);
        }
        any |= live[r];
    }
    return any != 0;
}

/* acc[b][r] = q_r . each of the sixteen keys of packed block kb[b], for `two` (1 or 2) blocks
   at once. The loop is bound by reading the query elements, not by the products: two blocks
   read each once for both. Without AVX512-BF16 the queries come widened (qw[r][d]: element d
   as fp32) and each pair is the emulated instruction's two FMAs in its order, odd element first. */
static inline __attribute__((always_inline)) void block_products(const uint32_t *const kb[2], const uint32_t *const *qr, float (*qw)[D],
                                                                 const int qb, const int two, __m512 acc[2][QB]) {
    for (int b = 0; b < two; b++)
        for (int r = 0; r < qb; r++) acc[b][r] = _mm512_setzero_ps();
    for (int i = 0; i < 32; i++) {
        __m512i kv[2];
        for (int b = 0; b < two; b++) kv[b] = _mm512_load_si512(kb[b] + i * 16);
#ifdef __AVX512BF16__
        (void)qw;
        for (int r = 0; r < qb; r++) {
            __m512bh x = (__m512bh)_mm512_set1_epi32((int)qr[r][i]);
            for (int b = 0; b < two; b++) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], x, (__m512bh)kv[b]);
        }
#else
        (void)qr;
        __m512 hi[2], lo[2];
        for (int b = 0; b < two; b++) hi[b] = bf16_hi(kv[b]), lo[b] = bf16_lo(kv[b]);
        for (int r = 0; r < qb; r++) {
            __m512 odd = _mm512_set1_ps(qw[r][2 * i + 1]), even = _mm512_set1_ps(qw[r][2 * i]);
            for (int b = 0; b < two; b++) acc[b][r] = _mm512_fmadd_ps(even, lo[b], _mm512_fmadd_ps(odd, hi[b], acc[b][r]));
        }
#endif
    }
}

/* scores[m][s] = (q_m . key s) * scale for n packed keys, in blocks of qb <= QB queries; MASKED
   past n and where seen[m] (a row of n visibility bytes, or NULL: every key) says 0, a block of
   sixteen keys no query of a block sees skipped. peak[m] rises to the largest; span (or NULL)
   widens to [first, last + 1) of the blocks some query sees, and alive[j] (or NULL) turns 1 for
   each block j some query sees. Key blocks go two at a time where both are seen. Inlined with qb
   a constant, so each block size gets its own loops. */
static inline __attribute__((always_inline)) void score_blocks(const uint32_t *kp, long n, const uint16_t **qm, const uint8_t **seen, long M,
                         float scale, float *scores, long width, float *peak, long *span, uint8_t *alive, const int qb) {
    long blocks = (n + 15) / 16;
    const __m512 scaled = _mm512_set1_ps(scale), masked = _mm512_set1_ps(MASKED);
    for (long m0 = 0; m0 < M; m0 += qb) {
        long rows = M - m0 < qb ? M - m0 : qb;
        const uint32_t *qr[QB];
        float qw[QB][D] __attribute__((aligned(64)));
        __m512 top[QB];
        for (int r = 0; r < qb; r++) { /* a short last block repeats its last query */
            qr[r] = (const uint32_t *)qm[m0 + (r < rows ? r : rows - 1)];
            top[r] = masked;
#ifndef __AVX512BF16__
            for (int c = 0; c < 4; c++) _mm512_store_ps(qw[r] + 16 * c, load_bf16((const uint16_t *)qr[r] + 16 * c, 0xffff));
#endif
        }
        for (long j = 0; j < blocks; j += 2) {
            long count = j + 1 < blocks ? 2 : 1;
            __mmask16 live[2][QB];
            int any[2] = {0, 0};
            for (int b = 0; b < count; b++) {
                any[b] = block_live(seen, m0, rows, n, j + b, live[b]);
                if (!any[b]) /* a block none of these queries sees (a causal row's later keys, padding) */
                    for (int r = 0; r < rows; r++) _mm512_store_ps(scores + (m0 + r) * width + (j + b) * 16, masked);
            }
            __m512 acc[2][QB];
            const uint32_t *kb[2] = {kp + j * 512, kp + (j + 1) * 512};
            if (any[0] && any[1]) {
#ifdef __AVX512F__
                block_products(kb, qr, qw, qb, 2, acc);
#else /* AVX2: a block a loop, each block's sums as they were */
                block_products(kb, qr, qw, qb, 1, acc);
                block_products(kb + 1, qr, qw, qb, 1, acc + 1);
#endif
            } else if (any[0] || any[1]) {
                kb[0] = kb[any[1]];
                block_products(kb, qr, qw, qb, 1, acc);
            }
            for (int b = 0; b < count; b++) {
                if (!any[b]) continue;
                long jb = j + b;
                const __m512 *sums = acc[any[0] && any[1] ? b : 0];
                if (span) {
                    if (jb < span[0]) span[0] = jb;
                    if (jb + 1 > span[1]) span[1] = jb + 1;
                }
                if (alive) alive[jb] = 1;
                for (int r = 0; r < rows; r++) {
                    __m512 x = _mm512_mask_mul_ps(masked, live[b][r], sums[r], scaled);
                    top[r] = _mm512_max_ps(top[r], x);
                    _mm512_store_ps(scores + (m0 + r) * width + jb * 16, x);
                }
            }
        }
        for (int r = 0; r < rows; r++) {
            float high = _mm512_reduce_max_ps(top[r]);
            if (high > peak[m0 + r]) peak[m0 + r] = high;
        }
    }
}

/* score_blocks in blocks of 8 queries, or of a decode step's 1-4 as they come (a block of 8 or 4
   spent its other products on repeated queries) */
static void score_packed(const uint32_t *kp, long n, const uint16_t **qm, const uint8_t **seen, long M,
                         float scale, float *scores, long width, float *peak, long *span, uint8_t *alive) {
    switch (M) {
        case 1: score_blocks(kp, n, qm, seen, M, scale, scores, width, peak, span, alive, 1); return;
        case 2: score_blocks(kp, n, qm, seen, M, scale, scores, width, peak, span, alive, 2); return;
        case 3: score_blocks(kp, n, qm, seen, M, scale, scores, width, peak, span, alive, 3); return;
        case 4: score_blocks(kp, n, qm, seen, M, scale, scores, width, peak, span, alive, 4); return;
        default: score_blocks(kp, n, qm, seen, M, scale, scores, width, peak, span, alive, QB);
    }
}

#ifndef __AVX512BF16__
/* The lane sums of sixteen vectors (p[t]: key t's products), in key order, each summed in
   `_mm512_reduce_add_ps`' order (GCC's: lanes i + 8, then j + 4, then (0 + 2) + (1 + 3)), but the
   sixteen at once: 46 operations where the one at a time took ~9 a key. */
static inline __m512 sums16(const __m512 p[16]) {
    __m512 half[8], quarter[4], pair[2];
    for (int i = 0; i < 8; i++) /* keys 2i | 2i + 1: lanes i + (i + 8), 8 apiece */
        half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                                _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)));
    for (int j = 0; j < 4; j++) /* keys 4j .. 4j + 3, a 128-bit lane apiece: j + (j + 4) */
        quarter[j] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * j], half[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                                   _mm512_shuffle_f32x4(half[2 * j], half[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)));
    for (int l = 0; l < 2; l++) /* (0 + 2), (1 + 3): lane L holds keys 8l + L and 8l + 4 + L */
        pair[l] = _mm512_add_ps(_mm512_shuffle_ps(quarter[2 * l], quarter[2 * l + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_ps(quarter[2 * l], quarter[2 * l + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* the last sum: element 4L + q holds key L + 4q */
    __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pair[0], pair[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(pair[0], pair[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

/* score_each for M a constant, on a CPU without AVX512-BF16: the queries widened to fp32 once and
   each key once for them all, then the FMAs the emulated instruction runs, in its order (odd
   elements, then even): the same bits, without unpacking both operands at every product. Keys
   go sixteen at a time (`sums16`) where the visibility rows are contiguous, the rest one by one. */
/* a row of D bf16 as four fp32 vectors: odd elements of its first half, even ones, then the second half's */
static inline void widen_row(const uint16_t *row, __m512 out[4]) {
    __m512i a0 = _mm512_loadu_si512(row), a1 = _mm512_loadu_si512(row + 32);
    out[0] = bf16_hi(a0), out[1] = bf16_lo(a0), out[2] = bf16_hi(a1), out[3] = bf16_lo(a1);
}

/* a query's and a key's four widened vectors multiplied and summed lane by lane, in the emulated
   instruction's order */
static inline __m512 products(const __m512 q[4], const __m512 k[4]) {
    __m512 acc = _mm512_fmadd_ps(q[0], k[0], _mm512_setzero_ps());
    acc = _mm512_fmadd_ps(q[1], k[1], acc);
    acc = _mm512_fmadd_ps(q[2], k[2], acc);
    return _mm512_fmadd_ps(q[3], k[3], acc);
}

static inline __attribute__((always_inline)) void each_fixed(const uint16_t *k, long n, long kss, const uint16_t **qm, const uint8_t **seen,
                                                             long iss, const int M, float scale, float *scores, long width, float *peak) {
    __m512 qw[4][4], kw[4];
    for (int m = 0; m < M; m++) widen_row(qm[m], qw[m]);
    long s = 0;
    if (iss == 1) {
        const __m512 masked = _mm512_set1_ps(MASKED), scaled = _mm512_set1_ps(scale);
        __m512 top[4], part[4][16];
        for (int m = 0; m < M; m++) top[m] = masked;
        for (; s + 16 <= n; s += 16) {
            for (int t = 0; t < 16; t++) {
                fetch_ahead(k + (s + t) * kss, kss);
                widen_row(k + (s + t) * kss, kw);
                for (int m = 0; m < M; m++) part[m][t] = products(qw[m], kw);
            }
            for (int m = 0; m < M; m++) {
                __m128i bytes = _mm_loadu_si128((const __m128i *)(seen[m] + s));
                __m512 x = _mm512_mask_mul_ps(masked, _mm_test_epi8_mask(bytes, bytes), sums16(part[m]), scaled);
                top[m] = _mm512_max_ps(x, top[m]); /* a NaN score leaves the peak, as `score > peak` did */
                _mm512_storeu_ps(scores + m * width + s, x);
            }
        }
        for (int m = 0; m < M; m++) {
            float high = _mm512_reduce_max_ps(top[m]);
            if (high > peak[m]) peak[m] = high;
        }
    }
    for (; s < n; s++) {
        fetch_ahead(k + s * kss, kss);
        widen_row(k + s * kss, kw);
        for (int m = 0; m < M; m++) {
            float score = MASKED;
            if (seen[m][s * iss]) {
                score = _mm512_reduce_add_ps(products(qw[m], kw)) * scale;
                if (score > peak[m]) peak[m] = score;
            }
            scores[m * width + s] = score;
        }
    }
}
#endif

/* The same scores one key at a time, from keys as they lie (few queries: packing would cost more
   than it saves); seen rows strided by iss */
static void score_each(const uint16_t *k, long n, long kss, const uint16_t **qm, const uint8_t **seen, long iss,
                       long M, float scale, float *scores, long width, float *peak) {
    long done = 0; /* keys scored before the loop below */
#ifndef __AVX512BF16__
    switch (M) {
        case 1: each_fixed(k, n, kss, qm, seen, iss, 1, scale, scores, width, peak); done = n; break;
        case 2: each_fixed(k, n, kss, qm, seen, iss, 2, scale, scores, width, peak); done = n; break;
        case 3: each_fixed(k, n, kss, qm, seen, iss, 3, scale, scores, width, peak); done = n; break;
        case 4: each_fixed(k, n, kss, qm, seen, iss, 4, scale, scores, width, peak); done = n; break;
    }
#endif
    for (long s = done; s < n; s++) {
        const uint16_t *ks = k + s * kss;
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(ks), k1 = (__m512bh)_mm512_loadu_si512(ks + 32);
        for (long m = 0; m < M; m++) {
            float score = MASKED;
            if (seen[m][s * iss]) {
                __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(qm[m]), k0);
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qm[m] + 32), k1);
                score = _mm512_reduce_add_ps(acc) * scale;
                if (score > peak[m]) peak[m] = score;
            }
            scores[m * width + s] = score;
        }
    }
    for (long m = 0; m < M; m++)
        for (long s = n; s < width; s++) scores[m * width + s] = MASKED;
}

/* scores -> exp(score - peak[m]) in place (0 where masked) for columns [from, to) (multiples of
   16; the rest are masked and never read), skipping the blocks of sixteen that alive (or NULL:
   none) marks 0, which are never read either; adds each row's sum to total[m] */
static void weigh_span(float *scores, long width, long from, long to, long M, const float *peak, float *total, const uint8_t *alive) {
    const __m512 masked = _mm512_set1_ps(MASKED);
    for (long m = 0; m < M; m++) {
        float *row = scores + m * width;
        __m512 top = _mm512_set1_ps(peak[m]), sum = _mm512_setzero_ps();
        for (long s = from; s < to; s += 16) {
            if (alive && !alive[s / 16]) continue;
            __m512 x = _mm512_load_ps(row + s);
            __mmask16 live = _mm512_cmp_ps_mask(x, masked, _CMP_GT_OQ);
            __m512 w = _mm512_maskz_mov_ps(live, exp_neg(_mm512_sub_ps(x, top)));
            _mm512_store_ps(row + s, w);
            sum = _mm512_add_ps(sum, w);
        }
        total[m] += _mm512_reduce_add_ps(sum);
    }
}

static void weigh(float *scores, long width, long M, const float *peak, float *total) { weigh_span(scores, width, 0, width, M, peak, total, NULL); }

/* acc[m] += w[m][s] * (r0, r1, r2, r3) for queries m < M: one value row's four vectors. A query
   whose weight is 0 (a masked key) adds nothing, not even 0 x a stray NaN. */
#define ADD_ROW(acc, M, w, width, s, r0, r1, r2, r3)                                 \
    for (long m_ = 0; m_ < (M); m_++) {                                                 \
        float x_ = (w)[m_ * (width) + (s)];                                             \
        __mmask16 live_ = x_ != 0.0f ? (__mmask16)0xffff : (__mmask16)0;                \
        __m512 ww_ = _mm512_set1_ps(x_);                                                \
        acc[m_][0] = _mm512_mask3_fmadd_ps(ww_, r0, acc[m_][0], live_);                \
        acc[m_][1] = _mm512_mask3_fmadd_ps(ww_, r1, acc[m_][1], live_);                \
        acc[m_][2] = _mm512_mask3_fmadd_ps(ww_, r2, acc[m_][2], live_);                \
        acc[m_][3] = _mm512_mask3_fmadd_ps(ww_, r3, acc[m_][3], live_);                \
    }

/* acc[m] += sum over s < n of w[m][s] * vf[s] (fp32 value rows). Inlined with M a constant, the
   sums stay in registers (held in `acc`, they left and came back for every product). */
static inline __attribute__((always_inline)) void values_loop(const float *vf, long n, const float *w, long width, long M, __m512 acc[16][4]) {
    __m512 a[16][4];
    for (long m = 0; m < M; m++)
        for (int c = 0; c < 4; c++) a[m][c] = acc[m][c];
    for (long s = 0; s < n; s++) {
        const float *vs = vf + s * D;
        __m512 v0 = _mm512_loadu_ps(vs), v1 = _mm512_loadu_ps(vs + 16), v2 = _mm512_loadu_ps(vs + 32), v3 = _mm512_loadu_ps(vs + 48);
        ADD_ROW(a, M, w, width, s, v0, v1, v2, v3);
    }
    for (long m = 0; m < M; m++)
        for (int c = 0; c < 4; c++) acc[m][c] = a[m][c];
}

/* values_loop from bf16 value rows read as pairs: even elements land in acc[m][0] and [2], odd
   ones in [1] and [3] (`interleave` puts them back in order) */
static inline __attribute__((always_inline)) void pairs_loop(const uint16_t *v, long n, long vss, const float *w, long width, long M,
                                                             __m512 acc[16][4]) {
    __m512 a[16][4];
    for (long m = 0; m < M; m++)
        for (int c = 0; c < 4; c++) a[m][c] = acc[m][c];
    for (long s = 0; s < n; s++) {
        const uint16_t *vs = v + s * vss;
        fetch_ahead(vs, vss);
        __m512i v0 = _mm512_loadu_si512(vs), v1 = _mm512_loadu_si512(vs + 32);
        __m512 r0 = bf16_lo(v0), r1 = bf16_hi(v0), r2 = bf16_lo(v1), r3 = bf16_hi(v1);
        ADD_ROW(a, M, w, width, s, r0, r1, r2, r3);
    }
    for (long m = 0; m < M; m++)
        for (int c = 0; c < 4; c++) acc[m][c] = a[m][c];
}

/* Each query's sums run in s order whatever M is: the same bits for a query alone or among
   others. The queries go four at a time through a loop of constant size, their sums in registers
   (a loop over all M, above four, kept them in memory: a drafted step's values took longer than
   its scores). */
static void add_values(const float *vf, long n, const float *w, long width, long M, __m512 acc[16][4]) {
    for (long m0 = 0; m0 < M; m0 += 4)
        switch (M - m0 < 4 ? M - m0 : 4) {
            case 1: values_loop(vf, n, w + m0 * width, width, 1, acc + m0); break;
            case 2: values_loop(vf, n, w + m0 * width, width, 2, acc + m0); break;
            case 3: values_loop(vf, n, w + m0 * width, width, 3, acc + m0); break;
            default: values_loop(vf, n, w + m0 * width, width, 4, acc + m0);
        }
}

static void add_pairs(const uint16_t *v, long n, long vss, const float *w, long width, long M, __m512 acc[16][4]) {
    for (long m0 = 0; m0 < M; m0 += 4)
        switch (M - m0 < 4 ? M - m0 : 4) {
            case 1: pairs_loop(v, n, vss, w + m0 * width, width, 1, acc + m0); break;
            case 2: pairs_loop(v, n, vss, w + m0 * width, width, 2, acc + m0); break;
            case 3: pairs_loop(v, n, vss, w + m0 * width, width, 3, acc + m0); break;
            default: pairs_loop(v, n, vss, w + m0 * width, width, 4, acc + m0);
        }
}

static void interleave(__m512 acc[4], float *row) {
    float even[16], odd[16];
    for (int half = 0; half < 2; half++) {
        _mm512_storeu_ps(even, acc[2 * half]);
        _mm512_storeu_ps(odd, acc[2 * half + 1]);
        for (int i = 0; i < 16; i++) {
            row[32 * half + 2 * i] = even[i];
            row[32 * half + 2 * i + 1] = odd[i];
        }
    }
}

"""

_SOURCE = (
    C_HEADER
    + ATTENTION_C
    + r"""
/* out[b, h, m, :] = softmax over the visible s of (q[b, h, m] . k[b, h, s]) * scale, times v;
   lse[b, h, m] = log of that softmax's denominator (-inf, and out 0, where no key is visible).
   Query m reads visibility row m % qlen. Strides in elements; the last dimension is contiguous.
   Answers 0, or -1 with nothing written where there is no memory for its scratch. */
int own_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint8_t *visible,
                  float *out, float *lse, long B, long H, long M, long S, long qlen,
                  long qsb, long qsh, long qsm, long ksb, long ksh, long kss,
                  long vsb, long vsh, long vss, long isb, long isq, long iss,
                  float scale, int threads) {
    long width = (S + 15) & ~15L;
    size_t bytes = sizeof(float) * M * width;
    char *scratch = thread_scratch(threads, bytes);
    if (!scratch) return -1;
#pragma omp parallel num_threads(threads)
    {
        float *scores = own_slice(scratch, bytes);
#pragma omp for collapse(2) schedule(static)
        for (long b = 0; b < B; b++) {
            for (long h = 0; h < H; h++) {
                const uint16_t *qm[16];
                const uint8_t *seen[16];
                float peak[16], total[16], row[D];
                for (long m = 0; m < M; m++) {
                    qm[m] = q + b * qsb + h * qsh + m * qsm;
                    seen[m] = visible + b * isb + (m % qlen) * isq;
                    peak[m] = MASKED;
                    total[m] = 0.0f;
                }
                score_each(k + b * ksb + h * ksh, S, kss, qm, seen, iss, M, scale, scores, width, peak);
                weigh(scores, width, M, peak, total);
                __m512 acc[16][4];
                for (long m = 0; m < M; m++)
                    for (int c = 0; c < 4; c++) acc[m][c] = _mm512_setzero_ps();
                add_pairs(v + b * vsb + h * vsh, S, vss, scores, width, M, acc);
                for (long m = 0; m < M; m++) {
                    lse[(b * H + h) * M + m] = peak[m] == MASKED ? -INFINITY : peak[m] + logf(total[m]);
                    __m512 inv = _mm512_set1_ps(peak[m] == MASKED ? 0.0f : 1.0f / total[m]);
                    interleave(acc[m], row);
                    for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + ((b * H + h) * M + m) * D + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(row + 16 * c), inv));
                }
            }
        }
    }
    free(scratch);
    return 0;
}

/* The same attention for many queries per (row, head): a prefill's, or every row's queries
   against a shared prefix (ksb = vsb = isb = 0: one copy of the keys for every row; visible may be
   NULL, every key seen). A thread packs its (row, head)'s keys sixteen to a vector (`pack_keys`),
   each packed vector serving a block of QB queries; the values are widened to fp32 once, and the
   softmax weights stay fp32. Visibility rows must be contiguous (iss = 1). Answers 0, or -1
   with nothing written where there is no memory for its scratch. */
#define PB 4
int block_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint8_t *visible,
                    float *out, float *lse, long B, long H, long M, long S, long qlen,
                    long qsb, long qsh, long qsm, long ksb, long ksh, long kss,
                    long vsb, long vsh, long vss, long isb, long isq,
                    float scale, int threads) {
    long blocks = (S + 15) / 16, width = blocks * 16, qblocks = (M + QB - 1) / QB;
    size_t kbytes = slice64(sizeof(uint32_t) * blocks * 32 * 16), vbytes = slice64(sizeof(float) * width * D);
    size_t bytes = kbytes + vbytes + sizeof(float) * QB * width + blocks; /* packed keys, widened values, scores, live blocks */
    char *scratch = thread_scratch(threads, bytes);
    if (!scratch) return -1;
    SHARES(shares, threads); /* a thread's run of items keeps its packed keys (`FOR_UNITS`) */
#pragma omp parallel num_threads(threads)
    {
        char *mine = own_slice(scratch, bytes);
        uint32_t *kp = (uint32_t *)mine;
        float *vf = (float *)(mine + kbytes), *scores = (float *)(mine + kbytes + vbytes);
        uint8_t *alive = (uint8_t *)(scores + QB * width);
        const uint16_t *packed_k = NULL, *packed_v = NULL;
        share_units(shares, B * H * qblocks);
        FOR_UNITS(shares, item, visit) {
            long bh = item / qblocks, m0 = (item % qblocks) * QB, b = bh / H, h = bh % H;
            long rows = M - m0 < QB ? M - m0 : QB;
            const uint16_t *kb = k + b * ksb + h * ksh, *vb = v + b * vsb + h * vsh;
            if (kb != packed_k || vb != packed_v) { /* this thread's first block of a (row, head) */
                pack_keys(kb, S, kss, kp);
                widen_values(vb, S, vss, width, vf);
                packed_k = kb;
                packed_v = vb;
            }
            const uint16_t *qm[QB];
            const uint8_t *seen[QB];
            float peak[QB], total[QB];
            for (int r = 0; r < rows; r++) {
                qm[r] = q + b * qsb + h * qsh + (m0 + r) * qsm;
                seen[r] = visible ? visible + b * isb + ((m0 + r) % qlen) * isq : NULL;
                peak[r] = MASKED;
                total[r] = 0.0f;
            }
            long span[2] = {blocks, 0};
            memset(alive, 0, blocks);
            score_packed(kp, S, qm, visible ? seen : NULL, rows, scale, scores, width, peak, span, alive);
            long first = span[0] * 16, last = span[1] * 16 < S ? span[1] * 16 : S; /* keys past these weigh 0 */
            weigh_span(scores, width, first, span[1] * 16, rows, peak, total, alive); /* a causal block's later keys, and blocks none of these queries sees: no exps */
            for (int r = 0; r < rows; r++)
                lse[(b * H + h) * M + m0 + r] = peak[r] == MASKED ? -INFINITY : peak[r] + logf(total[r]);
            for (int r0 = 0; r0 < rows; r0 += PB) { /* PB queries' accumulators stay in registers */
                __m512 acc[PB][4];
                for (int r = 0; r < PB; r++)
                    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
                const float *w0 = scores + r0 * width;
                for (long s = first; s < last; s++) {
                    if (!alive[s / 16]) { /* a block of sixteen keys none of these queries sees: all its weights 0 */
                        s |= 15;
                        continue;
                    }
                    const float *vs = vf + s * D;
                    __m512 v0 = _mm512_load_ps(vs), v1 = _mm512_load_ps(vs + 16), v2 = _mm512_load_ps(vs + 32), v3 = _mm512_load_ps(vs + 48);
                    for (int r = 0; r < PB; r++) {
                        __m512 w = _mm512_set1_ps(w0[r * width + s]);
                        acc[r][0] = _mm512_fmadd_ps(w, v0, acc[r][0]);
                        acc[r][1] = _mm512_fmadd_ps(w, v1, acc[r][1]);
                        acc[r][2] = _mm512_fmadd_ps(w, v2, acc[r][2]);
                        acc[r][3] = _mm512_fmadd_ps(w, v3, acc[r][3]);
                    }
                }
                for (int r = 0; r < PB && r0 + r < rows; r++) {
                    __m512 inv = _mm512_set1_ps(peak[r0 + r] == MASKED ? 0.0f : 1.0f / total[r0 + r]);
                    for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + ((b * H + h) * M + m0 + r0 + r) * D + 16 * c, _mm512_mul_ps(acc[r][c], inv));
                }
            }
        }
    }
    free(scratch);
    return 0;
}
"""
)


@cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels (`kernels.compiled`), their signatures set; None where they cannot be built."""
    lib = compiled(_SOURCE, "own_attention")
    if lib is None:
        return None
    lib.own_attention.restype = ctypes.c_int
    lib.own_attention.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_long] * 17 + [ctypes.c_float, ctypes.c_int]
    lib.block_attention.restype = ctypes.c_int
    lib.block_attention.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_long] * 16 + [ctypes.c_float, ctypes.c_int]
    return lib


def available() -> bool:
    """Whether `own_attention` runs the kernel here (enabled, and built or buildable)."""
    return enabled() and _library() is not None


def _takes(query: Tensor, key: Tensor, value: Tensor, visible: Tensor | None) -> bool:
    """What both kernels need: enabled; bf16 CPU tensors with contiguous rows; (B, H_kv, M, D)
    queries with D = HEAD_DIM over (., H_kv, S, D) keys and values, S > 0; a visibility
    ((B, q, S), q > 0 dividing M) if any; no gradients wanted."""
    batch, heads, queries, dim = query.shape
    return (
        enabled()
        and dim == HEAD_DIM
        and query.device.type == "cpu"
        and query.dtype == key.dtype == value.dtype == torch.bfloat16
        and key.shape[1] == heads
        and value.shape == key.shape
        and key.shape[2] > 0
        and (visible is None or (visible.shape == (batch, visible.shape[1], key.shape[2]) and visible.shape[1] > 0 and queries % visible.shape[1] == 0))
        and all(t.stride(-1) == 1 for t in (query, key, value))
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)))
    )


def own_attention(query: Tensor, key: Tensor, value: Tensor, visible: Tensor, scale: float) -> tuple[Tensor, Tensor] | None:
    """(B, H_kv, M, D) bf16 queries over (B, H_kv, S, D) bf16 keys and values where `visible`
    ((B, q, S) bool; query m reads row m % q) allows: (B, H_kv, M, D) fp32 outputs and (B, H_kv, M)
    fp32 log-sum-exps of the scaled scores (-inf, and output 0, for a query that sees no key).
    None where the kernel does not apply (another dtype, device or head size, a prefill's many
    queries, gradients wanted, no kernel here, no memory for its scratch): the caller runs its
    own path."""
    batch, heads, queries, dim = query.shape
    if not _takes(query, key, value, visible) or queries > MAX_QUERIES or key.shape[0] != batch:
        return None
    lib = _library()
    if lib is None:
        return None
    seen = visible.to(torch.uint8)
    out = torch.empty((batch, heads, queries, dim), dtype=torch.float32)
    lse = torch.empty((batch, heads, queries), dtype=torch.float32)
    failed = lib.own_attention(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), seen.data_ptr(), out.data_ptr(), lse.data_ptr(),
        batch, heads, queries, key.shape[2], visible.shape[1],
        *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *seen.stride(),
        scale, torch.get_num_threads(),
    )  # fmt: skip
    return None if failed else (out, lse)


def block_attention(query: Tensor, key: Tensor, value: Tensor, visible: Tensor | None, scale: float) -> tuple[Tensor, Tensor] | None:
    """`own_attention` for any number of queries: (B, H_kv, M, D) bf16 queries over (B, H_kv, S,
    D) bf16 keys and values, or (1, H_kv, S, D) ones that every row reads (a shared prefix),
    where `visible` ((B, q, S) bool, query m reading row m % q; None: every key) allows. The
    same outputs, exact to fp32 rounding against fp64; None where the kernel does not apply or
    has no memory for its scratch."""
    batch, heads, queries, dim = query.shape
    if not _takes(query, key, value, visible) or queries == 0 or key.shape[0] not in (1, batch):
        return None
    lib = _library()
    if lib is None:
        return None
    shared = key.shape[0] == 1 and batch > 1
    seen = visible.to(torch.uint8).contiguous() if visible is not None else None
    out = torch.empty((batch, heads, queries, dim), dtype=torch.float32)
    lse = torch.empty((batch, heads, queries), dtype=torch.float32)
    failed = lib.block_attention(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), None if seen is None else seen.data_ptr(), out.data_ptr(), lse.data_ptr(),
        batch, heads, queries, key.shape[2], 1 if seen is None else seen.shape[1],
        *query.stride()[:3], 0 if shared else key.stride(0), *key.stride()[1:3], 0 if shared else value.stride(0), *value.stride()[1:3],
        0 if seen is None else seen.stride(0), 0 if seen is None else seen.stride(1),
        scale, torch.get_num_threads(),
    )  # fmt: skip
    return None if failed else (out, lse)
