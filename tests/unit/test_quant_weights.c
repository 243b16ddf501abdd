// Unit tests for the weight quantizers (quantize_weights.c): per-type error bounds on Gaussian
// data (RMSE of dequantize(quantize(x)) relative to the data's RMS), determinism and row
// independence, Q8_0 = the activation quantizer, scale invariance, zero / constant / outlier
// blocks. Byte parity with gguf-py for the legacy types is in tests/integration/test_quantize.py.
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <string.h>

#include "quant/quant.h"
#include "quant/iq_tables.h"

// Deterministic random numbers (splitmix64, Box-Muller).
static uint64_t rng_state;

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

static void fill_normal(float *x, int64_t n, float scale, uint64_t seed) {
    rng_state = seed;
    for (int64_t i = 0; i < n; i++) x[i] = scale * rng_normal();
}

// The bound on RMSE / RMS for standard Gaussian data, per type: the measured value of this
// implementation (64 rows x 1024, seed 42) in the comment, the bound about 10% above it, so a
// change that makes a quantizer worse fails here. For scale: a uniform quantizer's error is
// step/sqrt(12), and a 32-value Gaussian block spans about ±2.4σ, so 4-bit types land near 7-8%.
static const struct { st_type type; double bound; } cases[] = {
    {ST_TYPE_F32, 0.0},       // exact
    {ST_TYPE_F16, 2.3e-4},    // 2.08e-4
    {ST_TYPE_BF16, 1.85e-3},  // 1.67e-3
    {ST_TYPE_Q8_0, 5.9e-3},   // 5.34e-3
    {ST_TYPE_Q6_K, 1.85e-2},  // 1.68e-2
    {ST_TYPE_Q5_1, 4.15e-2},  // 3.76e-2
    {ST_TYPE_Q5_0, 4.7e-2},   // 4.26e-2
    {ST_TYPE_Q5_K, 3.8e-2},   // 3.46e-2
    {ST_TYPE_Q4_1, 8.6e-2},   // 7.79e-2
    {ST_TYPE_Q4_0, 9.4e-2},   // 8.51e-2
    {ST_TYPE_Q4_K, 7.75e-2},  // 7.03e-2
    {ST_TYPE_IQ4_NL, 8.1e-2}, // 7.32e-2
    {ST_TYPE_IQ4_XS, 8.15e-2},// 7.40e-2
    {ST_TYPE_Q3_K, 1.6e-1},   // 1.44e-1
    {ST_TYPE_Q2_K, 2.9e-1},   // 2.63e-1
};
#define N_CASES (int)(sizeof cases / sizeof cases[0])

#define ROWS 64
#define COLS 1024

// RMSE(dequantize(quantize(x)) - x) / RMS(x), in double.
static double rel_rmse(st_type type, const float *x, int64_t rows, int64_t n) {
    size_t bytes = (size_t)rows * st_row_bytes(type, n);
    void *q = test_malloc(bytes);
    float *y = test_malloc((size_t)(rows * n) * sizeof(float));
    st_quantize_weights(type, x, q, rows, n);
    st_dequantize(type, q, y, rows * n);
    double se = 0.0, ss = 0.0;
    for (int64_t i = 0; i < rows * n; i++) {
        se += ((double)y[i] - x[i]) * ((double)y[i] - x[i]);
        ss += (double)x[i] * x[i];
    }
    test_free(q);
    test_free(y);
    return ss > 0.0 ? sqrt(se / ss) : sqrt(se);
}

static void test_error_bounds(void **state) {
    (void)state;
    float *x = test_malloc(ROWS * COLS * sizeof(float));
    fill_normal(x, ROWS * COLS, 1.0f, 42);
    int over = 0; // every type is measured and printed before the test fails
    for (int c = 0; c < N_CASES; c++) {
        assert_true(st_quantize_weights_supported(cases[c].type));
        double e = rel_rmse(cases[c].type, x, ROWS, COLS);
        print_message("%-7s relative RMSE %.3e (bound %.2e)%s\n", st_type_name(cases[c].type), e,
                      cases[c].bound, e <= cases[c].bound ? "" : "  OVER");
        over += e > cases[c].bound;
    }
    test_free(x);
    assert_int_equal(over, 0);
}

// The error is relative: scaling the data by 2^k (exact in float and fp16) scales the error.
static void test_scale_invariance(void **state) {
    (void)state;
    float *x = test_malloc(16 * 256 * sizeof(float));
    for (int c = 0; c < N_CASES; c++) {
        for (float scale = 1.0f / 1024.0f; scale <= 64.0f; scale *= 8.0f) {
            fill_normal(x, 16 * 256, scale, 7);
            double e = rel_rmse(cases[c].type, x, 16, 256);
            assert_true(e <= cases[c].bound * 1.3 + 1e-7);
        }
    }
    test_free(x);
}

// Same bytes on every call, and rows quantized one at a time give the bytes of all at once.
static void test_deterministic_rows(void **state) {
    (void)state;
    enum { R = 8, N = 512 };
    float *x = test_malloc(R * N * sizeof(float));
    fill_normal(x, R * N, 0.05f, 99);
    for (int c = 0; c < N_CASES; c++) {
        st_type t = cases[c].type;
        size_t rb = st_row_bytes(t, N);
        uint8_t *a = test_malloc(R * rb), *b = test_malloc(R * rb);
        st_quantize_weights(t, x, a, R, N);
        memset(b, 0x5a, R * rb);
        st_quantize_weights(t, x, b, R, N);
        assert_memory_equal(a, b, R * rb);
        memset(b, 0xa5, R * rb);
        for (int r = 0; r < R; r++) st_quantize_weights(t, x + r * N, b + r * rb, 1, N);
        assert_memory_equal(a, b, R * rb);
        test_free(a);
        test_free(b);
    }
    test_free(x);
}

// Q8_0 weights are exactly the activation quantizer's bytes (the dot pairing relies on it).
static void test_q8_0_is_activation_quantizer(void **state) {
    (void)state;
    enum { N = 4096 };
    float *x = test_malloc(N * sizeof(float));
    fill_normal(x, N, 0.3f, 5);
    size_t rb = st_row_bytes(ST_TYPE_Q8_0, N);
    uint8_t *a = test_malloc(rb), *b = test_malloc(rb);
    st_quantize_weights(ST_TYPE_Q8_0, x, a, 1, N);
    st_quantize(ST_TYPE_Q8_0, x, b, N);
    assert_memory_equal(a, b, rb);
    test_free(a);
    test_free(b);
    test_free(x);
}

// All-zero blocks give zeros; a constant block is represented exactly or nearly (types with a
// min/offset: to fp16 precision; symmetric types: to their scale rounding); an outlier does not
// break the other blocks of the row, and nothing is NaN; NaN or infinite inputs stay in their
// blocks.
static void test_special_blocks(void **state) {
    (void)state;
    enum { N = 512 };
    float x[N], y[N];
    uint8_t q[N * 4 + 64];
    for (int c = 0; c < N_CASES; c++) {
        st_type t = cases[c].type;
        memset(x, 0, sizeof x);
        st_quantize_weights(t, x, q, 1, N);
        st_dequantize(t, q, y, N);
        for (int i = 0; i < N; i++) assert_true(y[i] == 0.0f);

        for (int i = 0; i < N; i++) x[i] = 0.25f;
        st_quantize_weights(t, x, q, 1, N);
        st_dequantize(t, q, y, N);
        for (int i = 0; i < N; i++) assert_true(fabsf(y[i] - 0.25f) <= 0.25f * 0.02f);

        fill_normal(x, N, 0.01f, 3);
        x[17] = 50.0f; // 5000 sigma, in the first block of every type
        st_quantize_weights(t, x, q, 1, N);
        st_dequantize(t, q, y, N);
        for (int i = 0; i < N; i++) assert_false(isnan(y[i]) || isinf(y[i]));
        assert_true(fabsf(y[17] - 50.0f) <= 50.0f * 0.1f);
        double se = 0.0, ss = 0.0; // the second half of the row is in other blocks (256 >= block)
        for (int i = N / 2; i < N; i++) {
            se += ((double)y[i] - x[i]) * ((double)y[i] - x[i]);
            ss += (double)x[i] * x[i];
        }
        assert_true(sqrt(se / ss) <= cases[c].bound * 1.5 + 1e-7);

        // A NaN and an infinity spoil their own blocks only (both in the first 256 values).
        fill_normal(x, N, 1.0f, 4);
        x[3] = NAN;
        x[200] = INFINITY;
        st_quantize_weights(t, x, q, 1, N);
        st_dequantize(t, q, y, N);
        se = ss = 0.0;
        for (int i = N / 2; i < N; i++) {
            se += ((double)y[i] - x[i]) * ((double)y[i] - x[i]);
            ss += (double)x[i] * x[i];
        }
        assert_true(sqrt(se / ss) <= cases[c].bound * 1.5 + 1e-7);
    }
}

// The searched K/IQ4 quantizers beat the plain min/max mapping of the same format: Q4_1 and
// Q4_K both spend 4 bits plus scales per value, so Q4_K (searched, finer scales) must be better.
static void test_search_beats_plain(void **state) {
    (void)state;
    float *x = test_malloc(ROWS * COLS * sizeof(float));
    fill_normal(x, ROWS * COLS, 1.0f, 11);
    assert_true(rel_rmse(ST_TYPE_Q4_K, x, ROWS, COLS) < rel_rmse(ST_TYPE_Q4_1, x, ROWS, COLS));
    assert_true(rel_rmse(ST_TYPE_IQ4_NL, x, ROWS, COLS) < rel_rmse(ST_TYPE_Q4_0, x, ROWS, COLS));
    assert_true(rel_rmse(ST_TYPE_Q5_K, x, ROWS, COLS) < rel_rmse(ST_TYPE_Q5_1, x, ROWS, COLS));
    test_free(x);
}

// Data on a type's own grid come back exactly: every sub-block holds the most negative code, so
// the extreme-to-extreme candidate is the exact scale (a power of two, exact in fp16) and the
// search must keep it. Checks the code search and the bit packing together.
static void test_exact_grid(void **state) {
    (void)state;
    enum { N = 512 };
    static const struct { st_type t; int sub, lo, hi; bool iq4; } grids[] = {
        {ST_TYPE_Q8_0, 32, -127, 127, false}, {ST_TYPE_Q6_K, 16, -32, 31, false},
        {ST_TYPE_Q3_K, 16, -4, 3, false},     {ST_TYPE_IQ4_NL, 32, 0, 15, true},
        {ST_TYPE_IQ4_XS, 32, 0, 15, true},
    };
    float x[N], y[N];
    uint8_t q[N * 2];
    rng_state = 1234;
    for (size_t g = 0; g < sizeof grids / sizeof grids[0]; g++) {
        const float d = 1.0f / 64.0f;
        for (int i = 0; i < N; i++) {
            int c = grids[g].lo + (int)(rng_u64() % (uint64_t)(grids[g].hi - grids[g].lo + 1));
            if (i % grids[g].sub == 5) c = grids[g].lo; // the extreme, somewhere in every sub-block
            x[i] = d * (float)(grids[g].iq4 ? st_kvalues_iq4nl[c] : c);
        }
        st_quantize_weights(grids[g].t, x, q, 1, N);
        st_dequantize(grids[g].t, q, y, N);
        for (int i = 0; i < N; i++) assert_true(y[i] == x[i]);
    }
}

static void test_unsupported(void **state) {
    (void)state;
    assert_false(st_quantize_weights_supported(ST_TYPE_Q8_1));
    assert_false(st_quantize_weights_supported(ST_TYPE_Q8_K));
    assert_false(st_quantize_weights_supported(ST_TYPE_IQ2_XXS));
    assert_false(st_quantize_weights_supported(ST_TYPE_I32));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_error_bounds),     cmocka_unit_test(test_scale_invariance),
        cmocka_unit_test(test_deterministic_rows), cmocka_unit_test(test_q8_0_is_activation_quantizer),
        cmocka_unit_test(test_special_blocks),   cmocka_unit_test(test_search_beats_plain),
        cmocka_unit_test(test_exact_grid),       cmocka_unit_test(test_unsupported),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
