"""The AVX-512 intrinsics this project's kernels use, spelled in AVX2 for CPUs without AVX-512.

Many CPUs that run this project have AVX2 and FMA but no AVX-512: AMD's Zen 2 and Zen 3, and
Intel's desktop and laptop chips since Alder Lake. `kernels.C_HEADER` includes `AVX2_COMPAT` where
the compiler was not told of AVX512F: each 16-lane vector becomes two 8-lane halves (`cg512`),
one struct for `__m512`, `__m512i` and `__m512bh` alike (GCC takes a cast to a struct's own type
as a no-op, so the kernels' bit casts stand), and each intrinsic the kernels name becomes its two
halves' AVX2 instructions. A 16-bit mask stays a 16-bit mask, expanded into lane masks where an
operation takes one. Every operation gives the lanes AVX-512 would: the same roundings, and
`_mm512_reduce_add_ps` summed in GCC's order, so a kernel computes the same bits on either.

Only the intrinsics the kernels use are here, and only as far as they use them: `scalef` for the
exponents `exp_neg` passes (-126 to 0); the masked byte and word loads and stores go lane by lane
unless every lane is on (the kernels mask only a row's tail).
"""

from __future__ import annotations

AVX2_COMPAT = r"""
typedef struct { __m256 lo, hi; } cg512; /* lanes 0-7, 8-15 */
#define __m512 cg512
#define __m512i cg512
#define __m512bh cg512
#define __m256bh __m256i

static inline cg512 cg_pair(__m256 lo, __m256 hi) { cg512 r = {lo, hi}; return r; }
static inline cg512 cg_ipair(__m256i lo, __m256i hi) { return cg_pair(_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi)); }
static inline __m256i cg_ilo(cg512 x) { return _mm256_castps_si256(x.lo); }
static inline __m256i cg_ihi(cg512 x) { return _mm256_castps_si256(x.hi); }
/* a 16-bit mask as two halves of all-ones or all-zeros lanes */
static inline cg512 cg_lanes(__mmask16 m) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256i lo = _mm256_and_si256(_mm256_set1_epi32(m & 0xff), bit), hi = _mm256_and_si256(_mm256_set1_epi32(m >> 8), bit);
    return cg_ipair(_mm256_cmpeq_epi32(lo, bit), _mm256_cmpeq_epi32(hi, bit));
}
static inline __mmask16 cg_mask(cg512 lanes) { return (__mmask16)(_mm256_movemask_ps(lanes.lo) | (_mm256_movemask_ps(lanes.hi) << 8)); }
static inline cg512 cg_select(cg512 lanes, cg512 off, cg512 on) { /* on where the lane is set */
    return cg_pair(_mm256_blendv_ps(off.lo, on.lo, lanes.lo), _mm256_blendv_ps(off.hi, on.hi, lanes.hi));
}

#define CG_BINARY(name, op) \
    static inline cg512 name(cg512 a, cg512 b) { return cg_pair(op(a.lo, b.lo), op(a.hi, b.hi)); }
#define CG_IBINARY(name, op) \
    static inline cg512 name(cg512 a, cg512 b) { return cg_ipair(op(cg_ilo(a), cg_ilo(b)), op(cg_ihi(a), cg_ihi(b))); }
CG_BINARY(cg_add_ps, _mm256_add_ps)
CG_BINARY(cg_sub_ps, _mm256_sub_ps)
CG_BINARY(cg_mul_ps, _mm256_mul_ps)
CG_BINARY(cg_div_ps, _mm256_div_ps)
CG_BINARY(cg_max_ps, _mm256_max_ps)
CG_IBINARY(cg_and_si512, _mm256_and_si256)
CG_IBINARY(cg_or_si512, _mm256_or_si256)
CG_IBINARY(cg_xor_si512, _mm256_xor_si256)
CG_IBINARY(cg_add_epi32, _mm256_add_epi32)

static inline cg512 cg_fmadd_ps(cg512 a, cg512 b, cg512 c) { return cg_pair(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)); }
static inline cg512 cg_fmsub_ps(cg512 a, cg512 b, cg512 c) { return cg_pair(_mm256_fmsub_ps(a.lo, b.lo, c.lo), _mm256_fmsub_ps(a.hi, b.hi, c.hi)); }
static inline cg512 cg_fnmadd_ps(cg512 a, cg512 b, cg512 c) { return cg_pair(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)); }
static inline cg512 cg_set1_ps(float x) { __m256 v = _mm256_set1_ps(x); return cg_pair(v, v); }
static inline cg512 cg_set1_epi32(int x) { __m256i v = _mm256_set1_epi32(x); return cg_ipair(v, v); }
static inline cg512 cg_setzero_ps(void) { return cg_pair(_mm256_setzero_ps(), _mm256_setzero_ps()); }
#define _mm512_setzero_si512 cg_setzero_ps
static inline cg512 cg_setr_epi32(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7, int e8, int e9, int e10, int e11, int e12, int e13, int e14, int e15) {
    return cg_ipair(_mm256_setr_epi32(e0, e1, e2, e3, e4, e5, e6, e7), _mm256_setr_epi32(e8, e9, e10, e11, e12, e13, e14, e15));
}
static inline cg512 cg_castsi512_ps(cg512 x) { return x; }
static inline cg512 cg_castps_si512(cg512 x) { return x; }
static inline cg512 cg_abs_ps(cg512 x) { return cg_and_si512(x, cg_set1_epi32(0x7fffffff)); }
static inline cg512 cg_slli_epi32(cg512 x, unsigned int n) { return cg_ipair(_mm256_slli_epi32(cg_ilo(x), n), _mm256_slli_epi32(cg_ihi(x), n)); }
static inline cg512 cg_srli_epi32(cg512 x, unsigned int n) { return cg_ipair(_mm256_srli_epi32(cg_ilo(x), n), _mm256_srli_epi32(cg_ihi(x), n)); }

static inline cg512 cg_loadu_ps(const void *p) { const float *f = (const float *)p; return cg_pair(_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)); }
static inline cg512 cg_load_ps(const void *p) { const float *f = (const float *)p; return cg_pair(_mm256_load_ps(f), _mm256_load_ps(f + 8)); }
static inline void cg_storeu_ps(void *p, cg512 x) { float *f = (float *)p; _mm256_storeu_ps(f, x.lo); _mm256_storeu_ps(f + 8, x.hi); }
static inline void cg_store_ps(void *p, cg512 x) { float *f = (float *)p; _mm256_store_ps(f, x.lo); _mm256_store_ps(f + 8, x.hi); }
#define _mm512_loadu_si512 cg_loadu_ps
#define _mm512_load_si512 cg_load_ps
#define _mm512_store_si512 cg_store_ps
static inline cg512 cg_maskz_loadu_ps(__mmask16 m, const void *p) { /* masked-off lanes are not read, nor do they fault */
    const float *f = (const float *)p;
    cg512 on = cg_lanes(m);
    return cg_pair(_mm256_maskload_ps(f, cg_ilo(on)), _mm256_maskload_ps(f + 8, cg_ihi(on)));
}
static inline void cg_mask_storeu_ps(void *p, __mmask16 m, cg512 x) {
    float *f = (float *)p;
    cg512 on = cg_lanes(m);
    _mm256_maskstore_ps(f, cg_ilo(on), x.lo);
    _mm256_maskstore_ps(f + 8, cg_ihi(on), x.hi);
}
static inline __m256i cg_maskz_loadu_epi16(__mmask16 m, const void *p) { /* the lanes of m: 16-bit words */
    if (m == 0xffff) return _mm256_loadu_si256((const __m256i *)p);
    uint16_t w[16] = {0};
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) w[i] = ((const uint16_t *)p)[i];
    return _mm256_loadu_si256((const __m256i *)w);
}
static inline void cg_mask_storeu_epi16(void *p, __mmask16 m, __m256i x) {
    if (m == 0xffff) { _mm256_storeu_si256((__m256i *)p, x); return; }
    uint16_t w[16];
    _mm256_storeu_si256((__m256i *)w, x);
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) ((uint16_t *)p)[i] = w[i];
}
static inline __m128i cg_maskz_loadu_epi8(__mmask16 m, const void *p) {
    uint8_t b[16] = {0};
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) b[i] = ((const uint8_t *)p)[i];
    return _mm_loadu_si128((const __m128i *)b);
}
static inline __mmask16 cg_test_epi8_mask(__m128i a, __m128i b) { /* bytes where a & b is not zero */
    return (__mmask16)~_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_and_si128(a, b), _mm_setzero_si128()));
}
#define _mm256_maskz_loadu_epi16 cg_maskz_loadu_epi16
#define _mm256_mask_storeu_epi16 cg_mask_storeu_epi16
#define _mm_maskz_loadu_epi8 cg_maskz_loadu_epi8
#define _mm_test_epi8_mask cg_test_epi8_mask

static inline cg512 cg_maskz_mov_ps(__mmask16 m, cg512 a) { return cg_select(cg_lanes(m), cg_setzero_ps(), a); }
static inline cg512 cg_mask_mov_epi32(cg512 src, __mmask16 m, cg512 a) { return cg_select(cg_lanes(m), src, a); }
static inline cg512 cg_mask_blend_ps(__mmask16 m, cg512 a, cg512 b) { return cg_select(cg_lanes(m), a, b); }
static inline cg512 cg_mask_mul_ps(cg512 src, __mmask16 m, cg512 a, cg512 b) { return cg_select(cg_lanes(m), src, cg_mul_ps(a, b)); }
static inline cg512 cg_mask_max_ps(cg512 src, __mmask16 m, cg512 a, cg512 b) { return cg_select(cg_lanes(m), src, cg_max_ps(a, b)); }
static inline cg512 cg_mask3_fmadd_ps(cg512 a, cg512 b, cg512 c, __mmask16 m) { return cg_select(cg_lanes(m), c, cg_fmadd_ps(a, b, c)); }
#define _mm512_cmp_ps_mask(a, b, p) \
    ((__mmask16)(_mm256_movemask_ps(_mm256_cmp_ps((a).lo, (b).lo, (p))) | (_mm256_movemask_ps(_mm256_cmp_ps((a).hi, (b).hi, (p))) << 8)))

/* GCC's order for AVX-512: lanes i + 8, then i + 4, then (0 + 2) + (1 + 3) */
static inline float cg_reduce_add_ps(cg512 x) {
    __m256 s8 = _mm256_add_ps(x.lo, x.hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
static inline float cg_reduce_max_ps(cg512 x) {
    __m256 s8 = _mm256_max_ps(x.lo, x.hi);
    __m128 s4 = _mm_max_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_max_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_max_ss(s2, _mm_movehdup_ps(s2)));
}

static inline cg512 cg_cvtepu16_epi32(__m256i x) { /* 16 words -> 16 lanes */
    return cg_ipair(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(x)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(x, 1)));
}
static inline __m256i cg_cvtepi32_epi16(cg512 x) { /* each lane's low 16 bits, in lane order */
    const __m256i low = _mm256_set1_epi32(0xffff);
    __m256i packed = _mm256_packus_epi32(_mm256_and_si256(cg_ilo(x), low), _mm256_and_si256(cg_ihi(x), low));
    return _mm256_permute4x64_epi64(packed, 0xD8);
}
static inline cg512 cg_scalef_ps(cg512 a, cg512 b) { /* a 2^b for integral b in [-126, 127] */
    __m256i lo = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(b.lo), _mm256_set1_epi32(127)), 23);
    __m256i hi = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(b.hi), _mm256_set1_epi32(127)), 23);
    return cg_pair(_mm256_mul_ps(a.lo, _mm256_castsi256_ps(lo)), _mm256_mul_ps(a.hi, _mm256_castsi256_ps(hi)));
}
static inline cg512 cg_permutexvar_ps(cg512 index, cg512 x) {
    __m256i seven = _mm256_set1_epi32(7);
    __m256 lo = _mm256_blendv_ps(_mm256_permutevar8x32_ps(x.lo, cg_ilo(index)), _mm256_permutevar8x32_ps(x.hi, cg_ilo(index)),
                                 _mm256_castsi256_ps(_mm256_cmpgt_epi32(cg_ilo(index), seven)));
    __m256 hi = _mm256_blendv_ps(_mm256_permutevar8x32_ps(x.lo, cg_ihi(index)), _mm256_permutevar8x32_ps(x.hi, cg_ihi(index)),
                                 _mm256_castsi256_ps(_mm256_cmpgt_epi32(cg_ihi(index), seven)));
    return cg_pair(lo, hi);
}
/* the intrinsics that take immediates, as macros */
#define _mm512_roundscale_ps(x, imm) cg_pair(_mm256_round_ps((x).lo, (imm)), _mm256_round_ps((x).hi, (imm)))
#define _mm512_permute_ps(x, imm) cg_pair(_mm256_permute_ps((x).lo, (imm)), _mm256_permute_ps((x).hi, (imm)))
#define _mm512_shuffle_ps(a, b, imm) cg_pair(_mm256_shuffle_ps((a).lo, (b).lo, (imm)), _mm256_shuffle_ps((a).hi, (b).hi, (imm)))
/* 128-bit chunks: a's (imm & 3) and (imm >> 2 & 3), then b's (imm >> 4 & 3) and (imm >> 6 & 3) */
#define _mm512_shuffle_f32x4(a, b, imm)                                                          \
    cg_pair(_mm256_permute2f128_ps((a).lo, (a).hi, ((imm) & 3) | (((imm) >> 2 & 3) << 4)),      \
            _mm256_permute2f128_ps((b).lo, (b).hi, ((imm) >> 4 & 3) | (((imm) >> 6 & 3) << 4)))
/* the rest, by name */
#define _mm512_abs_ps cg_abs_ps
#define _mm512_add_epi32 cg_add_epi32
#define _mm512_add_ps cg_add_ps
#define _mm512_and_si512 cg_and_si512
#define _mm512_castps_si512 cg_castps_si512
#define _mm512_castsi512_ps cg_castsi512_ps
#define _mm512_cvtepi32_epi16 cg_cvtepi32_epi16
#define _mm512_cvtepu16_epi32 cg_cvtepu16_epi32
#define _mm512_div_ps cg_div_ps
#define _mm512_fmadd_ps cg_fmadd_ps
#define _mm512_fmsub_ps cg_fmsub_ps
#define _mm512_fnmadd_ps cg_fnmadd_ps
#define _mm512_load_ps cg_load_ps
#define _mm512_loadu_ps cg_loadu_ps
#define _mm512_mask3_fmadd_ps cg_mask3_fmadd_ps
#define _mm512_mask_blend_ps cg_mask_blend_ps
#define _mm512_mask_max_ps cg_mask_max_ps
#define _mm512_mask_mov_epi32 cg_mask_mov_epi32
#define _mm512_mask_mul_ps cg_mask_mul_ps
#define _mm512_mask_storeu_ps cg_mask_storeu_ps
#define _mm512_maskz_loadu_ps cg_maskz_loadu_ps
#define _mm512_maskz_mov_ps cg_maskz_mov_ps
#define _mm512_max_ps cg_max_ps
#define _mm512_mul_ps cg_mul_ps
#define _mm512_or_si512 cg_or_si512
#define _mm512_permutexvar_ps cg_permutexvar_ps
#define _mm512_reduce_add_ps cg_reduce_add_ps
#define _mm512_reduce_max_ps cg_reduce_max_ps
#define _mm512_scalef_ps cg_scalef_ps
#define _mm512_set1_epi32 cg_set1_epi32
#define _mm512_set1_ps cg_set1_ps
#define _mm512_setr_epi32 cg_setr_epi32
#define _mm512_setzero_ps cg_setzero_ps
#define _mm512_slli_epi32 cg_slli_epi32
#define _mm512_srli_epi32 cg_srli_epi32
#define _mm512_store_ps cg_store_ps
#define _mm512_storeu_ps cg_storeu_ps
#define _mm512_sub_ps cg_sub_ps
#define _mm512_xor_si512 cg_xor_si512
"""
