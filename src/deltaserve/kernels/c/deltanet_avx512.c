/* deltanet_avx512.c: the prefill's DeltaNet span kernels with 512-bit vectors (a build with DS_TABLES: AVX512F, BW
 * and VNNI): the depthwise causal conv + SiLU in blocks of channels, and the gated delta rule a chunk of tokens a
 * pass over the state (deltanet_avx2.c holds the AVX2 ones; the decode's one-token step is deltanet.c's). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ds.h"
#include "vmath.h"

#ifdef DS_TABLES

/* ---------------------------------------------------------------------------------------------------------
 * The prefill's causal conv of a DeltaNet layer, with SiLU in 16 lanes (the decode's one-token DeltaNet step,
 * ds_deltanet_step, is deltanet.c's on every CPU).
 * ------------------------------------------------------------------------------------------------------- */

/* v[i] = silu(v[i]) = v / (1 + e^-v), in place, n values */
static void silu16_inplace(float *v, int n) {
    for (int i = 0; i < n; i += 16) {
        __mmask16 k = (__mmask16)(i + 16 <= n ? 0xFFFF : (1u << (n - i)) - 1);
        __m512 x = _mm512_maskz_loadu_ps(k, v + i);
        __m512 y = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        _mm512_mask_storeu_ps(v + i, k, y);
    }
}

/* The depthwise causal conv of a DeltaNet layer over T new rows, then SiLU: out[t, c] = silu(sum_j
 * w[c, j] * window[t + j, c]) with window = [conv_state; x] ([Kc-1+T, C]); conv_state becomes the window's
 * last Kc-1 rows. One pass over x and out (torch's version is about six passes over [T, C]). */
#define CONV_BLOCK 512
int ds_causal_conv(const float *x, float *conv_state, const float *w, float *out, int T, int C, int Kc,
                   int nthreads, long ldx) {
    if (T <= 0 || C <= 0 || Kc < 2 || ldx < C) return -1;
    int H = Kc - 1;
    float *wt = malloc((size_t)Kc * C * sizeof(float));
    if (!wt) return -1;
    for (int c = 0; c < C; c++)
        for (int j = 0; j < Kc; j++) wt[(size_t)j * C + c] = w[(size_t)c * Kc + j];
    /* a block of CONV_BLOCK channels at a time down all T rows: its Kc weight rows (8 KB) and the window's last rows
       stay in L1 (a row at a time over all C channels read the Kc x C weights, 96 KB for the 0.8B's 6144, from L2
       for every row; 512 was the fastest block of those measured: docs/kernels.md) */
    const int blocks = (C + CONV_BLOCK - 1) / CONV_BLOCK;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int cb = 0; cb < blocks; cb++) {
        const int c0 = cb * CONV_BLOCK, n = C - c0 < CONV_BLOCK ? C - c0 : CONV_BLOCK;
        for (int t = 0; t < T; t++) {
            float *o = out + (size_t)t * C + c0;
            for (int v = 0; v < n; v += 16) {
                const __mmask16 k = (__mmask16)(v + 16 <= n ? 0xFFFF : (1u << (n - v)) - 1);
                __m512 acc = _mm512_setzero_ps();
                for (int j = 0; j < Kc; j++) {
                    const int r = t + j;  /* row of the window */
                    const float *src = r < H ? conv_state + (size_t)r * C : x + (size_t)(r - H) * ldx;
                    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, wt + (size_t)j * C + c0 + v),
                                          _mm512_maskz_loadu_ps(k, src + c0 + v), acc);
                }
                _mm512_mask_storeu_ps(o + v, k, acc);
            }
            silu16_inplace(o, n);
        }
    }
    /* the new state: the window's last H rows (some may still be old state rows when T < H) */
    float *keep = malloc((size_t)H * C * sizeof(float));
    if (!keep) { free(wt); return -1; }
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
 * The gated delta rule over T tokens of one sequence (a prefill), updating S [H, dk, dv]: the recurrence of the
 * decode step, S = e^g S; delta = beta (v - S^T k); S += k delta^T; o = S^T q, exactly (no chunked form's matrix
 * inverse), DR_C tokens a pass over the state. Each value column of a head's state evolves on its own given the
 * tokens' k, q and gates, so the work is split into (head, 32 columns) items whose dk x 32 slice (16 KB, copied out
 * to a contiguous block and back) stays in L1 for all T tokens. For the tokens j = 0 .. n-1 of a chunk starting from
 * S, with the gathered K_j = S^T k_j, Q_j = S^T q_j, g_j the decays, P_j = g_0 .. g_(j-1), E_ij = g_(i+1) .. g_(j-1):
 *   u_j = P_j K_j + sum_(i<j) E_ij (k_i.k_j) delta_i,  delta_j = beta_j (v_j - g_j u_j),
 *   o_j = g_j (P_j Q_j + sum_(i<j) E_ij (k_i.q_j) delta_i) + (k_j.q_j) delta_j,
 *   S' = P_n S + sum_i E_in k_i delta_i^T:
 * one pass over the slice a chunk (each row: P_n S_r + sum_i k_i[r] E_in delta_i, stored, and the next chunk's
 * 2 DR_C sums gathered from it) rather than one a token, whose reads of the rows the pass before wrote ran at half
 * the arithmetic's rate; the scalars (decays, the dot products) once per chunk and head, shared by its column groups
 * (a pass a chunk of 4 on the contiguous copy, two column groups alternated, takes well under half the time of a
 * pass a token in place: docs/kernels.md). q, k: [T, H, dk] (one per value head, normalised, q scaled), v, out:
 * [T, H, dv], g, beta: [T, H]. Returns -1 where dv is not a multiple of 32 (or memory is short).
 * ------------------------------------------------------------------------------------------------------- */
#define DR_C 4
static inline __attribute__((always_inline)) void dr_pass4(float *s, int dk, __m512 vd, const __m512 dl[DR_C][2],
                                                           const float *const ku[DR_C], const float *const kn[DR_C],
                                                           const float *const qn[DR_C], __m512 kv[DR_C][2],
                                                           __m512 qs[DR_C][2]) {
    __m512 a[DR_C][2], b[DR_C][2];
    for (int j = 0; j < DR_C; j++) a[j][0] = a[j][1] = b[j][0] = b[j][1] = _mm512_setzero_ps();
    for (int r = 0; r < dk; r++) {
        float *row = s + (size_t)r * 32;
        __m512 x0 = _mm512_mul_ps(vd, _mm512_loadu_ps(row)), x1 = _mm512_mul_ps(vd, _mm512_loadu_ps(row + 16));
        for (int i = 0; i < DR_C; i++) {
            __m512 c = _mm512_set1_ps(ku[i][r]);
            x0 = _mm512_fmadd_ps(c, dl[i][0], x0);
            x1 = _mm512_fmadd_ps(c, dl[i][1], x1);
        }
        _mm512_storeu_ps(row, x0);
        _mm512_storeu_ps(row + 16, x1);
        for (int j = 0; j < DR_C; j++) {
            __m512 kb = _mm512_set1_ps(kn[j][r]), qb = _mm512_set1_ps(qn[j][r]);
            a[j][0] = _mm512_fmadd_ps(kb, x0, a[j][0]); a[j][1] = _mm512_fmadd_ps(kb, x1, a[j][1]);
            b[j][0] = _mm512_fmadd_ps(qb, x0, b[j][0]); b[j][1] = _mm512_fmadd_ps(qb, x1, b[j][1]);
        }
    }
    for (int j = 0; j < DR_C; j++) {
        kv[j][0] = a[j][0]; kv[j][1] = a[j][1];
        qs[j][0] = b[j][0]; qs[j][1] = b[j][1];
    }
}

static inline float dr_dot(const float *x, const float *y, int n) {
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), acc);
    float r = _mm512_reduce_add_ps(acc);
    for (; i < n; i++) r += x[i] * y[i];
    return r;
}

/* a chunk's scalars for one head (the same for each of its column groups): the decays g_j, beta_j, P_j, the
 * coefficients E_ij (k_i.k_j) and E_ij (k_i.q_j) of the earlier tokens' deltas, k_j.q_j, E_in and P_n */
typedef struct {
    float g[DR_C], beta[DR_C], p[DR_C], ck[DR_C][DR_C], cq[DR_C][DR_C], kq[DR_C], e[DR_C], pn;
} dr_chunk_t;

/* one column group's run through the tokens: its slice (copied to a contiguous dk x 32 block: in place, its rows
 * dv floats apart fall in a few of L1's sets, dv 128: a stride of 512 bytes, 16 of 64 sets, more lines than their
 * ways hold) and the sums its last pass gathered */
typedef struct {
    int h, c0;
    float *s, *sg;
    __m512 kv[DR_C][2], qs[DR_C][2];
} dr_item_t;

/* rows[j]: row (token t0 + j, head h) of a [T, H, dk] array, or zero past T (a last chunk's missing tokens) */
static inline void dr_rows(const float *a, const float *zero, int t0, int T, int H, int h, int dk,
                           const float *rows[DR_C]) {
    for (int j = 0; j < DR_C; j++) rows[j] = t0 + j < T ? a + ((size_t)(t0 + j) * H + h) * dk : zero;
}

static void dr_item_start(dr_item_t *it, int item, int per_head, float *buf, float *S, const float *k, const float *q,
                          const float *zero, int T, int H, int dk, int dv) {
    it->h = item / per_head, it->c0 = (item % per_head) * 32;
    it->sg = S + (size_t)it->h * dk * dv + it->c0;
    it->s = buf;
    for (int i = 0; i < dk; i++) memcpy(it->s + (size_t)i * 32, it->sg + (size_t)i * dv, 32 * sizeof(float));
    const __m512 zv = _mm512_setzero_ps();
    __m512 dl[DR_C][2];
    const float *ku[DR_C], *kn[DR_C], *qn[DR_C];
    for (int j = 0; j < DR_C; j++) {
        ku[j] = zero;
        dl[j][0] = dl[j][1] = zv;
    }
    dr_rows(k, zero, 0, T, H, it->h, dk, kn);
    dr_rows(q, zero, 0, T, H, it->h, dk, qn);
    dr_pass4(it->s, dk, _mm512_set1_ps(1.0f), dl, ku, kn, qn, it->kv, it->qs);  /* the first chunk's sums (rows unchanged) */
}

/* chunk c of a column group: its tokens' deltas and outputs from the gathered sums, then the pass that applies them
 * and gathers the next chunk's */
static void dr_item_chunk(dr_item_t *it, int c, const dr_chunk_t *cc, const float *k, const float *q, const float *v,
                          float *out, const float *zero, int T, int H, int dk, int dv) {
    const int h = it->h, c0 = it->c0, t0 = c * DR_C, n = T - t0 < DR_C ? T - t0 : DR_C;
    const dr_chunk_t *x = cc + (size_t)c * H + h;
    const __m512 zv = _mm512_setzero_ps();
    __m512 dd[DR_C][2], dl[DR_C][2];
    const float *ku[DR_C], *kn[DR_C], *qn[DR_C];
    for (int j = 0; j < n; j++) {
        const size_t th = (size_t)(t0 + j) * H + h;
        const __m512 pj = _mm512_set1_ps(x->p[j]);
        __m512 u0 = _mm512_mul_ps(pj, it->kv[j][0]), u1 = _mm512_mul_ps(pj, it->kv[j][1]);
        __m512 w0 = _mm512_mul_ps(pj, it->qs[j][0]), w1 = _mm512_mul_ps(pj, it->qs[j][1]);
        for (int i = 0; i < j; i++) {
            const __m512 ck = _mm512_set1_ps(x->ck[i][j]), cq = _mm512_set1_ps(x->cq[i][j]);
            u0 = _mm512_fmadd_ps(ck, dd[i][0], u0); u1 = _mm512_fmadd_ps(ck, dd[i][1], u1);
            w0 = _mm512_fmadd_ps(cq, dd[i][0], w0); w1 = _mm512_fmadd_ps(cq, dd[i][1], w1);
        }
        const float *vt = v + th * dv + c0;
        const __m512 vg = _mm512_set1_ps(x->g[j]), vb = _mm512_set1_ps(x->beta[j]), vkq = _mm512_set1_ps(x->kq[j]);
        dd[j][0] = _mm512_mul_ps(vb, _mm512_fnmadd_ps(vg, u0, _mm512_loadu_ps(vt)));
        dd[j][1] = _mm512_mul_ps(vb, _mm512_fnmadd_ps(vg, u1, _mm512_loadu_ps(vt + 16)));
        float *ot = out + th * dv + c0;
        _mm512_storeu_ps(ot, _mm512_fmadd_ps(vkq, dd[j][0], _mm512_mul_ps(vg, w0)));
        _mm512_storeu_ps(ot + 16, _mm512_fmadd_ps(vkq, dd[j][1], _mm512_mul_ps(vg, w1)));
    }
    for (int j = 0; j < DR_C; j++) {
        dl[j][0] = j < n ? _mm512_mul_ps(_mm512_set1_ps(x->e[j]), dd[j][0]) : zv;
        dl[j][1] = j < n ? _mm512_mul_ps(_mm512_set1_ps(x->e[j]), dd[j][1]) : zv;
    }
    dr_rows(k, zero, t0, T, H, h, dk, ku);  /* this chunk's tokens, applied; the next chunk's, gathered */
    dr_rows(k, zero, t0 + DR_C, T, H, h, dk, kn);
    dr_rows(q, zero, t0 + DR_C, T, H, h, dk, qn);
    dr_pass4(it->s, dk, _mm512_set1_ps(x->pn), dl, ku, kn, qn, it->kv, it->qs);
}

int ds_delta_rule(const float *q, const float *k, const float *v, const float *g, const float *beta, float *S,
                  float *out, int T, int H, int dk, int dv, int nthreads) {
    if (T <= 0 || H <= 0 || dk <= 0 || dk % 2 || dv % 32) return -1;
    const int per_head = dv / 32, chunks = (T + DR_C - 1) / DR_C;
    dr_chunk_t *cc = malloc((size_t)chunks * H * sizeof(dr_chunk_t));
    float *zero = calloc((size_t)dk, sizeof(float));  /* k and q of the tokens past T in the last chunk */
    if (!cc || !zero) {
        free(cc), free(zero);
        return -1;
    }
    #pragma omp parallel num_threads(nthreads)
    {
        /* denormals flushed to zero on this kernel's threads: a chunk's products of decays (and the state times them)
           fall below f32's normal range where the decays are strong, and each such operand or result costs a
           microcode assist (several times the layer's time without them) */
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);  /* FTZ, DAZ */
        #pragma omp for schedule(static)
        for (int ch = 0; ch < chunks * H; ch++) {
            const int c = ch / H, h = ch % H, n = T - c * DR_C < DR_C ? T - c * DR_C : DR_C;
            dr_chunk_t *x = cc + ch;
            float e[DR_C], p = 1.0f;
            memset(x, 0, sizeof *x);
            for (int j = 0; j < n; j++) {
                const size_t tj = (size_t)(c * DR_C + j) * H + h;
                x->g[j] = expf(g[tj]);
                x->beta[j] = beta[tj];
                x->p[j] = p;
                for (int i = 0; i < j; i++) {  /* e[i] = E_ij */
                    const size_t ti = (size_t)(c * DR_C + i) * H + h;
                    x->ck[i][j] = e[i] * dr_dot(k + ti * dk, k + tj * dk, dk);
                    x->cq[i][j] = e[i] * dr_dot(k + ti * dk, q + tj * dk, dk);
                }
                x->kq[j] = dr_dot(k + tj * dk, q + tj * dk, dk);
                for (int i = 0; i < j; i++) e[i] *= x->g[j];
                e[j] = 1.0f;
                p *= x->g[j];
            }
            for (int i = 0; i < n; i++) x->e[i] = e[i];
            x->pn = p;
        }
        /* two column groups at a time, their chunks alternated: one's small serial step (its deltas, from the sums
           its pass ends with) runs beside the other's pass rather than between two passes of its own */
        #pragma omp for schedule(static)
        for (int pair = 0; pair < (H * per_head + 1) / 2; pair++) {
            dr_item_t it[2];
            const int items = 2 * pair + 1 < H * per_head ? 2 : 1;
            float sbuf[2][dk * 32] __attribute__((aligned(64)));
            for (int m = 0; m < items; m++) dr_item_start(&it[m], 2 * pair + m, per_head, sbuf[m], S, k, q, zero, T, H, dk, dv);
            for (int c = 0; c < chunks; c++)
                for (int m = 0; m < items; m++) dr_item_chunk(&it[m], c, cc, k, q, v, out, zero, T, H, dk, dv);
            for (int m = 0; m < items; m++)
                for (int i = 0; i < dk; i++) memcpy(it[m].sg + (size_t)i * dv, it[m].s + (size_t)i * 32, 32 * sizeof(float));
        }
        _mm_setcsr(csr);
    }
    free(cc);
    free(zero);
    return 0;
}
#endif  /* DS_TABLES */
