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
int ds_causal_conv(const float *x, float *conv_state, const float *w, float *out, int T, int C, int Kc,
                   int nthreads, long ldx) {
    if (T <= 0 || C <= 0 || Kc < 2 || ldx < C) return -1;
    int H = Kc - 1;
    float *wt = malloc((size_t)Kc * C * sizeof(float));
    if (!wt) return -1;
    for (int c = 0; c < C; c++)
        for (int j = 0; j < Kc; j++) wt[(size_t)j * C + c] = w[(size_t)c * Kc + j];
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < T; t++) {
        float *o = out + (size_t)t * C;
        for (int c = 0; c < C; c++) o[c] = 0.0f;
        for (int j = 0; j < Kc; j++) {
            int r = t + j;  /* row of the window */
            const float *src = r < H ? conv_state + (size_t)r * C : x + (size_t)(r - H) * ldx;
            const float *wj = wt + (size_t)j * C;
            for (int c = 0; c < C; c++) o[c] += wj[c] * src[c];
        }
        silu_inplace(o, C);
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
 * The gated delta rule over T tokens of one sequence (a prefill), token by token, updating S [H, dk, dv]:
 * the recurrence of the decode step, S = e^g S; delta = beta (v - S^T k); S += k delta^T; o = S^T q.
 * Each value column of a head's state evolves on its own given the token's k, q and gates, so the work is
 * split into (head, 32 columns) items whose 128 x 32 slice of the state (16 KB, copied out to a contiguous block
 * and back) stays in L1 for all T tokens;
 * one pass over the slice per token both applies token t's update and gathers S^T k and S^T q for token
 * t + 1 (o = S_new^T q = e^g S_old^T q + (k.q) delta). q, k: [T, H, dk] (one per value head, normalised, q
 * scaled), v, out: [T, H, dv], g, beta: [T, H]. Returns -1 where dv is not a multiple of 32.
 * ------------------------------------------------------------------------------------------------------- */
/* One pass over a 32-column slice s of a head's state (rows of stride dv): where ku is given, token t's update
 * row_i = vd row_i + ku[i] (d0, d1), stored; where kn is given, the next token's S^T k and S^T q gathered from
 * the (updated) rows into kv[0..1], qs[0..1]. Two rows at a time: eight independent accumulation chains.
 * Inlined with constant NULLs, each call site compiles to its own loop. */
static inline __attribute__((always_inline)) void dr_pass(float *s, int dk, int dv, const float *ku, __m512 vd,
                                                          __m512 d0, __m512 d1, const float *kn, const float *qn,
                                                          __m512 kv[2], __m512 qs[2]) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, e0 = a0, e1 = a0, f0 = a0, f1 = a0;
    for (int i = 0; i < dk; i += 2) {
        float *r0 = s + (size_t)i * dv, *r1 = r0 + dv;
        __m512 s0 = _mm512_loadu_ps(r0), s1 = _mm512_loadu_ps(r0 + 16);
        __m512 u0 = _mm512_loadu_ps(r1), u1 = _mm512_loadu_ps(r1 + 16);
        if (ku) {
            s0 = _mm512_fmadd_ps(_mm512_set1_ps(ku[i]), d0, _mm512_mul_ps(vd, s0));
            s1 = _mm512_fmadd_ps(_mm512_set1_ps(ku[i]), d1, _mm512_mul_ps(vd, s1));
            u0 = _mm512_fmadd_ps(_mm512_set1_ps(ku[i + 1]), d0, _mm512_mul_ps(vd, u0));
            u1 = _mm512_fmadd_ps(_mm512_set1_ps(ku[i + 1]), d1, _mm512_mul_ps(vd, u1));
            _mm512_storeu_ps(r0, s0); _mm512_storeu_ps(r0 + 16, s1);
            _mm512_storeu_ps(r1, u0); _mm512_storeu_ps(r1 + 16, u1);
        }
        if (kn) {
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(kn[i]), s0, a0); a1 = _mm512_fmadd_ps(_mm512_set1_ps(kn[i]), s1, a1);
            b0 = _mm512_fmadd_ps(_mm512_set1_ps(qn[i]), s0, b0); b1 = _mm512_fmadd_ps(_mm512_set1_ps(qn[i]), s1, b1);
            e0 = _mm512_fmadd_ps(_mm512_set1_ps(kn[i + 1]), u0, e0); e1 = _mm512_fmadd_ps(_mm512_set1_ps(kn[i + 1]), u1, e1);
            f0 = _mm512_fmadd_ps(_mm512_set1_ps(qn[i + 1]), u0, f0); f1 = _mm512_fmadd_ps(_mm512_set1_ps(qn[i + 1]), u1, f1);
        }
    }
    if (kn) {
        kv[0] = _mm512_add_ps(a0, e0); kv[1] = _mm512_add_ps(a1, e1);
        qs[0] = _mm512_add_ps(b0, f0); qs[1] = _mm512_add_ps(b1, f1);
    }
}

int ds_delta_rule(const float *q, const float *k, const float *v, const float *g, const float *beta, float *S,
                  float *out, int T, int H, int dk, int dv, int nthreads) {
    if (T <= 0 || H <= 0 || dk <= 0 || dk % 2 || dv % 32) return -1;
    int per_head = dv / 32;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int item = 0; item < H * per_head; item++) {
        int h = item / per_head, c0 = (item % per_head) * 32;
        float *sg = S + (size_t)h * dk * dv + c0;
        /* the slice copied to a contiguous dk x 32 block: in place, its rows dv floats apart fall in a few of L1's
           sets (dv 128: a stride of 512 bytes, 16 of 64 sets), more lines than their ways hold (one thread's 512
           tokens of 16 heads: 19.3 -> 15.4 ms on the Xeon) */
        float sbuf[dk * 32] __attribute__((aligned(64)));
        float *s = sbuf;
        for (int i = 0; i < dk; i++) memcpy(s + (size_t)i * 32, sg + (size_t)i * dv, 32 * sizeof(float));
        __m512 zero = _mm512_setzero_ps(), kv[2] = {zero, zero}, qs[2] = {zero, zero};
        dr_pass(s, dk, 32, NULL, zero, zero, zero, k + (size_t)h * dk, q + (size_t)h * dk, kv, qs);  /* the first token's */
        for (int t = 0; t < T; t++) {
            size_t th = (size_t)t * H + h;
            const float *kt = k + th * dk, *qt = q + th * dk, *vt = v + th * dv + c0;
            __m512 kqv = _mm512_setzero_ps();
            for (int i = 0; i + 16 <= dk; i += 16) kqv = _mm512_fmadd_ps(_mm512_loadu_ps(kt + i), _mm512_loadu_ps(qt + i), kqv);
            float kq = _mm512_reduce_add_ps(kqv);
            for (int i = dk / 16 * 16; i < dk; i++) kq += kt[i] * qt[i];
            float decay = expf(g[th]);
            __m512 vd = _mm512_set1_ps(decay), vb = _mm512_set1_ps(beta[th]), vkq = _mm512_set1_ps(kq);
            __m512 d0 = _mm512_mul_ps(vb, _mm512_fnmadd_ps(vd, kv[0], _mm512_loadu_ps(vt)));
            __m512 d1 = _mm512_mul_ps(vb, _mm512_fnmadd_ps(vd, kv[1], _mm512_loadu_ps(vt + 16)));
            float *ot = out + th * dv + c0;
            _mm512_storeu_ps(ot, _mm512_fmadd_ps(vkq, d0, _mm512_mul_ps(vd, qs[0])));
            _mm512_storeu_ps(ot + 16, _mm512_fmadd_ps(vkq, d1, _mm512_mul_ps(vd, qs[1])));
            if (t + 1 < T)  /* token t's update, and what token t + 1 reads from the new state */
                dr_pass(s, dk, 32, kt, vd, d0, d1, k + (th + H) * dk, q + (th + H) * dk, kv, qs);
            else
                dr_pass(s, dk, 32, kt, vd, d0, d1, NULL, NULL, kv, qs);
        }
        for (int i = 0; i < dk; i++) memcpy(sg + (size_t)i * dv, s + (size_t)i * 32, 32 * sizeof(float));
    }
    return 0;
}

#endif  /* AVX512 */
