/* gemm.c: many rows on the blocks: a GEMM on panels of the file's blocks (gemm.h), for the prefill's products on
 * a CPU without AMX (routes.block_gemm), an MoE layer's experts (moe.c) and a decode call of many rows (decode.c).
 * Compiled with -ffp-contract=off.
 *
 * The products on Q8_0, Q4_K, Q5_K and Q6_K tensors (and, from their expanded rows, every other quantized type: see
 * gemm_mode); with AVX512-VNNI on gemm_avx512.c's vpdpbusd tiles, built for AVX2 alone (a Zen 3) on gemm_avx2.c's
 * vpmaddubsw tiles: the file's values exactly, the activations int8 as llama.cpp quantizes them for the type: per block of 32 with an
 * f16-rounded scale (Q8_0's) or, for the K-quants and the IQ and TQ types, per block of 256 with an f32 scale (Q8_K's;
 * gemm_a256), so the only rounding is the activations'. torch has no such product: its int8 GEMM wants one scale per
 * row (requantizing Q8_0 per row doubled its error), and its f32 GEMM on exact chunks is far slower
 * (docs/kernels.md).
 * Each thread copies a panel of GP = 32 weight rows into a buffer laid out for vpdpbusd, once per product: each
 * sub-block of 32 (Q6_K: 16) values as unsigned bytes u, 16 rows' 4 bytes per vector, and per row and sub-block a
 * scale s (and for Q4_K/Q5_K a min m) with w = s (u - z) (Q8_0: u = w + 128, z = 128; Q6_K: z = 32) or
 * w = s u - m (Q4_K/Q5_K, z = 0). The copy is used by every token, so it costs ~1/M of the product and holds no
 * second copy of the tensor. A tile is the panel's 32 rows times GT tokens: per sub-block, SB/4 vpdpbusd per 16
 * rows and token into int32 sums that start at -z (the token's sum over the sub-block), so they end at the exact
 * sum of w' a (w' = u - z); then one convert and one multiply-add by s d_a into f32, and for a min one more
 * multiply-add by -m d_a (sum of a); with activations per 256, by s alone (and -m (sum of a)), the block of 256's
 * f32 sum then times d_a into the output. Each row's f32 sum takes the sub-blocks in order, whatever M is. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "activations.h"
#include "gemm.h"
#include "quants.h"

#ifdef DS_AVX2
/* 0: Q8_0, one scale per 32, z = 128; 1: Q6_K, a scale per 16, z = 32; 2: Q4_K/Q5_K, a scale and a min per 32.
 * The types whose rows expand (expand_row) to int8 values with one scale per 32 take mode 0 as v + 128 (Q4_0, Q5_0,
 * IQ4_NL, IQ4_XS, MXFP4, IQ3_S, IQ3_XXS, IQ2_XXS, IQ1_S, TQ1_0, TQ2_0: expand_row gives both halves of a 32 the same
 * scale), those with a min per 32 too mode 2 as v, -min (Q4_1, Q5_1), those with a scale per 16 and no min mode 3
 * (Q3_K, NVFP4, IQ2_XS, IQ2_S, IQ1_M), Q2_K (a scale and a min per 16) mode 4: mode 2's arithmetic per 16. */
int gemm_mode(int type) {
    switch (type) {
    case T_Q8_0: case T_Q4_0: case T_Q5_0: case T_IQ4_NL: case T_IQ4_XS: case T_MXFP4:
    case T_IQ3_S: case T_IQ3_XXS: case T_IQ2_XXS: case T_IQ1_S: case T_TQ1_0: case T_TQ2_0:  /* one scale per 32 */
        return 0;
    case T_Q6_K:
        return 1;
    case T_Q4_K: case T_Q5_K: case T_Q4_1: case T_Q5_1:
        return 2;
    case T_Q3_K: case T_NVFP4: case T_IQ2_XS: case T_IQ2_S: case T_IQ1_M:
        return 3;  /* a scale per 16 and no min: Q6_K's tiles (mode 1) on v + 128, z = 128 */
    case T_Q2_K:
        return 4;  /* a scale and a min per 16: the K-quants' arithmetic (v, -min) on Q6_K's sub-blocks */
    default:
        return -1;
    }
}


/* the types whose activations are int8 per block of 256 with an f32 scale (llama.cpp's Q8_K: what it multiplies the
 * K-quants and the IQ and TQ types with, and what the decode tiles use for the K-quants); the others' per block of
 * 32 with an f16 scale (Q8_0's: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, NVFP4). Per 256, the tile scales a
 * sub-block's sum by the weights' scale alone and the activations' once per 256 (a multiply less per sub-block). */
int gemm_a256(int type) {
    switch (type) {
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: case T_IQ3_S: case T_IQ3_XXS:
    case T_IQ2_XXS: case T_IQ2_XS: case T_IQ2_S: case T_IQ1_S: case T_IQ1_M: case T_TQ1_0: case T_TQ2_0:
        return 1;
    default:
        return 0;
    }
}

/* the types packed from their own bytes (pack_panel_direct, row_scales, unpack_row); the others by expand_row */
int gemm_direct(int type) {
    return type == T_Q8_0 || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

/* ---- the GEMM's pieces, for a caller's team (gemm.h): activations prepared once, panels as work items -------
 * blk_gemm_prepare: the rows of x (rows[m] where given) quantized as gemm_tile reads them, into `act`
 * (blk_gemm_act_bytes(M, K)): int8 values [Mp][K], scales [Mp][nb], the sums' terms [Mp][ni] and [Mp][nb], Mp = M
 * rounded up to GT plus GT rows of zeros (a tile may read past its last row; what it computes there is dropped).
 * blk_gemm_panel: panel p (rows 32p ..) of a tensor packed, then times rows m_first .. m_first + M of the prepared
 * activations; `work` of blk_gemm_work_bytes(K), one per thread. */
typedef struct {
    int8_t *q;
    float *d, *f;
    int32_t *i;
    int nb, ni;
} gemm_act_t;

static gemm_act_t gemm_act(int mode, void *act, int M, int K) {
    const int nb = K / 32, ni = gemm_per16(mode) ? 2 * nb : nb, Mp = (M + GT - 1) / GT * GT + GT;
    uint8_t *at = act;
    gemm_act_t g = {(int8_t *)at, NULL, NULL, NULL, nb, ni};
    at += ALIGN64((size_t)Mp * K);
    g.d = (float *)at;
    at += ALIGN64((size_t)Mp * nb * sizeof(float));
    g.f = (float *)at;  /* [Mp][ni]: per 16 in mode 4 */
    at += ALIGN64((size_t)Mp * 2 * nb * sizeof(float));
    g.i = (int32_t *)at;
    return g;
}

size_t blk_gemm_act_bytes(int M, int K) {
    const int nb = K / 32, Mp = (M + GT - 1) / GT * GT + GT;
    return ALIGN64((size_t)Mp * K) + ALIGN64((size_t)Mp * nb * sizeof(float)) + ALIGN64((size_t)Mp * 2 * nb * sizeof(float))
         + ALIGN64((size_t)Mp * 2 * nb * sizeof(int32_t));
}

int blk_gemm_type(int type) {
    int vals, bytes;
    /* the expanded types once the IQ grids' tables are set (ds_set_tables, at the library's load) */
    return gemm_mode(type) >= 0 && !block_info(type, &vals, &bytes) && (gemm_direct(type) || g_ksigns);
}

/* whether ds_gemm_blocks takes `type` in this build: 0 no (it returns -1), 1 yes, 2 yes at about the speed of
 * torch's f32 GEMM on exact chunks (AVX2's split tiles, gemm_avx2.c: routes.py keeps a prefill's chunks there, an
 * expert's few rows take the GEMM) */
int ds_gemm_type(int type) {
    if (!blk_gemm_type(type)) return 0;
#ifndef BLK_VNNI
    if (!gemm_run16(type, gemm_mode(type))) return 2;
#endif
    return 1;
}

void blk_gemm_prepare(int type, const float *x, int M, int K, long ldx, const int *rows, void *act) {
    const int mode = gemm_mode(type), a256 = gemm_a256(type), Mp = (M + GT - 1) / GT * GT + GT;
    gemm_act_t g = gemm_act(mode, act, M, K);
    const int nb = g.nb, ni = g.ni;
    int32_t c[K / 4];
    #pragma omp for schedule(static)
    for (int t = 0; t < Mp; t++) {
        int8_t *q = g.q + (size_t)t * K;
        float *d = g.d + (size_t)t * nb, *fs = g.f + (size_t)t * ni;
        int32_t *is = g.i + (size_t)t * ni;
        if (t >= M) {
            memset(q, 0, K), memset(d, 0, nb * sizeof(float)), memset(fs, 0, ni * sizeof(float));
            memset(is, 0, ni * sizeof(int32_t));
            continue;
        }
        const float *xr = x + (size_t)(rows ? rows[t] : t) * ldx;
        if (a256)
            quant_q8_256(xr, K, q, d, c);
        else
            quant_q8_0(xr, K, q, d, c, NULL);
        const int fours = K / ni / 4, z = gemm_z(mode);
        for (int i = 0; i < ni; i++) {  /* each sub-block's sum, from the quantizer's -128 x (sums of 4) */
            int32_t sum = 0;
            for (int l = 0; l < fours; l++) sum += c[i * fours + l];
            sum /= -128;
            is[i] = -z * sum;
            if (gemm_mins(mode)) fs[i] = a256 ? (float)sum : d[i * nb / ni] * (float)sum;
        }
    }
}

size_t blk_gemm_work_bytes(int K) {  /* the panel [nb][1024], ps and po (2 nb x GP each at most), ubuf [GP][K] */
    const int nb = K / 32;
    return ALIGN64((size_t)nb * 1024 + (size_t)4 * nb * GP * sizeof(float))
         + ALIGN64((size_t)GP * K);
}

int blk_gemm_panels(int N) { return (N + GP - 1) / GP; }

size_t blk_gemm_panel_bytes(int type, int N, int K, int p) {
    int vals = 1, bytes = 0;
    block_info(type, &vals, &bytes);
    const int n0 = p * GP, nrows = N - n0 < GP ? N - n0 : GP;
    return nrows > 0 ? (size_t)nrows * (K / vals) * bytes : 0;
}

const uint8_t *blk_gemm_panel_at(int type, const uint8_t *blocks, int K, int p) {
    int vals = 1, bytes = 0;
    block_info(type, &vals, &bytes);
    return blocks + (size_t)p * GP * (K / vals) * bytes;
}

void blk_gemm_panel(int type, const uint8_t *blocks, int N, int K, int p, const void *act, int Mall, int m_first,
                    int M, float *y, long ldy, void *work, const uint8_t *next, size_t next_bytes) {
    const int mode = gemm_mode(type), a256 = gemm_a256(type), nb = K / 32, ni = gemm_per16(mode) ? 2 * nb : nb;
    int vals, bytes;
    block_info(type, &vals, &bytes);
    const size_t row_bytes = (size_t)(K / vals) * bytes;
    gemm_act_t g = gemm_act(mode, (void *)act, Mall, K);
    uint8_t *pw = work, *ubuf = pw + ALIGN64((size_t)nb * 1024 + (size_t)4 * nb * GP * sizeof(float));
    float *ps = (float *)(pw + (size_t)nb * 1024), *po = ps + (size_t)ni * GP;
    const int n0 = p * GP, nrows = N - n0 < GP ? N - n0 : GP;
    /* a full panel of few tokens' product is packed and multiplied a run of GEMM_RUN values at a time, the packed run
       staying in L1 for the tiles that read it (a whole panel, 64 KB and up, went out to L2 and came back per tile) */
    const int run = nrows == GP && M <= GEMM_RUN_TOKENS && K % GEMM_RUN == 0 && gemm_direct(type) ? GEMM_RUN : K,
              runs = K / run;
    const int rb = run / 32;
#ifdef BLK_VNNI
    const int run16 = 0;
#else
    const int run16 = gemm_run16(type, mode);
#endif

    if (runs == 1) pack_panel(type, mode, blocks, row_bytes, n0, nrows, K, pw, ps, po, ubuf);
    const int pf_lines = next ? (int)((next_bytes + 63) / 64 + nb - 1) / nb : 0;  /* lines a block of the first tile */
    for (int c = 0; c < runs; c++) {
        const int b0 = c * rb;
        if (runs > 1) pack_panel_direct(type, blocks + (size_t)b0 * 32 / vals * bytes, row_bytes, n0, run, pw, ps, po);
        gemm_tiles(mode, a256, M, pw, ps, po, rb, nb, g.ni, b0, g.q + (size_t)m_first * K, g.d + (size_t)m_first * nb,
                   g.i + (size_t)m_first * g.ni, g.f + (size_t)m_first * g.ni, K, y + n0, ldy, nrows,
                   next ? next + (size_t)b0 * pf_lines * 64 : NULL, pf_lines, c > 0, run16);
    }
}

/* y[m, n] = sum_k v(n, k) x[m, k] for a tensor [N, K] of blocks of a type gemm_mode takes (rows after each other),
 * any M: see gemm_tile. Returns 0, or -1 when it cannot take the product (type, K, memory). */
int ds_gemm_blocks(int type, const float *x, int M, int K, long ldx, const uint8_t *blocks, int N, float *y,
                   long ldy, int nthreads) {
    int vals, bytes;
    if (!blk_gemm_type(type) || M <= 0 || N <= 0 || (block_info(type, &vals, &bytes), K % vals)) return -1;
    const int panels = (N + GP - 1) / GP;
    void *act = aligned_alloc(64, blk_gemm_act_bytes(M, K));
    if (!act) return -1;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        void *work = aligned_alloc(64, blk_gemm_work_bytes(K));
        if (!work) {
            #pragma omp atomic write
            failed = 1;
        }
        blk_gemm_prepare(type, x, M, K, ldx, NULL, act);  /* its barrier: every row quantized before any tile */
        if (!failed) {
            /* each thread a run of consecutive panels, the next one fetched while one is multiplied; the tokens
               GEMM_TOKENS at a time, whose activations stay in L2 while each panel passes over them (all 2048 of
               a long prefill's chunk, 2 MB at K = 1024, went out to L3 for every panel) */
            const int nt = omp_get_num_threads(), t = omp_get_thread_num();
            const int p0 = (int)((long)panels * t / nt), p1 = (int)((long)panels * (t + 1) / nt);
            for (int m0 = 0; m0 < M; m0 += GEMM_TOKENS) {
                const int mb = M - m0 < GEMM_TOKENS ? M - m0 : GEMM_TOKENS;
                for (int p = p0; p < p1; p++)
                    blk_gemm_panel(type, blocks, N, K, p, act, M, m0, mb, y + (size_t)m0 * ldy, ldy, work,
                                   p + 1 < p1 ? blk_gemm_panel_at(type, blocks, K, p + 1) : NULL,
                                   p + 1 < p1 ? blk_gemm_panel_bytes(type, N, K, p + 1) : 0);
            }
        }
        free(work);
    }
    free(act);
    return failed ? -1 : 0;
}
#endif  /* DS_AVX2 */
