/* rows_avx2.c: the decode products of Q8_0, Q4_0, Q4_K, Q5_K and Q6_K blocks on AVX2 (a build without AVX512-VNNI:
 * a Zen 3, a Haswell): one weight row, or four, against up to MG activation rows at a time.
 *
 * AVX2 has no unsigned-by-signed byte dot product with 32-bit sums (VNNI), so a block goes through vpmaddubsw
 * (u8 x s8 -> s16 pairs) and vpmaddwd (s16 pairs -> s32): an int8 weight w is made unsigned by the sign trick,
 * |w| times sign(w) * a (no pair can overflow: 2 * 128 * 127 < 32768). Each thread takes a run of output rows; a
 * row's blocks are read once from memory and then from L1 for every group of activation rows. M is a constant in
 * each row kernel (a switch over 1, 2, 3 and MG), so the sums stay in registers. Compiled with -ffp-contract=off. */
#include <omp.h>

#include "products.h"
#include "rows.h"

#if defined(DS_AVX2) && !defined(BLK_VNNI)

/* Four rows at once against M <= 2 activation rows: four independent accumulation chains (one row alone waits
 * on its own fmadd's latency every block). out[r * 2 + m]. */
static void rows4_q32(int type, const uint8_t *row0, size_t row_bytes, int K, const act_t *a, int M, float *out) {
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int bytes = type == T_Q8_0 ? 34 : 18;
    for (int j = 0; j < K / 32; j++) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(a[0].q + 32 * j));
        __m256i x1 = M > 1 ? _mm256_loadu_si256((const __m256i *)(a[1].q + 32 * j)) : x0;
        float d0 = a[0].d[j], d1 = M > 1 ? a[1].d[j] : 0.0f;
        for (int r = 0; r < 4; r++) {
            const uint8_t *b = row0 + (size_t)r * row_bytes + (size_t)j * bytes;
            if (j % 8 == 0) prefetch_ahead(b, 8 * bytes);
            float dw;
            __m256i w = type == T_Q8_0 ? load_q8_0(b, &dw) : load_q4_0(b, &dw);
            __m256i aw = _mm256_sign_epi8(w, w);
            acc[r][0] = _mm256_fmadd_ps(_mm256_set1_ps(dw * d0), _mm256_cvtepi32_ps(dot_i8(aw, w, x0)), acc[r][0]);
            if (M > 1)
                acc[r][1] = _mm256_fmadd_ps(_mm256_set1_ps(dw * d1), _mm256_cvtepi32_ps(dot_i8(aw, w, x1)), acc[r][1]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < M; m++) out[r * 2 + m] = blk_hsum8(acc[r][m]);
}

/* Q4_K / Q5_K: v = d sc q - dmin m per sub-block of 32 (q 0..15, or 0..31 with the fifth bit of qh). */
static inline __attribute__((always_inline)) void row_q45k(int type, const uint8_t *row, int K, const act_t *a,
                                                           const int M, float *out) {
    __m256 vacc[MG];
    __m128 macc[MG];
    for (int m = 0; m < M; m++) vacc[m] = _mm256_setzero_ps(), macc[m] = _mm_setzero_ps();
    int q5 = type == T_Q5_K, bytes = q5 ? 176 : 144;
    const __m256i lo4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    for (int j = 0; j < K / 256; j++) {
        const uint8_t *b = row + (size_t)j * bytes;
        prefetch_ahead(b, bytes);
        float d = h2f(b), dmin = h2f(b + 2);
        __m128i smv = k_scales_vec(b + 4);
        __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(smv));  /* the 8 scales as int16, both lanes */
        const uint8_t *qs = b + (q5 ? 48 : 16);
        __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
        __m256i isum[MG];
        for (int m = 0; m < M; m++) isum[m] = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
            __m256i w0 = _mm256_and_si256(raw, lo4), w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
            if (q5) {
                w0 = _mm256_or_si256(w0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), one), 4));
                w1 = _mm256_or_si256(w1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g + 1), one), 4));
            }
            __m256i s0 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)((4 * g + 1) << 8 | (4 * g))));
            __m256i s1 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)((4 * g + 3) << 8 | (4 * g + 2))));
            for (int m = 0; m < M; m++) {
                const int8_t *qa = a[m].q + 256 * j + 64 * g;
                __m256i p0 = _mm256_maddubs_epi16(w0, _mm256_loadu_si256((const __m256i *)qa));
                __m256i p1 = _mm256_maddubs_epi16(w1, _mm256_loadu_si256((const __m256i *)(qa + 32)));
                isum[m] = _mm256_add_epi32(isum[m], _mm256_add_epi32(_mm256_madd_epi16(p0, s0), _mm256_madd_epi16(p1, s1)));
            }
        }
        __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(smv, 8));
        for (int m = 0; m < M; m++) {
            const int16_t *bs = a[m].bs + 16 * j;
            __m128i pairs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)bs), _mm_loadu_si128((const __m128i *)(bs + 8)));
            __m128i ms = _mm_madd_epi16(pairs, mins);  /* sub-block s's min times its 32 activations' sum */
            float da = a[m].d[j];
            vacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_set1_ps(d * da), vacc[m]);
            /* the four sums of two mins' products kept in a vector: their horizontal sum once, at the row's end */
            macc[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(ms), _mm_set1_ps(dmin * da), macc[m]);
        }
    }
    for (int m = 0; m < M; m++) {
        __m128 h = _mm_add_ps(macc[m], _mm_movehl_ps(macc[m], macc[m]));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        out[m] = blk_hsum8(vacc[m]) - _mm_cvtss_f32(h);
    }
}

/* Q6_K: v = d sc (q - 32) per sub-block of 16, q 0..63 (four bits of ql, two of qh). */
static inline __attribute__((always_inline)) void row_q6k(const uint8_t *row, int K, const act_t *a, const int M,
                                                          float *out) {
    __m256 vacc[MG];
    const __m256i lo4 = _mm256_set1_epi8(0xF), hi2 = _mm256_set1_epi8(0x30);
    for (int m = 0; m < M; m++) vacc[m] = _mm256_setzero_ps();
    for (int j = 0; j < K / 256; j++) {
        const uint8_t *b = row + (size_t)j * 210;
        prefetch_ahead(b, 210);
        float d = h2f(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        /* the 16 scales as int16, the even sub-blocks' in the low lane and the odd ones' in the high: a group's
           two scales (sub-blocks 2i, 2i + 1) are then one in-lane shuffle (not two scalar loads, a broadcast and an
           insert each) */
        const __m128i s8 = _mm_loadu_si128((const __m128i *)sc);
        const __m256i seo = _mm256_set_m128i(
            _mm_cvtepi8_epi16(_mm_shuffle_epi8(s8, _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, -1, -1, -1, -1, -1, -1, -1, -1))),
            _mm_cvtepi8_epi16(_mm_shuffle_epi8(s8, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1))));
        __m256i isum[MG];
        for (int m = 0; m < M; m++) isum[m] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            __m256i w[4] = {
                _mm256_or_si256(_mm256_and_si256(l0, lo4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), hi2)),
                _mm256_or_si256(_mm256_and_si256(l1, lo4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), hi2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), lo4), _mm256_and_si256(hb, hi2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), lo4), _mm256_and_si256(_mm256_srli_epi16(hb, 2), hi2)),
            };
            for (int g = 0; g < 4; g++) {
                const int i = 4 * h + g;  /* the group's two sub-blocks of 16: 2i (low lane), 2i + 1 (high) */
                const __m256i sv = _mm256_shuffle_epi8(seo, _mm256_set1_epi16((short)((2 * i + 1) << 8 | (2 * i))));
                for (int m = 0; m < M; m++) {
                    __m256i p = _mm256_maddubs_epi16(w[g], _mm256_loadu_si256((const __m256i *)(a[m].q + 256 * j + 128 * h + 32 * g)));
                    isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(p, sv));
                }
            }
        }
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        for (int m = 0; m < M; m++) {
            __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(a[m].bs + 16 * j)));
            /* sum sc (q - 32) qa = sum sc q qa - 32 sum sc bs: the offset folded into the int32 lanes */
            __m256i v = _mm256_sub_epi32(isum[m], _mm256_slli_epi32(off, 5));
            vacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(d * a[m].d[j]), vacc[m]);
        }
    }
    for (int m = 0; m < M; m++) out[m] = blk_hsum8(vacc[m]);
}

/* a Q6_K row, or a Q4_K/Q5_K one */
static inline __attribute__((always_inline)) void row_k(int type, const uint8_t *row, int K, const act_t *a,
                                                        const int M, float *out) {
    if (type == T_Q6_K) row_q6k(row, K, a, M, out);
    else row_q45k(type, row, K, a, M, out);
}
void blk_tiles_isa(int type, int kind, const uint8_t *blocks, size_t row_bytes, int N, int K, void *scratch, int Mall,
                   int m_first, int M, float *y, long ldy) {
    act_t a[DS_MAX_ROWS > MG ? DS_MAX_ROWS : MG];
    if (kind == 1 && M <= 2) {  /* decode: four rows at a time (four accumulation chains) */
        for (int m = 0; m < M; m++) a[m] = act_row(kind, scratch, Mall, K, m_first + m);
        int tiles = N / 4;
        #pragma omp for schedule(static) nowait
        for (int t = 0; t < tiles + (N - 4 * tiles); t++) {
            float out[8];
            if (t < tiles) {
                rows4_q32(type, blocks + (size_t)(4 * t) * row_bytes, row_bytes, K, a, M, out);
                for (int r = 0; r < 4; r++)
                    for (int m = 0; m < M; m++) y[(size_t)m * ldy + 4 * t + r] = out[r * 2 + m];
            } else {
                int n = 4 * tiles + (t - tiles);
                row_q32(type, blocks + (size_t)n * row_bytes, K, a, M, out);
                for (int m = 0; m < M; m++) y[(size_t)m * ldy + n] = out[m];
            }
        }
        return;
    }
    #pragma omp for schedule(static) nowait
    for (int n = 0; n < N; n++) {
        const uint8_t *row = blocks + (size_t)n * row_bytes;
        if (M > MG && n + 1 < N) _mm_prefetch((const char *)(row + row_bytes), _MM_HINT_T0);
        for (int m0 = 0; m0 < M; m0 += MG) {
            int mg = M - m0 < MG ? M - m0 : MG;
            for (int m = 0; m < mg; m++) a[m] = act_row(kind, scratch, Mall, K, m_first + m0 + m);
            float out[MG];
            if (type == T_Q6_K || kind == 2) {  /* M a constant for one row (a decode) and for MG: the sums stay in
                                                   registers (with M a variable they lived on the stack) */
                switch (mg) {
                case 1: row_k(type, row, K, a, 1, out); break;
                case 2: row_k(type, row, K, a, 2, out); break;
                case 3: row_k(type, row, K, a, 3, out); break;
                default: row_k(type, row, K, a, MG, out);
                }
            } else switch (mg) {
                case 1: row_q32(type, row, K, a, 1, out); break;
                case 2: row_q32(type, row, K, a, 2, out); break;
                case 3: row_q32(type, row, K, a, 3, out); break;
                default: row_q32(type, row, K, a, MG, out);
            }
            for (int m = 0; m < mg; m++) y[(size_t)(m0 + m) * ldy + n] = out[m];
        }
    }
}

#endif  /* DS_AVX2 && !BLK_VNNI */
