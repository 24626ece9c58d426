/* attention_vision_avx2.c: the vision tower's attention on AVX2 + FMA, f32 throughout (attention_vision_avx512.c has
 * the bf16 one, where the build has AVX512-BF16).
 *
 * ds_attention_f32: softmax(q k^T * scale) v per head in f32 on every build: q, k, v, out f32 [n, heads, dim], any
 * dim. For the tower's f32 route (a CPU without bf16 arithmetic, a Zen 3; or DELTASERVE_VISION=f32), where torch's
 * SDPA is several times slower. Keys packed 8 to a vector by dim (K8[key block][dim][8]), values as they are (rows
 * of dims rounded up to 8); a tile is F_MR query rows by 16 keys. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ds.h"
#include "vmath.h"

#if defined(__AVX2__) && defined(__FMA__)

#define F_MR 6     /* query rows per register tile: 12 score accumulators, 2 key vectors, one broadcast */
#define F_KB 16    /* keys per step */
#define F_QBLK (F_MR * 8)
#define F_KCH 256

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

typedef struct {
    int n, npad, dim, dpad;
    float scale;
    const float *kp;  /* this head's keys: [npad / 8][dim][8] */
    const float *vp;  /* this head's values: [npad][dpad] */
} fatt_t;

/* rows of qt (F_MR x dim), keys j0 .. j0 + F_KB: m running maxima, l running sums (8 lanes a row), o rows of dpad */
static inline void tile_f32(const fatt_t *a, const float *qt, int j0, float *m, float *l, float *o) {
    const int D = a->dim, DP = a->dpad;
    const float *k0 = a->kp + (size_t)(j0 / 8) * D * 8, *k1 = k0 + (size_t)D * 8;
    __m256 s[F_MR][2];
    for (int r = 0; r < F_MR; r++) s[r][0] = s[r][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++) {
        __m256 kv0 = _mm256_loadu_ps(k0 + d * 8), kv1 = _mm256_loadu_ps(k1 + d * 8);
        for (int r = 0; r < F_MR; r++) {
            __m256 qb = _mm256_broadcast_ss(qt + r * D + d);
            s[r][0] = _mm256_fmadd_ps(qb, kv0, s[r][0]);
            s[r][1] = _mm256_fmadd_ps(qb, kv1, s[r][1]);
        }
    }
    int valid = a->n - j0;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 v0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane));
    __m256 v1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid - 8), lane));
    const __m256 sc = _mm256_set1_ps(a->scale), neg = _mm256_set1_ps(-1e30f);
    float alpha[F_MR], pr[F_MR][F_KB];
    int moved = 0;
    for (int r = 0; r < F_MR; r++) {
        __m256 x0 = _mm256_blendv_ps(neg, _mm256_mul_ps(s[r][0], sc), v0);
        __m256 x1 = _mm256_blendv_ps(neg, _mm256_mul_ps(s[r][1], sc), v1);
        float mx = hmax8(_mm256_max_ps(x0, x1));
        alpha[r] = 1.0f;
        if (mx > m[r]) {
            alpha[r] = expf(m[r] - mx);
            m[r] = mx;
            moved = 1;
        }
        __m256 mv = _mm256_set1_ps(m[r]);
        __m256 p0 = _mm256_and_ps(v0, exp256(_mm256_sub_ps(x0, mv)));
        __m256 p1 = _mm256_and_ps(v1, exp256(_mm256_sub_ps(x1, mv)));
        _mm256_storeu_ps(l + r * 8, _mm256_fmadd_ps(_mm256_loadu_ps(l + r * 8), _mm256_set1_ps(alpha[r]),
                                                    _mm256_add_ps(p0, p1)));
        _mm256_storeu_ps(pr[r], p0);
        _mm256_storeu_ps(pr[r] + 8, p1);
    }
    const float *vb = a->vp + (size_t)j0 * DP;
    for (int c = 0; c < DP; c += 8) {
        __m256 acc[F_MR];
        for (int r = 0; r < F_MR; r++) {
            acc[r] = _mm256_loadu_ps(o + r * DP + c);
            if (moved) acc[r] = _mm256_mul_ps(acc[r], _mm256_set1_ps(alpha[r]));
        }
        for (int j = 0; j < F_KB; j++) {
            __m256 vv = _mm256_loadu_ps(vb + (size_t)j * DP + c);
            for (int r = 0; r < F_MR; r++) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&pr[r][j]), vv, acc[r]);
        }
        for (int r = 0; r < F_MR; r++) _mm256_storeu_ps(o + r * DP + c, acc[r]);
    }
}

/* ds_attention_f32: out = softmax(q k^T * scale) v per head over n rows, all f32. Returns 0, 1 when scratch could
 * not be allocated (out untouched then), 2 for a bad shape. */
int ds_attention_f32(const float *q, const float *k, const float *v, float *out, int n, int heads, int dim,
                     float scale, int nthreads) {
    if (n <= 0 || heads <= 0 || dim <= 0) return 2;
    const int npad = (n + F_KB - 1) / F_KB * F_KB, DP = (dim + 7) / 8 * 8;
    float *kp = aligned_alloc(64, ((size_t)heads * npad * dim * 4 + 63) / 64 * 64);
    float *vp = aligned_alloc(64, ((size_t)heads * npad * DP * 4 + 63) / 64 * 64);
    if (!kp || !vp) { free(kp); free(vp); return 1; }
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int hb = 0; hb < heads * (npad / 8); hb++) {
        int h = hb / (npad / 8), jb = hb % (npad / 8);
        float *dst = kp + (size_t)h * npad * dim + (size_t)jb * dim * 8;
        float *vd = vp + (size_t)h * npad * DP + (size_t)jb * 8 * DP;
        for (int lane = 0; lane < 8; lane++) {
            int j = jb * 8 + lane;
            const float *ks = k + ((size_t)j * heads + h) * dim, *vs = v + ((size_t)j * heads + h) * dim;
            for (int d = 0; d < dim; d++) dst[d * 8 + lane] = j < n ? ks[d] : 0.0f;
            for (int d = 0; d < DP; d++) vd[(size_t)lane * DP + d] = j < n && d < dim ? vs[d] : 0.0f;
        }
    }
    const int qblocks = (n + F_QBLK - 1) / F_QBLK;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        float *qt = malloc((size_t)F_QBLK * dim * 4), *o = malloc((size_t)F_QBLK * DP * 4);
        float *l = malloc((size_t)F_QBLK * 8 * 4), m[F_QBLK];
        if (!qt || !o || !l) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < heads * qblocks; task++) {
            if (failed) continue;
            int h = task % heads, i0 = (task / heads) * F_QBLK, rows = n - i0 < F_QBLK ? n - i0 : F_QBLK;
            fatt_t a = {n, npad, dim, DP, scale, kp + (size_t)h * npad * dim, vp + (size_t)h * npad * DP};
            for (int r = 0; r < F_QBLK; r++) {
                for (int d = 0; d < dim; d++) qt[r * dim + d] = r < rows ? q[((size_t)(i0 + r) * heads + h) * dim + d] : 0;
                m[r] = -1e30f;
            }
            memset(l, 0, (size_t)F_QBLK * 8 * 4);
            memset(o, 0, (size_t)F_QBLK * DP * 4);
            int tiles = (rows + F_MR - 1) / F_MR;
            for (int c0 = 0; c0 < npad; c0 += F_KCH) {
                int c1 = c0 + F_KCH < npad ? c0 + F_KCH : npad;
                for (int t = 0; t < tiles; t++)
                    for (int j0 = c0; j0 < c1; j0 += F_KB)
                        tile_f32(&a, qt + (size_t)t * F_MR * dim, j0, m + t * F_MR, l + (size_t)t * F_MR * 8,
                                 o + (size_t)t * F_MR * DP);
            }
            for (int r = 0; r < rows; r++) {
                float inv = 1.0f / hsum8(_mm256_loadu_ps(l + r * 8));
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
