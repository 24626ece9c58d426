/* deltaserve's native CPU products on AVX512-VNNI for weights="tables": int8 weight tables, or a file's Q4_K blocks
 * repacked at load, times a few activation rows (decode, batched decode; tables.h: the same as pieces of the
 * one-call decode's team), and the prefill's delta rule and causal conv.
 *
 * Built by kernels/native.py with the system C compiler (-O3 -march=native -fopenmp) the first time a CPU
 * forward needs it; it is linked against the libgomp torch already loaded (same soname), so its parallel
 * regions run on the same OpenMP runtime as torch's.
 *
 * y[m, n] = ws[n] * sum_k W[n, k] * x[m, k]
 *   W: int8 [N, K] row-major (values in [-127, 127]), ws: f32 [N] per-row scales,
 *   x: f32 [M, K] (row stride ldx), y: f32 [M, N] (row stride ldy).
 * The activations are quantized to int8 per block of 32 (one f32 scale per block, round to nearest), as
 * llama.cpp does for its Q8_0 products. AVX512-VNNI's vpdpbusd multiplies unsigned by signed bytes: the
 * weight enters unsigned (w + 128, an xor of the sign bit) and the activation signed; the 128 * sum(x) this
 * adds is one constant per activation row, subtracted at the end.
 * Each thread streams a contiguous run of 4-row tiles and prefetches PREFETCH bytes ahead: without the
 * prefetch a tile of 4 interleaved row streams read ~28 GB/s here, with it as fast as a plain linear read.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#include "tables.h"
#include "vmath.h"  /* exp512 */

#define QB 32
#define PREFETCH 8192

int ds_abi_version(void) { return DS_ABI; }

/* Everything below needs AVX512F, AVX512BW and AVX512-VNNI (the build is -march=native): on a CPU without them
 * none of it is compiled, and kernels/native.py sees which functions the library has (a missing symbol is a
 * kernel this CPU does not run; blocks.c and native_avx2.c hold what runs on AVX2). */
#ifdef DS_TABLES


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
 * blocks as they lie are blocks.c's). Rows are N runs of K/256 blocks. The activations are quantized to int8 with
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

/* ---- the team-level pieces (tables.h): the one-call decode of native_avx2.c runs these for DS_I8 and DS_Q4KR
 * segments, as it runs blocks.c's for the file's blocks ------------------------------------------------------ */

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

/* ---------------------------------------------------------------------------------------------------------
 * The prefill's causal conv of a DeltaNet layer, with SiLU in 16 lanes (the decode's one-token DeltaNet step,
 * ds_deltanet_step, is native_avx2.c's on every CPU).
 * ------------------------------------------------------------------------------------------------------- */

/* v[i] = silu(v[i]) = v / (1 + e^-v), in place, n values */
static void silu_inplace(float *v, int n) {
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
       for every row; a 512-row prefill's 18 layers on the Xeon: 54 ms, 43 in blocks of 512 channels, 61 of 128,
       52 of 2048) */
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
            silu_inplace(o, n);
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
 * the arithmetic's rate; the scalars (decays, the dot products) once per chunk and head, shared by its column groups.
 * One thread's 512 tokens of 16 heads on the Xeon: 19.3 ms a pass a token in place, 15.4 on the contiguous copy,
 * 7.4 a pass a chunk of 4 (two column groups alternated). q, k: [T, H, dk] (one per value head, normalised, q
 * scaled), v, out: [T, H, dv], g, beta: [T, H]. Returns -1 where dv is not a multiple of 32 (or memory is short).
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
           microcode assist (a 0.8B prefill's 512 tokens: 21.8 ms a layer, 6.0 without them) */
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

#endif  /* AVX512 */
