// quant (internal): the per-type kernel tables of each CPU path. dot_scalar.c fills the
// reference for every computable type; dot_avx2.c and dot_avx512.c override what they speed up.
#pragma once

#include "quant/quant.h"

// s = dot(w, x): n elements, w a weight row of the table's type, x an activation row quantized
// to that type's dot type.
typedef void (*st_dot_fn)(int64_t n, float *s, const void *w, const void *x);
// s[r] = dot(w, x + r * x_stride) for r < nx: one weight row against several activation rows,
// reading the weight row once. Each s[r] is the bits dot gives (test_quant_simd checks it on
// every path): a window's rows get a row's (st_matmul_args.row_exact).
typedef void (*st_dot_multi_fn)(int64_t n, int nx, float *s, const void *w, const void *x,
                                size_t x_stride);

// GEMM for many activation rows (prompt chunks): ST_GEMM_ROWS weight rows are first laid out
// together (values unpacked, the rows interleaved in 4-byte groups, scales as vectors over the
// rows), then that tile is multiplied with every activation row, so the unpacking is paid once
// per tile and each activation group is broadcast against all 8 rows at once.
#define ST_GEMM_ROWS 8
// Lays out blocks [0, nb) of ST_GEMM_ROWS weight rows (w_row_bytes apart) into dst, which holds
// gemm_block_bytes bytes per block and is 32-byte aligned.
typedef void (*st_gemm_pack_fn)(int64_t nb, void *dst, const void *w, size_t w_row_bytes);
// y[r * ldy + o] (+)= dot(packed row o, x + r * x_stride) over nb blocks, for o < ST_GEMM_ROWS,
// r < nx; add: accumulate into y (a later K chunk) instead of storing.
typedef void (*st_gemm_fn)(int64_t nb, int nx, float *y, int64_t ldy, const void *packed,
                           const void *x, size_t x_stride, bool add);

// Activation rows to a dot type: nb blocks of x into y, byte for byte what quantize.c's scalar
// code writes (the reference that matches llama.cpp's CPU quantizers).
typedef void (*st_quantize_fn)(const float *x, void *y, int64_t nb);

// Weight or cache rows back to f32: n elements of x into y, the same values as dequant.c's code
// (NaNs as NaNs).
typedef void (*st_dequantize_fn)(const void *x, float *y, int64_t n);

typedef struct st_quant_kernels {
    st_quantize_fn quantize[ST_TYPE_COUNT];   // NULL: quantize.c's scalar code
    st_dequantize_fn dequantize[ST_TYPE_COUNT]; // NULL: dequant.c's scalar code
    st_dot_fn dot[ST_TYPE_COUNT];
    st_dot_multi_fn dot_multi[ST_TYPE_COUNT]; // NULL: the dispatcher loops over dot
    st_gemm_pack_fn gemm_pack[ST_TYPE_COUNT]; // NULL: no GEMM kernel, st_matmul uses dot_multi
    st_gemm_fn gemm[ST_TYPE_COUNT];
    int gemm_block_bytes[ST_TYPE_COUNT];      // packed bytes per weight block of 8 rows
} st_quant_kernels;

// Each fills the entries it implements and leaves the others as they are; the dispatcher
// starts from the scalar table and lays the faster paths over it.
void st_quant_kernels_scalar(st_quant_kernels *k);
// The current path's table (cpu.c).
const st_quant_kernels *st_quant_kernels_now(void);
void st_quant_kernels_avx2(st_quant_kernels *k);
void st_quant_kernels_avx512(st_quant_kernels *k);
