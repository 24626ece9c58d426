/* native_avx2.c: the DeltaNet kernels and the one-call token decode on AVX2, FMA and F16C:
 *
 * - ds_deltanet_step: one decode token of a DeltaNet mixer between its projections (every CPU);
 * - ds_decode_tokens: one token through the whole model in one call, for a batch of up to 8 sequences (every CPU).
 *   Each product's segments (native.h's seg_t) run where their type says: the file's own blocks (GGUF type ids:
 *   F16 1, Q4_0 2, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14, BF16 30) on blocks.c's products (activations quantized as
 *   llama.cpp does, see blocks.h), F32 rows here, and where native.c is compiled (AVX512-VNNI) its int8 tables
 *   (DS_I8) and repacked Q4_K blocks (DS_Q4KR) on its products (tables.h);
 * - ds_delta_rule: the prefill's gated delta rule token by token, the state split into 16-column slices (two ymm a
 *   row, 8 KB a slice) that stay in L1 for the whole span, and ds_causal_conv: the depthwise causal conv + SiLU over
 *   a span in one pass: for CPUs without AVX512 (an AMD EPYC Zen 3, say); native.c holds its own where it runs.
 */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#include "blocks.h"
#include "tables.h"
#include "vmath.h"  /* exp256: native.c's exp512 on 8 lanes */

#define MAXM DS_MAX_ROWS

static inline __m256 silu256(__m256 x) {
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

/* v[i] = silu(v[i]) = v / (1 + e^-v), in place, n values (the tail through the same vector code) */
static void silu_inplace(float *v, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, silu256(_mm256_loadu_ps(v + i)));
    if (i < n) {
        float t[8] = {0};
        for (int j = 0; j < n - i; j++) t[j] = v[i + j];
        _mm256_storeu_ps(t, silu256(_mm256_loadu_ps(t)));
        for (int j = 0; j < n - i; j++) v[i + j] = t[j];
    }
}

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
static void dn_mix(const float *qkv, const float *conv_w, float *conv_state, float *u, int C, int Kc, int nk, int dk) {
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
static void dn_head(int h, const float *u, const float *z, const float *b, const float *a, const float *a_neg,
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

#ifndef DS_TABLES  /* native.c's ds_causal_conv and ds_delta_rule where it is compiled */
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
 * S = e^g S; delta = beta (v - S^T k); S += k delta^T; o = S^T q (native.c's ds_delta_rule). The work is split
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

#endif  /* !DS_TABLES */

/* ---------------------------------------------------------------------------------------------------------
 * One token through the whole model in one call, for B <= 8 sequences: every layer's RMSNorms, products, DeltaNet
 * or attention step, SwiGLU and residual adds, then the final norm and the head, in one OpenMP team (the products
 * and the per-head steps are shared among its threads, the small serial pieces run on one), no Python or per-op
 * dispatch between the ~25 operations of a layer. A lin_t segment's type says whose product reads it: a GGUF
 * type id (the file's own blocks: blocks.c), 0 (F32 rows: here), DS_I8 or DS_Q4KR (native.c, where compiled); a
 * stacked linear may mix them, and each kind of activation quantization that occurs is prepared once per product.
 * ------------------------------------------------------------------------------------------------------- */
/* seg_t, lin_t, layer_t, model_t: native.h */

#define TAB0 (BLK_KINDS - 1)  /* tables.h's kind k (1, 2) is kind TAB0 + k here, after blk_kind's */
#define NKIND (TAB0 + 3)      /* 0: F32 rows, no preparation */

/* sum of x[i]^2 over n values: 8 lanes of fused multiply-adds, then the lanes and the tail in order */
static float sum_squares(const float *x, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) { __m256 v = _mm256_loadu_ps(x + i); acc = _mm256_fmadd_ps(v, v, acc); }
    float ss = blk_hsum8(acc);
    for (; i < n; i++) ss += x[i] * x[i];
    return ss;
}

static void rms_norm_row(const float *x, const float *w, float *out, int n, float eps) {
    float r = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* ---- a prefill's row-wise steps, one pass over each row (torch's versions take 3-6 passes and as many
 * temporaries: a fifth of a 0.8B prefill's time outside its products). Rows may lie apart (views of a wider
 * projection's output, read in place). Each runs its rows on the team where they are many. ---- */

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

static int lin_rows(const lin_t *L) {
    int n = 0;
    for (int s = 0; s < L->nseg; s++) n += L->seg[s].rows;
    return n;
}

/* The kind of a segment's activations: blk_kind's for a block type, TAB0 + tab_kind's for a table, 0 for F32
 * rows, -1 for what is not taken here. */
static int seg_kind(const seg_t *g, int K) {
    if (g->type == 0) return 0;
    int kind = blk_kind(g->type);
    if (kind > 0) return K % blk_values(g->type) ? -1 : kind;
#ifdef DS_TABLES
    kind = tab_kind(g->type);
    if (kind > 0) return K % (kind == 1 ? 32 : 256) || (kind == 1 && !g->scale) ? -1 : TAB0 + kind;
#endif
    return -1;
}

static int lin_ok(const lin_t *L) {
    if (L->nseg < 1 || L->nseg > DS_MAX_SEGMENTS || L->K <= 0) return 0;
    for (int s = 0; s < L->nseg; s++)
        if (L->seg[s].rows <= 0 || !L->seg[s].data || seg_kind(&L->seg[s], L->K) < 0) return 0;
    return 1;
}

/* F32 rows [N, K] against M activation rows (stride K): an orphaned worksharing loop, no barrier. */
static void f32_tiles(const float *W, int N, int K, const float *x, int M, float *y, long ldy) {
    #pragma omp for schedule(static) nowait
    for (int n = 0; n < N; n++) {
        const float *w = W + (size_t)n * K;
        for (int m = 0; m < M; m++) {
            const float *xm = x + (size_t)m * K;
            __m256 acc = _mm256_setzero_ps();
            int k = 0;
            for (; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(xm + k), acc);
            float sum = blk_hsum8(acc);
            for (; k < K; k++) sum += w[k] * xm[k];
            y[(size_t)m * ldy + n] = sum;
        }
    }
}

/* Rows from which a decode call's products go through blocks.c's GEMM (its panels packed once per product for all
 * the rows) instead of the decode tiles (which decode a tile's weights once per pair of rows): 0, never. */
static int g_gemm_rows = 0;
int ds_set_decode_gemm(int rows) { g_gemm_rows = rows; return 0; }

typedef struct {  /* a thread's view of the GEMM's buffers in a decode call */
    void *act;    /* the prepared activations, shared by the team (blk_gemm_act_bytes) */
    void *work;   /* this thread's panel buffer (blk_gemm_work_bytes) */
} gemm_ctx_t;
static __thread const gemm_ctx_t *t_gemm;  /* set by ds_decode_tokens for its team's threads, NULL elsewhere */

#ifdef BLK_GEMM
/* A stacked linear on the GEMM where every segment's type takes it: 1 done (ends on a barrier), 0 not taken. */
static int team_gemm(const lin_t *L, const float *x, int M, float *y, const gemm_ctx_t *g) {
    int K = L->K, ldy = lin_rows(L);
    for (int s = 0; s < L->nseg; s++)
        if (L->seg[s].type == 0 || seg_kind(&L->seg[s], K) <= 0 || seg_kind(&L->seg[s], K) >= NKIND
            || !blk_gemm_type(L->seg[s].type)) return 0;
    int off = 0, prepared = -1;
    for (int s = 0; s < L->nseg; s++) {
        const seg_t *sg = &L->seg[s];
        if (sg->type != prepared) {  /* a worksharing loop and its barrier: the rows quantized as this type wants */
            blk_gemm_prepare(sg->type, x, M, K, K, NULL, g->act);
            prepared = sg->type;
        }
        const int panels = blk_gemm_panels(sg->rows);
        #pragma omp for schedule(static)  /* its barrier: the next segment may prepare the rows again */
        for (int p = 0; p < panels; p++)
            blk_gemm_panel(sg->type, (const uint8_t *)sg->data, sg->rows, K, p, g->act, M, 0, M, y + off, ldy, g->work,
                           p + 1 < panels ? blk_gemm_panel_at(sg->type, (const uint8_t *)sg->data, K, p + 1) : NULL,
                           p + 1 < panels ? blk_gemm_panel_bytes(sg->type, sg->rows, K, p + 1) : 0);
        off += sg->rows;
    }
    return 1;
}
#endif

/* y [M, N] = x [M, K] W^T for a stacked linear (rows of x and y contiguous); called by every thread of the team
 * (the rows are shared among them); ends on a barrier. scratch[kind]: scratch_bytes(kind, M, K) or more each. */
static void team_product(const lin_t *L, const float *x, int M, float *y, void *const *scratch) {
#ifdef BLK_GEMM
    if (t_gemm && g_gemm_rows > 0 && M >= g_gemm_rows && team_gemm(L, x, M, y, t_gemm)) return;
#endif
    int K = L->K, ldy = lin_rows(L), need[NKIND] = {0};
    for (int s = 0; s < L->nseg; s++) need[seg_kind(&L->seg[s], K)] = 1;
    for (int kind = 1; kind < NKIND; kind++) {  /* each ends on its barrier */
        if (!need[kind]) continue;
#ifdef DS_TABLES
        if (kind > TAB0) { tab_prepare(kind - TAB0, x, M, K, scratch[kind]); continue; }
#endif
        blk_prepare(kind, x, M, K, K, scratch[kind]);
    }
    int off = 0;
    for (int s = 0; s < L->nseg; s++) {  /* each segment's rows shared out without a barrier between them */
        const seg_t *g = &L->seg[s];
        int kind = seg_kind(g, K);
        if (kind == 0) f32_tiles((const float *)g->data, g->rows, K, x, M, y + off, ldy);
#ifdef DS_TABLES
        else if (kind > TAB0) tab_tiles(g, K, scratch[kind], M, y + off, ldy);
#endif
        else blk_tiles(g->type, (const uint8_t *)g->data, g->rows, K, scratch[kind], M, y + off, ldy);
        off += g->rows;
    }
    #pragma omp barrier
}

static size_t scratch_bytes(int kind, int M, int K) {
    (void)kind;
#ifdef DS_TABLES
    if (kind > TAB0) return tab_scratch_bytes(M, K);
#endif
    return blk_scratch_bytes(M, K);
}

/* q/k RMS norm per head, rotary embedding (rotate-half over the first `rotary` dims) at rotary position `rpos`, k
 * and v written at `pos` of the caches [nkv, cap, hd]; the rotated queries to qout [nh, hd]. Serial. (rpos is pos
 * for text; after an image the positions fall behind the cache index: vision/span.py.) */
static void attn_prepare(const model_t *m, const layer_t *L, const float *qkv, float *kc, float *vc, int pos,
                         int rpos, int cap, float *qout) {
    int nh = m->nh, nkv = m->nkv, hd = m->hd, r = m->rotary, half = r / 2;
    float cs[half + 1], sn[half + 1];
    for (int i = 0; i < half; i++) {
        float inv = 1.0f / powf(m->theta, (float)(2 * i) / (float)r);
        float f = (float)rpos * inv;
        cs[i] = cosf(f);
        sn[i] = sinf(f);
    }
    const float *kin = qkv + (size_t)nh * 2 * hd, *vin = kin + (size_t)nkv * hd;
    for (int h = 0; h < nh + nkv; h++) {
        int is_q = h < nh;
        const float *src = is_q ? qkv + (size_t)h * 2 * hd : kin + (size_t)(h - nh) * hd;
        float *dst = is_q ? qout + (size_t)h * hd : kc + ((size_t)(h - nh) * cap + pos) * hd;
        float t[hd];
        rms_norm_row(src, is_q ? L->q_norm : L->k_norm, t, hd, m->eps);
        for (int i = 0; i < half; i++) {
            dst[i] = t[i] * cs[i] - t[i + half] * sn[i];
            dst[i + half] = t[i + half] * cs[i] + t[i] * sn[i];
        }
        for (int i = r; i < hd; i++) dst[i] = t[i];
    }
    for (int h = 0; h < nkv; h++)
        for (int i = 0; i < hd; i++) vc[((size_t)h * cap + pos) * hd + i] = vin[(size_t)h * hd + i];
}

/* Query head h over cache positions 0..pos, softmax in f32, times sigmoid of its output gate: out [hd]. */
static void attn_head(const model_t *m, int h, const float *qkv, const float *q, const float *kc, const float *vc,
                      int pos, int cap, float *scores, float *out) {
    int hd = m->hd, kvh = h / (m->nh / m->nkv), n = pos + 1;
    const float *qh = q + (size_t)h * hd, *keys = kc + (size_t)kvh * cap * hd, *vals = vc + (size_t)kvh * cap * hd;
    float scale = 1.0f / sqrtf((float)hd), mx = -INFINITY;
    for (int t = 0; t < n; t++) {
        const float *kt = keys + (size_t)t * hd;
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < hd; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(kt + i), acc);
        float sc = blk_hsum8(acc) * scale;
        scores[t] = sc;
        if (sc > mx) mx = sc;
    }
    __m256 vsum = _mm256_setzero_ps(), vmx = _mm256_set1_ps(mx);
    int t0 = 0;
    for (; t0 + 8 <= n; t0 += 8) {  /* e^(s - max) eight at a time (a long context has thousands per head) */
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + t0), vmx));
        _mm256_storeu_ps(scores + t0, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = blk_hsum8(vsum);
    for (int t = t0; t < n; t++) { scores[t] = expf(scores[t] - mx); sum += scores[t]; }
    float o[hd];
    for (int i = 0; i < hd; i++) o[i] = 0.0f;
    for (int t = 0; t < n; t++) {
        const float *vt = vals + (size_t)t * hd;
        float p = scores[t] / sum;
        for (int i = 0; i < hd; i++) o[i] += p * vt[i];
    }
    const float *gate = qkv + (size_t)h * 2 * hd + hd;
    for (int i = 0; i < hd; i++) out[(size_t)h * hd + i] = o[i] / (1.0f + expf(-gate[i]));
}

/* ---- the MoE block (qwen35moe): a router over n_expert experts, the top n_used a token, and a shared expert ---- */

/* The top k of E router logits (the larger first; of equal ones the lower expert), and their softmax weights
 * renormalised over the k (the softmax's denominator cancels: e^(l - max) / the k's sum): transformers'
 * Qwen3_5MoeTopKRouter, llama.cpp's qwen35moe (softmax gating, weights normalised). */
static void moe_route(const float *logits, int E, int k, int *sel, float *w) {
    unsigned char taken[E];
    for (int e = 0; e < E; e++) taken[e] = 0;
    float top = -INFINITY, sum = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || logits[e] > logits[best])) best = e;
        taken[best] = 1;
        sel[j] = best;
        if (j == 0) top = logits[best];
        w[j] = expf(logits[best] - top);
        sum += w[j];
    }
    for (int j = 0; j < k; j++) w[j] /= sum;
}

/* pairs from which an expert's product runs on blocks.c's GEMM (ds_moe_experts): on AVX2 the GEMM overtakes the row
 * products from 5-6 rows ([512, 2048] Q4_K: 74 against 81 us at 6, 86 against 99 at 8; Xeon built for AVX2) */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)  /* (blocks.c's BLK_VNNI) */
#define MOE_GEMM_ROWS 8
#else
#define MOE_GEMM_ROWS 6
#endif

/* expert e's first row of an experts_t of inner size K (blocks) */
static const uint8_t *expert_rows(const experts_t *X, int e, int K) {
    return (const uint8_t *)X->data + (size_t)e * X->stride * blk_row_bytes(X->type, K);
}


/* One expert's rows of an experts_t times M activation rows: rows m_first .. m_first + M of a scratch prepared for
 * Mall rows (blocks), or the f32 rows x (F32): an orphaned worksharing loop, no barrier. */
static void expert_tiles(const experts_t *X, int e, int K, const float *x, void *scratch, int Mall, int m_first, int M,
                         float *y, long ldy) {
    if (X->type == 0) {
        f32_tiles((const float *)X->data + (size_t)e * X->stride * K, X->rows, K, x, M, y, ldy);
        return;
    }
    blk_tiles_rows(X->type, expert_rows(X, e, K), X->rows, K, scratch, Mall, m_first, M, y, ldy);
}

static int experts_ok(const experts_t *X, int K, int rows) {
    return X->data && X->rows == rows && X->stride >= X->rows
        && (X->type == 0 || (blk_kind(X->type) > 0 && K % blk_values(X->type) == 0));
}

/* the MoE block's buffers for one call: U = min(n_expert, B n_used) experts at most in a layer */
typedef struct {
    float *logits, *gu, *mid, *out, *shared, *w;
    int *sel, *uniq, *slot, nu;
    void *scratch;     /* blk_scratch_bytes(U B, ff): every chosen expert's B rows of its down projection's input */
} moe_buf_t;

static void swiglu_rows(const float *gu, float *out, int rows, int I) {
    for (int r = 0; r < rows; r++) {
        float *g = (float *)gu + (size_t)r * 2 * I, *o = out + (size_t)r * I;
        silu_inplace(g, I);
        for (int j = 0; j < I; j++) o[j] = g[j] * g[I + j];
    }
}

/* x [B, H] += the MoE block of h [B, H] (the normed residual): the shared expert (gate_up, down) scaled by the
 * sigmoid of its gate, plus each token's n_used experts weighted by the router. Each expert any of the B rows
 * chose is read once, for all B rows (decode reads weights, not arithmetic). Called by every thread of the team. */
static void moe_ffn(const layer_t *L, int B, int H, const float *h, float *x, float *big, float *mid,
                    void *const *scratch, moe_buf_t *mb) {
    int E = L->n_expert, k = L->n_used, ff = L->exp_gate.rows, I = lin_rows(&L->gate_up) / 2;
    team_product(&L->router, h, B, mb->logits, scratch);  /* [B, E + 1]: the router's logits, the shared gate */
    team_product(&L->gate_up, h, B, big, scratch);
    #pragma omp for schedule(static)
    for (int b = 0; b < B; b++) swiglu_rows(big + (size_t)b * 2 * I, mid + (size_t)b * I, 1, I);
    team_product(&L->down, mid, B, mb->shared, scratch);
    #pragma omp single
    {
        int nu = 0;
        for (int b = 0; b < B; b++) {
            moe_route(mb->logits + (size_t)b * (E + 1), E, k, mb->sel + b * k, mb->w + b * k);
            for (int j = 0; j < k; j++) {
                int e = mb->sel[b * k + j], u = 0;
                while (u < nu && mb->uniq[u] != e) u++;
                if (u == nu) mb->uniq[nu++] = e;
                mb->slot[b * k + j] = u;
            }
        }
        mb->nu = nu;
    }
    int nu = mb->nu, kg = blk_kind(L->exp_gate.type), ku = blk_kind(L->exp_up.type), kd = blk_kind(L->exp_down.type);
    if (kg) blk_prepare(kg, h, B, H, H, scratch[kg]);
    if (ku && ku != kg) blk_prepare(ku, h, B, H, H, scratch[ku]);
    for (int u = 0; u < nu; u++) {  /* every chosen expert's gate and up rows, shared out without barriers */
        float *gu = mb->gu + (size_t)u * B * 2 * ff;
        expert_tiles(&L->exp_gate, mb->uniq[u], H, h, scratch[kg], B, 0, B, gu, 2 * ff);
        expert_tiles(&L->exp_up, mb->uniq[u], H, h, scratch[ku], B, 0, B, gu + ff, 2 * ff);
    }
    #pragma omp barrier
    #pragma omp for schedule(static)
    for (int t = 0; t < nu * B; t++) swiglu_rows(mb->gu + (size_t)t * 2 * ff, mb->mid + (size_t)t * ff, 1, ff);
    if (kd) blk_prepare_rows(kd, mb->mid, nu * B, ff, ff, NULL, mb->scratch);
    for (int u = 0; u < nu; u++)
        expert_tiles(&L->exp_down, mb->uniq[u], ff, mb->mid + (size_t)u * B * ff, mb->scratch, nu * B, u * B, B,
                     mb->out + (size_t)u * B * H, H);
    #pragma omp barrier
    #pragma omp for schedule(static)
    for (int b = 0; b < B; b++) {
        float g = 1.0f / (1.0f + expf(-mb->logits[(size_t)b * (E + 1) + E]));
        float *xb = x + (size_t)b * H;
        const float *sh = mb->shared + (size_t)b * H;
        for (int j = 0; j < H; j++) xb[j] += g * sh[j];
        for (int j = 0; j < k; j++) {
            const float *o = mb->out + ((size_t)mb->slot[b * k + j] * B + b) * H;
            float wj = mb->w[b * k + j];
            for (int i = 0; i < H; i++) xb[i] += wj * o[i];
        }
    }
}

/* An MoE layer's shapes, checked before anything is touched. */
static int moe_ok(const layer_t *L, int H) {
    int E = L->n_expert, ff = L->exp_gate.rows;
    return E > 0 && L->n_used >= 1 && L->n_used <= E && L->n_used <= DS_MAX_USED && ff > 0
        && lin_ok(&L->router) && L->router.K == H && lin_rows(&L->router) == E + 1
        && experts_ok(&L->exp_gate, H, ff) && experts_ok(&L->exp_up, H, ff) && experts_ok(&L->exp_down, ff, H);
}

/* The routed experts of one MoE layer over a prefill's P (row, expert) pairs, grouped by expert: the u-th expert used,
 * uniq[u], takes the pairs first[u] .. first[u] + count[u]; pair i reads row rows[i] of x [*, H] and writes
 * out[i] = weights[i] expert(x[rows[i]]) ([P, H]). Each expert's rows of the three tensors are read once for all its
 * pairs (the activations prepared once, as the types' products want them); one OpenMP team for the whole layer.
 * Blocks only (not F32). Returns 0, or -1 (nothing written) where a type or a shape is not taken or memory ran out.
 * `slot` and `y` (both or neither): the layer's routed sum in place of out's weighting: y [P / k, H] with
 * y[r] = sum over j < k (in order) of weights[s] out[s], s = slot[r k + j] (where row r's j-th choice sits among the
 * pairs); out then keeps the unweighted products. `ws` (may be NULL: allocated here): P 3 ff floats for the gate and
 * up products and their SwiGLU, the caller's buffer reused across a chunk's layers (fresh pages cost a fault each). */
#ifdef BLK_GEMM
/* This thread's share [lo, hi) of n experts' items (per items of each, expert gl[i]'s count[gl[i]] pairs): runs
 * of consecutive items of about equal cost, a panel's packing costing about MOE_PACK_PAIRS pairs' products, so that
 * a thread knows the item it takes next and fetches its bytes ahead. */
#define MOE_PACK_PAIRS 8
static void moe_share(int n, int per, const int *gl, const int *count, int *lo, int *hi) {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    long total = 0;
    for (int i = 0; i < n; i++) total += (long)per * (MOE_PACK_PAIRS + count[gl[i]]);
    const long from = total * t / nt, to = total * (t + 1) / nt;
    long at = 0;
    *lo = *hi = n * per;
    for (int it = 0, first = 1; it < n * per; it++) {
        if (first && at >= from) *lo = it, first = 0;
        if (at >= to) { *hi = it; break; }
        at += MOE_PACK_PAIRS + count[gl[it / per]];
    }
    if (*lo > *hi) *lo = *hi;
}
#endif

int ds_moe_experts(const experts_t *G, const experts_t *U, const experts_t *D, int H, int nu, const int *uniq,
                   const int *first, const int *count, const float *x, const int *rows, const float *weights, int P,
                   float *out, int nthreads, const int *slot, int k, float *y, float *ws) {
    int ff = G->rows, kg = blk_kind(G->type), ku = blk_kind(U->type), kd = blk_kind(D->type);
    if (P < 1 || nu < 1 || !kg || !ku || !kd || !experts_ok(G, H, ff) || !experts_ok(U, H, ff) || !experts_ok(D, ff, H)
        || (!slot) != (!y) || (y && (k < 1 || P % k)))
        return -1;
    /* an expert with MOE_GEMM_ROWS pairs or more runs on blocks.c's GEMM (where built: the panels of its weights pay
       off from about that many rows), each panel of 32 of its rows a work item of the team; the others on the tiles */
    int *gl = malloc((size_t)nu * sizeof(int)), ng = 0, tiles = 0;
    if (!gl) return -1;
#ifdef BLK_GEMM
    const int gemm_all = blk_gemm_type(G->type) && blk_gemm_type(U->type) && blk_gemm_type(D->type);
#else
    const int gemm_all = 0;
#endif
    for (int u = 0; u < nu; u++) {
        if (gemm_all && count[u] >= MOE_GEMM_ROWS) gl[ng++] = u;
        else tiles = 1;
    }
    float *gu = ws ? ws : malloc((size_t)P * 3 * ff * sizeof(float)), *mid = gu ? gu + (size_t)P * 2 * ff : NULL;
    void *ag = NULL, *au = NULL, *ad = NULL, *xg = NULL, *xu = NULL, *xd = NULL;
    int ok = gu && mid;
    if (tiles) {
        ag = malloc(blk_scratch_bytes(P, H)), au = ku != kg ? malloc(blk_scratch_bytes(P, H)) : ag;
        ad = malloc(blk_scratch_bytes(P, ff));
        ok = ok && ag && au && ad;
    }
#ifdef BLK_GEMM
    if (ng) {
        xg = aligned_alloc(64, blk_gemm_act_bytes(P, H)), xu = U->type != G->type ? aligned_alloc(64, blk_gemm_act_bytes(P, H)) : xg;
        xd = aligned_alloc(64, blk_gemm_act_bytes(P, ff));
        ok = ok && xg && xu && xd;
    }
#endif
#ifdef BLK_GEMM
    const int pg = (ff + 31) / 32, pd = (H + 31) / 32;  /* panels of 32 rows */
#endif
    int failed = !ok;
    if (ok) {
        #pragma omp parallel num_threads(nthreads)
        {
            void *work = NULL;
#ifdef BLK_GEMM
            if (ng && !(work = aligned_alloc(64, blk_gemm_work_bytes(H > ff ? H : ff)))) {
                #pragma omp atomic write
                failed = 1;
            }
            if (ng) {
                blk_gemm_prepare(G->type, x, P, H, H, rows, xg);
                if (xu != xg) blk_gemm_prepare(U->type, x, P, H, H, rows, xu);
            }
#endif
            if (tiles) {
                blk_prepare_rows(kg, x, P, H, H, rows, ag);
                if (au != ag) blk_prepare_rows(ku, x, P, H, H, rows, au);
            }
            for (int u = 0; u < nu && tiles; u++) {
                if (gemm_all && count[u] >= MOE_GEMM_ROWS) continue;
                float *g = gu + (size_t)first[u] * 2 * ff;
                expert_tiles(G, uniq[u], H, NULL, ag, P, first[u], count[u], g, 2 * ff);
                expert_tiles(U, uniq[u], H, NULL, au, P, first[u], count[u], g + ff, 2 * ff);
            }
#ifdef BLK_GEMM
            /* the gate and up panels: each thread a run of consecutive ones of about equal cost, the next panel's
               bytes fetched while one is multiplied */
            int lo, hi;
            moe_share(ng, 2 * pg, gl, count, &lo, &hi);
            for (int it = lo; it < hi && !failed; it++) {
                const uint8_t *next = NULL;
                size_t nbytes = 0;
                if (it + 1 < hi) {
                    const int u = gl[(it + 1) / (2 * pg)], up = ((it + 1) / pg) % 2, p = (it + 1) % pg;
                    const experts_t *X = up ? U : G;
                    next = blk_gemm_panel_at(X->type, expert_rows(X, uniq[u], H), H, p);
                    nbytes = blk_gemm_panel_bytes(X->type, ff, H, p);
                }
                const int u = gl[it / (2 * pg)], up = (it / pg) % 2, p = it % pg;
                const experts_t *X = up ? U : G;
                blk_gemm_panel(X->type, expert_rows(X, uniq[u], H), ff, H, p, up ? xu : xg, P, first[u], count[u],
                               gu + (size_t)first[u] * 2 * ff + up * ff, 2 * ff, work, next, nbytes);
            }
            #pragma omp barrier
#else
            #pragma omp barrier
#endif
            #pragma omp for schedule(static)
            for (int i = 0; i < P; i++) swiglu_rows(gu + (size_t)i * 2 * ff, mid + (size_t)i * ff, 1, ff);
#ifdef BLK_GEMM
            if (ng) blk_gemm_prepare(D->type, mid, P, ff, ff, NULL, xd);
#endif
            if (tiles) blk_prepare_rows(kd, mid, P, ff, ff, NULL, ad);
            for (int u = 0; u < nu && tiles; u++)
                if (!(gemm_all && count[u] >= MOE_GEMM_ROWS))
                    expert_tiles(D, uniq[u], ff, NULL, ad, P, first[u], count[u], out + (size_t)first[u] * H, H);
#ifdef BLK_GEMM
            moe_share(ng, pd, gl, count, &lo, &hi);
            for (int it = lo; it < hi && !failed; it++) {
                const int u = gl[it / pd], p = it % pd, nu_ = it + 1 < hi ? gl[(it + 1) / pd] : 0, np = (it + 1) % pd;
                blk_gemm_panel(D->type, expert_rows(D, uniq[u], ff), H, ff, p, xd, P, first[u], count[u],
                               out + (size_t)first[u] * H, H, work,
                               it + 1 < hi ? blk_gemm_panel_at(D->type, expert_rows(D, uniq[nu_], ff), ff, np) : NULL,
                               it + 1 < hi ? blk_gemm_panel_bytes(D->type, H, ff, np) : 0);
            }
            #pragma omp barrier
#else
            #pragma omp barrier
#endif
            if (y) {
                #pragma omp for schedule(static)
                for (int r = 0; r < P / k; r++) {
                    float *yr = y + (size_t)r * H;
                    for (int j = 0; j < k; j++) {
                        const int s = slot[(size_t)r * k + j];
                        const float wj = weights[s], *o = out + (size_t)s * H;
                        if (j == 0)
                            for (int i = 0; i < H; i++) yr[i] = wj * o[i];
                        else
                            for (int i = 0; i < H; i++) yr[i] += wj * o[i];
                    }
                }
            } else {
                #pragma omp for schedule(static)
                for (int i = 0; i < P; i++)
                    for (int j = 0; j < H; j++) out[(size_t)i * H + j] *= weights[i];
            }
            free(work);
        }
    }
    free(gl); free(ag); free(ad); free(xg); free(xd);
    if (!ws) free(gu);
    if (au != ag) free(au);
    if (xu != xg) free(xu);
    return failed ? -1 : 0;
}

/* B sequences, one token each (B <= 8: the products read every weight once for all of them).
 * x [B, hidden]: the tokens' embedding rows (overwritten: the residual streams). state[b][2i], state[b][2i+1]:
 * sequence b's layer i (conv [Kc-1, C], ssm [nv, dk, dv]) or (k cache, v cache) [nkv, cap[b], hd], f32;
 * pos[b]: the position its token takes. logits [B, vocab] out (NULL: the head is not run).
 * Rows form runs: a row whose state is the previous row's and whose position follows it continues that row's run
 * (a sequence's token and its drafts in a speculative verification, or an MTP layer's catch-up); every other row
 * starts a run of its own (one sequence's decoded token). The products read each weight once for all B rows;
 * attention row b sees the rows before it in its run (every row's k, v are written before any row attends), and the
 * DeltaNet conv and delta rule run a run's rows in order (runs, and heads, in parallel). `chain`: the B rows must
 * form ONE run (else -1). `snap` (may be NULL; else B entries, each NULL or a table): snap[b][2i], snap[b][2i+1]
 * receive DeltaNet layer i's conv and ssm state after row b, for a row that is not its run's last (the state after
 * a run's last row is the live one): a rejected draft rolls back to one of them without a second pass. `hidden` (may be NULL):
 * [B, hidden] out, the rows after the final norm (what an MTP layer reads). `rope` (may be NULL: pos): row b's
 * rotary position, where it is not its cache index (a conversation past an image).
 * Returns 0, or -1 (nothing touched) where a product's segments are not taken, a shape is not supported or
 * memory ran out. */
int ds_decode_tokens(const model_t *m, int B, float *x, float *const *const *state, const int *pos, const int *cap,
                     float *logits, int nthreads, int chain, float *const *const *snap, float *hidden,
                     const int *rope) {
    int H = m->hidden, C = 2 * m->nk * m->dk + m->nv * m->dv, nh = m->nh, nv = m->nv;
    if (B < 1 || B > MAXM || m->nk <= 0 || nv % m->nk || m->nkv <= 0 || nh % m->nkv || m->hd % 8
        || m->rotary > m->hd || m->rotary % 2 || !lin_ok(&m->head)) return -1;
    size_t kmax = (size_t)H, nmax = (size_t)H, spos[MAXM + 1];
    int run0[MAXM + 1], nrun = 0, longest = 1;  /* run r is rows run0[r] .. run0[r + 1] - 1 */
    spos[0] = 0;
    for (int b = 0; b < B; b++) {
        if (pos[b] < 0 || pos[b] >= cap[b]) return -1;
        if (b == 0 || state[b] != state[b - 1] || pos[b] != pos[b - 1] + 1) run0[nrun++] = b;
        else if (b - run0[nrun - 1] + 1 > longest) longest = b - run0[nrun - 1] + 1;
        spos[b + 1] = spos[b] + (size_t)nh * (pos[b] + 1);  /* sequence b's score rows start at spos[b] */
    }
    run0[nrun] = B;
    if (chain && nrun != 1) return -1;
    size_t emax = 0, umax = 0, ffmax = 0;  /* the MoE layers' most experts, chosen experts and expert rows */
    for (int i = 0; i < m->n_layers; i++) {
        const layer_t *L = &m->layers[i];
        const lin_t *ls[4] = {&L->mix_in, &L->mix_out, &L->gate_up, &L->down};
        for (int j = 0; j < 4; j++) {
            if (!lin_ok(ls[j])) return -1;
            if (ls[j]->K > (int)kmax) kmax = (size_t)ls[j]->K;
            if (lin_rows(ls[j]) > (int)nmax) nmax = (size_t)lin_rows(ls[j]);
        }
        if (L->n_expert) {
            if (!moe_ok(L, H)) return -1;
            size_t u = (size_t)B * L->n_used < (size_t)L->n_expert ? (size_t)B * L->n_used : (size_t)L->n_expert;
            if ((size_t)L->n_expert > emax) emax = (size_t)L->n_expert;
            if (u > umax) umax = u;
            if ((size_t)L->exp_gate.rows > ffmax) ffmax = (size_t)L->exp_gate.rows;
        }
    }
    if (m->head.K > (int)kmax) kmax = (size_t)m->head.K;
    kmax = (kmax + 255) / 256 * 256;
    float *hbuf = malloc(B * kmax * sizeof(float)), *big = malloc(B * nmax * sizeof(float)),
          *mid = malloc(B * kmax * sizeof(float)), *u = malloc((size_t)B * C * sizeof(float)),
          *qr = malloc((size_t)B * nh * m->hd * sizeof(float)), *scores = malloc(spos[B] * sizeof(float));
    void *scratch[NKIND] = {NULL};
    int ok = hbuf && big && mid && u && qr && scores;
    for (int kind = 1; kind < NKIND; kind++) ok = ok && (scratch[kind] = malloc(scratch_bytes(kind, B, (int)kmax)));
    moe_buf_t mb = {0};
    if (ok && emax) {
        mb.logits = malloc((size_t)B * (emax + 1) * sizeof(float));
        mb.gu = malloc(umax * B * 2 * ffmax * sizeof(float));
        mb.mid = malloc(umax * B * ffmax * sizeof(float));
        mb.out = malloc(umax * B * H * sizeof(float));
        mb.shared = malloc((size_t)B * H * sizeof(float));
        mb.w = malloc((size_t)B * DS_MAX_USED * sizeof(float));
        mb.sel = malloc((size_t)B * DS_MAX_USED * sizeof(int));
        mb.slot = malloc((size_t)B * DS_MAX_USED * sizeof(int));
        mb.uniq = malloc(umax * sizeof(int));
        mb.scratch = malloc(blk_scratch_bytes((int)(umax * B), (int)ffmax));
        ok = mb.logits && mb.gu && mb.mid && mb.out && mb.shared && mb.w && mb.sel && mb.slot && mb.uniq && mb.scratch;
    }
    void *gact = NULL;
    int gemm_missing = 0;  /* a thread without its panel buffer: no thread takes the GEMM route */
#ifdef BLK_GEMM
    if (ok && g_gemm_rows > 0 && B >= g_gemm_rows) gact = aligned_alloc(64, blk_gemm_act_bytes(B, (int)kmax));
#endif
    if (ok) {
        #pragma omp parallel num_threads(nthreads)
        {
            gemm_ctx_t gctx = {gact, NULL};
            t_gemm = NULL;
            if (gact) {  /* every thread of the team takes the GEMM route, or none */
#ifdef BLK_GEMM
                gctx.work = aligned_alloc(64, blk_gemm_work_bytes((int)kmax));
#endif
                if (!gctx.work) {
                    #pragma omp atomic write
                    gemm_missing = 1;
                }
                #pragma omp barrier
                if (!gemm_missing) t_gemm = &gctx;
            }
            for (int i = 0; i < m->n_layers; i++) {
                const layer_t *L = &m->layers[i];
                int nin = lin_rows(&L->mix_in), nmid = L->mix_out.K;
                #pragma omp for schedule(static)
                for (int b = 0; b < B; b++) rms_norm_row(x + (size_t)b * H, L->attn_norm, hbuf + (size_t)b * H, H, m->eps);
                team_product(&L->mix_in, hbuf, B, big, scratch);
                if (L->attention) {
                    #pragma omp for schedule(static)
                    for (int b = 0; b < B; b++)
                        attn_prepare(m, L, big + (size_t)b * nin, state[b][2 * i], state[b][2 * i + 1], pos[b],
                                     rope ? rope[b] : pos[b], cap[b],
                                     qr + (size_t)b * nh * m->hd);
                    #pragma omp for schedule(static)
                    for (int t = 0; t < B * nh; t++) {
                        int b = t / nh, h = t % nh;
                        attn_head(m, h, big + (size_t)b * nin, qr + (size_t)b * nh * m->hd, state[b][2 * i],
                                  state[b][2 * i + 1], pos[b], cap[b], scores + spos[b] + (size_t)h * (pos[b] + 1),
                                  mid + (size_t)b * nmid);
                    }
                } else if (longest > 1) {  /* runs of consecutive rows: the conv and the delta rule in row order */
                    size_t conv_n = (size_t)(m->Kc - 1) * C, sn = (size_t)m->dk * m->dv;
                    #pragma omp for schedule(static)
                    for (int r = 0; r < nrun; r++)
                        for (int b = run0[r]; b < run0[r + 1]; b++) {
                            dn_mix(big + (size_t)b * nin, L->conv_w, state[b][2 * i], u + (size_t)b * C, C, m->Kc,
                                   m->nk, m->dk);
                            if (snap && snap[b] && b < run0[r + 1] - 1)
                                memcpy(snap[b][2 * i], state[b][2 * i], conv_n * sizeof(float));
                        }
                    #pragma omp for schedule(static)
                    for (int t = 0; t < nrun * nv; t++) {
                        int r = t / nv, h = t % nv;
                        for (int b = run0[r]; b < run0[r + 1]; b++) {
                            const float *z = big + (size_t)b * nin + C, *bb = z + nv * m->dv, *a = bb + nv;
                            dn_head(h, u + (size_t)b * C, z, bb, a, L->a_neg, L->dt_bias, L->norm_w, state[b][2 * i + 1],
                                    mid + (size_t)b * nmid, m->nk, m->dk, nv, m->dv, m->tiled, m->eps);
                            if (snap && snap[b] && b < run0[r + 1] - 1)
                                memcpy(snap[b][2 * i + 1] + h * sn, state[b][2 * i + 1] + h * sn, sn * sizeof(float));
                        }
                    }
                } else {
                    #pragma omp for schedule(static)
                    for (int b = 0; b < B; b++)
                        dn_mix(big + (size_t)b * nin, L->conv_w, state[b][2 * i], u + (size_t)b * C, C, m->Kc, m->nk, m->dk);
                    #pragma omp for schedule(static)
                    for (int t = 0; t < B * nv; t++) {
                        int b = t / nv, h = t % nv;
                        const float *z = big + (size_t)b * nin + C, *bb = z + nv * m->dv, *a = bb + nv;
                        dn_head(h, u + (size_t)b * C, z, bb, a, L->a_neg, L->dt_bias, L->norm_w, state[b][2 * i + 1],
                                mid + (size_t)b * nmid, m->nk, m->dk, nv, m->dv, m->tiled, m->eps);
                    }
                }
                team_product(&L->mix_out, mid, B, hbuf, scratch);
                #pragma omp for schedule(static)
                for (int b = 0; b < B; b++) {
                    float *xb = x + (size_t)b * H, *hb = hbuf + (size_t)b * H;
                    for (int j = 0; j < H; j++) xb[j] += hb[j];
                    rms_norm_row(xb, L->post_norm, hb, H, m->eps);
                }
                if (L->n_expert) {
                    moe_ffn(L, B, H, hbuf, x, big, mid, scratch, &mb);
                    continue;
                }
                team_product(&L->gate_up, hbuf, B, big, scratch);
                #pragma omp for schedule(static)
                for (int b = 0; b < B; b++) {
                    int I = lin_rows(&L->gate_up) / 2;
                    swiglu_rows(big + (size_t)b * 2 * I, mid + (size_t)b * I, 1, I);
                }
                team_product(&L->down, mid, B, hbuf, scratch);
                #pragma omp for schedule(static)
                for (int b = 0; b < B; b++)
                    for (int j = 0; j < H; j++) x[(size_t)b * H + j] += hbuf[(size_t)b * H + j];
            }
            #pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                rms_norm_row(x + (size_t)b * H, m->final_norm, hbuf + (size_t)b * H, H, m->eps);
                if (hidden) memcpy(hidden + (size_t)b * H, hbuf + (size_t)b * H, (size_t)H * sizeof(float));
            }
            if (logits) team_product(&m->head, hbuf, B, logits, scratch);
            t_gemm = NULL;
            free(gctx.work);
        }
    }
    free(gact);
    free(hbuf); free(big); free(mid); free(u); free(qr); free(scores);
    for (int kind = 1; kind < NKIND; kind++) free(scratch[kind]);
    free(mb.logits); free(mb.gu); free(mb.mid); free(mb.out); free(mb.shared); free(mb.w); free(mb.sel); free(mb.slot);
    free(mb.uniq); free(mb.scratch);
    return ok ? 0 : -1;
}

#endif  /* AVX2 + FMA + F16C */
