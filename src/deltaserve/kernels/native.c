/* deltaserve's native CPU products: int8 weight tables, or a file's own Q4_K / Q6_K blocks, times a few
 * activation rows (decode, batched decode).
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

#include "native.h"

#define QB 32
#define PREFETCH 8192

int ds_abi_version(void) { return DS_ABI; }

/* Everything below needs AVX512F, AVX512BW and AVX512-VNNI (the build is -march=native): on a CPU without them
 * none of it is compiled, and kernels/native.py sees which functions the library has (a missing symbol is a
 * kernel this CPU does not run; blocks.c and native_avx2.c hold what runs on AVX2). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)


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
 * The file's own K-quant blocks (GGUF Q4_K, Q6_K: 256 values per block), exactly as the file defines them.
 * Rows are N runs of K/256 blocks. The activations are quantized to int8 with one scale per 256 values (as
 * llama.cpp does for its K-quant products), so a whole block accumulates in int32: each 64-value chunk is
 * unpacked to unsigned bytes in natural order, multiplied pairwise with the activations (vpmaddubsw, int16),
 * and the pairs are multiplied by their sub-block's integer scale and summed (vpdpwssd, int32).
 * Q4_K: v = d*sc*q - dmin*m (q in 0..15): the min term is dmin * sum over sub-blocks of m * sum(x).
 * Q6_K: v = d*sc*(q - 32) (q in 0..63): the offset is 32 * sum over sub-blocks of sc * sum(x).
 * No int16 or int32 sum can overflow: |pair| <= 2*63*127, |sc| <= 127, 128 pairs per block.
 * ------------------------------------------------------------------------------------------------------- */
#define MAXM DS_MAX_ROWS
#define Q6K DS_Q6K

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
        if (qp)
            for (int t = 0; t < 256; t++) qp[b + t] = q[b + q4kr_source(t)];
    }
}

/* R consecutive rows (R is a constant after inlining: 4 rows give the out-of-order core four independent
 * accumulation chains; one row alone is bound by the latency of its own chain) times M activation rows:
 * out[r * MAXM + m]. */
static inline __attribute__((always_inline)) void rows_q6k(const uint8_t *row0, size_t row_bytes, const int R,
                                                           int K, const act_t *a, int M, float *out) {
    __m512 vacc[4][MAXM];
    float acc[4][MAXM];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) { vacc[r][m] = _mm512_setzero_ps(); acc[r][m] = 0.0f; }
    const __m512i lo4 = _mm512_set1_epi8(0x0F), hi2 = _mm512_set1_epi8(0x30);
    /* int16 lanes: pair p of a 64-value chunk belongs to sub-block p / 8 */
    const __m512i idx = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                         1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk[4];
        __m256i sc16[4];
        float d[4];
        __m512i dot[4][MAXM];
        for (int r = 0; r < R; r++) {
            blk[r] = row0 + (size_t)r * row_bytes + (size_t)b * 210;
            for (int p = 0; p < 210; p += 64) _mm_prefetch((const char *)blk[r] + PREFETCH + p, _MM_HINT_T0);
            d[r] = f16(blk[r] + 208);
            sc16[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk[r] + 192)));  /* 16 scales */
            for (int m = 0; m < M; m++) dot[r][m] = _mm512_setzero_si512();
        }
        for (int h = 0; h < 2; h++) {
            __m512i ia = _mm512_add_epi16(idx, _mm512_set1_epi16((short)(8 * h)));
            __m512i ib = _mm512_add_epi16(idx, _mm512_set1_epi16((short)(8 * h + 4)));
            int c = b * 256 + 128 * h;
            for (int r = 0; r < R; r++) {
                __m512i ql = _mm512_loadu_si512(blk[r] + 64 * h);
                __m256i qh = _mm256_loadu_si256((const __m256i *)(blk[r] + 128 + 32 * h));
                __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
                __m512i va = _mm512_or_si512(_mm512_and_si512(ql, lo4), _mm512_and_si512(_mm512_slli_epi16(qh2, 4), hi2));
                __m512i vb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), lo4), _mm512_and_si512(qh2, hi2));
                /* va: values 0..63 of the half (sub-blocks 8h+0..3), vb: 64..127 (8h+4..7), 8 pairs each */
                __m512i sc512 = _mm512_castsi256_si512(sc16[r]);
                __m512i sa = _mm512_permutexvar_epi16(ia, sc512), sb = _mm512_permutexvar_epi16(ib, sc512);
                for (int m = 0; m < M; m++) {
                    dot[r][m] = _mm512_dpwssd_epi32(dot[r][m], _mm512_maddubs_epi16(va, _mm512_loadu_si512(a[m].q + c)), sa);
                    dot[r][m] = _mm512_dpwssd_epi32(dot[r][m], _mm512_maddubs_epi16(vb, _mm512_loadu_si512(a[m].q + c + 64)), sb);
                }
            }
        }
        for (int m = 0; m < M; m++) {
            __m256i sums = _mm256_loadu_si256((const __m256i *)(a[m].s16 + b * 16));
            for (int r = 0; r < R; r++) {
                __m256i t = _mm256_madd_epi16(sc16[r], sums);
                __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
                u = _mm_add_epi32(u, _mm_srli_si128(u, 8));
                u = _mm_add_epi32(u, _mm_srli_si128(u, 4));
                float da = d[r] * a[m].d[b];
                vacc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][m]), _mm512_set1_ps(da), vacc[r][m]);
                acc[r][m] -= da * (float)(32 * _mm_cvtsi128_si32(u));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) out[r * MAXM + m] = acc[r][m] + _mm512_reduce_add_ps(vacc[r][m]);
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

/* Rows 0..N-1 of a repacked Q4_K (type 112) or Q6_K (type 14) tensor against M prepared activation rows,
 * shared among the threads of the enclosing team as i8_tiles is; four rows at a time where the accumulators
 * fit in registers (M <= 2). */
static void kq_tiles(int type, const uint8_t *blocks, int N, int K, const act_t *a, int M, float *y, long ldy) {
    size_t row_bytes = (size_t)(K / 256) * (type == Q4KR ? Q4KR_BYTES : 210);
    int R = M <= 2 ? 4 : 1, tiles = N / R;
    #pragma omp for schedule(static) nowait
    for (int t = 0; t < tiles + (N - tiles * R); t++) {
        int n = t < tiles ? t * R : tiles * R + (t - tiles), rows = t < tiles ? R : 1;
        float out[4 * MAXM];
        const uint8_t *row = blocks + (size_t)n * row_bytes;
        if (rows == 4) {
            if (type == Q4KR) rows_q4kr(row, row_bytes, 4, K, a, M, out); else rows_q6k(row, row_bytes, 4, K, a, M, out);
        } else {
            if (type == Q4KR) rows_q4kr(row, row_bytes, 1, K, a, M, out); else rows_q6k(row, row_bytes, 1, K, a, M, out);
        }
        for (int r = 0; r < rows; r++)
            for (int m = 0; m < M; m++) y[(size_t)m * ldy + n + r] = out[r * MAXM + m];
    }
}

/* y[m, n] = sum_k v(n, k) x[m, k] for the blocks of a repacked Q4_K (type 112) or a Q6_K (type 14) tensor [N, K].
 * M <= 8, K a multiple of 256. Returns 0, or -1 when it cannot take the product. */
int ds_linear_kq(int type, const float *x, int M, int K, long ldx, const uint8_t *blocks, int N, float *y,
                 long ldy, int nthreads) {
    if (K <= 0 || K % 256 || M <= 0 || M > MAXM || N <= 0 || (type != Q6K && type != Q4KR)) return -1;
    int8_t *q = malloc((size_t)M * K), *qp = malloc((size_t)M * K);
    float *d = malloc((size_t)M * K / 256 * sizeof(float));
    int16_t *s16 = malloc((size_t)M * K / 16 * sizeof(int16_t));
    if (!q || !qp || !d || !s16) { free(q); free(qp); free(d); free(s16); return -1; }
    act_t a[MAXM];
    for (int m = 0; m < M; m++) {
        a[m].q = q + (size_t)m * K; a[m].d = d + (size_t)m * K / 256; a[m].s16 = s16 + (size_t)m * K / 16;
        a[m].qp = qp + (size_t)m * K;
        prepare(x + (size_t)m * ldx, K, (int8_t *)a[m].q, (float *)a[m].d, (int16_t *)a[m].s16,
                type == Q4KR ? (int8_t *)a[m].qp : NULL);
    }
    #pragma omp parallel num_threads(nthreads)
    kq_tiles(type, blocks, N, K, a, M, y, ldy);
    free(q); free(qp); free(d); free(s16);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------
 * One token of a Gated DeltaNet mixer, after its input projections and before its output projection:
 * the causal conv (updating conv_state [Kc-1, C]) and SiLU, the L2-normalised q (scaled by dk^-1/2) and k,
 * the gates beta = sigmoid(b), g = a_neg * softplus(a + dt_bias), the gated delta rule on S [nv, dk, dv]
 * (S = e^g S; delta = beta (v - S^T k); S += k delta^T; o = S^T q) and the gated RMS norm
 * o * rsqrt(mean(o^2) + eps) * norm_w * silu(z). The same math as layers.py, in one pass per head
 * (torch's version is ~40 small ops per layer; here the state is read twice and written once).
 * Value head h reads key head h / (nv / nk) ("grouped") or h % nk ("tiled").
 * ------------------------------------------------------------------------------------------------------- */

/* e^x for 16 floats: x = n ln2 + r, |r| <= ln2/2, e^r by a degree-6 polynomial (the classic single-precision
 * coefficients; relative error ~1e-7), times 2^n. glibc's scalar expf made SiLU the slowest step here. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3f)), _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* v[i] = silu(v[i]) = v / (1 + e^-v), in place, n values */
static void silu_inplace(float *v, int n) {
    for (int i = 0; i < n; i += 16) {
        __mmask16 k = (__mmask16)(i + 16 <= n ? 0xFFFF : (1u << (n - i)) - 1);
        __m512 x = _mm512_maskz_loadu_ps(k, v + i);
        __m512 y = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        _mm512_mask_storeu_ps(v + i, k, y);
    }
}

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

/* Value head h of the step, after dn_mix: the gates, the delta rule on its state, the gated RMS norm. */
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
    float kv[dv], delta[dv], o[dv];
    for (int j = 0; j < dv; j++) kv[j] = 0.0f;
    for (int i = 0; i < dk; i++) {
        float ki = kk[i];
        const float *row = s + (size_t)i * dv;
        for (int j = 0; j < dv; j++) kv[j] += ki * row[j];
    }
    for (int j = 0; j < dv; j++) { delta[j] = beta * (vv[j] - decay * kv[j]); o[j] = 0.0f; }
    for (int i = 0; i < dk; i++) {
        float ki = kk[i], qi = qq[i];
        float *row = s + (size_t)i * dv;
        for (int j = 0; j < dv; j++) {
            float nw = decay * row[j] + ki * delta[j];
            row[j] = nw;
            o[j] += qi * nw;
        }
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
    if (nk <= 0 || nv % nk || Kc < 2) return -1;
    float *u = malloc((size_t)C * sizeof(float));
    if (!u) return -1;
    dn_mix(qkv, conv_w, conv_state, u, C, Kc, nk, dk);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int h = 0; h < nv; h++) dn_head(h, u, z, b, a, a_neg, dt_bias, norm_w, S, out, nk, dk, nv, dv, tiled, eps);
    free(u);
    return 0;
}

/* The depthwise causal conv of a DeltaNet layer over T new rows, then SiLU: out[t, c] = silu(sum_j
 * w[c, j] * window[t + j, c]) with window = [conv_state; x] ([Kc-1+T, C]); conv_state becomes the window's
 * last Kc-1 rows. One pass over x and out (torch's version is about six passes over [T, C]). */
int ds_causal_conv(const float *x, float *conv_state, const float *w, float *out, int T, int C, int Kc,
                   int nthreads) {
    if (T <= 0 || C <= 0 || Kc < 2) return -1;
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
            const float *src = r < H ? conv_state + (size_t)r * C : x + (size_t)(r - H) * C;
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
        const float *src = r < H ? conv_state + (size_t)r * C : x + (size_t)(r - H) * C;
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
 * One token through the whole model in one call (the decode of one sequence): every layer's RMSNorms,
 * products, DeltaNet step or attention step, SwiGLU and residual adds, then the final norm and the head.
 * It is the math of layers.py / forward.py, written out once: one OpenMP team for the whole token (the
 * products and the per-head steps are shared among the threads, the small serial pieces run on one), no
 * Python or per-op dispatch between the ~25 operations of a layer. The products are the ones above: int8
 * tables (activations int8 per 32) or Q4_K/Q6_K blocks (activations int8 per 256).
 * ------------------------------------------------------------------------------------------------------- */
/* seg_t, lin_t, layer_t, model_t: native.h */

typedef struct {           /* a product's quantized activations, for up to MAXM rows */
    int8_t *q, *qp;
    float *d, *dv, corr[MAXM];
    int16_t *s16;
} abuf_t;

static void rms_norm_row(const float *x, const float *w, float *out, int n, float eps) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        __mmask16 k = (__mmask16)(i + 16 <= n ? 0xFFFF : (1u << (n - i)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(k, x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    float r = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

static int lin_rows(const lin_t *L) {
    int n = 0;
    for (int s = 0; s < L->nseg; s++) n += L->seg[s].rows;
    return n;
}

/* y [M, N] = x [M, K] W^T for a stacked linear (rows of x and y contiguous); called by every thread of the
 * team (the tiles are shared among them); ends on a barrier. */
static void team_product(const lin_t *L, const float *x, int M, float *y, abuf_t *ab) {
    int kq = L->seg[0].type != 0, K = L->K, ldy = lin_rows(L);
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        if (kq) prepare(x + (size_t)m * K, K, ab->q + (size_t)m * K, ab->d + (size_t)m * (K / 256),
                        ab->s16 + (size_t)m * (K / 16), ab->qp + (size_t)m * K);
        else ab->corr[m] = quantize_row(x + (size_t)m * K, K, ab->q + (size_t)m * K, ab->dv + (size_t)m * (K / 4));
    }
    act_t a[MAXM];
    for (int m = 0; m < M; m++) {
        act_t t = {ab->q + (size_t)m * K, ab->d + (size_t)m * (K / 256), ab->s16 + (size_t)m * (K / 16),
                   ab->qp + (size_t)m * K};
        a[m] = t;
    }
    int off = 0;
    for (int s = 0; s < L->nseg; s++) {  /* each segment's tiles shared out without a barrier between them */
        const seg_t *g = &L->seg[s];
        if (kq) kq_tiles(g->type, (const uint8_t *)g->data, g->rows, K, a, M, y + off, ldy);
        else i8_tiles((const int8_t *)g->data, g->scale, g->rows, K, ab->q, ab->dv, ab->corr, M, y + off, ldy);
        off += g->rows;
    }
    #pragma omp barrier
}

/* q/k RMS norm per head, rotary embedding (rotate-half over the first `rotary` dims) at `pos`, k and v
 * written at `pos` of the caches [nkv, cap, hd]; the rotated queries to qout [nh, hd]. Serial. */
static void attn_prepare(const model_t *m, const layer_t *L, const float *qkv, float *kc, float *vc, int pos,
                         int cap, float *qout) {
    int nh = m->nh, nkv = m->nkv, hd = m->hd, r = m->rotary, half = r / 2;
    float cs[half], sn[half];
    for (int i = 0; i < half; i++) {
        float inv = 1.0f / powf(m->theta, (float)(2 * i) / (float)r);
        float f = (float)pos * inv;
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
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < hd; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + i), _mm512_loadu_ps(kt + i), acc);
        float sc = _mm512_reduce_add_ps(acc) * scale;
        scores[t] = sc;
        if (sc > mx) mx = sc;
    }
    float sum = 0.0f;
    __m512 vsum = _mm512_setzero_ps(), vmx = _mm512_set1_ps(mx);
    int t0 = 0;
    for (; t0 + 16 <= n; t0 += 16) {  /* e^(s - max) sixteen at a time (a long context has thousands per head) */
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(scores + t0), vmx));
        _mm512_storeu_ps(scores + t0, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    sum = _mm512_reduce_add_ps(vsum);
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

/* B sequences, one token each (B <= 8: the products read every weight once for all of them).
 * x [B, hidden]: the tokens' embedding rows (overwritten: the residual streams). state[b][2i], state[b][2i+1]:
 * sequence b's layer i (conv [Kc-1, C], ssm [nv, dk, dv]) or (k cache, v cache) [nkv, cap[b], hd], f32;
 * pos[b]: the position its token takes. logits [B, vocab] out. */
int ds_decode_tokens(const model_t *m, int B, float *x, float *const *const *state, const int *pos, const int *cap,
                     float *logits, int nthreads) {
    int H = m->hidden, C = 2 * m->nk * m->dk + m->nv * m->dv, nh = m->nh, nv = m->nv;
    if (B < 1 || B > MAXM || m->nk <= 0 || nv % m->nk || m->nkv <= 0 || nh % m->nkv || m->hd % 16
        || m->rotary > m->hd || m->rotary % 2) return -1;
    size_t kmax = (size_t)H, nmax = (size_t)H, spos[MAXM + 1];
    spos[0] = 0;
    for (int b = 0; b < B; b++) {
        if (pos[b] < 0 || pos[b] >= cap[b]) return -1;
        spos[b + 1] = spos[b] + (size_t)nh * (pos[b] + 1);  /* sequence b's score rows start at spos[b] */
    }
    for (int i = 0; i < m->n_layers; i++) {
        const layer_t *L = &m->layers[i];
        const lin_t *ls[4] = {&L->mix_in, &L->mix_out, &L->gate_up, &L->down};
        for (int j = 0; j < 4; j++) {
            if (ls[j]->K > (int)kmax) kmax = (size_t)ls[j]->K;
            if (lin_rows(ls[j]) > (int)nmax) nmax = (size_t)lin_rows(ls[j]);
        }
    }
    kmax = (kmax + 255) / 256 * 256;
    float *hbuf = malloc(B * kmax * sizeof(float)), *big = malloc(B * nmax * sizeof(float)),
          *mid = malloc(B * kmax * sizeof(float)), *u = malloc((size_t)B * C * sizeof(float)),
          *qr = malloc((size_t)B * nh * m->hd * sizeof(float)), *scores = malloc(spos[B] * sizeof(float));
    abuf_t ab;
    ab.q = malloc(B * kmax + 64);
    ab.qp = malloc(B * kmax + 64);
    ab.d = malloc(B * kmax / 256 * sizeof(float) + 64);
    ab.dv = malloc((B * kmax / 4 + 16) * sizeof(float));
    ab.s16 = malloc(B * kmax / 16 * sizeof(int16_t) + 64);
    int ok = hbuf && big && mid && u && qr && scores && ab.q && ab.qp && ab.d && ab.dv && ab.s16;
    if (ok) {
        #pragma omp parallel num_threads(nthreads)
        {
            for (int i = 0; i < m->n_layers; i++) {
                const layer_t *L = &m->layers[i];
                int nin = lin_rows(&L->mix_in), nmid = L->mix_out.K;
                #pragma omp for schedule(static)
                for (int b = 0; b < B; b++) rms_norm_row(x + (size_t)b * H, L->attn_norm, hbuf + (size_t)b * H, H, m->eps);
                team_product(&L->mix_in, hbuf, B, big, &ab);
                if (L->attention) {
                    #pragma omp for schedule(static)
                    for (int b = 0; b < B; b++)
                        attn_prepare(m, L, big + (size_t)b * nin, state[b][2 * i], state[b][2 * i + 1], pos[b], cap[b],
                                     qr + (size_t)b * nh * m->hd);
                    #pragma omp for schedule(static)
                    for (int t = 0; t < B * nh; t++) {
                        int b = t / nh, h = t % nh;
                        attn_head(m, h, big + (size_t)b * nin, qr + (size_t)b * nh * m->hd, state[b][2 * i],
                                  state[b][2 * i + 1], pos[b], cap[b], scores + spos[b] + (size_t)h * (pos[b] + 1),
                                  mid + (size_t)b * nmid);
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
                team_product(&L->mix_out, mid, B, hbuf, &ab);
                #pragma omp for schedule(static)
                for (int b = 0; b < B; b++) {
                    float *xb = x + (size_t)b * H, *hb = hbuf + (size_t)b * H;
                    for (int j = 0; j < H; j++) xb[j] += hb[j];
                    rms_norm_row(xb, L->post_norm, hb, H, m->eps);
                }
                team_product(&L->gate_up, hbuf, B, big, &ab);
                #pragma omp for schedule(static)
                for (int b = 0; b < B; b++) {
                    int I = m->inter;
                    float *g = big + (size_t)b * 2 * I, *md = mid + (size_t)b * I;
                    silu_inplace(g, I);
                    for (int j = 0; j < I; j++) md[j] = g[j] * g[I + j];
                }
                team_product(&L->down, mid, B, hbuf, &ab);
                #pragma omp for schedule(static)
                for (int b = 0; b < B; b++)
                    for (int j = 0; j < H; j++) x[(size_t)b * H + j] += hbuf[(size_t)b * H + j];
            }
            #pragma omp for schedule(static)
            for (int b = 0; b < B; b++) rms_norm_row(x + (size_t)b * H, m->final_norm, hbuf + (size_t)b * H, H, m->eps);
            team_product(&m->head, hbuf, B, logits, &ab);
        }
    }
    free(hbuf); free(big); free(mid); free(u); free(qr); free(scores);
    free(ab.q); free(ab.qp); free(ab.d); free(ab.dv); free(ab.s16);
    return ok ? 0 : -1;
}

/* ---------------------------------------------------------------------------------------------------------
 * The gated delta rule over T tokens of one sequence (a prefill), token by token, updating S [H, dk, dv]:
 * the recurrence of the decode step, S = e^g S; delta = beta (v - S^T k); S += k delta^T; o = S^T q.
 * Each value column of a head's state evolves on its own given the token's k, q and gates, so the work is
 * split into (head, 32 columns) items whose 128 x 32 slice of the state (16 KB) stays in L1 for all T tokens;
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
        float *s = S + (size_t)h * dk * dv + c0;
        __m512 zero = _mm512_setzero_ps(), kv[2] = {zero, zero}, qs[2] = {zero, zero};
        dr_pass(s, dk, dv, NULL, zero, zero, zero, k + (size_t)h * dk, q + (size_t)h * dk, kv, qs);  /* the first token's */
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
                dr_pass(s, dk, dv, kt, vd, d0, d1, k + (th + H) * dk, q + (th + H) * dk, kv, qs);
            else
                dr_pass(s, dk, dv, kt, vd, d0, d1, NULL, NULL, kv, qs);
        }
    }
    return 0;
}

#endif  /* AVX512 */
