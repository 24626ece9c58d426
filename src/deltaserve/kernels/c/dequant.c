/* dequant.c: rows of a GGUF file's blocks to their exact f32 values, bit for bit what gguf.quants.dequantize gives
 * (compiled with -ffp-contract=off, as every file on the file's blocks is: each product and difference is one f32
 * rounding, in the reference's order), and those values rounded to bf16 as torch rounds them. A prefill's products
 * on exact chunks (kernels/linear.py) and every embedding lookup read these.
 *   ds_dequant       rows -> f32;
 *   ds_dequant_bf16  rows -> bf16 (dequant_avx512.c's 512-bit rows where the build has them). */
#include <stdlib.h>

#include "dequant.h"
#include "expand.h"

#ifdef DS_AVX2

/* (db g) s for 8 values of a grid row, s from sign bits (bit set: -1) */
static inline void grid8(float *o, float db, const float *g, uint8_t signs) {
    for (int j = 0; j < 8; j++) {
        float v = db * g[j];
        o[j] = (signs >> j) & 1 ? -v : v;
    }
}

/* Rows of the types below read as gguf.quants' dequantize_blocks reads them, each value's f32 operations in its
 * order (this file is compiled without contraction): bit for bit its values. Returns -1 for another type. */
static int deq_row_more(int type, const uint8_t *b, int K, float *o) {
    switch (type) {
    case T_Q4_1:
    case T_Q5_1: {
        const int q5 = type == T_Q5_1, bytes = q5 ? 24 : 20;
        for (int j = 0; j < K / 32; j++, b += bytes, o += 32) {
            float d = h2f(b), m = h2f(b + 2);
            uint32_t qh = q5 ? u32(b + 4) : 0;
            const uint8_t *qs = b + (q5 ? 8 : 4);
            for (int i = 0; i < 16; i++) {
                int lo = qs[i] & 0xF, hi = qs[i] >> 4;
                if (q5) lo |= ((qh >> i) & 1) << 4, hi |= ((qh >> (i + 16)) & 1) << 4;
                o[i] = d * (float)lo + m;
                o[i + 16] = d * (float)hi + m;
            }
        }
        return 0;
    }
    case T_Q5_0:
        for (int j = 0; j < K / 32; j++, b += 22, o += 32) {
            float d = h2f(b);
            uint32_t qh = u32(b + 2);
            for (int i = 0; i < 16; i++) {
                int lo = (b[6 + i] & 0xF) | (((qh >> i) & 1) << 4), hi = (b[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
                o[i] = d * (float)(lo - 16);
                o[i + 16] = d * (float)(hi - 16);
            }
        }
        return 0;
    case T_IQ4_NL:
        for (int j = 0; j < K / 32; j++, b += 18, o += 32) {
            float d = h2f(b);
            for (int i = 0; i < 16; i++) {
                o[i] = d * (float)KV_IQ4NL[b[2 + i] & 0xF];
                o[i + 16] = d * (float)KV_IQ4NL[b[2 + i] >> 4];
            }
        }
        return 0;
    case T_MXFP4:
        for (int j = 0; j < K / 32; j++, b += 17, o += 32) {
            float d = e8m0_half(b[0]);
            for (int i = 0; i < 16; i++) {
                o[i] = d * (float)KV_E2M1[b[1 + i] & 0xF];
                o[i + 16] = d * (float)KV_E2M1[b[1 + i] >> 4];
            }
        }
        return 0;
    case T_NVFP4:
        for (int j = 0; j < K / 64; j++, b += 36, o += 64)
            for (int s = 0; s < 4; s++) {
                float d = ue4m3_half(b[s]);
                const uint8_t *q = b + 4 + 8 * s;
                for (int i = 0; i < 8; i++) {
                    o[16 * s + i] = d * (float)KV_E2M1[q[i] & 0xF];
                    o[16 * s + 8 + i] = d * (float)KV_E2M1[q[i] >> 4];
                }
            }
        return 0;
    case T_Q2_K:
        for (int j = 0; j < K / 256; j++, b += 84, o += 256) {
            float d = h2f(b + 80), dmin = h2f(b + 82);
            for (int g = 0; g < 16; g++) {  /* 16 values of one scale: byte g of the scales */
                float dl = d * (float)(b[g] & 0xF), ml = dmin * (float)(b[g] >> 4);
                const uint8_t *q = b + 16 + 32 * (g / 8) + 16 * (g % 2);
                int shift = 2 * ((g / 2) % 4);
                for (int l = 0; l < 16; l++) o[16 * g + l] = dl * (float)((q[l] >> shift) & 3) - ml;
            }
        }
        return 0;
    case T_Q3_K:
        for (int j = 0; j < K / 256; j++, b += 110, o += 256) {
            float d = h2f(b + 108);
            const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
            for (int g = 0; g < 16; g++) {
                int lo = (sc[g % 8] >> (4 * (g / 8))) & 0xF, hi = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
                float dl = d * (float)((lo | (hi << 4)) - 32);
                const uint8_t *q = qs + 32 * (g / 8) + 16 * (g % 2), *h = hm + 16 * (g % 2);
                int shift = 2 * ((g / 2) % 4), bit = g / 2;
                for (int l = 0; l < 16; l++) {
                    int v = ((q[l] >> shift) & 3) - (((h[l] >> bit) & 1) ^ 1) * 4;
                    o[16 * g + l] = dl * (float)v;
                }
            }
        }
        return 0;
    case T_IQ4_XS:
        for (int j = 0; j < K / 256; j++, b += 136, o += 256) {
            float d = h2f(b);
            uint16_t sh = u16(b + 2);
            for (int s = 0; s < 8; s++) {
                int ls = ((b[4 + s / 2] >> (4 * (s % 2))) & 0xF) | (((sh >> (2 * s)) & 3) << 4);
                float dl = d * (float)(ls - 32);
                const uint8_t *q = b + 8 + 16 * s;
                for (int i = 0; i < 16; i++) {
                    o[32 * s + i] = dl * (float)KV_IQ4NL[q[i] & 0xF];
                    o[32 * s + 16 + i] = dl * (float)KV_IQ4NL[q[i] >> 4];
                }
            }
        }
        return 0;
    case T_TQ1_0:
        for (int j = 0; j < K / 256; j++, b += 54, o += 256) {
            float d = h2f(b + 52);
            static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
            int at = 0;
            for (int p = 0; p < 5; p++)  /* the first 32 bytes: 5 digits each, value p * 32 + l */
                for (int l = 0; l < 32; l++) o[at++] = d * (float)((((uint8_t)(b[l] * pow3[p]) * 3) >> 8) - 1);
            for (int p = 0; p < 5; p++)
                for (int l = 0; l < 16; l++) o[at++] = d * (float)((((uint8_t)(b[32 + l] * pow3[p]) * 3) >> 8) - 1);
            for (int p = 0; p < 4; p++)
                for (int l = 0; l < 4; l++) o[at++] = d * (float)((((uint8_t)(b[48 + l] * pow3[p]) * 3) >> 8) - 1);
        }
        return 0;
    case T_TQ2_0:
        for (int j = 0; j < K / 256; j++, b += 66, o += 256) {
            float d = h2f(b + 64);
            for (int h = 0; h < 2; h++)
                for (int p = 0; p < 4; p++)
                    for (int l = 0; l < 32; l++) o[128 * h + 32 * p + l] = d * (float)(((b[32 * h + l] >> (2 * p)) & 3) - 1);
        }
        return 0;
    }
    if (!g_ksigns) return -1;
    switch (type) {
    case T_IQ2_XXS:
        for (int j = 0; j < K / 256; j++, b += 66, o += 256) {
            float d = h2f(b);
            for (int s = 0; s < 8; s++) {
                const uint8_t *aux0 = b + 2 + 8 * s;
                uint32_t aux1 = u32(b + 2 + 8 * s + 4);
                float db = d * (0.5f + (float)(aux1 >> 28)) * 0.25f;
                for (int l = 0; l < 4; l++)
                    grid8(o + 32 * s + 8 * l, db, g_iq2xxs + 8 * aux0[l], g_ksigns[(aux1 >> (7 * l)) & 0x7F]);
            }
        }
        return 0;
    case T_IQ2_XS:
        for (int j = 0; j < K / 256; j++, b += 74, o += 256) {
            float d = h2f(b);
            for (int s = 0; s < 16; s++) {
                float db = d * (0.5f + (float)((b[66 + s / 2] >> (4 * (s % 2))) & 0xF)) * 0.25f;
                for (int l = 0; l < 2; l++) {
                    uint16_t q = u16(b + 2 + 2 * (2 * s + l));
                    grid8(o + 16 * s + 8 * l, db, g_iq2xs + 8 * (q & 511), g_ksigns[q >> 9]);
                }
            }
        }
        return 0;
    case T_IQ2_S:
        for (int j = 0; j < K / 256; j++, b += 82, o += 256) {
            float d = h2f(b);
            for (int s = 0; s < 16; s++) {
                float db = d * (0.5f + (float)((b[74 + s / 2] >> (4 * (s % 2))) & 0xF)) * 0.25f;
                for (int l = 0; l < 2; l++) {
                    int i = 2 * s + l, idx = b[2 + i] | (((b[66 + i / 4] >> (2 * (i % 4))) & 3) << 8);
                    grid8(o + 8 * i, db, g_iq2s + 8 * idx, b[34 + i]);
                }
            }
        }
        return 0;
    case T_IQ3_XXS:
        for (int j = 0; j < K / 256; j++, b += 98, o += 256) {
            float d = h2f(b);
            for (int s = 0; s < 8; s++) {
                uint32_t aux = u32(b + 66 + 4 * s);
                float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
                for (int l = 0; l < 4; l++) {
                    uint8_t signs = g_ksigns[(aux >> (7 * l)) & 0x7F];
                    const float *g0 = g_iq3xxs + 4 * b[2 + 8 * s + 2 * l], *g1 = g_iq3xxs + 4 * b[2 + 8 * s + 2 * l + 1];
                    float g[8] = {g0[0], g0[1], g0[2], g0[3], g1[0], g1[1], g1[2], g1[3]};
                    grid8(o + 32 * s + 8 * l, db, g, signs);
                }
            }
        }
        return 0;
    case T_IQ3_S:
        for (int j = 0; j < K / 256; j++, b += 110, o += 256) {
            float d = h2f(b);
            for (int s = 0; s < 8; s++) {
                float db = d * (float)(1 + 2 * ((b[106 + s / 2] >> (4 * (s % 2))) & 0xF));
                for (int l = 0; l < 4; l++) {
                    int i0 = 8 * s + 2 * l, i1 = i0 + 1;
                    int x0 = b[2 + i0] | (((b[66 + i0 / 8] >> (i0 % 8)) & 1) << 8);
                    int x1 = b[2 + i1] | (((b[66 + i1 / 8] >> (i1 % 8)) & 1) << 8);
                    const float *g0 = g_iq3s + 4 * x0, *g1 = g_iq3s + 4 * x1;
                    float g[8] = {g0[0], g0[1], g0[2], g0[3], g1[0], g1[1], g1[2], g1[3]};
                    grid8(o + 32 * s + 8 * l, db, g, b[74 + 4 * s + l]);
                }
            }
        }
        return 0;
    case T_IQ1_S:
        for (int j = 0; j < K / 256; j++, b += 50, o += 256) {
            float d = h2f(b);
            for (int s = 0; s < 8; s++) {
                uint16_t qh = u16(b + 34 + 2 * s);
                float dl = d * (float)(2 * ((qh >> 12) & 7) + 1), delta = qh & 0x8000 ? -0.125f : 0.125f;
                for (int l = 0; l < 4; l++) {
                    const float *g = g_iq1s + 8 * (b[2 + 4 * s + l] | (((qh >> (3 * l)) & 7) << 8));
                    for (int i = 0; i < 8; i++) o[32 * s + 8 * l + i] = dl * (g[i] + delta);
                }
            }
        }
        return 0;
    case T_IQ1_M:
        for (int j = 0; j < K / 256; j++, b += 56, o += 256) {
            uint16_t sc[4] = {u16(b + 48), u16(b + 50), u16(b + 52), u16(b + 54)};
            uint16_t dbits = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0xF0) | ((sc[2] >> 4) & 0xF00) | (sc[3] & 0xF000));
            float d = h2f((const uint8_t *)&dbits);
            for (int s = 0; s < 8; s++)
                for (int h = 0; h < 2; h++) {
                    int k = 2 * s + h;  /* the 16 three-bit scales: word k / 4, bits 3 (k % 4) */
                    float dl = d * (float)(2 * ((sc[k / 4] >> (3 * (k % 4))) & 7) + 1);
                    for (int g = 0; g < 2; g++) {
                        int i = 4 * s + 2 * h + g, nib = (b[32 + i / 2] >> (4 * (i % 2))) & 0xF;
                        const float *gr = g_iq1s + 8 * (b[i] | ((nib & 7) << 8));
                        float delta = nib & 8 ? -0.125f : 0.125f;
                        for (int v = 0; v < 8; v++) o[8 * i + v] = dl * (gr[v] + delta);
                    }
                }
        }
        return 0;
    }
    return -1;
}

/* A row as the products expand it (int8 values v, a scale per 16 and, for some types, a min), each value
 * sc v (+ mn): the IQ grid types' d_sub x (grid value x sign) with one rounding, the IQ1 types' 8 g +- 1 and
 * scale / 8, Q2_K/Q3_K's (d x sub-scale) x q (- dmin x sub-min), IQ4's and MXFP4's table values times their scale:
 * gguf's arithmetic in gguf's order, bit for bit (these files are built without contraction into FMAs), and
 * several times faster than deq_row_more's value by value (docs/kernels.md). 0 for the other types (Q4_1, Q5_0,
 * Q5_1, TQ2_0, NVFP4: no faster this way), then deq_row_more. */
int expands_exactly(int type, int K) {
    switch (type) {
    case T_IQ2_XXS: case T_IQ2_XS: case T_IQ2_S: case T_IQ3_XXS: case T_IQ3_S: case T_IQ1_S: case T_IQ1_M:
    case T_Q2_K: case T_Q3_K: case T_IQ4_NL: case T_IQ4_XS: case T_MXFP4: case T_TQ1_0:
        return K % 32 == 0;
    default:
        return 0;
    }
}

static int deq_row_expanded(int type, const uint8_t *b, int K, float *o) {
    if (!expands_exactly(type, K)) return 0;
    int8_t v[K];
    float sc[K / 16], mn[K / 16];
    const int mins = expand_row(type, b, K, v, sc, mn);
    /* runs of 16 values of one scale (and min): vectorized alike whatever the compiler tunes for (a loop over all K
       with the scale's index per value is not, where the build is tuned for no CPU in particular) */
    for (int g = 0; g < K / 16; g++) {
        const float s = sc[g], m = mins ? mn[g] : 0.0f;
        const int8_t *vg = v + 16 * g;
        float *og = o + 16 * g;
        if (mins)
            for (int i = 0; i < 16; i++) og[i] = s * (float)vg[i] + m;
        else
            for (int i = 0; i < 16; i++) og[i] = s * (float)vg[i];
    }
    return 1;
}

void deq_row(int type, const uint8_t *b, int K, float *o) {
    switch (type) {
    case T_F32:
        memcpy(o, b, (size_t)K * 4);
        return;
    case T_F16:
        for (int i = 0; i < K; i++) o[i] = h2f(b + 2 * i);
        return;
    case T_BF16:
        for (int i = 0; i < K; i++) {
            uint32_t u = (uint32_t)(b[2 * i] | (b[2 * i + 1] << 8)) << 16;
            memcpy(o + i, &u, 4);
        }
        return;
    case T_Q8_0:
        for (int j = 0; j < K / 32; j++, b += 34, o += 32) {
            float d = h2f(b);
            const int8_t *q = (const int8_t *)(b + 2);
            for (int i = 0; i < 32; i++) o[i] = d * (float)q[i];
        }
        return;
    case T_Q4_0:
        for (int j = 0; j < K / 32; j++, b += 18, o += 32) {
            float d = h2f(b);
            for (int i = 0; i < 16; i++) {
                o[i] = (float)((b[2 + i] & 0xF) - 8) * d;
                o[i + 16] = (float)((b[2 + i] >> 4) - 8) * d;
            }
        }
        return;
    case T_Q4_K:
    case T_Q5_K: {
        int q5 = type == T_Q5_K, bytes = q5 ? 176 : 144;
        for (int j = 0; j < K / 256; j++, b += bytes, o += 256) {
            float d = h2f(b), dmin = h2f(b + 2);
            uint8_t sc[8], mn[8];
            k_scales(b + 4, sc, mn);
            const uint8_t *qh = b + 16, *qs = b + (q5 ? 48 : 16);
            for (int s = 0; s < 8; s++) {
                float ds = d * (float)sc[s], dm = dmin * (float)mn[s];
                const uint8_t *g = qs + 32 * (s / 2);
                for (int l = 0; l < 32; l++) {
                    int q = (s & 1) ? g[l] >> 4 : g[l] & 0xF;
                    if (q5) q |= ((qh[l] >> s) & 1) << 4;
                    o[32 * s + l] = ds * (float)q - dm;
                }
            }
        }
        return;
    }
    case T_Q6_K:  /* runs of 16 values of one scale, the shifts fixed in each: the compiler vectorizes them (a loop
                     over all 256 with the scale's index and the shifts computed per value does not vectorize) */
        for (int j = 0; j < K / 256; j++, b += 210, o += 256) {
            float d = h2f(b + 208);
            const int8_t *sc = (const int8_t *)(b + 192);
            for (int h = 0; h < 2; h++)
                for (int g = 0; g < 4; g++) {
                    const uint8_t *lo = b + 64 * h + 32 * (g & 1), *hi = b + 128 + 32 * h;
                    const int sl = g < 2 ? 0 : 4, sh = 2 * g;
                    for (int half = 0; half < 2; half++) {
                        const int i0 = 128 * h + 32 * g + 16 * half;
                        const float ds = d * (float)sc[i0 / 16];
                        for (int l = 16 * half; l < 16 * half + 16; l++) {
                            int q = (((lo[l] >> sl) & 0xF) | (((hi[l] >> sh) & 3) << 4)) - 32;
                            o[128 * h + 32 * g + l] = ds * (float)q;
                        }
                    }
                }
        }
        return;
    default:
        if (deq_row_expanded(type, b, K, o)) return;
        deq_row_more(type, b, K, o);
    }
}

/* rows [rows, K] of blocks (row after row, no padding) -> dst f32 (row stride ldd). */
int ds_dequant(int type, const uint8_t *src, long rows, int K, float *dst, long ldd, int nthreads) {
    int elems, bytes;
    if (block_info(type, &elems, &bytes) || K <= 0 || K % elems || rows < 0) return -1;
    size_t row_bytes = (size_t)(K / elems) * bytes;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * (long)K >= 65536)
    for (long r = 0; r < rows; r++) deq_row(type, src + (size_t)r * row_bytes, K, dst + (size_t)r * ldd);
    return 0;
}

/* f32 -> bf16 rounded to nearest, ties to even (torch's .to(torch.bfloat16); a NaN becomes 0x7FC0). */
void to_bf16(const float *x, uint16_t *o, int n) {
    for (int i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        o[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
}

/* rows [rows, K] of blocks -> dst bf16 (row stride ldd), each value what ds_dequant gives rounded as torch rounds it
 * to bf16: with AVX512 a row of blocks goes straight to bf16 (deq_row_bf16); otherwise it is dequantized into f32
 * that stays in the cache and rounded from there (not an f32 chunk and a torch copy pass over it). */
int ds_dequant_bf16(int type, const uint8_t *src, long rows, int K, uint16_t *dst, long ldd, int nthreads) {
    int elems, bytes, failed = 0;
    if (block_info(type, &elems, &bytes) || K <= 0 || K % elems || rows < 0) return -1;
    size_t row_bytes = (size_t)(K / elems) * bytes;
    #pragma omp parallel num_threads(nthreads) if (rows * (long)K >= 65536) reduction(|:failed)
    {
        float *tmp = NULL;  /* the f32 row, for the types deq_row_bf16 does not take */
        #pragma omp for schedule(static)
        for (long r = 0; r < rows; r++) {
#ifdef BLK_VNNI
            if (deq_row_bf16(type, src + (size_t)r * row_bytes, K, dst + (size_t)r * ldd)) continue;
#endif
            if (!tmp && !(tmp = malloc((size_t)K * sizeof(float)))) {
                failed = 1;
                continue;
            }
            deq_row(type, src + (size_t)r * row_bytes, K, tmp);
            to_bf16(tmp, dst + (size_t)r * ldd, K);
        }
        free(tmp);
    }
    return failed ? -1 : 0;
}
#endif  /* DS_AVX2 */
