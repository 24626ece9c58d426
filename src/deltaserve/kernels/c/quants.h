/* quants.h: the GGUF block types the library reads, as the file stores them: their type ids, block sizes
 * (block_info), the scalar fields of a block (f16, e8m0, e4m3 scales; Q4_K/Q5_K's six-bit scales) and the IQ types'
 * grids. What is done with the blocks is elsewhere, by role: dequant.c (exact values), expand.c (rows as int8 values
 * and scales), products.c with rows_avx2.c and tiles_avx512.c (decode products), gemm*.c (many rows). */
#ifndef DS_QUANTS_H
#define DS_QUANTS_H

#include <math.h>
#include <string.h>

#include "ds.h"

#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_BF16 30
/* the other quantized types (their products: expand.c's rows, or the 512-bit tiles where fused) */
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q2_K 10
#define T_Q3_K 11
#define T_IQ2_XXS 16
#define T_IQ2_XS 17
#define T_IQ3_XXS 18
#define T_IQ1_S 19
#define T_IQ4_NL 20
#define T_IQ3_S 21
#define T_IQ2_S 22
#define T_IQ4_XS 23
#define T_IQ1_M 29
#define T_TQ1_0 34
#define T_TQ2_0 35
#define T_MXFP4 39
#define T_NVFP4 40

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline uint16_t u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static const int8_t KV_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t KV_E2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* e8m0 as ggml's ggml_e8m0_to_fp32_half: 2^(x - 128), subnormal for x < 2 */
static inline float e8m0_half(uint8_t x) {
    uint32_t bits = x < 2 ? 0x00200000u << x : (uint32_t)(x - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* unsigned e4m3 (bias 7) times 0.5, as gguf's NVFP4.ue4m3_to_fp32 (every value exact in f32) */
static inline float ue4m3_half(uint8_t x) {
    if (x == 0 || x == 0x7F) return 0.0f;
    int e = (x >> 3) & 0xF, m = x & 7;
    float v = e == 0 ? (float)m * 0x1p-9f : (1.0f + (float)m / 8.0f) * ldexpf(1.0f, e - 7);
    return v * 0.5f;
}

/* The 8 six-bit scales and mins of a Q4_K/Q5_K block (its bytes 4..15). */
static inline void k_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

#ifdef DS_AVX2
/* A Q4_K/Q5_K block's 8 six-bit scales (bytes 0..7) and 8 mins (bytes 8..15) from its 12 scale bytes at s (the
 * 16 bytes from s are read: the block goes on), unpacked in one vector: with u0, u1, u2 the three 32-bit words,
 * scales 0-3 = u0 & 0x3f.., mins 0-3 = u1 & 0x3f.., scales 4-7 = (u2 & 0x0f..) | ((u0 >> 6) & 0x03..) << 4,
 * mins 4-7 = ((u2 >> 4) & 0x0f..) | ((u1 >> 6) & 0x03..) << 4 (k_scales' byte by byte version is ~40 scalar
 * operations a block). */
static inline __m128i k_scales_vec(const uint8_t *s) {
    __m128i v = _mm_loadu_si128((const __m128i *)s);
    __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x3F));                     /* [scales 0-3, mins 0-3, ..] */
    __m128i t = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 2, 2)), _mm_setr_epi32(0, 4, 6, 6));
    t = _mm_and_si128(t, _mm_setr_epi32(0x0F0F0F0F, 0x0F0F0F0F, 0x03030303, 0x03030303));
    __m128i hi = _mm_or_si128(t, _mm_slli_epi32(_mm_srli_si128(t, 8), 4));  /* [scales 4-7, mins 4-7, ..] */
    return _mm_unpacklo_epi32(lo, hi);
}
#endif

/* The IQ types' grids, gguf's own, set once at load (ds_set_tables, quants.c): as floats for the exact values and as
 * int8 for the products; until then block_info refuses those types. */
DS_INTERNAL extern const float *g_iq2xxs, *g_iq2xs, *g_iq2s, *g_iq3xxs, *g_iq3s, *g_iq1s;
DS_INTERNAL extern const uint8_t *g_ksigns;
DS_INTERNAL extern int8_t *i_iq2xxs, *i_iq2xs, *i_iq2s, *i_iq3xxs, *i_iq3s, *i_iq1s;

/* values per block and bytes per block of `type`; -1 for a type the library does not read */
DS_INTERNAL int block_info(int type, int *elems, int *bytes);

#endif
