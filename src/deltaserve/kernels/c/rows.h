/* rows.h: what the decode products' files share (products.c, rows_avx2.c, tiles_avx512.c): a prepared activation
 * row (act_t) and where it lies in a product's scratch, the prefetch ahead of a weight row, and the Q8_0/Q4_0 row
 * product that the AVX2 rows run and the 512-bit tiles end a row with. Inline: each file's loops keep them inlined. */
#ifndef DS_ROWS_H
#define DS_ROWS_H

#include <string.h>

#include "native.h"
#include "quants.h"

#ifdef DS_AVX2
#define MG 4  /* activation rows per pass over a weight row */


typedef struct {
    const int8_t *q;
    const float *d;
    const int16_t *bs;
    const float *x;    /* the f32 row itself (F16/BF16 weights multiply it as it is) */
    const int32_t *c;  /* BLK_VNNI, blocks of 32: -128 * the sum of each 4 values */
    const int32_t *cb; /* BLK_VNNI, blocks of 32: -128 * the sum of each block's 32 values */
    const int8_t *qp;  /* BLK_VNNI, blocks of 256: the values in Q45_ORDER */
} act_t;

static inline __m256i dot_i8(__m256i aw, __m256i w, __m256i a) {  /* 8 int32 partial sums of w . a (aw = |w|) */
#ifdef BLK_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, _mm256_sign_epi8(a, w));
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(a, w)), _mm256_set1_epi16(1));
#endif
}
/* The decode products read each weight once, from memory: each row is prefetched into L2 PREFETCH bytes ahead
 * (docs/kernels.md has the measurements behind the distance). The call must be inlined: GCC deletes calls of a
 * function that only prefetches (it has no effect it can see). */
#define PREFETCH 16384

static inline __attribute__((always_inline)) void prefetch_ahead(const void *p, int bytes) {
    for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)p + PREFETCH + l, _MM_HINT_T1);
}

/* Q8_0 and Q4_0: int8 weights of a block of 32 and the block's scale. */
static inline __m256i load_q8_0(const uint8_t *b, float *d) {
    *d = h2f(b);
    return _mm256_loadu_si256((const __m256i *)(b + 2));
}

static inline __m256i load_q4_0(const uint8_t *b, float *d) {
    *d = h2f(b);
    __m128i raw = _mm_loadu_si128((const __m128i *)(b + 2));
    __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0xF)), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0xF));
    return _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
}

static inline __attribute__((always_inline)) void row_q32(int type, const uint8_t *row, int K, const act_t *a,
                                                           const int M, float *out) {
    __m256 acc[MG];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    int bytes = type == T_Q8_0 ? 34 : 18;
    for (int j = 0; j < K / 32; j++) {
        const uint8_t *b = row + (size_t)j * bytes;
        float dw;
        __m256i w = type == T_Q8_0 ? load_q8_0(b, &dw) : load_q4_0(b, &dw);
        __m256i aw = _mm256_sign_epi8(w, w);
        for (int m = 0; m < M; m++) {
            __m256i s = dot_i8(aw, w, _mm256_loadu_si256((const __m256i *)(a[m].q + 32 * j)));
            acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a[m].d[j]), _mm256_cvtepi32_ps(s), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) out[m] = blk_hsum8(acc[m]);
}
/* A product's scratch: M prepared rows of each part, the parts one after the other. */
typedef struct {
    int8_t *q, *qp;
    float *d;
    int16_t *bs;
    int32_t *c, *cb;
} parts_t;

static inline size_t parts_layout(void *scratch, int M, int K, parts_t *p) {
    size_t at = 0, q = ALIGN64((size_t)M * K + 64), d = ALIGN64((size_t)M * (K / 32) * sizeof(float) + 64),
           bs = ALIGN64((size_t)M * (K / 16) * sizeof(int16_t) + 64), c = ALIGN64((size_t)M * (K / 4) * sizeof(int32_t) + 64),
           cb = ALIGN64((size_t)M * (K / 32) * sizeof(int32_t) + 64);
    uint8_t *base = scratch;
    if (p) p->q = (int8_t *)(base + at);
    at += q;
    if (p) p->d = (float *)(base + at);
    at += d;
    if (p) p->bs = (int16_t *)(base + at);
    at += bs;
    if (p) p->c = (int32_t *)(base + at);
    at += c;
    if (p) p->cb = (int32_t *)(base + at);
    at += cb;
    if (p) p->qp = (int8_t *)(base + at);
    return at + q;
}

static inline act_t act_row(int kind, void *scratch, int M, int K, int m) {
    act_t a = {NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    if (kind >= 3) {  /* the f32 rows themselves, copied where the int8 ones would be */
        a.x = (const float *)scratch + (size_t)m * K;
        return a;
    }
    parts_t p;
    parts_layout(scratch, M, K, &p);
    a.q = p.q + (size_t)m * K;
    a.d = p.d + (size_t)m * (K / 32);
    if (kind == 2) a.bs = p.bs + (size_t)m * (K / 16), a.qp = p.qp + (size_t)m * K;
#ifdef BLK_VNNI  /* (only the 512-bit products read them: NULL, quant_q8_0 does not compute them) */
    else a.c = p.c + (size_t)m * (K / 4), a.cb = p.cb + (size_t)m * (K / 32);
#endif
    return a;
}
/* one expanded row (expand.c) against M prepared rows (products.c) */
DS_INTERNAL void row_expanded(const int8_t *v, const float *sc, const float *mn, int K, const act_t *a, int M, float *out);
/* this build's products of the types it multiplies from their own blocks (not F16/BF16, not the expanded ones):
 * rows_avx2.c's or tiles_avx512.c's; an orphaned worksharing loop over the N rows, no barrier */
DS_INTERNAL void blk_tiles_isa(int type, int kind, const uint8_t *blocks, size_t row_bytes, int N, int K, void *scratch,
                               int Mall, int m_first, int M, float *y, long ldy);
#endif  /* DS_AVX2 */

#endif
