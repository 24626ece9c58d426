/* decode.h: the one-call decode's products (decode.c): a stacked linear (native.h's lin_t) times a few rows on the
 * team, each segment on the kernel its type says (products.h's for the file's blocks, tables.h's for int8 tables,
 * f32_tiles for F32 rows), or the GEMM (gemm.h) from routes.decode_gemm_rows() rows. moe.c runs its products
 * through these too. */
#ifndef DS_DECODE_H
#define DS_DECODE_H

#include "ds.h"
#include "native.h"
#include "products.h"

#ifdef DS_AVX2
#define TAB0 (BLK_KINDS - 1)  /* tables.h's kind k (1, 2) is kind TAB0 + k here, after blk_kind's */
#define NKIND (TAB0 + 3)      /* 0: F32 rows, no preparation */


static inline int lin_rows(const lin_t *L) {
    int n = 0;
    for (int s = 0; s < L->nseg; s++) n += L->seg[s].rows;
    return n;
}
/* whether every segment of a stacked linear is taken here (its type, its inner size) */
DS_INTERNAL int lin_ok(const lin_t *L);
/* F32 rows [N, K] against M activation rows (stride K): an orphaned worksharing loop, no barrier */
DS_INTERNAL void f32_tiles(const float *W, int N, int K, const float *x, int M, float *y, long ldy);
/* y [M, N] = x [M, K] W^T for a stacked linear (rows of x and y contiguous); called by every thread of the team
 * (the rows are shared among them); ends on a barrier. scratch[kind]: enough for M rows of K of each kind */
DS_INTERNAL void team_product(const lin_t *L, const float *x, int M, float *y, void *const *scratch);
#endif

#endif
