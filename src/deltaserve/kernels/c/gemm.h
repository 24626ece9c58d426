/* gemm.h: the GEMM on a file's own blocks (gemm.c): many activation rows (a prefill's, an MoE expert's, a decode
 * call's from routes.decode_gemm_rows()) times the blocks, on panels of 32 weight rows packed once per product
 * (gemm_pack.c) and tiles of GT tokens (gemm_avx512.c with AVX512-VNNI, gemm_avx2.c without). AVX512-VNNI builds take
 * every type gemm_mode names; AVX2 ones at full speed those whose packed values stay below 64 (ds_gemm_type 1: Q4_K,
 * Q5_K, Q6_K, Q4_1, Q5_1, Q2_K), the others' nibbles apart (ds_gemm_type 2). */
#ifndef DS_GEMM_H
#define DS_GEMM_H

#include "ds.h"

#ifdef DS_AVX2
#define BLK_GEMM 1
int ds_gemm_blocks(int type, const float *x, int M, int K, long ldx, const uint8_t *blocks, int N, float *y, long ldy,
                   int nthreads);
/* its pieces for a caller's team: the rows of x (rows[m] where given) prepared once into act (blk_gemm_act_bytes;
 * a worksharing loop with its barrier), then panel p (rows 32p ..) of a tensor times the prepared rows m_first ..
 * m_first + M, each panel a work item (work: blk_gemm_work_bytes(K), one per thread) */
DS_INTERNAL int blk_gemm_type(int type);
DS_INTERNAL size_t blk_gemm_act_bytes(int M, int K);
DS_INTERNAL size_t blk_gemm_work_bytes(int K);
DS_INTERNAL void blk_gemm_prepare(int type, const float *x, int M, int K, long ldx, const int *rows, void *act);
DS_INTERNAL void blk_gemm_panel(int type, const uint8_t *blocks, int N, int K, int p, const void *act, int Mall,
                                int m_first, int M, float *y, long ldy, void *work, const uint8_t *next,
                                size_t next_bytes);
/* blk_gemm_panel's `next`: the bytes its thread multiplies next (NULL: unknown), fetched into the cache while this
 * panel's tiles run */
DS_INTERNAL size_t blk_gemm_panel_bytes(int type, int N, int K, int p);
DS_INTERNAL int blk_gemm_panels(int N);  /* the panels of a tensor of N rows */
DS_INTERNAL const uint8_t *blk_gemm_panel_at(int type, const uint8_t *blocks, int K, int p);

/* ---- among the GEMM's files ---------------------------------------------------------------------------------- */

#define GP 32
#define GT 6
#define GEMM_RUN 256          /* values of a panel packed at a time where the tokens are few (blk_gemm_panel) */
#define GEMM_RUN_TOKENS 64    /* ... up to this many tokens */
#define GEMM_TOKENS 512       /* tokens a panel passes over at a time (ds_gemm_blocks): their activations in L2 */
DS_INTERNAL int gemm_mode(int type);
DS_INTERNAL int gemm_a256(int type);
DS_INTERNAL int gemm_direct(int type);
/* modes whose scales come every 16 values (the tiles of mode 1) */
static inline int gemm_per16(int mode) { return mode == 1 || mode == 3 || mode == 4; }
/* modes with a min (w = s u - m, u unsigned, z = 0) */
static inline int gemm_mins(int mode) { return mode == 2 || mode == 4; }
/* z: the packed byte u = w' + z of a weight w' (a zero weight packs as z; the sums start at -z x the activations') */
static inline int gemm_z(int mode) { return mode == 0 || mode == 3 ? 128 : mode == 1 ? 32 : 0; }
/* gemm_pack.c: rows n0 .. n0 + nrows of a tensor packed for the tiles (a whole panel's, or a run of `K` values of a
 * full panel straight from the blocks: pack_panel_direct) */
DS_INTERNAL void pack_panel(int type, int mode, const uint8_t *blocks, size_t row_bytes, int n0, int nrows, int K,
                            uint8_t *pw, float *ps, float *po, uint8_t *ubuf);
DS_INTERNAL void pack_panel_direct(int type, const uint8_t *blocks, size_t row_bytes, int n0, int K, uint8_t *pw,
                                   float *ps, float *po);
DS_INTERNAL void row_scales(int type, const uint8_t *row, int K, float *ps, float *po, int r);
/* gemm_avx512.c / gemm_avx2.c: the scales of PV_ROWS rows at once (rows r0 .., the first at `rows`), and the tiles of
 * a packed run times M tokens, GT at a time (the mode, a256 and the token count made constants there) */
DS_INTERNAL void gemm_row_scales(int type, const uint8_t *rows, size_t row_bytes, int K, float *ps, float *po, int r0);
DS_INTERNAL void gemm_tiles(int mode, int a256, int M, const uint8_t *pw, const float *ps, const float *po, int rb,
                            int nb, int ni, int b0, const int8_t *q, const float *d, const int32_t *i,
                            const float *f, int K, float *y, long ldy, int nrows, const uint8_t *pf0,
                            int pf_lines, int more, int run16);
#ifndef BLK_VNNI
/* groups of 4 values the AVX2 tile sums in int16 before widening them; 0: its values' nibbles apart (gemm_avx2.c) */
DS_INTERNAL int gemm_run16(int type, int mode);
#endif
#endif  /* DS_AVX2 */

#endif
