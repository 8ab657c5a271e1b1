/* Paged attention for decode rows (one query token per request), reading K/V through the block table,
 * and the KV-cache write of a step's new tokens.
 *
 * kv_cache: float (2, num_blocks, block_size, num_kv_heads, head_dim), contiguous. Query head h reads
 * KV head h / (num_heads / num_kv_heads) (grouped-query attention). Softmax in two passes over the
 * request's scores (max, then exp and sum), float32 throughout.
 */
#pragma once

#include "pool.h"
#include "vec.h"

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
 * head_dim must be a multiple of 16 and at most 256. `scratch` holds scratch_per_worker floats per
 * pool worker (at least the longest seq_len rounded up to 16). */
struct attn_ctx {
    const float *query;
    long q_stride;
    float *out;
    long out_stride;
    const float *k_cache, *v_cache;
    long row;
    int block_size, group, head_dim, num_kv_heads;
    const int32_t *block_table;
    long block_table_stride;
    const int32_t *seq_lens, *query_start_loc;
    const int64_t *reqs;
    float scale;
    float *scratch;
    long scratch_per_worker;
};

static void attn_chunk(void *arg, long chunk, int worker) {
    const struct attn_ctx *c = arg;
    const long r = c->reqs[chunk / c->num_kv_heads];
    const int kvh = (int)(chunk % c->num_kv_heads);
    float *scores = c->scratch + (long)worker * c->scratch_per_worker;
#define ATTN_TASK(NV)                                                                                         \
    attn_task(c->query, c->q_stride, c->out, c->out_stride, c->k_cache, c->v_cache, c->row, c->block_size,    \
              c->group, c->head_dim, kvh, c->query_start_loc[r], c->seq_lens[r],                             \
              c->block_table + r * c->block_table_stride, c->scale, scores, NV)
    switch (c->head_dim / 16) {
        case 4: ATTN_TASK(4); break;
        case 8: ATTN_TASK(8); break;
        default: ATTN_TASK(c->head_dim / 16); break;
    }
#undef ATTN_TASK
}

void paged_decode_attention(const float *query, long q_stride, float *out, long out_stride,
                            const float *kv_cache, long num_slots, int block_size, int num_heads,
                            int num_kv_heads, int head_dim, const int32_t *block_table,
                            long block_table_stride, const int32_t *seq_lens,
                            const int32_t *query_start_loc, const int64_t *reqs, long n_reqs,
                            float scale, float *scratch, long scratch_per_worker) {
    const long row = (long)num_kv_heads * head_dim; /* floats per token slot */
    struct attn_ctx c = {query, q_stride, out, out_stride, kv_cache, kv_cache + num_slots * row, row,
                         block_size, num_heads / num_kv_heads, head_dim, num_kv_heads, block_table,
                         block_table_stride, seq_lens, query_start_loc, reqs, scale, scratch,
                         scratch_per_worker};
    pool_run(attn_chunk, &c, n_reqs * num_kv_heads);
}
