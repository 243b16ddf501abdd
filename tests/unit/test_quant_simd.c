// Unit tests for the SIMD CPU kernels: every path this CPU runs (AVX2, AVX-512) against the
// scalar reference, for every type, odd block counts, dot, dot_multi, the GEMM kernels and
// st_matmul with odd row counts and several threads, F16 rows back to f32. Paths the CPU lacks
// are skipped, saying so.
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant/blocks.h"
#include "quant/kernels.h"
#include "quant/quant.h"

// SIMD and scalar kernels compute the same integer block sums; only the float accumulation
// order differs. Bound: |simd - scalar| <= REL_TOL * sum_i |w_i * x_i| (dequantized weights,
// float activations), which is far above that reordering error and far below any real bug
// (a wrong element or scale changes the result by about one term, i.e. ~1/n of the magnitude).
#define REL_TOL 2e-5

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}
static float rndf(void) { return (float)((rnd() & 0xffffff) / 8388608.0 - 1.0); } // [-1, 1)

static void put_f16(uint8_t *p, float v) {
    st_f16 h = st_f32_to_f16(v);
    memcpy(p, &h, 2);
}

// Offsets of the fp16 scale fields of each block type (so random bytes get sane scales).
static void fix_scales(st_type t, uint8_t *b) {
    float d = 0.001f + (rnd() % 1000) * 1e-5f, m = -0.01f + (rnd() % 1000) * 2e-5f;
    switch (t) {
    case ST_TYPE_Q4_1: case ST_TYPE_Q5_1:
        put_f16(b, d);
        put_f16(b + 2, m);
        break;
    case ST_TYPE_Q4_K: case ST_TYPE_Q5_K:
        put_f16(b, d);
        put_f16(b + 2, fabsf(m));
        break;
    case ST_TYPE_Q2_K:
        put_f16(b + offsetof(block_q2_K, d), d);
        put_f16(b + offsetof(block_q2_K, dmin), fabsf(m));
        break;
    case ST_TYPE_Q3_K: put_f16(b + offsetof(block_q3_K, d), d); break;
    case ST_TYPE_Q6_K: put_f16(b + offsetof(block_q6_K, d), d); break;
    case ST_TYPE_IQ1_M: {
        // The fp16 scale lives in the top nibbles of the four u16 scale words.
        st_f16 h = st_f32_to_f16(d);
        uint8_t *sc = b + offsetof(block_iq1_m, scales);
        for (int k = 0; k < 4; k++) sc[2 * k + 1] = (uint8_t)((sc[2 * k + 1] & 0x0f) | (((h >> 4 * k) & 15) << 4));
        break;
    }
    default: put_f16(b, d); break; // d first: Q4_0, Q5_0, Q8_0, IQ4_NL, IQ4_XS, IQ2/IQ3/IQ1_S
    }
}

// A random weight row of type t with n elements (fp16 scales set to small finite values).
static void make_weights(st_type t, uint8_t *w, int64_t n) {
    const st_type_info *ti = st_type_get(t);
    if (t == ST_TYPE_F32 || t == ST_TYPE_F16 || t == ST_TYPE_BF16) {
        float *f = malloc((size_t)n * sizeof(float));
        for (int64_t i = 0; i < n; i++) f[i] = rndf();
        st_quantize(t, f, w, n);
        free(f);
        return;
    }
    size_t bytes = st_row_bytes(t, n);
    for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)rnd();
    for (int64_t b = 0; b < n / ti->block; b++) fix_scales(t, w + (size_t)b * ti->block_bytes);
}

typedef struct fixture {
    st_type type;
    int64_t n;
    int nx;
    int rows;
    uint8_t *w;     // (rows, n) weights
    uint8_t *x;     // (nx, n) activations quantized to the dot type
    size_t xs;      // bytes per activation row
    float *mag;     // (nx, rows) sum |w_i x_i|
    float *ref;     // (nx, rows) scalar results
} fixture;

static void fixture_init(fixture *f, st_type t, int64_t n, int rows, int nx) {
    const st_type_info *ti = st_type_get(t);
    f->type = t;
    f->n = n;
    f->rows = rows;
    f->nx = nx;
    size_t wr = st_row_bytes(t, n);
    f->xs = st_row_bytes(ti->dot_type, n);
    f->w = st_alloc(wr * (size_t)rows);
    f->x = st_alloc(f->xs * (size_t)nx);
    f->mag = malloc(sizeof(float) * (size_t)rows * nx);
    f->ref = malloc(sizeof(float) * (size_t)rows * nx);
    float *xf = malloc(sizeof(float) * (size_t)n * nx);
    float *wf = malloc(sizeof(float) * (size_t)n);
    assert_non_null(f->w);
    assert_non_null(f->x);
    for (int o = 0; o < rows; o++) make_weights(t, f->w + (size_t)o * wr, n);
    for (int r = 0; r < nx; r++) {
        for (int64_t i = 0; i < n; i++) xf[(size_t)r * n + i] = rndf() * (1 + (rnd() % 4));
        st_quantize(ti->dot_type, xf + (size_t)r * n, f->x + (size_t)r * f->xs, n);
    }
    assert_int_equal(st_cpu_path_set(ST_CPU_SCALAR), ST_OK);
    for (int o = 0; o < rows; o++) {
        st_dequantize(t, f->w + (size_t)o * wr, wf, n);
        for (int r = 0; r < nx; r++) {
            double m = 0;
            for (int64_t i = 0; i < n; i++) m += fabs((double)wf[i] * xf[(size_t)r * n + i]);
            f->mag[(size_t)r * rows + o] = (float)m;
            f->ref[(size_t)r * rows + o] = st_vec_dot(t, n, f->w + (size_t)o * wr, f->x + (size_t)r * f->xs);
        }
    }
    free(xf);
    free(wf);
}

static void fixture_free(fixture *f) {
    st_free(f->w);
    st_free(f->x);
    free(f->mag);
    free(f->ref);
}

static void check(const fixture *f, int o, int r, float got, const char *what, st_cpu_path p) {
    float want = f->ref[(size_t)r * f->rows + o];
    double tol = REL_TOL * f->mag[(size_t)r * f->rows + o] + 1e-6;
    if (!(fabs((double)got - want) <= tol)) {
        print_error("%s %s: type %s n=%lld row %d x-row %d: got %.9g, scalar %.9g (tol %.3g)\n",
                    st_cpu_path_name(p), what, st_type_name(f->type), (long long)f->n, o, r,
                    got, want, tol);
        fail();
    }
}

// Every computable type against the scalar reference on one path. Returns the number of types
// with their own kernel on this path; *n_wide: of those, the ones that are not the AVX2 kernel
// (so a run on an AVX-512 machine says how many AVX-512 kernels it checked).
static int check_path(st_cpu_path p, int *n_wide) {
    st_quant_kernels scalar, avx2, fast;
    memset(&scalar, 0, sizeof scalar);
    st_quant_kernels_scalar(&scalar);
    avx2 = scalar;
    st_quant_kernels_avx2(&avx2);
    fast = avx2;
    if (p == ST_CPU_AVX512) st_quant_kernels_avx512(&fast);
    *n_wide = 0;

    st_pool *pool = st_pool_create(3);
    assert_non_null(pool);
    int n_types = 0;
    for (int t = 0; t < ST_TYPE_COUNT; t++) {
        const st_type_info *ti = st_type_get(t);
        if (!ti || !ti->compute || !scalar.dot[t]) continue;
        bool own = fast.dot[t] != scalar.dot[t];
        // Block counts: odd ones (an AVX-512 pair loop's tail) and one large.
        int64_t counts[] = {1, 3, 7, 16, 33};
        for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
            int64_t n = counts[c] * ti->block;
            if (ti->block == 1) n = counts[c] * 37; // floats: not a multiple of the vector width
            int rows = c % 2 ? 13 : 5, nx = c == 4 ? 37 : (int)(c * 2 + 1);
            fixture f;
            fixture_init(&f, (st_type)t, n, rows, nx);
            assert_int_equal(st_cpu_path_set(p), ST_OK);
            size_t wr = st_row_bytes((st_type)t, n);
            // dot, one pair at a time
            for (int o = 0; o < rows; o++)
                for (int r = 0; r < nx; r++)
                    check(&f, o, r, st_vec_dot((st_type)t, n, f.w + (size_t)o * wr, f.x + (size_t)r * f.xs), "dot", p);
            // dot_multi directly, every count of activation rows up to 9
            if (fast.dot_multi[t]) {
                float s[9];
                for (int k = 1; k <= 9 && k <= nx; k++) {
                    fast.dot_multi[t](n, k, s, f.w, f.x, f.xs);
                    for (int r = 0; r < k; r++) check(&f, 0, r, s[r], "dot_multi", p);
                }
            }
            // st_matmul with a pool (and without), into a wider output
            int64_t ldy = rows + 3;
            float *y = malloc(sizeof(float) * (size_t)ldy * nx);
            for (int use_pool = 0; use_pool < 2; use_pool++) {
                for (int64_t i = 0; i < ldy * nx; i++) y[i] = NAN;
                st_matmul_args a = {.type = (st_type)t, .w = f.w, .n = n, .rows = rows, .x = f.x,
                                    .x_stride = f.xs, .nx = nx, .y = y, .ldy = ldy};
                st_matmul(use_pool ? pool : NULL, &a);
                for (int r = 0; r < nx; r++) {
                    for (int o = 0; o < rows; o++) check(&f, o, r, y[r * ldy + o], "matmul", p);
                    for (int o = rows; o < ldy; o++) assert_true(isnan(y[r * ldy + o])); // untouched
                }
            }
            free(y);
            fixture_free(&f);
        }
        if (own) n_types++;
        if (p == ST_CPU_AVX512 && fast.dot[t] != avx2.dot[t]) (*n_wide)++;
    }
    st_pool_free(pool);
    return n_types;
}

static void run_path(st_cpu_path p) {
    if (!st_cpu_path_supported(p)) {
        print_message("[  SKIPPED ] %s kernels: this CPU cannot run them (tested on a CPU that can)\n",
                      st_cpu_path_name(p));
        skip();
    }
    st_cpu_path saved = st_cpu_path_get();
    int n_wide = 0;
    int n = check_path(p, &n_wide);
    print_message("[    INFO  ] %s: %d types with their own kernels match the scalar reference\n",
                  st_cpu_path_name(p), n);
    if (p == ST_CPU_AVX512)
        print_message("[    INFO  ] avx512: %d of them have AVX-512 kernels (the rest use AVX2's)\n", n_wide);
    assert_int_equal(st_cpu_path_set(saved), ST_OK);
    assert_true(n > 0);
}

static void test_avx2(void **state) {
    (void)state;
    run_path(ST_CPU_AVX2);
}

static void test_avx512(void **state) {
    (void)state;
    run_path(ST_CPU_AVX512);
}

// The GEMM kernels (8 weight rows packed, then many activation rows) on one path: directly,
// for every count of activation rows up to 13 and with add set, and through st_matmul with
// row counts that leave a remainder of fewer than 8 rows, K chunks (long rows) and the pool.
// Returns the number of types with a GEMM kernel on the path.
static int check_gemm(st_cpu_path p) {
    st_quant_kernels k;
    memset(&k, 0, sizeof k);
    st_quant_kernels_scalar(&k);
    st_quant_kernels_avx2(&k);
    if (p == ST_CPU_AVX512) st_quant_kernels_avx512(&k);
    st_pool *pool = st_pool_create(3);
    assert_non_null(pool);
    int n_types = 0;
    for (int t = 0; t < ST_TYPE_COUNT; t++) {
        if (!k.gemm_pack[t]) continue;
        assert_non_null(k.gemm[t]);
        assert_true(k.gemm_block_bytes[t] > 0 && k.gemm_block_bytes[t] % 32 == 0);
        const st_type_info *ti = st_type_get(t);
        // Blocks per row: one, odd, and more than one K chunk of st_matmul's 32 KiB tile.
        int64_t counts[] = {1, 5, 32 * 1024 / k.gemm_block_bytes[t] + 3};
        for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
            int64_t nb = counts[c], n = nb * ti->block;
            int rows = c == 0 ? 8 : c == 1 ? 21 : 35, nx = c == 2 ? 37 : 13;
            fixture f;
            fixture_init(&f, (st_type)t, n, rows, nx);
            assert_int_equal(st_cpu_path_set(p), ST_OK);
            size_t wr = st_row_bytes((st_type)t, n);
            void *packed = st_alloc((size_t)nb * (size_t)k.gemm_block_bytes[t]);
            assert_non_null(packed);
            k.gemm_pack[t](nb, packed, f.w, wr);
            float y[13 * 10];
            for (int m = 1; m <= 13 && m <= nx; m++) {
                for (int add = 0; add < 2; add++) {
                    for (int i = 0; i < 13 * 10; i++) y[i] = add ? (float)(i % 7) : NAN;
                    k.gemm[t](nb, m, y, 10, packed, f.x, f.xs, add);
                    for (int r = 0; r < 13; r++)
                        for (int o = 0; o < 10; o++) {
                            float got = y[r * 10 + o];
                            if (r >= m || o >= 8) { // untouched
                                if (add) assert_true(got == (float)((r * 10 + o) % 7));
                                else assert_true(isnan(got));
                            } else {
                                check(&f, o, r, got - (add ? (float)((r * 10 + o) % 7) : 0), "gemm", p);
                            }
                        }
                }
            }
            st_free(packed);
            // st_matmul: every nx from 1 (dot) through the GEMM threshold to nx, with the pool
            for (int m = 1; m <= nx; m += m < 12 ? 1 : 12) {
                int64_t ldy = rows + 1;
                float *ym = malloc(sizeof(float) * (size_t)ldy * m);
                for (int use_pool = 0; use_pool < 2; use_pool++) {
                    for (int64_t i = 0; i < ldy * m; i++) ym[i] = NAN;
                    st_matmul_args a = {.type = (st_type)t, .w = f.w, .n = n, .rows = rows, .x = f.x,
                                        .x_stride = f.xs, .nx = m, .y = ym, .ldy = ldy};
                    st_matmul(use_pool ? pool : NULL, &a);
                    for (int r = 0; r < m; r++) {
                        for (int o = 0; o < rows; o++) check(&f, o, r, ym[r * ldy + o], "matmul (gemm)", p);
                        assert_true(isnan(ym[r * ldy + rows]));
                    }
                }
                free(ym);
            }
            fixture_free(&f);
        }
        n_types++;
    }
    st_pool_free(pool);
    return n_types;
}

static void run_gemm(st_cpu_path p) {
    if (!st_cpu_path_supported(p)) {
        print_message("[  SKIPPED ] %s GEMM kernels: this CPU cannot run them\n", st_cpu_path_name(p));
        skip();
    }
    st_cpu_path saved = st_cpu_path_get();
    int n = check_gemm(p);
    print_message("[    INFO  ] %s: %d types with GEMM kernels match the scalar reference\n",
                  st_cpu_path_name(p), n);
    assert_int_equal(st_cpu_path_set(saved), ST_OK);
    if (p == ST_CPU_AVX2) assert_true(n >= 2); // q8_0 and q4_K at least
}

static void test_gemm_avx2(void **state) {
    (void)state;
    run_gemm(ST_CPU_AVX2);
}

static void test_gemm_avx512(void **state) {
    (void)state;
    run_gemm(ST_CPU_AVX512);
}

// The scalar path itself through st_matmul's tiling (many activation rows, more than one tile
// and group) against single dots.
static void test_scalar_matmul_tiling(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, ST_TYPE_Q8_0, 64 * 32, 150, 21); // 150 rows of 2176 bytes: > one 256 KiB tile
    float *y = malloc(sizeof(float) * 150 * 21);
    st_pool *pool = st_pool_create(2);
    st_matmul_args a = {.type = ST_TYPE_Q8_0, .w = f.w, .n = f.n, .rows = 150, .x = f.x,
                        .x_stride = f.xs, .nx = 21, .y = y, .ldy = 150};
    st_matmul(pool, &a);
    for (int r = 0; r < 21; r++)
        for (int o = 0; o < 150; o++) check(&f, o, r, y[r * 150 + o], "matmul", ST_CPU_SCALAR);
    st_pool_free(pool);
    free(y);
    fixture_free(&f);
}

// The activation quantizers of each path write the scalar code's bytes: random rows, blocks of
// zeros, halves exactly at rounding ties (a block whose largest magnitude is 127 has scale 1),
// a negative extreme, and the largest magnitude twice with opposite signs (Q8_K takes the first).
static void test_quantize_paths(void **state) {
    (void)state;
    enum { N = 256 * 6 };
    static float x[N];
    for (int i = 0; i < N; i++) x[i] = rndf() * (i < 512 ? 1.0f : 40.0f);
    for (int i = 256; i < 288; i++) x[i] = 0.0f;                     // a zero Q8_0 block
    for (int i = 512; i < 768; i++) x[i] = 0.0f;                     // a zero Q8_K block
    for (int i = 768; i < 1024; i++) x[i] = (float)((int)(rnd() % 255) - 127) + 0.5f * (float)(rnd() & 1);
    x[768] = 127.0f, x[800] = -127.0f, x[1000] = 127.0f;           // ties under scale 1 (Q8_0 blocks too)
    x[1024] = -39.5f, x[1030] = 39.5f;                               // extremes of both signs
    static const st_type types[] = {ST_TYPE_Q8_0, ST_TYPE_Q8_K, ST_TYPE_Q8_1, ST_TYPE_F16, ST_TYPE_BF16};
    st_cpu_path saved = st_cpu_path_get();
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        size_t bytes = st_row_bytes(types[ti], N);
        char *ref = malloc(bytes), *got = malloc(bytes);
        assert_int_equal(st_cpu_path_set(ST_CPU_SCALAR), ST_OK);
        st_quantize(types[ti], x, ref, N);
        for (int p = ST_CPU_AVX2; p < ST_CPU_PATH_COUNT; p++) {
            if (!st_cpu_path_supported((st_cpu_path)p)) continue;
            assert_int_equal(st_cpu_path_set((st_cpu_path)p), ST_OK);
            memset(got, 0x5a, bytes);
            st_quantize(types[ti], x, got, N);
            for (size_t b = 0; b < bytes; b++)
                if (ref[b] != got[b])
                    fail_msg("quantize %s on %s: byte %zu differs (scalar %d, %d)", st_type_name(types[ti]),
                             st_cpu_path_name((st_cpu_path)p), b, ref[b], got[b]);
        }
        free(ref), free(got);
    }
    assert_int_equal(st_cpu_path_set(saved), ST_OK);
}

// st_matmul with one activation row (decode: each thread's rows run as two interleaved streams)
// gives every row exactly what st_vec_dot gives it, for row counts that split evenly, unevenly
// and not at all, with and without the pool.
static void test_matmul_one_row(void **state) {
    (void)state;
    static const st_type types[] = {ST_TYPE_Q8_0, ST_TYPE_Q4_K, ST_TYPE_F16};
    static const int row_counts[] = {1, 2, 3, 4, 17, 64, 101, 1000};
    st_pool *pool = st_pool_create(3);
    assert_non_null(pool);
    st_cpu_path saved = st_cpu_path_get();
    for (int p = 0; p < ST_CPU_PATH_COUNT; p++) {
        if (!st_cpu_path_supported((st_cpu_path)p)) continue;
        for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
            int64_t n = 512;
            int rows = row_counts[sizeof row_counts / sizeof row_counts[0] - 1];
            fixture f;
            fixture_init(&f, types[ti], n, rows, 1);
            assert_int_equal(st_cpu_path_set((st_cpu_path)p), ST_OK);
            size_t wr = st_row_bytes(types[ti], n);
            float *y = malloc(sizeof(float) * (size_t)rows);
            for (size_t c = 0; c < sizeof row_counts / sizeof row_counts[0]; c++)
                for (int use_pool = 0; use_pool < 2; use_pool++) {
                    for (int o = 0; o < rows; o++) y[o] = NAN;
                    st_matmul_args a = {.type = types[ti], .w = f.w, .n = n, .rows = row_counts[c], .x = f.x,
                                        .x_stride = f.xs, .nx = 1, .y = y, .ldy = row_counts[c]};
                    st_matmul(use_pool ? pool : NULL, &a);
                    for (int o = 0; o < row_counts[c]; o++) {
                        float want = st_vec_dot(types[ti], n, f.w + (size_t)o * wr, f.x);
                        if (memcmp(&want, &y[o], sizeof want))
                            fail_msg("%s %s rows %d pool %d: row %d %.9g, st_vec_dot %.9g", st_type_name(types[ti]),
                                     st_cpu_path_name((st_cpu_path)p), row_counts[c], use_pool, o, y[o], want);
                    }
                    for (int o = row_counts[c]; o < rows; o++) assert_true(isnan(y[o])); // untouched
                }
            free(y);
            fixture_free(&f);
        }
    }
    assert_int_equal(st_cpu_path_set(saved), ST_OK);
    st_pool_free(pool);
}

// Every path's dot_multi gives each activation row the bits dot gives it (kernels.h), for every
// type with a kernel, every row count up to 13 and odd block counts: the property a window's
// rows rest on (st_matmul_args.row_exact).
static void test_multi_is_dot(void **state) {
    (void)state;
    st_cpu_path saved = st_cpu_path_get();
    for (int p = 0; p < ST_CPU_PATH_COUNT; p++) {
        if (!st_cpu_path_supported((st_cpu_path)p)) continue;
        for (int t = 0; t < ST_TYPE_COUNT; t++) {
            const st_type_info *ti = st_type_get((st_type)t);
            assert_int_equal(st_cpu_path_set((st_cpu_path)p), ST_OK);
            const st_quant_kernels *k = st_quant_kernels_now();
            if (!ti || !k->dot[t] || !k->dot_multi[t]) continue;
            for (int nb = 1; nb <= 3; nb += 2) { // blocks of 256 elements: odd counts of 32-blocks too
                int64_t n = (int64_t)nb * 256 + (ti->block == 32 ? 32 : 0);
                fixture f;
                fixture_init(&f, (st_type)t, n, 1, 13);
                assert_int_equal(st_cpu_path_set((st_cpu_path)p), ST_OK);
                k = st_quant_kernels_now();
                for (int nx = 1; nx <= 13; nx++) {
                    float s[13], one;
                    k->dot_multi[t](n, nx, s, f.w, f.x, f.xs);
                    for (int r = 0; r < nx; r++) {
                        k->dot[t](n, &one, f.w, f.x + (size_t)r * f.xs);
                        if (memcmp(&one, &s[r], sizeof one))
                            fail_msg("%s %s n=%lld: dot_multi of %d rows, row %d: %.9g, dot %.9g",
                                     st_cpu_path_name((st_cpu_path)p), ti->name, (long long)n, nx, r, s[r], one);
                    }
                }
                fixture_free(&f);
            }
        }
    }
    assert_int_equal(st_cpu_path_set(saved), ST_OK);
}

// A row-exact st_matmul (a decode or verify window) gives every activation row the bits the
// one-row st_matmul gives it, for every type and path, 2 to 16 rows (past the GEMM threshold),
// with and without the pool.
static void test_matmul_row_exact(void **state) {
    (void)state;
    st_pool *pool = st_pool_create(3);
    assert_non_null(pool);
    st_cpu_path saved = st_cpu_path_get();
    const int64_t n = 512;
    const int rows = 40;
    for (int t = 0; t < ST_TYPE_COUNT; t++) {
        const st_type_info *ti = st_type_get((st_type)t);
        if (!ti || !st_quant_kernels_now()->dot[t] || n % ti->block) continue;
        fixture f;
        fixture_init(&f, (st_type)t, n, rows, 16);
        for (int p = 0; p < ST_CPU_PATH_COUNT; p++) {
            if (!st_cpu_path_supported((st_cpu_path)p)) continue;
            assert_int_equal(st_cpu_path_set((st_cpu_path)p), ST_OK);
            float one[16 * 40], got[16 * 40];
            for (int r = 0; r < 16; r++) {
                st_matmul_args a = {.type = (st_type)t, .w = f.w, .n = n, .rows = rows, .x = f.x + (size_t)r * f.xs,
                                    .x_stride = f.xs, .nx = 1, .y = one + r * rows, .ldy = rows};
                st_matmul(NULL, &a);
            }
            for (int nx = 2; nx <= 16; nx++)
                for (int use_pool = 0; use_pool < 2; use_pool++) {
                    st_matmul_args a = {.type = (st_type)t, .w = f.w, .n = n, .rows = rows, .x = f.x, .x_stride = f.xs,
                                        .nx = nx, .y = got, .ldy = rows, .row_exact = true};
                    st_matmul(use_pool ? pool : NULL, &a);
                    for (int i = 0; i < nx * rows; i++)
                        if (memcmp(&one[i], &got[i], sizeof(float)))
                            fail_msg("%s %s: %d rows row-exact (pool %d): row %d output %d: %.9g, alone %.9g",
                                     st_cpu_path_name((st_cpu_path)p), ti->name, nx, use_pool, i / rows, i % rows,
                                     got[i], one[i]);
                }
        }
        fixture_free(&f);
    }
    assert_int_equal(st_cpu_path_set(saved), ST_OK);
    st_pool_free(pool);
}

// st_matmul_many gives each product's rows exactly as its own st_matmul does, one activation row
// (decode) or several (the GEMM path), products of different types and sizes in one run.
static void test_matmul_many(void **state) {
    (void)state;
    static const st_type types[] = {ST_TYPE_Q8_0, ST_TYPE_Q4_K, ST_TYPE_F16};
    static const int rows[] = {1000, 64, 17};
    st_pool *pool = st_pool_create(3);
    assert_non_null(pool);
    for (int nx = 1; nx <= 5; nx += 4) {
        fixture f[3];
        st_matmul_args a[3];
        float *want[3];
        for (int i = 0; i < 3; i++) {
            fixture_init(&f[i], types[i], 512, rows[i], nx);
            want[i] = malloc(sizeof(float) * (size_t)rows[i] * nx);
            a[i] = (st_matmul_args){.type = types[i], .w = f[i].w, .n = 512, .rows = rows[i], .x = f[i].x,
                                    .x_stride = f[i].xs, .nx = nx, .y = want[i], .ldy = rows[i]};
            st_matmul(NULL, &a[i]);
            a[i].y = malloc(sizeof(float) * (size_t)rows[i] * nx);
        }
        for (int n = 1; n <= 3; n++) {
            st_matmul_many(pool, n, a);
            for (int i = 0; i < n; i++)
                if (memcmp(a[i].y, want[i], sizeof(float) * (size_t)rows[i] * nx))
                    fail_msg("nx %d, %d products: product %d (%s) differs from its st_matmul", nx, n, i,
                             st_type_name(types[i]));
        }
        for (int i = 0; i < 3; i++) {
            free(a[i].y);
            free(want[i]);
            fixture_free(&f[i]);
        }
    }
    st_pool_free(pool);
}

// Every path's F16 -> f32 gives st_f16_to_f32's bits for every half value (F16C quiets a
// signalling NaN, the scalar code keeps its bits: any NaN for a NaN).
static void test_dequantize_f16_paths(void **state) {
    (void)state;
    enum { N = 65536 + 5 }; // every bit pattern, then a tail shorter than a vector
    static st_f16 h[N];
    static float got[N];
    for (int i = 0; i < N; i++) h[i] = (st_f16)(i < 65536 ? i : 0x3c00 + i);
    st_cpu_path saved = st_cpu_path_get();
    for (int p = 0; p < ST_CPU_PATH_COUNT; p++) {
        if (!st_cpu_path_supported((st_cpu_path)p)) continue;
        assert_int_equal(st_cpu_path_set((st_cpu_path)p), ST_OK);
        st_dequantize(ST_TYPE_F16, h, got, N);
        for (int i = 0; i < N; i++) {
            float want = st_f16_to_f32(h[i]);
            if (isnan(want) ? !isnan(got[i]) : memcmp(&want, &got[i], sizeof want))
                fail_msg("f16 0x%04x on %s: %.9g, scalar %.9g", h[i], st_cpu_path_name((st_cpu_path)p), got[i], want);
        }
    }
    assert_int_equal(st_cpu_path_set(saved), ST_OK);
}

// Path selection: names, the scalar path always there, an unsupported path refused.
static void test_paths(void **state) {
    (void)state;
    assert_string_equal(st_cpu_path_name(ST_CPU_AVX512), "avx512");
    assert_true(st_cpu_path_supported(ST_CPU_SCALAR));
    st_cpu_path saved = st_cpu_path_get();
    assert_true(st_cpu_path_supported(saved));
    for (int p = 0; p < ST_CPU_PATH_COUNT; p++) {
        st_status s = st_cpu_path_set((st_cpu_path)p);
        assert_int_equal(s == ST_OK, st_cpu_path_supported((st_cpu_path)p));
        print_message("[    INFO  ] path %-6s %s\n", st_cpu_path_name((st_cpu_path)p),
                      s == ST_OK ? "supported" : "not supported by this CPU (its test is skipped)");
    }
    assert_int_equal(st_cpu_path_set(saved), ST_OK);
    assert_int_equal(st_cpu_path_set(ST_CPU_PATH_COUNT), ST_ERR_ARG);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_paths),
        cmocka_unit_test(test_scalar_matmul_tiling),
        cmocka_unit_test(test_quantize_paths),
        cmocka_unit_test(test_matmul_one_row),
        cmocka_unit_test(test_matmul_many),
        cmocka_unit_test(test_multi_is_dot),
        cmocka_unit_test(test_matmul_row_exact),
        cmocka_unit_test(test_dequantize_f16_paths),
        cmocka_unit_test(test_avx2),
        cmocka_unit_test(test_avx512),
        cmocka_unit_test(test_gemm_avx2),
        cmocka_unit_test(test_gemm_avx512),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
