/*
 * The decoder layers of a Llama / Qwen3 target in one native call (target_lean.lean_forward), and of a
 * DFlash drafter (drafter_lean.lean_layers: its context rows ride along, see `fresh` below).
 *
 * The lean loop in Python calls ~25 things a layer - seven products, norms, the rotary embedding,
 * the cache update, the attention, the residual adds and the SwiGLU product - each a ctypes or torch
 * dispatch of a few microseconds, plus the tensors they allocate: ~4-5 ms of a ~17 ms one-row step of
 * the embedded target on the 2-core Zen 3, none of it arithmetic (bench/NOTES.md, session 32). Here
 * the same kernels run in the same order on the same inputs, so the logits, the captured features
 * and the cache rows are bit for bit those of the Python loop (tests/test_target.py):
 *
 *   per layer  h = rms_norm(x; ln1)          q = h Wq, k = h Wk, v = h Wv   (+ bias where given)
 *              [Qwen3: q, k = rms_norm per head (q_norm, k_norm)]
 *              q, k = rope(q), rope(k)      cache rows [past, past + n) = k, v
 *              a = attention(q; cache rows [0, past + n), mask)
 *              x = x + a Wo                 h = rms_norm(x; ln2)
 *              x = x + (silu(h Wg) * (h Wu)) Wd            [capture x after the feature layers]
 *
 * Each add and product of two elements rounds once, as torch's elementwise ops do (no FMA can form:
 * no product feeds an add inside an expression here). Products read float32 or exact 4 / 8-bit
 * panels (a target: kinds 0 / 1 / 2), bf16 weights widened in registers (a drafter: kind 3) or, where
 * the CPU has AVX512-BF16, bf16 pairs whose inputs are rounded to bf16 first, to nearest even as
 * torch's `.to(torch.bfloat16)` rounds them (a drafter: kind 4), all cpu_gemm.c's; bias pointers may
 * be NULL.
 *
 * Compiled into the same library as cpu_gemm.c (kernels/cpu_native.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void bastion_gemm_f32(const float *x, int64_t R, const float *wp, int64_t N, int64_t K, const float *b, float *y,
                      int nthreads);
void bastion_gemm_q4(const float *x, int64_t R, const uint8_t *wp, int64_t N, int64_t K, const float *b, float *y,
                     int nthreads);
void bastion_gemm_q8(const float *x, int64_t R, const int8_t *wp, int64_t N, int64_t K, const float *b, float *y,
                     int nthreads);
int bastion_attn_f32(const float *q, int64_t qh, int64_t qn, const float *k, int64_t kg, int64_t kl,
                     const float *v, int64_t vg, int64_t vl, const float *mask, int64_t mn, float *out,
                     int64_t H, int64_t G, int64_t n, int64_t L, int64_t d, float scale, int nthreads);
void bastion_rms_norm_f32(const float *x, int64_t R, int64_t n, const float *w, float eps, float *y);
void bastion_rope_f32(const float *x, int64_t n, int64_t H, int64_t d, const float *cos, const float *sin,
                      float *out);
void bastion_silu_f32(const float *x, int64_t R, int64_t n, float *y);
void bastion_gemm_h16(const float *x, int64_t R, const uint16_t *wp, int64_t N, int64_t K, const float *b, float *y,
                      int nthreads);
void bastion_gemm_bf16(const uint32_t *x, int64_t R, const uint16_t *wp, int64_t N, int64_t K2, const float *b,
                       float *y, int nthreads);

/* x [R, K] rounded to bf16, to nearest even (ties to the even mantissa; any NaN becomes 0x7fc0, as
 * c10::BFloat16's rounding makes it): torch's float32 -> bfloat16 conversion, so kind 4 reads what
 * Product's cast gives the pair kernel. */
static void round_bf16(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        if ((u & 0x7fffffffu) > 0x7f800000u)
            out[i] = 0x7fc0u;
        else
            out[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

/* y [R, N] = x [R, K] W^T + b by the panels' kind; -1 when kind 4 had no memory for its bf16 rows. */
static int product(int kind, const float *x, int64_t R, const void *wp, int64_t N, int64_t K, const float *b,
                   float *y, int nthreads) {
    switch (kind) {
    case 1: bastion_gemm_q4(x, R, (const uint8_t *)wp, N, K, b, y, nthreads); break;
    case 2: bastion_gemm_q8(x, R, (const int8_t *)wp, N, K, b, y, nthreads); break;
    case 3: bastion_gemm_h16(x, R, (const uint16_t *)wp, N, K, b, y, nthreads); break;
    case 4: {
        uint16_t *xb = malloc((size_t)(R * K) * sizeof(uint16_t));
        if (!xb)
            return -1;
        round_bf16(x, R * K, xb);
        bastion_gemm_bf16((const uint32_t *)xb, R, (const uint16_t *)wp, N, K / 2, b, y, nthreads);
        free(xb);
        break;
    }
    default: bastion_gemm_f32(x, R, (const float *)wp, N, K, b, y, nthreads); break;
    }
    return 0;
}

/* dims: n (query rows), h (hidden), H (query heads), G (KV heads), d (head dim), I (MLP width), past
 * (cache rows before this call), mask row stride, m (context rows before the queries' own: 0 for a
 * target; a drafter's newly committed context, see below).
 * Per layer l (arrays of 7 per layer in the order q, k, v, o, gate, up, down): kinds (0 float32,
 * 1 / 2 exact 4 / 8-bit, 3 bf16 weights widened, 4 bf16 pairs: cpu_gemm.c), panels, bias (NULL: none);
 * norms[4 l ..]: ln1, ln2, q_norm, k_norm (the last two NULL for Llama), eps[4 l ..] their epsilons;
 * kbuf / vbuf: the layer's cache buffers [G, cap[l], d]; capture[l]: where to copy x after the layer
 * (NULL: nowhere). x [n, h] is updated in place; cos / sin [m + n, d]; mask [n, past + m + n] additive
 * or NULL (every key visible).
 * fresh [m, h] (a DFlash drafter's context features, already normed): rows whose keys and values join
 * the cache ahead of the queries' own, from the same k / v products (over [fresh ; rms_norm(x)]), with
 * no query of their own. A target passes m = 0 and fresh = NULL.
 * Returns 0, or -1 when there was no memory for the scratch rows (its own or the attention's). */
int bastion_decoder_f32(float *x, int64_t layers, const int64_t *dims, const int *kinds, const void *const *panels,
                        const float *const *bias, const float *const *norms, const float *eps,
                        float *const *kbuf, float *const *vbuf, const int64_t *cap, float *const *capture,
                        const float *cos, const float *sin, const float *mask, const float *fresh, float scale,
                        int nthreads) {
    const int64_t n = dims[0], h = dims[1], H = dims[2], G = dims[3], d = dims[4], I = dims[5], past = dims[6],
                  mn = dims[7], m = dims[8];
    const int64_t nk = m + n, L = past + nk;
    int64_t wide = n * I; /* s holds the MLP's rows, the normed and the rotated heads */
    if (n * H * d > wide) wide = n * H * d;
    if (nk * G * d > wide) wide = nk * G * d;
    float *scratch = malloc((size_t)(2 * n * h + nk * h + 2 * n * H * d + 2 * nk * G * d + 2 * n * I + wide)
                            * sizeof(float));
    if (!scratch)
        return -1;
    float *hb = scratch, *t = hb + n * h, *kin = t + n * h, *q = kin + nk * h, *a = q + n * H * d,
          *k = a + n * H * d, *v = k + nk * G * d, *g = v + nk * G * d, *u = g + n * I, *s = u + n * I;
    float *qr = a; /* the rotated queries may share a's rows: a is written only by the attention */
    if (m)
        memcpy(kin, fresh, (size_t)(m * h) * sizeof(float));
    for (int64_t l = 0; l < layers; l++) {
        const int *kd = kinds + 7 * l;
        const void *const *w = panels + 7 * l;
        const float *const *b = bias + 7 * l;
        const float *const *nm = norms + 4 * l;
        const float *ep = eps + 4 * l;
        bastion_rms_norm_f32(x, n, h, nm[0], ep[0], hb);
        const float *xk = hb; /* the k / v products' rows: [fresh ; hb] */
        if (m) {
            memcpy(kin + m * h, hb, (size_t)(n * h) * sizeof(float));
            xk = kin;
        }
        if (product(kd[0], hb, n, w[0], H * d, h, b[0], q, nthreads))
            goto fail;
        if (product(kd[1], xk, nk, w[1], G * d, h, b[1], k, nthreads))
            goto fail;
        if (nm[2]) { /* Qwen3: RMSNorm over each head before the rotary embedding */
            bastion_rms_norm_f32(q, n * H, d, nm[2], ep[2], s);
            memcpy(q, s, (size_t)(n * H * d) * sizeof(float));
            bastion_rms_norm_f32(k, nk * G, d, nm[3], ep[3], s);
            memcpy(k, s, (size_t)(nk * G * d) * sizeof(float));
        }
        bastion_rope_f32(q, n, H, d, cos + m * d, sin + m * d, qr);
        float *kb = kbuf[l], *vb = vbuf[l];
        const int64_t kg = cap[l] * d;
        bastion_rope_f32(k, nk, G, d, cos, sin, s); /* then into the cache: rows past.. of each head */
        for (int64_t i = 0; i < nk; i++)
            for (int64_t j = 0; j < G; j++)
                memcpy(kb + j * kg + (past + i) * d, s + (i * G + j) * d, (size_t)d * sizeof(float));
        if (product(kd[2], xk, nk, w[2], G * d, h, b[2], v, nthreads))
            goto fail;
        for (int64_t i = 0; i < nk; i++)
            for (int64_t j = 0; j < G; j++)
                memcpy(vb + j * kg + (past + i) * d, v + (i * G + j) * d, (size_t)d * sizeof(float));
        /* queries [n, H, d] as [H, n, d] strides: head stride d, row stride H d */
        if (bastion_attn_f32(qr, d, H * d, kb, kg, d, vb, kg, d, mask, mn, q, H, G, n, L, d, scale, nthreads))
            goto fail;
        if (product(kd[3], q, n, w[3], h, H * d, b[3], t, nthreads))
            goto fail;
        for (int64_t i = 0; i < n * h; i++)
            x[i] = x[i] + t[i];
        bastion_rms_norm_f32(x, n, h, nm[1], ep[1], hb);
        if (product(kd[4], hb, n, w[4], I, h, b[4], g, nthreads))
            goto fail;
        if (product(kd[5], hb, n, w[5], I, h, b[5], u, nthreads))
            goto fail;
        bastion_silu_f32(g, n, I, s);
        for (int64_t i = 0; i < n * I; i++)
            s[i] = s[i] * u[i];
        if (product(kd[6], s, n, w[6], h, I, b[6], t, nthreads))
            goto fail;
        for (int64_t i = 0; i < n * h; i++)
            x[i] = x[i] + t[i];
        if (capture[l])
            memcpy(capture[l], x, (size_t)(n * h) * sizeof(float));
    }
    free(scratch);
    return 0;
fail:
    free(scratch);
    return -1;
}
