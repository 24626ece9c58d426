/* products.c: the decode products on a GGUF file's own blocks (products.h), read where they lie (the file's mapping),
 * as llama.cpp's own CPU products do them: the activations quantized to int8 per block (activations.h), each block's
 * integer dot product exact in int32, scaled once per block. For a Q8_0 file the only rounding is the activations'.
 *
 * The dispatch by type, in one place (blk_tiles_rows):
 *   - the types without a product of their own (the IQ grid types, NVFP4; every expanded type on AVX2): each row
 *     expanded once (expand.c), then times every activation row (row_expanded, here);
 *   - F16 and BF16: the f32 activations times each row widened to f32 (row_half, here);
 *   - every other type: this build's products, the AVX2 rows (rows_avx2.c) or the 512-bit tiles (tiles_avx512.c):
 *     the same exact integer sum of each block, scaled by the same f32 factors; only the order in which the f32 terms
 *     are added differs between the two builds (never between row counts of one build: a row's result never depends
 *     on the rows beside it).
 * ds_linear_blocks is the product on a team of its own (the Python products of up to routes.block_rows() rows).
 * Compiled with -ffp-contract=off, as every file on the file's blocks. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "activations.h"
#include "expand.h"
#include "products.h"
#include "rows.h"

#ifdef DS_AVX2

/* F16 / BF16: the weights widened to f32 (exact) and multiplied with the f32 activations, 8 at a time. */
static inline __m256 load_half8(int type, const uint8_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (type == T_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* One F16/BF16 row against M (1..MG, a constant after inlining: the accumulators stay in registers) f32 rows, two
 * accumulation chains each (a single chain is bound by the FMA's latency, and a runtime M keeps the accumulators in
 * memory). Each row's sum is taken the same way
 * whatever M is. */
static inline __attribute__((always_inline)) void row_half_m(int type, const uint8_t *row, int K, const act_t *a,
                                                             const int M, float *out) {
    int k = 0;
#ifdef BLK_VNNI  /* AVX512: sixteen values a vector */
    __m512 wide[MG][2];
    for (int m = 0; m < M; m++) wide[m][0] = wide[m][1] = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
        __m256i h0 = _mm256_loadu_si256((const __m256i *)(row + 2 * (size_t)k)),
                h1 = _mm256_loadu_si256((const __m256i *)(row + 2 * (size_t)(k + 16)));
        __m512 w0 = type == T_F16 ? _mm512_cvtph_ps(h0)
                                  : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h0), 16));
        __m512 w1 = type == T_F16 ? _mm512_cvtph_ps(h1)
                                  : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h1), 16));
        for (int m = 0; m < M; m++) {
            wide[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(a[m].x + k), wide[m][0]);
            wide[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(a[m].x + k + 16), wide[m][1]);
        }
    }
#endif
    __m256 acc[MG][2];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        __m256 w0 = load_half8(type, row + 2 * (size_t)k), w1 = load_half8(type, row + 2 * (size_t)(k + 8));
        for (int m = 0; m < M; m++) {
            acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(a[m].x + k), acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(a[m].x + k + 8), acc[m][1]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        __m256 w = load_half8(type, row + 2 * (size_t)k);
        for (int m = 0; m < M; m++) acc[m][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(a[m].x + k), acc[m][0]);
    }
    for (int m = 0; m < M; m++) {
        float s = blk_hsum8(_mm256_add_ps(acc[m][0], acc[m][1]));
#ifdef BLK_VNNI
        s += _mm512_reduce_add_ps(_mm512_add_ps(wide[m][0], wide[m][1]));
#endif
        for (int i = k; i < K; i++) {
            float wi;
            if (type == T_F16) wi = h2f(row + 2 * (size_t)i);
            else { uint32_t u = (uint32_t)(row[2 * i] | (row[2 * i + 1] << 8)) << 16; memcpy(&wi, &u, 4); }
            s += wi * a[m].x[i];
        }
        out[m] = s;
    }
}

static void row_half(int type, const uint8_t *row, int K, const act_t *a, int M, float *out) {
    switch (M) {
    case 1: row_half_m(type, row, K, a, 1, out); break;
    case 2: row_half_m(type, row, K, a, 2, out); break;
    case 3: row_half_m(type, row, K, a, 3, out); break;
    default: row_half_m(type, row, K, a, 4, out);
    }
}

/* one expanded row against M prepared rows (Q8_0-style activations: a.q, a.d per 32; with BLK_VNNI a.c, -128 x the
 * sums of 4). With AVX512-VNNI 64 values a step: the values made unsigned (v + 128) for vpdpbusd, whose sums start
 * at a.c (so they end at the exact sum of v a), each group of 16's four lanes scaled by sc d_a; a min adds
 * mn d_a times the activations' sum, read off the same a.c lanes. */
void row_expanded(const int8_t *v, const float *sc, const float *mn, int K, const act_t *a, int M, float *out) {
    for (int m = 0; m < M; m++) {
        __m256 acc = _mm256_setzero_ps();
        float macc = 0.0f;
        int j = 0;
#ifdef BLK_VNNI
        {
            const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
            __m512 acc5 = _mm512_setzero_ps(), macc5 = _mm512_setzero_ps();
            for (; j + 2 <= K / 32; j += 2) {
                __m512i u = _mm512_xor_si512(_mm512_loadu_si512(v + 32 * j), _mm512_set1_epi8((char)0x80));
                __m512i c = _mm512_loadu_si512(a[m].c + 8 * j);
                __m512i s = _mm512_dpbusd_epi32(c, u, _mm512_loadu_si512(a[m].q + 32 * j));
                __m128 d2 = _mm_setr_ps(a[m].d[j], a[m].d[j], a[m].d[j + 1], a[m].d[j + 1]);
                __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(_mm_loadu_ps(sc + 2 * j), d2)));
                acc5 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc5);
                if (mn) {  /* c = -128 x the sums of 4: mn d_a / -128 on each of its lanes */
                    __m128 ms = _mm_mul_ps(_mm_mul_ps(_mm_loadu_ps(mn + 2 * j), d2), _mm_set1_ps(-1.0f / 128.0f));
                    macc5 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(ms)), macc5);
                }
            }
            macc = _mm512_reduce_add_ps(macc5);
            acc = _mm256_add_ps(_mm512_castps512_ps256(acc5), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc5), 1)));
        }
#endif
        for (; j < K / 32; j++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(v + 32 * j));
            __m256i s = dot_i8(_mm256_sign_epi8(w, w), w, _mm256_loadu_si256((const __m256i *)(a[m].q + 32 * j)));
            float da = a[m].d[j];
            __m256 scale = _mm256_set_m128(_mm_set1_ps(sc[2 * j + 1] * da), _mm_set1_ps(sc[2 * j] * da));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc);
            if (mn) {  /* the activations' sums of 16 */
                __m256i q = _mm256_loadu_si256((const __m256i *)(a[m].q + 32 * j));
                __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
                __m128i lo = _mm256_castsi256_si128(s4), hi = _mm256_extracti128_si256(s4, 1);
                lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0x4E)), hi = _mm_add_epi32(hi, _mm_shuffle_epi32(hi, 0x4E));
                int32_t s0 = _mm_cvtsi128_si32(lo) + _mm_extract_epi32(lo, 1), s1 = _mm_cvtsi128_si32(hi) + _mm_extract_epi32(hi, 1);
                macc += da * (mn[2 * j] * (float)s0 + mn[2 * j + 1] * (float)s1);
            }
        }
        out[m] = blk_hsum8(acc) + macc;
    }
}
/* ---- the team-level pieces (products.h), and the product built from them ------------------------------------- */
int blk_kind(int type) {
    int elems, bytes;
    if (block_info(type, &elems, &bytes) || type == T_F32) return 0;
    if (type == T_F16 || type == T_BF16) return 3;
    if (type == T_Q8_0 || type == T_Q4_0) return 1;
    if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) return 2;
    return 1;  /* the other types: expanded row by row (expand_row), times Q8_0-style activations */
}

/* the expanded types the 512-bit tiles multiply straight from their blocks (tile_b32) */
static int fused_b32(int type) {
#ifdef BLK_VNNI
    return type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 || type == T_IQ4_NL || type == T_IQ4_XS || type == T_MXFP4
        || type == T_Q2_K || type == T_Q3_K || type == T_TQ2_0 || type == T_TQ1_0;
#else
    (void)type;
    return 0;
#endif
}

/* the types multiplied by expanding each row (expand_row), with kind 1's activations */
static int expanded(int type) {
    return type != T_Q8_0 && type != T_Q4_0 && blk_kind(type) == 1;
}

int blk_values(int type) {
    int elems = 1, bytes;
    block_info(type, &elems, &bytes);
    return elems;
}

size_t blk_row_bytes(int type, int K) {
    int elems = 1, bytes = 0;
    if (block_info(type, &elems, &bytes)) return 0;
    return (size_t)(K / elems) * bytes;
}

size_t blk_scratch_bytes(int M, int K) {
    size_t ints = parts_layout(NULL, M, K, NULL), floats = (size_t)M * K * sizeof(float);
    return ints > floats ? ints : floats;
}

void blk_prepare(int kind, const float *x, int M, int K, long ldx, void *scratch) {
    blk_prepare_rows(kind, x, M, K, ldx, NULL, scratch);
}

void blk_prepare_rows(int kind, const float *x, int M, int K, long ldx, const int *rows, void *scratch) {
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        act_t a = act_row(kind, scratch, M, K, m);
        const float *row = x + (size_t)(rows ? rows[m] : m) * ldx;
        if (kind >= 3) memcpy((float *)a.x, row, (size_t)K * sizeof(float));
        else if (kind == 2) quant_q8_k(row, K, (int8_t *)a.q, (float *)a.d, (int16_t *)a.bs, (int8_t *)a.qp);
        else quant_q8_0(row, K, (int8_t *)a.q, (float *)a.d, (int32_t *)a.c, (int32_t *)a.cb);
    }
}

void blk_tiles(int type, const uint8_t *blocks, int N, int K, void *scratch, int M, float *y, long ldy) {
    blk_tiles_rows(type, blocks, N, K, scratch, M, 0, M, y, ldy);
}

void blk_tiles_rows(int type, const uint8_t *blocks, int N, int K, void *scratch, int Mall, int m_first, int M, float *y,
                    long ldy) {
    int elems = 1, bytes = 0, kind = blk_kind(type);
    block_info(type, &elems, &bytes);
    size_t row_bytes = (size_t)(K / elems) * bytes;
    if (expanded(type) && !fused_b32(type)) {  /* each row expanded once (to int8 values and scales), then times every
                                                 activation row */
        int8_t v[K];
        float sc[K / 16], mn[K / 16];
        #pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            int mins = expand_row(type, blocks + (size_t)n * row_bytes, K, v, sc, mn);
            float out[DS_MAX_ROWS > MG ? DS_MAX_ROWS : MG];
            for (int m0 = 0; m0 < M; m0 += DS_MAX_ROWS) {
                int mm = M - m0 < DS_MAX_ROWS ? M - m0 : DS_MAX_ROWS;
                act_t am[DS_MAX_ROWS];
                for (int m = 0; m < mm; m++) am[m] = act_row(kind, scratch, Mall, K, m_first + m0 + m);
                row_expanded(v, sc, mins > 0 ? mn : NULL, K, am, mm, out);
                for (int m = 0; m < mm; m++) y[(size_t)(m0 + m) * ldy + n] = out[m];
            }
        }
        return;
    }
    if (kind == 3) {  /* F16/BF16: the f32 activations times each row widened to f32, MG activation rows a pass */
        act_t a[MG];
        #pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            const uint8_t *row = blocks + (size_t)n * row_bytes;
            if (M > MG && n + 1 < N) _mm_prefetch((const char *)(row + row_bytes), _MM_HINT_T0);
            for (int m0 = 0; m0 < M; m0 += MG) {
                int mg = M - m0 < MG ? M - m0 : MG;
                for (int m = 0; m < mg; m++) a[m] = act_row(kind, scratch, Mall, K, m_first + m0 + m);
                float out[MG];
                row_half(type, row, K, a, mg, out);
                for (int m = 0; m < mg; m++) y[(size_t)(m0 + m) * ldy + n] = out[m];
            }
        }
        return;
    }
    blk_tiles_isa(type, kind, blocks, row_bytes, N, K, scratch, Mall, m_first, M, y, ldy);
}

/* y[m, n] = sum_k v(n, k) x[m, k] for a tensor [N, K] of blocks of `type` (rows after each other); any M.
 * Returns 0, or -1 when it cannot take the product (type, K, memory). */
int ds_linear_blocks(int type, const float *x, int M, int K, long ldx, const uint8_t *blocks, int N, float *y,
                     long ldy, int nthreads) {
    int kind = blk_kind(type), elems = 1, bytes = 0;
    if (M <= 0 || N <= 0 || !kind || (block_info(type, &elems, &bytes), K % elems)) return -1;
    void *scratch = malloc(blk_scratch_bytes(M, K));
    if (!scratch) return -1;
    #pragma omp parallel num_threads(nthreads)
    {
        blk_prepare(kind, x, M, K, ldx, scratch);
        blk_tiles(type, blocks, N, K, scratch, M, y, ldy);
    }
    free(scratch);
    return 0;
}
#endif  /* DS_AVX2 */
