// cli: `strata inspect FILE [--json] [--full]`: a GGUF model's architecture, hyper-parameters,
// tokenizer summary, metadata and tensor table (with totals per type), as text or one JSON
// object.

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "gguf/gguf.h"

// Why: vocabularies hold ~150k strings; arrays longer than this are summarised unless --full.
#define ARRAY_SHOWN 256

static void inspect_usage(FILE *f) {
    fprintf(f,
            "usage: strata inspect FILE [--json] [--full]\n"
            "  Shows a GGUF model: architecture, hyper-parameters (every <arch>.* key), tokenizer\n"
            "  summary, the other metadata, the tensor table (name, type, shape in ggml order with\n"
            "  ne0 first, bytes) and totals per type. A shard name (m-00001-of-00003.gguf) shows the\n"
            "  whole split model.\n"
            "  --json   print one JSON object instead of text\n"
            "  --full   print arrays longer than %d elements in full (default: count only)\n",
            ARRAY_SHOWN);
}

// ---------------------------------------------------------------------------------------------
// Values

// A JSON string from bytes that may not be valid UTF-8 (invalid bytes become U+FFFD).
static json_t *jstr(const char *s, size_t len) {
    json_t *j = json_stringn(s, len);
    if (j) return j;
    char *o = malloc(len * 3 + 1);
    if (!o) return json_null();
    size_t n = 0;
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < len;) {
        int k = u[i] < 0x80 ? 1 : (u[i] >> 5) == 6 ? 2 : (u[i] >> 4) == 14 ? 3 : (u[i] >> 3) == 30 ? 4 : 0;
        bool ok = k > 0 && i + (size_t)k <= len;
        for (int c = 1; ok && c < k; c++) ok = (u[i + c] & 0xc0) == 0x80;
        if (ok && k > 1) { // reject overlong forms, surrogates and values past U+10FFFF
            uint32_t cp = u[i] & (0x7f >> k);
            for (int c = 1; c < k; c++) cp = cp << 6 | (u[i + c] & 0x3f);
            ok = cp >= (k == 2   ? 0x80u
                        : k == 3 ? 0x800u
                                 : 0x10000u) &&
                 cp <= 0x10ffff && (cp < 0xd800 || cp > 0xdfff);
        }
        if (ok) {
            memcpy(o + n, s + i, (size_t)k);
            n += (size_t)k;
            i += (size_t)k;
        } else {
            memcpy(o + n, "\xef\xbf\xbd", 3);
            n += 3;
            i++;
        }
    }
    j = json_stringn(o, n);
    free(o);
    return j ? j : json_null();
}

static json_t *jnum(double d) {
    if (isnan(d)) return json_string("nan");
    if (isinf(d)) return json_string(d > 0 ? "inf" : "-inf");
    return json_real(d);
}

static uint64_t le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

// One fixed-size element of type t at p as JSON.
static json_t *jscalar(st_gguf_vtype t, const uint8_t *p) {
    switch (t) {
    case ST_GGUF_U8:
    case ST_GGUF_U16:
    case ST_GGUF_U32: return json_integer((json_int_t)le(p, (int)st_gguf_vtype_size(t)));
    case ST_GGUF_U64: {
        uint64_t v = le(p, 8);
        if (v <= (uint64_t)INT64_MAX) return json_integer((json_int_t)v);
        char b[32];
        snprintf(b, sizeof b, "%llu", (unsigned long long)v); // JSON integers stop at 2^63
        return json_string(b);
    }
    case ST_GGUF_I8: return json_integer((int8_t)p[0]);
    case ST_GGUF_I16: return json_integer((int16_t)(uint16_t)le(p, 2));
    case ST_GGUF_I32: return json_integer((int32_t)(uint32_t)le(p, 4));
    case ST_GGUF_I64: return json_integer((json_int_t)(int64_t)le(p, 8));
    case ST_GGUF_F32: {
        union {
            uint32_t u;
            float f;
        } v = {.u = (uint32_t)le(p, 4)};
        return jnum(v.f);
    }
    case ST_GGUF_F64: {
        union {
            uint64_t u;
            double f;
        } v = {.u = le(p, 8)};
        return jnum(v.f);
    }
    case ST_GGUF_BOOL: return json_boolean(p[0]);
    default: return json_null();
    }
}

// Decodes an encoded value of type t at p (validated by the reader) into JSON; returns the byte
// after it. `limit`: arrays longer than this become {"count": n} (0 = no limit).
static const uint8_t *jvalue(st_gguf_vtype t, const uint8_t *p, uint64_t limit, json_t **out) {
    if (t == ST_GGUF_STRING) {
        size_t len = (size_t)le(p, 8);
        *out = jstr((const char *)p + 8, len);
        return p + 8 + len;
    }
    if (t != ST_GGUF_ARRAY) {
        *out = jscalar(t, p);
        return p + st_gguf_vtype_size(t);
    }
    st_gguf_vtype et = (st_gguf_vtype)le(p, 4);
    uint64_t n = le(p + 4, 8);
    p += 12;
    bool shown = !limit || n <= limit;
    json_t *arr = shown ? json_array() : NULL;
    size_t esz = st_gguf_vtype_size(et);
    if (!shown && esz) {
        p += n * esz;
    } else {
        for (uint64_t i = 0; i < n; i++) {
            json_t *e;
            p = jvalue(et, p, limit, &e);
            if (shown)
                json_array_append_new(arr, e);
            else
                json_decref(e);
        }
    }
    if (!shown) {
        arr = json_object();
        json_object_set_new(arr, "elem_type", json_string(st_gguf_vtype_name(et)));
        json_object_set_new(arr, "count", json_integer((json_int_t)n));
    }
    *out = arr;
    return p;
}

// The shortest decimal that reads back as the same float / double.
static void print_real(FILE *f, st_gguf_vtype t, const uint8_t *p) {
    char b[40];
    if (t == ST_GGUF_F32) {
        union {
            uint32_t u;
            float v;
        } x = {.u = (uint32_t)le(p, 4)};
        for (int prec = 6; prec <= 9; prec++) {
            snprintf(b, sizeof b, "%.*g", prec, (double)x.v);
            if (strtof(b, NULL) == x.v || x.v != x.v) break;
        }
    } else {
        union {
            uint64_t u;
            double v;
        } x = {.u = le(p, 8)};
        for (int prec = 15; prec <= 17; prec++) {
            snprintf(b, sizeof b, "%.*g", prec, x.v);
            if (strtod(b, NULL) == x.v || x.v != x.v) break;
        }
    }
    fputs(b, f);
}

// Text form of a value; long strings and arrays are cut (the JSON form has them whole).
static void print_value(FILE *f, const st_gguf_kv *kv) {
    json_t *j;
    if (kv->type == ST_GGUF_ARRAY) {
        fprintf(f, "[%s x %llu]", st_gguf_vtype_name(kv->elem), (unsigned long long)kv->count);
        if (kv->elem == ST_GGUF_ARRAY || kv->count == 0) return;
        fputs(" [", f);
        uint64_t shown = kv->count < 6 ? kv->count : 6;
        const uint8_t *p = kv->data;
        for (uint64_t i = 0; i < shown; i++) {
            if (kv->elem == ST_GGUF_F32 || kv->elem == ST_GGUF_F64) {
                fputs(i ? ", " : "", f);
                print_real(f, kv->elem, p);
                p += st_gguf_vtype_size(kv->elem);
                continue;
            }
            p = jvalue(kv->elem, p, 1, &j);
            char *s = json_dumps(j, JSON_ENCODE_ANY);
            if (s && strlen(s) > 40) strcpy(s + 36, "...\"");
            fprintf(f, "%s%s", i ? ", " : "", s ? s : "?");
            free(s);
            json_decref(j);
        }
        fprintf(f, "%s]", shown < kv->count ? ", ..." : "");
        return;
    }
    if (kv->type == ST_GGUF_F32 || kv->type == ST_GGUF_F64) {
        print_real(f, kv->type, kv->value);
        return;
    }
    jvalue(kv->type, kv->value, 1, &j);
    char *s = json_dumps(j, JSON_ENCODE_ANY);
    if (s && kv->type == ST_GGUF_STRING && strlen(s) > 72) {
        fprintf(f, "%.64s...\" (%llu bytes)", s, (unsigned long long)le(kv->value, 8));
    } else {
        fputs(s ? s : "?", f);
    }
    free(s);
    json_decref(j);
}

// ---------------------------------------------------------------------------------------------
// Summaries

typedef struct type_total {
    int64_t count;
    uint64_t bytes;
} type_total;

static void human(char *b, size_t cap, double bytes) {
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int i = 0;
    while (bytes >= 1024 && i < 4) bytes /= 1024, i++;
    snprintf(b, cap, i ? "%.2f %s" : "%.0f %s", bytes, u[i]);
}

static bool tok_str(const st_gguf *g, const char *key, json_t **out) {
    const char *s;
    size_t len;
    if (!st_gguf_get_str(g, key, &s, &len)) return false;
    *out = jstr(s, len);
    return true;
}

static json_t *tokenizer_summary(const st_gguf *g) {
    json_t *t = json_object(), *v;
    json_object_set_new(t, "model", tok_str(g, "tokenizer.ggml.model", &v) ? v : json_null());
    json_object_set_new(t, "pre", tok_str(g, "tokenizer.ggml.pre", &v) ? v : json_null());
    st_gguf_vtype et;
    uint64_t n;
    const void *d;
    json_object_set_new(t, "vocab_size",
                        st_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n, &d) ? json_integer((json_int_t)n)
                                                                                 : json_null());
    json_object_set_new(t, "merges",
                        st_gguf_get_arr(g, "tokenizer.ggml.merges", &et, &n, &d) ? json_integer((json_int_t)n)
                                                                                 : json_null());
    int64_t id;
    json_object_set_new(t, "bos_token_id",
                        st_gguf_get_i64(g, "tokenizer.ggml.bos_token_id", &id) ? json_integer(id)
                                                                               : json_null());
    json_object_set_new(t, "eos_token_id",
                        st_gguf_get_i64(g, "tokenizer.ggml.eos_token_id", &id) ? json_integer(id)
                                                                               : json_null());
    const char *s;
    size_t len;
    json_object_set_new(t, "has_chat_template",
                        json_boolean(st_gguf_get_str(g, "tokenizer.chat_template", &s, &len)));
    return t;
}

static json_t *shape(const st_gguf_tensor *t) {
    json_t *a = json_array();
    for (int d = 0; d < t->n_dims; d++) json_array_append_new(a, json_integer(t->ne[d]));
    return a;
}

static int print_json(const st_gguf *g, const char *arch, size_t arch_len, bool full) {
    json_t *o = json_object();
    json_object_set_new(o, "file", jstr(st_gguf_path(g), strlen(st_gguf_path(g))));
    json_object_set_new(o, "version", json_integer(st_gguf_version(g)));
    json_object_set_new(o, "file_bytes", json_integer((json_int_t)st_gguf_file_bytes(g)));
    json_object_set_new(o, "shards", json_integer(st_gguf_shard_count(g)));
    json_object_set_new(o, "alignment", json_integer(st_gguf_alignment(g)));
    json_object_set_new(o, "architecture", arch ? jstr(arch, arch_len) : json_null());

    json_t *hp = json_object(), *meta = json_object();
    for (int64_t i = 0; i < st_gguf_kv_count(g); i++) {
        const st_gguf_kv *kv = st_gguf_kv_at(g, i);
        json_t *v;
        jvalue(kv->type, kv->value, full ? 0 : ARRAY_SHOWN, &v);
        if (arch && !strncmp(kv->key, arch, arch_len) && kv->key[arch_len] == '.')
            json_object_set(hp, kv->key, v);
        json_t *m = json_object();
        json_object_set_new(m, "type", json_string(st_gguf_vtype_name(kv->type)));
        if (kv->type == ST_GGUF_ARRAY) {
            json_object_set_new(m, "elem_type", json_string(st_gguf_vtype_name(kv->elem)));
            json_object_set_new(m, "count", json_integer((json_int_t)kv->count));
        }
        if (json_is_array(v) || kv->type != ST_GGUF_ARRAY) json_object_set(m, "value", v);
        json_decref(v);
        json_object_set_new(meta, kv->key, m);
    }
    json_object_set_new(o, "hparams", hp);
    json_object_set_new(o, "tokenizer", tokenizer_summary(g));
    json_object_set_new(o, "metadata", meta);

    json_t *ts = json_array(), *totals = json_object();
    type_total tot[ST_TYPE_COUNT] = {{0}};
    uint64_t all = 0;
    for (int64_t i = 0; i < st_gguf_tensor_count(g); i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        json_t *e = json_object();
        json_object_set_new(e, "name", jstr(t->name, strlen(t->name)));
        json_object_set_new(e, "type", json_string(st_type_name(t->type)));
        json_object_set_new(e, "shape", shape(t));
        json_object_set_new(e, "bytes", json_integer((json_int_t)t->bytes));
        json_object_set_new(e, "offset", json_integer((json_int_t)t->offset));
        json_object_set_new(e, "shard", json_integer(t->shard));
        json_array_append_new(ts, e);
        tot[t->type].count++;
        tot[t->type].bytes += t->bytes;
        all += t->bytes;
    }
    for (int ty = 0; ty < ST_TYPE_COUNT; ty++) {
        if (!tot[ty].count) continue;
        json_t *e = json_object();
        json_object_set_new(e, "count", json_integer(tot[ty].count));
        json_object_set_new(e, "bytes", json_integer((json_int_t)tot[ty].bytes));
        json_object_set_new(totals, st_type_name(ty), e);
    }
    json_object_set_new(o, "tensor_count", json_integer(st_gguf_tensor_count(g)));
    json_object_set_new(o, "tensor_bytes", json_integer((json_int_t)all));
    json_object_set_new(o, "tensors", ts);
    json_object_set_new(o, "type_totals", totals);
    int rc = json_dumpf(o, stdout, JSON_INDENT(1) | JSON_PRESERVE_ORDER) == 0 ? 0 : 1;
    fputc('\n', stdout);
    json_decref(o);
    if (rc) fprintf(stderr, "strata inspect: writing the JSON failed\n");
    return rc;
}

static void print_kv_line(const st_gguf_kv *kv) {
    char ty[32];
    if (kv->type == ST_GGUF_ARRAY)
        snprintf(ty, sizeof ty, "arr");
    else
        snprintf(ty, sizeof ty, "%s", st_gguf_vtype_name(kv->type));
    printf("  %-44s %-6s ", kv->key, ty);
    print_value(stdout, kv);
    putchar('\n');
}

static bool is_tokenizer_key(const char *k) { return !strncmp(k, "tokenizer.", 10); }

static int print_text(const st_gguf *g, const char *arch, size_t arch_len) {
    char hb[32];
    human(hb, sizeof hb, (double)st_gguf_file_bytes(g));
    int ns = st_gguf_shard_count(g);
    printf("file:          %s (GGUF v%u, %d shard%s, %s, alignment %u)\n", st_gguf_path(g),
           st_gguf_version(g), ns, ns == 1 ? "" : "s", hb, st_gguf_alignment(g));
    printf("architecture:  %.*s\n", arch ? (int)arch_len : 7, arch ? arch : "unknown");
    const char *name;
    size_t nlen;
    if (st_gguf_get_str(g, "general.name", &name, &nlen)) printf("name:          %.*s\n", (int)nlen, name);

    if (arch) {
        printf("\nhyper-parameters (%.*s.*):\n", (int)arch_len, arch);
        for (int64_t i = 0; i < st_gguf_kv_count(g); i++) {
            const st_gguf_kv *kv = st_gguf_kv_at(g, i);
            if (!strncmp(kv->key, arch, arch_len) && kv->key[arch_len] == '.') print_kv_line(kv);
        }
    }

    json_t *tk = tokenizer_summary(g);
    printf("\ntokenizer:\n");
    const char *labels[][2] = {{"model", "model"},
                               {"pre", "pre-tokenizer"},
                               {"vocab_size", "vocabulary"},
                               {"merges", "merges"},
                               {"bos_token_id", "bos id"},
                               {"eos_token_id", "eos id"},
                               {"has_chat_template", "chat template"}};
    for (size_t i = 0; i < sizeof labels / sizeof labels[0]; i++) {
        json_t *v = json_object_get(tk, labels[i][0]);
        if (json_is_null(v))
            printf("  %-14s -\n", labels[i][1]);
        else if (json_is_string(v))
            printf("  %-14s %s\n", labels[i][1], json_string_value(v));
        else if (json_is_boolean(v))
            printf("  %-14s %s\n", labels[i][1], json_is_true(v) ? "yes" : "no");
        else
            printf("  %-14s %lld\n", labels[i][1], (long long)json_integer_value(v));
    }
    json_decref(tk);

    printf("\nother metadata:\n");
    for (int64_t i = 0; i < st_gguf_kv_count(g); i++) {
        const st_gguf_kv *kv = st_gguf_kv_at(g, i);
        if (arch && !strncmp(kv->key, arch, arch_len) && kv->key[arch_len] == '.') continue;
        if (is_tokenizer_key(kv->key) && kv->type == ST_GGUF_ARRAY && kv->count > 64) {
            printf("  %-44s %-6s [%s x %llu]\n", kv->key, "arr", st_gguf_vtype_name(kv->elem),
                   (unsigned long long)kv->count);
            continue;
        }
        print_kv_line(kv);
    }

    int64_t nt = st_gguf_tensor_count(g);
    printf("\ntensors (%lld):\n  %-48s %-8s %-28s %14s\n", (long long)nt, "name", "type", "shape (ne0 first)",
           "bytes");
    type_total tot[ST_TYPE_COUNT] = {{0}};
    uint64_t all = 0;
    for (int64_t i = 0; i < nt; i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        char sh[96];
        int n = 0;
        for (int d = 0; d < t->n_dims && n < (int)sizeof sh; d++)
            n += snprintf(sh + n, sizeof sh - (size_t)n, "%s%lld", d ? " x " : "", (long long)t->ne[d]);
        printf("  %-48s %-8s %-28s %14zu\n", t->name, st_type_name(t->type), sh, t->bytes);
        tot[t->type].count++;
        tot[t->type].bytes += t->bytes;
        all += t->bytes;
    }
    printf("\ntotals per type:\n");
    for (int ty = 0; ty < ST_TYPE_COUNT; ty++) {
        if (!tot[ty].count) continue;
        human(hb, sizeof hb, (double)tot[ty].bytes);
        printf("  %-8s %6lld tensors %16llu bytes (%s)\n", st_type_name(ty), (long long)tot[ty].count,
               (unsigned long long)tot[ty].bytes, hb);
    }
    human(hb, sizeof hb, (double)all);
    printf("  %-8s %6lld tensors %16llu bytes (%s)\n", "all", (long long)nt, (unsigned long long)all, hb);
    return 0;
}

int st_cmd_inspect(int argc, char **argv) {
    const char *path = NULL;
    bool json = false, full = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            inspect_usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--json")) {
            json = true;
        } else if (!strcmp(argv[i], "--full")) {
            full = true;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "strata inspect: unknown option '%s'\n", argv[i]);
            inspect_usage(stderr);
            return 2;
        } else if (!path) {
            path = argv[i];
        } else {
            fprintf(stderr, "strata inspect: one FILE only ('%s' is extra)\n", argv[i]);
            return 2;
        }
    }
    if (!path) {
        inspect_usage(stderr);
        return 2;
    }
    st_gguf *g;
    st_status s = st_gguf_open(path, &g);
    if (s != ST_OK) return st_cli_fail(s);
    const char *arch = NULL;
    size_t arch_len = 0;
    if (!st_gguf_get_str(g, "general.architecture", &arch, &arch_len)) arch = NULL;
    int rc = json ? print_json(g, arch, arch_len, full) : print_text(g, arch, arch_len);
    st_gguf_free(g);
    return rc;
}
