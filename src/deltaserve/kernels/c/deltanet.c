/* deltanet.c: one decode token of a Gated DeltaNet mixer (ds_deltanet_step, and dn_mix/dn_head for the one-call
 * decode), on AVX2, FMA and F16C: every build. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "deltanet.h"
#include "vmath.h"

#ifdef DS_AVX2

/* ---------------------------------------------------------------------------------------------------------
 * One token of a Gated DeltaNet mixer, after its input projections and before its output projection: the causal
 * conv (updating conv_state [Kc-1, C]) and SiLU, the L2-normalised q (scaled by dk^-1/2) and k, the gates
 * beta = sigmoid(b), g = a_neg * softplus(a + dt_bias), the gated delta rule on S [nv, dk, dv] (S = e^g S;
 * delta = beta (v - S^T k); S += k delta^T; o = S^T q) and the gated RMS norm o * rsqrt(mean(o^2) + eps) * norm_w *
 * silu(z): layers.py's math in one pass per head (torch's version is ~40 small ops per layer). Value head h reads
 * key head h / (nv / nk) ("grouped") or h % nk ("tiled").
 * ------------------------------------------------------------------------------------------------------- */

/* The conv over [conv_state; qkv] (the state shifts by one), SiLU, and the L2 norms of the q (scaled by
 * dk^-1/2) and k heads, into u [C]. Serial: C is a few thousand values. */
void dn_mix(const float *qkv, const float *conv_w, float *conv_state, float *u, int C, int Kc, int nk, int dk) {
    for (int c = 0; c < C; c++) {
        const float *w = conv_w + (size_t)c * Kc;
        float acc = w[Kc - 1] * qkv[c];
        for (int j = 0; j < Kc - 1; j++) acc += w[j] * conv_state[(size_t)j * C + c];
        for (int j = 0; j < Kc - 2; j++) conv_state[(size_t)j * C + c] = conv_state[(size_t)(j + 1) * C + c];
        conv_state[(size_t)(Kc - 2) * C + c] = qkv[c];
        u[c] = acc;
    }
    silu_inplace(u, C);
    for (int hh = 0; hh < 2 * nk; hh++) {
        float *x = u + (size_t)hh * dk, ss = 0.0f;
        for (int i = 0; i < dk; i++) ss += x[i] * x[i];
        float r = 1.0f / sqrtf(ss + 1e-6f);
        if (hh < nk) r *= 1.0f / sqrtf((float)dk);
        for (int i = 0; i < dk; i++) x[i] *= r;
    }
}

/* Value head h of the step, after dn_mix: the gates, the delta rule on its state, the gated RMS norm. One pass
 * over the old state gathers S^T k and S^T q; the second applies the update (o = e^g S^T q + (k.q) delta). */
void dn_head(int h, const float *u, const float *z, const float *b, const float *a, const float *a_neg,
                    const float *dt_bias, const float *norm_w, float *S, float *out, int nk, int dk, int nv, int dv,
                    int tiled, float eps) {
    const float *q = u, *k = u + nk * dk, *v = u + 2 * nk * dk;
    int kh = tiled ? h % nk : h / (nv / nk);
    const float *kk = k + (size_t)kh * dk, *qq = q + (size_t)kh * dk, *vv = v + (size_t)h * dv;
    float beta = 1.0f / (1.0f + expf(-b[h]));
    float sp = a[h] + dt_bias[h];
    sp = sp > 20.0f ? sp : log1pf(expf(sp));
    float decay = expf(a_neg[h] * sp);
    float *s = S + (size_t)h * dk * dv;
    float kv[dv], sq[dv], delta[dv], o[dv];
    float kq = 0.0f;
    for (int i = 0; i < dk; i++) kq += kk[i] * qq[i];
    for (int j = 0; j < dv; j++) kv[j] = sq[j] = 0.0f;
    for (int i = 0; i < dk; i++) {
        float ki = kk[i], qi = qq[i];
        const float *row = s + (size_t)i * dv;
        for (int j = 0; j < dv; j++) { kv[j] += ki * row[j]; sq[j] += qi * row[j]; }
    }
    for (int j = 0; j < dv; j++) {
        delta[j] = beta * (vv[j] - decay * kv[j]);
        o[j] = decay * sq[j] + kq * delta[j];
    }
    for (int i = 0; i < dk; i++) {
        float ki = kk[i];
        float *row = s + (size_t)i * dv;
        for (int j = 0; j < dv; j++) row[j] = decay * row[j] + ki * delta[j];
    }
    float ss = 0.0f;
    for (int j = 0; j < dv; j++) ss += o[j] * o[j];
    float r = 1.0f / sqrtf(ss / (float)dv + eps);
    float gate[dv];
    for (int j = 0; j < dv; j++) gate[j] = z[(size_t)h * dv + j];
    silu_inplace(gate, dv);
    for (int j = 0; j < dv; j++) out[(size_t)h * dv + j] = o[j] * r * norm_w[j] * gate[j];
}

int ds_deltanet_step(const float *qkv, const float *z, const float *b, const float *a, const float *conv_w,
                     const float *a_neg, const float *dt_bias, const float *norm_w, float *conv_state, float *S,
                     float *out, int nk, int dk, int nv, int dv, int Kc, int tiled, float eps, int nthreads) {
    int C = 2 * nk * dk + nv * dv;
    if (nk <= 0 || nv % nk || Kc < 2 || dk <= 0 || dv <= 0) return -1;
    float *u = malloc((size_t)C * sizeof(float));
    if (!u) return -1;
    dn_mix(qkv, conv_w, conv_state, u, C, Kc, nk, dk);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int h = 0; h < nv; h++) dn_head(h, u, z, b, a, a_neg, dt_bias, norm_w, S, out, nk, dk, nv, dv, tiled, eps);
    free(u);
    return 0;
}
#endif  /* DS_AVX2 */
