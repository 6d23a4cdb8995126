/* Every kernel the library exports, as kernels/library.py declares them to ctypes (one table
   there mirrors this file). float32 but where a name or comment says bfloat16 (uint16_t bit
   patterns); "ld" arguments are row strides in elements. */
#ifndef SWITCHBOARD_KERNELS_H
#define SWITCHBOARD_KERNELS_H
#include <stdint.h>

/* paged_decode.c: decode attention over the paged KV cache, read in place */
int paged_decode_f32(const float *query, int64_t ldq, const float *kv, const int64_t *block_table,
                     const int64_t *context_lens, float *out, int64_t B, int64_t H, int64_t KVH,
                     int64_t D, int64_t NB, int64_t BS, int64_t MB, float scale, int64_t window);
/* the same over a bfloat16 cache (float32 query and output) */
int paged_decode_bf16kv(const float *query, int64_t ldq, const uint16_t *kv,
                        const int64_t *block_table, const int64_t *context_lens, float *out,
                        int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t NB, int64_t BS,
                        int64_t MB, float scale, int64_t window);

/* fused_ops.c: a layer's small operations */
void rms_norm_f32(const float *x, int64_t ldx, const float *weight, float *out, int64_t rows,
                  int64_t H, float eps);
void rotary_f32(float *x, int64_t ldx, int64_t tokens, int64_t heads, int64_t D,
                const float *cos_half, const float *sin_half);
void silu_and_mul_f32(const float *x, int64_t ldx, float *out, int64_t rows, int64_t I);
int write_kv_f32(const float *key, int64_t ldk, const float *value, int64_t ldv,
                 const int64_t *slots, int64_t tokens, int64_t row, float *cache_k,
                 float *cache_v, int64_t num_slots);
void argmax_rows_f32(const float *x, int64_t ldx, int64_t rows, int64_t V, int64_t *out);

/* fused_ops_bf16.c: the same on bfloat16 tensors (bit patterns as uint16_t), and the KV-cache
   write from float32 into a bfloat16 cache */
void rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *weight, uint16_t *out,
                   int64_t rows, int64_t H, float eps);
void rotary_bf16(uint16_t *x, int64_t ldx, int64_t tokens, int64_t heads, int64_t D,
                 const uint16_t *cos_half, const uint16_t *sin_half);
void silu_and_mul_bf16(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t rows, int64_t I);
void bf16_rows_to_f32(const uint16_t *x, int64_t ldx, float *out, int64_t rows, int64_t cols);
void f32_rows_to_bf16(const float *x, int64_t ldx, uint16_t *out, int64_t rows, int64_t cols);
void add_f32(const float *a, int64_t lda, const float *b, int64_t ldb, float *out, int64_t rows,
             int64_t cols);
void add_bf16(const uint16_t *a, int64_t lda, const uint16_t *b, int64_t ldb, uint16_t *out,
              int64_t rows, int64_t cols);
int write_kv_bf16(const float *key, int64_t ldk, const float *value, int64_t ldv,
                  const int64_t *slots, int64_t tokens, int64_t row, uint16_t *cache_k,
                  uint16_t *cache_v, int64_t num_slots);

/* small_batch_gemm.c: matmuls of a few rows (0 rows at a time: built without AVX2 and FMA) */
int small_batch_max_rows(void);
void small_batch_pack(const float *w, float *p, int64_t N, int64_t K);
int small_batch_linear(const float *x, int64_t ldx, const float *p, const float *bias, float *y,
                       int64_t M, int64_t K, int64_t N);

/* quant_gemm.c: matmuls of a few rows on int8 weights with per-block scales and offsets (0 rows
   at a time: built without AVX2 and FMA) */
int quant_gemm_max_rows(void);
void quant_pack(const int8_t *q, const float *scale, const float *offset, uint8_t *p, int64_t N,
                int64_t K, int64_t B);
int quant_linear(const float *x, int64_t ldx, const uint8_t *p, const float *bias, float *y,
                 int64_t M, int64_t K, int64_t N, int64_t B);

/* quant_dot.c: the same with integer dot products, the rows quantized to int8 per block
   (variants: bit 1 AVX2, 2 AVX-512 VNNI; 0 rows at a time: none selected). A block size B with
   QUANT_HALF_SCALES set: the panels' scales and offsets are float16; with QUANT_NO_OFFSETS:
   they hold no offsets (all zero). The packs return how many factors that layout does not hold
   exactly: such panels must not be used. */
#define QUANT_HALF_SCALES 256
#define QUANT_NO_OFFSETS 512
int quant_dot_variants(void);
int quant_dot_select(int variant);
int quant_dot_max_rows(void);
int64_t quant_dot_pack(const int8_t *q, const float *scale, const float *offset, uint8_t *p,
                       int64_t N, int64_t K, int64_t B);
int quant_dot_linear(const float *x, int64_t ldx, const uint8_t *p, const float *bias, float *y,
                     int64_t M, int64_t K, int64_t N, int64_t B);
/* the same with the values as 4 bits (weights whose q span at most 16 values) */
int64_t quant_dot4_pack(const int8_t *q, const float *scale, const float *offset, uint8_t *p,
                        int64_t N, int64_t K, int64_t B, int64_t qmin);
int quant_dot4_linear(const float *x, int64_t ldx, const uint8_t *p, const float *bias,
                      float *y, int64_t M, int64_t K, int64_t N, int64_t B);

/* bf16_gemm.c: matmuls of a few rows on bfloat16 weights (variants: bit 1 AVX2, 2 AVX-512,
   3 AVX-512 BF16, 4 AMX; 0 rows at a time: none selected) */
int bf16_gemm_variants(void);
int bf16_gemm_select(int variant);
int bf16_gemm_max_rows(void);
void bf16_pack(const uint16_t *w, uint32_t *p, int64_t N, int64_t K);
int bf16_linear(const float *x, int64_t ldx, const uint32_t *p, const float *bias, float *y,
                int64_t M, int64_t K, int64_t N);
/* bf16_amx.c: bf16_gemm.c's AMX variant (ready: compiled, and Linux granted the tiles) */
int bf16_amx_ready(void);
void bf16_amx_linear(const uint32_t *xp, const uint32_t *p, const float *bias, float *y,
                     int64_t M, int64_t KP, int64_t N);

/* lora_delta.c: y[r] += (x[r] A_s^T) B_s for each row r of a slot s = row_slot[r] != -1 (A
   [slots, parts * max_rank, K], B [slots, parts * max_rank, N]; part p writes the columns
   [cols[p], cols[p + 1]) only). 0; -1 out of memory; -3 a slot out of range; -4 max_rank above
   LORA_MAX_RANK. */
#define LORA_MAX_RANK 512
int lora_delta_f32(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t M, int64_t K,
                   int64_t N, const float *a, const float *b, const int64_t *row_slot,
                   int64_t slots, const int64_t *slot_rank, int64_t max_rank, int64_t parts,
                   const int64_t *cols);

/* decode_stack.c: a decode step's decoder layers in one call; with LoRA rows where lora_fields
   is not NULL ([layers, 8]: the A and B of qkv, o, gate_up and down, for lora_delta_f32); then
   the final norm and the logits where logits is not NULL (head: [4], see decode_stack.c) */
int decode_stack_f32(float *x, int64_t M, int64_t layers, const int64_t *fields, int64_t H,
                     int64_t nH, int64_t nKV, int64_t D, int64_t I, float eps, float scale,
                     const float *cos_half, const float *sin_half, const int64_t *slots,
                     const int64_t *block_table, const int64_t *context_lens, int64_t MB,
                     int64_t NB, int64_t BS, int64_t kv_bf16, const int64_t *lora_fields,
                     const int64_t *row_slot, int64_t lora_slots, const int64_t *slot_rank,
                     int64_t max_rank, const int64_t *head, float head_eps, float *logits);
#endif
