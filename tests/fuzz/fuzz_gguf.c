// Fuzz target for the GGUF reader (libFuzzer): any input either fails with a message or opens;
// an opened file is walked completely (every key, element and tensor byte range) and must
// survive a copy through the writer unchanged. ASan/UBSan catch any out-of-bounds read.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf/gguf.h"

#define CHECK(c)                                                                                             \
    do {                                                                                                     \
        if (!(c)) __builtin_trap();                                                                          \
    } while (0)

static volatile uint8_t sink;

static void walk(const st_gguf *g) {
    for (int64_t i = 0; i < st_gguf_kv_count(g); i++) {
        const st_gguf_kv *kv = st_gguf_kv_at(g, i);
        const char *key = st_gguf_key(g, i);
        CHECK(kv && key && st_gguf_find_key(g, key) == i && st_gguf_kv_type(g, i) == kv->type);
        uint32_t u32;
        uint64_t u64;
        int64_t i64;
        float f;
        double d;
        bool b;
        const char *s;
        size_t len;
        (void)st_gguf_get_u32(g, key, &u32);
        (void)st_gguf_get_u64(g, key, &u64);
        (void)st_gguf_get_i64(g, key, &i64);
        (void)st_gguf_get_f32(g, key, &f);
        (void)st_gguf_get_f64(g, key, &d);
        (void)st_gguf_get_bool(g, key, &b);
        if (st_gguf_get_str(g, key, &s, &len) && len) sink ^= (uint8_t)(s[0] ^ s[len - 1]);
        st_gguf_vtype et;
        uint64_t count;
        const void *data;
        if (!st_gguf_get_arr(g, key, &et, &count, &data)) continue;
        for (uint64_t k = 0; k < count; k++) {
            if (et == ST_GGUF_STRING) {
                CHECK(st_gguf_arr_str(g, key, k, &s, &len));
                if (len) sink ^= (uint8_t)(s[0] ^ s[len - 1]);
            } else {
                (void)st_gguf_arr_i64(g, key, k, &i64);
                (void)st_gguf_arr_f64(g, key, k, &d);
            }
        }
        CHECK(!st_gguf_arr_str(g, key, count, &s, &len) && !st_gguf_arr_i64(g, key, count, &i64));
    }
    for (int64_t i = 0; i < st_gguf_tensor_count(g); i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        CHECK(st_gguf_find_tensor(g, t->name) == t && t->bytes > 0);
        const uint8_t *p = t->data;
        sink ^= (uint8_t)(p[0] ^ p[t->bytes - 1]);
    }
}

// Copies every key and tensor through the writer; the copy must open and match.
static void round_trip(const st_gguf *g) {
    if (st_gguf_alignment(g) > 4096) return; // padding to a huge alignment only costs memory
    st_gguf_writer *w = st_gguf_writer_create();
    CHECK(w);
    for (int64_t i = 0; i < st_gguf_kv_count(g); i++) CHECK(st_gguf_writer_copy_kv(w, g, i) == ST_OK);
    for (int64_t i = 0; i < st_gguf_tensor_count(g); i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        CHECK(st_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data, t->bytes) == ST_OK);
    }
    void *data;
    size_t size;
    CHECK(st_gguf_writer_write_memory(w, &data, &size) == ST_OK);
    st_gguf_writer_free(w);
    st_gguf *g2;
    CHECK(st_gguf_open_memory(data, size, "copy", &g2) == ST_OK);
    CHECK(st_gguf_kv_count(g2) == st_gguf_kv_count(g) && st_gguf_tensor_count(g2) == st_gguf_tensor_count(g));
    for (int64_t i = 0; i < st_gguf_kv_count(g); i++) {
        const st_gguf_kv *a = st_gguf_kv_at(g, i), *b = st_gguf_kv_at(g2, i);
        CHECK(!strcmp(a->key, b->key) && a->type == b->type && a->value_bytes == b->value_bytes &&
              !memcmp(a->value, b->value, a->value_bytes));
    }
    for (int64_t i = 0; i < st_gguf_tensor_count(g); i++) {
        const st_gguf_tensor *a = st_gguf_tensor_at(g, i), *b = st_gguf_tensor_at(g2, i);
        CHECK(!strcmp(a->name, b->name) && a->type == b->type && a->bytes == b->bytes &&
              !memcmp(a->ne, b->ne, sizeof a->ne) && !memcmp(a->data, b->data, a->bytes));
    }
    st_gguf_free(g2);
    st_free(data);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    st_gguf *g;
    if (st_gguf_open_memory(data, size, "fuzz.gguf", &g) != ST_OK) {
        CHECK(st_error()[0] != 0); // a failure always says why
        return 0;
    }
    walk(g);
    round_trip(g);
    st_gguf_free(g);
    return 0;
}
