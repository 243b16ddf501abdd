// Unit tests for the sampler: greedy, top-k/top-p/min-p filtering, temperature, penalties,
// and seeded reproducibility.
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "engine/engine.h"

#define V 8

static strata_sampling base(void) {
    return (strata_sampling){.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f,
                             .repeat_penalty = 1.0f, .penalty_last_n = 64, .seed = 1};
}

// Draws n samples and counts them per token.
static void histogram(const strata_sampling *p, const float *logits, int n, int counts[V]) {
    st_sampler *s;
    assert_int_equal(st_sampler_create(p, V, &s), ST_OK);
    memset(counts, 0, sizeof(int) * V);
    for (int i = 0; i < n; i++) {
        float l[V];
        memcpy(l, logits, sizeof l);
        int32_t t = st_sampler_sample(s, l, NULL, 0);
        assert_true(t >= 0 && t < V);
        counts[t]++;
    }
    st_sampler_free(s);
}

static const float logits[V] = {1.0f, 3.0f, 2.0f, 0.5f, 2.9f, -1.0f, 0.0f, 2.5f};

static void test_greedy(void **state) {
    (void)state;
    strata_sampling p = base();
    p.temperature = 0;
    int c[V];
    histogram(&p, logits, 10, c);
    assert_int_equal(c[1], 10);
}

static void test_top_k_one_is_greedy(void **state) {
    (void)state;
    strata_sampling p = base();
    p.top_k = 1;
    int c[V];
    histogram(&p, logits, 200, c);
    assert_int_equal(c[1], 200);
}

static void test_top_k_keeps_k(void **state) {
    (void)state;
    strata_sampling p = base();
    p.top_k = 3; // tokens 1, 4, 7
    int c[V];
    histogram(&p, logits, 3000, c);
    assert_int_equal(c[1] + c[4] + c[7], 3000);
    assert_true(c[1] > 0 && c[4] > 0 && c[7] > 0);
}

// Temperature 1 with no filters follows the softmax: within 4 sigma per token over 20000 draws.
static void test_distribution(void **state) {
    (void)state;
    strata_sampling p = base();
    int n = 20000, c[V];
    histogram(&p, logits, n, c);
    double z = 0;
    for (int i = 0; i < V; i++) z += exp(logits[i]);
    for (int i = 0; i < V; i++) {
        double pi = exp(logits[i]) / z, sd = sqrt(n * pi * (1 - pi));
        assert_true(fabs(c[i] - n * pi) < 4 * sd + 1);
    }
}

// top_p: the smallest set of most likely tokens whose mass reaches p.
static void test_top_p(void **state) {
    (void)state;
    strata_sampling p = base();
    double z = 0;
    for (int i = 0; i < V; i++) z += exp(logits[i]);
    // mass of token 1 then 4: choose p between them so exactly two remain
    p.top_p = (float)((exp(3.0) + exp(2.9) * 0.5) / z);
    int c[V];
    histogram(&p, logits, 2000, c);
    assert_int_equal(c[1] + c[4], 2000);
    assert_true(c[4] > 0);
}

static void test_min_p(void **state) {
    (void)state;
    strata_sampling p = base();
    p.min_p = 0.5f; // keep tokens with p >= 0.5 p_max: e^x >= 0.5 e^3 -> x >= 2.307: 1, 4, 7
    int c[V];
    histogram(&p, logits, 3000, c);
    assert_int_equal(c[1] + c[4] + c[7], 3000);
}

static void test_repeat_penalty(void **state) {
    (void)state;
    strata_sampling p = base();
    p.temperature = 0;
    p.repeat_penalty = 2.0f; // token 1's 3.0 -> 1.5; token 4 (2.9) wins
    st_sampler *s;
    assert_int_equal(st_sampler_create(&p, V, &s), ST_OK);
    float l[V];
    memcpy(l, logits, sizeof l);
    int32_t hist[] = {1, 1, 5};
    assert_int_equal(st_sampler_sample(s, l, hist, 3), 4);
    // presence/frequency: token 4 seen twice with frequency 0.3 -> 2.3; token 7 (2.5) wins
    strata_sampling q = base();
    q.temperature = 0;
    q.repeat_penalty = 1.0f;
    q.frequency_penalty = 0.3f;
    q.presence_penalty = 0.0f;
    st_sampler *s2;
    assert_int_equal(st_sampler_create(&q, V, &s2), ST_OK);
    memcpy(l, logits, sizeof l);
    l[1] = -5; // take token 1 out of the race
    int32_t hist2[] = {4, 4};
    assert_int_equal(st_sampler_sample(s2, l, hist2, 2), 7);
    // penalty_last_n = 1: only the last token (5) is penalized, so 4 wins at 2.9
    q.penalty_last_n = 1;
    st_sampler *s3;
    assert_int_equal(st_sampler_create(&q, V, &s3), ST_OK);
    memcpy(l, logits, sizeof l);
    l[1] = -5;
    int32_t hist3[] = {4, 4, 5};
    assert_int_equal(st_sampler_sample(s3, l, hist3, 3), 4);
    st_sampler_free(s);
    st_sampler_free(s2);
    st_sampler_free(s3);
}

static void test_seed_reproducible(void **state) {
    (void)state;
    strata_sampling p = base();
    p.seed = 42;
    int a[V], b[V];
    histogram(&p, logits, 500, a);
    histogram(&p, logits, 500, b);
    assert_memory_equal(a, b, sizeof a);
    p.seed = 43;
    histogram(&p, logits, 500, b);
    assert_true(memcmp(a, b, sizeof a) != 0);
}

// Each setting out of range is refused, and the message names that setting and no other.
static void test_bad_params(void **state) {
    (void)state;
    static const char *names[] = {"temperature", "top_k", "top_p", "min_p", "repeat_penalty", "penalty_last_n"};
    for (int i = 0; i < 6; i++) {
        strata_sampling p = base();
        switch (i) {
        case 0: p.temperature = -1; break;
        case 1: p.top_k = -2; break;
        case 2: p.top_p = 0; break;
        case 3: p.min_p = NAN; break;
        case 4: p.repeat_penalty = 0; break;
        case 5: p.penalty_last_n = -1; break;
        }
        st_sampler *s;
        assert_int_equal(st_sampler_create(&p, V, &s), ST_ERR_ARG);
        assert_null(s);
        const char *e = st_error();
        assert_non_null(strstr(e, names[i]));
        for (int j = 0; j < 6; j++) {
            // (a name followed by a space: "penalty" alone is in two of them)
            if (j == i) continue;
            char word[32];
            snprintf(word, sizeof word, "%s ", names[j]);
            assert_null(strstr(e, word));
        }
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy),       cmocka_unit_test(test_top_k_one_is_greedy),
        cmocka_unit_test(test_top_k_keeps_k), cmocka_unit_test(test_distribution),
        cmocka_unit_test(test_top_p),        cmocka_unit_test(test_min_p),
        cmocka_unit_test(test_repeat_penalty), cmocka_unit_test(test_seed_reproducible),
        cmocka_unit_test(test_bad_params),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
