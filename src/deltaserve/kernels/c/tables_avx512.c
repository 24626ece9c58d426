/* tables_avx512.c: the products of weights="tables" on AVX512-VNNI: int8 weight tables, or a file's Q4_K blocks
 * repacked at load, times a few activation rows (decode, a batched decode; tables.h: the same as pieces of the
 * one-call decode's team), and the int8 x int8 GEMM's activations and epilogue (torch's _int_mm between them).
 *
 * y[m, n] = ws[n] * sum_k W[n, k] * x[m, k]
 *   W: int8 [N, K] row-major (values in [-127, 127]), ws: f32 [N] per-row scales,
 *   x: f32 [M, K] (row stride ldx), y: f32 [M, N] (row stride ldy).
 * The activations are quantized to int8 per block of 32 (one f32 scale per block, round to nearest), as
 * llama.cpp does for its Q8_0 products. AVX512-VNNI's vpdpbusd multiplies unsigned by signed bytes: the
 * weight enters unsigned (w + 128, an xor of the sign bit) and the activation signed; the 128 * sum(x) this
 * adds is one constant per activation row, subtracted at the end.
 * Each thread streams a contiguous run of 4-row tiles and prefetches PREFETCH bytes ahead (a tile's 4 interleaved
 * row streams read well below a plain linear read's speed without it). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#include "tables.h"

#ifdef DS_TABLES

#define QB 32
#define PREFETCH 8192

/* One activation row: q (int8), lane scales dv (one per 4 elements: the scale of the element's block, so a
 * 64-byte chunk's 16 int32 lanes are scaled by one vector) and the correction 128 * sum(dv * q). */
static float quantize_row(const float *x, int K, int8_t *q, float *dv) {
    float corr = 0.0f;
    for (int b = 0; b < K; b += QB) {
        __m512 lo = _mm512_loadu_ps(x + b), hi = _mm512_loadu_ps(x + b + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
        __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(q + b), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q + b + 16), _mm512_cvtsepi32_epi8(qhi));
        corr += 128.0f * d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        for (int i = 0; i < QB / 4; i++) dv[b / 4 + i] = d;
    }
    return corr;
}

static inline __m512i load_w(const int8_t *p, __mmask64 k) {
    return _mm512_xor_si512(_mm512_maskz_loadu_epi8(k, p), _mm512_set1_epi8((char)0x80));
}

static inline __m512 dot_chunk(__m512 acc, __m512i wu, __m512i xq, __m512 dv) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, xq)), dv, acc);
}

/* rows n0..n0+R-1 (R = 4 or 1) against activation rows m0, m0+1 (two = 1 when only one is left). */
#define ROWS_BODY(R)                                                                                          \
    for (int m = 0; m < M; m += 2) {                                                                          \
        int two = m + 1 < M;                                                                                  \
        const int8_t *qa = xq + (size_t)m * K, *qb = two ? qa + K : qa;                                       \
        const float *da = dv + (size_t)m * K4, *db = two ? da + K4 : da;                                      \
        __m512 a[R], b[R];                                                                                    \
        for (int r = 0; r < R; r++) a[r] = b[r] = _mm512_setzero_ps();                                        \
        for (int c = 0; c < K; c += 64) {                                                                     \
            __mmask64 k = c + 64 <= K ? ~0ULL : (1ULL << (K - c)) - 1;                                        \
            if (m == 0 && R == 4) {                                                                           \
                const char *p = (const char *)(w0 + PREFETCH + 4 * (size_t)c);                                \
                _mm_prefetch(p, _MM_HINT_T0); _mm_prefetch(p + 64, _MM_HINT_T0);                              \
                _mm_prefetch(p + 128, _MM_HINT_T0); _mm_prefetch(p + 192, _MM_HINT_T0);                       \
            }                                                                                                 \
            __m512i xa = _mm512_maskz_loadu_epi8(k, qa + c), xb = _mm512_maskz_loadu_epi8(k, qb + c);         \
            __mmask16 kd = (__mmask16)(c + 64 <= K ? 0xFFFF : (1u << ((K - c) / 4)) - 1);                     \
            __m512 va = _mm512_maskz_loadu_ps(kd, da + c / 4), vb = _mm512_maskz_loadu_ps(kd, db + c / 4);    \
            for (int r = 0; r < R; r++) {                                                                     \
                __m512i wu = load_w(w0 + (size_t)r * K + c, k);                                               \
                a[r] = dot_chunk(a[r], wu, xa, va);                                                           \
                if (two) b[r] = dot_chunk(b[r], wu, xb, vb);                                                  \
            }                                                                                                 \
        }                                                                                                     \
        for (int r = 0; r < R; r++) {                                                                         \
            y[(size_t)m * ldy + n0 + r] = (_mm512_reduce_add_ps(a[r]) - corr[m]) * ws[n0 + r];                \
            if (two) y[(size_t)(m + 1) * ldy + n0 + r] = (_mm512_reduce_add_ps(b[r]) - corr[m + 1]) * ws[n0 + r]; \
        }                                                                                                     \
    }

/* Rows 0..N-1 of W against M quantized activation rows, shared among the threads of the enclosing team
 * (an orphaned worksharing loop: a parallel region of the caller's, or one thread outside any), no barrier. */
static void i8_tiles(const int8_t *W, const float *ws, int N, int K, const int8_t *xq, const float *dv,
                     const float *corr, int M, float *y, long ldy) {
    const int K4 = K / 4;
    int tiles = N / 4;
    #pragma omp for schedule(static) nowait
    for (int t = 0; t < tiles + (N - tiles * 4); t++) {
        if (t < tiles) {
            int n0 = t * 4;
            const int8_t *w0 = W + (size_t)n0 * K;
            ROWS_BODY(4)
        } else {
            int n0 = tiles * 4 + (t - tiles);
            const int8_t *w0 = W + (size_t)n0 * K;
            ROWS_BODY(1)
        }
    }
}

/* Returns 0, or -1 when the shapes are not supported (K not a multiple of 32) or memory ran out. */
int ds_linear_i8(const float *x, int M, int K, long ldx, const int8_t *W, const float *ws, int N, float *y,
                 long ldy, int nthreads) {
    if (K <= 0 || K % QB || M <= 0 || N <= 0) return -1;
    int K4 = K / 4;
    int8_t *xq = malloc((size_t)M * K + 64);
    float *dv = malloc(((size_t)M * K4 + 16) * sizeof(float));
    float *corr = malloc((size_t)M * sizeof(float));
    if (!xq || !dv || !corr) { free(xq); free(dv); free(corr); return -1; }
    for (int m = 0; m < M; m++) corr[m] = quantize_row(x + (size_t)m * ldx, K, xq + (size_t)m * K, dv + (size_t)m * K4);
    #pragma omp parallel num_threads(nthreads)
    i8_tiles(W, ws, N, K, xq, dv, corr, M, y, ldy);
    free(xq); free(dv); free(corr);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------
 * A file's Q4_K blocks (256 values per block), repacked once at load (ds_repack_q4k; the file's own Q4_K and Q6_K
 * blocks as they lie are products.c's). Rows are N runs of K/256 blocks. The activations are quantized to int8 with
 * one scale per 256 values (as llama.cpp does for its K-quant products), so a whole block accumulates in int32:
 * each 64-value chunk is unpacked to unsigned bytes, multiplied pairwise with the activations (vpmaddubsw,
 * int16), and the pairs are multiplied by their sub-block's integer scale and summed (vpdpwssd, int32).
 * v = d*sc*q - dmin*m (q in 0..15): the min term is dmin * sum over sub-blocks of m * sum(x).
 * No int16 or int32 sum can overflow: |pair| <= 2*15*127, |sc| <= 63, 128 pairs per block.
 * ------------------------------------------------------------------------------------------------------- */
#define MAXM DS_MAX_ROWS

typedef struct {
    const int8_t *q;     /* [K] int8 activations */
    const float *d;      /* [K/256] their scales */
    const int16_t *s16;  /* [K/16] sums of each 16 int8 values */
    const int8_t *qp;    /* [K] the same int8 values in the order of the repacked Q4_K blocks (see below) */
} act_t;

static inline float f16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    return _cvtsh_ss(h);
}

/* Where byte t of a repacked Q4_K block's activation order comes from in the natural order (see ds_repack_q4k). */
static inline int q4kr_source(int t) {
    int half = t / 128, hi = (t % 128) / 64, p = t % 64, lane = p / 2;
    return 32 * (4 * half + lane % 4) + 16 * hi + 2 * (lane / 4) + p % 2;
}

static void prepare(const float *x, int K, int8_t *q, float *d, int16_t *s16, int8_t *qp) {
    for (int b = 0; b < K; b += 256) {
        __m512 mx = _mm512_setzero_ps();
        for (int i = 0; i < 256; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + b + i)));
        float amax = _mm512_reduce_max_ps(mx);
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b / 256] = amax / 127.0f;
        for (int i = 0; i < 256; i += 16) {
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + b + i), _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)(q + b + i), _mm512_cvtsepi32_epi8(v));
            s16[(b + i) / 16] = (int16_t)_mm512_reduce_add_epi32(v);
        }
        for (int t = 0; t < 256; t++) qp[b + t] = q[b + q4kr_source(t)];
    }
}

/* Q4_K blocks repacked once at load for the product below (152 bytes instead of 144): the block's two f16
 * factors as f32, its 8 six-bit scales and 8 mins as bytes, then its 256 four-bit values in an order that
 * needs no scale shuffle: each of the two 64-byte halves holds sub-blocks 4h..4h+3, and in each 16-bit lane
 * (two values) of either nibble plane the sub-block is the lane's index mod 4. So the int16 scales of a
 * half are one 64-bit pattern broadcast across the register, and the activations are put in the same order
 * once per product (q4kr_source). Byte p of half h: lane = p / 2, sub-block s = 4h + lane % 4, value
 * i = 2 (lane / 4) + p % 2 of it in the low nibble and value 16 + i in the high nibble. */
#define Q4KR DS_Q4KR
#define Q4KR_BYTES 152

int ds_repack_q4k(const uint8_t *src, long nblocks, uint8_t *dst) {
    for (long i = 0; i < nblocks; i++) {
        const uint8_t *b = src + i * 144;
        uint8_t *o = dst + i * Q4KR_BYTES;
        float d = f16(b), dmin = f16(b + 2);
        __builtin_memcpy(o, &d, 4);
        __builtin_memcpy(o + 4, &dmin, 4);
        const uint8_t *q = b + 4;
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            if (j < 4) { sc = q[j] & 63; mn = q[j + 4] & 63; }
            else { sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
            o[8 + j] = (uint8_t)sc;
            o[16 + j] = (uint8_t)mn;
        }
        const uint8_t *qs = b + 16;  /* sub-block s, value v: nibble (s odd: high) of byte 32 (s / 2) + v */
        for (int t = 0; t < 128; t++) {  /* byte p of half h: activation-order values 128h + p and 128h + 64 + p */
            int src_lo = q4kr_source(128 * (t / 64) + t % 64), src_hi = src_lo + 16;
            int vl = (qs[32 * (src_lo / 64) + src_lo % 32] >> (4 * ((src_lo / 32) % 2))) & 0xF;
            int vh = (qs[32 * (src_hi / 64) + src_hi % 32] >> (4 * ((src_hi / 32) % 2))) & 0xF;
            o[24 + t] = (uint8_t)(vl | (vh << 4));
        }
    }
    return 0;
}

static inline __attribute__((always_inline)) void rows_q4kr(const uint8_t *row0, size_t row_bytes, const int R,
                                                            int K, const act_t *a, int M, float *out) {
    __m512 vacc[4][MAXM];
    __m128 macc[4][MAXM];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) { vacc[r][m] = _mm512_setzero_ps(); macc[r][m] = _mm_setzero_ps(); }
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk[4];
        __m512i sc[4][2];
        __m128i mn[4];
        __m512i dot[4][MAXM];
        for (int r = 0; r < R; r++) {
            blk[r] = row0 + (size_t)r * row_bytes + (size_t)b * Q4KR_BYTES;
            for (int p = 0; p < Q4KR_BYTES; p += 64) _mm_prefetch((const char *)blk[r] + PREFETCH + p, _MM_HINT_T0);
            __m128i s8 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(blk[r] + 8)));
            sc[r][0] = _mm512_broadcastq_epi64(s8);
            sc[r][1] = _mm512_broadcastq_epi64(_mm_unpackhi_epi64(s8, s8));
            mn[r] = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(blk[r] + 16)));
            for (int m = 0; m < M; m++) dot[r][m] = _mm512_setzero_si512();
        }
        for (int h = 0; h < 2; h++) {
            for (int r = 0; r < R; r++) {
                __m512i raw = _mm512_loadu_si512(blk[r] + 24 + 64 * h);
                __m512i wl = _mm512_and_si512(raw, lo4), wh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
                for (int m = 0; m < M; m++) {
                    const int8_t *ap = a[m].qp + b * 256 + 128 * h;
                    dot[r][m] = _mm512_dpwssd_epi32(dot[r][m], _mm512_maddubs_epi16(wl, _mm512_loadu_si512(ap)), sc[r][h]);
                    dot[r][m] = _mm512_dpwssd_epi32(dot[r][m], _mm512_maddubs_epi16(wh, _mm512_loadu_si512(ap + 64)), sc[r][h]);
                }
            }
        }
        for (int m = 0; m < M; m++) {
            const int16_t *bs = a[m].s16 + b * 16;
            __m128i pairs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)bs), _mm_loadu_si128((const __m128i *)(bs + 8)));
            float da = a[m].d[b];
            for (int r = 0; r < R; r++) {
                float d, dmin;
                __builtin_memcpy(&d, blk[r], 4);
                __builtin_memcpy(&dmin, blk[r] + 4, 4);
                vacc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][m]), _mm512_set1_ps(d * da), vacc[r][m]);
                macc[r][m] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(pairs, mn[r])), _mm_set1_ps(dmin * da), macc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) {
            __m128 t = macc[r][m];
            t = _mm_add_ps(t, _mm_movehl_ps(t, t));
            t = _mm_add_ss(t, _mm_movehdup_ps(t));
            out[r * MAXM + m] = _mm512_reduce_add_ps(vacc[r][m]) - _mm_cvtss_f32(t);
        }
}

/* Rows 0..N-1 of a repacked Q4_K tensor against M prepared activation rows, shared among the threads of the
 * enclosing team as i8_tiles is; four rows at a time where the accumulators fit in registers (M <= 2). */
static void q4kr_tiles(const uint8_t *blocks, int N, int K, const act_t *a, int M, float *y, long ldy) {
    size_t row_bytes = (size_t)(K / 256) * Q4KR_BYTES;
    int R = M <= 2 ? 4 : 1, tiles = N / R;
    #pragma omp for schedule(static) nowait
    for (int t = 0; t < tiles + (N - tiles * R); t++) {
        int n = t < tiles ? t * R : tiles * R + (t - tiles), rows = t < tiles ? R : 1;
        float out[4 * MAXM];
        const uint8_t *row = blocks + (size_t)n * row_bytes;
        if (rows == 4) rows_q4kr(row, row_bytes, 4, K, a, M, out);
        else rows_q4kr(row, row_bytes, 1, K, a, M, out);
        for (int r = 0; r < rows; r++)
            for (int m = 0; m < M; m++) y[(size_t)m * ldy + n + r] = out[r * MAXM + m];
    }
}

/* y[m, n] = sum_k v(n, k) x[m, k] for the blocks of a repacked Q4_K (type 112) tensor [N, K]. M <= 8, K a multiple
 * of 256. Returns 0, or -1 when it cannot take the product. */
int ds_linear_kq(int type, const float *x, int M, int K, long ldx, const uint8_t *blocks, int N, float *y,
                 long ldy, int nthreads) {
    if (K <= 0 || K % 256 || M <= 0 || M > MAXM || N <= 0 || type != Q4KR) return -1;
    int8_t *q = malloc((size_t)M * K), *qp = malloc((size_t)M * K);
    float *d = malloc((size_t)M * K / 256 * sizeof(float));
    int16_t *s16 = malloc((size_t)M * K / 16 * sizeof(int16_t));
    if (!q || !qp || !d || !s16) { free(q); free(qp); free(d); free(s16); return -1; }
    act_t a[MAXM];
    for (int m = 0; m < M; m++) {
        a[m].q = q + (size_t)m * K; a[m].d = d + (size_t)m * K / 256; a[m].s16 = s16 + (size_t)m * K / 16;
        a[m].qp = qp + (size_t)m * K;
        prepare(x + (size_t)m * ldx, K, (int8_t *)a[m].q, (float *)a[m].d, (int16_t *)a[m].s16, (int8_t *)a[m].qp);
    }
    #pragma omp parallel num_threads(nthreads)
    q4kr_tiles(blocks, N, K, a, M, y, ldy);
    free(q); free(qp); free(d); free(s16);
    return 0;
}

/* ---- the team-level pieces (tables.h): the one-call decode (decode.c) runs these for DS_I8 and DS_Q4KR segments,
 * as it runs products.h's for the file's blocks ----------------------------------------------------------------- */

int tab_kind(int type) { return type == DS_I8 ? 1 : type == Q4KR ? 2 : 0; }

typedef struct {           /* a prepared product's activations, M rows of K (tab_parts: where in the scratch) */
    int8_t *q, *qp;        /* int8 values; DS_Q4KR: also in the repacked blocks' order */
    float *dv, *corr;      /* DS_I8: lane scales (one per 4 values), 128 * sum(dv * q) per row */
    float *d;              /* DS_Q4KR: one scale per 256 values */
    int16_t *s16;          /* DS_Q4KR: sums of 16 values */
} tab_act_t;

static tab_act_t tab_parts(void *scratch, int M, int K) {
    uint8_t *p = scratch;
    tab_act_t t;
    t.q = (int8_t *)p, p += (size_t)M * K + 64;
    t.qp = (int8_t *)p, p += (size_t)M * K + 64;
    t.dv = (float *)p, p += ((size_t)M * (K / 4) + 16) * sizeof(float);
    t.corr = (float *)p, p += (MAXM + 16) * sizeof(float);
    t.d = (float *)p, p += ((size_t)M * (K / 256) + 16) * sizeof(float);
    t.s16 = (int16_t *)p;
    return t;
}

size_t tab_scratch_bytes(int M, int K) {
    return 2 * ((size_t)M * K + 64) + ((size_t)M * (K / 4) + (K / 256) * M + MAXM + 48) * sizeof(float)
           + ((size_t)M * (K / 16) + 32) * sizeof(int16_t);
}

void tab_prepare(int kind, const float *x, int M, int K, void *scratch) {
    tab_act_t t = tab_parts(scratch, M, K);
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        if (kind == 1) t.corr[m] = quantize_row(x + (size_t)m * K, K, t.q + (size_t)m * K, t.dv + (size_t)m * (K / 4));
        else prepare(x + (size_t)m * K, K, t.q + (size_t)m * K, t.d + (size_t)m * (K / 256), t.s16 + (size_t)m * (K / 16),
                     t.qp + (size_t)m * K);
    }
}

void tab_tiles(const seg_t *g, int K, void *scratch, int M, float *y, long ldy) {
    tab_act_t t = tab_parts(scratch, M, K);
    if (g->type == DS_I8) {
        i8_tiles((const int8_t *)g->data, g->scale, g->rows, K, t.q, t.dv, t.corr, M, y, ldy);
        return;
    }
    act_t a[MAXM];
    for (int m = 0; m < M; m++) {
        act_t r = {t.q + (size_t)m * K, t.d + (size_t)m * (K / 256), t.s16 + (size_t)m * (K / 16), t.qp + (size_t)m * K};
        a[m] = r;
    }
    q4kr_tiles((const uint8_t *)g->data, g->rows, K, a, M, y, ldy);
}

/* Per-row symmetric int8 quantization of the activations of a many-row product (what linear.py's
 * quantize_rows_int8 does in five passes over x, here in two): scale[m] = max(|x[m]| / 127, FLT_MIN),
 * q = round-to-nearest-even(x / scale). Bit for bit the same as the torch version. */
int ds_quantize_rows(const float *x, int M, int K, long ldx, int8_t *q, float *scale, int nthreads) {
    if (M <= 0 || K <= 0) return -1;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int m = 0; m < M; m++) {
        const float *row = x + (size_t)m * ldx;
        __m512 mx = _mm512_setzero_ps();
        for (int k = 0; k < K; k += 16) {
            __mmask16 kk = (__mmask16)(k + 16 <= K ? 0xFFFF : (1u << (K - k)) - 1);
            mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_maskz_loadu_ps(kk, row + k)));
        }
        float s = _mm512_reduce_max_ps(mx) / 127.0f;
        if (!(s >= 1.17549435e-38f)) s = 1.17549435e-38f;
        scale[m] = s;
        __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
        for (int k = 0; k < K; k += 16) {
            __mmask16 kk = (__mmask16)(k + 16 <= K ? 0xFFFF : (1u << (K - k)) - 1);
            __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(kk, row + k), vs),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
            _mm_mask_storeu_epi8(q + (size_t)m * K + k, kk, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
        }
    }
    return 0;
}

/* y[m, n] = (float)acc[m, n] * col[n] * row[m]: the epilogue of an int8 x int8 product, in one pass
 * (the same rounding order as torch.mul(acc, col).mul_(row[:, None])). */
int ds_scale_product(const int32_t *acc, int M, int N, const float *col, const float *row, float *y, int nthreads) {
    if (M <= 0 || N <= 0) return -1;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int m = 0; m < M; m++) {
        __m512 r = _mm512_set1_ps(row[m]);
        for (int n = 0; n < N; n += 16) {
            __mmask16 kk = (__mmask16)(n + 16 <= N ? 0xFFFF : (1u << (N - n)) - 1);
            __m512 v = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(kk, acc + (size_t)m * N + n));
            v = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_maskz_loadu_ps(kk, col + n)), r);
            _mm512_mask_storeu_ps(y + (size_t)m * N + n, kk, v);
        }
    }
    return 0;
}
#endif  /* DS_TABLES */
