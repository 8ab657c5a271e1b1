/* 16-lane float / int vectors (GCC vector extensions) and the few helpers every kernel shares.
 *
 * The compiler maps f32x16 onto one AVX-512 register, two AVX2 registers or four SSE registers,
 * whichever `-march=native` offers. Byte widening and fp16 loads use intrinsics where they exist
 * (GCC does not turn __builtin_convertvector on byte vectors into one vpmovzxbd).
 */
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* x86 with AVX2 + FMA + F16C but no AVX-512 (AMD Zen 2/3, Intel before Ice Lake): a 16-lane vector is
 * a pair of the 16 ymm registers there, and kernels whose 16-lane loops keep many vectors live spill;
 * the hottest loops have 256-bit versions (gguf_gemm_avx2.h, attention_avx2.h) under this macro. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define VEC_AVX2 1
#else
#define VEC_AVX2 0
#endif

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));


static inline f32x16 load_f32x16(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_f32x16(float *p, f32x16 v) { memcpy(p, &v, sizeof v); }

static inline f32x16 splat(float s) { return (f32x16){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

/* 16 bytes -> 16 int32 lanes. */
static inline i32x16 load_u8_i32x16(const uint8_t *p) {
#if defined(__AVX512F__)
    return (i32x16)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    i32x16 v;
    __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    memcpy(&v, &lo, 32);
    memcpy((char *)&v + 32, &hi, 32);
    return v;
#else
    i32x16 v;
    for (int i = 0; i < 16; i++) v[i] = p[i];
    return v;
#endif
}

static inline f32x16 load_f16x16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (f32x16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    f32x16 v;
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    memcpy(&v, &lo, 32);
    memcpy((char *)&v + 32, &hi, 32);
    return v;
#else
    f32x16 v;
    for (int i = 0; i < 16; i++) {  /* IEEE half -> float, subnormals included */
        uint32_t h = p[i], sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
        if (exp == 0x1f) {
            bits = sign | 0x7f800000u | (man << 13);
        } else if (exp != 0) {
            bits = sign | ((exp + 112) << 23) | (man << 13);
        } else if (man == 0) {
            bits = sign;
        } else {
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400u));
            bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
        }
        memcpy(&v[i], &bits, 4);
    }
    return v;
#endif
}

static inline i32x16 splat_i(int32_t s) { return (i32x16){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

/* Lanes of a where mask (all ones), else b, on int lanes. */
static inline i32x16 vselect_i(i32x16 mask, i32x16 a, i32x16 b) { return (a & mask) | (b & ~mask); }

/* float32 -> IEEE half, round to nearest even (as torch's .to(float16)); overflow gives inf, NaN stays NaN.
 * The portable fallback of store_f16x16 (F. Giesen's float_to_half_fast3_rtne). */
static inline uint16_t f32_to_f16_rne(float f) {
    uint32_t x, ax;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    ax = x & 0x7fffffffu;
    if (ax >= 0x47800000u) return (uint16_t)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u)); /* >= 2^16, inf, NaN */
    if (ax < 0x38800000u) { /* below 2^-14: a half subnormal (or zero); adding 0.5 rounds it into the low bits */
        float a;
        memcpy(&a, &ax, 4);
        a += 0.5f;
        memcpy(&ax, &a, 4);
        return (uint16_t)(sign | (ax - 0x3f000000u));
    }
    ax += ((uint32_t)(15 - 127) << 23) + 0xfffu + ((ax >> 13) & 1u); /* rebias the exponent, round */
    return (uint16_t)(sign | (ax >> 13));
}

static inline void store_f16x16(uint16_t *p, f32x16 v) {
#if defined(__AVX512F__)
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
    __m256 lo, hi;
    memcpy(&lo, &v, 32);
    memcpy(&hi, (const char *)&v + 32, 32);
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128((__m128i *)(p + 8), _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    for (int i = 0; i < 16; i++) p[i] = f32_to_f16_rne(v[i]);
#endif
}

/* bfloat16 = the top 16 bits of a float32: widening is a shift. */
static inline f32x16 load_bf16x16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (f32x16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    i32x16 v;
    for (int i = 0; i < 16; i++) v[i] = (int32_t)((uint32_t)p[i] << 16);
    return (f32x16)v;
#endif
}

/* float32 -> bfloat16 rounded to nearest even, any NaN -> 0x7fc0: torch's own rounding. */
static inline void store_bf16x16(uint16_t *p, f32x16 v) {
    const u32x16 x = (u32x16)v;
    const i32x16 rounded = (i32x16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
    const i32x16 out = vselect_i(v != v, splat_i(0x7fc0), rounded);
    for (int i = 0; i < 16; i++) p[i] = (uint16_t)out[i];
}

static inline i32x16 load_s8_i32x16(const int8_t *p) {
#if defined(__AVX512F__)
    return (i32x16)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    i32x16 v;
    __m256i lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    memcpy(&v, &lo, 32);
    memcpy((char *)&v + 32, &hi, 32);
    return v;
#else
    i32x16 v;
    for (int i = 0; i < 16; i++) v[i] = p[i];
    return v;
#endif
}

static inline float hsum16(f32x16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* Lane i of the result = the sum of the 16 lanes of v[i]: a transpose-and-add tree (30 two-source
 * shuffles and 15 adds for 16 sums, instead of 16 serial horizontal sums). */
static inline f32x16 hsum16x16(const f32x16 *v) {
    const i32x16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i32x16 hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const i32x16 lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const i32x16 hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const i32x16 lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const i32x16 hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const i32x16 lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const i32x16 hi1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    f32x16 a[8], b[4], c[2];
    /* a[k]: lanes 0-7 partial sums of v[2k], lanes 8-15 of v[2k+1] */
    for (int k = 0; k < 8; k++)
        a[k] = __builtin_shuffle(v[2 * k], v[2 * k + 1], lo8) + __builtin_shuffle(v[2 * k], v[2 * k + 1], hi8);
    /* b[k]: lanes 0-3 v[4k], 4-7 v[4k+2], 8-11 v[4k+1], 12-15 v[4k+3] */
    for (int k = 0; k < 4; k++)
        b[k] = __builtin_shuffle(a[2 * k], a[2 * k + 1], lo4) + __builtin_shuffle(a[2 * k], a[2 * k + 1], hi4);
    for (int k = 0; k < 2; k++)
        c[k] = __builtin_shuffle(b[2 * k], b[2 * k + 1], lo2) + __builtin_shuffle(b[2 * k], b[2 * k + 1], hi2);
    const f32x16 z = __builtin_shuffle(c[0], c[1], lo1) + __builtin_shuffle(c[0], c[1], hi1);
    /* Lane l of z holds the sum of v[src[l]]; put each sum back in its own lane. */
    static const int src[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    i32x16 inv;
    for (int l = 0; l < 16; l++) inv[src[l]] = l;
    return __builtin_shuffle(z, inv);
}

/* Lanes of a where mask (all ones), else b: C has no vector ?: (GCC's bit casts keep the bits). */
static inline f32x16 vselect(i32x16 mask, f32x16 a, f32x16 b) {
    return (f32x16)(((i32x16)a & mask) | ((i32x16)b & ~mask));
}

static inline f32x16 vmax(f32x16 a, f32x16 b) { return vselect(a > b, a, b); }

/* exp of 16 lanes: 2^n * p(r) with n = round(x / ln 2), r = x - n ln 2 (two-part ln 2), p a degree-6
 * Taylor polynomial: within 2 ulp of expf; x < -87.3 gives 0 (softmax weights of masked-far scores). */
#if VEC_AVX2
/* The same steps on 8 lanes in intrinsics, fused as -ffp-contract=fast fuses the 16-lane code: that code
 * compiled for AVX2 moved its selects' masks through the stack (~15% of attention's time on Zen3). */
static inline __m256 exp8_avx2(__m256 x) {
    const __m256 lo_lim = _mm256_set1_ps(-87.33654f), magic = _mm256_set1_ps(12582912.0f);
    x = _mm256_max_ps(x, lo_lim);
    const __m256 fn = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic), magic);
    const __m256 r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(1.428606765330187e-06f),
                                      _mm256_fnmadd_ps(fn, _mm256_set1_ps(0.693145751953125f), x));
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fn), _mm256_set1_epi32(127)), 23);
    const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(_mm256_cmp_ps(x, lo_lim, _CMP_LE_OQ), y);
}

static inline f32x16 exp16(f32x16 x) {
    __m256 h[2];
    memcpy(h, &x, sizeof x);
    h[0] = exp8_avx2(h[0]);
    h[1] = exp8_avx2(h[1]);
    memcpy(&x, h, sizeof x);
    return x;
}
#else
static inline f32x16 exp16(f32x16 x) {
    const f32x16 lo_lim = splat(-87.33654f);
    x = vmax(x, lo_lim);
    const f32x16 fn = __builtin_convertvector(__builtin_convertvector(x * splat(1.44269504088896341f) +
                                                                          splat(12582912.0f) - splat(12582912.0f),
                                                                      i32x16), f32x16);
    const f32x16 r = (x - fn * splat(0.693145751953125f)) - fn * splat(1.428606765330187e-06f);
    f32x16 p = splat(1.0f / 720.0f);
    p = p * r + splat(1.0f / 120.0f);
    p = p * r + splat(1.0f / 24.0f);
    p = p * r + splat(1.0f / 6.0f);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    const i32x16 e = (__builtin_convertvector(fn, i32x16) + 127) << 23;
    f32x16 scale;
    memcpy(&scale, &e, sizeof scale);
    const f32x16 y = p * scale;
    return vselect(x <= lo_lim, splat(0.0f), y);
}
#endif
