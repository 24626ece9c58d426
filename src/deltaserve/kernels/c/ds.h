/* ds.h: what every C file of the native library includes first.
 *
 * The library is compiled once per instruction-set level (kernels/native.py's variants: x86-64-v3, avx512-vnni,
 * avx512-bf16, or -march=native), every file in every build; each file compiles to nothing where its level is
 * missing, by the guards named here (the one place they are spelled):
 *   DS_AVX2    AVX2 + FMA + F16C: every build (the file's blocks, the one-call decode, the DeltaNet step);
 *   BLK_VNNI   AVX512F/BW/VL + AVX512-VNNI: the 512-bit products on the file's blocks (*_avx512.c);
 *   DS_TABLES  AVX512F/BW + AVX512-VNNI: the int8 tables, the prefill's 512-bit delta rule and conv;
 *   and the AVX2-only halves (*_avx2.c) where BLK_VNNI (or DS_TABLES) is not.
 * A kernel Python may call is a `ds_` function; kernels/native.py's SIGNATURES binds those this build holds, and
 * kernels/routes.py decides which of them takes a product. The functions the files share among themselves are
 * DS_INTERNAL: hidden in the library, called directly (no PLT). */
#ifndef DS_DS_H
#define DS_DS_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DS_AVX2 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define BLK_VNNI 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define DS_TABLES 1
#endif

#define DS_INTERNAL __attribute__((visibility("hidden")))
#define ALIGN64(n) (((n) + 63) & ~(size_t)63)

#ifdef DS_AVX2
/* the sum of a vector's 8 floats */
static inline float blk_hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
#endif

#endif
