// gguf: the GGUF writer (v3). Metadata are encoded as they are added; tensors are only recorded
// and streamed from the caller's pointers (or produced by its fill functions) when the file is
// written, so quantizing a model never holds a second copy of it.

#include "gguf/gguf.h"
#include "gguf/gguf_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct wkv {
    char *key;
    uint8_t *enc; // value type (u32) + encoded value
    size_t n;
} wkv;

typedef struct wtensor {
    char *name;
    st_type type;
    int n_dims;
    int64_t ne[ST_GGUF_MAX_DIMS];
    const void *data; // the caller's, read at write time
    size_t bytes;
    st_gguf_fill_fn fill; // or, when set, the producer that writes the data at write time
    void *fill_ctx;
} wtensor;

struct st_gguf_writer {
    uint32_t alignment;
    wkv *kv;
    int64_t n_kv, cap_kv;
    wtensor *t;
    int64_t n_t, cap_t;
};

// A growing byte buffer.
typedef struct buf {
    uint8_t *p;
    size_t n, cap;
} buf;

static st_status buf_put(buf *b, const void *src, size_t n) {
    if (n > b->cap - b->n) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap - b->n < n) {
            if (cap > SIZE_MAX / 2)
                return st_fail(ST_ERR_NOMEM, "gguf writer: buffer of %zu bytes overflows", b->n);
            cap *= 2;
        }
        uint8_t *p = st_alloc(cap);
        if (!p) return ST_ERR_NOMEM;
        if (b->n) memcpy(p, b->p, b->n);
        st_free(b->p);
        b->p = p;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, src, n);
    b->n += n;
    return ST_OK;
}

static st_status buf_le(buf *b, uint64_t v, int n) {
    uint8_t x[8];
    for (int i = 0; i < n; i++) x[i] = (uint8_t)(v >> (8 * i));
    return buf_put(b, x, (size_t)n);
}

static st_status buf_str(buf *b, const char *s, size_t len) {
    ST_TRY(buf_le(b, len, 8));
    return buf_put(b, s, len);
}

st_gguf_writer *st_gguf_writer_create(void) {
    st_gguf_writer *w = st_calloc(1, sizeof *w);
    if (w) w->alignment = ST_GGUF_DEFAULT_ALIGNMENT;
    return w;
}

void st_gguf_writer_free(st_gguf_writer *w) {
    if (!w) return;
    for (int64_t i = 0; i < w->n_kv; i++) {
        st_free(w->kv[i].key);
        st_free(w->kv[i].enc);
    }
    for (int64_t i = 0; i < w->n_t; i++) st_free(w->t[i].name);
    st_free(w->kv);
    st_free(w->t);
    st_free(w);
}

static bool pow2(uint64_t v) { return v && !(v & (v - 1)); }

static int64_t kv_index(const st_gguf_writer *w, const char *key) {
    for (int64_t i = 0; i < w->n_kv; i++)
        if (!strcmp(w->kv[i].key, key)) return i;
    return -1;
}

static st_status grow(void **arr, int64_t *cap, int64_t n, size_t elem) {
    if (n < *cap) return ST_OK;
    int64_t nc = *cap ? *cap * 2 : 16;
    void *p = st_alloc((size_t)nc * elem);
    if (!p) return ST_ERR_NOMEM;
    if (n) memcpy(p, *arr, (size_t)n * elem);
    st_free(*arr);
    *arr = p;
    *cap = nc;
    return ST_OK;
}

// Takes over `b` (the encoded type + value) as key `key`.
static st_status add_encoded(st_gguf_writer *w, const char *key, buf *b) {
    st_status s = ST_OK;
    size_t klen = key ? strlen(key) : 0;
    if (!klen)
        s = st_fail(ST_ERR_ARG, "gguf writer: empty key");
    else if (kv_index(w, key) >= 0)
        s = st_fail(ST_ERR_ARG, "gguf writer: duplicate key '%s'", key);
    if (s == ST_OK && !strcmp(key, "general.alignment")) {
        // The value decides the file's alignment, so it must be an integer power of two.
        uint64_t v = 0;
        if (!st_gguf_uint_value((st_gguf_vtype)st_gguf_le(b->p, 4), b->p + 4, &v) || !pow2(v) ||
            v > ST_GGUF_MAX_ALIGNMENT)
            s = st_fail(ST_ERR_ARG, "gguf writer: general.alignment must be an integer power of two <= %u",
                        ST_GGUF_MAX_ALIGNMENT);
        else
            w->alignment = (uint32_t)v;
    }
    if (s == ST_OK) s = grow((void **)&w->kv, &w->cap_kv, w->n_kv, sizeof *w->kv);
    char *k = NULL;
    if (s == ST_OK && !(k = st_alloc(klen + 1))) s = ST_ERR_NOMEM;
    if (s != ST_OK) {
        st_free(b->p);
        return s;
    }
    memcpy(k, key, klen + 1);
    w->kv[w->n_kv++] = (wkv){k, b->p, b->n};
    return ST_OK;
}

st_status st_gguf_writer_set_alignment(st_gguf_writer *w, uint32_t alignment) {
    if (!pow2(alignment) || alignment > ST_GGUF_MAX_ALIGNMENT)
        return st_fail(ST_ERR_ARG, "gguf writer: alignment %u is not a power of two <= %u", alignment,
                       ST_GGUF_MAX_ALIGNMENT);
    int64_t i = kv_index(w, "general.alignment");
    if (i >= 0) { // keep the key and the layout in agreement
        buf b = {0};
        ST_TRY(buf_le(&b, ST_GGUF_U32, 4));
        ST_TRY(buf_le(&b, alignment, 4));
        st_free(w->kv[i].enc);
        w->kv[i].enc = b.p;
        w->kv[i].n = b.n;
    }
    w->alignment = alignment;
    return ST_OK;
}

st_status st_gguf_writer_add_scalar(st_gguf_writer *w, const char *key, st_gguf_vtype type,
                                    const void *value) {
    size_t sz = st_gguf_vtype_size(type);
    if (!sz)
        return st_fail(ST_ERR_ARG, "gguf writer: key '%s': %s is not a scalar type", key,
                       st_gguf_vtype_name(type));
    uint64_t v = 0;
    switch (type) {
    case ST_GGUF_U8:
    case ST_GGUF_I8: v = *(const uint8_t *)value; break;
    case ST_GGUF_BOOL: v = *(const bool *)value ? 1 : 0; break;
    case ST_GGUF_U16:
    case ST_GGUF_I16: {
        uint16_t x;
        memcpy(&x, value, 2);
        v = x;
        break;
    }
    case ST_GGUF_U32:
    case ST_GGUF_I32:
    case ST_GGUF_F32: {
        uint32_t x;
        memcpy(&x, value, 4);
        v = x;
        break;
    }
    default: memcpy(&v, value, 8); break;
    }
    buf b = {0};
    st_status s = buf_le(&b, type, 4);
    if (s == ST_OK) s = buf_le(&b, v, (int)sz);
    if (s != ST_OK) {
        st_free(b.p);
        return s;
    }
    return add_encoded(w, key, &b);
}

st_status st_gguf_writer_add_u32(st_gguf_writer *w, const char *key, uint32_t v) {
    return st_gguf_writer_add_scalar(w, key, ST_GGUF_U32, &v);
}
st_status st_gguf_writer_add_i32(st_gguf_writer *w, const char *key, int32_t v) {
    return st_gguf_writer_add_scalar(w, key, ST_GGUF_I32, &v);
}
st_status st_gguf_writer_add_u64(st_gguf_writer *w, const char *key, uint64_t v) {
    return st_gguf_writer_add_scalar(w, key, ST_GGUF_U64, &v);
}
st_status st_gguf_writer_add_f32(st_gguf_writer *w, const char *key, float v) {
    return st_gguf_writer_add_scalar(w, key, ST_GGUF_F32, &v);
}
st_status st_gguf_writer_add_bool(st_gguf_writer *w, const char *key, bool v) {
    return st_gguf_writer_add_scalar(w, key, ST_GGUF_BOOL, &v);
}

st_status st_gguf_writer_add_strn(st_gguf_writer *w, const char *key, const char *v, size_t len) {
    buf b = {0};
    st_status s = buf_le(&b, ST_GGUF_STRING, 4);
    if (s == ST_OK) s = buf_str(&b, v, len);
    if (s != ST_OK) {
        st_free(b.p);
        return s;
    }
    return add_encoded(w, key, &b);
}

st_status st_gguf_writer_add_str(st_gguf_writer *w, const char *key, const char *v) {
    return st_gguf_writer_add_strn(w, key, v, strlen(v));
}

st_status st_gguf_writer_add_arr(st_gguf_writer *w, const char *key, st_gguf_vtype elem_type,
                                 const void *data, uint64_t count) {
    size_t sz = st_gguf_vtype_size(elem_type);
    if (!sz)
        return st_fail(ST_ERR_ARG, "gguf writer: key '%s': arrays of %s need their own call", key,
                       st_gguf_vtype_name(elem_type));
    if (count > SIZE_MAX / sz)
        return st_fail(ST_ERR_ARG, "gguf writer: key '%s': %llu elements overflow", key,
                       (unsigned long long)count);
    buf b = {0};
    st_status s = buf_le(&b, ST_GGUF_ARRAY, 4);
    if (s == ST_OK) s = buf_le(&b, elem_type, 4);
    if (s == ST_OK) s = buf_le(&b, count, 8);
    const uint8_t *src = data;
    // Elements are written little-endian one at a time, so the caller's native array works on
    // any host; bools are normalised to 0/1.
    for (uint64_t i = 0; i < count && s == ST_OK; i++) {
        uint64_t v = 0;
        const uint8_t *e = src + i * sz;
        if (elem_type == ST_GGUF_BOOL)
            v = *(const bool *)e ? 1 : 0;
        else if (sz == 1)
            v = e[0];
        else if (sz == 2) {
            uint16_t x;
            memcpy(&x, e, 2);
            v = x;
        } else if (sz == 4) {
            uint32_t x;
            memcpy(&x, e, 4);
            v = x;
        } else
            memcpy(&v, e, 8);
        s = buf_le(&b, v, (int)sz);
    }
    if (s != ST_OK) {
        st_free(b.p);
        return s;
    }
    return add_encoded(w, key, &b);
}

st_status st_gguf_writer_add_str_arr(st_gguf_writer *w, const char *key, const char *const *v,
                                     uint64_t count) {
    buf b = {0};
    st_status s = buf_le(&b, ST_GGUF_ARRAY, 4);
    if (s == ST_OK) s = buf_le(&b, ST_GGUF_STRING, 4);
    if (s == ST_OK) s = buf_le(&b, count, 8);
    for (uint64_t i = 0; i < count && s == ST_OK; i++) s = buf_str(&b, v[i], strlen(v[i]));
    if (s != ST_OK) {
        st_free(b.p);
        return s;
    }
    return add_encoded(w, key, &b);
}

st_status st_gguf_writer_copy_kv(st_gguf_writer *w, const st_gguf *g, int64_t i) {
    const st_gguf_kv *kv = st_gguf_kv_at(g, i);
    if (!kv) return st_fail(ST_ERR_RANGE, "gguf writer: key index %lld is out of range", (long long)i);
    buf b = {0};
    st_status s = buf_le(&b, kv->type, 4);
    if (s == ST_OK) s = buf_put(&b, kv->value, kv->value_bytes); // validated when the file was opened
    if (s != ST_OK) {
        st_free(b.p);
        return s;
    }
    return add_encoded(w, kv->key, &b);
}

// A tensor's data come either from `data` or, at write time, from `fill`.
static st_status add_tensor(st_gguf_writer *w, const char *name, st_type type, int n_dims, const int64_t *ne,
                            size_t bytes, const void *data, st_gguf_fill_fn fill, void *ctx) {
    if (!name || !name[0]) return st_fail(ST_ERR_ARG, "gguf writer: empty tensor name");
    const st_type_info *ti = st_type_get((int)type);
    if (!ti) return st_fail(ST_ERR_ARG, "gguf writer: tensor '%s': unknown type %d", name, (int)type);
    if (n_dims < 1 || n_dims > ST_GGUF_MAX_DIMS)
        return st_fail(ST_ERR_ARG, "gguf writer: tensor '%s': n_dims %d is not in 1..%d", name, n_dims,
                       ST_GGUF_MAX_DIMS);
    uint64_t nelem = 1;
    for (int d = 0; d < n_dims; d++) {
        if (ne[d] <= 0 || nelem > (uint64_t)INT64_MAX / (uint64_t)ne[d])
            return st_fail(ST_ERR_ARG, "gguf writer: tensor '%s': bad dimension ne[%d] = %lld", name, d,
                           (long long)ne[d]);
        nelem *= (uint64_t)ne[d];
    }
    if (ne[0] % ti->block)
        return st_fail(ST_ERR_ARG,
                       "gguf writer: tensor '%s': ne[0] = %lld is not a multiple of the %s block size %d",
                       name, (long long)ne[0], ti->name, ti->block);
    uint64_t want = nelem / (uint64_t)ti->block * (uint64_t)ti->block_bytes;
    if (want != bytes)
        return st_fail(ST_ERR_ARG, "gguf writer: tensor '%s': %zu bytes given, its type and shape need %llu",
                       name, bytes, (unsigned long long)want);
    for (int64_t i = 0; i < w->n_t; i++)
        if (!strcmp(w->t[i].name, name))
            return st_fail(ST_ERR_ARG, "gguf writer: duplicate tensor name '%s'", name);
    ST_TRY(grow((void **)&w->t, &w->cap_t, w->n_t, sizeof *w->t));
    size_t len = strlen(name) + 1;
    char *n = st_alloc(len);
    if (!n) return ST_ERR_NOMEM;
    memcpy(n, name, len);
    wtensor *t = &w->t[w->n_t++];
    *t = (wtensor){.name = n, .type = type, .n_dims = n_dims, .data = data, .bytes = bytes, .fill = fill,
                   .fill_ctx = ctx};
    for (int d = 0; d < ST_GGUF_MAX_DIMS; d++) t->ne[d] = d < n_dims ? ne[d] : 1;
    return ST_OK;
}

st_status st_gguf_writer_add_tensor(st_gguf_writer *w, const char *name, st_type type, int n_dims,
                                    const int64_t *ne, const void *data, size_t bytes) {
    return add_tensor(w, name, type, n_dims, ne, bytes, data, NULL, NULL);
}

st_status st_gguf_writer_add_tensor_fn(st_gguf_writer *w, const char *name, st_type type, int n_dims,
                                       const int64_t *ne, size_t bytes, st_gguf_fill_fn fill, void *ctx) {
    if (!fill) return st_fail(ST_ERR_ARG, "gguf writer: tensor '%s': no fill function", name ? name : "");
    return add_tensor(w, name, type, n_dims, ne, bytes, NULL, fill, ctx);
}

// ---------------------------------------------------------------------------------------------
// Output: a file or a memory buffer behind one put().

typedef struct sink {
    FILE *f;
    const char *path;
    buf mem;
    uint64_t pos;
} sink;

static st_status put(sink *s, const void *p, size_t n) {
    s->pos += n;
    if (!s->f) return buf_put(&s->mem, p, n);
    if (n && fwrite(p, 1, n, s->f) != n)
        return st_fail(ST_ERR_IO, "%s: write failed at byte %llu: %s", s->path,
                       (unsigned long long)(s->pos - n), strerror(errno));
    return ST_OK;
}

static st_status put_le(sink *s, uint64_t v, int n) {
    uint8_t x[8];
    for (int i = 0; i < n; i++) x[i] = (uint8_t)(v >> (8 * i));
    return put(s, x, (size_t)n);
}

static st_status fill_put(void *s, const void *p, size_t n) { return put(s, p, n); }

static st_status pad(sink *s, uint32_t alignment) {
    static const uint8_t zeros[256];
    uint64_t n = (alignment - s->pos % alignment) % alignment;
    while (n) {
        size_t k = n < sizeof zeros ? (size_t)n : sizeof zeros;
        ST_TRY(put(s, zeros, k));
        n -= k;
    }
    return ST_OK;
}

static st_status emit(st_gguf_writer *w, sink *s) {
    bool extra_align = w->alignment != ST_GGUF_DEFAULT_ALIGNMENT && kv_index(w, "general.alignment") < 0;
    ST_TRY(put(s, "GGUF", 4));
    ST_TRY(put_le(s, 3, 4));
    ST_TRY(put_le(s, (uint64_t)w->n_t, 8));
    ST_TRY(put_le(s, (uint64_t)w->n_kv + extra_align, 8));
    for (int64_t i = 0; i < w->n_kv; i++) {
        ST_TRY(put_le(s, strlen(w->kv[i].key), 8));
        ST_TRY(put(s, w->kv[i].key, strlen(w->kv[i].key)));
        ST_TRY(put(s, w->kv[i].enc, w->kv[i].n));
    }
    if (extra_align) {
        static const char k[] = "general.alignment";
        ST_TRY(put_le(s, sizeof k - 1, 8));
        ST_TRY(put(s, k, sizeof k - 1));
        ST_TRY(put_le(s, ST_GGUF_U32, 4));
        ST_TRY(put_le(s, w->alignment, 4));
    }
    uint64_t off = 0;
    for (int64_t i = 0; i < w->n_t; i++) {
        const wtensor *t = &w->t[i];
        ST_TRY(put_le(s, strlen(t->name), 8));
        ST_TRY(put(s, t->name, strlen(t->name)));
        ST_TRY(put_le(s, (uint64_t)t->n_dims, 4));
        for (int d = 0; d < t->n_dims; d++) ST_TRY(put_le(s, (uint64_t)t->ne[d], 8));
        ST_TRY(put_le(s, (uint64_t)t->type, 4));
        ST_TRY(put_le(s, off, 8));
        off += (t->bytes + w->alignment - 1) / w->alignment * w->alignment;
    }
    ST_TRY(pad(s, w->alignment));
    for (int64_t i = 0; i < w->n_t; i++) {
        const wtensor *t = &w->t[i];
        if (t->fill) {
            uint64_t start = s->pos;
            ST_TRY(t->fill(t->fill_ctx, i, fill_put, s));
            if (s->pos - start != t->bytes)
                return st_fail(ST_ERR_ARG, "gguf writer: tensor '%s': fill wrote %llu bytes, not %zu", t->name,
                               (unsigned long long)(s->pos - start), t->bytes);
        } else {
            ST_TRY(put(s, t->data, t->bytes));
        }
        ST_TRY(pad(s, w->alignment));
    }
    return ST_OK;
}

st_status st_gguf_writer_write(st_gguf_writer *w, const char *path) {
    sink s = {.path = path};
    s.f = fopen(path, "wb");
    if (!s.f) return st_fail(ST_ERR_IO, "%s: cannot open for writing: %s", path, strerror(errno));
    st_status st = emit(w, &s);
    if (fclose(s.f) != 0 && st == ST_OK)
        st = st_fail(ST_ERR_IO, "%s: write failed when closing: %s", path, strerror(errno));
    if (st != ST_OK) unlink(path);
    return st;
}

st_status st_gguf_writer_write_memory(st_gguf_writer *w, void **data, size_t *size) {
    sink s = {.path = "<memory>"};
    st_status st = emit(w, &s);
    if (st != ST_OK) {
        st_free(s.mem.p);
        return st;
    }
    *data = s.mem.p;
    *size = s.mem.n;
    return ST_OK;
}
