// chat templates, internal: the arena, the Jinja value type, the syntax tree, and the pieces
// the parser (chat_parse.c), the values (chat_value.c) and the renderer (chat_render.c) share.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "tokenizer/tokenizer.h"

// ---------------------------------------------------------------------------------------------
// Arena: every value and syntax node lives in one; freed all at once. A cap on its total size
// bounds the memory a hostile template can take (strings built in a loop, say).

typedef struct jchunk jchunk;
typedef struct jarena {
    jchunk *head;
    size_t total; // bytes taken from malloc so far
    size_t cap;   // 0: unlimited
} jarena;

void ja_init(jarena *a, size_t cap);
void ja_free(jarena *a);
void *ja_alloc(jarena *a, size_t n); // 16-byte aligned, zeroed; NULL when over the cap

// ---------------------------------------------------------------------------------------------
// Values. Strings are UTF-8, immutable, NUL-terminated. Lists and dicts are immutable once
// built (the sandbox forbids mutation), except namespaces, whose attributes `set` can change.

typedef enum jtype {
    JV_UNDEF, // undefined: prints as '', iterates as empty, is falsy; `.x` on it is an error
    JV_NONE,
    JV_BOOL,
    JV_INT,
    JV_FLOAT,
    JV_STR,
    JV_LIST, // lists and tuples
    JV_DICT,
    JV_NS,    // namespace(): a dict whose attributes can be set
    JV_FUNC,  // a built-in function or a bound method (self + which)
    JV_MACRO, // a macro (or a call block's caller)
    JV_LOOP,  // the `loop` object of a for loop
} jtype;

typedef struct jstr {
    size_t len;
    char s[]; // len bytes + NUL
} jstr;

typedef struct jlist jlist;
typedef struct jdict jdict;
typedef struct jfunc jfunc;
typedef struct jmacro jmacro;
typedef struct jloop jloop;

typedef struct jval {
    jtype t;
    union {
        bool b;
        int64_t i;
        double f;
        jstr *s;
        jlist *l;
        jdict *d;
        jfunc *fn;
        jmacro *m;
        jloop *loop;
        const char *undef; // JV_UNDEF: what was missing, for the error message (may be NULL)
    };
} jval;

struct jlist {
    size_t n;
    jval *v;
    bool tuple; // prints as (a, b) like a Python tuple
};
struct jdict {
    size_t n, cap;
    jval *k, *v; // insertion order, as Python dicts keep it
};

// Built-in functions, filters reachable as functions, and methods of str / dict / loop.
typedef enum jfn_kind {
    F_RANGE, F_NAMESPACE, F_DICT, F_RAISE, F_STRFTIME, F_LIPSUM_NONE,
    M_STARTSWITH, M_ENDSWITH, M_SPLIT, M_RSPLIT, M_STRIP, M_LSTRIP, M_RSTRIP, M_REPLACE, M_UPPER,
    M_LOWER, M_TITLE, M_CAPITALIZE, M_FIND, M_RFIND, M_COUNT, M_JOIN, M_SPLITLINES, M_ISDIGIT,
    M_ISALPHA, M_ISSPACE, M_ISALNUM, M_ISUPPER, M_ISLOWER, M_FORMAT,
    M_ITEMS, M_KEYS, M_VALUES, M_GET,
    M_LOOP_CYCLE,
    M_UNSAFE, // a method the sandbox refuses (list.append, dict.update, ...)
} jfn_kind;

struct jfunc {
    jfn_kind kind;
    jval self;
    const char *name;
};

typedef struct jnode jnode;
typedef struct jframe jframe;
struct jmacro {
    const jnode *def;   // N_MACRO node (or the N_CALLBLOCK for a caller)
    jframe *closure;    // frame it was defined in
    const jnode *caller_body; // for a call block's caller()
};

struct jloop {
    int64_t index0, length;
    const jlist *items;
    int depth;
};

static inline jval jv_undef(const char *why) { jval v = {.t = JV_UNDEF}; v.undef = why; return v; }
static inline jval jv_none(void) { jval v = {.t = JV_NONE}; return v; }
static inline jval jv_bool(bool b) { jval v = {.t = JV_BOOL}; v.b = b; return v; }
static inline jval jv_int(int64_t i) { jval v = {.t = JV_INT}; v.i = i; return v; }
static inline jval jv_float(double f) { jval v = {.t = JV_FLOAT}; v.f = f; return v; }
static inline jval jv_strp(jstr *s) { jval v = {.t = JV_STR}; v.s = s; return v; }

// ---- a growable byte buffer (malloc'd: the output can be large and outlives the arena)
typedef struct jbuf {
    char *p;
    size_t len, cap;
    size_t max; // 0: unlimited; past it, jb_put fails
    bool over;
    bool too_deep; // a value nested deeper than JV_MAX_NEST was printed (and cut)
} jbuf;
bool jb_put(jbuf *b, const char *s, size_t n);
static inline bool jb_puts(jbuf *b, const char *s) { return jb_put(b, s, __builtin_strlen(s)); }
bool jb_printf(jbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void jb_free(jbuf *b);

// UTF-8: decodes one code point at s[*i] (advancing *i); invalid bytes decode as U+FFFD.
uint32_t utf8_next(const char *s, size_t n, size_t *i);

// Values can nest (lists in dicts in lists...); printing and comparing recurse, so nesting is
// bounded to keep the C stack safe whatever a template builds.
#define JV_MAX_NEST 512

// ---- value helpers (chat_value.c)
jstr *js_new(jarena *a, const char *s, size_t n); // NULL when the arena is full
jval jv_str(jarena *a, const char *s, size_t n);  // JV_UNDEF(NULL) when the arena is full
jlist *jl_new(jarena *a, size_t n);
jdict *jd_new(jarena *a, size_t cap);
bool jd_set(jarena *a, jdict *d, jval k, jval v); // replaces an equal key in place
const jval *jd_get(const jdict *d, const char *key, size_t klen);
const jval *jd_getv(const jdict *d, jval key);
bool jv_truthy(jval v);
bool jv_equal(jval a, jval b);
const char *jv_type_name(jval v); // Python's type names, for messages
bool jv_is_ascii(const jstr *s);
size_t utf8_count(const char *s, size_t n); // code points

// Python str() and repr() of a value, appended to b. False when the buffer is full.
bool jv_write_str(jbuf *b, jval v);
bool jv_write_repr(jbuf *b, jval v);
void jv_write_float(jbuf *b, double f); // Python's repr(float)

typedef struct jjson_opts {
    int indent;        // < 0: none
    bool sort_keys;
    bool ensure_ascii;
    const char *item_sep, *key_sep; // NULL: Python's defaults for the indent
} jjson_opts;
// json.dumps(v, ...). Fails (message set) on a value JSON cannot hold.
st_status jv_write_json(jbuf *b, jval v, const jjson_opts *o, int depth);

// ---------------------------------------------------------------------------------------------
// Syntax tree

typedef enum jnode_kind {
    // statements
    N_TEXT, N_OUTPUT, N_IF, N_FOR, N_SET, N_SET_BLOCK, N_MACRO, N_CALLBLOCK, N_BREAK, N_CONTINUE,
    N_BLOCK, // a plain body (generation blocks, filter-free wrappers)
    N_FILTER_BLOCK,
    // expressions
    E_LIT, E_NAME, E_ATTR, E_ITEM, E_SLICE, E_CALL, E_FILTER, E_TEST, E_NOT, E_NEG, E_POS,
    E_BIN, E_AND, E_OR, E_CMP, E_COND, E_LIST, E_DICT,
} jnode_kind;

typedef enum jop {
    OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_CONCAT,
    OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE, OP_IN, OP_NOTIN,
} jop;

struct jnode {
    uint8_t kind;
    uint8_t neg;          // E_TEST: `is not`; E_LIST: a tuple
    uint16_t height;      // expression nesting below this node (bounds the evaluator's recursion)
    int line, col;
    jval lit;             // E_LIT value
    jstr *name;           // E_NAME / E_ATTR / E_FILTER / E_TEST / N_MACRO / N_SET target name
    jnode *a, *b, *c;     // operands; N_SET: a = value, b = namespace object for `set ns.x`
    jnode **args;         // call/filter/test args, list items, dict k/v pairs, macro defaults
    jstr **kw;            // per-arg keyword name (NULL: positional)
    int nargs;
    uint8_t *ops;         // E_CMP: n-1... ops (one per args[i>0])
    jnode **body;         // statement bodies
    int nbody;
    jnode **alt;          // N_IF: the else branch (an elif is an N_IF inside it); N_FOR: else
    int nalt;
    jstr **targets;       // N_FOR targets / N_SET tuple targets / N_MACRO params
    int ntargets;
    jnode *filter;        // N_FOR: `if` condition; N_FILTER_BLOCK: filter chain
    bool recursive;
    bool captures;        // N_FOR: the body defines macros / call blocks, which keep its scope
};

typedef struct jtemplate_ast {
    jnode **body;
    int nbody;
} jtemplate_ast;

// Parses `src` (a template) into nodes allocated in `a`. On failure: an st_status whose
// message names `name`, the line and the column.
st_status jparse(jarena *a, const char *name, const char *src, size_t len, jtemplate_ast *out);
