// gguf: the GGUF reader (v2/v3, every value type, sharded models loaded as one). The parser runs
// over a bounds-checked cursor and validates every count, length, shape and offset before any
// of it is used, so a hostile or truncated file yields a message, never an out-of-bounds read.

#include "gguf/gguf.h"
#include "gguf/gguf_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_MAGIC 0x46554747u // "GGUF" read little-endian
// Why: nested arrays are legal but unused; a bound keeps a hostile file from exhausting the stack.
#define MAX_DEPTH 16
// Why: shard names carry five digits ("-00001-of-00003").
#define MAX_SHARDS 99999

static const char *const vtype_names[ST_GGUF_VTYPE_COUNT] = {
    "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64",
};

const char *st_gguf_vtype_name(st_gguf_vtype t) {
    return (unsigned)t < ST_GGUF_VTYPE_COUNT ? vtype_names[t] : "unknown";
}

size_t st_gguf_vtype_size(st_gguf_vtype t) {
    static const size_t sizes[ST_GGUF_VTYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return (unsigned)t < ST_GGUF_VTYPE_COUNT ? sizes[t] : 0;
}

uint64_t st_gguf_le(const void *p, int n) {
    const uint8_t *b = p;
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v |= (uint64_t)b[i] << (8 * i);
    return v;
}

// Copies up to 60 bytes of a name from the file for a message, replacing what a terminal would
// not show, and marks a cut with "...".
void st_gguf_printable(char *dst, size_t cap, const void *src, size_t len) {
    const uint8_t *s = src;
    size_t max = cap > 4 ? cap - 4 : 0, n = 0;
    if (max > 60) max = 60;
    for (; n < len && n < max; n++) dst[n] = (s[n] >= 0x20 && s[n] < 0x7f) ? (char)s[n] : '?';
    if (n < len && cap >= n + 4) {
        memcpy(dst + n, "...", 3);
        n += 3;
    }
    if (cap) dst[n < cap ? n : cap - 1] = 0;
}

// ---------------------------------------------------------------------------------------------
// Bounds-checked cursor. Every read names what it reads (`ctx` + field) for the message.

typedef struct cursor {
    const uint8_t *p;
    size_t size, pos;
    const char *file;
    char ctx[160]; // "header", "key 'x' (at byte N)", "tensor 'y' (info at byte N)"
} cursor;

static st_status need(cursor *c, size_t n, const char *field) {
    if (n <= c->size - c->pos) return ST_OK;
    return st_fail(ST_ERR_FORMAT, "%s: %s: %s at byte %zu needs %zu bytes but the file ends at byte %zu",
                   c->file, c->ctx, field, c->pos, n, c->size);
}

static st_status rd(cursor *c, int n, const char *field, uint64_t *v) {
    ST_TRY(need(c, (size_t)n, field));
    *v = st_gguf_le(c->p + c->pos, n);
    c->pos += (size_t)n;
    return ST_OK;
}

static st_status rd_u32(cursor *c, const char *field, uint32_t *v) {
    uint64_t x;
    ST_TRY(rd(c, 4, field, &x));
    *v = (uint32_t)x;
    return ST_OK;
}

static st_status rd_str(cursor *c, const char *field, const uint8_t **s, size_t *len) {
    size_t at = c->pos;
    uint64_t n;
    ST_TRY(rd(c, 8, field, &n));
    if (n > c->size - c->pos)
        return st_fail(ST_ERR_FORMAT,
                       "%s: %s: %s at byte %zu has length %llu, which runs past the end of the file "
                       "(size %zu)",
                       c->file, c->ctx, field, at, (unsigned long long)n, c->size);
    *s = c->p + c->pos;
    *len = (size_t)n;
    c->pos += (size_t)n;
    return ST_OK;
}

static size_t min_elem_bytes(uint32_t t) {
    if (t == ST_GGUF_STRING) return 8;
    if (t == ST_GGUF_ARRAY) return 12; // element type + count
    return st_gguf_vtype_size((st_gguf_vtype)t);
}

static st_status check_bools(cursor *c, const uint8_t *b, uint64_t n, const char *field) {
    for (uint64_t i = 0; i < n; i++)
        if (b[i] > 1)
            return st_fail(ST_ERR_FORMAT, "%s: %s: %s at byte %zu is %u, not 0 or 1", c->file, c->ctx, field,
                           (size_t)(b + i - c->p), b[i]);
    return ST_OK;
}

// Reads an array header and checks that `count` elements could fit in what is left of the file
// before anything iterates over them.
static st_status rd_arr_head(cursor *c, uint32_t *elem, uint64_t *count) {
    size_t at = c->pos;
    ST_TRY(rd_u32(c, "array element type", elem));
    if (*elem >= ST_GGUF_VTYPE_COUNT)
        return st_fail(ST_ERR_FORMAT, "%s: %s: array element type %u at byte %zu is not a GGUF value type",
                       c->file, c->ctx, *elem, at);
    at = c->pos;
    ST_TRY(rd(c, 8, "array count", count));
    if (*count > (c->size - c->pos) / min_elem_bytes(*elem))
        return st_fail(ST_ERR_FORMAT,
                       "%s: %s: array count %llu at byte %zu cannot fit in the %zu bytes left in the file "
                       "(each %s element takes at least %zu bytes)",
                       c->file, c->ctx, (unsigned long long)*count, at, c->size - c->pos, vtype_names[*elem],
                       min_elem_bytes(*elem));
    return ST_OK;
}

// Validates one value of type t and moves past it.
static st_status skip_value(cursor *c, uint32_t t, int depth) {
    if (t >= ST_GGUF_VTYPE_COUNT)
        return st_fail(ST_ERR_FORMAT, "%s: %s: value type %u is not a GGUF value type", c->file, c->ctx, t);
    if (t == ST_GGUF_STRING) {
        const uint8_t *s;
        size_t len;
        return rd_str(c, "string length", &s, &len);
    }
    if (t != ST_GGUF_ARRAY) {
        size_t n = st_gguf_vtype_size((st_gguf_vtype)t);
        ST_TRY(need(c, n, "value"));
        if (t == ST_GGUF_BOOL) ST_TRY(check_bools(c, c->p + c->pos, 1, "bool value"));
        c->pos += n;
        return ST_OK;
    }
    if (depth >= MAX_DEPTH)
        return st_fail(ST_ERR_FORMAT, "%s: %s: arrays nested deeper than %d levels at byte %zu", c->file,
                       c->ctx, MAX_DEPTH, c->pos);
    uint32_t elem;
    uint64_t count;
    ST_TRY(rd_arr_head(c, &elem, &count));
    size_t esize = st_gguf_vtype_size((st_gguf_vtype)elem);
    if (esize) { // fits: checked by rd_arr_head
        if (elem == ST_GGUF_BOOL) ST_TRY(check_bools(c, c->p + c->pos, count, "bool element"));
        c->pos += (size_t)count * esize;
        return ST_OK;
    }
    for (uint64_t i = 0; i < count; i++) ST_TRY(skip_value(c, elem, depth + 1));
    return ST_OK;
}

// ---------------------------------------------------------------------------------------------
// Name lookup: open addressing over indices, used for keys and tensor names (and to find
// duplicates while loading).

static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

typedef struct names {
    int64_t *slot; // index + 1, 0 = empty
    size_t cap;    // power of two
} names;

static st_status names_init(names *h, int64_t n) {
    h->cap = 16;
    while (h->cap < (size_t)n * 2) h->cap *= 2;
    h->slot = st_calloc(h->cap, sizeof *h->slot);
    return h->slot ? ST_OK : ST_ERR_NOMEM;
}

// Inserts item i named `name`; returns the index already holding that name, or -1.
static int64_t names_add(names *h, const char *name, int64_t i, const char *(*name_of)(const void *, int64_t),
                         const void *items) {
    size_t m = h->cap - 1, k = hash_str(name) & m;
    for (; h->slot[k]; k = (k + 1) & m)
        if (!strcmp(name_of(items, h->slot[k] - 1), name)) return h->slot[k] - 1;
    h->slot[k] = i + 1;
    return -1;
}

static int64_t names_find(const names *h, const char *name, const char *(*name_of)(const void *, int64_t),
                          const void *items) {
    if (!h->slot) return -1;
    size_t m = h->cap - 1, k = hash_str(name) & m;
    for (; h->slot[k]; k = (k + 1) & m)
        if (!strcmp(name_of(items, h->slot[k] - 1), name)) return h->slot[k] - 1;
    return -1;
}

static const char *kv_name(const void *items, int64_t i) { return ((const st_gguf_kv *)items)[i].key; }
static const char *tensor_name(const void *items, int64_t i) {
    return ((const st_gguf_tensor *)items)[i].name;
}

// ---------------------------------------------------------------------------------------------
// One file (a whole model or one shard).

typedef struct gfile {
    const char *name; // for messages
    const uint8_t *base;
    size_t size;
    uint32_t version;
    int64_t n_kv;
    st_gguf_kv *kv;
    int64_t n_t;
    st_gguf_tensor *t;
    size_t *t_info_at; // byte offset of each tensor's info, for messages
    uint32_t alignment;
    size_t data_start;
} gfile;

static void kvs_free(st_gguf_kv *kv, int64_t n) {
    if (!kv) return;
    for (int64_t i = 0; i < n; i++) {
        st_free(kv[i].key);
        st_free(kv[i].str_at);
    }
    st_free(kv);
}

static void tensors_free(st_gguf_tensor *t, int64_t n) {
    if (!t) return;
    for (int64_t i = 0; i < n; i++) st_free((char *)t[i].name);
    st_free(t);
}

static void gfile_free(gfile *f) {
    kvs_free(f->kv, f->n_kv);
    tensors_free(f->t, f->n_t);
    st_free(f->t_info_at);
    memset(f, 0, sizeof *f);
}

static st_status copy_name(cursor *c, const uint8_t *s, size_t len, size_t at, const char *what, char **out) {
    if (len == 0) return st_fail(ST_ERR_FORMAT, "%s: %s at byte %zu is empty", c->file, what, at);
    if (memchr(s, 0, len)) {
        char pn[80];
        st_gguf_printable(pn, sizeof pn, s, len);
        return st_fail(ST_ERR_FORMAT, "%s: %s '%s' at byte %zu contains a NUL byte", c->file, what, pn, at);
    }
    char *n = st_alloc(len + 1);
    if (!n) return ST_ERR_NOMEM;
    memcpy(n, s, len);
    n[len] = 0;
    *out = n;
    return ST_OK;
}

static st_status parse_kv(cursor *c, st_gguf_kv *kv, int64_t i, names *seen, st_gguf_kv *all) {
    size_t at = c->pos;
    snprintf(c->ctx, sizeof c->ctx, "key #%lld (at byte %zu)", (long long)i, at);
    const uint8_t *s;
    size_t len;
    ST_TRY(rd_str(c, "key length", &s, &len));
    ST_TRY(copy_name(c, s, len, at, "key", &kv->key));
    char pn[80];
    st_gguf_printable(pn, sizeof pn, s, len);
    snprintf(c->ctx, sizeof c->ctx, "key '%s' (at byte %zu)", pn, at);
    int64_t dup = names_add(seen, kv->key, i, kv_name, all);
    if (dup >= 0)
        return st_fail(ST_ERR_FORMAT, "%s: %s: duplicate key (key #%lld has the same name)", c->file, c->ctx,
                       (long long)dup);
    uint32_t t;
    size_t tat = c->pos;
    ST_TRY(rd_u32(c, "value type", &t));
    if (t >= ST_GGUF_VTYPE_COUNT)
        return st_fail(ST_ERR_FORMAT, "%s: %s: value type %u at byte %zu is not a GGUF value type", c->file,
                       c->ctx, t, tat);
    kv->type = (st_gguf_vtype)t;
    kv->value = c->p + c->pos;
    if (t != ST_GGUF_ARRAY) {
        ST_TRY(skip_value(c, t, 0));
        kv->value_bytes = (size_t)(c->p + c->pos - kv->value);
        return ST_OK;
    }
    uint32_t elem;
    uint64_t count;
    ST_TRY(rd_arr_head(c, &elem, &count));
    kv->elem = (st_gguf_vtype)elem;
    kv->count = count;
    kv->data = c->p + c->pos;
    size_t esize = st_gguf_vtype_size(kv->elem);
    if (esize) {
        if (elem == ST_GGUF_BOOL) ST_TRY(check_bools(c, kv->data, count, "bool element"));
        c->pos += (size_t)count * esize;
    } else {
        // String arrays get an index so element i is found without a walk (vocabularies hold
        // 150k strings). Its size is bounded by the file: each string takes 8+ bytes.
        if (elem == ST_GGUF_STRING && count) {
            kv->str_at = st_alloc((size_t)count * sizeof *kv->str_at);
            if (!kv->str_at) return ST_ERR_NOMEM;
        }
        for (uint64_t k = 0; k < count; k++) {
            if (kv->str_at) kv->str_at[k] = (size_t)(c->p + c->pos - kv->data);
            ST_TRY(skip_value(c, elem, 1));
        }
    }
    kv->value_bytes = (size_t)(c->p + c->pos - kv->value);
    return ST_OK;
}

static const st_gguf_kv *gfile_kv(const gfile *f, const char *key) {
    for (int64_t i = 0; i < f->n_kv; i++)
        if (!strcmp(f->kv[i].key, key)) return &f->kv[i];
    return NULL;
}

static st_status parse_tensor_info(cursor *c, gfile *f, int64_t i) {
    st_gguf_tensor *t = &f->t[i];
    size_t at = c->pos;
    f->t_info_at[i] = at;
    snprintf(c->ctx, sizeof c->ctx, "tensor #%lld (info at byte %zu)", (long long)i, at);
    const uint8_t *s;
    size_t len;
    ST_TRY(rd_str(c, "name length", &s, &len));
    char *name;
    ST_TRY(copy_name(c, s, len, at, "tensor name", &name));
    t->name = name;
    char pn[80];
    st_gguf_printable(pn, sizeof pn, s, len);
    snprintf(c->ctx, sizeof c->ctx, "tensor '%s' (info at byte %zu)", pn, at);

    uint32_t n_dims;
    size_t fat = c->pos;
    ST_TRY(rd_u32(c, "n_dims", &n_dims));
    if (n_dims < 1 || n_dims > ST_GGUF_MAX_DIMS)
        return st_fail(ST_ERR_FORMAT, "%s: %s: n_dims %u at byte %zu is not in 1..%d", c->file, c->ctx,
                       n_dims, fat, ST_GGUF_MAX_DIMS);
    t->n_dims = (int)n_dims;
    uint64_t nelem = 1;
    for (int d = 0; d < ST_GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        uint64_t v;
        fat = c->pos;
        ST_TRY(rd(c, 8, "dimension", &v));
        if (v == 0 || v > (uint64_t)INT64_MAX)
            return st_fail(ST_ERR_FORMAT, "%s: %s: ne[%u] = %llu at byte %zu is not in 1..2^63-1", c->file,
                           c->ctx, d, (unsigned long long)v, fat);
        if (nelem > (uint64_t)INT64_MAX / v)
            return st_fail(ST_ERR_FORMAT, "%s: %s: the element count overflows at ne[%u] = %llu (byte %zu)",
                           c->file, c->ctx, d, (unsigned long long)v, fat);
        nelem *= v;
        t->ne[d] = (int64_t)v;
    }
    uint32_t type;
    fat = c->pos;
    ST_TRY(rd_u32(c, "type", &type));
    const st_type_info *ti = st_type_get((int)type);
    if (!ti)
        return st_fail(ST_ERR_UNSUPPORTED, "%s: %s: type %u at byte %zu is not a known tensor type", c->file,
                       c->ctx, type, fat);
    t->type = (st_type)type;
    if (t->ne[0] % ti->block)
        return st_fail(ST_ERR_FORMAT, "%s: %s: ne[0] = %lld is not a multiple of the %s block size %d",
                       c->file, c->ctx, (long long)t->ne[0], ti->name, ti->block);
    // ne0/block * block_bytes and its product with the row count, both checked for overflow:
    uint64_t row = (uint64_t)(t->ne[0] / ti->block) * (uint64_t)ti->block_bytes;
    uint64_t rows = nelem / (uint64_t)t->ne[0];
    if ((uint64_t)(t->ne[0] / ti->block) > UINT64_MAX / (uint64_t)ti->block_bytes ||
        (rows && row > (uint64_t)SIZE_MAX / rows) || row * rows > (uint64_t)INT64_MAX)
        return st_fail(ST_ERR_FORMAT, "%s: %s: the byte size of %llu elements of %s overflows", c->file,
                       c->ctx, (unsigned long long)nelem, ti->name);
    t->bytes = (size_t)(row * rows);
    fat = c->pos;
    ST_TRY(rd(c, 8, "offset", &t->offset));
    if (t->offset % f->alignment)
        return st_fail(ST_ERR_FORMAT,
                       "%s: %s: data offset %llu at byte %zu is not a multiple of the alignment %u", c->file,
                       c->ctx, (unsigned long long)t->offset, fat, f->alignment);
    return ST_OK;
}

typedef struct span {
    uint64_t start, end;
    int64_t i;
} span;

static int span_cmp(const void *a, const void *b) {
    const span *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

// Places every tensor inside the data section and checks that no two overlap.
static st_status place_tensors(gfile *f) {
    if (!f->n_t) return ST_OK;
    span *sp = st_alloc((size_t)f->n_t * sizeof *sp);
    if (!sp) return ST_ERR_NOMEM;
    st_status s = ST_OK;
    for (int64_t i = 0; i < f->n_t && s == ST_OK; i++) {
        st_gguf_tensor *t = &f->t[i];
        uint64_t start = (uint64_t)f->data_start + t->offset, end = start + t->bytes;
        if (t->offset > f->size || start > f->size || t->bytes > f->size - start) {
            char pn[80];
            st_gguf_printable(pn, sizeof pn, t->name, strlen(t->name));
            if (t->offset > (uint64_t)INT64_MAX || t->bytes > (uint64_t)INT64_MAX - t->offset)
                s = st_fail(
                    ST_ERR_FORMAT,
                    "%s: tensor '%s' (info at byte %zu): data offset %llu + %zu bytes runs past the end "
                    "of the file (size %zu)",
                    f->name, pn, f->t_info_at[i], (unsigned long long)t->offset, t->bytes, f->size);
            else
                s = st_fail(ST_ERR_FORMAT,
                            "%s: tensor '%s' (info at byte %zu): data [%llu, %llu) runs past the end of the "
                            "file (size %zu)",
                            f->name, pn, f->t_info_at[i], (unsigned long long)start, (unsigned long long)end,
                            f->size);
            break;
        }
        t->offset = start; // from here on: absolute in this file
        t->data = f->base + start;
        sp[i] = (span){start, end, i};
    }
    if (s == ST_OK) {
        qsort(sp, (size_t)f->n_t, sizeof *sp, span_cmp);
        for (int64_t k = 1; k < f->n_t; k++) {
            if (sp[k].start >= sp[k - 1].end) continue;
            const st_gguf_tensor *a = &f->t[sp[k - 1].i], *b = &f->t[sp[k].i];
            char pa[80], pb[80];
            st_gguf_printable(pa, sizeof pa, a->name, strlen(a->name));
            st_gguf_printable(pb, sizeof pb, b->name, strlen(b->name));
            s = st_fail(ST_ERR_FORMAT,
                        "%s: tensor '%s' (info at byte %zu): data [%llu, %llu) overlaps tensor '%s' (info at "
                        "byte %zu), data [%llu, %llu)",
                        f->name, pb, f->t_info_at[sp[k].i], (unsigned long long)sp[k].start,
                        (unsigned long long)sp[k].end, pa, f->t_info_at[sp[k - 1].i],
                        (unsigned long long)sp[k - 1].start, (unsigned long long)sp[k - 1].end);
            break;
        }
    }
    st_free(sp);
    return s;
}

static st_status parse_file(gfile *f, const char *name, const uint8_t *base, size_t size) {
    memset(f, 0, sizeof *f);
    f->name = name;
    f->base = base;
    f->size = size;
    cursor c = {.p = base, .size = size, .file = name};
    snprintf(c.ctx, sizeof c.ctx, "header");
    uint32_t magic;
    ST_TRY(rd_u32(&c, "magic", &magic));
    if (magic != GGUF_MAGIC) {
        char pm[16];
        st_gguf_printable(pm, sizeof pm, base, 4);
        return st_fail(ST_ERR_FORMAT,
                       "%s: not a GGUF file: magic at byte 0 is '%s' (0x%08x), expected 'GGUF'", name, pm,
                       magic);
    }
    ST_TRY(rd_u32(&c, "version", &f->version));
    if (f->version != 2 && f->version != 3) {
        if (f->version == 1)
            return st_fail(ST_ERR_UNSUPPORTED,
                           "%s: GGUF version 1 (at byte 4) is not supported; only 2 and 3", name);
        return st_fail(ST_ERR_UNSUPPORTED, "%s: GGUF version %u at byte 4 is not supported (only 2 and 3)%s",
                       name, f->version, (f->version & 0xffff) == 0 ? "; is it a big-endian file?" : "");
    }
    uint64_t n_t, n_kv;
    ST_TRY(rd(&c, 8, "tensor_count", &n_t));
    ST_TRY(rd(&c, 8, "kv_count", &n_kv));
    // Bound the counts by the file before allocating anything sized by them: a KV takes at least
    // 13 bytes (key length, type, one byte of value), a tensor info at least 32.
    size_t left = size - c.pos;
    if (n_kv > left / 13)
        return st_fail(
            ST_ERR_FORMAT,
            "%s: header: kv_count %llu at byte 16 cannot fit in the file (size %zu; each key-value "
            "pair takes at least 13 bytes)",
            name, (unsigned long long)n_kv, size);
    if (n_t > left / 32)
        return st_fail(
            ST_ERR_FORMAT,
            "%s: header: tensor_count %llu at byte 8 cannot fit in the file (size %zu; each tensor "
            "info takes at least 32 bytes)",
            name, (unsigned long long)n_t, size);
    f->kv = st_calloc(n_kv ? (size_t)n_kv : 1, sizeof *f->kv);
    if (!f->kv) return ST_ERR_NOMEM;
    names seen = {0};
    ST_TRY(names_init(&seen, (int64_t)n_kv));
    st_status s = ST_OK;
    for (uint64_t i = 0; i < n_kv && s == ST_OK; i++) {
        s = parse_kv(&c, &f->kv[i], (int64_t)i, &seen, f->kv);
        f->n_kv = (int64_t)i + 1; // what was allocated is freed, even on failure
    }
    st_free(seen.slot);
    ST_TRY(s);

    f->alignment = ST_GGUF_DEFAULT_ALIGNMENT;
    const st_gguf_kv *al = gfile_kv(f, "general.alignment");
    if (al) {
        bool is_int = al->type <= ST_GGUF_I32 || al->type == ST_GGUF_U64 || al->type == ST_GGUF_I64;
        uint64_t v;
        if (!st_gguf_uint_value(al->type, al->value, &v)) v = 0; // negative: reported as not a power of two
        size_t at = (size_t)(al->value - base);
        if (!is_int)
            return st_fail(ST_ERR_FORMAT,
                           "%s: key 'general.alignment' (value at byte %zu) is a %s, not an integer", name,
                           at, vtype_names[al->type]);
        if (v == 0 || (v & (v - 1)) || v > ST_GGUF_MAX_ALIGNMENT)
            return st_fail(ST_ERR_FORMAT,
                           "%s: key 'general.alignment' (value at byte %zu) = %llu is not a power of two in "
                           "1..%u",
                           name, at, (unsigned long long)v, ST_GGUF_MAX_ALIGNMENT);
        f->alignment = (uint32_t)v;
    }

    f->t = st_calloc(n_t ? (size_t)n_t : 1, sizeof *f->t);
    f->t_info_at = st_calloc(n_t ? (size_t)n_t : 1, sizeof *f->t_info_at);
    if (!f->t || !f->t_info_at) return ST_ERR_NOMEM;
    for (uint64_t i = 0; i < n_t && s == ST_OK; i++) {
        s = parse_tensor_info(&c, f, (int64_t)i);
        f->n_t = (int64_t)i + 1;
    }
    ST_TRY(s);
    ST_TRY(names_init(&seen, (int64_t)n_t));
    for (int64_t i = 0; i < f->n_t && s == ST_OK; i++) {
        int64_t dup = names_add(&seen, f->t[i].name, i, tensor_name, f->t);
        if (dup < 0) continue;
        char pn[80];
        st_gguf_printable(pn, sizeof pn, f->t[i].name, strlen(f->t[i].name));
        s = st_fail(
            ST_ERR_FORMAT,
            "%s: tensor '%s' (info at byte %zu): duplicate tensor name (the info at byte %zu has it too)",
            name, pn, f->t_info_at[i], f->t_info_at[dup]);
    }
    st_free(seen.slot);
    ST_TRY(s);
    // c.pos <= size < 2^63, alignment <= 2^30: no overflow.
    f->data_start = (c.pos + f->alignment - 1) / f->alignment * f->alignment;
    return place_tensors(f);
}

// ---------------------------------------------------------------------------------------------
// The model: one file or every shard of a split one.

typedef struct shard {
    char *path;
    const uint8_t *base;
    size_t size;
    size_t map_bytes; // what munmap releases (the file's size, or the rounded anonymous copy)
    bool mapped;
} shard;

struct st_gguf {
    char *path;
    uint32_t version;
    int n_shards;
    shard *shards;
    size_t total_bytes;
    uint32_t alignment;
    int64_t n_kv; // from the first file
    st_gguf_kv *kv;
    names kv_names;
    int64_t n_t; // from every file, in shard order
    st_gguf_tensor *t;
    names t_names;
};

void st_gguf_free(st_gguf *g) {
    if (!g) return;
    kvs_free(g->kv, g->n_kv);
    tensors_free(g->t, g->n_t);
    st_free(g->kv_names.slot);
    st_free(g->t_names.slot);
    for (int i = 0; i < g->n_shards; i++) {
        if (g->shards[i].mapped && g->shards[i].map_bytes) munmap((void *)g->shards[i].base, g->shards[i].map_bytes);
        st_free(g->shards[i].path);
    }
    st_free(g->shards);
    st_free(g->path);
    st_free(g);
}

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = st_alloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

// The file's bytes in anonymous memory of huge pages (where the kernel gives them), read in
// pieces of at most 1 GiB.
static st_status read_file(shard *sh, int fd) {
    const size_t huge = (size_t)2 << 20, piece = (size_t)1 << 30;
    size_t bytes = (sh->size + huge - 1) / huge * huge;
    uint8_t *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return st_fail(ST_ERR_NOMEM, "%s: cannot allocate %.2f GiB to read the file into memory (--no-mmap): %s",
                       sh->path, bytes / 1073741824.0, strerror(errno));
#ifdef MADV_HUGEPAGE
    madvise(m, bytes, MADV_HUGEPAGE); // advice: without huge pages it still works
#endif
    for (size_t got = 0; got < sh->size;) {
        size_t want = sh->size - got < piece ? sh->size - got : piece;
        ssize_t r = pread(fd, m + got, want, (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            int e = r < 0 ? errno : 0;
            munmap(m, bytes);
            return st_fail(ST_ERR_IO, "%s: cannot read byte %zu of %zu: %s", sh->path, got, sh->size,
                           e ? strerror(e) : "the file became shorter");
        }
        got += (size_t)r;
    }
    mprotect(m, bytes, PROT_READ);
    sh->base = m;
    sh->map_bytes = bytes;
    sh->mapped = true;
    return ST_OK;
}

static st_status map_file(shard *sh, bool in_memory) {
    int fd = open(sh->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return st_fail(ST_ERR_IO, "%s: cannot open: %s", sh->path, strerror(errno));
    struct stat stt;
    if (fstat(fd, &stt) != 0) {
        int e = errno;
        close(fd);
        return st_fail(ST_ERR_IO, "%s: cannot stat: %s", sh->path, strerror(e));
    }
    if (!S_ISREG(stt.st_mode)) {
        close(fd);
        return st_fail(ST_ERR_IO, "%s: not a regular file", sh->path);
    }
    sh->size = (size_t)stt.st_size;
    if (sh->size == 0) {
        close(fd);
        return st_fail(ST_ERR_FORMAT, "%s: the file is empty (a GGUF file starts with a 24-byte header)",
                       sh->path);
    }
    if (in_memory) {
        st_status s = read_file(sh, fd);
        close(fd);
        return s;
    }
    void *m = mmap(NULL, sh->size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (m == MAP_FAILED)
        return st_fail(ST_ERR_IO, "%s: cannot map %zu bytes: %s", sh->path, sh->size, strerror(e));
    sh->base = m;
    sh->map_bytes = sh->size;
    sh->mapped = true;
    return ST_OK;
}

// Moves a parsed file's tensors into g (names are taken over, not copied).
static st_status take_tensors(st_gguf *g, gfile *f, int shard_no) {
    if (!f->n_t) return ST_OK;
    st_gguf_tensor *t = st_alloc((size_t)(g->n_t + f->n_t) * sizeof *t);
    if (!t) return ST_ERR_NOMEM;
    if (g->n_t) memcpy(t, g->t, (size_t)g->n_t * sizeof *t);
    for (int64_t i = 0; i < f->n_t; i++) {
        t[g->n_t + i] = f->t[i];
        t[g->n_t + i].shard = shard_no;
    }
    st_free(g->t);
    g->t = t;
    g->n_t += f->n_t;
    st_free(f->t);
    f->t = NULL;
    f->n_t = 0;
    return ST_OK;
}

static st_status index_names(st_gguf *g) {
    ST_TRY(names_init(&g->kv_names, g->n_kv));
    for (int64_t i = 0; i < g->n_kv; i++) names_add(&g->kv_names, g->kv[i].key, i, kv_name, g->kv);
    ST_TRY(names_init(&g->t_names, g->n_t));
    for (int64_t i = 0; i < g->n_t; i++) {
        int64_t dup = names_add(&g->t_names, g->t[i].name, i, tensor_name, g->t);
        if (dup < 0) continue;
        char pn[80];
        st_gguf_printable(pn, sizeof pn, g->t[i].name, strlen(g->t[i].name));
        const st_gguf_tensor *a = &g->t[dup], *b = &g->t[i];
        return st_fail(ST_ERR_FORMAT,
                       "%s: tensor '%s' (data at byte %llu): duplicate tensor name (also at byte %llu%s%s)",
                       g->shards[b->shard].path, pn, (unsigned long long)b->offset,
                       (unsigned long long)a->offset, a->shard != b->shard ? " of " : "",
                       a->shard != b->shard ? g->shards[a->shard].path : "");
    }
    return ST_OK;
}

static st_status finish(st_gguf *g, gfile *files) {
    g->version = files[0].version;
    g->alignment = files[0].alignment;
    g->kv = files[0].kv;
    g->n_kv = files[0].n_kv;
    files[0].kv = NULL;
    files[0].n_kv = 0;
    for (int i = 0; i < g->n_shards; i++) {
        ST_TRY(take_tensors(g, &files[i], i));
        g->total_bytes += g->shards[i].size;
    }
    return index_names(g);
}

st_status st_gguf_open_memory(const void *data, size_t size, const char *name, st_gguf **out) {
    *out = NULL;
    st_gguf *g = st_calloc(1, sizeof *g);
    if (!g) return ST_ERR_NOMEM;
    g->n_shards = 1;
    g->shards = st_calloc(1, sizeof *g->shards);
    g->path = dup_str(name ? name : "<memory>");
    if (!g->shards || !g->path || !(g->shards[0].path = dup_str(g->path))) {
        st_gguf_free(g);
        return ST_ERR_NOMEM;
    }
    g->shards[0].base = data;
    g->shards[0].size = size;
    gfile f;
    st_status s = parse_file(&f, g->path, data ? data : (const void *)"", data ? size : 0);
    if (s == ST_OK) s = finish(g, &f);
    gfile_free(&f);
    if (s != ST_OK) {
        st_gguf_free(g);
        return s;
    }
    *out = g;
    return ST_OK;
}

// "<prefix>-NNNNN-of-MMMMM.gguf": sets the prefix length, shard number and count.
static bool split_name(const char *path, size_t *prefix, int *no, int *count) {
    static const char tail[] = "-00000-of-00000.gguf";
    size_t n = strlen(path), tl = sizeof tail - 1;
    if (n < tl) return false;
    const char *s = path + n - tl;
    for (size_t i = 0; i < tl; i++) {
        bool digit = tail[i] == '0';
        if (digit ? (s[i] < '0' || s[i] > '9') : s[i] != tail[i]) return false;
    }
    *no = atoi(s + 1);
    *count = atoi(s + 10);
    *prefix = n - tl;
    return *count >= 1 && *no >= 1 && *no <= *count;
}

bool st_gguf_uint_value(st_gguf_vtype t, const uint8_t *p, uint64_t *v) {
    bool is_signed = t == ST_GGUF_I8 || t == ST_GGUF_I16 || t == ST_GGUF_I32 || t == ST_GGUF_I64;
    if (!is_signed && t != ST_GGUF_U8 && t != ST_GGUF_U16 && t != ST_GGUF_U32 && t != ST_GGUF_U64)
        return false;
    int n = (int)st_gguf_vtype_size(t);
    uint64_t u = st_gguf_le(p, n);
    if (is_signed && (u >> (8 * n - 1))) return false; // negative
    *v = u;
    return true;
}

static bool kv_uint(const st_gguf_kv *kv, uint64_t *v) { return st_gguf_uint_value(kv->type, kv->value, v); }

// Checks split.no / split.count / split.tensors.count of every shard against the file names.
static st_status check_split(st_gguf *g, gfile *files) {
    int n = g->n_shards;
    uint64_t total = 0;
    for (int i = 0; i < n; i++) {
        total += (uint64_t)files[i].n_t;
        const st_gguf_kv *cnt = gfile_kv(&files[i], "split.count"), *no = gfile_kv(&files[i], "split.no");
        uint64_t v;
        if (!cnt || !kv_uint(cnt, &v) || v != (uint64_t)n)
            return st_fail(ST_ERR_FORMAT, "%s: key 'split.count' is %s, but the file name says %d shards",
                           g->shards[i].path, cnt ? "not that number" : "missing", n);
        if (!no || !kv_uint(no, &v) || v != (uint64_t)i)
            return st_fail(ST_ERR_FORMAT,
                           "%s: key 'split.no' is %s, but the file name says shard %d (split.no %d)",
                           g->shards[i].path, no ? "another number" : "missing", i + 1, i);
    }
    const st_gguf_kv *tc = gfile_kv(&files[0], "split.tensors.count");
    uint64_t v;
    if (tc && (!kv_uint(tc, &v) || v != total))
        return st_fail(ST_ERR_FORMAT,
                       "%s: key 'split.tensors.count' does not match the %llu tensors in the %d shards",
                       g->shards[0].path, (unsigned long long)total, n);
    return ST_OK;
}

st_status st_gguf_open(const char *path, st_gguf **out) { return st_gguf_open_ex(path, false, out); }

st_status st_gguf_open_ex(const char *path, bool in_memory, st_gguf **out) {
    *out = NULL;
    size_t prefix;
    int no = 1, count = 1;
    bool split = split_name(path, &prefix, &no, &count) && count > 1;
    if (split && count > MAX_SHARDS) split = false;
    st_gguf *g = st_calloc(1, sizeof *g);
    if (!g) return ST_ERR_NOMEM;
    g->n_shards = split ? count : 1;
    g->shards = st_calloc((size_t)g->n_shards, sizeof *g->shards);
    gfile *files = st_calloc((size_t)g->n_shards, sizeof *files);
    st_status s = (g->shards && files) ? ST_OK : ST_ERR_NOMEM;
    for (int i = 0; i < g->n_shards && s == ST_OK; i++) {
        shard *sh = &g->shards[i];
        if (!split) {
            sh->path = dup_str(path);
        } else {
            size_t cap = prefix + 32;
            sh->path = st_alloc(cap);
            if (sh->path) snprintf(sh->path, cap, "%.*s-%05d-of-%05d.gguf", (int)prefix, path, i + 1, count);
        }
        if (!sh->path) {
            s = ST_ERR_NOMEM;
            break;
        }
        s = map_file(sh, in_memory);
        if (s != ST_OK && split && i + 1 != no)
            s = st_fail_prefix(s, "shard %d of %d is missing (opening %s)", i + 1, count, path);
        if (s == ST_OK) s = parse_file(&files[i], sh->path, sh->base, sh->size);
    }
    if (s == ST_OK && !(g->path = dup_str(g->shards[0].path))) s = ST_ERR_NOMEM;
    if (s == ST_OK && split) s = check_split(g, files);
    if (s == ST_OK && !split) {
        const st_gguf_kv *cnt = gfile_kv(&files[0], "split.count");
        uint64_t v;
        if (cnt && kv_uint(cnt, &v) && v > 1)
            s = st_fail(ST_ERR_FORMAT,
                        "%s: this is one shard of a split model (split.count = %llu), but the file name does "
                        "not end in -0000k-of-%05llu.gguf, so the other shards cannot be found",
                        path, (unsigned long long)v, (unsigned long long)v);
    }
    if (s == ST_OK) s = finish(g, files);
    for (int i = 0; files && i < g->n_shards; i++) gfile_free(&files[i]);
    st_free(files);
    if (s != ST_OK) {
        st_gguf_free(g);
        return s;
    }
    *out = g;
    return ST_OK;
}

// ---------------------------------------------------------------------------------------------
// Accessors

const char *st_gguf_path(const st_gguf *g) { return g->path; }
uint32_t st_gguf_version(const st_gguf *g) { return g->version; }
int st_gguf_shard_count(const st_gguf *g) { return g->n_shards; }
const char *st_gguf_shard_path(const st_gguf *g, int i) {
    return i >= 0 && i < g->n_shards ? g->shards[i].path : NULL;
}
size_t st_gguf_file_bytes(const st_gguf *g) { return g->total_bytes; }
uint32_t st_gguf_alignment(const st_gguf *g) { return g->alignment; }

int64_t st_gguf_kv_count(const st_gguf *g) { return g->n_kv; }
int64_t st_gguf_find_key(const st_gguf *g, const char *key) {
    return names_find(&g->kv_names, key, kv_name, g->kv);
}
const char *st_gguf_key(const st_gguf *g, int64_t i) { return i >= 0 && i < g->n_kv ? g->kv[i].key : NULL; }
st_gguf_vtype st_gguf_kv_type(const st_gguf *g, int64_t i) {
    return i >= 0 && i < g->n_kv ? g->kv[i].type : ST_GGUF_VTYPE_COUNT;
}
const st_gguf_kv *st_gguf_kv_at(const st_gguf *g, int64_t i) {
    return i >= 0 && i < g->n_kv ? &g->kv[i] : NULL;
}

static const st_gguf_kv *find(const st_gguf *g, const char *key) {
    int64_t i = st_gguf_find_key(g, key);
    return i < 0 ? NULL : &g->kv[i];
}

// An integer element of type t at p, as a sign flag and magnitude-free pair: signed types go to
// *iv (is_signed = true), unsigned ones to *uv.
static bool int_at(st_gguf_vtype t, const uint8_t *p, bool *is_signed, int64_t *iv, uint64_t *uv) {
    switch (t) {
    case ST_GGUF_U8:
    case ST_GGUF_U16:
    case ST_GGUF_U32:
    case ST_GGUF_U64:
    case ST_GGUF_BOOL:
        *is_signed = false;
        *uv = st_gguf_le(p, (int)st_gguf_vtype_size(t));
        return true;
    case ST_GGUF_I8:
        *is_signed = true;
        *iv = (int8_t)p[0];
        return true;
    case ST_GGUF_I16:
        *is_signed = true;
        *iv = (int16_t)(uint16_t)st_gguf_le(p, 2);
        return true;
    case ST_GGUF_I32:
        *is_signed = true;
        *iv = (int32_t)(uint32_t)st_gguf_le(p, 4);
        return true;
    case ST_GGUF_I64:
        *is_signed = true;
        *iv = (int64_t)st_gguf_le(p, 8);
        return true;
    default: return false;
    }
}

static bool float_at(st_gguf_vtype t, const uint8_t *p, double *out) {
    if (t == ST_GGUF_F32) {
        union {
            uint32_t u;
            float f;
        } v = {.u = (uint32_t)st_gguf_le(p, 4)};
        *out = v.f;
        return true;
    }
    if (t == ST_GGUF_F64) {
        union {
            uint64_t u;
            double f;
        } v = {.u = st_gguf_le(p, 8)};
        *out = v.f;
        return true;
    }
    bool sg;
    int64_t iv;
    uint64_t uv;
    if (!int_at(t, p, &sg, &iv, &uv)) return false;
    *out = sg ? (double)iv : (double)uv;
    return true;
}

static bool is_int_type(st_gguf_vtype t) { return t <= ST_GGUF_I32 || t == ST_GGUF_U64 || t == ST_GGUF_I64; }

bool st_gguf_get_u32(const st_gguf *g, const char *key, uint32_t *out) {
    uint64_t v;
    if (!st_gguf_get_u64(g, key, &v) || v > UINT32_MAX) return false;
    *out = (uint32_t)v;
    return true;
}

bool st_gguf_get_u64(const st_gguf *g, const char *key, uint64_t *out) {
    const st_gguf_kv *kv = find(g, key);
    bool sg;
    int64_t iv;
    uint64_t uv;
    if (!kv || !is_int_type(kv->type) || !int_at(kv->type, kv->value, &sg, &iv, &uv)) return false;
    if (sg && iv < 0) return false;
    *out = sg ? (uint64_t)iv : uv;
    return true;
}

bool st_gguf_get_i64(const st_gguf *g, const char *key, int64_t *out) {
    const st_gguf_kv *kv = find(g, key);
    bool sg;
    int64_t iv;
    uint64_t uv;
    if (!kv || !is_int_type(kv->type) || !int_at(kv->type, kv->value, &sg, &iv, &uv)) return false;
    if (!sg && uv > (uint64_t)INT64_MAX) return false;
    *out = sg ? iv : (int64_t)uv;
    return true;
}

bool st_gguf_get_f64(const st_gguf *g, const char *key, double *out) {
    const st_gguf_kv *kv = find(g, key);
    if (!kv || (kv->type != ST_GGUF_F32 && kv->type != ST_GGUF_F64)) return false;
    return float_at(kv->type, kv->value, out);
}

bool st_gguf_get_f32(const st_gguf *g, const char *key, float *out) {
    double d;
    if (!st_gguf_get_f64(g, key, &d)) return false;
    *out = (float)d;
    return true;
}

bool st_gguf_get_bool(const st_gguf *g, const char *key, bool *out) {
    const st_gguf_kv *kv = find(g, key);
    if (!kv || kv->type != ST_GGUF_BOOL) return false;
    *out = kv->value[0] != 0;
    return true;
}

bool st_gguf_get_str(const st_gguf *g, const char *key, const char **s, size_t *len) {
    const st_gguf_kv *kv = find(g, key);
    if (!kv || kv->type != ST_GGUF_STRING) return false;
    *len = (size_t)st_gguf_le(kv->value, 8);
    *s = (const char *)kv->value + 8;
    return true;
}

bool st_gguf_get_arr(const st_gguf *g, const char *key, st_gguf_vtype *elem_type, uint64_t *count,
                     const void **data) {
    const st_gguf_kv *kv = find(g, key);
    if (!kv || kv->type != ST_GGUF_ARRAY) return false;
    *elem_type = kv->elem;
    *count = kv->count;
    *data = kv->data;
    return true;
}

bool st_gguf_arr_str(const st_gguf *g, const char *key, uint64_t i, const char **s, size_t *len) {
    const st_gguf_kv *kv = find(g, key);
    if (!kv || kv->type != ST_GGUF_ARRAY || kv->elem != ST_GGUF_STRING || i >= kv->count) return false;
    return st_gguf_kv_arr_str(kv, i, s, len);
}

bool st_gguf_kv_arr_str(const st_gguf_kv *kv, uint64_t i, const char **s, size_t *len) {
    if (kv->type != ST_GGUF_ARRAY || kv->elem != ST_GGUF_STRING || i >= kv->count) return false;
    const uint8_t *p = kv->data + kv->str_at[i];
    *len = (size_t)st_gguf_le(p, 8);
    *s = (const char *)p + 8;
    return true;
}

bool st_gguf_kv_arr_i64(const st_gguf_kv *kv, uint64_t i, int64_t *out) {
    if (kv->type != ST_GGUF_ARRAY || i >= kv->count || !is_int_type(kv->elem)) return false;
    bool sg;
    int64_t iv;
    uint64_t uv;
    int_at(kv->elem, kv->data + i * st_gguf_vtype_size(kv->elem), &sg, &iv, &uv);
    if (!sg && uv > (uint64_t)INT64_MAX) return false;
    *out = sg ? iv : (int64_t)uv;
    return true;
}

bool st_gguf_kv_arr_f64(const st_gguf_kv *kv, uint64_t i, double *out) {
    if (kv->type != ST_GGUF_ARRAY || i >= kv->count || kv->elem == ST_GGUF_STRING ||
        kv->elem == ST_GGUF_ARRAY || kv->elem == ST_GGUF_BOOL)
        return false;
    return float_at(kv->elem, kv->data + i * st_gguf_vtype_size(kv->elem), out);
}

bool st_gguf_arr_i64(const st_gguf *g, const char *key, uint64_t i, int64_t *out) {
    const st_gguf_kv *kv = find(g, key);
    return kv && st_gguf_kv_arr_i64(kv, i, out);
}

bool st_gguf_arr_f64(const st_gguf *g, const char *key, uint64_t i, double *out) {
    const st_gguf_kv *kv = find(g, key);
    return kv && st_gguf_kv_arr_f64(kv, i, out);
}

int64_t st_gguf_tensor_count(const st_gguf *g) { return g->n_t; }
const st_gguf_tensor *st_gguf_tensor_at(const st_gguf *g, int64_t i) {
    return i >= 0 && i < g->n_t ? &g->t[i] : NULL;
}
const st_gguf_tensor *st_gguf_find_tensor(const st_gguf *g, const char *name) {
    int64_t i = names_find(&g->t_names, name, tensor_name, g->t);
    return i < 0 ? NULL : &g->t[i];
}
