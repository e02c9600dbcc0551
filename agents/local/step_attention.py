"""A decode step's whole attention in one C call: the shared prompt's keys and each row's own.

A decode step's attention was two kernel calls (`decode_attention`: the shared prompt's part and
each row's own) and some twenty PyTorch ops around them to lay out the queries, merge the two
softmaxes and cast the result, ~150 us a layer however few the rows: a sixth of a 1-row step of
SmolLM2. Here one call does it all. The prompt's keys are packed once per sampling call
(`pack_prefix`: sixteen keys across a vector's lanes, values widened to fp32, as
`block_attention` packs them), so every row's queries score sixteen prompt keys with 32
`vdpbf16ps` and no horizontal sums; a row's own keys are scored one at a time, as in
`own_attention`; one softmax runs over both, in fp32, and the output is written in bf16 where
the output projection reads it, laid out (B, T, H, D).

For up to `MAX_QUERIES` queries per row and kv head (one new id, or a few drafted ones, times
the query heads of a group): above `FEW_QUERIES` a row's own keys are packed too. A layer of
SmolLM2 against the split path (2 cores): 1 row over 250 prompt and 100 own keys 24 against
111 us, 32 rows 235 against 303 us; at 100 rows with few own keys it is ~13% slower (each row
reads the prompt's keys again, where the split path read them once for all rows). Built on first
use (`agents.local.kernels`); None wherever it does not apply, and the caller keeps
`kv_cache.split_attention`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch
from cgym.agents.local.decode_attention import FEW_QUERIES, HEAD_DIM, MAX_QUERIES
from cgym.agents.local.kernels import C_HEADER, compiled, enabled
from torch import Tensor

_SOURCE = (
    C_HEADER
    + r"""
#define D 64
#define MASKED (-1e30f)
#define QB 8

/* n keys sixteen to a vector: kp gets blocks x 32 x 16 dwords, lane = key, one pair of
   dimensions per vector (zero past n) */
static void pack_keys(const uint16_t *k, long n, long kss, uint32_t *kp) {
    long blocks = (n + 15) / 16;
    memset(kp, 0, sizeof(uint32_t) * blocks * 512);
    for (long s = 0; s < n; s++) {
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
        for (int c = 0; c < 4; c++) {
            __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vs + 16 * c)));
            _mm512_storeu_ps(vf + s * D + 16 * c, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
        }
    }
}

/* scores[m][s] = (q_m . key s) * scale for n packed keys, in blocks of qb <= QB queries; MASKED
   past n and where seen[m] (a row of n visibility bytes, or NULL: every key) says 0. peak[m]
   rises to the largest. Inlined with qb a constant, so each block size gets its own loops. */
static inline __attribute__((always_inline)) void score_blocks(const uint32_t *kp, long n, const uint16_t **qm, const uint8_t **seen, long M,
                         float scale, float *scores, long width, float *peak, const int qb) {
    long blocks = (n + 15) / 16;
    const __m512 scaled = _mm512_set1_ps(scale), masked = _mm512_set1_ps(MASKED);
    for (long m0 = 0; m0 < M; m0 += qb) {
        long rows = M - m0 < qb ? M - m0 : qb;
        const uint32_t *qr[QB];
        __m512 top[QB];
        for (int r = 0; r < qb; r++) { /* a short last block repeats its last query */
            qr[r] = (const uint32_t *)qm[m0 + (r < rows ? r : rows - 1)];
            top[r] = masked;
        }
        for (long j = 0; j < blocks; j++) {
            __m512 acc[QB];
            for (int r = 0; r < qb; r++) acc[r] = _mm512_setzero_ps();
            const uint32_t *kj = kp + j * 512;
            for (int i = 0; i < 32; i++) {
                __m512bh kv = (__m512bh)_mm512_load_si512(kj + i * 16);
                for (int r = 0; r < qb; r++)
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)qr[r][i]), kv);
            }
            long left = n - j * 16;
            __mmask16 inside = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
            for (int r = 0; r < rows; r++) {
                __mmask16 live = inside;
                if (seen) {
                    const uint8_t *row = seen[m0 + r] + j * 16;
                    __m128i bytes = left >= 16 ? _mm_loadu_si128((const __m128i *)row) : _mm_maskz_loadu_epi8(inside, row);
                    live &= _mm_test_epi8_mask(bytes, bytes);
                }
                __m512 x = _mm512_mask_mul_ps(masked, live, acc[r], scaled);
                top[r] = _mm512_max_ps(top[r], x);
                _mm512_store_ps(scores + (m0 + r) * width + j * 16, x);
            }
        }
        for (int r = 0; r < rows; r++) {
            float high = _mm512_reduce_max_ps(top[r]);
            if (high > peak[m0 + r]) peak[m0 + r] = high;
        }
    }
}

/* score_blocks in blocks of 8 queries, or of 4 for a decode step's few (half the products went
   to repeated queries otherwise) */
static void score_packed(const uint32_t *kp, long n, const uint16_t **qm, const uint8_t **seen, long M,
                         float scale, float *scores, long width, float *peak) {
    if (M <= 4) score_blocks(kp, n, qm, seen, M, scale, scores, width, peak, 4);
    else score_blocks(kp, n, qm, seen, M, scale, scores, width, peak, QB);
}

/* The same scores one key at a time, from keys as they lie (few queries: packing would cost more
   than it saves); seen rows strided by iss */
static void score_each(const uint16_t *k, long n, long kss, const uint16_t **qm, const uint8_t **seen, long iss,
                       long M, float scale, float *scores, long width, float *peak) {
    for (long s = 0; s < n; s++) {
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

/* scores -> exp(score - peak[m]) in place (0 where masked); adds each row's sum to total[m] */
static void weigh(float *scores, long width, long M, const float *peak, float *total) {
    const __m512 masked = _mm512_set1_ps(MASKED);
    for (long m = 0; m < M; m++) {
        float *row = scores + m * width;
        __m512 top = _mm512_set1_ps(peak[m]), sum = _mm512_setzero_ps();
        for (long s = 0; s < width; s += 16) {
            __m512 x = _mm512_load_ps(row + s);
            __mmask16 live = _mm512_cmp_ps_mask(x, masked, _CMP_GT_OQ);
            __m512 w = _mm512_maskz_mov_ps(live, exp_neg(_mm512_sub_ps(x, top)));
            _mm512_store_ps(row + s, w);
            sum = _mm512_add_ps(sum, w);
        }
        total[m] += _mm512_reduce_add_ps(sum);
    }
}

/* acc[m] += sum over s < n of w[m][s] * vf[s] (fp32 value rows) */
static void add_values(const float *vf, long n, const float *w, long width, long M, __m512 acc[16][4]) {
    for (long s = 0; s < n; s++) {
        const float *vs = vf + s * D;
        __m512 v0 = _mm512_loadu_ps(vs), v1 = _mm512_loadu_ps(vs + 16), v2 = _mm512_loadu_ps(vs + 32), v3 = _mm512_loadu_ps(vs + 48);
        for (long m = 0; m < M; m++) {
            float x = w[m * width + s];
            if (x == 0.0f) continue;
            __m512 ww = _mm512_set1_ps(x);
            acc[m][0] = _mm512_fmadd_ps(ww, v0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(ww, v1, acc[m][1]);
            acc[m][2] = _mm512_fmadd_ps(ww, v2, acc[m][2]);
            acc[m][3] = _mm512_fmadd_ps(ww, v3, acc[m][3]);
        }
    }
}

/* The same from bf16 value rows read as pairs: even elements land in acc[m][0] and [2], odd ones
   in [1] and [3] (`interleave` puts them back in order) */
static void add_pairs(const uint16_t *v, long n, long vss, const float *w, long width, long M, __m512 acc[16][4]) {
    for (long s = 0; s < n; s++) {
        const uint16_t *vs = v + s * vss;
        __m512i v0 = _mm512_loadu_si512(vs), v1 = _mm512_loadu_si512(vs + 32);
        __m512 r0 = bf16_lo(v0), r1 = bf16_hi(v0), r2 = bf16_lo(v1), r3 = bf16_hi(v1);
        for (long m = 0; m < M; m++) {
            float x = w[m * width + s];
            if (x == 0.0f) continue;
            __m512 ww = _mm512_set1_ps(x);
            acc[m][0] = _mm512_fmadd_ps(ww, r0, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(ww, r1, acc[m][1]);
            acc[m][2] = _mm512_fmadd_ps(ww, r2, acc[m][2]);
            acc[m][3] = _mm512_fmadd_ps(ww, r3, acc[m][3]);
        }
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

/* A (H, P, D) bf16 prefix for step_attention: each head's keys packed (kp: H x blocks x 512
   dwords), values widened (vf: H x width x D). */
void pack_prefix(const uint16_t *k, const uint16_t *v, uint32_t *kp, float *vf, long H, long P,
                 long ksh, long kss, long vsh, long vss) {
    long blocks = (P + 15) / 16, width = blocks * 16;
    for (long h = 0; h < H; h++) {
        pack_keys(k + h * ksh, P, kss, kp + h * blocks * 512);
        widen_values(v + h * vsh, P, vss, width, vf + h * width * D);
    }
}

/* out[b, t, h * G + j, :] = softmax over the P prefix keys (all seen) and the row's own keys s
   where visible[b, t, s], of (query . key) * scale, times the values; bf16, rounded to nearest
   even. Query head h * G + j of row b at step t is q + b * qsb + (h * G + j) * qsh + t * qst.
   M = G * T <= 16 queries per (row, kv head): up to `few` scored one key at a time, more
   against the row's own keys packed as the prefix's are (then iss must be 1). P may be 0; a
   query that then sees no key gets 0. */
void step_attention(const uint16_t *q, const uint32_t *kp, const float *vf, const uint16_t *k, const uint16_t *v,
                    const uint8_t *visible, uint16_t *out, long B, long H, long G, long T, long P, long S,
                    long qsb, long qsh, long qst, long ksb, long ksh, long kss, long vsb, long vsh, long vss,
                    long isb, long ist, long iss, long osb, long ost, long osh, long few, float scale, int threads) {
    long M = G * T, blocks = (P + 15) / 16, pwidth = blocks * 16, owidth = (S + 15) & ~15L;
    int packed = M > few;
#pragma omp parallel num_threads(threads)
    {
        float *sp = aligned_alloc(64, sizeof(float) * (M * pwidth + M * owidth + 16));
        float *so = sp + M * pwidth;
        uint32_t *own_kp = packed ? aligned_alloc(64, sizeof(uint32_t) * (owidth / 16 + 1) * 512) : NULL;
        float *own_vf = packed ? aligned_alloc(64, sizeof(float) * (owidth + 16) * D) : NULL;
#pragma omp for collapse(2) schedule(static)
        for (long b = 0; b < B; b++) {
            for (long h = 0; h < H; h++) {
                const uint16_t *qm[16];
                const uint8_t *seen[16];
                float peak[16], total[16];
                for (long m = 0; m < M; m++) {
                    qm[m] = q + b * qsb + (h * G + m / T) * qsh + (m % T) * qst;
                    seen[m] = visible + b * isb + (m % T) * ist;
                    peak[m] = MASKED;
                    total[m] = 0.0f;
                }
                const uint16_t *kb = k + b * ksb + h * ksh, *vb = v + b * vsb + h * vsh;
                if (blocks) score_packed(kp + h * blocks * 512, P, qm, NULL, M, scale, sp, pwidth, peak);
                if (packed) {
                    pack_keys(kb, S, kss, own_kp);
                    score_packed(own_kp, S, qm, seen, M, scale, so, owidth, peak);
                } else {
                    score_each(kb, S, kss, qm, seen, iss, M, scale, so, owidth, peak);
                }
                weigh(sp, pwidth, M, peak, total);
                weigh(so, owidth, M, peak, total);
                __m512 accp[16][4], acco[16][4];
                for (long m = 0; m < M; m++)
                    for (int c = 0; c < 4; c++) accp[m][c] = acco[m][c] = _mm512_setzero_ps();
                add_values(vf + h * pwidth * D, P, sp, pwidth, M, accp);
                if (packed) {
                    widen_values(vb, S, vss, owidth, own_vf);
                    add_values(own_vf, S, so, owidth, M, acco);
                }
                else add_pairs(vb, S, vss, so, owidth, M, acco);
                for (long m = 0; m < M; m++) {
                    float inv = peak[m] == MASKED ? 0.0f : 1.0f / total[m], row[D];
                    if (packed)
                        for (int c = 0; c < 4; c++) _mm512_storeu_ps(row + 16 * c, acco[m][c]);
                    else
                        interleave(acco[m], row);
                    uint16_t *o = out + b * osb + (m % T) * ost + (h * G + m / T) * osh;
                    for (int c = 0; c < 4; c++) {
                        __m512 x = _mm512_mul_ps(_mm512_add_ps(accp[m][c], _mm512_loadu_ps(row + 16 * c)), _mm512_set1_ps(inv));
                        _mm256_storeu_si256((__m256i *)(o + 16 * c), (__m256i)_mm512_cvtneps_pbh(x));
                    }
                }
            }
        }
        free(sp);
        free(own_kp);
        free(own_vf);
    }
}
"""
)


@dataclass(frozen=True)
class PackedPrefix:
    """A shared prefix's keys and values as `step_attention` reads them (`pack_prefix`)."""

    keys: Tensor  # (H, blocks x 512) int32: sixteen keys to a vector
    values: Tensor  # (H, blocks x 16, D) fp32
    length: int  # P


@cache
def _library() -> ctypes.CDLL | None:
    lib = compiled(_SOURCE, "step_attention")
    if lib is None:
        return None
    lib.pack_prefix.restype = None
    lib.pack_prefix.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 6
    lib.step_attention.restype = None
    lib.step_attention.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_long] * 22 + [ctypes.c_float, ctypes.c_int]
    return lib


def pack_prefix(key: Tensor, value: Tensor) -> PackedPrefix | None:
    """(1, H, P, D) bf16 prefix keys and values packed for `step_attention`; None where it does not run."""
    if not (
        enabled()
        and key.dtype == value.dtype == torch.bfloat16
        and key.device.type == "cpu"
        and key.dim() == 4
        and key.shape[0] == 1
        and key.shape[-1] == HEAD_DIM
        and value.shape == key.shape
    ):
        return None
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        return None
    lib = _library()
    if lib is None:
        return None
    heads, length = key.shape[1], key.shape[2]
    blocks = (length + 15) // 16
    keys = torch.empty((heads, blocks * 512), dtype=torch.int32)
    values = torch.empty((heads, blocks * 16, HEAD_DIM), dtype=torch.float32)
    lib.pack_prefix(
        key.data_ptr(), value.data_ptr(), keys.data_ptr(), values.data_ptr(), heads, length, key.stride(1), key.stride(2), value.stride(1), value.stride(2)
    )
    return PackedPrefix(keys, values, length)


def step_attention(query: Tensor, prefix: PackedPrefix | None, key: Tensor, value: Tensor, visible: Tensor, scale: float) -> Tensor | None:
    """Attention of (B, H, T, D) bf16 query heads over a packed shared prefix (every query sees
    it; None: no prefix) and (B, H_kv, S, D) bf16 own keys and values where `visible` ((B, T, S)
    bool) allows: (B, T, H, D) bf16 out. None where the kernel does not apply (more than
    `MAX_QUERIES` queries per row and kv head, another dtype or head size, gradients wanted, no
    kernel here): the caller runs `split_attention`."""
    batch, heads, steps, dim = query.shape
    kv_heads = key.shape[1]
    if not (
        enabled()
        and dim == HEAD_DIM
        and query.dtype == key.dtype == value.dtype == torch.bfloat16
        and query.device.type == "cpu"
        and heads % kv_heads == 0
        and heads // kv_heads * steps <= MAX_QUERIES
        and key.shape[0] == batch
        and value.shape == key.shape
        and visible.dtype == torch.bool
        and visible.shape == (batch, steps, key.shape[2])
        and (heads // kv_heads * steps <= FEW_QUERIES or visible.stride(-1) == 1)
        and (prefix is None or prefix.keys.shape[0] == kv_heads)
        and all(t.stride(-1) == 1 for t in (query, key, value))
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)))
    ):
        return None
    lib = _library()
    if lib is None:
        return None
    out = torch.empty((batch, steps, heads, dim), dtype=torch.bfloat16)
    lib.step_attention(
        query.data_ptr(), None if prefix is None else prefix.keys.data_ptr(), None if prefix is None else prefix.values.data_ptr(),
        key.data_ptr(), value.data_ptr(), visible.data_ptr(), out.data_ptr(),
        batch, kv_heads, heads // kv_heads, steps, 0 if prefix is None else prefix.length, key.shape[2],
        query.stride(0), query.stride(1), query.stride(2), *key.stride()[:3], *value.stride()[:3],
        *visible.stride(), out.stride(0), out.stride(1), out.stride(2), FEW_QUERIES,
        scale, torch.get_num_threads(),
    )  # fmt: skip
    return out
