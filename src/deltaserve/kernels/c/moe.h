/* moe.h: the MoE block (qwen35moe) of the one-call decode (moe.c's moe_ffn); the prefill's routed experts are
 * ds_moe_experts, on a team of its own. */
#ifndef DS_MOE_H
#define DS_MOE_H

#include "ds.h"
#include "native.h"

#ifdef DS_AVX2

/* the MoE block's buffers for one call: U = min(n_expert, B n_used) experts at most in a layer */
typedef struct {
    float *logits, *gu, *mid, *out, *shared, *w;
    int *sel, *uniq, *slot, nu;
    void *scratch;     /* blk_scratch_bytes(U B, ff): every chosen expert's B rows of its down projection's input */
} moe_buf_t;
/* an MoE layer's shapes, checked before anything is touched */
DS_INTERNAL int moe_ok(const layer_t *L, int H);
/* x [B, H] += the MoE block of h [B, H] (the normed residual); called by every thread of the team */
DS_INTERNAL void moe_ffn(const layer_t *L, int B, int H, const float *h, float *x, float *big, float *mid,
                         void *const *scratch, moe_buf_t *mb);
#endif

#endif
