/* activations.h: a product's activation rows quantized to int8 as llama.cpp quantizes them for the weights' type
 * (activations.c): per block of 32 with an f16-rounded scale (its Q8_0), or per block of 256 with an f32 scale (its
 * Q8_K). Every product on the file's blocks (products.c, the GEMM) reads them so; their integer sums are exact. */
#ifndef DS_ACTIVATIONS_H
#define DS_ACTIVATIONS_H

#include "ds.h"

/* the order of a 256-block's sub-blocks of 32 in quant_q8_k's qp (how the Q4_K/Q5_K decode tile reads them) */
#define Q45_ORDER {0, 2, 1, 3, 4, 6, 5, 7}

/* Q8_0 blocks of 32: q int8 [K], d [K/32] (the f16-rounded scale); where c is given, c [K/4]: -128 times the sum of
 * each 4 values, and where cb is, cb [K/32]: -128 times each block's sum */
DS_INTERNAL void quant_q8_0(const float *x, int K, int8_t *q, float *d, int32_t *c, int32_t *cb);
/* quant_q8_0's values with one f32 scale per 256 (d [K/256]; Q8_K's values, for the GEMM) */
DS_INTERNAL void quant_q8_256(const float *x, int K, int8_t *q, float *d, int32_t *c);
/* Q8_K: q int8 [K], d [K/256] f32, bs [K/16] sums of 16 values; with BLK_VNNI qp [K] in Q45_ORDER */
DS_INTERNAL void quant_q8_k(const float *x, int K, int8_t *q, float *d, int16_t *bs, int8_t *qp);

#endif
