/* tiles_avx512.c: the decode products on the file's blocks with 512-bit vectors (AVX512-VNNI: a Zen 4/5, a Xeon).
 * vpdpbusd (u8 x s8, four products summed into each int32 lane) and vpdpwssd (s16 pairs times s16 into int32) take
 * a block in one instruction each, and every product of blocks of 32 or 256 runs on tiles of four weight rows: the
 * same exact integer sum of each block as rows_avx2.c's, scaled by the same f32 factors; only the order in which
 * the f32 terms are added differs (blocks in pairs and lanes, rows alike whatever M is, so a row's result never
 * depends on the rows beside it). Q8_0 tensors of long rows take 16-row tiles (tile16_q8_0); Q6_K products of 3 rows
 * or more take one weight row against up to four activation rows (multi_tile). Compiled with -ffp-contract=off. */
#include <omp.h>

#include "expand.h"
#include "products.h"
#include "rows.h"
#include "transpose.h"

#ifdef BLK_VNNI

/* The most activation rows a tile's pass takes: the tiles of four weight rows take one or two, multi_tile (one Q6_K
 * weight row) up to TM: four rows' sums and the row's unpacked values fit the 32 registers. Each (weight row,
 * activation row) pair has accumulators of its own and the same operations in the same order whatever R and M are,
 * so a row's sum never depends on the rows beside it. */
#define TM 4

/* ---- the products of blocks of 32 and 256 with 512-bit vectors (AVX512-VNNI) ------------------------------------
 * R weight rows at a time (R = 4, or 1 for the last rows; a constant after inlining, as M is) against M = 1 or 2
 * activation rows (blk_tiles runs more rows two at a time, or Q6_K's on multi_tile): four independent accumulation
 * chains, each row's blocks read once and used for both activation rows. out[r * 2 + m].
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
 * word permute from the run's cache lines (two or four vectors; a gather is slower). */
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
    __m512 vacc[4][TM];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) vacc[r][m] = _mm512_setzero_ps();
    for (int jb = 0; jb < K / 256; jb++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *b = row0 + (size_t)r * row_bytes + (size_t)jb * 210;
            prefetch_ahead(b, 210);
            __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));  /* the 16 scales */
            __m512i sc512 = _mm512_castsi256_si512(sc16);
            __m512i dot[TM];
            for (int m = 0; m < M; m++) dot[m] = _mm512_setzero_si512();
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
 * `inlined`: the loop inside the type's own tile code (type and M constants); else a decode_tile call per tile (on a
 * product of short rows, an expert's down projection at K = 512, that call is a large part of a tile's work). */
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

/* Q8_0, 16 rows at a time against M <= 8 prepared rows, every row summed as the GEMM sums it: each block's 16 rows
 * x 32 bytes transposed in registers (transpose16x8_v) into 8 vectors of the 16 rows' 4 bytes, u = w + 128, so one
 * vpdpbusd per 4 values and activation row takes all 16 rows (the row's 4 values broadcast), into int32 sums that
 * start at a.cb (-128 x the block's sum of activations) and so end at the block's exact sum of w a; then per row
 * one convert and one multiply-add by d_w d_a, the blocks in order. The work per activation row is a third of the
 * pair tile's (which spends a convert, a permute and a multiply-add on every 8 values), so a verification or a
 * batch of 4-8 rows stays at the memory's speed; each row's sum is the same whatever M is. The 16 rows' scales of a
 * block come by one gather (their first 4 bytes). out[m * ldo + r]. */
#define T16_ROWS 8
/* Rows shorter than this stay on the pair tiles (there the 16-row tile is no faster from memory: docs/kernels.md); a
 * tensor takes one or the other whatever M is, so its rows' sums never depend on M. */
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
              of lines, are slower from memory */
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
/* ---- the many-row decode products of Q6_K (3 to 16 activation rows) --------------------------------------------
 * One weight row at a time against up to TM activation rows a pass: the row's blocks are loaded and unpacked once a
 * pass (the six-bit values from ql and qh, the 16 scales), where the pair tiles unpack them again for every pair.
 * The code is the one-row tile's (tile_q6k with R = 1 and M a constant up to TM), so each activation row's sum is
 * the one-row product's bit for bit: a decode step of several sequences on these tiles (DELTASERVE_BATCH_INVARIANT)
 * gives each the bits it gets alone. Only Q6_K: its unpacking is a third of its one-row work and shares nothing
 * between weight rows; Q4_K's (and Q5_K's, the same tile) shares its scales among the four rows of a pair tile, and
 * one or two weight rows against four activation rows were no faster than the pair tiles; Q8_0's is a load and an
 * xor, and one weight row against 4-8 rows was slower than they are (docs/kernels.md). */
static int blk_multi_type(int type) { return type == T_Q6_K; }

/* its presence says that this build's Q6_K decode products of 3 rows or more take multi_tile */
int ds_blocks_multi(void) { return 1; }

/* one weight row against M <= TM activation rows (M a constant in each case: the sums stay in registers) */
static void multi_tile(const uint8_t *row, int K, const act_t *a, int M, float *out) {
    switch (M) {
    case 1: tile_q6k(row, 0, 1, K, a, 1, out); break;
    case 2: tile_q6k(row, 0, 1, K, a, 2, out); break;
    case 3: tile_q6k(row, 0, 1, K, a, 3, out); break;
    default: tile_q6k(row, 0, 1, K, a, TM, out);
    }
}

void blk_tiles_isa(int type, int kind, const uint8_t *blocks, size_t row_bytes, int N, int K, void *scratch, int Mall,
                   int m_first, int M, float *y, long ldy) {
    act_t a[DS_MAX_ROWS > MG ? DS_MAX_ROWS : MG];
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
    /* 512-bit products, four rows at a time, the activation rows two at a time (the tile's rows stay in L1 between
     * the pairs; each row's sum is accumulated the same way whatever M is) */
    int tiles = N / 4;
    if (M <= 2) {  /* this thread's share of the tiles as `omp for schedule(static)` gives it, in one call */
        const int total = tiles + (N - 4 * tiles), nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int q = total / nt, rest = total % nt, t0 = id * q + (id < rest ? id : rest), t1 = t0 + q + (id < rest);
        for (int m = 0; m < M; m++) a[m] = act_row(kind, scratch, Mall, K, m_first + m);
        decode_tiles(type, blocks, row_bytes, tiles, t0, t1, K, a, M, y, ldy);
        return;
    }
    if (blk_multi_type(type)) {  /* more rows: up to TM at a time over each weight row */
        #pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++) {
            const uint8_t *row = blocks + (size_t)n * row_bytes;
            for (int m0 = 0; m0 < M; m0 += TM) {
                const int mm = M - m0 < TM ? M - m0 : TM;
                act_t am[TM];
                float out[2 * TM];
                for (int m = 0; m < mm; m++) am[m] = act_row(kind, scratch, Mall, K, m_first + m0 + m);
                multi_tile(row, K, am, mm, out);
                for (int m = 0; m < mm; m++) y[(size_t)(m0 + m) * ldy + n] = out[m];
            }
        }
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
}

#endif  /* BLK_VNNI */
