/* transpose.h: the byte transposes a GEMM panel is packed with (gemm_pack.c) and the 16-row Q8_0 decode tile loads
 * its rows with (tiles_avx512.c), and the panel's vector (PV_) for this build: 16 rows of 4 bytes in a 512-bit vector
 * with BLK_VNNI, 8 rows in a 256-bit one on AVX2. Inline: they run inside the packing loops. */
#ifndef DS_TRANSPOSE_H
#define DS_TRANSPOSE_H

#include "ds.h"

#ifdef BLK_VNNI

/* 16 rows of 8 words (32 bytes at base + r stride) as 8 vectors of 16 words, vector k holding word k of every row
 * (at dst + 128 k): rows r and r + 8 in the two halves of a vector, an 8 x 8 transpose of words in each half (words,
 * then pairs of words, within 128-bit lanes), and the lanes put in row order by one two-source permute a vector. */
static inline __attribute__((always_inline)) void transpose16x8_v(const uint8_t *base, size_t stride, __m512i v[8]) {
    __m512i z[8], t[8], u[8];
    for (int i = 0; i < 8; i++)  /* rows i and i + 8 joined by the load ports (a masked 256-bit broadcast from memory)
                                    rather than the shuffle port (an insert), which the 24 steps below keep busy */
        z[i] = _mm512_mask_broadcast_i64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(base + i * stride))),
                                           0xF0, _mm256_loadu_si256((const __m256i *)(base + (i + 8) * stride)));
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) {  /* u[4h + c]: word c (lanes 0, 2) and c + 4 (lanes 1, 3) of rows 4h .. 4h + 3 */
        u[4 * h + 0] = _mm512_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm512_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm512_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm512_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    for (int c = 0; c < 4; c++) {
        v[c] = _mm512_permutex2var_epi64(u[c], lo, u[c + 4]);
        v[c + 4] = _mm512_permutex2var_epi64(u[c], hi, u[c + 4]);
    }
}

static inline void transpose16x8(const uint8_t *base, size_t stride, uint8_t *dst) {
    __m512i v[8];
    transpose16x8_v(base, stride, v);
    for (int k = 0; k < 8; k++) _mm512_store_si512(dst + k * 128, v[k]);
}
typedef __m512i pvec_t;
#define PV_ROWS 16
#define PV_AND _mm512_and_si512
#define PV_OR _mm512_or_si512
#define PV_XOR _mm512_xor_si512
#define PV_SRLI16 _mm512_srli_epi16
#define PV_SLLI16 _mm512_slli_epi16
#define PV_SET1_8 _mm512_set1_epi8
#define PV_STORE(p, v) _mm512_store_si512(p, v)
#define PV_TRANSPOSE transpose16x8_v

#elif defined(DS_AVX2)
/* 8 rows of 8 words (32 bytes at base + r stride) as 8 vectors of 8 words, vector k holding word k of every row
 * in row order: an 8 x 8 transpose of words (words, then pairs of words within 128-bit lanes, then the lanes). */
static inline __attribute__((always_inline)) void transpose8x8_v(const uint8_t *base, size_t stride, __m256i v[8]) {
    __m256i z[8], t[8], u[8];
    for (int i = 0; i < 8; i++) z[i] = _mm256_loadu_si256((const __m256i *)(base + i * stride));
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) {  /* u[4h + c]: word c (low lane) and c + 4 (high lane) of rows 4h .. 4h + 3 */
        u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int c = 0; c < 4; c++) {
        v[c] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x20);
        v[c + 4] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x31);
    }
}

static inline void transpose8x8(const uint8_t *base, size_t stride, uint8_t *dst) {
    __m256i v[8];
    transpose8x8_v(base, stride, v);
    for (int k = 0; k < 8; k++) _mm256_store_si256((__m256i *)(dst + k * 128), v[k]);
}
typedef __m256i pvec_t;
#define PV_ROWS 8
#define PV_AND _mm256_and_si256
#define PV_OR _mm256_or_si256
#define PV_XOR _mm256_xor_si256
#define PV_SRLI16 _mm256_srli_epi16
#define PV_SLLI16 _mm256_slli_epi16
#define PV_SET1_8 _mm256_set1_epi8
#define PV_STORE(p, v) _mm256_store_si256((__m256i *)(p), v)
#define PV_TRANSPOSE transpose8x8_v
#endif

#endif
