// chat templates: the lexer and parser. Turns template text into a tree of jnodes with the
// whitespace rules Hugging Face renders with (trim_blocks, lstrip_blocks, `-` / `+` markers,
// one trailing newline dropped), following Jinja2's grammar and operator precedence.

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/chat_impl.h"

// Deepest nesting of expressions / blocks the parser accepts: a bound on its recursion.
#define MAX_PARSE_DEPTH 200
// Tallest expression tree (a chain like a ~ b ~ c ... or x|f|g... nests without recursing in
// the parser, but the evaluator recurses through it): a bound on the renderer's stack.
#define MAX_EXPR_HEIGHT 1000

typedef enum ttype {
    T_EOF, T_DATA, T_VAR_BEGIN, T_VAR_END, T_BLOCK_BEGIN, T_BLOCK_END, T_NAME, T_STRING, T_INT,
    T_FLOAT, T_OP,
} ttype;

typedef struct tok {
    ttype t;
    int line, col;
    jstr *s;      // T_DATA / T_NAME / T_STRING text; T_OP: the operator
    int64_t i;
    double f;
} tok;

typedef struct parser {
    jarena *a;
    const char *name;
    const char *src;
    size_t len;
    tok *toks;
    size_t ntok, cap;
    size_t pos;
    int depth;
    char err[512];
    bool failed;
    size_t lc_off; // line_col cache: tokens come in source order, so positions are found
    int lc_line, lc_col; // by walking on from the previous one
} parser;

static bool is_ws(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v' ||
           (c >= 0x1c && c <= 0x1f);
}

static void perr(parser *p, int line, int col, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void perr(parser *p, int line, int col, const char *fmt, ...) {
    if (p->failed) return;
    p->failed = true;
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(p->err, sizeof p->err, "%s:%d:%d: %s", p->name, line, col, msg);
}

// ---------------------------------------------------------------------------------------------
// Lexer

static void line_col_from(const char *src, size_t from, int l, int c, size_t off, int *line,
                          int *col) {
    for (size_t i = from; i < off; i++) {
        if (src[i] == '\n') l++, c = 1;
        else if (((unsigned char)src[i] & 0xC0) != 0x80) c++;
    }
    *line = l, *col = c;
}
static void line_col(const char *src, size_t off, int *line, int *col) {
    line_col_from(src, 0, 1, 1, off, line, col);
}

static tok *push_tok(parser *p, ttype t, size_t off) {
    if (p->ntok == p->cap) {
        size_t nc = p->cap ? p->cap * 2 : 256;
        tok *nt = realloc(p->toks, nc * sizeof *nt);
        if (!nt) {
            perr(p, 0, 0, "out of memory");
            return NULL;
        }
        p->toks = nt, p->cap = nc;
    }
    tok *k = &p->toks[p->ntok++];
    memset(k, 0, sizeof *k);
    k->t = t;
    if (off < p->lc_off || !p->lc_line) p->lc_off = 0, p->lc_line = 1, p->lc_col = 1;
    line_col_from(p->src, p->lc_off, p->lc_line, p->lc_col, off, &k->line, &k->col);
    p->lc_off = off, p->lc_line = k->line, p->lc_col = k->col;
    return k;
}

// Decodes a Python string literal body (the escapes Jinja's lexer understands) into the arena.
static jstr *unescape(parser *p, const char *s, size_t n, int line, int col) {
    char *buf = malloc(n + 1);
    if (!buf) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (c != '\\' || i + 1 >= n) {
            buf[o++] = c;
            continue;
        }
        char e = s[++i];
        switch (e) {
        case 'n': buf[o++] = '\n'; break;
        case 't': buf[o++] = '\t'; break;
        case 'r': buf[o++] = '\r'; break;
        case '0': case '1': case '2': case '3': case '4': case '5': case '6': case '7': {
            uint32_t cp = (uint32_t)(e - '0'); // octal: up to three digits, as Python reads them
            for (int k = 0; k < 2 && i + 1 < n && s[i + 1] >= '0' && s[i + 1] <= '7'; k++)
                cp = cp * 8 + (uint32_t)(s[++i] - '0');
            o += (size_t)st_utf8_encode(buf + o, cp);
            break;
        }
        case 'a': buf[o++] = '\a'; break;
        case 'b': buf[o++] = '\b'; break;
        case 'f': buf[o++] = '\f'; break;
        case 'v': buf[o++] = '\v'; break;
        case '\\': buf[o++] = '\\'; break;
        case '\'': buf[o++] = '\''; break;
        case '"': buf[o++] = '"'; break;
        case '\n': break; // line continuation
        case 'x': case 'u': case 'U': {
            int nd = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            uint32_t cp = 0;
            for (int k = 0; k < nd; k++) {
                char h = i + 1 + k < n ? s[i + 1 + k] : 0;
                int v = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
                      : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
                if (v < 0) {
                    free(buf);
                    perr(p, line, col, "bad \\%c escape in a string literal", e);
                    return NULL;
                }
                cp = cp * 16 + (uint32_t)v;
            }
            i += (size_t)nd;
            if (cp > 0x10FFFF) cp = 0xFFFD;
            // UTF-8 encode (our output is never longer than the escape that produced it)
            if (cp < 0x80) buf[o++] = (char)cp;
            else if (cp < 0x800) {
                buf[o++] = (char)(0xC0 | (cp >> 6));
                buf[o++] = (char)(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                buf[o++] = (char)(0xE0 | (cp >> 12));
                buf[o++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                buf[o++] = (char)(0x80 | (cp & 0x3F));
            } else {
                buf[o++] = (char)(0xF0 | (cp >> 18));
                buf[o++] = (char)(0x80 | ((cp >> 12) & 0x3F));
                buf[o++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                buf[o++] = (char)(0x80 | (cp & 0x3F));
            }
            break;
        }
        default: // Python keeps unknown escapes as they are
            buf[o++] = '\\';
            buf[o++] = e;
        }
    }
    jstr *r = js_new(p->a, buf, o);
    free(buf);
    return r;
}

static const char *const ops2[] = {"//", "**", "==", "!=", ">=", "<=", NULL};
static const char ops1[] = "+-/*%~[](){}><=.:|,;";

// Lexes the inside of a {{ }} or {% %} tag starting at *pi; returns after pushing the end token.
static bool lex_tag(parser *p, size_t *pi, bool is_block, bool *line_starting) {
    const char *s = p->src;
    size_t n = p->len, i = *pi;
    int balance = 0;
    for (;;) {
        // the end of the tag, when brackets are balanced
        if (balance == 0) {
            const char *end = is_block ? "%}" : "}}";
            if (s[i] == '-' && i + 2 < n && !strncmp(s + i + 1, end, 2)) {
                if (!push_tok(p, is_block ? T_BLOCK_END : T_VAR_END, i)) return false;
                i += 3;
                while (i < n && is_ws((unsigned char)s[i])) i++;
                *line_starting = i > 0 && s[i - 1] == '\n';
                *pi = i;
                return true;
            }
            if (is_block && i + 2 < n && s[i] == '+' && !strncmp(s + i + 1, end, 2)) {
                if (!push_tok(p, T_BLOCK_END, i)) return false;
                i += 3;
                *line_starting = false;
                *pi = i;
                return true;
            }
            if (i + 1 < n && !strncmp(s + i, end, 2)) {
                if (!push_tok(p, is_block ? T_BLOCK_END : T_VAR_END, i)) return false;
                i += 2;
                *line_starting = false;
                if (is_block && i < n && s[i] == '\n') i++, *line_starting = true; // trim_blocks
                *pi = i;
                return true;
            }
        }
        if (i >= n) {
            int l, c;
            line_col(s, i, &l, &c);
            perr(p, l, c, "unexpected end of template inside a %s tag", is_block ? "{% %}" : "{{ }}");
            return false;
        }
        unsigned char c = (unsigned char)s[i];
        if (is_ws(c)) {
            i++;
            continue;
        }
        size_t st = i;
        if (c >= '0' && c <= '9') {
            while (i < n && ((s[i] >= '0' && s[i] <= '9') || s[i] == '_')) i++;
            bool is_float = false;
            if (i + 1 < n && s[i] == '.' && s[i + 1] >= '0' && s[i + 1] <= '9') {
                is_float = true;
                i++;
                while (i < n && ((s[i] >= '0' && s[i] <= '9') || s[i] == '_')) i++;
            }
            if (i < n && (s[i] == 'e' || s[i] == 'E')) {
                size_t j = i + 1;
                if (j < n && (s[j] == '+' || s[j] == '-')) j++;
                if (j < n && s[j] >= '0' && s[j] <= '9') {
                    is_float = true;
                    i = j;
                    while (i < n && s[i] >= '0' && s[i] <= '9') i++;
                }
            }
            char num[64];
            size_t k = 0;
            for (size_t j = st; j < i && k < sizeof num - 1; j++)
                if (s[j] != '_') num[k++] = s[j];
            num[k] = 0;
            tok *t = push_tok(p, is_float ? T_FLOAT : T_INT, st);
            if (!t) return false;
            if (is_float) t->f = strtod(num, NULL);
            else {
                errno = 0;
                t->i = strtoll(num, NULL, 10);
                if (errno) {
                    perr(p, t->line, t->col, "integer literal %s is too large", num);
                    return false;
                }
            }
            continue;
        }
        if (c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80) {
            while (i < n && (s[i] == '_' || (s[i] >= 'a' && s[i] <= 'z') ||
                             (s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= '0' && s[i] <= '9') ||
                             (unsigned char)s[i] >= 0x80))
                i++;
            tok *t = push_tok(p, T_NAME, st);
            if (!t || !(t->s = js_new(p->a, s + st, i - st))) return false;
            continue;
        }
        if (c == '\'' || c == '"') {
            i++;
            while (i < n && s[i] != (char)c) {
                if (s[i] == '\\' && i + 1 < n) i++;
                i++;
            }
            tok *t = push_tok(p, T_STRING, st);
            if (!t) return false;
            if (i >= n) {
                perr(p, t->line, t->col, "unterminated string literal");
                return false;
            }
            if (!(t->s = unescape(p, s + st + 1, i - st - 1, t->line, t->col))) {
                if (!p->failed) perr(p, t->line, t->col, "out of memory");
                return false;
            }
            i++;
            continue;
        }
        size_t olen = 0;
        for (int k = 0; ops2[k]; k++)
            if (i + 1 < n && s[i] == ops2[k][0] && s[i + 1] == ops2[k][1]) olen = 2;
        if (!olen && strchr(ops1, (char)c) && c) olen = 1;
        if (!olen) {
            int l, cc;
            line_col(s, i, &l, &cc);
            perr(p, l, cc, "unexpected character '%c'", c);
            return false;
        }
        if (olen == 1) {
            if (c == '(' || c == '[' || c == '{') balance++;
            else if (c == ')' || c == ']' || c == '}') {
                if (balance == 0) {
                    int l, cc;
                    line_col(s, i, &l, &cc);
                    perr(p, l, cc, "unexpected '%c'", c);
                    return false;
                }
                balance--;
            }
        }
        tok *t = push_tok(p, T_OP, st);
        if (!t || !(t->s = js_new(p->a, s + st, olen))) return false;
        i += olen;
    }
}

// Splits the template into data and tags, applying the whitespace rules as Jinja's lexer does.
static bool lex(parser *p) {
    const char *s = p->src;
    size_t n = p->len, i = 0;
    bool line_starting = true;
    while (i < n) {
        // find the next tag start
        size_t j = i;
        int kind = 0; // 1 var, 2 block, 3 comment
        for (; j + 1 < n; j++) {
            if (s[j] != '{') continue;
            if (s[j + 1] == '{') kind = 1;
            else if (s[j + 1] == '%') kind = 2;
            else if (s[j + 1] == '#') kind = 3;
            if (kind) break;
        }
        if (!kind) j = n;
        char sign = kind && j + 2 < n && (s[j + 2] == '-' || s[j + 2] == '+') ? s[j + 2] : 0;
        size_t dend = j; // data is s[i, dend)
        if (kind) {
            if (sign == '-') {
                while (dend > i && is_ws((unsigned char)s[dend - 1])) dend--;
            } else if (sign != '+' && kind != 1) {
                // lstrip_blocks: drop spaces between the line start and the tag
                size_t l = dend;
                while (l > i && s[l - 1] != '\n') l--;
                bool at_line_start = l > i || (l == i && line_starting);
                if (at_line_start) {
                    bool all_ws = true;
                    for (size_t k = l; k < dend; k++)
                        if (!is_ws((unsigned char)s[k])) all_ws = false;
                    if (all_ws) dend = l;
                }
            }
        }
        if (dend > i) {
            tok *t = push_tok(p, T_DATA, i);
            if (!t || !(t->s = js_new(p->a, s + i, dend - i))) return false;
        }
        if (!kind) break;
        size_t k = j + 2 + (sign ? 1 : 0);
        if (kind == 3) {
            // comment: find the end, honouring -#} and +#}
            size_t e = k;
            for (; e + 1 < n; e++)
                if (s[e] == '#' && s[e + 1] == '}') break;
            if (e + 1 >= n) {
                int l, c;
                line_col(s, j, &l, &c);
                perr(p, l, c, "missing end of comment tag");
                return false;
            }
            char esign = e > k && (s[e - 1] == '-' || s[e - 1] == '+') ? s[e - 1] : 0;
            i = e + 2;
            line_starting = false;
            if (esign == '-') {
                while (i < n && is_ws((unsigned char)s[i])) i++;
                line_starting = i > 0 && s[i - 1] == '\n';
            } else if (esign != '+' && i < n && s[i] == '\n') {
                i++;
                line_starting = true;
            }
            continue;
        }
        // {% raw %} ... {% endraw %}
        if (kind == 2) {
            size_t q = k;
            while (q < n && is_ws((unsigned char)s[q])) q++;
            if (q + 3 <= n && !strncmp(s + q, "raw", 3) && (q + 3 == n || !(s[q + 3] == '_' ||
                (s[q + 3] >= 'a' && s[q + 3] <= 'z') || (s[q + 3] >= '0' && s[q + 3] <= '9')))) {
                q += 3;
                while (q < n && is_ws((unsigned char)s[q])) q++;
                bool rm = q < n && s[q] == '-';
                if (rm) q++;
                if (q + 1 >= n || s[q] != '%' || s[q + 1] != '}') goto not_raw;
                q += 2;
                if (rm) while (q < n && is_ws((unsigned char)s[q])) q++;
                else if (q < n && s[q] == '\n') q++;
                // find {%[-+]? endraw [-+]?%}
                for (size_t e = q; e + 1 < n; e++) {
                    if (s[e] != '{' || s[e + 1] != '%') continue;
                    size_t r = e + 2;
                    char bs = r < n && (s[r] == '-' || s[r] == '+') ? s[r] : 0;
                    if (bs) r++;
                    while (r < n && is_ws((unsigned char)s[r])) r++;
                    if (r + 6 > n || strncmp(s + r, "endraw", 6)) continue;
                    r += 6;
                    while (r < n && is_ws((unsigned char)s[r])) r++;
                    char es = r < n && (s[r] == '-' || s[r] == '+') ? s[r] : 0;
                    if (es) r++;
                    if (r + 1 >= n || s[r] != '%' || s[r + 1] != '}') continue;
                    size_t de = e;
                    if (bs == '-') while (de > q && is_ws((unsigned char)s[de - 1])) de--;
                    if (de > q) {
                        tok *t = push_tok(p, T_DATA, q);
                        if (!t || !(t->s = js_new(p->a, s + q, de - q))) return false;
                    }
                    i = r + 2;
                    line_starting = false;
                    if (es == '-') {
                        while (i < n && is_ws((unsigned char)s[i])) i++;
                        line_starting = i > 0 && s[i - 1] == '\n';
                    } else if (es != '+' && i < n && s[i] == '\n') i++, line_starting = true;
                    goto next;
                }
                int l, c;
                line_col(s, j, &l, &c);
                perr(p, l, c, "missing {%% endraw %%} for this raw block");
                return false;
            }
        }
    not_raw:
        if (!push_tok(p, kind == 1 ? T_VAR_BEGIN : T_BLOCK_BEGIN, j)) return false;
        i = k;
        if (!lex_tag(p, &i, kind == 2, &line_starting)) return false;
    next:;
    }
    return push_tok(p, T_EOF, n) != NULL;
}

// ---------------------------------------------------------------------------------------------
// Parser helpers

static tok *cur(parser *p) { return &p->toks[p->pos]; }
static tok *peek(parser *p, int k) {
    size_t q = p->pos + (size_t)k;
    return &p->toks[q < p->ntok ? q : p->ntok - 1];
}
static void adv(parser *p) {
    if (p->pos + 1 < p->ntok) p->pos++;
}
static bool is_op(tok *t, const char *op) { return t->t == T_OP && !strcmp(t->s->s, op); }
static bool is_name(tok *t, const char *nm) { return t->t == T_NAME && !strcmp(t->s->s, nm); }

static const char *tok_desc(tok *t) {
    switch (t->t) {
    case T_EOF: return "end of template";
    case T_DATA: return "template data";
    case T_VAR_BEGIN: return "'{{'";
    case T_VAR_END: return "'}}'";
    case T_BLOCK_BEGIN: return "'{%'";
    case T_BLOCK_END: return "'%}'";
    case T_NAME: case T_OP: return t->s->s;
    case T_STRING: return "a string";
    case T_INT: case T_FLOAT: return "a number";
    }
    return "?";
}

static bool expect_op(parser *p, const char *op) {
    tok *t = cur(p);
    if (!is_op(t, op)) {
        perr(p, t->line, t->col, "expected '%s', got '%s'", op, tok_desc(t));
        return false;
    }
    adv(p);
    return true;
}

static jnode *node(parser *p, int kind, tok *at) {
    jnode *n = ja_alloc(p->a, sizeof *n);
    if (!n) {
        perr(p, at->line, at->col, "template too large (parser memory limit)");
        return NULL;
    }
    n->kind = (uint8_t)kind;
    n->line = at->line, n->col = at->col;
    return n;
}

// A small growable array of node pointers, copied into the arena when done.
typedef struct nvec {
    jnode **v;
    jstr **kw;
    int n, cap;
} nvec;
static bool nv_push(parser *p, nvec *v, jnode *x, jstr *kw) {
    if (v->n == v->cap) {
        int nc = v->cap ? v->cap * 2 : 8;
        jnode **nv = ja_alloc(p->a, (size_t)nc * sizeof *nv);
        jstr **nk = ja_alloc(p->a, (size_t)nc * sizeof *nk);
        if (!nv || !nk) {
            perr(p, 0, 0, "template too large (parser memory limit)");
            return false;
        }
        if (v->n) {
            memcpy(nv, v->v, (size_t)v->n * sizeof *nv);
            memcpy(nk, v->kw, (size_t)v->n * sizeof *nk);
        }
        v->v = nv, v->kw = nk, v->cap = nc;
    }
    v->kw[v->n] = kw;
    v->v[v->n++] = x;
    return true;
}

// Records that `x` sits above `child`; fails when the tree grows taller than MAX_EXPR_HEIGHT.
static bool above(parser *p, jnode *x, const jnode *child) {
    if (!x || !child) return x != NULL;
    if (child->height + 1 > x->height) x->height = (uint16_t)(child->height + 1);
    if (x->height > MAX_EXPR_HEIGHT) {
        perr(p, x->line, x->col, "expression nested deeper than %d levels", MAX_EXPR_HEIGHT);
        return false;
    }
    return true;
}

static jnode *parse_expr(parser *p);
static jnode *parse_or(parser *p);
static jnode *parse_unary(parser *p, bool with_filter);
static jnode *parse_primary(parser *p);

static bool enter(parser *p) {
    if (++p->depth > MAX_PARSE_DEPTH) {
        tok *t = cur(p);
        perr(p, t->line, t->col, "expression nested deeper than %d levels", MAX_PARSE_DEPTH);
        return false;
    }
    return true;
}

// Arguments of a call, filter or test: positional and keyword, up to ')'.
static bool parse_args(parser *p, jnode *n) {
    nvec v = {0};
    if (!expect_op(p, "(")) return false;
    while (!is_op(cur(p), ")")) {
        if (v.n && !expect_op(p, ",")) return false;
        if (is_op(cur(p), ")")) break; // trailing comma
        jstr *kw = NULL;
        if (cur(p)->t == T_NAME && is_op(peek(p, 1), "=")) {
            kw = cur(p)->s;
            adv(p), adv(p);
        } else if (is_op(cur(p), "*") || is_op(cur(p), "**")) {
            perr(p, cur(p)->line, cur(p)->col, "*args / **kwargs in calls are not supported");
            return false;
        }
        jnode *e = parse_expr(p);
        if (!e || !nv_push(p, &v, e, kw) || !above(p, n, e)) return false;
    }
    adv(p);
    n->args = v.v, n->kw = v.kw, n->nargs = v.n;
    return true;
}

static jnode *parse_postfix(parser *p, jnode *e) {
    for (;;) {
        tok *t = cur(p);
        if (is_op(t, ".")) {
            adv(p);
            tok *nm = cur(p);
            jnode *x = node(p, E_ATTR, nm);
            if (!x) return NULL;
            if (nm->t == T_NAME) x->name = nm->s;
            else if (nm->t == T_INT) {
                x->kind = E_ITEM;
                x->b = node(p, E_LIT, nm);
                if (!x->b) return NULL;
                x->b->lit = jv_int(nm->i);
            } else {
                perr(p, nm->line, nm->col, "expected an attribute name after '.', got '%s'", tok_desc(nm));
                return NULL;
            }
            adv(p);
            x->a = e;
            if (!above(p, x, e)) return NULL;
            e = x;
        } else if (is_op(t, "[")) {
            adv(p);
            // a subscript or a slice a:b:c
            jnode *parts[3] = {NULL, NULL, NULL};
            int np = 0;
            bool slice = false;
            for (;;) {
                if (is_op(cur(p), ":")) {
                    slice = true;
                    if (np >= 2) {
                        perr(p, cur(p)->line, cur(p)->col, "too many ':' in a slice");
                        return NULL;
                    }
                    np++;
                    adv(p);
                    continue;
                }
                if (is_op(cur(p), "]")) break;
                jnode *x = parse_expr(p);
                if (!x) return NULL;
                if (!slice && np == 0 && is_op(cur(p), ",")) { // x[a, b] subscripts with a tuple
                    nvec tv = {0};
                    if (!nv_push(p, &tv, x, NULL)) return NULL;
                    while (is_op(cur(p), ",")) {
                        adv(p);
                        if (is_op(cur(p), "]")) break;
                        jnode *y = parse_expr(p);
                        if (!y || !nv_push(p, &tv, y, NULL)) return NULL;
                    }
                    jnode *tup = node(p, E_LIST, t);
                    if (!tup) return NULL;
                    tup->args = tv.v, tup->nargs = tv.n, tup->neg = 1;
                    for (int k = 0; k < tv.n; k++)
                        if (!above(p, tup, tv.v[k])) return NULL;
                    x = tup;
                }
                parts[np] = x;
                if (!is_op(cur(p), ":") && !is_op(cur(p), "]")) {
                    perr(p, cur(p)->line, cur(p)->col, "expected ']' or ':', got '%s'", tok_desc(cur(p)));
                    return NULL;
                }
            }
            adv(p);
            jnode *x = node(p, slice ? E_SLICE : E_ITEM, t);
            if (!x) return NULL;
            x->a = e;
            if (!above(p, x, e)) return NULL;
            for (int k = 0; k < 3; k++)
                if (!above(p, x, parts[k])) return NULL;
            if (slice) {
                x->args = ja_alloc(p->a, 3 * sizeof *x->args);
                if (!x->args) return NULL;
                memcpy(x->args, parts, sizeof parts);
                x->nargs = 3;
            } else {
                if (!parts[0]) {
                    perr(p, t->line, t->col, "empty subscript");
                    return NULL;
                }
                x->b = parts[0];
            }
            e = x;
        } else if (is_op(t, "(")) {
            jnode *x = node(p, E_CALL, t);
            if (!x) return NULL;
            x->a = e;
            if (!above(p, x, e)) return NULL;
            x->line = e->line, x->col = e->col; // errors point at what is called
            if (!parse_args(p, x)) return NULL;
            e = x;
        } else {
            return e;
        }
    }
}

static jnode *parse_filter_expr(parser *p, jnode *e) {
    for (;;) {
        tok *t = cur(p);
        if (is_op(t, "|")) {
            adv(p);
            tok *nm = cur(p);
            if (nm->t != T_NAME) {
                perr(p, nm->line, nm->col, "expected a filter name after '|', got '%s'", tok_desc(nm));
                return NULL;
            }
            jnode *x = node(p, E_FILTER, nm);
            if (!x) return NULL;
            x->name = nm->s;
            x->a = e;
            if (!above(p, x, e)) return NULL;
            adv(p);
            if (is_op(cur(p), "(") && !parse_args(p, x)) return NULL;
            e = x;
        } else if (is_name(t, "is")) {
            adv(p);
            jnode *x = node(p, E_TEST, t);
            if (!x) return NULL;
            if (is_name(cur(p), "not")) {
                x->neg = 1;
                adv(p);
            }
            tok *nm = cur(p);
            if (nm->t != T_NAME) {
                perr(p, nm->line, nm->col, "expected a test name after 'is', got '%s'", tok_desc(nm));
                return NULL;
            }
            x->name = nm->s;
            x->a = e;
            if (!above(p, x, e)) return NULL;
            adv(p);
            tok *n2 = cur(p);
            if (is_op(n2, "(")) {
                if (!parse_args(p, x)) return NULL;
            } else if ((n2->t == T_NAME || n2->t == T_STRING || n2->t == T_INT || n2->t == T_FLOAT ||
                        is_op(n2, "[") || is_op(n2, "{")) &&
                       !is_name(n2, "else") && !is_name(n2, "or") && !is_name(n2, "and")) {
                if (is_name(n2, "is")) {
                    perr(p, n2->line, n2->col, "unexpected 'is'");
                    return NULL;
                }
                // one argument without parentheses: `is divisibleby 3`, `is sameas none`
                jnode *arg = parse_primary(p);
                if (!arg || !(arg = parse_postfix(p, arg))) return NULL;
                x->args = ja_alloc(p->a, sizeof *x->args);
                x->kw = ja_alloc(p->a, sizeof *x->kw);
                if (!x->args || !x->kw) return NULL;
                x->args[0] = arg;
                x->nargs = 1;
            }
            e = x;
        } else if (is_op(t, "(")) {
            jnode *x = node(p, E_CALL, t);
            if (!x) return NULL;
            x->a = e;
            if (!above(p, x, e)) return NULL;
            x->line = e->line, x->col = e->col; // errors point at what is called
            if (!parse_args(p, x)) return NULL;
            e = x;
        } else {
            return e;
        }
    }
}

static jnode *parse_primary(parser *p) {
    tok *t = cur(p);
    if (!enter(p)) return NULL;
    jnode *e = NULL;
    if (t->t == T_NAME) {
        const char *s = t->s->s;
        e = node(p, E_LIT, t);
        if (!e) return NULL;
        if (!strcmp(s, "true") || !strcmp(s, "True")) e->lit = jv_bool(true);
        else if (!strcmp(s, "false") || !strcmp(s, "False")) e->lit = jv_bool(false);
        else if (!strcmp(s, "none") || !strcmp(s, "None")) e->lit = jv_none();
        else {
            e->kind = E_NAME;
            e->name = t->s;
        }
        adv(p);
    } else if (t->t == T_STRING) {
        // adjacent string literals concatenate
        jstr *s = t->s;
        adv(p);
        while (cur(p)->t == T_STRING) {
            jstr *s2 = cur(p)->s;
            jstr *c = ja_alloc(p->a, sizeof *c + s->len + s2->len + 1);
            if (!c) return NULL;
            c->len = s->len + s2->len;
            memcpy(c->s, s->s, s->len);
            memcpy(c->s + s->len, s2->s, s2->len);
            s = c;
            adv(p);
        }
        e = node(p, E_LIT, t);
        if (!e) return NULL;
        e->lit = jv_strp(s);
    } else if (t->t == T_INT || t->t == T_FLOAT) {
        e = node(p, E_LIT, t);
        if (!e) return NULL;
        e->lit = t->t == T_INT ? jv_int(t->i) : jv_float(t->f);
        adv(p);
    } else if (is_op(t, "(")) {
        adv(p);
        if (is_op(cur(p), ")")) { // empty tuple
            adv(p);
            e = node(p, E_LIST, t);
            if (!e) return NULL;
            e->neg = 1;
        } else {
            jnode *x = parse_expr(p);
            if (!x) return NULL;
            if (is_op(cur(p), ",")) { // a tuple
                nvec v = {0};
                if (!nv_push(p, &v, x, NULL)) return NULL;
                while (is_op(cur(p), ",")) {
                    adv(p);
                    if (is_op(cur(p), ")")) break;
                    jnode *y = parse_expr(p);
                    if (!y || !nv_push(p, &v, y, NULL)) return NULL;
                }
                e = node(p, E_LIST, t);
                if (!e) return NULL;
                e->args = v.v, e->nargs = v.n;
                for (int k = 0; k < v.n; k++)
                    if (!above(p, e, v.v[k])) return NULL;
                e->neg = 1; // a tuple
            } else {
                e = x;
            }
            if (!expect_op(p, ")")) return NULL;
        }
    } else if (is_op(t, "[")) {
        adv(p);
        nvec v = {0};
        while (!is_op(cur(p), "]")) {
            if (v.n && !expect_op(p, ",")) return NULL;
            if (is_op(cur(p), "]")) break;
            jnode *y = parse_expr(p);
            if (!y || !nv_push(p, &v, y, NULL)) return NULL;
        }
        adv(p);
        e = node(p, E_LIST, t);
        if (!e) return NULL;
        e->args = v.v, e->nargs = v.n;
        for (int k = 0; k < v.n; k++)
            if (!above(p, e, v.v[k])) return NULL;
    } else if (is_op(t, "{")) {
        adv(p);
        nvec v = {0};
        while (!is_op(cur(p), "}")) {
            if (v.n && !expect_op(p, ",")) return NULL;
            if (is_op(cur(p), "}")) break;
            jnode *k = parse_expr(p);
            if (!k || !expect_op(p, ":")) return NULL;
            jnode *y = parse_expr(p);
            if (!y || !nv_push(p, &v, k, NULL) || !nv_push(p, &v, y, NULL)) return NULL;
        }
        adv(p);
        e = node(p, E_DICT, t);
        if (!e) return NULL;
        e->args = v.v, e->nargs = v.n;
        for (int k = 0; k < v.n; k++)
            if (!above(p, e, v.v[k])) return NULL;
    } else {
        perr(p, t->line, t->col, "unexpected '%s'", tok_desc(t));
        return NULL;
    }
    p->depth--;
    return e;
}

static jnode *parse_unary(parser *p, bool with_filter) {
    tok *t = cur(p);
    jnode *e;
    if (!enter(p)) return NULL;
    if (is_op(t, "-") || is_op(t, "+")) {
        adv(p);
        jnode *x = parse_unary(p, false);
        if (!x) return NULL;
        e = node(p, is_op(t, "-") ? E_NEG : E_POS, t);
        if (!e) return NULL;
        e->a = x;
        if (!above(p, e, x)) return NULL;
    } else {
        e = parse_primary(p);
    }
    if (!e || !(e = parse_postfix(p, e))) return NULL;
    if (with_filter && !(e = parse_filter_expr(p, e))) return NULL;
    p->depth--;
    return e;
}

static jnode *binop(parser *p, tok *t, int op, jnode *a, jnode *b) {
    jnode *e = node(p, E_BIN, t);
    if (!e) return NULL;
    e->ops = ja_alloc(p->a, 1);
    if (!e->ops) return NULL;
    e->ops[0] = (uint8_t)op;
    e->a = a, e->b = b;
    if (!above(p, e, a) || !above(p, e, b)) return NULL;
    return e;
}

static jnode *parse_pow(parser *p) {
    jnode *e = parse_unary(p, true);
    while (e && is_op(cur(p), "**")) {
        tok *t = cur(p);
        adv(p);
        jnode *r = parse_unary(p, true);
        if (!r) return NULL;
        e = binop(p, t, OP_POW, e, r);
    }
    return e;
}

static jnode *parse_math2(parser *p) {
    jnode *e = parse_pow(p);
    for (;;) {
        if (!e) return NULL;
        tok *t = cur(p);
        int op = is_op(t, "*") ? OP_MUL : is_op(t, "/") ? OP_DIV : is_op(t, "//") ? OP_FLOORDIV
               : is_op(t, "%") ? OP_MOD : -1;
        if (op < 0) return e;
        adv(p);
        jnode *r = parse_pow(p);
        if (!r) return NULL;
        e = binop(p, t, op, e, r);
    }
}

static jnode *parse_concat(parser *p) {
    jnode *e = parse_math2(p);
    while (e && is_op(cur(p), "~")) {
        tok *t = cur(p);
        adv(p);
        jnode *r = parse_math2(p);
        if (!r) return NULL;
        e = binop(p, t, OP_CONCAT, e, r);
    }
    return e;
}

static jnode *parse_math1(parser *p) {
    jnode *e = parse_concat(p);
    for (;;) {
        if (!e) return NULL;
        tok *t = cur(p);
        int op = is_op(t, "+") ? OP_ADD : is_op(t, "-") ? OP_SUB : -1;
        if (op < 0) return e;
        adv(p);
        jnode *r = parse_concat(p);
        if (!r) return NULL;
        e = binop(p, t, op, e, r);
    }
}

static jnode *parse_compare(parser *p) {
    tok *t0 = cur(p);
    jnode *e = parse_math1(p);
    if (!e) return NULL;
    nvec v = {0};
    uint8_t ops[64];
    for (;;) {
        tok *t = cur(p);
        int op = -1;
        if (is_op(t, "==")) op = OP_EQ;
        else if (is_op(t, "!=")) op = OP_NE;
        else if (is_op(t, "<")) op = OP_LT;
        else if (is_op(t, "<=")) op = OP_LE;
        else if (is_op(t, ">")) op = OP_GT;
        else if (is_op(t, ">=")) op = OP_GE;
        else if (is_name(t, "in")) op = OP_IN;
        else if (is_name(t, "not") && is_name(peek(p, 1), "in")) {
            op = OP_NOTIN;
            adv(p);
        }
        if (op < 0) break;
        adv(p);
        if (v.n >= 63) {
            perr(p, t->line, t->col, "too many chained comparisons");
            return NULL;
        }
        if (!v.n && !nv_push(p, &v, e, NULL)) return NULL;
        jnode *r = parse_math1(p);
        if (!r || !nv_push(p, &v, r, NULL)) return NULL;
        ops[v.n - 2] = (uint8_t)op;
    }
    if (!v.n) return e;
    jnode *c = node(p, E_CMP, t0);
    if (!c) return NULL;
    c->args = v.v, c->nargs = v.n;
    for (int i = 0; i < v.n; i++)
        if (!above(p, c, v.v[i])) return NULL;
    c->ops = ja_alloc(p->a, (size_t)v.n);
    if (!c->ops) return NULL;
    memcpy(c->ops, ops, (size_t)v.n);
    return c;
}

static jnode *parse_not(parser *p) {
    tok *t = cur(p);
    if (is_name(t, "not")) {
        if (!enter(p)) return NULL;
        adv(p);
        jnode *x = parse_not(p);
        if (!x) return NULL;
        jnode *e = node(p, E_NOT, t);
        if (!e) return NULL;
        e->a = x;
        if (!above(p, e, x)) return NULL;
        p->depth--;
        return e;
    }
    return parse_compare(p);
}

static jnode *parse_and(parser *p) {
    jnode *e = parse_not(p);
    while (e && is_name(cur(p), "and")) {
        tok *t = cur(p);
        adv(p);
        jnode *r = parse_not(p);
        if (!r) return NULL;
        jnode *x = node(p, E_AND, t);
        if (!x) return NULL;
        x->a = e, x->b = r;
        if (!above(p, x, e) || !above(p, x, r)) return NULL;
        e = x;
    }
    return e;
}

static jnode *parse_or(parser *p) {
    jnode *e = parse_and(p);
    while (e && is_name(cur(p), "or")) {
        tok *t = cur(p);
        adv(p);
        jnode *r = parse_and(p);
        if (!r) return NULL;
        jnode *x = node(p, E_OR, t);
        if (!x) return NULL;
        x->a = e, x->b = r;
        if (!above(p, x, e) || !above(p, x, r)) return NULL;
        e = x;
    }
    return e;
}

// expr: or-expression with optional `a if cond else b` (Jinja's conditional expression)
static jnode *parse_expr(parser *p) {
    if (!enter(p)) return NULL;
    jnode *e = parse_or(p);
    while (e && is_name(cur(p), "if")) {
        tok *t = cur(p);
        adv(p);
        jnode *cond = parse_or(p);
        if (!cond) return NULL;
        jnode *x = node(p, E_COND, t);
        if (!x) return NULL;
        x->a = cond, x->b = e;
        if (!above(p, x, e) || !above(p, x, cond)) return NULL;
        if (is_name(cur(p), "else")) {
            adv(p);
            x->c = parse_expr(p);
            if (!x->c || !above(p, x, x->c)) return NULL;
        }
        e = x;
    }
    p->depth--;
    return e;
}

// A tuple without parentheses (`a, b`) is allowed where Jinja allows it: set values, for iterables.
static jnode *parse_tuple_expr(parser *p) {
    tok *t = cur(p);
    jnode *e = parse_expr(p);
    if (!e || !is_op(cur(p), ",")) return e;
    nvec v = {0};
    if (!nv_push(p, &v, e, NULL)) return NULL;
    while (is_op(cur(p), ",")) {
        adv(p);
        if (cur(p)->t == T_BLOCK_END || cur(p)->t == T_VAR_END || is_name(cur(p), "in") || is_op(cur(p), "=")) break;
        jnode *y = parse_expr(p);
        if (!y || !nv_push(p, &v, y, NULL)) return NULL;
    }
    jnode *l = node(p, E_LIST, t);
    if (!l) return NULL;
    l->args = v.v, l->nargs = v.n;
    l->neg = 1; // a tuple
    return l;
}

// ---------------------------------------------------------------------------------------------
// Statements

static bool parse_body(parser *p, const char *const *ends, jnode ***body, int *nbody);

static bool expect_block_end(parser *p) {
    tok *t = cur(p);
    if (t->t != T_BLOCK_END) {
        perr(p, t->line, t->col, "expected end of statement '%%}', got '%s'", tok_desc(t));
        return false;
    }
    adv(p);
    return true;
}

// The end of a statement that opens a body; Jinja allows a Python-like ':' before the '%}'.
static bool expect_body_start(parser *p) {
    if (is_op(cur(p), ":")) adv(p);
    return expect_block_end(p);
}

// Parses target names: `a` or `a, b` (for loops, set).
static bool parse_targets(parser *p, jnode *n) {
    jstr *names[16];
    int k = 0;
    bool paren = is_op(cur(p), "(");
    if (paren) adv(p);
    for (;;) {
        tok *t = cur(p);
        if (t->t != T_NAME) {
            perr(p, t->line, t->col, "expected a variable name, got '%s'", tok_desc(t));
            return false;
        }
        if (k == 16) {
            perr(p, t->line, t->col, "too many targets");
            return false;
        }
        names[k++] = t->s;
        adv(p);
        if (!is_op(cur(p), ",")) break;
        adv(p);
    }
    if (paren && !expect_op(p, ")")) return false;
    n->targets = ja_alloc(p->a, (size_t)k * sizeof *n->targets);
    if (!n->targets) return false;
    memcpy(n->targets, names, (size_t)k * sizeof *names);
    n->ntargets = k;
    return true;
}

static jnode *parse_if(parser *p, tok *t) {
    jnode *n = node(p, N_IF, t);
    if (!n || !(n->a = parse_tuple_expr(p)) || !expect_body_start(p)) return NULL;
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    if (!parse_body(p, ends, &n->body, &n->nbody)) return NULL;
    tok *e = cur(p);
    adv(p);
    if (!strcmp(e->s->s, "elif")) {
        jnode *x = parse_if(p, e);
        if (!x) return NULL;
        n->alt = ja_alloc(p->a, sizeof *n->alt);
        if (!n->alt) return NULL;
        n->alt[0] = x;
        n->nalt = 1;
        return n;
    }
    if (!strcmp(e->s->s, "else")) {
        static const char *const ends2[] = {"endif", NULL};
        if (!expect_body_start(p) || !parse_body(p, ends2, &n->alt, &n->nalt)) return NULL;
        adv(p);
    }
    return expect_block_end(p) ? n : NULL;
}

// Whether statements define a macro or call block (whose closure keeps the enclosing scope alive).
static bool has_capture(jnode *const *body, int n) {
    for (int i = 0; i < n; i++) {
        const jnode *s = body[i];
        if (s->kind == N_MACRO || s->kind == N_CALLBLOCK) return true;
        if (has_capture(s->body, s->nbody) || has_capture(s->alt, s->nalt)) return true;
    }
    return false;
}

static jnode *parse_for(parser *p, tok *t) {
    jnode *n = node(p, N_FOR, t);
    if (!n || !parse_targets(p, n)) return NULL;
    if (!is_name(cur(p), "in")) {
        perr(p, cur(p)->line, cur(p)->col, "expected 'in' in the for loop, got '%s'", tok_desc(cur(p)));
        return NULL;
    }
    adv(p);
    // the iterable stops before `if` (a loop filter) and `recursive`; `a, b` is a tuple
    if (!(n->a = parse_or(p))) return NULL;
    if (is_op(cur(p), ",")) {
        nvec tv = {0};
        if (!nv_push(p, &tv, n->a, NULL)) return NULL;
        while (is_op(cur(p), ",")) {
            adv(p);
            if (cur(p)->t == T_BLOCK_END || is_name(cur(p), "if") || is_name(cur(p), "recursive")) break;
            jnode *y = parse_or(p);
            if (!y || !nv_push(p, &tv, y, NULL)) return NULL;
        }
        jnode *tup = node(p, E_LIST, t);
        if (!tup) return NULL;
        tup->args = tv.v, tup->nargs = tv.n, tup->neg = 1;
        for (int k = 0; k < tv.n; k++)
            if (!above(p, tup, tv.v[k])) return NULL;
        n->a = tup;
    }
    if (is_name(cur(p), "if")) {
        adv(p);
        if (!(n->filter = parse_expr(p))) return NULL;
    }
    if (is_name(cur(p), "recursive")) {
        n->recursive = true;
        adv(p);
    }
    if (!expect_body_start(p)) return NULL;
    static const char *const ends[] = {"else", "endfor", NULL};
    if (!parse_body(p, ends, &n->body, &n->nbody)) return NULL;
    n->captures = has_capture(n->body, n->nbody);
    tok *e = cur(p);
    adv(p);
    if (!strcmp(e->s->s, "else")) {
        static const char *const ends2[] = {"endfor", NULL};
        if (!expect_body_start(p) || !parse_body(p, ends2, &n->alt, &n->nalt)) return NULL;
        adv(p);
    }
    return expect_block_end(p) ? n : NULL;
}

static jnode *parse_set(parser *p, tok *t) {
    jnode *n = node(p, N_SET, t);
    if (!n) return NULL;
    tok *nm = cur(p);
    if (nm->t != T_NAME) {
        perr(p, nm->line, nm->col, "expected a variable name after 'set', got '%s'", tok_desc(nm));
        return NULL;
    }
    if (is_op(peek(p, 1), ".")) { // set ns.attr = value
        tok *at = peek(p, 2);
        if (at->t != T_NAME) {
            perr(p, at->line, at->col, "expected an attribute name");
            return NULL;
        }
        n->b = node(p, E_NAME, nm);
        if (!n->b) return NULL;
        n->b->name = nm->s;
        n->name = at->s;
        adv(p), adv(p), adv(p);
    } else if (!parse_targets(p, n)) {
        return NULL;
    }
    if (cur(p)->t == T_BLOCK_END || is_op(cur(p), "|")) { // block set: {% set x %}...{% endset %}
        if (n->b || n->ntargets != 1) {
            perr(p, nm->line, nm->col, "a block set takes one variable name");
            return NULL;
        }
        n->kind = N_SET_BLOCK;
        jnode *f = node(p, E_NAME, nm); // placeholder the filters apply to
        if (!f) return NULL;
        if (is_op(cur(p), "|") && !(n->filter = parse_filter_expr(p, f))) return NULL;
        if (!expect_body_start(p)) return NULL;
        static const char *const ends[] = {"endset", NULL};
        if (!parse_body(p, ends, &n->body, &n->nbody)) return NULL;
        adv(p);
        return expect_block_end(p) ? n : NULL;
    }
    if (!expect_op(p, "=")) return NULL;
    if (!(n->a = parse_tuple_expr(p))) return NULL;
    return expect_block_end(p) ? n : NULL;
}

// Parameters of a macro or call block: (a, b=default, ...).
static bool parse_params(parser *p, jnode *n) {
    nvec names = {0};
    jstr *nm[64];
    int k = 0;
    if (!is_op(cur(p), "(")) return true;
    adv(p);
    while (!is_op(cur(p), ")")) {
        if (k && !expect_op(p, ",")) return false;
        tok *t = cur(p);
        if (t->t != T_NAME) {
            perr(p, t->line, t->col, "expected a parameter name, got '%s'", tok_desc(t));
            return false;
        }
        if (k == 64) {
            perr(p, t->line, t->col, "too many parameters");
            return false;
        }
        nm[k++] = t->s;
        adv(p);
        jnode *def = NULL;
        if (is_op(cur(p), "=")) {
            adv(p);
            if (!(def = parse_expr(p))) return false;
        }
        if (!nv_push(p, &names, def, NULL)) return false;
    }
    adv(p);
    n->targets = ja_alloc(p->a, (size_t)(k ? k : 1) * sizeof *n->targets);
    if (!n->targets) return false;
    memcpy(n->targets, nm, (size_t)k * sizeof *nm);
    n->ntargets = k;
    n->args = names.v; // defaults (NULL where none)
    n->nargs = names.n;
    return true;
}

static jnode *parse_macro(parser *p, tok *t) {
    jnode *n = node(p, N_MACRO, t);
    tok *nm = cur(p);
    if (!n) return NULL;
    if (nm->t != T_NAME) {
        perr(p, nm->line, nm->col, "expected a macro name, got '%s'", tok_desc(nm));
        return NULL;
    }
    n->name = nm->s;
    adv(p);
    if (!parse_params(p, n) || !expect_body_start(p)) return NULL;
    static const char *const ends[] = {"endmacro", NULL};
    if (!parse_body(p, ends, &n->body, &n->nbody)) return NULL;
    adv(p);
    if (cur(p)->t == T_NAME) adv(p); // {% endmacro name %}
    return expect_block_end(p) ? n : NULL;
}

static jnode *parse_call_block(parser *p, tok *t) {
    jnode *n = node(p, N_CALLBLOCK, t);
    if (!n) return NULL;
    if (is_op(cur(p), "(") && !parse_params(p, n)) return NULL;
    if (!(n->a = parse_expr(p))) return NULL;
    if (n->a->kind != E_CALL) {
        perr(p, t->line, t->col, "expected a macro call after 'call'");
        return NULL;
    }
    if (!expect_body_start(p)) return NULL;
    static const char *const ends[] = {"endcall", NULL};
    if (!parse_body(p, ends, &n->body, &n->nbody)) return NULL;
    adv(p);
    return expect_block_end(p) ? n : NULL;
}

static jnode *parse_filter_block(parser *p, tok *t) {
    jnode *n = node(p, N_FILTER_BLOCK, t);
    if (!n) return NULL;
    jnode *f = node(p, E_NAME, t);
    if (!f) return NULL;
    // reuse the filter grammar: pretend a '|' precedes the first name
    tok *nm = cur(p);
    if (nm->t != T_NAME) {
        perr(p, nm->line, nm->col, "expected a filter name");
        return NULL;
    }
    jnode *x = node(p, E_FILTER, nm);
    if (!x) return NULL;
    x->name = nm->s;
    x->a = f;
    adv(p);
    if (is_op(cur(p), "(") && !parse_args(p, x)) return NULL;
    if (!(n->filter = parse_filter_expr(p, x)) || !expect_body_start(p)) return NULL;
    static const char *const ends[] = {"endfilter", NULL};
    if (!parse_body(p, ends, &n->body, &n->nbody)) return NULL;
    adv(p);
    return expect_block_end(p) ? n : NULL;
}

static jnode *parse_statement(parser *p) {
    tok *b = cur(p); // T_BLOCK_BEGIN
    adv(p);
    tok *t = cur(p);
    if (t->t != T_NAME) {
        perr(p, t->line, t->col, "expected a statement name, got '%s'", tok_desc(t));
        return NULL;
    }
    const char *s = t->s->s;
    (void)b;
    adv(p);
    if (!strcmp(s, "if")) return parse_if(p, t);
    if (!strcmp(s, "for")) return parse_for(p, t);
    if (!strcmp(s, "set")) return parse_set(p, t);
    if (!strcmp(s, "macro")) return parse_macro(p, t);
    if (!strcmp(s, "call")) return parse_call_block(p, t);
    if (!strcmp(s, "filter")) return parse_filter_block(p, t);
    if (!strcmp(s, "break") || !strcmp(s, "continue")) {
        jnode *n = node(p, !strcmp(s, "break") ? N_BREAK : N_CONTINUE, t);
        return n && expect_block_end(p) ? n : NULL;
    }
    if (!strcmp(s, "generation")) { // transformers' AssistantTracker: renders its body as is
        jnode *n = node(p, N_BLOCK, t);
        static const char *const ends[] = {"endgeneration", NULL};
        if (!n || !expect_body_start(p) || !parse_body(p, ends, &n->body, &n->nbody)) return NULL;
        adv(p);
        return expect_block_end(p) ? n : NULL;
    }
    if (!strcmp(s, "include") || !strcmp(s, "import") || !strcmp(s, "from") ||
        !strcmp(s, "extends") || !strcmp(s, "block") || !strcmp(s, "do") || !strcmp(s, "with") ||
        !strcmp(s, "autoescape") || !strcmp(s, "trans"))
        perr(p, t->line, t->col, "the '%s' statement is not supported in chat templates", s);
    else
        perr(p, t->line, t->col, "unknown statement '%s'", s);
    return NULL;
}

// Parses statements until a block tag named in `ends` (left as the current token) or EOF.
static bool parse_body(parser *p, const char *const *ends, jnode ***body, int *nbody) {
    nvec v = {0};
    tok *start = cur(p);
    if (++p->depth > MAX_PARSE_DEPTH) {
        perr(p, start->line, start->col, "blocks nested deeper than %d levels", MAX_PARSE_DEPTH);
        return false;
    }
    for (;;) {
        tok *t = cur(p);
        jnode *n = NULL;
        if (t->t == T_EOF) {
            if (ends) {
                int k = 0; // the closing tag is the last one listed (elif/else come first)
                while (ends[k + 1]) k++;
                perr(p, t->line, t->col, "unexpected end of template: missing {%% %s %%}", ends[k]);
                return false;
            }
            break;
        }
        if (t->t == T_DATA) {
            n = node(p, N_TEXT, t);
            if (!n) return false;
            n->lit = jv_strp(t->s);
            adv(p);
        } else if (t->t == T_VAR_BEGIN) {
            adv(p);
            n = node(p, N_OUTPUT, t);
            if (!n || !(n->a = parse_tuple_expr(p))) return false;
            if (cur(p)->t != T_VAR_END) {
                perr(p, cur(p)->line, cur(p)->col, "expected '}}', got '%s'", tok_desc(cur(p)));
                return false;
            }
            adv(p);
        } else if (t->t == T_BLOCK_BEGIN) {
            tok *nm = peek(p, 1);
            if (nm->t == T_NAME && ends)
                for (int k = 0; ends[k]; k++)
                    if (!strcmp(nm->s->s, ends[k])) {
                        adv(p); // leave the name as the current token
                        goto done;
                    }
            if (nm->t == T_NAME && (!strncmp(nm->s->s, "end", 3) || !strcmp(nm->s->s, "elif") ||
                                    !strcmp(nm->s->s, "else"))) {
                perr(p, nm->line, nm->col, "unexpected '%s'%s%s", nm->s->s,
                     ends ? ", expected " : "", ends ? ends[0] : "");
                return false;
            }
            if (!(n = parse_statement(p))) return false;
        } else {
            perr(p, t->line, t->col, "unexpected '%s'", tok_desc(t));
            return false;
        }
        if (!nv_push(p, &v, n, NULL)) return false;
    }
done:
    p->depth--;
    *body = v.v, *nbody = v.n;
    return true;
}

st_status jparse(jarena *a, const char *name, const char *src, size_t len, jtemplate_ast *out) {
    // Jinja normalizes \r\n and \r to \n and drops one trailing newline (keep_trailing_newline off).
    char *norm = malloc(len + 1);
    if (!norm) return st_fail(ST_ERR_NOMEM, "%s: out of memory (%zu bytes)", name, len);
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            norm[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            norm[n++] = src[i];
        }
    }
    if (n && norm[n - 1] == '\n') n--;
    norm[n] = 0;
    parser p = {.a = a, .name = name, .src = norm, .len = n};
    bool ok = lex(&p) && parse_body(&p, NULL, &out->body, &out->nbody);
    free(p.toks);
    free(norm);
    if (!ok) return st_fail(ST_ERR_FORMAT, "%s", p.err[0] ? p.err : "template parse failed");
    return ST_OK;
}
