/* Few-row float32 matrix products on the CPU over weights packed in 16-column panels.
 *
 *   y[r, n] = sum_k x[r, k] * W[n, k] (+ b[n])      x [R, K], W [N, K], y [R, N], R small (1-64)
 *
 * Decoding multiplies 1-64 rows by every weight matrix of the model, and the BLAS gemm kernels are
 * tuned for many rows: a 16-row product over SmolLM2-135M's weights took 51 ms through oneDNN on the
 * development machine, against a memory floor of 12 ms (bastion/kernels/cpu_native.py has the
 * table). Here W is re-laid out once as panels Wp [ceil(N/16), K, 16] (16 consecutive outputs per k,
 * zero padded), so a panel is one sequential stream and each k step is two 8-float vector loads of W
 * and one FMA per row into 16 accumulators per row: no horizontal sums, and each W element, once
 * loaded, serves up to RB rows; the panel is prefetched 2 KB ahead of the FMAs.
 *
 * Every output element is summed in the same order (k ascending, one accumulator lane per output)
 * whatever R is, so a row's result does not depend on which other rows share the call: a tree
 * verification and plain decoding compute bit-identical logits for the same hidden state.
 *
 * Compiled at run time by bastion/kernels/cpu_native.py (cc -O3 -march=native -fopenmp); GCC's
 * vector extensions lower to AVX2/AVX-512 or whatever the machine has. The OpenMP runtime is the
 * one torch already loaded (same soname), so torch's thread count is passed in explicitly.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif
#if defined(__AVX512BF16__) || defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32), aligned(4))); /* 8 floats, unaligned access */

#define P 16 /* outputs per panel */
#ifdef __AVX512F__
#define RB 12 /* rows per pass: 2·RB accumulators + 3 registers must fit in the 32 vector registers */
#else
#define RB 6 /* 16 registers (AVX2) */
#endif

int bastion_gemm_panel(void) { return P; }

/* W [N, K] row-major -> Wp [ceil(N/16), K, 16], zero padded. */
void bastion_pack_f32(const float *w, int64_t N, int64_t K, float *wp, int nthreads) {
    int64_t np = (N + P - 1) / P;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t p = 0; p < np; p++) {
        float *dst = wp + p * K * P;
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < P; j++) {
                int64_t n = p * P + j;
                dst[k * P + j] = n < N ? w[n * K + k] : 0.f;
            }
    }
}

/* The weights of a panel row k as two 8-float vectors: float32 panels as they are; bf16 ones
 * (uint16, the float's upper half) widened in registers - a shift, exact - so the FMAs and their
 * order are the same as the float32 kernel's. */
typedef uint16_t vh8 __attribute__((vector_size(16), aligned(2)));
typedef int32_t vw8 __attribute__((vector_size(32), aligned(4)));
static inline __attribute__((always_inline)) void load_f32(const float *w, v8 *w0, v8 *w1) {
    *w0 = *(const v8 *)w;
    *w1 = *(const v8 *)(w + 8);
}
static inline __attribute__((always_inline)) void load_h16(const uint16_t *w, v8 *w0, v8 *w1) {
    *w0 = (v8)(__builtin_convertvector(*(const vh8 *)w, vw8) << 16);
    *w1 = (v8)(__builtin_convertvector(*(const vh8 *)(w + 8), vw8) << 16);
}

/* rr rows (x rows ldx floats apart; ldx = 0 repeats one row) times one panel; the first `keep`
 * rows are stored. always_inline + constant rr from the switch below unrolls the row loops.
 * Defined once per weight type (float32 panels; bf16 panels for drafters on CPUs without
 * AVX512-BF16): the prefetch asks for the line 2 KB ahead either way. */
#define DEFINE_PANEL(NAME, WT, LOAD)                                                               \
static inline __attribute__((always_inline)) void                                                 \
NAME(const float *x, int64_t ldx, int rr, int keep, const WT *wp, int64_t K, const float *b,       \
     float *y, int64_t N, int64_t n0) {                                                            \
    v8 acc[RB][2];                                                                                 \
    for (int i = 0; i < rr; i++) acc[i][0] = acc[i][1] = (v8){0};                                  \
    for (int64_t k = 0; k < K; k++) {                                                              \
        __builtin_prefetch(wp + (k + 2048 / (P * sizeof(WT))) * P);                               \
        v8 w0, w1;                                                                                 \
        LOAD(wp + k * P, &w0, &w1);                                                                \
        for (int i = 0; i < rr; i++) {                                                             \
            float xv = x[i * ldx + k];                                                             \
            v8 xb = {xv, xv, xv, xv, xv, xv, xv, xv};                                              \
            acc[i][0] += w0 * xb;                                                                  \
            acc[i][1] += w1 * xb;                                                                  \
        }                                                                                          \
    }                                                                                              \
    int64_t m = N - n0 < P ? N - n0 : P;                                                           \
    for (int i = 0; i < keep; i++) {                                                               \
        float out[P];                                                                              \
        memcpy(out, &acc[i][0], sizeof(v8));                                                       \
        memcpy(out + 8, &acc[i][1], sizeof(v8));                                                   \
        if (b)                                                                                     \
            for (int j = 0; j < m; j++) out[j] += b[n0 + j];                                       \
        memcpy(y + i * N + n0, out, (size_t)m * sizeof(float));                                    \
    }                                                                                              \
}
DEFINE_PANEL(panel, float, load_f32)
DEFINE_PANEL(panel_h16, uint16_t, load_h16)

#define CASE(n) case n: PANEL(xr, K, n, n, wpp, K, b, yr, N, n0); break;

/* Rows in the next pass when `left` rows remain for `passes` passes: passes are equal (16 rows as
 * 8 + 8, not 12 + 4: a short last pass reuses each W load little), at most `most`. */
static inline int pass_rows(int64_t left, int64_t passes, int most) {
    int64_t rr = left / passes;
    return (int)(rr > most ? most : rr);
}

/* y [R, N] = x [R, K] times the panels (+ b): passes of up to RB rows over each panel, the panels
 * split between threads; one row runs as two copies of itself (two independent accumulator chains
 * per output; measured 17 vs 13.5 ms for the whole model), and passes are equal (pass_rows). Small
 * products stay on one thread. */
#define DEFINE_GEMM(NAME, WT)                                                                      \
void NAME(const float *x, int64_t R, const WT *wp, int64_t N, int64_t K,                           \
          const float *b, float *y, int nthreads) {                                                \
    int64_t np = (N + P - 1) / P;                                                                  \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (np * K * R > 32768)")     \
    for (int64_t p = 0; p < np; p++) {                                                             \
        const WT *wpp = wp + p * K * P;                                                            \
        int64_t n0 = p * P;                                                                        \
        if (R == 1) {                                                                              \
            PANEL(x, 0, 2, 1, wpp, K, b, y, N, n0);                                                \
            continue;                                                                              \
        }                                                                                          \
        int64_t npass = (R + RB - 1) / RB;                                                         \
        for (int64_t pass = 0, r0 = 0; pass < npass; pass++) {                                     \
            int rr = pass_rows(R - r0, npass - pass, RB);                                          \
            const float *xr = x + r0 * K;                                                          \
            float *yr = y + r0 * N;                                                                \
            switch (rr) {                                                                          \
                CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)                                    \
                CASES_OVER_6                                                                       \
            }                                                                                      \
            r0 += rr;                                                                              \
        }                                                                                          \
    }                                                                                              \
}
#if RB > 6
#define CASES_OVER_6 CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#else
#define CASES_OVER_6
#endif

#define PANEL panel
DEFINE_GEMM(bastion_gemm_f32, float)
#undef PANEL
#define PANEL panel_h16
/* bf16 weights, float32 inputs and sums: a drafter's products on CPUs without AVX512-BF16 (half
 * the bytes of the float32 panels; each weight widened exactly, so the result is the float32
 * product of the bf16-rounded weight). Panels [ceil(N/16), K, 16] of uint16. */
DEFINE_GEMM(bastion_gemm_h16, uint16_t)
#undef PANEL

/* rr rows times KC-input chunk of a decoded panel, the accumulators carried in memory between chunks
 * (exact: stored and reloaded as they are), so each output's FMAs keep the float32 kernel's k order.
 * The same `acc += w * x` as `panel`, compiled with contraction as it is. */
#define KC 128 /* inputs per decoded chunk: 128 × 16 floats = 8 KB, in L1 with the rows' inputs */
#if defined(__AVX512F__)
/* With AVX-512 a decoded chunk row (16 outputs) is one 512-bit vector and up to CRB rows' accumulators
 * stay in registers (acc[i][0..1] is the same 64 bytes): 17-64 rows ~10% faster than 12-row passes of
 * two 256-bit halves (the embedded target's 211 products, session 24: 17 rows 26.4 -> 23.1 ms, 32
 * rows 43.8 -> 39.4, 64 rows 84.7 -> 76.2); 22 or 24 rows a pass spill and lose. */
typedef float v16c __attribute__((vector_size(64), aligned(4)));
#define CRB 16
static inline __attribute__((always_inline)) void
chunk_pass(const float *x, int64_t ldx, int rr, const float *wc, int kc, v8 (*acc)[2]) {
    v16c a[CRB];
    for (int i = 0; i < rr; i++) memcpy(&a[i], acc[i], sizeof(v16c));
    for (int k = 0; k < kc; k++) {
        v16c w = *(const v16c *)(wc + k * P);
        for (int i = 0; i < rr; i++) {
            float xv = x[i * ldx + k];
            a[i] += w * xv;
        }
    }
    for (int i = 0; i < rr; i++) memcpy(acc[i], &a[i], sizeof(v16c));
}
#else
#define CRB RB
static inline __attribute__((always_inline)) void
chunk_pass(const float *x, int64_t ldx, int rr, const float *wc, int kc, v8 (*acc)[2]) {
    v8 a[RB][2];
    for (int i = 0; i < rr; i++) a[i][0] = acc[i][0], a[i][1] = acc[i][1];
    for (int k = 0; k < kc; k++) {
        v8 w0, w1;
        load_f32(wc + k * P, &w0, &w1);
        for (int i = 0; i < rr; i++) {
            float xv = x[i * ldx + k];
            v8 xb = {xv, xv, xv, xv, xv, xv, xv, xv};
            a[i][0] += w0 * xb;
            a[i][1] += w1 * xb;
        }
    }
    for (int i = 0; i < rr; i++) acc[i][0] = a[i][0], acc[i][1] = a[i][1];
}
#endif
#define CCASE(n) case n: chunk_pass(xr, K, n, wc, kc, acc + r0); break;

/* Panel p of a compressed weight for many rows: groups of up to 64 rows; per group, chunks of KC
 * inputs decoded into an L1 buffer (DECODE(blocks, count, buffer)), each chunk run by passes of up to
 * RB rows over it. */
#define DEFINE_CHUNKED(NAME, WT, BYTES, DECODE)                                                    \
static __attribute__((noinline)) void NAME(const float *x, int64_t R, const WT *wp, int64_t p, int64_t K, \
                                           const float *b, float *y, int64_t N) {                  \
    v8 acc[64][2];                                                                                 \
    float wc[KC * P] __attribute__((aligned(64)));                                                 \
    int64_t nb = K / QB;                                                                           \
    const WT *src = wp + p * nb * BYTES;                                                           \
    for (int64_t g0 = 0; g0 < R; g0 += 64) {                                                       \
        int64_t G = R - g0 < 64 ? R - g0 : 64;                                                     \
        for (int64_t i = 0; i < G; i++) acc[i][0] = acc[i][1] = (v8){0};                           \
        for (int64_t kb = 0; kb < nb; kb += KC / QB) {                                             \
            int64_t nblk = nb - kb < KC / QB ? nb - kb : KC / QB;                                  \
            int kc = (int)(nblk * QB);                                                             \
            DECODE(src + kb * BYTES, nblk, wc);                                                    \
            int64_t npass = (G + CRB - 1) / CRB;                                                   \
            for (int64_t pass = 0, r0 = 0; pass < npass; pass++) {                                 \
                int rr = pass_rows(G - r0, npass - pass, CRB);                                     \
                const float *xr = x + (g0 + r0) * K + kb * QB;                                     \
                switch (rr) {                                                                      \
                    CCASE(1) CCASE(2) CCASE(3) CCASE(4) CCASE(5) CCASE(6)                          \
                    CCASES_OVER_6                                                                  \
                }                                                                                  \
                r0 += rr;                                                                          \
            }                                                                                      \
        }                                                                                          \
        for (int64_t i = 0; i < G; i++) store_row(acc[i][0], acc[i][1], b, y + (g0 + i) * N, N, p * P); \
    }                                                                                              \
}
#if CRB > 12
#define CCASES_OVER_6 CCASE(7) CCASE(8) CCASE(9) CCASE(10) CCASE(11) CCASE(12) CCASE(13) CCASE(14) CCASE(15) \
    CCASE(16)
#elif RB > 6
#define CCASES_OVER_6 CCASE(7) CCASE(8) CCASE(9) CCASE(10) CCASE(11) CCASE(12)
#else
#define CCASES_OVER_6
#endif

static inline __attribute__((always_inline)) void store_row(v8 a0, v8 a1, const float *b, float *y, int64_t N,
                                                            int64_t n0) {
    float out[P];
    memcpy(out, &a0, sizeof(v8));
    memcpy(out + 8, &a1, sizeof(v8));
    int64_t m = N - n0 < P ? N - n0 : P;
    for (int j = 0; j < m; j++) y[n0 + j] = b ? out[j] + b[n0 + j] : out[j];
}

/* ---------------------------------------------------------------------------------------------
 * Exact compressed weights: float32 products over weights stored in 4 or 8 bits, bit for bit.
 *
 * A model dequantised from a llama.cpp file holds float32 weights that take few values: the
 * embedded SmolLM2's 210 matrices come from Q4_1 blocks (per 32 inputs of an output, w = d·q + m,
 * q in 0..15, d and m half floats, each product and the sum rounded to float32 - gguf's numpy
 * dequantisation) and its tied embedding / LM head from Q8_0 (w = d·q, q in -128..127). The pack
 * functions recover d, m and q for every block of 32 inputs and keep the matrix only when decoding
 * gives back every weight bit for bit; they return 0 when the packed copy is exact. The product
 * decodes the weights as it goes (in registers for up to 16 rows with AVX-512, 12 with AVX2 + FMA,
 * through L1
 * chunks for more) and multiplies them as the float32 kernel does: the same weights, the same FMAs in
 * the same order, so the same bits as the float32 panels - from 0.75 (Q4_1) or 1.125 (Q8_0) bytes a
 * weight instead of 4.
 * At one row the float32 product streams 4 bytes a weight from memory and waits on it (~25 ms of a
 * ~35 ms step of the embedded target on the Zen 3); decoding costs a few instructions per 16 weights.
 *
 * Layouts, per panel of 16 outputs and block of 32 inputs (panels [ceil(N/16), K/32, bytes]):
 *   Q4: d[16], m[16] float32, then 32 × 8 bytes: input k's byte j holds output j (low nibble) and
 *       output j + 8 (high nibble)                                           - 384 bytes / 512 weights
 *   Q8: d[16] float32, then 32 × 16 int8: input k's 16 outputs                - 576 bytes / 512 weights
 * Padding outputs (N not a multiple of 16) decode to zero. K must be a multiple of 32.
 */
#define QB 32
#define Q4_BYTES (2 * P * 4 + QB * P / 2)
#define Q8_BYTES (P * 4 + QB * P)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#if defined(__clang__)
#define QNO_CONTRACT _Pragma("clang fp contract(off)")
#else
#define QNO_CONTRACT
#endif
typedef uint8_t vb8 __attribute__((vector_size(8), aligned(1)));
typedef int8_t vc8 __attribute__((vector_size(8), aligned(1)));
/* 8 bytes widened to 8 int32 lanes: one VPMOVZXBD / VPMOVSXBD with AVX2 (GCC's generic conversion
 * of an 8-byte vector goes byte by byte through scalar registers: 3× slower decoding) */
static inline __attribute__((always_inline)) vw8 widen_u8(const uint8_t *p) {
#ifdef __AVX2__
    return (vw8)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    return __builtin_convertvector(*(const vb8 *)p, vw8);
#endif
}
static inline __attribute__((always_inline)) v8 widen_s8(const int8_t *p) {
#ifdef __AVX2__
    return __builtin_convertvector((vw8)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)), v8);
#else
    return __builtin_convertvector(*(const vc8 *)p, v8);
#endif
}

#define AHEAD 4 /* blocks of 32 inputs (~600 cycles of decoding): DRAM latency is ~100 ns */
typedef float v8a __attribute__((vector_size(32), aligned(4), may_alias)); /* a v8 read from bytes */

static int same_bits(float a, float b) {
    uint32_t x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    return x == y;
}

/* f rounded to the nearest half float (ties to even), as a float; f finite, |f| < 65504. */
static float round_half(float f) {
    if (fabsf(f) < 6.103515625e-05f) /* below 2^-14: half floats are multiples of 2^-24 */
        return nearbyintf(f * 16777216.f) / 16777216.f;
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0xFFFu + ((u >> 13) & 1u)) & ~0x1FFFu;
    memcpy(&f, &u, 4);
    return f;
}

/* One output's 32 weights as Q4_1: d, m and the 32 q, or 0 when no d among the candidates decodes
 * them exactly. m is the block's least weight (its q is 0, and fl(d·0) + m = m); d is tried as the
 * half float nearest (max - min) / t for the largest code t = 15, then 14..12 (a block whose largest
 * weight rounded to a smaller code). */
static int fit_q4(const float *w, float *d, float *m, uint8_t *q) {
    QNO_CONTRACT
    float lo = w[0], hi = w[0];
    for (int i = 1; i < QB; i++) {
        lo = w[i] < lo ? w[i] : lo;
        hi = w[i] > hi ? w[i] : hi;
    }
    if (!isfinite(lo) || !isfinite(hi) || fabsf(hi - lo) >= 65504.f * 12)
        return 0;
    *m = lo;
    for (int t = 15; t >= 12; t--) {
        float dd = hi == lo ? 0.f : round_half((hi - lo) / (float)t);
        int ok = 1;
        for (int i = 0; i < QB && ok; i++) {
            float c = dd > 0.f ? nearbyintf((w[i] - lo) / dd) : 0.f;
            c = c < 0.f ? 0.f : c > 15.f ? 15.f : c;
            float prod = dd * c;
            ok = same_bits(prod + lo, w[i]);
            q[i] = (uint8_t)c;
        }
        if (ok) {
            *d = dd;
            return 1;
        }
        if (hi == lo)
            break;
    }
    return 0;
}

/* One output's 32 weights as Q8_0 (w = fl(d·q)): d the half float nearest max|w| / t, t = 127..125. */
static int fit_q8(const float *w, float *d, int8_t *q) {
    QNO_CONTRACT
    float amax = 0.f;
    for (int i = 0; i < QB; i++) {
        if (!isfinite(w[i]))
            return 0;
        amax = fabsf(w[i]) > amax ? fabsf(w[i]) : amax;
    }
    if (amax >= 65504.f * 125)
        return 0;
    for (int t = 127; t >= 125; t--) {
        float dd = amax == 0.f ? 0.f : round_half(amax / (float)t);
        int ok = 1;
        for (int i = 0; i < QB && ok; i++) {
            float c = dd > 0.f ? nearbyintf(w[i] / dd) : 0.f;
            c = c < -128.f ? -128.f : c > 127.f ? 127.f : c;
            ok = same_bits(dd * c, w[i]);
            q[i] = (int8_t)c;
        }
        if (ok) {
            *d = dd;
            return 1;
        }
        if (amax == 0.f)
            break;
    }
    return 0;
}

/* W [N, K] -> Q4 panels [ceil(N/16), K/32, 384]; returns 0 when every (output, block) pair is exactly
 * Q4_1 (the copy is usable only then), else 1 - as soon as one pair is not: the threads skip their
 * remaining panels, so a weight of any other kind (a hub model's) costs little at load. K % 32 == 0
 * (the caller checks). */
int64_t bastion_pack_q4(const float *w, int64_t N, int64_t K, uint8_t *out, int nthreads) {
    int64_t np = (N + P - 1) / P, nb = K / QB;
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t p = 0; p < np; p++)
        for (int64_t kb = 0; kb < nb && !__atomic_load_n(&bad, __ATOMIC_RELAXED); kb++) {
            uint8_t *blk = out + (p * nb + kb) * Q4_BYTES;
            float d[P], m[P];
            uint8_t *qs = blk + 2 * P * 4;
            memset(qs, 0, QB * P / 2);
            for (int j = 0; j < P; j++) {
                int64_t n = p * P + j;
                uint8_t q[QB];
                d[j] = m[j] = 0.f;
                if (n >= N)
                    continue;
                if (!fit_q4(w + n * K + kb * QB, &d[j], &m[j], q)) {
                    __atomic_store_n(&bad, 1, __ATOMIC_RELAXED);
                    break;
                }
                for (int k = 0; k < QB; k++)
                    qs[k * 8 + (j & 7)] |= (uint8_t)(q[k] << (4 * (j >> 3)));
            }
            memcpy(blk, d, sizeof d);
            memcpy(blk + P * 4, m, sizeof m);
        }
    return bad;
}

/* W [N, K] -> Q8 panels [ceil(N/16), K/32, 576]; returns 0 when every block is exactly Q8_0, else 1
 * (stopping early, as bastion_pack_q4). */
int64_t bastion_pack_q8(const float *w, int64_t N, int64_t K, int8_t *out, int nthreads) {
    int64_t np = (N + P - 1) / P, nb = K / QB;
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t p = 0; p < np; p++)
        for (int64_t kb = 0; kb < nb && !__atomic_load_n(&bad, __ATOMIC_RELAXED); kb++) {
            int8_t *blk = out + (p * nb + kb) * Q8_BYTES;
            float d[P];
            int8_t *qs = blk + P * 4;
            memset(qs, 0, QB * P);
            for (int j = 0; j < P; j++) {
                int64_t n = p * P + j;
                int8_t q[QB];
                d[j] = 0.f;
                if (n >= N)
                    continue;
                if (!fit_q8(w + n * K + kb * QB, &d[j], q)) {
                    __atomic_store_n(&bad, 1, __ATOMIC_RELAXED);
                    break;
                }
                for (int k = 0; k < QB; k++)
                    qs[k * P + j] = q[k];
            }
            memcpy(blk, d, sizeof d);
        }
    return bad;
}

/* Decode n consecutive Q4 / Q8 blocks (one panel, 32 inputs each) into the float32 panel layout
 * [32·n, 16]: w = (d·q) + m and w = d·q, each product and sum rounded as gguf's numpy rounds them
 * (fp-contract is off in this region, and the functions are not inlined into code compiled with it). */
static __attribute__((noinline)) void decode_q4(const uint8_t *src, int64_t n, float *dst) {
    QNO_CONTRACT
    for (int64_t kb = 0; kb < n; kb++, src += Q4_BYTES, dst += QB * P) {
        v8 d0 = *(const v8a *)src, d1 = *(const v8a *)(src + 32);
        v8 m0 = *(const v8a *)(src + 64), m1 = *(const v8a *)(src + 96);
        const uint8_t *qs = src + 2 * P * 4;
        for (int k = 0; k < QB; k++) {
            vw8 c = widen_u8(qs + k * 8);
            v8 t0 = d0 * __builtin_convertvector(c & 15, v8), t1 = d1 * __builtin_convertvector(c >> 4, v8);
            *(v8 *)(dst + k * P) = t0 + m0;
            *(v8 *)(dst + k * P + 8) = t1 + m1;
        }
    }
}

static __attribute__((noinline)) void decode_q8(const int8_t *src, int64_t n, float *dst) {
    QNO_CONTRACT
    for (int64_t kb = 0; kb < n; kb++, src += Q8_BYTES, dst += QB * P) {
        v8 d0 = *(const v8a *)src, d1 = *(const v8a *)(src + 32);
        const int8_t *qs = src + P * 4;
        for (int k = 0; k < QB; k++) {
            *(v8 *)(dst + k * P) = d0 * widen_s8(qs + k * P);
            *(v8 *)(dst + k * P + 8) = d1 * widen_s8(qs + k * P + 8);
        }
    }
}

#ifdef __FMA__
/* acc + w·x rounded once, as the float32 kernel's `acc += w * xb` compiles on a CPU with FMA (GCC
 * contracts it): the one operation of this region that must fuse, spelled out because fp-contract is
 * off here. Without FMA (or off x86) every row count goes through the chunks, whose FMAs are the
 * float32 kernel's own code. */
static inline __attribute__((always_inline)) v8 fma8(v8 w, v8 x, v8 acc) {
    return (v8)_mm256_fmadd_ps((__m256)w, (__m256)x, (__m256)acc);
}

/* rr rows (rr <= RQ; x rows ldx floats apart) times Q4 / Q8 panel p, decoding in registers: no
 * round trip through memory, each decoded weight used by every row at once. A decoding step (one row)
 * and the trees Bastion verifies on a CPU (a few rows) take this path; more rows decode each chunk of
 * a panel once into L1 for all their passes (DEFINE_CHUNKED). Every output's sum is one chain of FMAs
 * in k order, the float32 kernel's order. Products of all 211 matrices of the embedded target on the
 * Zen 3 (2 threads, noisy medians): 1 row 19, 4-6 rows 14-19 ms; chunked 7-9 rows 25-28, 16 rows 39
 * (float32 panels: 33-52 ms at 1-9 rows). Fused 7-8 rows spilled accumulators: no faster; 7-12 rows
 * take half panels instead (DEFINE_HALF), and with AVX-512 up to 16 rows take 512-bit registers
 * (DEFINE_ZFUSED). */
#define RQ 6 /* 2·RQ accumulators, two weights and the input fill AVX2's 16 registers */
#define DEFINE_FUSED(NAME, WT, BYTES, DECODE)                                                      \
static inline __attribute__((always_inline)) void NAME(const float *x, int64_t ldx, int rr, int cnt, \
        const WT *wp, int64_t p, int64_t K, const float *b, float *y, int64_t N) {                 \
    QNO_CONTRACT                                                                                   \
    int64_t nb = K / QB, stride = nb * BYTES;                                                      \
    const WT *src = wp + p * stride;                                                               \
    v8 acc[2][RQ][2];                                                                              \
    for (int c = 0; c < cnt; c++)                                                                  \
        for (int i = 0; i < rr; i++) acc[c][i][0] = acc[c][i][1] = (v8){0};                        \
    for (int64_t kb = 0; kb < nb; kb++, src += BYTES) {                                            \
        for (int c = 0; c < cnt; c++)                                                              \
            for (int l = 0; l < BYTES; l += 64) /* every line of the block AHEAD blocks on */     \
                __builtin_prefetch(src + c * stride + AHEAD * BYTES + l);                          \
        const float *xk = x + kb * QB;                                                             \
        for (int k = 0; k < QB; k++)                                                               \
            for (int c = 0; c < cnt; c++) {                                                        \
                v8 w0, w1;                                                                         \
                DECODE(src + c * stride, k, &w0, &w1);                                             \
                for (int i = 0; i < rr; i++) {                                                     \
                    float xv = xk[i * ldx + k];                                                    \
                    v8 xb = {xv, xv, xv, xv, xv, xv, xv, xv};                                      \
                    acc[c][i][0] = fma8(w0, xb, acc[c][i][0]);                                     \
                    acc[c][i][1] = fma8(w1, xb, acc[c][i][1]);                                     \
                }                                                                                  \
            }                                                                                      \
    }                                                                                              \
    for (int c = 0; c < cnt; c++)                                                                  \
        for (int i = 0; i < rr; i++) store_row(acc[c][i][0], acc[c][i][1], b, y + i * N, N, (p + c) * P); \
}

/* Input k's 16 weights of a Q4 / Q8 block: fl(fl(d·q) + m) and fl(d·q), as gguf's numpy rounds them.
 * Q4 decodes with one FMA, fl(d·q + m), which is the same number: d is a half float (11 significant
 * bits, bastion_pack_q4 keeps no other) and q < 16 (4 bits), so d·q has at most 15 significant bits
 * and is exact in float32 - the unfused product had nothing to round. One operation fewer per 8
 * weights: the embedded target's 211 products 4-10% faster at 1-12 rows on a Zen 4, bit for bit
 * (session 37). Elsewhere in this region fp-contract stays off. */
static inline __attribute__((always_inline)) void dec_q4(const uint8_t *blk, int k, v8 *w0, v8 *w1) {
    QNO_CONTRACT
    vw8 q = widen_u8(blk + 2 * P * 4 + k * 8);
    *w0 = fma8(*(const v8a *)blk, __builtin_convertvector(q & 15, v8), *(const v8a *)(blk + 64));
    *w1 = fma8(*(const v8a *)(blk + 32), __builtin_convertvector(q >> 4, v8), *(const v8a *)(blk + 96));
}
static inline __attribute__((always_inline)) void dec_q8(const int8_t *blk, int k, v8 *w0, v8 *w1) {
    QNO_CONTRACT
    *w0 = *(const v8a *)blk * widen_s8(blk + P * 4 + k * P);
    *w1 = *(const v8a *)(blk + 32) * widen_s8(blk + P * 4 + k * P + 8);
}
DEFINE_FUSED(fused_q4, uint8_t, Q4_BYTES, dec_q4)
DEFINE_FUSED(fused_q8, int8_t, Q8_BYTES, dec_q8)

/* RQ < rr <= RH rows times Q4 / Q8 panel p, one half of the panel (8 outputs) at a time, decoding
 * in registers: rr accumulators, one decoded weight vector and the input - so each decoded weight
 * serves rr rows where the whole-panel kernel (two weight vectors, 2·rr accumulators) stops at RQ.
 * The second half re-reads the panel's codes from L1/L2. Each output's sum is still one chain of
 * FMAs in k order. The embedded target's 211 products, AVX2 build on a Xeon (session 24, medians):
 * 7 rows 17.8 -> 16.9 ms, 9 rows 20.9 -> 20.2 against the chunks (12 rows: a tie). */
#define RH 12
#define DEFINE_HALF(NAME, WT, BYTES, DECODE1)                                                      \
static inline __attribute__((always_inline)) void NAME(const float *x, int64_t ldx, int rr, int h,  \
        const WT *wp, int64_t p, int64_t K, const float *b, float *y, int64_t N) {                 \
    QNO_CONTRACT                                                                                   \
    int64_t nb = K / QB;                                                                           \
    const WT *src = wp + p * nb * BYTES;                                                           \
    v8 acc[RH];                                                                                    \
    for (int i = 0; i < rr; i++) acc[i] = (v8){0};                                                 \
    for (int64_t kb = 0; kb < nb; kb++, src += BYTES) {                                            \
        if (!h)                                                                                    \
            for (int l = 0; l < BYTES; l += 64)                                                    \
                __builtin_prefetch(src + AHEAD * BYTES + l);                                       \
        const float *xk = x + kb * QB;                                                             \
        for (int k = 0; k < QB; k++) {                                                             \
            v8 w = DECODE1(src, k, h);                                                             \
            for (int i = 0; i < rr; i++) {                                                         \
                float xv = xk[i * ldx + k];                                                        \
                v8 xb = {xv, xv, xv, xv, xv, xv, xv, xv};                                          \
                acc[i] = fma8(w, xb, acc[i]);                                                      \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    int64_t n0 = p * P + h * 8, m = N - n0 < 8 ? N - n0 : 8;                                       \
    for (int i = 0; i < rr; i++) {                                                                 \
        float out[8];                                                                              \
        memcpy(out, &acc[i], sizeof(v8));                                                          \
        for (int j = 0; j < m; j++) y[i * N + n0 + j] = b ? out[j] + b[n0 + j] : out[j];          \
    }                                                                                              \
}
static inline __attribute__((always_inline)) v8 dec1_q4(const uint8_t *blk, int k, int h) {
    QNO_CONTRACT
    vw8 q = widen_u8(blk + 2 * P * 4 + k * 8);
    return fma8(*(const v8a *)(blk + 32 * h), __builtin_convertvector(h ? q >> 4 : q & 15, v8),
                *(const v8a *)(blk + 64 + 32 * h));
}
static inline __attribute__((always_inline)) v8 dec1_q8(const int8_t *blk, int k, int h) {
    QNO_CONTRACT
    return *(const v8a *)(blk + 32 * h) * widen_s8(blk + P * 4 + k * P + 8 * h);
}
DEFINE_HALF(half_q4, uint8_t, Q4_BYTES, dec1_q4)
DEFINE_HALF(half_q8, int8_t, Q8_BYTES, dec1_q8)
#define HCASE(F, n) case n: F(x, K, n, 0, wp, p, K, b, y, N); F(x, K, n, 1, wp, p, K, b, y, N); return 1;

/* The gemm loop's hook for few rows: 1 when panel p is done, 0 for the chunked path (R > RQ). One or
 * two rows run two panels side by side (an even panel takes its odd neighbour along; the odd ones then
 * return at once): each output's FMAs form one chain whose latency bounds a k step, and 2·rr chains
 * of one panel are too few to hide it. */
#define FCASE(F, n, c) case n: F(x, K, n, c, wp, p, K, b, y, N); return 1;
#define DEFINE_ROWS(NAME, WT, F, H)                                                                \
static __attribute__((noinline)) int NAME(const float *x, int64_t R, const WT *wp, int64_t p, int64_t K, \
                                          const float *b, float *y, int64_t N) {                  \
    if (R <= 2) {                                                                                  \
        if (p & 1)                                                                                 \
            return 1;                                                                              \
        int pair = p + 1 < (N + P - 1) / P;                                                        \
        if (R == 1) {                                                                              \
            if (pair) F(x, K, 1, 2, wp, p, K, b, y, N); else F(x, K, 1, 1, wp, p, K, b, y, N);     \
        } else {                                                                                   \
            if (pair) F(x, K, 2, 2, wp, p, K, b, y, N); else F(x, K, 2, 1, wp, p, K, b, y, N);     \
        }                                                                                          \
        return 1;                                                                                  \
    }                                                                                              \
    switch (R) {                                                                                   \
        FCASE(F, 3, 1) FCASE(F, 4, 1) FCASE(F, 5, 1) FCASE(F, 6, 1)                                \
        HCASES(H)                                                                                  \
    }                                                                                              \
    return 0;                                                                                      \
}
#define HCASES(H) HCASE(H, 7) HCASE(H, 8) HCASE(H, 9) HCASE(H, 10) HCASE(H, 11) HCASE(H, 12)
DEFINE_ROWS(row_q4, uint8_t, fused_q4, half_q4)
DEFINE_ROWS(row_q8, int8_t, fused_q8, half_q8)
#define ROW_Q4(x, R, wp, p, K, b, y, N) row_q4(x, R, wp, p, K, b, y, N)
#define ROW_Q8(x, R, wp, p, K, b, y, N) row_q8(x, R, wp, p, K, b, y, N)

#if defined(__AVX512F__)
/* With AVX-512 a panel's 16 outputs are one 512-bit vector: a k step decodes 16 weights in one
 * pass (the 8 code bytes broadcast, widened to 16 lanes, shifted by 0 or 4 and masked) and each row
 * takes one FMA - half the instructions of two 256-bit halves, and 32 registers hold the
 * accumulators of up to ZR rows, so one decoding serves every row of a verification tree. Few rows
 * run ZG(rr) panels side by side so that 8 or more FMA chains hide the FMA latency. Each lane is the
 * float32 kernel's output lane: the same decoded weights, the same FMAs in k order, the same bits.
 * The embedded target's 211 products on a 2-core Xeon with AVX-512 (session 24, medians, against
 * the 256-bit paths): 7 rows 17.8 -> 12.2 ms, 9 rows 20.9 -> 14.2, 12 rows 24.0 -> 17.4, 16 rows
 * 31.0 -> 23.2; 1-6 rows a tie (decoding, not the FMAs, bounds them). Past 16 rows the
 * accumulators spill (18 rows 39 ms): the chunks take over. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v16a __attribute__((vector_size(64), aligned(4), may_alias));
#define ZR 16
#define ZGMAX 8
/* fl(d·q + m) in one FMA: the same bits as fl(fl(d·q) + m) (see dec_q4) */
static inline __attribute__((always_inline)) v16 zdec_q4(const uint8_t *blk, int k) {
    QNO_CONTRACT
    long long codes;
    memcpy(&codes, blk + 2 * P * 4 + k * 8, 8);
    __m512i c = _mm512_cvtepu8_epi32(_mm_set1_epi64x(codes));
    c = _mm512_srlv_epi32(c, _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0));
    c = _mm512_and_si512(c, _mm512_set1_epi32(15));
    return (v16)_mm512_fmadd_ps(_mm512_loadu_ps((const float *)blk), _mm512_cvtepi32_ps(c),
                                _mm512_loadu_ps((const float *)(blk + 64)));
}
static inline __attribute__((always_inline)) v16 zdec_q8(const int8_t *blk, int k) {
    QNO_CONTRACT
    __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + P * 4 + k * P)));
    return *(const v16a *)blk * (v16)_mm512_cvtepi32_ps(c);
}
static inline __attribute__((always_inline)) void zstore(v16 a, const float *b, float *y, int64_t N, int64_t n0) {
    float out[P];
    memcpy(out, &a, sizeof(v16));
    int64_t m = N - n0 < P ? N - n0 : P;
    for (int j = 0; j < m; j++) y[n0 + j] = b ? out[j] + b[n0 + j] : out[j];
}
/* rr rows times cnt consecutive panels from p */
#define DEFINE_ZFUSED(NAME, WT, BYTES, DECODE)                                                     \
static inline __attribute__((always_inline)) void NAME(const float *x, int64_t ldx, int rr, int cnt, \
        const WT *wp, int64_t p, int64_t K, const float *b, float *y, int64_t N) {                 \
    QNO_CONTRACT                                                                                   \
    int64_t nb = K / QB, stride = nb * BYTES;                                                      \
    const WT *src = wp + p * stride;                                                               \
    v16 acc[ZGMAX][ZR];                                                                            \
    for (int c = 0; c < cnt; c++)                                                                  \
        for (int i = 0; i < rr; i++) acc[c][i] = (v16){0};                                         \
    for (int64_t kb = 0; kb < nb; kb++, src += BYTES) {                                            \
        for (int c = 0; c < cnt; c++)                                                              \
            for (int l = 0; l < BYTES; l += 64)                                                    \
                __builtin_prefetch(src + c * stride + AHEAD * BYTES + l);                          \
        const float *xk = x + kb * QB;                                                             \
        for (int k = 0; k < QB; k++) {                                                             \
            v16 w[ZGMAX];                                                                          \
            for (int c = 0; c < cnt; c++) w[c] = DECODE(src + c * stride, k);                      \
            for (int i = 0; i < rr; i++) {                                                         \
                __m512 xb = _mm512_set1_ps(xk[i * ldx + k]);                                       \
                for (int c = 0; c < cnt; c++)                                                      \
                    acc[c][i] = (v16)_mm512_fmadd_ps((__m512)w[c], xb, (__m512)acc[c][i]);        \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    for (int c = 0; c < cnt; c++)                                                                  \
        for (int i = 0; i < rr; i++) zstore(acc[c][i], b, y + i * N, N, (p + c) * P);              \
}
DEFINE_ZFUSED(zfused_q4, uint8_t, Q4_BYTES, zdec_q4)
DEFINE_ZFUSED(zfused_q8, int8_t, Q8_BYTES, zdec_q8)
/* panels side by side for rr rows: at least 8 accumulator chains */
static inline int zgroup(int rr) { return rr == 1 ? 8 : rr == 2 ? 4 : rr == 3 ? 3 : rr < 8 ? 2 : 1; }
#define ZC(F, n, c) case (n) * 16 + (c): F(x, K, n, c, wp, p, K, b, y, N); break;
#define ZCASES(F)                                                                                  \
    ZC(F, 1, 1) ZC(F, 1, 2) ZC(F, 1, 3) ZC(F, 1, 4) ZC(F, 1, 5) ZC(F, 1, 6) ZC(F, 1, 7)            \
    ZC(F, 1, 8) ZC(F, 2, 1) ZC(F, 2, 2) ZC(F, 2, 3) ZC(F, 2, 4) ZC(F, 3, 1) ZC(F, 3, 2)            \
    ZC(F, 3, 3) ZC(F, 4, 1) ZC(F, 4, 2) ZC(F, 5, 1) ZC(F, 5, 2) ZC(F, 6, 1) ZC(F, 6, 2)            \
    ZC(F, 7, 1) ZC(F, 7, 2) ZC(F, 8, 1) ZC(F, 9, 1) ZC(F, 10, 1) ZC(F, 11, 1) ZC(F, 12, 1)         \
    ZC(F, 13, 1) ZC(F, 14, 1) ZC(F, 15, 1) ZC(F, 16, 1)
/* y = x W^T (+ b) for R <= ZR rows: each thread takes a contiguous range of panels (groups of
 * panels would split unevenly otherwise) and walks it zgroup(R) panels at a time. */
#define DEFINE_ZGEMM(NAME, WT, F)                                                                  \
static __attribute__((noinline)) void NAME(const float *x, int64_t R, const WT *wp, int64_t N, int64_t K, \
                                           const float *b, float *y, int nthreads) {              \
    int64_t np = (N + P - 1) / P;                                                                  \
    int G = zgroup((int)R);                                                                        \
    _Pragma("omp parallel num_threads(nthreads) if (np * K * R > 32768)")                          \
    {                                                                                              \
        int64_t t = omp_get_thread_num(), T = omp_get_num_threads();                               \
        int64_t pe = np * (t + 1) / T;                                                             \
        for (int64_t p = np * t / T; p < pe; p += G) {                                             \
            int cnt = pe - p < G ? (int)(pe - p) : G;                                              \
            switch ((int)R * 16 + cnt) { ZCASES(F) }                                       \
        }                                                                                          \
    }                                                                                              \
}
DEFINE_ZGEMM(zgemm_q4, uint8_t, zfused_q4)
DEFINE_ZGEMM(zgemm_q8, int8_t, zfused_q8)
/* Which row counts take the 512-bit path: bit r-1 of zrows[0] (Q4) / zrows[1] (Q8) for r rows, all
 * by default. Both paths return the same bits, so the choice is speed alone, and it differs between
 * CPUs: on the 2-core Xeon (true 512-bit units) 1-6 rows tied and 7-16 ran ~30% faster, on a Zen 4
 * (512-bit ops as two 256-bit halves) whole verifications of 1-7 rows ran 5-13% faster on the 256-bit
 * path and 8-16 rows 5-14% slower (session 36). probe.tune_wide_rows times both and sets these
 * (cpu_native.set_wide_rows). */
static uint32_t zrows[2] = {0xffffu, 0xffffu};
#define ZGEMM_Q4(x, R, wp, N, K, b, y, t) \
    ((R) <= ZR && (zrows[0] >> ((R) - 1) & 1) ? (zgemm_q4(x, R, wp, N, K, b, y, t), 1) : 0)
#define ZGEMM_Q8(x, R, wp, N, K, b, y, t) \
    ((R) <= ZR && (zrows[1] >> ((R) - 1) & 1) ? (zgemm_q8(x, R, wp, N, K, b, y, t), 1) : 0)
int bastion_wide_rows(int which, int64_t mask) {
    if (which < 0 || which > 1) return -1;
    uint32_t old = zrows[which];
    if (mask >= 0) zrows[which] = (uint32_t)mask & 0xffffu;
    return (int)old;
}
#else
#define ZGEMM_Q4(x, R, wp, N, K, b, y, t) 0
#define ZGEMM_Q8(x, R, wp, N, K, b, y, t) 0
#endif
#else
#define ROW_Q4(x, R, wp, p, K, b, y, N) 0
#define ZGEMM_Q4(x, R, wp, N, K, b, y, t) 0
#define ZGEMM_Q8(x, R, wp, N, K, b, y, t) 0
#define ROW_Q8(x, R, wp, p, K, b, y, N) 0
#endif
#pragma GCC pop_options
#ifndef ZR
int bastion_wide_rows(int which, int64_t mask) { (void)which; (void)mask; return -1; } /* no 512-bit path */
#endif

DEFINE_CHUNKED(chunked_q4, uint8_t, Q4_BYTES, decode_q4)
DEFINE_CHUNKED(chunked_q8, int8_t, Q8_BYTES, decode_q8)

/* y [R, N] = x [R, K] times compressed panels (+ b), the panels split between threads: up to ZR rows
 * in 512-bit registers where the CPU has AVX-512 (ZGEMM_*), else up to RH rows in 256-bit ones
 * (ROW_Q4 / ROW_Q8), more through L1 chunks. */
#define DEFINE_QGEMM(NAME, WT, ROWS, CHUNKED, Z)                                                   \
void NAME(const float *x, int64_t R, const WT *wp, int64_t N, int64_t K, const float *b, float *y,  \
         int nthreads) {                                                                           \
    if (Z(x, R, wp, N, K, b, y, nthreads))                                                         \
        return;                                                                                    \
    int64_t np = (N + P - 1) / P;                                                                  \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (np * K * R > 32768)")     \
    for (int64_t p = 0; p < np; p++)                                                               \
        if (!ROWS(x, R, wp, p, K, b, y, N))                                                        \
            CHUNKED(x, R, wp, p, K, b, y, N);                                                      \
}
DEFINE_QGEMM(bastion_gemm_q4, uint8_t, ROW_Q4, chunked_q4, ZGEMM_Q4)
DEFINE_QGEMM(bastion_gemm_q8, int8_t, ROW_Q8, chunked_q8, ZGEMM_Q8)

/* ---------------------------------------------------------------------------------------------
 * Low-precision products for drafters: bf16 weights and inputs, float32 sums.
 *
 * A drafter's output is only a proposal (the target verifies every token), so its products may
 * round. Weights are packed as Wb [ceil(N/16), K/2, 16, 2] bf16 (for each pair of k, the 16 outputs'
 * two consecutive weights) and x arrives as bf16 pairs, one 32-bit word per (row, k pair); each
 * VDPBF16PS then does 32 multiply-adds (16 outputs x 2 k) into float32 accumulators: twice the
 * FMAs of the float32 kernel per instruction over half the bytes of weights. As there, every
 * output is summed in the same order whatever the number of rows. Needs AVX512-BF16 (Zen 4,
 * Sapphire Rapids); elsewhere bastion_gemm_bf16_available() is 0 and callers keep float32.
 */
#ifdef __AVX512BF16__
int bastion_gemm_bf16_available(void) { return 1; }

static inline __attribute__((always_inline)) void
panel_bf16(const uint32_t *x, int64_t ldx, int rr, const uint16_t *wp, int64_t K2, const float *b,
           float *y, int64_t N, int64_t n0) {
    __m512 acc[RB];
    for (int i = 0; i < rr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K2; k++) {
        __builtin_prefetch(wp + (k + 16) * P * 2); /* one 64-byte line per k pair, 1 KB ahead */
        __m512bh w = (__m512bh)_mm512_loadu_si512(wp + k * P * 2);
        for (int i = 0; i < rr; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], w, (__m512bh)_mm512_set1_epi32((int)x[i * ldx + k]));
    }
    int64_t m = N - n0 < P ? N - n0 : P;
    for (int i = 0; i < rr; i++) {
        float out[P];
        _mm512_storeu_ps(out, acc[i]);
        if (b)
            for (int j = 0; j < m; j++) out[j] += b[n0 + j];
        memcpy(y + i * N + n0, out, (size_t)m * sizeof(float));
    }
}

#define CASEB(n) case n: panel_bf16(xr, K2, n, wpp, K2, b, yr, N, n0); break;

/* x: R rows of K2 bf16 pairs (uint32), wp: packed bf16 panels, y [R, N] float32. */
void bastion_gemm_bf16(const uint32_t *x, int64_t R, const uint16_t *wp, int64_t N, int64_t K2,
                       const float *b, float *y, int nthreads) {
    int64_t np = (N + P - 1) / P;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (np * K2 * R > 16384)
    for (int64_t p = 0; p < np; p++) {
        const uint16_t *wpp = wp + p * K2 * P * 2;
        int64_t n0 = p * P;
        int64_t npass = (R + RB - 1) / RB;
        for (int64_t pass = 0, r0 = 0; pass < npass; pass++) {
            int rr = pass_rows(R - r0, npass - pass, RB);
            const uint32_t *xr = x + r0 * K2;
            float *yr = y + r0 * N;
            switch (rr) {
                CASEB(1) CASEB(2) CASEB(3) CASEB(4) CASEB(5) CASEB(6)
                CASEB(7) CASEB(8) CASEB(9) CASEB(10) CASEB(11) CASEB(12)
            }
            r0 += rr;
        }
    }
}
#else
int bastion_gemm_bf16_available(void) { return 0; }

void bastion_gemm_bf16(const uint32_t *x, int64_t R, const uint16_t *wp, int64_t N, int64_t K2,
                       const float *b, float *y, int nthreads) {
    (void)x; (void)R; (void)wp; (void)N; (void)K2; (void)b; (void)y; (void)nthreads;
}
#endif

/* ---------------------------------------------------------------------------------------------
 * Attention of a few queries (a tree verification, a decoding step) over the KV cache.
 *
 *   out[i, h, :] = sum_j softmax_j(scale * q[h, i] . k[g, j] + mask[i, j]) v[g, j],   g = h / (H / G)
 *
 * torch's CPU flash attention spends ~50-100 us a call on these shapes (9 query heads x a few rows
 * over 150-500 keys: ~1 M multiply-adds). Here each (head, query) pair's result is computed on its
 * own: the keys its mask row leaves visible are listed (entries <= -1e30 hide a key), then its scores,
 * their maximum, exp (a vector polynomial, the same for every element), the sum and the weighted sum
 * of values over that list, in list order. The result depends only on the query and on the sequence
 * of visible keys and values - not on the other rows of the call, nor on where hidden keys sit - so a
 * node verified inside a tree and the same token decoded alone get bit-identical outputs. The query
 * heads of one KV head (grouped-query attention: 3 per KV head in SmolLM2) run together, up to four
 * at a time, so they share the key list and every key and value load; per head the arithmetic and
 * its order are unchanged (measured 7-32% faster on one thread at 2-9 queries over 160-400 keys,
 * bit-identical to one head at a time). The scores of four keys are summed across their lanes
 * together (sum4: two rounds of pairwise adds, no scalar lane extraction), and the head's query and
 * weight vectors sit in registers while each key and value vector is loaded once: 12 accumulators,
 * 3 queries and one key fill AVX2's 16 registers for SmolLM2's 3 heads per KV head, where the
 * compiler had reloaded every key per head and spilled accumulators (session 21, one thread on the
 * Zen 3 without AVX-512, 9 query / 3 KV heads of 64, interleaved medians: 9 queries over 300 keys
 * 272 -> 190 us, over 1,200 keys 980 -> 589 us, one query over 300 keys 40 -> 31 us; 4 heads per
 * KV head 794 -> 579 us over 1,200 keys; one head per KV head unchanged).
 * q [H, n, d] (strides qh, qn), k / v [G, L, d] (strides kg, kl / vg, vl), mask [n, L] (stride mn) or
 * NULL (every key visible), out [n, H, d] contiguous. Returns -1 when scratch memory runs out.
 */
typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));
#define SPLAT8(x) ((v8){(x), (x), (x), (x), (x), (x), (x), (x)})

/* one dot product: 8 lanes over d, then the lanes summed as ((0+1)+(2+3))+((4+5)+(6+7)) - the order
 * sum4 below gives four dot products at once, so a key's score is the same on either path */
static inline float dot_f32(const float *a, const float *b, int64_t d) {
    v8 acc = (v8){0};
    int64_t t = 0;
    for (; t + 8 <= d; t += 8) acc += *(const v8 *)(a + t) * *(const v8 *)(b + t);
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; t < d; t++) s += a[t] * b[t];
    return s;
}

typedef float v4 __attribute__((vector_size(16), aligned(4)));
#if defined(__clang__)
#define SHUF8(a, b, ...) __builtin_shufflevector((a), (b), __VA_ARGS__)
#else
#define SHUF8(a, b, ...) __builtin_shuffle((a), (b), (vi8){__VA_ARGS__})
#endif

/* the lane sums of four accumulators, each ((0+1)+(2+3))+((4+5)+(6+7)) as dot_f32: two rounds of
 * pairwise adds across the vectors (what x86's haddps does within each 128-bit half), then the halves */
static inline v4 sum4(v8 r0, v8 r1, v8 r2, v8 r3) {
    v8 t01 = SHUF8(r0, r1, 0, 2, 8, 10, 4, 6, 12, 14) + SHUF8(r0, r1, 1, 3, 9, 11, 5, 7, 13, 15);
    v8 t23 = SHUF8(r2, r3, 0, 2, 8, 10, 4, 6, 12, 14) + SHUF8(r2, r3, 1, 3, 9, 11, 5, 7, 13, 15);
    v8 u = SHUF8(t01, t23, 0, 2, 8, 10, 4, 6, 12, 14) + SHUF8(t01, t23, 1, 3, 9, 11, 5, 7, 13, 15);
    /* u = [r0 0123, r1 0123, r2 0123, r3 0123 | r0 4567, r1 4567, r2 4567, r3 4567] */
    return (v4){u[0], u[1], u[2], u[3]} + (v4){u[4], u[5], u[6], u[7]};
}

/* exp(x) for x <= 0 to ~2 ulp: x = k ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 polynomial, 2^k from
 * the exponent bits; below -87 (exp under float's normal range) the result is 0 */
static inline v8 exp_v8(v8 x) {
    const v8 lo = SPLAT8(-87.f);
    vi8 keep = x >= lo;
    x = (v8)(((vi8)x & keep) | ((vi8)lo & ~keep));
    v8 kf = x * 1.44269504088896341f + 12582912.f; /* round to nearest through the 2^23 + 2^22 trick */
    kf -= 12582912.f;
    v8 r = x - kf * 0.693145751953125f;
    r -= kf * 1.428606765330187045e-06f;
    v8 p = SPLAT8(1.f / 720.f) * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    vi8 e = (__builtin_convertvector(kf, vi8) + 127) << 23;
    return (v8)((vi8)(p * (v8)e) & keep);
}

/* scores s[p][t] = scale * q_p . k[idx[t]] + mask for NH query heads of one KV head, sharing each
 * key's loads between the heads; per head the same operations in the same order as one head alone
 * (four-key blocks, dot_f32's lane order, then one key at a time) */
static inline __attribute__((always_inline)) void
score_heads(float *s, int64_t cap, float *m, const float *const *qr, int NH, const int64_t *idx, int64_t c,
            const float *kb, int64_t kl, const float *mr, int64_t d, float scale) {
    for (int p = 0; p < NH; p++) m[p] = -INFINITY;
    int64_t t = 0;
    if (d % 8 == 0)
        for (; t + 4 <= c; t += 4) {
            const float *k0 = kb + idx[t] * kl, *k1 = kb + idx[t + 1] * kl;
            const float *k2 = kb + idx[t + 2] * kl, *k3 = kb + idx[t + 3] * kl;
            v8 a[4][4];
            for (int p = 0; p < NH; p++)
                for (int e = 0; e < 4; e++) a[p][e] = (v8){0};
            for (int64_t u = 0; u < d; u += 8) {
                /* the heads' query vectors in registers, each key vector loaded once and used by every
                 * head: with 3 heads, 12 accumulators + 3 queries + 1 key fill AVX2's 16 registers */
                v8 qv[4];
                for (int p = 0; p < NH; p++) qv[p] = *(const v8 *)(qr[p] + u);
                v8 x = *(const v8 *)(k0 + u);
                for (int p = 0; p < NH; p++) a[p][0] += qv[p] * x;
                x = *(const v8 *)(k1 + u);
                for (int p = 0; p < NH; p++) a[p][1] += qv[p] * x;
                x = *(const v8 *)(k2 + u);
                for (int p = 0; p < NH; p++) a[p][2] += qv[p] * x;
                x = *(const v8 *)(k3 + u);
                for (int p = 0; p < NH; p++) a[p][3] += qv[p] * x;
            }
            v4 bias = mr ? (v4){mr[idx[t]], mr[idx[t + 1]], mr[idx[t + 2]], mr[idx[t + 3]]} : (v4){0};
            for (int p = 0; p < NH; p++) { /* dot_f32's lane order */
                v4 x = sum4(a[p][0], a[p][1], a[p][2], a[p][3]) * scale + bias;
                memcpy(s + p * cap + t, &x, sizeof(v4));
                for (int e = 0; e < 4; e++) m[p] = x[e] > m[p] ? x[e] : m[p];
            }
        }
    for (; t < c; t++) /* the same sums, one key at a time */
        for (int p = 0; p < NH; p++) {
            float x = dot_f32(qr[p], kb + idx[t] * kl, d) * scale + (mr ? mr[idx[t]] : 0.f);
            s[p * cap + t] = x;
            m[p] = x > m[p] ? x : m[p];
        }
}

/* o[p][0 : 8 nv] = sum_t w[p][t] v[idx[t]] for NH heads sharing each value row's loads, four vectors
 * of a row at a time (per output element: the sum over t in list order, as for one head alone) */
static inline __attribute__((always_inline)) void
weigh_heads(float *o, int64_t ostride, const float *w, int64_t cap, int NH, const int64_t *idx, int64_t c,
            const float *vb, int64_t vl, int nv) {
    for (int u0 = 0; u0 < nv; u0 += 4) {
        v8 acc[4][4];
        for (int p = 0; p < NH; p++)
            for (int u = 0; u < 4; u++) acc[p][u] = (v8){0};
        for (int64_t t = 0; t < c; t++) {
            /* as in score_heads: the heads' weights in registers, each value vector loaded once */
            const float *vr = vb + idx[t] * vl + 8 * u0;
            v8 pv[4];
            for (int p = 0; p < NH; p++) pv[p] = SPLAT8(w[p * cap + t]);
            for (int u = 0; u < 4; u++) {
                v8 y = *(const v8 *)(vr + 8 * u);
                for (int p = 0; p < NH; p++) acc[p][u] += pv[p] * y;
            }
        }
        for (int p = 0; p < NH; p++)
            for (int u = 0; u < 4; u++) memcpy(o + p * ostride + 8 * (u0 + u), &acc[p][u], sizeof(v8));
    }
}

/* one query's NH heads of KV head g: visible keys listed once, scores, exp, sums and values per head */
static inline __attribute__((always_inline)) void
attend_heads(int NH, float *s, int64_t cap, float *o, const int64_t *idx, int64_t c, const float *const *qr,
             float *const *dst, const float *kb, int64_t kl, const float *vb, int64_t vl, const float *mr,
             int64_t d, float scale) {
    float m[4], sum[4];
    score_heads(s, cap, m, qr, NH, idx, c, kb, kl, mr, d, scale);
    int64_t c8 = (c + 7) / 8 * 8;
    for (int p = 0; p < NH; p++) {
        float *sp = s + p * cap;
        for (int64_t t = c; t < c8; t++) sp[t] = -INFINITY;
        v8 sum8 = (v8){0}, mv = SPLAT8(m[p]);
        for (int64_t t = 0; t < c8; t += 8) {
            v8 e = exp_v8(*(v8 *)(sp + t) - mv);
            *(v8 *)(sp + t) = e;
            sum8 += e;
        }
        sum[p] = ((sum8[0] + sum8[4]) + (sum8[1] + sum8[5])) + ((sum8[2] + sum8[6]) + (sum8[3] + sum8[7]));
    }
    if (d == 64 || d == 128)
        weigh_heads(o, d + 8, s, cap, NH, idx, c, vb, vl, (int)(d / 8));
    else
        for (int p = 0; p < NH; p++) {
            float *op = o + p * (d + 8);
            const float *sp = s + p * cap;
            for (int64_t u = 0; u < d; u++) op[u] = 0.f;
            for (int64_t t2 = 0; t2 < c; t2++) {
                const float *vr = vb + idx[t2] * vl;
                for (int64_t u = 0; u < d; u++) op[u] += sp[t2] * vr[u];
            }
        }
    for (int p = 0; p < NH; p++) {
        float inv = 1.f / sum[p];
        for (int64_t u = 0; u < d; u++) dst[p][u] = o[p * (d + 8) + u] * inv;
    }
}

int bastion_attn_f32(const float *q, int64_t qh, int64_t qn, const float *k, int64_t kg, int64_t kl,
                     const float *v, int64_t vg, int64_t vl, const float *mask, int64_t mn, float *out,
                     int64_t H, int64_t G, int64_t n, int64_t L, int64_t d, float scale, int nthreads) {
    /* work items: (KV head, query, block of up to 4 of its query heads) - the heads of a block
     * share the key list and every key and value load */
    int64_t per = H / G, blocks = (per + 3) / 4, items = G * n * blocks, cap = (L + 8 + 7) / 8 * 8;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (H * n * L * d > 65536)
    {
        float *s = aligned_alloc(32, (size_t)(4 * cap) * sizeof(float));
        float *o = malloc((size_t)(4 * (d + 8)) * sizeof(float));
        int64_t *idx = malloc((size_t)cap * sizeof(int64_t));
        int ok = s && o && idx;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            if (!ok) continue;
            int64_t g = it / (n * blocks), rest = it % (n * blocks), i = rest / blocks, h0 = g * per + (rest % blocks) * 4;
            int NH = (int)(g * per + per - h0 < 4 ? g * per + per - h0 : 4);
            int64_t c = 0;
            const float *mr = mask ? mask + i * mn : NULL;
            const float *kb = k + g * kg, *vb = v + g * vg;
            const float *qr[4];
            float *dst[4];
            for (int p = 0; p < NH; p++) {
                qr[p] = q + (h0 + p) * qh + i * qn;
                dst[p] = out + (i * H + h0 + p) * d;
            }
            for (int64_t j = 0; j < L; j++)
                if (!mr || mr[j] > -1e30f) idx[c++] = j;
            if (c == 0) { /* no visible key: zeros (such a row is never read) */
                for (int p = 0; p < NH; p++) memset(dst[p], 0, (size_t)d * sizeof(float));
                continue;
            }
            switch (NH) { /* compile-time head counts: the accumulators stay in registers */
            case 1: attend_heads(1, s, cap, o, idx, c, qr, dst, kb, kl, vb, vl, mr, d, scale); break;
            case 2: attend_heads(2, s, cap, o, idx, c, qr, dst, kb, kl, vb, vl, mr, d, scale); break;
            case 3: attend_heads(3, s, cap, o, idx, c, qr, dst, kb, kl, vb, vl, mr, d, scale); break;
            default: attend_heads(4, s, cap, o, idx, c, qr, dst, kb, kl, vb, vl, mr, d, scale); break;
            }
        }
        free(s);
        free(o);
        free(idx);
    }
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------------------------------------
 * A verified tree's accepted rows moved into place in every KV-cache tensor at once.
 *
 * t[i] (n tensors: each layer's keys and values) holds heads x rows x d floats (head stride hs[i],
 * row stride rs[i]); row src[j] moves to row dst[j] for j = 0..m-1, in that order, for every head. The
 * engine passes increasing src with dst[j] = prefix + j <= src[j], so a row is read before anything is
 * written over it. One call instead of two torch ops per tensor (~60 a round on a 30-layer target).
 */
void bastion_move_rows(float *const *t, const int64_t *hs, const int64_t *rs, int64_t n, int64_t heads, int64_t d,
                       const int64_t *src, const int64_t *dst, int64_t m) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < heads; h++) {
            float *base = t[i] + h * hs[i];
            for (int64_t j = 0; j < m; j++)
                if (src[j] != dst[j]) memmove(base + dst[j] * rs[i], base + src[j] * rs[i], (size_t)d * sizeof(float));
        }
}

/*
 * RMSNorm of rows: y[r, i] = w[i] * (x[r, i] * (1 / sqrt(mean_i x[r, i]^2 + eps)))  x, y [R, n].
 *
 * transformers' float32 RMSNorm is six torch ops (pow, mean, add, rsqrt, two muls), each dispatched
 * and, at a few rows, each waking torch's thread pool: ~25 us a call for one row of 576 and ~90 us
 * for nine (61 calls a forward of SmolLM2-135M: ~5 ms of a nine-row verification; session 22's
 * profile). Here one pass per row: the sum of squares in 32 float lanes (four 8-float accumulators,
 * k ascending), the lanes summed in a fixed order, so a row's result depends on that row alone
 * (batch-invariant, as the products). Not torch's summation order: results agree to float rounding
 * (~1e-7 relative), not bit for bit - the target's norms all go through this function (lean and full
 * forward alike; kernels/cpu_modules.py), so every path of this engine agrees with itself.
 */
void bastion_rms_norm_f32(const float *x, int64_t R, int64_t n, const float *w, float eps, float *y) {
#pragma omp parallel for schedule(static) if (R >= 64)
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        v8 a0 = (v8){0}, a1 = (v8){0}, a2 = (v8){0}, a3 = (v8){0};
        int64_t i = 0;
        for (; i + 32 <= n; i += 32) {
            v8 u0 = *(const v8 *)(xr + i), u1 = *(const v8 *)(xr + i + 8);
            v8 u2 = *(const v8 *)(xr + i + 16), u3 = *(const v8 *)(xr + i + 24);
            a0 += u0 * u0; a1 += u1 * u1; a2 += u2 * u2; a3 += u3 * u3;
        }
        for (; i + 8 <= n; i += 8) {
            v8 u = *(const v8 *)(xr + i);
            a0 += u * u;
        }
        v8 a = (a0 + a1) + (a2 + a3);
        float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
        for (; i < n; i++) s += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(s / (float)n + eps);
        for (int64_t j = 0; j < n; j++) yr[j] = w[j] * (xr[j] * inv);
    }
}

/*
 * Rotary position embedding of a few rows, bit for bit transformers' apply_rotary_pos_emb:
 *   out = (x * cos) + (rotate_half(x) * sin),  rotate_half(x) = [-x[h:], x[:h]],  h = d / 2
 * x, out [n, H, d] (a product's rows viewed as heads), cos / sin [n, d]. Each of the two products and
 * the sum is rounded on its own, as torch's three elementwise ops round them: the compiler must not
 * fuse a product and the sum into one FMA (fp-contract off below), or the bits would differ from
 * transformers' full forward, which the engine's longest trees still take. Replaces ~14 torch ops a
 * layer (slices, neg, cat, muls, adds for q and k: ~1.5 ms of a forward of the embedded target).
 */
#if defined(__clang__)
#define NO_CONTRACT _Pragma("clang fp contract(off)")
#else
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#define NO_CONTRACT
#endif
void bastion_rope_f32(const float *x, int64_t n, int64_t H, int64_t d, const float *cos, const float *sin,
                      float *out) {
    NO_CONTRACT
    const int64_t h = d / 2;
    for (int64_t r = 0; r < n; r++) {
        const float *c = cos + r * d, *s = sin + r * d;
        for (int64_t j = 0; j < H; j++) {
            const float *xr = x + (r * H + j) * d;
            float *o = out + (r * H + j) * d;
            for (int64_t i = 0; i < h; i++) {
                float a = xr[i] * c[i];
                float b = (-xr[i + h]) * s[i];
                o[i] = a + b;
            }
            for (int64_t i = h; i < d; i++) {
                float a = xr[i] * c[i];
                float b = xr[i - h] * s[i];
                o[i] = a + b;
            }
        }
    }
}
#if !defined(__clang__)
#pragma GCC pop_options
#endif

/*
 * SiLU of rows: y = x * sigmoid(x), x, y [R, n]. torch's CPU silu took ~20 us for nine rows of 1,536
 * (the embedded target's MLP; 30 calls a forward, the largest torch op left in a verification after
 * the norms and the rotary embedding went native, session 22). sigmoid from exp_v8 of -|x| (its
 * domain is x <= 0): x >= 0: 1 / (1 + e^-x), x < 0: e^x / (1 + e^x). Each row in the same 8-lane
 * blocks (a partial last block padded), so an element's result does not depend on the row count.
 * Within a few ulp of torch's silu, not bit for bit: the target's activations all go through it
 * (lean and full forward; kernels/cpu_modules.py).
 */
static inline v8 silu_v8(v8 x) {
    vi8 neg = x < SPLAT8(0.f);
    v8 ax = (v8)((vi8)x & ~(vi8)SPLAT8(-0.f)); /* |x| */
    v8 e = exp_v8(-ax);                         /* e^-|x| in (0, 1] */
    v8 one = SPLAT8(1.f);
    v8 den = one + e;
    v8 sig = (v8)(((vi8)(one / den) & ~neg) | ((vi8)(e / den) & neg));
    return x * sig;
}

void bastion_silu_f32(const float *x, int64_t R, int64_t n, float *y) {
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) *(v8 *)(yr + i) = silu_v8(*(const v8 *)(xr + i));
        if (i < n) {
            v8 t = (v8){0};
            for (int64_t j = i; j < n; j++) t[j - i] = xr[j];
            t = silu_v8(t);
            for (int64_t j = i; j < n; j++) yr[j] = t[j - i];
        }
    }
}
