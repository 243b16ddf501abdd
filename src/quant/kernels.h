// quant (internal): the per-type kernel tables of each CPU path. dot_scalar.c fills the
// reference for every computable type; dot_avx2.c and dot_avx512.c override what they speed up.
#pragma once

#include "quant/quant.h"

// s = dot(w, x): n elements, w a weight row of the table's type, x an activation row quantized
// to that type's dot type.
typedef void (*st_dot_fn)(int64_t n, float *s, const void *w, const void *x);
// s[r] = dot(w, x + r * x_stride) for r < nx: one weight row against several activation rows,
// reading the weight row once.
typedef void (*st_dot_multi_fn)(int64_t n, int nx, float *s, const void *w, const void *x,
                                size_t x_stride);

typedef struct st_quant_kernels {
    st_dot_fn dot[ST_TYPE_COUNT];
    st_dot_multi_fn dot_multi[ST_TYPE_COUNT]; // NULL: the dispatcher loops over dot
} st_quant_kernels;

// Each fills the entries it implements and leaves the others as they are; the dispatcher
// starts from the scalar table and lays the faster paths over it.
void st_quant_kernels_scalar(st_quant_kernels *k);
void st_quant_kernels_avx2(st_quant_kernels *k);
void st_quant_kernels_avx512(st_quant_kernels *k);
