/*
 * The counter-based uniform stream of kernels/reference.py (uniform_stream), natively: for each row
 * key k_i (the row counter and seed already mixed, uint32) and token v,
 *   u[i, v] = ((h >> 9) + 0.5) * 2^-23,  h = mix32(k_i ^ mix32(v + 0x9E3779B9)),
 * with mix32 the 'lowbias32' hash. Integer arithmetic and exact float conversions only, so the bits
 * equal the torch reference's (tests/test_sampling.py) - which builds int64 tensors op by op, ~1 ms
 * a row of 49,152 tokens on the 2-core Zen 3, paid for every new position a sampled round draws at.
 *
 * Compiled into the same library as cpu_gemm.c (kernels/cpu_native.py).
 */
#include <stdint.h>

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

void bastion_uniform_rows(const uint32_t *keys, int64_t n, int64_t vocab, float *out) {
    for (int64_t i = 0; i < n; i++) { /* a row at a time: the token loop vectorises (8 lanes with AVX2) */
        const uint32_t key = keys[i];
        float *o = out + i * vocab;
        for (int64_t v = 0; v < vocab; v++) {
            uint32_t h = mix32(key ^ mix32((uint32_t)v + 0x9E3779B9u));
            o[v] = ((float)(h >> 9) + 0.5f) * (1.0f / 8388608.0f);
        }
    }
}

/* The same variates at a subset of each row's tokens, given their halves of the hash
 * (col_keys[j] = mix32(v_j + 0x9E3779B9)): a drafter's vocabulary of ~8,600 tokens instead of a
 * row of 49,152 (coupled drafting, bastion/coupling.py). */
void bastion_uniform_cells(const uint32_t *keys, int64_t n, const uint32_t *col_keys, int64_t m, float *out) {
    for (int64_t i = 0; i < n; i++) {
        const uint32_t key = keys[i];
        float *o = out + i * m;
        for (int64_t j = 0; j < m; j++) {
            uint32_t h = mix32(key ^ col_keys[j]);
            o[j] = ((float)(h >> 9) + 0.5f) * (1.0f / 8388608.0f);
        }
    }
}
