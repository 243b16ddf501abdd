// Unit tests for the GGUF reader and writer: round trips of every value type, v2 files, nested
// arrays, alignment, shards, and one corruption per validation rule (each checks the message).
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf/gguf.h"

// ---------------------------------------------------------------------------------------------
// A byte builder for hand-made files, so each corruption sits at a known offset.

typedef struct bb {
    uint8_t p[1 << 16];
    size_t n;
} bb;

static void b_le(bb *b, uint64_t v, int n) {
    for (int i = 0; i < n; i++) b->p[b->n++] = (uint8_t)(v >> (8 * i));
}
static void b_str(bb *b, const char *s) {
    b_le(b, strlen(s), 8);
    memcpy(b->p + b->n, s, strlen(s));
    b->n += strlen(s);
}
static void b_hdr(bb *b, uint32_t version, uint64_t n_t, uint64_t n_kv) {
    memcpy(b->p, "GGUF", 4);
    b->n = 4;
    b_le(b, version, 4);
    b_le(b, n_t, 8);
    b_le(b, n_kv, 8);
}
static void b_kv_u32(bb *b, const char *key, uint32_t v) {
    b_str(b, key);
    b_le(b, ST_GGUF_U32, 4);
    b_le(b, v, 4);
}
// Returns the info's offset.
static size_t b_tinfo(bb *b, const char *name, int n_dims, const int64_t *ne, int type, uint64_t off) {
    size_t at = b->n;
    b_str(b, name);
    b_le(b, (uint64_t)n_dims, 4);
    for (int d = 0; d < n_dims; d++) b_le(b, (uint64_t)ne[d], 8);
    b_le(b, (uint64_t)type, 4);
    b_le(b, off, 8);
    return at;
}
static void b_pad(bb *b, size_t a) {
    while (b->n % a) b->p[b->n++] = 0;
}
static void b_zeros(bb *b, size_t n) {
    memset(b->p + b->n, 0, n);
    b->n += n;
}

// Opening must fail with `code` and a message holding every one of the NULL-terminated parts.
static void expect_fail(const bb *b, st_status code, ...) {
    st_gguf *g = NULL;
    st_status s = st_gguf_open_memory(b->p, b->n, "m.gguf", &g);
    if (s == ST_OK) st_gguf_free(g);
    assert_null(g);
    const char *msg = st_error();
    if (getenv("ST_TEST_VERBOSE")) fprintf(stderr, "  %s\n", msg);
    va_list ap;
    va_start(ap, code);
    for (const char *part; (part = va_arg(ap, const char *));) {
        if (!strstr(msg, part)) {
            fprintf(stderr, "message: %s\nmissing: %s\n", msg, part);
            fail();
        }
    }
    va_end(ap);
    if (s != code) fprintf(stderr, "status %d, message: %s\n", s, msg);
    assert_int_equal(s, code);
}

static bb B; // one at a time; 64 KiB is too much for the stack under ASan

// A valid two-tensor file: key general.architecture, tensors a (f32 8x2) and b (q8_0 32x1).
static void good_file(bb *b, size_t *info_a, size_t *info_b) {
    b_hdr(b, 3, 2, 1);
    b_str(b, "general.architecture");
    b_le(b, ST_GGUF_STRING, 4);
    b_str(b, "test");
    int64_t ne_a[2] = {8, 2}, ne_b[1] = {32};
    size_t ia = b_tinfo(b, "a", 2, ne_a, ST_TYPE_F32, 0);
    size_t ib = b_tinfo(b, "b", 1, ne_b, ST_TYPE_Q8_0, 64);
    if (info_a) *info_a = ia;
    if (info_b) *info_b = ib;
    b_pad(b, 32);
    b_zeros(b, 64 + 34);
}

// ---------------------------------------------------------------------------------------------
// Round trips

static void test_roundtrip_all_types(void **state) {
    (void)state;
    st_gguf_writer *w = st_gguf_writer_create();
    assert_non_null(w);
    uint8_t u8 = 200;
    int8_t i8 = -100;
    uint16_t u16 = 60000;
    int16_t i16 = -30000;
    int32_t i32 = -2000000000;
    uint64_t u64 = 0xfedcba9876543210ull;
    int64_t i64 = -0x123456789abcdefll;
    double f64 = 3.141592653589793;
    assert_int_equal(st_gguf_writer_add_scalar(w, "k.u8", ST_GGUF_U8, &u8), ST_OK);
    assert_int_equal(st_gguf_writer_add_scalar(w, "k.i8", ST_GGUF_I8, &i8), ST_OK);
    assert_int_equal(st_gguf_writer_add_scalar(w, "k.u16", ST_GGUF_U16, &u16), ST_OK);
    assert_int_equal(st_gguf_writer_add_scalar(w, "k.i16", ST_GGUF_I16, &i16), ST_OK);
    assert_int_equal(st_gguf_writer_add_u32(w, "k.u32", 4000000000u), ST_OK);
    assert_int_equal(st_gguf_writer_add_i32(w, "k.i32", i32), ST_OK);
    assert_int_equal(st_gguf_writer_add_f32(w, "k.f32", 1.5e-6f), ST_OK);
    assert_int_equal(st_gguf_writer_add_bool(w, "k.bool", true), ST_OK);
    assert_int_equal(st_gguf_writer_add_str(w, "k.str", "héllo"), ST_OK);
    assert_int_equal(st_gguf_writer_add_u64(w, "k.u64", u64), ST_OK);
    assert_int_equal(st_gguf_writer_add_scalar(w, "k.i64", ST_GGUF_I64, &i64), ST_OK);
    assert_int_equal(st_gguf_writer_add_scalar(w, "k.f64", ST_GGUF_F64, &f64), ST_OK);
    assert_int_equal(st_gguf_writer_add_strn(w, "k.empty", "", 0), ST_OK);
    uint8_t a_u8[] = {1, 2, 255};
    int8_t a_i8[] = {-1, 0, 127};
    uint16_t a_u16[] = {1, 65535};
    int16_t a_i16[] = {-32768, 5};
    uint32_t a_u32[] = {7, 0xffffffffu};
    int32_t a_i32[] = {-7, 1 << 30};
    float a_f32[] = {0.5f, -2.25f};
    bool a_bool[] = {true, false, true};
    uint64_t a_u64[] = {1, 0xffffffffffffffffull};
    int64_t a_i64[] = {-5, 1ll << 62};
    double a_f64[] = {1e300, -0.125};
    const char *a_str[] = {"a", "", "ccc", "Ġhello"};
    struct {
        const char *k;
        st_gguf_vtype t;
        const void *p;
        uint64_t n;
    } arrs[] = {
        {"a.u8", ST_GGUF_U8, a_u8, 3},    {"a.i8", ST_GGUF_I8, a_i8, 3},
        {"a.u16", ST_GGUF_U16, a_u16, 2}, {"a.i16", ST_GGUF_I16, a_i16, 2},
        {"a.u32", ST_GGUF_U32, a_u32, 2}, {"a.i32", ST_GGUF_I32, a_i32, 2},
        {"a.f32", ST_GGUF_F32, a_f32, 2}, {"a.bool", ST_GGUF_BOOL, a_bool, 3},
        {"a.u64", ST_GGUF_U64, a_u64, 2}, {"a.i64", ST_GGUF_I64, a_i64, 2},
        {"a.f64", ST_GGUF_F64, a_f64, 2}, {"a.empty", ST_GGUF_I32, a_i32, 0},
    };
    for (size_t i = 0; i < sizeof arrs / sizeof arrs[0]; i++)
        assert_int_equal(st_gguf_writer_add_arr(w, arrs[i].k, arrs[i].t, arrs[i].p, arrs[i].n), ST_OK);
    assert_int_equal(st_gguf_writer_add_str_arr(w, "a.str", a_str, 4), ST_OK);
    // Duplicates are refused.
    assert_int_equal(st_gguf_writer_add_u32(w, "k.u32", 1), ST_ERR_ARG);
    assert_non_null(strstr(st_error(), "duplicate key 'k.u32'"));

    float t0[16];
    for (int i = 0; i < 16; i++) t0[i] = (float)i * 0.5f;
    uint8_t t1[2 * 34];
    for (size_t i = 0; i < sizeof t1; i++) t1[i] = (uint8_t)(i * 7);
    uint16_t t2[3 * 5 * 2];
    for (int i = 0; i < 30; i++) t2[i] = (uint16_t)(0x3c00 + i);
    int64_t ne0[2] = {8, 2}, ne1[2] = {32, 2}, ne2[3] = {3, 5, 2};
    assert_int_equal(st_gguf_writer_add_tensor(w, "t.f32", ST_TYPE_F32, 2, ne0, t0, sizeof t0), ST_OK);
    assert_int_equal(st_gguf_writer_add_tensor(w, "t.q8", ST_TYPE_Q8_0, 2, ne1, t1, sizeof t1), ST_OK);
    assert_int_equal(st_gguf_writer_add_tensor(w, "t.f16", ST_TYPE_F16, 3, ne2, t2, sizeof t2), ST_OK);
    assert_int_equal(st_gguf_writer_add_tensor(w, "t.f16", ST_TYPE_F16, 3, ne2, t2, sizeof t2), ST_ERR_ARG);
    assert_int_equal(st_gguf_writer_add_tensor(w, "t.bad", ST_TYPE_Q8_0, 1, ne2, t1, 34), ST_ERR_ARG);
    assert_non_null(strstr(st_error(), "not a multiple of the q8_0 block size 32"));
    assert_int_equal(st_gguf_writer_add_tensor(w, "t.bad", ST_TYPE_F32, 1, ne0, t0, 4), ST_ERR_ARG);

    void *data;
    size_t size;
    assert_int_equal(st_gguf_writer_write_memory(w, &data, &size), ST_OK);
    st_gguf_writer_free(w);
    st_gguf *g;
    st_status s = st_gguf_open_memory(data, size, "rt.gguf", &g);
    if (s) fprintf(stderr, "%s\n", st_error());
    assert_int_equal(s, ST_OK);
    assert_int_equal(st_gguf_version(g), 3);
    assert_int_equal(st_gguf_kv_count(g), 13 + 13);

    uint32_t vu32;
    int64_t vi64;
    uint64_t vu64;
    float vf;
    double vd;
    bool vb;
    const char *str;
    size_t len;
    assert_true(st_gguf_get_u32(g, "k.u8", &vu32) && vu32 == 200);
    assert_true(st_gguf_get_i64(g, "k.i8", &vi64) && vi64 == -100);
    assert_false(st_gguf_get_u32(g, "k.i8", &vu32)); // negative does not fit
    assert_true(st_gguf_get_u32(g, "k.u16", &vu32) && vu32 == 60000);
    assert_true(st_gguf_get_i64(g, "k.i16", &vi64) && vi64 == -30000);
    assert_true(st_gguf_get_u32(g, "k.u32", &vu32) && vu32 == 4000000000u);
    assert_true(st_gguf_get_i64(g, "k.i32", &vi64) && vi64 == i32);
    assert_true(st_gguf_get_f32(g, "k.f32", &vf) && vf == 1.5e-6f);
    assert_true(st_gguf_get_bool(g, "k.bool", &vb) && vb);
    assert_true(st_gguf_get_str(g, "k.str", &str, &len) && len == strlen("héllo") &&
                !memcmp(str, "héllo", len));
    assert_true(st_gguf_get_u64(g, "k.u64", &vu64) && vu64 == u64);
    assert_false(st_gguf_get_i64(g, "k.u64", &vi64)); // does not fit
    assert_false(st_gguf_get_u32(g, "k.u64", &vu32));
    assert_true(st_gguf_get_i64(g, "k.i64", &vi64) && vi64 == i64);
    assert_true(st_gguf_get_f64(g, "k.f64", &vd) && vd == f64);
    assert_true(st_gguf_get_str(g, "k.empty", &str, &len) && len == 0);
    assert_false(st_gguf_get_u32(g, "k.str", &vu32)); // wrong type
    assert_false(st_gguf_get_str(g, "k.u32", &str, &len));
    assert_false(st_gguf_get_u32(g, "absent", &vu32));
    assert_int_equal(st_gguf_find_key(g, "absent"), -1);
    assert_int_equal(st_gguf_kv_type(g, st_gguf_find_key(g, "k.f64")), ST_GGUF_F64);

    st_gguf_vtype et;
    uint64_t cnt;
    const void *ad;
    assert_true(st_gguf_get_arr(g, "a.u8", &et, &cnt, &ad) && et == ST_GGUF_U8 && cnt == 3 &&
                !memcmp(ad, a_u8, 3));
    assert_true(st_gguf_arr_i64(g, "a.i8", 0, &vi64) && vi64 == -1);
    assert_true(st_gguf_arr_i64(g, "a.u16", 1, &vi64) && vi64 == 65535);
    assert_true(st_gguf_arr_i64(g, "a.i16", 0, &vi64) && vi64 == -32768);
    assert_true(st_gguf_arr_i64(g, "a.u32", 1, &vi64) && vi64 == 0xffffffffll);
    assert_true(st_gguf_arr_i64(g, "a.i32", 1, &vi64) && vi64 == (1 << 30));
    assert_true(st_gguf_arr_f64(g, "a.f32", 1, &vd) && vd == -2.25);
    assert_true(st_gguf_get_arr(g, "a.bool", &et, &cnt, &ad) && et == ST_GGUF_BOOL && cnt == 3);
    assert_memory_equal(ad, "\1\0\1", 3);
    assert_false(st_gguf_arr_i64(g, "a.u64", 1, &vi64)); // 2^64-1 does not fit
    assert_true(st_gguf_get_arr(g, "a.u64", &et, &cnt, &ad));
    memcpy(&vu64, (const uint8_t *)ad + 8, 8);
    assert_true(vu64 == a_u64[1]);
    assert_true(st_gguf_arr_i64(g, "a.i64", 1, &vi64) && vi64 == (1ll << 62));
    assert_true(st_gguf_arr_f64(g, "a.f64", 0, &vd) && vd == 1e300);
    assert_true(st_gguf_arr_f64(g, "a.i32", 0, &vd) && vd == -7.0);
    assert_false(st_gguf_arr_i64(g, "a.i32", 2, &vi64)); // out of range
    assert_true(st_gguf_get_arr(g, "a.empty", &et, &cnt, &ad) && cnt == 0);
    for (int i = 0; i < 4; i++) {
        assert_true(st_gguf_arr_str(g, "a.str", (uint64_t)i, &str, &len));
        assert_int_equal(len, strlen(a_str[i]));
        assert_memory_equal(str, a_str[i], len);
    }
    assert_false(st_gguf_arr_str(g, "a.str", 4, &str, &len));
    assert_false(st_gguf_arr_str(g, "a.i32", 0, &str, &len));
    assert_false(st_gguf_arr_i64(g, "a.str", 0, &vi64));

    assert_int_equal(st_gguf_tensor_count(g), 3);
    const st_gguf_tensor *t = st_gguf_find_tensor(g, "t.q8");
    assert_non_null(t);
    assert_int_equal(t->type, ST_TYPE_Q8_0);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->ne[0], 32);
    assert_int_equal(t->ne[1], 2);
    assert_int_equal(t->ne[2], 1);
    assert_int_equal(t->bytes, sizeof t1);
    assert_memory_equal(t->data, t1, sizeof t1);
    assert_int_equal(t->offset % 32, 0);
    t = st_gguf_find_tensor(g, "t.f16");
    assert_int_equal(t->ne[2], 2);
    assert_memory_equal(t->data, t2, sizeof t2);
    assert_memory_equal(st_gguf_find_tensor(g, "t.f32")->data, t0, sizeof t0);
    assert_ptr_equal(st_gguf_tensor_at(g, 0), st_gguf_find_tensor(g, "t.f32"));
    assert_null(st_gguf_tensor_at(g, 3));
    assert_null(st_gguf_find_tensor(g, "nope"));

    // Copying every key into a new file gives the same metadata bytes.
    st_gguf_writer *w2 = st_gguf_writer_create();
    for (int64_t i = 0; i < st_gguf_kv_count(g); i++)
        assert_int_equal(st_gguf_writer_copy_kv(w2, g, i), ST_OK);
    void *data2;
    size_t size2;
    assert_int_equal(st_gguf_writer_write_memory(w2, &data2, &size2), ST_OK);
    st_gguf_writer_free(w2);
    st_gguf *g2;
    assert_int_equal(st_gguf_open_memory(data2, size2, "copy.gguf", &g2), ST_OK);
    assert_int_equal(st_gguf_kv_count(g2), st_gguf_kv_count(g));
    for (int64_t i = 0; i < st_gguf_kv_count(g); i++) {
        const st_gguf_kv *a = st_gguf_kv_at(g, i), *b = st_gguf_kv_at(g2, i);
        assert_string_equal(a->key, b->key);
        assert_int_equal(a->type, b->type);
        assert_int_equal(a->value_bytes, b->value_bytes);
        assert_memory_equal(a->value, b->value, a->value_bytes);
    }
    st_gguf_free(g2);
    st_free(data2);
    st_gguf_free(g);
    st_free(data);
}

// Alignment other than 32, written to a file and opened through the mmap path and read into memory.
static void test_alignment_file(void **state) {
    (void)state;
    char path[] = "/tmp/st_gguf_align_XXXXXX.gguf";
    int fd = mkstemps(path, 5);
    assert_true(fd >= 0);
    close(fd);
    st_gguf_writer *w = st_gguf_writer_create();
    assert_int_equal(st_gguf_writer_set_alignment(w, 48), ST_ERR_ARG);
    assert_int_equal(st_gguf_writer_set_alignment(w, 256), ST_OK);
    float a[3] = {1, 2, 3}, b[5] = {4, 5, 6, 7, 8};
    int64_t na = 3, nb = 5;
    assert_int_equal(st_gguf_writer_add_tensor(w, "a", ST_TYPE_F32, 1, &na, a, sizeof a), ST_OK);
    assert_int_equal(st_gguf_writer_add_tensor(w, "b", ST_TYPE_F32, 1, &nb, b, sizeof b), ST_OK);
    assert_int_equal(st_gguf_writer_write(w, path), ST_OK);
    st_gguf_writer_free(w);
    st_gguf *g;
    assert_int_equal(st_gguf_open(path, &g), ST_OK);
    uint32_t al;
    assert_true(st_gguf_get_u32(g, "general.alignment", &al) && al == 256);
    assert_int_equal(st_gguf_alignment(g), 256);
    assert_int_equal(st_gguf_shard_count(g), 1);
    const st_gguf_tensor *tb = st_gguf_find_tensor(g, "b");
    assert_int_equal(tb->offset % 256, 0);
    assert_memory_equal(tb->data, b, sizeof b);
    assert_int_equal(st_gguf_file_bytes(g), tb->offset + 256);
    st_gguf_free(g);
    // Read into memory (--no-mmap) instead of mapped: the same tensors and bytes.
    assert_int_equal(st_gguf_open_ex(path, true, &g), ST_OK);
    tb = st_gguf_find_tensor(g, "b");
    assert_int_equal(tb->offset % 256, 0);
    assert_memory_equal(tb->data, b, sizeof b);
    assert_memory_equal(st_gguf_find_tensor(g, "a")->data, a, sizeof a);
    assert_int_equal(st_gguf_file_bytes(g), tb->offset + 256);
    st_gguf_free(g);
    unlink(path);

    // An unwritable path is a clear error.
    w = st_gguf_writer_create();
    assert_int_equal(st_gguf_writer_write(w, "/nonexistent-dir/x.gguf"), ST_ERR_IO);
    assert_non_null(strstr(st_error(), "/nonexistent-dir/x.gguf: cannot open for writing"));
    st_gguf_writer_free(w);
    assert_int_equal(st_gguf_open("/nonexistent-dir/x.gguf", &g), ST_ERR_IO);
    assert_non_null(strstr(st_error(), "cannot open"));
    assert_int_equal(st_gguf_open("/tmp", &g), ST_ERR_IO);
    assert_non_null(strstr(st_error(), "/tmp: not a regular file"));
}

// A v2 file with nested arrays opens; its values read back.
static void test_v2_nested(void **state) {
    (void)state;
    bb *b = &B;
    b_hdr(b, 2, 1, 2);
    b_str(b, "nested");
    b_le(b, ST_GGUF_ARRAY, 4);
    b_le(b, ST_GGUF_ARRAY, 4); // array of 2 arrays
    b_le(b, 2, 8);
    b_le(b, ST_GGUF_STRING, 4); // ["xy", "z"]
    b_le(b, 2, 8);
    b_str(b, "xy");
    b_str(b, "z");
    b_le(b, ST_GGUF_U16, 4); // [7]
    b_le(b, 1, 8);
    b_le(b, 7, 2);
    b_kv_u32(b, "after", 99);
    int64_t ne[1] = {4};
    b_tinfo(b, "t", 1, ne, ST_TYPE_F32, 0);
    b_pad(b, 32);
    b_zeros(b, 16);
    st_gguf *g;
    st_status s = st_gguf_open_memory(b->p, b->n, "v2.gguf", &g);
    if (s) fprintf(stderr, "%s\n", st_error());
    assert_int_equal(s, ST_OK);
    assert_int_equal(st_gguf_version(g), 2);
    st_gguf_vtype et;
    uint64_t cnt;
    const void *d;
    assert_true(st_gguf_get_arr(g, "nested", &et, &cnt, &d) && et == ST_GGUF_ARRAY && cnt == 2);
    uint32_t v;
    assert_true(st_gguf_get_u32(g, "after", &v) && v == 99);
    assert_int_equal(st_gguf_tensor_at(g, 0)->ne[0], 4);
    st_gguf_free(g);
}

// Every prefix of a valid file fails cleanly (no read past the end; ASan watches).
static void test_truncated_everywhere(void **state) {
    (void)state;
    bb *b = &B;
    good_file(b, NULL, NULL);
    for (size_t n = 0; n < b->n; n++) {
        uint8_t *copy = malloc(n ? n : 1); // exactly n bytes: ASan catches any overread
        memcpy(copy, b->p, n);
        st_gguf *g = NULL;
        st_status s = st_gguf_open_memory(copy, n, "cut.gguf", &g);
        assert_int_not_equal(s, ST_OK);
        assert_null(g);
        assert_non_null(strstr(st_error(), "cut.gguf"));
        free(copy);
    }
    st_gguf *g;
    assert_int_equal(st_gguf_open_memory(b->p, b->n, "ok.gguf", &g), ST_OK);
    st_gguf_free(g);
}

// ---------------------------------------------------------------------------------------------
// One corruption per rule; the message names the file, the place and the thing at fault.

static void test_bad_header(void **state) {
    (void)state;
    bb *b = &B;
    good_file(b, NULL, NULL);
    memcpy(b->p, "GGUG", 4);
    expect_fail(b, ST_ERR_FORMAT, "m.gguf: not a GGUF file", "magic at byte 0", "'GGUG'", NULL);
    good_file(b, NULL, NULL);
    b->p[4] = 1;
    expect_fail(b, ST_ERR_UNSUPPORTED, "m.gguf: GGUF version 1", NULL);
    b->p[4] = 4;
    expect_fail(b, ST_ERR_UNSUPPORTED, "m.gguf: GGUF version 4 at byte 4", NULL);
    b->p[4] = 0, b->p[7] = 3;
    expect_fail(b, ST_ERR_UNSUPPORTED, "big-endian", NULL);
    good_file(b, NULL, NULL);
    b->n = 20;
    expect_fail(b, ST_ERR_FORMAT,
                "m.gguf: header: kv_count at byte 16 needs 8 bytes but the file ends at byte 20", NULL);
    // Counts that cannot fit in the file are refused before any allocation.
    good_file(b, NULL, NULL);
    memset(b->p + 8, 0xff, 7);
    expect_fail(b, ST_ERR_FORMAT, "m.gguf: header: tensor_count 72057594037927935 at byte 8 cannot fit",
                NULL);
    good_file(b, NULL, NULL);
    memset(b->p + 16, 0xff, 8);
    expect_fail(b, ST_ERR_FORMAT, "kv_count 18446744073709551615 at byte 16 cannot fit", NULL);
}

static void test_bad_kv(void **state) {
    (void)state;
    bb *b = &B;
    // Key length past the end.
    good_file(b, NULL, NULL);
    b->p[24 + 5] = 0x10;
    expect_fail(b, ST_ERR_FORMAT, "m.gguf: key #0 (at byte 24): key length at byte 24 has length",
                "runs past the end", NULL);
    // Unknown value type.
    b_hdr(b, 3, 0, 1);
    b_str(b, "k");
    b_le(b, 13, 4);
    b_le(b, 0, 8);
    expect_fail(b, ST_ERR_FORMAT,
                "m.gguf: key 'k' (at byte 24): value type 13 at byte 33 is not a GGUF value type", NULL);
    // String value length past the end.
    b_hdr(b, 3, 0, 1);
    b_str(b, "name");
    b_le(b, ST_GGUF_STRING, 4);
    b_le(b, 1000, 8);
    b_zeros(b, 20);
    expect_fail(b, ST_ERR_FORMAT, "key 'name' (at byte 24): string length at byte 40 has length 1000", NULL);
    // Array count that cannot fit.
    b_hdr(b, 3, 0, 1);
    b_str(b, "arr");
    b_le(b, ST_GGUF_ARRAY, 4);
    b_le(b, ST_GGUF_U32, 4);
    b_le(b, 1ull << 40, 8);
    b_zeros(b, 16);
    expect_fail(b, ST_ERR_FORMAT, "key 'arr' (at byte 24): array count 1099511627776 at byte 43 cannot fit",
                NULL);
    // Bad array element type.
    b_hdr(b, 3, 0, 1);
    b_str(b, "arr");
    b_le(b, ST_GGUF_ARRAY, 4);
    b_le(b, 77, 4);
    b_le(b, 1, 8);
    expect_fail(b, ST_ERR_FORMAT, "key 'arr' (at byte 24): array element type 77 at byte 39", NULL);
    // Bool that is neither 0 nor 1, as a value and in an array.
    b_hdr(b, 3, 0, 1);
    b_str(b, "flag");
    b_le(b, ST_GGUF_BOOL, 4);
    b_le(b, 2, 1);
    expect_fail(b, ST_ERR_FORMAT, "key 'flag' (at byte 24): bool value at byte 40 is 2, not 0 or 1", NULL);
    b_hdr(b, 3, 0, 1);
    b_str(b, "flags");
    b_le(b, ST_GGUF_ARRAY, 4);
    b_le(b, ST_GGUF_BOOL, 4);
    b_le(b, 3, 8);
    b_le(b, 0x050001, 3);
    expect_fail(b, ST_ERR_FORMAT, "key 'flags' (at byte 24): bool element at byte 55 is 5", NULL);
    // Duplicate key.
    b_hdr(b, 3, 0, 2);
    b_kv_u32(b, "dup", 1);
    b_kv_u32(b, "dup", 2);
    expect_fail(b, ST_ERR_FORMAT, "m.gguf: key 'dup' (at byte 43): duplicate key (key #0", NULL);
    // Empty key and a NUL inside a key.
    b_hdr(b, 3, 0, 1);
    b_kv_u32(b, "", 1);
    expect_fail(b, ST_ERR_FORMAT, "m.gguf: key at byte 24 is empty", NULL);
    b_hdr(b, 3, 0, 1);
    b_kv_u32(b, "a?b", 1);
    b->p[24 + 8 + 1] = 0;
    expect_fail(b, ST_ERR_FORMAT, "m.gguf: key 'a?b' at byte 24 contains a NUL byte", NULL);
    // Arrays nested too deep.
    b_hdr(b, 3, 0, 1);
    b_str(b, "deep");
    b_le(b, ST_GGUF_ARRAY, 4);
    for (int i = 0; i < 40; i++) {
        b_le(b, ST_GGUF_ARRAY, 4);
        b_le(b, 1, 8);
    }
    b_le(b, ST_GGUF_U8, 4);
    b_le(b, 1, 8);
    b_le(b, 1, 1);
    expect_fail(b, ST_ERR_FORMAT, "key 'deep' (at byte 24): arrays nested deeper than 16 levels", NULL);
    // Alignment: not a power of two, zero, not an integer.
    for (int k = 0; k < 3; k++) {
        b_hdr(b, 3, 0, 1);
        if (k == 2) {
            b_str(b, "general.alignment");
            b_le(b, ST_GGUF_STRING, 4);
            b_str(b, "32");
        } else {
            b_kv_u32(b, "general.alignment", k == 0 ? 48 : 0);
        }
        if (k == 2)
            expect_fail(b, ST_ERR_FORMAT, "m.gguf: key 'general.alignment' (value at byte 53) is a string",
                        NULL);
        else
            expect_fail(b, ST_ERR_FORMAT,
                        "m.gguf: key 'general.alignment' (value at byte 53) = ", "not a power of two", NULL);
    }
}

static void test_bad_tensor_info(void **state) {
    (void)state;
    bb *b = &B;
    size_t ia, ib;
    char want[200];
    // n_dims 5.
    good_file(b, &ia, &ib);
    b->p[ib + 8 + 1] = 5;
    snprintf(want, sizeof want, "m.gguf: tensor 'b' (info at byte %zu): n_dims 5 at byte %zu is not in 1..4",
             ib, ib + 9);
    expect_fail(b, ST_ERR_FORMAT, want, NULL);
    good_file(b, &ia, &ib);
    b->p[ib + 8 + 1] = 0;
    expect_fail(b, ST_ERR_FORMAT, "tensor 'b'", "n_dims 0", "is not in 1..4", NULL);
    // A zero dimension.
    good_file(b, &ia, &ib);
    memset(b->p + ia + 9 + 4 + 8, 0, 8);
    snprintf(want, sizeof want, "m.gguf: tensor 'a' (info at byte %zu): ne[1] = 0 at byte %zu is not in", ia,
             ia + 21);
    expect_fail(b, ST_ERR_FORMAT, want, NULL);
    // Element count overflow.
    b_hdr(b, 3, 1, 0);
    int64_t big[3] = {1ll << 32, 1ll << 20, 1ll << 20};
    b_tinfo(b, "huge", 3, big, ST_TYPE_F32, 0);
    expect_fail(b, ST_ERR_FORMAT,
                "m.gguf: tensor 'huge' (info at byte 24): the element count overflows at ne[2]", NULL);
    // Byte size overflow (the element count fits, the bytes do not).
    b_hdr(b, 3, 1, 0);
    int64_t big2[2] = {1ll << 32, 1ll << 29};
    b_tinfo(b, "huge", 2, big2, ST_TYPE_F32, 0);
    expect_fail(b, ST_ERR_FORMAT, "tensor 'huge' (info at byte 24): the byte size of", "overflows", NULL);
    // Unknown type.
    good_file(b, &ia, &ib);
    b->p[ib + 9 + 4 + 8] = 4; // id 4 was removed from ggml
    snprintf(want, sizeof want,
             "m.gguf: tensor 'b' (info at byte %zu): type 4 at byte %zu is not a known tensor type", ib,
             ib + 21);
    expect_fail(b, ST_ERR_UNSUPPORTED, want, NULL);
    // ne0 not a multiple of the block size.
    good_file(b, &ia, &ib);
    b->p[ib + 9 + 4] = 31;
    snprintf(want, sizeof want,
             "tensor 'b' (info at byte %zu): ne[0] = 31 is not a multiple of the q8_0 block size 32", ib);
    expect_fail(b, ST_ERR_FORMAT, want, NULL);
    // Misaligned offset.
    good_file(b, &ia, &ib);
    b->p[ib + 9 + 4 + 8 + 4] = 65;
    snprintf(
        want, sizeof want,
        "tensor 'b' (info at byte %zu): data offset 65 at byte %zu is not a multiple of the alignment 32", ib,
        ib + 25);
    expect_fail(b, ST_ERR_FORMAT, want, NULL);
    // Data past the end of the file.
    good_file(b, &ia, &ib);
    b->n -= 1;
    snprintf(want, sizeof want, "m.gguf: tensor 'b' (info at byte %zu): data [", ib);
    char size_part[64];
    snprintf(size_part, sizeof size_part, ") runs past the end of the file (size %zu)", b->n);
    expect_fail(b, ST_ERR_FORMAT, want, size_part, NULL);
    // An offset far past the end (no overflow in the check).
    good_file(b, &ia, &ib);
    memset(b->p + ib + 9 + 4 + 8 + 4, 0xff, 8);
    memset(b->p + ib + 9 + 4 + 8 + 4, 0xe0, 1);
    expect_fail(b, ST_ERR_FORMAT, "tensor 'b'", "runs past the end of the file", NULL);
    // Overlapping tensors.
    good_file(b, &ia, &ib);
    b->p[ib + 9 + 4 + 8 + 4] = 32; // b now starts inside a (a is 64 bytes)
    snprintf(want, sizeof want, "m.gguf: tensor 'b' (info at byte %zu): data [", ib);
    expect_fail(b, ST_ERR_FORMAT, want, "overlaps tensor 'a'", NULL);
    // Duplicate tensor names.
    good_file(b, &ia, &ib);
    b->p[ib + 8] = 'a';
    snprintf(want, sizeof want,
             "m.gguf: tensor 'a' (info at byte %zu): duplicate tensor name (the info at byte %zu", ib, ia);
    expect_fail(b, ST_ERR_FORMAT, want, NULL);
    // Empty tensor name.
    b_hdr(b, 3, 1, 0);
    int64_t one = 4;
    b_tinfo(b, "", 1, &one, ST_TYPE_F32, 0);
    expect_fail(b, ST_ERR_FORMAT, "m.gguf: tensor name at byte 24 is empty", NULL);
}

// ---------------------------------------------------------------------------------------------
// Shards

// Shard i of n holding one tensor; tensors_count < 0 leaves split.tensors.count out.
static void write_shard(const char *dir, int i, int n, int split_no, const char *tensor, int tensors_count) {
    char path[512];
    snprintf(path, sizeof path, "%s/model-%05d-of-%05d.gguf", dir, i + 1, n);
    st_gguf_writer *w = st_gguf_writer_create();
    if (i == 0) assert_int_equal(st_gguf_writer_add_str(w, "general.architecture", "test"), ST_OK);
    uint16_t no = (uint16_t)split_no, cnt = (uint16_t)n;
    assert_int_equal(st_gguf_writer_add_scalar(w, "split.no", ST_GGUF_U16, &no), ST_OK);
    assert_int_equal(st_gguf_writer_add_scalar(w, "split.count", ST_GGUF_U16, &cnt), ST_OK);
    if (tensors_count >= 0)
        assert_int_equal(st_gguf_writer_add_i32(w, "split.tensors.count", tensors_count), ST_OK);
    float v[4] = {(float)i, 1, 2, 3};
    int64_t ne = 4;
    assert_int_equal(st_gguf_writer_add_tensor(w, tensor, ST_TYPE_F32, 1, &ne, v, sizeof v), ST_OK);
    assert_int_equal(st_gguf_writer_write(w, path), ST_OK);
    st_gguf_writer_free(w);
}

static void test_shards(void **state) {
    (void)state;
    char dir[] = "/tmp/st_gguf_shards_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char p1[512], p2[512], p3[512];
    snprintf(p1, sizeof p1, "%s/model-00001-of-00003.gguf", dir);
    snprintf(p2, sizeof p2, "%s/model-00002-of-00003.gguf", dir);
    snprintf(p3, sizeof p3, "%s/model-00003-of-00003.gguf", dir);
    write_shard(dir, 0, 3, 0, "t0", 3);
    write_shard(dir, 1, 3, 1, "t1", -1);
    // A missing shard is a clear error naming it.
    st_gguf *g;
    assert_int_equal(st_gguf_open(p1, &g), ST_ERR_IO);
    assert_non_null(strstr(st_error(), "shard 3 of 3 is missing"));
    assert_non_null(strstr(st_error(), "model-00003-of-00003.gguf: cannot open"));
    write_shard(dir, 2, 3, 2, "t2", -1);
    // Any shard's name opens the whole model.
    const char *paths[3] = {p1, p2, p3};
    for (int k = 0; k < 3; k++) {
        st_status s = st_gguf_open(paths[k], &g);
        if (s) fprintf(stderr, "%s\n", st_error());
        assert_int_equal(s, ST_OK);
        assert_int_equal(st_gguf_shard_count(g), 3);
        assert_string_equal(st_gguf_path(g), p1);
        assert_int_equal(st_gguf_tensor_count(g), 3);
        for (int i = 0; i < 3; i++) {
            char name[16];
            snprintf(name, sizeof name, "t%d", i);
            const st_gguf_tensor *t = st_gguf_find_tensor(g, name);
            assert_non_null(t);
            assert_int_equal(t->shard, i);
            float v0;
            memcpy(&v0, t->data, 4);
            assert_true(v0 == (float)i);
        }
        const char *arch;
        size_t len;
        assert_true(st_gguf_get_str(g, "general.architecture", &arch, &len) && len == 4);
        st_gguf_free(g);
    }
    // A shard whose split.no disagrees with its name.
    write_shard(dir, 1, 3, 2, "t1", -1);
    assert_int_equal(st_gguf_open(p3, &g), ST_ERR_FORMAT);
    assert_non_null(strstr(st_error(), "model-00002-of-00003.gguf: key 'split.no'"));
    // A tensor name repeated in two shards.
    write_shard(dir, 1, 3, 1, "t2", -1);
    assert_int_equal(st_gguf_open(p1, &g), ST_ERR_FORMAT);
    assert_non_null(strstr(st_error(), "tensor 't2'"));
    assert_non_null(strstr(st_error(), "duplicate tensor name"));
    // split.tensors.count that disagrees with the shards.
    write_shard(dir, 1, 3, 1, "t1", -1);
    write_shard(dir, 0, 3, 0, "t0", 4);
    assert_int_equal(st_gguf_open(p2, &g), ST_ERR_FORMAT);
    assert_non_null(strstr(
        st_error(), "model-00001-of-00003.gguf: key 'split.tensors.count' does not match the 3 tensors"));
    write_shard(dir, 0, 3, 0, "t0", 3);
    char extra[512];
    snprintf(extra, sizeof extra, "%s/single.gguf", dir);
    // A shard renamed so the others cannot be found.
    assert_int_equal(rename(p2, extra), 0);
    assert_int_equal(st_gguf_open(extra, &g), ST_ERR_FORMAT);
    assert_non_null(strstr(st_error(), "one shard of a split model (split.count = 3)"));
    unlink(p1);
    unlink(p3);
    unlink(extra);
    rmdir(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_all_types), cmocka_unit_test(test_alignment_file),
        cmocka_unit_test(test_v2_nested),           cmocka_unit_test(test_truncated_everywhere),
        cmocka_unit_test(test_bad_header),          cmocka_unit_test(test_bad_kv),
        cmocka_unit_test(test_bad_tensor_info),     cmocka_unit_test(test_shards),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
