/* The two inner loops of attention.h's attn_task in 256-bit intrinsics, for x86 with AVX2 and no AVX-512.
 *
 * Why: attention.h's loops keep 16 16-lane vectors live (the transpose-reduce of 16 scores; GS * nv
 * output accumulators in the P.V loop). Compiled for AVX2 each is a pair of ymm: 32 live registers of
 * 16, so GCC spilled them and its 16-lane shuffles became element moves through the stack: 2.5-2.7 G
 * multiply-adds/s on one Zen3 core (its FMA pipes allow ~39 G), 0.7 ms per layer for 16 decode rows at
 * 100 positions. Here the reductions work on 8 positions at a time and the P.V loop on a few output
 * columns at a time, so everything fits the 16 ymm registers. Same arithmetic (float32 products and
 * sums, the softmax of attention.h), summed in another order: results agree to float32 rounding.
 */
#pragma once

#include <immintrin.h>

/* 8 cache elements at p, widened to float32. */
static inline __attribute__((always_inline)) __m256 load_kv8(const char *p, const int kvt) {
    if (kvt == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (kvt == KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}

/* Lane u of the result = the sum of the 8 lanes of a[u]. */
static inline __attribute__((always_inline)) __m256 hsum8x8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    /* u0: lanes 0-3 = halves' sums of a0..a3 (low 128), lanes 4-7 the same of the high 128 bits */
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* qk_scores of attention.h for all `group` heads of a KV head at once: scores[g * seq16 + p] = q_g . k[p]
 * for p < seq, -inf from seq up to seq16 (the next multiple of 16); mx[g] = the max over p of head g;
 * group <= 16. q: group * nv * 16 floats, q_g scaled by `scale` on load (as attention.h's qv). Each 8 positions' K rows are widened to float32 once into
 * an L1 buffer for all heads (vcvtph2ps issues about once a cycle on Zen3: widening them per head made
 * the conversions, not the FMAs, the bound). */
#define QK_HEADS_AVX2 16
static inline __attribute__((always_inline)) void qk_scores_avx2(const float *q, int group, float scale,
                                                                const char *k_base,
                                                                const long *offs, int seq, int seq16,
                                                                float *scores, float *mx, const int nv,
                                                                const int kvt) {
    const int nw = 2 * nv; /* ymm per head */
    const long w_bytes = 8 * KV_ELEM_BYTES(kvt), vec_bytes = 16 * KV_ELEM_BYTES(kvt);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    _Alignas(32) float kf[8][16 * 16]; /* 8 positions x head_dim (<= 256) */
    __m256 m8[QK_HEADS_AVX2];          /* per head: the running max */
    const __m256 sc = _mm256_set1_ps(scale);
    for (int g = 0; g < group; g++) m8[g] = ninf;
    int p0 = 0;
    for (; p0 < seq; p0 += 8) {
        const int n = seq - p0 < 8 ? seq - p0 : 8;
        for (int u = p0 + KV_PF; u < p0 + KV_PF + 8 && u < seq; u++)
            for (long l = 0; l < nv * vec_bytes; l += 64) __builtin_prefetch(k_base + offs[u] + l);
        /* Positions past seq repeat the last one (their lanes become -inf below): no branch in the
         * unrolled loops, so the 8 accumulators stay in registers. */
        for (int u = 0; u < 8; u++) {
            const char *k = k_base + offs[p0 + (u < n ? u : n - 1)];
            for (int j = 0; j < nw; j++) _mm256_store_ps(kf[u] + 8 * j, load_kv8(k + j * w_bytes, kvt));
        }
        for (int g = 0; g < group; g++) {
            /* Without this GCC hoists the kf loads out of the head loop and spills them to other stack
             * slots: 64 more 256-bit stores per 8 positions, and stores (one a cycle) were the bound. */
            __asm__ volatile("" ::: "memory");
            const float *qg = q + (long)g * nw * 8;
            __m256 acc[8];
            const __m256 q0 = _mm256_mul_ps(_mm256_loadu_ps(qg), sc);
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) acc[u] = _mm256_mul_ps(q0, _mm256_load_ps(kf[u]));
            for (int j = 1; j < nw; j++) {
                const __m256 qj = _mm256_mul_ps(_mm256_loadu_ps(qg + 8 * j), sc);
#pragma GCC unroll 8
                for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(qj, _mm256_load_ps(kf[u] + 8 * j), acc[u]);
            }
            __m256 sv = hsum8x8(acc);
            if (n < 8) {
                const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                sv = _mm256_blendv_ps(sv, ninf, _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(n - 1))));
            }
            _mm256_storeu_ps(scores + (long)g * seq16 + p0, sv);
            m8[g] = _mm256_max_ps(m8[g], sv);
        }
    }
    for (int g = 0; g < group; g++) {
        for (int p = p0; p < seq16; p += 8) _mm256_storeu_ps(scores + (long)g * seq16 + p, ninf);
        float lanes[8], m = -INFINITY;
        _mm256_storeu_ps(lanes, m8[g]);
        for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
        mx[g] = m;
    }
}

/* Heads per pass of pv_heads_avx2 (attn_task's PV loop steps by it). */
#define PV_HEADS_AVX2 4

/* One pass of pv_heads_avx2: output columns [8 c0, 8 (c0 + CW)) of gn (<= 4) heads, GN * CW <= 8
 * accumulators (two sets of positions when one head, for two FMA chains). */
static inline __attribute__((always_inline)) void pv_cols_avx2(const char *v_base, const long *offs, int seq,
                                                              const float *w, long wstride, const float *inv,
                                                              float *out, int head_dim, int c0, const int GN,
                                                              const int CW, const int nv, const int kvt,
                                                              const int prefetch) {
    const long w_bytes = 8 * KV_ELEM_BYTES(kvt), vec_bytes = 16 * KV_ELEM_BYTES(kvt);
    __m256 acc[2][4][4];
    const int sets = GN == 1 ? 2 : 1;
    for (int s = 0; s < sets; s++)
        for (int g = 0; g < GN; g++)
            for (int j = 0; j < CW; j++) acc[s][g][j] = _mm256_setzero_ps();
    int p = 0;
    for (; p + sets <= seq; p += sets) {
        if (prefetch && p + KV_PF < seq)
            for (int s = 0; s < sets && p + KV_PF + s < seq; s++)
                for (long l = 0; l < nv * vec_bytes; l += 64) __builtin_prefetch(v_base + offs[p + KV_PF + s] + l);
        for (int s = 0; s < sets; s++) {
            const char *vr = v_base + offs[p + s] + c0 * w_bytes;
            for (int j = 0; j < CW; j++) {
                const __m256 v = load_kv8(vr + j * w_bytes, kvt);
                for (int g = 0; g < GN; g++)
                    acc[s][g][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + g * wstride + p + s), v, acc[s][g][j]);
            }
        }
    }
    if (p < seq) { /* one head, odd seq: the last position */
        const char *vr = v_base + offs[p] + c0 * w_bytes;
        for (int j = 0; j < CW; j++) {
            const __m256 v = load_kv8(vr + j * w_bytes, kvt);
            for (int g = 0; g < GN; g++)
                acc[0][g][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + g * wstride + p), v, acc[0][g][j]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int j = 0; j < CW; j++) {
            __m256 a = acc[0][g][j];
            if (sets == 2) a = _mm256_add_ps(a, acc[1][g][j]);
            _mm256_storeu_ps(out + (long)g * head_dim + 8 * (c0 + j), _mm256_mul_ps(a, _mm256_set1_ps(inv[g])));
        }
}

/* pv_heads of attention.h: out_g = sum_p w_g[p] v[p] * inv_g for gn <= PV_HEADS_AVX2 heads, in passes
 * over the output columns (V rows are reread from cache per pass; the first pass prefetches). */
static inline __attribute__((always_inline)) void pv_heads_avx2(const char *v_base, const long *offs, int seq,
                                                               const float *w, long wstride, const float *inv,
                                                               int gn, float *out, int head_dim, const int nv,
                                                               const int kvt) {
    const int nw = 2 * nv;
#define PV_PASSES(GN, CW)                                                                                     \
    for (int c0 = 0; c0 < nw; c0 += (CW)) {                                                                   \
        if (c0 + (CW) <= nw)                                                                                  \
            pv_cols_avx2(v_base, offs, seq, w, wstride, inv, out, head_dim, c0, GN, CW, nv, kvt, c0 == 0);    \
        else                                                                                                  \
            pv_cols_avx2(v_base, offs, seq, w, wstride, inv, out, head_dim, c0, GN, 2, nv, kvt, c0 == 0);     \
    }
    switch (gn) {
        case 1: PV_PASSES(1, 4) break;
        case 2: PV_PASSES(2, 4) break;
        case 3: PV_PASSES(3, 2) break;
        default: PV_PASSES(4, 2) break;
    }
#undef PV_PASSES
}
