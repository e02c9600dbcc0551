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

For up to `query_limit()` queries per row and kv head (one new id, or drafted ones, times the
query heads of a group; sixteen at a time): above `FEW_QUERIES` a row's own keys are packed too. A layer of
SmolLM2 against the split path (2 cores): 1 row over 250 prompt and 100 own keys 24 against
111 us, 32 rows 235 against 303 us; at 100 rows with few own keys it is ~13% slower (each row
reads the prompt's keys again, where the split path read them once for all rows). Built on first
use (`agents.local.kernels`); None wherever it does not apply, and the caller keeps
`kv_cache.split_attention`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache

import torch
from cgym.agents.local.decode_attention import ATTENTION_C, FEW_QUERIES, HEAD_DIM, MAX_QUERIES
from cgym.agents.local.kernels import C_HEADER, compiled, enabled
from torch import Tensor

# Queries per row and kv head in a step that checks drafts: a few rows' long ones
# (`lookup.LONG_DRAFT_TOKENS` + 1 ids x up to 12 query heads a kv head). Other calls keep
# `MAX_QUERIES`, so that a short prefill runs the prefill's kernels, with their bits.
DRAFT_QUERIES = 256
_DRAFTING: ContextVar[bool] = ContextVar("cgym_drafting", default=False)


@contextmanager
def drafting() -> Iterator[None]:
    """Within it, a model call is a decode step checking drafts: up to `DRAFT_QUERIES` queries
    per row and kv head take the one-call step."""
    token = _DRAFTING.set(True)
    try:
        yield
    finally:
        _DRAFTING.reset(token)


def query_limit() -> int:
    """The most queries per row and kv head a step takes here: `DRAFT_QUERIES` while
    `drafting`, else `MAX_QUERIES`."""
    return DRAFT_QUERIES if _DRAFTING.get() else MAX_QUERIES


_SOURCE = (
    C_HEADER
    + ATTENTION_C
    + r"""
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
   Its M = G * T queries per (row, kv head) go sixteen at a time (each query's sums are its own,
   so the same bits as alone): up to `few` in all scored one key at a time, more against the
   row's own keys packed as the prefix's are (then iss must be 1). P may be 0; a query that then
   sees no key gets 0. Answers 0, or -1 with nothing written where there is no memory for its
   scratch. */
int step_attention(const uint16_t *q, const uint32_t *kp, const float *vf, const uint16_t *k, const uint16_t *v,
                   const uint8_t *visible, uint16_t *out, long B, long H, long G, long T, long P, long S,
                    long qsb, long qsh, long qst, long ksb, long ksh, long kss, long vsb, long vsh, long vss,
                    long isb, long ist, long iss, long osb, long ost, long osh, long few, float scale, int threads) {
    long M = G * T, C = M < 16 ? M : 16, blocks = (P + 15) / 16, pwidth = blocks * 16, owidth = (S + 15) & ~15L;
    int packed = M > few;
    /* scores of C queries (prefix, then own keys), and where M > few the own keys packed and values widened */
    size_t sbytes = slice64(sizeof(float) * (C * pwidth + C * owidth + 16)), kbytes = packed ? slice64(sizeof(uint32_t) * (owidth / 16 + 1) * 512) : 0;
    size_t bytes = sbytes + kbytes + (packed ? sizeof(float) * (owidth + 16) * D : 0);
    char *scratch = thread_scratch(threads, bytes);
    if (!scratch) return -1;
    SHARES(shares, threads);
#pragma omp parallel num_threads(threads)
    {
        char *mine = own_slice(scratch, bytes);
        float *sp = (float *)mine, *so = sp + C * pwidth;
        uint32_t *own_kp = packed ? (uint32_t *)(mine + sbytes) : NULL;
        float *own_vf = packed ? (float *)(mine + sbytes + kbytes) : NULL;
        share_units(shares, B * H); /* (row, kv head) units: a thread the host slows is not waited for */
        FOR_UNITS(shares, unit, visit) {
            long b = unit / H, h = unit % H;
            const uint16_t *kb = k + b * ksb + h * ksh, *vb = v + b * vsb + h * vsh;
            if (packed) {
                pack_keys(kb, S, kss, own_kp);
                widen_values(vb, S, vss, owidth, own_vf);
            }
            for (long m0 = 0; m0 < M; m0 += C) {
                long n = M - m0 < C ? M - m0 : C;
                const uint16_t *qm[16];
                const uint8_t *seen[16];
                float peak[16], total[16];
                for (long i = 0; i < n; i++) {
                    long m = m0 + i;
                    qm[i] = q + b * qsb + (h * G + m / T) * qsh + (m % T) * qst;
                    seen[i] = visible + b * isb + (m % T) * ist;
                    peak[i] = MASKED;
                    total[i] = 0.0f;
                }
                if (blocks) score_packed(kp + h * blocks * 512, P, qm, NULL, n, scale, sp, pwidth, peak, NULL, NULL);
                if (packed)
                    score_packed(own_kp, S, qm, seen, n, scale, so, owidth, peak, NULL, NULL);
                else
                    score_each(kb, S, kss, qm, seen, iss, n, scale, so, owidth, peak);
                weigh(sp, pwidth, n, peak, total);
                weigh(so, owidth, n, peak, total);
                __m512 accp[16][4], acco[16][4];
                for (long i = 0; i < n; i++)
                    for (int c = 0; c < 4; c++) accp[i][c] = acco[i][c] = _mm512_setzero_ps();
                add_values(vf + h * pwidth * D, P, sp, pwidth, n, accp);
                if (packed)
                    add_values(own_vf, S, so, owidth, n, acco);
                else
                    add_pairs(vb, S, vss, so, owidth, n, acco);
                for (long i = 0; i < n; i++) {
                    long m = m0 + i;
                    float inv = peak[i] == MASKED ? 0.0f : 1.0f / total[i], row[D];
                    if (packed)
                        for (int c = 0; c < 4; c++) _mm512_storeu_ps(row + 16 * c, acco[i][c]);
                    else
                        interleave(acco[i], row);
                    uint16_t *o = out + b * osb + (m % T) * ost + (h * G + m / T) * osh;
                    for (int c = 0; c < 4; c++) {
                        __m512 x = _mm512_mul_ps(_mm512_add_ps(accp[i][c], _mm512_loadu_ps(row + 16 * c)), _mm512_set1_ps(inv));
                        _mm256_storeu_si256((__m256i *)(o + 16 * c), (__m256i)_mm512_cvtneps_pbh(x));
                    }
                }
            }
        }
    }
    free(scratch);
    return 0;
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
    lib.step_attention.restype = ctypes.c_int
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
    `query_limit()` queries per row and kv head, another dtype or head size, gradients wanted, no
    kernel here, no memory for its scratch): the caller runs `split_attention`."""
    batch, heads, steps, dim = query.shape
    kv_heads = key.shape[1]
    if not (
        enabled()
        and dim == HEAD_DIM
        and query.dtype == key.dtype == value.dtype == torch.bfloat16
        and query.device.type == "cpu"
        and heads % kv_heads == 0
        and heads // kv_heads * steps <= query_limit()
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
    failed = lib.step_attention(
        query.data_ptr(), None if prefix is None else prefix.keys.data_ptr(), None if prefix is None else prefix.values.data_ptr(),
        key.data_ptr(), value.data_ptr(), visible.data_ptr(), out.data_ptr(),
        batch, kv_heads, heads // kv_heads, steps, 0 if prefix is None else prefix.length, key.shape[2],
        query.stride(0), query.stride(1), query.stride(2), *key.stride()[:3], *value.stride()[:3],
        *visible.stride(), out.stride(0), out.stride(1), out.stride(2), FEW_QUERIES,
        scale, torch.get_num_threads(),
    )  # fmt: skip
    return None if failed else out
