/* attention_decode.c: a gated attention layer's step in the one-call decode: each sequence's new k and v written
 * into its cache, then every query head over the cache (scores and softmax in f32, the output gated by the sigmoid of
 * its gate). The cache is f32 [nkv, cap, hd] per layer and sequence (decode.c hands in its rows); a cache of another
 * type adds its own writer (attn_prepare's last loops) and reader (attn_head's two passes over keys and values)
 * here, chosen by the cache's type the way products.c chooses a weight type's product. */
#include <math.h>

#include "attention_decode.h"
#include "rowops.h"
#include "vmath.h"

#ifdef DS_AVX2

/* q/k RMS norm per head, rotary embedding (rotate-half over the first `rotary` dims) at rotary position `rpos`, k
 * and v written at `pos` of the caches [nkv, cap, hd]; the rotated queries to qout [nh, hd]. Serial. (rpos is pos
 * for text; after an image the positions fall behind the cache index: vision/span.py.) */
void attn_prepare(const model_t *m, const layer_t *L, const float *qkv, float *kc, float *vc, int pos,
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
        const float *src = is_q ? qkv + (size_t)h * 2 * hd : kin + (size_t)(h - nh) * hd;
        float *dst = is_q ? qout + (size_t)h * hd : kc + ((size_t)(h - nh) * cap + pos) * hd;
        float t[hd];
        rms_norm_row(src, is_q ? L->q_norm : L->k_norm, t, hd, m->eps);
        for (int i = 0; i < half; i++) {
            dst[i] = t[i] * cs[i] - t[i + half] * sn[i];
            dst[i + half] = t[i + half] * cs[i] + t[i] * sn[i];
        }
        for (int i = r; i < hd; i++) dst[i] = t[i];
    }
    for (int h = 0; h < nkv; h++)
        for (int i = 0; i < hd; i++) vc[((size_t)h * cap + pos) * hd + i] = vin[(size_t)h * hd + i];
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
#endif  /* DS_AVX2 */
