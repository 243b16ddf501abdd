// GPU tests of the quantized-weight ops (quant_matmul.cu) against the CPU backend: matmul for
// every weight type with odd sizes and window sizes on both sides of the GEMM crossover,
// get_rows (exact), the shared expert on the side stream, and the routed experts on random
// routing. Exits 77 (skipped) without a usable GPU. `test_cuda_quant --bench` prints matrix-vector bandwidth and expert timings.
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
#include "experts/experts.h"
#include "quant/quant.h"

static st_backend *cpu, *gpu;

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static uint64_t rng_u64(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static double rnd(void) { return (double)(rng_u64() >> 11) / 9007199254740992.0; } // [0, 1)
static float rnd_normal(void) {
    double u1 = rnd() + 1e-12, u2 = rnd();
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    return p;
}

static float *rand_normal(size_t n, float scale) {
    float *x = xmalloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) x[i] = scale * rnd_normal();
    return x;
}

static void *dev_put(const void *host, size_t bytes) {
    void *p = gpu->ops->alloc(gpu, bytes ? bytes : 4);
    if (!p) fail_msg("device alloc of %zu bytes failed: %s", bytes, st_error());
    if (host && bytes) gpu->ops->from_host(gpu, p, host, bytes);
    return p;
}

static void gpu_sync(const char *what) {
    st_status s = gpu->ops->sync(gpu);
    if (s != ST_OK) fail_msg("%s: GPU error: %s", what, st_error());
}

static void dev_get(void *host, const void *dev, size_t bytes) {
    gpu->ops->to_host(gpu, host, dev, bytes);
    gpu_sync("to_host");
}

static void dev_free(void *p) { gpu->ops->free(gpu, p); }

// ---------------------------------------------------------------------------------------------
// Weights. Types with a quantizer: Gaussian weights quantized. The others (IQ2/IQ3/IQ1): random
// bytes (every bit pattern of their index and sign fields is valid) with sane fp16 scales.

// Offsets of the fp16 scale fields of one block (d, and dmin / m where the type has one).
static int scale_fields(st_type t, int off[2]) {
    switch (t) {
    case ST_TYPE_Q4_1:
    case ST_TYPE_Q5_1:
    case ST_TYPE_Q4_K:
    case ST_TYPE_Q5_K: off[0] = 0, off[1] = 2; return 2;
    case ST_TYPE_Q2_K: off[0] = 80, off[1] = 82; return 2;
    case ST_TYPE_Q3_K: off[0] = 108; return 1;
    case ST_TYPE_Q6_K: off[0] = 208; return 1;
    case ST_TYPE_IQ1_M: return 0; // spread over the scale words: set apart
    default: off[0] = 0; return 1;
    }
}

static void put_f16(uint8_t *p, float v) {
    st_f16 h = st_f32_to_f16(v);
    memcpy(p, &h, 2);
}

// Random bytes with each block's scales set to ±[0.002, 0.02).
static void random_blocks(st_type t, uint8_t *buf, size_t bytes) {
    for (size_t i = 0; i < bytes; i++) buf[i] = (uint8_t)(rng_u64() >> 24);
    const st_type_info *info = st_type_get(t);
    if (!info->quantized) {
        size_t n = bytes / info->block_bytes;
        for (size_t i = 0; i < n; i++) {
            float v = 0.05f * rnd_normal();
            if (t == ST_TYPE_F32) memcpy(buf + 4 * i, &v, 4);
            else if (t == ST_TYPE_F16) put_f16(buf + 2 * i, v);
            else {
                st_bf16 h = st_f32_to_bf16(v);
                memcpy(buf + 2 * i, &h, 2);
            }
        }
        return;
    }
    size_t nb = bytes / info->block_bytes;
    for (size_t b = 0; b < nb; b++) {
        uint8_t *blk = buf + b * info->block_bytes;
        float d = (float)((0.002 + 0.018 * rnd()) * (rnd() < 0.5 ? -1 : 1));
        int off[2], nf = scale_fields(t, off);
        for (int f = 0; f < nf; f++) put_f16(blk + off[f], f == 0 ? d : fabsf(d) * 0.5f);
        if (t == ST_TYPE_IQ1_M) {
            st_f16 h = st_f32_to_f16(fabsf(d));
            for (int k = 0; k < 4; k++) { // nibble k of d in the top nibble of scale word k
                uint16_t w;
                memcpy(&w, blk + 48 + 2 * k, 2);
                w = (uint16_t)((w & 0x0fff) | ((h >> (4 * k)) & 15) << 12);
                memcpy(blk + 48 + 2 * k, &w, 2);
            }
        }
    }
}

static uint8_t *make_weights(st_type t, int64_t rows, int64_t cols, bool random_bytes) {
    size_t bytes = st_row_bytes(t, cols) * (size_t)rows;
    uint8_t *w = xmalloc(bytes);
    if (!random_bytes && st_quantize_weights_supported(t)) {
        float *f = rand_normal((size_t)rows * cols, 0.1f);
        st_quantize_weights(t, f, w, rows, cols);
        free(f);
    } else {
        random_blocks(t, w, bytes);
    }
    return w;
}

// make_weights' matrix uploaded to the GPU (quantized from normal values).
static st_mat device_weights(st_type t, int64_t rows, int64_t cols) {
    uint8_t *w = make_weights(t, rows, cols, false);
    st_mat m = {t, cols, rows, st_row_bytes(t, cols), gpu->ops->upload(gpu, w, st_row_bytes(t, cols) * (size_t)rows)};
    free(w);
    if (!m.data) fail_msg("upload failed: %s", st_error());
    return m;
}

static const st_type ALL_TYPES[] = {
    ST_TYPE_Q8_0,   ST_TYPE_Q4_K,   ST_TYPE_Q5_K,   ST_TYPE_Q6_K,    ST_TYPE_IQ4_XS, ST_TYPE_IQ3_XXS,
    ST_TYPE_IQ3_S,  ST_TYPE_IQ2_XS, ST_TYPE_Q4_0,   ST_TYPE_F16,     ST_TYPE_BF16,   ST_TYPE_F32,
    ST_TYPE_Q4_1,   ST_TYPE_Q5_0,   ST_TYPE_Q5_1,   ST_TYPE_Q2_K,    ST_TYPE_Q3_K,   ST_TYPE_IQ2_XXS,
    ST_TYPE_IQ2_S,  ST_TYPE_IQ1_S,  ST_TYPE_IQ1_M,  ST_TYPE_IQ4_NL,
};
#define N_TYPES (int)(sizeof ALL_TYPES / sizeof ALL_TYPES[0])

// ---------------------------------------------------------------------------------------------
// matmul. The GPU quantizes activations to int8 blocks of 32 (scale amax/127) and the CPU to
// its dot type (q8_0 / q8_1 blocks of 32, q8_K blocks of 256, f16, bf16): each side's error per
// element is at most half a step, amax/254 of the element's 256-block (+ the CPU's fp16 scale
// rounding), so |gpu - cpu| <= 1.5 · Σ_e |w_e| · 2 · amax256(e) / 254. Prompt chunks (n > 16)
// use bf16 weights and activations on the GPU: another 2 · 2^-9 · Σ|w_e x_e|. Float weights:
// the CPU rounds x to f16 (2^-11) or bf16 (2^-9); F32 differs by summation order only.

static const int NS[] = {1, 2, 3, 8, 16, 17, 64, 200};
#define N_NS (int)(sizeof NS / sizeof NS[0])

typedef struct err_stats {
    double max_abs, max_rel, max_ratio; // ratio: error / bound
} err_stats;

static void matmul_case(st_type t, int64_t rows, int64_t cols, err_stats *st) {
    bool qt = st_type_get(t)->quantized;
    uint8_t *w = make_weights(t, rows, cols, false);
    size_t wbytes = st_row_bytes(t, cols) * (size_t)rows;
    float *wf = xmalloc(sizeof(float) * (size_t)rows * cols);
    st_dequantize(t, w, wf, rows * cols);
    void *wd = gpu->ops->upload(gpu, w, wbytes);
    if (!wd) fail_msg("upload of %zu bytes failed: %s", wbytes, st_error());
    int nmax = NS[N_NS - 1];
    float *x = rand_normal((size_t)nmax * cols, 1.0f);
    float *xd = dev_put(x, sizeof(float) * (size_t)nmax * cols);
    float *yd = dev_put(NULL, sizeof(float) * (size_t)nmax * rows);
    float *yc = xmalloc(sizeof(float) * (size_t)nmax * rows), *yg = xmalloc(sizeof(float) * (size_t)nmax * rows);
    double *amax = xmalloc(sizeof(double) * (size_t)cols);
    st_mat mc = {t, cols, rows, st_row_bytes(t, cols), w};
    st_mat mg = {t, cols, rows, st_row_bytes(t, cols), wd};
    for (int ni = 0; ni < N_NS; ni++) {
        int n = NS[ni];
        cpu->ops->matmul(cpu, &mc, x, n, yc);
        gpu->ops->matmul(gpu, &mg, xd, n, yd);
        dev_get(yg, yd, sizeof(float) * (size_t)n * rows);
        for (int i = 0; i < n; i++) {
            const float *xi = x + (size_t)i * cols;
            for (int64_t b0 = 0; b0 < cols; b0 += 256) { // amax of each 256-block (or the row's tail)
                double m = 0;
                int64_t b1 = b0 + 256 < cols ? b0 + 256 : cols;
                for (int64_t e = b0; e < b1; e++) m = fmax(m, fabs(xi[e]));
                for (int64_t e = b0; e < b1; e++) amax[e] = m;
            }
            double ymax = 0;
            for (int64_t r = 0; r < rows; r++) ymax = fmax(ymax, fabs(yc[(size_t)i * rows + r]));
            for (int64_t r = 0; r < rows; r++) {
                const float *wr = wf + (size_t)r * cols;
                double mag = 0, qerr = 0;
                for (int64_t e = 0; e < cols; e++) {
                    mag += fabs((double)wr[e] * xi[e]);
                    qerr += fabs((double)wr[e]) * amax[e];
                }
                double bound;
                if (qt) bound = 1.5 * 2.0 * qerr / 254.0 + (n > 16 ? 1.5 * 2.0 * mag / 512.0 : 0.0);
                else if (t == ST_TYPE_F16) bound = 1.5 * mag / 2048.0 * (n > 16 ? 2 : 1);
                else if (t == ST_TYPE_BF16) bound = 1.5 * mag / 512.0 * (n > 16 ? 2 : 1);
                else bound = 0.0;
                bound += 1e-5 * mag + 1e-6;
                double c = yc[(size_t)i * rows + r], g = yg[(size_t)i * rows + r], e = fabs(c - g);
                if (!(e <= bound)) // NaN fails too
                    fail_msg("matmul %s %lld x %lld n=%d: row %d output %lld: cpu %.7g gpu %.7g (error %.3g > bound %.3g; "
                             "row max |y| %.4g)",
                             st_type_name(t), (long long)rows, (long long)cols, n, i, (long long)r, c, g, e, bound,
                             ymax);
                if (e > st->max_abs) st->max_abs = e;
                if (ymax > 0 && e / ymax > st->max_rel) st->max_rel = e / ymax;
                if (bound > 0 && e / bound > st->max_ratio) st->max_ratio = e / bound;
            }
        }
    }
    dev_free(wd), dev_free(xd), dev_free(yd);
    free(w), free(wf), free(x), free(yc), free(yg), free(amax);
}

// STRATA_TEST_QUICK=1 (the sanitizer runs): skip the A/B reruns of the previous kernels.
static bool quick(void) {
    const char *v = getenv("STRATA_TEST_QUICK");
    return v && v[0] == '1';
}

// Dense quantized prompt matmuls through the tensor-core tile GEMM (STRATA_CUQ_DENSE_MMA=1).
static void test_matmul_mma(void **state) {
    (void)state;
    setenv("STRATA_CUQ_DENSE_MMA", "1", 1);
    // The tile GEMM (STRATA_GMM_STAGED=0), then the staged one (the default: raw blocks in
    // shared memory a span ahead).
    for (int staged = 0; staged < 2; staged++) {
        if (staged) unsetenv("STRATA_GMM_STAGED");
        else setenv("STRATA_GMM_STAGED", "0", 1);
        for (int ti = 0; ti < N_TYPES; ti++) {
            st_type t = ALL_TYPES[ti];
            if (!st_type_get(t)->quantized) continue;
            err_stats st = {0, 0, 0};
            matmul_case(t, 129, 768, &st);
            if (st_type_get(t)->block <= 32) matmul_case(t, 33, 96, &st);
            printf("%s %-8s %12.3g %12.3g %12.3f\n", staged ? "staged" : "mma", st_type_name(t), st.max_abs, st.max_rel,
                   st.max_ratio);
        }
    }
    unsetenv("STRATA_GMM_STAGED");
    unsetenv("STRATA_CUQ_DENSE_MMA");
    if (quick()) return;
    // The previous kernels (STRATA_CUQ_OLD=1: separate quantize launch, staged matrix-vector
    // kernels; still the path for x not 16-byte aligned).
    setenv("STRATA_CUQ_OLD", "1", 1);
    static const st_type old_types[] = {ST_TYPE_Q8_0, ST_TYPE_Q4_K, ST_TYPE_Q6_K, ST_TYPE_IQ4_XS, ST_TYPE_Q4_1};
    for (int ti = 0; ti < 5; ti++) {
        err_stats st = {0, 0, 0};
        matmul_case(old_types[ti], 129, 768, &st);
        printf("old %-8s %12.3g %12.3g %12.3f\n", st_type_name(old_types[ti]), st.max_abs, st.max_rel, st.max_ratio);
    }
    unsetenv("STRATA_CUQ_OLD");
}

static void test_matmul(void **state) {
    (void)state;
    printf("%-8s %12s %12s %12s\n", "type", "max abs", "max rel", "err/bound");
    for (int ti = 0; ti < N_TYPES; ti++) {
        st_type t = ALL_TYPES[ti];
        int blk = st_type_get(t)->block;
        err_stats st = {0, 0, 0};
        // Odd row counts (not multiples of the 4 rows a block computes); widths of 1-3 blocks
        // of 256, and for 32-blocks widths that are not multiples of 256.
        static const int64_t shapes[][2] = {{1, 256}, {7, 512}, {129, 768}, {1000, 256}};
        for (int s = 0; s < 4; s++) matmul_case(t, shapes[s][0], shapes[s][1], &st);
        if (blk <= 32) {
            matmul_case(t, 33, 96, &st);
            matmul_case(t, 129, 288, &st);
        }
        if (blk == 1) matmul_case(t, 5, 77, &st); // float types: a width with no vector loads
        if (t == ST_TYPE_F32) matmul_case(t, 100, 300, &st); // the router-sized own GEMM (64-128 rows)
        printf("%-8s %12.3g %12.3g %12.3f\n", st_type_name(t), st.max_abs, st.max_rel, st.max_ratio);
    }
}

// matmul_many: each product exactly as matmul computes it alone (one launch for the matrices of
// one type and width, one product after another for the others).
static void test_matmul_many(void **state) {
    (void)state;
    static const struct { st_type t[3]; int64_t rows[3], cols; } sets[] = {
        {{ST_TYPE_Q8_0, ST_TYPE_Q8_0, ST_TYPE_Q8_0}, {4096, 512, 512}, 2048}, // q, k, v of the 30B shape
        {{ST_TYPE_Q4_K, ST_TYPE_Q4_K, ST_TYPE_Q4_K}, {37, 8, 129}, 512},      // odd row counts
        {{ST_TYPE_Q8_0, ST_TYPE_Q6_K, ST_TYPE_F32}, {64, 33, 16}, 256},       // mixed: one after another
        {{ST_TYPE_Q8_0, ST_TYPE_F32, ST_TYPE_Q8_0}, {40, 16, 96}, 2048},      // two of a type (the Next's ba)
    };
    static const int ns[] = {1, 2, 3, 8, 16, 17};
    for (size_t si = 0; si < sizeof sets / sizeof sets[0]; si++) {
        int64_t cols = sets[si].cols;
        st_mat m[3];
        const st_mat *mp[3];
        float *y1[3], *y2[3];
        int nmax = ns[sizeof ns / sizeof ns[0] - 1];
        for (int i = 0; i < 3; i++) {
            m[i] = device_weights(sets[si].t[i], sets[si].rows[i], cols);
            mp[i] = &m[i];
            y1[i] = dev_put(NULL, sizeof(float) * (size_t)nmax * m[i].rows);
            y2[i] = dev_put(NULL, sizeof(float) * (size_t)nmax * m[i].rows);
        }
        float *x = rand_normal((size_t)nmax * cols, 1.0f), *xd = dev_put(x, sizeof(float) * (size_t)nmax * cols);
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
            int n = ns[ni];
            for (int i = 0; i < 3; i++) gpu->ops->matmul(gpu, &m[i], xd, n, y1[i]);
            gpu->ops->matmul_many(gpu, 3, mp, xd, n, y2);
            for (int i = 0; i < 3; i++) {
                size_t cnt = (size_t)n * m[i].rows;
                float *a = xmalloc(sizeof(float) * cnt), *b = xmalloc(sizeof(float) * cnt);
                dev_get(a, y1[i], sizeof(float) * cnt);
                dev_get(b, y2[i], sizeof(float) * cnt);
                if (memcmp(a, b, sizeof(float) * cnt))
                    fail_msg("matmul_many set %zu matrix %d (%s %lld x %lld) n=%d: differs from matmul", si, i,
                             st_type_name(m[i].type), (long long)m[i].rows, (long long)cols, n);
                free(a), free(b);
            }
        }
        for (int i = 0; i < 3; i++) dev_free((void *)m[i].data), dev_free(y1[i]), dev_free(y2[i]);
        dev_free(xd), free(x);
    }
}

// shared_ffn: the Qwen3-Next shared expert, which a decode window runs on the side stream
// (STRATA_SHARED_SIDE=0: in line), against its ops one after another on the main stream, bit for
// bit: the output and gate logit, and y after add_gated_rows reads them (which must join the
// side stream first), run as it comes and recorded into a graph and replayed (a recording ends
// with the fork joined). Windows of 1, 2 and 4 rows fork; 5 runs in line.
typedef struct sh_work {
    st_shared_ffn_args a;
    float *y;
    int d;
} sh_work;

static st_status sh_body(void *ctx) {
    sh_work *w = ctx;
    gpu->ops->shared_ffn(gpu, &w->a);
    gpu->ops->add_gated_rows(gpu, w->y, w->a.o, w->a.s, w->a.n, w->d);
    return ST_OK;
}

static void sh_same(const char *what, int n, const float *a_dev, const float *b_dev, size_t cnt) {
    float *a = xmalloc(sizeof(float) * cnt), *b = xmalloc(sizeof(float) * cnt);
    dev_get(a, a_dev, sizeof(float) * cnt);
    dev_get(b, b_dev, sizeof(float) * cnt);
    if (memcmp(a, b, sizeof(float) * cnt)) fail_msg("shared_ffn n=%d: %s differs from the ops in turn", n, what);
    free(a), free(b);
}

static void test_shared_ffn(void **state) {
    (void)state;
    const int d = 512, F = 512, nmax = 5;
    st_mat gate = device_weights(ST_TYPE_Q8_0, F, d), up = device_weights(ST_TYPE_Q8_0, F, d);
    st_mat down = device_weights(ST_TYPE_Q8_0, d, F);
    float *gi = rand_normal((size_t)d, 0.05f), *x = rand_normal((size_t)nmax * d, 1.0f);
    float *y0 = rand_normal((size_t)nmax * d, 1.0f);
    float *gid = dev_put(gi, sizeof(float) * d), *xd = dev_put(x, sizeof(float) * (size_t)nmax * d);
    sh_work w[2]; // [0] the op, [1] its ops in turn
    for (int i = 0; i < 2; i++) {
        w[i].a = (st_shared_ffn_args){.gate = &gate, .up = &up, .down = &down, .gate_inp = gid, .x = xd,
                                      .g = dev_put(NULL, sizeof(float) * (size_t)nmax * F),
                                      .u = dev_put(NULL, sizeof(float) * (size_t)nmax * F),
                                      .s = dev_put(NULL, sizeof(float) * nmax),
                                      .o = dev_put(NULL, sizeof(float) * (size_t)nmax * d)};
        w[i].y = dev_put(NULL, sizeof(float) * (size_t)nmax * d);
        w[i].d = d;
    }
    static const int ns[] = {1, 2, 4, 5};
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
        int n = ns[ni];
        w[0].a.n = w[1].a.n = n;
        gpu->ops->from_host(gpu, w[1].y, y0, sizeof(float) * (size_t)n * d);
        st_shared_ffn_ops(gpu, &w[1].a);
        gpu->ops->add_gated_rows(gpu, w[1].y, w[1].a.o, w[1].a.s, n, d);
        void *slot = NULL;
        for (int run = 0; run < 3; run++) { // as it comes, recorded, replayed
            gpu->ops->from_host(gpu, w[0].y, y0, sizeof(float) * (size_t)n * d);
            if (gpu->ops->run(gpu, &slot, sh_body, &w[0]) != ST_OK) fail_msg("shared_ffn n=%d: %s", n, st_error());
            gpu_sync("shared_ffn");
            sh_same("y after add_gated_rows", n, w[0].y, w[1].y, (size_t)n * d);
            sh_same("the output", n, w[0].a.o, w[1].a.o, (size_t)n * d);
            sh_same("the gate logit", n, w[0].a.s, w[1].a.s, (size_t)n);
        }
        gpu->ops->graph_free(gpu, slot);
        // The output read straight after the op (the copy to the host joins the side stream).
        gpu->ops->shared_ffn(gpu, &w[0].a);
        sh_same("the output read at once", n, w[0].a.o, w[1].a.o, (size_t)n * d);
    }
    for (int i = 0; i < 2; i++)
        dev_free(w[i].a.g), dev_free(w[i].a.u), dev_free(w[i].a.s), dev_free(w[i].a.o), dev_free(w[i].y);
    dev_free((void *)gate.data), dev_free((void *)up.data), dev_free((void *)down.data);
    dev_free(gid), dev_free(xd), free(gi), free(x), free(y0);
}

// norm_matmul: the products whose blocks norm their input themselves (windows of up to 4 rows,
// rows up to 4095 wide) give the bits of the norm kernel followed by matmul_many
// (STRATA_NORM_UNFUSED=1): the sum, the normed rows and every product, with and without the
// residual add; wider rows, longer windows and other first matrices take the unfused path.
typedef struct nm_out {
    const char *what;
    float *a, *b;
    size_t cnt;
} nm_out;

static void test_norm_matmul(void **state) {
    (void)state;
    static const struct { int nw; st_type t[3]; int64_t rows[3], cols; } sets[] = {
        {3, {ST_TYPE_Q8_0, ST_TYPE_Q8_0, ST_TYPE_Q8_0}, {4096, 512, 512}, 2048}, // q, k, v of the 30B shape
        {1, {ST_TYPE_F32}, {128}, 2048},                                        // the 30B's router
        {3, {ST_TYPE_Q8_0, ST_TYPE_F32, ST_TYPE_Q8_0}, {40, 16, 96}, 2048},     // the Next's qkv, ba, z
        {2, {ST_TYPE_Q4_K, ST_TYPE_Q6_K}, {37, 129}, 512},                      // odd rows, a second type
        {1, {ST_TYPE_Q8_0}, {64}, 4096},                                        // wider: the norm kernel
        {0, {ST_TYPE_F32}, {0}, 2048},                                          // the final norm alone
    };
    static const int ns[] = {1, 2, 3, 4, 5, 16, 17};
    int nmax = 17;
    for (size_t si = 0; si < sizeof sets / sizeof sets[0]; si++) {
        int64_t d = sets[si].cols;
        int nw = sets[si].nw;
        st_mat m[3];
        const st_mat *mp[3];
        float *ya[3], *yb[3];
        for (int i = 0; i < nw; i++) {
            m[i] = device_weights(sets[si].t[i], sets[si].rows[i], d);
            mp[i] = &m[i];
            ya[i] = dev_put(NULL, sizeof(float) * (size_t)nmax * m[i].rows);
            yb[i] = dev_put(NULL, sizeof(float) * (size_t)nmax * m[i].rows);
        }
        size_t sz = (size_t)nmax * d;
        float *x = rand_normal(sz, 1.0f), *y = rand_normal(sz, 1.0f), *g = rand_normal((size_t)d, 0.3f);
        for (int64_t j = 0; j < d; j++) g[j] += 1.0f;
        float *xd = dev_put(x, sizeof(float) * sz), *yd = dev_put(y, sizeof(float) * sz);
        float *gd = dev_put(g, sizeof(float) * (size_t)d);
        float *xoa = dev_put(NULL, sizeof(float) * sz), *xob = dev_put(NULL, sizeof(float) * sz);
        float *xna = dev_put(NULL, sizeof(float) * sz), *xnb = dev_put(NULL, sizeof(float) * sz);
        float *ha = xmalloc(sizeof(float) * sz * 4), *hb = xmalloc(sizeof(float) * sz * 4);
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
            for (int add = 0; add < 2; add++) {
                int n = ns[ni];
                unsetenv("STRATA_NORM_UNFUSED");
                gpu->ops->norm_matmul(gpu, xd, add ? yd : NULL, xoa, gd, 1e-6f, xna, n, (int)d, nw, mp, ya);
                setenv("STRATA_NORM_UNFUSED", "1", 1);
                gpu->ops->norm_matmul(gpu, xd, add ? yd : NULL, xob, gd, 1e-6f, xnb, n, (int)d, nw, mp, yb);
                unsetenv("STRATA_NORM_UNFUSED");
                gpu_sync("norm_matmul");
                nm_out outs[5];
                int no = 0;
                outs[no++] = (nm_out){"normed rows", xna, xnb, (size_t)n * d};
                if (add) outs[no++] = (nm_out){"sum", xoa, xob, (size_t)n * d};
                for (int i = 0; i < nw; i++) outs[no++] = (nm_out){"product", ya[i], yb[i], (size_t)n * m[i].rows};
                for (int o = 0; o < no; o++) {
                    dev_get(ha, outs[o].a, sizeof(float) * outs[o].cnt);
                    dev_get(hb, outs[o].b, sizeof(float) * outs[o].cnt);
                    if (memcmp(ha, hb, sizeof(float) * outs[o].cnt))
                        fail_msg("norm_matmul set %zu n=%d add=%d: the %s (output %d) differs from the unfused path",
                                 si, n, add, outs[o].what, o);
                }
            }
        for (int i = 0; i < nw; i++) dev_free((void *)m[i].data), dev_free(ya[i]), dev_free(yb[i]);
        dev_free(xd), dev_free(yd), dev_free(gd), dev_free(xoa), dev_free(xob), dev_free(xna), dev_free(xnb);
        free(x), free(y), free(g), free(ha), free(hb);
    }
}

// ---------------------------------------------------------------------------------------------
// get_rows: exact.

static void test_get_rows(void **state) {
    (void)state;
    for (int ti = 0; ti < N_TYPES; ti++) {
        st_type t = ALL_TYPES[ti];
        int64_t rows = 129, cols = st_type_get(t)->block == 32 ? 288 : 768;
        uint8_t *w = make_weights(t, rows, cols, false);
        size_t rb = st_row_bytes(t, cols);
        void *wd = gpu->ops->upload(gpu, w, rb * rows);
        if (!wd) fail_msg("upload failed: %s", st_error());
        int n = 37;
        int32_t ids[37];
        for (int i = 0; i < n; i++) ids[i] = i < 3 ? (int32_t)(rows - 1 - i) : (int32_t)(rng_u64() % rows);
        int32_t *idd = dev_put(ids, sizeof ids);
        float *yd = dev_put(NULL, sizeof(float) * n * cols);
        float *yg = xmalloc(sizeof(float) * n * cols), *yc = xmalloc(sizeof(float) * cols);
        st_mat mg = {t, cols, rows, rb, wd};
        gpu->ops->get_rows(gpu, &mg, idd, n, yd);
        dev_get(yg, yd, sizeof(float) * n * cols);
        for (int i = 0; i < n; i++) {
            st_dequantize(t, w + (size_t)ids[i] * rb, yc, cols);
            for (int64_t e = 0; e < cols; e++)
                if (yc[e] != yg[(size_t)i * cols + e] && !(isnan(yc[e]) && isnan(yg[(size_t)i * cols + e])))
                    fail_msg("get_rows %s: id %d (entry %d) element %lld: cpu %.9g gpu %.9g", st_type_name(t), ids[i],
                             i, (long long)e, yc[e], yg[(size_t)i * cols + e]);
        }
        dev_free(wd), dev_free(idd), dev_free(yd);
        free(w), free(yg), free(yc);
    }
}

// ---------------------------------------------------------------------------------------------
// moe vs st_experts_compute. Both sides quantize x for gate/up and the activations for down
// (CPU: q8_K / q8_0; GPU: int8 blocks of 32 or bf16 for n > 16), so errors compound over two
// layers; the bound is relative to the row's largest output.

typedef struct moe_case {
    int E, k, n, d, F;
    st_type tg, tu, td;
    double tol; // of the row's max |y|
} moe_case;

static void routing(int n, int k, int E, int32_t *ids, float *wts) {
    for (int i = 0; i < n; i++) {
        float sum = 0;
        for (int j = 0; j < k; j++) {
            int32_t e;
            bool dup;
            do { // distinct within a row, as the router's top-k
                e = (int32_t)(rng_u64() % (uint64_t)E);
                dup = false;
                for (int q = 0; q < j; q++) dup |= ids[i * k + q] == e;
            } while (dup);
            ids[i * k + j] = e;
            wts[i * k + j] = (float)(0.1 + rnd());
            sum += wts[i * k + j];
        }
        for (int j = 0; j < k; j++) wts[i * k + j] /= sum;
    }
}

static st_mat3 stack(st_type t, int64_t rows, int64_t cols, int E, const void *data) {
    size_t rb = st_row_bytes(t, cols);
    st_mat3 m = {t, cols, rows, E, rb, rb * (size_t)rows, data};
    return m;
}

static void moe_run(const moe_case *mc) {
    int E = mc->E, k = mc->k, n = mc->n, d = mc->d, F = mc->F;
    uint8_t *g = make_weights(mc->tg, (int64_t)E * F, d, false), *u = make_weights(mc->tu, (int64_t)E * F, d, false),
            *dn = make_weights(mc->td, (int64_t)E * d, F, false);
    st_mat3 gc = stack(mc->tg, F, d, E, g), uc = stack(mc->tu, F, d, E, u), dc = stack(mc->td, d, F, E, dn);
    st_mat3 gg = gc, ug = uc, dg = dc;
    gg.data = gpu->ops->upload(gpu, g, gc.mat_bytes * E);
    ug.data = gpu->ops->upload(gpu, u, uc.mat_bytes * E);
    dg.data = gpu->ops->upload(gpu, dn, dc.mat_bytes * E);
    if (!gg.data || !ug.data || !dg.data) fail_msg("upload failed: %s", st_error());
    float *x = rand_normal((size_t)n * d, 1.0f), *wts = xmalloc(sizeof(float) * n * k);
    int32_t *ids = xmalloc(sizeof(int32_t) * n * k);
    routing(n, k, E, ids, wts);
    float *yc = xmalloc(sizeof(float) * n * d), *yg = xmalloc(sizeof(float) * n * d);

    st_placement *pl;
    st_experts *ex;
    assert_int_equal(st_placement_create_host(1, E, &pl), ST_OK);
    st_experts_params ep = {.placement = pl};
    assert_int_equal(st_experts_create(&ep, &ex), ST_OK);
    st_moe_args ac = {.layer = 0, .gate = &gc, .up = &uc, .down = &dc, .x = x, .ids = ids, .weights = wts,
                      .n = n, .k = k, .y = yc};
    assert_int_equal(st_experts_compute(ex, cpu, &ac, NULL), ST_OK);

    float *xd = dev_put(x, sizeof(float) * n * d), *wd = dev_put(wts, sizeof(float) * n * k);
    int32_t *idd = dev_put(ids, sizeof(int32_t) * n * k);
    float *yd = dev_put(NULL, sizeof(float) * n * d);
    st_moe_args ag = {.layer = 0, .gate = &gg, .up = &ug, .down = &dg, .x = xd, .ids = idd, .weights = wd,
                      .n = n, .k = k, .y = yd};
    gpu->ops->moe(gpu, &ag);
    dev_get(yg, yd, sizeof(float) * n * d);

    double worst = 0;
    for (int i = 0; i < n; i++) {
        double ymax = 0;
        for (int c = 0; c < d; c++) ymax = fmax(ymax, fabs(yc[(size_t)i * d + c]));
        for (int c = 0; c < d; c++) {
            double e = fabs((double)yc[(size_t)i * d + c] - yg[(size_t)i * d + c]);
            if (!(e <= mc->tol * ymax + 1e-6))
                fail_msg("moe E=%d k=%d n=%d d=%d F=%d %s/%s/%s: row %d col %d: cpu %.7g gpu %.7g (row max %.4g, tol %g)",
                         E, k, n, d, F, st_type_name(mc->tg), st_type_name(mc->tu), st_type_name(mc->td), i, c,
                         yc[(size_t)i * d + c], yg[(size_t)i * d + c], ymax, mc->tol);
            if (ymax > 0 && e / ymax > worst) worst = e / ymax;
        }
    }
    printf("moe E=%3d k=%d n=%3d d=%d F=%d %-7s/%-7s/%-7s max err / row max %.3g\n", E, k, n, d, F,
           st_type_name(mc->tg), st_type_name(mc->tu), st_type_name(mc->td), worst);

    // The same experts split over two slot stacks as the hybrid cache uses them: even ids in one
    // (through a slot map), odd ids in the other, added (accumulate); the sum must equal the
    // single-stack result above up to float rounding of the order of the two halves.
    int half[2] = {(E + 1) / 2, E / 2};
    for (int part = 0; part < 2 && half[1] > 0; part++) {
        int32_t *map = xmalloc(sizeof(int32_t) * E);
        st_mat3 sg = gc, su = uc, sd = dc;
        sg.n = su.n = sd.n = half[part];
        uint8_t *hg = xmalloc(gc.mat_bytes * half[part]), *hu = xmalloc(uc.mat_bytes * half[part]),
                *hd = xmalloc(dc.mat_bytes * half[part]);
        for (int e = 0, slot = 0; e < E; e++) {
            map[e] = e % 2 == part ? slot : -1;
            if (e % 2 != part) continue;
            memcpy(hg + gc.mat_bytes * slot, g + gc.mat_bytes * e, gc.mat_bytes);
            memcpy(hu + uc.mat_bytes * slot, u + uc.mat_bytes * e, uc.mat_bytes);
            memcpy(hd + dc.mat_bytes * slot, dn + dc.mat_bytes * e, dc.mat_bytes);
            slot++;
        }
        sg.data = dev_put(hg, gc.mat_bytes * half[part]);
        su.data = dev_put(hu, uc.mat_bytes * half[part]);
        sd.data = dev_put(hd, dc.mat_bytes * half[part]);
        int32_t *mapd = dev_put(map, sizeof(int32_t) * E);
        uint32_t *cnt = dev_put(NULL, sizeof(uint32_t) * E);
        gpu->ops->zero(gpu, cnt, sizeof(uint32_t) * E);
        st_moe_args as = ag;
        as.gate = &sg, as.up = &su, as.down = &sd;
        as.slot_map = mapd, as.n_expert = E, as.accumulate = part == 1, as.counts = cnt;
        gpu->ops->moe(gpu, &as);
        uint32_t *cnt_h = xmalloc(sizeof(uint32_t) * E);
        dev_get(cnt_h, cnt, sizeof(uint32_t) * E);
        for (int e = 0; e < E; e++) {
            uint32_t want = 0;
            for (int i = 0; i < n * k; i++) want += ids[i] == e;
            if (cnt_h[e] != want) fail_msg("moe counts: expert %d counted %u, routed %u", e, cnt_h[e], want);
        }
        dev_free((void *)sg.data), dev_free((void *)su.data), dev_free((void *)sd.data), dev_free(mapd), dev_free(cnt);
        free(map), free(hg), free(hu), free(hd), free(cnt_h);
    }
    if (half[1] > 0) {
        float *ys = xmalloc(sizeof(float) * n * d);
        dev_get(ys, yd, sizeof(float) * n * d);
        for (int i = 0; i < n; i++) {
            double ymax = 0;
            for (int c = 0; c < d; c++) ymax = fmax(ymax, fabs(yg[(size_t)i * d + c]));
            for (int c = 0; c < d; c++) {
                double a = yg[(size_t)i * d + c], b2 = ys[(size_t)i * d + c];
                if (!(fabs(a - b2) <= 1e-4 * ymax + 1e-6))
                    fail_msg("moe split in two slot stacks: row %d col %d: one stack %.7g, two %.7g", i, c, a, b2);
            }
        }
        free(ys);
    }
    st_experts_free(ex);
    st_placement_free(pl);
    dev_free((void *)gg.data), dev_free((void *)ug.data), dev_free((void *)dg.data);
    dev_free(xd), dev_free(wd), dev_free(idd), dev_free(yd);
    free(g), free(u), free(dn), free(x), free(wts), free(ids), free(yc), free(yg);
}

static void test_moe(void **state) {
    (void)state;
    static const moe_case cases[] = {
        {8, 2, 1, 256, 256, ST_TYPE_Q4_K, ST_TYPE_Q4_K, ST_TYPE_Q6_K, 0.05},
        {16, 4, 5, 512, 256, ST_TYPE_Q8_0, ST_TYPE_Q8_0, ST_TYPE_Q8_0, 0.05},
        {128, 8, 16, 256, 512, ST_TYPE_Q4_K, ST_TYPE_Q4_K, ST_TYPE_Q4_K, 0.05},
        {8, 8, 16, 256, 256, ST_TYPE_IQ4_XS, ST_TYPE_IQ4_XS, ST_TYPE_Q5_K, 0.05}, // every expert in every row
        {8, 1, 3, 256, 256, ST_TYPE_IQ3_XXS, ST_TYPE_Q4_K, ST_TYPE_Q8_0, 0.05},  // gate and up differ
        {16, 3, 7, 128, 96, ST_TYPE_F16, ST_TYPE_F16, ST_TYPE_F16, 0.01},
        {64, 8, 40, 256, 256, ST_TYPE_IQ4_XS, ST_TYPE_IQ4_XS, ST_TYPE_Q5_K, 0.05},
        {32, 6, 300, 256, 256, ST_TYPE_Q4_K, ST_TYPE_Q4_K, ST_TYPE_Q6_K, 0.05},
        {128, 8, 17, 512, 256, ST_TYPE_Q4_K, ST_TYPE_Q4_K, ST_TYPE_Q6_K, 0.05},
        {8, 2, 20, 64, 64, ST_TYPE_F32, ST_TYPE_F32, ST_TYPE_BF16, 0.02},
        {16, 4, 9, 256, 256, ST_TYPE_IQ2_XS, ST_TYPE_IQ2_XS, ST_TYPE_IQ3_S, 0.05},
        // Row counts that leave the last block of 4 row pairs a warp (n = 1) partial.
        {16, 4, 1, 288, 96, ST_TYPE_Q8_0, ST_TYPE_Q8_0, ST_TYPE_Q8_0, 0.05},
        {16, 4, 3, 288, 96, ST_TYPE_Q8_0, ST_TYPE_Q8_0, ST_TYPE_Q4_0, 0.05},
        // Prompt chunks: exact fp32 for F32 experts; f16 in place; widths that end in half a
        // 64-column step and row counts that are not multiples of the 128-row tile.
        // Every row picks every expert and d is wide: members are quantized in several groups.
        {4, 4, 16, 4096, 64, ST_TYPE_Q8_0, ST_TYPE_Q8_0, ST_TYPE_Q8_0, 0.05},
        {16, 4, 40, 256, 128, ST_TYPE_F32, ST_TYPE_F32, ST_TYPE_F32, 1e-4},
        {16, 3, 40, 128, 96, ST_TYPE_F16, ST_TYPE_F16, ST_TYPE_F16, 0.01},
        {16, 4, 33, 288, 96, ST_TYPE_Q8_0, ST_TYPE_Q8_0, ST_TYPE_Q8_0, 0.05},
        {8, 2, 200, 288, 160, ST_TYPE_Q4_0, ST_TYPE_Q5_0, ST_TYPE_IQ4_NL, 0.05}, // gate and up differ (one activation type on the CPU)
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) moe_run(&cases[i]);
    // One row at the widths of the real shapes (the 30B-A3B's, the Next-80B-A3B's with a Q8_0
    // down, a Q5_K gate/up with a Q4_0 down).
    static const moe_case one[] = {
        {8, 2, 1, 2048, 768, ST_TYPE_Q4_K, ST_TYPE_Q4_K, ST_TYPE_Q4_K, 0.05},
        {12, 10, 1, 2048, 512, ST_TYPE_Q4_K, ST_TYPE_Q4_K, ST_TYPE_Q8_0, 0.05},
        {8, 3, 1, 512, 288, ST_TYPE_Q5_K, ST_TYPE_Q5_K, ST_TYPE_Q4_0, 0.05},
    };
    for (size_t i = 0; i < sizeof one / sizeof one[0]; i++) moe_run(&one[i]);
    // Prompt chunks through the unstaged tile GEMM (STRATA_GMM_STAGED=0; above: the staged one).
    setenv("STRATA_GMM_STAGED", "0", 1);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (cases[i].n > 16) moe_run(&cases[i]); // (prompt chunks: more rows than a window)
    unsetenv("STRATA_GMM_STAGED");
    // The previous paths (windows: plan, quantize, staged kernels; prompts: dequantize, one
    // cuBLAS GEMM per expert), kept for A/B runs.
    if (quick()) return; // under the sanitizers: the current paths only
    setenv("STRATA_CUQ_OLD", "1", 1);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) moe_run(&cases[i]);
    unsetenv("STRATA_CUQ_OLD");
}

// The moe op given the router's logits (it routes itself; one row folds the routing into the
// gate/up kernel) against the router op then the moe op given the ids: the same ids, weights
// and outputs bit for bit, with a slot map and counts as the whole-card layers use them, on
// logits with ties (the lower id first) and expert counts that leave a group of 32 partial.
// With holes, every third expert is not in the stack (a hybrid layer's cache: those slots idle).
// Every variant adds a shared expert's gated output: the reference with add_gated_rows after
// the op on its old path (STRATA_MOE_LATE: the down blocks learn their expert after their wait),
// the others (one row: the down blocks take their expert before their wait, from the ids or by
// ranking up to 128 logits) with add_gated_rows or through gated_o / gated_s. Where the gate/up
// kernel ranks more than 128 logits, the down blocks ask for the expert of the id they read
// before their wait (the hint; the reference runs without it, STRATA_MOE_HINT=0): the last two
// variants start from ids that are wrong, as an earlier layer's are, or from the right ones.
// The one-row down kernel's combine three ways (sm_90: in a cluster by stores counted on an
// mbarrier, the default; by stores the cluster's barrier publishes, STRATA_MOE_COUNTED=0; by
// counting in through L2, STRATA_MOE_CLUSTER=0, as before sm_90), and the gate/up kernel's
// rows staged in shared memory (the default), read through L2 (STRATA_MOE_STAGE=0), or asked for
// after x is quantized (STRATA_MOE_RANK_FIRST=0): the same bits.
enum {
    FOLD_REF, FOLD_LOGITS, FOLD_GATED, FOLD_IDS, FOLD_HINT_STALE, FOLD_HINT_RIGHT, FOLD_BARRIER, FOLD_PLAIN,
    FOLD_UNSTAGED, FOLD_X_FIRST, FOLD_NV
};
static const char *const fold_names[FOLD_NV] = {
    "reference", "logits", "logits + gated", "ids + gated", "logits + gated, stale hints",
    "logits + gated, right hints", "logits + gated, stores and a barrier", "logits + gated, no cluster",
    "logits + gated, rows through L2", "logits + gated, x quantized first"};

static void moe_fold_run(int E, int k, int n, st_type t, bool holes, int d, int F) {
    // (random blocks: the paths are compared with each other, and the Next-80B-A3B shape's
    // 1.6 billion weights would take minutes to quantize)
    uint8_t *g = make_weights(t, (int64_t)E * F, d, true), *u = make_weights(t, (int64_t)E * F, d, true),
            *dn = make_weights(t, (int64_t)E * d, F, true);
    st_mat3 gg = stack(t, F, d, E, NULL), ug = stack(t, F, d, E, NULL), dg = stack(t, d, F, E, NULL);
    gg.data = dev_put(g, gg.mat_bytes * E);
    ug.data = dev_put(u, ug.mat_bytes * E);
    dg.data = dev_put(dn, dg.mat_bytes * E);
    float *x = rand_normal((size_t)n * d, 1.0f), *lg = rand_normal((size_t)n * E, 2.0f);
    float *so = rand_normal((size_t)n * d, 1.0f), *ss = rand_normal((size_t)n, 2.0f);
    for (int i = 0; i < n * E; i++) lg[i] = roundf(lg[i] * 4.0f) / 4.0f; // ties
    int32_t *map = xmalloc(sizeof(int32_t) * E);
    for (int e = 0; e < E; e++) map[e] = holes && e % 3 == 0 ? -1 : E - 1 - e;
    float *xd = dev_put(x, sizeof(float) * n * d), *ld = dev_put(lg, sizeof(float) * n * E);
    float *sod = dev_put(so, sizeof(float) * n * d), *ssd = dev_put(ss, sizeof(float) * n);
    int32_t *mapd = dev_put(map, sizeof(int32_t) * E);
    int32_t *ids[FOLD_NV];
    float *w[FOLD_NV], *y[FOLD_NV];
    uint32_t *cnt[FOLD_NV];
    int32_t *hint = xmalloc(sizeof(int32_t) * n * k);
    for (int i = 0; i < n * k; i++) hint[i] = (i * 7 + 3) % E; // (distinct from the ranked ones mostly)
    for (int v = 0; v < FOLD_NV; v++) {
        if (v == FOLD_HINT_RIGHT) dev_get(hint, ids[FOLD_REF], sizeof(int32_t) * n * k);
        ids[v] = dev_put(v == FOLD_HINT_STALE || v == FOLD_HINT_RIGHT ? hint : NULL, sizeof(int32_t) * n * k);
        w[v] = dev_put(NULL, sizeof(float) * n * k);
        y[v] = dev_put(NULL, sizeof(float) * n * d);
        cnt[v] = dev_put(NULL, sizeof(uint32_t) * E);
        gpu->ops->zero(gpu, cnt[v], sizeof(uint32_t) * E);
        st_moe_args a = {.layer = 0, .gate = &gg, .up = &ug, .down = &dg, .x = xd, .ids = ids[v], .weights = w[v],
                         .n = n, .k = k, .y = y[v], .slot_map = mapd, .n_expert = E, .counts = cnt[v]};
        if (v == FOLD_REF || v == FOLD_IDS) gpu->ops->moe_route(gpu, ld, n, E, k, ids[v], w[v]);
        else a.logits = ld;
        if (v != FOLD_REF && v != FOLD_LOGITS) a.gated_o = sod, a.gated_s = ssd;
        if (v == FOLD_REF) setenv("STRATA_MOE_LATE", "1", 1), setenv("STRATA_MOE_HINT", "0", 1);
        if (v == FOLD_BARRIER) setenv("STRATA_MOE_COUNTED", "0", 1);
        if (v == FOLD_PLAIN) setenv("STRATA_MOE_CLUSTER", "0", 1);
        if (v == FOLD_UNSTAGED) setenv("STRATA_MOE_STAGE", "0", 1);
        if (v == FOLD_X_FIRST) setenv("STRATA_MOE_RANK_FIRST", "0", 1);
        gpu->ops->moe(gpu, &a);
        unsetenv("STRATA_MOE_LATE");
        unsetenv("STRATA_MOE_HINT");
        unsetenv("STRATA_MOE_COUNTED");
        unsetenv("STRATA_MOE_CLUSTER");
        unsetenv("STRATA_MOE_STAGE");
        unsetenv("STRATA_MOE_RANK_FIRST");
        if (!a.gated_o) gpu->ops->add_gated_rows(gpu, y[v], sod, ssd, n, d);
    }
    int32_t *hi[FOLD_NV];
    float *hw[FOLD_NV], *hy[FOLD_NV];
    uint32_t *hc[FOLD_NV];
    for (int v = 0; v < FOLD_NV; v++) {
        hi[v] = xmalloc(sizeof(int32_t) * n * k), hw[v] = xmalloc(sizeof(float) * n * k);
        hy[v] = xmalloc(sizeof(float) * n * d), hc[v] = xmalloc(sizeof(uint32_t) * E);
        dev_get(hi[v], ids[v], sizeof(int32_t) * n * k);
        dev_get(hw[v], w[v], sizeof(float) * n * k);
        dev_get(hy[v], y[v], sizeof(float) * n * d);
        dev_get(hc[v], cnt[v], sizeof(uint32_t) * E);
    }
    for (int v = 1; v < FOLD_NV; v++) {
        if (memcmp(hi[0], hi[v], sizeof(int32_t) * n * k) || memcmp(hw[0], hw[v], sizeof(float) * n * k))
            fail_msg("moe with logits E=%d k=%d n=%d, %s: ids/weights differ from moe_route's (first: id %d vs %d, w %.9g "
                     "vs %.9g)", E, k, n, fold_names[v], hi[0][0], hi[v][0], hw[0][0], hw[v][0]);
        if (memcmp(hy[0], hy[v], sizeof(float) * n * d))
            fail_msg("moe with logits E=%d k=%d n=%d, %s: outputs differ", E, k, n, fold_names[v]);
        if (memcmp(hc[0], hc[v], sizeof(uint32_t) * E))
            fail_msg("moe with logits E=%d k=%d n=%d, %s: counts differ", E, k, n, fold_names[v]);
    }
    printf("moe with logits E=%3d k=%2d n=%d d=%d F=%d %s%s: ids, weights, outputs (+ gated) and counts as moe_route + "
           "moe, each way\n", E, k, n, d, F, st_type_name(t), holes ? " (a third not cached)" : "");
    for (int v = 0; v < FOLD_NV; v++) {
        dev_free(ids[v]), dev_free(w[v]), dev_free(y[v]), dev_free(cnt[v]);
        free(hi[v]), free(hw[v]), free(hy[v]), free(hc[v]);
    }
    dev_free((void *)gg.data), dev_free((void *)ug.data), dev_free((void *)dg.data);
    dev_free(xd), dev_free(ld), dev_free(mapd), dev_free(sod), dev_free(ssd);
    free(g), free(u), free(dn), free(x), free(lg), free(map), free(so), free(ss), free(hint);
}

static void test_moe_fold(void **state) {
    (void)state;
    moe_fold_run(128, 8, 1, ST_TYPE_Q4_K, false, 256, 256);  // Qwen3-30B-A3B's router
    moe_fold_run(128, 8, 1, ST_TYPE_Q4_K, false, 2048, 768); // ... and its shape (448 blocks)
    moe_fold_run(128, 8, 1, ST_TYPE_Q4_K, true, 256, 256);   // ... a hybrid layer
    moe_fold_run(512, 10, 1, ST_TYPE_Q4_K, false, 256, 256); // Qwen3-Next-80B-A3B's
    moe_fold_run(512, 10, 1, ST_TYPE_Q4_K, false, 2048, 512); // ... and its shape
    moe_fold_run(512, 10, 1, ST_TYPE_Q6_K, true, 256, 256);
    moe_fold_run(100, 4, 1, ST_TYPE_Q8_0, false, 256, 256);  // a partial group
    moe_fold_run(300, 8, 1, ST_TYPE_Q4_K, false, 256, 256);  // more groups than warps: sorted in pairs, one partial
    moe_fold_run(480, 10, 1, ST_TYPE_Q4_K, true, 256, 256);  // ... an odd count of groups (the last sorted alone)
    moe_fold_run(16, 16, 1, ST_TYPE_Q8_0, false, 256, 256);  // every expert
    moe_fold_run(600, 8, 1, ST_TYPE_Q8_0, false, 256, 256);  // too many to fold: the router kernel first
    moe_fold_run(128, 8, 3, ST_TYPE_Q4_K, false, 256, 256);  // a window: the router kernel first
}

// A hybrid layer's hand-off with the routing folded in: publish and the moe op each given the
// logits (each routes; publish runs beside the moe op), then collect, against the router op,
// publish given the ids and the moe op, then the host's rows added here: the same ids, weights,
// published slot, and outputs bit for bit. The host has answered already (its done flag is
// set), so collect's wait returns at once.
static void hand_fold_run(int E, int k) {
    int n = 1, d = 256, F = 256;
    st_type t = ST_TYPE_Q4_K;
    int half = E / 2; // even experts cached, odd ones missing
    uint8_t *g = make_weights(t, (int64_t)half * F, d, false), *u = make_weights(t, (int64_t)half * F, d, false),
            *dn = make_weights(t, (int64_t)half * d, F, false);
    st_mat3 gg = stack(t, F, d, half, NULL), ug = stack(t, F, d, half, NULL), dg = stack(t, d, F, half, NULL);
    gg.data = dev_put(g, gg.mat_bytes * half);
    ug.data = dev_put(u, ug.mat_bytes * half);
    dg.data = dev_put(dn, dg.mat_bytes * half);
    float *x = rand_normal((size_t)n * d, 1.0f), *lg = rand_normal((size_t)n * E, 2.0f), *hy = rand_normal((size_t)n * d, 1.0f);
    for (int i = 0; i < n * E; i++) lg[i] = roundf(lg[i] * 4.0f) / 4.0f;
    lg[1] = 100.0f; // an odd (missing) expert is surely chosen
    int32_t *map = xmalloc(sizeof(int32_t) * E);
    for (int e = 0; e < E; e++) map[e] = e % 2 ? -1 : e / 2;
    uint32_t seq = 7;
    float *xd = dev_put(x, sizeof(float) * n * d), *ld = dev_put(lg, sizeof(float) * n * E);
    int32_t *mapd = dev_put(map, sizeof(int32_t) * E);
    uint32_t *seqd = dev_put(&seq, sizeof seq);
    float *yv[2];
    int32_t *idv[2], *needv[2];
    float *wv[2];
    uint8_t *slot[2];
    size_t o_ids = 64, o_w = 128, o_x = 256, o_y = 256 + sizeof(float) * d, slot_b = o_y + sizeof(float) * d;
    for (int v = 0; v < 2; v++) {
        idv[v] = dev_put(NULL, sizeof(int32_t) * n * k);
        wv[v] = dev_put(NULL, sizeof(float) * n * k);
        yv[v] = dev_put(NULL, sizeof(float) * n * d);
        needv[v] = dev_put(NULL, sizeof(int32_t));
        slot[v] = gpu->ops->host_alloc(gpu, slot_b);
        if (!slot[v]) fail_msg("host_alloc: %s", st_error());
        memset(slot[v], 0, slot_b);
        ((uint32_t *)slot[v])[4] = seq; // done: the host has answered
        memcpy(slot[v] + o_y, hy, sizeof(float) * d);
        st_hand_args ha = {.ids = idv[v], .weights = wv[v], .x = xd, .slot_map = mapd, .n = n, .k = k, .d = d,
                           .n_expert = E, .seq = seqd, .need = needv[v], .pub = (uint32_t *)slot[v],
                           .done = (uint32_t *)slot[v] + 4, .h_ids = (int32_t *)(slot[v] + o_ids),
                           .h_w = (float *)(slot[v] + o_w), .h_x = (float *)(slot[v] + o_x),
                           .h_y = (const float *)(slot[v] + o_y), .y = yv[v], .wait_ns = (uint64_t *)slot[v] + 1};
        st_moe_args a = {.layer = 0, .gate = &gg, .up = &ug, .down = &dg, .x = xd, .ids = idv[v], .weights = wv[v],
                         .n = n, .k = k, .y = yv[v], .slot_map = mapd, .n_expert = E};
        if (v == 0) {
            gpu->ops->moe_route(gpu, ld, n, E, k, idv[v], wv[v]);
            gpu->ops->hand_publish(gpu, &ha);
            gpu->ops->moe(gpu, &a);
        } else {
            ha.logits = ld; // publish (beside the moe op) and the moe op each route
            a.logits = ld;
            gpu->ops->hand_publish(gpu, &ha);
            gpu->ops->moe(gpu, &a);
            gpu->ops->hand_collect(gpu, &ha);
        }
    }
    gpu_sync("hand fold");
    float *hy0 = xmalloc(sizeof(float) * n * d), *hy1 = xmalloc(sizeof(float) * n * d);
    dev_get(hy0, yv[0], sizeof(float) * n * d);
    dev_get(hy1, yv[1], sizeof(float) * n * d);
    int32_t need[2];
    dev_get(&need[0], needv[0], sizeof(int32_t));
    dev_get(&need[1], needv[1], sizeof(int32_t));
    int32_t hid[2][16];
    float hwt[2][16];
    for (int v = 0; v < 2; v++) {
        dev_get(hid[v], idv[v], sizeof(int32_t) * k);
        dev_get(hwt[v], wv[v], sizeof(float) * k);
    }
    if (memcmp(hid[0], hid[1], sizeof(int32_t) * k) || memcmp(hwt[0], hwt[1], sizeof(float) * k))
        fail_msg("hand fold E=%d k=%d: the device's ids or weights differ", E, k);
    if (need[0] != 1 || need[1] != 1) fail_msg("hand fold: need %d / %d, want 1 (an odd expert is chosen)", need[0], need[1]);
    if (memcmp(slot[0], slot[1], 8) || memcmp(slot[0] + o_ids, slot[1] + o_ids, o_y - o_ids))
        fail_msg("hand fold E=%d k=%d: the published slots differ", E, k);
    if (((uint32_t *)slot[1])[0] != seq) fail_msg("hand fold: not published");
    for (int c = 0; c < d; c++) {
        float want = hy0[c] + hy[c];
        if (memcmp(&want, &hy1[c], sizeof want))
            fail_msg("hand fold E=%d k=%d: col %d: %.9g, want %.9g (gpu %.9g + host %.9g)", E, k, c, hy1[c], want, hy0[c], hy[c]);
    }
    printf("hand-off E=%3d k=%2d, routing folded into publish: as router + publish\n", E, k);
    for (int v = 0; v < 2; v++) {
        dev_free(idv[v]), dev_free(wv[v]), dev_free(yv[v]), dev_free(needv[v]);
        gpu->ops->host_free(gpu, slot[v]);
    }
    dev_free((void *)gg.data), dev_free((void *)ug.data), dev_free((void *)dg.data);
    dev_free(xd), dev_free(ld), dev_free(mapd), dev_free(seqd);
    free(g), free(u), free(dn), free(x), free(lg), free(hy), free(map), free(hy0), free(hy1);
}

static void test_hand_fold(void **state) {
    (void)state;
    hand_fold_run(128, 8);
    hand_fold_run(512, 10);
    hand_fold_run(600, 8); // the router's own kernel
}

// ---------------------------------------------------------------------------------------------
// --bench

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

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

typedef struct mm_ctx {
    st_mat w;
    float *x, *y;
    int n;
} mm_ctx;
static void mm_fn(void *ctx) {
    mm_ctx *m = ctx;
    gpu->ops->matmul(gpu, &m->w, m->x, m->n, m->y);
}
static void moe_fn(void *ctx) { gpu->ops->moe(gpu, ctx); }
// One row's experts with the expert sets taken in turn (set i: experts 8i .. 8i + 7 of 128), so
// that each call's weights are cold in L2 (the 16 sets' 340 MB are far more than it holds).
#define MOE_COLD_SETS 16
typedef struct moe_cold_ctx {
    st_moe_args a[MOE_COLD_SETS];
    int next;
} moe_cold_ctx;
static void moe_cold_fn(void *ctx) {
    moe_cold_ctx *m = ctx;
    gpu->ops->moe(gpu, &m->a[m->next]);
    m->next = (m->next + 1) % MOE_COLD_SETS;
}

typedef struct gr_ctx {
    st_mat w;
    int32_t *ids;
    float *y;
    int n;
} gr_ctx;
static void gr_fn(void *ctx) {
    gr_ctx *g = ctx;
    gpu->ops->get_rows(gpu, &g->w, g->ids, g->n, g->y);
}

// One call's wall time, synchronized: the first call of a kernel includes loading its module
// (CUDA loads lazily) and cuBLAS's first call its setup.
static double once_us(bench_fn fn, void *ctx) {
    double t0 = now_s();
    fn(ctx);
    gpu_sync("first call");
    return (now_s() - t0) * 1e6;
}

static st_mat bench_weights(st_type t, int64_t rows, int64_t cols) {
    size_t bytes = st_row_bytes(t, cols) * (size_t)rows;
    uint8_t *w = xmalloc(bytes);
    random_blocks(t, w, bytes);
    st_mat m = {t, cols, rows, st_row_bytes(t, cols), gpu->ops->upload(gpu, w, bytes)};
    free(w);
    if (!m.data) fail_msg("upload failed: %s", st_error());
    return m;
}

// The figures the model profile showed as slow: get_rows of the embedding, the router's f32
// matmul and the dense q8_0 prompt matmuls. First calls are timed apart from steady state.
static void bench_first_and_prompt(float *xd, float *yd) {
    int nmax = 2048;
    int32_t *ids = xmalloc(sizeof(int32_t) * nmax);
    for (int i = 0; i < nmax; i++) ids[i] = (int32_t)(rng_u64() % 151936);
    int32_t *idd = dev_put(ids, sizeof(int32_t) * nmax);
    free(ids);
    gr_ctx g = {bench_weights(ST_TYPE_Q8_0, 151936, 2048), idd, yd, 1};
    printf("get_rows q8_0 151936x2048 n=1 first call (tables, module load) %.1f us\n", once_us(gr_fn, &g));
    int gns[] = {1, 16, 2048};
    for (int i = 0; i < 3; i++) {
        g.n = gns[i];
        double sec = time_op(gr_fn, &g);
        double bytes = (double)g.n * (g.w.row_bytes + 4.0 * 2048);
        printf("get_rows q8_0 151936x2048 n=%-5d %9.1f us %7.0f GB/s (rows read + floats written)\n", g.n, sec * 1e6,
               bytes / sec / 1e9);
    }
    dev_free((void *)g.w.data);
    dev_free(idd);

    struct {
        st_type t;
        int64_t rows, cols;
    } mm[] = {{ST_TYPE_F32, 128, 2048}, {ST_TYPE_Q8_0, 4096, 2048}, {ST_TYPE_Q8_0, 2048, 4096}, {ST_TYPE_Q8_0, 512, 2048},
              {ST_TYPE_Q4_K, 4096, 4096}};
    for (int i = 0; i < 5; i++) {
        mm_ctx m = {bench_weights(mm[i].t, mm[i].rows, mm[i].cols), xd, yd, nmax};
        double first = once_us(mm_fn, &m);
        double sec = time_op(mm_fn, &m);
        double fl = 2.0 * nmax * mm[i].rows * mm[i].cols;
        printf("matmul %-5s %5lldx%-5lld n=%d: first call %9.1f us, then %9.1f us %7.1f TFLOPS", st_type_name(mm[i].t),
               (long long)mm[i].rows, (long long)mm[i].cols, nmax, first, sec * 1e6, fl / sec / 1e12);
        if (st_type_get(mm[i].t)->quantized) {
            setenv("STRATA_CUQ_DENSE_MMA", "1", 1);
            double s2 = time_op(mm_fn, &m);
            unsetenv("STRATA_CUQ_DENSE_MMA");
            printf("; tile GEMM (STRATA_CUQ_DENSE_MMA=1) %9.1f us %7.1f TFLOPS", s2 * 1e6, fl / s2 / 1e12);
        }
        printf("\n");
        dev_free((void *)m.w.data);
    }
}

static int bench(void) {
    static const st_type types[] = {ST_TYPE_Q8_0, ST_TYPE_Q4_K,   ST_TYPE_Q5_K,    ST_TYPE_Q6_K,
                                    ST_TYPE_IQ4_XS, ST_TYPE_IQ3_XXS, ST_TYPE_IQ3_S, ST_TYPE_IQ2_XS,
                                    ST_TYPE_Q4_0, ST_TYPE_F16,    ST_TYPE_BF16,    ST_TYPE_F32};
    static const int64_t shapes[][2] = {{2048, 768}, {4096, 4096}, {151936, 2048}}; // rows x cols
    printf("matmul n=1 (one quantize + one matrix-vector launch per call, no graph): GB/s of weights, vs 4.0 TB/s\n");
    printf("%-8s", "type");
    for (int s = 0; s < 3; s++) printf("   %6lldx%-5lld us    GB/s  %%4TB", (long long)shapes[s][0], (long long)shapes[s][1]);
    printf("\n");
    int nmax = 2048;
    float *x = xmalloc(sizeof(float) * (size_t)nmax * 4096);
    for (size_t i = 0; i < (size_t)nmax * 4096; i++) x[i] = rnd_normal();
    float *xd = dev_put(x, sizeof(float) * (size_t)nmax * 4096);
    float *yd = dev_put(NULL, sizeof(float) * (size_t)151936 * 16 > sizeof(float) * (size_t)nmax * 4096
                                  ? sizeof(float) * (size_t)151936 * 16
                                  : sizeof(float) * (size_t)nmax * 4096);
    free(x);
    // STRATA_BENCH_MOE=1: the experts' timings only (A/B runs of their switches, read once).
    const char *mo = getenv("STRATA_BENCH_MOE");
    bool moe_only = mo && mo[0] == '1';
    if (!moe_only) bench_first_and_prompt(xd, yd);
    for (size_t ti = 0; !moe_only && ti < sizeof types / sizeof types[0]; ti++) {
        st_type t = types[ti];
        printf("%-8s", st_type_name(t));
        for (int s = 0; s < 3; s++) {
            int64_t rows = shapes[s][0], cols = shapes[s][1];
            size_t bytes = st_row_bytes(t, cols) * (size_t)rows;
            uint8_t *w = xmalloc(bytes);
            random_blocks(t, w, bytes);
            mm_ctx m = {{t, cols, rows, st_row_bytes(t, cols), gpu->ops->upload(gpu, w, bytes)}, xd, yd, 1};
            free(w);
            if (!m.w.data) fail_msg("upload failed: %s", st_error());
            double sec = time_op(mm_fn, &m);
            double gbs = bytes / sec / 1e9;
            printf("   %12.1f %7.0f %5.1f%%", sec * 1e6, gbs, gbs / 40.0);
            if (st_type_get(t)->quantized) { // the previous kernels, for A/B
                setenv("STRATA_CUQ_OLD", "1", 1);
                double so = time_op(mm_fn, &m);
                unsetenv("STRATA_CUQ_OLD");
                printf(" (old %5.1f%%)", bytes / so / 4e10);
            }
            dev_free((void *)m.w.data);
        }
        printf("\n");
    }

    // Window sizes and the prompt GEMM on the 4096 x 4096 Q4_K matrix.
    if (!moe_only) {
        st_type t = ST_TYPE_Q4_K;
        int64_t rows = 4096, cols = 4096;
        size_t bytes = st_row_bytes(t, cols) * (size_t)rows;
        uint8_t *w = xmalloc(bytes);
        random_blocks(t, w, bytes);
        mm_ctx m = {{t, cols, rows, st_row_bytes(t, cols), gpu->ops->upload(gpu, w, bytes)}, xd, yd, 1};
        free(w);
        static const int ns[] = {1, 2, 4, 8, 16, 17, 64, 512, 2048};
        for (int i = 0; i < 9; i++) {
            m.n = ns[i];
            double sec = time_op(mm_fn, &m);
            printf("q4_K 4096x4096 n=%-5d %9.1f us %7.0f GB/s %8.1f TFLOPS", ns[i], sec * 1e6, bytes / sec / 1e9,
                   2.0 * ns[i] * rows * cols / sec / 1e12);
            // Windows: the old kernels; prompts: the tile GEMM unstaged, then staged (its default).
            setenv(ns[i] <= 16 ? "STRATA_CUQ_OLD" : "STRATA_CUQ_DENSE_MMA", "1", 1);
            if (ns[i] > 16) setenv("STRATA_GMM_STAGED", "0", 1);
            double s2 = time_op(mm_fn, &m);
            unsetenv("STRATA_CUQ_OLD");
            unsetenv("STRATA_GMM_STAGED");
            printf("; %s %9.1f us %7.0f GB/s", ns[i] <= 16 ? "old kernels" : "tile GEMM", s2 * 1e6, bytes / s2 / 1e9);
            if (ns[i] > 16) {
                double s3 = time_op(mm_fn, &m);
                printf("; staged %9.1f us %8.1f TFLOPS", s3 * 1e6, 2.0 * ns[i] * rows * cols / s3 / 1e12);
            }
            unsetenv("STRATA_CUQ_DENSE_MMA");
            printf("\n");
        }
        dev_free((void *)m.w.data);
    }

    // Experts at the Qwen3-30B-A3B shape: E=128, k=8, d=2048, F=768, Q4_K.
    {
        int E = 128, k = 8, d = 2048, F = 768;
        st_type t = ST_TYPE_Q4_K;
        size_t gb = st_row_bytes(t, d) * (size_t)F * E, db = st_row_bytes(t, F) * (size_t)d * E;
        uint8_t *w = xmalloc(gb > db ? gb : db);
        random_blocks(t, w, gb);
        st_mat3 g = stack(t, F, d, E, gpu->ops->upload(gpu, w, gb));
        random_blocks(t, w, gb);
        st_mat3 u = stack(t, F, d, E, gpu->ops->upload(gpu, w, gb));
        random_blocks(t, w, db);
        st_mat3 dn = stack(t, d, F, E, gpu->ops->upload(gpu, w, db));
        free(w);
        size_t per_expert = g.mat_bytes + u.mat_bytes + dn.mat_bytes;
        static const int ns[] = {1, 2, 4, 8, 16, 17, 512, 2048};
        for (int i = 0; i < 8; i++) {
            int n = ns[i];
            int32_t *ids = xmalloc(sizeof(int32_t) * n * k);
            float *wts = xmalloc(sizeof(float) * n * k);
            routing(n, k, E, ids, wts);
            bool used[128] = {false};
            int nu = 0;
            for (int j = 0; j < n * k; j++)
                if (!used[ids[j]]) used[ids[j]] = true, nu++;
            float *xdd = dev_put(NULL, sizeof(float) * (size_t)n * d);
            float *ydd = dev_put(NULL, sizeof(float) * (size_t)n * d);
            {
                float *xh = rand_normal((size_t)n * d, 1.0f);
                gpu->ops->from_host(gpu, xdd, xh, sizeof(float) * (size_t)n * d);
                free(xh);
            }
            st_moe_args a = {.layer = 0, .gate = &g, .up = &u, .down = &dn, .x = xdd,
                             .ids = dev_put(ids, sizeof(int32_t) * n * k), .weights = dev_put(wts, sizeof(float) * n * k),
                             .n = n, .k = k, .y = ydd};
            double sec = time_op(moe_fn, &a);
            double flops = 2.0 * n * k * 3.0 * d * F;
            printf("moe 30B shape q4_K n=%-5d %3d experts %9.1f us %7.0f GB/s (%4.1f%% of 4 TB/s) %7.2f TFLOPS\n", n, nu,
                   sec * 1e6, nu * per_expert / sec / 1e9, nu * per_expert / sec / 4e10, flops / sec / 1e12);
            if (n > 16) {
                setenv("STRATA_CUQ_OLD", "1", 1);
                double s2 = time_op(moe_fn, &a);
                unsetenv("STRATA_CUQ_OLD");
                printf("    (previous path, STRATA_CUQ_OLD=1: %9.1f us %7.2f TFLOPS)\n", s2 * 1e6, flops / s2 / 1e12);
                setenv("STRATA_GMM_STAGED", "0", 1);
                double s3 = time_op(moe_fn, &a);
                unsetenv("STRATA_GMM_STAGED");
                printf("    (unstaged tile GEMM, STRATA_GMM_STAGED=0: %9.1f us %7.2f TFLOPS)\n", s3 * 1e6, flops / s3 / 1e12);
            }
            if (n == 1) { // the same call with its weights cold: this less the hot figure above is DRAM's share
                moe_cold_ctx mc = {.next = 0};
                for (int c = 0; c < MOE_COLD_SETS; c++) {
                    int32_t cid[8];
                    for (int j = 0; j < k; j++) cid[j] = (int32_t)(c * k + j);
                    mc.a[c] = a;
                    mc.a[c].ids = dev_put(cid, sizeof(int32_t) * k);
                }
                double sc = time_op(moe_cold_fn, &mc);
                printf("moe 30B shape q4_K n=1     cold L2 (%d expert sets in turn) %9.1f us %7.0f GB/s\n", MOE_COLD_SETS,
                       sc * 1e6, k * per_expert / sc / 1e9);
                for (int c = 0; c < MOE_COLD_SETS; c++) dev_free((void *)mc.a[c].ids);
            }
            dev_free((void *)a.ids), dev_free((void *)a.weights), dev_free(xdd), dev_free(ydd);
            free(ids), free(wts);
        }
        dev_free((void *)g.data), dev_free((void *)u.data), dev_free((void *)dn.data);
    }
    dev_free(xd), dev_free(yd);
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
    if (st_backend_cpu_create(4, &cpu) != ST_OK || st_backend_cuda_create(0, 256 << 20, 2, &gpu) != ST_OK) {
        fprintf(stderr, "cannot create the backends: %s\n", st_error());
        return 1;
    }
    int rc;
    const char *only = getenv("STRATA_TEST_ONLY"); // a test name pattern (cmocka's filter: * and ?)
    if (only && *only) cmocka_set_test_filter(only);
    if (argc > 1 && !strcmp(argv[1], "--bench")) {
        printf("GPU 0: %s\n", info[0].name);
        rc = bench();
    } else {
        const struct CMUnitTest tests[] = {
            cmocka_unit_test(test_get_rows),
            cmocka_unit_test(test_matmul),
            cmocka_unit_test(test_matmul_many), cmocka_unit_test(test_norm_matmul),
            cmocka_unit_test(test_shared_ffn),
            cmocka_unit_test(test_matmul_mma),
            cmocka_unit_test(test_moe),
            cmocka_unit_test(test_moe_fold),
            cmocka_unit_test(test_hand_fold),
        };
        rc = cmocka_run_group_tests(tests, NULL, NULL);
    }
    st_backend_free(gpu);
    st_backend_free(cpu);
    return rc;
}
