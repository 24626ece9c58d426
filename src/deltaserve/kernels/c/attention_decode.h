/* attention_decode.h: a gated attention layer's step in the one-call decode (attention_decode.c), over the layer's
 * KV cache of each sequence ([nkv, cap, hd] per cache, in the call's type: native.h's DS_KV_F32, DS_KV_F16,
 * DS_KV_BF16). */
#ifndef DS_ATTENTION_DECODE_H
#define DS_ATTENTION_DECODE_H

#include "ds.h"
#include "native.h"

#ifdef DS_AVX2
/* q/k RMS norm per head, rotary embedding at rotary position rpos, k and v written at `pos` of the caches in type
 * kvt, the rotated queries to qout [nh, hd]. Serial: one sequence's row. */
DS_INTERNAL void attn_prepare(const model_t *m, const layer_t *L, const float *qkv, void *kc, void *vc, int kvt,
                              int pos, int rpos, int cap, float *qout);
/* an f32 cache: query head h over cache positions 0..pos, times sigmoid of its output gate: out [hd]; scores:
 * pos + 1 floats */
DS_INTERNAL void attn_head(const model_t *m, int h, const float *qkv, const float *q, const float *kc, const float *vc,
                           int pos, int cap, float *scores, float *out);
/* a 16-bit cache (kvt DS_KV_F16 or DS_KV_BF16): the g = nh / nkv query heads of KV head kvh (q: the row's rotated
 * queries [nh, hd]) over positions t0..t1-1 of the n the row sees, each key and value read once for all g.
 * scores: the row's [nh, n] (this chunk's part written); part [g, hd + 2]: per head, the chunk's max score, its sum
 * of e^(s - max), and the sum of e^(s - max) v (not normalized): attn_merge's input. */
DS_INTERNAL void attn_group(const model_t *m, int kvt, int kvh, const float *q, const void *kc, const void *vc, int n,
                            int t0, int t1, int cap, float *scores, float *part);
/* query head h's output from its KV head's nc chunks (part: head h's [hd + 2] in the first chunk, `stride` floats
 * from one chunk's to the next), times sigmoid of its output gate: out [hd] at h */
DS_INTERNAL void attn_merge(const model_t *m, int h, const float *qkv, const float *part, int nc, size_t stride,
                            float *out);
#endif

#endif
