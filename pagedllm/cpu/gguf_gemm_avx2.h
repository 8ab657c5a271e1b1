/* The GGUF block GEMM of gguf_gemm.h for x86 with AVX2 + FMA + F16C and no AVX-512 (e.g. AMD Zen 2/3,
 * Intel before Ice Lake), in 256-bit intrinsics.
 *
 * Why a separate kernel: the generic one is written for 16-lane vectors (one zmm). Compiled for AVX2,
 * each f32x16 is a pair of ymm and its NCHAINS(mr) * mr accumulators (8 pairs at 1 row, 8 at 4 rows)
 * plus d, m and the weights need more than the 16 ymm registers there are: GCC kept the accumulators
 * on the stack, and the kernel ran at ~3.3 G multiply-adds/s whatever the number of rows (1 thread,
 * Zen3 at 2.45 GHz; its two FMA pipes allow ~39 G), ~2 GB/s of Q4_1 blocks at one row.
 *
 * Same tile layout (gguf_gemm.h), same weights: w = fma(q, d, m) for Q4 and q * d for Q8, the float32
 * values gguf-py gives; only the order of the float32 sums differs from the dense product (as in the
 * AVX-512 kernel). Two kernels, picked per pass of rows:
 *
 *   rows <= 4 (decode): the weights are dequantized in registers and used at once; per 8 outputs x
 *     2 k: one vpmovzxbd, an and and a shift, 2 conversions, 2 FMAs to dequantize, 2 * rows FMAs.
 *     At one row that is 1 cycle per 8 weights on the two FMA pipes (~12 GB/s of Q4_1 blocks per
 *     core at 2.45 GHz, about what two cores' memory bandwidth gives).
 *   rows > 4: each 32 x 16 block is dequantized once into a 2 KB buffer in L1, then passes of up to 6
 *     rows (12 accumulators + 2 weight vectors + 1 broadcast = 15 ymm) multiply it, their partial
 *     sums kept in a small L1 array between blocks: the dequantization (1/rows of the work before) is
 *     paid once per block however many rows there are.
 */
#pragma once

#include <immintrin.h>

#define AVX2_PASS 6           /* rows per pass of the buffered kernel (= MAX_MR: x is regrouped per 6 rows) */
#define AVX2_GROUP_ROWS 48    /* rows whose partial sums stay in the L1 array at once */

/* Tiles per pool chunk, sized by work: ~10k cycles (~4 us at 2.45 GHz) at ~40 + 32 M cycles per 32 x 16
 * block. By tiles alone (gguf_gemm.h's tiles_per_chunk), a 1-row down_proj (K = 1536) made 5 chunks of
 * ~10 us for 2 workers. */
static inline long tiles_per_chunk_avx2(long M, long K) {
    const long per = 10000 / ((K / QK) * (40 + 32 * (M < 48 ? M : 48)));
    return per < 1 ? 1 : per;
}

static inline __attribute__((always_inline)) void store_tile_avx2(float *y, __m256 a0, __m256 a1, int ncols) {
    if (ncols == TILE) {
        _mm256_storeu_ps(y, a0);
        _mm256_storeu_ps(y + 8, a1);
    } else {
        float tmp[TILE];
        _mm256_storeu_ps(tmp, a0);
        _mm256_storeu_ps(tmp + 8, a1);
        memcpy(y, tmp, sizeof(float) * ncols);
    }
}

/* The register kernels' epilogue: per row, the two 8-output halves summed over sp (1 or 2) chains. */
static inline __attribute__((always_inline)) void store_rows_avx2(float *y, long ldy, __m256 acc[4][2][2], int mr,
                                                                  int sp, int ncols) {
    for (int r = 0; r < mr; r++) {
        __m256 a0 = acc[r][0][0], a1 = acc[r][1][0];
        if (sp == 2) {
            a0 = _mm256_add_ps(a0, acc[r][0][1]);
            a1 = _mm256_add_ps(a1, acc[r][1][1]);
        }
        store_tile_avx2(y + r * ldy, a0, a1, ncols);
    }
}

/* Q4 tile, mr rows (x as [k][row]), weights dequantized in registers and used at once; used at 1 row
 * (from 2 rows its accumulators spill: q4_half_avx2). At 1-2 rows the low and high nibbles feed separate
 * accumulators (4 per row: an FMA's 4-cycle latency would otherwise bound the loop). */
static inline __attribute__((always_inline)) void q4_tile_avx2(const uint8_t *tile, int nblocks, const float *xt,
                                                                float *y, long ldy, int mr, int ncols) {
    const int sp = mr <= 2 ? 2 : 1;
    __m256 acc[4][2][2];
    for (int r = 0; r < mr; r++)
        for (int s = 0; s < sp; s++) acc[r][0][s] = acc[r][1][s] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int b = 0; b < nblocks; b++) {
        const uint8_t *blk = tile + (long)b * Q4_TILE_BLOCK_BYTES;
        for (int l = 0; l < Q4_TILE_BLOCK_BYTES; l += 64) __builtin_prefetch(blk + PREFETCH_BYTES + l);
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32)));
        const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 48)));
        const uint8_t *q = blk + TILE * 4;
        const float *xb = xt + (long)b * QK * mr;
#pragma GCC unroll 16
        for (int p = 0; p < 16; p++) {
            const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + p * TILE)));
            const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + p * TILE + 8)));
            const __m256 lo0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, low4)), d0, m0);
            const __m256 lo1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, low4)), d1, m1);
            const __m256 hi0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), d0, m0);
            const __m256 hi1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), d1, m1);
            for (int r = 0; r < mr; r++) {
                const __m256 xl = _mm256_broadcast_ss(xb + p * mr + r);
                const __m256 xh = _mm256_broadcast_ss(xb + (p + 16) * mr + r);
                acc[r][0][0] = _mm256_fmadd_ps(xl, lo0, acc[r][0][0]);
                acc[r][1][0] = _mm256_fmadd_ps(xl, lo1, acc[r][1][0]);
                acc[r][0][sp - 1] = _mm256_fmadd_ps(xh, hi0, acc[r][0][sp - 1]);
                acc[r][1][sp - 1] = _mm256_fmadd_ps(xh, hi1, acc[r][1][sp - 1]);
            }
        }
    }
    store_rows_avx2(y, ldy, acc, mr, sp, ncols);
}

/* Q4, one half of a tile (8 outputs, `half` 0 or 1) for mr <= 4 rows: d, m, the mask, the weights and
 * mr * nch accumulators fit in the 16 ymm registers (both halves at once do not from 2 rows). nch chains
 * per row: (low / high nibble) x (even / odd p) at 1-2 rows, low / high at 3-4. */
static inline __attribute__((always_inline)) void q4_half_avx2(const uint8_t *tile, int nblocks, const float *xt,
                                                                float *y, long ldy, int mr, int ncols, int half) {
    const int nch = mr <= 2 ? 4 : 2;
    __m256 acc[4][4];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nch; c++) acc[r][c] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int b = 0; b < nblocks; b++) {
        const uint8_t *blk = tile + (long)b * Q4_TILE_BLOCK_BYTES;
        if (half == 0)
            for (int l = 0; l < Q4_TILE_BLOCK_BYTES; l += 64) __builtin_prefetch(blk + PREFETCH_BYTES + l);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * half)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * half)));
        const uint8_t *q = blk + TILE * 4 + 8 * half;
        const float *xb = xt + (long)b * QK * mr;
#pragma GCC unroll 16
        for (int p = 0; p < 16; p++) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + p * TILE)));
            const __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low4)), d, m);
            const __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d, m);
            const int c = nch == 4 ? 2 * (p & 1) : 0;
            for (int r = 0; r < mr; r++) {
                acc[r][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + p * mr + r), lo, acc[r][c]);
                acc[r][c + 1] = _mm256_fmadd_ps(_mm256_broadcast_ss(xb + (p + 16) * mr + r), hi, acc[r][c + 1]);
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        __m256 a = _mm256_add_ps(acc[r][0], acc[r][1]);
        if (nch == 4) a = _mm256_add_ps(a, _mm256_add_ps(acc[r][2], acc[r][3]));
        float tmp[8];
        _mm256_storeu_ps(tmp, a);
        const int n = ncols - 8 * half < 8 ? ncols - 8 * half : 8;
        if (n > 0) memcpy(y + r * ldy + 8 * half, tmp, sizeof(float) * n);
    }
}

/* Q8 tile, mr <= 4 rows: w = q * d (exact), two accumulator pairs per row at 1-2 rows (even / odd k). */
static inline __attribute__((always_inline)) void q8_tile_avx2(const uint8_t *tile, int nblocks, const float *xt,
                                                                float *y, long ldy, int mr, int ncols) {
    const int sp = mr <= 2 ? 2 : 1;
    __m256 acc[4][2][2];
    for (int r = 0; r < mr; r++)
        for (int s = 0; s < sp; s++) acc[r][0][s] = acc[r][1][s] = _mm256_setzero_ps();
    for (int b = 0; b < nblocks; b++) {
        const uint8_t *blk = tile + (long)b * Q8_TILE_BLOCK_BYTES;
        for (int l = 0; l < Q8_TILE_BLOCK_BYTES; l += 64) __builtin_prefetch(blk + PREFETCH_BYTES + l);
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        const int8_t *q = (const int8_t *)(blk + TILE * 2);
        const float *xb = xt + (long)b * QK * mr;
#pragma GCC unroll 32
        for (int k = 0; k < QK; k++) {
            const __m256 w0 = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + k * TILE)))), d0);
            const __m256 w1 = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + k * TILE + 8)))), d1);
            const int s = k % sp;
            for (int r = 0; r < mr; r++) {
                const __m256 xk = _mm256_broadcast_ss(xb + k * mr + r);
                acc[r][0][s] = _mm256_fmadd_ps(xk, w0, acc[r][0][s]);
                acc[r][1][s] = _mm256_fmadd_ps(xk, w1, acc[r][1][s]);
            }
        }
    }
    store_rows_avx2(y, ldy, acc, mr, sp, ncols);
}

/* One 32 x 16 block dequantized into buf[k][16] (the same values as in the register kernels). */
static inline __attribute__((always_inline)) void dequant_block_avx2(int kind, const uint8_t *blk, float *buf) {
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
    if (kind == 4) {
        const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32)));
        const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 48)));
        const __m256i low4 = _mm256_set1_epi32(15);
        const uint8_t *q = blk + TILE * 4;
#pragma GCC unroll 16
        for (int p = 0; p < 16; p++) {
            const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + p * TILE)));
            const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + p * TILE + 8)));
            _mm256_store_ps(buf + p * TILE, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, low4)), d0, m0));
            _mm256_store_ps(buf + p * TILE + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, low4)), d1, m1));
            _mm256_store_ps(buf + (p + 16) * TILE, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), d0, m0));
            _mm256_store_ps(buf + (p + 16) * TILE + 8,
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), d1, m1));
        }
    } else {
        const int8_t *q = (const int8_t *)(blk + TILE * 2);
#pragma GCC unroll 32
        for (int k = 0; k < QK; k++) {
            const __m256i v0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + k * TILE)));
            const __m256i v1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + k * TILE + 8)));
            _mm256_store_ps(buf + k * TILE, _mm256_mul_ps(_mm256_cvtepi32_ps(v0), d0));
            _mm256_store_ps(buf + k * TILE + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(v1), d1));
        }
    }
}

/* acc[r][16] += sum over the block's 32 k of x[k][r] * buf[k][:], mr <= 6 rows in registers. */
static inline __attribute__((always_inline)) void block_pass_avx2(const float *buf, const float *xb, float *acc, int mr) {
    __m256 a[AVX2_PASS][2];
    for (int r = 0; r < mr; r++) {
        a[r][0] = _mm256_load_ps(acc + r * TILE);
        a[r][1] = _mm256_load_ps(acc + r * TILE + 8);
    }
#pragma GCC unroll 8
    for (int k = 0; k < QK; k++) {
        const __m256 w0 = _mm256_load_ps(buf + k * TILE), w1 = _mm256_load_ps(buf + k * TILE + 8);
        for (int r = 0; r < mr; r++) {
            const __m256 xk = _mm256_broadcast_ss(xb + k * mr + r);
            a[r][0] = _mm256_fmadd_ps(xk, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xk, w1, a[r][1]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_store_ps(acc + r * TILE, a[r][0]);
        _mm256_store_ps(acc + r * TILE + 8, a[r][1]);
    }
}

/* Rows [r0, r0 + rows) of one tile through the L1 buffer (rows <= AVX2_GROUP_ROWS, r0 a multiple of 6). */
static void tile_buffered_avx2(int kind, const uint8_t *tile, int nblocks, const float *xt, long K, float *y,
                               long ldy, long r0, long M, int ncols) {
    _Alignas(32) float buf[QK * TILE];
    _Alignas(32) float acc[AVX2_GROUP_ROWS * TILE];
    const long rows = M - r0 < AVX2_GROUP_ROWS ? M - r0 : AVX2_GROUP_ROWS;
    memset(acc, 0, sizeof(float) * rows * TILE);
    const long bb = kind == 4 ? Q4_TILE_BLOCK_BYTES : Q8_TILE_BLOCK_BYTES;
    for (int b = 0; b < nblocks; b++) {
        const uint8_t *blk = tile + (long)b * bb;
        for (int l = 0; l < bb; l += 64) __builtin_prefetch(blk + PREFETCH_BYTES + l);
        dequant_block_avx2(kind, blk, buf);
        for (long p0 = 0; p0 < rows; p0 += AVX2_PASS) {
            const int mr = (int)(rows - p0 < AVX2_PASS ? rows - p0 : AVX2_PASS);
            const float *xb = xt + (r0 + p0) * K + (long)b * QK * mr;
            float *ap = acc + p0 * TILE;
            switch (mr) {
                case 1: block_pass_avx2(buf, xb, ap, 1); break;
                case 2: block_pass_avx2(buf, xb, ap, 2); break;
                case 3: block_pass_avx2(buf, xb, ap, 3); break;
                case 4: block_pass_avx2(buf, xb, ap, 4); break;
                case 5: block_pass_avx2(buf, xb, ap, 5); break;
                default: block_pass_avx2(buf, xb, ap, 6); break;
            }
        }
    }
    for (long r = 0; r < rows; r++) memcpy(y + (r0 + r) * ldy, acc + r * TILE, sizeof(float) * ncols);
}

/* All M rows of one tile: a single pass of <= 4 rows in registers, else through the L1 buffer. */
static inline void tile_avx2(int kind, const uint8_t *tile, int nblocks, const float *xt, long K, float *y, long ldy,
                             long M, int ncols) {
    if (M <= 4) {
        const int mr = (int)M;
        if (kind == 4 && mr == 1) {
            q4_tile_avx2(tile, nblocks, xt, y, ldy, 1, ncols);
        } else if (kind == 4) { /* 2-4 rows: both halves at once would spill accumulators */
            for (int h = 0; h < 2; h++) switch (mr) {
                case 2: q4_half_avx2(tile, nblocks, xt, y, ldy, 2, ncols, h); break;
                case 3: q4_half_avx2(tile, nblocks, xt, y, ldy, 3, ncols, h); break;
                default: q4_half_avx2(tile, nblocks, xt, y, ldy, 4, ncols, h); break;
            }
        } else {
            switch (mr) {
                case 1: q8_tile_avx2(tile, nblocks, xt, y, ldy, 1, ncols); break;
                case 2: q8_tile_avx2(tile, nblocks, xt, y, ldy, 2, ncols); break;
                case 3: q8_tile_avx2(tile, nblocks, xt, y, ldy, 3, ncols); break;
                default: q8_tile_avx2(tile, nblocks, xt, y, ldy, 4, ncols); break;
            }
        }
        return;
    }
    for (long r0 = 0; r0 < M; r0 += AVX2_GROUP_ROWS) tile_buffered_avx2(kind, tile, nblocks, xt, K, y, ldy, r0, M, ncols);
}
