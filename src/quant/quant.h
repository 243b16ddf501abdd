// quant: the ggml tensor types (ids, block sizes), dequantization, activation quantization,
// and the CPU dot / matrix kernels (scalar reference, AVX2, AVX-512) chosen at run time.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "util/util.h"

// ggml's type ids, as stored in GGUF tensor infos.
typedef enum st_type {
    ST_TYPE_F32 = 0,
    ST_TYPE_F16 = 1,
    ST_TYPE_Q4_0 = 2,
    ST_TYPE_Q4_1 = 3,
    ST_TYPE_Q5_0 = 6,
    ST_TYPE_Q5_1 = 7,
    ST_TYPE_Q8_0 = 8,
    ST_TYPE_Q8_1 = 9,
    ST_TYPE_Q2_K = 10,
    ST_TYPE_Q3_K = 11,
    ST_TYPE_Q4_K = 12,
    ST_TYPE_Q5_K = 13,
    ST_TYPE_Q6_K = 14,
    ST_TYPE_Q8_K = 15,
    ST_TYPE_IQ2_XXS = 16,
    ST_TYPE_IQ2_XS = 17,
    ST_TYPE_IQ3_XXS = 18,
    ST_TYPE_IQ1_S = 19,
    ST_TYPE_IQ4_NL = 20,
    ST_TYPE_IQ3_S = 21,
    ST_TYPE_IQ2_S = 22,
    ST_TYPE_IQ4_XS = 23,
    ST_TYPE_I8 = 24,
    ST_TYPE_I16 = 25,
    ST_TYPE_I32 = 26,
    ST_TYPE_I64 = 27,
    ST_TYPE_F64 = 28,
    ST_TYPE_IQ1_M = 29,
    ST_TYPE_BF16 = 30,
    ST_TYPE_TQ1_0 = 34, // known sizes only (no kernels)
    ST_TYPE_TQ2_0 = 35,
    ST_TYPE_MXFP4 = 39,
    ST_TYPE_COUNT = 40, // ids below this may exist in files; st_type_get says which we know
} st_type;

typedef struct st_type_info {
    const char *name;  // ggml's spelling: "f32", "q4_K", "iq2_xxs", ...
    int block;         // elements per block (1 for plain types)
    int block_bytes;   // bytes per block
    st_type dot_type;  // activation type the CPU dot kernels pair with (REFERENCE.md §4.3)
    bool quantized;    // a block format (not a plain number type)
    bool compute;      // dequantize and dot kernels exist (false for I8..F64, Q8_1/Q8_K weights)
} st_type_info;

const st_type_info *st_type_get(int type); // NULL for an id we do not know
const char *st_type_name(int type);        // "unknown(N)" for an id we do not know
bool st_type_from_name(const char *name, st_type *type); // case-insensitive
size_t st_row_bytes(st_type type, int64_t n);              // n a multiple of the block size

// Rows of n elements (n a multiple of the block size) to and from f32.
void st_dequantize(st_type type, const void *src, float *dst, int64_t n);
// Quantizes f32 to an activation type (F32, F16, BF16, Q8_0, Q8_1, Q8_K) the way ggml's CPU
// reference does.
void st_quantize(st_type type, const float *src, void *dst, int64_t n);
// Quantizes `rows` rows of n f32 weights (n a multiple of the block size) for storage
// (quantize_weights.c): F32, F16, BF16, Q8_0 (the same bytes as st_quantize), Q4_0, Q4_1, Q5_0,
// Q5_1 (the formats' plain rounding, as gguf-py), Q2_K..Q6_K, IQ4_NL, IQ4_XS (searched scales).
// Deterministic; rows are independent, so callers may split them over threads.
bool st_quantize_weights_supported(st_type type);
void st_quantize_weights(st_type type, const float *src, void *dst, int64_t rows, int64_t n);

// ---------------------------------------------------------------------------------------------
// CPU kernels. Every path computes the same dot products; SIMD paths are tested against the
// scalar one. STRATA_CPU=scalar|avx2|avx512 overrides the cpuid choice.

typedef enum st_cpu_path { ST_CPU_SCALAR, ST_CPU_AVX2, ST_CPU_AVX512, ST_CPU_PATH_COUNT } st_cpu_path;
const char *st_cpu_path_name(st_cpu_path path);
bool st_cpu_path_supported(st_cpu_path path);    // this CPU can run it
st_cpu_path st_cpu_path_get(void);               // the path in use
st_status st_cpu_path_set(st_cpu_path path);     // fails if the CPU lacks it

// dot(w_row, x) for one weight row of type `type` and an activation row already quantized to
// st_type_get(type)->dot_type, n elements.
float st_vec_dot(st_type type, int64_t n, const void *w, const void *x);

// y[r * ldy + o] = dot(W[o, :], X[r, :]) for o < rows, r < nx. W is rows x n of `type`,
// row-contiguous; X is nx activation rows quantized to the dot type, x_stride bytes apart.
// Each weight row is read once for all nx rows. Work is split over the pool by rows of W. From
// 4 activation rows on, types with a GEMM kernel on the path (kernels.h) go 8 weight rows at a
// time through it, unless row_exact.
typedef struct st_matmul_args {
    st_type type;
    const void *w;      // (rows, n) weights
    int64_t n, rows;
    const void *x;      // (nx, n) quantized activations
    size_t x_stride;    // bytes between activation rows
    int nx;
    float *y;           // (nx, ldy) output
    int64_t ldy;
    // Each activation row's outputs are the bits st_matmul gives that row alone (nx = 1):
    // decode and verify windows, whose logits must not depend on the window. (dot_multi gives
    // dot's bits on every path; the GEMM kernels sum in their own order and are left out.)
    bool row_exact;
} st_matmul_args;
void st_matmul(st_pool *pool, const st_matmul_args *args);
// Several independent products (at most ST_MATMUL_MANY of them) as one pool run: one wake-up
// and one join where as many st_matmul calls take one each (decode's q, k and v share their
// input). Each output row is computed exactly as st_matmul computes it.
#define ST_MATMUL_MANY 4 // the most a forward takes at once (q, k, v)
void st_matmul_many(st_pool *pool, int n, const st_matmul_args *args);
