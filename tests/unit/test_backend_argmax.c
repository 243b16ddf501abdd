// Unit test for the CPU backend's argmax: the index the plain loop `if (r[j] > r[best]) best = j`
// finds (the first of the largest values; a NaN only from r[0]), on random rows with ties and
// NaNs, of widths around its eight lanes.
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>

#include "backend/backend.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 32);
}

static int plain_argmax(const float *r, int d) {
    int best = 0;
    for (int j = 1; j < d; j++) best = r[j] > r[best] ? j : best;
    return best;
}

static void test_argmax_matches_plain_loop(void **state) {
    (void)state;
    st_backend *b = NULL;
    assert_int_equal(st_backend_cpu_create(1, &b), ST_OK);
    const int widths[] = {1, 7, 8, 9, 15, 16, 17, 100, 1000, 151936};
    for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++) {
        int d = widths[w];
        float *x = malloc(sizeof(float) * (size_t)d * 3);
        for (int trial = 0; trial < 20; trial++) {
            for (int i = 0; i < 3 * d; i++) {
                // Few distinct values (ties), signed zeros, and now and then a NaN.
                uint32_t u = rnd();
                x[i] = (float)((int)(u % 9) - 4) * (u & 512 ? -1.0f : 1.0f) * (u % 9 == 4 ? 0.0f : 1.0f);
                if (u % 97 == 0) x[i] = NAN;
            }
            if (trial == 1) x[0] = NAN;   // a NaN first: the loop keeps it
            if (trial == 2) x[d - 1] = 9; // the largest last
            int32_t ids[3];
            b->ops->argmax(b, x, 3, d, ids);
            for (int i = 0; i < 3; i++) assert_int_equal(ids[i], plain_argmax(x + (size_t)i * d, d));
        }
        free(x);
    }
    st_backend_free(b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_argmax_matches_plain_loop),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
