/* rowops.c: a prefill's row-wise steps on AVX2, one pass over each row (torch's versions take 3-6 passes and as many
 * temporaries): the RMS norm, the q/k L2 norms per head, the gated RMS norm and the MLP's SwiGLU. Rows may lie apart
 * (views of a wider projection's output, read in place). Each runs its rows on the team where they are many. */
#include <math.h>
#include <omp.h>

#include "rowops.h"

#ifdef DS_AVX2

#define ROWS_PARALLEL(rows, n) if ((long)(rows) * (n) >= 32768)

/* 8 floats of p (n - i of them where fewer are left, the rest 0) */
static inline __m256 load_tail8(const float *p, int left) {
    if (left >= 8) return _mm256_loadu_ps(p);
    float t[8] = {0};
    for (int j = 0; j < left; j++) t[j] = p[j];
    return _mm256_loadu_ps(t);
}

static inline void store_tail8(float *p, __m256 v, int left) {
    if (left >= 8) { _mm256_storeu_ps(p, v); return; }
    float t[8];
    _mm256_storeu_ps(t, v);
    for (int j = 0; j < left; j++) p[j] = t[j];
}

/* out [rows, n] = x r w, r = 1 / sqrt(mean(x^2) + eps) (layers.rms_norm) */
int ds_rms_norm(const float *x, long ldx, const float *w, float *out, int rows, int n, float eps, int nthreads) {
    if (rows <= 0 || n <= 0 || ldx < n) return -1;
    #pragma omp parallel for num_threads(nthreads) schedule(static) ROWS_PARALLEL(rows, n)
    for (int r = 0; r < rows; r++) rms_norm_row(x + (size_t)r * ldx, w, out + (size_t)r * n, n, eps);
    return 0;
}

/* out [rows, heads, d] = x r scale per head, r = 1 / sqrt(sum(x^2) + 1e-6) (layers.l2_normalize, then the scale) */
int ds_l2_norm_heads(const float *x, long ldx, float *out, int rows, int heads, int d, float scale, int nthreads) {
    if (rows <= 0 || heads <= 0 || d <= 0 || ldx < (long)heads * d) return -1;
    #pragma omp parallel for num_threads(nthreads) schedule(static) ROWS_PARALLEL(rows, heads * d)
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            const float *xh = x + (size_t)r * ldx + (size_t)h * d;
            float *o = out + ((size_t)r * heads + h) * d;
            const float rr = 1.0f / sqrtf(sum_squares(xh, d) + 1e-6f);
            for (int i = 0; i < d; i++) o[i] = xh[i] * rr * scale;
        }
    return 0;
}

/* out [rows, heads, d] = w (o r) silu(z) per head, r = 1 / sqrt(mean(o^2) + eps) (layers.gated_rms_norm); o
 * [rows, heads, d] contiguous, z's rows ldz apart */
int ds_gated_rms_norm(const float *o, const float *z, long ldz, const float *w, float *out, int rows, int heads, int d,
                      float eps, int nthreads) {
    if (rows <= 0 || heads <= 0 || d <= 0 || ldz < (long)heads * d) return -1;
    #pragma omp parallel for num_threads(nthreads) schedule(static) ROWS_PARALLEL(rows, heads * d)
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            const float *oh = o + ((size_t)r * heads + h) * d, *zh = z + (size_t)r * ldz + (size_t)h * d;
            float *y = out + ((size_t)r * heads + h) * d;
            const __m256 rr = _mm256_set1_ps(1.0f / sqrtf(sum_squares(oh, d) / (float)d + eps));
            for (int i = 0; i < d; i += 8)
                store_tail8(y + i, _mm256_mul_ps(_mm256_mul_ps(load_tail8(w + i, d - i), _mm256_mul_ps(load_tail8(oh + i, d - i), rr)),
                                                 silu256(load_tail8(zh + i, d - i))), d - i);
        }
    return 0;
}

/* out [rows, n] = silu(g) u (layers.mlp's SwiGLU), g's and u's rows ldg and ldu apart (the two halves of a stacked
 * gate/up output) */
int ds_swiglu(const float *g, long ldg, const float *u, long ldu, float *out, int rows, int n, int nthreads) {
    if (rows <= 0 || n <= 0 || ldg < n || ldu < n) return -1;
    #pragma omp parallel for num_threads(nthreads) schedule(static) ROWS_PARALLEL(rows, n)
    for (int r = 0; r < rows; r++) {
        const float *gr = g + (size_t)r * ldg, *ur = u + (size_t)r * ldu;
        float *o = out + (size_t)r * n;
        for (int i = 0; i < n; i += 8)
            store_tail8(o + i, _mm256_mul_ps(silu256(load_tail8(gr + i, n - i)), load_tail8(ur + i, n - i)), n - i);
    }
    return 0;
}
#endif  /* DS_AVX2 */
