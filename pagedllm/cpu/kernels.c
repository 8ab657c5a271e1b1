/* CPU kernels for pagedllm, compiled at first use with `cc -O3 -march=native -fopenmp` (see build.py).
 *
 * Plain C with GCC vector extensions: the compiler maps the 16-lane vectors onto AVX-512, AVX2 or
 * SSE, whichever the machine has. OpenMP here shares torch's runtime (same libgomp.so.1 soname), so
 * torch's threads and ours are one pool.
 *
 * 1. GEMM on GGUF blocks: y (M, N) = x (M, K) @ W^T with W kept as Q4_0 / Q4_1 / Q8_0 blocks of 32.
 *    Every weight is dequantized exactly as gguf-py does in float32 (d * q + m: the product d * q
 *    is exact, one rounding for the sum; FMA rounds once too), so the weights equal the dequantized
 *    float32 checkpoint bit for bit and only the order of the float32 sums differs from a dense
 *    matmul. The weights are repacked once into tiles of 16 output rows, so one vector holds one k
 *    for 16 outputs and x is broadcast (no horizontal sums):
 *
 *      Q4 tile block (16 rows x 32 k):  fp16 d[16]; fp16 m[16]; uint8 q[16][16]    320 bytes
 *          q[p][j] = row j's byte p of the GGUF block: low nibble = k p, high nibble = k p + 16
 *      Q8 tile block (16 rows x 32 k):  fp16 d[16]; int8 q[32][16]                  544 bytes
 *
 *    5 and 8.5 bits per weight, as in the GGUF file: a decode step streams every weight once, so
 *    the bytes read bound its time (SmolLM2-135M: ~97 MB, which can stay in a large L3).
 *
 *    Tiles of a weight: [tile 0: block 0, block 1, ... block K/32-1][tile 1: ...]...
 *
 * 2. Paged decode attention (one query token per request) straight from the block table.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

#define TILE 16
#define QK 32
#define Q4_TILE_BLOCK_BYTES (TILE * 2 * 2 + TILE * 16)
#define Q8_TILE_BLOCK_BYTES (TILE * 2 + TILE * QK)
/* Rows of x per pass over a tile: all accumulators must fit in registers (32 zmm with AVX-512). */
#if defined(__AVX512F__)
#define MAX_MR 16
#else
#define MAX_MR 4
#endif

static inline f32x16 load_f32x16(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_f32x16(float *p, f32x16 v) { memcpy(p, &v, sizeof v); }

static inline f32x16 splat(float s) { return (f32x16){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

/* 16 bytes -> 16 int32 lanes. GCC does not turn __builtin_convertvector on byte vectors into one
 * vpmovzxbd (it inserts byte by byte), so the widening loads are intrinsics where available. */
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
    const uint8_t *tile, int nblocks, const float *x, long ldx, float *y, long ldy, int mr, int ncols) {
    const int nc = NCHAINS(mr);
    f32x16 acc[MAX_ACC];
    for (int i = 0; i < mr * nc; i++) acc[i] = splat(0.0f);
    for (int b = 0; b < nblocks; b++) {
        const uint8_t *blk = tile + (long)b * Q4_TILE_BLOCK_BYTES;
        const f32x16 d = load_f16x16((const uint16_t *)blk);
        const f32x16 m = load_f16x16((const uint16_t *)blk + TILE);
        const uint8_t *q = blk + TILE * 4;
        const float *xb = x + b * QK;
        for (int p = 0; p < 16; p++) {
            i32x16 v = load_u8_i32x16(q + p * TILE);
            f32x16 w_lo = __builtin_convertvector(v & 15, f32x16) * d + m;
            f32x16 w_hi = __builtin_convertvector(v >> 4, f32x16) * d + m;
            const int c_lo = (2 * p) % nc, c_hi = (2 * p + 1) % nc;
            for (int r = 0; r < mr; r++) {
                acc[r * nc + c_lo] += splat(xb[r * ldx + p]) * w_lo;
                acc[r * nc + c_hi] += splat(xb[r * ldx + p + 16]) * w_hi;
            }
        }
    }
    store_rows(y, ldy, acc, mr, nc, ncols);
}

static inline __attribute__((always_inline)) void q8_tile(
    const uint8_t *tile, int nblocks, const float *x, long ldx, float *y, long ldy, int mr, int ncols) {
    const int nc = NCHAINS(mr);
    f32x16 acc[MAX_ACC];
    for (int i = 0; i < mr * nc; i++) acc[i] = splat(0.0f);
    for (int b = 0; b < nblocks; b++) {
        const uint8_t *blk = tile + (long)b * Q8_TILE_BLOCK_BYTES;
        const f32x16 d = load_f16x16((const uint16_t *)blk);
        const int8_t *q = (const int8_t *)(blk + TILE * 2);
        const float *xb = x + b * QK;
        for (int k = 0; k < QK; k++) {
            f32x16 w = __builtin_convertvector(load_s8_i32x16(q + k * TILE), f32x16) * d;
            for (int r = 0; r < mr; r++) acc[r * nc + k % nc] += splat(xb[r * ldx + k]) * w;
        }
    }
    store_rows(y, ldy, acc, mr, nc, ncols);
}

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

/* kind: 4 = Q4 tiles (Q4_0 / Q4_1), 8 = Q8_0 tiles. x (M, K) row stride ldx, y (M, N) row stride ldy. */
void gguf_gemm(int kind, const float *x, long ldx, const uint8_t *w, float *y, long ldy,
               long M, long N, long K, int num_threads) {
    const int nblocks = (int)(K / QK);
    const long ntiles = (N + TILE - 1) / TILE;
    const long tile_bytes = (long)nblocks * (kind == 4 ? Q4_TILE_BLOCK_BYTES : Q8_TILE_BLOCK_BYTES);
    /* Rows in chunks of MAX_MR; tiles split over threads. Each thread walks its tiles once per
     * chunk of rows, so a tile's bytes are reread only M / MAX_MR times (from cache when small). */
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (long t = 0; t < ntiles; t++) {
        const uint8_t *tile = w + t * tile_bytes;
        const int nc = (int)((N - t * TILE) < TILE ? (N - t * TILE) : TILE);
        for (long r0 = 0; r0 < M; r0 += MAX_MR) {
            const int mr = (int)((M - r0) < MAX_MR ? (M - r0) : MAX_MR);
            const float *xr = x + r0 * ldx;
            float *yr = y + r0 * ldy + t * TILE;
            if (kind == 4) {
                DISPATCH_MR(q4_tile, mr, tile, nblocks, xr, ldx, yr, ldy)
            } else {
                DISPATCH_MR(q8_tile, mr, tile, nblocks, xr, ldx, yr, ldy)
            }
        }
    }
}

/* The dense float32 weight (N, K), row-major, from its tiles: for long prefills, which MKL multiplies
 * faster than gguf_gemm once the weight is dense (the same float32 values as gguf-py's dequantize). */
void gguf_dequantize(int kind, const uint8_t *w, float *out, long N, long K, int num_threads) {
    const int nblocks = (int)(K / QK);
    const long ntiles = (N + TILE - 1) / TILE;
    const long tile_bytes = (long)nblocks * (kind == 4 ? Q4_TILE_BLOCK_BYTES : Q8_TILE_BLOCK_BYTES);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (long t = 0; t < ntiles; t++) {
        const uint8_t *tile = w + t * tile_bytes;
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
                float *dst = out + (t * TILE + j) * K + (long)b * QK;
                for (int k = 0; k < QK; k++) dst[k] = buf[k][j];
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * 2. Paged attention for decode rows (one query token per request), reading K/V through the block
 *    table; and the KV-cache write of a step's new tokens.
 *
 *    kv_cache: float (2, num_blocks, block_size, num_kv_heads, head_dim), contiguous.
 *    Query head h reads KV head h / (num_heads / num_kv_heads) (grouped-query attention).
 *    Softmax in two passes over the request's scores (max, then exp and sum), float32 throughout.
 */

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

/* Copy row t of key/value (num_kv_heads * head_dim floats, row strides in floats) to its slot;
 * slot < 0 (padding) is skipped. */
void write_kv_cache(const float *key, long key_stride, const float *value, long value_stride,
                    float *kv_cache, long num_slots, const int64_t *slot_mapping, long num_tokens,
                    long row) {
    float *k_cache = kv_cache, *v_cache = kv_cache + num_slots * row;
    for (long t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row, key + t * key_stride, sizeof(float) * row);
        memcpy(v_cache + slot * row, value + t * value_stride, sizeof(float) * row);
    }
}


/* Row pointers of positions p0 .. p0+15 (< seq) of one KV head, walking the block table block by
 * block (no division per position). */
static inline void kv_rows(const float *cache, const int32_t *table, int block_size, long row, long head_off,
                           int p0, int seq, const float **rows) {
    int b = p0 / block_size, off = p0 % block_size;
    const float *base = cache + (long)table[b] * block_size * row + head_off;
    for (int u = 0; u < 16 && p0 + u < seq; u++) {
        rows[u] = base + (long)off * row;
        if (++off == block_size) {
            off = 0;
            if (p0 + u + 1 < seq) base = cache + (long)table[++b] * block_size * row + head_off;
        }
    }
}

/* One (request, KV head) task: every query head of the group. `nv` = head_dim / 16 is a compile-time
 * constant at each call site, so q and the output accumulators stay in registers. */
static inline __attribute__((always_inline)) void attn_task(
    const float *query, long q_stride, float *out, long out_stride, const float *k_cache, const float *v_cache,
    long row, int block_size, int group, int head_dim, int kvh, long t, int seq, const int32_t *table,
    float scale, float *scores, const int nv) {
    const int seq16 = (seq + 15) & ~15;
    for (int g = 0; g < group; g++) {
        const int h = kvh * group + g;
        const float *q = query + t * q_stride + (long)h * head_dim;
        f32x16 qv[16];
        for (int j = 0; j < nv; j++) qv[j] = load_f32x16(q + 16 * j) * splat(scale);
        /* 1. scores = q . k, 16 positions at a time, one transpose-reduce per 16 */
        f32x16 mx = splat(-INFINITY);
        for (int p0 = 0; p0 < seq; p0 += 16) {
            const float *k_row[16];
            kv_rows(k_cache, table, block_size, row, (long)kvh * head_dim, p0, seq, k_row);
            f32x16 part[16];
            const int n = seq - p0 < 16 ? seq - p0 : 16;
            for (int u = 0; u < 16; u++) {
                if (u >= n) {
                    part[u] = splat(0.0f);
                    continue;
                }
                f32x16 acc = qv[0] * load_f32x16(k_row[u]);
                for (int j = 1; j < nv; j++) acc += qv[j] * load_f32x16(k_row[u] + 16 * j);
                part[u] = acc;
            }
            f32x16 sv = hsum16x16(part);
            for (int u = n; u < 16; u++) sv[u] = -INFINITY;
            store_f32x16(scores + p0, sv);
            mx = vmax(sv, mx);
        }
        /* 2. softmax numerators (masked lanes give 0) and their sum */
        float m = -INFINITY;
        for (int l = 0; l < 16; l++) m = mx[l] > m ? mx[l] : m;
        f32x16 sum = splat(0.0f);
        for (int p0 = 0; p0 < seq16; p0 += 16) {
            const f32x16 e = exp16(load_f32x16(scores + p0) - splat(m));
            store_f32x16(scores + p0, e);
            sum += e;
        }
        /* 3. out = sum_pos p[pos] v[pos] / sum; two accumulator sets for independent FMA chains */
        f32x16 o0[16], o1[16];
        for (int j = 0; j < nv; j++) o0[j] = o1[j] = splat(0.0f);
        for (int p0 = 0; p0 < seq; p0 += 16) {
            const float *v_row[16];
            kv_rows(v_cache, table, block_size, row, (long)kvh * head_dim, p0, seq, v_row);
            const int n = seq - p0 < 16 ? seq - p0 : 16;
            int u = 0;
            for (; u + 1 < n; u += 2) {
                const f32x16 pa = splat(scores[p0 + u]), pb = splat(scores[p0 + u + 1]);
                for (int j = 0; j < nv; j++) {
                    o0[j] += pa * load_f32x16(v_row[u] + 16 * j);
                    o1[j] += pb * load_f32x16(v_row[u + 1] + 16 * j);
                }
            }
            if (u < n) {
                const f32x16 pa = splat(scores[p0 + u]);
                for (int j = 0; j < nv; j++) o0[j] += pa * load_f32x16(v_row[u] + 16 * j);
            }
        }
        const f32x16 inv = splat(1.0f / hsum16(sum));
        float *dst = out + t * out_stride + (long)h * head_dim;
        for (int j = 0; j < nv; j++) store_f32x16(dst + 16 * j, (o0[j] + o1[j]) * inv);
    }
}

/* out[t] for the decode rows t = query_start_loc[r] of requests r in `reqs` (n_reqs of them).
 * query (T, num_heads, head_dim) with row stride q_stride; out likewise with out_stride.
 * head_dim must be a multiple of 16 and at most 256. `scratch` holds seq_len rounded up to 16
 * scores per thread (scratch_per_thread floats each). */
void paged_decode_attention(const float *query, long q_stride, float *out, long out_stride,
                            const float *kv_cache, long num_slots, int block_size, int num_heads,
                            int num_kv_heads, int head_dim, const int32_t *block_table,
                            long block_table_stride, const int32_t *seq_lens,
                            const int32_t *query_start_loc, const int64_t *reqs, long n_reqs,
                            float scale, float *scratch, long scratch_per_thread, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int nv = head_dim / 16;
    const long row = (long)num_kv_heads * head_dim; /* floats per token slot */
    const float *k_cache = kv_cache, *v_cache = kv_cache + num_slots * row;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) collapse(2)
    for (long i = 0; i < n_reqs; i++) {
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {
            int tid = 0;
#ifdef _OPENMP
            tid = omp_get_thread_num();
#endif
            const long r = reqs[i];
            float *scores = scratch + (long)tid * scratch_per_thread;
#define ATTN_TASK(NV)                                                                                       \
    attn_task(query, q_stride, out, out_stride, k_cache, v_cache, row, block_size, group, head_dim, kvh,     \
              query_start_loc[r], seq_lens[r], block_table + r * block_table_stride, scale, scores, NV)
            switch (nv) {
                case 4: ATTN_TASK(4); break;
                case 8: ATTN_TASK(8); break;
                default: ATTN_TASK(nv); break;
            }
#undef ATTN_TASK
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * 3. RMSNorm (with the residual add fused) and rotary embedding, row by row.
 */

/* out[t] = (s * (1 / sqrt(mean(s^2) + eps))) * weight with s = x[t] (+ residual[t], also stored to
 * residual_out[t]). The two products round separately, as the torch reference does; only the order
 * of the mean's sum differs from torch's reduction. */
void rms_norm(const float *x, long x_stride, const float *residual, long res_stride, float *residual_out,
              const float *weight, float *out, long num_tokens, long hidden, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens >= 8)
    for (long t = 0; t < num_tokens; t++) {
        const float *xr = x + t * x_stride;
        float *o = out + t * hidden;
        const float *s = xr;
        if (residual != NULL) {
            const float *rr = residual + t * res_stride;
            float *so = residual_out + t * hidden;
            for (long i = 0; i < hidden; i++) so[i] = xr[i] + rr[i];
            s = so;
        }
        f32x16 acc = splat(0.0f);
        long i = 0;
        for (; i + 16 <= hidden; i += 16) {
            f32x16 v = load_f32x16(s + i);
            acc += v * v;
        }
        float ss = hsum16(acc);
        for (; i < hidden; i++) ss += s[i] * s[i];
        const float r = 1.0f / sqrtf(ss / (float)hidden + eps);
        /* (s * r) rounds before `* weight`, like `(x * rsqrt).to(dtype) * weight` (no FMA: no add). */
        for (long j = 0; j < hidden; j++) o[j] = (s[j] * r) * weight[j];
    }
}

/* Rotary embedding of q and k rows, out of place, bit-exact with the torch reference: o1 = x1 cos
 * - x2 sin and o2 = x2 cos + x1 sin with every product rounded (no FMA contraction here).
 * neox: x1 = features [0, rd/2), x2 = [rd/2, rd); else (GPT-J) x1 = even, x2 = odd features.
 * cos_sin_cache: (max_position, rd) = [cos | sin]. Features past rd are copied. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
static void rope_rows(const float *x, long x_stride, float *out, long num_heads, long head_size, long rd,
                      const float *cs, int neox) {
    const long half = rd / 2;
    for (long h = 0; h < num_heads; h++) {
        const float *xh = x + h * head_size;
        float *oh = out + h * head_size;
        for (long i = 0; i < half; i++) {
            const float c = cs[i], s = cs[half + i];
            const long a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
            const float x1 = xh[a], x2 = xh[b];
            const float p1 = x1 * c, p2 = x2 * s, p3 = x2 * c, p4 = x1 * s;
            oh[a] = p1 - p2;
            oh[b] = p3 + p4;
        }
        for (long i = rd; i < head_size; i++) oh[i] = xh[i];
    }
    (void)x_stride;
}

void rotary_embedding(const int64_t *positions, const float *q, long q_stride, const float *k, long k_stride,
                      float *q_out, float *k_out, long num_tokens, long num_q_heads, long num_k_heads,
                      long head_size, long rotary_dim, const float *cos_sin_cache, int neox, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens >= 8)
    for (long t = 0; t < num_tokens; t++) {
        const float *cs = cos_sin_cache + positions[t] * rotary_dim;
        rope_rows(q + t * q_stride, q_stride, q_out + t * num_q_heads * head_size, num_q_heads, head_size,
                  rotary_dim, cs, neox);
        rope_rows(k + t * k_stride, k_stride, k_out + t * num_k_heads * head_size, num_k_heads, head_size,
                  rotary_dim, cs, neox);
    }
}
#pragma GCC pop_options
