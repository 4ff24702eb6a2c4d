/* How fast this core can multiply-add int8 at all: the ceiling under the q8 kernel's many-row products.
 *
 * Three loops over data in registers or L1, no memory traffic, `threads` copies at once (OpenMP):
 *   int   - the byte products alone: maddubs then madd (or VNNI's vpdpbusd), 8 independent accumulators;
 *   block - the q8 kernel's whole step for one activation row and one block of 32 (q8w_tile in
 *           infopt_lab/kernels/q8_dot.c: the weight's sign onto the activations, the byte products, their
 *           conversion to float and one multiply-add by the block's scale), 4 rows over one weight row of 18
 *           blocks (SmolLM2's 576 inputs) as the kernel tiles them;
 *   fma   - fp32 fused multiply-adds, 10 independent accumulators (what a float GEMM could do instead).
 * Prints one line: threads, int8 multiply-adds a second, blocks a second, fp32 multiply-adds a second
 * (best of 5). Built and run by scripts/q8_batch_bound.py with the kernel's own flags.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define ACC 8
#define NB 18

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__))
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static int64_t int_loop(long iters) {
    __m256i u = _mm256_set1_epi8(3), acc[ACC], s[ACC];
    for (int i = 0; i < ACC; i++) { acc[i] = _mm256_setzero_si256(); s[i] = _mm256_set1_epi8((char)(i + 1)); }
    for (long it = 0; it < iters; it++) {
        for (int i = 0; i < ACC; i++) acc[i] = _mm256_add_epi32(acc[i], dot_u8s8(u, s[i]));
        __asm__ volatile("" : "+x"(u));        /* keep the compiler from hoisting the products out of the loop */
    }
    __m256i t = acc[0];
    for (int i = 1; i < ACC; i++) t = _mm256_add_epi32(t, acc[i]);
    return _mm256_extract_epi32(t, 0);
}

static float block_loop(long reps, const int8_t *w, const int8_t *a, const float *d) {
    __m256 acc[4];
    for (int i = 0; i < 4; i++) acc[i] = _mm256_setzero_ps();
    for (long r = 0; r < reps; r++) {
        for (int b = 0; b < NB; b++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + b * 32));
            const __m256i magnitude = _mm256_sign_epi8(wv, wv);
            for (int i = 0; i < 4; i++) {
                const __m256i av = _mm256_loadu_si256((const __m256i *)(a + (i * NB + b) * 32));
                const __m256i dot = dot_u8s8(magnitude, _mm256_sign_epi8(av, wv));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d[i * NB + b]), acc[i]);
            }
        }
        __asm__ volatile("" ::: "memory");
    }
    float out[8];
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    return out[0];
}

static float fma_loop(long iters) {
    __m256 acc[10], x = _mm256_set1_ps(1.0001f), y = _mm256_set1_ps(0.9999f);
    for (int i = 0; i < 10; i++) acc[i] = _mm256_set1_ps((float)i);
    for (long it = 0; it < iters; it++) {
        for (int i = 0; i < 10; i++) acc[i] = _mm256_fmadd_ps(x, y, acc[i]);
        __asm__ volatile("" : "+x"(x));
    }
    __m256 t = acc[0];
    for (int i = 1; i < 10; i++) t = _mm256_add_ps(t, acc[i]);
    float out[8];
    _mm256_storeu_ps(out, t);
    return out[0];
}

int main(int argc, char **argv) {
    const int nt = argc > 1 ? atoi(argv[1]) : 1;
    static int8_t w[NB * 32], a[4 * NB * 32];
    static float d[4 * NB];
    for (int i = 0; i < NB * 32; i++) w[i] = (int8_t)(i * 7 - 50);
    for (int i = 0; i < 4 * NB * 32; i++) a[i] = (int8_t)(i * 13 - 60);
    for (int i = 0; i < 4 * NB; i++) d[i] = 0.01f * (float)i;
    double best_int = 0, best_block = 0, best_fma = 0, sink = 0;
    for (int rep = 0; rep < 5; rep++) {
        const long int_iters = 20000000, block_reps = 2000000, fma_iters = 50000000;
        double t0 = now();
#pragma omp parallel num_threads(nt) reduction(+ : sink)
        sink += (double)int_loop(int_iters);
        double rate = (double)nt * int_iters * ACC * 32 / (now() - t0);
        best_int = rate > best_int ? rate : best_int;
        t0 = now();
#pragma omp parallel num_threads(nt) reduction(+ : sink)
        sink += block_loop(block_reps, w, a, d);
        rate = (double)nt * block_reps * NB * 4 / (now() - t0);
        best_block = rate > best_block ? rate : best_block;
        t0 = now();
#pragma omp parallel num_threads(nt) reduction(+ : sink)
        sink += fma_loop(fma_iters);
        rate = (double)nt * fma_iters * 10 * 8 / (now() - t0);
        best_fma = rate > best_fma ? rate : best_fma;
    }
    printf("%d %.6e %.6e %.6e %s\n", nt, best_int, best_block, best_fma, sink == 0.5 ? "!" : "");
    return 0;
}
