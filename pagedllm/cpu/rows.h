/* Row-wise kernels: RMSNorm (with the residual add fused), rotary embedding, silu * mul, argmax.
 *
 * One thread, but for argmax over the pool: a decode step has a few rows, and a prefill spends its
 * time in the matmuls.
 */
#pragma once

#include "pool.h"
#include "vec.h"

/* out[t] = (s * (1 / sqrt(mean(s^2) + eps))) * weight with s = x[t] (+ residual[t], also stored to
 * residual_out[t]). The two products round separately, as the torch reference does; only the order
 * of the mean's sum differs from torch's reduction. */
void rms_norm(const float *x, long x_stride, const float *residual, long res_stride, float *residual_out,
              const float *weight, float *out, long num_tokens, long hidden, float eps) {
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
                      long head_size, long rotary_dim, const float *cos_sin_cache, int neox) {
    for (long t = 0; t < num_tokens; t++) {
        const float *cs = cos_sin_cache + positions[t] * rotary_dim;
        rope_rows(q + t * q_stride, q_stride, q_out + t * num_q_heads * head_size, num_q_heads, head_size,
                  rotary_dim, cs, neox);
        rope_rows(k + t * k_stride, k_stride, k_out + t * num_k_heads * head_size, num_k_heads, head_size,
                  rotary_dim, cs, neox);
    }
}
#pragma GCC pop_options

/* out (T, d) = silu(x[:, :d]) * x[:, d:] with silu(g) = g / (1 + exp(-g)) (exp16: within 2 ulp of expf). */
void silu_and_mul(const float *x, long x_stride, float *out, long num_tokens, long d) {
    for (long t = 0; t < num_tokens; t++) {
        const float *g = x + t * x_stride, *u = g + d;
        float *o = out + t * d;
        long i = 0;
        for (; i + 16 <= d; i += 16) {
            const f32x16 gv = load_f32x16(g + i);
            store_f32x16(o + i, gv / (splat(1.0f) + exp16(-gv)) * load_f32x16(u + i));
        }
        for (; i < d; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* out[r] = index of the first largest value of row r (x: rows x n, row stride ld); a NaN counts as the
 * largest, as torch.argmax does. Rows are spread over the pool (16 rows of a 49k vocabulary: 3 MB). */
static long argmax_row(const float *row, long n) {
    f32x16 best = splat(-INFINITY);
    long i = 0;
    int has_nan = 0;
    for (; i + 16 <= n; i += 16) {
        const f32x16 v = load_f32x16(row + i);
        has_nan |= !!hsum16((f32x16)(vselect(v != v, splat(1.0f), splat(0.0f))));
        best = vmax(v, best);
    }
    float m = -INFINITY;
    for (int l = 0; l < 16; l++) m = best[l] > m ? best[l] : m;
    for (long j = i; j < n; j++) {
        if (row[j] != row[j]) has_nan = 1;
        if (row[j] > m) m = row[j];
    }
    long idx = 0;
    if (has_nan) {
        while (row[idx] == row[idx]) idx++;
    } else {
        while (idx < n - 1 && row[idx] != m) idx++;
    }
    return idx;
}

struct argmax_ctx {
    const float *x;
    long ld, n;
    int64_t *out;
};

static void argmax_chunk(void *arg, long r, int worker) {
    const struct argmax_ctx *c = arg;
    (void)worker;
    c->out[r] = argmax_row(c->x + r * c->ld, c->n);
}

void argmax_rows(const float *x, long ld, long rows, long n, int64_t *out) {
    struct argmax_ctx c = {x, ld, n, out};
    pool_run(argmax_chunk, &c, rows);
}
