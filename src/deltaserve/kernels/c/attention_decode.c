/* attention_decode.c: a gated attention layer's step in the one-call decode: each sequence's new k and v written
 * into its cache, then every query head over the cache (scores and softmax in f32, the output gated by the sigmoid of
 * its gate). The cache is [nkv, cap, hd] per layer and sequence (decode.c hands in its rows) in the call's KV type
 * (native.h's DS_KV_*): f32, read by attn_head one query head at a time; f16 or bf16, read by attn_group one KV head
 * at a time: each key and value row is loaded once in its type and widened to f32 in registers, and the g query heads
 * of its GQA group take their dot products against it (and their weighted sums of it) together, so a token reads
 * the cache's bytes once. attn_group covers a chunk of positions; attn_merge joins a head's chunks (their maxima and
 * sums, as a split softmax does) and applies the gate. */
#include <math.h>
#include <string.h>

#include "attention_decode.h"
#include "rowops.h"
#include "vmath.h"

#ifdef DS_AVX2

#define KV_SUB 32  /* positions per sub-block of a 16-bit chunk: its rows stay in L1 while every head group reads them */
#define KV_HEADS 4 /* query heads whose accumulators a pass over the rows holds in registers */
#define KV_AHEAD 8 /* key rows ahead that the scores' pass asks the memory for */

/* a float as bfloat16, rounded to nearest even as torch's .to(torch.bfloat16) does (a NaN becomes 0x7FC0, as there) */
static inline uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* hd floats stored as row `at` (in elements) of a 16-bit cache: f16 by F16C, round to nearest even (what torch's
 * .to(torch.float16) gives), or bf16 */
static void kv_store(int kvt, void *cache, size_t at, const float *src, int hd) {
    uint16_t *dst = (uint16_t *)cache + at;
    if (kvt == DS_KV_F16)
        for (int i = 0; i < hd; i += 8)
            _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    else
        for (int i = 0; i < hd; i++) dst[i] = bf16_of(src[i]);
}

/* q/k RMS norm per head, rotary embedding (rotate-half over the first `rotary` dims) at rotary position `rpos`, k
 * and v written at `pos` of the caches [nkv, cap, hd] in type kvt; the rotated queries to qout [nh, hd]. Serial.
 * (rpos is pos for text; after an image the positions fall behind the cache index: vision/span.py.) */
void attn_prepare(const model_t *m, const layer_t *L, const float *qkv, void *kc, void *vc, int kvt, int pos,
                  int rpos, int cap, float *qout) {
    int nh = m->nh, nkv = m->nkv, hd = m->hd, r = m->rotary, half = r / 2;
    float cs[half + 1], sn[half + 1];
    for (int i = 0; i < half; i++) {
        float inv = 1.0f / powf(m->theta, (float)(2 * i) / (float)r);
        float f = (float)rpos * inv;
        cs[i] = cosf(f);
        sn[i] = sinf(f);
    }
    const float *kin = qkv + (size_t)nh * 2 * hd, *vin = kin + (size_t)nkv * hd;
    for (int h = 0; h < nh + nkv; h++) {
        int is_q = h < nh;
        size_t at = ((size_t)(h - nh) * cap + pos) * hd;
        const float *src = is_q ? qkv + (size_t)h * 2 * hd : kin + (size_t)(h - nh) * hd;
        float t[hd], row[hd];
        float *dst = is_q ? qout + (size_t)h * hd : kvt == DS_KV_F32 ? (float *)kc + at : row;
        rms_norm_row(src, is_q ? L->q_norm : L->k_norm, t, hd, m->eps);
        for (int i = 0; i < half; i++) {
            dst[i] = t[i] * cs[i] - t[i + half] * sn[i];
            dst[i + half] = t[i + half] * cs[i] + t[i] * sn[i];
        }
        for (int i = r; i < hd; i++) dst[i] = t[i];
        if (!is_q && kvt != DS_KV_F32) kv_store(kvt, kc, at, row, hd);
    }
    if (kvt != DS_KV_F32) {
        for (int h = 0; h < nkv; h++) kv_store(kvt, vc, ((size_t)h * cap + pos) * hd, vin + (size_t)h * hd, hd);
        return;
    }
    float *vf = vc;
    for (int h = 0; h < nkv; h++)
        for (int i = 0; i < hd; i++) vf[((size_t)h * cap + pos) * hd + i] = vin[(size_t)h * hd + i];
}

/* Query head h over cache positions 0..pos, softmax in f32, times sigmoid of its output gate: out [hd]. */
void attn_head(const model_t *m, int h, const float *qkv, const float *q, const float *kc, const float *vc,
                      int pos, int cap, float *scores, float *out) {
    int hd = m->hd, kvh = h / (m->nh / m->nkv), n = pos + 1;
    const float *qh = q + (size_t)h * hd, *keys = kc + (size_t)kvh * cap * hd, *vals = vc + (size_t)kvh * cap * hd;
    float scale = 1.0f / sqrtf((float)hd), mx = -INFINITY;
    for (int t = 0; t < n; t++) {
        const float *kt = keys + (size_t)t * hd;
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < hd; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(kt + i), acc);
        float sc = blk_hsum8(acc) * scale;
        scores[t] = sc;
        if (sc > mx) mx = sc;
    }
    __m256 vsum = _mm256_setzero_ps(), vmx = _mm256_set1_ps(mx);
    int t0 = 0;
    for (; t0 + 8 <= n; t0 += 8) {  /* e^(s - max) eight at a time (a long context has thousands per head) */
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + t0), vmx));
        _mm256_storeu_ps(scores + t0, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = blk_hsum8(vsum);
    for (int t = t0; t < n; t++) { scores[t] = expf(scores[t] - mx); sum += scores[t]; }
    float o[hd];
    for (int i = 0; i < hd; i++) o[i] = 0.0f;
    for (int t = 0; t < n; t++) {
        const float *vt = vals + (size_t)t * hd;
        float p = scores[t] / sum;
        for (int i = 0; i < hd; i++) o[i] += p * vt[i];
    }
    const float *gate = qkv + (size_t)h * 2 * hd + hd;
    for (int i = 0; i < hd; i++) out[(size_t)h * hd + i] = o[i] / (1.0f + expf(-gate[i]));
}

/* 8 values of a 16-bit row as f32: f16 by F16C, bf16 by a shift (both exact) */
static inline __attribute__((always_inline)) __m256 kv_load8(const uint16_t *p, const int kvt) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (kvt == DS_KV_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The scaled scores of gn query heads (q: their rows, stride hd) against keys t0..t1-1: s[j * ns + t]. Two
 * positions a step, so that each query vector loaded serves two keys. */
static inline __attribute__((always_inline)) void group_scores(const float *q, int hd, const uint16_t *keys, int t0,
                                                               int t1, float scale, float *s, size_t ns,
                                                               const int kvt, const int gn) {
    int t = t0;
    for (; t + 2 <= t1; t += 2) {
        const uint16_t *k0 = keys + (size_t)t * hd, *k1 = k0 + hd;
        for (int i = 0; i < 2 * hd; i += 32) _mm_prefetch((const char *)(k0 + KV_AHEAD * hd + i), _MM_HINT_T0);
        __m256 a0[KV_HEADS], a1[KV_HEADS];
        for (int j = 0; j < gn; j++) a0[j] = a1[j] = _mm256_setzero_ps();
        for (int i = 0; i < hd; i += 8) {
            __m256 x0 = kv_load8(k0 + i, kvt), x1 = kv_load8(k1 + i, kvt);
            for (int j = 0; j < gn; j++) {
                __m256 qv = _mm256_loadu_ps(q + (size_t)j * hd + i);
                a0[j] = _mm256_fmadd_ps(qv, x0, a0[j]);
                a1[j] = _mm256_fmadd_ps(qv, x1, a1[j]);
            }
        }
        for (int j = 0; j < gn; j++) {
            s[j * ns + t] = blk_hsum8(a0[j]) * scale;
            s[j * ns + t + 1] = blk_hsum8(a1[j]) * scale;
        }
    }
    if (t < t1) {
        const uint16_t *k0 = keys + (size_t)t * hd;
        __m256 a0[KV_HEADS];
        for (int j = 0; j < gn; j++) a0[j] = _mm256_setzero_ps();
        for (int i = 0; i < hd; i += 8) {
            __m256 x0 = kv_load8(k0 + i, kvt);
            for (int j = 0; j < gn; j++) a0[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)j * hd + i), x0, a0[j]);
        }
        for (int j = 0; j < gn; j++) s[j * ns + t] = blk_hsum8(a0[j]) * scale;
    }
}

/* o[j * ow + i] += sum over t in t0..t1-1 of p[j * ns + t] * value t's element i, for gn heads: sixteen dims of all
 * gn heads held in registers over the rows (eight where hd leaves them). */
static inline __attribute__((always_inline)) void group_values(const float *p, size_t ns, const uint16_t *vals,
                                                               int hd, int t0, int t1, float *o, size_t ow,
                                                               const int kvt, const int gn) {
    int d = 0;
    for (; d + 16 <= hd; d += 16) {
        __m256 c0[KV_HEADS], c1[KV_HEADS];
        for (int j = 0; j < gn; j++) {
            c0[j] = _mm256_loadu_ps(o + j * ow + d);
            c1[j] = _mm256_loadu_ps(o + j * ow + d + 8);
        }
        for (int t = t0; t < t1; t++) {
            const uint16_t *vt = vals + (size_t)t * hd + d;
            if (d % 32 == 0) _mm_prefetch((const char *)(vt + (size_t)KV_SUB * hd), _MM_HINT_T0);
            __m256 x0 = kv_load8(vt, kvt), x1 = kv_load8(vt + 8, kvt);
            for (int j = 0; j < gn; j++) {
                __m256 pj = _mm256_broadcast_ss(p + j * ns + t);
                c0[j] = _mm256_fmadd_ps(pj, x0, c0[j]);
                c1[j] = _mm256_fmadd_ps(pj, x1, c1[j]);
            }
        }
        for (int j = 0; j < gn; j++) {
            _mm256_storeu_ps(o + j * ow + d, c0[j]);
            _mm256_storeu_ps(o + j * ow + d + 8, c1[j]);
        }
    }
    if (d < hd) {
        __m256 c0[KV_HEADS];
        for (int j = 0; j < gn; j++) c0[j] = _mm256_loadu_ps(o + j * ow + d);
        for (int t = t0; t < t1; t++) {
            __m256 x0 = kv_load8(vals + (size_t)t * hd + d, kvt);
            for (int j = 0; j < gn; j++) c0[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j * ns + t), x0, c0[j]);
        }
        for (int j = 0; j < gn; j++) _mm256_storeu_ps(o + j * ow + d, c0[j]);
    }
}

/* a head group's pass in the kernel's own types: gn (1..KV_HEADS) a constant in each copy */
#define GROUP_SWITCH(call, kvt, gn) \
    switch (gn) { case 4: call(kvt, 4); break; case 3: call(kvt, 3); break; case 2: call(kvt, 2); break; \
                  default: call(kvt, 1); }

static inline __attribute__((always_inline)) void group_run(const model_t *m, int kvh, const float *q,
                                                            const uint16_t *keys, const uint16_t *vals, int n, int t0,
                                                            int t1, float *scores, float *part, const int kvt) {
    int hd = m->hd, g = m->nh / m->nkv;
    size_t w = (size_t)hd + 2;
    float scale = 1.0f / sqrtf((float)hd);
    const float *qg = q + (size_t)kvh * g * hd;
    float *sg = scores + (size_t)kvh * g * n;
    for (int s0 = t0; s0 < t1; s0 += KV_SUB) {
        int s1 = s0 + KV_SUB < t1 ? s0 + KV_SUB : t1;
        for (int h0 = 0; h0 < g; h0 += KV_HEADS) {
            int gn = g - h0 < KV_HEADS ? g - h0 : KV_HEADS;
#define SCORES(kt, c) group_scores(qg + (size_t)h0 * hd, hd, keys, s0, s1, scale, sg + (size_t)h0 * n, n, kt, c)
            GROUP_SWITCH(SCORES, kvt, gn)
#undef SCORES
        }
    }
    for (int j = 0; j < g; j++) {  /* each head's max over the chunk, e^(s - max) in place, their sum */
        float *s = sg + (size_t)j * n, mx = -INFINITY;
        for (int t = t0; t < t1; t++) mx = s[t] > mx ? s[t] : mx;
        __m256 vsum = _mm256_setzero_ps(), vmx = _mm256_set1_ps(mx);
        int t = t0;
        for (; t + 8 <= t1; t += 8) {
            __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx));
            _mm256_storeu_ps(s + t, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        float sum = blk_hsum8(vsum);
        for (; t < t1; t++) { s[t] = expf(s[t] - mx); sum += s[t]; }
        float *pj = part + j * w;
        pj[0] = mx;
        pj[1] = sum;
        memset(pj + 2, 0, (size_t)hd * sizeof(float));
    }
    for (int s0 = t0; s0 < t1; s0 += KV_SUB) {
        int s1 = s0 + KV_SUB < t1 ? s0 + KV_SUB : t1;
        for (int h0 = 0; h0 < g; h0 += KV_HEADS) {
            int gn = g - h0 < KV_HEADS ? g - h0 : KV_HEADS;
#define VALUES(kt, c) group_values(sg + (size_t)h0 * n, n, vals, hd, s0, s1, part + h0 * w + 2, w, kt, c)
            GROUP_SWITCH(VALUES, kvt, gn)
#undef VALUES
        }
    }
}

/* (attention_decode.h) */
void attn_group(const model_t *m, int kvt, int kvh, const float *q, const void *kc, const void *vc, int n, int t0,
                int t1, int cap, float *scores, float *part) {
    size_t off = (size_t)kvh * cap * m->hd;
    const uint16_t *keys = (const uint16_t *)kc + off, *vals = (const uint16_t *)vc + off;
    if (kvt == DS_KV_F16) group_run(m, kvh, q, keys, vals, n, t0, t1, scores, part, DS_KV_F16);
    else group_run(m, kvh, q, keys, vals, n, t0, t1, scores, part, DS_KV_BF16);
}

/* (attention_decode.h) */
void attn_merge(const model_t *m, int h, const float *qkv, const float *part, int nc, size_t stride, float *out) {
    int hd = m->hd;
    float mx = -INFINITY, sum = 0.0f, o[hd], wc[nc];
    for (int c = 0; c < nc; c++) mx = part[c * stride] > mx ? part[c * stride] : mx;
    for (int c = 0; c < nc; c++) {
        wc[c] = expf(part[c * stride] - mx);
        sum += wc[c] * part[c * stride + 1];
    }
    for (int i = 0; i < hd; i++) o[i] = 0.0f;
    for (int c = 0; c < nc; c++) {
        const float *oc = part + c * stride + 2;
        float k = wc[c] / sum;
        for (int i = 0; i < hd; i++) o[i] += k * oc[i];
    }
    const float *gate = qkv + (size_t)h * 2 * hd + hd;
    for (int i = 0; i < hd; i++) out[(size_t)h * hd + i] = o[i] / (1.0f + expf(-gate[i]));
}
#endif  /* DS_AVX2 */
