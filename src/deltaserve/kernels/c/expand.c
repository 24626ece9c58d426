/* expand.c: rows of Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, MXFP4, NVFP4, Q2_K, Q3_K, TQ1_0, TQ2_0 and the IQ1/IQ2/IQ3
 * grid types expanded to int8 values with a scale (and a min) per 16, each value the type's exactly: the products
 * of the types without a fused tile of their own (products.c's row_expanded), the GEMM's panels of every type it does
 * not pack from the bytes (gemm_pack.c), and the faster exact dequantization of most of them (dequant.c). */
#include "expand.h"

#ifdef DS_AVX2

/* ---- the other types' products: each row expanded to int8 values with a scale (and a min) per 16 -------------
 * A row of Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, MXFP4, NVFP4, Q2_K, Q3_K, TQ1_0, TQ2_0 or an IQ1/IQ2/IQ3 grid type is
 * w = sc[i / 16] v[i] + mn[i / 16] with v int8 (|v| <= 127) and f32 sc, mn: each the type's values exactly (its
 * scale times a small integer; IQ1's grid + delta as (dl / 8) (8 g +- 1)). The row is expanded once per product (into
 * L1), then multiplied as llama.cpp multiplies these types: the activations int8 per block of 32 (Q8_0's), each block
 * of 16's integer sum exact, scaled by sc d_a, plus mn d_a times the activations' sum. */

static const int8_t KV_IQ4NL8[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* 16 bytes of nibbles as 32 values (the low nibbles, then the high ones) looked up in a 16-entry table */
static inline __m256i nib_lookup(const uint8_t *q, __m128i table) {
    __m128i x = _mm_loadu_si128((const __m128i *)q), m = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(x, m), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
    return _mm256_set_m128i(_mm_shuffle_epi8(table, hi), _mm_shuffle_epi8(table, lo));
}

/* the 32 bits of a little-endian uint32 as bytes 0xFF (bit set) or 0 (bit i -> byte i) */
static inline __m256i bit_mask32(uint32_t bits) {
    __m256i v = _mm256_set1_epi32((int)bits);
    v = _mm256_shuffle_epi8(v, _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                 0x0101010101010101LL, 0x0000000000000000LL));
    __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

static inline __m256i bits_x16(uint32_t qh) { return _mm256_and_si256(bit_mask32(qh), _mm256_set1_epi8(0x10)); }

/* v negated where the sign bit is set (bit i for byte i) */
static inline __m256i apply_signs(__m256i v, uint32_t signs) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_mask_sub_epi8(v, (__mmask32)signs, _mm256_setzero_si256(), v);  /* the bits as a byte mask */
#else
    __m256i m = bit_mask32(signs);
    return _mm256_sub_epi8(_mm256_xor_si256(v, m), m);
#endif
}

/* 32 int8 grid values: four rows of 8 (IQ2/IQ1 grids), rows idx[0..3] */
static inline __m256i grid_rows8(const int8_t *grid, int i0, int i1, int i2, int i3) {
    return _mm256_i32gather_epi64((const long long *)grid, _mm_setr_epi32(i0, i1, i2, i3), 8);
}

/* the same, the rows' indices in the four lanes of idx */
static inline __m256i grid_rows8v(const int8_t *grid, __m128i idx) {
    return _mm256_i32gather_epi64((const long long *)grid, idx, 8);
}

/* 32 int8 grid values: eight rows of 4 (IQ3 grids) */
static inline __m256i grid_rows4(const int8_t *grid, __m256i idx) {
    return _mm256_i32gather_epi32((const int *)grid, idx, 4);
}

static inline uint32_t ksigns4(uint32_t aux) {  /* the four 7-bit sign indices of aux as four sign bytes */
    return (uint32_t)g_ksigns[aux & 0x7F] | (uint32_t)g_ksigns[(aux >> 7) & 0x7F] << 8 |
           (uint32_t)g_ksigns[(aux >> 14) & 0x7F] << 16 | (uint32_t)g_ksigns[(aux >> 21) & 0x7F] << 24;
}

/* 32 values of a 2-bit field: (q[l] >> shift) & 3, l < 32 */
static inline __m256i two_bits(const uint8_t *q, int shift) {
    __m256i x = _mm256_loadu_si256((const __m256i *)q);
    return _mm256_and_si256(_mm256_srl_epi16(x, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(3));
}

static inline void set2(float *p, float a) { p[0] = p[1] = a; }

/* TQ1_0's trits: ((uint8)(x k) * 3 >> 8) - 1 for each byte x (k a power of 3), in 16-bit lanes */
static inline __m256i trits32(__m256i x, int k) {
    const __m256i ff = _mm256_set1_epi16(0xFF), kk = _mm256_set1_epi16((short)k), three = _mm256_set1_epi16(3);
    __m256i lo = _mm256_and_si256(_mm256_mullo_epi16(_mm256_and_si256(x, ff), kk), ff);
    __m256i hi = _mm256_and_si256(_mm256_mullo_epi16(_mm256_srli_epi16(x, 8), kk), ff);
    lo = _mm256_srli_epi16(_mm256_mullo_epi16(lo, three), 8);
    hi = _mm256_srli_epi16(_mm256_mullo_epi16(hi, three), 8);
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 8)), _mm256_set1_epi8(1));
}

/* Expand one row: v [K], sc [K / 16], mn [K / 16] (left unwritten, and 0 returned, for the types without a min). */
int expand_row(int type, const uint8_t *b, int K, int8_t *v, float *sc, float *mn) {
    const __m128i iq4 = _mm_loadu_si128((const __m128i *)KV_IQ4NL8), e2m1 = _mm_loadu_si128((const __m128i *)KV_E2M1);
    switch (type) {
    case T_Q4_1:
    case T_Q5_1:
    case T_Q5_0: {
        const int q5 = type != T_Q4_1, min = type != T_Q5_0, bytes = type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24;
        const int at = type == T_Q4_1 ? 4 : type == T_Q5_0 ? 6 : 8;
        const __m128i ident = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (int j = 0; j < K / 32; j++, b += bytes) {
            __m256i q = nib_lookup(b + at, ident);
            if (q5) q = _mm256_or_si256(q, bits_x16(u32(b + (min ? 4 : 2))));
            if (!min) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
            _mm256_storeu_si256((__m256i *)(v + 32 * j), q);
            set2(sc + 2 * j, h2f(b));
            if (min) set2(mn + 2 * j, h2f(b + 2));
        }
        return min;
    }
    case T_Q4_0: {  /* (q - 8) d (the GEMM's panels; the other products take Q4_0 as it lies) */
        const __m128i ident = _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
        for (int j = 0; j < K / 32; j++, b += 18) {
            _mm256_storeu_si256((__m256i *)(v + 32 * j), nib_lookup(b + 2, ident));
            set2(sc + 2 * j, h2f(b));
        }
        return 0;
    }
    case T_IQ4_NL:
    case T_MXFP4: {
        const int nl = type == T_IQ4_NL, bytes = nl ? 18 : 17;
        for (int j = 0; j < K / 32; j++, b += bytes) {
            _mm256_storeu_si256((__m256i *)(v + 32 * j), nib_lookup(b + (nl ? 2 : 1), nl ? iq4 : e2m1));
            set2(sc + 2 * j, nl ? h2f(b) : e8m0_half(b[0]));
        }
        return 0;
    }
    case T_IQ4_XS:
        for (int jb = 0; jb < K / 256; jb++, b += 136) {
            float d = h2f(b);
            uint16_t sh = u16(b + 2);
            for (int s = 0; s < 8; s++) {
                int ls = ((b[4 + s / 2] >> (4 * (s % 2))) & 0xF) | (((sh >> (2 * s)) & 3) << 4);
                _mm256_storeu_si256((__m256i *)(v + 256 * jb + 32 * s), nib_lookup(b + 8 + 16 * s, iq4));
                set2(sc + 16 * jb + 2 * s, d * (float)(ls - 32));
            }
        }
        return 0;
    case T_NVFP4:
        for (int jb = 0; jb < K / 64; jb++, b += 36)
            for (int s = 0; s < 4; s++) {
                const uint8_t *q = b + 4 + 8 * s;
                for (int i = 0; i < 8; i++) {
                    v[64 * jb + 16 * s + i] = KV_E2M1[q[i] & 0xF];
                    v[64 * jb + 16 * s + 8 + i] = KV_E2M1[q[i] >> 4];
                }
                sc[4 * jb + s] = ue4m3_half(b[s]);
            }
        return 0;
    case T_Q2_K:
    case T_TQ2_0: {
        const int q2 = type == T_Q2_K, bytes = q2 ? 84 : 66;
        for (int jb = 0; jb < K / 256; jb++, b += bytes) {
            const uint8_t *qs = b + (q2 ? 16 : 0);
            for (int h = 0; h < 2; h++)
                for (int p = 0; p < 4; p++) {
                    __m256i q = two_bits(qs + 32 * h, 2 * p);
                    if (!q2) q = _mm256_sub_epi8(q, _mm256_set1_epi8(1));
                    _mm256_storeu_si256((__m256i *)(v + 256 * jb + 128 * h + 32 * p), q);
                }
            if (q2) {
                float d = h2f(b + 80), dmin = h2f(b + 82);
                for (int g = 0; g < 16; g++) sc[16 * jb + g] = d * (float)(b[g] & 0xF), mn[16 * jb + g] = -(dmin * (float)(b[g] >> 4));
            } else {
                float d = h2f(b + 64);
                for (int g = 0; g < 16; g++) sc[16 * jb + g] = d;
            }
        }
        return q2;
    }
    case T_Q3_K:
        for (int jb = 0; jb < K / 256; jb++, b += 110) {
            const uint8_t *hm = b, *qs = b + 32, *scs = b + 96;
            float d = h2f(b + 108);
            __m256i hmv = _mm256_loadu_si256((const __m256i *)hm);
            for (int h = 0; h < 2; h++)
                for (int p = 0; p < 4; p++) {
                    __m256i q = two_bits(qs + 32 * h, 2 * p);
                    __m256i hb = _mm256_and_si256(_mm256_srl_epi16(hmv, _mm_cvtsi32_si128(4 * h + p)), _mm256_set1_epi8(1));
                    q = _mm256_sub_epi8(q, _mm256_slli_epi16(_mm256_xor_si256(hb, _mm256_set1_epi8(1)), 2));
                    _mm256_storeu_si256((__m256i *)(v + 256 * jb + 128 * h + 32 * p), q);
                }
            for (int g = 0; g < 16; g++) {
                int lo = (scs[g % 8] >> (4 * (g / 8))) & 0xF, hi = (scs[8 + g % 4] >> (2 * (g / 4))) & 3;
                sc[16 * jb + g] = d * (float)((lo | (hi << 4)) - 32);
            }
        }
        return 0;
    case T_TQ1_0:
        for (int jb = 0; jb < K / 256; jb++, b += 54) {
            static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
            int8_t *o = v + 256 * jb;
            const __m256i x = _mm256_loadu_si256((const __m256i *)b);  /* bytes 0..31: values 0..159 */
            for (int p = 0; p < 5; p++, o += 32) _mm256_storeu_si256((__m256i *)o, trits32(x, pow3[p]));
            const __m256i y = _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b + 32)));  /* 160..239 */
            for (int p = 0; p < 5; p++, o += 16) _mm_storeu_si128((__m128i *)o, _mm256_castsi256_si128(trits32(y, pow3[p])));
            for (int p = 0; p < 4; p++)
                for (int l = 0; l < 4; l++) *o++ = (int8_t)((((uint8_t)(b[48 + l] * pow3[p]) * 3) >> 8) - 1);
            float d = h2f(b + 52);
            for (int g = 0; g < 16; g++) sc[16 * jb + g] = d;
        }
        return 0;
    }
    if (!g_ksigns) return -1;
    switch (type) {
    case T_IQ2_XXS:
        for (int jb = 0; jb < K / 256; jb++, b += 66) {
            float d = h2f(b);
            for (int s = 0; s < 8; s++) {
                const uint8_t *aux0 = b + 2 + 8 * s;
                uint32_t aux1 = u32(b + 2 + 8 * s + 4);
                __m256i g = grid_rows8v(i_iq2xxs, _mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)u32(aux0))));
                _mm256_storeu_si256((__m256i *)(v + 256 * jb + 32 * s), apply_signs(g, ksigns4(aux1)));
                set2(sc + 16 * jb + 2 * s, d * (0.5f + (float)(aux1 >> 28)) * 0.25f);
            }
        }
        return 0;
    case T_IQ2_XS:
        for (int jb = 0; jb < K / 256; jb++, b += 74) {
            float d = h2f(b);
            for (int s = 0; s < 8; s++) {  /* 32 values: four codes, two scales */
                uint16_t q[4] = {u16(b + 2 + 8 * s), u16(b + 4 + 8 * s), u16(b + 6 + 8 * s), u16(b + 8 + 8 * s)};
                __m128i codes = _mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * s)));
                __m256i g = grid_rows8v(i_iq2xs, _mm_and_si128(codes, _mm_set1_epi32(511)));
                uint32_t signs = (uint32_t)g_ksigns[q[0] >> 9] | (uint32_t)g_ksigns[q[1] >> 9] << 8 |
                                 (uint32_t)g_ksigns[q[2] >> 9] << 16 | (uint32_t)g_ksigns[q[3] >> 9] << 24;
                _mm256_storeu_si256((__m256i *)(v + 256 * jb + 32 * s), apply_signs(g, signs));
                for (int h = 0; h < 2; h++)
                    sc[16 * jb + 2 * s + h] = d * (0.5f + (float)((b[66 + s] >> (4 * h)) & 0xF)) * 0.25f;
            }
        }
        return 0;
    case T_IQ2_S:
        for (int jb = 0; jb < K / 256; jb++, b += 82) {
            float d = h2f(b);
            for (int s = 0; s < 8; s++) {  /* 32 values: groups i = 4 s .. 4 s + 3, two scales */
                __m128i high = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(b[66 + s]), _mm_setr_epi32(0, 2, 4, 6)),
                                             _mm_set1_epi32(3));
                __m128i idx = _mm_or_si128(_mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)u32(b + 2 + 4 * s))),
                                           _mm_slli_epi32(high, 8));
                __m256i g = grid_rows8v(i_iq2s, idx);
                _mm256_storeu_si256((__m256i *)(v + 256 * jb + 32 * s), apply_signs(g, u32(b + 34 + 4 * s)));
                for (int h = 0; h < 2; h++)
                    sc[16 * jb + 2 * s + h] = d * (0.5f + (float)((b[74 + s] >> (4 * h)) & 0xF)) * 0.25f;
            }
        }
        return 0;
    case T_IQ3_XXS:
        for (int jb = 0; jb < K / 256; jb++, b += 98) {
            float d = h2f(b);
            for (int s = 0; s < 8; s++) {
                uint32_t aux = u32(b + 66 + 4 * s);
                __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * s)));
                _mm256_storeu_si256((__m256i *)(v + 256 * jb + 32 * s), apply_signs(grid_rows4(i_iq3xxs, idx), ksigns4(aux)));
                set2(sc + 16 * jb + 2 * s, d * (0.5f + (float)(aux >> 28)) * 0.5f);
            }
        }
        return 0;
    case T_IQ3_S:
        for (int jb = 0; jb < K / 256; jb++, b += 110) {
            float d = h2f(b);
            for (int s = 0; s < 8; s++) {
                __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * s)));
                __m256i high = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(b[66 + s]),
                                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                                                _mm256_set1_epi32(1));
                idx = _mm256_or_si256(idx, _mm256_slli_epi32(high, 8));
                _mm256_storeu_si256((__m256i *)(v + 256 * jb + 32 * s), apply_signs(grid_rows4(i_iq3s, idx), u32(b + 74 + 4 * s)));
                set2(sc + 16 * jb + 2 * s, d * (float)(1 + 2 * ((b[106 + s / 2] >> (4 * (s % 2))) & 0xF)));
            }
        }
        return 0;
    case T_IQ1_S:
    case T_IQ1_M: {
        const int m = type == T_IQ1_M;
        for (int jb = 0; jb < K / 256; jb++, b += m ? 56 : 50) {
            float d;
            uint16_t scw[4] = {0, 0, 0, 0};
            if (m) {
                for (int k = 0; k < 4; k++) scw[k] = u16(b + 48 + 2 * k);
                uint16_t dbits = (uint16_t)((scw[0] >> 12) | ((scw[1] >> 8) & 0xF0) | ((scw[2] >> 4) & 0xF00) | (scw[3] & 0xF000));
                d = h2f((const uint8_t *)&dbits);
            } else {
                d = h2f(b);
            }
            const uint8_t *qs = b + (m ? 0 : 2);
            for (int s = 0; s < 8; s++) {  /* 32 values: four rows of the grid, 8 g +- 1 (the delta's sign) */
                /* the four rows' 11-bit indices: qs[4 s + l] and 3 high bits each (IQ1_S: qh's bits 3 l..3 l+2;
                 * IQ1_M: the low 3 bits of nibble l of the 16 bits at 32 + 2 s, whose bit 3 is the row's sign) */
                uint16_t qh = u16(b + (m ? 32 : 34) + 2 * s);
                __m128i bits = _mm_srlv_epi32(_mm_set1_epi32(qh), m ? _mm_setr_epi32(0, 4, 8, 12) : _mm_setr_epi32(0, 3, 6, 9));
                __m128i idx = _mm_or_si128(_mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)u32(qs + 4 * s))),
                                           _mm_slli_epi32(_mm_and_si128(bits, _mm_set1_epi32(7)), 8));
                __m256i g = grid_rows8v(i_iq1s, idx);  /* -1, 0, 1 */
                __m256i delta;
                if (m) {  /* each row's own sign: -1 where its bit 3 is set, else +1 */
                    __m256i neg = _mm256_cvtepi32_epi64(_mm_cmpeq_epi32(_mm_and_si128(bits, _mm_set1_epi32(8)),
                                                                         _mm_set1_epi32(8)));
                    delta = _mm256_blendv_epi8(_mm256_set1_epi8(1), _mm256_set1_epi8(-1), neg);
                } else {
                    delta = _mm256_set1_epi8(qh & 0x8000 ? -1 : 1);
                }
                __m256i eight = _mm256_shuffle_epi8(_mm256_setr_epi8(-8, 0, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                     -8, 0, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                                                    _mm256_add_epi8(g, _mm256_set1_epi8(1)));
                __m256i val = _mm256_add_epi8(eight, delta);
                _mm256_storeu_si256((__m256i *)(v + 256 * jb + 32 * s), val);
                if (m)
                    for (int h = 0; h < 2; h++) {
                        int k = 2 * s + h;
                        sc[16 * jb + k] = d * (float)(2 * ((scw[k / 4] >> (3 * (k % 4))) & 7) + 1) * 0.125f;
                    }
                else
                    set2(sc + 16 * jb + 2 * s, d * (float)(2 * ((qh >> 12) & 7) + 1) * 0.125f);
            }
        }
        return 0;
    }
    }
    return -1;
}
#endif  /* DS_AVX2 */
