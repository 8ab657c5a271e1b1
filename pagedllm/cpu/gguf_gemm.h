/* GEMM on GGUF blocks: y (M, N) = x (M, K) @ W^T with W kept as Q4_0 / Q4_1 / Q8_0 blocks of 32.
 *
 * Every weight is dequantized exactly as gguf-py does in float32 (d * q + m: the product d * q is
 * exact, one rounding for the sum; FMA rounds once too), so the weights equal the dequantized float32
 * checkpoint bit for bit and only the order of the float32 sums differs from a dense matmul. The
 * weights are repacked once (gguf_gemm.py) into tiles of 16 output rows, so one vector holds one k
 * for 16 outputs and x is broadcast (no horizontal sums):
 *
 *   Q4 tile block (16 rows x 32 k):  fp16 d[16]; fp16 m[16]; uint8 q[16][16]    320 bytes
 *       q[p][j] = row j's byte p of the GGUF block: low nibble = k p, high nibble = k p + 16
 *   Q8 tile block (16 rows x 32 k):  fp16 d[16]; int8 q[32][16]                  544 bytes
 *   Tiles of a weight: [tile 0: block 0, block 1, ... block K/32-1][tile 1: ...]...
 *
 * 5 and 8.5 bits per weight, as in the GGUF file: a decode step streams every weight once, so the
 * bytes read bound its time (SmolLM2-135M: ~97 MB, which can stay in a large L3).
 *
 * Prefills (more than ~48 rows) go through gguf_gemm_dense instead: panels of the weight are dequantized
 * into each worker's L2 and multiplied by BLAS sgemm (MKL in torch's wheels), ~1.2x faster than the
 * block kernel at 64 rows and ~1.6x at 1024.
 */
#pragma once

#include "pool.h"
#include "vec.h"

#define TILE 16
#define QK 32
#define Q4_TILE_BLOCK_BYTES (TILE * 2 * 2 + TILE * 16)
#define Q8_TILE_BLOCK_BYTES (TILE * 2 + TILE * QK)
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096 /* software prefetch distance in the weight stream */
#endif
/* AVX2 without AVX-512 has its own 256-bit kernels (gguf_gemm_avx2.h); the generic ones below are for
 * 16-lane vectors. */
#define GEMM_AVX2 VEC_AVX2
/* Rows of x per pass over a tile: all accumulators must fit in registers (32 zmm with AVX-512). */
#if defined(__AVX512F__)
#define MAX_MR 16
#elif GEMM_AVX2
#define MAX_MR 6 /* the AVX2 buffered kernel's pass (AVX2_PASS) */
#else
#define MAX_MR 4
#endif

/* Independent accumulators per row: an FMA waits ~4 cycles for the previous one into the same
 * register, so few rows need several partial sums (chains) to keep both FMA units busy. */
#define NCHAINS(mr) ((mr) >= 6 ? 1 : (mr) >= 3 ? 2 : 4)
#define MAX_ACC (MAX_MR > 8 ? MAX_MR : 8)

static inline void store_rows(float *y, long ldy, f32x16 *acc, int mr, int nc, int ncols) {
    for (int r = 0; r < mr; r++) {
        f32x16 s = acc[r * nc];
        for (int c = 1; c < nc; c++) s += acc[r * nc + c];
        if (ncols == TILE) {
            store_f32x16(y + r * ldy, s);
        } else {
            float tmp[TILE];
            store_f32x16(tmp, s);
            memcpy(y + r * ldy, tmp, sizeof(float) * ncols);
        }
    }
}

/* One tile (16 outputs) for `mr` rows of x; `mr` is a compile-time constant at every call site,
 * so the row loops unroll and the accumulators live in registers. */
static inline __attribute__((always_inline)) void q4_tile(
    const uint8_t *tile, int nblocks, const float *xt, float *y, long ldy, int mr, int ncols) {
    const int nc = NCHAINS(mr);
    f32x16 acc[MAX_ACC];
    for (int i = 0; i < mr * nc; i++) acc[i] = splat(0.0f);
    for (int b = 0; b < nblocks; b++) {
        const uint8_t *blk = tile + (long)b * Q4_TILE_BLOCK_BYTES;
        /* A few blocks ahead (the next tile's first blocks at the end): keeps several cache lines in
         * flight while one block's 16 k-pairs compute. */
        for (int l = 0; l < Q4_TILE_BLOCK_BYTES; l += 64) __builtin_prefetch(blk + PREFETCH_BYTES + l);
        const f32x16 d = load_f16x16((const uint16_t *)blk);
        const f32x16 m = load_f16x16((const uint16_t *)blk + TILE);
        const uint8_t *q = blk + TILE * 4;
        const float *xb = xt + (long)b * QK * mr; /* [k][row] */
        for (int p = 0; p < 16; p++) {
            i32x16 v = load_u8_i32x16(q + p * TILE);
            f32x16 w_lo = __builtin_convertvector(v & 15, f32x16) * d + m;
            f32x16 w_hi = __builtin_convertvector(v >> 4, f32x16) * d + m;
            const int c_lo = (2 * p) % nc, c_hi = (2 * p + 1) % nc;
            for (int r = 0; r < mr; r++) {
                acc[r * nc + c_lo] += splat(xb[p * mr + r]) * w_lo;
                acc[r * nc + c_hi] += splat(xb[(p + 16) * mr + r]) * w_hi;
            }
        }
    }
    store_rows(y, ldy, acc, mr, nc, ncols);
}

static inline __attribute__((always_inline)) void q8_tile(
    const uint8_t *tile, int nblocks, const float *xt, float *y, long ldy, int mr, int ncols) {
    const int nc = NCHAINS(mr);
    f32x16 acc[MAX_ACC];
    for (int i = 0; i < mr * nc; i++) acc[i] = splat(0.0f);
    for (int b = 0; b < nblocks; b++) {
        const uint8_t *blk = tile + (long)b * Q8_TILE_BLOCK_BYTES;
        for (int l = 0; l < Q8_TILE_BLOCK_BYTES; l += 64) __builtin_prefetch(blk + PREFETCH_BYTES + l);
        const f32x16 d = load_f16x16((const uint16_t *)blk);
        const int8_t *q = (const int8_t *)(blk + TILE * 2);
        const float *xb = xt + (long)b * QK * mr; /* [k][row] */
        for (int k = 0; k < QK; k++) {
            f32x16 w = __builtin_convertvector(load_s8_i32x16(q + k * TILE), f32x16) * d;
            for (int r = 0; r < mr; r++) acc[r * nc + k % nc] += splat(xb[k * mr + r]) * w;
        }
    }
    store_rows(y, ldy, acc, mr, nc, ncols);
}

#if GEMM_AVX2
#include "gguf_gemm_avx2.h"
#endif

#if MAX_MR == 16
#define DISPATCH_MR(fn, mr, ...)                      \
    switch (mr) {                                     \
        case 1: fn(__VA_ARGS__, 1, nc); break;        \
        case 2: fn(__VA_ARGS__, 2, nc); break;        \
        case 3: fn(__VA_ARGS__, 3, nc); break;        \
        case 4: fn(__VA_ARGS__, 4, nc); break;        \
        case 5: fn(__VA_ARGS__, 5, nc); break;        \
        case 6: fn(__VA_ARGS__, 6, nc); break;        \
        case 7: fn(__VA_ARGS__, 7, nc); break;        \
        case 8: fn(__VA_ARGS__, 8, nc); break;        \
        case 9: fn(__VA_ARGS__, 9, nc); break;        \
        case 10: fn(__VA_ARGS__, 10, nc); break;      \
        case 11: fn(__VA_ARGS__, 11, nc); break;      \
        case 12: fn(__VA_ARGS__, 12, nc); break;      \
        case 13: fn(__VA_ARGS__, 13, nc); break;      \
        case 14: fn(__VA_ARGS__, 14, nc); break;      \
        case 15: fn(__VA_ARGS__, 15, nc); break;      \
        default: fn(__VA_ARGS__, 16, nc); break;      \
    }
#else
#define DISPATCH_MR(fn, mr, ...)                      \
    switch (mr) {                                     \
        case 1: fn(__VA_ARGS__, 1, nc); break;        \
        case 2: fn(__VA_ARGS__, 2, nc); break;        \
        case 3: fn(__VA_ARGS__, 3, nc); break;        \
        default: fn(__VA_ARGS__, 4, nc); break;       \
    }
#endif


static inline long tile_bytes_of(int kind, long K) {
    return K / QK * (kind == 4 ? Q4_TILE_BLOCK_BYTES : Q8_TILE_BLOCK_BYTES);
}

/* Tiles per pool chunk: small chunks (~10-30 us of work), so a helper preempted in the middle of one
 * holds back little; a claim costs one atomic op. 8 tiles at M <= 4, down to 1 tile from M = 32. */
static inline long tiles_per_chunk(long M) {
    const long per = 8 / ((M + 3) / 4);
    return per < 1 ? 1 : per;
}


struct gemm_ctx {
    int kind;
    const float *xt; /* x regrouped: per pass of up to MAX_MR rows, [k][row] (see regroup_rows) */
    const uint8_t *w;
    float *y;
    long ldy, M, N, K, tiles_per_chunk;
};

static void gemm_chunk(void *arg, long chunk, int worker) {
    const struct gemm_ctx *c = arg;
    (void)worker;
    const int nblocks = (int)(c->K / QK);
    const long ntiles = (c->N + TILE - 1) / TILE;
    const long tb = tile_bytes_of(c->kind, c->K);
    const long t_end = (chunk + 1) * c->tiles_per_chunk < ntiles ? (chunk + 1) * c->tiles_per_chunk : ntiles;
    for (long t = chunk * c->tiles_per_chunk; t < t_end; t++) {
        const uint8_t *tile = c->w + t * tb;
        const int nc = (int)((c->N - t * TILE) < TILE ? (c->N - t * TILE) : TILE);
#if GEMM_AVX2
        tile_avx2(c->kind, tile, nblocks, c->xt, c->K, c->y + t * TILE, c->ldy, c->M, nc);
#else
        /* Rows in passes of MAX_MR; the tile's bytes are reread per pass, from cache. */
        for (long r0 = 0; r0 < c->M; r0 += MAX_MR) {
            const int mr = (int)((c->M - r0) < MAX_MR ? (c->M - r0) : MAX_MR);
            const float *xt = c->xt + r0 * c->K;
            float *yr = c->y + r0 * c->ldy + t * TILE;
            const long ldy = c->ldy;
            if (c->kind == 4) {
                DISPATCH_MR(q4_tile, mr, tile, nblocks, xt, yr, ldy)
            } else {
                DISPATCH_MR(q8_tile, mr, tile, nblocks, xt, yr, ldy)
            }
        }
#endif
    }
}

/* x regrouped per pass of mr = min(MAX_MR, rows left) rows as [k][row], the pass at offset
 * r0 * K: the kernel then broadcasts x values at fixed offsets from one pointer instead of keeping
 * MAX_MR row pointers in registers. Thread-local: concurrent callers do not share it. */
static _Thread_local float *XT = NULL;
static _Thread_local long XT_LEN = 0;

static const float *regroup_rows(const float *x, long ldx, long M, long K) {
    if (XT_LEN < M * K) {
        free(XT);
        XT = malloc(sizeof(float) * M * K);
        XT_LEN = XT ? M * K : 0;
        if (XT == NULL) return NULL;
    }
    for (long r0 = 0; r0 < M; r0 += MAX_MR) {
        const long mr = M - r0 < MAX_MR ? M - r0 : MAX_MR;
        float *dst = XT + r0 * K;
        for (long r = 0; r < mr; r++) {
            const float *src = x + (r0 + r) * ldx;
            for (long k = 0; k < K; k++) dst[k * mr + r] = src[k];
        }
    }
    return XT;
}

/* kind: 4 = Q4 tiles (Q4_0 / Q4_1), 8 = Q8_0 tiles. x (M, K) row stride ldx, y (M, N) row stride ldy.
 * Returns 0 (nothing done) when the regrouping buffer cannot be allocated. */
int gguf_gemm(int kind, const float *x, long ldx, const uint8_t *w, float *y, long ldy, long M, long N, long K) {
    const float *xt = regroup_rows(x, ldx, M, K);
    if (xt == NULL) return 0;
    const long ntiles = (N + TILE - 1) / TILE;
#if GEMM_AVX2
    struct gemm_ctx c = {kind, xt, w, y, ldy, M, N, K, tiles_per_chunk_avx2(M, K)};
#else
    struct gemm_ctx c = {kind, xt, w, y, ldy, M, N, K, tiles_per_chunk(M)};
#endif
    pool_run(gemm_chunk, &c, (ntiles + c.tiles_per_chunk - 1) / c.tiles_per_chunk);
    return 1;
}

/* Rows [t0 * 16, t1 * 16) of the dense weight, row-major with row stride K, from tiles t0..t1-1. */
static void dequantize_tiles(int kind, const uint8_t *w, float *out, long N, long K, long t0, long t1) {
    const int nblocks = (int)(K / QK);
    const long tb = tile_bytes_of(kind, K);
    for (long t = t0; t < t1; t++) {
        const uint8_t *tile = w + t * tb;
        const int nc = (int)((N - t * TILE) < TILE ? (N - t * TILE) : TILE);
        float buf[QK][TILE]; /* one block: 32 k x 16 rows */
        for (int b = 0; b < nblocks; b++) {
            if (kind == 4) {
                const uint8_t *blk = tile + (long)b * Q4_TILE_BLOCK_BYTES;
                const f32x16 d = load_f16x16((const uint16_t *)blk);
                const f32x16 m = load_f16x16((const uint16_t *)blk + TILE);
                const uint8_t *q = blk + TILE * 4;
                for (int p = 0; p < 16; p++) {
                    i32x16 v = load_u8_i32x16(q + p * TILE);
                    store_f32x16(buf[p], __builtin_convertvector(v & 15, f32x16) * d + m);
                    store_f32x16(buf[p + 16], __builtin_convertvector(v >> 4, f32x16) * d + m);
                }
            } else {
                const uint8_t *blk = tile + (long)b * Q8_TILE_BLOCK_BYTES;
                const f32x16 d = load_f16x16((const uint16_t *)blk);
                const int8_t *q = (const int8_t *)(blk + TILE * 2);
                for (int k = 0; k < QK; k++)
                    store_f32x16(buf[k], __builtin_convertvector(load_s8_i32x16(q + k * TILE), f32x16) * d);
            }
            for (int j = 0; j < nc; j++) {
                float *dst = out + ((t - t0) * TILE + j) * K + (long)b * QK;
                for (int k = 0; k < QK; k++) dst[k] = buf[k][j];
            }
        }
    }
}

struct dequant_ctx {
    int kind;
    const uint8_t *w;
    float *out;
    long N, K, tiles_per_chunk;
};

static void dequant_chunk(void *arg, long chunk, int worker) {
    const struct dequant_ctx *c = arg;
    (void)worker;
    const long ntiles = (c->N + TILE - 1) / TILE;
    const long t0 = chunk * c->tiles_per_chunk;
    const long t1 = t0 + c->tiles_per_chunk < ntiles ? t0 + c->tiles_per_chunk : ntiles;
    dequantize_tiles(c->kind, c->w, c->out + t0 * TILE * c->K, c->N, c->K, t0, t1);
}

/* The dense float32 weight (N, K), row-major (the same values as gguf-py's dequantize). */
void gguf_dequantize(int kind, const uint8_t *w, float *out, long N, long K) {
    const long ntiles = (N + TILE - 1) / TILE;
    struct dequant_ctx c = {kind, w, out, N, K, 4};
    pool_run(dequant_chunk, &c, (ntiles + c.tiles_per_chunk - 1) / c.tiles_per_chunk);
}

/* Fortran BLAS sgemm (column-major), handed in by Python from torch's own BLAS (cpu_set_sgemm). */
typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                         const float *beta, float *c, const int *ldc);
static sgemm_fn SGEMM = NULL;
/* MKL's per-thread thread count (Fortran mkl_set_num_threads_local_, the argument by pointer): our
 * workers call sgemm from threads MKL has never seen, which would otherwise each start an OpenMP team
 * of all cores inside the call. */
typedef int (*blas_threads_fn)(const int *);
static blas_threads_fn BLAS_SET_THREADS_LOCAL = NULL;
static _Thread_local int BLAS_THREADS_SET = 0;

void cpu_set_sgemm(void *fn, void *set_threads_local) {
    SGEMM = (sgemm_fn)fn;
    BLAS_SET_THREADS_LOCAL = (blas_threads_fn)set_threads_local;
}

/* Long prefills: per (N block, M block) chunk, dequantize the weight's DENSE_N_BLOCK rows into a panel
 * that stays in the worker's L2 (transposed: a tile block lands as 32 vector stores), then sgemm the
 * chunk's rows of x against it. Chunks are numbered N-major, so a worker's next chunk usually reuses
 * its panel. (Dequantizing the whole weight into one shared scratch first, as before, wrote and read
 * back ~540 MB per prefill step: M = 416 took 352 ms, now 305 ms.) */
#define DENSE_N_BLOCK 256
#define DENSE_M_BLOCK 128

/* Tile t of the weight, transposed: out[k * ld + j] = W[t * 16 + j][k] for j < the tile's rows. */
static void dequantize_tile_t(int kind, const uint8_t *w, long N, long K, long t, float *out, long ld) {
    const int nblocks = (int)(K / QK);
    const uint8_t *tile = w + t * tile_bytes_of(kind, K);
    const int nc = (int)((N - t * TILE) < TILE ? (N - t * TILE) : TILE);
    for (int b = 0; b < nblocks; b++) {
        float *dst = out + (long)b * QK * ld; /* row k = b * 32 */
        f32x16 rows[QK];
        if (kind == 4) {
            const uint8_t *blk = tile + (long)b * Q4_TILE_BLOCK_BYTES;
            const f32x16 d = load_f16x16((const uint16_t *)blk);
            const f32x16 m = load_f16x16((const uint16_t *)blk + TILE);
            const uint8_t *q = blk + TILE * 4;
            for (int p = 0; p < 16; p++) {
                i32x16 v = load_u8_i32x16(q + p * TILE);
                rows[p] = __builtin_convertvector(v & 15, f32x16) * d + m;
                rows[p + 16] = __builtin_convertvector(v >> 4, f32x16) * d + m;
            }
        } else {
            const uint8_t *blk = tile + (long)b * Q8_TILE_BLOCK_BYTES;
            const f32x16 d = load_f16x16((const uint16_t *)blk);
            const int8_t *q = (const int8_t *)(blk + TILE * 2);
            for (int k = 0; k < QK; k++) rows[k] = __builtin_convertvector(load_s8_i32x16(q + k * TILE), f32x16) * d;
        }
        for (int k = 0; k < QK; k++) {
            if (nc == TILE) {
                store_f32x16(dst + (long)k * ld, rows[k]);
            } else {
                float tmp[TILE];
                store_f32x16(tmp, rows[k]);
                memcpy(dst + (long)k * ld, tmp, sizeof(float) * nc);
            }
        }
    }
}

/* Per worker: the dequantized panel of the last chunk (DENSE_N_BLOCK rows x K, transposed) and which. */
static _Thread_local float *PANEL = NULL;
static _Thread_local long PANEL_LEN = 0, PANEL_CALL = -1, PANEL_N0 = -1;
static _Atomic long PANEL_CALLS = 0;

struct panel_ctx {
    int kind;
    const float *x;
    long ldx;
    const uint8_t *w;
    float *y;
    long ldy, M, N, K, m_blocks, call;
    _Atomic int failed; /* a worker could not allocate its panel */
};

static void panel_chunk(void *arg, long chunk, int worker) {
    const struct panel_ctx *c = arg;
    (void)worker;
    const long n0 = (chunk / c->m_blocks) * DENSE_N_BLOCK, m0 = (chunk % c->m_blocks) * DENSE_M_BLOCK;
    const int m = (int)(c->N - n0 < DENSE_N_BLOCK ? c->N - n0 : DENSE_N_BLOCK);
    const int n = (int)(c->M - m0 < DENSE_M_BLOCK ? c->M - m0 : DENSE_M_BLOCK);
    if (PANEL_LEN < DENSE_N_BLOCK * c->K) {
        free(PANEL);
        PANEL = aligned_alloc(64, sizeof(float) * DENSE_N_BLOCK * c->K);
        PANEL_LEN = PANEL ? DENSE_N_BLOCK * c->K : 0;
        PANEL_CALL = -1;
        if (PANEL == NULL) {
            atomic_store(&((struct panel_ctx *)arg)->failed, 1);
            return;
        }
    }
    if (PANEL_CALL != c->call || PANEL_N0 != n0) {
        for (long t = n0 / TILE; t < (n0 + m + TILE - 1) / TILE; t++)
            dequantize_tile_t(c->kind, c->w, c->N, c->K, t, PANEL + (t * TILE - n0), DENSE_N_BLOCK);
        PANEL_CALL = c->call;
        PANEL_N0 = n0;
    }
    const int k = (int)c->K, lda = DENSE_N_BLOCK, ldb = (int)c->ldx, ldc = (int)c->ldy;
    const float alpha = 1.0f, beta = 0.0f;
    if (!BLAS_THREADS_SET && BLAS_SET_THREADS_LOCAL != NULL) {
        const int one = 1;
        BLAS_SET_THREADS_LOCAL(&one);
        BLAS_THREADS_SET = 1;
    }
    SGEMM("N", "N", &m, &n, &k, &alpha, PANEL, &lda, c->x + m0 * c->ldx, &ldb, &beta, c->y + m0 * c->ldy + n0, &ldc);
}

/* Same result as gguf_gemm (up to the order of the sums), for large M; 0 (y not complete) when no sgemm
 * was handed in or a worker could not allocate its panel: the caller then uses gguf_gemm. */
int gguf_gemm_dense(int kind, const float *x, long ldx, const uint8_t *w, float *y, long ldy, long M, long N,
                    long K) {
    if (SGEMM == NULL) return 0;
    const long n_blocks = (N + DENSE_N_BLOCK - 1) / DENSE_N_BLOCK, m_blocks = (M + DENSE_M_BLOCK - 1) / DENSE_M_BLOCK;
    struct panel_ctx c = {kind, x, ldx, w, y, ldy, M, N, K, m_blocks, atomic_fetch_add(&PANEL_CALLS, 1), 0};
    pool_run(panel_chunk, &c, n_blocks * m_blocks);
    return !atomic_load(&c.failed);
}

