// quant: f32 rows to the activation types the CPU dot kernels pair with (F32, F16, BF16, Q8_0,
// Q8_1, Q8_K), reproducing ggml's CPU reference quantizers so dot results match llama.cpp's.

#include <math.h>
#include <string.h>

#include "quant/quant.h"
#include "quant/blocks.h"
#include "quant/kernels.h"

static float block_amax(const float *x, int n) {
    float amax = 0.0f;
    for (int j = 0; j < n; j++) amax = fmaxf(amax, fabsf(x[j]));
    return amax;
}

// Q8_0: d = amax/127; the values are scaled by 1/d before d is rounded to fp16, and rounded
// half away from zero (roundf), as ggml's reference does.
static void quantize_q8_0(const float *x, block_q8_0 *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK8_0) {
        float d = block_amax(x, QK8_0) / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = st_f32_to_f16(d);
        for (int j = 0; j < QK8_0; j++) y[i].qs[j] = (int8_t)roundf(x[j] * id);
    }
}

// Q8_1 as on the CPU: like Q8_0, plus s = d * sum(q) with the unrounded d (CUDA stores the sum
// of the original floats instead; that is the CUDA backend's business).
static void quantize_q8_1(const float *x, block_q8_1 *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK8_1) {
        float d = block_amax(x, QK8_1) / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK8_1; j++) {
            y[i].qs[j] = (int8_t)roundf(x[j] * id);
            sum += y[i].qs[j];
        }
        y[i].d = st_f32_to_f16(d);
        y[i].s = st_f32_to_f16((float)sum * d);
    }
}

// Q8_K: the scale comes from the signed value of largest magnitude, mapped to -127, so the
// opposite extreme lands on +127 and nothing needs -128 (ggml's AVX IQ kernels rely on that).
// Rounding is to nearest even here (ggml's nearest_int), unlike Q8_0's roundf. d stays f32.
static void quantize_q8_K(const float *x, block_q8_K *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK_K; j++)
            if (fabsf(x[j]) > amax) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        if (amax == 0.0f) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        float iscale = -127.0f / max;
        for (int j = 0; j < QK_K; j++) {
            int v = (int)nearbyintf(iscale * x[j]);
            y[i].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int g = 0; g < QK_K / 16; g++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += y[i].qs[16 * g + j];
            y[i].bsums[g] = (int16_t)sum;
        }
        y[i].d = 1.0f / iscale;
    }
}

void st_quantize(st_type type, const float *src, void *dst, int64_t n) {
    const st_type_info *info = st_type_get(type);
    ST_ASSERT(info && n >= 0 && n % info->block == 0);
    int64_t nb = n / info->block;
    st_quantize_fn fast = st_quant_kernels_now()->quantize[type];
    if (fast) {
        fast(src, dst, nb);
        return;
    }
    switch (type) {
    case ST_TYPE_F32: memcpy(dst, src, (size_t)n * sizeof(float)); break;
    case ST_TYPE_F16:
        for (int64_t i = 0; i < n; i++) ((st_f16 *)dst)[i] = st_f32_to_f16(src[i]);
        break;
    case ST_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) ((st_bf16 *)dst)[i] = st_f32_to_bf16(src[i]);
        break;
    case ST_TYPE_Q8_0: quantize_q8_0(src, dst, nb); break;
    case ST_TYPE_Q8_1: quantize_q8_1(src, dst, nb); break;
    case ST_TYPE_Q8_K: quantize_q8_K(src, dst, nb); break;
    default: ST_ASSERT(!"st_quantize: not an activation type");
    }
}
