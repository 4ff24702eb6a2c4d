/* Quantized products for a CPU decode step: int4 or int8 weights against activations quantized to int8.
 *
 * The weights stay in the course's format (quant_format.py): int4 two per byte, low nibble first, with a
 * scale and an integer zero per group of G weights (w = (q - z) * s); int8 with one scale per output row.
 * Each call first quantizes its activations, row by row, in blocks of 32: d = max|x| / 127, a = round(x / d).
 * A block's product is then a sum of byte products, which AVX2 computes 32 at a time (_mm256_maddubs_epi16,
 * or VNNI's vpdpbusd where the CPU has it) instead of converting every weight to a float; the float work is one
 * multiply-add per block.
 * llama.cpp computes its Q4_1 x Q8_1 and Q8_0 x Q8_0 products the same way.
 *
 * Every activation row is quantized and reduced on its own, in the same order whatever the number of rows:
 * a row's result does not depend on the rows beside it (batch-invariant by construction). The weights are
 * read from memory once per call: each thread owns a band of output rows and runs every activation row over
 * a weight row while it is in cache. Built at first use by infopt_lab/cpu_q8.py, for x86 CPUs with AVX2, with
 * -ffp-contract=off: the compiler may not fuse a multiply and an add differently in the one-row and many-row
 * code it generates, so the only fused multiply-adds are the ones written here.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#ifndef __AVX2__
#error "q8_dot.c needs AVX2 and FMA (cpu_q8.py builds it only where the CPU has them)"
#endif

#define QB 32            /* activations per quantization block */
#define ROW_TILE 4       /* activation rows computed together over one weight row */
#define COL_TILE 4       /* int4: weight rows computed together for one activation row */
#define PF_ROWS 16       /* int4, one row: how many weight rows ahead q4_cols asks for the weights it will read */

/* Activations of one call, quantized: a [rows, K] int8, and per block of 32 its scale d and d times the sum
 * of its integers (ds, for the int4 zero points). For int4, each 64 values are stored in the order of the
 * nibbles of their 32 weight bytes: the even elements of both blocks, then the odd ones; dv holds each
 * pair of blocks' scales as one vector, the first block's four times, then the second's; and dsg sums ds over
 * each group of G, so the zero points come off once per group: s z (sum over the group's blocks of d sum(a)). */
typedef struct {
    int8_t *a;
    float *d, *ds, *dv, *dsg;   /* dsg [rows, K/G]: ds summed over each int4 group */
} Quantized;

static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* A block's scale and integers, eight lanes at a time: the largest magnitude is exact in any order, x * inv is
 * one fp32 multiply as in scalar code, and _mm256_cvtps_epi32 rounds half to even as lrintf does (the default
 * rounding mode), so the integers are those of the scalar loop, without a library call per element. */
static void quantize_rows(const float *x, int64_t rows, int64_t K, int int4_order, Quantized *q) {
    const int64_t nb = K / QB;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * K + b * QB;
            __m256 v[QB / 8], m = _mm256_setzero_ps();
            for (int i = 0; i < QB / 8; i++) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
            }
            const float amax = hmax(m);
            const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t ints[QB];
            for (int i = 0; i < QB / 8; i++)
                _mm256_storeu_si256((__m256i *)(ints + 8 * i),
                                    _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv))));
            int8_t *out = q->a + r * K + (b / 2) * 2 * QB;    /* this pair of blocks' 64 bytes */
            int32_t sum = 0;
            for (int i = 0; i < QB; i++) {
                const int64_t at = int4_order ? (i % 2) * QB + (b % 2) * (QB / 2) + i / 2 : (b % 2) * QB + i;
                out[at] = (int8_t)ints[i];
                sum += ints[i];
            }
            q->d[r * nb + b] = scale;
            q->ds[r * nb + b] = scale * (float)sum;
            for (int i = 0; i < 4; i++) q->dv[(r * nb + b) * 4 + i] = scale;   /* (pair, [4 x first, 4 x second]) */
        }
    }
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* Byte products summed in fours into eight int32 lanes: unsigned u times signed s. VNNI does it in one instruction
 * (vpdpbusd); elsewhere maddubs sums pairs into int16 and madd pairs those. The integers are the same: a pair
 * here is at most 2 x 128 x 127 = 32512 in magnitude (int8), so maddubs never saturates, and the int4 sum of
 * two pairs of pairs at most 4 x 15 x 127. */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define Q8_VNNI 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#else
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
#endif

static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#ifdef Q8_VNNI
    return DPBUSD(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* Two such products added: low nibbles times the even activations plus high nibbles times the odd ones. */
static inline __m256i dot2_u8s8(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#ifdef Q8_VNNI
    return DPBUSD(DPBUSD(_mm256_setzero_si256(), u0, s0), u1, s1);
#else
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)),
                             _mm256_set1_epi16(1));
#endif
}

/* The row loops below run a tile of rt activation rows over one weight row; each is inlined for every rt from
 * 1 to ROW_TILE, so the tile's accumulators stay in registers. Every row sums its blocks in the same order
 * whatever rt is: a row's result is the same alone or in a batch. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))
_Static_assert(ROW_TILE == 4 && COL_TILE == 4, "q4_rows and q8w_rows switch over tiles of 1 to 4 rows");

/* One int4 weight row's 32 bytes at pair p, unpacked: its low and high nibbles, and the scale of each of the
 * pair's two blocks (one group holds both, or each block its own). */
typedef struct { __m256i lo, hi; __m256 sv; } Q4Pair;

ALWAYS_INLINE Q4Pair q4_pair(const uint8_t *wn, const float *sn, int64_t p, int64_t bpg) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(wn + p * QB));
    const int64_t b0 = 2 * p, b1 = 2 * p + 1;
    const Q4Pair w = {_mm256_and_si256(packed, low4), _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4),
                      bpg > 1 ? _mm256_set1_ps(sn[b0 / bpg])
                              : _mm256_set_m128(_mm_set1_ps(sn[b1]), _mm_set1_ps(sn[b0]))};
    return w;
}

/* The zero points' term of one output: sum over groups g of s[n, g] z[n, g] dsg[r, g], eight groups a vector
 * (lane i sums groups i, i + 8, ...; the lanes are added as hsum adds them), then the last ng % 8 in order.
 * One output row and a many-row tile call it alike, so a row's result stays the same alone or in a batch. */
ALWAYS_INLINE float q4_zero_term(const float *sn, const uint8_t *zn, const float *dsg, int64_t ng) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8) {
        const __m256 z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(zn + g))));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(sn + g), z), _mm256_loadu_ps(dsg + g)));
    }
    float corr = hsum(acc);
    for (; g < ng; g++) corr += sn[g] * (float)zn[g] * dsg[g];
    return corr;
}

/* int4: 64 weights (32 bytes, two blocks) per step. The low nibbles are the even elements of both blocks, the
 * high nibbles the odd ones, matching the activations' order; the byte products of the two halves add as
 * int16 (at most 4 x 15 x 127 in magnitude), pair up into 8 int32 sums, four per block, each scaled by its
 * block's d times its group's s. The zero points come off after, once per group.
 * y[r, n] = sum over blocks b of s(n, b) d[r, b] dot(q, a)  -  sum over groups g of s[n, g] z[n, g] dsg[r, g] */
ALWAYS_INLINE void q4_tile(const Quantized *q, int64_t r0, const int rt, int64_t K, const uint8_t *wn,
                           const float *sn, const uint8_t *zn, int64_t G, int64_t n, int64_t N, float *y) {
    const int64_t nb = K / QB, np = K / (2 * QB), ng = K / G, bpg = G / QB;
    __m256 acc[ROW_TILE];
    for (int i = 0; i < rt; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        const Q4Pair w = q4_pair(wn, sn, p, bpg);
        for (int i = 0; i < rt; i++) {
            const int64_t r = r0 + i;
            const int8_t *ap = q->a + r * K + p * 2 * QB;
            const __m256i dot = dot2_u8s8(w.lo, _mm256_loadu_si256((const __m256i *)ap),
                                          w.hi, _mm256_loadu_si256((const __m256i *)(ap + QB)));
            const __m256 f = _mm256_mul_ps(_mm256_loadu_ps(q->dv + (r * nb + 2 * p) * 4), w.sv);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), f, acc[i]);
        }
    }
    for (int i = 0; i < rt; i++)
        y[(r0 + i) * N + n] = hsum(acc[i]) - q4_zero_term(sn, zn, q->dsg + (r0 + i) * ng, ng);
}

/* One activation row (a decode step's one token) over nc weight rows at once: nc independent accumulators, where
 * one weight row at a time waits on its fused multiply-add at every step, and the activations loaded once for
 * all nc. Each output's operations are q4_tile's for one row, in the same order: the same result, bit for bit.
 * One token over a SmolLM2-sized stack of int4 weights (67 MB, 2 threads, a 2-core Intel Xeon, native build):
 * 0.68-0.79x the time of one weight row at a time; built for AVX2 only (-march=haswell) on the same CPU, 1.02-1.04x
 * (scripts/q8_kernel_ab.py measures both). int8 keeps one row at a time: tiled, it took 1.03-1.04x.
 * A weight row of K = 576 is 288 bytes, under five cache lines, so a tile reads four short streams at once and
 * the hardware prefetcher lags behind them; asking for the lines PF_ROWS rows ahead took the same stack 0.77-0.85x
 * the time on a 2-core AMD EPYC (Zen 1, AVX2; 2 threads; 0.87x with 1), results bit for bit the same. The
 * many-row tiles compute more per byte: prefetching there changed nothing (0.99-1.00x at 4 and 8 rows). */
ALWAYS_INLINE void q4_cols(const Quantized *q, int64_t r, const int nc, int64_t K, const uint8_t *w,
                           const float *scales, const uint8_t *zeros, int64_t G, int64_t n, int64_t N, float *y) {
    const int64_t nb = K / QB, np = K / (2 * QB), ng = K / G, bpg = G / QB;
    __m256 acc[COL_TILE];
    for (int j = 0; j < nc; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        const int8_t *ap = q->a + r * K + p * 2 * QB;
        const __m256i a_even = _mm256_loadu_si256((const __m256i *)ap);
        const __m256i a_odd = _mm256_loadu_si256((const __m256i *)(ap + QB));
        const __m256 dv = _mm256_loadu_ps(q->dv + (r * nb + 2 * p) * 4);
        if (p % 2 == 0 && n + PF_ROWS + nc <= N)            /* one cache line of each row, PF_ROWS rows on */
            for (int j = 0; j < nc; j++)
                _mm_prefetch((const char *)(w + (n + j + PF_ROWS) * (K / 2) + p * QB), _MM_HINT_T0);
        for (int j = 0; j < nc; j++) {
            const Q4Pair wj = q4_pair(w + (n + j) * (K / 2), scales + (n + j) * ng, p, bpg);
            const __m256i dot = dot2_u8s8(wj.lo, a_even, wj.hi, a_odd);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dv, wj.sv), acc[j]);
        }
    }
    for (int j = 0; j < nc; j++)
        y[r * N + n + j] = hsum(acc[j]) - q4_zero_term(scales + (n + j) * ng, zeros + (n + j) * ng,
                                                        q->dsg + r * ng, ng);
}

static void q4_rows(const Quantized *q, int64_t rows, int64_t K, const uint8_t *w, const float *scales,
                    const uint8_t *zeros, int64_t G, int64_t n0, int64_t n1, int64_t N, float *y) {
    const int64_t ng = K / G;
    if (rows == 1) {                                                    /* one token: weight rows in tiles */
        for (int64_t n = n0; n < n1; n += COL_TILE) {
            switch (n1 - n < COL_TILE ? n1 - n : COL_TILE) {
                case 4: q4_cols(q, 0, 4, K, w, scales, zeros, G, n, N, y); break;
                case 3: q4_cols(q, 0, 3, K, w, scales, zeros, G, n, N, y); break;
                case 2: q4_cols(q, 0, 2, K, w, scales, zeros, G, n, N, y); break;
                default: q4_cols(q, 0, 1, K, w, scales, zeros, G, n, N, y); break;
            }
        }
        return;
    }
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wn = w + n * (K / 2);
        const float *sn = scales + n * ng;
        const uint8_t *zn = zeros + n * ng;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            switch (rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE) {
                case 4: q4_tile(q, r0, 4, K, wn, sn, zn, G, n, N, y); break;
                case 3: q4_tile(q, r0, 3, K, wn, sn, zn, G, n, N, y); break;
                case 2: q4_tile(q, r0, 2, K, wn, sn, zn, G, n, N, y); break;
                default: q4_tile(q, r0, 1, K, wn, sn, zn, G, n, N, y); break;
            }
        }
    }
}

/* int8: 32 weights per step; maddubs takes unsigned bytes first, so |w| times a with w's sign.
 * y[r, n] = scale[n] * sum over blocks b of d[r, b] dot(w[n, b], a[r, b]) */
ALWAYS_INLINE void q8w_tile(const Quantized *q, int64_t r0, const int rt, int64_t K, const int8_t *wn, float scale,
                            int64_t n, int64_t N, float *y) {
    const int64_t nb = K / QB;
    __m256 acc[ROW_TILE];
    for (int i = 0; i < rt; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(wn + b * QB));
        const __m256i magnitude = _mm256_sign_epi8(wv, wv);   /* |w| as unsigned bytes (-128 -> 128) */
        for (int i = 0; i < rt; i++) {
            const int64_t r = r0 + i;
            const __m256i av = _mm256_loadu_si256((const __m256i *)(q->a + r * K + b * QB));
            const __m256i signed_a = _mm256_sign_epi8(av, wv);  /* a with w's sign, 0 where w is 0 */
            const __m256i dot = dot_u8s8(magnitude, signed_a);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(q->d[r * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < rt; i++) y[(r0 + i) * N + n] = scale * hsum(acc[i]);
}

static void q8w_rows(const Quantized *q, int64_t rows, int64_t K, const int8_t *w, const float *scales,
                     int64_t n0, int64_t n1, int64_t N, float *y) {
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *wn = w + n * K;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            switch (rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE) {
                case 4: q8w_tile(q, r0, 4, K, wn, scales[n], n, N, y); break;
                case 3: q8w_tile(q, r0, 3, K, wn, scales[n], n, N, y); break;
                case 2: q8w_tile(q, r0, 2, K, wn, scales[n], n, N, y); break;
                default: q8w_tile(q, r0, 1, K, wn, scales[n], n, N, y); break;
            }
        }
    }
}

/* Output rows per thread band: whole bands of 16 rows, so threads never share a cache line of y. */
static void band(int64_t N, int t, int nt, int64_t *n0, int64_t *n1) {
    const int64_t chunks = (N + 15) / 16, per = (chunks + nt - 1) / nt;
    *n0 = t * per * 16 < N ? t * per * 16 : N;
    *n1 = (t + 1) * per * 16 < N ? (t + 1) * per * 16 : N;
}

static int quantized_alloc(Quantized *q, int64_t rows, int64_t K, int64_t G) {
    const size_t nb = (size_t)(rows * (K / QB));
    q->a = malloc((size_t)(rows * K));
    q->d = malloc(sizeof(float) * nb);
    q->ds = malloc(sizeof(float) * nb);
    q->dv = malloc(sizeof(float) * nb * 4);
    q->dsg = malloc(sizeof(float) * (size_t)(rows * (K / G)));
    return q->a && q->d && q->ds && q->dv && q->dsg ? 0 : -1;
}

static void quantized_free(Quantized *q) { free(q->a); free(q->d); free(q->ds); free(q->dv); free(q->dsg); }

static void group_sums(Quantized *q, int64_t rows, int64_t K, int64_t G) {
    const int64_t nb = K / QB, ng = K / G, bpg = G / QB;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < ng; g++) {
            float sum = 0.0f;
            for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) sum += q->ds[r * nb + b];
            q->dsg[r * ng + g] = sum;
        }
}

/* x [rows, K] fp32, w [N, K/2] packed int4, scales [N, K/G] fp32, zeros [N, K/G] uint8 -> y [rows, N] fp32.
 * K must be a multiple of 64, G a multiple of 32 dividing K. Returns 0, or -1 if scratch memory ran out. */
int q4_linear(const float *x, int64_t rows, int64_t K, const uint8_t *w, const float *scales,
              const uint8_t *zeros, int64_t N, int64_t G, float *y, int nthreads) {
    Quantized q;
    if (quantized_alloc(&q, rows, K, G)) { quantized_free(&q); return -1; }
    quantize_rows(x, rows, K, 1, &q);
    group_sums(&q, rows, K, G);
    const int nt = nthreads > 0 ? nthreads : 1;
#pragma omp parallel for num_threads(nt) schedule(static, 1)
    for (int t = 0; t < nt; t++) {
        int64_t n0, n1;
        band(N, t, nt, &n0, &n1);
        q4_rows(&q, rows, K, w, scales, zeros, G, n0, n1, N, y);
    }
    quantized_free(&q);
    return 0;
}

/* x [rows, K] fp32, w [N, K] int8, scales [N] fp32 -> y [rows, N] fp32. K must be a multiple of 32. */
int q8w_linear(const float *x, int64_t rows, int64_t K, const int8_t *w, const float *scales, int64_t N,
               float *y, int nthreads) {
    Quantized q;
    if (quantized_alloc(&q, rows, K, QB)) { quantized_free(&q); return -1; }
    quantize_rows(x, rows, K, 0, &q);
    const int nt = nthreads > 0 ? nthreads : 1;
#pragma omp parallel for num_threads(nt) schedule(static, 1)
    for (int t = 0; t < nt; t++) {
        int64_t n0, n1;
        band(N, t, nt, &n0, &n1);
        q8w_rows(&q, rows, K, w, scales, n0, n1, N, y);
    }
    quantized_free(&q);
    return 0;
}
