/* Vector math shared by the kernels: e^x on 8 lanes (AVX2 + FMA) and, where AVX512F is, on 16. */
#ifndef DS_VMATH_H
#define DS_VMATH_H

#include <immintrin.h>

/* e^x: x = n ln2 + r, |r| <= ln2/2 (ln2 in two parts), e^r by its polynomial of degree 6 (the classic
 * single-precision coefficients, relative error under 2e-7), times 2^n; x is clamped so that n + 127 stays in
 * 1..254 (a normal float). glibc's scalar expf made SiLU the slowest step of the prefill's conv. */
#define EXP_CLAMP_HI 88.3f
#define EXP_CLAMP_LO -87.3f
#define EXP_LOG2E 1.44269504f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_C6 1.9875691500e-4f
#define EXP_C5 1.3981999507e-3f
#define EXP_C4 8.3334519073e-3f
#define EXP_C3 4.1665795894e-2f
#define EXP_C2 1.6666665459e-1f
#define EXP_C1 5.0000001201e-1f

/* the polynomial and the reduction, on either width (V: the vector type's intrinsic prefix, e.g. _mm256) */
#define EXP_BODY(V, x, n, p)                                                                              \
    do {                                                                                                  \
        __typeof__(x) r_ = V##_fnmadd_ps(n, V##_set1_ps(EXP_LN2_HI), x);                                  \
        r_ = V##_fnmadd_ps(n, V##_set1_ps(EXP_LN2_LO), r_);                                               \
        p = V##_set1_ps(EXP_C6);                                                                          \
        p = V##_fmadd_ps(p, r_, V##_set1_ps(EXP_C5));                                                     \
        p = V##_fmadd_ps(p, r_, V##_set1_ps(EXP_C4));                                                     \
        p = V##_fmadd_ps(p, r_, V##_set1_ps(EXP_C3));                                                     \
        p = V##_fmadd_ps(p, r_, V##_set1_ps(EXP_C2));                                                     \
        p = V##_fmadd_ps(p, r_, V##_set1_ps(EXP_C1));                                                     \
        p = V##_fmadd_ps(p, V##_mul_ps(r_, r_), V##_add_ps(r_, V##_set1_ps(1.0f)));                       \
    } while (0)

/* e^x for 8 floats: 2^n built in the exponent field */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(EXP_CLAMP_HI)), _mm256_set1_ps(EXP_CLAMP_LO));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 p;
    EXP_BODY(_mm256, x, n, p);
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#ifdef __AVX512F__
/* e^x for 16 floats: 2^n by vscalefps */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(EXP_CLAMP_HI)), _mm512_set1_ps(EXP_CLAMP_LO));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 p;
    EXP_BODY(_mm512, x, n, p);
    return _mm512_scalef_ps(p, n);
}
#endif

/* silu(x) = x / (1 + e^-x) on 8 lanes */

static inline __m256 silu256(__m256 x) {
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

/* v[i] = silu(v[i]) = v / (1 + e^-v), in place, n values (the tail through the same vector code) */
static inline void silu_inplace(float *v, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, silu256(_mm256_loadu_ps(v + i)));
    if (i < n) {
        float t[8] = {0};
        for (int j = 0; j < n - i; j++) t[j] = v[i + j];
        _mm256_storeu_ps(t, silu256(_mm256_loadu_ps(t)));
        for (int j = 0; j < n - i; j++) v[i + j] = t[j];
    }
}
#endif
