/* tables.h: the products on int8 tables (DS_I8: int8 rows with per-row scales) and on Q4_K blocks repacked at load
 * (DS_Q4KR), tables_avx512.c's, as pieces a caller's OpenMP team runs, the way products.h's run the file's own blocks
 * (the one-call decode, decode.c, dispatches each segment to one or the other). They need AVX512F, AVX512BW and
 * AVX512-VNNI (ds.h's DS_TABLES).
 *   tab_kind(type): 1 (DS_I8: activations int8 per block of 32 with lane scales), 2 (DS_Q4KR: int8 per 256 with
 *   sums of 16, and in the repacked order), 0: not a table type. Every thread of the team calls tab_prepare(kind)
 *   (into `scratch` of tab_scratch_bytes(M, K); a worksharing loop with its barrier), then tab_tiles for each
 *   segment of that kind (an orphaned worksharing loop over its rows, no barrier: put one after the last). */
#ifndef DS_TABLES_H
#define DS_TABLES_H

#include "ds.h"

#ifdef DS_TABLES
#include "native.h"

DS_INTERNAL int tab_kind(int type);
DS_INTERNAL size_t tab_scratch_bytes(int M, int K);
DS_INTERNAL void tab_prepare(int kind, const float *x, int M, int K, void *scratch);
DS_INTERNAL void tab_tiles(const seg_t *g, int K, void *scratch, int M, float *y, long ldy);
#endif

#endif
