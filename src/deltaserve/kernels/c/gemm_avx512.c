/* gemm_avx512.c: the GEMM's tile with AVX512-VNNI (gemm_tile: the panel's 32 rows times GT tokens, vpdpbusd per 16
 * rows and token), and the panel's scales 16 rows at a time (gather loads). Compiled with -ffp-contract=off. */
#include <string.h>

#include "gemm.h"
#include "quants.h"

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

/* row_scales of 16 rows at once (rows r0 .. r0 + 15 of ps/po, the first at `rows`, row_bytes apart): each block's
 * scale words of the 16 rows by one gather apiece, the scales and mins taken apart in the vector, and each
 * sub-block's 16 values stored as one run (the rows' scalar unpacking weighed on a few-token expert's product). The
 * same values as row_scales, bit for bit (the same f16 conversions and products). */
void gemm_row_scales(int type, const uint8_t *rows, size_t row_bytes, int K, float *ps, float *po, int r0) {
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
/* the tiles of a run of blocks (b0 .., rb of them) times M tokens, GT at a time (the first at xq, xd, xi, xf: the
 * prepared activations' rows), each tile's sums into out (y + n0) ldy apart; pf: the bytes fetched while the first
 * tile runs. The loop over tokens is here, with the tile inlined in it, the mode, a256 and the token count made
 * constants of gemm_tile (what the tile reads per token is computed per tile, not per call). */
void gemm_tiles(int mode, int a256, int M, const uint8_t *pw, const float *ps, const float *po, int rb, int nb, int ni,
                int b0, const int8_t *q, const float *d, const int32_t *i, const float *f, int K, float *y, long ldy,
                int nrows, const uint8_t *pf0, int pf_lines, int more, int run16) {
    (void)run16;  /* the AVX2 tile's */
    const int subs = gemm_per16(mode) ? 2 : 1;
    for (int m0 = 0; m0 < M; m0 += GT) {
        const int gt = M - m0 < GT ? M - m0 : GT;  /* the last tile of a few tokens computes only those */
        float *out = y + (size_t)m0 * ldy;
        const int8_t *xq = q + (size_t)m0 * K + (size_t)b0 * 32;
        const float *xd = d + (size_t)m0 * nb + (a256 ? b0 / 8 : b0), *xf = f + (size_t)m0 * ni + (size_t)b0 * subs;
        const int32_t *xi = i + (size_t)m0 * ni + (size_t)b0 * subs;
        const uint8_t *pf = m0 == 0 ? pf0 : NULL;
#define GEMM_TILE(MODE, A, T) gemm_tile(MODE, A, T, pw, ps, po, rb, nb, xq, xd, xi, xf, K, out, ldy, nrows, pf, pf_lines, more)
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
#endif  /* BLK_VNNI */
