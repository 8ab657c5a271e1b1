/* Paged attention of query rows (each a token with its causal context length) reading K/V through the
 * block table, and the KV-cache write of a step's new tokens.
 *
 * kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim), contiguous, of element type kv_type:
 * float32, IEEE half or bfloat16 (a 16-bit cache halves the bytes a decode step reads; elements widen
 * to float32 on load, and everything after is float32). Query head h reads KV head
 * h / (num_heads / num_kv_heads) (grouped-query attention). Softmax in two passes over the request's
 * scores (max, then exp and sum), float32 throughout.
 */
#pragma once

#include "pool.h"
#include "vec.h"

/* KV cache element types (the kv_type argument; cpu/attention.py maps torch dtypes to them). */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

#define KV_ELEM_BYTES(kvt) ((kvt) == KV_F32 ? 4 : 2)

/* 16 cache elements at p, widened to float32; kvt is a compile-time constant at every call site. */
static inline __attribute__((always_inline)) f32x16 load_kv(const char *p, const int kvt) {
    if (kvt == KV_F16) return load_f16x16((const uint16_t *)p);
    if (kvt == KV_BF16) return load_bf16x16((const uint16_t *)p);
    return load_f32x16((const float *)p);
}

/* Copy row t of key/value (num_kv_heads * head_dim floats, row strides in floats) to its slot, rounded
 * to the cache's element type (to nearest even, as torch's .to(dtype)); slot < 0 (padding) is
 * skipped. A 16-bit cache needs row % 16 == 0. */
void write_kv_cache(const float *key, long key_stride, const float *value, long value_stride,
                    void *kv_cache, long num_slots, const int64_t *slot_mapping, long num_tokens,
                    long row, int kv_type) {
    const long row_bytes = row * KV_ELEM_BYTES(kv_type);
    char *k_cache = kv_cache, *v_cache = (char *)kv_cache + num_slots * row_bytes;
    for (long t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const float *src[2] = {key + t * key_stride, value + t * value_stride};
        char *dst[2] = {k_cache + slot * row_bytes, v_cache + slot * row_bytes};
        for (int kv = 0; kv < 2; kv++) {
            if (kv_type == KV_F32) {
                memcpy(dst[kv], src[kv], sizeof(float) * row);
                continue;
            }
            for (long i = 0; i < row; i += 16) {
                uint16_t *d = (uint16_t *)dst[kv] + i;
                if (kv_type == KV_F16)
                    store_f16x16(d, load_f32x16(src[kv] + i));
                else
                    store_bf16x16(d, load_f32x16(src[kv] + i));
            }
        }
    }
}


/* Byte offsets of positions 0 .. seq-1 in the K (or V) half of the cache, walking the block table
 * once per task: every head of the group, K and V, reuse them. */
static inline void slot_offsets(const int32_t *table, int block_size, long row, int seq, long *offs) {
    for (int p = 0, b = 0; p < seq; b++) {
        const long base = (long)table[b] * block_size * row;
        for (int o = 0; o < block_size && p < seq; o++, p++) offs[p] = base + (long)o * row;
    }
}

#ifndef KV_PF
/* Positions ahead that the K and V loops prefetch: the rows of a task are scattered over blocks, which
 * the hardware prefetcher does not follow (a decode step after the weight stream finds them in DRAM:
 * -25% attention time at 16 streams). */
#define KV_PF 16
#endif

/* scores[p] = q . k[p] for p < seq (16 positions per transpose-reduce; lanes past seq hold -inf up to
 * the next multiple of 16); returns their max. q already carries the softmax scale. */
static inline __attribute__((always_inline)) float qk_scores(const f32x16 *qv, const char *k_base,
                                                            const long *offs, int seq, float *scores,
                                                            const int nv, const int kvt) {
    const long vec_bytes = 16 * KV_ELEM_BYTES(kvt);
    f32x16 mx = splat(-INFINITY);
    for (int p0 = 0; p0 < seq; p0 += 16) {
        f32x16 part[16];
        const int n = seq - p0 < 16 ? seq - p0 : 16;
        for (int u = p0 + KV_PF; u < p0 + KV_PF + 16 && u < seq; u++)
            for (long l = 0; l < nv * vec_bytes; l += 64) __builtin_prefetch(k_base + offs[u] + l);
        for (int u = 0; u < 16; u++) {
            if (u >= n) {
                part[u] = splat(0.0f);
                continue;
            }
            const char *k = k_base + offs[p0 + u];
            f32x16 acc = qv[0] * load_kv(k, kvt);
            for (int j = 1; j < nv; j++) acc += qv[j] * load_kv(k + j * vec_bytes, kvt);
            part[u] = acc;
        }
        f32x16 sv = hsum16x16(part);
        for (int u = n; u < 16; u++) sv[u] = -INFINITY;
        store_f32x16(scores + p0, sv);
        mx = vmax(sv, mx);
    }
    float m = -INFINITY;
    for (int l = 0; l < 16; l++) m = mx[l] > m ? mx[l] : m;
    return m;
}

/* Heads per pass of the P.V loop: GS * nv <= 16 accumulators, so each V row is loaded (and widened)
 * once for GS heads. */
#if VEC_AVX2
#include "attention_avx2.h"
#define PV_HEADS(nv) PV_HEADS_AVX2
#else
#define PV_HEADS(nv) ((nv) >= 16 ? 1 : 16 / (nv))
#endif

/* out_g = sum_p w_g[p] v[p] * inv_g for the gn (<= PV_HEADS(nv)) heads whose weights start at w
 * (head g at w + g * wstride) and whose outputs start at out (head g at out + g * head_dim). */
static inline __attribute__((always_inline)) void pv_heads(const char *v_base, const long *offs, int seq,
                                                          const float *w, long wstride, const float *inv,
                                                          int gn, float *out, int head_dim, const int nv,
                                                          const int kvt) {
    const int GS = PV_HEADS(nv);
    const long vec_bytes = 16 * KV_ELEM_BYTES(kvt);
    f32x16 o[16]; /* GS * nv <= 16 */
    for (int i = 0; i < GS * nv; i++) o[i] = splat(0.0f);
    if (gn == 1) {
        /* One head: nv accumulators would chain every FMA on the last; two sets, alternate positions. */
        f32x16 o1[16];
        for (int j = 0; j < nv; j++) o1[j] = splat(0.0f);
        int p = 0;
        for (; p + 1 < seq; p += 2) {
            const char *va = v_base + offs[p], *vb = v_base + offs[p + 1];
            const f32x16 pa = splat(w[p]), pb = splat(w[p + 1]);
            for (int j = 0; j < nv; j++) {
                o[j] += pa * load_kv(va + j * vec_bytes, kvt);
                o1[j] += pb * load_kv(vb + j * vec_bytes, kvt);
            }
        }
        if (p < seq) {
            const char *va = v_base + offs[p];
            const f32x16 pa = splat(w[p]);
            for (int j = 0; j < nv; j++) o[j] += pa * load_kv(va + j * vec_bytes, kvt);
        }
        for (int j = 0; j < nv; j++) store_f32x16(out + 16 * j, (o[j] + o1[j]) * splat(inv[0]));
        return;
    }
    for (int p = 0; p < seq; p++) {
        const char *vr = v_base + offs[p];
        if (p + KV_PF < seq)
            for (long l = 0; l < nv * vec_bytes; l += 64) __builtin_prefetch(v_base + offs[p + KV_PF] + l);
        f32x16 v[16];
        for (int j = 0; j < nv; j++) v[j] = load_kv(vr + j * vec_bytes, kvt);
        for (int g = 0; g < GS; g++) {
            if (g >= gn) break;
            const f32x16 pg = splat(w[g * wstride + p]);
            for (int j = 0; j < nv; j++) o[g * nv + j] += pg * v[j];
        }
    }
    for (int g = 0; g < GS; g++) {
        if (g >= gn) break;
        for (int j = 0; j < nv; j++) store_f32x16(out + (long)g * head_dim + 16 * j, o[g * nv + j] * splat(inv[g]));
    }
}

/* One (query row, KV head) task: every query head of the group. The query row t attends to positions
 * 0 .. seq-1 of its request (block table `table`). `nv` = head_dim / 16 and the cache's element type
 * `kvt` are compile-time constants at each call site, so q and the accumulators stay in registers.
 * row: bytes per token slot. scratch: seq16 offsets (long), then group * seq16 scores. */
static inline __attribute__((always_inline)) void attn_task(
    const float *query, long q_stride, float *out, long out_stride, const char *k_cache, const char *v_cache,
    long row, int block_size, int group, int head_dim, int kvh, long t, int seq, const int32_t *table,
    float scale, char *scratch, const int nv, const int kvt) {
    const long head_off = (long)kvh * head_dim * KV_ELEM_BYTES(kvt);
    const int seq16 = (seq + 15) & ~15;
    long *offs = (long *)scratch;
    float *scores = (float *)(offs + seq16), inv[group];
    slot_offsets(table, block_size, row, seq, offs);
    /* 1. per head: scores = q . k, then softmax numerators (masked lanes give 0) and 1 / their sum */
#if VEC_AVX2
    float mx[group];
    const float *q_row = query + t * q_stride + (long)kvh * group * head_dim;
    for (int g0 = 0; g0 < group; g0 += QK_HEADS_AVX2)
        qk_scores_avx2(q_row + (long)g0 * head_dim, group - g0 < QK_HEADS_AVX2 ? group - g0 : QK_HEADS_AVX2, scale,
                       k_cache + head_off, offs, seq, seq16, scores + (long)g0 * seq16, mx + g0, nv, kvt);
#endif
    for (int g = 0; g < group; g++) {
        float *s = scores + (long)g * seq16;
#if VEC_AVX2
        const float m = mx[g];
#else
        const float *q = query + t * q_stride + (long)(kvh * group + g) * head_dim;
        f32x16 qv[16];
        for (int j = 0; j < nv; j++) qv[j] = load_f32x16(q + 16 * j) * splat(scale);
        const float m = qk_scores(qv, k_cache + head_off, offs, seq, s, nv, kvt);
#endif
        f32x16 sum = splat(0.0f);
        for (int p0 = 0; p0 < seq16; p0 += 16) {
            const f32x16 e = exp16(load_f32x16(s + p0) - splat(m));
            store_f32x16(s + p0, e);
            sum += e;
        }
        inv[g] = 1.0f / hsum16(sum);
    }
    /* 2. out_g = sum_p s_g[p] v[p] / sum_g, PV_HEADS(nv) heads per pass over V */
    float *o = out + t * out_stride + (long)kvh * group * head_dim;
    for (int g0 = 0; g0 < group; g0 += PV_HEADS(nv)) {
        const int gn = group - g0 < PV_HEADS(nv) ? group - g0 : PV_HEADS(nv);
#if VEC_AVX2
        pv_heads_avx2(v_cache + head_off, offs, seq, scores + (long)g0 * seq16, seq16, inv + g0, gn,
                      o + (long)g0 * head_dim, head_dim, nv, kvt);
#else
        pv_heads(v_cache + head_off, offs, seq, scores + (long)g0 * seq16, seq16, inv + g0, gn,
                 o + (long)g0 * head_dim, head_dim, nv, kvt);
#endif
    }
}

/* out[t] for query rows i < n_rows: token row_token[i] of request row_req[i] (its block table row)
 * attends causally to row_seq[i] positions. query (T, num_heads, head_dim) with row stride q_stride;
 * out likewise with out_stride. head_dim must be a multiple of 16 and at most 256. `scratch` holds
 * scratch_per_worker bytes per pool worker, 64-byte aligned: seq16 * 8 (slot offsets) + group * seq16 * 4
 * (scores), seq16 = the longest row_seq rounded up to 16. */
struct attn_ctx {
    const float *query;
    long q_stride;
    float *out;
    long out_stride;
    const char *k_cache, *v_cache;
    long row; /* bytes per token slot */
    int block_size, group, head_dim, num_kv_heads, kv_type;
    const int32_t *block_table;
    long block_table_stride;
    const int64_t *row_token;
    const int32_t *row_req, *row_seq;
    float scale;
    char *scratch;
    long scratch_per_worker;
};

static void attn_chunk(void *arg, long chunk, int worker) {
    const struct attn_ctx *c = arg;
    const long i = chunk / c->num_kv_heads;
    const int kvh = (int)(chunk % c->num_kv_heads);
    char *scratch = c->scratch + (long)worker * c->scratch_per_worker;
#define ATTN_TASK(NV, KVT)                                                                                    \
    attn_task(c->query, c->q_stride, c->out, c->out_stride, c->k_cache, c->v_cache, c->row, c->block_size,    \
              c->group, c->head_dim, kvh, c->row_token[i], c->row_seq[i],                                     \
              c->block_table + (long)c->row_req[i] * c->block_table_stride, c->scale, scratch, NV, KVT)
#define ATTN_NV(KVT)                                                                                          \
    switch (c->head_dim / 16) {                                                                               \
        case 4: ATTN_TASK(4, KVT); break;                                                                     \
        case 8: ATTN_TASK(8, KVT); break;                                                                     \
        default: ATTN_TASK(c->head_dim / 16, KVT); break;                                                     \
    }
    switch (c->kv_type) {
        case KV_F16: ATTN_NV(KV_F16) break;
        case KV_BF16: ATTN_NV(KV_BF16) break;
        default: ATTN_NV(KV_F32) break;
    }
#undef ATTN_NV
#undef ATTN_TASK
}

/* Write this step's K/V (key/value rows t < num_tokens to slot_mapping[t]; see write_kv_cache), then
 * attend: out[t] for the query rows (see attn_ctx). One call per layer. */
void paged_attention_rows(const float *query, long q_stride, const float *key, long key_stride,
                          const float *value, long value_stride, const int64_t *slot_mapping, long num_tokens,
                          float *out, long out_stride, void *kv_cache, int kv_type, long num_slots, int block_size,
                          int num_heads, int num_kv_heads, int head_dim, const int32_t *block_table,
                          long block_table_stride, const int64_t *row_token, const int32_t *row_req,
                          const int32_t *row_seq, long n_rows, float scale, void *scratch, long scratch_per_worker) {
    write_kv_cache(key, key_stride, value, value_stride, kv_cache, num_slots, slot_mapping, num_tokens,
                   (long)num_kv_heads * head_dim, kv_type);
    const long row = (long)num_kv_heads * head_dim * KV_ELEM_BYTES(kv_type); /* bytes per token slot */
    struct attn_ctx c = {query, q_stride, out, out_stride, kv_cache, (const char *)kv_cache + num_slots * row,
                         row, block_size, num_heads / num_kv_heads, head_dim, num_kv_heads, kv_type,
                         block_table, block_table_stride, row_token, row_req, row_seq, scale, scratch,
                         scratch_per_worker};
    pool_run(attn_chunk, &c, n_rows * num_kv_heads);
}
