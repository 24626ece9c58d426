/* dequant_avx512.c: rows of the usual block types straight to bf16 on 512-bit vectors (the prefill's bf16 chunks on
 * AMX): no f32 row in between, each value the same f32 arithmetic as dequant.c's, then to_bf16's rounding. */
#include "dequant.h"
#include "expand.h"

#ifdef BLK_VNNI

/* 32 f32 (v0, then v1) -> bf16 as to_bf16 rounds them: to nearest, ties to even, a NaN -> 0x7FC0. With AVX512-BF16
 * one vcvtne2ps2bf16 (it treats denormals as zero, and none reach it: every value below is a multiple of 2^-24, the
 * f16 scales' quantum, times small integers), else the integer rounding of to_bf16 in 16 lanes of 32 bits. */
static inline void store_bf16x32(uint16_t *o, __m512 v0, __m512 v1) {
    const __mmask16 n0 = _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q), n1 = _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
#ifdef __AVX512BF16__
    __m512i r = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
    _mm512_storeu_si512(o, _mm512_mask_mov_epi16(r, _mm512_kunpackw(n1, n0), _mm512_set1_epi16(0x7FC0)));
#else
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF), nan = _mm512_set1_epi32(0x7FC0);
    __m512i u0 = _mm512_castps_si512(v0), u1 = _mm512_castps_si512(v1);
    u0 = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u0, bias), _mm512_and_si512(_mm512_srli_epi32(u0, 16), one)), 16);
    u1 = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u1, bias), _mm512_and_si512(_mm512_srli_epi32(u1, 16), one)), 16);
    _mm256_storeu_si256((__m256i *)o, _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(u0, n0, nan)));
    _mm256_storeu_si256((__m256i *)(o + 16), _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(u1, n1, nan)));
#endif
}

static inline __m512i u8x16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

/* A row of Q8_0, Q4_0, Q4_K, Q5_K or Q6_K blocks straight to bf16, 32 values at a time: each value the same f32
 * arithmetic as deq_row's (the same products and differences, in the same order), then to_bf16's rounding.
 * Returns 0 for another type. (The scalar row, deq_row into an f32 buffer and then to_bf16, was a visible part of a
 * prefill on AMX: docs/kernels.md.) */
int deq_row_bf16(int type, const uint8_t *b, int K, uint16_t *o) {
    const __m512i lo4 = _mm512_set1_epi32(0xF);
    switch (type) {
    case T_Q8_0:
        for (int j = 0; j < K / 32; j++, b += 34, o += 32) {
            const __m512 d = _mm512_set1_ps(h2f(b));
            const __m512 v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2))));
            const __m512 v1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18))));
            store_bf16x32(o, _mm512_mul_ps(d, v0), _mm512_mul_ps(d, v1));
        }
        return 1;
    case T_Q4_0:
        for (int j = 0; j < K / 32; j++, b += 18, o += 32) {
            const __m512 d = _mm512_set1_ps(h2f(b));
            const __m512i q = u8x16(b + 2), eight = _mm512_set1_epi32(8);
            store_bf16x32(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(q, lo4), eight)), d),
                          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight)), d));
        }
        return 1;
    case T_Q4_K:
    case T_Q5_K: {
        const int q5 = type == T_Q5_K, bytes = q5 ? 176 : 144;
        const __m512i bit = _mm512_set1_epi32(1);
        for (int j = 0; j < K / 256; j++, b += bytes, o += 256) {
            const float d = h2f(b), dmin = h2f(b + 2);
            uint8_t sc[8], mn[8];
            k_scales(b + 4, sc, mn);
            const uint8_t *qh = b + 16, *qs = b + (q5 ? 48 : 16);
            for (int s = 0; s < 8; s++) {
                const __m512 ds = _mm512_set1_ps(d * (float)sc[s]), dm = _mm512_set1_ps(dmin * (float)mn[s]);
                __m512 v[2];
                for (int h = 0; h < 2; h++) {
                    __m512i q = u8x16(qs + 32 * (s / 2) + 16 * h);
                    q = _mm512_and_si512((s & 1) ? _mm512_srli_epi32(q, 4) : q, lo4);
                    if (q5)
                        q = _mm512_or_si512(q, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u8x16(qh + 16 * h), s), bit), 4));
                    v[h] = _mm512_sub_ps(_mm512_mul_ps(ds, _mm512_cvtepi32_ps(q)), dm);
                }
                store_bf16x32(o + 32 * s, v[0], v[1]);
            }
        }
        return 1;
    }
    case T_Q6_K: {
        const __m512i hi2 = _mm512_set1_epi32(3), off = _mm512_set1_epi32(32);
        for (int j = 0; j < K / 256; j++, b += 210, o += 256) {
            const float d = h2f(b + 208);
            const int8_t *sc = (const int8_t *)(b + 192);
            for (int h = 0; h < 2; h++)
                for (int g = 0; g < 4; g++) {
                    const uint8_t *lo = b + 64 * h + 32 * (g & 1), *hi = b + 128 + 32 * h;
                    const int sl = g < 2 ? 0 : 4, sh = 2 * g, i0 = 128 * h + 32 * g;
                    __m512 v[2];
                    for (int half = 0; half < 2; half++) {
                        const __m512 ds = _mm512_set1_ps(d * (float)sc[(i0 + 16 * half) / 16]);
                        __m512i q = _mm512_and_si512(_mm512_srli_epi32(u8x16(lo + 16 * half), sl), lo4);
                        q = _mm512_or_si512(q, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u8x16(hi + 16 * half), sh), hi2), 4));
                        v[half] = _mm512_mul_ps(ds, _mm512_cvtepi32_ps(_mm512_sub_epi32(q, off)));
                    }
                    store_bf16x32(o + i0, v[0], v[1]);
                }
        }
        return 1;
    }
    default: {  /* deq_row_expanded's values (gguf's, bit for bit: the same products and sums), 32 at a time */
        if (!expands_exactly(type, K)) return 0;
        int8_t v[K];
        float sc[K / 16], mn[K / 16];
        const int mins = expand_row(type, b, K, v, sc, mn);
        for (int i = 0; i < K; i += 32) {
            __m512 v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(v + i))));
            __m512 v1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(v + i + 16))));
            v0 = _mm512_mul_ps(_mm512_set1_ps(sc[i / 16]), v0);
            v1 = _mm512_mul_ps(_mm512_set1_ps(sc[i / 16 + 1]), v1);
            if (mins) {
                v0 = _mm512_add_ps(v0, _mm512_set1_ps(mn[i / 16]));
                v1 = _mm512_add_ps(v1, _mm512_set1_ps(mn[i / 16 + 1]));
            }
            store_bf16x32(o + i, v0, v1);
        }
        return 1;
    }
    }
}
#endif  /* BLK_VNNI */
