/* attention_vision_avx512.c: the vision tower's attention on AVX512-BF16: softmax(q k^T * scale) v over one image's
 * patches, every head,
 * without the score matrix ever in memory (the online softmax of FlashAttention, one pass over the keys).
 *
 * q, k, v: bf16 [n, heads, dim] (dim even), out: f32 [n, heads, dim]. Scores and the softmax are f32: each score is
 * an f32 sum of bf16 x bf16 products (vdpbf16ps), the probabilities enter the product with v as bf16 (as
 * llama.cpp's CPU flash attention takes them in f16), the running sums and the output stay f32.
 *
 * Why our own: an image of 1344 x 1344 pixels is 7056 patches, and its attention is half the tower's arithmetic;
 * torch's CPU scaled_dot_product_attention, or its bf16 GEMMs with the 16 x 7056 x 7056 scores written out and a
 * softmax in between, ran it at a fraction of this kernel's speed (docs/kernels.md).
 *
 * Layout: the keys of one head are packed as pairs of dims for 16 keys at a time (Kp[key block][pair][16]: one
 * vector holds 16 keys' dims 2p, 2p+1, so one vdpbf16ps adds that pair for 16 scores of a query row), the values
 * as pairs of keys for 16 dims at a time (Vp[key pair][dims rounded up to 16]: one vdpbf16ps adds two keys'
 * values into 16 output dims of a row). A task is one head and QBLK query rows; it walks the keys KCH at a time
 * (their packed keys and values, 72 KB for dim 72, stay in L2 while every tile of its rows passes over them).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ds.h"
#include "vmath.h"


#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VL__)

#define MR 12      /* query rows per register tile */
#define KB 32     /* keys per step: two vectors of scores a row */
#define QBLK (MR * 8)  /* query rows per task (whole tiles) */
#define KCH 512   /* keys per chunk a task's tiles pass over together */

/* e^x for 16 floats x <= 0 (the scores less their running maximum): x = n ln2 + r, |r| <= ln2/2, e^r by its Taylor
 * polynomial of degree 5 (relative error under 3e-6, far below the bf16 the probabilities are rounded to), times
 * 2^n. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 120);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

typedef struct {
    int n, npad, heads, dim, pairs, dpad;
    float scale;
    const uint32_t *q;  /* [n, heads, pairs] */
    const uint32_t *kp; /* per head: [npad / 16][pairs][16] */
    const uint32_t *vp; /* per head: [npad / 2][dpad] */
    float *out;
} att_t;

/* One tile: rows r0 .. r0 + MR of the task (qt: their q pairs, MR x pairs; m: their running maxima; l: their
 * running sums, 16 lanes a row, added across at the end; o: their outputs, rows of dpad), keys j0 .. j0 + KB. */
static inline void tile(const att_t *a, int head, const uint32_t *qt, int j0, float *m, float *l, float *o) {
    const int P = a->pairs, DP = a->dpad;
    const uint32_t *k0 = a->kp + (size_t)head * a->npad * P + (size_t)(j0 / 16) * P * 16;
    const uint32_t *k1 = k0 + (size_t)P * 16;
    __m512 s[MR][2];
    for (int r = 0; r < MR; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int p = 0; p < P; p++) {
        __m512bh kv0 = (__m512bh)_mm512_loadu_si512(k0 + p * 16), kv1 = (__m512bh)_mm512_loadu_si512(k1 + p * 16);
        for (int r = 0; r < MR; r++) {
            __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qt[r * P + p]);
            s[r][0] = _mm512_dpbf16_ps(s[r][0], qb, kv0);
            s[r][1] = _mm512_dpbf16_ps(s[r][1], qb, kv1);
        }
    }
    /* keys past n (the last step's padding) take no weight */
    int valid = a->n - j0;
    __mmask16 v0 = valid >= 16 ? 0xFFFF : (__mmask16)((1u << (valid > 0 ? valid : 0)) - 1);
    __mmask16 v1 = valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : (__mmask16)((1u << (valid - 16)) - 1);
    const __m512 sc = _mm512_set1_ps(a->scale), neg = _mm512_set1_ps(-1e30f);
    float alpha[MR];
    uint32_t pb[MR][KB / 2];
    int moved = 0;
    for (int r = 0; r < MR; r++) {
        __m512 x0 = _mm512_mask_mul_ps(neg, v0, s[r][0], sc), x1 = _mm512_mask_mul_ps(neg, v1, s[r][1], sc);
        __m512 mx = _mm512_max_ps(x0, x1);
        alpha[r] = 1.0f;
        /* the running maximum moves only where a score passes it (after the first steps, seldom): only then the
         * row's maximum is found across lanes and its sums rescaled */
        if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(m[r]), _CMP_GT_OQ)) {
            float mnew = _mm512_reduce_max_ps(mx);
            alpha[r] = expf(m[r] - mnew);
            m[r] = mnew;
            moved = 1;
        }
        __m512 mv = _mm512_set1_ps(m[r]);
        __m512 p0 = _mm512_maskz_mov_ps(v0, exp16(_mm512_sub_ps(x0, mv)));
        __m512 p1 = _mm512_maskz_mov_ps(v1, exp16(_mm512_sub_ps(x1, mv)));
        _mm512_storeu_ps(l + r * 16, _mm512_fmadd_ps(_mm512_loadu_ps(l + r * 16), _mm512_set1_ps(alpha[r]),
                                                     _mm512_add_ps(p0, p1)));
        _mm512_storeu_si512(pb[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    /* o = o * alpha + p v: 16 dims at a time, and 8 for a width that leaves 8 or fewer (72 = 4 x 16 + 8) */
    const uint32_t *vb = a->vp + (size_t)head * (a->npad / 2) * DP + (size_t)(j0 / 2) * DP;
    int c = 0;
    for (; c + 16 <= DP; c += 16) {
        __m512 acc[MR];
        for (int r = 0; r < MR; r++) {
            acc[r] = _mm512_loadu_ps(o + r * DP + c);
            if (moved) acc[r] = _mm512_mul_ps(acc[r], _mm512_set1_ps(alpha[r]));
        }
        for (int t = 0; t < KB / 2; t++) {
            __m512bh vv = (__m512bh)_mm512_loadu_si512(vb + (size_t)t * DP + c);
            for (int r = 0; r < MR; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)pb[r][t]), vv);
        }
        for (int r = 0; r < MR; r++) _mm512_storeu_ps(o + r * DP + c, acc[r]);
    }
    if (c < DP) {  /* DP - c == 8 */
        __m256 acc[MR];
        for (int r = 0; r < MR; r++) {
            acc[r] = _mm256_loadu_ps(o + r * DP + c);
            if (moved) acc[r] = _mm256_mul_ps(acc[r], _mm256_set1_ps(alpha[r]));
        }
        for (int t = 0; t < KB / 2; t++) {
            __m256bh vv = (__m256bh)_mm256_loadu_si256((const __m256i *)(vb + (size_t)t * DP + c));
            for (int r = 0; r < MR; r++)
                acc[r] = _mm256_dpbf16_ps(acc[r], (__m256bh)_mm256_set1_epi32((int)pb[r][t]), vv);
        }
        for (int r = 0; r < MR; r++) _mm256_storeu_ps(o + r * DP + c, acc[r]);
    }
}

/* ds_attention_bf16: out = softmax(q k^T * scale) v per head over n rows (see the top of this file). Returns 0, or 1
 * when scratch could not be allocated (out untouched then). */
int ds_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, float *out, int n, int heads, int dim,
                      float scale, int nthreads) {
    if (n <= 0 || heads <= 0 || dim <= 0 || dim % 2) return 2;
    const int P = dim / 2, npad = (n + KB - 1) / KB * KB;
    const int DP = dim % 16 && dim % 16 <= 8 ? dim / 16 * 16 + 8 : (dim + 15) / 16 * 16;  /* see tile's last part */
    uint32_t *kp = aligned_alloc(64, ((size_t)heads * npad * P * 4 + 63) / 64 * 64);
    uint32_t *vp = aligned_alloc(64, ((size_t)heads * (npad / 2) * DP * 4 + 63) / 64 * 64);
    if (!kp || !vp) { free(kp); free(vp); return 1; }
    const uint32_t *q32 = (const uint32_t *)q, *k32 = (const uint32_t *)k;
    /* pack: keys by pairs of dims, values by pairs of keys (padding keys are zero) */
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int hb = 0; hb < heads * (npad / 16); hb++) {
        int h = hb / (npad / 16), jb = hb % (npad / 16);
        uint32_t *dst = kp + (size_t)h * npad * P + (size_t)jb * P * 16;
        for (int lane = 0; lane < 16; lane++) {
            int j = jb * 16 + lane;
            const uint32_t *src = k32 + ((size_t)j * heads + h) * P;
            for (int p = 0; p < P; p++) dst[p * 16 + lane] = j < n ? src[p] : 0;
        }
        uint32_t *vd = vp + (size_t)h * (npad / 2) * DP + (size_t)jb * 8 * DP;
        for (int t = 0; t < 8; t++) {
            int j = jb * 16 + 2 * t;
            const uint16_t *r0 = v + ((size_t)j * heads + h) * dim, *r1 = r0 + (size_t)heads * dim;
            for (int d = 0; d < DP; d++) {
                uint32_t lo = j < n && d < dim ? r0[d] : 0, hi = j + 1 < n && d < dim ? r1[d] : 0;
                vd[(size_t)t * DP + d] = lo | (hi << 16);
            }
        }
    }
    att_t a = {n, npad, heads, dim, P, DP, scale, q32, kp, vp, out};
    const int qblocks = (n + QBLK - 1) / QBLK;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        uint32_t *qt = malloc((size_t)QBLK * P * 4);
        float *o = aligned_alloc(64, (size_t)QBLK * DP * 4), *l = aligned_alloc(64, (size_t)QBLK * 16 * 4), m[QBLK];
        if (!qt || !o || !l) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < heads * qblocks; task++) {
            if (failed) continue;
            int h = task % heads, i0 = (task / heads) * QBLK, rows = n - i0 < QBLK ? n - i0 : QBLK;
            for (int r = 0; r < QBLK; r++) {
                for (int p = 0; p < P; p++) qt[r * P + p] = r < rows ? q32[((size_t)(i0 + r) * heads + h) * P + p] : 0;
                m[r] = -1e30f;
            }
            memset(l, 0, (size_t)QBLK * 16 * 4);
            memset(o, 0, (size_t)QBLK * DP * 4);
            int tiles = (rows + MR - 1) / MR;
            for (int c0 = 0; c0 < npad; c0 += KCH) {
                int c1 = c0 + KCH < npad ? c0 + KCH : npad;
                for (int t = 0; t < tiles; t++)
                    for (int j0 = c0; j0 < c1; j0 += KB)
                        tile(&a, h, qt + (size_t)t * MR * P, j0, m + t * MR, l + (size_t)t * MR * 16,
                             o + (size_t)t * MR * DP);
            }
            for (int r = 0; r < rows; r++) {
                float inv = 1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(l + r * 16));
                float *dst = out + ((size_t)(i0 + r) * heads + h) * dim;
                for (int d = 0; d < dim; d++) dst[d] = o[r * DP + d] * inv;
            }
        }
        free(qt);
        free(o);
        free(l);
    }
    free(kp);
    free(vp);
    return failed;
}

#endif
