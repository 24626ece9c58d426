/* moe.c: the MoE block (qwen35moe): a router over n_expert experts, the top n_used a token, and a shared expert.
 * moe_ffn is the one-call decode's (each expert any of the B rows chose read once for all of them); ds_moe_experts
 * runs a prefill's routed experts, each expert's rows read once for all its (row, expert) pairs, on the decode
 * products below routes.MOE_GEMM_ROWS pairs and on the GEMM from there (ds_set_moe_gemm, set at load). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "decode.h"
#include "gemm.h"
#include "moe.h"
#include "products.h"
#include "rowops.h"

#ifdef DS_AVX2

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

/* pairs from which an expert's product runs on the GEMM (ds_moe_experts; 0: never): routes.py's MOE_GEMM_ROWS, set
 * at load (ds_set_moe_gemm); this build's until then */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static int g_moe_gemm_rows = 8;
#else
static int g_moe_gemm_rows = 6;
#endif
int ds_set_moe_gemm(int rows) { g_moe_gemm_rows = rows; return 0; }
#define MOE_GEMM(pairs) (g_moe_gemm_rows > 0 && (pairs) >= g_moe_gemm_rows)

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

/* x [B, H] += the MoE block of h [B, H] (the normed residual): the shared expert (gate_up, down) scaled by the
 * sigmoid of its gate, plus each token's n_used experts weighted by the router. Each expert any of the B rows
 * chose is read once, for all B rows (decode reads weights, not arithmetic). Called by every thread of the team. */
void moe_ffn(const layer_t *L, int B, int H, const float *h, float *x, float *big, float *mid,
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
int moe_ok(const layer_t *L, int H) {
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
    /* an expert with MOE_GEMM_ROWS pairs or more runs on the GEMM (where built: the panels of its weights pay
       off from about that many rows), each panel of 32 of its rows a work item of the team; the others on the tiles */
    int *gl = malloc((size_t)nu * sizeof(int)), ng = 0, tiles = 0;
    if (!gl) return -1;
#ifdef BLK_GEMM
    const int gemm_all = blk_gemm_type(G->type) && blk_gemm_type(U->type) && blk_gemm_type(D->type);
#else
    const int gemm_all = 0;
#endif
    for (int u = 0; u < nu; u++) {
        if (gemm_all && MOE_GEMM(count[u])) gl[ng++] = u;
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
                if (gemm_all && MOE_GEMM(count[u])) continue;
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
                if (!(gemm_all && MOE_GEMM(count[u])))
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
#endif  /* DS_AVX2 */
