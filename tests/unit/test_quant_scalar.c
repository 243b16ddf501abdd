// Unit tests for the scalar quant layer: the type table, the activation quantizers (known values
// and round trips) and the scalar dot kernels against dequantize(w) . dequantize(quantize(x))
// computed in double. Dequantization itself is checked bit for bit against gguf-py in
// tests/integration/test_quant_parity.py.
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <float.h>
#include <math.h>
#include <string.h>

#include "quant/quant.h"
#include "quant/blocks.h"
#include "quant/kernels.h"
#include "quant/iq_tables.h"

// ---------------------------------------------------------------------------------------------
// Deterministic random numbers (splitmix64).

static uint64_t rng_state = 0x5eed5eed12345678ull;

static uint64_t rng_u64(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float rng_normal(void) {
    double u1 = ((double)(rng_u64() >> 11) + 1.0) / 9007199254740993.0;
    double u2 = (double)(rng_u64() >> 11) / 9007199254740992.0;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

// ---------------------------------------------------------------------------------------------
// Type table

static void test_type_table(void **state) {
    (void)state;
    static const struct { st_type t; int block, bytes; st_type dot; } want[] = {
        {ST_TYPE_F32, 1, 4, ST_TYPE_F32},          {ST_TYPE_F16, 1, 2, ST_TYPE_F16},
        {ST_TYPE_BF16, 1, 2, ST_TYPE_BF16},        {ST_TYPE_Q4_0, 32, 18, ST_TYPE_Q8_0},
        {ST_TYPE_Q4_1, 32, 20, ST_TYPE_Q8_1},      {ST_TYPE_Q5_0, 32, 22, ST_TYPE_Q8_0},
        {ST_TYPE_Q5_1, 32, 24, ST_TYPE_Q8_1},      {ST_TYPE_Q8_0, 32, 34, ST_TYPE_Q8_0},
        {ST_TYPE_Q8_1, 32, 36, ST_TYPE_Q8_1},      {ST_TYPE_Q2_K, 256, 84, ST_TYPE_Q8_K},
        {ST_TYPE_Q3_K, 256, 110, ST_TYPE_Q8_K},    {ST_TYPE_Q4_K, 256, 144, ST_TYPE_Q8_K},
        {ST_TYPE_Q5_K, 256, 176, ST_TYPE_Q8_K},    {ST_TYPE_Q6_K, 256, 210, ST_TYPE_Q8_K},
        {ST_TYPE_Q8_K, 256, 292, ST_TYPE_Q8_K},    {ST_TYPE_IQ2_XXS, 256, 66, ST_TYPE_Q8_K},
        {ST_TYPE_IQ2_XS, 256, 74, ST_TYPE_Q8_K},   {ST_TYPE_IQ3_XXS, 256, 98, ST_TYPE_Q8_K},
        {ST_TYPE_IQ1_S, 256, 50, ST_TYPE_Q8_K},    {ST_TYPE_IQ4_NL, 32, 18, ST_TYPE_Q8_0},
        {ST_TYPE_IQ3_S, 256, 110, ST_TYPE_Q8_K},   {ST_TYPE_IQ2_S, 256, 82, ST_TYPE_Q8_K},
        {ST_TYPE_IQ4_XS, 256, 136, ST_TYPE_Q8_K},  {ST_TYPE_IQ1_M, 256, 56, ST_TYPE_Q8_K},
        {ST_TYPE_TQ1_0, 256, 54, ST_TYPE_Q8_K},    {ST_TYPE_TQ2_0, 256, 66, ST_TYPE_Q8_K},
        {ST_TYPE_MXFP4, 32, 17, ST_TYPE_Q8_0},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const st_type_info *info = st_type_get(want[i].t);
        assert_non_null(info);
        assert_int_equal(info->block, want[i].block);
        assert_int_equal(info->block_bytes, want[i].bytes);
        assert_int_equal(info->dot_type, want[i].dot);
        assert_int_equal(info->quantized, want[i].block > 1);
        st_type back;
        assert_true(st_type_from_name(info->name, &back));
        assert_int_equal(back, want[i].t);
    }
    static const int plain[] = {ST_TYPE_I8, ST_TYPE_I16, ST_TYPE_I32, ST_TYPE_I64, ST_TYPE_F64};
    static const int plain_bytes[] = {1, 2, 4, 8, 8};
    for (int i = 0; i < 5; i++) {
        assert_int_equal(st_type_get(plain[i])->block_bytes, plain_bytes[i]);
        assert_false(st_type_get(plain[i])->compute);
    }
    // Removed ggml ids and out-of-range ids are unknown.
    static const int gone[] = {-1, 4, 5, 31, 32, 33, 36, 37, 38, 40, 1000};
    for (int i = 0; i < 11; i++) assert_null(st_type_get(gone[i]));
    assert_string_equal(st_type_name(4), "unknown(4)");
    assert_string_equal(st_type_name(ST_TYPE_Q4_K), "q4_K");
    st_type t;
    assert_true(st_type_from_name("IQ2_XXS", &t));
    assert_int_equal(t, ST_TYPE_IQ2_XXS);
    assert_true(st_type_from_name("Q6_k", &t));
    assert_int_equal(t, ST_TYPE_Q6_K);
    assert_false(st_type_from_name("q4_2", &t));
    assert_int_equal(st_row_bytes(ST_TYPE_Q4_K, 512), 288);
    assert_int_equal(st_row_bytes(ST_TYPE_Q8_0, 2048), 64 * 34);
    assert_int_equal(st_row_bytes(ST_TYPE_F16, 7), 14);
    assert_false(st_type_get(ST_TYPE_Q8_1)->compute);
    assert_false(st_type_get(ST_TYPE_Q8_K)->compute);
    assert_false(st_type_get(ST_TYPE_TQ1_0)->compute);
}

// Every type marked computable has a scalar dot kernel; no other type has one.
static void test_kernel_table(void **state) {
    (void)state;
    st_quant_kernels k;
    memset(&k, 0, sizeof k);
    st_quant_kernels_scalar(&k);
    for (int t = 0; t < ST_TYPE_COUNT; t++) {
        const st_type_info *info = st_type_get(t);
        assert_int_equal(k.dot[t] != NULL, info && info->compute);
    }
}

// ---------------------------------------------------------------------------------------------
// Quantizers: known values

// Q8_0 and Q8_1 round half away from zero; with amax 127 the scale is exactly 1.
static void test_q8_0_known(void **state) {
    (void)state;
    float x[32] = {127.0f, 2.5f, -2.5f, 0.5f, -0.49f, 3.7f, -126.5f};
    block_q8_0 b;
    st_quantize(ST_TYPE_Q8_0, x, &b, 32);
    assert_int_equal(b.d, 0x3c00);
    static const int8_t want[7] = {127, 3, -3, 1, 0, 4, -127};
    for (int j = 0; j < 7; j++) assert_int_equal(b.qs[j], want[j]);
    for (int j = 7; j < 32; j++) assert_int_equal(b.qs[j], 0);

    block_q8_1 b1;
    st_quantize(ST_TYPE_Q8_1, x, &b1, 32);
    assert_int_equal(b1.d, 0x3c00);
    assert_memory_equal(b1.qs, b.qs, 32);
    assert_true(st_f16_to_f32(b1.s) == 127 + 3 - 3 + 1 + 4 - 127); // d * sum(q), d = 1

    // amax 254: d = 2 exactly, x / d = 1.25 -> 1.
    float y[32] = {-254.0f, 2.5f};
    st_quantize(ST_TYPE_Q8_0, y, &b, 32);
    assert_int_equal(b.d, 0x4000);
    assert_int_equal(b.qs[0], -127);
    assert_int_equal(b.qs[1], 1);

    // An all-zero block: d = 0 and q = 0, no division by zero.
    float z[32] = {0};
    st_quantize(ST_TYPE_Q8_0, z, &b, 32);
    assert_int_equal(b.d, 0);
    for (int j = 0; j < 32; j++) assert_int_equal(b.qs[j], 0);
}

// Q8_K: the element of largest magnitude maps to -127 (so d takes its opposite sign), rounding
// is to nearest even, and bsums are the sums of 16.
static void test_q8_K_known(void **state) {
    (void)state;
    float x[256] = {0};
    x[0] = -127.0f; // iscale = 1, d = 1
    x[1] = 2.5f;
    x[2] = -2.5f;
    x[3] = 3.5f;
    x[17] = 100.0f;
    block_q8_K b;
    st_quantize(ST_TYPE_Q8_K, x, &b, 256);
    assert_true(b.d == 1.0f);
    assert_int_equal(b.qs[0], -127);
    assert_int_equal(b.qs[1], 2);
    assert_int_equal(b.qs[2], -2);
    assert_int_equal(b.qs[3], 4);
    assert_int_equal(b.bsums[0], -127 + 2 - 2 + 4);
    assert_int_equal(b.bsums[1], 100);
    for (int g = 2; g < 16; g++) assert_int_equal(b.bsums[g], 0);

    x[0] = 127.0f; // positive max: iscale = -1, d = -1, values flip sign
    st_quantize(ST_TYPE_Q8_K, x, &b, 256);
    assert_true(b.d == -1.0f);
    assert_int_equal(b.qs[0], -127);
    assert_int_equal(b.qs[1], -2);
    assert_int_equal(b.qs[17], -100);

    float z[256] = {0};
    memset(&b, 0x55, sizeof b);
    st_quantize(ST_TYPE_Q8_K, z, &b, 256);
    assert_true(b.d == 0.0f);
    for (int j = 0; j < 256; j++) assert_int_equal(b.qs[j], 0);
    for (int g = 0; g < 16; g++) assert_int_equal(b.bsums[g], 0);
}

// F16 / BF16 rows round to nearest even (the util conversions); F32 copies.
static void test_plain_quantize(void **state) {
    (void)state;
    float x[3] = {1.0f, 1.00048828125f /* 1 + 2^-11: tie, to even */, -2.0f};
    st_f16 h[3];
    st_quantize(ST_TYPE_F16, x, h, 3);
    assert_int_equal(h[0], 0x3c00);
    assert_int_equal(h[1], 0x3c00);
    assert_int_equal(h[2], 0xc000);
    st_bf16 b[3];
    st_quantize(ST_TYPE_BF16, x, b, 3);
    assert_int_equal(b[0], 0x3f80);
    assert_int_equal(b[2], 0xc000);
    float f[3];
    st_quantize(ST_TYPE_F32, x, f, 3);
    assert_memory_equal(f, x, sizeof x);
}

// ---------------------------------------------------------------------------------------------
// Quantizers: round trips within their step

// Q8_0 / Q8_1: |x - d16 q| <= d/2 (rounding) + 127 |d16 - d| (the stored scale is fp16), with d
// the exact amax/127.
static void test_q8_roundtrip(void **state) {
    (void)state;
    static const st_type types[] = {ST_TYPE_Q8_0, ST_TYPE_Q8_1};
    for (int ti = 0; ti < 2; ti++)
        for (int nb = 1; nb <= 9; nb += 4) {
            int n = 32 * nb;
            float x[32 * 9], y[32 * 9];
            uint8_t q[36 * 9];
            for (int i = 0; i < n; i++) x[i] = rng_normal() * (i < 32 ? 1e-3f : 10.0f);
            st_quantize(types[ti], x, q, n);
            st_dequantize(types[ti], q, y, n);
            for (int b = 0; b < nb; b++) {
                float amax = 0;
                for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[32 * b + j]));
                double d = amax / 127.0, d16 = st_f16_to_f32(st_f32_to_f16((float)d));
                double tol = d / 2 + 127 * fabs(d16 - d) + 1e-6 * amax;
                for (int j = 0; j < 32; j++) assert_true(fabs((double)x[32 * b + j] - y[32 * b + j]) <= tol);
            }
        }
}

// Q8_K keeps an f32 scale: the error is within half a step, and bsums match the quants.
static void test_q8_K_roundtrip(void **state) {
    (void)state;
    for (int nb = 1; nb <= 3; nb += 2) {
        int n = 256 * nb;
        float x[256 * 3], y[256 * 3];
        block_q8_K q[3];
        for (int i = 0; i < n; i++) x[i] = rng_normal() * (i % 3 ? 0.5f : 4.0f);
        st_quantize(ST_TYPE_Q8_K, x, q, n);
        st_dequantize(ST_TYPE_Q8_K, q, y, n);
        for (int b = 0; b < nb; b++) {
            double step = fabs(q[b].d);
            for (int j = 0; j < 256; j++) {
                assert_true(q[b].qs[j] >= -127);
                assert_true(fabs((double)x[256 * b + j] - y[256 * b + j]) <= step * (0.5 + 1e-5));
            }
            for (int g = 0; g < 16; g++) {
                int s = 0;
                for (int j = 0; j < 16; j++) s += q[b].qs[16 * g + j];
                assert_int_equal(q[b].bsums[g], s);
            }
        }
    }
}

static void test_half_roundtrip(void **state) {
    (void)state;
    float x[101], y[101];
    st_f16 h[101];
    for (int i = 0; i < 101; i++) x[i] = rng_normal() * 100.0f;
    st_quantize(ST_TYPE_F16, x, h, 101);
    st_dequantize(ST_TYPE_F16, h, y, 101);
    for (int i = 0; i < 101; i++) assert_true(fabsf(x[i] - y[i]) <= fabsf(x[i]) * 0x1p-11f);
    st_quantize(ST_TYPE_BF16, x, h, 101);
    st_dequantize(ST_TYPE_BF16, h, y, 101);
    for (int i = 0; i < 101; i++) assert_true(fabsf(x[i] - y[i]) <= fabsf(x[i]) * 0x1p-8f);
}

// ---------------------------------------------------------------------------------------------
// Dequantization: hand-built blocks (the full layouts are compared with gguf-py in pytest)

static void test_dequant_known(void **state) {
    (void)state;
    float y[256];

    block_q4_0 a = {.d = 0x3c00}; // d = 1
    a.qs[0] = 0x9f;               // element 0: 15 - 8, element 16: 9 - 8
    st_dequantize(ST_TYPE_Q4_0, &a, y, 32);
    assert_true(y[0] == 7.0f && y[16] == 1.0f && y[1] == -8.0f);

    block_q5_0 c = {.d = 0x4000}; // d = 2
    c.qh[2] = 0x01;               // 5th bit of element 16
    c.qs[0] = 0x3f;
    st_dequantize(ST_TYPE_Q5_0, &c, y, 32);
    assert_true(y[0] == 2.0f * (15 - 16) && y[16] == 2.0f * (3 + 16 - 16) && y[1] == -32.0f);

    // Q4_K sub-block 5: scale = (b[9] & 15) | (b[1] >> 6) << 4, min = (b[9] >> 4) | (b[5] >> 6) << 4.
    block_q4_K k = {.d = 0x3c00, .dmin = 0x3800}; // d = 1, dmin = 0.5
    k.scales[1] = 0xc0;
    k.scales[5] = 0x40;
    k.scales[9] = 0x27;
    k.qs[64] = 0x30; // element 160 (sub-block 5 = high nibbles of bytes 64..95): 3
    st_dequantize(ST_TYPE_Q4_K, &k, y, 256);
    assert_true(y[160] == (float)(7 | 3 << 4) * 3 - 0.5f * (2 | 1 << 4));
    uint8_t sc, m;
    st_kq_scale_min(k.scales, 5, &sc, &m);
    assert_int_equal(sc, 55);
    assert_int_equal(m, 18);

    // Q3_K: scale 13 has low bits from the high nibble of byte 5 and high bits 2..3 of byte 9.
    uint8_t q3[12] = {0};
    q3[5] = 0xa0;
    q3[9] = 0xc0; // bits 6..7: the high bits of scales 1, 5, 9, 13 sit at 2 * (s / 4)
    int8_t s3[16];
    st_q3k_scales(q3, s3);
    assert_int_equal(s3[13], (10 | 3 << 4) - 32);
    assert_int_equal(s3[0], -32);

    block_iq4_nl nl = {.d = 0x3c00};
    nl.qs[3] = 0xf0;
    st_dequantize(ST_TYPE_IQ4_NL, &nl, y, 32);
    assert_true(y[3] == -127.0f && y[19] == 113.0f);

    // Table facts: the sign table's 8th bit restores even parity; grid row 0 is all 8s.
    for (int i = 0; i < 128; i++) {
        assert_int_equal(st_ksigns_iq2xs[i] & 127, i);
        assert_int_equal(__builtin_popcount(st_ksigns_iq2xs[i]) % 2, 0);
    }
    assert_true(st_iq2xxs_grid[0] == 0x0808080808080808ull);
    assert_true(st_iq1s_grid[0] == 0xffffffffffffffffull);
}

// ---------------------------------------------------------------------------------------------
// Dot kernels against dequantize(w) . dequantize(quantize(x)) in double. The kernels multiply
// quants exactly in integers, so the only differences are float roundings of the per-block
// scaling and the float accumulation: the tolerance is 16 (blocks + 2) FLT_EPSILON sum|w_i x_i|.

static void put_f16(uint8_t *p, float v) {
    st_f16 h = st_f32_to_f16(v);
    memcpy(p, &h, 2);
}

// Random bytes for every quant field, then sane fp16 scales (finite, about 0.01 in size) so the
// values are well scaled. Plain types get normal values.
static void random_row(st_type t, uint8_t *row, int nb) {
    const st_type_info *info = st_type_get(t);
    int bytes = info->block_bytes;
    if (!info->quantized) {
        for (int i = 0; i < nb; i++) {
            float v = rng_normal();
            if (t == ST_TYPE_F32) memcpy(row + 4 * i, &v, 4);
            else if (t == ST_TYPE_F16) put_f16(row + 2 * i, v);
            else {
                st_bf16 b = st_f32_to_bf16(v);
                memcpy(row + 2 * i, &b, 2);
            }
        }
        return;
    }
    for (int i = 0; i < nb * bytes; i++) row[i] = (uint8_t)rng_u64();
    for (int b = 0; b < nb; b++) {
        uint8_t *blk = row + (size_t)b * bytes;
        switch (t) {
        case ST_TYPE_Q2_K:
            put_f16(blk + offsetof(block_q2_K, d), 0.01f * rng_normal());
            put_f16(blk + offsetof(block_q2_K, dmin), 0.01f * rng_normal());
            break;
        case ST_TYPE_Q3_K: put_f16(blk + offsetof(block_q3_K, d), 0.01f * rng_normal()); break;
        case ST_TYPE_Q6_K: put_f16(blk + offsetof(block_q6_K, d), 0.01f * rng_normal()); break;
        case ST_TYPE_Q4_1: case ST_TYPE_Q5_1: case ST_TYPE_Q4_K: case ST_TYPE_Q5_K:
            put_f16(blk, 0.01f * rng_normal()); // d, then m / dmin
            put_f16(blk + 2, 0.01f * rng_normal());
            break;
        case ST_TYPE_IQ1_M: { // the fp16 scale lives in the top nibbles of the 4 scale words
            st_f16 d = st_f32_to_f16(0.01f * rng_normal());
            uint8_t *sc = blk + offsetof(block_iq1_m, scales);
            for (int k = 0; k < 4; k++) sc[2 * k + 1] = (uint8_t)((sc[2 * k + 1] & 0x0f) | ((d >> (4 * k)) & 15) << 4);
            break;
        }
        default: put_f16(blk, 0.01f * rng_normal()); break; // d first
        }
    }
}

// ggml's Q4_1 / Q5_1 dot takes the offset term m * dx * sum(qx) from the activation's stored s,
// which is fp16(d * sum(q)) with the exact d rather than d16 * sum(q) (a relative difference up to
// about 2^-10). This returns what that changes in the dot, so the comparison stays exact.
static double q8_1_s_correction(st_type t, const uint8_t *w, const block_q8_1 *x, int nb) {
    double corr = 0;
    for (int b = 0; b < nb; b++) {
        st_f16 mh;
        memcpy(&mh, w + (size_t)b * st_type_get(t)->block_bytes + 2, 2); // m follows d
        int sum = 0;
        for (int j = 0; j < 32; j++) sum += x[b].qs[j];
        corr += (double)st_f16_to_f32(mh) * ((double)st_f16_to_f32(x[b].s) - (double)st_f16_to_f32(x[b].d) * sum);
    }
    return corr;
}

static void test_dot_vs_dequant(void **state) {
    (void)state;
    st_quant_kernels k;
    memset(&k, 0, sizeof k);
    st_quant_kernels_scalar(&k);
    static const int block_counts[] = {1, 3, 7};
    enum { MAXN = 256 * 7 };
    static uint8_t w[MAXN * 4], xq[MAXN * 4];
    static float wf[MAXN], x[MAXN], xf[MAXN];
    int checked = 0;
    for (int t = 0; t < ST_TYPE_COUNT; t++) {
        const st_type_info *info = st_type_get(t);
        if (!info || !info->compute) continue;
        st_type dt = info->dot_type;
        for (int c = 0; c < 3; c++)
            for (int row = 0; row < 3; row++) { // several rows per size, each with fresh data
                int nb = block_counts[c] * (info->block == 1 ? 37 : 1); // plain types: odd n
                int64_t n = (int64_t)nb * info->block;
                random_row(t, w, nb);
                st_dequantize(t, w, wf, n);
                for (int64_t i = 0; i < n; i++) x[i] = rng_normal() * (row == 1 ? 100.0f : 1.0f);
                st_quantize(dt, x, xq, n);
                st_dequantize(dt, xq, xf, n);
                double ref = 0, mag = 0;
                for (int64_t i = 0; i < n; i++) {
                    ref += (double)wf[i] * xf[i];
                    mag += fabs((double)wf[i] * xf[i]);
                }
                if (dt == ST_TYPE_Q8_1) ref += q8_1_s_correction((st_type)t, w, (const block_q8_1 *)xq, nb);
                float got = NAN;
                k.dot[t](n, &got, w, xq);
                // Float rounding: a few roundings per block and one per block accumulated, each
                // bounded by eps times the magnitude of the products involved (16x margin).
                double tol = 16.0 * (nb + 2) * FLT_EPSILON * mag + 1e-30;
                if (!(fabs(got - ref) <= tol))
                    fail_msg("%s n=%lld: dot %.9g, reference %.9g, tolerance %.3g", info->name, (long long)n,
                             got, ref, tol);
                checked++;
            }
    }
    assert_int_equal(checked, 22 * 9);
}

// A hand-made case: all quants 1 and scales 1 give n.
static void test_dot_known(void **state) {
    (void)state;
    st_quant_kernels k;
    memset(&k, 0, sizeof k);
    st_quant_kernels_scalar(&k);
    block_q8_0 w[3], x[3];
    for (int b = 0; b < 3; b++) {
        w[b].d = x[b].d = 0x3c00;
        memset(w[b].qs, 1, 32);
        memset(x[b].qs, 2, 32);
    }
    float s = 0;
    k.dot[ST_TYPE_Q8_0](96, &s, w, x);
    assert_true(s == 192.0f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_type_table),     cmocka_unit_test(test_kernel_table),
        cmocka_unit_test(test_q8_0_known),     cmocka_unit_test(test_q8_K_known),
        cmocka_unit_test(test_plain_quantize), cmocka_unit_test(test_q8_roundtrip),
        cmocka_unit_test(test_q8_K_roundtrip), cmocka_unit_test(test_half_roundtrip),
        cmocka_unit_test(test_dequant_known),  cmocka_unit_test(test_dot_vs_dequant),
        cmocka_unit_test(test_dot_known),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
