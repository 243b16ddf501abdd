// Unit tests for util: error messages, half-precision conversion, memory helpers.
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <string.h>

#include "util/util.h"

static void test_error_messages(void **state) {
    (void)state;
    st_status s = st_fail(ST_ERR_FORMAT, "%s: bad magic at byte %d", "x.gguf", 0);
    assert_int_equal(s, ST_ERR_FORMAT);
    assert_string_equal(st_error(), "x.gguf: bad magic at byte 0");
    st_fail_prefix(ST_ERR_FORMAT, "loading %s", "model");
    assert_string_equal(st_error(), "loading model: x.gguf: bad magic at byte 0");
    assert_string_equal(st_status_name(ST_ERR_NOMEM), "out of memory");
}

// Every half value converts to f32 and back unchanged (NaNs stay NaN).
static void test_f16_roundtrip(void **state) {
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = st_f16_to_f32((st_f16)h);
        st_f16 back = st_f32_to_f16(f);
        if (isnan(f)) assert_true((back & 0x7c00) == 0x7c00 && (back & 0x3ff));
        else assert_int_equal(back, h);
    }
}

// f32 -> f16 rounds to nearest even: check midpoints between consecutive halves.
static void test_f16_rounding(void **state) {
    (void)state;
    assert_int_equal(st_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(st_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(st_f32_to_f16(65520.0f), 0x7c00); // rounds up to inf
    assert_int_equal(st_f32_to_f16(-0.0f), 0x8000);
    for (uint32_t h = 1; h < 0x7bff; h += 7) {
        double a = st_f16_to_f32((st_f16)h), b = st_f16_to_f32((st_f16)(h + 1));
        float mid = (float)((a + b) / 2);
        st_f16 want = (h & 1) ? (st_f16)(h + 1) : (st_f16)h;
        assert_int_equal(st_f32_to_f16(mid), want);
        assert_int_equal(st_f32_to_f16(nextafterf(mid, 0)), h);
        assert_int_equal(st_f32_to_f16(nextafterf(mid, 1e9f)), h + 1);
    }
}

static void test_bf16(void **state) {
    (void)state;
    assert_int_equal(st_f32_to_bf16(1.0f), 0x3f80);
    assert_true(st_bf16_to_f32(0x3f80) == 1.0f);
    // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to even (1.0)
    assert_int_equal(st_f32_to_bf16(1.00390625f), 0x3f80);
    assert_int_equal(st_f32_to_bf16(1.01171875f), 0x3f82);
}

static void test_alloc(void **state) {
    (void)state;
    void *p = st_alloc(100);
    assert_non_null(p);
    assert_int_equal((uintptr_t)p % ST_ALIGN, 0);
    st_free(p);
    assert_null(st_calloc(SIZE_MAX / 2, 4));
    assert_non_null(strstr(st_error(), "overflows"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_error_messages), cmocka_unit_test(test_f16_roundtrip),
        cmocka_unit_test(test_f16_rounding),   cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_alloc),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
