/* blocks.h: blocks.c's products on a GGUF file's own blocks, as pieces a caller's OpenMP team runs (the one-call
 * decode of native_avx2.c shares them). Block types are GGUF's type ids: F16 1, Q4_0 2, Q8_0 8, Q4_K 12, Q5_K 13,
 * Q6_K 14, BF16 30. A product of M rows (M <= DS_MAX_ROWS inside a team) against a tensor [N, K]:
 *   every thread of the team calls blk_prepare (the activations quantized as the type's kind wants them, into
 *   `scratch` of blk_scratch_bytes(M, K); a worksharing loop with its barrier), then blk_tiles for each tensor
 *   (an orphaned worksharing loop over the output rows, no barrier: put one after the last).
 * One prepared scratch serves every tensor of the same kind and K. */
#ifndef DS_BLOCKS_H
#define DS_BLOCKS_H
#include <stddef.h>
#include <stdint.h>
#include <immintrin.h>

/* the sum of a vector's 8 floats (blocks.c and native_avx2.c, both compiled only with AVX2) */
static inline float blk_hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

#define BLK_KINDS 4  /* blk_kind's kinds are 1 .. BLK_KINDS - 1 */
/* 1: activations int8 per block of 32 (Q8_0, Q4_0, and every other type but the three below: their rows expanded to
 * int8 values with a scale per 16), 2: per block of 256 (Q4_K, Q5_K, Q6_K), 3: F16/BF16 (the f32 rows), 0: none */
int blk_kind(int type);
int blk_values(int type);  /* values per block (1 for F16/BF16): a product's K is a multiple of it */
size_t blk_scratch_bytes(int M, int K);
size_t blk_row_bytes(int type, int K);  /* bytes of one row of K values of `type` (0 for a type it does not know) */
void blk_prepare(int kind, const float *x, int M, int K, long ldx, void *scratch);
/* blk_prepare of the rows rows[0..M) of x (row m of the scratch from x + rows[m] ldx; NULL: rows 0..M) */
void blk_prepare_rows(int kind, const float *x, int M, int K, long ldx, const int *rows, void *scratch);
void blk_tiles(int type, const uint8_t *blocks, int N, int K, void *scratch, int M, float *y, long ldy);
/* blk_tiles on rows m_first .. m_first + M of a scratch prepared for Mall rows (y: the first of them's outputs) */
void blk_tiles_rows(int type, const uint8_t *blocks, int N, int K, void *scratch, int Mall, int m_first, int M, float *y,
                    long ldy);

/* blocks.c's GEMM on Q8_0 and K-quant blocks: its own OpenMP team, any M (see blocks.c). AVX512-VNNI builds take
 * every type gemm_mode names; AVX2 ones those whose packed values stay below 64 (blk_gemm_type: Q4_K, Q5_K, Q6_K,
 * Q4_1, Q5_1, Q2_K; ds_gemm_blocks returns -1 for the others) */
#if defined(__AVX2__)
#define BLK_GEMM 1
int ds_gemm_blocks(int type, const float *x, int M, int K, long ldx, const uint8_t *blocks, int N, float *y, long ldy,
                   int nthreads);
/* its pieces for a caller's team: the rows of x (rows[m] where given) prepared once into act (blk_gemm_act_bytes;
 * a worksharing loop with its barrier), then panel p (rows 32p ..) of a tensor times the prepared rows m_first ..
 * m_first + M, each panel a work item (work: blk_gemm_work_bytes(K), one per thread) */
int blk_gemm_type(int type);
size_t blk_gemm_act_bytes(int M, int K);
size_t blk_gemm_work_bytes(int K);
void blk_gemm_prepare(int type, const float *x, int M, int K, long ldx, const int *rows, void *act);
void blk_gemm_panel(int type, const uint8_t *blocks, int N, int K, int p, const void *act, int Mall, int m_first, int M,
                    float *y, long ldy, void *work, const uint8_t *next, size_t next_bytes);
/* blk_gemm_panel's `next`: the bytes its thread multiplies next (NULL: unknown), fetched into the cache while this
 * panel's tiles run (the panels' first touch of the mapped file was a third of a Q4_K_M expert's product) */
size_t blk_gemm_panel_bytes(int type, int N, int K, int p);
int blk_gemm_panels(int N);  /* the panels of a tensor of N rows */
const uint8_t *blk_gemm_panel_at(int type, const uint8_t *blocks, int K, int p);
#endif

#endif
