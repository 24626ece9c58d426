/* deltanet_avx2.c: the prefill's DeltaNet span kernels on AVX2 (a build without AVX512-VNNI: a Zen 3): the depthwise
 * causal conv + SiLU over a span in one pass, and the gated delta rule token by token, the state split into
 * 16-column slices (two ymm a row, 8 KB a slice) that stay in L1 for the whole span. deltanet_avx512.c holds the
 * 512-bit ones where the build has DS_TABLES. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "ds.h"
#include "vmath.h"

#if defined(DS_AVX2) && !defined(DS_TABLES)

/* The depthwise causal conv of a DeltaNet layer over T new rows, then SiLU: out[t, c] = silu(sum_j
 * w[c, j] * window[t + j, c]) with window = [conv_state; x] ([Kc-1+T, C]); conv_state becomes the window's
 * last Kc-1 rows. One pass over x and out. */
int ds_causal_conv(const float *x, float *conv_state, const float *w, float *out, int T, int C, int Kc,
                   int nthreads, long ldx) {
    if (T <= 0 || C <= 0 || Kc < 2 || ldx < C) return -1;
    int H = Kc - 1;
    float *wt = malloc((size_t)Kc * C * sizeof(float)), *keep = malloc((size_t)H * C * sizeof(float));
    if (!wt || !keep) { free(wt); free(keep); return -1; }
    for (int c = 0; c < C; c++)
        for (int j = 0; j < Kc; j++) wt[(size_t)j * C + c] = w[(size_t)c * Kc + j];
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < T; t++) {
        float *o = out + (size_t)t * C;
        int c = 0;
        for (; c + 8 <= C; c += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (int j = 0; j < Kc; j++) {
                int r = t + j;  /* row of the window */
                const float *src = r < H ? conv_state + (size_t)r * C : x + (size_t)(r - H) * ldx;
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(wt + (size_t)j * C + c), _mm256_loadu_ps(src + c), acc);
            }
            _mm256_storeu_ps(o + c, silu256(acc));
        }
        for (; c < C; c++) {
            float acc = 0.0f;
            for (int j = 0; j < Kc; j++) {
                int r = t + j;
                const float *src = r < H ? conv_state + (size_t)r * C : x + (size_t)(r - H) * ldx;
                acc += wt[(size_t)j * C + c] * src[c];
            }
            o[c] = acc;
        }
        if (C % 8) silu_inplace(o + C / 8 * 8, C % 8);
    }
    /* the new state: the window's last H rows (some may still be old state rows when T < H) */
    for (int i = 0; i < H; i++) {
        int r = T + i;
        const float *src = r < H ? conv_state + (size_t)r * C : x + (size_t)(r - H) * ldx;
        for (int c = 0; c < C; c++) keep[(size_t)i * C + c] = src[c];
    }
    for (size_t i = 0; i < (size_t)H * C; i++) conv_state[i] = keep[i];
    free(keep); free(wt);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------
 * The gated delta rule over T tokens of one sequence (a prefill), token by token, updating S [H, dk, dv]:
 * S = e^g S; delta = beta (v - S^T k); S += k delta^T; o = S^T q (deltanet_avx512.c's ds_delta_rule). The work is split
 * into (head, 16 columns) items whose dk x 16 slice of the state (8 KB at dk 128) stays in L1 for all T tokens;
 * one pass over the slice per token both applies token t's update and gathers S^T k and S^T q for token t + 1
 * (o = S_new^T q = e^g S_old^T q + (k.q) delta). q, k: [T, H, dk]; v, out: [T, H, dv]; g, beta: [T, H].
 *
 * The pass is bound by the FMA pipes (a row of a slice: two ymm, 2 updates and 4 gathers), so the decay is kept out
 * of it: the slice holds S' with S = c S' (c the product of the decays since the last rescale), and token t's update
 * is S' += k (delta / c) with one FMA a vector instead of a multiply and an FMA. When c falls below 2^-40 (and at the
 * last token, so that S is left as it is) the pass multiplies by c instead and c returns to 1. Returns -1 where dv is
 * not a multiple of 16.
 * ------------------------------------------------------------------------------------------------------- */
/* One pass over a 16-column slice s (rows of stride dv), two rows an iteration (eight accumulation chains: the FMA
 * latency of two pipes). UPDATE 1: row_i += ku[i] (d0, d1); UPDATE 2: row_i = vd row_i + ku[i] (d0, d1); then stored.
 * GATHER: the next token's S'^T k and S'^T q from the (updated) rows into kv[0..1], qs[0..1]. A macro, so that each
 * kind of pass is its own loop with no test inside. */
#define DR_ROW(R, UPDATE, GATHER, A0, A1, B0, B1)                                                              \
    {                                                                                                         \
        float *r0 = s + (size_t)(R) * dv;                                                                     \
        __m256 s0 = _mm256_loadu_ps(r0), s1 = _mm256_loadu_ps(r0 + 8);                                        \
        if (UPDATE) {                                                                                         \
            __m256 k0 = _mm256_broadcast_ss(ku + (R));                                                        \
            s0 = _mm256_fmadd_ps(k0, d0, UPDATE == 2 ? _mm256_mul_ps(vd, s0) : s0);                           \
            s1 = _mm256_fmadd_ps(k0, d1, UPDATE == 2 ? _mm256_mul_ps(vd, s1) : s1);                           \
            _mm256_storeu_ps(r0, s0); _mm256_storeu_ps(r0 + 8, s1);                                           \
        }                                                                                                     \
        if (GATHER) {                                                                                         \
            __m256 k0 = _mm256_broadcast_ss(kn + (R)), q0 = _mm256_broadcast_ss(qn + (R));                    \
            A0 = _mm256_fmadd_ps(k0, s0, A0); A1 = _mm256_fmadd_ps(k0, s1, A1);                               \
            B0 = _mm256_fmadd_ps(q0, s0, B0); B1 = _mm256_fmadd_ps(q0, s1, B1);                               \
        }                                                                                                     \
    }
#define DR_PASS(UPDATE, GATHER)                                                                               \
    do {                                                                                                      \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, e0 = a0, e1 = a0, f0 = a0, f1 = a0;       \
        int i = 0;                                                                                            \
        for (; i + 2 <= dk; i += 2) {                                                                         \
            DR_ROW(i, UPDATE, GATHER, a0, a1, b0, b1)                                                         \
            DR_ROW(i + 1, UPDATE, GATHER, e0, e1, f0, f1)                                                     \
        }                                                                                                     \
        if (i < dk) DR_ROW(i, UPDATE, GATHER, a0, a1, b0, b1)                                                 \
        if (GATHER) {                                                                                         \
            kv[0] = _mm256_add_ps(a0, e0); kv[1] = _mm256_add_ps(a1, e1);                                     \
            qs[0] = _mm256_add_ps(b0, f0); qs[1] = _mm256_add_ps(b1, f1);                                     \
        }                                                                                                     \
    } while (0)

#define DR_RESCALE 9.094947e-13f  /* 2^-40 */

int ds_delta_rule(const float *q, const float *k, const float *v, const float *g, const float *beta, float *S,
                  float *out, int T, int H, int dk, int dv, int nthreads) {
    if (T <= 0 || H <= 0 || dk <= 0 || dv <= 0 || dv % 16) return -1;
    int per_head = dv / 16;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int item = 0; item < H * per_head; item++) {
        int h = item / per_head, c0 = (item % per_head) * 16;
        float *s = S + (size_t)h * dk * dv + c0;
        float c = 1.0f;  /* S = c S' */
        __m256 zero = _mm256_setzero_ps(), kv[2] = {zero, zero}, qs[2] = {zero, zero};
        {  /* what the first token reads */
            const float *kn = k + (size_t)h * dk, *qn = q + (size_t)h * dk, *ku = NULL;
            __m256 vd = zero, d0 = zero, d1 = zero;
            (void)ku; (void)vd; (void)d0; (void)d1;
            DR_PASS(0, 1);
        }
        for (int t = 0; t < T; t++) {
            size_t th = (size_t)t * H + h;
            const float *kt = k + th * dk, *qt = q + th * dk, *vt = v + th * dv + c0;
            __m256 kqv = _mm256_setzero_ps();
            int i = 0;
            for (; i + 8 <= dk; i += 8) kqv = _mm256_fmadd_ps(_mm256_loadu_ps(kt + i), _mm256_loadu_ps(qt + i), kqv);
            float kq = blk_hsum8(kqv);
            for (; i < dk; i++) kq += kt[i] * qt[i];
            float decay = expf(g[th]), cd = c * decay;  /* S_old = c S', S_old e^g = cd S' */
            __m256 vc = _mm256_set1_ps(cd), vb = _mm256_set1_ps(beta[th]), vkq = _mm256_set1_ps(kq);
            __m256 d0 = _mm256_mul_ps(vb, _mm256_fnmadd_ps(vc, kv[0], _mm256_loadu_ps(vt)));
            __m256 d1 = _mm256_mul_ps(vb, _mm256_fnmadd_ps(vc, kv[1], _mm256_loadu_ps(vt + 8)));
            float *ot = out + th * dv + c0;
            _mm256_storeu_ps(ot, _mm256_fmadd_ps(vkq, d0, _mm256_mul_ps(vc, qs[0])));
            _mm256_storeu_ps(ot + 8, _mm256_fmadd_ps(vkq, d1, _mm256_mul_ps(vc, qs[1])));
            const float *ku = kt, *kn = k + (th + H) * dk, *qn = q + (th + H) * dk;
            if (t + 1 < T && cd >= DR_RESCALE) {  /* S' += k delta^T / cd: S_new = cd S' */
                __m256 inv = _mm256_set1_ps(1.0f / cd), vd = zero;
                (void)vd;
                d0 = _mm256_mul_ps(d0, inv);
                d1 = _mm256_mul_ps(d1, inv);
                c = cd;
                DR_PASS(1, 1);
            } else {  /* S' = cd S' + k delta^T: S_new = S' */
                __m256 vd = vc;
                c = 1.0f;
                if (t + 1 < T) DR_PASS(2, 1); else DR_PASS(2, 0);
            }
        }
    }
    return 0;
}

#endif  /* DS_AVX2 && !DS_TABLES */
