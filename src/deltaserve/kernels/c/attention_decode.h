/* attention_decode.h: a gated attention layer's step in the one-call decode (attention_decode.c), over the layer's
 * KV cache of each sequence ([nkv, cap, hd] per cache, f32). */
#ifndef DS_ATTENTION_DECODE_H
#define DS_ATTENTION_DECODE_H

#include "ds.h"
#include "native.h"

#ifdef DS_AVX2
/* q/k RMS norm per head, rotary embedding at rotary position rpos, k and v written at `pos` of the caches, the
 * rotated queries to qout [nh, hd]. Serial: one sequence's row. */
DS_INTERNAL void attn_prepare(const model_t *m, const layer_t *L, const float *qkv, float *kc, float *vc, int pos,
                              int rpos, int cap, float *qout);
/* query head h over cache positions 0..pos, times sigmoid of its output gate: out [hd]; scores: pos + 1 floats */
DS_INTERNAL void attn_head(const model_t *m, int h, const float *qkv, const float *q, const float *kc, const float *vc,
                           int pos, int cap, float *scores, float *out);
#endif

#endif
