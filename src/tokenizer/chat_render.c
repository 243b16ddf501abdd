// chat templates: the renderer, a tree-walking interpreter over the parsed template. Values follow
// Python's rules (Jinja2 runs on CPython), scoping follows Jinja2 (a fresh scope per loop
// iteration and per macro call; `if` has none), and every render is bounded in steps, depth,
// memory and output size so that no template can hang or exhaust the process.

#include <errno.h>
#include <jansson.h>
#include <locale.h>
#include <pthread.h>
#include <wctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tokenizer/chat_impl.h"

#define DEFAULT_MAX_OUTPUT ((size_t)16 << 20)
#define DEFAULT_MAX_STEPS 20000000ull
#define DEFAULT_MAX_DEPTH 64
#define DEFAULT_MAX_MEMORY ((size_t)512 << 20)
#define MAX_RANGE 100000 // as Jinja's sandbox: range() longer than this is refused
// Nested evaluations at once (expression height times macro nesting): bounds the C stack a
// render uses, whatever the template, at well under a megabyte.
#define MAX_EVAL_DEPTH 1500
#define AST_ARENA_CAP ((size_t)256 << 20)

struct st_chat_template {
    jarena arena;
    jtemplate_ast ast;
    char name[128];
};

struct jframe {
    jframe *parent;
    jdict *vars;
};

typedef struct rctx {
    jarena *a;
    jbuf *out;
    const char *tname;
    uint64_t steps, max_steps;
    int depth, max_depth;
    int edepth; // evaluations in progress (see MAX_EVAL_DEPTH)
    size_t max_output;
    int brk; // 1: break, 2: continue pending
    bool failed;
    st_status code;
    char err[700];
    jframe *root;
} rctx;

static bool fail(rctx *c, const jnode *at, st_status code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static bool fail(rctx *c, const jnode *at, st_status code, const char *fmt, ...) {
    if (c->failed) return false;
    c->failed = true;
    c->code = code;
    char msg[560];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (at) snprintf(c->err, sizeof c->err, "%s:%d:%d: %s", c->tname, at->line, at->col, msg);
    else snprintf(c->err, sizeof c->err, "%s: %s", c->tname, msg);
    return false;
}

static bool too_deep(rctx *c, const jnode *at) {
    return fail(c, at, ST_ERR_RANGE, "value nested deeper than %d levels", JV_MAX_NEST);
}

static bool oom(rctx *c, const jnode *at) {
    return fail(c, at, ST_ERR_NOMEM, "render memory budget exhausted (%zu bytes)", c->a->cap);
}

static bool step(rctx *c, const jnode *at) {
    if (++c->steps > c->max_steps)
        return fail(c, at, ST_ERR_RANGE, "render took more than %llu steps (evaluations, loop iterations, calls and outputs)",
                    (unsigned long long)c->max_steps);
    return true;
}

// An undefined value whose message says what was missing.
static jval undef_msg(rctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static jval undef_msg(rctx *c, const char *fmt, ...) {
    char m[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    jstr *s = js_new(c->a, m, strlen(m));
    return jv_undef(s ? s->s : NULL);
}

static bool undefined_error(rctx *c, const jnode *at, jval v) {
    return fail(c, at, ST_ERR_ARG, "%s", v.undef ? v.undef : "value is undefined");
}

// A Python-style description of a value for "'dict object' has no attribute" messages.
static const char *obj_desc(jval v) {
    switch (v.t) {
    case JV_DICT: return "dict object";
    case JV_LIST: return v.l->tuple ? "tuple object" : "list object";
    case JV_STR: return "str object";
    case JV_INT: return "int object";
    case JV_FLOAT: return "float object";
    case JV_BOOL: return "bool object";
    case JV_NONE: return "None";
    default: return "object";
    }
}

// ---------------------------------------------------------------------------------------------
// Frames

static jframe *frame_new(rctx *c, jframe *parent) {
    jframe *f = ja_alloc(c->a, sizeof *f);
    if (!f || !(f->vars = jd_new(c->a, 2))) return NULL; // small: one per loop iteration
    f->parent = parent;
    return f;
}

static bool frame_set(rctx *c, jframe *f, const jstr *name, jval v) {
    jval k = jv_strp((jstr *)name);
    return jd_set(c->a, f->vars, k, v);
}

static const jval *lookup(jframe *f, const jstr *name) {
    for (; f; f = f->parent) {
        const jval *v = jd_get(f->vars, name->s, name->len);
        if (v) return v;
    }
    return NULL;
}

// ---------------------------------------------------------------------------------------------
// Strings

static jval mkstr(rctx *c, const char *s, size_t n) { return jv_str(c->a, s, n); }
#define STR_OK(v) ((v).t == JV_STR)

// str(v) as a new value (strings are returned as they are).
static bool to_str(rctx *c, const jnode *at, jval v, jval *out) {
    if (v.t == JV_STR) {
        *out = v;
        return true;
    }
    jbuf b = {0};
    b.max = c->a->cap;
    jv_write_str(&b, v);
    if (b.over || b.too_deep) {
        bool deep = b.too_deep;
        jb_free(&b);
        return deep ? too_deep(c, at) : oom(c, at);
    }
    *out = mkstr(c, b.p ? b.p : "", b.len);
    jb_free(&b);
    return STR_OK(*out) || oom(c, at);
}

// Code point offsets of a string, for indexing and slicing by character as Python does.
// Returns the number of code points; *offs (n+1 entries) is arena memory.
static size_t cp_offsets(rctx *c, const jstr *s, size_t **offs) {
    size_t n = utf8_count(s->s, s->len);
    size_t *o = ja_alloc(c->a, (n + 1) * sizeof *o);
    if (!o) return (size_t)-1;
    size_t i = 0, k = 0;
    while (i < s->len) {
        o[k++] = i;
        utf8_next(s->s, s->len, &i);
    }
    o[k] = s->len;
    *offs = o;
    return n;
}

static bool py_space(uint32_t cp) {
    return cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x1F) || cp == 0x85 ||
           cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
           cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

static bool in_set(uint32_t cp, const jstr *chars) {
    if (!chars) return py_space(cp);
    for (size_t i = 0; i < chars->len;)
        if (utf8_next(chars->s, chars->len, &i) == cp) return true;
    return false;
}

// strip / lstrip / rstrip with Python's rules (chars NULL: whitespace).
static jval strip(rctx *c, const jstr *s, const jstr *chars, bool left, bool right) {
    size_t b = 0, e = s->len;
    if (left)
        while (b < e) {
            size_t i = b;
            uint32_t cp = utf8_next(s->s, s->len, &i);
            if (!in_set(cp, chars)) break;
            b = i;
        }
    if (right)
        while (e > b) {
            size_t st = e - 1;
            while (st > b && ((unsigned char)s->s[st] & 0xC0) == 0x80) st--;
            size_t i = st;
            uint32_t cp = utf8_next(s->s, s->len, &i);
            if (!in_set(cp, chars)) break;
            e = st;
        }
    return mkstr(c, s->s + b, e - b);
}

static const char *memfind(const char *h, size_t hn, const char *n, size_t nn) {
    if (nn == 0) return h;
    if (nn > hn) return NULL;
    for (size_t i = 0; i + nn <= hn; i++)
        if (h[i] == n[0] && !memcmp(h + i, n, nn)) return h + i;
    return NULL;
}

static jval str_replace(rctx *c, const jstr *s, const jstr *old, const jstr *nw, int64_t count) {
    jbuf b = {0};
    b.max = c->a->cap;
    if (old->len == 0) { // Python inserts `new` around every character
        int64_t done = 0;
        for (size_t i = 0; i <= s->len;) {
            if (count < 0 || done < count) {
                jb_put(&b, nw->s, nw->len);
                done++;
            }
            if (i == s->len) break;
            size_t st = i;
            utf8_next(s->s, s->len, &i);
            jb_put(&b, s->s + st, i - st);
        }
    } else {
        size_t i = 0;
        int64_t done = 0;
        while (i <= s->len) {
            const char *f = count >= 0 && done >= count ? NULL : memfind(s->s + i, s->len - i, old->s, old->len);
            if (!f) {
                jb_put(&b, s->s + i, s->len - i);
                break;
            }
            size_t at = (size_t)(f - s->s);
            jb_put(&b, s->s + i, at - i);
            jb_put(&b, nw->s, nw->len);
            i = at + old->len;
            done++;
        }
    }
    jval r = b.over ? jv_undef(NULL) : mkstr(c, b.p ? b.p : "", b.len);
    jb_free(&b);
    return r;
}

static jval mklist(rctx *c, size_t n) {
    jval v = {.t = JV_LIST};
    v.l = jl_new(c->a, n);
    if (!v.l) v = jv_undef(NULL);
    return v;
}

// Python str.split(sep, maxsplit) / rsplit.
static jval str_split(rctx *c, const jstr *s, const jstr *sep, int64_t maxsplit, bool from_right) {
    // collect pieces as (start, end) pairs
    size_t cap = 16, n = 0;
    size_t *pc = malloc(cap * 2 * sizeof *pc);
    if (!pc) return jv_undef(NULL);
#define PUSH(b_, e_)                                                             \
    do {                                                                         \
        if (n == cap) {                                                          \
            cap *= 2;                                                            \
            size_t *np_ = realloc(pc, cap * 2 * sizeof *np_);                    \
            if (!np_) { free(pc); return jv_undef(NULL); }                       \
            pc = np_;                                                            \
        }                                                                        \
        pc[2 * n] = (b_), pc[2 * n + 1] = (e_), n++;                             \
    } while (0)
    if (sep) {
        if (!from_right) {
            size_t i = 0;
            int64_t k = 0;
            for (;;) {
                const char *f = maxsplit >= 0 && k >= maxsplit ? NULL : memfind(s->s + i, s->len - i, sep->s, sep->len);
                if (!f) {
                    PUSH(i, s->len);
                    break;
                }
                size_t at = (size_t)(f - s->s);
                PUSH(i, at);
                i = at + sep->len;
                k++;
            }
        } else {
            size_t e = s->len;
            int64_t k = 0;
            for (;;) {
                size_t found = (size_t)-1;
                if (!(maxsplit >= 0 && k >= maxsplit) && e >= sep->len)
                    for (size_t i = e - sep->len + 1; i-- > 0;)
                        if (!memcmp(s->s + i, sep->s, sep->len)) {
                            found = i;
                            break;
                        }
                if (found == (size_t)-1) {
                    PUSH(0, e);
                    break;
                }
                PUSH(found + sep->len, e);
                e = found;
                k++;
            }
            for (size_t i = 0; i < n / 2; i++) { // reverse into reading order
                size_t a0 = pc[2 * i], a1 = pc[2 * i + 1];
                pc[2 * i] = pc[2 * (n - 1 - i)], pc[2 * i + 1] = pc[2 * (n - 1 - i) + 1];
                pc[2 * (n - 1 - i)] = a0, pc[2 * (n - 1 - i) + 1] = a1;
            }
        }
    } else { // runs of whitespace; leading/trailing whitespace gives no empty pieces
        size_t i = 0;
        int64_t k = 0;
        for (;;) {
            while (i < s->len) {
                size_t j = i;
                if (!py_space(utf8_next(s->s, s->len, &j))) break;
                i = j;
            }
            if (i >= s->len) break;
            if (maxsplit >= 0 && k >= maxsplit) {
                // the rest, with trailing whitespace removed
                size_t e = s->len;
                while (e > i) {
                    size_t st = e - 1;
                    while (st > i && ((unsigned char)s->s[st] & 0xC0) == 0x80) st--;
                    size_t j = st;
                    if (!py_space(utf8_next(s->s, s->len, &j))) break;
                    e = st;
                }
                PUSH(i, e);
                break;
            }
            size_t st = i;
            while (i < s->len) {
                size_t j = i;
                if (py_space(utf8_next(s->s, s->len, &j))) break;
                i = j;
            }
            PUSH(st, i);
            k++;
        }
        (void)from_right; // rsplit() without sep splits the same way when maxsplit is unlimited
    }
#undef PUSH
    jval l = mklist(c, n);
    for (size_t i = 0; l.t == JV_LIST && i < n; i++) {
        l.l->v[i] = mkstr(c, s->s + pc[2 * i], pc[2 * i + 1] - pc[2 * i]);
        if (!STR_OK(l.l->v[i])) l = jv_undef(NULL);
    }
    free(pc);
    return l;
}

// Case mapping beyond ASCII uses the C library's simple Unicode mappings (the C.UTF-8 locale),
// which agree with Python's str.upper/lower except for the few characters whose mapping changes
// length (ß -> SS is special-cased here) or depends on context (final sigma).
static locale_t utf8_locale;
static pthread_once_t utf8_locale_once = PTHREAD_ONCE_INIT;
static void utf8_locale_init(void) { utf8_locale = newlocale(LC_CTYPE_MASK, "C.UTF-8", (locale_t)0); }

static uint32_t map_case(uint32_t cp, bool up) {
    if (cp < 0x80) {
        if (up && cp >= 'a' && cp <= 'z') return cp - 32;
        if (!up && cp >= 'A' && cp <= 'Z') return cp + 32;
        return cp;
    }
    pthread_once(&utf8_locale_once, utf8_locale_init);
    if (!utf8_locale) return cp;
    return (uint32_t)(up ? towupper_l((wint_t)cp, utf8_locale) : towlower_l((wint_t)cp, utf8_locale));
}
static bool is_cased(uint32_t cp) { return map_case(cp, true) != cp || map_case(cp, false) != cp; }

// 0 lower, 1 upper, 2 capitalize, 3 str.title() (a word starts after any uncased character),
// 4 Jinja's |title filter (a word starts after whitespace or one of -({[<)
static jval ascii_case(rctx *c, const jstr *s, int mode) {
    jbuf b = {0};
    b.max = c->a->cap;
    bool start = true;
    for (size_t i = 0; i < s->len;) {
        size_t st = i;
        uint32_t cp = utf8_next(s->s, s->len, &i);
        bool up = mode == 1 || (mode == 2 && st == 0) || (mode >= 3 && start);
        if (up && cp == 0xDF) { // ß has no single upper-case letter: Python writes SS (Ss in titles)
            jb_puts(&b, mode == 1 ? "SS" : "Ss");
        } else {
            uint32_t m = map_case(cp, up);
            if (m == cp) jb_put(&b, s->s + st, i - st); // unchanged: keep the bytes as they were
            else {
                char enc[4];
                jb_put(&b, enc, (size_t)st_utf8_encode(enc, m));
            }
        }
        if (mode == 3) start = !is_cased(cp);
        if (mode == 4) start = cp < 0x80 && cp && strchr("-({[< \t\n\r\f\v", (int)cp) != NULL;
    }
    jval r = b.over ? jv_undef(NULL) : mkstr(c, b.p ? b.p : "", b.len);
    jb_free(&b);
    return r;
}

// ---------------------------------------------------------------------------------------------
// JSON input -> values

static bool from_json(rctx *c, const json_t *j, jval *out, int depth) {
    if (depth > 512) return fail(c, NULL, ST_ERR_RANGE, "input JSON nested deeper than 512 levels");
    switch (json_typeof(j)) {
    case JSON_NULL: *out = jv_none(); return true;
    case JSON_TRUE: *out = jv_bool(true); return true;
    case JSON_FALSE: *out = jv_bool(false); return true;
    case JSON_INTEGER: *out = jv_int((int64_t)json_integer_value(j)); return true;
    case JSON_REAL: *out = jv_float(json_real_value(j)); return true;
    case JSON_STRING:
        *out = mkstr(c, json_string_value(j), json_string_length(j));
        return STR_OK(*out) || oom(c, NULL);
    case JSON_ARRAY: {
        size_t n = json_array_size(j);
        jval l = mklist(c, n);
        if (l.t != JV_LIST) return oom(c, NULL);
        for (size_t i = 0; i < n; i++)
            if (!from_json(c, json_array_get(j, i), &l.l->v[i], depth + 1)) return false;
        *out = l;
        return true;
    }
    case JSON_OBJECT: {
        jval d = {.t = JV_DICT};
        if (!(d.d = jd_new(c->a, json_object_size(j)))) return oom(c, NULL);
        const char *k;
        size_t klen;
        json_t *v;
        void *tmp;
        json_object_keylen_foreach_safe((json_t *)j, tmp, k, klen, v) {
            jval kv = mkstr(c, k, klen), vv;
            if (!STR_OK(kv)) return oom(c, NULL);
            if (!from_json(c, v, &vv, depth + 1)) return false;
            if (!jd_set(c->a, d.d, kv, vv)) return oom(c, NULL);
        }
        *out = d;
        return true;
    }
    }
    return fail(c, NULL, ST_ERR_FORMAT, "unsupported JSON value");
}

// ---------------------------------------------------------------------------------------------
// Iteration: what `for x in v` walks over, as a list.

static bool to_iter(rctx *c, const jnode *at, jval v, jlist **out) {
    static jlist empty = {0};
    switch (v.t) {
    case JV_UNDEF: *out = &empty; return true;
    case JV_LIST: *out = v.l; return true;
    case JV_DICT: case JV_NS: {
        jlist *l = jl_new(c->a, v.d->n);
        if (!l) return oom(c, at);
        for (size_t i = 0; i < v.d->n; i++) l->v[i] = v.d->k[i];
        *out = l;
        return true;
    }
    case JV_STR: {
        size_t *offs;
        size_t n = cp_offsets(c, v.s, &offs);
        if (n == (size_t)-1) return oom(c, at);
        jlist *l = jl_new(c->a, n);
        if (!l) return oom(c, at);
        for (size_t i = 0; i < n; i++) {
            l->v[i] = mkstr(c, v.s->s + offs[i], offs[i + 1] - offs[i]);
            if (!STR_OK(l->v[i])) return oom(c, at);
        }
        *out = l;
        return true;
    }
    default:
        return fail(c, at, ST_ERR_ARG, "'%s' object is not iterable", jv_type_name(v));
    }
}

// ---------------------------------------------------------------------------------------------
// Attribute and item access

static const char *const dict_methods[] = {"items", "keys", "values", "get", "pop", "popitem",
                                           "setdefault", "update", "clear", "copy", "fromkeys", NULL};
static const char *const list_methods[] = {"append", "extend", "insert", "remove", "pop", "clear",
                                           "index", "count", "sort", "reverse", "copy", NULL};
static const struct { const char *name; jfn_kind kind; } str_methods[] = {
    {"startswith", M_STARTSWITH}, {"endswith", M_ENDSWITH}, {"split", M_SPLIT}, {"rsplit", M_RSPLIT},
    {"strip", M_STRIP}, {"lstrip", M_LSTRIP}, {"rstrip", M_RSTRIP}, {"replace", M_REPLACE},
    {"upper", M_UPPER}, {"lower", M_LOWER}, {"title", M_TITLE}, {"capitalize", M_CAPITALIZE},
    {"find", M_FIND}, {"rfind", M_RFIND}, {"count", M_COUNT}, {"join", M_JOIN},
    {"splitlines", M_SPLITLINES}, {"isdigit", M_ISDIGIT}, {"isalpha", M_ISALPHA},
    {"isspace", M_ISSPACE}, {"isalnum", M_ISALNUM}, {"isupper", M_ISUPPER}, {"islower", M_ISLOWER},
    {"format", M_FORMAT}, {NULL, M_UNSAFE},
};

static jval mkfunc(rctx *c, jfn_kind kind, jval self, const char *name) {
    jval v = {.t = JV_FUNC};
    v.fn = ja_alloc(c->a, sizeof *v.fn);
    if (!v.fn) return jv_undef(NULL);
    v.fn->kind = kind;
    v.fn->self = self;
    v.fn->name = name;
    return v;
}

static bool in_list(const char *const *names, const char *s) {
    for (int i = 0; names[i]; i++)
        if (!strcmp(names[i], s)) return true;
    return false;
}

static bool get_attr(rctx *c, const jnode *at, jval obj, const jstr *name, jval *out) {
    const char *nm = name->s;
    switch (obj.t) {
    case JV_UNDEF: return undefined_error(c, at, obj);
    case JV_DICT:
        if (in_list(dict_methods, nm)) {
            jfn_kind k = !strcmp(nm, "items") ? M_ITEMS : !strcmp(nm, "keys") ? M_KEYS
                       : !strcmp(nm, "values") ? M_VALUES : !strcmp(nm, "get") ? M_GET : M_UNSAFE;
            *out = mkfunc(c, k, obj, nm);
            return out->t == JV_FUNC || oom(c, at);
        } else {
            const jval *v = jd_get(obj.d, name->s, name->len);
            *out = v ? *v : undef_msg(c, "'dict object' has no attribute '%s'", nm);
            return true;
        }
    case JV_NS: {
        const jval *v = jd_get(obj.d, name->s, name->len);
        *out = v ? *v : undef_msg(c, "'Namespace' object has no attribute '%s'", nm);
        return true;
    }
    case JV_STR:
        for (int i = 0; str_methods[i].name; i++)
            if (!strcmp(str_methods[i].name, nm)) {
                *out = mkfunc(c, str_methods[i].kind, obj, str_methods[i].name);
                return out->t == JV_FUNC || oom(c, at);
            }
        break;
    case JV_LIST:
        if (in_list(list_methods, nm)) {
            *out = mkfunc(c, M_UNSAFE, obj, nm);
            return out->t == JV_FUNC || oom(c, at);
        }
        break;
    case JV_LOOP: {
        const jloop *l = obj.loop;
        int64_t i = l->index0, n = l->length;
        if (!strcmp(nm, "index")) *out = jv_int(i + 1);
        else if (!strcmp(nm, "index0")) *out = jv_int(i);
        else if (!strcmp(nm, "revindex")) *out = jv_int(n - i);
        else if (!strcmp(nm, "revindex0")) *out = jv_int(n - i - 1);
        else if (!strcmp(nm, "first")) *out = jv_bool(i == 0);
        else if (!strcmp(nm, "last")) *out = jv_bool(i == n - 1);
        else if (!strcmp(nm, "length")) *out = jv_int(n);
        else if (!strcmp(nm, "depth")) *out = jv_int(l->depth);
        else if (!strcmp(nm, "depth0")) *out = jv_int(l->depth - 1);
        else if (!strcmp(nm, "previtem"))
            *out = i > 0 ? l->items->v[i - 1] : undef_msg(c, "there is no previous item");
        else if (!strcmp(nm, "nextitem"))
            *out = i + 1 < n ? l->items->v[i + 1] : undef_msg(c, "there is no next item");
        else if (!strcmp(nm, "cycle")) {
            *out = mkfunc(c, M_LOOP_CYCLE, obj, "cycle");
            return out->t == JV_FUNC || oom(c, at);
        } else
            *out = undef_msg(c, "'LoopContext' object has no attribute '%s'", nm);
        return true;
    }
    default:
        break;
    }
    *out = undef_msg(c, "'%s' has no attribute '%s'", obj_desc(obj), nm);
    return true;
}

static bool index_of(int64_t i, size_t n, size_t *out) {
    if (i < 0) i += (int64_t)n;
    if (i < 0 || (uint64_t)i >= n) return false;
    *out = (size_t)i;
    return true;
}

static bool get_item(rctx *c, const jnode *at, jval obj, jval key, jval *out) {
    if (obj.t == JV_UNDEF) return undefined_error(c, at, obj);
    bool int_key = key.t == JV_INT || key.t == JV_BOOL;
    int64_t ik = key.t == JV_INT ? key.i : key.t == JV_BOOL ? key.b : 0;
    if (obj.t == JV_DICT) {
        const jval *v = jd_getv(obj.d, key);
        if (v) {
            *out = *v;
            return true;
        }
    } else if (obj.t == JV_LIST && int_key) {
        size_t i;
        *out = index_of(ik, obj.l->n, &i) ? obj.l->v[i] : undef_msg(c, "%s has no element %lld", obj_desc(obj), (long long)ik);
        return true;
    } else if (obj.t == JV_STR && int_key) {
        size_t *offs;
        size_t n = cp_offsets(c, obj.s, &offs), i;
        if (n == (size_t)-1) return oom(c, at);
        if (!index_of(ik, n, &i)) {
            *out = undef_msg(c, "str object has no element %lld", (long long)ik);
            return true;
        }
        *out = mkstr(c, obj.s->s + offs[i], offs[i + 1] - offs[i]);
        return STR_OK(*out) || oom(c, at);
    }
    if (key.t == JV_STR) return get_attr(c, at, obj, key.s, out);
    *out = undef_msg(c, "'%s' has no element", obj_desc(obj));
    return true;
}

// Python's slice.indices(): normalizes start/stop for a step over n items.
static bool slice_indices(rctx *c, const jnode *at, jval vs, jval ve, jval vp, size_t n, int64_t *start,
                          int64_t *stop, int64_t *stepv) {
    int64_t st = 1;
    if (vp.t != JV_NONE && vp.t != JV_UNDEF) {
        if (vp.t != JV_INT) return fail(c, at, ST_ERR_ARG, "slice indices must be integers or None");
        st = vp.i;
        if (st == 0) return fail(c, at, ST_ERR_ARG, "slice step cannot be zero");
    }
    int64_t len = (int64_t)n;
    int64_t lo = st < 0 ? -1 : 0, hi = st < 0 ? len - 1 : len;
    int64_t b, e;
    if (vs.t == JV_NONE || vs.t == JV_UNDEF) b = st < 0 ? hi : lo;
    else {
        if (vs.t != JV_INT) return fail(c, at, ST_ERR_ARG, "slice indices must be integers or None");
        b = vs.i;
        if (b < 0) {
            b += len;
            if (b < lo) b = lo;
        } else if (b > hi) b = hi;
    }
    if (ve.t == JV_NONE || ve.t == JV_UNDEF) e = st < 0 ? lo : hi;
    else {
        if (ve.t != JV_INT) return fail(c, at, ST_ERR_ARG, "slice indices must be integers or None");
        e = ve.i;
        if (e < 0) {
            e += len;
            if (e < lo) e = lo;
        } else if (e > hi) e = hi;
    }
    *start = b, *stop = e, *stepv = st;
    return true;
}

static bool do_slice(rctx *c, const jnode *at, jval obj, jval vs, jval ve, jval vp, jval *out) {
    if (obj.t == JV_UNDEF) return undefined_error(c, at, obj);
    size_t n;
    size_t *offs = NULL;
    if (obj.t == JV_LIST) n = obj.l->n;
    else if (obj.t == JV_STR) {
        n = cp_offsets(c, obj.s, &offs);
        if (n == (size_t)-1) return oom(c, at);
    } else { // Jinja's getitem turns the TypeError into an undefined value
        *out = undef_msg(c, "'%s' object is not subscriptable", jv_type_name(obj));
        return true;
    }
    int64_t b = 0, e = 0, st = 1; // set by slice_indices (gcc -O2 cannot see it)
    if (!slice_indices(c, at, vs, ve, vp, n, &b, &e, &st)) return false;
    size_t cnt = 0;
    if (st > 0 && b < e) cnt = (size_t)((e - b - 1) / st + 1);
    if (st < 0 && b > e) cnt = (size_t)((b - e - 1) / -st + 1);
    if (obj.t == JV_LIST) {
        jval l = mklist(c, cnt);
        if (l.t != JV_LIST) return oom(c, at);
        l.l->tuple = obj.l->tuple;
        for (size_t k = 0; k < cnt; k++) l.l->v[k] = obj.l->v[b + (int64_t)k * st];
        *out = l;
        return true;
    }
    jbuf buf = {0};
    for (size_t k = 0; k < cnt; k++) {
        size_t i = (size_t)(b + (int64_t)k * st);
        jb_put(&buf, obj.s->s + offs[i], offs[i + 1] - offs[i]);
    }
    *out = mkstr(c, buf.p ? buf.p : "", buf.len);
    jb_free(&buf);
    return STR_OK(*out) || oom(c, at);
}

// ---------------------------------------------------------------------------------------------
// Operators

static bool is_num(jval v) { return v.t == JV_INT || v.t == JV_FLOAT || v.t == JV_BOOL; }
static double fnum(jval v) { return v.t == JV_FLOAT ? v.f : v.t == JV_INT ? (double)v.i : (double)v.b; }
static int64_t inum(jval v) { return v.t == JV_INT ? v.i : (int64_t)v.b; }

static const char *op_name(int op) {
    static const char *const names[] = {"+", "-", "*", "/", "//", "%", "**", "~",
                                        "==", "!=", "<", "<=", ">", ">=", "in", "not in"};
    return names[op];
}

static bool type_error(rctx *c, const jnode *at, int op, jval a, jval b) {
    if (a.t == JV_UNDEF) return undefined_error(c, at, a);
    if (b.t == JV_UNDEF) return undefined_error(c, at, b);
    if (op == OP_ADD && a.t == JV_STR)
        return fail(c, at, ST_ERR_ARG, "can only concatenate str (not \"%s\") to str", jv_type_name(b));
    if (op == OP_ADD && a.t == JV_LIST)
        return fail(c, at, ST_ERR_ARG, "can only concatenate list (not \"%s\") to list", jv_type_name(b));
    if (op >= OP_LT && op <= OP_GE)
        return fail(c, at, ST_ERR_ARG, "'%s' not supported between instances of '%s' and '%s'",
                    op_name(op), jv_type_name(a), jv_type_name(b));
    return fail(c, at, ST_ERR_ARG, "unsupported operand type(s) for %s: '%s' and '%s'", op_name(op),
                jv_type_name(a), jv_type_name(b));
}

// Whether every positional argument was used (a mapping or a non-tuple argument used once
// needs no check beyond that).
static bool have_mapping_or_done(jval args, size_t used, size_t n) {
    if (args.t == JV_DICT) return true;
    if (args.t == JV_LIST && args.l->tuple) return used == n;
    return used == 1;
}

// Python's printf-style formatting, `fmt % args`: a tuple spreads into the conversions, a dict
// serves %(name)s, anything else is the single argument. Conversions s r a d i u f F e E g G x X
// o c and %%, with flags, width and precision.
static bool percent_format(rctx *c, const jnode *at, const jstr *fmt, jval args, jval *out) {
    const jval *av = &args;
    size_t an = 1, ai = 0;
    if (args.t == JV_LIST && args.l->tuple) av = args.l->v, an = args.l->n;
    jbuf b = {0};
    b.max = c->a->cap;
    const char *s = fmt->s, *e = s + fmt->len;
    bool ok = true;
    while (s < e && ok) {
        const char *pct = memchr(s, '%', (size_t)(e - s));
        if (!pct) {
            jb_put(&b, s, (size_t)(e - s));
            break;
        }
        jb_put(&b, s, (size_t)(pct - s));
        s = pct + 1;
        jval v = jv_undef(NULL);
        bool have = false;
        if (s < e && *s == '(') { // %(key)s
            const char *close = memchr(s, ')', (size_t)(e - s));
            if (!close || args.t != JV_DICT) {
                ok = fail(c, at, ST_ERR_ARG, "format requires a mapping");
                break;
            }
            const jval *x = jd_get(args.d, s + 1, (size_t)(close - s - 1));
            if (!x) {
                ok = fail(c, at, ST_ERR_ARG, "KeyError: '%.*s'", (int)(close - s - 1), s + 1);
                break;
            }
            v = *x, have = true;
            s = close + 1;
        }
        char spec[48];
        size_t k = 0;
        spec[k++] = '%';
        while (s < e && strchr("-+ 0#", *s) && k < 8) spec[k++] = *s++;
        while (s < e && *s >= '0' && *s <= '9' && k < 20) spec[k++] = *s++;
        if (s < e && *s == '.') {
            spec[k++] = *s++;
            while (s < e && *s >= '0' && *s <= '9' && k < 32) spec[k++] = *s++;
        }
        if (s >= e) {
            ok = fail(c, at, ST_ERR_ARG, "incomplete format");
            break;
        }
        spec[k] = 0;
        char conv = *s++;
        if (conv == '%') {
            jb_put(&b, "%", 1);
            continue;
        }
        if (!strchr("sradiufFeEgGxXoc", conv)) {
            ok = fail(c, at, ST_ERR_ARG, "unsupported format character '%c'", conv);
            break;
        }
        if (!have) {
            if (ai >= an) {
                ok = fail(c, at, ST_ERR_ARG, "not enough arguments for format string");
                break;
            }
            v = av[ai++];
        }
        // widths and precisions beyond these are refused: they only serve to blow up the output
        {
            long wd = 0, pr = 0;
            const char *q = spec + 1;
            while (*q && strchr("-+ 0#", *q)) q++;
            wd = strtol(q, (char **)&q, 10);
            if (*q == '.') pr = strtol(q + 1, NULL, 10);
            if (wd > 4000 || pr > 400) {
                ok = fail(c, at, ST_ERR_RANGE, "format width or precision too large in '%s%c'", spec, conv);
                break;
            }
        }
        char tmp[4600];
        if (conv == 's' || conv == 'r' || conv == 'a' || conv == 'c') {
            jbuf sb = {0};
            if (conv == 'c' && (v.t == JV_INT || v.t == JV_BOOL)) {
                char enc[4];
                jb_put(&sb, enc, (size_t)st_utf8_encode(enc, (uint32_t)inum(v) & 0x1FFFFF));
            } else if (conv == 'r' || conv == 'a') jv_write_repr(&sb, v);
            else jv_write_str(&sb, v);
            // width/precision count characters; '-' pads on the right
            int width = 0, prec = -1;
            bool left = false;
            for (size_t q = 1; q < k; q++) {
                if (spec[q] == '-') left = true;
                else if (spec[q] == '.') {
                    prec = atoi(spec + q + 1);
                    break;
                } else if (spec[q] >= '1' && spec[q] <= '9' && !width) width = atoi(spec + q);
            }
            const char *txt = sb.p ? sb.p : "";
            size_t tl = sb.len, nchar = utf8_count(txt, tl);
            if (prec >= 0 && (size_t)prec < nchar) { // cut to prec characters
                size_t q = 0;
                for (int m = 0; m < prec; m++) utf8_next(txt, tl, &q);
                tl = q, nchar = (size_t)prec;
            }
            size_t pad = width > 0 && (size_t)width > nchar ? (size_t)width - nchar : 0;
            if (!left) for (size_t q = 0; q < pad; q++) jb_put(&b, " ", 1);
            jb_put(&b, txt, tl);
            if (left) for (size_t q = 0; q < pad; q++) jb_put(&b, " ", 1);
            jb_free(&sb);
            continue;
        }
        if (!is_num(v)) {
            ok = fail(c, at, ST_ERR_ARG, "%%%c format: a real number is required, not %s", conv, jv_type_name(v));
            break;
        }
        if (strchr("diuxXo", conv)) {
            int64_t x = v.t == JV_FLOAT ? (int64_t)v.f : inum(v);
            if (conv == 'x' || conv == 'X' || conv == 'o') {
                // Python prints the sign before the digits: -0x1f as -1f
                spec[k++] = 'l', spec[k++] = 'l', spec[k++] = conv, spec[k] = 0;
                char digits[4200];
                snprintf(digits, sizeof digits, spec, (unsigned long long)(x < 0 ? -(uint64_t)x : (uint64_t)x));
                snprintf(tmp, sizeof tmp, "%s%s", x < 0 ? "-" : "", digits);
            } else {
                spec[k++] = 'l', spec[k++] = 'l', spec[k++] = 'd', spec[k] = 0;
                snprintf(tmp, sizeof tmp, spec, (long long)x);
            }
        } else {
            spec[k++] = conv, spec[k] = 0;
            snprintf(tmp, sizeof tmp, spec, fnum(v));
        }
        jb_puts(&b, tmp);
    }
    if (ok && !have_mapping_or_done(args, ai, an)) ok = fail(c, at, ST_ERR_ARG, "not all arguments converted during string formatting");
    if (ok) {
        *out = b.over ? jv_undef(NULL) : mkstr(c, b.p ? b.p : "", b.len);
        ok = STR_OK(*out) || oom(c, at);
    }
    jb_free(&b);
    return ok;
}

static bool arith(rctx *c, const jnode *at, int op, jval a, jval b, jval *out) {
    if (op == OP_CONCAT) {
        jbuf buf = {0};
        buf.max = c->a->cap;
        jv_write_str(&buf, a);
        jv_write_str(&buf, b);
        if (buf.over || buf.too_deep) {
            bool deep = buf.too_deep;
            jb_free(&buf);
            return deep ? too_deep(c, at) : oom(c, at);
        }
        *out = mkstr(c, buf.p ? buf.p : "", buf.len);
        jb_free(&buf);
        return STR_OK(*out) || oom(c, at);
    }
    if (op == OP_ADD && a.t == JV_STR && b.t == JV_STR) {
        if (a.s->len + b.s->len + 64 > c->a->cap) return oom(c, at);
        jstr *s = ja_alloc(c->a, sizeof *s + a.s->len + b.s->len + 1);
        if (!s) return oom(c, at);
        s->len = a.s->len + b.s->len;
        memcpy(s->s, a.s->s, a.s->len);
        memcpy(s->s + a.s->len, b.s->s, b.s->len);
        *out = jv_strp(s);
        return true;
    }
    if (op == OP_ADD && a.t == JV_LIST && b.t == JV_LIST) {
        jval l = mklist(c, a.l->n + b.l->n);
        if (l.t != JV_LIST) return oom(c, at);
        if (a.l->n) memcpy(l.l->v, a.l->v, a.l->n * sizeof(jval));
        if (b.l->n) memcpy(l.l->v + a.l->n, b.l->v, b.l->n * sizeof(jval));
        l.l->tuple = a.l->tuple;
        *out = l;
        return true;
    }
    if (op == OP_MUL && ((a.t == JV_STR && (b.t == JV_INT || b.t == JV_BOOL)) ||
                         (b.t == JV_STR && (a.t == JV_INT || a.t == JV_BOOL)))) {
        const jstr *s = a.t == JV_STR ? a.s : b.s;
        int64_t k = a.t == JV_STR ? inum(b) : inum(a);
        if (k <= 0 || s->len == 0) {
            *out = mkstr(c, "", 0);
            return STR_OK(*out) || oom(c, at);
        }
        if ((uint64_t)k > (c->a->cap / (s->len + 1))) return oom(c, at);
        jstr *r = ja_alloc(c->a, sizeof *r + s->len * (size_t)k + 1);
        if (!r) return oom(c, at);
        r->len = s->len * (size_t)k;
        for (int64_t i = 0; i < k; i++) memcpy(r->s + (size_t)i * s->len, s->s, s->len);
        *out = jv_strp(r);
        return true;
    }
    if (op == OP_MOD && a.t == JV_STR)
        return percent_format(c, at, a.s, b, out);
    if (!is_num(a) || !is_num(b)) return type_error(c, at, op, a, b);
    bool ints = a.t != JV_FLOAT && b.t != JV_FLOAT;
    if (ints) {
        int64_t x = inum(a), y = inum(b), r;
        switch (op) {
        case OP_ADD:
            if (__builtin_add_overflow(x, y, &r)) goto overflow;
            *out = jv_int(r);
            return true;
        case OP_SUB:
            if (__builtin_sub_overflow(x, y, &r)) goto overflow;
            *out = jv_int(r);
            return true;
        case OP_MUL:
            if (__builtin_mul_overflow(x, y, &r)) goto overflow;
            *out = jv_int(r);
            return true;
        case OP_DIV:
            if (y == 0) return fail(c, at, ST_ERR_ARG, "division by zero");
            *out = jv_float((double)x / (double)y);
            return true;
        case OP_FLOORDIV: case OP_MOD: {
            if (y == 0) return fail(c, at, ST_ERR_ARG, "integer division or modulo by zero");
            if (x == INT64_MIN && y == -1) goto overflow;
            int64_t q = x / y, m = x % y;
            if (m != 0 && ((m < 0) != (y < 0))) q--, m += y; // Python floors
            *out = jv_int(op == OP_MOD ? m : q);
            return true;
        }
        case OP_POW:
            if (y < 0) {
                *out = jv_float(pow((double)x, (double)y));
                return true;
            }
            r = 1;
            for (int64_t i = 0; i < y; i++) {
                if (__builtin_mul_overflow(r, x, &r)) goto overflow;
                if (r == 0 || r == 1) break;
            }
            if (r == -1 || r == 1) r = (x == -1 && (y & 1)) ? -1 : (x == 0 && y > 0 ? 0 : r);
            *out = jv_int(r);
            return true;
        }
    } else {
        double x = fnum(a), y = fnum(b);
        switch (op) {
        case OP_ADD: *out = jv_float(x + y); return true;
        case OP_SUB: *out = jv_float(x - y); return true;
        case OP_MUL: *out = jv_float(x * y); return true;
        case OP_DIV:
            if (y == 0) return fail(c, at, ST_ERR_ARG, "float division by zero");
            *out = jv_float(x / y);
            return true;
        case OP_FLOORDIV: case OP_MOD: {
            if (y == 0) return fail(c, at, ST_ERR_ARG, "float floor division or modulo by zero");
            // CPython's float divmod: the remainder takes the divisor's sign
            double m = fmod(x, y), d = (x - m) / y;
            if (m != 0 && ((y < 0) != (m < 0))) m += y, d -= 1.0;
            double q = floor(d);
            if (d - q > 0.5) q += 1.0;
            if (m == 0) m = copysign(0.0, y);
            *out = jv_float(op == OP_MOD ? m : q);
            return true;
        }
        case OP_POW: *out = jv_float(pow(x, y)); return true;
        }
    }
    return type_error(c, at, op, a, b);
overflow:
    return fail(c, at, ST_ERR_RANGE, "integer overflow in '%s'", op_name(op));
}

static int cmp_vals_d(rctx *c, const jnode *at, int op, jval a, jval b, bool *ok, int depth);
static int cmp_vals(rctx *c, const jnode *at, int op, jval a, jval b, bool *ok) {
    return cmp_vals_d(c, at, op, a, b, ok, 0);
}
static int cmp_vals_d(rctx *c, const jnode *at, int op, jval a, jval b, bool *ok, int depth) {
    *ok = true;
    if (depth > JV_MAX_NEST) {
        *ok = false;
        too_deep(c, at);
        return 0;
    }
    if (is_num(a) && is_num(b)) {
        if (a.t != JV_FLOAT && b.t != JV_FLOAT) return (inum(a) > inum(b)) - (inum(a) < inum(b));
        double x = fnum(a), y = fnum(b);
        return (x > y) - (x < y);
    }
    if (a.t == JV_STR && b.t == JV_STR) {
        size_t n = a.s->len < b.s->len ? a.s->len : b.s->len;
        int r = memcmp(a.s->s, b.s->s, n);
        if (r) return r < 0 ? -1 : 1;
        return (a.s->len > b.s->len) - (a.s->len < b.s->len);
    }
    if (a.t == JV_LIST && b.t == JV_LIST) {
        size_t n = a.l->n < b.l->n ? a.l->n : b.l->n;
        for (size_t i = 0; i < n; i++) {
            if (jv_equal(a.l->v[i], b.l->v[i])) continue;
            return cmp_vals_d(c, at, op, a.l->v[i], b.l->v[i], ok, depth + 1);
        }
        return (a.l->n > b.l->n) - (a.l->n < b.l->n);
    }
    *ok = false;
    type_error(c, at, op, a, b);
    return 0;
}

static bool contains(rctx *c, const jnode *at, jval needle, jval hay, bool *res) {
    switch (hay.t) {
    case JV_UNDEF: *res = false; return true;
    case JV_STR:
        if (needle.t != JV_STR)
            return fail(c, at, ST_ERR_ARG, "'in <string>' requires string as left operand, not %s", jv_type_name(needle));
        *res = memfind(hay.s->s, hay.s->len, needle.s->s, needle.s->len) != NULL;
        return true;
    case JV_LIST:
        *res = false;
        for (size_t i = 0; i < hay.l->n && !*res; i++) *res = jv_equal(hay.l->v[i], needle);
        return true;
    case JV_DICT: case JV_NS:
        *res = jd_getv(hay.d, needle) != NULL;
        return true;
    default:
        return fail(c, at, ST_ERR_ARG, "argument of type '%s' is not iterable", jv_type_name(hay));
    }
}

// ---------------------------------------------------------------------------------------------
// Evaluation

static bool eval(rctx *c, const jnode *n, jframe *f, jval *out);
static bool exec_body(rctx *c, jnode *const *body, int nbody, jframe *f);
static bool call_value(rctx *c, const jnode *at, jval callee, jval *args, jstr **kw, int nargs, jframe *f,
                       jval *out);
static bool apply_filter(rctx *c, const jnode *n, jval v, jval *args, jstr **kw, int nargs, jframe *f,
                         jval *out);
static bool apply_test(rctx *c, const jnode *n, const char *name, jval v, jval *args, int nargs, bool *res);

// Evaluates a node's argument list into fresh arrays.
static bool eval_args(rctx *c, const jnode *n, jframe *f, jval **args) {
    *args = NULL;
    if (!n->nargs) return true;
    *args = ja_alloc(c->a, (size_t)n->nargs * sizeof **args);
    if (!*args) return oom(c, n);
    for (int i = 0; i < n->nargs; i++)
        if (!eval(c, n->args[i], f, &(*args)[i])) return false;
    return true;
}

static bool eval_node(rctx *c, const jnode *n, jframe *f, jval *out);
static bool eval(rctx *c, const jnode *n, jframe *f, jval *out) {
    if (c->failed) return false;
    if (c->edepth >= MAX_EVAL_DEPTH)
        return fail(c, n, ST_ERR_RANGE, "expressions and macro calls nested deeper than %d", MAX_EVAL_DEPTH);
    if (!step(c, n)) return false;
    c->edepth++;
    bool ok = eval_node(c, n, f, out);
    c->edepth--;
    return ok;
}

static bool eval_node(rctx *c, const jnode *n, jframe *f, jval *out) {
    switch (n->kind) {
    case E_LIT: *out = n->lit; return true;
    case E_NAME: {
        const jval *v = lookup(f, n->name);
        *out = v ? *v : undef_msg(c, "'%s' is undefined", n->name->s);
        return true;
    }
    case E_ATTR: {
        jval o;
        return eval(c, n->a, f, &o) && get_attr(c, n, o, n->name, out);
    }
    case E_ITEM: {
        jval o, k;
        return eval(c, n->a, f, &o) && eval(c, n->b, f, &k) && get_item(c, n, o, k, out);
    }
    case E_SLICE: {
        jval o, p[3] = {jv_none(), jv_none(), jv_none()};
        if (!eval(c, n->a, f, &o)) return false;
        for (int i = 0; i < 3; i++)
            if (n->args[i] && !eval(c, n->args[i], f, &p[i])) return false;
        return do_slice(c, n, o, p[0], p[1], p[2], out);
    }
    case E_CALL: {
        jval callee, *args;
        if (!eval(c, n->a, f, &callee) || !eval_args(c, n, f, &args)) return false;
        return call_value(c, n, callee, args, n->kw, n->nargs, f, out);
    }
    case E_FILTER: {
        jval v, *args;
        if (!eval(c, n->a, f, &v) || !eval_args(c, n, f, &args)) return false;
        return apply_filter(c, n, v, args, n->kw, n->nargs, f, out);
    }
    case E_TEST: {
        jval v, *args;
        bool r;
        if (!eval(c, n->a, f, &v) || !eval_args(c, n, f, &args)) return false;
        if (!apply_test(c, n, n->name->s, v, args, n->nargs, &r)) return false;
        *out = jv_bool(n->neg ? !r : r);
        return true;
    }
    case E_NOT: {
        jval v;
        if (!eval(c, n->a, f, &v)) return false;
        *out = jv_bool(!jv_truthy(v));
        return true;
    }
    case E_NEG: case E_POS: {
        jval v;
        if (!eval(c, n->a, f, &v)) return false;
        if (v.t == JV_UNDEF) return undefined_error(c, n, v);
        if (v.t == JV_FLOAT) *out = jv_float(n->kind == E_NEG ? -v.f : v.f);
        else if (v.t == JV_INT || v.t == JV_BOOL) {
            int64_t x = inum(v);
            if (n->kind == E_NEG && x == INT64_MIN) return fail(c, n, ST_ERR_RANGE, "integer overflow");
            *out = jv_int(n->kind == E_NEG ? -x : x);
        } else
            return fail(c, n, ST_ERR_ARG, "bad operand type for unary %s: '%s'", n->kind == E_NEG ? "-" : "+",
                        jv_type_name(v));
        return true;
    }
    case E_BIN: {
        jval a, b;
        return eval(c, n->a, f, &a) && eval(c, n->b, f, &b) && arith(c, n, n->ops[0], a, b, out);
    }
    case E_AND: case E_OR: {
        jval a;
        if (!eval(c, n->a, f, &a)) return false;
        bool t = jv_truthy(a);
        if ((n->kind == E_AND) != t) {
            *out = a;
            return true;
        }
        return eval(c, n->b, f, out);
    }
    case E_CMP: {
        jval a;
        if (!eval(c, n->args[0], f, &a)) return false;
        for (int i = 1; i < n->nargs; i++) {
            jval b;
            if (!eval(c, n->args[i], f, &b)) return false;
            int op = n->ops[i - 1];
            bool r = false, ok = true;
            switch (op) {
            case OP_EQ: r = jv_equal(a, b); break;
            case OP_NE: r = !jv_equal(a, b); break;
            case OP_IN: case OP_NOTIN:
                if (!contains(c, n, a, b, &r)) return false;
                if (op == OP_NOTIN) r = !r;
                break;
            default: {
                int k = cmp_vals(c, n, op, a, b, &ok);
                if (!ok) return false;
                r = op == OP_LT ? k < 0 : op == OP_LE ? k <= 0 : op == OP_GT ? k > 0 : k >= 0;
            }
            }
            if (!r || i == n->nargs - 1) {
                *out = jv_bool(r);
                return true;
            }
            a = b;
        }
        *out = jv_bool(true);
        return true;
    }
    case E_COND: {
        jval cond;
        if (!eval(c, n->a, f, &cond)) return false;
        if (jv_truthy(cond)) return eval(c, n->b, f, out);
        if (n->c) return eval(c, n->c, f, out);
        *out = undef_msg(c, "the inline if-expression evaluated to false and no else section was defined");
        return true;
    }
    case E_LIST: {
        jval l = mklist(c, (size_t)n->nargs);
        if (l.t != JV_LIST) return oom(c, n);
        l.l->tuple = n->neg;
        for (int i = 0; i < n->nargs; i++)
            if (!eval(c, n->args[i], f, &l.l->v[i])) return false;
        *out = l;
        return true;
    }
    case E_DICT: {
        jval d = {.t = JV_DICT};
        if (!(d.d = jd_new(c->a, (size_t)n->nargs / 2))) return oom(c, n);
        for (int i = 0; i + 1 < n->nargs; i += 2) {
            jval k, v;
            if (!eval(c, n->args[i], f, &k) || !eval(c, n->args[i + 1], f, &v)) return false;
            if (k.t == JV_LIST && !k.l->tuple) return fail(c, n, ST_ERR_ARG, "unhashable type: 'list'");
            if (k.t == JV_DICT) return fail(c, n, ST_ERR_ARG, "unhashable type: 'dict'");
            if (!jd_set(c->a, d.d, k, v)) return oom(c, n);
        }
        *out = d;
        return true;
    }
    default:
        return fail(c, n, ST_ERR_UNSUPPORTED, "internal: node kind %d is not an expression", n->kind);
    }
}

// ---------------------------------------------------------------------------------------------
// Calls: macros, built-in functions, methods

// Finds a keyword argument by name; also accepts it positionally at `pos` (-1: keyword only).
static jval arg(jval *args, jstr **kw, int nargs, int pos, const char *name, jval dflt) {
    int p = 0;
    for (int i = 0; i < nargs; i++) {
        if (kw && kw[i]) {
            if (name && !strcmp(kw[i]->s, name)) return args[i];
        } else {
            if (p == pos) return args[i];
            p++;
        }
    }
    return dflt;
}
static int npos(jstr **kw, int nargs) {
    int p = 0;
    for (int i = 0; i < nargs; i++)
        if (!kw || !kw[i]) p++;
    return p;
}

static bool render_to_string(rctx *c, jnode *const *body, int nbody, jframe *f, const jnode *at,
                             jval *out) {
    jbuf buf = {0};
    buf.max = c->max_output;
    jbuf *saved = c->out;
    c->out = &buf;
    bool ok = exec_body(c, body, nbody, f);
    c->out = saved;
    if (ok && buf.over) ok = fail(c, at, ST_ERR_RANGE, "output is longer than %zu bytes", c->max_output);
    if (ok) {
        *out = mkstr(c, buf.p ? buf.p : "", buf.len);
        if (!STR_OK(*out)) ok = oom(c, at);
    }
    jb_free(&buf);
    return ok;
}

static bool call_macro(rctx *c, const jnode *at, const jmacro *m, jval *args, jstr **kw, int nargs,
                       const jmacro *caller, jval *out) {
    const jnode *def = m->def;
    if (!step(c, at)) return false;
    if (c->depth >= c->max_depth)
        return fail(c, at, ST_ERR_RANGE, "macro calls nested deeper than %d", c->max_depth);
    jframe *f = frame_new(c, m->closure);
    if (!f) return oom(c, at);
    int p = 0;
    for (int i = 0; i < nargs; i++) {
        if (kw && kw[i]) {
            int k = 0;
            for (; k < def->ntargets; k++)
                if (!strcmp(def->targets[k]->s, kw[i]->s)) break;
            if (k == def->ntargets)
                return fail(c, at, ST_ERR_ARG, "macro '%s' takes no keyword argument '%s'",
                            def->name ? def->name->s : "caller", kw[i]->s);
            if (!frame_set(c, f, def->targets[k], args[i])) return oom(c, at);
        } else {
            if (p >= def->ntargets)
                return fail(c, at, ST_ERR_ARG, "macro '%s' takes not more than %d argument(s)",
                            def->name ? def->name->s : "caller", def->ntargets);
            if (!frame_set(c, f, def->targets[p], args[i])) return oom(c, at);
            p++;
        }
    }
    for (int k = 0; k < def->ntargets; k++) {
        if (jd_get(f->vars, def->targets[k]->s, def->targets[k]->len)) continue;
        jval v;
        if (k < def->nargs && def->args[k]) {
            if (!eval(c, def->args[k], f, &v)) return false;
        } else {
            v = undef_msg(c, "parameter '%s' was not provided", def->targets[k]->s);
        }
        if (!frame_set(c, f, def->targets[k], v)) return oom(c, at);
    }
    if (caller) {
        jval cv = {.t = JV_MACRO};
        cv.m = (jmacro *)caller;
        jstr *nm = js_new(c->a, "caller", 6);
        if (!nm || !frame_set(c, f, nm, cv)) return oom(c, at);
    }
    c->depth++;
    bool ok = render_to_string(c, def->body, def->nbody, f, at, out);
    c->depth--;
    return ok;
}

static jval mkns(rctx *c) {
    jval v = {.t = JV_NS};
    v.d = jd_new(c->a, 8);
    return v.d ? v : jv_undef(NULL);
}

static bool need_str(rctx *c, const jnode *at, jval v, const char *what) {
    if (v.t == JV_STR) return true;
    if (v.t == JV_UNDEF) return undefined_error(c, at, v);
    return fail(c, at, ST_ERR_ARG, "%s must be str, not %s", what, jv_type_name(v));
}

// Applies a format spec ([[fill]align][sign][0][width][,][.precision][type]) to one value, as
// Python's format() does for str, int and float.
static bool format_one(rctx *c, const jnode *at, jval v, const char *spec, size_t sl, jbuf *b) {
    char fill = ' ', align = 0, sign = 0, type = 0;
    int width = 0, prec = -1;
    bool comma = false, zero = false;
    size_t i = 0;
    if (sl >= 2 && strchr("<>^=", spec[1])) fill = spec[0], align = spec[1], i = 2;
    else if (sl >= 1 && strchr("<>^=", spec[0])) align = spec[0], i = 1;
    if (i < sl && strchr("+- ", spec[i])) sign = spec[i++];
    if (i < sl && spec[i] == '0') zero = true, i++;
    while (i < sl && spec[i] >= '0' && spec[i] <= '9') width = width * 10 + (spec[i++] - '0');
    if (i < sl && spec[i] == ',') comma = true, i++;
    if (i < sl && spec[i] == '.') {
        prec = 0, i++;
        while (i < sl && spec[i] >= '0' && spec[i] <= '9') prec = prec * 10 + (spec[i++] - '0');
    }
    if (i < sl) type = spec[i++];
    if (i != sl || width > 1000 || prec > 100 || comma)
        return fail(c, at, ST_ERR_UNSUPPORTED, "format spec '%.*s' is not supported", (int)sl, spec);
    jbuf t = {0};
    char tmp[256];
    if (v.t == JV_STR || (!type && !is_num(v)) || type == 's') {
        if (type && type != 's') {
            jb_free(&t);
            return fail(c, at, ST_ERR_ARG, "unknown format code '%c' for object of type '%s'", type, jv_type_name(v));
        }
        jv_write_str(&t, v);
        if (prec >= 0 && (size_t)prec < utf8_count(t.p ? t.p : "", t.len)) {
            size_t q = 0;
            for (int m = 0; m < prec; m++) utf8_next(t.p, t.len, &q);
            t.len = q;
        }
        if (!align) align = '<';
    } else {
        if (!is_num(v)) return fail(c, at, ST_ERR_ARG, "format code '%c' needs a number, not %s", type, jv_type_name(v));
        char f[32];
        int k = 0;
        f[k++] = '%';
        if (sign == '+' || sign == ' ') f[k++] = sign;
        bool is_int = v.t != JV_FLOAT;
        if (!type) type = is_int ? 'd' : (prec >= 0 ? 'g' : 'r');
        if (type == 'r') { // a float without a type prints as repr()
            jv_write_float(&t, v.f);
        } else if (strchr("dxXob", type)) {
            if (!is_int) return fail(c, at, ST_ERR_ARG, "unknown format code '%c' for object of type 'float'", type);
            if (type == 'b') return fail(c, at, ST_ERR_UNSUPPORTED, "format code 'b' is not supported");
            int64_t x = inum(v);
            f[k++] = 'l', f[k++] = 'l', f[k++] = 'd', f[k] = 0;
            if (type == 'd') snprintf(tmp, sizeof tmp, f, (long long)x);
            else { // the sign goes before the digits of the magnitude, as Python prints -ff
                unsigned long long mag = x < 0 ? -(uint64_t)x : (uint64_t)x;
                char d[80];
                snprintf(d, sizeof d, type == 'x' ? "%llx" : type == 'X' ? "%llX" : "%llo", mag);
                snprintf(tmp, sizeof tmp, "%s%s", x < 0 ? "-" : (sign == '+' ? "+" : sign == ' ' ? " " : ""), d);
            }
            jb_puts(&t, tmp);
        } else if (strchr("fFeEgG%", type)) {
            double x = fnum(v);
            if (type == '%') x *= 100.0;
            k += snprintf(f + k, sizeof f - (size_t)k, ".%d%c", prec >= 0 ? prec : 6, type == '%' ? 'f' : type);
            snprintf(tmp, sizeof tmp, f, x);
            jb_puts(&t, tmp);
            if (type == '%') jb_puts(&t, "%");
        } else {
            return fail(c, at, ST_ERR_ARG, "unknown format code '%c'", type);
        }
        if (!align) align = zero ? '=' : '>';
        if (zero && fill == ' ') fill = '0';
    }
    const char *txt = t.p ? t.p : "";
    size_t n = utf8_count(txt, t.len);
    size_t pad = width > 0 && (size_t)width > n ? (size_t)width - n : 0;
    size_t lpad = align == '>' ? pad : align == '^' ? pad / 2 : 0, rpad = pad - (align == '=' ? pad : lpad);
    size_t pre = 0;
    if (align == '=' && t.len && strchr("+- ", txt[0])) pre = 1; // padding goes after the sign
    jb_put(b, txt, pre);
    for (size_t q = 0; q < lpad + (align == '=' ? pad : 0); q++) jb_put(b, &fill, 1);
    jb_put(b, txt + pre, t.len - pre);
    for (size_t q = 0; q < rpad; q++) jb_put(b, &fill, 1);
    jb_free(&t);
    return true;
}

// str.format: {} / {0} / {name} fields with optional !s / !r and a format spec; {{ and }}.
static bool str_format(rctx *c, const jnode *at, const jstr *s, jval *args, jstr **kw, int nargs, jval *out) {
    jbuf b = {0};
    b.max = c->a->cap;
    int autoi = 0;
    bool ok = true;
    for (size_t i = 0; i < s->len && ok;) {
        char ch = s->s[i];
        if (ch == '}' ) {
            if (i + 1 < s->len && s->s[i + 1] == '}') {
                jb_put(&b, "}", 1), i += 2;
                continue;
            }
            ok = fail(c, at, ST_ERR_ARG, "Single '}' encountered in format string");
            break;
        }
        if (ch != '{') {
            jb_put(&b, &ch, 1), i++;
            continue;
        }
        if (i + 1 < s->len && s->s[i + 1] == '{') {
            jb_put(&b, "{", 1), i += 2;
            continue;
        }
        const char *close = memchr(s->s + i, '}', s->len - i);
        if (!close) {
            ok = fail(c, at, ST_ERR_ARG, "Single '{' encountered in format string");
            break;
        }
        const char *f0 = s->s + i + 1, *fe = close;
        const char *colon = memchr(f0, ':', (size_t)(fe - f0));
        const char *bang = memchr(f0, '!', (size_t)((colon ? colon : fe) - f0));
        const char *ne = bang ? bang : colon ? colon : fe;
        jval v = jv_undef(NULL);
        if (ne == f0) {
            if (autoi >= npos(kw, nargs)) {
                ok = fail(c, at, ST_ERR_ARG, "Replacement index %d out of range for positional args tuple", autoi);
                break;
            }
            v = arg(args, kw, nargs, autoi++, NULL, jv_undef(NULL));
        } else if (*f0 >= '0' && *f0 <= '9') {
            int idx = atoi(f0);
            if (idx >= npos(kw, nargs)) {
                ok = fail(c, at, ST_ERR_ARG, "Replacement index %d out of range for positional args tuple", idx);
                break;
            }
            v = arg(args, kw, nargs, idx, NULL, jv_undef(NULL));
        } else {
            char name[128];
            snprintf(name, sizeof name, "%.*s", (int)(ne - f0), f0);
            bool found = false;
            for (int k = 0; k < nargs; k++)
                if (kw && kw[k] && !strcmp(kw[k]->s, name)) v = args[k], found = true;
            if (!found) {
                ok = fail(c, at, ST_ERR_ARG, "KeyError: '%s'", name);
                break;
            }
        }
        if (bang) {
            char conv = bang + 1 < fe ? bang[1] : 0;
            if (conv == 'r' || conv == 'a') {
                jbuf r = {0};
                jv_write_repr(&r, v);
                v = mkstr(c, r.p ? r.p : "", r.len);
                jb_free(&r);
                if (!STR_OK(v)) return oom(c, at);
            } else if (conv == 's') {
                if (!to_str(c, at, v, &v)) return false;
            } else {
                ok = fail(c, at, ST_ERR_ARG, "Unknown conversion specifier %c", conv ? conv : '?');
                break;
            }
        }
        ok = format_one(c, at, v, colon ? colon + 1 : fe, colon ? (size_t)(fe - colon - 1) : 0, &b);
        i = (size_t)(close - s->s) + 1;
    }
    if (ok) {
        *out = b.over ? jv_undef(NULL) : mkstr(c, b.p ? b.p : "", b.len);
        ok = STR_OK(*out) || oom(c, at);
    }
    jb_free(&b);
    return ok;
}

static bool call_method(rctx *c, const jnode *at, const jfunc *fn, jval *args, jstr **kw, int nargs,
                        jval *out) {
    jval self = fn->self;
    jval none = jv_none();
    switch (fn->kind) {
    case M_ITEMS: case M_KEYS: case M_VALUES: {
        jval l = mklist(c, self.d->n);
        if (l.t != JV_LIST) return oom(c, at);
        for (size_t i = 0; i < self.d->n; i++) {
            if (fn->kind == M_KEYS) l.l->v[i] = self.d->k[i];
            else if (fn->kind == M_VALUES) l.l->v[i] = self.d->v[i];
            else {
                jval t = mklist(c, 2);
                if (t.t != JV_LIST) return oom(c, at);
                t.l->tuple = true;
                t.l->v[0] = self.d->k[i], t.l->v[1] = self.d->v[i];
                l.l->v[i] = t;
            }
        }
        *out = l;
        return true;
    }
    case M_GET: {
        jval k = arg(args, kw, nargs, 0, "key", jv_undef(NULL)), d = arg(args, kw, nargs, 1, "default", none);
        const jval *v = jd_getv(self.d, k);
        *out = v ? *v : d;
        return true;
    }
    case M_LOOP_CYCLE: {
        if (!nargs) return fail(c, at, ST_ERR_ARG, "no items for cycling given");
        *out = args[self.loop->index0 % nargs];
        return true;
    }
    case M_UNSAFE:
        return fail(c, at, ST_ERR_ARG, "access to attribute '%s' of '%s' object is unsafe (the sandbox forbids changing values)",
                    fn->name, jv_type_name(self));
    default:
        break;
    }
    // string methods
    const jstr *s = self.s;
    switch (fn->kind) {
    case M_STARTSWITH: case M_ENDSWITH: {
        jval p = arg(args, kw, nargs, 0, NULL, jv_undef(NULL));
        size_t n = 1;
        const jval *cands = &p;
        if (p.t == JV_LIST) n = p.l->n, cands = p.l->v;
        bool r = false;
        for (size_t i = 0; i < n && !r; i++) {
            if (!need_str(c, at, cands[i], fn->kind == M_STARTSWITH ? "startswith first arg" : "endswith first arg"))
                return false;
            const jstr *q = cands[i].s;
            if (q->len <= s->len)
                r = fn->kind == M_STARTSWITH ? !memcmp(s->s, q->s, q->len) : !memcmp(s->s + s->len - q->len, q->s, q->len);
        }
        if (nargs > 1) return fail(c, at, ST_ERR_UNSUPPORTED, "%s with start/end is not supported", fn->name);
        *out = jv_bool(r);
        return true;
    }
    case M_SPLIT: case M_RSPLIT: {
        jval sep = arg(args, kw, nargs, 0, "sep", none), mx = arg(args, kw, nargs, 1, "maxsplit", jv_int(-1));
        if (sep.t != JV_NONE && !need_str(c, at, sep, "separator")) return false;
        if (sep.t == JV_STR && sep.s->len == 0) return fail(c, at, ST_ERR_ARG, "empty separator");
        if (mx.t != JV_INT) return fail(c, at, ST_ERR_ARG, "maxsplit must be an integer");
        *out = str_split(c, s, sep.t == JV_STR ? sep.s : NULL, mx.i, fn->kind == M_RSPLIT);
        return out->t == JV_LIST || oom(c, at);
    }
    case M_STRIP: case M_LSTRIP: case M_RSTRIP: {
        jval ch = arg(args, kw, nargs, 0, "chars", none);
        if (ch.t != JV_NONE && !need_str(c, at, ch, "strip arg")) return false;
        *out = strip(c, s, ch.t == JV_STR ? ch.s : NULL, fn->kind != M_RSTRIP, fn->kind != M_LSTRIP);
        return STR_OK(*out) || oom(c, at);
    }
    case M_REPLACE: {
        jval a = arg(args, kw, nargs, 0, NULL, jv_undef(NULL)), b = arg(args, kw, nargs, 1, NULL, jv_undef(NULL));
        jval k = arg(args, kw, nargs, 2, "count", jv_int(-1));
        if (!need_str(c, at, a, "replace arg 1") || !need_str(c, at, b, "replace arg 2")) return false;
        *out = str_replace(c, s, a.s, b.s, k.t == JV_INT ? k.i : -1);
        return STR_OK(*out) || oom(c, at);
    }
    case M_UPPER: case M_LOWER: case M_TITLE: case M_CAPITALIZE:
        *out = ascii_case(c, s, fn->kind == M_LOWER ? 0 : fn->kind == M_UPPER ? 1 : fn->kind == M_CAPITALIZE ? 2 : 3);
        return STR_OK(*out) || oom(c, at);
    case M_FIND: case M_RFIND: case M_COUNT: {
        jval q = arg(args, kw, nargs, 0, NULL, jv_undef(NULL));
        if (!need_str(c, at, q, "argument")) return false;
        if (fn->kind == M_COUNT) {
            int64_t k = 0;
            if (q.s->len == 0) k = (int64_t)utf8_count(s->s, s->len) + 1;
            else
                for (size_t i = 0; i + q.s->len <= s->len;) {
                    const char *h = memfind(s->s + i, s->len - i, q.s->s, q.s->len);
                    if (!h) break;
                    k++;
                    i = (size_t)(h - s->s) + q.s->len;
                }
            *out = jv_int(k);
            return true;
        }
        int64_t pos = -1;
        if (fn->kind == M_FIND) {
            const char *h = memfind(s->s, s->len, q.s->s, q.s->len);
            if (h) pos = (int64_t)utf8_count(s->s, (size_t)(h - s->s));
        } else if (q.s->len <= s->len) {
            for (size_t i = s->len - q.s->len + 1; i-- > 0;)
                if (!memcmp(s->s + i, q.s->s, q.s->len)) {
                    pos = (int64_t)utf8_count(s->s, i);
                    break;
                }
        }
        *out = jv_int(pos);
        return true;
    }
    case M_JOIN: {
        jval it = arg(args, kw, nargs, 0, NULL, jv_undef(NULL));
        jlist *l;
        if (!to_iter(c, at, it, &l)) return false;
        jbuf b = {0};
        b.max = c->a->cap;
        for (size_t i = 0; i < l->n; i++) {
            if (l->v[i].t != JV_STR) {
                jb_free(&b);
                return fail(c, at, ST_ERR_ARG, "sequence item %zu: expected str instance, %s found", i,
                            jv_type_name(l->v[i]));
            }
            if (i) jb_put(&b, s->s, s->len);
            jb_put(&b, l->v[i].s->s, l->v[i].s->len);
        }
        *out = b.over ? jv_undef(NULL) : mkstr(c, b.p ? b.p : "", b.len);
        jb_free(&b);
        return STR_OK(*out) || oom(c, at);
    }
    case M_SPLITLINES: {
        // split on \n, \r\n, \r (and the other Python line boundaries in ASCII); no keepends
        size_t cnt = 0, i = 0;
        for (int pass = 0; pass < 2; pass++) {
            jval l = {.t = JV_NONE};
            if (pass) {
                l = mklist(c, cnt);
                if (l.t != JV_LIST) return oom(c, at);
            }
            cnt = 0, i = 0;
            while (i < s->len) {
                size_t st = i;
                while (i < s->len && s->s[i] != '\n' && s->s[i] != '\r' && s->s[i] != '\v' && s->s[i] != '\f' &&
                       !(s->s[i] >= 0x1c && s->s[i] <= 0x1e))
                    i++;
                if (pass) {
                    l.l->v[cnt] = mkstr(c, s->s + st, i - st);
                    if (!STR_OK(l.l->v[cnt])) return oom(c, at);
                }
                cnt++;
                if (i < s->len) {
                    if (s->s[i] == '\r' && i + 1 < s->len && s->s[i + 1] == '\n') i++;
                    i++;
                }
            }
            if (pass) *out = l;
        }
        return true;
    }
    case M_ISDIGIT: case M_ISALPHA: case M_ISSPACE: case M_ISALNUM: case M_ISUPPER: case M_ISLOWER: {
        bool r = s->len > 0, cased = false;
        for (size_t i = 0; i < s->len; i++) {
            char ch = s->s[i];
            bool dg = ch >= '0' && ch <= '9', up = ch >= 'A' && ch <= 'Z', lo = ch >= 'a' && ch <= 'z';
            bool sp = ch == ' ' || (ch >= 9 && ch <= 13);
            switch (fn->kind) {
            case M_ISDIGIT: r &= dg; break;
            case M_ISALPHA: r &= up || lo; break;
            case M_ISSPACE: r &= sp; break;
            case M_ISALNUM: r &= dg || up || lo; break;
            case M_ISUPPER: r &= !lo; cased |= up; break;
            default: r &= !up; cased |= lo; break;
            }
        }
        if (fn->kind == M_ISUPPER || fn->kind == M_ISLOWER) r = r && cased;
        *out = jv_bool(r);
        return true;
    }
    case M_FORMAT:
        return str_format(c, at, s, args, kw, nargs, out);
    default:
        return fail(c, at, ST_ERR_UNSUPPORTED, "method '%s' is not supported", fn->name);
    }
}

static bool call_value(rctx *c, const jnode *at, jval callee, jval *args, jstr **kw, int nargs, jframe *f,
                       jval *out) {
    (void)f;
    if (callee.t == JV_MACRO) return call_macro(c, at, callee.m, args, kw, nargs, NULL, out);
    if (callee.t == JV_UNDEF) return undefined_error(c, at, callee);
    if (callee.t != JV_FUNC) return fail(c, at, ST_ERR_ARG, "'%s' object is not callable", jv_type_name(callee));
    if (!step(c, at)) return false;
    const jfunc *fn = callee.fn;
    switch (fn->kind) {
    case F_RANGE: {
        int np = npos(kw, nargs);
        if (np < 1 || np > 3) return fail(c, at, ST_ERR_ARG, "range expected 1 to 3 arguments, got %d", np);
        for (int i = 0; i < np; i++)
            if (args[i].t != JV_INT && args[i].t != JV_BOOL)
                return fail(c, at, ST_ERR_ARG, "'%s' object cannot be interpreted as an integer", jv_type_name(args[i]));
        int64_t b = np > 1 ? inum(args[0]) : 0, e = np > 1 ? inum(args[1]) : inum(args[0]);
        int64_t s = np > 2 ? inum(args[2]) : 1;
        if (s == 0) return fail(c, at, ST_ERR_ARG, "range() arg 3 must not be zero");
        int64_t cnt = 0;
        if (s > 0 && b < e) cnt = (e - b - 1) / s + 1;
        if (s < 0 && b > e) cnt = (b - e - 1) / -s + 1;
        if (cnt > MAX_RANGE) return fail(c, at, ST_ERR_RANGE, "range too big, the sandbox allows at most %d items", MAX_RANGE);
        jval l = mklist(c, (size_t)cnt);
        if (l.t != JV_LIST) return oom(c, at);
        for (int64_t i = 0; i < cnt; i++) l.l->v[i] = jv_int(b + i * s);
        *out = l;
        return true;
    }
    case F_NAMESPACE: case F_DICT: {
        jval ns = mkns(c);
        if (ns.t != JV_NS) return oom(c, at);
        for (int i = 0; i < nargs; i++) {
            if (kw && kw[i]) {
                if (!jd_set(c->a, ns.d, jv_strp(kw[i]), args[i])) return oom(c, at);
            } else if (args[i].t == JV_DICT || args[i].t == JV_NS) {
                for (size_t k = 0; k < args[i].d->n; k++)
                    if (!jd_set(c->a, ns.d, args[i].d->k[k], args[i].d->v[k])) return oom(c, at);
            } else {
                return fail(c, at, ST_ERR_ARG, "%s() takes keyword arguments or a mapping",
                            fn->kind == F_DICT ? "dict" : "namespace");
            }
        }
        if (fn->kind == F_DICT) ns.t = JV_DICT;
        *out = ns;
        return true;
    }
    case F_RAISE: {
        jval m = nargs ? args[0] : jv_str(c->a, "", 0);
        jval ms;
        if (!to_str(c, at, m, &ms)) return false;
        return fail(c, at, ST_ERR_ARG, "template raised an exception: %s", ms.s->s);
    }
    case F_STRFTIME: {
        jval fmt = arg(args, kw, nargs, 0, NULL, jv_undef(NULL));
        if (!need_str(c, at, fmt, "strftime_now format")) return false;
        time_t now = time(NULL);
        struct tm tmv;
        localtime_r(&now, &tmv);
        char buf[256];
        size_t k = strftime(buf, sizeof buf, fmt.s->s, &tmv);
        *out = mkstr(c, buf, k);
        return STR_OK(*out) || oom(c, at);
    }
    default:
        return call_method(c, at, fn, args, kw, nargs, out);
    }
}

// ---------------------------------------------------------------------------------------------
// Tests

static const char *const test_names[] = {
    "defined", "undefined", "none", "boolean", "false", "true", "integer", "float", "number",
    "string", "mapping", "iterable", "sequence", "callable", "sameas", "eq", "equalto", "==", "ne",
    "!=", "lt", "lessthan", "<", "le", "<=", "gt", "greaterthan", ">", "ge", ">=", "in", "odd",
    "even", "divisibleby", "lower", "upper", "escaped", NULL};

static bool apply_test(rctx *c, const jnode *n, const char *name, jval v, jval *args, int nargs, bool *res) {
    jval a0 = nargs > 0 ? args[0] : jv_undef(NULL);
    if (!strcmp(name, "defined")) *res = v.t != JV_UNDEF;
    else if (!strcmp(name, "undefined")) *res = v.t == JV_UNDEF;
    else if (!strcmp(name, "none")) *res = v.t == JV_NONE;
    else if (!strcmp(name, "boolean")) *res = v.t == JV_BOOL;
    else if (!strcmp(name, "false")) *res = v.t == JV_BOOL && !v.b;
    else if (!strcmp(name, "true")) *res = v.t == JV_BOOL && v.b;
    else if (!strcmp(name, "integer")) *res = v.t == JV_INT;
    else if (!strcmp(name, "float")) *res = v.t == JV_FLOAT;
    else if (!strcmp(name, "number")) *res = is_num(v);
    else if (!strcmp(name, "string")) *res = v.t == JV_STR;
    else if (!strcmp(name, "mapping")) *res = v.t == JV_DICT;
    else if (!strcmp(name, "iterable")) *res = v.t == JV_STR || v.t == JV_LIST || v.t == JV_DICT || v.t == JV_UNDEF;
    else if (!strcmp(name, "sequence")) *res = v.t == JV_STR || v.t == JV_LIST || v.t == JV_DICT || v.t == JV_UNDEF;
    else if (!strcmp(name, "callable")) *res = v.t == JV_FUNC || v.t == JV_MACRO;
    else if (!strcmp(name, "sameas")) {
        // `is` identity: singletons and the same container
        if (v.t != a0.t) *res = false;
        else if (v.t == JV_NONE || v.t == JV_UNDEF) *res = true;
        else if (v.t == JV_BOOL) *res = v.b == a0.b;
        else if (v.t == JV_LIST) *res = v.l == a0.l;
        else if (v.t == JV_DICT || v.t == JV_NS) *res = v.d == a0.d;
        else *res = jv_equal(v, a0);
    } else if (!strcmp(name, "eq") || !strcmp(name, "equalto") || !strcmp(name, "=="))
        *res = jv_equal(v, a0);
    else if (!strcmp(name, "ne") || !strcmp(name, "!=")) *res = !jv_equal(v, a0);
    else if (!strcmp(name, "in")) return contains(c, n, v, a0, res);
    else if (!strcmp(name, "odd") || !strcmp(name, "even") || !strcmp(name, "divisibleby")) {
        if (v.t != JV_INT && v.t != JV_BOOL) return fail(c, n, ST_ERR_ARG, "test '%s' needs an integer", name);
        int64_t x = inum(v);
        if (!strcmp(name, "divisibleby")) {
            if (a0.t != JV_INT || a0.i == 0) return fail(c, n, ST_ERR_ARG, "divisibleby needs a non-zero integer");
            *res = x % a0.i == 0;
        } else
            *res = (x % 2 != 0) == !strcmp(name, "odd");
    } else if (!strcmp(name, "lower") || !strcmp(name, "upper")) {
        jval s;
        if (!to_str(c, n, v, &s)) return false;
        bool up = !strcmp(name, "upper"), cased = false, ok = true;
        for (size_t i = 0; i < s.s->len; i++) {
            char ch = s.s->s[i];
            if (ch >= 'a' && ch <= 'z') ok &= !up, cased = true;
            if (ch >= 'A' && ch <= 'Z') ok &= up, cased = true;
        }
        *res = ok && cased;
    } else if (!strcmp(name, "escaped")) *res = false;
    else {
        bool okc = true;
        int k;
        if (!strcmp(name, "lt") || !strcmp(name, "lessthan") || !strcmp(name, "<"))
            k = cmp_vals(c, n, OP_LT, v, a0, &okc), *res = k < 0;
        else if (!strcmp(name, "le") || !strcmp(name, "<="))
            k = cmp_vals(c, n, OP_LE, v, a0, &okc), *res = k <= 0;
        else if (!strcmp(name, "gt") || !strcmp(name, "greaterthan") || !strcmp(name, ">"))
            k = cmp_vals(c, n, OP_GT, v, a0, &okc), *res = k > 0;
        else if (!strcmp(name, "ge") || !strcmp(name, ">="))
            k = cmp_vals(c, n, OP_GE, v, a0, &okc), *res = k >= 0;
        else
            return fail(c, n, ST_ERR_ARG, "no test named '%s'", name);
        return okc;
    }
    return true;
}

// ---------------------------------------------------------------------------------------------
// Filters

static const char *const filter_names[] = {
    "tojson", "length", "count", "trim", "items", "first", "last", "join", "default", "d",
    "upper", "lower", "capitalize", "title", "replace", "string", "int", "float", "list",
    "selectattr", "rejectattr", "select", "reject", "map", "safe", "e", "escape", "forceescape",
    "abs", "round", "unique", "sort", "reverse", "dictsort", "sum", "min", "max", "indent",
    "wordcount", "batch", "tojson", "attr", "center", "truncate", "striptags", NULL};

static bool attr_path(rctx *c, const jnode *at, jval v, jval name, jval *out) {
    // "a.b" walks attributes; an integer part indexes
    if (name.t == JV_INT) return get_item(c, at, v, name, out);
    if (name.t != JV_STR) return fail(c, at, ST_ERR_ARG, "attribute name must be a string");
    const char *s = name.s->s;
    jval cur = v;
    for (;;) {
        const char *dot = strchr(s, '.');
        size_t len = dot ? (size_t)(dot - s) : strlen(s);
        jstr *part = js_new(c->a, s, len);
        if (!part) return oom(c, at);
        bool digits = len > 0;
        for (size_t i = 0; i < len; i++) digits &= s[i] >= '0' && s[i] <= '9';
        if (cur.t == JV_UNDEF) break;
        if (digits && cur.t == JV_LIST) {
            if (!get_item(c, at, cur, jv_int(atoll(part->s)), &cur)) return false;
        } else if (!get_item(c, at, cur, jv_strp(part), &cur)) return false;
        if (!dot) break;
        s = dot + 1;
    }
    *out = cur;
    return true;
}

// select/reject/selectattr/rejectattr: one item's verdict.
static bool select_one(rctx *c, const jnode *at, jval item, jval *args, int nargs, int first_test, bool *keep) {
    if (nargs <= first_test) {
        *keep = jv_truthy(item);
        return true;
    }
    if (args[first_test].t != JV_STR) return fail(c, at, ST_ERR_ARG, "test name must be a string");
    const char *tn = args[first_test].s->s;
    if (!in_list(test_names, tn)) return fail(c, at, ST_ERR_ARG, "no test named '%s'", tn);
    return apply_test(c, at, tn, item, args + first_test + 1, nargs - first_test - 1, keep);
}

static jval list_from(rctx *c, jval *items, size_t n) {
    jval l = mklist(c, n);
    if (l.t == JV_LIST && n) memcpy(l.l->v, items, n * sizeof *items);
    return l;
}

// Sorting for sort/dictsort: a stable merge sort over (value, key) pairs that can report a
// comparison error (Python raises TypeError for mixed types).
typedef struct sort_item {
    jval v, key;
} sort_item;

static int sort_cmp(rctx *c, const jnode *at, const sort_item *x, const sort_item *y, bool case_sensitive,
                    bool *ok) {
    jval a = x->key, b = y->key;
    *ok = true;
    if (jv_equal(a, b)) return 0; // Python compares sort keys for equality first (Undefined == Undefined)
    if (!case_sensitive && a.t == JV_STR && b.t == JV_STR) {
        size_t n = a.s->len < b.s->len ? a.s->len : b.s->len;
        for (size_t i = 0; i < n; i++) {
            unsigned char p = (unsigned char)a.s->s[i], q = (unsigned char)b.s->s[i];
            if (p >= 'A' && p <= 'Z') p |= 0x20;
            if (q >= 'A' && q <= 'Z') q |= 0x20;
            if (p != q) return p < q ? -1 : 1;
        }
        return (a.s->len > b.s->len) - (a.s->len < b.s->len);
    }
    return cmp_vals(c, at, OP_LT, a, b, ok);
}

// reverse flips each comparison (not the result), which keeps equal items in their order, as
// Python's sorted(reverse=True) does.
static bool merge_sort(rctx *c, const jnode *at, sort_item *v, sort_item *tmp, size_t n, bool cs, bool rev) {
    if (n < 2) return true;
    size_t h = n / 2;
    if (!merge_sort(c, at, v, tmp, h, cs, rev) || !merge_sort(c, at, v + h, tmp, n - h, cs, rev)) return false;
    size_t i = 0, j = h, k = 0;
    while (i < h && j < n) {
        bool ok;
        int r = sort_cmp(c, at, &v[j], &v[i], cs, &ok);
        if (!ok) return false;
        if (rev) r = -r;
        tmp[k++] = r < 0 ? v[j++] : v[i++];
    }
    while (i < h) tmp[k++] = v[i++];
    while (j < n) tmp[k++] = v[j++];
    memcpy(v, tmp, n * sizeof *v);
    return true;
}

static bool apply_filter(rctx *c, const jnode *n, jval v, jval *args, jstr **kw, int nargs, jframe *f,
                         jval *out) {
    const char *name = n->name->s;
    jval none = jv_none();
    if (!step(c, n)) return false;
    if (!strcmp(name, "tojson")) {
        // transformers: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
        jval ea = arg(args, kw, nargs, 0, "ensure_ascii", jv_bool(false));
        jval ind = arg(args, kw, nargs, 1, "indent", none);
        jval sep = arg(args, kw, nargs, 2, "separators", none);
        jval sk = arg(args, kw, nargs, 3, "sort_keys", jv_bool(false));
        jjson_opts o = {.indent = -1, .sort_keys = jv_truthy(sk), .ensure_ascii = jv_truthy(ea)};
        char spaces[2] = {0};
        (void)spaces;
        if (ind.t == JV_INT) o.indent = ind.i < 0 ? 0 : ind.i > 64 ? 64 : (int)ind.i;
        else if (ind.t != JV_NONE) return fail(c, n, ST_ERR_UNSUPPORTED, "tojson: indent must be an integer");
        if (sep.t == JV_LIST && sep.l->n == 2 && sep.l->v[0].t == JV_STR && sep.l->v[1].t == JV_STR) {
            o.item_sep = sep.l->v[0].s->s;
            o.key_sep = sep.l->v[1].s->s;
        } else if (sep.t != JV_NONE)
            return fail(c, n, ST_ERR_ARG, "tojson: separators must be a pair of strings");
        jbuf b = {0};
        b.max = c->a->cap;
        st_status s = jv_write_json(&b, v, &o, 0);
        if (s != ST_OK) {
            jb_free(&b);
            return fail(c, n, s, "%s", st_error());
        }
        *out = b.over ? jv_undef(NULL) : mkstr(c, b.p ? b.p : "", b.len);
        jb_free(&b);
        return STR_OK(*out) || oom(c, n);
    }
    if (!strcmp(name, "length") || !strcmp(name, "count")) {
        switch (v.t) {
        case JV_UNDEF: *out = jv_int(0); return true;
        case JV_STR: *out = jv_int((int64_t)utf8_count(v.s->s, v.s->len)); return true;
        case JV_LIST: *out = jv_int((int64_t)v.l->n); return true;
        case JV_DICT: case JV_NS: *out = jv_int((int64_t)v.d->n); return true;
        default: return fail(c, n, ST_ERR_ARG, "object of type '%s' has no len()", jv_type_name(v));
        }
    }
    if (!strcmp(name, "trim")) {
        jval s, ch = arg(args, kw, nargs, 0, "chars", none);
        if (!to_str(c, n, v, &s)) return false;
        if (ch.t != JV_NONE && !need_str(c, n, ch, "trim chars")) return false;
        *out = strip(c, s.s, ch.t == JV_STR ? ch.s : NULL, true, true);
        return STR_OK(*out) || oom(c, n);
    }
    if (!strcmp(name, "items")) {
        if (v.t == JV_UNDEF) {
            *out = mklist(c, 0);
            return out->t == JV_LIST || oom(c, n);
        }
        if (v.t != JV_DICT && v.t != JV_NS)
            return fail(c, n, ST_ERR_ARG, "can only get item pairs from a mapping, not %s", jv_type_name(v));
        jfunc fn = {.kind = M_ITEMS, .self = v, .name = "items"};
        return call_method(c, n, &fn, NULL, NULL, 0, out);
    }
    if (!strcmp(name, "first") || !strcmp(name, "last")) {
        jlist *l;
        if (!to_iter(c, n, v, &l)) return false;
        if (!l->n) *out = undef_msg(c, "No %s item, sequence was empty.", name);
        else *out = name[0] == 'f' ? l->v[0] : l->v[l->n - 1];
        return true;
    }
    if (!strcmp(name, "join")) {
        jval sep = arg(args, kw, nargs, 0, "d", jv_str(c->a, "", 0)), at = arg(args, kw, nargs, 1, "attribute", none);
        jlist *l;
        jval seps;
        if (!to_iter(c, n, v, &l) || !to_str(c, n, sep, &seps)) return false;
        jbuf b = {0};
        b.max = c->a->cap;
        for (size_t i = 0; i < l->n; i++) {
            jval it = l->v[i];
            if (at.t != JV_NONE && !attr_path(c, n, it, at, &it)) {
                jb_free(&b);
                return false;
            }
            if (i) jb_put(&b, seps.s->s, seps.s->len);
            jv_write_str(&b, it);
            if (b.too_deep) {
                jb_free(&b);
                return too_deep(c, n);
            }
        }
        *out = b.over ? jv_undef(NULL) : mkstr(c, b.p ? b.p : "", b.len);
        jb_free(&b);
        return STR_OK(*out) || oom(c, n);
    }
    if (!strcmp(name, "default") || !strcmp(name, "d")) {
        jval dv = arg(args, kw, nargs, 0, "default_value", jv_str(c->a, "", 0));
        jval bo = arg(args, kw, nargs, 1, "boolean", jv_bool(false));
        *out = v.t == JV_UNDEF || (jv_truthy(bo) && !jv_truthy(v)) ? dv : v;
        return true;
    }
    if (!strcmp(name, "title")) {
        jval s;
        if (!to_str(c, n, v, &s)) return false;
        *out = ascii_case(c, s.s, 4);
        return STR_OK(*out) || oom(c, n);
    }
    if (!strcmp(name, "upper") || !strcmp(name, "lower") || !strcmp(name, "capitalize")) {
        jval s;
        if (!to_str(c, n, v, &s)) return false;
        jfunc fn = {.kind = name[0] == 'u' ? M_UPPER : name[0] == 'l' ? M_LOWER : name[0] == 'c' ? M_CAPITALIZE : M_TITLE,
                    .self = s, .name = name};
        return call_method(c, n, &fn, NULL, NULL, 0, out);
    }
    if (!strcmp(name, "replace")) {
        jval s;
        if (!to_str(c, n, v, &s)) return false;
        jval a = arg(args, kw, nargs, 0, "old", jv_undef(NULL)), b = arg(args, kw, nargs, 1, "new", jv_undef(NULL));
        jval k = arg(args, kw, nargs, 2, "count", none);
        jval sa, sb;
        if (!to_str(c, n, a, &sa) || !to_str(c, n, b, &sb)) return false;
        *out = str_replace(c, s.s, sa.s, sb.s, k.t == JV_INT ? k.i : -1);
        return STR_OK(*out) || oom(c, n);
    }
    if (!strcmp(name, "string")) return to_str(c, n, v, out);
    if (!strcmp(name, "safe") || !strcmp(name, "forceescape") || !strcmp(name, "e") || !strcmp(name, "escape")) {
        if (name[0] == 's') {
            *out = v;
            return true;
        }
        jval s;
        if (!to_str(c, n, v, &s)) return false;
        jbuf b = {0};
        for (size_t i = 0; i < s.s->len; i++) {
            char ch = s.s->s[i];
            if (ch == '&') jb_puts(&b, "&amp;");
            else if (ch == '<') jb_puts(&b, "&lt;");
            else if (ch == '>') jb_puts(&b, "&gt;");
            else if (ch == '"') jb_puts(&b, "&#34;");
            else if (ch == '\'') jb_puts(&b, "&#39;");
            else jb_put(&b, &ch, 1);
        }
        *out = mkstr(c, b.p ? b.p : "", b.len);
        jb_free(&b);
        return STR_OK(*out) || oom(c, n);
    }
    if (!strcmp(name, "int") || !strcmp(name, "float")) {
        bool want_int = name[0] == 'i';
        jval dflt = arg(args, kw, nargs, 0, "default", want_int ? jv_int(0) : jv_float(0.0));
        if (v.t == JV_INT || v.t == JV_BOOL) {
            *out = want_int ? jv_int(inum(v)) : jv_float((double)inum(v));
            return true;
        }
        if (v.t == JV_FLOAT) {
            if (want_int && (isnan(v.f) || isinf(v.f) || fabs(v.f) >= 9.2e18)) *out = dflt;
            else *out = want_int ? jv_int((int64_t)v.f) : v;
            return true;
        }
        if (v.t == JV_STR) {
            jval t = strip(c, v.s, NULL, true, true);
            if (!STR_OK(t)) return oom(c, n);
            char *end;
            errno = 0;
            if (want_int) {
                long long x = strtoll(t.s->s, &end, 10);
                if (t.s->len && !*end && !errno) {
                    *out = jv_int(x);
                    return true;
                }
            }
            double d = strtod(t.s->s, &end);
            if (t.s->len && !*end && !(t.s->s[0] == '0' && (t.s->s[1] == 'x' || t.s->s[1] == 'X'))) {
                *out = want_int ? (isnan(d) || isinf(d) || fabs(d) >= 9.2e18 ? dflt : jv_int((int64_t)d)) : jv_float(d);
                return true;
            }
        }
        *out = dflt;
        return true;
    }
    if (!strcmp(name, "list")) {
        jlist *l;
        if (!to_iter(c, n, v, &l)) return false;
        *out = list_from(c, l->v, l->n);
        return out->t == JV_LIST || oom(c, n);
    }
    if (!strcmp(name, "selectattr") || !strcmp(name, "rejectattr") || !strcmp(name, "select") || !strcmp(name, "reject")) {
        bool by_attr = strstr(name, "attr") != NULL, rej = name[0] == 'r';
        jlist *l;
        if (!to_iter(c, n, v, &l)) return false;
        jval r = mklist(c, l->n);
        if (r.t != JV_LIST) return oom(c, n);
        size_t k = 0;
        for (size_t i = 0; i < l->n; i++) {
            jval it = l->v[i];
            bool keep;
            if (by_attr) {
                if (nargs < 1) return fail(c, n, ST_ERR_ARG, "%s needs an attribute name", name);
                if (!attr_path(c, n, it, args[0], &it)) return false;
            }
            if (!select_one(c, n, it, args, nargs, by_attr ? 1 : 0, &keep)) return false;
            if (keep != rej) r.l->v[k++] = l->v[i];
        }
        r.l->n = k;
        *out = r;
        return true;
    }
    if (!strcmp(name, "map")) {
        jlist *l;
        if (!to_iter(c, n, v, &l)) return false;
        jval r = mklist(c, l->n);
        if (r.t != JV_LIST) return oom(c, n);
        jval at = arg(args, kw, nargs, -1, "attribute", jv_undef(NULL));
        jval dflt = arg(args, kw, nargs, -1, "default", jv_undef(NULL));
        if (at.t == JV_UNDEF && npos(kw, nargs) < 1) return fail(c, n, ST_ERR_ARG, "map needs a filter name or attribute=");
        for (size_t i = 0; i < l->n; i++) {
            jval it = l->v[i];
            if (at.t != JV_UNDEF) {
                if (!attr_path(c, n, it, at, &it)) return false;
                if (it.t == JV_UNDEF && dflt.t != JV_UNDEF) it = dflt;
            } else {
                if (args[0].t != JV_STR || !in_list(filter_names, args[0].s->s))
                    return fail(c, n, ST_ERR_ARG, "map: no filter named '%s'",
                                args[0].t == JV_STR ? args[0].s->s : "?");
                jnode fake = *n;
                fake.name = args[0].s;
                if (!apply_filter(c, &fake, it, args + 1, kw ? kw + 1 : NULL, nargs - 1, f, &it)) return false;
            }
            r.l->v[i] = it;
        }
        *out = r;
        return true;
    }
    if (!strcmp(name, "abs")) {
        if (v.t == JV_FLOAT) *out = jv_float(fabs(v.f));
        else if (v.t == JV_INT || v.t == JV_BOOL) *out = jv_int(inum(v) < 0 ? -inum(v) : inum(v));
        else return fail(c, n, ST_ERR_ARG, "bad operand type for abs(): '%s'", jv_type_name(v));
        return true;
    }
    if (!strcmp(name, "round")) {
        jval pr = arg(args, kw, nargs, 0, "precision", jv_int(0)), me = arg(args, kw, nargs, 1, "method", none);
        if (!is_num(v)) return fail(c, n, ST_ERR_ARG, "round needs a number");
        if (v.t != JV_FLOAT && (me.t != JV_STR || !strcmp(me.s->s, "common"))) { // round(int) is the int
            *out = jv_int(inum(v));
            return true;
        }
        int64_t prec = pr.t == JV_INT ? pr.i : 0;
        if (prec < 0 || prec > 30) return fail(c, n, ST_ERR_UNSUPPORTED, "round: precision must be in [0, 30]");
        double x = fnum(v), m = pow(10.0, (double)prec), r;
        const char *how = me.t == JV_STR ? me.s->s : "common";
        if (!strcmp(how, "ceil")) r = ceil(x * m) / m;
        else if (!strcmp(how, "floor")) r = floor(x * m) / m;
        else { // Python's round(): correctly rounded from the exact binary value, ties to even
            char tmp[400];
            snprintf(tmp, sizeof tmp, "%.*f", (int)prec, x);
            r = strtod(tmp, NULL);
        }
        *out = jv_float(r);
        return true;
    }
    if (!strcmp(name, "unique") || !strcmp(name, "reverse")) {
        jlist *l;
        if (v.t == JV_STR && name[0] == 'r') {
            jval s;
            jval mone = jv_int(-1);
            if (!do_slice(c, n, v, none, none, mone, &s)) return false;
            *out = s;
            return true;
        }
        if (!to_iter(c, n, v, &l)) return false;
        jval r = mklist(c, l->n);
        if (r.t != JV_LIST) return oom(c, n);
        size_t k = 0;
        for (size_t i = 0; i < l->n; i++) {
            if (name[0] == 'r') {
                r.l->v[k++] = l->v[l->n - 1 - i];
                continue;
            }
            bool seen = false;
            for (size_t j = 0; j < k && !seen; j++) seen = jv_equal(r.l->v[j], l->v[i]);
            if (!seen) r.l->v[k++] = l->v[i];
        }
        r.l->n = k;
        *out = r;
        return true;
    }
    if (!strcmp(name, "sort") || !strcmp(name, "dictsort")) {
        bool dictsort = name[0] == 'd';
        jval rev = arg(args, kw, nargs, dictsort ? 2 : 0, "reverse", jv_bool(false));
        jval cs = arg(args, kw, nargs, dictsort ? 0 : 1, "case_sensitive", jv_bool(false));
        jval at = dictsort ? none : arg(args, kw, nargs, 2, "attribute", none);
        jval by = dictsort ? arg(args, kw, nargs, 1, "by", jv_str(c->a, "key", 3)) : none;
        jlist *l;
        if (dictsort) {
            if (v.t != JV_DICT) return fail(c, n, ST_ERR_ARG, "dictsort needs a mapping");
            jval items;
            jfunc fn = {.kind = M_ITEMS, .self = v, .name = "items"};
            if (!call_method(c, n, &fn, NULL, NULL, 0, &items)) return false;
            l = items.l;
        } else if (!to_iter(c, n, v, &l)) return false;
        size_t cnt = l->n;
        sort_item *items = malloc((cnt ? cnt : 1) * 2 * sizeof *items);
        if (!items) return oom(c, n);
        for (size_t i = 0; i < cnt; i++) {
            jval key = l->v[i];
            if (dictsort) key = l->v[i].l->v[by.t == JV_STR && !strcmp(by.s->s, "value") ? 1 : 0];
            else if (at.t != JV_NONE && !attr_path(c, n, key, at, &key)) {
                free(items);
                return false;
            }
            items[i].v = l->v[i], items[i].key = key;
        }
        bool ok = merge_sort(c, n, items, items + cnt, cnt, jv_truthy(cs), jv_truthy(rev));
        jval r = ok ? mklist(c, cnt) : jv_none();
        if (ok && r.t == JV_LIST)
            for (size_t i = 0; i < cnt; i++) r.l->v[i] = items[i].v;
        free(items);
        if (!ok) return false;
        if (r.t != JV_LIST) return oom(c, n);
        *out = r;
        return true;
    }
    if (!strcmp(name, "sum") || !strcmp(name, "min") || !strcmp(name, "max")) {
        jlist *l;
        if (!to_iter(c, n, v, &l)) return false;
        if (name[1] == 'u') {
            jval acc = arg(args, kw, nargs, 1, "start", jv_int(0)), at = arg(args, kw, nargs, 0, "attribute", none);
            for (size_t i = 0; i < l->n; i++) {
                jval it = l->v[i];
                if (at.t != JV_NONE && !attr_path(c, n, it, at, &it)) return false;
                if (!arith(c, n, OP_ADD, acc, it, &acc)) return false;
            }
            *out = acc;
            return true;
        }
        if (!l->n) {
            *out = undef_msg(c, "No aggregated item, sequence was empty.");
            return true;
        }
        jval best = l->v[0];
        for (size_t i = 1; i < l->n; i++) {
            bool ok;
            int k = cmp_vals(c, n, OP_LT, l->v[i], best, &ok);
            if (!ok) return false;
            if (name[1] == 'i' ? k < 0 : k > 0) best = l->v[i];
        }
        *out = best;
        return true;
    }
    if (!strcmp(name, "indent")) {
        // Jinja's do_indent: lines after the first get the indent unless empty (or blank=True)
        jval s, w = arg(args, kw, nargs, 0, "width", jv_int(4)), first = arg(args, kw, nargs, 1, "first", jv_bool(false));
        jval blank = arg(args, kw, nargs, 2, "blank", jv_bool(false));
        if (!to_str(c, n, v, &s)) return false;
        jval pad;
        if (w.t == JV_STR) pad = w;
        else if (w.t == JV_INT) {
            if (w.i < 0 || w.i > 1024) return fail(c, n, ST_ERR_RANGE, "indent width out of range");
            char sp[1025];
            memset(sp, ' ', (size_t)w.i);
            pad = mkstr(c, sp, (size_t)w.i);
            if (!STR_OK(pad)) return oom(c, n);
        } else
            return fail(c, n, ST_ERR_ARG, "indent width must be an integer or a string");
        jbuf b = {0};
        b.max = c->a->cap;
        if (jv_truthy(first)) jb_put(&b, pad.s->s, pad.s->len);
        const char *p = s.s->s, *e = p + s.s->len;
        bool firstline = true;
        while (p < e) {
            const char *nl = memchr(p, '\n', (size_t)(e - p));
            size_t len = nl ? (size_t)(nl - p) : (size_t)(e - p);
            if (!firstline) {
                jb_put(&b, "\n", 1);
                if (len || jv_truthy(blank)) jb_put(&b, pad.s->s, pad.s->len);
            }
            jb_put(&b, p, len);
            firstline = false;
            p += len + (nl ? 1 : 0);
        }
        *out = b.over ? jv_undef(NULL) : mkstr(c, b.p ? b.p : "", b.len);
        jb_free(&b);
        return STR_OK(*out) || oom(c, n);
    }
    if (!strcmp(name, "wordcount")) {
        jval s;
        if (!to_str(c, n, v, &s)) return false;
        jval parts = str_split(c, s.s, NULL, -1, false);
        if (parts.t != JV_LIST) return oom(c, n);
        *out = jv_int((int64_t)parts.l->n);
        return true;
    }
    if (!strcmp(name, "attr")) {
        jval nm = arg(args, kw, nargs, 0, "name", jv_undef(NULL));
        if (!need_str(c, n, nm, "attr name")) return false;
        return get_attr(c, n, v, nm.s, out);
    }
    if (in_list(filter_names, name)) return fail(c, n, ST_ERR_UNSUPPORTED, "the '%s' filter is not supported", name);
    return fail(c, n, ST_ERR_ARG, "no filter named '%s'", name);
}

// ---------------------------------------------------------------------------------------------
// Statements

static bool emit(rctx *c, const jnode *at, const char *s, size_t n) {
    if (!jb_put(c->out, s, n)) {
        if (c->out->max && c->out->len + n > c->out->max)
            return fail(c, at, ST_ERR_RANGE, "output is longer than %zu bytes", c->max_output);
        return oom(c, at);
    }
    return true;
}

// Applies a filter chain whose innermost operand is a placeholder, to `base`.
static bool apply_chain(rctx *c, const jnode *chain, jval base, jframe *f, jval *out) {
    if (chain->kind != E_FILTER) {
        *out = base;
        return true;
    }
    jval v, *args;
    if (!apply_chain(c, chain->a, base, f, &v) || !eval_args(c, chain, f, &args)) return false;
    return apply_filter(c, chain, v, args, chain->kw, chain->nargs, f, out);
}

static bool assign(rctx *c, const jnode *at, jframe *f, jstr **targets, int nt, jval v) {
    if (nt == 1) return frame_set(c, f, targets[0], v) || oom(c, at);
    jlist *l;
    if (!to_iter(c, at, v, &l)) return false;
    if ((int)l->n != nt)
        return fail(c, at, ST_ERR_ARG, "cannot unpack %zu values into %d names", l->n, nt);
    for (int i = 0; i < nt; i++)
        if (!frame_set(c, f, targets[i], l->v[i])) return oom(c, at);
    return true;
}

static bool exec_for(rctx *c, const jnode *n, jframe *f) {
    jval it;
    jlist *src;
    if (n->recursive) return fail(c, n, ST_ERR_UNSUPPORTED, "recursive for loops are not supported");
    if (!eval(c, n->a, f, &it) || !to_iter(c, n, it, &src)) return false;
    jlist *items = src;
    if (n->filter) { // `for x in xs if cond`: filter first, so loop.length counts what remains
        items = jl_new(c->a, src->n);
        if (!items && src->n) return oom(c, n);
        if (!items) items = src;
        size_t k = 0;
        jframe *ff = frame_new(c, f); // one scope, cleared per item: a filter defines nothing
        if (!ff) return oom(c, n);
        for (size_t i = 0; i < src->n; i++) {
            jval keep;
            if (!step(c, n)) return false;
            ff->vars->n = 0;
            if (!assign(c, n, ff, n->targets, n->ntargets, src->v[i]) || !eval(c, n->filter, ff, &keep)) return false;
            if (jv_truthy(keep)) items->v[k++] = src->v[i];
        }
        if (items != src) items->n = k;
    }
    if (!items->n) {
        jframe *ff = frame_new(c, f);
        if (!ff) return oom(c, n);
        return exec_body(c, n->alt, n->nalt, ff);
    }
    jloop *lp = ja_alloc(c->a, sizeof *lp);
    if (!lp) return oom(c, n);
    lp->length = (int64_t)items->n;
    lp->items = items;
    lp->depth = 1;
    jval lv = {.t = JV_LOOP};
    lv.loop = lp;
    jstr *lname = js_new(c->a, "loop", 4);
    if (!lname) return oom(c, n);
    if (c->depth >= c->max_depth) return fail(c, n, ST_ERR_RANGE, "loops nested deeper than %d", c->max_depth);
    c->depth++;
    // Each iteration gets a fresh scope (Jinja's rule); the same storage is reused unless the
    // body defines a macro, whose closure must keep its iteration's scope.
    jframe *reuse = NULL;
    for (size_t i = 0; i < items->n; i++) {
        if (!step(c, n)) {
            c->depth--;
            return false;
        }
        lp->index0 = (int64_t)i;
        jframe *ff = reuse;
        if (ff) ff->vars->n = 0;
        else if ((ff = frame_new(c, f)) && !n->captures) reuse = ff;
        if (!ff || !frame_set(c, ff, lname, lv)) {
            c->depth--;
            return oom(c, n);
        }
        if (!assign(c, n, ff, n->targets, n->ntargets, items->v[i]) || !exec_body(c, n->body, n->nbody, ff)) {
            c->depth--;
            return false;
        }
        if (c->brk == 1) {
            c->brk = 0;
            break;
        }
        c->brk = 0;
    }
    c->depth--;
    return true;
}

static bool exec_node(rctx *c, const jnode *n, jframe *f) {
    switch (n->kind) {
    case N_TEXT: return emit(c, n, n->lit.s->s, n->lit.s->len);
    case N_OUTPUT: {
        jval v;
        if (!eval(c, n->a, f, &v)) return false;
        if (!step(c, n)) return false;
        if (v.t == JV_STR) return emit(c, n, v.s->s, v.s->len);
        if (v.t == JV_UNDEF) return true;
        if (!jv_write_str(c->out, v)) {
            if (c->out->too_deep) return too_deep(c, n);
            return fail(c, n, ST_ERR_RANGE, "output is longer than %zu bytes", c->max_output);
        }
        return true;
    }
    case N_IF: {
        jval v;
        if (!eval(c, n->a, f, &v)) return false;
        return jv_truthy(v) ? exec_body(c, n->body, n->nbody, f) : exec_body(c, n->alt, n->nalt, f);
    }
    case N_FOR: return exec_for(c, n, f);
    case N_SET: {
        jval v;
        if (!eval(c, n->a, f, &v)) return false;
        if (n->b) {
            jval ns;
            if (!eval(c, n->b, f, &ns)) return false;
            if (ns.t != JV_NS)
                return fail(c, n, ST_ERR_ARG, "cannot assign attribute on non-namespace object '%s'", n->b->name->s);
            return jd_set(c->a, ns.d, jv_strp(n->name), v) || oom(c, n);
        }
        return assign(c, n, f, n->targets, n->ntargets, v);
    }
    case N_SET_BLOCK: {
        jval v;
        if (!render_to_string(c, n->body, n->nbody, f, n, &v)) return false;
        if (n->filter && !apply_chain(c, n->filter, v, f, &v)) return false;
        return assign(c, n, f, n->targets, n->ntargets, v);
    }
    case N_FILTER_BLOCK: {
        jval v;
        if (!render_to_string(c, n->body, n->nbody, f, n, &v) || !apply_chain(c, n->filter, v, f, &v)) return false;
        jval s;
        if (!to_str(c, n, v, &s)) return false;
        return emit(c, n, s.s->s, s.s->len);
    }
    case N_MACRO: {
        jval m = {.t = JV_MACRO};
        m.m = ja_alloc(c->a, sizeof *m.m);
        if (!m.m) return oom(c, n);
        m.m->def = n;
        m.m->closure = f;
        return frame_set(c, f, n->name, m) || oom(c, n);
    }
    case N_CALLBLOCK: {
        const jnode *call = n->a;
        jval callee, *args, r;
        if (!eval(c, call->a, f, &callee) || !eval_args(c, call, f, &args)) return false;
        if (callee.t != JV_MACRO) return fail(c, n, ST_ERR_ARG, "call block needs a macro");
        jmacro *caller = ja_alloc(c->a, sizeof *caller);
        if (!caller) return oom(c, n);
        caller->def = n;
        caller->closure = f;
        if (!call_macro(c, n, callee.m, args, call->kw, call->nargs, caller, &r)) return false;
        return emit(c, n, r.s->s, r.s->len);
    }
    case N_BREAK: c->brk = 1; return true;
    case N_CONTINUE: c->brk = 2; return true;
    case N_BLOCK: return exec_body(c, n->body, n->nbody, f);
    default: return fail(c, n, ST_ERR_UNSUPPORTED, "internal: node kind %d is not a statement", n->kind);
    }
}

static bool exec_body(rctx *c, jnode *const *body, int nbody, jframe *f) {
    for (int i = 0; i < nbody; i++) {
        if (!exec_node(c, body[i], f)) return false;
        if (c->brk) return true; // break/continue unwinds to the loop
    }
    return true;
}

// ---------------------------------------------------------------------------------------------
// Checking names at parse time: an unknown filter or test is a template error with its place,
// as Jinja reports it when compiling.

// Jinja reports an unknown filter or test when compiling, except inside an `if` (its test and
// branches) or a conditional expression, where the error waits until the code runs; a loop,
// macro or block body inside those is checked at compile time again. `soft` tracks that.
static st_status check_names(const char *tname, jnode *const *body, int nbody, bool soft);
static st_status check_node(const char *tname, const jnode *n, bool soft) {
    if (!n) return ST_OK;
    if (!soft && n->kind == E_FILTER && !in_list(filter_names, n->name->s))
        return st_fail(ST_ERR_FORMAT, "%s:%d:%d: no filter named '%s'", tname, n->line, n->col, n->name->s);
    if (!soft && n->kind == E_TEST && !in_list(test_names, n->name->s))
        return st_fail(ST_ERR_FORMAT, "%s:%d:%d: no test named '%s'", tname, n->line, n->col, n->name->s);
    bool in = soft || n->kind == N_IF || n->kind == E_COND; // this node's own expressions
    bool inner = n->kind == N_FOR || n->kind == N_MACRO || n->kind == N_CALLBLOCK ||
                 n->kind == N_SET_BLOCK || n->kind == N_FILTER_BLOCK ? false : in; // bodies
    ST_TRY(check_node(tname, n->a, in));
    ST_TRY(check_node(tname, n->b, in));
    ST_TRY(check_node(tname, n->c, in));
    ST_TRY(check_node(tname, n->filter, n->kind == N_FOR ? false : in));
    if (n->kind != E_SLICE || n->args)
        for (int i = 0; i < n->nargs; i++) ST_TRY(check_node(tname, n->args[i], in));
    ST_TRY(check_names(tname, n->body, n->nbody, inner));
    return check_names(tname, n->alt, n->nalt, inner);
}
static st_status check_names(const char *tname, jnode *const *body, int nbody, bool soft) {
    for (int i = 0; i < nbody; i++) ST_TRY(check_node(tname, body[i], soft));
    return ST_OK;
}

// ---------------------------------------------------------------------------------------------
// Public API

st_status st_chat_template_parse(const char *src, size_t len, const char *name, st_chat_template **out) {
    *out = NULL;
    st_chat_template *t = calloc(1, sizeof *t);
    if (!t) return st_fail(ST_ERR_NOMEM, "chat template: out of memory");
    snprintf(t->name, sizeof t->name, "%s", name ? name : "template");
    ja_init(&t->arena, AST_ARENA_CAP);
    st_status s = jparse(&t->arena, t->name, src, len, &t->ast);
    if (s == ST_OK) s = check_names(t->name, t->ast.body, t->ast.nbody, false);
    if (s != ST_OK) {
        st_chat_template_free(t);
        return s;
    }
    *out = t;
    return ST_OK;
}

st_status st_chat_template_from_gguf(const st_gguf *g, st_chat_template **out) {
    const char *s;
    size_t len;
    *out = NULL;
    if (!st_gguf_get_str(g, "tokenizer.chat_template", &s, &len))
        return st_fail(ST_ERR_FORMAT, "%s: no tokenizer.chat_template in the metadata", st_gguf_path(g));
    char name[160];
    const char *p = st_gguf_path(g), *base = strrchr(p, '/');
    snprintf(name, sizeof name, "%s:tokenizer.chat_template", base ? base + 1 : p);
    return st_chat_template_parse(s, len, name, out);
}

void st_chat_template_free(st_chat_template *t) {
    if (!t) return;
    ja_free(&t->arena);
    free(t);
}

static bool add_global_fn(rctx *c, jframe *g, const char *name, jfn_kind k) {
    jval fn = mkfunc(c, k, jv_none(), name);
    jstr *nm = js_new(c->a, name, strlen(name));
    return fn.t == JV_FUNC && nm && frame_set(c, g, nm, fn);
}

st_status st_chat_template_render(const st_chat_template *t, const struct json_t *vars,
                                  const st_chat_limits *limits, char **out, size_t *len) {
    *out = NULL;
    if (len) *len = 0;
    st_chat_limits lim = limits ? *limits : (st_chat_limits){0};
    if (!lim.max_output) lim.max_output = DEFAULT_MAX_OUTPUT;
    if (!lim.max_steps) lim.max_steps = DEFAULT_MAX_STEPS;
    if (!lim.max_depth) lim.max_depth = DEFAULT_MAX_DEPTH;
    if (!lim.max_memory) lim.max_memory = DEFAULT_MAX_MEMORY;
    if (vars && !json_is_object((const json_t *)vars))
        return st_fail(ST_ERR_ARG, "%s: template variables must be a JSON object", t->name);

    jarena arena;
    ja_init(&arena, lim.max_memory);
    jbuf buf = {0};
    buf.max = lim.max_output;
    rctx c = {.a = &arena, .out = &buf, .tname = t->name, .max_steps = lim.max_steps,
              .max_depth = lim.max_depth, .max_output = lim.max_output};
    // globals: the functions transformers and Jinja provide, then the caller's variables
    jframe *g = frame_new(&c, NULL);
    bool ok = g && add_global_fn(&c, g, "range", F_RANGE) && add_global_fn(&c, g, "namespace", F_NAMESPACE) &&
              add_global_fn(&c, g, "dict", F_DICT) && add_global_fn(&c, g, "raise_exception", F_RAISE) &&
              add_global_fn(&c, g, "strftime_now", F_STRFTIME);
    if (!ok) oom(&c, NULL);
    if (ok && vars) {
        const char *k;
        size_t klen;
        json_t *v;
        void *tmp;
        json_object_keylen_foreach_safe((json_t *)vars, tmp, k, klen, v) {
            jval kv = mkstr(&c, k, klen), vv;
            if (!STR_OK(kv)) {
                ok = oom(&c, NULL);
                break;
            }
            if (!(ok = from_json(&c, v, &vv, 0))) break;
            if (!jd_set(c.a, g->vars, kv, vv)) {
                ok = oom(&c, NULL);
                break;
            }
        }
    }
    c.root = g;
    if (ok) {
        // the template's own top-level scope sits on the globals, as Jinja's context does
        jframe *top = frame_new(&c, g);
        ok = top ? exec_body(&c, t->ast.body, t->ast.nbody, top) : oom(&c, NULL);
    }
    st_status s = ST_OK;
    if (!ok || c.failed) {
        s = st_fail(c.failed ? c.code : ST_ERR_NOMEM, "%s", c.failed ? c.err : "render failed");
        jb_free(&buf);
    } else {
        if (!buf.p) jb_put(&buf, "", 0);
        if (!buf.p) s = st_fail(ST_ERR_NOMEM, "%s: out of memory", t->name);
        *out = buf.p;
        if (len) *len = buf.len;
    }
    ja_free(&arena);
    return s;
}

st_status st_chat_apply(const st_chat_template *t, const struct json_t *messages, const struct json_t *tools,
                        bool add_generation_prompt, const struct json_t *extra, char **out, size_t *len) {
    json_t *vars = json_object();
    if (!vars) return st_fail(ST_ERR_NOMEM, "out of memory");
    if (extra && json_is_object((const json_t *)extra)) json_object_update(vars, (json_t *)extra);
    json_object_set_new(vars, "messages", messages ? json_incref((json_t *)messages) : json_array());
    json_object_set_new(vars, "tools", tools ? json_incref((json_t *)tools) : json_null());
    json_object_set_new(vars, "documents", json_null());
    json_object_set_new(vars, "add_generation_prompt", json_boolean(add_generation_prompt));
    st_status s = st_chat_template_render(t, vars, NULL, out, len);
    json_decref(vars);
    return s;
}
