// server: splits a model's generated text into content, reasoning (<think>...</think>) and tool
// calls (Qwen3's JSON and Qwen3-Coder's XML inside <tool_call>...</tool_call>), piece by piece as
// it streams, holding back any text that may still turn out to be markup.

#include <stdlib.h>
#include <string.h>

#include "server/server.h"

enum { MODE_CONTENT, MODE_REASONING, MODE_TOOL };

static const char TAG_THINK[] = "<think>", TAG_THINK_END[] = "</think>";
static const char TAG_TOOL[] = "<tool_call>", TAG_TOOL_END[] = "</tool_call>";

struct st_out_parser {
    int mode;
    const json_t *tools;      // NULL: tool markup stays text
    char *buf;                // text not handed out yet
    size_t len, cap;
    bool said_anything;       // content or a tool call went out: a later <think> is text
    bool skip_ws;             // drop whitespace before the next content or reasoning
};

st_status st_out_parser_create(bool in_reasoning, const json_t *tools, st_out_parser **out) {
    st_out_parser *p = calloc(1, sizeof *p);
    if (!p) return st_fail(ST_ERR_NOMEM, "output parser: out of memory");
    p->mode = in_reasoning ? MODE_REASONING : MODE_CONTENT;
    p->tools = tools && json_array_size(tools) ? tools : NULL;
    p->skip_ws = true;
    *out = p;
    return ST_OK;
}

void st_out_parser_free(st_out_parser *p) {
    if (!p) return;
    free(p->buf);
    free(p);
}

static bool is_ws(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

static const char *find(const char *h, size_t n, const char *needle) {
    return memmem(h, n, needle, strlen(needle));
}

// The length of the longest end of buf[0..n) that begins tag (a tag that may be arriving).
static size_t partial_tag(const char *buf, size_t n, const char *tag) {
    size_t tl = strlen(tag);
    for (size_t k = tl - 1; k > 0; k--)
        if (k <= n && !memcmp(buf + n - k, tag, k)) return k;
    return 0;
}

// Hands out text of the current kind. Whitespace at the end is kept back (trailing whitespace
// before a tag, or at the very end, is dropped); whitespace at the start after a tag too.
static size_t emit_text(st_out_parser *p, size_t n, bool final, st_out_fn fn, void *ctx) {
    size_t from = 0, end = n;
    if (p->skip_ws)
        while (from < n && is_ws(p->buf[from])) from++;
    while (end > from && is_ws(p->buf[end - 1])) end--;
    if (end > from) {
        st_out_event ev = {.kind = p->mode == MODE_REASONING ? ST_OUT_REASONING : ST_OUT_CONTENT,
                           .text = p->buf + from, .len = end - from};
        fn(ctx, &ev);
        p->skip_ws = false;
        if (p->mode == MODE_CONTENT) p->said_anything = true;
    }
    // Consumed: all of it when final; else up to the trailing whitespace, which waits for what
    // follows it (and is dropped before a tag).
    return final ? n : end > from ? end : from;
}

static void consume(st_out_parser *p, size_t n) {
    memmove(p->buf, p->buf + n, p->len - n);
    p->len -= n;
}

static st_status emit_tool(st_out_parser *p, const char *body, size_t n, st_out_fn fn, void *ctx) {
    char *name = NULL, *args = NULL;
    if (st_parse_tool_call(body, n, p->tools, &name, &args) == ST_OK) {
        st_out_event ev = {.kind = ST_OUT_TOOL_CALL, .name = name, .arguments = args};
        fn(ctx, &ev);
    } else { // not a call we can read: give the model's text back rather than lose it
        st_error_clear();
        size_t tl = strlen(TAG_TOOL);
        char *raw = malloc(tl + n);
        if (!raw) return st_fail(ST_ERR_NOMEM, "output parser: out of memory");
        memcpy(raw, TAG_TOOL, tl);
        memcpy(raw + tl, body, n);
        st_out_event ev = {.kind = ST_OUT_CONTENT, .text = raw, .len = tl + n};
        fn(ctx, &ev);
        free(raw);
    }
    free(name);
    free(args);
    p->said_anything = true;
    p->skip_ws = true;
    return ST_OK;
}

// Hands out everything certain in buf; returns with only undecided text left.
static st_status process(st_out_parser *p, st_out_fn fn, void *ctx) {
    for (;;) {
        if (p->mode == MODE_TOOL) {
            const char *end = find(p->buf, p->len, TAG_TOOL_END);
            if (!end) return ST_OK;
            size_t n = (size_t)(end - p->buf);
            ST_TRY(emit_tool(p, p->buf, n, fn, ctx));
            consume(p, n + strlen(TAG_TOOL_END));
            p->mode = MODE_CONTENT;
            continue;
        }
        // Content or reasoning: the earliest tag that changes the mode.
        const char *tags[2];
        int n_tags = 0;
        if (p->mode == MODE_REASONING) tags[n_tags++] = TAG_THINK_END;
        else {
            if (!p->said_anything) tags[n_tags++] = TAG_THINK;
            if (p->tools) tags[n_tags++] = TAG_TOOL;
        }
        const char *hit = NULL, *hit_tag = NULL;
        for (int i = 0; i < n_tags; i++) {
            const char *at = find(p->buf, p->len, tags[i]);
            if (at && tags[i] == TAG_THINK) // reasoning opens the reply: after words it is text
                for (const char *q = p->buf; q < at && at; q++)
                    if (!is_ws(*q)) at = NULL;
            if (at && (!hit || at < hit)) hit = at, hit_tag = tags[i];
        }
        if (hit) {
            size_t n = (size_t)(hit - p->buf);
            emit_text(p, n, true, fn, ctx);
            consume(p, n + strlen(hit_tag));
            if (hit_tag == TAG_THINK) p->mode = MODE_REASONING;
            else if (hit_tag == TAG_THINK_END) p->mode = MODE_CONTENT;
            else p->mode = MODE_TOOL;
            p->skip_ws = true;
            continue;
        }
        size_t hold = 0;
        for (int i = 0; i < n_tags; i++) {
            size_t k = partial_tag(p->buf, p->len, tags[i]);
            if (k > hold) hold = k;
        }
        consume(p, emit_text(p, p->len - hold, false, fn, ctx));
        return ST_OK;
    }
}

st_status st_out_parser_push(st_out_parser *p, const char *text, size_t len, st_out_fn fn, void *ctx) {
    if (p->len + len + 1 > p->cap) {
        size_t cap = (p->len + len + 1) * 2;
        char *nb = realloc(p->buf, cap);
        if (!nb) return st_fail(ST_ERR_NOMEM, "output parser: out of memory (%zu bytes)", cap);
        p->buf = nb, p->cap = cap;
    }
    memcpy(p->buf + p->len, text, len);
    p->len += len;
    p->buf[p->len] = 0;
    return process(p, fn, ctx);
}

st_status st_out_parser_finish(st_out_parser *p, st_out_fn fn, void *ctx) {
    if (p->mode == MODE_TOOL) { // cut off inside a call (a length limit, or no closing tag)
        ST_TRY(emit_tool(p, p->buf, p->len, fn, ctx));
        p->len = 0;
        p->mode = MODE_CONTENT;
        return ST_OK;
    }
    emit_text(p, p->len, true, fn, ctx);
    p->len = 0;
    return ST_OK;
}

// ---------------------------------------------------------------------------------------------
// One tool call's body

// The JSON Schema type of a tool's parameter, or NULL when the request does not say.
static const char *param_type(const json_t *tools, const char *fname, const char *pname) {
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        json_t *f = json_object_get(t, "function");
        if (!f) f = t;
        const char *n = json_string_value(json_object_get(f, "name"));
        if (!n || strcmp(n, fname)) continue;
        json_t *prop = json_object_get(json_object_get(json_object_get(f, "parameters"), "properties"), pname);
        json_t *type = json_object_get(prop, "type");
        if (json_is_string(type)) return json_string_value(type);
        if (json_is_array(type)) { // ["string", "null"]: a string when any of them is
            size_t j;
            json_t *x;
            json_array_foreach(type, j, x) if (json_is_string(x) && !strcmp(json_string_value(x), "string")) return "string";
            return "any";
        }
        return NULL;
    }
    return NULL;
}

static char *dup_range(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) memcpy(d, s, n), d[n] = 0;
    return d;
}

static void trim(const char **s, size_t *n) {
    while (*n && is_ws(**s)) (*s)++, (*n)--;
    while (*n && is_ws((*s)[*n - 1])) (*n)--;
}

// Qwen3-Coder: <function=NAME> then <parameter=P>VALUE</parameter>... then </function>. A value
// is text (one newline each side is the format's); typed parameters are read as JSON.
static st_status parse_xml(const char *s, size_t n, const json_t *tools, char **name, json_t *args) {
    const char *end = s + n, *gt = memchr(s, '>', n);
    if (!gt) return st_fail(ST_ERR_FORMAT, "tool call: <function= without '>'");
    const char *nm = s + strlen("<function=");
    size_t nl = (size_t)(gt - nm);
    trim(&nm, &nl);
    if (!nl) return st_fail(ST_ERR_FORMAT, "tool call: a function without a name");
    if (!(*name = dup_range(nm, nl))) return st_fail(ST_ERR_NOMEM, "tool call: out of memory");
    const char *q = gt + 1;
    for (;;) {
        while (q < end && is_ws(*q)) q++;
        if (q >= end || ((size_t)(end - q) >= 11 && !memcmp(q, "</function>", 11))) break;
        static const char P[] = "<parameter=";
        if ((size_t)(end - q) < strlen(P) || memcmp(q, P, strlen(P)))
            return st_fail(ST_ERR_FORMAT, "tool call %s: expected <parameter=NAME> or </function>", *name);
        const char *pn = q + strlen(P), *pgt = memchr(pn, '>', (size_t)(end - pn));
        if (!pgt) return st_fail(ST_ERR_FORMAT, "tool call %s: <parameter= without '>'", *name);
        size_t pnl = (size_t)(pgt - pn);
        trim(&pn, &pnl);
        const char *v = pgt + 1, *vend = memmem(v, (size_t)(end - v), "</parameter>", 12);
        const char *next = vend ? vend + 12 : end;
        if (!vend) { // an unclosed value runs to the next parameter or the function's end
            const char *a = memmem(v, (size_t)(end - v), "<parameter=", 11), *b = memmem(v, (size_t)(end - v), "</function>", 11);
            vend = a && (!b || a < b) ? a : b ? b : end;
            next = vend;
        }
        size_t vl = (size_t)(vend - v);
        if (vl && v[0] == '\n') v++, vl--;
        if (vl && v[vl - 1] == '\n') vl--;
        char *pname = dup_range(pn, pnl), *val = dup_range(v, vl);
        if (!pname || !val) {
            free(pname), free(val);
            return st_fail(ST_ERR_NOMEM, "tool call: out of memory");
        }
        const char *type = tools ? param_type(tools, *name, pname) : NULL;
        json_t *jv = NULL;
        if (type && strcmp(type, "string")) jv = json_loadb(val, vl, JSON_DECODE_ANY, NULL);
        if (!jv) jv = json_stringn(val, vl);
        json_object_set_new(args, pname, jv ? jv : json_null());
        free(pname), free(val);
        q = next;
    }
    return ST_OK;
}

st_status st_parse_tool_call(const char *body, size_t len, const json_t *tools, char **name, char **arguments) {
    *name = *arguments = NULL;
    const char *s = body;
    size_t n = len;
    trim(&s, &n);
    json_t *args = NULL;
    st_status st = ST_OK;
    if (n && s[0] == '{') { // Qwen3: {"name": ..., "arguments": {...}}
        json_error_t je;
        json_t *obj = json_loadb(s, n, 0, &je);
        json_t *nm = json_object_get(obj, "name"), *a = json_object_get(obj, "arguments");
        if (!a) a = json_object_get(obj, "parameters");
        if (!obj) st = st_fail(ST_ERR_FORMAT, "tool call: not JSON (%s)", je.text);
        else if (!json_is_string(nm) || !json_string_length(nm)) st = st_fail(ST_ERR_FORMAT, "tool call: no \"name\"");
        else if (!a || json_is_null(a)) args = json_object();
        else if (json_is_object(a)) args = json_incref(a);
        else if (json_is_string(a)) { // arguments written as a JSON string
            args = json_loads(json_string_value(a), 0, NULL);
            if (!json_is_object(args)) st = st_fail(ST_ERR_FORMAT, "tool call: \"arguments\" is not an object");
        } else st = st_fail(ST_ERR_FORMAT, "tool call: \"arguments\" is not an object");
        if (!st && !(*name = strdup(json_string_value(nm)))) st = st_fail(ST_ERR_NOMEM, "tool call: out of memory");
        json_decref(obj);
    } else if (n >= 10 && !memcmp(s, "<function=", 10)) {
        args = json_object();
        st = parse_xml(s, n, tools, name, args);
    } else {
        st = st_fail(ST_ERR_FORMAT, "tool call: neither JSON nor <function=...>");
    }
    if (!st && !(*arguments = json_dumps(args, JSON_COMPACT))) st = st_fail(ST_ERR_NOMEM, "tool call: out of memory");
    json_decref(args);
    if (st) {
        free(*name), free(*arguments);
        *name = *arguments = NULL;
    }
    return st;
}
