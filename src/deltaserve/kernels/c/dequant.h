/* dequant.h: a GGUF row's exact values (dequant.c), what gguf.quants.dequantize gives bit for bit. */
#ifndef DS_DEQUANT_H
#define DS_DEQUANT_H

#include "quants.h"

/* row of K values of `type` -> f32 */
DS_INTERNAL void deq_row(int type, const uint8_t *b, int K, float *o);
/* whether expand.c's int8 values and scales of a row of `type` are its exact values (then dequantized that way) */
DS_INTERNAL int expands_exactly(int type, int K);
/* f32 -> bf16 rounded to nearest, ties to even (torch's .to(torch.bfloat16); a NaN becomes 0x7FC0) */
DS_INTERNAL void to_bf16(const float *x, uint16_t *o, int n);
#ifdef BLK_VNNI
/* a row straight to bf16 on 512-bit vectors (dequant_avx512.c): the same values as deq_row then to_bf16; 0 where
 * it does not take the type */
DS_INTERNAL int deq_row_bf16(int type, const uint8_t *b, int K, uint16_t *o);
#endif

#endif
