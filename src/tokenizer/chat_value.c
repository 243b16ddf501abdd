// chat templates: the arena, the Jinja value type, and how values print — Python's str() and
// repr() (the renderer must print what Jinja2 on CPython prints) and json.dumps for `tojson`.

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/chat_impl.h"

// ---------------------------------------------------------------------------------------------
// Arena

#define CHUNK_MIN (64 * 1024)

struct jchunk {
    jchunk *next;
    size_t size, used;
    _Alignas(16) unsigned char data[];
};

void ja_init(jarena *a, size_t cap) {
    a->head = NULL;
    a->total = 0;
    a->cap = cap;
}

void ja_free(jarena *a) {
    for (jchunk *c = a->head, *n; c; c = n) {
        n = c->next;
        free(c);
    }
    a->head = NULL;
    a->total = 0;
}

void *ja_alloc(jarena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (n == 0) n = 16;
    jchunk *c = a->head;
    if (!c || c->size - c->used < n) {
        size_t sz = n > CHUNK_MIN ? n : CHUNK_MIN;
        if (a->cap && a->total + sz + sizeof(jchunk) > a->cap) return NULL;
        c = malloc(sizeof(jchunk) + sz);
        if (!c) return NULL;
        c->size = sz;
        c->used = 0;
        c->next = a->head;
        a->head = c;
        a->total += sz + sizeof(jchunk);
    }
    void *p = c->data + c->used;
    c->used += n;
    memset(p, 0, n);
    return p;
}

// ---------------------------------------------------------------------------------------------
// Output buffer

bool jb_put(jbuf *b, const char *s, size_t n) {
    if (b->over) return false;
    if (b->max && b->len + n > b->max) {
        b->over = true;
        return false;
    }
    if (b->len + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->len + n + 1) nc *= 2;
        char *np = realloc(b->p, nc);
        if (!np) {
            b->over = true;
            return false;
        }
        b->p = np, b->cap = nc;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
    return true;
}

bool jb_printf(jbuf *b, const char *fmt, ...) {
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k < 0) return false;
    if ((size_t)k < sizeof tmp) return jb_put(b, tmp, (size_t)k);
    char *big = malloc((size_t)k + 1);
    if (!big) return false;
    va_start(ap, fmt);
    vsnprintf(big, (size_t)k + 1, fmt, ap);
    va_end(ap);
    bool ok = jb_put(b, big, (size_t)k);
    free(big);
    return ok;
}

void jb_free(jbuf *b) {
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

// ---------------------------------------------------------------------------------------------
// UTF-8

uint32_t utf8_next(const char *s, size_t n, size_t *i) {
    const unsigned char *u = (const unsigned char *)s;
    size_t k = *i;
    unsigned char c = u[k];
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (!len || k + (size_t)len > n) {
        *i = k + 1;
        return 0xFFFD;
    }
    uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
    for (int j = 1; j < len; j++) {
        if ((u[k + (size_t)j] & 0xC0) != 0x80) {
            *i = k + 1;
            return 0xFFFD;
        }
        cp = (cp << 6) | (u[k + (size_t)j] & 0x3F);
    }
    *i = k + (size_t)len;
    return cp;
}

size_t utf8_count(const char *s, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n;) {
        utf8_next(s, n, &i);
        c++;
    }
    return c;
}

bool jv_is_ascii(const jstr *s) {
    for (size_t i = 0; i < s->len; i++)
        if ((unsigned char)s->s[i] >= 0x80) return false;
    return true;
}

// ---------------------------------------------------------------------------------------------
// Constructors

jstr *js_new(jarena *a, const char *s, size_t n) {
    jstr *r = ja_alloc(a, sizeof *r + n + 1);
    if (!r) return NULL;
    r->len = n;
    if (n) memcpy(r->s, s, n);
    r->s[n] = 0;
    return r;
}

jval jv_str(jarena *a, const char *s, size_t n) {
    jstr *r = js_new(a, s, n);
    return r ? jv_strp(r) : jv_undef(NULL);
}

jlist *jl_new(jarena *a, size_t n) {
    jlist *l = ja_alloc(a, sizeof *l);
    if (!l) return NULL;
    l->n = n;
    if (n && !(l->v = ja_alloc(a, n * sizeof *l->v))) return NULL;
    return l;
}

jdict *jd_new(jarena *a, size_t cap) {
    jdict *d = ja_alloc(a, sizeof *d);
    if (!d) return NULL;
    if (cap < 2) cap = 2;
    d->cap = cap;
    d->k = ja_alloc(a, cap * sizeof *d->k);
    d->v = ja_alloc(a, cap * sizeof *d->v);
    return d->k && d->v ? d : NULL;
}

const jval *jd_getv(const jdict *d, jval key) {
    for (size_t i = 0; i < d->n; i++)
        if (jv_equal(d->k[i], key)) return &d->v[i];
    return NULL;
}

const jval *jd_get(const jdict *d, const char *key, size_t klen) {
    for (size_t i = 0; i < d->n; i++)
        if (d->k[i].t == JV_STR && d->k[i].s->len == klen && !memcmp(d->k[i].s->s, key, klen))
            return &d->v[i];
    return NULL;
}

bool jd_set(jarena *a, jdict *d, jval k, jval v) {
    for (size_t i = 0; i < d->n; i++)
        if (jv_equal(d->k[i], k)) {
            d->v[i] = v;
            return true;
        }
    if (d->n == d->cap) {
        size_t nc = d->cap * 2;
        jval *nk = ja_alloc(a, nc * sizeof *nk), *nv = ja_alloc(a, nc * sizeof *nv);
        if (!nk || !nv) return false;
        memcpy(nk, d->k, d->n * sizeof *nk);
        memcpy(nv, d->v, d->n * sizeof *nv);
        d->k = nk, d->v = nv, d->cap = nc;
    }
    d->k[d->n] = k;
    d->v[d->n++] = v;
    return true;
}

// ---------------------------------------------------------------------------------------------
// Python semantics: truth, equality, type names

bool jv_truthy(jval v) {
    switch (v.t) {
    case JV_UNDEF: case JV_NONE: return false;
    case JV_BOOL: return v.b;
    case JV_INT: return v.i != 0;
    case JV_FLOAT: return v.f != 0.0;
    case JV_STR: return v.s->len > 0;
    case JV_LIST: return v.l->n > 0;
    case JV_DICT: return v.d->n > 0;
    default: return true;
    }
}

static bool is_num(jval v) { return v.t == JV_BOOL || v.t == JV_INT || v.t == JV_FLOAT; }
static double num_f(jval v) { return v.t == JV_FLOAT ? v.f : v.t == JV_INT ? (double)v.i : v.b; }

static bool equal_d(jval a, jval b, int depth);
bool jv_equal(jval a, jval b) { return equal_d(a, b, 0); }

static bool equal_d(jval a, jval b, int depth) {
    if (depth > JV_MAX_NEST) return false; // deeper than anything printable; never equal
    if (is_num(a) && is_num(b)) {
        if (a.t != JV_FLOAT && b.t != JV_FLOAT) {
            int64_t x = a.t == JV_INT ? a.i : a.b, y = b.t == JV_INT ? b.i : b.b;
            return x == y;
        }
        return num_f(a) == num_f(b);
    }
    if (a.t != b.t) return false;
    switch (a.t) {
    case JV_UNDEF: case JV_NONE: return true;
    case JV_STR: return a.s->len == b.s->len && !memcmp(a.s->s, b.s->s, a.s->len);
    case JV_LIST:
        if (a.l->n != b.l->n || a.l->tuple != b.l->tuple) return false;
        for (size_t i = 0; i < a.l->n; i++)
            if (!equal_d(a.l->v[i], b.l->v[i], depth + 1)) return false;
        return true;
    case JV_DICT:
        if (a.d->n != b.d->n) return false;
        for (size_t i = 0; i < a.d->n; i++) {
            const jval *o = jd_getv(b.d, a.d->k[i]);
            if (!o || !equal_d(a.d->v[i], *o, depth + 1)) return false;
        }
        return true;
    case JV_NS: return a.d == b.d;
    case JV_FUNC: return a.fn == b.fn;
    case JV_MACRO: return a.m == b.m;
    case JV_LOOP: return a.loop == b.loop;
    default: return false;
    }
}

const char *jv_type_name(jval v) {
    switch (v.t) {
    case JV_UNDEF: return "Undefined";
    case JV_NONE: return "NoneType";
    case JV_BOOL: return "bool";
    case JV_INT: return "int";
    case JV_FLOAT: return "float";
    case JV_STR: return "str";
    case JV_LIST: return v.l->tuple ? "tuple" : "list";
    case JV_DICT: return "dict";
    case JV_NS: return "Namespace";
    case JV_FUNC: return "builtin_function_or_method";
    case JV_MACRO: return "Macro";
    case JV_LOOP: return "LoopContext";
    }
    return "object";
}

// ---------------------------------------------------------------------------------------------
// Printing

// repr(float): the shortest digits that read back to the same double, laid out as CPython does
// (fixed notation for exponents in [-4, 16), else d.ddde+XX).
void jv_write_float(jbuf *b, double f) {
    if (isnan(f)) {
        jb_puts(b, "nan");
        return;
    }
    if (isinf(f)) {
        jb_puts(b, f < 0 ? "-inf" : "inf");
        return;
    }
    char tmp[40];
    int prec = 1;
    for (; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, f);
        if (strtod(tmp, NULL) == f) break;
    }
    // tmp: [-]d[.ddd]e[+-]XX
    char digits[24];
    int nd = 0, exp10;
    bool neg = tmp[0] == '-';
    const char *q = tmp + (neg ? 1 : 0);
    for (; *q && *q != 'e'; q++)
        if (*q >= '0' && *q <= '9') digits[nd++] = *q;
    exp10 = atoi(q + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--; // trailing zeros carry nothing
    char out[64];
    int o = 0;
    if (neg) out[o++] = '-';
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            out[o++] = '0';
            out[o++] = '.';
            for (int k = 0; k < -exp10 - 1; k++) out[o++] = '0';
            for (int k = 0; k < nd; k++) out[o++] = digits[k];
        } else {
            for (int k = 0; k <= exp10; k++) out[o++] = k < nd ? digits[k] : '0';
            out[o++] = '.';
            if (nd > exp10 + 1)
                for (int k = exp10 + 1; k < nd; k++) out[o++] = digits[k];
            else
                out[o++] = '0';
        }
        out[o] = 0;
    } else {
        out[o++] = digits[0];
        if (nd > 1) {
            out[o++] = '.';
            for (int k = 1; k < nd; k++) out[o++] = digits[k];
        }
        snprintf(out + o, sizeof out - (size_t)o, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
    }
    jb_puts(b, out);
}

// Python's str.isprintable() for a code point, close enough for repr(): controls, the C1 range,
// separators other than the ASCII space, and a few format characters are not printable.
static bool py_printable(uint32_t cp) {
    if (cp < 0x20 || cp == 0x7F) return false;
    if (cp >= 0x80 && cp <= 0xA0) return false;
    if (cp == 0xAD) return false;
    if (cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200F) || (cp >= 0x2028 && cp <= 0x202F) ||
        (cp >= 0x205F && cp <= 0x206F) || cp == 0x3000 || cp == 0xFEFF)
        return false;
    if (cp >= 0xD800 && cp <= 0xDFFF) return false;
    if (cp >= 0xE000 && cp <= 0xF8FF) return false; // private use
    if ((cp & 0xFFFE) == 0xFFFE) return false;
    if (cp == 0xFFF9 || cp == 0xFFFA || cp == 0xFFFB) return false;
    if (cp >= 0xF0000) return false;
    return true;
}

static bool write_repr_str(jbuf *b, const jstr *s) {
    bool has_sq = memchr(s->s, '\'', s->len) != NULL, has_dq = memchr(s->s, '"', s->len) != NULL;
    char q = has_sq && !has_dq ? '"' : '\'';
    jb_put(b, &q, 1);
    for (size_t i = 0; i < s->len;) {
        size_t st = i;
        uint32_t cp = utf8_next(s->s, s->len, &i);
        char e[16];
        if (cp == (uint32_t)q || cp == '\\') {
            e[0] = '\\', e[1] = (char)cp;
            jb_put(b, e, 2);
        } else if (cp == '\n') jb_puts(b, "\\n");
        else if (cp == '\r') jb_puts(b, "\\r");
        else if (cp == '\t') jb_puts(b, "\\t");
        else if (!py_printable(cp)) {
            if (cp < 0x100) snprintf(e, sizeof e, "\\x%02x", cp);
            else if (cp < 0x10000) snprintf(e, sizeof e, "\\u%04x", cp);
            else snprintf(e, sizeof e, "\\U%08x", cp);
            jb_puts(b, e);
        } else {
            jb_put(b, s->s + st, i - st);
        }
    }
    return jb_put(b, &q, 1);
}

static bool write_seq(jbuf *b, jval v, int depth);
static bool write_str_d(jbuf *b, jval v, int depth);

static bool write_repr_d(jbuf *b, jval v, int depth) {
    if (v.t == JV_STR) return write_repr_str(b, v.s);
    if (v.t == JV_UNDEF) return jb_puts(b, "Undefined"); // repr() of Jinja's Undefined, inside a list
    return write_str_d(b, v, depth);
}
bool jv_write_repr(jbuf *b, jval v) { return write_repr_d(b, v, 0); }

static bool write_seq(jbuf *b, jval v, int depth) {
    if (depth > JV_MAX_NEST) {
        b->too_deep = true;
        return false;
    }
    if (v.t == JV_LIST) {
        jb_puts(b, v.l->tuple ? "(" : "[");
        for (size_t i = 0; i < v.l->n; i++) {
            if (i) jb_puts(b, ", ");
            if (!write_repr_d(b, v.l->v[i], depth + 1) && b->too_deep) return false;
        }
        if (v.l->tuple && v.l->n == 1) jb_puts(b, ",");
        return jb_puts(b, v.l->tuple ? ")" : "]");
    }
    jb_puts(b, "{");
    for (size_t i = 0; i < v.d->n; i++) {
        if (i) jb_puts(b, ", ");
        jv_write_repr(b, v.d->k[i]);
        jb_puts(b, ": ");
        if (!write_repr_d(b, v.d->v[i], depth + 1) && b->too_deep) return false;
    }
    return jb_puts(b, "}");
}

bool jv_write_str(jbuf *b, jval v) { return write_str_d(b, v, 0); }

static bool write_str_d(jbuf *b, jval v, int depth) {
    switch (v.t) {
    case JV_UNDEF: return true;
    case JV_NONE: return jb_puts(b, "None");
    case JV_BOOL: return jb_puts(b, v.b ? "True" : "False");
    case JV_INT: return jb_printf(b, "%lld", (long long)v.i);
    case JV_FLOAT: jv_write_float(b, v.f); return !b->over;
    case JV_STR: return jb_put(b, v.s->s, v.s->len);
    case JV_LIST: case JV_DICT: return write_seq(b, v, depth);
    case JV_NS:
        jb_puts(b, "<Namespace ");
        { jval d = {.t = JV_DICT}; d.d = v.d; if (!write_seq(b, d, depth) && b->too_deep) return false; }
        return jb_puts(b, ">");
    case JV_FUNC: return jb_printf(b, "<built-in method %s>", v.fn->name ? v.fn->name : "?");
    case JV_MACRO: return jb_puts(b, "<Macro>");
    case JV_LOOP:
        return jb_printf(b, "<LoopContext %lld/%lld>", (long long)v.loop->index0 + 1,
                         (long long)v.loop->length);
    }
    return false;
}

// ---------------------------------------------------------------------------------------------
// json.dumps

static void json_str(jbuf *b, const char *s, size_t n, bool ensure_ascii) {
    jb_put(b, "\"", 1);
    size_t run = 0; // start of a run of bytes copied as they are
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char tmp[16];
        size_t st = i;
        if (c == '"') esc = "\\\"";
        else if (c == '\\') esc = "\\\\";
        else if (c == '\n') esc = "\\n";
        else if (c == '\r') esc = "\\r";
        else if (c == '\t') esc = "\\t";
        else if (c == '\b') esc = "\\b";
        else if (c == '\f') esc = "\\f";
        else if (c < 0x20) {
            snprintf(tmp, sizeof tmp, "\\u%04x", c);
            esc = tmp;
        } else if (c >= 0x80 && ensure_ascii) {
            uint32_t cp = utf8_next(s, n, &i);
            if (cp >= 0x10000) {
                cp -= 0x10000;
                snprintf(tmp, sizeof tmp, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
            } else {
                snprintf(tmp, sizeof tmp, "\\u%04x", cp);
            }
            jb_put(b, s + run, st - run);
            jb_puts(b, tmp);
            run = i;
            continue;
        }
        i++;
        if (esc) {
            jb_put(b, s + run, st - run);
            jb_puts(b, esc);
            run = i;
        }
    }
    jb_put(b, s + run, n - run);
    jb_put(b, "\"", 1);
}

static void json_newline(jbuf *b, int indent, int level) {
    jb_put(b, "\n", 1);
    for (int k = 0; k < indent * level; k++) jb_put(b, " ", 1);
}

static int key_cmp(const void *x, const void *y) {
    const jval *a = *(const jval *const *)x, *b = *(const jval *const *)y;
    size_t n = a->s->len < b->s->len ? a->s->len : b->s->len;
    int c = memcmp(a->s->s, b->s->s, n); // UTF-8 byte order = code point order, as Python sorts
    return c ? c : (a->s->len > b->s->len) - (a->s->len < b->s->len);
}

// Jinja's recursion limit for nested data keeps the writer's stack bounded.
#define JSON_MAX_DEPTH 256

st_status jv_write_json(jbuf *b, jval v, const jjson_opts *o, int depth) {
    if (depth > JSON_MAX_DEPTH) return st_fail(ST_ERR_RANGE, "tojson: data nested deeper than %d levels", JSON_MAX_DEPTH);
    const char *isep = o->item_sep ? o->item_sep : o->indent >= 0 ? "," : ", ";
    const char *ksep = o->key_sep ? o->key_sep : ": ";
    switch (v.t) {
    case JV_NONE: jb_puts(b, "null"); break;
    case JV_BOOL: jb_puts(b, v.b ? "true" : "false"); break;
    case JV_INT: jb_printf(b, "%lld", (long long)v.i); break;
    case JV_FLOAT:
        if (isnan(v.f)) jb_puts(b, "NaN");
        else if (isinf(v.f)) jb_puts(b, v.f < 0 ? "-Infinity" : "Infinity");
        else jv_write_float(b, v.f);
        break;
    case JV_STR: json_str(b, v.s->s, v.s->len, o->ensure_ascii); break;
    case JV_LIST:
        if (!v.l->n) {
            jb_puts(b, "[]");
            break;
        }
        jb_puts(b, "[");
        for (size_t i = 0; i < v.l->n; i++) {
            if (i) jb_puts(b, isep);
            if (o->indent >= 0) json_newline(b, o->indent, depth + 1);
            ST_TRY(jv_write_json(b, v.l->v[i], o, depth + 1));
        }
        if (o->indent >= 0) json_newline(b, o->indent, depth);
        jb_puts(b, "]");
        break;
    case JV_DICT: {
        if (!v.d->n) {
            jb_puts(b, "{}");
            break;
        }
        size_t n = v.d->n;
        const jval **order = malloc(n * sizeof *order);
        if (!order) return st_fail(ST_ERR_NOMEM, "tojson: out of memory");
        for (size_t i = 0; i < n; i++) order[i] = &v.d->k[i];
        if (o->sort_keys) {
            for (size_t i = 0; i < n; i++)
                if (order[i]->t != JV_STR) {
                    free(order);
                    return st_fail(ST_ERR_FORMAT, "tojson: sort_keys needs string keys");
                }
            qsort(order, n, sizeof *order, key_cmp);
        }
        jb_puts(b, "{");
        st_status s = ST_OK;
        for (size_t i = 0; i < n && s == ST_OK; i++) {
            size_t idx = (size_t)(order[i] - v.d->k);
            jval k = v.d->k[idx];
            if (i) jb_puts(b, isep);
            if (o->indent >= 0) json_newline(b, o->indent, depth + 1);
            if (k.t == JV_STR) json_str(b, k.s->s, k.s->len, o->ensure_ascii);
            else if (k.t == JV_INT || k.t == JV_FLOAT || k.t == JV_BOOL || k.t == JV_NONE) {
                jb_puts(b, "\"");
                if (k.t == JV_BOOL) jb_puts(b, k.b ? "true" : "false");
                else if (k.t == JV_NONE) jb_puts(b, "null");
                else jv_write_str(b, k);
                jb_puts(b, "\"");
            } else {
                s = st_fail(ST_ERR_FORMAT, "tojson: keys must be str, int, float, bool or None, not %s",
                            jv_type_name(k));
                break;
            }
            jb_puts(b, ksep);
            s = jv_write_json(b, v.d->v[idx], o, depth + 1);
        }
        free(order);
        if (s != ST_OK) return s;
        if (o->indent >= 0) json_newline(b, o->indent, depth);
        jb_puts(b, "}");
        break;
    }
    default:
        return st_fail(ST_ERR_FORMAT, "tojson: object of type %s is not JSON serializable", jv_type_name(v));
    }
    return ST_OK;
}
