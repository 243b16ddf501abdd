// GPU tests of the CUDA backend's small ops, attention and Gated DeltaNet against the CPU
// backend (the reference), on fresh seeded random data with odd sizes. Exits 77 (skipped) on a
// machine without a usable GPU. `test_cuda_ops --bench` prints a table of kernel times instead.
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "quant/quant.h"

static st_backend *cpu, *gpu;

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double rnd(void) { // uniform [0, 1)
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

static float *rand_buf(size_t n, float lo, float hi) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    assert_non_null(x);
    for (size_t i = 0; i < n; i++) x[i] = (float)(lo + (hi - lo) * rnd());
    return x;
}

// Device copies: alloc + from_host, and back.
static void *dev_put(const void *host, size_t bytes) {
    void *p = gpu->ops->alloc(gpu, bytes ? bytes : 4);
    if (!p) fail_msg("device alloc of %zu bytes failed: %s", bytes, st_error());
    if (host && bytes) gpu->ops->from_host(gpu, p, host, bytes);
    return p;
}

static void dev_get(void *host, const void *dev, size_t bytes) {
    gpu->ops->to_host(gpu, host, dev, bytes);
    st_status s = gpu->ops->sync(gpu);
    if (s != ST_OK) fail_msg("GPU error: %s", st_error());
}

static void gpu_sync(const char *what) {
    st_status s = gpu->ops->sync(gpu);
    if (s != ST_OK) fail_msg("%s: GPU error: %s", what, st_error());
}

static void dev_free(void *p) { gpu->ops->free(gpu, p); }

// Compares n floats: an element fails when |got - ref| > atol + rtol * |ref|. Prints the worst
// errors and the first failing index; fails the test when any element fails.
static void check(const char *what, const float *ref, const float *got, size_t n, double atol, double rtol) {
    double max_abs = 0, max_rel = 0;
    size_t bad = 0, first = (size_t)-1;
    for (size_t i = 0; i < n; i++) {
        double a = ref[i], b = got[i], e = fabs(a - b);
        bool nan_mismatch = isnan(a) != isnan(b);
        if (e > max_abs) max_abs = e;
        if (fabs(a) > 1e-6 && e / fabs(a) > max_rel) max_rel = e / fabs(a);
        if (nan_mismatch || e > atol + rtol * fabs(a)) {
            if (!bad) first = i;
            bad++;
        }
    }
    if (bad) {
        fail_msg("%s: %zu of %zu differ (atol %g rtol %g); first at %zu: cpu %.9g gpu %.9g; max abs %.3g max rel %.3g",
                 what, bad, n, atol, rtol, first, ref[first], got[first], max_abs, max_rel);
    }
}

static void check_exact_i32(const char *what, const int32_t *ref, const int32_t *got, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (ref[i] != got[i]) fail_msg("%s: index %zu: cpu %d gpu %d", what, i, ref[i], got[i]);
}

static const int ROWS[] = {1, 3, 16, 17, 100, 333};
#define NROWS (int)(sizeof ROWS / sizeof ROWS[0])

// ---------------------------------------------------------------------------------------------
// Norms, RoPE

static void test_rmsnorm(void **st) {
    (void)st;
    const int dims[] = {100, 128, 1000, 2048, 2050};
    for (int di = 0; di < 5; di++)
        for (int ri = 0; ri < NROWS; ri++)
            for (int with_w = 0; with_w < 2; with_w++) {
                int n = ROWS[ri], d = dims[di];
                size_t sz = (size_t)n * d;
                float *x = rand_buf(sz, -3, 3), *w = rand_buf(d, 0.5f, 1.5f), *y = malloc(sizeof(float) * sz),
                      *yg = malloc(sizeof(float) * sz);
                cpu->ops->rmsnorm(cpu, x, with_w ? w : NULL, y, n, d, 1e-6f);
                float *dx = dev_put(x, sizeof(float) * sz), *dw = dev_put(w, sizeof(float) * d);
                gpu->ops->rmsnorm(gpu, dx, with_w ? dw : NULL, dx, n, d, 1e-6f); // in place, as the forward does
                dev_get(yg, dx, sizeof(float) * sz);
                char what[96];
                snprintf(what, sizeof what, "rmsnorm n=%d d=%d w=%d", n, d, with_w);
                check(what, y, yg, sz, 1e-6, 2e-6);
                dev_free(dx), dev_free(dw);
                free(x), free(w), free(y), free(yg);
            }
}

// The gated norm: against the CPU, and bit for bit against the GPU's rmsnorm then mul_silu
// (the ops it replaces in the DeltaNet layers), in place as the forward runs it.
static void test_rmsnorm_silu(void **st) {
    (void)st;
    const int dims[] = {128, 100, 2048};
    for (int di = 0; di < 3; di++)
        for (int ri = 0; ri < NROWS; ri++) {
            int n = ROWS[ri], d = dims[di];
            size_t sz = (size_t)n * d;
            float *x = rand_buf(sz, -3, 3), *w = rand_buf(d, 0.5f, 1.5f), *g = rand_buf(sz, -6, 6);
            float *y = malloc(sizeof(float) * sz), *ya = malloc(sizeof(float) * sz), *yb = malloc(sizeof(float) * sz);
            cpu->ops->rmsnorm_silu(cpu, x, w, g, y, n, d, 1e-6f);
            float *da = dev_put(x, sizeof(float) * sz), *db = dev_put(x, sizeof(float) * sz);
            float *dw = dev_put(w, sizeof(float) * d), *dg = dev_put(g, sizeof(float) * sz);
            gpu->ops->rmsnorm_silu(gpu, da, dw, dg, da, n, d, 1e-6f);
            gpu->ops->rmsnorm(gpu, db, dw, db, n, d, 1e-6f);
            gpu->ops->mul_silu(gpu, db, dg, (int64_t)sz);
            dev_get(ya, da, sizeof(float) * sz);
            dev_get(yb, db, sizeof(float) * sz);
            char what[96];
            snprintf(what, sizeof what, "rmsnorm_silu n=%d d=%d", n, d);
            check(what, y, ya, sz, 1e-6, 4e-6);
            if (memcmp(ya, yb, sizeof(float) * sz)) fail_msg("%s: differs from rmsnorm then mul_silu", what);
            dev_free(da), dev_free(db), dev_free(dw), dev_free(dg);
            free(x), free(w), free(g), free(y), free(ya), free(yb);
        }
}

static void test_l2norm(void **st) {
    (void)st;
    const int dims[] = {128, 100, 256};
    for (int di = 0; di < 3; di++)
        for (int ri = 0; ri < NROWS; ri++) {
            int n = ROWS[ri], d = dims[di];
            size_t sz = (size_t)n * d;
            float *x = rand_buf(sz, -2, 2), *xg = malloc(sizeof(float) * sz);
            if (n > 2) memset(x + d, 0, sizeof(float) * d); // a zero row: the eps branch
            float *dx = dev_put(x, sizeof(float) * sz);
            cpu->ops->l2norm(cpu, x, n, d, 1e-6f, 0.0883883f);
            gpu->ops->l2norm(gpu, dx, n, d, 1e-6f, 0.0883883f);
            dev_get(xg, dx, sizeof(float) * sz);
            char what[96];
            snprintf(what, sizeof what, "l2norm n=%d d=%d", n, d);
            check(what, x, xg, sz, 1e-7, 2e-6);
            dev_free(dx), free(x), free(xg);
        }
}

static void test_rope(void **st) {
    (void)st;
    struct { int heads, hd, n_rot; float base; } cfg[] = {{32, 128, 128, 1e6f}, {4, 128, 128, 1e6f},
                                                          {16, 256, 64, 1e7f}, {3, 96, 32, 10000.0f}};
    for (int ci = 0; ci < 4; ci++)
        for (int ri = 0; ri < NROWS; ri++) {
            int n = ROWS[ri], H = cfg[ci].heads, hd = cfg[ci].hd;
            size_t sz = (size_t)n * H * hd;
            float *x = rand_buf(sz, -2, 2), *xg = malloc(sizeof(float) * sz);
            int32_t *pos = malloc(sizeof(int32_t) * n);
            int start = (int)(rnd() * 40000);
            for (int i = 0; i < n; i++) pos[i] = i % 7 == 3 ? (int)(rnd() * 100000) : start + i;
            float *dx = dev_put(x, sizeof(float) * sz);
            int32_t *dp = dev_put(pos, sizeof(int32_t) * n);
            cpu->ops->rope(cpu, x, n, H, hd, cfg[ci].n_rot, pos, cfg[ci].base);
            gpu->ops->rope(gpu, dx, n, H, hd, cfg[ci].n_rot, dp, cfg[ci].base);
            dev_get(xg, dx, sizeof(float) * sz);
            char what[96];
            snprintf(what, sizeof what, "rope n=%d heads=%d head_dim=%d n_rot=%d", n, H, hd, cfg[ci].n_rot);
            check(what, x, xg, sz, 2e-6, 2e-6);
            dev_free(dx), dev_free(dp), free(x), free(xg), free(pos);
        }
}

// The residual add and the norm after it (norm_matmul without products): the sum xo and xn
// both compared, with an unaligned case (an odd width) for the scalar path and y NULL (the norm
// alone, xo untouched). The products' part is test_cuda_quant's test_norm_matmul.
static void test_add_rmsnorm(void **st) {
    (void)st;
    const int dims[] = {100, 2048, 2050, 4096, 5};
    for (int di = 0; di < 5; di++)
        for (int ri = 0; ri < NROWS; ri++)
            for (int mode = 0; mode < 3; mode++) { // weights and y; no weights; no y
                int n = ROWS[ri], d = dims[di];
                bool with_w = mode != 1, with_y = mode != 2;
                size_t sz = (size_t)n * d;
                float *x = rand_buf(sz, -3, 3), *y = rand_buf(sz, -3, 3), *w = rand_buf(d, 0.5f, 1.5f),
                      *xo = calloc(sz, sizeof(float)), *xn = malloc(sizeof(float) * sz),
                      *xg = malloc(sizeof(float) * sz), *xng = malloc(sizeof(float) * sz);
                float *dx = dev_put(x, sizeof(float) * sz), *dy = dev_put(y, sizeof(float) * sz),
                      *dw = dev_put(w, sizeof(float) * d), *dxo = dev_put(xo, sizeof(float) * sz),
                      *dxn = dev_put(NULL, sizeof(float) * sz);
                cpu->ops->norm_matmul(cpu, x, with_y ? y : NULL, xo, with_w ? w : NULL, 1e-6f, xn, n, d, 0, NULL, NULL);
                gpu->ops->norm_matmul(gpu, dx, with_y ? dy : NULL, dxo, with_w ? dw : NULL, 1e-6f, dxn, n, d, 0, NULL,
                                      NULL);
                dev_get(xg, dxo, sizeof(float) * sz);
                dev_get(xng, dxn, sizeof(float) * sz);
                char what[96];
                snprintf(what, sizeof what, "add_rmsnorm xo n=%d d=%d w=%d y=%d", n, d, with_w, with_y);
                check(what, xo, xg, sz, 0, 0);
                snprintf(what, sizeof what, "add_rmsnorm xn n=%d d=%d w=%d y=%d", n, d, with_w, with_y);
                check(what, xn, xng, sz, 1e-6, 2e-6);
                dev_free(dx), dev_free(dy), dev_free(dw), dev_free(dxo), dev_free(dxn);
                free(x), free(y), free(w), free(xo), free(xn), free(xg), free(xng);
            }
}

static void test_norm_rope(void **st) {
    (void)st;
    struct { int heads, hd, n_rot; float base; } cfg[] = {{32, 128, 128, 1e6f}, {4, 128, 128, 1e6f},
                                                          {16, 256, 64, 1e7f}, {3, 96, 32, 10000.0f},
                                                          {9, 64, 64, 10000.0f}};
    for (int ci = 0; ci < 5; ci++)
        for (int ri = 0; ri < NROWS; ri++)
            for (int with_w = 0; with_w < 2; with_w++) {
                int n = ROWS[ri], H = cfg[ci].heads, hd = cfg[ci].hd;
                size_t sz = (size_t)n * H * hd;
                float *x = rand_buf(sz, -2, 2), *xg = malloc(sizeof(float) * sz), *w = rand_buf(hd, 0.5f, 1.5f);
                int32_t *pos = malloc(sizeof(int32_t) * n);
                int start = (int)(rnd() * 40000);
                for (int i = 0; i < n; i++) pos[i] = i % 7 == 3 ? (int)(rnd() * 100000) : start + i;
                float *dx = dev_put(x, sizeof(float) * sz), *dw = dev_put(w, sizeof(float) * hd);
                int32_t *dp = dev_put(pos, sizeof(int32_t) * n);
                cpu->ops->norm_rope(cpu, x, with_w ? w : NULL, n, H, hd, cfg[ci].n_rot, pos, cfg[ci].base, 1e-6f);
                gpu->ops->norm_rope(gpu, dx, with_w ? dw : NULL, n, H, hd, cfg[ci].n_rot, dp, cfg[ci].base, 1e-6f);
                dev_get(xg, dx, sizeof(float) * sz);
                char what[112];
                snprintf(what, sizeof what, "norm_rope n=%d heads=%d head_dim=%d n_rot=%d w=%d", n, H, hd, cfg[ci].n_rot,
                         with_w);
                check(what, x, xg, sz, 4e-6, 4e-6);
                dev_free(dx), dev_free(dw), dev_free(dp), free(x), free(xg), free(w), free(pos);
            }
}

// ---------------------------------------------------------------------------------------------
// Conv (state carried over two calls) and the element-wise ops

static void test_conv(void **st) {
    (void)st;
    const int chans[] = {8192 + 4096, 1000, 33};
    for (int ci = 0; ci < 3; ci++)
        for (int ri = 0; ri < NROWS; ri++) {
            int C = chans[ci], K = 4, n = ROWS[ri];
            float *w = rand_buf((size_t)C * K, -1, 1), *state = rand_buf((size_t)(K - 1) * C, -2, 2);
            float *dw = dev_put(w, sizeof(float) * C * K), *ds = dev_put(state, sizeof(float) * (K - 1) * C);
            for (int call = 0; call < 2; call++) {
                int nn = call ? (n % 5) + 1 : n; // then a short call: the state shifts partly
                size_t sz = (size_t)nn * C;
                float *x = rand_buf(sz, -2, 2), *y = malloc(sizeof(float) * sz), *yg = malloc(sizeof(float) * sz);
                float *sg = malloc(sizeof(float) * (K - 1) * C);
                float *dx = dev_put(x, sizeof(float) * sz), *dy = dev_put(NULL, sizeof(float) * sz);
                st_conv_args a = {.x = x, .w = w, .state = state, .y = y, .n = nn, .channels = C, .kernel = K};
                cpu->ops->conv(cpu, &a);
                st_conv_args b = {.x = dx, .w = dw, .state = ds, .y = dy, .n = nn, .channels = C, .kernel = K};
                gpu->ops->conv(gpu, &b);
                dev_get(yg, dy, sizeof(float) * sz);
                dev_get(sg, ds, sizeof(float) * (K - 1) * C);
                char what[96];
                snprintf(what, sizeof what, "conv y channels=%d n=%d call %d", C, nn, call);
                check(what, y, yg, sz, 1e-6, 2e-6);
                snprintf(what, sizeof what, "conv state channels=%d n=%d call %d", C, nn, call);
                check(what, state, sg, (size_t)(K - 1) * C, 0, 0);
                dev_free(dx), dev_free(dy), free(x), free(y), free(yg), free(sg);
            }
            dev_free(dw), dev_free(ds), free(w), free(state);
        }
}

typedef enum { EW_ADD, EW_SWIGLU, EW_MUL_SIGMOID, EW_MUL_SILU } ew_kind;

static void test_elementwise(void **st) {
    (void)st;
    const int64_t sizes[] = {1, 3, 17, 1000, 333 * 768 + 5};
    const char *names[] = {"add", "swiglu", "mul_sigmoid", "mul_silu"};
    for (int k = 0; k < 4; k++)
        for (int si = 0; si < 5; si++) {
            int64_t n = sizes[si];
            float *y = rand_buf(n, -4, 4), *x = rand_buf(n, -30, 30), *out = malloc(sizeof(float) * n),
                  *got = malloc(sizeof(float) * n);
            float *dy = dev_put(y, sizeof(float) * n), *dx = dev_put(x, sizeof(float) * n);
            switch ((ew_kind)k) {
            case EW_ADD: cpu->ops->add(cpu, y, x, n), gpu->ops->add(gpu, dy, dx, n); break;
            case EW_SWIGLU: cpu->ops->swiglu(cpu, x, y, y, n), gpu->ops->swiglu(gpu, dx, dy, dy, n); break;
            case EW_MUL_SIGMOID: cpu->ops->mul_sigmoid(cpu, y, x, n), gpu->ops->mul_sigmoid(gpu, dy, dx, n); break;
            case EW_MUL_SILU: cpu->ops->mul_silu(cpu, y, x, n), gpu->ops->mul_silu(gpu, dy, dx, n); break;
            }
            memcpy(out, y, sizeof(float) * n);
            dev_get(got, dy, sizeof(float) * n);
            char what[96];
            snprintf(what, sizeof what, "%s n=%lld", names[k], (long long)n);
            check(what, out, got, n, 1e-6, 1e-6);
            dev_free(dy), dev_free(dx), free(y), free(x), free(out), free(got);
        }
}

static void test_gated_rows_and_gates(void **st) {
    (void)st;
    for (int ri = 0; ri < NROWS; ri++) {
        int n = ROWS[ri], d = 2047;
        size_t sz = (size_t)n * d;
        float *y = rand_buf(sz, -2, 2), *x = rand_buf(sz, -2, 2), *g = rand_buf(n, -6, 6), *got = malloc(sizeof(float) * sz);
        float *dy = dev_put(y, sizeof(float) * sz), *dx = dev_put(x, sizeof(float) * sz), *dg = dev_put(g, sizeof(float) * n);
        cpu->ops->add_gated_rows(cpu, y, x, g, n, d);
        gpu->ops->add_gated_rows(gpu, dy, dx, dg, n, d);
        dev_get(got, dy, sizeof(float) * sz);
        char what[96];
        snprintf(what, sizeof what, "add_gated_rows n=%d d=%d", n, d);
        check(what, y, got, sz, 1e-6, 1e-6);
        dev_free(dy), dev_free(dx), dev_free(dg), free(y), free(x), free(g), free(got);

        int hk = 16, hv = 32;
        float *ba = rand_buf((size_t)n * 2 * hv, -25, 25), *a = rand_buf(hv, -8, -0.1f), *bias = rand_buf(hv, -2, 2);
        float *beta = malloc(sizeof(float) * n * hv), *gg = malloc(sizeof(float) * n * hv);
        float *beta_g = malloc(sizeof(float) * n * hv), *gg_g = malloc(sizeof(float) * n * hv);
        float *dba = dev_put(ba, sizeof(float) * n * 2 * hv), *da = dev_put(a, sizeof(float) * hv),
              *dbias = dev_put(bias, sizeof(float) * hv), *dbeta = dev_put(NULL, sizeof(float) * n * hv),
              *dgg = dev_put(NULL, sizeof(float) * n * hv);
        cpu->ops->gdn_gates(cpu, ba, a, bias, beta, gg, n, hk, hv);
        gpu->ops->gdn_gates(gpu, dba, da, dbias, dbeta, dgg, n, hk, hv);
        dev_get(beta_g, dbeta, sizeof(float) * n * hv);
        dev_get(gg_g, dgg, sizeof(float) * n * hv);
        snprintf(what, sizeof what, "gdn_gates beta n=%d", n);
        check(what, beta, beta_g, (size_t)n * hv, 1e-7, 1e-6);
        snprintf(what, sizeof what, "gdn_gates g n=%d", n);
        check(what, gg, gg_g, (size_t)n * hv, 1e-7, 1e-6);
        dev_free(dba), dev_free(da), dev_free(dbias), dev_free(dbeta), dev_free(dgg);
        free(ba), free(a), free(bias), free(beta), free(gg), free(beta_g), free(gg_g);
    }
}

static void test_copies(void **st) {
    (void)st;
    for (int ri = 0; ri < NROWS; ri++) {
        int n = ROWS[ri], heads = 16, A = 256, B = 256;
        size_t sz = (size_t)n * heads * (A + B);
        float *x = rand_buf(sz, -1, 1), *ya = malloc(sizeof(float) * n * heads * A), *yb = malloc(sizeof(float) * n * heads * B);
        float *ga = malloc(sizeof(float) * n * heads * A), *gb = malloc(sizeof(float) * n * heads * B);
        float *dx = dev_put(x, sizeof(float) * sz), *dya = dev_put(NULL, sizeof(float) * n * heads * A),
              *dyb = dev_put(NULL, sizeof(float) * n * heads * B);
        cpu->ops->split_heads(cpu, x, ya, yb, n, heads, A, B);
        gpu->ops->split_heads(gpu, dx, dya, dyb, n, heads, A, B);
        dev_get(ga, dya, sizeof(float) * n * heads * A);
        dev_get(gb, dyb, sizeof(float) * n * heads * B);
        check("split_heads a", ya, ga, (size_t)n * heads * A, 0, 0);
        check("split_heads b", yb, gb, (size_t)n * heads * B, 0, 0);

        // copy_cols: a 100-wide column range from x (ld 513) into y (ld 301) at column 37
        int64_t ldx = 513, ldy = 301, w = 100;
        float *src = rand_buf((size_t)n * ldx, -1, 1), *dst = rand_buf((size_t)n * ldy, -1, 1), *got = malloc(sizeof(float) * n * ldy);
        float *dsrc = dev_put(src, sizeof(float) * n * ldx), *ddst = dev_put(dst, sizeof(float) * n * ldy);
        cpu->ops->copy_cols(cpu, src, ldx, 411, dst, ldy, 37, n, w);
        gpu->ops->copy_cols(gpu, dsrc, ldx, 411, ddst, ldy, 37, n, w);
        dev_get(got, ddst, sizeof(float) * n * ldy);
        char what[96];
        snprintf(what, sizeof what, "copy_cols n=%d (and the columns it must not touch)", n);
        check(what, dst, got, (size_t)n * ldy, 0, 0);
        dev_free(dx), dev_free(dya), dev_free(dyb), dev_free(dsrc), dev_free(ddst);
        free(x), free(ya), free(yb), free(ga), free(gb), free(src), free(dst), free(got);
    }
}

// ---------------------------------------------------------------------------------------------
// Router and argmax: ids exact. Logits are a shuffled ladder of distinct values (no near-ties),
// with some exact duplicates placed on purpose (ties go to the lower id on both backends).

static void ladder(float *x, int d, float step, int dups) {
    for (int i = 0; i < d; i++) x[i] = (float)(i - d / 2) * step;
    for (int i = d - 1; i > 0; i--) {
        int j = (int)(rnd() * (i + 1));
        float t = x[i];
        x[i] = x[j], x[j] = t;
    }
    for (int k = 0; k < dups && d > 2; k++) x[(int)(rnd() * d)] = x[(int)(rnd() * d)];
}

static void test_moe_route(void **st) {
    (void)st;
    struct { int E, k; } cfg[] = {{128, 8}, {512, 10}, {60, 4}, {33, 16}};
    for (int ci = 0; ci < 4; ci++)
        for (int ri = 0; ri < NROWS; ri++) {
            int n = ROWS[ri], E = cfg[ci].E, k = cfg[ci].k;
            float *l = malloc(sizeof(float) * n * E);
            for (int i = 0; i < n; i++) ladder(l + (size_t)i * E, E, 0.013f, i % 3 == 0 ? 6 : 0);
            int32_t *ids = malloc(sizeof(int32_t) * n * k), *gids = malloc(sizeof(int32_t) * n * k);
            float *w = malloc(sizeof(float) * n * k), *gw = malloc(sizeof(float) * n * k);
            float *dl = dev_put(l, sizeof(float) * n * E), *dw = dev_put(NULL, sizeof(float) * n * k);
            int32_t *dids = dev_put(NULL, sizeof(int32_t) * n * k);
            cpu->ops->moe_route(cpu, l, n, E, k, ids, w);
            gpu->ops->moe_route(gpu, dl, n, E, k, dids, dw);
            dev_get(gids, dids, sizeof(int32_t) * n * k);
            dev_get(gw, dw, sizeof(float) * n * k);
            char what[96];
            snprintf(what, sizeof what, "moe_route ids E=%d k=%d n=%d", E, k, n);
            check_exact_i32(what, ids, gids, (size_t)n * k);
            snprintf(what, sizeof what, "moe_route weights E=%d k=%d n=%d", E, k, n);
            check(what, w, gw, (size_t)n * k, 1e-7, 1e-6);
            dev_free(dl), dev_free(dw), dev_free(dids);
            free(l), free(ids), free(gids), free(w), free(gw);
        }
}

static void test_argmax(void **st) {
    (void)st;
    const int dims[] = {151936, 1000, 33, 151643};
    const int rows[] = {1, 3, 17};
    for (int di = 0; di < 4; di++)
        for (int ri = 0; ri < 3; ri++) {
            int n = rows[ri], d = dims[di];
            float *x = malloc(sizeof(float) * n * d);
            for (int i = 0; i < n; i++) {
                float *r = x + (size_t)i * d;
                ladder(r, d, 1e-3f, 0);
                if (i % 2) { // the maximum twice: the first must win
                    int best = 0;
                    for (int j = 1; j < d; j++) best = r[j] > r[best] ? j : best;
                    r[(int)(rnd() * d)] = r[best];
                }
            }
            int32_t *ids = malloc(sizeof(int32_t) * n), *gids = malloc(sizeof(int32_t) * n);
            float *dx = dev_put(x, sizeof(float) * n * d);
            int32_t *dids = dev_put(NULL, sizeof(int32_t) * n);
            cpu->ops->argmax(cpu, x, n, d, ids);
            gpu->ops->argmax(gpu, dx, n, d, dids);
            dev_get(gids, dids, sizeof(int32_t) * n);
            char what[96];
            snprintf(what, sizeof what, "argmax n=%d d=%d", n, d);
            check_exact_i32(what, ids, gids, n);
            dev_free(dx), dev_free(dids), free(x), free(ids), free(gids);
        }
}

// ---------------------------------------------------------------------------------------------
// Attention: a cache filled over several calls (prompt chunks, decode steps, a verify window),
// on both backends; outputs and the cache bytes written by each call compared.

typedef struct attn_case {
    int H, Hkv, D, n_ctx;
    st_kv_type type;
    const int *calls; // row counts, 0-terminated
    bool qk_norm;     // the op applies the q / k norms and rope first
} attn_case;

static const char *kv_name(st_kv_type t) { return t == ST_KV_F16 ? "f16" : t == ST_KV_Q8_0 ? "q8_0" : "f32"; }

static float f16_val(uint16_t h) { return st_f16_to_f32(h); }

// Cache rows [from, to) of both backends: f16 / f32 bytes exactly (approx: values computed on
// each side, as the normed and rotated keys are, within one f16 step or 1e-5 for f32); q8_0
// within one quantum.
static void check_cache(const char *what, const st_kv_layer *kv, const void *cpu_base, const void *gpu_base,
                        int from, int to, bool approx) {
    size_t bytes = kv->row_bytes * (size_t)(to - from);
    char *g = malloc(bytes);
    const char *c = (const char *)cpu_base + kv->row_bytes * (size_t)from;
    dev_get(g, (const char *)gpu_base + kv->row_bytes * (size_t)from, bytes);
    if (approx && kv->type != ST_KV_Q8_0) {
        size_t nv = kv->type == ST_KV_F16 ? bytes / 2 : bytes / 4;
        for (size_t i = 0; i < nv; i++) {
            float a, b;
            if (kv->type == ST_KV_F16) {
                uint16_t ha, hb;
                memcpy(&ha, c + 2 * i, 2), memcpy(&hb, g + 2 * i, 2);
                a = f16_val(ha), b = f16_val(hb);
            } else {
                memcpy(&a, c + 4 * i, 4), memcpy(&b, g + 4 * i, 4);
            }
            double tol = kv->type == ST_KV_F16 ? fabs(a) / 1024.0 + 1e-7 : fabs(a) * 1e-5 + 1e-7;
            if (!(fabs(a - b) <= tol)) fail_msg("%s: cache value %zu of rows %d..%d: cpu %g gpu %g", what, i, from, to - 1, a, b);
        }
    } else if (kv->type != ST_KV_Q8_0) {
        for (size_t i = 0; i < bytes; i++)
            if (c[i] != g[i]) fail_msg("%s: cache byte %zu of rows %d..%d differs", what, i, from, to - 1);
    } else {
        size_t nb = bytes / 34;
        for (size_t b = 0; b < nb; b++) {
            const char *cb = c + b * 34, *gb = g + b * 34;
            uint16_t cd, gd;
            memcpy(&cd, cb, 2), memcpy(&gd, gb, 2);
            float dc = f16_val(cd), dg = f16_val(gd);
            for (int j = 0; j < 32; j++) {
                float vc = dc * (float)(int8_t)cb[2 + j], vg = dg * (float)(int8_t)gb[2 + j];
                if (fabsf(vc - vg) > dc * 1.001f + 1e-30f)
                    fail_msg("%s: q8_0 block %zu value %d: cpu %g gpu %g (d %g)", what, b, j, vc, vg, dc);
            }
        }
    }
    free(g);
}

static void run_attn_case(const attn_case *ac) {
    int H = ac->H, Hkv = ac->Hkv, D = ac->D, nv = Hkv * D;
    st_kv_layer kc = {.type = ac->type, .n_ctx = ac->n_ctx, .n_head_kv = Hkv, .head_dim = D,
                      .row_bytes = st_kv_row_bytes(ac->type, nv)};
    st_kv_layer kg = kc;
    size_t cache_bytes = kc.row_bytes * (size_t)ac->n_ctx;
    kc.k = calloc(1, cache_bytes), kc.v = calloc(1, cache_bytes);
    kg.k = dev_put(NULL, cache_bytes), kg.v = dev_put(NULL, cache_bytes);
    gpu->ops->zero(gpu, kg.k, cache_bytes), gpu->ops->zero(gpu, kg.v, cache_bytes);
    int32_t *dpos = dev_put(NULL, sizeof(int32_t));
    int pos = 0;
    for (int ci = 0; ac->calls[ci]; ci++) {
        int n = ac->calls[ci];
        size_t nq = (size_t)n * H * D, nk = (size_t)n * nv;
        float *q = rand_buf(nq, -1, 1), *k = rand_buf(nk, -1, 1), *v = rand_buf(nk, -1, 1);
        // Some larger logits so the softmax is not flat.
        for (size_t i = 0; i < nk; i += 7) k[i] *= 4;
        float *out = malloc(sizeof(float) * nq), *got = malloc(sizeof(float) * nq);
        float *dq = dev_put(q, sizeof(float) * nq), *dk = dev_put(k, sizeof(float) * nk), *dv = dev_put(v, sizeof(float) * nk),
              *dout = dev_put(NULL, sizeof(float) * nq);
        int32_t pos_h = pos;
        gpu->ops->from_host(gpu, dpos, &pos_h, sizeof pos_h);
        float scale = 1.0f / sqrtf((float)D);
        st_attn_args a = {.kv = &kc, .pos_dev = &pos_h, .q = q, .k = k, .v = v, .out = out, .n = n, .pos0 = pos,
                          .n_head = H, .scale = scale};
        st_attn_args b = {.kv = &kg, .pos_dev = dpos, .q = dq, .k = dk, .v = dv, .out = dout, .n = n, .pos0 = pos,
                          .n_head = H, .scale = scale};
        float *qn = NULL, *kn = NULL, *dqn = NULL, *dkn = NULL;
        int32_t *rp = NULL, *drp = NULL;
        if (ac->qk_norm) {
            qn = rand_buf(D, 0.5f, 1.5f), kn = rand_buf(D, 0.5f, 1.5f);
            rp = malloc(sizeof(int32_t) * n);
            for (int i = 0; i < n; i++) rp[i] = pos + i;
            dqn = dev_put(qn, sizeof(float) * D), dkn = dev_put(kn, sizeof(float) * D), drp = dev_put(rp, sizeof(int32_t) * n);
            a.q_norm = qn, a.k_norm = kn, a.pos = rp;
            b.q_norm = dqn, b.k_norm = dkn, b.pos = drp;
            a.n_rot = b.n_rot = D, a.rope_base = b.rope_base = 1e6f, a.eps = b.eps = 1e-6f;
        }
        cpu->ops->attention(cpu, &a);
        gpu->ops->attention(gpu, &b);
        dev_get(got, dout, sizeof(float) * nq);
        char what[160];
        snprintf(what, sizeof what, "attention %s H=%d Hkv=%d D=%d call %d: n=%d at pos %d", kv_name(ac->type), H, Hkv, D,
                 ci, n, pos);
        // Same cache contents on both sides; the outputs differ by summation order (and, for
        // q8_0, by any value quantized one step apart).
        // With the norms on each side, keys may round to f16 one step apart: a looser bound.
        bool loose = ac->type == ST_KV_Q8_0 || ac->qk_norm;
        check(what, out, got, nq, loose ? 2e-3 : 2e-5, loose ? 1e-3 : 1e-4);
        check_cache(what, &kc, kc.k, kg.k, pos, pos + n, ac->qk_norm);
        check_cache(what, &kc, kc.v, kg.v, pos, pos + n, false);
        pos += n;
        if (ac->qk_norm) dev_free(dqn), dev_free(dkn), dev_free(drp), free(qn), free(kn), free(rp);
        dev_free(dq), dev_free(dk), dev_free(dv), dev_free(dout);
        free(q), free(k), free(v), free(out), free(got);
    }
    dev_free(kg.k), dev_free(kg.v), dev_free(dpos), free(kc.k), free(kc.v);
}

// A random q8_0 matrix of rows x cols (values in [-s, s] before quantization) on the host (h)
// and the device (d): an op's output projection. q8_mat_free frees both.
static void q8_mat_make(int rows, int cols, float s, st_mat *h, st_mat *d) {
    float *wf = rand_buf((size_t)rows * cols, -s, s);
    size_t rb = st_row_bytes(ST_TYPE_Q8_0, cols);
    char *wq = malloc(rb * rows);
    for (int r = 0; r < rows; r++) st_quantize(ST_TYPE_Q8_0, wf + (size_t)r * cols, wq + (size_t)r * rb, cols);
    free(wf);
    *h = (st_mat){ST_TYPE_Q8_0, cols, rows, rb, wq};
    *d = *h;
    d->data = dev_put(wq, rb * rows);
}
static void q8_mat_free(st_mat *h, st_mat *d) { free((void *)h->data), dev_free((void *)d->data); }

// The output projection inside the attention op (st_attn_args.wo): the GPU's y must equal, bit
// for bit, its own attention followed by its own matmul of the same output (the kernel hands
// the projection its output quantized as the matmul would have), and the CPU's y within
// tolerance. Decode steps before and after the context is split among blocks, windows, and a
// prompt chunk (the tensor-core kernel, which projects the floats).
static void run_attention_wo(int n_ctx, const int *calls) {
    const int H = 32, Hkv = 4, D = 128, nv = Hkv * D, cols = H * D, rows = 200;
    st_kv_layer kc = {.type = ST_KV_F16, .n_ctx = n_ctx, .n_head_kv = Hkv, .head_dim = D,
                      .row_bytes = st_kv_row_bytes(ST_KV_F16, nv)};
    st_kv_layer kg = kc;
    size_t cache_bytes = kc.row_bytes * (size_t)n_ctx;
    kc.k = calloc(1, cache_bytes), kc.v = calloc(1, cache_bytes);
    kg.k = dev_put(NULL, cache_bytes), kg.v = dev_put(NULL, cache_bytes);
    gpu->ops->zero(gpu, kg.k, cache_bytes), gpu->ops->zero(gpu, kg.v, cache_bytes);
    st_mat wc, wg;
    q8_mat_make(rows, cols, 1.0f, &wc, &wg);
    float *qn = rand_buf(D, 0.5f, 1.5f), *kn = rand_buf(D, 0.5f, 1.5f);
    float *dqn = dev_put(qn, sizeof(float) * D), *dkn = dev_put(kn, sizeof(float) * D);
    int32_t *dpos = dev_put(NULL, sizeof(int32_t));
    int pos = 0;
    for (int ci = 0; calls[ci]; ci++) {
        int n = calls[ci];
        size_t nq = (size_t)n * H * D, nk = (size_t)n * nv, ny = (size_t)n * rows;
        float *q = rand_buf(nq, -1, 1), *k = rand_buf(nk, -1, 1), *v = rand_buf(nk, -1, 1);
        int32_t *rp = malloc(sizeof(int32_t) * n);
        for (int i = 0; i < n; i++) rp[i] = pos + i;
        float *out = malloc(sizeof(float) * nq), *y = malloc(sizeof(float) * ny);
        float *o1 = malloc(sizeof(float) * nq), *o2 = malloc(sizeof(float) * nq);
        float *y1 = malloc(sizeof(float) * ny), *y2 = malloc(sizeof(float) * ny);
        float *dk = dev_put(k, sizeof(float) * nk), *dv = dev_put(v, sizeof(float) * nk), *dq = dev_put(NULL, sizeof(float) * nq);
        float *dout = dev_put(NULL, sizeof(float) * nq), *dy = dev_put(NULL, sizeof(float) * ny);
        int32_t *drp = dev_put(rp, sizeof(int32_t) * n);
        int32_t pos_h = pos;
        gpu->ops->from_host(gpu, dpos, &pos_h, sizeof pos_h);
        float *qc = malloc(sizeof(float) * nq), *kcp = malloc(sizeof(float) * nk);
        memcpy(qc, q, sizeof(float) * nq), memcpy(kcp, k, sizeof(float) * nk);
        st_attn_args a = {.kv = &kc, .pos_dev = &pos_h, .q = qc, .k = kcp, .v = v, .out = out, .n = n, .pos0 = pos,
                          .n_head = H, .scale = 1.0f / sqrtf((float)D), .q_norm = qn, .k_norm = kn, .pos = rp,
                          .n_rot = D, .rope_base = 1e6f, .eps = 1e-6f, .wo = &wc, .y = y};
        cpu->ops->attention(cpu, &a);
        st_attn_args b = a;
        b.kv = &kg, b.pos_dev = dpos, b.q = dq, b.k = dk, b.v = dv, b.out = dout, b.q_norm = dqn, b.k_norm = dkn;
        b.pos = drp, b.wo = &wg, b.y = dy;
        // Each GPU call gets the raw q and k (a prompt chunk norms them in place).
        gpu->ops->from_host(gpu, dq, q, sizeof(float) * nq), gpu->ops->from_host(gpu, dk, k, sizeof(float) * nk);
        gpu->ops->attention(gpu, &b);
        dev_get(o1, dout, sizeof(float) * nq), dev_get(y1, dy, sizeof(float) * ny);
        gpu->ops->from_host(gpu, dq, q, sizeof(float) * nq), gpu->ops->from_host(gpu, dk, k, sizeof(float) * nk);
        b.wo = NULL, b.y = NULL;
        gpu->ops->attention(gpu, &b); // the same rows stored again at the same positions
        gpu->ops->matmul(gpu, &wg, dout, n, dy);
        dev_get(o2, dout, sizeof(float) * nq), dev_get(y2, dy, sizeof(float) * ny);
        char what[96];
        snprintf(what, sizeof what, "attention + wo (context %d): n=%d at pos %d", n_ctx, n, pos);
        if (memcmp(o1, o2, sizeof(float) * nq)) fail_msg("%s: the outputs with and without wo differ", what);
        for (size_t i = 0; i < ny; i++)
            if (memcmp(&y1[i], &y2[i], sizeof(float)))
                fail_msg("%s: y[%zu] = %.9g with wo, %.9g from the separate matmul", what, i, y1[i], y2[i]);
        // Prompt chunks project through bf16 (dequantized weights, cuBLAS): a looser bound.
        bool chunk = n > 16;
        check(what, y, y1, ny, chunk ? 0.4 : 5e-2, chunk ? 3e-2 : 1e-2);
        pos += n;
        dev_free(dk), dev_free(dv), dev_free(dq), dev_free(dout), dev_free(dy), dev_free(drp);
        free(q), free(k), free(v), free(rp), free(out), free(y), free(o1), free(o2), free(y1), free(y2), free(qc), free(kcp);
    }
    dev_free(kg.k), dev_free(kg.v), dev_free(dpos), dev_free(dqn), dev_free(dkn), q8_mat_free(&wc, &wg);
    free(kc.k), free(kc.v), free(qn), free(kn);
}

static void test_attention_wo(void **st) {
    (void)st;
    static const int split[] = {1, 1, 3, 1, 16, 600, 1, 1, 5, 0}; // the context split among blocks
    static const int whole[] = {1, 1, 3, 16, 1, 0};               // one block a head: no combine
    run_attention_wo(1024, split);
    run_attention_wo(40, whole);
}

// The gated attention (st_attn_args.gated, Qwen3-Next): the op reads the q projection's rows,
// [query | gate] per head, in place and gates its output. On the GPU its out and y must equal,
// bit for bit, the GPU's split_heads, attention, mul_sigmoid and matmul one after another (the
// forward's ops before: the gate is applied with mul_sigmoid_kernel's arithmetic wherever the
// output is written), out the same without wo, and the cache the same bytes; against the CPU's
// gated op within the bounds of the tests above. Decode steps before and after the context is
// split among blocks (cluster merges, or for head size 96 the counting merge), windows, and
// prompt chunks (the tensor-core kernel and its combine; FP32 for head size 96). With
// STRATA_CLUSTER=0 or STRATA_ATTN_OLD=1 (tests/gpu/run.sh) the other merges run.
typedef struct gated_case {
    int H, Hkv, D, n_rot, n_ctx;
    st_kv_type type;
    bool qk_norm;
    const int *calls; // row counts, 0-terminated
} gated_case;

static void run_attention_gated(const gated_case *gc) {
    const int H = gc->H, Hkv = gc->Hkv, D = gc->D, nv = Hkv * D, cols = H * D, rows = 200;
    st_kv_layer kc = {.type = gc->type, .n_ctx = gc->n_ctx, .n_head_kv = Hkv, .head_dim = D,
                      .row_bytes = st_kv_row_bytes(gc->type, nv)};
    st_kv_layer kg = kc, kr = kc; // the GPU's gated op (kg) and its ops one after another (kr)
    size_t cache_bytes = kc.row_bytes * (size_t)gc->n_ctx;
    kc.k = calloc(1, cache_bytes), kc.v = calloc(1, cache_bytes);
    kg.k = dev_put(NULL, cache_bytes), kg.v = dev_put(NULL, cache_bytes);
    kr.k = dev_put(NULL, cache_bytes), kr.v = dev_put(NULL, cache_bytes);
    gpu->ops->zero(gpu, kg.k, cache_bytes), gpu->ops->zero(gpu, kg.v, cache_bytes);
    gpu->ops->zero(gpu, kr.k, cache_bytes), gpu->ops->zero(gpu, kr.v, cache_bytes);
    st_mat wc, wg;
    q8_mat_make(rows, cols, 1.0f, &wc, &wg);
    float *qn = rand_buf(D, 0.5f, 1.5f), *kn = rand_buf(D, 0.5f, 1.5f);
    float *dqn = dev_put(qn, sizeof(float) * D), *dkn = dev_put(kn, sizeof(float) * D);
    int32_t *dpos = dev_put(NULL, sizeof(int32_t));
    int pos = 0;
    for (int ci = 0; gc->calls[ci]; ci++) {
        int n = gc->calls[ci];
        size_t nq = (size_t)n * H * D, nk = (size_t)n * nv, ny = (size_t)n * rows;
        float *big = rand_buf(2 * nq, -1, 1), *k = rand_buf(nk, -1, 1), *v = rand_buf(nk, -1, 1);
        for (size_t i = 0; i < nk; i += 7) k[i] *= 4;       // some larger logits: a softmax that is not flat
        for (size_t i = 0; i < 2 * nq; i += 5) big[i] *= 6; // gates well into sigmoid's tails too
        int32_t *rp = malloc(sizeof(int32_t) * n);
        for (int i = 0; i < n; i++) rp[i] = pos + i;
        int32_t pos_h = pos;
        gpu->ops->from_host(gpu, dpos, &pos_h, sizeof pos_h);
        // The CPU's gated op (it norms q and k in place: copies).
        float *qc = malloc(sizeof(float) * 2 * nq), *kcp = malloc(sizeof(float) * nk);
        memcpy(qc, big, sizeof(float) * 2 * nq), memcpy(kcp, k, sizeof(float) * nk);
        float *out = malloc(sizeof(float) * nq), *y = malloc(sizeof(float) * ny);
        st_attn_args a = {.kv = &kc, .pos_dev = &pos_h, .q = qc, .k = kcp, .v = v, .out = out, .n = n, .pos0 = pos,
                          .n_head = H, .scale = 1.0f / sqrtf((float)D), .gated = true, .wo = &wc, .y = y};
        if (gc->qk_norm)
            a.q_norm = qn, a.k_norm = kn, a.pos = rp, a.n_rot = gc->n_rot, a.rope_base = 1e7f, a.eps = 1e-6f;
        cpu->ops->attention(cpu, &a);
        // The GPU: the gated op with wo, then without (the same rows stored again at the same
        // positions), each on the raw q and k.
        float *dbig = dev_put(NULL, sizeof(float) * 2 * nq), *dk = dev_put(NULL, sizeof(float) * nk);
        float *dv = dev_put(v, sizeof(float) * nk), *dout = dev_put(NULL, sizeof(float) * nq);
        float *dy = dev_put(NULL, sizeof(float) * ny), *dq = dev_put(NULL, sizeof(float) * nq);
        float *dgate = dev_put(NULL, sizeof(float) * nq);
        int32_t *drp = dev_put(rp, sizeof(int32_t) * n);
        float *o1 = malloc(sizeof(float) * nq), *o2 = malloc(sizeof(float) * nq), *o3 = malloc(sizeof(float) * nq);
        float *y1 = malloc(sizeof(float) * ny), *y2 = malloc(sizeof(float) * ny);
        st_attn_args b = a;
        b.kv = &kg, b.pos_dev = dpos, b.q = dbig, b.k = dk, b.v = dv, b.out = dout, b.wo = &wg, b.y = dy;
        if (gc->qk_norm) b.q_norm = dqn, b.k_norm = dkn, b.pos = drp;
        gpu->ops->from_host(gpu, dbig, big, sizeof(float) * 2 * nq), gpu->ops->from_host(gpu, dk, k, sizeof(float) * nk);
        gpu->ops->attention(gpu, &b);
        dev_get(o1, dout, sizeof(float) * nq), dev_get(y1, dy, sizeof(float) * ny);
        gpu->ops->from_host(gpu, dbig, big, sizeof(float) * 2 * nq), gpu->ops->from_host(gpu, dk, k, sizeof(float) * nk);
        b.wo = NULL, b.y = NULL;
        gpu->ops->attention(gpu, &b);
        dev_get(o3, dout, sizeof(float) * nq);
        // The GPU's ops one after another, on a cache of their own.
        gpu->ops->from_host(gpu, dbig, big, sizeof(float) * 2 * nq), gpu->ops->from_host(gpu, dk, k, sizeof(float) * nk);
        gpu->ops->split_heads(gpu, dbig, dq, dgate, n, H, D, D);
        b.kv = &kr, b.q = dq, b.gated = false;
        gpu->ops->attention(gpu, &b);
        gpu->ops->mul_sigmoid(gpu, dout, dgate, (int64_t)nq);
        gpu->ops->matmul(gpu, &wg, dout, n, dy);
        dev_get(o2, dout, sizeof(float) * nq), dev_get(y2, dy, sizeof(float) * ny);

        char what[160];
        snprintf(what, sizeof what, "gated attention %s H=%d Hkv=%d D=%d norms=%d (context %d): n=%d at pos %d",
                 kv_name(gc->type), H, Hkv, D, gc->qk_norm, gc->n_ctx, n, pos);
        for (size_t i = 0; i < nq; i++) {
            if (memcmp(&o1[i], &o2[i], sizeof(float)))
                fail_msg("%s: out[%zu] = %.9g, %.9g from split_heads + attention + mul_sigmoid", what, i, o1[i], o2[i]);
            if (memcmp(&o1[i], &o3[i], sizeof(float)))
                fail_msg("%s: out[%zu] = %.9g with wo, %.9g without", what, i, o1[i], o3[i]);
        }
        for (size_t i = 0; i < ny; i++)
            if (memcmp(&y1[i], &y2[i], sizeof(float)))
                fail_msg("%s: y[%zu] = %.9g with wo, %.9g from the separate ops", what, i, y1[i], y2[i]);
        size_t rows_bytes = kc.row_bytes * (size_t)n, off = kc.row_bytes * (size_t)pos;
        char *cg = malloc(rows_bytes), *cr = malloc(rows_bytes);
        for (int kvi = 0; kvi < 2; kvi++) {
            dev_get(cg, (char *)(kvi ? kg.v : kg.k) + off, rows_bytes);
            dev_get(cr, (char *)(kvi ? kr.v : kr.k) + off, rows_bytes);
            if (memcmp(cg, cr, rows_bytes))
                fail_msg("%s: the %s cache rows differ from the separate ops'", what, kvi ? "v" : "k");
        }
        free(cg), free(cr);
        bool loose = gc->type == ST_KV_Q8_0 || gc->qk_norm, chunk = n > 16;
        check(what, out, o1, nq, loose ? 2e-3 : 2e-5, loose ? 1e-3 : 1e-4);
        check(what, y, y1, ny, chunk ? 0.4 : 5e-2, chunk ? 3e-2 : 1e-2);
        check_cache(what, &kc, kc.k, kg.k, pos, pos + n, gc->qk_norm);
        check_cache(what, &kc, kc.v, kg.v, pos, pos + n, false);
        pos += n;
        dev_free(dbig), dev_free(dk), dev_free(dv), dev_free(dout), dev_free(dy), dev_free(dq), dev_free(dgate);
        dev_free(drp);
        free(big), free(k), free(v), free(rp), free(qc), free(kcp), free(out), free(y);
        free(o1), free(o2), free(o3), free(y1), free(y2);
    }
    dev_free(kg.k), dev_free(kg.v), dev_free(kr.k), dev_free(kr.v), dev_free(dpos), dev_free(dqn), dev_free(dkn);
    q8_mat_free(&wc, &wg);
    free(kc.k), free(kc.v), free(qn), free(kn);
}

static void test_attention_gated(void **st) {
    (void)st;
    static const int split[] = {1, 1, 5, 64, 1, 600, 1, 1, 5, 100, 1, 0}; // to 780: split among blocks
    static const int whole[] = {1, 1, 3, 16, 1, 5, 0};                    // one block a head
    static const gated_case cases[] = {
        {16, 2, 256, 64, 1024, ST_KV_F16, true, split}, // Qwen3-Next: head_dim 256, a quarter rotated
        {16, 2, 256, 64, 1024, ST_KV_Q8_0, true, split},
        {16, 2, 256, 64, 40, ST_KV_F16, true, whole},
        {32, 4, 128, 128, 1024, ST_KV_F16, false, split}, // head_dim 128, q and k ready
        {32, 4, 128, 32, 40, ST_KV_Q8_0, true, whole},
        {8, 2, 96, 32, 1024, ST_KV_F16, true, split}, // no cluster kernels: the counting merge, FP32 chunks
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_attention_gated(&cases[i]);
}

static void test_attention(void **st) {
    (void)st;
    static const int short_calls[] = {17, 1, 1, 3, 16, 100, 1, 5, 0};
    static const int long_calls[] = {333, 1000, 1700, 1, 1, 16, 1900, 17, 1, 7, 0};      // to 4977
    static const attn_case cases[] = {
        {8, 8, 128, 256, ST_KV_F16, short_calls, false},   // G = 1
        {8, 4, 64, 256, ST_KV_Q8_0, short_calls, false},   // G = 2
        {32, 4, 128, 256, ST_KV_F16, short_calls, false},  // Qwen3-30B: G = 8
        {32, 4, 128, 256, ST_KV_Q8_0, short_calls, false},
        {32, 4, 128, 256, ST_KV_F16, short_calls, true}, // with the q / k norms and rope
        {16, 2, 256, 256, ST_KV_F16, short_calls, false},  // Qwen3-Next: G = 8, head_dim 256
        {16, 2, 256, 256, ST_KV_Q8_0, short_calls, true},
        {16, 2, 256, 256, ST_KV_Q8_0, short_calls, false},
        {6, 3, 96, 256, ST_KV_F32, short_calls, false},    // an odd head size, f32 cache
        {8, 1, 64, 5000, ST_KV_F16, long_calls, false},    // long context: the split path late
        {2, 1, 128, 5000, ST_KV_Q8_0, long_calls, false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_attn_case(&cases[i]);
}

// ---------------------------------------------------------------------------------------------
// Gated DeltaNet: both GPU forms against the CPU step form, state carried across calls.

static void unit_rows(float *x, int rows, int d, float scale) {
    for (int i = 0; i < rows; i++) {
        double ss = 0;
        for (int j = 0; j < d; j++) ss += (double)x[i * d + j] * x[i * d + j];
        for (int j = 0; j < d; j++) x[i * d + j] = (float)(x[i * d + j] / sqrt(ss) * scale);
    }
}

static void run_gdn(bool chunked, int d) {
    int hk = 16, hv = 32;
    static const int calls[] = {1, 3, 16, 17, 64, 65, 100, 300, 1, 0};
    size_t ns = (size_t)hv * d * d;
    float *S = rand_buf(ns, -0.5f, 0.5f), *Sg = malloc(sizeof(float) * ns);
    float *dS = dev_put(S, sizeof(float) * ns);
    for (int ci = 0; calls[ci]; ci++) {
        int n = calls[ci];
        size_t nk = (size_t)n * hk * d, nvv = (size_t)n * hv * d;
        float *q = rand_buf(nk, -1, 1), *k = rand_buf(nk, -1, 1), *v = rand_buf(nvv, -1, 1);
        float *beta = rand_buf((size_t)n * hv, 0.02f, 0.98f), *g = malloc(sizeof(float) * n * hv);
        for (int i = 0; i < n * hv; i++) g[i] = (float)(i % 5 == 0 ? -1e-4 * rnd() : -3 * rnd() * rnd());
        unit_rows(q, n * hk, d, 1.0f / sqrtf((float)d));
        unit_rows(k, n * hk, d, 1.0f);
        float *out = malloc(sizeof(float) * nvv), *got = malloc(sizeof(float) * nvv);
        float *dq = dev_put(q, sizeof(float) * nk), *dk = dev_put(k, sizeof(float) * nk), *dv = dev_put(v, sizeof(float) * nvv),
              *db = dev_put(beta, sizeof(float) * n * hv), *dg = dev_put(g, sizeof(float) * n * hv),
              *dout = dev_put(NULL, sizeof(float) * nvv);
        st_gdn_args a = {.q = q, .k = k, .v = v, .beta = beta, .g = g, .state = S, .out = out, .n = n, .h_k = hk, .h_v = hv, .d = d};
        cpu->ops->gdn(cpu, &a);
        st_gdn_args b = {.q = dq, .k = dk, .v = dv, .beta = db, .g = dg, .state = dS, .out = dout, .n = n, .h_k = hk, .h_v = hv, .d = d};
        (chunked ? gpu->ops->gdn_chunked : gpu->ops->gdn)(gpu, &b);
        dev_get(got, dout, sizeof(float) * nvv);
        dev_get(Sg, dS, sizeof(float) * ns);
        char what[96];
        snprintf(what, sizeof what, "gdn%s d=%d call %d n=%d out", chunked ? "_chunked" : "", d, ci, n);
        check(what, out, got, nvv, 1e-4, 1e-3);
        snprintf(what, sizeof what, "gdn%s d=%d call %d n=%d state", chunked ? "_chunked" : "", d, ci, n);
        check(what, S, Sg, ns, 1e-4, 1e-3);
        // Carry the CPU's state to both sides so rounding differences do not compound.
        gpu->ops->from_host(gpu, dS, S, sizeof(float) * ns);
        dev_free(dq), dev_free(dk), dev_free(dv), dev_free(db), dev_free(dg), dev_free(dout);
        free(q), free(k), free(v), free(beta), free(g), free(out), free(got);
    }
    dev_free(dS), free(S), free(Sg);
}

// The DeltaNet mixer (st_deltanet_args) with its output projection (a q8_0 wo) over a run of
// calls, the states carried: the GPU's op (one kernel for decode windows, which hands the
// projection its outputs quantized; STRATA_DN_FUSED=0: the ops in turn) against the CPU's, and
// bit for bit against the same ops one after another on the GPU (st_deltanet_ops, the product
// quantizing the floats itself), which the fused kernel must match exactly. Qwen3-Next's head
// shape (d 128, 16 key and 32 value heads) and r = 1.
typedef struct dn_bufs {
    float *qkv, *conv_w, *conv_state, *ba, *ssm_a, *dt_bias, *z, *norm_w, *state, *out, *u, *q, *k, *v, *beta, *g, *y;
    const st_mat *wo;
} dn_bufs;

static st_deltanet_args dn_args(const dn_bufs *m, int n, int hk, int hv, int d, int K) {
    return (st_deltanet_args){.qkv = m->qkv, .conv_w = m->conv_w, .conv_state = m->conv_state, .ba = m->ba,
                              .ssm_a = m->ssm_a, .dt_bias = m->dt_bias, .z = m->z, .norm_w = m->norm_w,
                              .state = m->state, .out = m->out, .u = m->u, .q = m->q, .k = m->k, .v = m->v,
                              .beta = m->beta, .g = m->g, .n = n, .h_k = hk, .h_v = hv, .d = d, .kernel = K,
                              .eps = 1e-6f, .wo = m->wo, .y = m->y};
}

static void run_deltanet(int hk, int hv) {
    const int d = 128, K = 4, cd = 2 * hk * d + hv * d, vd = hv * d, nmax = 40;
    static const int calls[] = {1, 1, 2, 4, 5, 1, 16, 33, 1, 3, 0};
    size_t ns = (size_t)hv * d * d, ncs = (size_t)(K - 1) * cd;
    dn_bufs c = {0}, g = {0}, o = {0}; // CPU, GPU op, GPU ops one after another
    c.conv_w = rand_buf((size_t)cd * K, -0.5f, 0.5f), c.ssm_a = rand_buf(hv, -2.0f, -0.1f);
    c.dt_bias = rand_buf(hv, -1, 1), c.norm_w = rand_buf(d, 0.5f, 1.5f);
    c.conv_state = rand_buf(ncs, -1, 1), c.state = rand_buf(ns, -0.2f, 0.2f);
    c.u = malloc(sizeof(float) * nmax * cd), c.q = malloc(sizeof(float) * nmax * hk * d);
    c.k = malloc(sizeof(float) * nmax * hk * d), c.v = malloc(sizeof(float) * nmax * vd);
    c.beta = malloc(sizeof(float) * nmax * hv), c.g = malloc(sizeof(float) * nmax * hv);
    c.out = malloc(sizeof(float) * nmax * vd);
    // The output projection's rows, weights of a trained model's size: y then stays O(1), as
    // attention's does in run_attention_wo, so the same bounds hold.
    const int rows = 200;
    st_mat wc, wg;
    q8_mat_make(rows, vd, 0.05f, &wc, &wg);
    c.wo = &wc, c.y = malloc(sizeof(float) * nmax * rows);
    dn_bufs *dev[2] = {&g, &o};
    for (int i = 0; i < 2; i++) {
        dn_bufs *b = dev[i];
        b->conv_w = dev_put(c.conv_w, sizeof(float) * cd * K), b->ssm_a = dev_put(c.ssm_a, sizeof(float) * hv);
        b->dt_bias = dev_put(c.dt_bias, sizeof(float) * hv), b->norm_w = dev_put(c.norm_w, sizeof(float) * d);
        b->conv_state = dev_put(c.conv_state, sizeof(float) * ncs), b->state = dev_put(c.state, sizeof(float) * ns);
        b->u = dev_put(NULL, sizeof(float) * nmax * cd), b->q = dev_put(NULL, sizeof(float) * nmax * hk * d);
        b->k = dev_put(NULL, sizeof(float) * nmax * hk * d), b->v = dev_put(NULL, sizeof(float) * nmax * vd);
        b->beta = dev_put(NULL, sizeof(float) * nmax * hv), b->g = dev_put(NULL, sizeof(float) * nmax * hv);
        b->out = dev_put(NULL, sizeof(float) * nmax * vd);
        b->wo = &wg, b->y = dev_put(NULL, sizeof(float) * nmax * rows);
    }
    size_t most = ns > (size_t)nmax * vd ? ns : (size_t)nmax * vd;
    most = most > (size_t)nmax * rows ? most : (size_t)nmax * rows;
    float *got = malloc(sizeof(float) * most), *ref2 = malloc(sizeof(float) * most);
    for (int ci = 0; calls[ci]; ci++) {
        int n = calls[ci];
        c.qkv = rand_buf((size_t)n * cd, -2, 2), c.ba = rand_buf((size_t)n * 2 * hv, -3, 3);
        c.z = rand_buf((size_t)n * vd, -3, 3);
        for (int i = 0; i < 2; i++) {
            dev[i]->qkv = dev_put(c.qkv, sizeof(float) * n * cd), dev[i]->ba = dev_put(c.ba, sizeof(float) * n * 2 * hv);
            dev[i]->z = dev_put(c.z, sizeof(float) * n * vd);
        }
        st_deltanet_args ac = dn_args(&c, n, hk, hv, d, K), ag = dn_args(&g, n, hk, hv, d, K),
                         ao = dn_args(&o, n, hk, hv, d, K);
        cpu->ops->deltanet(cpu, &ac);
        gpu->ops->deltanet(gpu, &ag);
        st_deltanet_ops(gpu, &ao);
        char what[128];
        struct { const char *name; float *cpu_p, *g_p, *o_p; size_t len; double atol, rtol; } outs[] = {
            {"out", c.out, g.out, o.out, (size_t)n * vd, 2e-4, 2e-3},
            {"state", c.state, g.state, o.state, ns, 1e-4, 1e-3},
            {"conv state", c.conv_state, g.conv_state, o.conv_state, ncs, 0, 0},
            // (windows: q8_0 activations as the CPU's; prompt chunks: bf16 weights, cuBLAS)
            {"y", c.y, g.y, o.y, (size_t)n * rows, n > 16 ? 0.4 : 5e-2, n > 16 ? 3e-2 : 1e-2},
        };
        for (int k = 0; k < 4; k++) {
            dev_get(got, outs[k].g_p, sizeof(float) * outs[k].len);
            dev_get(ref2, outs[k].o_p, sizeof(float) * outs[k].len);
            snprintf(what, sizeof what, "deltanet h_k=%d h_v=%d call %d n=%d %s", hk, hv, ci, n, outs[k].name);
            check(what, outs[k].cpu_p, got, outs[k].len, outs[k].atol, outs[k].rtol);
            if (memcmp(got, ref2, sizeof(float) * outs[k].len))
                fail_msg("%s: the op and its ops one after another differ on the GPU", what);
        }
        // Carry the CPU's states to both GPU sides so rounding differences do not compound.
        for (int i = 0; i < 2; i++) {
            gpu->ops->from_host(gpu, dev[i]->state, c.state, sizeof(float) * ns);
            dev_free(dev[i]->qkv), dev_free(dev[i]->ba), dev_free(dev[i]->z);
        }
        free(c.qkv), free(c.ba), free(c.z);
    }
    for (int i = 0; i < 2; i++) {
        dn_bufs *b = dev[i];
        float *ps[] = {b->conv_w, b->ssm_a, b->dt_bias, b->norm_w, b->conv_state, b->state, b->u, b->q, b->k, b->v,
                       b->beta, b->g, b->out, b->y};
        for (size_t k = 0; k < sizeof ps / sizeof ps[0]; k++) dev_free(ps[k]);
    }
    float *ps[] = {c.conv_w, c.ssm_a, c.dt_bias, c.norm_w, c.conv_state, c.state, c.u, c.q, c.k, c.v, c.beta, c.g,
                   c.out, c.y, got, ref2};
    for (size_t k = 0; k < sizeof ps / sizeof ps[0]; k++) free(ps[k]);
    q8_mat_free(&wc, &wg);
}

static void test_deltanet(void **st) {
    (void)st;
    run_deltanet(16, 32); // Qwen3-Next: two value heads a key head
    run_deltanet(4, 4);
}

static void test_gdn_step(void **st) {
    (void)st;
    run_gdn(false, 128);
    run_gdn(false, 64);
}

static void test_gdn_chunked(void **st) {
    (void)st;
    run_gdn(true, 128);
    run_gdn(true, 64); // not the chunked kernel's size: the step form
}

// ---------------------------------------------------------------------------------------------
// --bench

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Seconds per call of fn: a warm-up, then enough repetitions for ~0.2 s.
typedef void (*bench_fn)(void *ctx);
static double time_op(bench_fn fn, void *ctx) {
    fn(ctx);
    gpu_sync("bench warm-up");
    int reps = 1;
    for (;;) {
        double t0 = now_s();
        for (int i = 0; i < reps; i++) fn(ctx);
        gpu_sync("bench");
        double t = now_s() - t0;
        if (t > 0.2 || reps >= (1 << 20)) return t / reps;
        reps *= t < 0.02 ? 10 : 2;
    }
}

// Seconds per call inside a CUDA graph: GRAPH_REPS calls recorded once (through the backend's
// run, which records a window on its second run), the recording replayed until ~0.2 s. Shows a
// kernel's latency without the host's launch cost, as decode steps see it.
#define GRAPH_REPS 100
typedef struct graph_ctx {
    bench_fn fn;
    void *ctx;
} graph_ctx;
static st_status graph_body(void *ctx) {
    graph_ctx *g = ctx;
    for (int i = 0; i < GRAPH_REPS; i++) g->fn(g->ctx);
    return ST_OK;
}
static double time_graph(bench_fn fn, void *ctx) {
    graph_ctx g = {fn, ctx};
    void *slot = NULL;
    for (int i = 0; i < 3; i++) // eager, recorded, replayed
        if (gpu->ops->run(gpu, &slot, graph_body, &g) != ST_OK) fail_msg("graph run failed: %s", st_error());
    gpu_sync("graph warm-up");
    int reps = 1;
    double per = 0;
    for (;;) {
        double t0 = now_s();
        for (int i = 0; i < reps; i++) gpu->ops->run(gpu, &slot, graph_body, &g);
        gpu_sync("graph bench");
        double t = now_s() - t0;
        if (t > 0.2 || reps >= (1 << 16)) {
            per = t / reps / GRAPH_REPS;
            break;
        }
        reps *= t < 0.02 ? 10 : 2;
    }
    gpu->ops->graph_free(gpu, slot);
    return per;
}

static void attn_fn(void *ctx) { gpu->ops->attention(gpu, ctx); }
static void gdn_fn(void *ctx) { gpu->ops->gdn(gpu, ctx); }
static void gdn_chunked_fn(void *ctx) { gpu->ops->gdn_chunked(gpu, ctx); }

typedef struct small_ctx {
    float *x, *y, *xo, *xn, *w;
    int32_t *pos, *ids;
    float *weights;
    int n, d, heads, k;
} small_ctx;
static void rmsnorm_fn(void *ctx) {
    small_ctx *s = ctx;
    gpu->ops->rmsnorm(gpu, s->x, s->w, s->xn, s->n, s->d, 1e-6f);
}
static void add_rmsnorm_fn(void *ctx) {
    small_ctx *s = ctx;
    gpu->ops->norm_matmul(gpu, s->x, s->y, s->xo, s->w, 1e-6f, s->xn, s->n, s->d, 0, NULL, NULL);
}
static void add_fn(void *ctx) {
    small_ctx *s = ctx;
    gpu->ops->add(gpu, s->x, s->y, (int64_t)s->n * s->d);
}
static void rope_fn(void *ctx) {
    small_ctx *s = ctx;
    gpu->ops->rope(gpu, s->x, s->n, s->heads, s->d, s->d, s->pos, 1e6f);
}
static void norm_rope_fn(void *ctx) {
    small_ctx *s = ctx;
    gpu->ops->norm_rope(gpu, s->x, s->w, s->n, s->heads, s->d, s->d, s->pos, 1e6f, 1e-6f);
}
static void moe_route_fn(void *ctx) {
    small_ctx *s = ctx;
    gpu->ops->moe_route(gpu, s->x, s->n, s->d, s->k, s->ids, s->weights);
}
static void argmax_fn(void *ctx) {
    small_ctx *s = ctx;
    gpu->ops->argmax(gpu, s->x, s->n, s->d, s->ids);
}

static void *dev_rand(size_t n, float lo, float hi) {
    float *h = rand_buf(n, lo, hi);
    void *d = dev_put(h, sizeof(float) * n);
    free(h);
    return d;
}

// One line per op: the time per call launched one by one (host launch included, as without
// graphs) and inside a graph (the kernel's latency as a decode step sees it).
static void bench_small(const char *name, bench_fn fn, small_ctx *s) {
    double eager = time_op(fn, s), graph = time_graph(fn, s);
    printf("%-48s %9.2f us %8.2f us in a graph\n", name, eager * 1e6, graph * 1e6);
}

static int bench(void) {
    printf("%-48s %12s %s\n", "op", "time", "rate");

    // Tiny-op latency at decode sizes (Qwen3-30B-A3B: d 2048, 32 / 4 heads of 128, 128 experts).
    {
        int V = 151936;
        small_ctx s = {.x = dev_rand((size_t)V * 16, -1, 1), .y = dev_rand(2048 * 16, -1, 1),
                       .xn = dev_put(NULL, sizeof(float) * 2048 * 16), .xo = dev_put(NULL, sizeof(float) * 2048 * 16),
                       .w = dev_rand(2048, 0.5f, 1.5f),
                       .ids = dev_put(NULL, sizeof(int32_t) * 16 * 8), .weights = dev_put(NULL, sizeof(float) * 16 * 8)};
        int32_t p[16];
        for (int i = 0; i < 16; i++) p[i] = 1234 + i;
        s.pos = dev_put(p, sizeof p);
        for (int n = 1; n <= 16; n *= 16) {
            char name[96];
            s.n = n, s.d = 2048;
            snprintf(name, sizeof name, "rmsnorm n=%d d=2048", n);
            bench_small(name, rmsnorm_fn, &s);
            snprintf(name, sizeof name, "add_rmsnorm n=%d d=2048", n);
            bench_small(name, add_rmsnorm_fn, &s);
            snprintf(name, sizeof name, "add n=%d d=2048", n);
            bench_small(name, add_fn, &s);
            s.d = 128, s.heads = 32;
            snprintf(name, sizeof name, "rope n=%d 32 heads x 128", n);
            bench_small(name, rope_fn, &s);
            snprintf(name, sizeof name, "norm_rope n=%d 32 heads x 128", n);
            bench_small(name, norm_rope_fn, &s);
            s.heads = 4;
            snprintf(name, sizeof name, "norm_rope n=%d 4 heads x 128", n);
            bench_small(name, norm_rope_fn, &s);
            s.d = 128, s.k = 8;
            snprintf(name, sizeof name, "moe_route n=%d 128 experts top 8", n);
            bench_small(name, moe_route_fn, &s);
            s.d = 512, s.k = 10;
            snprintf(name, sizeof name, "moe_route n=%d 512 experts top 10", n);
            bench_small(name, moe_route_fn, &s);
            s.d = V;
            snprintf(name, sizeof name, "argmax n=%d d=%d", n, V);
            bench_small(name, argmax_fn, &s);
        }
        dev_free(s.x), dev_free(s.y), dev_free(s.xn), dev_free(s.xo), dev_free(s.w), dev_free(s.ids), dev_free(s.weights);
        dev_free(s.pos);
    }

    // Attention, Qwen3-30B-A3B shape: 32 query heads, 4 kv heads, head_dim 128, f16 cache.
    int H = 32, Hkv = 4, D = 128, n_ctx = 32768 + 16;
    st_kv_layer kv = {.type = ST_KV_F16, .n_ctx = n_ctx, .n_head_kv = Hkv, .head_dim = D,
                      .row_bytes = st_kv_row_bytes(ST_KV_F16, Hkv * D)};
    size_t cb = kv.row_bytes * (size_t)n_ctx;
    uint16_t *fill = malloc(cb);
    for (size_t i = 0; i < cb / 2; i++) fill[i] = st_f32_to_f16((float)(2 * rnd() - 1));
    kv.k = dev_put(fill, cb), kv.v = dev_put(fill, cb);
    free(fill);
    int nmax = 2048;
    float *q = dev_rand((size_t)nmax * H * D, -1, 1), *k = dev_rand((size_t)nmax * Hkv * D, -1, 1),
          *v = dev_rand((size_t)nmax * Hkv * D, -1, 1), *out = dev_put(NULL, sizeof(float) * nmax * H * D);
    int32_t *dpos = dev_put(NULL, sizeof(int32_t));
    const int ctxs[] = {1024, 8192, 32768};
    for (int i = 0; i < 3; i++) {
        // n = 4: 32 queries per kv head, the widest window the FP32 kernel takes at this shape
        // (STRATA_ATTN_OLD=1 times the previous decode path for an A/B).
        for (int n = 1; n <= 16; n *= 4) {
            int32_t p0 = ctxs[i] - n;
            gpu->ops->from_host(gpu, dpos, &p0, sizeof p0);
            st_attn_args a = {.kv = &kv, .pos_dev = dpos, .q = q, .k = k, .v = v, .out = out, .n = n, .pos0 = p0,
                              .n_head = H, .scale = 0.088f};
            double t = time_op(attn_fn, &a), tg = time_graph(attn_fn, &a);
            double gbs = 2.0 * kv.row_bytes * ctxs[i] / tg / 1e9;
            char name[96];
            snprintf(name, sizeof name, "attention decode ctx %d n=%d (30B shape)", ctxs[i], n);
            printf("%-48s %9.1f us %8.1f us in a graph, %5.0f GB/s of KV\n", name, t * 1e6, tg * 1e6, gbs);
        }
    }
    for (int pi = 0; pi < 2; pi++) { // a 2048-row prompt chunk from 0, and one late in the context
        int32_t p0 = pi ? 8192 : 0;
        gpu->ops->from_host(gpu, dpos, &p0, sizeof p0);
        st_attn_args a = {.kv = &kv, .pos_dev = dpos, .q = q, .k = k, .v = v, .out = out, .n = nmax, .pos0 = p0,
                          .n_head = H, .scale = 0.088f};
        double t = time_op(attn_fn, &a);
        // Causal: query row i sees p0 + i + 1 positions; QK and PV 2 flops per multiply-add each.
        double flops = 4.0 * H * D * ((double)nmax * p0 + (double)nmax * (nmax + 1) / 2);
        char name[96];
        snprintf(name, sizeof name, "attention prompt 2048 at pos %d (30B shape)", p0);
        printf("%-48s %9.1f us %8.1f TFLOPS\n", name, t * 1e6, flops / t / 1e12);
    }
    dev_free(kv.k), dev_free(kv.v), dev_free(q), dev_free(k), dev_free(v), dev_free(out), dev_free(dpos);

    // Gated DeltaNet, Qwen3-Next shape.
    int hk = 16, hv = 32, d = 128;
    float *gq = dev_rand((size_t)nmax * hk * d, -0.05f, 0.05f), *gk = dev_rand((size_t)nmax * hk * d, -0.08f, 0.08f),
          *gv = dev_rand((size_t)nmax * hv * d, -1, 1), *gb = dev_rand((size_t)nmax * hv, 0.1f, 0.9f),
          *gg = dev_rand((size_t)nmax * hv, -1, -0.01f), *gs = dev_rand((size_t)hv * d * d, -0.1f, 0.1f),
          *go = dev_put(NULL, sizeof(float) * nmax * hv * d);
    const int gn[] = {1, 16, 64, 2048};
    for (int i = 0; i < 4; i++) {
        st_gdn_args a = {.q = gq, .k = gk, .v = gv, .beta = gb, .g = gg, .state = gs, .out = go, .n = gn[i], .h_k = hk,
                         .h_v = hv, .d = d};
        char name[96];
        double t = time_op(gdn_fn, &a);
        snprintf(name, sizeof name, "gdn step n=%d (Next shape)", gn[i]);
        if (gn[i] <= 16) {
            double tg = time_graph(gdn_fn, &a);
            printf("%-48s %9.1f us %8.2f us in a graph\n", name, t * 1e6, tg * 1e6);
        } else {
            printf("%-48s %9.1f us %8.2f us/row\n", name, t * 1e6, t * 1e6 / gn[i]);
        }
        if (gn[i] < 32) continue;
        t = time_op(gdn_chunked_fn, &a);
        snprintf(name, sizeof name, "gdn chunked n=%d (Next shape)", gn[i]);
        printf("%-48s %9.1f us %8.2f us/row\n", name, t * 1e6, t * 1e6 / gn[i]);
    }
    dev_free(gq), dev_free(gk), dev_free(gv), dev_free(gb), dev_free(gg), dev_free(gs), dev_free(go);
    return 0;
}

int main(int argc, char **argv) {
    if (!st_cuda_available()) {
        printf("SKIPPED: built without CUDA\n");
        return 77;
    }
    st_gpu_info info[8];
    int ngpu = 0;
    char why[256] = "";
    if (st_cuda_devices(info, 8, &ngpu, why, sizeof why) != ST_OK || ngpu == 0) {
        printf("SKIPPED: no GPU (%s)\n", why);
        return 77;
    }
    if (st_backend_cpu_create(2, &cpu) != ST_OK || st_backend_cuda_create(0, 256 << 20, 2, &gpu) != ST_OK) {
        fprintf(stderr, "cannot create the backends: %s\n", st_error());
        return 1;
    }
    int rc;
    if (argc > 1 && !strcmp(argv[1], "--bench")) {
        printf("GPU 0: %s\n", info[0].name);
        rc = bench();
    } else {
        const struct CMUnitTest tests[] = {
            cmocka_unit_test(test_rmsnorm),       cmocka_unit_test(test_rmsnorm_silu),
            cmocka_unit_test(test_l2norm),
            cmocka_unit_test(test_rope),          cmocka_unit_test(test_add_rmsnorm),
            cmocka_unit_test(test_norm_rope),     cmocka_unit_test(test_conv),
            cmocka_unit_test(test_elementwise),   cmocka_unit_test(test_gated_rows_and_gates),
            cmocka_unit_test(test_copies),        cmocka_unit_test(test_moe_route),
            cmocka_unit_test(test_argmax),        cmocka_unit_test(test_attention),
            cmocka_unit_test(test_attention_wo),  cmocka_unit_test(test_attention_gated),
            cmocka_unit_test(test_gdn_step),      cmocka_unit_test(test_gdn_chunked),
            cmocka_unit_test(test_deltanet),
        };
        rc = cmocka_run_group_tests(tests, NULL, NULL);
    }
    st_backend_free(gpu);
    st_backend_free(cpu);
    return rc;
}
