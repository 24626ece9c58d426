/* tables.h: native.c's products on int8 tables (DS_I8: int8 rows with per-row scales) and on Q4_K blocks repacked
 * at load (DS_Q4KR), as pieces a caller's OpenMP team runs, the way blocks.h's run the file's own blocks (the
 * one-call decode of native_avx2.c dispatches each segment to one or the other). They need AVX512F, AVX512BW and
 * AVX512-VNNI: DS_TABLES is defined where the build (-march=native) has them, and native.c is compiled only then.
 *   tab_kind(type): 1 (DS_I8: activations int8 per block of 32 with lane scales), 2 (DS_Q4KR: int8 per 256 with
 *   sums of 16, and in the repacked order), 0: not a table type. Every thread of the team calls tab_prepare(kind)
 *   (into `scratch` of tab_scratch_bytes(M, K); a worksharing loop with its barrier), then tab_tiles for each
 *   segment of that kind (an orphaned worksharing loop over its rows, no barrier: put one after the last). */
#ifndef DS_TABLES_H
#define DS_TABLES_H
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define DS_TABLES 1
#include <stddef.h>

#include "native.h"

int tab_kind(int type);
size_t tab_scratch_bytes(int M, int K);
void tab_prepare(int kind, const float *x, int M, int K, void *scratch);
void tab_tiles(const seg_t *g, int K, void *scratch, int M, float *y, long ldy);
#endif
#endif
