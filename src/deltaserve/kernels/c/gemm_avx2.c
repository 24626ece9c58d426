/* gemm_avx2.c: the GEMM's tile on AVX2 (a build without AVX512-VNNI: a Zen 3), and the panel's scales 8 rows at a
 * time. Compiled with -ffp-contract=off. */
#include <string.h>

#include "gemm.h"
#include "quants.h"
#include "transpose.h"

#if defined(DS_AVX2) && !defined(BLK_VNNI)

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
int gemm_run16(int type, int mode) {
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

/* row_scales of 8 rows (r0 .. r0 + 7) at once for the K-quants: each row's scales of a block as f32 vectors into a
 * small table, transposed (transpose8x8_v: they are words) into runs of 8 rows per sub-block. The same values as
 * row_scales, bit for bit (the same f16 conversions and products). */
void gemm_row_scales(int type, const uint8_t *rows, size_t row_bytes, int K, float *ps, float *po, int r0) {
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
/* the tiles of a run of blocks (b0 .., rb of them) times M tokens, GT at a time (the first at xq, xd, xi, xf: the
 * prepared activations' rows), each tile's sums into out (y + n0) ldy apart; pf: the bytes fetched while the first
 * tile runs. The loop over tokens is here, with the tile inlined in it, the mode, a256 and the token count made
 * constants of gemm_tile (what the tile reads per token is computed per tile, not per call). */
void gemm_tiles(int mode, int a256, int M, const uint8_t *pw, const float *ps, const float *po, int rb, int nb, int ni,
                int b0, const int8_t *q, const float *d, const int32_t *i, const float *f, int K, float *y, long ldy,
                int nrows, const uint8_t *pf0, int pf_lines, int more, int run16) {
    const int subs = gemm_per16(mode) ? 2 : 1;
    for (int m0 = 0; m0 < M; m0 += GT) {
        const int gt = M - m0 < GT ? M - m0 : GT;  /* the last tile of a few tokens computes only those */
        float *out = y + (size_t)m0 * ldy;
        const int8_t *xq = q + (size_t)m0 * K + (size_t)b0 * 32;
        const float *xd = d + (size_t)m0 * nb + (a256 ? b0 / 8 : b0), *xf = f + (size_t)m0 * ni + (size_t)b0 * subs;
        const int32_t *xi = i + (size_t)m0 * ni + (size_t)b0 * subs;
        const uint8_t *pf = m0 == 0 ? pf0 : NULL;
#define GEMM_TILE(MODE, A, T) gemm_tile(MODE, A, T, pw, ps, po, rb, nb, xq, xd, xi, xf, K, out, ldy, nrows, pf, pf_lines, more, run16)
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
#endif  /* DS_AVX2 && !BLK_VNNI */
