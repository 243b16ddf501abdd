// Unit tests for the writer's streaming form (st_gguf_writer_add_tensor_fn): data produced at
// write time in pieces land where the reader finds them, mixed with pointer tensors; a fill that
// writes too few or too many bytes, or fails, fails the write and leaves no file.
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf/gguf.h"

typedef struct fill_ctx {
    int64_t want_index;
    int pieces;       // the tensor's bytes are passed in this many calls
    int extra;        // bytes written beyond (or, negative, short of) the declared size
    bool fail;        // return an error instead
    int calls;
} fill_ctx;

// Bytes of tensor "s": element i is the float i * 0.25.
static st_status fill_floats(void *vctx, int64_t index, st_gguf_put_fn put, void *sink) {
    fill_ctx *c = vctx;
    c->calls++;
    assert_int_equal(index, c->want_index);
    if (c->fail) return st_fail(ST_ERR_IO, "fill: made-up failure");
    float v[64];
    for (int i = 0; i < 64; i++) v[i] = (float)i * 0.25f;
    size_t total = sizeof v + (size_t)(c->extra > 0 ? c->extra : 0) - (size_t)(c->extra < 0 ? -c->extra : 0);
    uint8_t buf[sizeof v + 16] = {0};
    memcpy(buf, v, sizeof v);
    size_t done = 0;
    for (int p = 0; p < c->pieces; p++) {
        size_t n = p == c->pieces - 1 ? total - done : total / (size_t)c->pieces;
        ST_TRY(put(sink, buf + done, n));
        done += n;
    }
    return ST_OK;
}

static st_gguf_writer *make_writer(fill_ctx *c, const float *plain) {
    st_gguf_writer *w = st_gguf_writer_create();
    assert_non_null(w);
    int64_t ne_a[1] = {3}, ne_s[2] = {16, 4};
    assert_int_equal(st_gguf_writer_add_u32(w, "k", 7), ST_OK);
    size_t nb = 3 * sizeof(float);
    assert_int_equal(st_gguf_writer_add_tensor(w, "a", ST_TYPE_F32, 1, ne_a, plain, nb), ST_OK);
    st_status st = st_gguf_writer_add_tensor_fn(w, "s", ST_TYPE_F32, 2, ne_s, 64 * 4, fill_floats, c);
    assert_int_equal(st, ST_OK);
    assert_int_equal(st_gguf_writer_add_tensor(w, "b", ST_TYPE_F32, 1, ne_a, plain, nb), ST_OK);
    return w;
}

static void test_stream_roundtrip(void **state) {
    (void)state;
    const float plain[3] = {1.0f, -2.0f, 3.5f};
    for (int pieces = 1; pieces <= 5; pieces += 2) {
        fill_ctx c = {.want_index = 1, .pieces = pieces};
        st_gguf_writer *w = make_writer(&c, plain);
        void *data;
        size_t size;
        assert_int_equal(st_gguf_writer_write_memory(w, &data, &size), ST_OK);
        assert_int_equal(c.calls, 1);
        st_gguf_writer_free(w);
        st_gguf *g;
        assert_int_equal(st_gguf_open_memory(data, size, "stream.gguf", &g), ST_OK);
        const st_gguf_tensor *s = st_gguf_find_tensor(g, "s"), *b = st_gguf_find_tensor(g, "b");
        assert_non_null(s);
        assert_int_equal(s->ne[0], 16);
        assert_int_equal(s->ne[1], 4);
        for (int i = 0; i < 64; i++) {
            float v;
            memcpy(&v, (const uint8_t *)s->data + 4 * i, 4);
            assert_true(v == (float)i * 0.25f);
        }
        assert_memory_equal(b->data, plain, sizeof plain);
        st_gguf_free(g);
        st_free(data);
    }
}

static void test_stream_wrong_size_or_failure(void **state) {
    (void)state;
    const float plain[3] = {0};
    const fill_ctx bad[] = {{.want_index = 1, .pieces = 2, .extra = -4},
                            {.want_index = 1, .pieces = 2, .extra = 8},
                            {.want_index = 1, .pieces = 1, .fail = true}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fill_ctx c = bad[i];
        st_gguf_writer *w = make_writer(&c, plain);
        char path[] = "/tmp/strata_test_stream_XXXXXX";
        int fd = mkstemp(path);
        assert_true(fd >= 0);
        close(fd);
        assert_int_not_equal(st_gguf_writer_write(w, path), ST_OK);
        assert_non_null(strstr(st_error(), c.fail ? "made-up failure" : "tensor 's': fill wrote"));
        assert_int_not_equal(access(path, F_OK), 0); // the partial file is gone
        st_gguf_writer_free(w);
    }
    st_gguf_writer *w = st_gguf_writer_create();
    int64_t ne[1] = {4};
    assert_int_equal(st_gguf_writer_add_tensor_fn(w, "x", ST_TYPE_F32, 1, ne, 16, NULL, NULL), ST_ERR_ARG);
    assert_int_equal(st_gguf_writer_add_tensor_fn(w, "x", ST_TYPE_F32, 1, ne, 12, fill_floats, NULL),
                     ST_ERR_ARG); // 12 bytes for 4 floats
    st_gguf_writer_free(w);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stream_roundtrip),
        cmocka_unit_test(test_stream_wrong_size_or_failure),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
