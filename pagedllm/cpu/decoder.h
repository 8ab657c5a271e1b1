/* A Llama decoder stack (all layers and the final RMSNorm) for one step of few tokens, in one call.
 *
 * Why: a decode step of a 30-layer model through the nn.Modules is ~300 Python module calls and ~400
 * tensor allocations and views between ~10 C kernels per layer: ~2.5-3 ms of a ~10 ms one-stream step
 * on this project's 2-core CPU (docs/CPU_PROFILE.md), during which the kernel workers idle. Here the
 * same kernels run back to back in C with the pool's helpers hot between them.
 *
 * Same kernels, same arguments, same order as the module path (models/llama.py with the GGUF block
 * GEMM, rms_norm, rotary_embedding, paged_attention_rows, silu_and_mul): results are bit-identical to
 * it. Per layer, T rows, H hidden, Q = heads * head_dim, V = kv_heads * head_dim, I intermediate:
 *
 *   normed, residual = rms_norm(hidden [+ residual])          layer 0: residual = hidden (the embeddings)
 *   qkv (T, Q + 2V)  = normed @ Wqkv^T
 *   q (T, Q), k (T, V) = rope(qkv[:, :Q], qkv[:, Q:Q+V]);  v = qkv[:, Q+V:]
 *   attn (T, Q)      = paged_attention_rows(q, k, v)          (writes k, v to the cache first)
 *   hidden (T, H)    = attn @ Wo^T
 *   normed, residual = rms_norm(hidden + residual)
 *   hidden           = silu_and_mul(normed @ Wgate_up^T) @ Wdown^T
 *   out              = rms_norm(hidden + residual) with the final norm's weight
 *
 * The descriptors are int64 arrays built once by cpu/decoder.py (pointers as integers); see the enums.
 */
#pragma once

#include "attention.h"
#include "gguf_gemm.h"
#include "rows.h"

/* Model constants (int64 each). */
enum {
    DM_HIDDEN, DM_Q, DM_KV, DM_INTER, DM_HEADS, DM_KV_HEADS, DM_HEAD_DIM, DM_ROT_DIM, DM_NEOX, DM_BLOCK_SIZE,
    DM_NUM_SLOTS, DM_KV_TYPE, DM_COS_SIN, DM_FINAL_NORM, DM_COUNT
};
/* Per layer (int64 each): norm weights, GEMM weights with their tile kind (4 or 8), the layer's cache. */
enum {
    DL_LN1, DL_QKV, DL_QKV_KIND, DL_O, DL_O_KIND, DL_LN2, DL_GU, DL_GU_KIND, DL_DOWN, DL_DOWN_KIND, DL_KV_CACHE,
    DL_COUNT
};
/* Per step (int64 each): rows, inputs, the attention's row tables (cpu/attention.py's _StepRows), buffers. */
enum {
    DS_T, DS_POSITIONS, DS_SLOT_MAPPING, DS_BLOCK_TABLE, DS_BT_STRIDE, DS_ROW_TOKEN, DS_ROW_REQ, DS_ROW_SEQ,
    DS_N_ROWS, DS_ATTN_SCRATCH, DS_ATTN_SCRATCH_PER_WORKER, DS_EMBEDDINGS, DS_OUT, DS_WORK, DS_COUNT
};

/* Floats of the work buffer for T rows: normed, residual, hidden (H each), qkv (Q + 2V), q (Q), k (V),
 * attn (Q), gate_up (2I), act (I). */
static inline long decoder_work_floats(const int64_t *m, long T) {
    return T * (3 * m[DM_HIDDEN] + 2 * m[DM_Q] + 2 * m[DM_KV] + m[DM_Q] + m[DM_KV] + 3 * m[DM_INTER]);
}

#define DPTR(type, v) ((type)(intptr_t)(v))

/* Returns 1, or 0 when a GEMM could not allocate its regrouping buffer (nothing valid in out then). */
int llama_decoder_stack(const int64_t *m, const int64_t *layers, long n_layers, const int64_t *s, float eps,
                        float scale) {
    const long T = s[DS_T], H = m[DM_HIDDEN], Q = m[DM_Q], V = m[DM_KV], I = m[DM_INTER];
    const long QKV = Q + 2 * V;
    float *w = DPTR(float *, s[DS_WORK]);
    float *normed = w, *residual = normed + T * H, *hidden = residual + T * H, *qkv = hidden + T * H;
    float *q = qkv + T * QKV, *k = q + T * Q, *attn = k + T * V, *gu = attn + T * Q, *act = gu + T * 2 * I;
    const float *emb = DPTR(const float *, s[DS_EMBEDDINGS]);
    const int64_t *positions = DPTR(const int64_t *, s[DS_POSITIONS]);
    const float *cos_sin = DPTR(const float *, m[DM_COS_SIN]);
    for (long l = 0; l < n_layers; l++) {
        const int64_t *L = layers + l * DL_COUNT;
        if (l == 0) {
            memcpy(residual, emb, sizeof(float) * T * H);
            rms_norm(emb, H, NULL, 0, NULL, DPTR(const float *, L[DL_LN1]), normed, T, H, eps);
        } else {
            rms_norm(hidden, H, residual, H, residual, DPTR(const float *, L[DL_LN1]), normed, T, H, eps);
        }
        if (!gguf_gemm((int)L[DL_QKV_KIND], normed, H, DPTR(const uint8_t *, L[DL_QKV]), qkv, QKV, T, QKV, H))
            return 0;
        rotary_embedding(positions, qkv, QKV, qkv + Q, QKV, q, k, T, m[DM_HEADS], m[DM_KV_HEADS], m[DM_HEAD_DIM],
                         m[DM_ROT_DIM], cos_sin, (int)m[DM_NEOX]);
        paged_attention_rows(q, Q, k, V, qkv + Q + V, QKV, DPTR(const int64_t *, s[DS_SLOT_MAPPING]), T, attn, Q,
                             DPTR(void *, L[DL_KV_CACHE]), (int)m[DM_KV_TYPE], m[DM_NUM_SLOTS],
                             (int)m[DM_BLOCK_SIZE], (int)m[DM_HEADS], (int)m[DM_KV_HEADS], (int)m[DM_HEAD_DIM],
                             DPTR(const int32_t *, s[DS_BLOCK_TABLE]), s[DS_BT_STRIDE],
                             DPTR(const int64_t *, s[DS_ROW_TOKEN]), DPTR(const int32_t *, s[DS_ROW_REQ]),
                             DPTR(const int32_t *, s[DS_ROW_SEQ]), s[DS_N_ROWS], scale,
                             DPTR(void *, s[DS_ATTN_SCRATCH]), s[DS_ATTN_SCRATCH_PER_WORKER]);
        if (!gguf_gemm((int)L[DL_O_KIND], attn, Q, DPTR(const uint8_t *, L[DL_O]), hidden, H, T, H, Q)) return 0;
        rms_norm(hidden, H, residual, H, residual, DPTR(const float *, L[DL_LN2]), normed, T, H, eps);
        if (!gguf_gemm((int)L[DL_GU_KIND], normed, H, DPTR(const uint8_t *, L[DL_GU]), gu, 2 * I, T, 2 * I, H))
            return 0;
        silu_and_mul(gu, 2 * I, act, T, I);
        if (!gguf_gemm((int)L[DL_DOWN_KIND], act, I, DPTR(const uint8_t *, L[DL_DOWN]), hidden, H, T, H, I))
            return 0;
    }
    rms_norm(hidden, H, residual, H, residual, DPTR(const float *, m[DM_FINAL_NORM]), DPTR(float *, s[DS_OUT]), T,
             H, eps);
    return 1;
}

#undef DPTR
