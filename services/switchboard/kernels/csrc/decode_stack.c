/* A Llama-family decode step's decoder layers in one call: per layer RMSNorm, the QKV matmul,
   the rotary embedding, the KV-cache write, paged decode attention, the output matmul and
   residual add, RMSNorm, gate/up, SiLU-and-mul, down and residual add. It calls the same
   functions the layers call one by one, in the same order on the same floats, so the hidden
   states are bit-identical to the layer-by-layer path. A step with rows of LoRA adapters adds
   their deltas after each of the four matmuls (lora_delta.c), as the projections' hooks do on
   the layer-by-layer path. A step whose every row is sampled may end with the model's final
   norm and LM head too (the logits), as the model's own calls would compute them. */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

/* Per layer, the addresses (as integers, 0 = none) of the norms, matmul panels and biases and
   the KV cache, the sliding window, and per matmul its panels' kind: 0 float32
   (small_batch_gemm.c), BF16_PANELS bfloat16 (bf16_gemm.c), DOT_PANELS + B (DOT4_PANELS + B:
   4-bit values) quantized for integer dot products in blocks of B inputs (quant_dot.c), else quantized in blocks of that
   many inputs (quant_gemm.c). B carries the dot product panels' layout flags (kernels.h). */
#define BF16_PANELS (-1)
#define DOT_PANELS 1024
#define DOT4_PANELS 2048
enum {
    LN1, QKV, QKV_BIAS, O, O_BIAS, LN2, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, KV, WINDOW,
    QKV_BLOCK, O_BLOCK, GATE_UP_BLOCK, DOWN_BLOCK, LAYER_FIELDS
};

/* The final norm and LM head: the norm's weights, the head's kind of panels (as a layer's
   matmuls) and their address, and its output features (the logits' columns). */
enum { HEAD_NORM, HEAD_KIND, HEAD_PANELS, HEAD_COLUMNS, HEAD_FIELDS };

/* With LoRA rows, per layer the addresses of the A and B (lora_delta.c) of each matmul. */
enum { QKV_A, QKV_B, O_A, O_B, GATE_UP_A, GATE_UP_B, DOWN_A, DOWN_B, LORA_FIELDS };

static int stack_linear(int64_t block, const float *x, int64_t ldx, const void *p,
                        const float *bias, float *y, int64_t M, int64_t K, int64_t N) {
    if (block == BF16_PANELS) return bf16_linear(x, ldx, p, bias, y, M, K, N);
    if (block > DOT4_PANELS)
        return quant_dot4_linear(x, ldx, p, bias, y, M, K, N, block - DOT4_PANELS);
    if (block > DOT_PANELS)
        return quant_dot_linear(x, ldx, p, bias, y, M, K, N, block - DOT_PANELS);
    if (block) return quant_linear(x, ldx, p, bias, y, M, K, N, block);
    return small_batch_linear(x, ldx, p, bias, y, M, K, N);
}

/* x [M, H]: the hidden states in, the last layer's out (float32 whatever the weights). The
   KV caches hold float32, or bfloat16 where kv_bf16 (written rounded, read widened). With
   logits (not NULL): x out normed by the head's norm (eps head_eps) and logits [M, columns] its
   product with the head (head: HEAD_FIELDS). Returns 0; -1 out of memory; -2 a slot outside
   the KV cache; -3 / -4 lora_delta_f32's refusals. */
int decode_stack_f32(float *x, int64_t M, int64_t layers, const int64_t *fields, int64_t H,
                     int64_t nH, int64_t nKV, int64_t D, int64_t I, float eps, float scale,
                     const float *cos_half, const float *sin_half, const int64_t *slots,
                     const int64_t *block_table, const int64_t *context_lens, int64_t MB,
                     int64_t NB, int64_t BS, int64_t kv_bf16, const int64_t *lora_fields,
                     const int64_t *row_slot, int64_t lora_slots, const int64_t *slot_rank,
                     int64_t max_rank, const int64_t *head, float head_eps, float *logits) {
    const int64_t qkv_n = (nH + 2 * nKV) * D, attn_n = nH * D;
    /* scratch kept from call to call (one worker per process calls this, from one thread):
       a new allocation of this size each step would be fresh pages, faulted in every time */
    static float *buffer = NULL;
    static size_t capacity = 0;
    const size_t needed = (size_t)(M * (H + qkv_n + attn_n + H + 3 * I));
    if (needed > capacity) {
        free(buffer);
        buffer = malloc(sizeof(float) * needed);
        capacity = buffer == NULL ? 0 : needed;
        if (buffer == NULL) return -1;
    }
    float *h = buffer, *qkv = h + M * H, *attn = qkv + M * qkv_n, *tmp = attn + M * attn_n;
    float *gate_up = tmp + M * H, *act = gate_up + M * 2 * I;
    int code = 0;
    /* each LoRA part's output columns: q, k, v; the whole output; gate, up; the whole output */
    const int64_t qkv_cols[] = {0, nH * D, (nH + nKV) * D, qkv_n}, hidden_cols[] = {0, H};
    const int64_t gate_up_cols[] = {0, I, 2 * I};
    for (int64_t l = 0; l < layers && code == 0; l++) {
        const int64_t *f = fields + l * LAYER_FIELDS;
        const int64_t *lf = lora_fields ? lora_fields + l * LORA_FIELDS : NULL;
/* y [M, N] += the LoRA rows' delta of the matmul x [M, K] -> y (parts: see lora_delta.c) */
#define LORA_DELTA(which, x, y, K, N, parts, cols)                                             \
    (lf ? lora_delta_f32(x, K, y, N, M, K, N, (const float *)(intptr_t)lf[which##_A],          \
                         (const float *)(intptr_t)lf[which##_B], row_slot, lora_slots,          \
                         slot_rank, max_rank, parts, cols)                                      \
        : 0)
#define PTR(i) ((float *)(intptr_t)f[i])
        void *kv = (void *)(intptr_t)f[KV];
        rms_norm_f32(x, H, PTR(LN1), h, M, H, eps);
        code = stack_linear(f[QKV_BLOCK], h, H, PTR(QKV), PTR(QKV_BIAS), qkv, M, H, qkv_n);
        if (code != 0) break;
        code = LORA_DELTA(QKV, h, qkv, H, qkv_n, 3, qkv_cols);
        if (code != 0) break;
        rotary_f32(qkv, qkv_n, M, nH, D, cos_half, sin_half);
        rotary_f32(qkv + nH * D, qkv_n, M, nKV, D, cos_half, sin_half);
        const float *k_new = qkv + nH * D, *v_new = qkv + (nH + nKV) * D;
        const int64_t half = NB * BS * nKV * D; /* the values' offset in the cache */
        const int written =
            kv_bf16 ? write_kv_bf16(k_new, qkv_n, v_new, qkv_n, slots, M, nKV * D, kv,
                                    (uint16_t *)kv + half, NB * BS)
                    : write_kv_f32(k_new, qkv_n, v_new, qkv_n, slots, M, nKV * D, kv,
                                   (float *)kv + half, NB * BS);
        if (written != 0) {
            code = -2;
            break;
        }
        code = kv_bf16 ? paged_decode_bf16kv(qkv, qkv_n, kv, block_table, context_lens, attn, M,
                                             nH, nKV, D, NB, BS, MB, scale, f[WINDOW])
                       : paged_decode_f32(qkv, qkv_n, kv, block_table, context_lens, attn, M, nH,
                                          nKV, D, NB, BS, MB, scale, f[WINDOW]);
        if (code != 0) break;
        code = stack_linear(f[O_BLOCK], attn, attn_n, PTR(O), PTR(O_BIAS), tmp, M, attn_n, H);
        if (code != 0) break;
        code = LORA_DELTA(O, attn, tmp, attn_n, H, 1, hidden_cols);
        if (code != 0) break;
        for (int64_t i = 0; i < M * H; i++) x[i] = x[i] + tmp[i];
        rms_norm_f32(x, H, PTR(LN2), h, M, H, eps);
        code = stack_linear(f[GATE_UP_BLOCK], h, H, PTR(GATE_UP), PTR(GATE_UP_BIAS), gate_up, M, H,
                            2 * I);
        if (code != 0) break;
        code = LORA_DELTA(GATE_UP, h, gate_up, H, 2 * I, 2, gate_up_cols);
        if (code != 0) break;
        silu_and_mul_f32(gate_up, 2 * I, act, M, I);
        code = stack_linear(f[DOWN_BLOCK], act, I, PTR(DOWN), PTR(DOWN_BIAS), tmp, M, I, H);
        if (code != 0) break;
        code = LORA_DELTA(DOWN, act, tmp, I, H, 1, hidden_cols);
        if (code != 0) break;
        for (int64_t i = 0; i < M * H; i++) x[i] = x[i] + tmp[i];
#undef PTR
#undef LORA_DELTA
    }
    if (code == 0 && logits != NULL) {
        /* in place: each row's sum of squares is taken before any of it is written */
        rms_norm_f32(x, H, (const float *)(intptr_t)head[HEAD_NORM], x, M, H, head_eps);
        code = stack_linear(head[HEAD_KIND], x, H, (const void *)(intptr_t)head[HEAD_PANELS],
                            NULL, logits, M, H, head[HEAD_COLUMNS]);
    }
    return code;
}
