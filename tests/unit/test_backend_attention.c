// Unit test for the CPU backend's gated attention (st_attn_args.gated, Qwen3-Next's): the op on
// the q projection's rows, [query | gate] per head, must give bit for bit what split_heads,
// attention, mul_sigmoid and matmul give one after another (the forward's ops before), the cache
// bytes included, with and without the output projection, the q / k norms and RoPE.
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"

static uint64_t rng_state = 0x853c49e6748fea9bull;
static float rnd(float lo, float hi) { // uniform [lo, hi)
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return lo + (hi - lo) * (float)((double)(rng_state >> 11) / 9007199254740992.0);
}

static float *rand_buf(size_t n, float lo, float hi) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    assert_non_null(x);
    for (size_t i = 0; i < n; i++) x[i] = rnd(lo, hi);
    return x;
}

static float *copy_of(const float *x, size_t n) {
    float *y = malloc(sizeof(float) * (n ? n : 1));
    assert_non_null(y);
    memcpy(y, x, sizeof(float) * n);
    return y;
}

typedef struct gated_case {
    int H, Hkv, D, n_rot, n_ctx;
    st_kv_type type;
    bool qk_norm;
} gated_case;

// Row counts of the calls: decode steps, windows, and chunks past the CPU kernel's 32-row blocks
// and 128-position tiles.
static const int CALLS[] = {1, 1, 5, 40, 1, 150, 3, 1, 0};

static void fail_if_differs(const char *what, const char *part, const void *a, const void *b, size_t bytes) {
    if (memcmp(a, b, bytes)) fail_msg("%s: %s differ", what, part);
}

static void run_gated_case(st_backend *b, const gated_case *gc) {
    const int H = gc->H, Hkv = gc->Hkv, D = gc->D, nv = Hkv * D, cols = H * D, rows = 48;
    // Three caches, all fed the same rows: the gated op with wo (0), the ops one after another
    // (1), the gated op without wo (2).
    st_kv_layer kv[3];
    size_t cache_bytes = st_kv_row_bytes(gc->type, nv) * (size_t)gc->n_ctx;
    for (int i = 0; i < 3; i++) {
        kv[i] = (st_kv_layer){.type = gc->type, .n_ctx = gc->n_ctx, .n_head_kv = Hkv, .head_dim = D,
                              .row_bytes = st_kv_row_bytes(gc->type, nv)};
        kv[i].k = calloc(1, cache_bytes), kv[i].v = calloc(1, cache_bytes);
        assert_non_null(kv[i].k), assert_non_null(kv[i].v);
    }
    float *wf = rand_buf((size_t)rows * cols, -1, 1);
    size_t rb = st_row_bytes(ST_TYPE_Q8_0, cols);
    char *wq = malloc(rb * rows);
    for (int r = 0; r < rows; r++) st_quantize(ST_TYPE_Q8_0, wf + (size_t)r * cols, wq + (size_t)r * rb, cols);
    st_mat wo = {ST_TYPE_Q8_0, cols, rows, rb, wq};
    float *qn = rand_buf(D, 0.5f, 1.5f), *kn = rand_buf(D, 0.5f, 1.5f);
    int pos = 0;
    for (int ci = 0; CALLS[ci]; ci++) {
        int n = CALLS[ci];
        size_t nq = (size_t)n * H * D, nk = (size_t)n * nv, ny = (size_t)n * rows;
        // The q projection's rows: per head D query values, then D gate logits.
        float *big = rand_buf(2 * nq, -1, 1), *k = rand_buf(nk, -1, 1), *v = rand_buf(nk, -1, 1);
        for (size_t i = 0; i < nk; i += 7) k[i] *= 4; // some larger logits: a softmax that is not flat
        for (size_t i = 0; i < 2 * nq; i += 5) big[i] *= 6; // gates well into sigmoid's tails too
        int32_t *rp = malloc(sizeof(int32_t) * n);
        for (int i = 0; i < n; i++) rp[i] = pos + i;
        int32_t pos_h = pos;
        st_attn_args base = {.pos_dev = &pos_h, .v = v, .n = n, .pos0 = pos, .n_head = H,
                             .scale = 1.0f / sqrtf((float)D)};
        if (gc->qk_norm) {
            base.q_norm = qn, base.k_norm = kn, base.pos = rp;
            base.n_rot = gc->n_rot, base.rope_base = 1e7f, base.eps = 1e-6f;
        }
        float *out[3], *y[3], *qarg[3], *karg[3];
        for (int i = 0; i < 3; i++) {
            out[i] = malloc(sizeof(float) * nq), y[i] = calloc(ny, sizeof(float));
            qarg[i] = copy_of(big, 2 * nq), karg[i] = copy_of(k, nk);
        }
        // 0: one op with wo.
        st_attn_args a = base;
        a.kv = &kv[0], a.q = qarg[0], a.k = karg[0], a.out = out[0], a.gated = true, a.wo = &wo, a.y = y[0];
        b->ops->attention(b, &a);
        // 1: split_heads, attention, mul_sigmoid, matmul.
        float *q1 = malloc(sizeof(float) * nq), *g1 = malloc(sizeof(float) * nq);
        b->ops->split_heads(b, qarg[1], q1, g1, n, H, D, D);
        a = base;
        a.kv = &kv[1], a.q = q1, a.k = karg[1], a.out = out[1];
        b->ops->attention(b, &a);
        b->ops->mul_sigmoid(b, out[1], g1, (int64_t)nq);
        b->ops->matmul(b, &wo, out[1], n, y[1]);
        // 2: one op without wo.
        a = base;
        a.kv = &kv[2], a.q = qarg[2], a.k = karg[2], a.out = out[2], a.gated = true;
        b->ops->attention(b, &a);

        char what[160];
        snprintf(what, sizeof what, "gated attention %s H=%d Hkv=%d D=%d norms=%d call %d: n=%d at pos %d",
                 gc->type == ST_KV_F16 ? "f16" : gc->type == ST_KV_Q8_0 ? "q8_0" : "f32", H, Hkv, D, gc->qk_norm, ci, n,
                 pos);
        fail_if_differs(what, "outputs with wo and split_heads + attention + mul_sigmoid", out[0], out[1],
                        sizeof(float) * nq);
        fail_if_differs(what, "outputs with and without wo", out[0], out[2], sizeof(float) * nq);
        fail_if_differs(what, "y with wo and from the separate matmul", y[0], y[1], sizeof(float) * ny);
        for (size_t i = 0; i < ny; i++)
            if (y[2][i] != 0.0f) fail_msg("%s: y written without wo", what);
        size_t rows_bytes = kv[0].row_bytes * (size_t)n, off = kv[0].row_bytes * (size_t)pos;
        for (int i = 1; i < 3; i++) {
            fail_if_differs(what, "k cache rows", (char *)kv[0].k + off, (char *)kv[i].k + off, rows_bytes);
            fail_if_differs(what, "v cache rows", (char *)kv[0].v + off, (char *)kv[i].v + off, rows_bytes);
        }
        // In place, the norms and RoPE changed the queries as they changed split_heads' copy,
        // and left the gates as they were.
        for (size_t rh = 0; rh < (size_t)n * H; rh++) {
            fail_if_differs(what, "queries after the norms", qarg[0] + rh * 2 * D, q1 + rh * D, sizeof(float) * D);
            fail_if_differs(what, "gates", qarg[0] + rh * 2 * D + D, big + rh * 2 * D + D, sizeof(float) * D);
        }
        pos += n;
        for (int i = 0; i < 3; i++) free(out[i]), free(y[i]), free(qarg[i]), free(karg[i]);
        free(big), free(k), free(v), free(rp), free(q1), free(g1);
    }
    for (int i = 0; i < 3; i++) free(kv[i].k), free(kv[i].v);
    free(wf), free(wq), free(qn), free(kn);
}

// The plans a recorded window is sized for: 256 positions, doubling past the window's end, at
// most the cache's context; the plan index names each size once.
static void test_graph_plans(void **state) {
    (void)state;
    assert_int_equal(st_graph_plan(1), 0);
    assert_int_equal(st_graph_plan(256), 0);
    assert_int_equal(st_graph_plan(257), 1);
    assert_int_equal(st_graph_plan(512), 1);
    assert_int_equal(st_graph_plan(513), 2);
    assert_int_equal(st_graph_ctx(80, 144), 144);
    assert_int_equal(st_graph_ctx(80, 32768), 256);
    assert_int_equal(st_graph_ctx(300, 32768), 512);
    assert_int_equal(st_graph_ctx(32768, 32768), 32768);
    assert_int_equal(st_graph_ctx(20000, 24000), 24000);
    // Past the largest plan the index stays in range (the recording then plans for that size,
    // and the kernels still cover every position: their splits grow).
    assert_int_equal(st_graph_plan(1 << 30), ST_GRAPH_PLANS - 1);
    for (int e = 1; e < 1 << 22; e = e * 3 / 2 + 1) {
        int c = st_graph_ctx(e, 1 << 30);
        assert_true(c >= e && c < 2 * e + 256);
        assert_true(st_graph_plan(e) == st_graph_plan(c));
    }
}

static void test_gated_attention_equals_its_ops(void **state) {
    (void)state;
    st_backend *b = NULL;
    assert_int_equal(st_backend_cpu_create(3, &b), ST_OK);
    static const gated_case cases[] = {
        {4, 2, 256, 64, 256, ST_KV_F16, true},  // Qwen3-Next's heads: 256 values, a quarter rotated
        {4, 2, 256, 64, 256, ST_KV_Q8_0, true},
        {8, 2, 64, 64, 256, ST_KV_F32, true},
        {8, 2, 64, 64, 256, ST_KV_F16, false}, // q and k ready: no norms
        {6, 6, 32, 16, 256, ST_KV_Q8_0, false}, // G = 1
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_gated_case(b, &cases[i]);
    st_backend_free(b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_graph_plans),
        cmocka_unit_test(test_gated_attention_equals_its_ops),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
