/* deltanet.h: a Gated DeltaNet layer's mixer between its projections, one token (deltanet.c; the one-call decode
 * runs its two halves per sequence and per head). The prefill's span kernels, ds_delta_rule and ds_causal_conv, are
 * deltanet_avx512.c's where the build has DS_TABLES and deltanet_avx2.c's elsewhere. */
#ifndef DS_DELTANET_H
#define DS_DELTANET_H

#include "ds.h"

#ifdef DS_AVX2
/* the conv over [conv_state; qkv] (the state shifts by one), SiLU, and the L2 norms of the q and k heads, into u [C] */
DS_INTERNAL void dn_mix(const float *qkv, const float *conv_w, float *conv_state, float *u, int C, int Kc, int nk, int dk);
/* value head h after dn_mix: the gates, the delta rule on its state, the gated RMS norm, into out[h dv ..] */
DS_INTERNAL void dn_head(int h, const float *u, const float *z, const float *b, const float *a, const float *a_neg,
                         const float *dt_bias, const float *norm_w, float *S, float *out, int nk, int dk, int nv, int dv,
                         int tiled, float eps);
#endif

#endif
