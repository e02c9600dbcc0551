"""Linear layers with their weights pre-packed for oneDNN, for sampling on CPUs with native bf16.

A bf16 `F.linear` on the CPU hands oneDNN a plain row-major weight, which it reorders into its
blocked layout at every call. A decode step of a few rows is bound by reading the weights, and
the reorder reads and writes each one again: on the 2-core AVX512-BF16 machine a 1536 x 576
layer at 12 rows took 170 us (10 GB/s of weights) plain and 102 us (17 GB/s) packed once, with
the same products (`benchmarks/RESULTS.md`). Packing happens once per set of weights: when the
sampler folds or copies them for a new optimizer step.

Where this project's C kernels run (`agents.local.kernels`), the weights are packed for one of
its own instead: sixteen outputs a block, each as pairs of inputs, summed with `vdpbf16ps` for
six rows at a time against four blocks (five without AVX512-BF16, below). oneDNN read the
weights at 12-19 GB/s for the few rows of a decode step; this kernel (at five rows a tile) at up
to 31, and matches it at hundreds of rows (SmolLM2's 120 body layers, ad hoc
`few_rows_kernel.py`: 7.7 against 10.1 ms for 5 rows, 15.6 against 19.0 for 20, 60.0 against
65.1 for 100, 349.9 against 344.5 for 600). Its sums run in the order oneDNN's
few-row kernel runs them, so a step of a few rows gives the same bits; past ~16 rows oneDNN
blocks its sums otherwise, and outputs may differ in the last bf16 bit.

A last block of fewer rows runs as a tile of its own rows (it had run a whole one, repeating its
last): the same sums, and on SmolLM2's layers (2-core Ice Lake, weights in cache, ad hoc
`small_m.py`) one row of a 576 -> 3072 layer took 59 against 173 us, six rows 139 against 207.
Six rows a tile rather than five (the thirty-first session, on the 2-core AVX512-BF16 EPYC): a
pass over SmolLM2's 121 packed layers, out of cache, alternated 9 times (ad hoc `rb_bench.py`),
took as long or less at every row count tried, 1 to 512 (the old time over the new): 1.00-1.03x
at 1 row, 1.05-1.09x at 8, 1.08x at 12, 1.06x at 16 and 32, 1.02x at 24, 1.01-1.03x at 64-512.
A tile's row count changes which rows share a weight load, not any sum's order: the same bits.

On a CPU without AVX512-BF16 each pair's two products are two FMAs on widened operands, in the
same order, so every path below gives the same bits. From 3 rows on, the call's rows are widened
once into fp32 and each pair's weights in registers (`pair_rows`), so the FMAs read row values
from memory and only the weights are unpacked: a median 1.07 times the pair loop's speed on
SmolLM2's layers at 1-40 rows (0.92-1.19), and as fast or faster than the panel below up to 64
rows. From 96 rows on, a group's weights are widened once into an fp32 panel that every row
tile reads, and the rows into fp32, 1,024 at a time (`pair_wide`), each pair's two inputs
swapped so that the tile is a plain product loop: 1.03-1.13 times `pair_rows` at 100-240 rows,
and 1.0-1.3 times the panel before the swap at 256-1,024 (2-core Ice Lake, alternated, ad hoc
`rows_ab.py`, `rw_ab.py`, `cross_ab.py` and `packed_ab.py`; the panel ran at 200-310 GFLOP/s
as the host's speed went, where PyTorch's fp32 products ran at ~200-230).

A decode step of few rows reads every weight once, from memory (SmolLM2's 212 MB of bf16 body
weights are more than the caches hold), in four streams a thread (a group's four blocks). The
pair loop and `pair_rows` fetch each stream `AHEAD` lines ahead of their loads: over those 212 MB
(2-core Ice Lake, alternated, ad hoc `stream_ab.py`, `pf_ab.py`) 1-16 rows ran 5-17% faster,
more while the host was slow, and 24 rows or more within the noise. `pair_wide` reads a
group's weights once for many rows and gained nothing from it, nor from fetching the next
group's while a group's tiles ran (100 rows: 1.00 of the time without; 300 rows: 1.06, ad hoc
`pf_off.py`). The pair loop's tiles after a group's first read its weights from cache, and its
first tile streamed them from memory: now a group's second tile fetches the next group's
weights into L2 as it runs. Over SmolLM2's 120 body layers and its LM head (the 2-core
AVX512-BF16 EPYC, 9 alternated passes, ad hoc `pd_v2.py`; the same bits) 12 rows took 10.4
against 12.9 ms, 18-32 rows 10-13% less, 64 rows 5% less; 1-6 rows, one tile, are unchanged.

Built for AVX2 (`agents.local.avx2`: each 16-lane vector as two halves, 16 registers where
AVX-512 has 32), the AVX-512 tiles spilled: on a 2-core Zen 3, over three SmolLM2 layers, they
took 2.2-2.5x the time of PyTorch's fp32 products at 100-400 rows. There a group is one block,
a pair tile 4 rows and a panel tile 5 (6 spilled one accumulator): 0.43-0.79x PyTorch's time at
1-32 rows, 0.86-0.96x at 100-400 (ad hoc `pl_bench.py`). The order of each sum is unchanged.

Only for inference (the packed ops have no backward) and only where `packable` says the CPU and
the dtype take it; `tests/agents/local/test_packed.py` holds the results to `F.linear`'s.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from functools import cache
from typing import Any

import torch
from cgym.agents.local.kernels import C_HEADER, aligned, compiled, enabled
from torch import Tensor, nn

_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)

_SOURCE = (
    C_HEADER
    + r"""
#if defined(__AVX512BF16__)
#define RB 6 /* rows a block: 24 accumulators and 4 weight vectors, 28 of the 32 registers (below) */
#elif defined(__AVX512F__)
#define RB 5 /* the widened FMAs below need registers of their own */
#else
#define RB 4 /* AVX2's 16 registers: 8 accumulator halves, 4 widened weight halves, 2 row values */
#endif
#ifdef __AVX512F__
#define CB 4 /* blocks of 16 outputs a group */
#else
#define CB 1 /* each block two registers wide */
#endif
#define AHEAD 24 /* lines fetched ahead in each block's weights: a few-row step streams them from memory (below) */

/* acc[r][c] += row r's pairs (xr[r]) dotted with block c's (wg: CB blocks of pairs x 16 u32), R rows:
   a tile of constant shape wherever R is a constant */
static inline __attribute__((always_inline)) void dot_tile(const uint32_t *const *xr, const uint32_t *wg, long pairs, int R, __m512 acc[RB][CB], const uint32_t *next) {
    for (long i = 0; i < pairs; i++) {
        __m512bh wv[CB];
        for (int c = 0; c < CB; c++) wv[c] = (__m512bh)_mm512_load_si512(wg + (c * pairs + i) * 16);
        if (next)
            for (int c = 0; c < CB; c++) _mm_prefetch((const char *)(next + (c * pairs + i) * 16), _MM_HINT_T1);
        else
            for (int c = 0; c < CB; c++) _mm_prefetch((const char *)(wg + (c * pairs + i + AHEAD) * 16), _MM_HINT_T0);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xr[r][i]);
            for (int c = 0; c < CB; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
}

/* y's rows r0 .. r0 + rows - 1, blocks b0 .. b0 + cb - 1: bf16(acc + bias), nearest even. A macro,
   not a function: passed by pointer, the accumulators left registers (2-4% slower in three
   alternated runs, ad hoc `head_ab.py`). */
#define STORE_ROWS(acc, rows, cb, bias, b0, y, r0, N)                                                                     \
    for (int r_ = 0; r_ < (rows); r_++)                                                                                   \
        for (int c_ = 0; c_ < (cb); c_++) {                                                                               \
            __m512 out_ = (bias) ? _mm512_add_ps(acc[r_][c_], _mm512_loadu_ps((bias) + ((b0) + c_) * 16)) : acc[r_][c_]; \
            _mm256_storeu_si256((__m256i *)((y) + ((r0) + r_) * (N) + ((b0) + c_) * 16), (__m256i)_mm512_cvtneps_pbh(out_)); \
        }

/* y (M x N, bf16) = x (M x K, bf16) w^T (+ bias, fp32, or NULL); w packed as N / 16 blocks of
   K / 2 x 16 u32, each one output's pair of inputs (k even | k odd << 16) */
static void pair_dot(const uint16_t *x, const uint32_t *w, const float *bias, uint16_t *y, long M, long K, long N, int threads) {
    long blocks = N / 16, groups = (blocks + CB - 1) / CB, pairs = K / 2, tiles = (M + RB - 1) / RB;
    SHARES(shares, threads);
    /* shared out by (group, row tile): SmolLM2's 576 outputs are 9 groups, which two threads
       split 5 to 4 by group alone; a tile's sums are the same on either thread */
#pragma omp parallel num_threads(threads)
    {
        share_units(shares, groups * tiles);
        FOR_UNITS(shares, unit, visit) {
            long g = unit / tiles, t = unit % tiles, b0 = g * CB, cb = blocks - b0 < CB ? blocks - b0 : CB, r0 = t * RB;
            const uint32_t *wg = w + b0 * pairs * 16;
            int rows = M - r0 < RB ? (int)(M - r0) : RB;
            const uint32_t *xr[RB];
            for (int r = 0; r < rows; r++) xr[r] = (const uint32_t *)(x + (r0 + r) * K); /* tiles read only their own rows */
            __m512 acc[RB][CB];
            for (int r = 0; r < RB; r++)
                for (int c = 0; c < CB; c++) acc[r][c] = _mm512_setzero_ps();
            /* a group's second tile fetches the next group's weights into L2 as it reads its own from cache */
            const uint32_t *next = t == 1 && blocks - b0 >= 2 * CB ? wg + CB * pairs * 16 : NULL; /* the next group, where it is a whole one */
            if (cb == CB)
                switch (rows) { /* a short last block: a tile of its own rows, not a full one */
#if RB > 5
                    case 6: dot_tile(xr, wg, pairs, 6, acc, next); break;
#endif
#if RB > 4
                    case 5: dot_tile(xr, wg, pairs, 5, acc, next); break;
#endif
                    case 4: dot_tile(xr, wg, pairs, 4, acc, next); break;
                    case 3: dot_tile(xr, wg, pairs, 3, acc, next); break;
                    case 2: dot_tile(xr, wg, pairs, 2, acc, next); break;
                    default: dot_tile(xr, wg, pairs, 1, acc, next);
                }
            else
                for (long i = 0; i < pairs; i++)
                    for (int c = 0; c < cb; c++) {
                        __m512bh wv = (__m512bh)_mm512_load_si512(wg + (c * pairs + i) * 16);
                        for (int r = 0; r < rows; r++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)_mm512_set1_epi32((int)xr[r][i]), wv);
                    }
            STORE_ROWS(acc, rows, cb, bias, b0, y, r0, N);
        }
    }
}

#ifdef __AVX512BF16__
void pair_linear(const uint16_t *x, const uint32_t *w, const float *bias, uint16_t *y, long M, long K, long N, int threads) {
    pair_dot(x, w, bias, y, M, K, N, threads);
}
#else
/* Without the instruction, each pair's two products are two FMAs on widened operands. Where a
   group's weights serve many rows, they are widened once into a panel (per pair, the odd inputs'
   sixteen weights of each block, then the even inputs'), the rows once into fp32, and the tiles
   run FMAs alone: the same products added in the same order, so the same bits as `pair_dot`.
   The rows are widened with each pair's two inputs swapped, the odd one first as the
   instruction sums them, so that panel row s meets row element s: the tile is then a plain
   fp32 product loop (1.1-1.3x the loop that picked each pair's inputs apart, 2-core Ice Lake). */
#ifdef __AVX512F__
#define WR 6 /* rows a tile: 24 accumulators, 4 weight vectors, a broadcast row value */
#else
#define WR 5 /* AVX2: 10 accumulator halves, 2 weight halves, a row value; 6 rows spilled one accumulator */
#endif
#define WIDE_ROWS 96 /* fewer: `pair_rows` was as fast or faster (ad hoc `cross_ab.py`: the panel 0.83-0.97x at 16-32 rows, 0.96-1.05x at 48-80, 1.03-1.13x at 100-240) */
#define FEW_ROWS 3 /* fewer: the pair loop, which widens nothing, was as fast or faster than `pair_rows` (ad hoc `rows_ab.py`) */

/* acc += R rows, widened and swapped (`widen_swapped`), times the panel's 2 pairs rows of C blocks */
static inline __attribute__((always_inline)) void wide_tile(const float *xs, long K, const float *panel, long pairs, int R, int C,
                                                            __m512 acc[WR][CB]) {
    for (long s = 0; s < 2 * pairs; s++) {
        const float *p = panel + s * CB * 16;
        __m512 wv[CB];
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) wv[c] = _mm512_load_ps(p + c * 16);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_set1_ps(xs[r * K + s]);
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
}

/* M rows of K bf16 into fp32, each pair of inputs swapped (2i + 1 at 2i, 2i at 2i + 1) */
static void widen_swapped(const uint16_t *x, long M, long K, float *xs) {
#pragma omp for schedule(static)
    for (long r = 0; r < M; r++)
        for (long k = 0; k < K; k += 16)
            _mm512_mask_storeu_ps(xs + r * K + k, lanes(K - k), _mm512_permute_ps(load_bf16(x + r * K + k, lanes(K - k)), 0xB1));
}

/* FEW_ROWS to WIDE_ROWS - 1 rows: the rows widened once into fp32 (`widen_swapped`, M K values, cheap) and each
   pair's weights widened in registers as the loop reaches them. A tile's FMAs then take their
   row values from memory, and the only unpacking left is the weights' (8 operations to 40 FMAs;
   the pair loop also splits each row's pair, 18 to 40): the same products in the same order. */
static inline __attribute__((always_inline)) void row_tile(const float *xw, long K, const uint32_t *wg, long pairs, int R, int C,
                                                           __m512 acc[RB][CB]) {
    for (long i = 0; i < pairs; i++) {
        __m512 odd[CB], even[CB];
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) {
            __m512i v = _mm512_load_si512(wg + (c * pairs + i) * 16);
            _mm_prefetch((const char *)(wg + (c * pairs + i + AHEAD) * 16), _MM_HINT_T0);
            odd[c] = bf16_hi(v);
            even[c] = bf16_lo(v);
        }
#pragma GCC unroll 5
        for (int r = 0; r < R; r++) {
            __m512 xo = _mm512_set1_ps(xw[r * K + 2 * i]), xe = _mm512_set1_ps(xw[r * K + 2 * i + 1]); /* swapped */
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(xe, even[c], _mm512_fmadd_ps(xo, odd[c], acc[r][c]));
        }
    }
}

static void pair_rows(const uint16_t *x, const uint32_t *w, const float *bias, uint16_t *y, long M, long K, long N, int threads) {
    float *xw = aligned64(sizeof(float) * (M * K + 16));
    if (!xw) {
        pair_dot(x, w, bias, y, M, K, N, threads);
        return;
    }
    SHARES(shares, threads); /* (group, row tile) units in shares, as `pair_wide`'s */
    long blocks = N / 16, groups = (blocks + CB - 1) / CB, pairs = K / 2, tiles = (M + RB - 1) / RB;
#pragma omp parallel num_threads(threads)
    {
        share_units(shares, groups * tiles);
        widen_swapped(x, M, K, xw); /* in the products' region: one team's start a call, not two */
        FOR_UNITS(shares, unit, visit) {
            long g = unit / tiles, t = unit % tiles, b0 = g * CB, cb = blocks - b0 < CB ? blocks - b0 : CB, r0 = t * RB;
            const uint32_t *wg = w + b0 * pairs * 16;
            const float *xr = xw + r0 * K;
            int rows = M - r0 < RB ? (int)(M - r0) : RB;
            __m512 acc[RB][CB];
            for (int r = 0; r < RB; r++)
                for (int c = 0; c < CB; c++) acc[r][c] = _mm512_setzero_ps();
            if (cb < CB) row_tile(xr, K, wg, pairs, rows, (int)cb, acc);
            else switch (rows) { /* each a tile of constant shape */
#if RB > 4
                case 5: row_tile(xr, K, wg, pairs, 5, CB, acc); break;
#endif
                case 4: row_tile(xr, K, wg, pairs, 4, CB, acc); break;
                case 3: row_tile(xr, K, wg, pairs, 3, CB, acc); break;
                case 2: row_tile(xr, K, wg, pairs, 2, CB, acc); break;
                default: row_tile(xr, K, wg, pairs, 1, CB, acc);
            }
            STORE_ROWS(acc, rows, cb, bias, b0, y, r0, N);
        }
    }
    free(xw);
}

/* Each thread a share of the (group, row tile) units (`FOR_UNITS`): a group's panel is widened
   once for each run of its tiles that a thread takes. */
static void pair_wide(const uint16_t *x, const uint32_t *w, const float *bias, uint16_t *y, long M, long K, long N, int threads) {
    long blocks = N / 16, groups = (blocks + CB - 1) / CB, pairs = K / 2, tiles = (M + WR - 1) / WR;
    size_t bytes = sizeof(float) * pairs * 2 * CB * 16; /* a thread's panel */
    float *xw = aligned64(sizeof(float) * (M * K + 16));
    char *panels = thread_scratch(threads, bytes);
    if (!xw || !panels) { /* no room for the widened rows or panels: the pair loop needs neither */
        free(xw);
        free(panels);
        pair_dot(x, w, bias, y, M, K, N, threads);
        return;
    }
    SHARES(shares, threads);
#pragma omp parallel num_threads(threads)
    {
        share_units(shares, groups * tiles);
        widen_swapped(x, M, K, xw);
        float *panel = own_slice(panels, bytes);
        long held = -1; /* the group whose weights the panel holds */
        FOR_UNITS(shares, unit, visit) {
            long g = unit / tiles, t = unit % tiles, b0 = g * CB, cb = blocks - b0 < CB ? blocks - b0 : CB, r0 = t * WR;
            if (held != g) {
                const uint32_t *wg = w + b0 * pairs * 16;
                for (long i = 0; i < pairs; i++)
                    for (int c = 0; c < cb; c++) {
                        __m512i wv = _mm512_load_si512(wg + (c * pairs + i) * 16);
                        _mm512_store_ps(panel + (2 * i) * CB * 16 + c * 16, bf16_hi(wv));
                        _mm512_store_ps(panel + (2 * i + 1) * CB * 16 + c * 16, bf16_lo(wv));
                    }
                held = g;
            }
            int rows = M - r0 < WR ? (int)(M - r0) : WR;
            __m512 acc[WR][CB];
            for (int r = 0; r < WR; r++)
                for (int c = 0; c < CB; c++) acc[r][c] = _mm512_setzero_ps();
            const float *xr = xw + r0 * K;
            if (cb < CB) wide_tile(xr, K, panel, pairs, rows, (int)cb, acc);
            else switch (rows) { /* each a tile of constant shape */
#if WR > 5
                case 6: wide_tile(xr, K, panel, pairs, 6, CB, acc); break;
#endif
                case 5: wide_tile(xr, K, panel, pairs, 5, CB, acc); break;
                case 4: wide_tile(xr, K, panel, pairs, 4, CB, acc); break;
                case 3: wide_tile(xr, K, panel, pairs, 3, CB, acc); break;
                case 2: wide_tile(xr, K, panel, pairs, 2, CB, acc); break;
                default: wide_tile(xr, K, panel, pairs, 1, CB, acc);
            }
            STORE_ROWS(acc, rows, cb, bias, b0, y, r0, N);
        }
    }
    free(panels);
    free(xw);
}

#define WIDE_SPAN 1024 /* rows widened at a time: a 512-id prefill of 100 rows would otherwise widen 51,200 */

void pair_linear(const uint16_t *x, const uint32_t *w, const float *bias, uint16_t *y, long M, long K, long N, int threads) {
    if (M < WIDE_ROWS) {
        (M < FEW_ROWS ? pair_dot : pair_rows)(x, w, bias, y, M, K, N, threads);
        return;
    }
    for (long r0 = 0; r0 < M; r0 += WIDE_SPAN)
        pair_wide(x + r0 * K, w, bias, y + r0 * N, M - r0 < WIDE_SPAN ? M - r0 : WIDE_SPAN, K, N, threads);
}
void pair_linear_dot(const uint16_t *x, const uint32_t *w, const float *bias, uint16_t *y, long M, long K, long N, int threads) {
    pair_dot(x, w, bias, y, M, K, N, threads);
}
void pair_linear_wide(const uint16_t *x, const uint32_t *w, const float *bias, uint16_t *y, long M, long K, long N, int threads) {
    pair_wide(x, w, bias, y, M, K, N, threads);
}
void pair_linear_rows(const uint16_t *x, const uint32_t *w, const float *bias, uint16_t *y, long M, long K, long N, int threads) {
    pair_rows(x, w, bias, y, M, K, N, threads);
}
#endif
"""
)


@cache
def _library() -> ctypes.CDLL | None:
    lib = compiled(_SOURCE, "pair_linear")
    if lib is None:
        return None
    for name in ("pair_linear", "pair_linear_dot", "pair_linear_wide", "pair_linear_rows"):  # the last three: each path alone, without AVX512-BF16
        if hasattr(lib, name):
            getattr(lib, name).restype = None
            getattr(lib, name).argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    return lib


def _pairs(weight: Tensor) -> Tensor:
    """(N, K) bf16 -> (N / 16, K / 2, 16) int32: each block's outputs side by side, a pair of
    inputs per element, as `pair_linear` reads them (64-byte aligned)."""
    out_features, in_features = weight.shape
    pairs = weight.contiguous().view(torch.int32)  # (N, K / 2): little endian, the even input low
    blocks = pairs.view(out_features // 16, 16, in_features // 2).transpose(1, 2)
    out = aligned(torch.empty(blocks.numel() + 16, dtype=torch.int32))[: blocks.numel()].view(blocks.shape)
    out.copy_(blocks)
    return out


def pairs_run() -> bool:
    """Whether `pair_linear` runs here (the kernels are on and build for this CPU)."""
    return enabled() and _library() is not None


def _takes_pairs(weight: Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0 and pairs_run()


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward on a weight packed in oneDNN's layout; no `weight` parameter (the
    plain one is not kept) and no gradients."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.load(weight, bias)

    def load(self, weight: Tensor, bias: Tensor | None) -> None:
        """Pack new weights (of any dtype: cast to this layer's) in place of the current ones."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight of shape {tuple(weight.shape)} for a {self.in_features} -> {self.out_features} layer")
        weight = weight.detach().to(self.dtype)
        self.pairs = _takes_pairs(weight)  # this project's kernel, or oneDNN's
        self.packed = _pairs(weight) if self.pairs else _REORDER(weight, None)
        self.bias = None if bias is None else bias.detach().to(self.dtype).clone()
        self.wide_bias = None if bias is None else self.bias.float()  # added before the output's rounding, as oneDNN does

    def forward(self, x: Tensor) -> Tensor:
        if not self.pairs:
            return _LINEAR(x, self.packed, self.bias, "none", [None], "")
        rows = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        out = rows.new_empty((rows.shape[0], self.out_features))
        bias = self.wide_bias.data_ptr() if self.wide_bias is not None else None
        _library().pair_linear(rows.data_ptr(), self.packed.data_ptr(), bias, out.data_ptr(), rows.shape[0], self.in_features, self.out_features, torch.get_num_threads())
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


class FusedLinear(PackedLinear):
    """Several linear layers that read the same input as one packed layer: their outputs side by
    side, in the order of `parts` (the names of the layers it replaces, beside it in its parent).
    Each output column is the same dot product as in its own layer."""

    def __init__(self, parts: tuple[str, ...], layers: list[nn.Module]) -> None:
        self.parts = parts
        self.widths = [layer.out_features for layer in layers]
        super().__init__(*_stacked(layers))

    def load_parts(self, layers: list[nn.Module]) -> None:
        """Pack the weights of new layers of the replaced shapes, in the order of `parts`."""
        if [layer.out_features for layer in layers] != self.widths:
            raise ValueError(f"layers of {[layer.out_features for layer in layers]} outputs for parts of {self.widths}")
        self.load(*_stacked(layers))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parts={'+'.join(self.parts)}"


def _stacked(layers: list[nn.Module]) -> tuple[Tensor, Tensor | None]:
    weight = torch.cat([layer.weight.detach() for layer in layers])
    biases = [layer.bias for layer in layers]
    if all(bias is None for bias in biases):
        return weight, None
    return weight, torch.cat([b.detach() if b is not None else weight.new_zeros(layer.out_features) for b, layer in zip(biases, layers, strict=True)])


def packable(model: nn.Module) -> bool:
    """Whether `model`'s linear layers can be packed: bf16 weights on the CPU, and a PyTorch
    built with oneDNN's packed linear. (fp32 is left alone: there `F.linear` takes MKL's sgemm,
    and oneDNN's sums differ from it in the last bits.)"""
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cpu" and param.dtype == torch.bfloat16 and _REORDER is not None and _LINEAR is not None


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every `nn.Linear` of `model` (in place) by a `PackedLinear` of its weights, and
    return it; a model that is not `packable` is returned as it is. A weight another module
    shares (an LM head tied to the embeddings) stays where that module holds it."""
    if not packable(model):
        return model
    targets = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    for name in targets:  # one at a time: each plain weight goes as its packed one comes
        linear = model.get_submodule(name)
        try:
            layer = PackedLinear(linear.weight, linear.bias)
        except RuntimeError:  # a shape this project's kernel does not take, on a CPU whose oneDNN
            continue  # cannot reorder bf16 weights (AVX2 alone): that layer stays plain
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
    return model


def copy_weights(copy: nn.Module, source: nn.Module | Mapping[str, Any]) -> None:
    """Copy `source`'s parameters into `copy`, a copy of it made earlier (in another dtype, its
    linear layers perhaps packed since), in place: packed layers pack the new weights again.
    `source` may also be its modules by name, some of them stand-ins (a linear layer's needs
    only `weight`, `bias` and `out_features`)."""
    sources = dict(source.named_modules()) if isinstance(source, nn.Module) else source
    with torch.no_grad():
        for name, module in copy.named_modules():
            if isinstance(module, FusedLinear):
                parent = name.rpartition(".")[0]
                module.load_parts([sources[f"{parent}.{part}" if parent else part] for part in module.parts])
                continue
            if isinstance(module, PackedLinear):
                module.load(sources[name].weight, sources[name].bias)
                continue
            theirs = sources[name]
            if not isinstance(theirs, nn.Module):  # a linear layer's stand-in
                theirs = [t for t in (theirs.weight, theirs.bias) if t is not None]
            else:
                theirs = list(theirs.parameters(recurse=False))
            for mine, their in zip(module.parameters(recurse=False), theirs, strict=True):
                mine.copy_(their)


def own_weights(module: nn.Module) -> int:
    """Number of weights `module` holds itself, not through its children: its parameters, and a
    packed layer's packed ones (which are not parameters)."""
    own = sum(p.numel() for p in module.parameters(recurse=False))
    if isinstance(module, PackedLinear):
        own += module.in_features * module.out_features + (0 if module.bias is None else module.out_features)
    return own


def is_packed(model: nn.Module) -> bool:
    """Whether any linear layer of `model` is packed."""
    return any(isinstance(module, PackedLinear) for module in model.modules())
