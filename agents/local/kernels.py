"""This project's small C kernels: built on first use, kept by their source's hash, optional.

A kernel's source is compiled (about a second) with the system's C compiler for AVX-512,
linked to the OpenMP runtime PyTorch loaded (one thread pool), and kept in the model cache's
`kernels/` as `STEM_HASH.so`, the hash covering the source, compiler and flags. The kernels read
and write bf16 and compute in fp32. Their two bf16 instructions are AVX512-BF16's where the CPU
has it; on plain AVX-512 (Ice Lake, Skylake) the header spells them out in AVX512F, with the
same sums: `_mm512_dpbf16_ps` as two fused multiply-adds, odd element first (a product of two
bf16 is exact in fp32), and `_mm512_cvtneps_pbh` as round to nearest even. On a CPU with AVX2,
FMA and F16C but no AVX-512 (Zen 2 and 3, Intel's client chips since Alder Lake) the same
sources build for AVX2: each 16-lane vector is two 8-lane halves (`agents.local.avx2`), with the
same lanes and roundings. Without a compiler, on a CPU without AVX2, off Linux, or where the
build fails, `compiled` answers None and callers keep their PyTorch path.
`CGYM_DECODE_KERNEL=0` turns every kernel off (the name is the first kernel's, the decode step's
attention); `CGYM_KERNEL_ISA=avx2` builds for AVX2 on an AVX-512 CPU as well.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch
from cgym.agents.local.avx2 import AVX2_COMPAT
from cgym.agents.pretrained import ModelFetchError, cache_root

KERNEL_ENV = "CGYM_DECODE_KERNEL"
ISA_ENV = "CGYM_KERNEL_ISA"  # `avx2`: build for AVX2 on an AVX-512 CPU too (CI runs the kernel tests on both)
COMMON = ["-O3", "-mfma", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
ISA_FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl"], "avx2": ["-mavx2", "-mf16c"]}
BF16_FLAG = "-mavx512bf16"  # where the CPU has the instructions; else the header's AVX512F forms
AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "fma"})
AVX2 = frozenset({"avx2", "fma", "f16c"})

# What every kernel's source starts with: the headers, a 16-lane exp, bf16 read as fp32.
C_HEADER = (
    r"""
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef __AVX512F__ /* AVX2: each 16-lane vector as two halves (`agents.local.avx2`) */
"""
    + AVX2_COMPAT
    + r"""
#endif

#ifndef __AVX512BF16__ /* AVX512-BF16's two instructions in AVX512F, the same sums */
static inline __m512 emulated_dpbf16(__m512 acc, __m512bh a, __m512bh b) { /* acc += a.odd b.odd, then a.even b.even */
    const __m512i high = _mm512_set1_epi32((int)0xffff0000);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512((__m512i)a, high)), _mm512_castsi512_ps(_mm512_and_si512((__m512i)b, high)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32((__m512i)a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32((__m512i)b, 16)), acc);
}
static inline __m256bh emulated_cvtne(__m512 x) { /* fp32 -> bf16, nearest even; NaN stays a quiet NaN */
    __m512i bits = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
    return (__m256bh)_mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
#define _mm512_dpbf16_ps emulated_dpbf16
#define _mm512_cvtneps_pbh emulated_cvtne
#endif

/* e^x for x <= 0 (x >= -87.3 or it is 0), 16 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2 */
static inline __m512 exp_neg(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512 out = _mm512_scalef_ps(p, n);
    return _mm512_mask_blend_ps(under, out, _mm512_setzero_ps());
}

static inline __m512 bf16_lo(__m512i x) { /* bf16 pairs -> the low element of each as fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}
static inline __m512 bf16_hi(__m512i x) {
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000)));
}
static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) { /* up to 16 bf16 -> fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline __mmask16 lanes(long left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }
static inline float bf16_value(uint16_t h) { uint32_t bits = (uint32_t)h << 16; float f; memcpy(&f, &bits, 4); return f; }
static inline size_t slice64(size_t bytes) { return (bytes + 63) & ~(size_t)63; } /* bytes rounded up to whole 64s */
/* 64-byte aligned memory: C11's aligned_alloc takes only a size that is a multiple of the alignment */
static inline void *aligned64(size_t bytes) { return aligned_alloc(64, slice64(bytes)); }
/* Scratch for each thread of a parallel region of at most `threads`, taken before the region so
   that a kernel without room can say so before it writes anything (inside the region a NULL
   has nowhere to go): `threads` slices of `bytes`, each 64-byte aligned, or NULL. */
static inline char *thread_scratch(int threads, size_t bytes) { return aligned64((size_t)(threads > 0 ? threads : 1) * slice64(bytes) + 64); }
static inline void *own_slice(char *scratch, size_t bytes) { return scratch + (size_t)omp_get_thread_num() * slice64(bytes); }

/* A parallel loop's units in shares: each thread of a team owns an equal, contiguous share and
   takes its units from the front; a thread done with its own takes the others' from their backs.
   A thread's units stay contiguous where nobody is late (a kernel keeps what it packed for the
   last unit: `pair_wide`'s panel), and a thread that runs slower, as one of a 2-vCPU VM's does at
   times, is not waited for. `SHARES` declares them on the caller's stack, a 64-byte line a
   thread, each [front, back) in one word; `share_units` fills them for the calling team (then a
   barrier). */
#define SHARES(name, threads) uint64_t name[8 * ((threads) > 0 ? (threads) : 1)] __attribute__((aligned(64)))
static inline void share_units(uint64_t *shares, long units) {
    int team = omp_get_num_threads();
#pragma omp single
    for (int i = 0; i < team; i++) shares[8 * i] = ((uint64_t)(units * (i + 1) / team) << 32) | (uint64_t)(units * i / team);
}
/* The next unit for this thread (visit v: its own share's front at 0, then thread me + v's back),
   or -1 when that share is empty. Units below 2^32. */
static inline long take_unit(uint64_t *shares, int v) {
    int team = omp_get_num_threads();
    uint64_t *span = shares + 8 * ((omp_get_thread_num() + v) % team), old = __atomic_load_n(span, __ATOMIC_RELAXED);
    for (;;) {
        uint64_t front = old & 0xffffffffu, back = old >> 32;
        if (front >= back) return -1;
        uint64_t next = v ? ((back - 1) << 32) | front : (back << 32) | (front + 1);
        if (__atomic_compare_exchange_n(span, &old, next, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return (long)(v ? back - 1 : front);
    }
}
/* for (u over this thread's units, v its visit): `FOR_UNITS(shares, u, v) { ... }` in a parallel region */
#define FOR_UNITS(shares, u, v) \
    for (int v = 0; v < omp_get_num_threads(); v++) \
        for (long u; (u = take_unit((shares), v)) >= 0;)

"""
)


def aligned(raw: torch.Tensor) -> torch.Tensor:
    """The part of a flat 4-byte `raw` buffer that starts on a 64-byte boundary (allocate 16
    elements more than needed), for kernels that load whole AVX-512 vectors."""
    return raw[(-raw.data_ptr() % 64) // 4 :]


def enabled() -> bool:
    """Whether the kernels may be used (`CGYM_DECODE_KERNEL=0` turns them off)."""
    return os.environ.get(KERNEL_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


def isa() -> str | None:
    """The instruction set the kernels are built for: `avx512` (AVX512F, BW and VL; BF16 is
    optional), else `avx2` (AVX2, FMA and F16C), else None. `CGYM_KERNEL_ISA=avx2` asks for the
    AVX2 build where AVX-512 is there too."""
    cpu = cpu_flags()
    if os.environ.get(ISA_ENV, "").strip().lower() != "avx2" and AVX512 <= cpu:
        return "avx512"
    return "avx2" if AVX2 <= cpu else None


def available() -> bool:
    """Whether kernels can run on this CPU at all."""
    return isa() is not None


def flags() -> list[str]:
    chosen = isa() or "avx512"
    bf16 = [BF16_FLAG] if chosen == "avx512" and cpu_has_avx512_bf16() else []
    return [*COMMON, *ISA_FLAGS[chosen], *bf16]


@cache
def compiled(source: str, stem: str) -> ctypes.CDLL | None:
    """`source` built into a shared library and loaded (once per process; once per machine and
    source in the model cache); None where it cannot be."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None or not sys.platform.startswith("linux") or not available():
        return None
    build = flags()
    omp = Path(torch.__file__).parent / "lib"
    link = [f"-L{omp}", f"-Wl,-rpath,{omp}"] if any(omp.glob("libgomp*.so*")) else []
    digest = hashlib.sha256("\0".join([source, compiler, *build, *link]).encode()).hexdigest()[:16]
    try:
        target = cache_root() / "kernels" / f"{stem}_{digest}.so"  # beside the models
    except ModelFetchError:  # the cache names a file: no kernel, and the models say why
        return None
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                path, built = Path(tmp) / f"{stem}.c", Path(tmp) / target.name
                path.write_text(source)
                subprocess.run([compiler, *build, str(path), "-o", str(built), *link], check=True, capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: a concurrent build finds a whole file or none
        except (OSError, subprocess.SubprocessError):
            return None
    try:
        return ctypes.CDLL(str(target))
    except OSError:
        return None
