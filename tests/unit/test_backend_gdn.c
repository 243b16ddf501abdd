// Unit tests for the Gated DeltaNet ops of the CPU backend: the step form (gdn) and the chunked
// form (gdn_chunked) against a float64 recurrence written here from REFERENCE.md §3.3 step 7, on
// random data with row counts around the chunk size, a non-zero entering state and several
// threads. `test_backend_gdn --bench [threads]` times both forms at Qwen3-Next's shape instead.
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

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static double rnd(void) { // uniform [0, 1)
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

// Random inputs of one call: unit-norm keys, queries scaled by 1/sqrt(d) as the forward makes
// them, β in (0, 1), log-decays from about 0 (long memory) to -3, and a random entering state.
typedef struct gdn_case {
    int n, h_k, h_v, d;
    float *q, *k, *v, *beta, *g, *state; // shapes as in st_gdn_args
} gdn_case;

static void unit_rows(float *x, int rows, int d, float scale) {
    for (int i = 0; i < rows; i++) {
        double ss = 0;
        for (int j = 0; j < d; j++) ss += (double)x[i * d + j] * x[i * d + j];
        for (int j = 0; j < d; j++) x[i * d + j] = (float)(x[i * d + j] / sqrt(ss) * scale);
    }
}

static gdn_case case_make(int n, int h_k, int h_v, int d) {
    gdn_case c = {n, h_k, h_v, d, NULL, NULL, NULL, NULL, NULL, NULL};
    size_t nk = (size_t)n * h_k * d, nv = (size_t)n * h_v * d, ns = (size_t)h_v * d * d;
    c.q = malloc(sizeof(float) * nk);
    c.k = malloc(sizeof(float) * nk);
    c.v = malloc(sizeof(float) * nv);
    c.beta = malloc(sizeof(float) * n * h_v);
    c.g = malloc(sizeof(float) * n * h_v);
    c.state = malloc(sizeof(float) * ns);
    for (size_t i = 0; i < nk; i++) c.q[i] = (float)(2 * rnd() - 1);
    for (size_t i = 0; i < nk; i++) c.k[i] = (float)(2 * rnd() - 1);
    for (size_t i = 0; i < nv; i++) c.v[i] = (float)(2 * rnd() - 1);
    for (int i = 0; i < n * h_v; i++) c.beta[i] = (float)(0.02 + 0.96 * rnd());
    for (int i = 0; i < n * h_v; i++) c.g[i] = (float)(i % 5 == 0 ? -1e-4 * rnd() : -3 * rnd() * rnd());
    for (size_t i = 0; i < ns; i++) c.state[i] = (float)(0.5 * (2 * rnd() - 1));
    unit_rows(c.q, n * h_k, d, 1.0f / sqrtf((float)d));
    unit_rows(c.k, n * h_k, d, 1.0f);
    return c;
}

static void case_free(gdn_case *c) {
    free(c->q), free(c->k), free(c->v), free(c->beta), free(c->g), free(c->state);
}

// The delta rule in float64, one row at a time, with S stored as the ops store it (value rows,
// key dims contiguous): S ← e^g S; δ = β (v − S k); S ← S + δ kᵀ; o = S q.
static void reference(const gdn_case *c, double *out, double *S) {
    int d = c->d, r = c->h_v / c->h_k;
    for (size_t i = 0; i < (size_t)c->h_v * d * d; i++) S[i] = c->state[i];
    for (int t = 0; t < c->n; t++) {
        for (int j = 0; j < c->h_v; j++) {
            const float *q = c->q + ((size_t)t * c->h_k + j / r) * d;
            const float *k = c->k + ((size_t)t * c->h_k + j / r) * d;
            const float *v = c->v + ((size_t)t * c->h_v + j) * d;
            double beta = c->beta[t * c->h_v + j], decay = exp(c->g[t * c->h_v + j]);
            double *Sj = S + (size_t)j * d * d;
            for (int vi = 0; vi < d; vi++) {
                double *row = Sj + (size_t)vi * d, m = 0, o = 0;
                for (int ki = 0; ki < d; ki++) m += (row[ki] *= decay) * k[ki];
                double delta = beta * (v[vi] - m);
                for (int ki = 0; ki < d; ki++) o += (row[ki] += delta * k[ki]) * q[ki];
                out[((size_t)t * c->h_v + j) * d + vi] = o;
            }
        }
    }
}

// Runs one op on a copy of the case's state; out (n, h_v, d) and state receive the results.
static void run_op(st_backend *b, bool chunked, const gdn_case *c, float *out, float *state) {
    memcpy(state, c->state, sizeof(float) * c->h_v * c->d * c->d);
    st_gdn_args a = {.q = c->q, .k = c->k, .v = c->v, .beta = c->beta, .g = c->g, .state = state,
                     .out = out, .n = c->n, .h_k = c->h_k, .h_v = c->h_v, .d = c->d};
    (chunked ? b->ops->gdn_chunked : b->ops->gdn)(b, &a);
}

// max |got - want| / max |want|
static double rel_err(const float *got, const double *want, size_t n) {
    double err = 0, scale = 0;
    for (size_t i = 0; i < n; i++) {
        err = fmax(err, fabs(got[i] - want[i]));
        scale = fmax(scale, fabs(want[i]));
    }
    return err / scale;
}

// Float32 rounding of a few hundred rows of d-long dot products stays near 1e-6 of the values;
// a wrong decay, a missed row or a mis-indexed head is off by 1e-2 or more.
#define TOL 2e-5

static void check_shape(int h_k, int h_v, int d, int threads) {
    static const int lengths[] = {1, 2, 63, 64, 65, 130, 200};
    st_backend *b;
    assert_int_equal(st_backend_cpu_create(threads, &b), ST_OK);
    for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
        gdn_case c = case_make(lengths[li], h_k, h_v, d);
        size_t no = (size_t)c.n * h_v * d, ns = (size_t)h_v * d * d;
        double *want = malloc(sizeof(double) * no), *want_s = malloc(sizeof(double) * ns);
        float *out = malloc(sizeof(float) * no), *state = malloc(sizeof(float) * ns);
        reference(&c, want, want_s);
        for (int chunked = 0; chunked <= 1; chunked++) {
            run_op(b, chunked, &c, out, state);
            double eo = rel_err(out, want, no), es = rel_err(state, want_s, ns);
            if (eo > TOL || es > TOL)
                fail_msg("%s, n %d, h_k %d, h_v %d, d %d, %d threads: output error %.2e, state error %.2e",
                         chunked ? "gdn_chunked" : "gdn", c.n, h_k, h_v, d, threads, eo, es);
        }
        free(want), free(want_s), free(out), free(state);
        case_free(&c);
    }
    st_backend_free(b);
}

static void test_small_heads(void **st) {
    (void)st;
    check_shape(2, 4, 32, 1);
    check_shape(2, 4, 32, 3);
}

static void test_odd_head_size(void **st) {
    (void)st;
    check_shape(1, 3, 37, 2); // d not a multiple of 4; r = 3
}

static void test_qwen3next_head(void **st) {
    (void)st;
    check_shape(1, 2, 128, 2);
}

// Two calls continue each other: n rows at once equal a rows then n - a rows, either form.
static void test_split_calls(void **st) {
    (void)st;
    st_backend *b;
    assert_int_equal(st_backend_cpu_create(2, &b), ST_OK);
    gdn_case c = case_make(150, 2, 4, 32);
    size_t no = (size_t)c.n * c.h_v * c.d, ns = (size_t)c.h_v * c.d * c.d;
    double *want = malloc(sizeof(double) * no), *want_s = malloc(sizeof(double) * ns);
    float *out = malloc(sizeof(float) * no), *state = malloc(sizeof(float) * ns);
    reference(&c, want, want_s);
    static const int splits[] = {1, 7, 64, 100};
    for (size_t si = 0; si < sizeof splits / sizeof splits[0]; si++) {
        memcpy(state, c.state, sizeof(float) * ns);
        for (int part = 0; part < 2; part++) {
            int t0 = part ? splits[si] : 0, n = part ? c.n - splits[si] : splits[si];
            size_t ko = (size_t)t0 * c.h_k * c.d, vo = (size_t)t0 * c.h_v * c.d, go = (size_t)t0 * c.h_v;
            st_gdn_args a = {.q = c.q + ko, .k = c.k + ko, .v = c.v + vo, .beta = c.beta + go, .g = c.g + go,
                             .state = state, .out = out + vo, .n = n, .h_k = c.h_k, .h_v = c.h_v, .d = c.d};
            (part ? b->ops->gdn_chunked : b->ops->gdn)(b, &a);
        }
        double eo = rel_err(out, want, no), es = rel_err(state, want_s, ns);
        if (eo > TOL || es > TOL)
            fail_msg("split at %d: output error %.2e, state error %.2e", splits[si], eo, es);
    }
    free(want), free(want_s), free(out), free(state);
    case_free(&c);
    st_backend_free(b);
}

// CPU seconds of this process: on a shared machine a fairer clock than wall time (with one
// thread; more threads add the workers' time, spinning included).
static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Times both forms at Qwen3-Next's shape (h_k 16, h_v 32, d 128) for several row counts.
static int bench(int threads) {
    st_backend *b;
    if (st_backend_cpu_create(threads, &b)) return 1;
    static const int lengths[] = {1, 2, 4, 8, 16, 32, 64, 128, 512};
    printf("gdn at h_k 16, h_v 32, d 128, %d threads: CPU ms per call (µs per row)\n", threads);
    for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
        gdn_case c = case_make(lengths[li], 16, 32, 128);
        float *out = malloc(sizeof(float) * c.n * c.h_v * c.d), *state = malloc(sizeof(float) * c.h_v * c.d * c.d);
        double t[2];
        for (int chunked = 0; chunked <= 1; chunked++) {
            int reps = 0;
            double t0 = cpu_s(), el;
            do {
                run_op(b, chunked, &c, out, state);
                reps++;
            } while ((el = cpu_s() - t0) < 0.3);
            t[chunked] = el / reps;
        }
        printf("  n %4d: step %8.3f ms (%7.1f µs/row)   chunked %8.3f ms (%7.1f µs/row)   chunked/step %.2f\n",
               c.n, t[0] * 1e3, t[0] * 1e6 / c.n, t[1] * 1e3, t[1] * 1e6 / c.n, t[1] / t[0]);
        free(out), free(state);
        case_free(&c);
    }
    st_backend_free(b);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--bench")) return bench(argc > 2 ? atoi(argv[2]) : 1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_small_heads),
        cmocka_unit_test(test_odd_head_size),
        cmocka_unit_test(test_qwen3next_head),
        cmocka_unit_test(test_split_calls),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
