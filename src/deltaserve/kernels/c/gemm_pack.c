/* gemm_pack.c: the GEMM's panels: GP rows of a tensor laid out once per product for the tiles (gemm.c's layout
 * comment says what a panel holds), straight from the blocks of Q8_0 and the K-quants (pack_panel_direct: each
 * group of PV_ROWS rows transposed in registers, transpose.h), from their expanded rows for every other type
 * (expand.c). Compiled with -ffp-contract=off. */
#include <string.h>

#include "expand.h"
#include "gemm.h"
#include "quants.h"
#include "transpose.h"

#ifdef DS_AVX2

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

/* Row r's scales (and mins) per sub-block into ps[i * 32 + r] (po[b * 32 + r]); its values are unpack_row's. */
void row_scales(int type, const uint8_t *row, int K, float *ps, float *po, int r) {
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

/* A full panel (GP rows) packed straight from the file's blocks: each group of PV_ROWS rows' 32-byte runs of quants
 * transposed once (transpose16x8_v, or transpose8x8_v on AVX2) and the values taken out of the transposed words, with
 * no unpacked copy of the rows in between (the copy and its second pass weighed on a few-token expert's product).
 * The same layout as pack_panel's, on either build. */
void pack_panel_direct(int type, const uint8_t *blocks, size_t row_bytes, int n0, int K, uint8_t *pw,
                              float *ps, float *po) {
    const pvec_t lo4 = PV_SET1_8(0x0F), one = PV_SET1_8(1), three = PV_SET1_8(3);
    pvec_t v[8], w[8];
    for (int g = 0; g < GP / PV_ROWS; g++) {
        const uint8_t *rows = blocks + (size_t)(n0 + PV_ROWS * g) * row_bytes;
        uint8_t *dst = pw + g * PV_ROWS * 4;
        gemm_row_scales(type, rows, row_bytes, K, ps, po, PV_ROWS * g);
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
void pack_panel(int type, int mode, const uint8_t *blocks, size_t row_bytes, int n0, int nrows, int K,
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
#endif  /* DS_AVX2 */
