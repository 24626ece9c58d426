/* rowops.h: the row-wise steps the one-call decode and the prefill's row kernels (rowops.c) share: a row's RMS norm
 * and the MLP's SwiGLU. Inline: they run inside the callers' loops. */
#ifndef DS_ROWOPS_H
#define DS_ROWOPS_H

#include <math.h>

#include "ds.h"
#include "vmath.h"

#ifdef DS_AVX2

/* sum of x[i]^2 over n values: 8 lanes of fused multiply-adds, then the lanes and the tail in order */
static inline float sum_squares(const float *x, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) { __m256 v = _mm256_loadu_ps(x + i); acc = _mm256_fmadd_ps(v, v, acc); }
    float ss = blk_hsum8(acc);
    for (; i < n; i++) ss += x[i] * x[i];
    return ss;
}

static inline void rms_norm_row(const float *x, const float *w, float *out, int n, float eps) {
    float r = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

static inline void swiglu_rows(const float *gu, float *out, int rows, int I) {
    for (int r = 0; r < rows; r++) {
        float *g = (float *)gu + (size_t)r * 2 * I, *o = out + (size_t)r * I;
        silu_inplace(g, I);
        for (int j = 0; j < I; j++) o[j] = g[j] * g[I + j];
    }
}
#endif

#endif
