/* products.h: the decode products on a GGUF file's own blocks, as pieces a caller's OpenMP team runs (the one-call
 * decode, decode.c, and the MoE block, moe.c, share them; ds_linear_blocks is the same product on a team of its
 * own). Block types are GGUF's type ids (quants.h). A product of M rows (M <= DS_MAX_ROWS inside a team) against a
 * tensor [N, K]:
 *   every thread of the team calls blk_prepare (the activations quantized as the type's kind wants them, into
 *   `scratch` of blk_scratch_bytes(M, K); a worksharing loop with its barrier), then blk_tiles for each tensor
 *   (an orphaned worksharing loop over the output rows, no barrier: put one after the last).
 * One prepared scratch serves every tensor of the same kind and K. Which kernel a type takes is products.c's
 * dispatch: the rows of rows_avx2.c, the 512-bit tiles of tiles_avx512.c, an expanded row, or f32 rows for F16/BF16
 * (kernels/routes.py names the same choice). */
#ifndef DS_PRODUCTS_H
#define DS_PRODUCTS_H

#include "ds.h"

#define BLK_KINDS 4  /* blk_kind's kinds are 1 .. BLK_KINDS - 1 */
/* 1: activations int8 per block of 32 (Q8_0, Q4_0, and every other type but the three below: their rows expanded to
 * int8 values with a scale per 16), 2: per block of 256 (Q4_K, Q5_K, Q6_K), 3: F16/BF16 (the f32 rows), 0: none */
int blk_kind(int type);
DS_INTERNAL int blk_values(int type);  /* values per block (1 for F16/BF16): a product's K is a multiple of it */
DS_INTERNAL size_t blk_scratch_bytes(int M, int K);
DS_INTERNAL size_t blk_row_bytes(int type, int K);  /* bytes of a row of K values of `type` (0: a type it does not know) */
DS_INTERNAL void blk_prepare(int kind, const float *x, int M, int K, long ldx, void *scratch);
/* blk_prepare of the rows rows[0..M) of x (row m of the scratch from x + rows[m] ldx; NULL: rows 0..M) */
DS_INTERNAL void blk_prepare_rows(int kind, const float *x, int M, int K, long ldx, const int *rows, void *scratch);
DS_INTERNAL void blk_tiles(int type, const uint8_t *blocks, int N, int K, void *scratch, int M, float *y, long ldy);
/* blk_tiles on rows m_first .. m_first + M of a scratch prepared for Mall rows (y: the first of them's outputs) */
DS_INTERNAL void blk_tiles_rows(int type, const uint8_t *blocks, int N, int K, void *scratch, int Mall, int m_first,
                                int M, float *y, long ldy);

#endif
