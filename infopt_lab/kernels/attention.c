/* One new token's attention over a contiguous KV cache, for a compiled CPU decode step (compiled.py's
 * StaticLayer): infopt::one_query_attention in q8_ops.cpp calls it.
 *
 * A static cache attends over all of its positions under a mask, so that one compiled graph serves every
 * length; the loops inductor writes for it run over every position, visible or not, with one accumulator per
 * output, and on SmolLM2 cost tens of microseconds a layer. Here only the n visible positions are read (the
 * masked ones would add exp(-inf) = 0): per query head, the n scores q . k_j / sqrt(D) with eight lanes at a
 * time, their softmax, and the sum of the value rows weighted by it, eight lanes of the output at a time.
 * Query head h reads key-value head h / (H / H_kv), as PyTorch's enable_gqa does. Each head is computed on its
 * own, in the same order whatever the batch: a row's result does not depend on the rows beside it.
 * Built with q8_dot.c's flags (-ffp-contract=off: the multiply-adds are the ones written here).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#ifndef __AVX2__
#error "attention.c needs AVX2 and FMA (cpu_q8.py builds it only where the CPU has them)"
#endif

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline float dot(const float *a, const float *b, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    float sum = hsum8(acc);
    for (; d < D; d++) sum += a[d] * b[d];
    return sum;
}

/* out[d] += w * row[d] */
static inline void axpy(float *out, float w, const float *row, int64_t D) {
    const __m256 wv = _mm256_set1_ps(w);
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(out + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(row + d), _mm256_loadu_ps(out + d)));
    for (; d < D; d++) out[d] += w * row[d];
}

static void one_head(const float *qh, const float *kh, const float *vh, int64_t D, int64_t n, float scale,
                     float *s, float *o) {
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        s[j] = dot(qh, kh + j * D, D) * scale;
        m = s[j] > m ? s[j] : m;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    for (int64_t j = 0; j < n; j++) axpy(o, s[j], vh + j * D, D);
    for (int64_t d = 0; d < D; d++) o[d] /= sum;
}

/* q [B, H, D], k and v [B, H_kv, S, D], fp32 and contiguous; positions 0 .. n-1 visible (1 <= n <= S);
 * scores: scratch of B * H * n floats; out [B, H, D]. Threads only where the work outweighs starting them. */
void one_query_attention(const float *q, const float *k, const float *v, int64_t B, int64_t H, int64_t Hkv,
                         int64_t S, int64_t D, int64_t n, float scale, float *scores, float *out, int nthreads) {
    const int64_t group = H / Hkv;
    const int nt = nthreads > 1 && B * H * n * D >= (1 << 17) ? nthreads : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, kv = (bh % H) / group;
        const float *kh = k + (b * Hkv + kv) * S * D, *vh = v + (b * Hkv + kv) * S * D;
        one_head(q + bh * D, kh, vh, D, n, scale, scores + bh * n, out + bh * D);
    }
}
