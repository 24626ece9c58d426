/* activations.c: activation rows quantized as llama.cpp quantizes them (see activations.h). */
#include <string.h>

#include "activations.h"

#ifdef DS_AVX2

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* 32 floats * id rounded to nearest (ties to even), as int8 (|v| <= 127 by construction) */
static inline __m256i round32(const float *x, float id) {
    __m256 s = _mm256_set1_ps(id);
    __m256i a = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i b = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i c = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 16), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i e = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 24), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i ab = _mm256_packs_epi32(a, b), ce = _mm256_packs_epi32(c, e);
    __m256i v = _mm256_packs_epi16(ab, ce);  /* lanes interleaved by the packs: put them back in order */
    return _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline float amax32(const float *x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
    for (int i = 8; i < 32; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    return hmax8(m);
}

static inline float amax256(const float *x) {
    float amax = 0.0f;
    for (int i = 0; i < 256; i += 32) { float a = amax32(x + i); if (a > amax) amax = a; }
    return amax;
}

/* -128 times the sum of each 4 of the 32 int8 values v, into c [8] (what the tiles' sums start from); returns the
 * 4-sums themselves */
static inline __m256i neg_sums4(__m256i v, int32_t *c) {
#ifdef BLK_VNNI
    __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)0x80), v);
#else  /* the same: the sums of 4 (pairs by maddubs with ones, exact: |2 v| <= 256) times 128 */
    __m256i s = _mm256_slli_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1)), 7);
#endif
    _mm256_storeu_si256((__m256i *)c, _mm256_sub_epi32(_mm256_setzero_si256(), s));
    return s;
}

/* Q8_0 blocks of 32: q int8 [K], d [K/32] (the f16-rounded scale, as the block would store it); where c is given
 * also c [K/4]: -128 times the sum of each 4 values (the VNNI decode tile and the GEMM multiply w + 128 by them, see
 * tile_q32), and where cb is, cb [K/32]: -128 times each block's sum. */
void quant_q8_0(const float *x, int K, int8_t *q, float *d, int32_t *c, int32_t *cb) {
    for (int b = 0; b < K; b += 32) {
        float amax = amax32(x + b);
        float dd = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256i v = round32(x + b, id);
        _mm256_storeu_si256((__m256i *)(q + b), v);
        d[b / 32] = _cvtsh_ss(_cvtss_sh(dd, 0));
        if (!c) continue;
        __m256i s = neg_sums4(v, c + b / 4);
        if (cb) {
            __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
            cb[b / 32] = -_mm_cvtsi128_si32(h);
        }
    }
}

/* quant_q8_0's output with one f32 scale per 256 values (d [K/256]; Q8_K's values, for the GEMM) */
void quant_q8_256(const float *x, int K, int8_t *q, float *d, int32_t *c) {
    for (int b = 0; b < K; b += 256) {
        const float amax = amax256(x + b), id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b / 256] = amax / 127.0f;
        for (int i = b; i < b + 256; i += 32) {
            __m256i v = round32(x + i, id);
            _mm256_storeu_si256((__m256i *)(q + i), v);
            neg_sums4(v, c + i / 4);
        }
    }
}

/* blocks of 256 (llama.cpp's Q8_K): q int8 [K], d [K/256] f32, bs [K/16] sums of 16 quantized values; with
 * BLK_VNNI also qp [K]: the values with the sub-blocks of 32 of each block in the order the Q4_K/Q5_K decode tile
 * reads them (Q45_ORDER). */
void quant_q8_k(const float *x, int K, int8_t *q, float *d, int16_t *bs, int8_t *qp) {
    for (int b = 0; b < K; b += 256) {
        const float amax = amax256(x + b), id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b / 256] = amax / 127.0f;
        for (int i = 0; i < 256; i += 32) _mm256_storeu_si256((__m256i *)(q + b + i), round32(x + b + i, id));
        for (int i = 0; i < 256; i += 16) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += q[b + i + j];
            bs[(b + i) / 16] = (int16_t)s;
        }
#ifdef BLK_VNNI
        static const int order[8] = Q45_ORDER;
        for (int i = 0; i < 8; i++) memcpy(qp + b + 32 * i, q + b + 32 * order[i], 32);
#else
        (void)qp;
#endif
    }
}
#endif  /* DS_AVX2 */
