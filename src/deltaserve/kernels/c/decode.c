/* decode.c: one token through the whole model in one call, for B <= DS_MAX_ROWS rows of one or several sequences
 * (ds_decode_tokens): every layer's RMSNorms, products, DeltaNet or attention step, SwiGLU and residual adds, then the
 * final norm and the head, in one OpenMP team (the products and the per-head steps are shared among its threads, the
 * small serial pieces run on one), no Python or per-op dispatch between the ~25 operations of a layer. A lin_t
 * segment's type says whose product reads it: a GGUF type id (the file's own blocks: products.h), 0 (F32 rows: here),
 * DS_I8 or DS_Q4KR (tables.h, where the build has DS_TABLES); a stacked linear may mix them, and each kind of
 * activation quantization that occurs is prepared once per product. From routes.decode_gemm_rows() rows (set at load:
 * ds_set_decode_gemm) a product whose types the GEMM takes runs on it instead (its panels packed once for all rows).
 * The layer's steps are deltanet.c's, attention_decode.c's, rowops.h's and moe.c's. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "attention_decode.h"
#include "decode.h"
#include "deltanet.h"
#include "gemm.h"
#include "moe.h"
#include "rowops.h"
#include "tables.h"

#ifdef DS_AVX2
#define MAXM DS_MAX_ROWS
/* positions a 16-bit cache's attention task takes (the row's last chunk fewer): fixed, so that a row's sums do not
 * depend on the thread count or the rows beside it; small enough that a long row shares out among the threads,
 * large enough that joining the chunks costs little beside reading them */
#define KV_CHUNK 512


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

int lin_ok(const lin_t *L) {
    if (L->nseg < 1 || L->nseg > DS_MAX_SEGMENTS || L->K <= 0) return 0;
    for (int s = 0; s < L->nseg; s++)
        if (L->seg[s].rows <= 0 || !L->seg[s].data || seg_kind(&L->seg[s], L->K) < 0) return 0;
    return 1;
}

/* F32 rows [N, K] against M activation rows (stride K): an orphaned worksharing loop, no barrier. */
void f32_tiles(const float *W, int N, int K, const float *x, int M, float *y, long ldy) {
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

/* Rows from which a decode call's products go through the GEMM (its panels packed once per product for all
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

/* (decode.h) */
void team_product(const lin_t *L, const float *x, int M, float *y, void *const *scratch) {
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

/* B sequences, one token each (B <= 8: the products read every weight once for all of them).
 * x [B, hidden]: the tokens' embedding rows (overwritten: the residual streams). state[b][2i], state[b][2i+1]:
 * sequence b's layer i (conv [Kc-1, C], ssm [nv, dk, dv], f32) or (k cache, v cache) [nkv, cap[b], hd] in type
 * `kv_type` (native.h's DS_KV_*: every row's the same);
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
 * Returns 0, or -1 (nothing touched) where a product's segments are not taken, a shape or the KV type is not
 * supported or memory ran out.
 * An f32 cache is read one query head a task (attn_head); a 16-bit one one KV head a task (attn_group: its keys and
 * values read once for the g query heads of its group) and a chunk of KV_CHUNK positions a task (the chunks' softmax
 * joined by attn_merge). */
int ds_decode_tokens(const model_t *m, int B, float *x, float *const *const *state, const int *pos, const int *cap,
                     float *logits, int nthreads, int chain, float *const *const *snap, float *hidden,
                     const int *rope, int kv_type) {
    int H = m->hidden, C = 2 * m->nk * m->dk + m->nv * m->dv, nh = m->nh, nv = m->nv;
    if (B < 1 || B > MAXM || m->nk <= 0 || nv % m->nk || m->nkv <= 0 || nh % m->nkv || m->hd % 8
        || m->rotary > m->hd || m->rotary % 2 || !lin_ok(&m->head)
        || (kv_type != DS_KV_F32 && kv_type != DS_KV_F16 && kv_type != DS_KV_BF16)) return -1;
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
    /* a 16-bit cache's tasks: row b's KV heads in nch[b] chunks of KV_CHUNK positions, tasks tb[b] .. tb[b + 1] - 1
     * (KV head by KV head) */
    int nkv = m->nkv, g = nh / nkv, nch[MAXM], tb[MAXM + 1];
    size_t pstride = (size_t)g * (m->hd + 2);  /* a task's part: attn_group's [g, hd + 2] */
    tb[0] = 0;
    for (int b = 0; b < B; b++) {
        nch[b] = kv_type == DS_KV_F32 ? 0 : (pos[b] + KV_CHUNK) / KV_CHUNK;  /* ceil((pos[b] + 1) / KV_CHUNK) */
        tb[b + 1] = tb[b] + nkv * nch[b];
    }
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
          *qr = malloc((size_t)B * nh * m->hd * sizeof(float)), *scores = malloc(spos[B] * sizeof(float)),
          *part = kv_type != DS_KV_F32 ? malloc((size_t)tb[B] * pstride * sizeof(float)) : NULL;
    void *scratch[NKIND] = {NULL};
    int ok = hbuf && big && mid && u && qr && scores && (kv_type == DS_KV_F32 || part);
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
                        attn_prepare(m, L, big + (size_t)b * nin, state[b][2 * i], state[b][2 * i + 1], kv_type,
                                     pos[b], rope ? rope[b] : pos[b], cap[b], qr + (size_t)b * nh * m->hd);
                    if (kv_type == DS_KV_F32) {
                        #pragma omp for schedule(static)
                        for (int t = 0; t < B * nh; t++) {
                            int b = t / nh, h = t % nh;
                            attn_head(m, h, big + (size_t)b * nin, qr + (size_t)b * nh * m->hd, state[b][2 * i],
                                      state[b][2 * i + 1], pos[b], cap[b], scores + spos[b] + (size_t)h * (pos[b] + 1),
                                      mid + (size_t)b * nmid);
                        }
                    } else {
                        #pragma omp for schedule(dynamic, 1)
                        for (int t = 0; t < tb[B]; t++) {
                            int b = 0;
                            while (t >= tb[b + 1]) b++;
                            int kvh = (t - tb[b]) / nch[b], c = (t - tb[b]) % nch[b], n = pos[b] + 1;
                            int t1 = (c + 1) * KV_CHUNK < n ? (c + 1) * KV_CHUNK : n;
                            attn_group(m, kv_type, kvh, qr + (size_t)b * nh * m->hd, state[b][2 * i],
                                       state[b][2 * i + 1], n, c * KV_CHUNK, t1, cap[b], scores + spos[b],
                                       part + (size_t)t * pstride);
                        }
                        #pragma omp for schedule(static)
                        for (int t = 0; t < B * nh; t++) {
                            int b = t / nh, h = t % nh;
                            attn_merge(m, h, big + (size_t)b * nin,
                                       part + (size_t)(tb[b] + h / g * nch[b]) * pstride + (size_t)(h % g) * (m->hd + 2),
                                       nch[b], pstride, mid + (size_t)b * nmid);
                        }
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
    free(hbuf); free(big); free(mid); free(u); free(qr); free(scores); free(part);
    for (int kind = 1; kind < NKIND; kind++) free(scratch[kind]);
    free(mb.logits); free(mb.gu); free(mb.mid); free(mb.out); free(mb.shared); free(mb.w); free(mb.sel); free(mb.slot);
    free(mb.uniq); free(mb.scratch);
    return ok ? 0 : -1;
}
#endif  /* DS_AVX2 */
