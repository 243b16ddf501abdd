// Unit tests for the routed experts on the CPU pool (st_experts_compute on the CPU backend): a
// decode window (the small path, one pool job with barriers) gives bit for bit the rows the
// other path (pool passes) gives for the same rows inside a larger batch, and the rows each of
// them gives alone. The windows route to disjoint sets of experts, so in the batch every expert
// has the same rows as in its window; every call is a window (up to ST_GRAPH_ROWS rows), whose
// products are row-exact (st_matmul_args.row_exact), so the paths make the same products. Two
// weight-type sets, one with a partial make unit.
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "experts/experts.h"
#include "quant/quant.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng_u64(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

// Random blocks with their f16 scales replaced by small normal numbers (random bytes would
// give infinities and NaNs): offsets of the scales in a block of each type used here.
static void fill_weights(st_type t, void *data, size_t bytes) {
    uint8_t *p = data;
    for (size_t i = 0; i < bytes; i++) p[i] = (uint8_t)(rng_u64() >> 32);
    int bb = st_type_get(t)->block_bytes, off[2], n_off;
    switch (t) {
    case ST_TYPE_Q4_K: off[0] = 0, off[1] = 2, n_off = 2; break; // d, dmin
    case ST_TYPE_Q6_K: off[0] = 208, n_off = 1; break;
    case ST_TYPE_Q8_0:
    case ST_TYPE_Q4_0: off[0] = 0, n_off = 1; break;
    default: fail_msg("no scale layout for %s", st_type_name(t)); return;
    }
    for (size_t b = 0; b < bytes / (size_t)bb; b++)
        for (int o = 0; o < n_off; o++) {
            st_f16 h = st_f32_to_f16(0.001f * (float)(1 + rng_u64() % 16));
            memcpy(p + b * bb + off[o], &h, 2);
        }
}

static st_mat3 stack(st_type t, int64_t rows, int64_t cols, int E) {
    size_t rb = st_row_bytes(t, cols);
    st_mat3 m = {t, cols, rows, E, rb, rb * (size_t)rows, NULL};
    void *data = malloc(m.mat_bytes * E);
    assert_non_null(data);
    fill_weights(t, data, m.mat_bytes * E);
    m.data = data;
    return m;
}

enum { E = 64, K = 8, PER_WINDOW = 10 }; // each window routes to its own PER_WINDOW experts

static void window_vs_batch(st_type tg, st_type td, int d, int F) {
    static const int sizes[] = {1, 2, 3, 4, 6}; // n * K <= 64: the small path; the batch: 128
    enum { W = sizeof sizes / sizeof sizes[0] };
    int N = 0;
    for (int w = 0; w < W; w++) N += sizes[w];
    st_mat3 gate = stack(tg, F, d, E), up = stack(tg, F, d, E), down = stack(td, d, F, E);
    float *x = malloc(sizeof(float) * N * d), *wt = malloc(sizeof(float) * N * K);
    float *yb = malloc(sizeof(float) * N * d), *yw = malloc(sizeof(float) * N * d), *yr = malloc(sizeof(float) * d);
    int32_t *ids = malloc(sizeof(int32_t) * N * K);
    assert_true(x && wt && yb && yw && yr && ids);
    assert_true(N <= ST_GRAPH_ROWS); // the batch is a window too (the other path)
    for (int i = 0; i < N * d; i++) x[i] = (float)((double)(rng_u64() >> 11) / 9007199254740992.0 * 2 - 1);
    for (int w = 0, row = 0; w < W; w++)
        for (int i = 0; i < sizes[w]; i++, row++) {
            float s = 0;
            for (int j = 0; j < K; j++) { // distinct within a row, from the window's experts
                int32_t e;
                bool dup;
                do {
                    e = w * PER_WINDOW + (int32_t)(rng_u64() % PER_WINDOW);
                    dup = false;
                    for (int q = 0; q < j; q++) dup |= ids[row * K + q] == e;
                } while (dup);
                ids[row * K + j] = e;
                wt[row * K + j] = 0.1f + (float)(rng_u64() % 100) / 100.0f;
                s += wt[row * K + j];
            }
            for (int j = 0; j < K; j++) wt[row * K + j] /= s;
        }

    st_backend *b;
    assert_int_equal(st_backend_cpu_create(3, &b), ST_OK);
    st_placement *pl;
    assert_int_equal(st_placement_create_host(1, E, &pl), ST_OK);
    st_experts_params ep = {.placement = pl};
    st_experts *ex;
    assert_int_equal(st_experts_create(&ep, &ex), ST_OK);
    st_moe_args a = {.layer = 0, .gate = &gate, .up = &up, .down = &down, .x = x, .ids = ids, .weights = wt,
                     .n = N, .k = K, .y = yb};
    assert_int_equal(st_experts_compute(ex, b, &a, NULL), ST_OK);
    for (int rep = 0; rep < 3; rep++) { // the workspace and the pool's barrier reused
        memset(yw, 0xff, sizeof(float) * N * d);
        for (int w = 0, row = 0; w < W; row += sizes[w], w++) {
            st_moe_args aw = a;
            aw.x = x + (size_t)row * d, aw.ids = ids + row * K, aw.weights = wt + row * K;
            aw.n = sizes[w], aw.y = yw + (size_t)row * d;
            assert_int_equal(st_experts_compute(ex, b, &aw, NULL), ST_OK);
        }
        for (int i = 0; i < N * d; i++)
            if (memcmp(&yb[i], &yw[i], sizeof(float)))
                fail_msg("%s/%s d=%d F=%d: row %d col %d: window %.9g, batch %.9g", st_type_name(tg),
                         st_type_name(td), d, F, i / d, i % d, yw[i], yb[i]);
    }
    for (int row = 0; row < N; row++) { // each row alone
        st_moe_args ar = a;
        ar.x = x + (size_t)row * d, ar.ids = ids + row * K, ar.weights = wt + row * K, ar.n = 1, ar.y = yr;
        assert_int_equal(st_experts_compute(ex, b, &ar, NULL), ST_OK);
        for (int c = 0; c < d; c++)
            if (memcmp(&yr[c], &yw[(size_t)row * d + c], sizeof(float)))
                fail_msg("%s/%s d=%d F=%d: row %d col %d: in its window %.9g, alone %.9g", st_type_name(tg),
                         st_type_name(td), d, F, row, c, yw[(size_t)row * d + c], yr[c]);
    }
    double mag = 0;
    for (int i = 0; i < N * d; i++) {
        assert_true(isfinite(yb[i]));
        mag += fabs(yb[i]);
    }
    assert_true(mag > 0);

    st_experts_free(ex);
    st_placement_free(pl);
    st_backend_free(b);
    free((void *)gate.data), free((void *)up.data), free((void *)down.data);
    free(x), free(wt), free(yb), free(yw), free(yr), free(ids);
}

// Q8_K activations, whole make units.
static void test_window_vs_batch_q4_K(void **state) {
    (void)state;
    window_vs_batch(ST_TYPE_Q4_K, ST_TYPE_Q6_K, 512, 512);
}

// Q8_0 activations; F = 320 ends in a partial make unit of 64.
static void test_window_vs_batch_q8_0(void **state) {
    (void)state;
    window_vs_batch(ST_TYPE_Q8_0, ST_TYPE_Q4_0, 512, 320);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_window_vs_batch_q4_K),
        cmocka_unit_test(test_window_vs_batch_q8_0),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
