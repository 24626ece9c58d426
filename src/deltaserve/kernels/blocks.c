/* blocks.c: a GGUF file's own tensor blocks, read where they lie (the file's mapping), on any x86-64 CPU with
 * AVX2, FMA and F16C (every CPU these machines have: AMD EPYC Zen 3/4/5, Intel Xeon).
 *
 * Why our own: nothing in torch reads GGUF blocks, and the alternative, a second copy of every weight in a
 * form torch multiplies (int8 tables, bf16), cost 1.5-3.4x the file in memory and 8-9 s of conversion at load.
 *
 * - ds_dequant: rows of a tensor to f32, bit for bit what gguf.quants.dequantize gives (this file is compiled
 *   with -ffp-contract=off: every product and difference is one f32 rounding, in the reference's order).
 *   A many-row product (a prefill) dequantizes a chunk of rows at a time and multiplies it with torch's f32
 *   GEMM (kernels/linear.py): the weights are the file's values exactly, the activations stay f32.
 * - ds_linear_blocks: x [M, K] f32 times a tensor of Q8_0, Q4_0, Q4_K, Q5_K or Q6_K blocks, as llama.cpp's own
 *   CPU products do it: the activations quantized to int8 per block (Q8_0 blocks of 32 for Q8_0/Q4_0, with an
 *   f16 scale; blocks of 256 with an f32 scale and sums of 16 for the K-quants), each block's integer dot
 *   product exact in int32, scaled once per block. For a Q8_0 file the only rounding is the activations'.
 *   Each thread takes a run of output rows; a row's blocks are read once from memory and then from L1 for
 *   every group of activation rows.
 * - ds_gemm_blocks (AVX512-VNNI): the same arithmetic on the blocks of every quantized type for many rows (a prefill on a
 *   CPU without AMX), on panels of 32 weight rows laid out for vpdpbusd once per product and tiles of 6 tokens.
 *
 * AVX2 has no unsigned-by-signed byte dot product with 32-bit sums (VNNI), so a block goes through vpmaddubsw
 * (u8 x s8 -> s16 pairs) and vpmaddwd (s16 pairs -> s32): an int8 weight w is made unsigned by the sign trick,
 * |w| times sign(w) * a (no pair can overflow: 2 * 128 * 127 < 32768). Where the CPU has AVX512-VNNI (BLK_VNNI),
 * vpdpbusd (u8 x s8, four products summed into each int32 lane) and vpdpwssd (s16 pairs times s16 into int32) do
 * it in one instruction each, and every product of blocks of 32 or 256 runs on 512-bit tiles of four rows (see
 * tile_q32, tile_q45k, tile_q6k): the same exact integer sum of each block as the AVX2 products, scaled by the
 * same f32 factors; only the order in which the f32 terms are added differs (blocks in pairs and lanes, rows
 * alike whatever M is, so a row's result never depends on the rows beside it).
 */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#include "blocks.h"

#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_BF16 30
/* the types read by dequantizing a row (deq_row_more), then multiplied in f32 (kind 4, see blk_kind) */
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
#define MG 4  /* activation rows per pass over a weight row */
#define ALIGN64(n) (((n) + 63) & ~(size_t)63)

/* AVX512-VNNI, with AVX512BW and AVX512VL (the 256-bit forms of the tails): the 512-bit products below */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define BLK_VNNI 1
#endif

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The IQ types' lookup tables, gguf's own (gguf.quants builds its grids from ggml's): kernels/native.py hands
 * them over once (ds_set_tables); until then those types are not taken. Grids as floats, rows of 8 (IQ2_XXS 256,
 * IQ2_XS 512, IQ2_S 1024, IQ1_S 2048) or 4 (IQ3_XXS 256, IQ3_S 512) values; ksigns: 128 bytes of sign bits. */
static const float *g_iq2xxs, *g_iq2xs, *g_iq2s, *g_iq3xxs, *g_iq3s, *g_iq1s;
static const uint8_t *g_ksigns;
/* the same grids as int8 (their values are small integers: IQ2 8..43, IQ3 1..62, IQ1 -1..1), for the products */
static int8_t *i_iq2xxs, *i_iq2xs, *i_iq2s, *i_iq3xxs, *i_iq3s, *i_iq1s;

static int8_t *int8_grid(const float *g, int n) {
    int8_t *out = malloc((size_t)n);
    if (out)
        for (int i = 0; i < n; i++) out[i] = (int8_t)g[i];
    return out;
}

int ds_set_tables(const float *iq2xxs, const float *iq2xs, const float *iq2s, const float *iq3xxs, const float *iq3s,
                  const float *iq1s, const uint8_t *ksigns) {
    if (g_ksigns) return 0;  /* once per process (the tables are gguf's, the same every time) */
    g_iq2xxs = iq2xxs, g_iq2xs = iq2xs, g_iq2s = iq2s, g_iq3xxs = iq3xxs, g_iq3s = iq3s, g_iq1s = iq1s;
    i_iq2xxs = int8_grid(iq2xxs, 256 * 8), i_iq2xs = int8_grid(iq2xs, 512 * 8), i_iq2s = int8_grid(iq2s, 1024 * 8);
    i_iq3xxs = int8_grid(iq3xxs, 256 * 4), i_iq3s = int8_grid(iq3s, 512 * 4), i_iq1s = int8_grid(iq1s, 2048 * 8);
    if (!i_iq2xxs || !i_iq2xs || !i_iq2s || !i_iq3xxs || !i_iq3s || !i_iq1s) return -1;
    g_ksigns = ksigns;
    return 0;
}

static int block_info(int type, int *elems, int *bytes) {
    switch (type) {
    case T_F32: *elems = 1; *bytes = 4; return 0;
    case T_F16: *elems = 1; *bytes = 2; return 0;
    case T_BF16: *elems = 1; *bytes = 2; return 0;
    case T_Q4_0: *elems = 32; *bytes = 18; return 0;
    case T_Q8_0: *elems = 32; *bytes = 34; return 0;
    case T_Q4_K: *elems = 256; *bytes = 144; return 0;
    case T_Q5_K: *elems = 256; *bytes = 176; return 0;
    case T_Q6_K: *elems = 256; *bytes = 210; return 0;
    case T_Q4_1: *elems = 32; *bytes = 20; return 0;
    case T_Q5_0: *elems = 32; *bytes = 22; return 0;
    case T_Q5_1: *elems = 32; *bytes = 24; return 0;
    case T_IQ4_NL: *elems = 32; *bytes = 18; return 0;
    case T_MXFP4: *elems = 32; *bytes = 17; return 0;
    case T_NVFP4: *elems = 64; *bytes = 36; return 0;
    case T_Q2_K: *elems = 256; *bytes = 84; return 0;
    case T_Q3_K: *elems = 256; *bytes = 110; return 0;
    case T_IQ4_XS: *elems = 256; *bytes = 136; return 0;
    case T_TQ1_0: *elems = 256; *bytes = 54; return 0;
    case T_TQ2_0: *elems = 256; *bytes = 66; return 0;
    }
    if (!g_ksigns) return -1;
    switch (type) {
    case T_IQ2_XXS: *elems = 256; *bytes = 66; return 0;
    case T_IQ2_XS: *elems = 256; *bytes = 74; return 0;
    case T_IQ2_S: *elems = 256; *bytes = 82; return 0;
    case T_IQ3_XXS: *elems = 256; *bytes = 98; return 0;
    case T_IQ3_S: *elems = 256; *bytes = 110; return 0;
    case T_IQ1_S: *elems = 256; *bytes = 50; return 0;
    case T_IQ1_M: *elems = 256; *bytes = 56; return 0;
    default: return -1;
    }
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

/* The 8 six-bit scales and mins of a Q4_K/Q5_K block (its bytes 4..15). */
static inline void k_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* ---- exact dequantization ---------------------------------------------------------------------------- */

static int expand_row(int type, const uint8_t *b, int K, int8_t *v, float *sc, float *mn);

/* A row as the products expand it (int8 values v, a scale per 16 and, for some types, a min), each value
 * sc v (+ mn): the IQ grid types' d_sub x (grid value x sign) with one rounding, the IQ1 types' 8 g +- 1 and
 * scale / 8, Q2_K/Q3_K's (d x sub-scale) x q (- dmin x sub-min), IQ4's and MXFP4's table values times their scale:
 * gguf's arithmetic in gguf's order, bit for bit (blocks.c is built without contraction into FMAs), and 1.2-10x
 * faster than deq_row_more's value by value (the prefill's exact chunks: [4096, 2048] on two Xeon threads IQ3_S
 * 14.3 -> 1.5 ms, Q3_K 2.4 -> 1.5, IQ4_XS 2.7 -> 1.3, MXFP4 3.3 -> 1.3). 0 for the other types (Q4_1, Q5_0, Q5_1,
 * TQ2_0, NVFP4: no faster this way), then deq_row_more. */
static int expands_exactly(int type, int K) {
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
    if (mins)
        for (int i = 0; i < K; i++) o[i] = sc[i / 16] * (float)v[i] + mn[i / 16];
    else
        for (int i = 0; i < K; i++) o[i] = sc[i / 16] * (float)v[i];
    return 1;
}

static void deq_row(int type, const uint8_t *b, int K, float *o) {
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
                     over all 256 with the scale's index and the shifts computed per value ran 8x slower) */
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
static void to_bf16(const float *x, uint16_t *o, int n) {
    for (int i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        o[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
}

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
 * Returns 0 for another type. The scalar row (deq_row into an f32 buffer, then to_bf16) ran at 1.3-2.2 G weights/s
 * for Q6_K, 3.3-5.1 for Q4_K and 4.7-6.5 for Q8_0 on two Xeon threads: 8 % of a 0.8B Q4_K_M pp512 on AMX. */
static int deq_row_bf16(int type, const uint8_t *b, int K, uint16_t *o) {
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
#endif

/* rows [rows, K] of blocks -> dst bf16 (row stride ldd), each value what ds_dequant gives rounded as torch rounds it
 * to bf16: with AVX512 a row of blocks goes straight to bf16 (deq_row_bf16); otherwise it is dequantized into f32
 * that stays in the cache and rounded from there (the prefill's bf16 chunks took an f32 chunk and a torch copy pass
 * over it, 11 % of a 0.8B Q4_K_M pp512 on a Xeon). */
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

/* ---- activations quantized as llama.cpp quantizes them ----------------------------------------------- */

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
static void quant_q8_0(const float *x, int K, int8_t *q, float *d, int32_t *c, int32_t *cb) {
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
static void quant_q8_256(const float *x, int K, int8_t *q, float *d, int32_t *c) {
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
#define Q45_ORDER {0, 2, 1, 3, 4, 6, 5, 7}
static void quant_q8_k(const float *x, int K, int8_t *q, float *d, int16_t *bs, int8_t *qp) {
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

typedef struct {
    const int8_t *q;
    const float *d;
    const int16_t *bs;
    const float *x;    /* the f32 row itself (F16/BF16 weights multiply it as it is) */
    const int32_t *c;  /* BLK_VNNI, blocks of 32: -128 * the sum of each 4 values */
    const int32_t *cb; /* BLK_VNNI, blocks of 32: -128 * the sum of each block's 32 values */
    const int8_t *qp;  /* BLK_VNNI, blocks of 256: the values in Q45_ORDER */
} act_t;

/* ---- one weight row against up to MG activation rows -------------------------------------------------- */

static inline __m256i dot_i8(__m256i aw, __m256i w, __m256i a) {  /* 8 int32 partial sums of w . a (aw = |w|) */
#ifdef BLK_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, _mm256_sign_epi8(a, w));
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(a, w)), _mm256_set1_epi16(1));
#endif
}


/* The decode products read each weight once, from memory: each row is prefetched into L2 PREFETCH bytes ahead. On a
 * model's worth of weights one thread's 512-bit products ran at 7-8 GB/s without it, 10.5-12 with it (0.8B shapes;
 * 4 KB ahead: 5% slower, 32 KB: the same; into L1: 3-6% slower); the AVX2 ones (a Zen 3's) likewise: on the Xeon
 * here built for AVX2 alone, two threads' [512, 2048] products from memory Q4_K 8.9 -> 11.3 GB/s, Q6_K 10.5 -> 14.8,
 * Q8_0 15.7 -> 20.0, Q4_0 7.8 -> 14.5 (and 17.0 and 16.0 for Q4_K and Q6_K once their row kernels took M as a
 * constant: see blk_tiles_rows). The call must be inlined: GCC deletes calls of a function that only prefetches (it
 * has no effect it can see). */
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

#ifndef BLK_VNNI
/* Four rows at once against M <= 2 activation rows: four independent accumulation chains (one row alone waits
 * on its own fmadd's latency every block: 2.5 weights a cycle here, against ~8 with four). out[r * 2 + m]. */
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
#endif

/* A Q4_K/Q5_K block's 8 six-bit scales (bytes 0..7) and 8 mins (bytes 8..15) from its 12 scale bytes at s (the
 * 16 bytes from s are read: the block goes on), unpacked in one vector: with u0, u1, u2 the three 32-bit words,
 * scales 0-3 = u0 & 0x3f.., mins 0-3 = u1 & 0x3f.., scales 4-7 = (u2 & 0x0f..) | ((u0 >> 6) & 0x03..) << 4,
 * mins 4-7 = ((u2 >> 4) & 0x0f..) | ((u1 >> 6) & 0x03..) << 4 (k_scales' byte by byte version cost ~40 scalar
 * operations a block, a third of the decode product's). */
static inline __m128i k_scales_vec(const uint8_t *s) {
    __m128i v = _mm_loadu_si128((const __m128i *)s);
    __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x3F));                     /* [scales 0-3, mins 0-3, ..] */
    __m128i t = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 2, 2)), _mm_setr_epi32(0, 4, 6, 6));
    t = _mm_and_si128(t, _mm_setr_epi32(0x0F0F0F0F, 0x0F0F0F0F, 0x03030303, 0x03030303));
    __m128i hi = _mm_or_si128(t, _mm_slli_epi32(_mm_srli_si128(t, 8), 4));  /* [scales 4-7, mins 4-7, ..] */
    return _mm_unpacklo_epi32(lo, hi);
}

#ifndef BLK_VNNI  /* (the 512-bit decode tiles below take every M there) */
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
           two scales (sub-blocks 2i, 2i + 1) are then one in-lane shuffle (each taken by two scalar loads, a
           broadcast and an insert, they were a fifth of the product's operations) */
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
#endif

/* F16 / BF16: the weights widened to f32 (exact) and multiplied with the f32 activations, 8 at a time. */
static inline __m256 load_half8(int type, const uint8_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (type == T_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* One F16/BF16 row against M (1..MG, a constant after inlining: the accumulators stay in registers) f32 rows, two
 * accumulation chains each (a single chain was bound by the FMA's latency, and a runtime M kept the accumulators in
 * memory: a 4-row verification of the demo model cost 2.1x a decode step). Each row's sum is taken the same way
 * whatever M is. */
static inline __attribute__((always_inline)) void row_half_m(int type, const uint8_t *row, int K, const act_t *a,
                                                             const int M, float *out) {
    int k = 0;
#ifdef BLK_VNNI  /* AVX512: sixteen values a vector */
    __m512 wide[MG][2];
    for (int m = 0; m < M; m++) wide[m][0] = wide[m][1] = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
        __m256i h0 = _mm256_loadu_si256((const __m256i *)(row + 2 * (size_t)k)),
                h1 = _mm256_loadu_si256((const __m256i *)(row + 2 * (size_t)(k + 16)));
        __m512 w0 = type == T_F16 ? _mm512_cvtph_ps(h0)
                                  : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h0), 16));
        __m512 w1 = type == T_F16 ? _mm512_cvtph_ps(h1)
                                  : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h1), 16));
        for (int m = 0; m < M; m++) {
            wide[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(a[m].x + k), wide[m][0]);
            wide[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(a[m].x + k + 16), wide[m][1]);
        }
    }
#endif
    __m256 acc[MG][2];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        __m256 w0 = load_half8(type, row + 2 * (size_t)k), w1 = load_half8(type, row + 2 * (size_t)(k + 8));
        for (int m = 0; m < M; m++) {
            acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(a[m].x + k), acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(a[m].x + k + 8), acc[m][1]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        __m256 w = load_half8(type, row + 2 * (size_t)k);
        for (int m = 0; m < M; m++) acc[m][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(a[m].x + k), acc[m][0]);
    }
    for (int m = 0; m < M; m++) {
        float s = blk_hsum8(_mm256_add_ps(acc[m][0], acc[m][1]));
#ifdef BLK_VNNI
        s += _mm512_reduce_add_ps(_mm512_add_ps(wide[m][0], wide[m][1]));
#endif
        for (int i = k; i < K; i++) {
            float wi;
            if (type == T_F16) wi = h2f(row + 2 * (size_t)i);
            else { uint32_t u = (uint32_t)(row[2 * i] | (row[2 * i + 1] << 8)) << 16; memcpy(&wi, &u, 4); }
            s += wi * a[m].x[i];
        }
        out[m] = s;
    }
}

static void row_half(int type, const uint8_t *row, int K, const act_t *a, int M, float *out) {
    switch (M) {
    case 1: row_half_m(type, row, K, a, 1, out); break;
    case 2: row_half_m(type, row, K, a, 2, out); break;
    case 3: row_half_m(type, row, K, a, 3, out); break;
    default: row_half_m(type, row, K, a, 4, out);
    }
}

#ifdef BLK_VNNI
/* ---- the products of blocks of 32 and 256 with 512-bit vectors (AVX512-VNNI) ------------------------------------
 * R weight rows at a time (R = 4, or 1 for the last rows; a constant after inlining, as M is) against M = 1 or 2
 * activation rows (blk_tiles runs more rows two at a time): four independent accumulation chains, each row's blocks
 * read once and used for both activation rows. out[r * 2 + m].
 * Each row is prefetched into L2 PREFETCH bytes ahead (prefetch_ahead, above). */

/* Blocks j, j + 1 of a Q8_0 or Q4_0 row (b: block j) as 64 unsigned bytes in the activations' order: Q8_0's w + 128
 * (the sign bit flipped), Q4_0's q (0..15 for the value q - 8; each block's low nibbles, then its high ones). */
static inline __m512i pair_q32(int q8, const uint8_t *b) {
    if (q8) {
        __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2))),
                                       _mm256_loadu_si256((const __m256i *)(b + 36)), 1);
        return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
    }
    __m256i t = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b + 2))),
                                        _mm_loadu_si128((const __m128i *)(b + 20)), 1);
    __m512i tt = _mm512_shuffle_i64x2(_mm512_castsi256_si512(t), _mm512_castsi256_si512(t), 0x50);  /* j, j, j+1, j+1 */
    return _mm512_and_si512(_mm512_mask_blend_epi64(0xCC, tt, _mm512_srli_epi16(tt, 4)), _mm512_set1_epi8(0x0F));
}

/* The f16 scales of blocks j .. j+7 of a Q8_0 or Q4_0 row (b: block j) as f32. Each block's scale is its first
 * two bytes, so they are the 16-bit words 17 i (Q8_0, 34-byte blocks) or 9 i (Q4_0, 18) of the run: picked by a
 * word permute from the run's cache lines (two or four vectors; a gather was slower here). */
static inline __m256 scales8(int q8, const uint8_t *b) {
    __m512i r;
    if (q8) {
        const __m512i first = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                               0, 0, 0, 0, 0, 0, 0, 0, 55, 38, 21, 4, 51, 34, 17, 0);
        __m512i lo = _mm512_permutex2var_epi16(_mm512_loadu_si512(b), first, _mm512_loadu_si512(b + 64));
        __m512i hi = _mm512_permutex2var_epi16(_mm512_loadu_si512(b + 128), first, _mm512_loadu_si512(b + 192));
        r = _mm512_mask_blend_epi16(0xF0, lo, hi);  /* words 0..3 from bytes 0..127, 4..7 (68.. - 64) from 128.. */
    } else {
        const __m512i first = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                               0, 0, 0, 0, 0, 0, 0, 0, 63, 54, 45, 36, 27, 18, 9, 0);
        r = _mm512_permutex2var_epi16(_mm512_loadu_si512(b), first, _mm512_loadu_si512(b + 64));
    }
    return _mm256_cvtph_ps(_mm512_castsi512_si128(r));
}

/* Q8_0 / Q4_0. vpdpbusd multiplies unsigned by signed bytes: the weights enter as u = w + 128 (Q8_0) or u = q = w + 8
 * (Q4_0), and each int32 lane starts from the activations' -128 * (sum of its 4 values) (a.c; / 16 for Q4_0), so it
 * ends at the exact sum of its four w * a (what the AVX2 product's lane holds). A lane of two blocks' 16 is scaled by
 * its block's d_w * d_a: the eight weight scales of a run of 8 blocks are read at once (scales8) and times the
 * activations' 8, then spread over the lanes by a permute. */
static inline __attribute__((always_inline)) void tile_q32(int type, const uint8_t *row0, size_t row_bytes,
                                                           const int R, int K, const act_t *a, const int M, float *out) {
    const int q8 = type == T_Q8_0, bytes = q8 ? 34 : 18, nb = K / 32;
    const __m512i second = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);  /* lanes of block j + 1 */
    __m512 acc[4][2];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    int j = 0;
    for (; j + 8 <= nb; j += 8) {
        __m512 sc[4][2];  /* d_w * d_a of blocks j .. j+7, in the low 8 lanes */
        for (int r = 0; r < R; r++) {
            const uint8_t *b = row0 + (size_t)r * row_bytes + (size_t)j * bytes;
            prefetch_ahead(b, 8 * bytes);
            __m256 dw = scales8(q8, b);
            for (int m = 0; m < M; m++)
                sc[r][m] = _mm512_castps256_ps512(_mm256_mul_ps(dw, _mm256_loadu_ps(a[m].d + j)));
        }
        for (int p = 0; p < 4; p++) {
            const int jj = j + 2 * p;
            const __m512i spread = _mm512_add_epi32(second, _mm512_set1_epi32(2 * p));
            __m512i x[2], c[2];
            for (int m = 0; m < M; m++) {
                x[m] = _mm512_loadu_si512(a[m].q + 32 * jj);
                c[m] = _mm512_loadu_si512(a[m].c + 8 * jj);
                if (!q8) c[m] = _mm512_srai_epi32(c[m], 4);
            }
            for (int r = 0; r < R; r++) {
                __m512i u = pair_q32(q8, row0 + (size_t)r * row_bytes + (size_t)jj * bytes);
                for (int m = 0; m < M; m++)
                    acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c[m], u, x[m])),
                                                _mm512_permutexvar_ps(spread, sc[r][m]), acc[r][m]);
            }
        }
    }
    float tail[MG] = {0};
    for (int r = 0; r < R; r++) {
        if (j < nb) {  /* the last blocks of a row (fewer than 8) one at a time */
            act_t at[2];
            for (int m = 0; m < M; m++) {
                at[m] = a[m];
                at[m].q += 32 * j, at[m].d += j;
            }
            row_q32(type, row0 + (size_t)r * row_bytes + (size_t)j * bytes, K - 32 * j, at, M, tail);
        }
        for (int m = 0; m < M; m++) out[r * 2 + m] = _mm512_reduce_add_ps(acc[r][m]) + tail[m];
    }
}

/* The other types of blocks of 32 values, fused as Q4_0's product is (no expanded copy of the row): Q4_1, Q5_0,
 * Q5_1, IQ4_NL, MXFP4, and IQ4_XS (superblocks of 256 with a scale per 32). Each pair of blocks becomes 64 unsigned
 * bytes u in the activations' order (a block's 16 low nibbles, then its high ones): Q4_1's q; Q5's q with bit 4 from
 * qh; IQ4_NL's and MXFP4's table values + 128 (one byte shuffle). Each int32 lane starts from the activations' sums
 * (a.c = -128 x the sum of its 4 values) so that it ends at the exact sum of w a with w the block's integer values:
 * a.c for u = w + 128, a.c / 16 for Q5_0's u = w + 16; Q4_1 and Q5_1 (w = d q + m) start at 0 and add their min
 * times the activations' sum (-a.c / 128) times d_a. */
static const uint8_t KV_IQ4NL_U[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
static const uint8_t KV_E2M1_U[16] = {128, 129, 130, 131, 132, 134, 136, 140, 128, 127, 126, 125, 124, 122, 120, 116};
static void row_expanded(const int8_t *v, const float *sc, const float *mn, int K, const act_t *a, int M, float *out);

static inline int b32_bytes(int type) {
    return type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : type == T_Q5_1 ? 24 : type == T_IQ4_NL ? 18 : type == T_MXFP4 ? 17 : 136;
}

/* where block j's 16 bytes of nibbles lie, from the row's first block */
static inline const uint8_t *b32_qs(int type, const uint8_t *row, int j) {
    if (type == T_IQ4_XS) return row + (size_t)(j / 8) * 136 + 8 + 16 * (j % 8);
    const int at = type == T_Q4_1 ? 4 : type == T_Q5_0 ? 6 : type == T_Q5_1 ? 8 : type == T_IQ4_NL ? 2 : 1;
    return row + (size_t)j * b32_bytes(type) + at;
}

static inline __m512i b32_pair(int type, const uint8_t *row, int j) {
    const uint8_t *q0 = b32_qs(type, row, j), *q1 = b32_qs(type, row, j + 1);
    __m256i t = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)q0)),
                                        _mm_loadu_si128((const __m128i *)q1), 1);
    __m512i tt = _mm512_shuffle_i64x2(_mm512_castsi256_si512(t), _mm512_castsi256_si512(t), 0x50);  /* j, j, j+1, j+1 */
    __m512i u = _mm512_and_si512(_mm512_mask_blend_epi64(0xCC, tt, _mm512_srli_epi16(tt, 4)), _mm512_set1_epi8(0x0F));
    if (type == T_Q5_0 || type == T_Q5_1) {  /* qh bit i: value i's bit 4 */
        const int at = type == T_Q5_0 ? 2 : 4, bytes = b32_bytes(type);
        const __mmask64 k = (__mmask64)u32(row + (size_t)j * bytes + at) | (__mmask64)u32(row + (size_t)(j + 1) * bytes + at) << 32;
        u = _mm512_or_si512(u, _mm512_maskz_set1_epi8(k, 0x10));
    } else if (type == T_IQ4_NL || type == T_IQ4_XS || type == T_MXFP4) {
        u = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(type == T_MXFP4 ? KV_E2M1_U : KV_IQ4NL_U))), u);
    }
    return u;
}

/* the scales (min = 1: the mins) of blocks j .. j + 7 as f32, built in registers (eight scalars stored and loaded
 * as a vector stalled on the store forwarding) */
static inline __m256 b32_scales8(int type, const uint8_t *row, int j, int min) {
    if (type == T_IQ4_XS) {  /* one superblock: d (ls - 32), ls = its low 4 bits (scales_l) | 2 high (scales_h) */
        const uint8_t *b = row + (size_t)(j / 8) * 136;
        const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)u32(b + 4)),
                                                              _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)), _mm256_set1_epi32(0xF));
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)u16(b + 2)),
                                                              _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)), _mm256_set1_epi32(3));
        const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
        return _mm256_mul_ps(_mm256_set1_ps(h2f(b)), _mm256_cvtepi32_ps(ls));
    }
    const int bytes = b32_bytes(type);
    const uint8_t *b = row + (size_t)j * bytes;
    if (type == T_MXFP4) {  /* e8m0_half: (x - 1) << 23, or 0x00200000 << x for x < 2 */
        const __m256i x = _mm256_setr_epi32(b[0], b[bytes], b[2 * bytes], b[3 * bytes], b[4 * bytes], b[5 * bytes],
                                            b[6 * bytes], b[7 * bytes]);
        const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(x, _mm256_set1_epi32(1)), 23);
        const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), x);
        const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), x);
        return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, small));
    }
    const int at = 2 * min;
    const __m128i h = _mm_setr_epi16((short)u16(b + at), (short)u16(b + bytes + at), (short)u16(b + 2 * bytes + at),
                                     (short)u16(b + 3 * bytes + at), (short)u16(b + 4 * bytes + at),
                                     (short)u16(b + 5 * bytes + at), (short)u16(b + 6 * bytes + at),
                                     (short)u16(b + 7 * bytes + at));
    return _mm256_cvtph_ps(h);
}

static inline __attribute__((always_inline)) void tile_b32(const int type, const uint8_t *row0, size_t row_bytes,
                                                           const int R, int K, const act_t *a, const int M, float *out) {
    const int nb = K / 32, min = type == T_Q4_1 || type == T_Q5_1;
    const __m512i second = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);  /* lanes of block j + 1 */
    __m512 acc[4][2];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    int j = 0;
    for (; j + 8 <= nb; j += 8) {
        __m512 sc[4][2], mc[4][2];  /* d_w d_a (and m_w d_a / -128) of blocks j .. j+7, in the low 8 lanes */
        for (int r = 0; r < R; r++) {
            const uint8_t *row = row0 + (size_t)r * row_bytes;
            prefetch_ahead(b32_qs(type, row, j), 8 * b32_bytes(type) / (type == T_IQ4_XS ? 8 : 1));
            __m256 dw = b32_scales8(type, row, j, 0), mw = min ? b32_scales8(type, row, j, 1) : dw;
            for (int m = 0; m < M; m++) {
                __m256 da = _mm256_loadu_ps(a[m].d + j);
                sc[r][m] = _mm512_castps256_ps512(_mm256_mul_ps(dw, da));
                if (min) mc[r][m] = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_mul_ps(mw, da), _mm256_set1_ps(-1.0f / 128.0f)));
            }
        }
        for (int p = 0; p < 4; p++) {
            const int jj = j + 2 * p;
            const __m512i spread = _mm512_add_epi32(second, _mm512_set1_epi32(2 * p));
            __m512i x[2], c[2];
            __m512 cf[2];
            for (int m = 0; m < M; m++) {
                x[m] = _mm512_loadu_si512(a[m].q + 32 * jj);
                c[m] = _mm512_loadu_si512(a[m].c + 8 * jj);
                if (min) cf[m] = _mm512_cvtepi32_ps(c[m]), c[m] = _mm512_setzero_si512();
                else if (type == T_Q5_0) c[m] = _mm512_srai_epi32(c[m], 3);
            }
            for (int r = 0; r < R; r++) {
                __m512i u = b32_pair(type, row0 + (size_t)r * row_bytes, jj);
                for (int m = 0; m < M; m++) {
                    acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c[m], u, x[m])),
                                                _mm512_permutexvar_ps(spread, sc[r][m]), acc[r][m]);
                    if (min) acc[r][m] = _mm512_fmadd_ps(cf[m], _mm512_permutexvar_ps(spread, mc[r][m]), acc[r][m]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float tail[2] = {0.0f, 0.0f};
        if (j < nb) {  /* the last blocks of a row (fewer than 8; not IQ4_XS's, whole superblocks) expanded */
            int8_t v[256];
            float vs[16], vm[16];
            act_t at[2];
            for (int m = 0; m < M; m++) {
                at[m] = a[m];
                at[m].q += 32 * j, at[m].d += j, at[m].c += 8 * j;
            }
            const int mins = expand_row(type, row0 + (size_t)r * row_bytes + (size_t)j * b32_bytes(type), K - 32 * j, v, vs, vm);
            row_expanded(v, vs, mins > 0 ? vm : NULL, K - 32 * j, at, M, tail);
        }
        for (int m = 0; m < M; m++) out[r * 2 + m] = _mm512_reduce_add_ps(acc[r][m]) + tail[m];
    }
}

/* Q2_K, Q3_K and TQ2_0 (superblocks of 256 values of 2 bits, Q3_K's third bit in hmask), fused likewise: each pair
 * of 32-blocks (values 64p .. 64p + 63 of a superblock: its half n = p / 2, fields j0 = 2 (p % 2) and j0 + 1) is the
 * 32 bytes of 2-bit fields shifted by 2 j0 and 2 j0 + 2 (u = q, 0..3; Q3_K's + 4 where its hmask bit 4n + j is set,
 * so u = w + 4 and the sums start at a.c / 32; TQ2_0's u = w + 1, at a.c / 128); each sub-block of 16 (four lanes) is
 * scaled by its scale times d_a; Q2_K's min adds dmin m d_a times the activations' sum (-a.c / 128 a lane). */
/* TQ1_0's values 64p .. 64p + 63 of a superblock as u = w + 1 (0..2): trit t of byte x is floor(3 y / 256) with
 * y = x 3^t mod 256, that is [y >= 86] + [y >= 171]. Values 0..159 are the trits 0..4 of bytes 0..31, 160..239
 * those of bytes 32..47, 240..255 the trits 0..3 of bytes 48..51. Per byte: x, and 3^t, in 16-bit lanes. */
static inline __m512i tq1_pair(const uint8_t *b, int p) {
    __m512i x, k;
    const __m256i lo = _mm256_loadu_si256((const __m256i *)b);
    const __m128i mid = _mm_loadu_si128((const __m128i *)(b + 32));
    switch (p) {
    case 0: x = _mm512_broadcast_i64x4(lo), k = _mm512_inserti64x4(_mm512_set1_epi16(1), _mm256_set1_epi16(3), 1); break;
    case 1: x = _mm512_broadcast_i64x4(lo), k = _mm512_inserti64x4(_mm512_set1_epi16(9), _mm256_set1_epi16(27), 1); break;
    case 2:
        x = _mm512_inserti64x4(_mm512_castsi256_si512(lo), _mm256_broadcastsi128_si256(mid), 1);
        k = _mm512_inserti64x4(_mm512_set1_epi16(81), _mm256_set_m128i(_mm_set1_epi16(3), _mm_set1_epi16(1)), 1);
        break;
    default:
        x = _mm512_inserti32x4(_mm512_broadcast_i32x4(mid), _mm_set1_epi32((int)u32(b + 48)), 3);
        k = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_set1_epi16(9), _mm_set1_epi16(27), 1), _mm_set1_epi16(81), 2),
                               _mm_setr_epi16(1, 1, 3, 3, 9, 9, 27, 27), 3);
    }
    const __m512i ylo = _mm512_mullo_epi16(x, k), yhi = _mm512_mullo_epi16(_mm512_and_si512(x, _mm512_set1_epi16((short)0xFF00)), k);
    const __m512i y = _mm512_ternarylogic_epi32(_mm512_set1_epi16(0x00FF), ylo, yhi, 0xCA);  /* m ? ylo : yhi */
    const __mmask64 k1 = _mm512_cmpge_epu8_mask(y, _mm512_set1_epi8((char)86)), k2 = _mm512_cmpge_epu8_mask(y, _mm512_set1_epi8((char)171));
    return _mm512_mask_add_epi8(_mm512_maskz_set1_epi8(k1, 1), k2, _mm512_maskz_set1_epi8(k1, 1), _mm512_set1_epi8(1));
}

static inline __attribute__((always_inline)) void tile_q23k(const int type, const uint8_t *row0, size_t row_bytes,
                                                            const int R, int K, const act_t *a, const int M, float *out) {
    const int q2 = type == T_Q2_K, q3 = type == T_Q3_K, tq1 = type == T_TQ1_0;
    const int bytes = q2 ? 84 : q3 ? 110 : tq1 ? 54 : 66, at_qs = q2 ? 16 : q3 ? 32 : 0;
    const __m512i sub4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);   /* lane -> sub-block */
    const __m512i blk2 = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);   /* sub-block -> block */
    __m512 acc[4][2];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    for (int jb = 0; jb < K / 256; jb++) {
        __m512 S[4][2], Mn[4][2];  /* per sub-block: scale d_a (and Q2_K's dmin m d_a / 128) */
        for (int r = 0; r < R; r++) {
            const uint8_t *b = row0 + (size_t)r * row_bytes + (size_t)jb * bytes;
            prefetch_ahead(b, bytes);
            __m512 scf, mnf = _mm512_setzero_ps();
            if (q2) {
                const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
                scf = _mm512_mul_ps(_mm512_set1_ps(h2f(b + 80)), _mm512_cvtepi32_ps(_mm512_and_si512(raw, _mm512_set1_epi32(0xF))));
                mnf = _mm512_mul_ps(_mm512_set1_ps(h2f(b + 82) / 128.0f), _mm512_cvtepi32_ps(_mm512_srli_epi32(raw, 4)));
            } else if (q3) {  /* sub-block g: (scs[g % 8] >> 4 (g / 8)) & 15 | ((scs[8 + g % 4] >> 2 (g / 4)) & 3) << 4, - 32 */
                const uint8_t *scs = b + 96;
                const __m128i lo8 = _mm_loadl_epi64((const __m128i *)scs);
                const __m512i lo = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo8, lo8)),
                                                                      _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4)),
                                                    _mm512_set1_epi32(0xF));
                const __m512i hi = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)u32(scs + 8)),
                                                                      _mm512_setr_epi32(0, 8, 16, 24, 2, 10, 18, 26, 4, 12, 20, 28, 6, 14, 22, 30)),
                                                    _mm512_set1_epi32(3));
                const __m512i ls = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
                scf = _mm512_mul_ps(_mm512_set1_ps(h2f(b + 108)), _mm512_cvtepi32_ps(ls));
            } else {
                scf = _mm512_set1_ps(h2f(b + (tq1 ? 52 : 64)));
            }
            for (int m = 0; m < M; m++) {
                const __m512 da = _mm512_permutexvar_ps(blk2, _mm512_castps256_ps512(_mm256_loadu_ps(a[m].d + 8 * jb)));
                S[r][m] = _mm512_mul_ps(scf, da);
                if (q2) Mn[r][m] = _mm512_mul_ps(mnf, da);
            }
        }
        for (int p = 0; p < 4; p++) {
            const int n = p / 2, j0 = 2 * (p % 2);
            const __m512i idx = _mm512_add_epi32(sub4, _mm512_set1_epi32(4 * p));
            const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * j0)), _mm256_set1_epi16((short)(2 * j0 + 2)), 1);
            const __m512i hshift = _mm512_inserti64x4(_mm512_set1_epi16((short)(4 * n + j0)), _mm256_set1_epi16((short)(4 * n + j0 + 1)), 1);
            __m512i x[2], c[2];
            __m512 cf[2];
            for (int m = 0; m < M; m++) {
                x[m] = _mm512_loadu_si512(a[m].q + 256 * jb + 64 * p);
                c[m] = _mm512_loadu_si512(a[m].c + 64 * jb + 16 * p);
                if (q2) cf[m] = _mm512_cvtepi32_ps(c[m]), c[m] = _mm512_setzero_si512();
                else c[m] = _mm512_srai_epi32(c[m], q3 ? 5 : 7);
            }
            for (int r = 0; r < R; r++) {
                const uint8_t *b = row0 + (size_t)r * row_bytes + (size_t)jb * bytes;
                __m512i u;
                if (tq1) {
                    u = tq1_pair(b, p);
                } else {
                    const __m512i qv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + at_qs + 32 * n)));
                    u = _mm512_and_si512(_mm512_srlv_epi16(qv, shift), _mm512_set1_epi8(3));
                }
                if (q3) {
                    const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)b));
                    u = _mm512_or_si512(u, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hm, hshift), _mm512_set1_epi8(1)), 2));
                }
                for (int m = 0; m < M; m++) {
                    acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c[m], u, x[m])),
                                                _mm512_permutexvar_ps(idx, S[r][m]), acc[r][m]);
                    if (q2) acc[r][m] = _mm512_fmadd_ps(cf[m], _mm512_permutexvar_ps(idx, Mn[r][m]), acc[r][m]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) out[r * 2 + m] = _mm512_reduce_add_ps(acc[r][m]);
}

/* The first 16 bytes of a Q4_K/Q5_K block (d, dmin and the 12 scale bytes) at b, b + row_bytes, .. of R <= 4 rows
 * at once, row r's in 128-bit lane r: *raw as loaded (its dword 0 is the row's [d, dmin]), and returned, the
 * unpacked six-bit scales and mins (k_scales_vec's arithmetic, the words one dword on): in each lane bytes 0-3 are
 * scales 4-7, 4-7 scales 0-3, 8-11 mins 0-3, 12-15 mins 4-7 (K_SC_BYTE). */
#define K_SC_BYTE(s) ((s) < 4 ? 4 + (s) : (s) - 4)
static inline __m512i k_scales_rows(const uint8_t *b, size_t row_bytes, const int R, __m512i *raw) {
    /* (zero-extended: a tile of one row converts lanes 1-3's d and dmin too, and reads nothing of them) */
    __m512i v = _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i *)b));
    if (R > 1) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b + row_bytes)), 1);
    if (R > 2) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b + 2 * row_bytes)), 2);
    if (R > 3) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b + 3 * row_bytes)), 3);
    *raw = v;
    /* dwords [dd, u0, u1, u2]: lo = [., scales 0-3, mins 0-3, .]; t = [u2 & 0x0f.., (u0 >> 6) & 0x03..,
     * (u1 >> 6) & 0x03.., (u2 >> 4) & 0x0f..] and its neighbours swapped give scales 4-7 in dword 0, mins 4-7 in 3 */
    __m512i lo = _mm512_and_si512(v, _mm512_set1_epi8(0x3F));
    __m512i t = _mm512_srlv_epi32(_mm512_shuffle_epi32(v, (_MM_PERM_ENUM)_MM_SHUFFLE(3, 2, 1, 3)), _mm512_set4_epi32(4, 6, 6, 0));
    t = _mm512_and_si512(t, _mm512_set4_epi32(0x0F0F0F0F, 0x03030303, 0x03030303, 0x0F0F0F0F));
    __m512i hi = _mm512_or_si512(t, _mm512_slli_epi32(_mm512_shuffle_epi32(t, (_MM_PERM_ENUM)_MM_SHUFFLE(2, 3, 0, 1)), 4));
    return _mm512_mask_blend_epi32((__mmask16)0x9999, lo, hi);
}

/* The high nibbles of each byte as bytes 0..15: one GFNI affine transform where the CPU has it (bit i of a byte out
 * is bit i + 4 in), a shift and a mask elsewhere. */
static inline __m512i hi_nibbles(__m512i v) {
#ifdef __GFNI__
    return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000LL), 0);
#else
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
#endif
}

/* Q4_K / Q5_K: v = d sc q - dmin m per sub-block of 32. A block's 128 bytes of nibbles are two vectors; each gives
 * two of 64 values (its low nibbles: sub-blocks 0 and 2, or 4 and 6; its high ones: 1 and 3, or 5 and 7), so the
 * activations are read in that order (a.qp, Q45_ORDER). Their products with the values are summed in int16 pairs
 * (vpmaddubsw: q <= 31, |a| <= 127) and the pairs times their sub-block's scale into int32 (vpdpwssd). What is per
 * block and not per value is done for the R rows at once, each row in its 128-bit lane: the scales' unpacking, the
 * f16 [d, dmin] pairs to f32, and the mins times the activations' sums of 32 (one vpmaddwd for the four rows).
 * Q5_K's fifth bits: bit s of qh[l] for value l of sub-block s. */
static inline __attribute__((always_inline)) void tile_q45k(int type, const uint8_t *row0, size_t row_bytes,
                                                            const int R, int K, const act_t *a, const int M, float *out) {
    const int q5 = type == T_Q5_K, bytes = q5 ? 176 : 144;
    const __m512i lo4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    static const int first[4] = {0, 1, 4, 5};  /* vector c of a block: sub-blocks first[c] and first[c] + 2 */
    /* byte shuffles of a row's unpacked scales and mins: vector c's int16 scales, the mins as int16 */
    __m512i pick[4];
    for (int c = 0; c < 4; c++)
        pick[c] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)(0x8000 | K_SC_BYTE(first[c])))),
                                     _mm256_set1_epi16((short)(0x8000 | K_SC_BYTE(first[c] + 2))), 1);
    const __m512i pick_mins = _mm512_broadcast_i32x4(_mm_setr_epi8(8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14, -1, 15, -1));
    const __m512i dd_of_rows = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i dmin_of_rows = _mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7);
    __m512 vacc[4][2], macc[2];  /* macc: lane r, row r's mins times the sums */
    for (int m = 0; m < M; m++) {
        macc[m] = _mm512_setzero_ps();
        for (int r = 0; r < R; r++) vacc[r][m] = _mm512_setzero_ps();
    }
    for (int jb = 0; jb < K / 256; jb++) {
        __m512i raw;
        __m512i sm = k_scales_rows(row0 + (size_t)jb * bytes, row_bytes, R, &raw);
        /* [d0, dmin0, d1, dmin1, ..] of the R rows in f32 */
        __m512 dd = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi32(dd_of_rows, raw))));
        __m512i mins = _mm512_shuffle_epi8(sm, pick_mins);
        __m512 f[2];  /* [d da, dmin da, ..] */
        for (int m = 0; m < M; m++) {
            const int16_t *bs = a[m].bs + 16 * jb;  /* the activations' sums of 32, sub-blocks 0..7 */
            __m128i sums = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)bs), _mm_loadu_si128((const __m128i *)(bs + 8)));
            f[m] = _mm512_mul_ps(dd, _mm512_set1_ps(a[m].d[jb]));
            macc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(mins, _mm512_broadcast_i32x4(sums))),
                                      _mm512_permutexvar_ps(dmin_of_rows, f[m]), macc[m]);
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *b = row0 + (size_t)r * row_bytes + (size_t)jb * bytes;
            prefetch_ahead(b, bytes);
            __m512i sc = _mm512_permutexvar_epi32(_mm512_add_epi32(_mm512_set4_epi32(3, 2, 1, 0), _mm512_set1_epi32(4 * r)),
                                                  sm);  /* row r's scales and mins, in each 128 bits */
            const uint8_t *qs = b + (q5 ? 48 : 16);
            __m512i raw0 = _mm512_loadu_si512(qs), raw1 = _mm512_loadu_si512(qs + 64);
            __m512i w[4] = {_mm512_and_si512(raw0, lo4), hi_nibbles(raw0), _mm512_and_si512(raw1, lo4), hi_nibbles(raw1)};
            if (q5) {  /* qh2: [qh, qh >> 2], so that a vector's two sub-blocks s, s + 2 find their bits at bit s */
                __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
                __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
                w[0] = _mm512_ternarylogic_epi32(w[0], _mm512_slli_epi16(qh2, 4), bit4, 0xF8);  /* w | (t & 0x10) */
                w[1] = _mm512_ternarylogic_epi32(w[1], _mm512_slli_epi16(qh2, 3), bit4, 0xF8);
                w[2] = _mm512_ternarylogic_epi32(w[2], qh2, bit4, 0xF8);
                w[3] = _mm512_ternarylogic_epi32(w[3], _mm512_srli_epi16(qh2, 1), bit4, 0xF8);
            }
            __m512i dot[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
            for (int c = 0; c < 4; c++) {
                __m512i s = _mm512_shuffle_epi8(sc, pick[c]);
                for (int m = 0; m < M; m++)
                    dot[m] = _mm512_dpwssd_epi32(dot[m], _mm512_maddubs_epi16(w[c], _mm512_loadu_si512(a[m].qp + 256 * jb + 64 * c)), s);
            }
            for (int m = 0; m < M; m++)
                vacc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_permutexvar_ps(_mm512_set1_epi32(2 * r), f[m]),
                                             vacc[r][m]);
        }
    }
    for (int m = 0; m < M; m++) {
        float mins_of[16];
        _mm512_storeu_ps(mins_of, macc[m]);
        for (int r = 0; r < R; r++)
            out[r * 2 + m] = _mm512_reduce_add_ps(vacc[r][m]) -
                             ((mins_of[4 * r] + mins_of[4 * r + 1]) + (mins_of[4 * r + 2] + mins_of[4 * r + 3]));
    }
}

/* Q6_K: v = d sc (q - 32) per sub-block of 16 (q 0..63: four bits of ql, two of qh). A half of a block (128 values)
 * is two vectors of 64 in the natural order; the int16 pairs of a vector take the scales of their sub-blocks of 16
 * (a permute), and the offset is -32 sum over sub-blocks of sc times the sum of its 16 activations, in int32. */
static inline __attribute__((always_inline)) void tile_q6k(const uint8_t *row0, size_t row_bytes, const int R, int K,
                                                           const act_t *a, const int M, float *out) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F), hi2 = _mm512_set1_epi8(0x33);
    const __m512i idx = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                         1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);  /* pair p: sub-block p / 8 */
    __m512 vacc[4][2];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) vacc[r][m] = _mm512_setzero_ps();
    for (int jb = 0; jb < K / 256; jb++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *b = row0 + (size_t)r * row_bytes + (size_t)jb * 210;
            prefetch_ahead(b, 210);
            __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));  /* the 16 scales */
            __m512i sc512 = _mm512_castsi256_si512(sc16);
            __m512i dot[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
            for (int h = 0; h < 2; h++) {
                __m512i ql = _mm512_loadu_si512(b + 64 * h);
                __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                /* [qh, qh >> 2] & 0x33: the two high bits of values 0..63 of the half at bits 0-1, of 64..127 at 4-5 */
                __m512i qh2 = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1), hi2);
                /* va: values 0..63 of the half (sub-blocks 8h+0..3), vb: 64..127 (8h+4..7): the low four bits from ql,
                 * the high four from the shifted qh2 (a bit-select: lo4 ? ql : qh2) */
                __m512i va = _mm512_ternarylogic_epi32(lo4, ql, _mm512_slli_epi16(qh2, 4), 0xCA);
                __m512i vb = _mm512_ternarylogic_epi32(lo4, _mm512_srli_epi16(ql, 4), qh2, 0xCA);
                __m512i sa = _mm512_permutexvar_epi16(_mm512_add_epi16(idx, _mm512_set1_epi16((short)(8 * h))), sc512);
                __m512i sb = _mm512_permutexvar_epi16(_mm512_add_epi16(idx, _mm512_set1_epi16((short)(8 * h + 4))), sc512);
                for (int m = 0; m < M; m++) {
                    const int8_t *q = a[m].q + 256 * jb + 128 * h;
                    dot[m] = _mm512_dpwssd_epi32(dot[m], _mm512_maddubs_epi16(va, _mm512_loadu_si512(q)), sa);
                    dot[m] = _mm512_dpwssd_epi32(dot[m], _mm512_maddubs_epi16(vb, _mm512_loadu_si512(q + 64)), sb);
                }
            }
            float d = h2f(b + 208);
            for (int m = 0; m < M; m++) {
                /* sum sc (q - 32) qa = sum sc q qa - 32 sum sc bs: the offset folded into the int32 lanes */
                __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(a[m].bs + 16 * jb)));
                __m512i v = _mm512_sub_epi32(dot[m], _mm512_zextsi256_si512(_mm256_slli_epi32(off, 5)));
                vacc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(d * a[m].d[jb]), vacc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) out[r * 2 + m] = _mm512_reduce_add_ps(vacc[r][m]);
}

static inline __attribute__((always_inline)) void tile_any(int type, const uint8_t *row0, size_t row_bytes,
                                                           const int R, int K, const act_t *a, const int M, float *out) {
    switch (type) {
    case T_Q6_K: tile_q6k(row0, row_bytes, R, K, a, M, out); break;
    case T_Q4_K: case T_Q5_K: tile_q45k(type, row0, row_bytes, R, K, a, M, out); break;
    case T_Q4_1: tile_b32(T_Q4_1, row0, row_bytes, R, K, a, M, out); break;
    case T_Q5_0: tile_b32(T_Q5_0, row0, row_bytes, R, K, a, M, out); break;
    case T_Q5_1: tile_b32(T_Q5_1, row0, row_bytes, R, K, a, M, out); break;
    case T_IQ4_NL: tile_b32(T_IQ4_NL, row0, row_bytes, R, K, a, M, out); break;
    case T_IQ4_XS: tile_b32(T_IQ4_XS, row0, row_bytes, R, K, a, M, out); break;
    case T_MXFP4: tile_b32(T_MXFP4, row0, row_bytes, R, K, a, M, out); break;
    case T_Q2_K: tile_q23k(T_Q2_K, row0, row_bytes, R, K, a, M, out); break;
    case T_Q3_K: tile_q23k(T_Q3_K, row0, row_bytes, R, K, a, M, out); break;
    case T_TQ2_0: tile_q23k(T_TQ2_0, row0, row_bytes, R, K, a, M, out); break;
    case T_TQ1_0: tile_q23k(T_TQ1_0, row0, row_bytes, R, K, a, M, out); break;
    default: tile_q32(type, row0, row_bytes, R, K, a, M, out);
    }
}

/* R (4 or 1) rows of a Q8_0, Q4_0, Q4_K, Q5_K or Q6_K tensor against M (1 or 2) prepared rows: out[r * 2 + m]. */
/* its presence says that this build's products are these (kernels/native.py reads the library's symbols) */
int ds_blocks_vnni(void) { return 1; }

static void decode_tile(int type, const uint8_t *row0, size_t row_bytes, int R, int K, const act_t *a, int M, float *out) {
    if (R == 4) {
        if (M == 1) tile_any(type, row0, row_bytes, 4, K, a, 1, out);
        else tile_any(type, row0, row_bytes, 4, K, a, 2, out);
    } else {
        if (M == 1) tile_any(type, row0, row_bytes, 1, K, a, 1, out);
        else tile_any(type, row0, row_bytes, 1, K, a, 2, out);
    }
}

/* Tiles t0 .. t1 of a product of M <= 2 activation rows (tiles of 4 rows, then tiles of 1 from row 4 x `tiles`).
 * `inlined`: the loop inside the type's own tile code (type and M constants); else a decode_tile call per tile. A
 * product of short rows (an expert's down projection, K = 512: two blocks a row) paid ~80 cycles a tile for that call,
 * ~30 % of the tile's work. */
static inline __attribute__((always_inline)) void tiles_loop(const int type, const int inlined, const uint8_t *blocks,
                                                             size_t row_bytes, int tiles, int t0, int t1, int K,
                                                             const act_t *a, const int M, float *y, long ldy) {
    for (int t = t0; t < t1; t++) {
        float out[8];
        const int n = t < tiles ? 4 * t : 4 * tiles + (t - tiles), R = t < tiles ? 4 : 1;
        if (!inlined) decode_tile(type, blocks + (size_t)n * row_bytes, row_bytes, R, K, a, M, out);
        else if (R == 4) tile_any(type, blocks + (size_t)n * row_bytes, row_bytes, 4, K, a, M, out);
        else tile_any(type, blocks + (size_t)n * row_bytes, row_bytes, 1, K, a, M, out);
        for (int r = 0; r < R; r++)
            for (int m = 0; m < M; m++) y[(size_t)m * ldy + n + r] = out[r * 2 + m];
    }
}

/* tiles_loop with the K-quants of the usual files in loops of their own, every other type through decode_tile */
static void decode_tiles(int type, const uint8_t *blocks, size_t row_bytes, int tiles, int t0, int t1, int K,
                         const act_t *a, int M, float *y, long ldy) {
#define DS_TILES(T) do { if (M == 1) tiles_loop(T, 1, blocks, row_bytes, tiles, t0, t1, K, a, 1, y, ldy); \
                         else tiles_loop(T, 1, blocks, row_bytes, tiles, t0, t1, K, a, 2, y, ldy); } while (0)
    switch (type) {
    case T_Q4_K: DS_TILES(T_Q4_K); break;
    case T_Q5_K: DS_TILES(T_Q5_K); break;
    case T_Q6_K: DS_TILES(T_Q6_K); break;
    default: tiles_loop(type, 0, blocks, row_bytes, tiles, t0, t1, K, a, M, y, ldy);
    }
#undef DS_TILES
}

#endif  /* BLK_VNNI: the 512-bit decode tiles */

/* ---- many rows on the blocks: a GEMM on panels of the file's blocks -----------------------------------------
 * The prefill's products on Q8_0, Q4_K, Q5_K and Q6_K tensors (and, from their expanded rows, every other quantized
 * type: see gemm_mode) where the CPU has AVX512-VNNI and no AMX (a Zen 4/5), and the MoE experts' (ds_moe_experts);
 * built for AVX2 alone (a Zen 3) the same panels go through gemm_pass2's vpmaddubsw tiles (see there):
 * the file's values exactly, the activations int8 as llama.cpp quantizes them for the type: per block of 32 with an
 * f16-rounded scale (Q8_0's) or, for the K-quants and the IQ and TQ types, per block of 256 with an f32 scale (Q8_K's;
 * gemm_a256), so the only rounding is the activations'. torch has no such product: its int8 GEMM wants one scale per
 * row (requantizing Q8_0 per row doubled its error), and its f32 GEMM on exact chunks ran at a third of this speed.
 * Each thread copies a panel of GP = 32 weight rows into a buffer laid out for vpdpbusd, once per product: each
 * sub-block of 32 (Q6_K: 16) values as unsigned bytes u, 16 rows' 4 bytes per vector, and per row and sub-block a
 * scale s (and for Q4_K/Q5_K a min m) with w = s (u - z) (Q8_0: u = w + 128, z = 128; Q6_K: z = 32) or
 * w = s u - m (Q4_K/Q5_K, z = 0). The copy is used by every token, so it costs ~1/M of the product and holds no
 * second copy of the tensor. A tile is the panel's 32 rows times GT tokens: per sub-block, SB/4 vpdpbusd per 16
 * rows and token into int32 sums that start at -z (the token's sum over the sub-block), so they end at the exact
 * sum of w' a (w' = u - z); then one convert and one multiply-add by s d_a into f32, and for a min one more
 * multiply-add by -m d_a (sum of a); with activations per 256, by s alone (and -m (sum of a)), the block of 256's
 * f32 sum then times d_a into the output. Each row's f32 sum takes the sub-blocks in order, whatever M is. */
#define GP 32
#define GT 6
#define GEMM_RUN 256          /* values of a panel packed at a time where the tokens are few (blk_gemm_panel) */
#define GEMM_RUN_TOKENS 64    /* ... up to this many tokens */
#define GEMM_TOKENS 512       /* tokens a panel passes over at a time (ds_gemm_blocks): their activations in L2 */

/* 0: Q8_0, one scale per 32, z = 128; 1: Q6_K, a scale per 16, z = 32; 2: Q4_K/Q5_K, a scale and a min per 32.
 * The types whose rows expand (expand_row) to int8 values with one scale per 32 take mode 0 as v + 128 (Q4_0, Q5_0,
 * IQ4_NL, IQ4_XS, MXFP4, IQ3_S, IQ3_XXS, IQ2_XXS, IQ1_S, TQ1_0, TQ2_0: expand_row gives both halves of a 32 the same
 * scale), those with a min per 32 too mode 2 as v, -min (Q4_1, Q5_1), those with a scale per 16 and no min mode 3
 * (Q3_K, NVFP4, IQ2_XS, IQ2_S, IQ1_M), Q2_K (a scale and a min per 16) mode 4: mode 2's arithmetic per 16. */
static int gemm_mode(int type) {
    switch (type) {
    case T_Q8_0: case T_Q4_0: case T_Q5_0: case T_IQ4_NL: case T_IQ4_XS: case T_MXFP4:
    case T_IQ3_S: case T_IQ3_XXS: case T_IQ2_XXS: case T_IQ1_S: case T_TQ1_0: case T_TQ2_0:  /* one scale per 32 */
        return 0;
    case T_Q6_K:
        return 1;
    case T_Q4_K: case T_Q5_K: case T_Q4_1: case T_Q5_1:
        return 2;
    case T_Q3_K: case T_NVFP4: case T_IQ2_XS: case T_IQ2_S: case T_IQ1_M:
        return 3;  /* a scale per 16 and no min: Q6_K's tiles (mode 1) on v + 128, z = 128 */
    case T_Q2_K:
        return 4;  /* a scale and a min per 16: the K-quants' arithmetic (v, -min) on Q6_K's sub-blocks */
    default:
        return -1;
    }
}

/* modes whose scales come every 16 values (the tiles of mode 1) */
static inline int gemm_per16(int mode) { return mode == 1 || mode == 3 || mode == 4; }
/* modes with a min (w = s u - m, u unsigned, z = 0) */
static inline int gemm_mins(int mode) { return mode == 2 || mode == 4; }
/* z: the packed byte u = w' + z of a weight w' (a zero weight packs as z; the sums start at -z x the activations') */
static inline int gemm_z(int mode) { return mode == 0 || mode == 3 ? 128 : mode == 1 ? 32 : 0; }

/* the types whose activations are int8 per block of 256 with an f32 scale (llama.cpp's Q8_K: what it multiplies the
 * K-quants and the IQ and TQ types with, and what the decode tiles use for the K-quants); the others' per block of
 * 32 with an f16 scale (Q8_0's: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, NVFP4). Per 256, the tile scales a
 * sub-block's sum by the weights' scale alone and the activations' once per 256 (a multiply less per sub-block:
 * Q6_K's GEMM 20 % faster, Q4_K's 11 %, on the Xeon here). */
static int gemm_a256(int type) {
    switch (type) {
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: case T_IQ3_S: case T_IQ3_XXS:
    case T_IQ2_XXS: case T_IQ2_XS: case T_IQ2_S: case T_IQ1_S: case T_IQ1_M: case T_TQ1_0: case T_TQ2_0:
        return 1;
    default:
        return 0;
    }
}

/* the types packed from their own bytes (pack_panel_direct, row_scales, unpack_row); the others by expand_row */
static int gemm_direct(int type) {
    return type == T_Q8_0 || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

#ifdef BLK_VNNI
static inline __attribute__((always_inline)) void gemm_tile(const int mode, const int a256, const int GT_,
                                                            const uint8_t *pw, const float *ps, const float *po,
                                                            int nb, int nbs, const int8_t *xq, const float *xd, const int32_t *xi,
                                                            const float *xf, int K, float *out, long ldo, int nrows,
                                                            const uint8_t *pf, int pf_lines, int more) {
    /* nb blocks of the panel (pw, ps, po from the first of them; xq, xd, xi, xf likewise, a token's rows nbs blocks
       apart); `more`: out already holds the sums of the blocks before these (a panel packed in runs of blocks);
       a256: the activations' scale comes per 256 (xd[t * nbs + b / 8]): f holds a block of 256's sums scaled by the
       weights' scales only, added to out times the activations' scale at the block's end (no multiply per sub-block) */
    const int subs = mode == 1 || mode == 4 ? 2 : 1, groups = 8 / subs, ni = subs * nbs;  /* mode 3 runs as 1 */
    __mmask16 k0 = nrows >= 16 ? 0xFFFF : (__mmask16)((1u << nrows) - 1),
              k1 = nrows >= GP ? 0xFFFF : nrows <= 16 ? 0 : (__mmask16)((1u << (nrows - 16)) - 1);
    __m512 f[GT][2];  /* GT_ <= GT of them used */
    for (int t = 0; t < GT_; t++) {
        f[t][0] = more && !a256 ? _mm512_maskz_loadu_ps(k0, out + t * ldo) : _mm512_setzero_ps();
        f[t][1] = more && !a256 ? _mm512_maskz_loadu_ps(k1, out + t * ldo + 16) : _mm512_setzero_ps();
    }
    int first = !more;  /* a256: out holds nothing yet */
    for (int b = 0; b < nb; b++) {
        const uint8_t *w = pw + (size_t)b * 8 * 128;
        if (a256 && b % 8 == 0)
            for (int t = 0; t < GT_; t++) f[t][0] = f[t][1] = _mm512_setzero_ps();
        for (int i = 0; pf && i < pf_lines; i++)  /* the next panel's lines, spread over this tile's blocks */
            _mm_prefetch((const char *)pf + ((size_t)b * pf_lines + i) * 64, _MM_HINT_T1);
        for (int h = 0; h < subs; h++) {
            __m512i acc[GT][2];
            for (int t = 0; t < GT_; t++)
                acc[t][0] = acc[t][1] = gemm_mins(mode) ? _mm512_setzero_si512()
                                                        : _mm512_set1_epi32(xi[(size_t)t * ni + b * subs + h]);
#pragma GCC unroll 8
            for (int k = h * groups; k < (h + 1) * groups; k++) {
                __m512i w0 = _mm512_load_si512(w + k * 128), w1 = _mm512_load_si512(w + k * 128 + 64);
                for (int t = 0; t < GT_; t++) {
                    int32_t v;
                    memcpy(&v, xq + (size_t)t * K + 32 * b + 4 * k, 4);
                    __m512i xb = _mm512_set1_epi32(v);
                    acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], w0, xb);
                    acc[t][1] = _mm512_dpbusd_epi32(acc[t][1], w1, xb);
                }
            }
            const float *sv = ps + ((size_t)b * subs + h) * 32;
            __m512 s0 = _mm512_load_ps(sv), s1 = _mm512_load_ps(sv + 16);
            for (int t = 0; t < GT_; t++) {
                if (a256) {
                    f[t][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t][0]), s0, f[t][0]);
                    f[t][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t][1]), s1, f[t][1]);
                } else {
                    __m512 d = _mm512_set1_ps(xd[(size_t)t * nbs + b]);
                    f[t][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t][0]), _mm512_mul_ps(s0, d), f[t][0]);
                    f[t][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[t][1]), _mm512_mul_ps(s1, d), f[t][1]);
                }
            }
            if (mode == 4) {  /* - m (d_a times the sum of the sub-block's int8 activations), per 16 */
                const float *mv = po + ((size_t)b * 2 + h) * 32;
                __m512 m0 = _mm512_load_ps(mv), m1 = _mm512_load_ps(mv + 16);
                for (int t = 0; t < GT_; t++) {
                    __m512 a = _mm512_set1_ps(xf[(size_t)t * ni + b * 2 + h]);
                    f[t][0] = _mm512_fnmadd_ps(m0, a, f[t][0]);
                    f[t][1] = _mm512_fnmadd_ps(m1, a, f[t][1]);
                }
            }
        }
        if (mode == 2) {  /* - m (d_a times the sum of the block's int8 activations) */
            __m512 m0 = _mm512_load_ps(po + (size_t)b * 32), m1 = _mm512_load_ps(po + (size_t)b * 32 + 16);
            for (int t = 0; t < GT_; t++) {
                __m512 a = _mm512_set1_ps(xf[(size_t)t * nbs + b]);
                f[t][0] = _mm512_fnmadd_ps(m0, a, f[t][0]);
                f[t][1] = _mm512_fnmadd_ps(m1, a, f[t][1]);
            }
        }
        if (a256 && b % 8 == 7) {  /* the end of a block of 256: its sums times the activations' scale into out */
            for (int t = 0; t < GT_; t++) {
                __m512 d = _mm512_set1_ps(xd[(size_t)t * nbs + b / 8]);
                float *o = out + t * ldo;
                _mm512_mask_storeu_ps(o, k0, first ? _mm512_mul_ps(f[t][0], d)
                                                   : _mm512_fmadd_ps(f[t][0], d, _mm512_maskz_loadu_ps(k0, o)));
                _mm512_mask_storeu_ps(o + 16, k1, first ? _mm512_mul_ps(f[t][1], d)
                                                        : _mm512_fmadd_ps(f[t][1], d, _mm512_maskz_loadu_ps(k1, o + 16)));
            }
            first = 0;
        }
    }
    if (!a256)
        for (int t = 0; t < GT_; t++) {
            _mm512_mask_storeu_ps(out + t * ldo, k0, f[t][0]);
            _mm512_mask_storeu_ps(out + t * ldo + 16, k1, f[t][1]);
        }
}

#else
/* The AVX2 tile (a Zen 3's, no VNNI): the same panels and sums with vpmaddubsw (u8 x s8 pairs into int16, saturating)
 * and vpmaddwd (int16 pairs into int32). A pair's sum stays exact where the weights' u is small: gemm_umax(type) 2 x
 * umax x 128 <= 32767 (Q4_K, Q4_1: 15; Q5_K, Q5_1: 31; Q6_K: 63, z = 32; Q2_K: 3), and `run` groups of 4 values
 * are summed in int16 before one vpmaddwd widens them (run x 2 x umax x 128 <= 32767: Q4_K a whole sub-block of 32,
 * Q5_K half of one, Q6_K 8 values), so most groups cost a vpmaddubsw and an add per 8 rows and token where vpdpbusd
 * would cost one. Q8_0 and the types packed as v + 128 (u up to 255) would saturate: `split` multiplies the low and
 * the high nibbles of u apart (twice the work: ds_gemm_type says so) and adds 16 x the high ones' sums. A pass takes
 * 16 of the panel's rows and TT2 tokens (2 when split); the sums are the VNNI tile's exactly (the same integers, the
 * same f32 operations in the same order). */
#define TT2 4
static inline __attribute__((always_inline)) void gemm_pass2(const int mode, const int a256, const int TT, const int run,
                                                             const int split, const int hr, const uint8_t *pw, const float *ps,
                                                             const float *po, int nb, int nbs, const int8_t *xq,
                                                             const float *xd, const int32_t *xi, const float *xf, int K,
                                                             float *out, long ldo, int nrows, const uint8_t *pf,
                                                             int pf_lines, int more) {
    const int subs = mode == 1 || mode == 4 ? 2 : 1, groups = 8 / subs, ni = subs * nbs;
    const int full = nrows >= 16 * hr + 16;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), ones = _mm256_set1_epi16(1);
    const __m256i k0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nrows - 16 * hr), lane),
                  k1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nrows - 16 * hr - 8), lane);
    out += 16 * hr, ps += 16 * hr, po += 16 * hr;
#define LOAD2(p, k) (full ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, k))
#define STORE2(p, k, v) (full ? _mm256_storeu_ps(p, v) : _mm256_maskstore_ps(p, k, v))
    __m256 f[TT2][2];
    for (int t = 0; t < TT; t++) {
        f[t][0] = more && !a256 ? LOAD2(out + t * ldo, k0) : _mm256_setzero_ps();
        f[t][1] = more && !a256 ? LOAD2(out + t * ldo + 8, k1) : _mm256_setzero_ps();
    }
    int first = !more;
    for (int b = 0; b < nb; b++) {
        const uint8_t *w = pw + (size_t)b * 8 * 128 + 64 * hr;
        if (a256 && b % 8 == 0)
            for (int t = 0; t < TT; t++) f[t][0] = f[t][1] = _mm256_setzero_ps();
        for (int i = 0; pf && i < pf_lines; i++)
            _mm_prefetch((const char *)pf + ((size_t)b * pf_lines + i) * 64, _MM_HINT_T1);
        for (int h = 0; h < subs; h++) {
            __m256i acc[TT2][2];
            for (int t = 0; t < TT; t++)
                acc[t][0] = acc[t][1] = gemm_mins(mode) ? _mm256_setzero_si256()
                                                        : _mm256_set1_epi32(xi[(size_t)t * ni + b * subs + h]);
            if (split) for (int k0_ = h * groups; k0_ < (h + 1) * groups; k0_ += run) {
                /* u up to 255 (Q8_0's w + 128, the types expanded as v + 128): its low and high nibbles multiplied
                   apart (each pair sum at most 2 x 15 x 128), the high ones' sums then times 16 by vpmaddwd */
                __m256i sl[TT2][2], sh[TT2][2];
                const __m256i lo4 = _mm256_set1_epi8(0x0F);
                for (int t = 0; t < TT; t++) sl[t][0] = sl[t][1] = sh[t][0] = sh[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 2
                for (int k = k0_; k < k0_ + run; k++) {
                    const __m256i w0 = _mm256_load_si256((const __m256i *)(w + k * 128)),
                                  w1 = _mm256_load_si256((const __m256i *)(w + k * 128 + 32));
                    const __m256i l0 = _mm256_and_si256(w0, lo4), h0 = _mm256_and_si256(_mm256_srli_epi16(w0, 4), lo4),
                                  l1 = _mm256_and_si256(w1, lo4), h1 = _mm256_and_si256(_mm256_srli_epi16(w1, 4), lo4);
                    for (int t = 0; t < TT; t++) {
                        int32_t v;
                        memcpy(&v, xq + (size_t)t * K + 32 * b + 4 * k, 4);
                        const __m256i xb = _mm256_set1_epi32(v);
                        sl[t][0] = _mm256_add_epi16(sl[t][0], _mm256_maddubs_epi16(l0, xb));
                        sh[t][0] = _mm256_add_epi16(sh[t][0], _mm256_maddubs_epi16(h0, xb));
                        sl[t][1] = _mm256_add_epi16(sl[t][1], _mm256_maddubs_epi16(l1, xb));
                        sh[t][1] = _mm256_add_epi16(sh[t][1], _mm256_maddubs_epi16(h1, xb));
                    }
                }
                const __m256i sixteen = _mm256_set1_epi16(16);
                for (int t = 0; t < TT; t++)
                    for (int i = 0; i < 2; i++)
                        acc[t][i] = _mm256_add_epi32(acc[t][i], _mm256_add_epi32(_mm256_madd_epi16(sl[t][i], ones),
                                                                                 _mm256_madd_epi16(sh[t][i], sixteen)));
            }
            else for (int k0_ = h * groups; k0_ < (h + 1) * groups; k0_ += run) {
                __m256i s16[TT2][2];
                for (int t = 0; t < TT; t++) s16[t][0] = s16[t][1] = _mm256_setzero_si256();
#pragma GCC unroll 2
                for (int k = k0_; k < k0_ + run; k++) {
                    const __m256i w0 = _mm256_load_si256((const __m256i *)(w + k * 128)),
                                  w1 = _mm256_load_si256((const __m256i *)(w + k * 128 + 32));
                    for (int t = 0; t < TT; t++) {
                        int32_t v;
                        memcpy(&v, xq + (size_t)t * K + 32 * b + 4 * k, 4);
                        const __m256i xb = _mm256_set1_epi32(v);
                        s16[t][0] = _mm256_add_epi16(s16[t][0], _mm256_maddubs_epi16(w0, xb));
                        s16[t][1] = _mm256_add_epi16(s16[t][1], _mm256_maddubs_epi16(w1, xb));
                    }
                }
                for (int t = 0; t < TT; t++) {
                    acc[t][0] = _mm256_add_epi32(acc[t][0], _mm256_madd_epi16(s16[t][0], ones));
                    acc[t][1] = _mm256_add_epi32(acc[t][1], _mm256_madd_epi16(s16[t][1], ones));
                }
            }
            const float *sv = ps + ((size_t)b * subs + h) * 32;
            const __m256 s0 = _mm256_loadu_ps(sv), s1 = _mm256_loadu_ps(sv + 8);
            for (int t = 0; t < TT; t++) {
                if (a256) {
                    f[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t][0]), s0, f[t][0]);
                    f[t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t][1]), s1, f[t][1]);
                } else {
                    const __m256 d = _mm256_set1_ps(xd[(size_t)t * nbs + b]);
                    f[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t][0]), _mm256_mul_ps(s0, d), f[t][0]);
                    f[t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t][1]), _mm256_mul_ps(s1, d), f[t][1]);
                }
            }
            if (mode == 4) {
                const float *mv = po + ((size_t)b * 2 + h) * 32;
                const __m256 m0 = _mm256_loadu_ps(mv), m1 = _mm256_loadu_ps(mv + 8);
                for (int t = 0; t < TT; t++) {
                    const __m256 a = _mm256_set1_ps(xf[(size_t)t * ni + b * 2 + h]);
                    f[t][0] = _mm256_fnmadd_ps(m0, a, f[t][0]);
                    f[t][1] = _mm256_fnmadd_ps(m1, a, f[t][1]);
                }
            }
        }
        if (mode == 2) {
            const __m256 m0 = _mm256_loadu_ps(po + (size_t)b * 32), m1 = _mm256_loadu_ps(po + (size_t)b * 32 + 8);
            for (int t = 0; t < TT; t++) {
                const __m256 a = _mm256_set1_ps(xf[(size_t)t * nbs + b]);
                f[t][0] = _mm256_fnmadd_ps(m0, a, f[t][0]);
                f[t][1] = _mm256_fnmadd_ps(m1, a, f[t][1]);
            }
        }
        if (a256 && b % 8 == 7) {
            for (int t = 0; t < TT; t++) {
                const __m256 d = _mm256_set1_ps(xd[(size_t)t * nbs + b / 8]);
                float *o = out + t * ldo;
                STORE2(o, k0, first ? _mm256_mul_ps(f[t][0], d) : _mm256_fmadd_ps(f[t][0], d, LOAD2(o, k0)));
                STORE2(o + 8, k1, first ? _mm256_mul_ps(f[t][1], d) : _mm256_fmadd_ps(f[t][1], d, LOAD2(o + 8, k1)));
            }
            first = 0;
        }
    }
    if (!a256)
        for (int t = 0; t < TT; t++) {
            STORE2(out + t * ldo, k0, f[t][0]);
            STORE2(out + t * ldo + 8, k1, f[t][1]);
        }
#undef LOAD2
#undef STORE2
}

/* u's largest value in a panel of `type` (2 x umax x 128 must fit int16: see gemm_pass2) */
static int gemm_umax(int type) {
    switch (type) {
    case T_Q4_K: case T_Q4_1: return 15;
    case T_Q5_K: case T_Q5_1: return 31;
    case T_Q6_K: return 63;
    case T_Q2_K: return 3;
    default: return 255;
    }
}

/* groups of 4 values a tile sums in int16 before widening them (a power of two dividing a sub-block's groups); 0: u
 * goes past 63 (Q8_0, the types packed as v + 128), its nibbles multiplied apart (gemm_pass2's split) */
static int gemm_run16(int type, int mode) {
    if (gemm_umax(type) > 63) return 0;
    int run = gemm_per16(mode) ? 4 : 8;
    while (run > 1 && run * 2 * gemm_umax(type) * 128 > 32767) run /= 2;
    return run;
}

/* gemm_pass2 over the tile: both halves of the panel's rows, the tokens TT2 at a time */
#define PASS2(MODE, A, TT, RUN) gemm_pass2(MODE, A, TT, RUN ? RUN : MODE == 0 ? 8 : 4, RUN == 0, hr, pw, ps, po, nb, nbs, xq + (size_t)t0 * K, \
        xd + (size_t)t0 * nbs, xi + (size_t)t0 * ni, xf + (size_t)t0 * ni, K, out + t0 * ldo, ldo, nrows, \
        hr == 0 && t0 == 0 ? pf : NULL, pf_lines, more)
#define PASS2_TT(MODE, A, RUN) { if (tt == TT2) PASS2(MODE, A, TT2, RUN); else if (tt == 2) PASS2(MODE, A, 2, RUN); \
                                 else PASS2(MODE, A, 1, RUN); }
#define PASS2_SPLIT(MODE, A) { if (tt == 2) PASS2(MODE, A, 2, 0); else PASS2(MODE, A, 1, 0); }
static void gemm_tile_avx2(const int mode, const int a256, const int run, const int GT_, const uint8_t *pw,
                           const float *ps, const float *po, int nb, int nbs, const int8_t *xq, const float *xd,
                           const int32_t *xi, const float *xf, int K, float *out, long ldo, int nrows,
                           const uint8_t *pf, int pf_lines, int more) {
    const int ni = (gemm_per16(mode) ? 2 : 1) * nbs;
    for (int hr = 0; hr < 2 && 16 * hr < nrows; hr++)
        for (int t0 = 0, tt; t0 < GT_; t0 += tt) {
            tt = GT_ - t0 >= TT2 && run ? TT2 : GT_ - t0 >= 2 ? 2 : 1;  /* the last few tokens two or one at a time
                                                                          (the split ones always: twice the sums) */
            if (!run) {  /* u past 63 */
                if (mode == 0 && a256) PASS2_SPLIT(0, 1)
                else if (mode == 0) PASS2_SPLIT(0, 0)
                else if (a256) PASS2_SPLIT(1, 1)
                else PASS2_SPLIT(1, 0)
            } else if (mode == 1) PASS2_TT(1, 1, 2)
            else if (mode == 4) PASS2_TT(4, 1, 4)
            else if (a256 && run == 8) PASS2_TT(2, 1, 8)
            else if (a256) PASS2_TT(2, 1, 4)
            else if (run == 8) PASS2_TT(2, 0, 8)
            else PASS2_TT(2, 0, 4)
        }
}
#undef PASS2_SPLIT
#undef PASS2_TT
#undef PASS2

/* blk_gemm_panel calls it as the VNNI tile (the mode, a256 and the token count as constants) */
static inline __attribute__((always_inline)) void gemm_tile(const int mode, const int a256, const int GT_,
                                                            const uint8_t *pw, const float *ps, const float *po,
                                                            int nb, int nbs, const int8_t *xq, const float *xd, const int32_t *xi,
                                                            const float *xf, int K, float *out, long ldo, int nrows,
                                                            const uint8_t *pf, int pf_lines, int more, int run) {
    gemm_tile_avx2(mode, a256, run, GT_, pw, ps, po, nb, nbs, xq, xd, xi, xf, K, out, ldo, nrows, pf, pf_lines, more);
}
#endif  /* BLK_VNNI */

/* Row `row`'s values as unsigned bytes u [K] into `u` (see the section's comment: Q8_0's w + 128, Q4_K/Q5_K's q, Q6_K's
 * q with its two high bits); its scales are row_scales'. */
static void unpack_row(int type, const uint8_t *row, int K, uint8_t *u) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    switch (type) {
    case T_Q8_0:
        for (int b = 0; b < K / 32; b++) {
            const uint8_t *blk = row + (size_t)b * 34;
            _mm256_storeu_si256((__m256i *)(u + 32 * b),
                                _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)), _mm256_set1_epi8((char)0x80)));
        }
        return;
    case T_Q4_K:
    case T_Q5_K: {
        const int q5 = type == T_Q5_K, bytes = q5 ? 176 : 144;
        for (int jb = 0; jb < K / 256; jb++) {
            const uint8_t *blk = row + (size_t)jb * bytes, *qs = blk + (q5 ? 48 : 16);
            __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                const int b = jb * 8 + j;
                __m256i g = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
                __m256i q = (j & 1) ? _mm256_and_si256(_mm256_srli_epi16(g, 4), lo4) : _mm256_and_si256(g, lo4);
                if (q5) {  /* bit j of qh[l] -> bit 4 */
                    __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1));
                    q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
                }
                _mm256_storeu_si256((__m256i *)(u + 32 * b), q);
            }
        }
        return;
    }
    case T_Q6_K:
        for (int jb = 0; jb < K / 256; jb++) {
            const uint8_t *blk = row + (size_t)jb * 210;
            for (int h = 0; h < 2; h++) {
                __m256i hi = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                for (int g = 0; g < 4; g++) {
                    __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (g & 1)));
                    if (g >= 2) lo = _mm256_srli_epi16(lo, 4);
                    __m256i top = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * g), _mm256_set1_epi8(3));
                    __m256i q = _mm256_or_si256(_mm256_and_si256(lo, lo4), _mm256_slli_epi16(top, 4));
                    _mm256_storeu_si256((__m256i *)(u + (size_t)jb * 256 + 128 * h + 32 * g), q);
                }
            }
        }
        return;
    }
}

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

#endif

/* Row r's scales (and mins) per sub-block into ps[i * 32 + r] (po[b * 32 + r]); its values are unpack_row's. */
static void row_scales(int type, const uint8_t *row, int K, float *ps, float *po, int r) {
    switch (type) {
    case T_Q8_0:
        for (int b = 0; b < K / 32; b++) ps[(size_t)b * 32 + r] = h2f(row + (size_t)b * 34);
        return;
    case T_Q4_K:
    case T_Q5_K: {
        const int bytes = type == T_Q5_K ? 176 : 144;
        for (int jb = 0; jb < K / 256; jb++) {
            const uint8_t *blk = row + (size_t)jb * bytes;
            const float d = h2f(blk), dmin = h2f(blk + 2);
            uint8_t sc[8], mn[8];
            k_scales(blk + 4, sc, mn);
            for (int j = 0; j < 8; j++) {
                ps[(size_t)(jb * 8 + j) * 32 + r] = d * (float)sc[j];
                po[(size_t)(jb * 8 + j) * 32 + r] = dmin * (float)mn[j];
            }
        }
        return;
    }
    case T_Q6_K:
        for (int jb = 0; jb < K / 256; jb++) {
            const uint8_t *blk = row + (size_t)jb * 210;
            const float d = h2f(blk + 208);
            const int8_t *sc = (const int8_t *)(blk + 192);
            for (int j = 0; j < 16; j++) ps[(size_t)(jb * 16 + j) * 32 + r] = d * (float)sc[j];
        }
        return;
    }
}

#ifdef BLK_VNNI
/* row_scales of 16 rows at once (rows r0 .. r0 + 15 of ps/po, the first at `rows`, row_bytes apart): each block's
 * scale words of the 16 rows by one gather apiece, the scales and mins taken apart in the vector, and each
 * sub-block's 16 values stored as one run (the rows' scalar unpacking was a third of a 16-token expert's product). The
 * same values as row_scales, bit for bit (the same f16 conversions and products). */
static void row_scales16(int type, const uint8_t *rows, size_t row_bytes, int K, float *ps, float *po, int r0) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32((int)row_bytes));
    const __m512i b6 = _mm512_set1_epi32(63), b4 = _mm512_set1_epi32(15), bf = _mm512_set1_epi32(0xFF);
#define GATHER(off) _mm512_i32gather_epi32(idx, (const void *)(rows + (off)), 1)
#define HALF(v) _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v))  /* the low 16 bits of each lane, an f16, as f32 */
#define BYTE(v, i) _mm512_and_si512(_mm512_srli_epi32(v, 8 * (i)), bf)
    switch (type) {
    case T_Q8_0:
        for (int b = 0; b < K / 32; b++) _mm512_storeu_ps(ps + (size_t)b * 32 + r0, HALF(GATHER((size_t)b * 34)));
        break;
    case T_Q4_K:
    case T_Q5_K: {
        const int bytes = type == T_Q5_K ? 176 : 144;
        for (int jb = 0; jb < K / 256; jb++) {
            const size_t o = (size_t)jb * bytes;
            const __m512i dd = GATHER(o), q0 = GATHER(o + 4), q1 = GATHER(o + 8), q2 = GATHER(o + 12);
            const __m512 d = HALF(dd), dmin = HALF(_mm512_srli_epi32(dd, 16));
            for (int j = 0; j < 4; j++) {
                const __m512i a = BYTE(q0, j), m = BYTE(q1, j), c = BYTE(q2, j);
                const __m512i sc = _mm512_and_si512(a, b6), mn = _mm512_and_si512(m, b6);
                const __m512i sc4 = _mm512_or_si512(_mm512_and_si512(c, b4), _mm512_slli_epi32(_mm512_srli_epi32(a, 6), 4));
                const __m512i mn4 = _mm512_or_si512(_mm512_srli_epi32(c, 4), _mm512_slli_epi32(_mm512_srli_epi32(m, 6), 4));
                float *s0 = ps + (size_t)(jb * 8 + j) * 32 + r0, *m0 = po + (size_t)(jb * 8 + j) * 32 + r0;
                _mm512_storeu_ps(s0, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
                _mm512_storeu_ps(m0, _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn)));
                _mm512_storeu_ps(s0 + 4 * 32, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc4)));
                _mm512_storeu_ps(m0 + 4 * 32, _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn4)));
            }
        }
        break;
    }
    case T_Q6_K:
        for (int jb = 0; jb < K / 256; jb++) {
            const size_t o = (size_t)jb * 210;
            const __m512 d = HALF(_mm512_srli_epi32(GATHER(o + 206), 16));  /* bytes 208, 209: the block's last */
            for (int w = 0; w < 4; w++) {
                const __m512i q = GATHER(o + 192 + 4 * w);
                for (int i = 0; i < 4; i++) {
                    const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(q, 24 - 8 * i), 24);  /* int8 */
                    _mm512_storeu_ps(ps + (size_t)(jb * 16 + 4 * w + i) * 32 + r0, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
                }
            }
        }
        break;
    default:
        for (int r = 0; r < 16; r++) row_scales(type, rows + (size_t)r * row_bytes, K, ps, po, r0 + r);
    }
#undef GATHER
#undef HALF
#undef BYTE
}

#else
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

/* row_scales of 8 rows (r0 .. r0 + 7) at once for the K-quants: each row's scales of a block as f32 vectors into a
 * small table, transposed (transpose8x8_v: they are words) into runs of 8 rows per sub-block. The same values as
 * row_scales, bit for bit (the same f16 conversions and products). */
static void row_scales8(int type, const uint8_t *rows, size_t row_bytes, int K, float *ps, float *po, int r0) {
    float sc[8][16] __attribute__((aligned(32))), mn[8][8] __attribute__((aligned(32)));
    __m256i v[8];
    switch (type) {
    case T_Q4_K:
    case T_Q5_K: {
        const int bytes = type == T_Q5_K ? 176 : 144;
        for (int jb = 0; jb < K / 256; jb++) {
            for (int r = 0; r < 8; r++) {
                const uint8_t *blk = rows + (size_t)r * row_bytes + (size_t)jb * bytes;
                const __m128i smv = k_scales_vec(blk + 4);
                const __m256 d = _mm256_set1_ps(h2f(blk)), dmin = _mm256_set1_ps(h2f(blk + 2));
                _mm256_store_ps(sc[r], _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(smv))));
                _mm256_store_ps(mn[r], _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(smv, 8)))));
            }
            transpose8x8_v((const uint8_t *)sc, sizeof sc[0], v);
            for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)(ps + (size_t)(jb * 8 + j) * 32 + r0), v[j]);
            transpose8x8_v((const uint8_t *)mn, sizeof mn[0], v);
            for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)(po + (size_t)(jb * 8 + j) * 32 + r0), v[j]);
        }
        return;
    }
    case T_Q6_K:
        for (int jb = 0; jb < K / 256; jb++) {
            for (int r = 0; r < 8; r++) {
                const uint8_t *blk = rows + (size_t)r * row_bytes + (size_t)jb * 210;
                const __m256 d = _mm256_set1_ps(h2f(blk + 208));
                const __m128i s8 = _mm_loadu_si128((const __m128i *)(blk + 192));
                _mm256_store_ps(sc[r], _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8))));
                _mm256_store_ps(sc[r] + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8)))));
            }
            for (int hh = 0; hh < 2; hh++) {
                transpose8x8_v((const uint8_t *)sc + 32 * hh, sizeof sc[0], v);
                for (int j = 0; j < 8; j++)
                    _mm256_storeu_si256((__m256i *)(ps + (size_t)(jb * 16 + 8 * hh + j) * 32 + r0), v[j]);
            }
        }
        return;
    default:
        for (int r = 0; r < 8; r++) row_scales(type, rows + (size_t)r * row_bytes, K, ps, po, r0 + r);
    }
}

#endif  /* BLK_VNNI */

/* A full panel (GP rows) packed straight from the file's blocks: each group of PV_ROWS rows' 32-byte runs of quants
 * transposed once (transpose16x8_v, or transpose8x8_v on AVX2) and the values taken out of the transposed words, with
 * no unpacked copy of the rows in between (the copy and its second pass were a third of a 16-token expert's product).
 * The same layout as pack_panel's, on either build. */
#ifdef BLK_VNNI
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
#define PV_SCALES row_scales16
#else
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
#define PV_SCALES row_scales8
#endif
static void pack_panel_direct(int type, const uint8_t *blocks, size_t row_bytes, int n0, int K, uint8_t *pw,
                              float *ps, float *po) {
    const pvec_t lo4 = PV_SET1_8(0x0F), one = PV_SET1_8(1), three = PV_SET1_8(3);
    pvec_t v[8], w[8];
    for (int g = 0; g < GP / PV_ROWS; g++) {
        const uint8_t *rows = blocks + (size_t)(n0 + PV_ROWS * g) * row_bytes;
        uint8_t *dst = pw + g * PV_ROWS * 4;
        PV_SCALES(type, rows, row_bytes, K, ps, po, PV_ROWS * g);
        switch (type) {
        case T_Q8_0:
            for (int b = 0; b < K / 32; b++) {
                PV_TRANSPOSE(rows + (size_t)b * 34 + 2, row_bytes, v);
                for (int k = 0; k < 8; k++)
                    PV_STORE(dst + (size_t)b * 1024 + k * 128, PV_XOR(v[k], PV_SET1_8((char)0x80)));
            }
            break;
        case T_Q4_K:
        case T_Q5_K: {
            const int q5 = type == T_Q5_K, bytes = q5 ? 176 : 144;
            for (int jb = 0; jb < K / 256; jb++) {
                const uint8_t *blk = rows + (size_t)jb * bytes, *qs = blk + (q5 ? 48 : 16);
                if (q5) PV_TRANSPOSE(blk + 16, row_bytes, w);  /* qh: bit j of byte l is value l of sub-block j */
                for (int p = 0; p < 4; p++) {  /* sub-blocks 2p (low nibbles) and 2p + 1 (high) */
                    PV_TRANSPOSE(qs + 32 * p, row_bytes, v);
                    for (int h = 0; h < 2; h++) {
                        const int j = 2 * p + h;
                        uint8_t *o = dst + (size_t)(jb * 8 + j) * 1024;
                        for (int k = 0; k < 8; k++) {
                            pvec_t q = PV_AND(h ? PV_SRLI16(v[k], 4) : v[k], lo4);
                            if (q5) q = PV_OR(q, PV_SLLI16(PV_AND(PV_SRLI16(w[k], j), one), 4));
                            PV_STORE(o + k * 128, q);
                        }
                    }
                }
            }
            break;
        }
        case T_Q6_K:
            for (int jb = 0; jb < K / 256; jb++) {
                const uint8_t *blk = rows + (size_t)jb * 210;
                for (int h = 0; h < 2; h++) {
                    PV_TRANSPOSE(blk + 128 + 32 * h, row_bytes, w);  /* the two high bits of 4 groups */
                    for (int c = 0; c < 2; c++) {
                        PV_TRANSPOSE(blk + 64 * h + 32 * c, row_bytes, v);  /* groups c (low) and c + 2 (high) */
                        for (int s = 0; s < 2; s++) {
                            const int gq = c + 2 * s;
                            uint8_t *o = dst + (size_t)(jb * 8 + 4 * h + gq) * 1024;
                            for (int k = 0; k < 8; k++) {
                                pvec_t low = PV_AND(s ? PV_SRLI16(v[k], 4) : v[k], lo4);
                                pvec_t top = PV_AND(PV_SRLI16(w[k], 2 * gq), three);
                                PV_STORE(o + k * 128, PV_OR(low, PV_SLLI16(top, 4)));
                            }
                        }
                    }
                }
            }
            break;
        }
    }
}

/* rows n0 .. n0 + nrows - 1 (nrows <= GP) of a tensor laid out for gemm_tile: pw [nb][8][2][16 rows x 4 bytes],
 * ps [subs][32], po [nb or 2 nb][32] (the modes with a min); rows past the tensor: u = z (a zero weight), s = m = 0. Each row unpacked to
 * bytes (unpack_row) into `ubuf` [GP][K], then each sub-block's 16 rows x 8 words transposed into the 8 vectors of
 * 16 rows' 4 bytes each (transpose16x8). */
static void pack_panel(int type, int mode, const uint8_t *blocks, size_t row_bytes, int n0, int nrows, int K,
                       uint8_t *pw, float *ps, float *po, uint8_t *ubuf) {
    const int nb = K / 32, per32 = gemm_per16(mode) ? 2 : 1;
    const uint8_t zero = (uint8_t)gemm_z(mode);
    if (nrows == GP && gemm_direct(type)) {
        pack_panel_direct(type, blocks, row_bytes, n0, K, pw, ps, po);
        return;
    }
    for (int r = 0; r < GP; r++) {
        if (r < nrows && !gemm_direct(type)) {  /* u = v + z, s = sc, m = -mn (per 32 or per 16: sc[i] per 16) */
            int8_t v[K];
            float sc[K / 16], mn[K / 16];
            const int mins = expand_row(type, blocks + (size_t)(n0 + r) * row_bytes, K, v, sc, mn);
            uint8_t *u = ubuf + (size_t)r * K;
            for (int i = 0; i < K; i++) u[i] = (uint8_t)(v[i] + zero);
            for (int i = 0; i < nb * per32; i++) {
                ps[(size_t)i * 32 + r] = sc[i * 2 / per32];
                if (gemm_mins(mode)) po[(size_t)i * 32 + r] = mins ? -mn[i * 2 / per32] : 0.0f;
            }
            continue;
        }
        if (r < nrows) {
            row_scales(type, blocks + (size_t)(n0 + r) * row_bytes, K, ps, po, r);
            unpack_row(type, blocks + (size_t)(n0 + r) * row_bytes, K, ubuf + (size_t)r * K);
            continue;
        }
        memset(ubuf + (size_t)r * K, zero, K);
        for (int i = 0; i < nb * per32; i++) {
            ps[(size_t)i * 32 + r] = 0.0f;
            if (gemm_mins(mode)) po[(size_t)i * 32 + r] = 0.0f;
        }
    }
    for (int b = 0; b < nb; b++)
#ifdef BLK_VNNI
        for (int g = 0; g < 2; g++) transpose16x8(ubuf + (size_t)(16 * g) * K + 32 * b, K, pw + (size_t)b * 1024 + g * 64);
#else
        for (int g = 0; g < 4; g++) transpose8x8(ubuf + (size_t)(8 * g) * K + 32 * b, K, pw + (size_t)b * 1024 + g * 32);
#endif
}

/* ---- the GEMM's pieces, for a caller's team (blocks.h): activations prepared once, panels as work items ----
 * blk_gemm_prepare: the rows of x (rows[m] where given) quantized as gemm_tile reads them, into `act`
 * (blk_gemm_act_bytes(M, K)): int8 values [Mp][K], scales [Mp][nb], the sums' terms [Mp][ni] and [Mp][nb], Mp = M
 * rounded up to GT plus GT rows of zeros (a tile may read past its last row; what it computes there is dropped).
 * blk_gemm_panel: panel p (rows 32p ..) of a tensor packed, then times rows m_first .. m_first + M of the prepared
 * activations; `work` of blk_gemm_work_bytes(K), one per thread. */
typedef struct {
    int8_t *q;
    float *d, *f;
    int32_t *i;
    int nb, ni;
} gemm_act_t;

static gemm_act_t gemm_act(int mode, void *act, int M, int K) {
    const int nb = K / 32, ni = gemm_per16(mode) ? 2 * nb : nb, Mp = (M + GT - 1) / GT * GT + GT;
    uint8_t *at = act;
    gemm_act_t g = {(int8_t *)at, NULL, NULL, NULL, nb, ni};
    at += ALIGN64((size_t)Mp * K);
    g.d = (float *)at;
    at += ALIGN64((size_t)Mp * nb * sizeof(float));
    g.f = (float *)at;  /* [Mp][ni]: per 16 in mode 4 */
    at += ALIGN64((size_t)Mp * 2 * nb * sizeof(float));
    g.i = (int32_t *)at;
    return g;
}

size_t blk_gemm_act_bytes(int M, int K) {
    const int nb = K / 32, Mp = (M + GT - 1) / GT * GT + GT;
    return ALIGN64((size_t)Mp * K) + ALIGN64((size_t)Mp * nb * sizeof(float)) + ALIGN64((size_t)Mp * 2 * nb * sizeof(float))
         + ALIGN64((size_t)Mp * 2 * nb * sizeof(int32_t));
}

int blk_gemm_type(int type) {
    int vals, bytes;
    /* the expanded types once the IQ grids' tables are set (ds_set_tables, at the library's load) */
    return gemm_mode(type) >= 0 && !block_info(type, &vals, &bytes) && (gemm_direct(type) || g_ksigns);
}

/* whether ds_gemm_blocks takes `type` in this build: 0 no (it returns -1), 1 yes, 2 yes at about the speed of
 * torch's f32 GEMM on exact chunks (AVX2's split tiles: Q8_0 [8192, 2048] x 512 rows 91 GMAC/s against 105 for
 * the chunks, dequantization included; 74-82 against 63-70 for the row products at an expert's 16 rows) */
int ds_gemm_type(int type) {
    if (!blk_gemm_type(type)) return 0;
#ifndef BLK_VNNI
    if (!gemm_run16(type, gemm_mode(type))) return 2;
#endif
    return 1;
}

void blk_gemm_prepare(int type, const float *x, int M, int K, long ldx, const int *rows, void *act) {
    const int mode = gemm_mode(type), a256 = gemm_a256(type), Mp = (M + GT - 1) / GT * GT + GT;
    gemm_act_t g = gemm_act(mode, act, M, K);
    const int nb = g.nb, ni = g.ni;
    int32_t c[K / 4];
    #pragma omp for schedule(static)
    for (int t = 0; t < Mp; t++) {
        int8_t *q = g.q + (size_t)t * K;
        float *d = g.d + (size_t)t * nb, *fs = g.f + (size_t)t * ni;
        int32_t *is = g.i + (size_t)t * ni;
        if (t >= M) {
            memset(q, 0, K), memset(d, 0, nb * sizeof(float)), memset(fs, 0, ni * sizeof(float));
            memset(is, 0, ni * sizeof(int32_t));
            continue;
        }
        const float *xr = x + (size_t)(rows ? rows[t] : t) * ldx;
        if (a256)
            quant_q8_256(xr, K, q, d, c);
        else
            quant_q8_0(xr, K, q, d, c, NULL);
        const int fours = K / ni / 4, z = gemm_z(mode);
        for (int i = 0; i < ni; i++) {  /* each sub-block's sum, from the quantizer's -128 x (sums of 4) */
            int32_t sum = 0;
            for (int l = 0; l < fours; l++) sum += c[i * fours + l];
            sum /= -128;
            is[i] = -z * sum;
            if (gemm_mins(mode)) fs[i] = a256 ? (float)sum : d[i * nb / ni] * (float)sum;
        }
    }
}

size_t blk_gemm_work_bytes(int K) {  /* the panel [nb][1024], ps and po (2 nb x GP each at most), ubuf [GP][K] */
    const int nb = K / 32;
    return ALIGN64((size_t)nb * 1024 + (size_t)4 * nb * GP * sizeof(float))
         + ALIGN64((size_t)GP * K);
}

int blk_gemm_panels(int N) { return (N + GP - 1) / GP; }

size_t blk_gemm_panel_bytes(int type, int N, int K, int p) {
    int vals = 1, bytes = 0;
    block_info(type, &vals, &bytes);
    const int n0 = p * GP, nrows = N - n0 < GP ? N - n0 : GP;
    return nrows > 0 ? (size_t)nrows * (K / vals) * bytes : 0;
}

const uint8_t *blk_gemm_panel_at(int type, const uint8_t *blocks, int K, int p) {
    int vals = 1, bytes = 0;
    block_info(type, &vals, &bytes);
    return blocks + (size_t)p * GP * (K / vals) * bytes;
}

void blk_gemm_panel(int type, const uint8_t *blocks, int N, int K, int p, const void *act, int Mall, int m_first,
                    int M, float *y, long ldy, void *work, const uint8_t *next, size_t next_bytes) {
    const int mode = gemm_mode(type), a256 = gemm_a256(type), nb = K / 32, ni = gemm_per16(mode) ? 2 * nb : nb;
    int vals, bytes;
    block_info(type, &vals, &bytes);
    const size_t row_bytes = (size_t)(K / vals) * bytes;
    gemm_act_t g = gemm_act(mode, (void *)act, Mall, K);
    uint8_t *pw = work, *ubuf = pw + ALIGN64((size_t)nb * 1024 + (size_t)4 * nb * GP * sizeof(float));
    float *ps = (float *)(pw + (size_t)nb * 1024), *po = ps + (size_t)ni * GP;
    const int n0 = p * GP, nrows = N - n0 < GP ? N - n0 : GP;
    /* a full panel of few tokens' product is packed and multiplied a run of GEMM_RUN values at a time, the packed run
       staying in L1 for the tiles that read it (a whole panel, 64 KB and up, went out to L2 and came back per tile) */
    const int run = nrows == GP && M <= GEMM_RUN_TOKENS && K % GEMM_RUN == 0 && gemm_direct(type) ? GEMM_RUN : K,
              runs = K / run;
    const int rb = run / 32, subs = gemm_per16(mode) ? 2 : 1;
#ifndef BLK_VNNI
    const int run16 = gemm_run16(type, mode);
#endif
    if (runs == 1) pack_panel(type, mode, blocks, row_bytes, n0, nrows, K, pw, ps, po, ubuf);
    const int pf_lines = next ? (int)((next_bytes + 63) / 64 + nb - 1) / nb : 0;  /* lines a block of the first tile */
    for (int c = 0; c < runs; c++) {
        const int b0 = c * rb;
        if (runs > 1) pack_panel_direct(type, blocks + (size_t)b0 * 32 / vals * bytes, row_bytes, n0, run, pw, ps, po);
        for (int m0 = 0; m0 < M; m0 += GT) {
            const size_t at = (size_t)(m_first + m0);
            const int gt = M - m0 < GT ? M - m0 : GT;  /* the last tile of a few tokens computes only those */
            float *out = y + (size_t)m0 * ldy + n0;
            const int8_t *xq = g.q + at * K + (size_t)b0 * 32;
            const float *xd = g.d + at * nb + (a256 ? b0 / 8 : b0), *xf = g.f + at * ni + (size_t)b0 * subs;
            const int32_t *xi = g.i + at * ni + (size_t)b0 * subs;
            const uint8_t *pf = m0 == 0 && next ? next + (size_t)b0 * pf_lines * 64 : NULL;
#ifdef BLK_VNNI
#define GEMM_TILE(MODE, A, T) gemm_tile(MODE, A, T, pw, ps, po, rb, nb, xq, xd, xi, xf, K, out, ldy, nrows, pf, pf_lines, c > 0)
#else
#define GEMM_TILE(MODE, A, T) gemm_tile(MODE, A, T, pw, ps, po, rb, nb, xq, xd, xi, xf, K, out, ldy, nrows, pf, pf_lines, c > 0, run16)
#endif
#define GEMM_TILES(MODE, A) switch (gt) { \
            case 1: GEMM_TILE(MODE, A, 1); break; case 2: GEMM_TILE(MODE, A, 2); break; case 3: GEMM_TILE(MODE, A, 3); break; \
            case 4: GEMM_TILE(MODE, A, 4); break; case 5: GEMM_TILE(MODE, A, 5); break; default: GEMM_TILE(MODE, A, GT); }
#define GEMM_MODES(A) if (mode == 0) GEMM_TILES(0, A) else if (mode == 4) GEMM_TILES(4, A) \
            else if (gemm_per16(mode)) GEMM_TILES(1, A) else GEMM_TILES(2, A)
            if (a256) GEMM_MODES(1)
            else GEMM_MODES(0)
#undef GEMM_MODES
#undef GEMM_TILES
#undef GEMM_TILE
        }
    }
}

/* y[m, n] = sum_k v(n, k) x[m, k] for a tensor [N, K] of blocks of a type gemm_mode takes (rows after each other),
 * any M: see gemm_tile. Returns 0, or -1 when it cannot take the product (type, K, memory). */
int ds_gemm_blocks(int type, const float *x, int M, int K, long ldx, const uint8_t *blocks, int N, float *y,
                   long ldy, int nthreads) {
    int vals, bytes;
    if (!blk_gemm_type(type) || M <= 0 || N <= 0 || (block_info(type, &vals, &bytes), K % vals)) return -1;
    const int panels = (N + GP - 1) / GP;
    void *act = aligned_alloc(64, blk_gemm_act_bytes(M, K));
    if (!act) return -1;
    int failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        void *work = aligned_alloc(64, blk_gemm_work_bytes(K));
        if (!work) {
            #pragma omp atomic write
            failed = 1;
        }
        blk_gemm_prepare(type, x, M, K, ldx, NULL, act);  /* its barrier: every row quantized before any tile */
        if (!failed) {
            /* each thread a run of consecutive panels, the next one fetched while one is multiplied; the tokens
               GEMM_TOKENS at a time, whose activations stay in L2 while each panel passes over them (all 2048 of
               a long prefill's chunk, 2 MB at K = 1024, went out to L3 for every panel: 340 GMAC/s against 413 at
               512 tokens, Q8_0 [3584, 1024] on the Xeon's two threads) */
            const int nt = omp_get_num_threads(), t = omp_get_thread_num();
            const int p0 = (int)((long)panels * t / nt), p1 = (int)((long)panels * (t + 1) / nt);
            for (int m0 = 0; m0 < M; m0 += GEMM_TOKENS) {
                const int mb = M - m0 < GEMM_TOKENS ? M - m0 : GEMM_TOKENS;
                for (int p = p0; p < p1; p++)
                    blk_gemm_panel(type, blocks, N, K, p, act, M, m0, mb, y + (size_t)m0 * ldy, ldy, work,
                                   p + 1 < p1 ? blk_gemm_panel_at(type, blocks, K, p + 1) : NULL,
                                   p + 1 < p1 ? blk_gemm_panel_bytes(type, N, K, p + 1) : 0);
            }
        }
        free(work);
    }
    free(act);
    return failed ? -1 : 0;
}

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
static int expand_row(int type, const uint8_t *b, int K, int8_t *v, float *sc, float *mn) {
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
    case T_Q4_0: {  /* (q - 8) d (blocks.c's GEMM; the other products take Q4_0 as it lies) */
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

/* one expanded row against M prepared rows (Q8_0-style activations: a.q, a.d per 32; with BLK_VNNI a.c, -128 x the
 * sums of 4). With AVX512-VNNI 64 values a step: the values made unsigned (v + 128) for vpdpbusd, whose sums start
 * at a.c (so they end at the exact sum of v a), each group of 16's four lanes scaled by sc d_a; a min adds
 * mn d_a times the activations' sum, read off the same a.c lanes. */
static void row_expanded(const int8_t *v, const float *sc, const float *mn, int K, const act_t *a, int M, float *out) {
    for (int m = 0; m < M; m++) {
        __m256 acc = _mm256_setzero_ps();
        float macc = 0.0f;
        int j = 0;
#ifdef BLK_VNNI
        {
            const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
            __m512 acc5 = _mm512_setzero_ps(), macc5 = _mm512_setzero_ps();
            for (; j + 2 <= K / 32; j += 2) {
                __m512i u = _mm512_xor_si512(_mm512_loadu_si512(v + 32 * j), _mm512_set1_epi8((char)0x80));
                __m512i c = _mm512_loadu_si512(a[m].c + 8 * j);
                __m512i s = _mm512_dpbusd_epi32(c, u, _mm512_loadu_si512(a[m].q + 32 * j));
                __m128 d2 = _mm_setr_ps(a[m].d[j], a[m].d[j], a[m].d[j + 1], a[m].d[j + 1]);
                __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(_mm_loadu_ps(sc + 2 * j), d2)));
                acc5 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc5);
                if (mn) {  /* c = -128 x the sums of 4: mn d_a / -128 on each of its lanes */
                    __m128 ms = _mm_mul_ps(_mm_mul_ps(_mm_loadu_ps(mn + 2 * j), d2), _mm_set1_ps(-1.0f / 128.0f));
                    macc5 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(ms)), macc5);
                }
            }
            macc = _mm512_reduce_add_ps(macc5);
            acc = _mm256_add_ps(_mm512_castps512_ps256(acc5), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc5), 1)));
        }
#endif
        for (; j < K / 32; j++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(v + 32 * j));
            __m256i s = dot_i8(_mm256_sign_epi8(w, w), w, _mm256_loadu_si256((const __m256i *)(a[m].q + 32 * j)));
            float da = a[m].d[j];
            __m256 scale = _mm256_set_m128(_mm_set1_ps(sc[2 * j + 1] * da), _mm_set1_ps(sc[2 * j] * da));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc);
            if (mn) {  /* the activations' sums of 16 */
                __m256i q = _mm256_loadu_si256((const __m256i *)(a[m].q + 32 * j));
                __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
                __m128i lo = _mm256_castsi256_si128(s4), hi = _mm256_extracti128_si256(s4, 1);
                lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0x4E)), hi = _mm_add_epi32(hi, _mm_shuffle_epi32(hi, 0x4E));
                int32_t s0 = _mm_cvtsi128_si32(lo) + _mm_extract_epi32(lo, 1), s1 = _mm_cvtsi128_si32(hi) + _mm_extract_epi32(hi, 1);
                macc += da * (mn[2 * j] * (float)s0 + mn[2 * j + 1] * (float)s1);
            }
        }
        out[m] = blk_hsum8(acc) + macc;
    }
}

/* ---- the team-level pieces (blocks.h), and the product built from them ----------------------------------- */

int blk_kind(int type) {
    int elems, bytes;
    if (block_info(type, &elems, &bytes) || type == T_F32) return 0;
    if (type == T_F16 || type == T_BF16) return 3;
    if (type == T_Q8_0 || type == T_Q4_0) return 1;
    if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) return 2;
    return 1;  /* the other types: expanded row by row (expand_row), times Q8_0-style activations */
}

/* the expanded types the 512-bit tiles multiply straight from their blocks (tile_b32) */
static int fused_b32(int type) {
#ifdef BLK_VNNI
    return type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 || type == T_IQ4_NL || type == T_IQ4_XS || type == T_MXFP4
        || type == T_Q2_K || type == T_Q3_K || type == T_TQ2_0 || type == T_TQ1_0;
#else
    (void)type;
    return 0;
#endif
}

/* the types multiplied by expanding each row (expand_row), with kind 1's activations */
static int expanded(int type) {
    return type != T_Q8_0 && type != T_Q4_0 && blk_kind(type) == 1;
}

int blk_values(int type) {
    int elems = 1, bytes;
    block_info(type, &elems, &bytes);
    return elems;
}

size_t blk_row_bytes(int type, int K) {
    int elems = 1, bytes = 0;
    if (block_info(type, &elems, &bytes)) return 0;
    return (size_t)(K / elems) * bytes;
}

/* A product's scratch: M prepared rows of each part, the parts one after the other (scratch_parts). */
typedef struct {
    int8_t *q, *qp;
    float *d;
    int16_t *bs;
    int32_t *c, *cb;
} parts_t;

static size_t parts_layout(void *scratch, int M, int K, parts_t *p) {
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

size_t blk_scratch_bytes(int M, int K) {
    size_t ints = parts_layout(NULL, M, K, NULL), floats = (size_t)M * K * sizeof(float);
    return ints > floats ? ints : floats;
}

static act_t act_row(int kind, void *scratch, int M, int K, int m) {
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

void blk_prepare(int kind, const float *x, int M, int K, long ldx, void *scratch) {
    blk_prepare_rows(kind, x, M, K, ldx, NULL, scratch);
}

void blk_prepare_rows(int kind, const float *x, int M, int K, long ldx, const int *rows, void *scratch) {
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        act_t a = act_row(kind, scratch, M, K, m);
        const float *row = x + (size_t)(rows ? rows[m] : m) * ldx;
        if (kind >= 3) memcpy((float *)a.x, row, (size_t)K * sizeof(float));
        else if (kind == 2) quant_q8_k(row, K, (int8_t *)a.q, (float *)a.d, (int16_t *)a.bs, (int8_t *)a.qp);
        else quant_q8_0(row, K, (int8_t *)a.q, (float *)a.d, (int32_t *)a.c, (int32_t *)a.cb);
    }
}

#ifdef BLK_VNNI
/* Q8_0, 16 rows at a time against M <= 8 prepared rows, every row summed as the GEMM sums it: each block's 16 rows
 * x 32 bytes transposed in registers (transpose16x8_v) into 8 vectors of the 16 rows' 4 bytes, u = w + 128, so one
 * vpdpbusd per 4 values and activation row takes all 16 rows (the row's 4 values broadcast), into int32 sums that
 * start at a.cb (-128 x the block's sum of activations) and so end at the block's exact sum of w a; then per row
 * one convert and one multiply-add by d_w d_a, the blocks in order. The work per activation row is a third of the
 * pair tile's (which spends a convert, a permute and a multiply-add on every 8 values), so a verification or a
 * batch of 4-8 rows stays at the memory's speed; each row's sum is the same whatever M is. The 16 rows' scales of a
 * block come by one gather (their first 4 bytes). out[m * ldo + r]. */
#define T16_ROWS 8
/* Rows shorter than this stay on the pair tiles: from memory, one activation row of a [65536, 1024] Q8_0 tensor took
 * 2.3 ms here against the pair tiles' 2.1 (a [32768, 2048]: 2.2-2.4 against 1.9), of a [12288, 4096] 1.0 against
 * 1.1 (a Xeon, 2 threads); a tensor takes one or the other whatever M is, so its rows' sums never depend on M. */
#define T16_MIN_K 4096
/* the lines PFD bytes on (past a row's end: the same row of the next tile, which this thread takes next) */
#define PFD 1024
static inline __attribute__((always_inline)) void tile16_q8_0(const uint8_t *row0, size_t row_bytes, int K,
                                                              const act_t *a, const int M, float *out, long ldo) {
    const int nb = K / 32;
    const __m512i vindex = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32((int)row_bytes));
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 f[T16_ROWS];
    for (int m = 0; m < M; m++) f[m] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row0 + (size_t)b * 34;
        __m512i v[8];
        {  /* half the rows each block (a row moves 34 bytes a block); all 16 rows a block, or the next tile as one run
              of lines, were 3-30 % slower from memory on a Xeon */
            size_t off = (size_t)b * 34 + PFD;
            const uint8_t *pf = row0 + (off < row_bytes ? off : 15 * row_bytes + off) + (size_t)(b & 1) * 8 * row_bytes;
            for (int r = 0; r < 8; r++) _mm_prefetch((const char *)pf + r * row_bytes, _MM_HINT_T0);
        }
        transpose16x8_v(blk + 2, row_bytes, v);
        for (int k = 0; k < 8; k++) v[k] = _mm512_xor_si512(v[k], flip);
        const __m512 s = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(vindex, blk, 1)));
        for (int m = 0; m < M; m++) {
            const uint8_t *xq = (const uint8_t *)a[m].q + 32 * b;
            __m512i acc0 = _mm512_set1_epi32(a[m].cb[b]), acc1 = _mm512_setzero_si512();
            for (int k = 0; k < 8; k += 2) {
                int32_t x0, x1;
                memcpy(&x0, xq + 4 * k, 4), memcpy(&x1, xq + 4 * k + 4, 4);
                acc0 = _mm512_dpbusd_epi32(acc0, v[k], _mm512_set1_epi32(x0));
                acc1 = _mm512_dpbusd_epi32(acc1, v[k + 1], _mm512_set1_epi32(x1));
            }
            f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc0, acc1)),
                                   _mm512_mul_ps(s, _mm512_set1_ps(a[m].d[b])), f[m]);
        }
    }
    for (int m = 0; m < M; m++) _mm512_storeu_ps(out + (size_t)m * ldo, f[m]);
}
#endif

void blk_tiles(int type, const uint8_t *blocks, int N, int K, void *scratch, int M, float *y, long ldy) {
    blk_tiles_rows(type, blocks, N, K, scratch, M, 0, M, y, ldy);
}

void blk_tiles_rows(int type, const uint8_t *blocks, int N, int K, void *scratch, int Mall, int m_first, int M, float *y,
                    long ldy) {
    int elems = 1, bytes = 0, kind = blk_kind(type);
    block_info(type, &elems, &bytes);
    size_t row_bytes = (size_t)(K / elems) * bytes;
    act_t a[DS_MAX_ROWS > MG ? DS_MAX_ROWS : MG];
    if (expanded(type) && !fused_b32(type)) {  /* each row expanded once (to int8 values and scales), then times every
                                                 activation row */
        int8_t v[K];
        float sc[K / 16], mn[K / 16];
        #pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            int mins = expand_row(type, blocks + (size_t)n * row_bytes, K, v, sc, mn);
            float out[DS_MAX_ROWS > MG ? DS_MAX_ROWS : MG];
            for (int m0 = 0; m0 < M; m0 += DS_MAX_ROWS) {
                int mm = M - m0 < DS_MAX_ROWS ? M - m0 : DS_MAX_ROWS;
                act_t am[DS_MAX_ROWS];
                for (int m = 0; m < mm; m++) am[m] = act_row(kind, scratch, Mall, K, m_first + m0 + m);
                row_expanded(v, sc, mins > 0 ? mn : NULL, K, am, mm, out);
                for (int m = 0; m < mm; m++) y[(size_t)(m0 + m) * ldy + n] = out[m];
            }
        }
        return;
    }
#ifdef BLK_VNNI
    if (type == T_Q8_0 && N >= 16 && K >= T16_MIN_K) {  /* 16 rows at a time (tile16_q8_0); the last tile ends at row
                                          N - 1, its first rows (a tile's before) computed twice, the same each time */
        const int tiles = (N + 15) / 16;
        #pragma omp for schedule(static) nowait
        for (int t = 0; t < tiles; t++) {
            const int n = t * 16 < N - 16 ? t * 16 : N - 16;  /* the last tile ends at row N - 1 */
            for (int m0 = 0; m0 < M; m0 += T16_ROWS) {
                const int mm = M - m0 < T16_ROWS ? M - m0 : T16_ROWS;
                act_t am[T16_ROWS];
                float out[T16_ROWS * 16];
                for (int m = 0; m < mm; m++) am[m] = act_row(kind, scratch, Mall, K, m_first + m0 + m);
                tile16_q8_0(blocks + (size_t)n * row_bytes, row_bytes, K, am, mm, out, 16);
                for (int m = 0; m < mm; m++)
                    for (int r = t * 16 - n; r < 16; r++) y[(size_t)(m0 + m) * ldy + n + r] = out[m * 16 + r];
            }
        }
        return;
    }
    if (kind != 3) {  /* 512-bit products, four rows at a time, the activation rows two at a time (the tile's rows
                         stay in L1 between the pairs; each row's sum is accumulated the same way whatever M is) */
        int tiles = N / 4;
        if (M <= 2) {  /* this thread's share of the tiles as `omp for schedule(static)` gives it, in one call */
            const int total = tiles + (N - 4 * tiles), nt = omp_get_num_threads(), id = omp_get_thread_num();
            const int q = total / nt, rest = total % nt, t0 = id * q + (id < rest ? id : rest), t1 = t0 + q + (id < rest);
            for (int m = 0; m < M; m++) a[m] = act_row(kind, scratch, Mall, K, m_first + m);
            decode_tiles(type, blocks, row_bytes, tiles, t0, t1, K, a, M, y, ldy);
            return;
        }
        #pragma omp for schedule(static) nowait  /* more rows: two at a time over each tile */
        for (int t = 0; t < tiles + (N - 4 * tiles); t++) {
            int n = t < tiles ? 4 * t : 4 * tiles + (t - tiles), R = t < tiles ? 4 : 1;
            for (int m0 = 0; m0 < M; m0 += 2) {
                int mm = M - m0 < 2 ? M - m0 : 2;
                float out[8];
                for (int m = 0; m < mm; m++) a[m] = act_row(kind, scratch, Mall, K, m_first + m0 + m);
                decode_tile(type, blocks + (size_t)n * row_bytes, row_bytes, R, K, a, mm, out);
                for (int r = 0; r < R; r++)
                    for (int m = 0; m < mm; m++) y[(size_t)(m0 + m) * ldy + n + r] = out[r * 2 + m];
            }
        }
        return;
    }
#else
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
#endif
    #pragma omp for schedule(static) nowait
    for (int n = 0; n < N; n++) {
        const uint8_t *row = blocks + (size_t)n * row_bytes;
        if (M > MG && n + 1 < N) _mm_prefetch((const char *)(row + row_bytes), _MM_HINT_T0);
        for (int m0 = 0; m0 < M; m0 += MG) {
            int mg = M - m0 < MG ? M - m0 : MG;
            for (int m = 0; m < mg; m++) a[m] = act_row(kind, scratch, Mall, K, m_first + m0 + m);
            float out[MG];
            if (kind == 3) row_half(type, row, K, a, mg, out);
#ifndef BLK_VNNI
            else if (type == T_Q6_K || kind == 2) {  /* M a constant for one row (a decode) and for MG: the sums
                                                        stay in registers (with M a variable they lived on the
                                                        stack: Q6_K 1.8x and Q4_K 2.5x slower, hot in L2) */
                switch (mg) {  /* (and for 2 and 3, a prefill's last rows or a batch's: 1.3-1.9x faster) */
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
#endif
            for (int m = 0; m < mg; m++) y[(size_t)(m0 + m) * ldy + n] = out[m];
        }
    }
}

/* y[m, n] = sum_k v(n, k) x[m, k] for a tensor [N, K] of blocks of `type` (rows after each other); any M.
 * Returns 0, or -1 when it cannot take the product (type, K, memory). */
int ds_linear_blocks(int type, const float *x, int M, int K, long ldx, const uint8_t *blocks, int N, float *y,
                     long ldy, int nthreads) {
    int kind = blk_kind(type), elems = 1, bytes = 0;
    if (M <= 0 || N <= 0 || !kind || (block_info(type, &elems, &bytes), K % elems)) return -1;
    void *scratch = malloc(blk_scratch_bytes(M, K));
    if (!scratch) return -1;
    #pragma omp parallel num_threads(nthreads)
    {
        blk_prepare(kind, x, M, K, ldx, scratch);
        blk_tiles(type, blocks, N, K, scratch, M, y, ldy);
    }
    free(scratch);
    return 0;
}

#endif  /* AVX2 + FMA + F16C */
