// engine: JSON-constrained decoding (response_format json_object). An incremental validator of
// one JSON object (RFC 8259) over bytes, a pushdown automaton in a small copyable state, and the
// mask that leaves only the tokens whose bytes keep the output a valid prefix of such an object.

#include <math.h>
#include <string.h>

#include "engine/engine.h"
#include "tokenizer/tokenizer.h"

// ---------------------------------------------------------------------------------------------
// The validator. One byte at a time; the container stack is a bit per level (1: object), which is
// why the depth is capped at 64 (and a model that nests deeper than that is not writing data).

enum {
    J_START,      // before the top-level object: whitespace, '{'
    J_OBJ_OPEN,   // after '{': whitespace, a key or '}'
    J_OBJ_KEY,    // after ',' in an object: whitespace or a key
    J_COLON,      // after a key: whitespace or ':'
    J_VALUE,      // after ':' or ',' in an array: whitespace or a value
    J_ARR_OPEN,   // after '[': whitespace, a value or ']'
    J_AFTER,      // after a value in a container: whitespace, ',' or the container's closer
    J_STR,        // in a string (key says whether it is an object's key)
    J_STR_ESC,    // after a backslash
    J_STR_HEX,    // in \uXXXX: aux hex digits read, u their value
    J_STR_LOW_BS, // after a high surrogate escape: its low half must follow ('\')
    J_STR_LOW_U,  // ... ('u')
    J_STR_UTF8,   // in a multi-byte character: aux bytes to come, the next in [lo, hi]
    J_NUM_MINUS,  // after '-': a digit
    J_NUM_ZERO,   // a leading 0: no more integer digits
    J_NUM_INT,    // integer digits
    J_NUM_DOT,    // after '.': a digit
    J_NUM_FRAC,   // fraction digits
    J_NUM_E,      // after 'e': a sign or a digit
    J_NUM_ESIGN,  // after the exponent's sign: a digit
    J_NUM_EXP,    // exponent digits
    J_LIT,        // in true / false / null: literal aux, aux2 bytes matched
    J_DONE,       // the object is complete: trailing whitespace only
};

static const char *const literals[3] = {"true", "false", "null"};

static bool is_ws(unsigned c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
// Whitespace between tokens, capped: with everything else masked a weak model often prefers
// whitespace to '{' or '"', and would fill the reply with it. (Strings keep theirs.)
static bool take_ws(st_json_state *s, unsigned c) {
    if (!is_ws(c) || s->ws >= ST_JSON_MAX_WS) return false;
    s->ws++;
    return true;
}

static bool is_digit(unsigned c) { return c - '0' < 10u; }

static int hex_value(unsigned c) {
    if (c - '0' < 10u) return (int)(c - '0');
    c |= 0x20; // lower case
    return c - 'a' < 6u ? (int)(c - 'a' + 10) : -1;
}

static bool top_is_object(const st_json_state *s) { return (s->stack >> (s->depth - 1)) & 1; }

static bool push(st_json_state *s, bool object) {
    if (s->depth >= ST_JSON_MAX_DEPTH) return false;
    s->stack = (s->stack & ~(1ull << s->depth)) | ((uint64_t)object << s->depth);
    s->depth++;
    s->mode = object ? J_OBJ_OPEN : J_ARR_OPEN;
    return true;
}

// A value ended: what follows depends on the container it is in (none: the object is complete).
static void value_done(st_json_state *s) { s->mode = s->depth ? J_AFTER : J_DONE; }

static bool pop(st_json_state *s, bool object) {
    if (!s->depth || top_is_object(s) != object) return false;
    s->depth--;
    value_done(s);
    return true;
}

static bool value_start(st_json_state *s, unsigned c) {
    switch (c) {
    case '{': return push(s, true);
    case '[': return push(s, false);
    case '"': s->mode = J_STR, s->key = 0; return true;
    case '-': s->mode = J_NUM_MINUS; return true;
    case '0': s->mode = J_NUM_ZERO; return true;
    case 't': s->mode = J_LIT, s->aux = 0, s->aux2 = 1; return true;
    case 'f': s->mode = J_LIT, s->aux = 1, s->aux2 = 1; return true;
    case 'n': s->mode = J_LIT, s->aux = 2, s->aux2 = 1; return true;
    default:
        if (c - '1' < 9u) { s->mode = J_NUM_INT; return true; }
        return false;
    }
}

// The first byte of a multi-byte UTF-8 character: how many follow and the range of the next
// one (the narrow ranges exclude overlong forms, surrogates and code points past U+10FFFF).
static bool utf8_lead(st_json_state *s, unsigned c) {
    s->lo = 0x80, s->hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) s->aux = 1;
    else if (c >= 0xE0 && c <= 0xEF) {
        s->aux = 2;
        if (c == 0xE0) s->lo = 0xA0;
        if (c == 0xED) s->hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        s->aux = 3;
        if (c == 0xF0) s->lo = 0x90;
        if (c == 0xF4) s->hi = 0x8F;
    } else return false;
    s->mode = J_STR_UTF8;
    return true;
}

// \uXXXX, digit by digit, so that exactly the valid prefixes pass: a high surrogate (D800-DBFF)
// must be followed by a \u low one (DC00-DFFF), and a lone low surrogate is refused (strict
// parsers such as jansson reject unpaired surrogates; they encode no character).
static bool hex_digit(st_json_state *s, unsigned c) {
    int v = hex_value(c);
    if (v < 0) return false;
    if (s->low) { // the low half: DC00-DFFF
        if ((s->aux == 0 && v != 0xD) || (s->aux == 1 && v < 0xC)) return false;
    } else if (s->aux == 1 && s->u == 0xD && v >= 0xC) {
        return false;
    }
    s->u = (uint16_t)(s->u * 16 + v);
    if (++s->aux < 4) return true;
    bool high = !s->low && s->u >= 0xD800 && s->u <= 0xDBFF;
    s->low = 0;
    s->mode = high ? J_STR_LOW_BS : J_STR;
    return true;
}

// A number ends at the first byte that cannot continue it; that byte then belongs to the
// container (the top level is an object, so a number is always inside one).
static void number_end(st_json_state *s) { s->mode = J_AFTER; }

// One byte. Returns false when it leaves the language (s is then unspecified).
static bool step(st_json_state *s, unsigned c) {
    if (!is_ws(c)) s->ws = 0;
    for (;;) {
        switch (s->mode) {
        case J_START:
            return take_ws(s, c) || (c == '{' && push(s, true));
        case J_OBJ_OPEN:
            if (c == '}') return pop(s, true);
            // fall through
        case J_OBJ_KEY:
            if (c == '"') { s->mode = J_STR, s->key = 1; return true; }
            return take_ws(s, c);
        case J_COLON:
            if (c == ':') { s->mode = J_VALUE; return true; }
            return take_ws(s, c);
        case J_ARR_OPEN:
            if (c == ']') return pop(s, false);
            // fall through
        case J_VALUE:
            return take_ws(s, c) || value_start(s, c);
        case J_AFTER:
            if (take_ws(s, c)) return true;
            if (c == ',') { s->mode = top_is_object(s) ? J_OBJ_KEY : J_VALUE; return true; }
            if (c == '}') return pop(s, true);
            if (c == ']') return pop(s, false);
            return false;
        case J_STR:
            if (c == '"') {
                if (s->key) s->mode = J_COLON;
                else value_done(s);
                return true;
            }
            if (c == '\\') { s->mode = J_STR_ESC; return true; }
            if (c < 0x20) return false; // control characters must be escaped
            return c < 0x80 || utf8_lead(s, c);
        case J_STR_ESC:
            if (c == 'u') { s->mode = J_STR_HEX, s->aux = 0, s->u = 0; return true; }
            if (!strchr("\"\\/bfnrt", (int)c) || !c) return false;
            s->mode = J_STR;
            return true;
        case J_STR_HEX:
            return hex_digit(s, c);
        case J_STR_LOW_BS:
            if (c != '\\') return false;
            s->mode = J_STR_LOW_U;
            return true;
        case J_STR_LOW_U:
            if (c != 'u') return false;
            s->mode = J_STR_HEX, s->aux = 0, s->u = 0, s->low = 1;
            return true;
        case J_STR_UTF8:
            if (c < s->lo || c > s->hi) return false;
            s->lo = 0x80, s->hi = 0xBF;
            if (--s->aux == 0) s->mode = J_STR;
            return true;
        case J_NUM_MINUS:
            if (c == '0') { s->mode = J_NUM_ZERO; return true; }
            if (c - '1' < 9u) { s->mode = J_NUM_INT; return true; }
            return false;
        case J_NUM_ZERO:
        case J_NUM_INT:
            if (s->mode == J_NUM_INT && is_digit(c)) return true;
            if (c == '.') { s->mode = J_NUM_DOT; return true; }
            if ((c | 0x20) == 'e') { s->mode = J_NUM_E; return true; }
            number_end(s);
            continue;
        case J_NUM_DOT:
            if (!is_digit(c)) return false;
            s->mode = J_NUM_FRAC;
            return true;
        case J_NUM_FRAC:
            if (is_digit(c)) return true;
            if ((c | 0x20) == 'e') { s->mode = J_NUM_E; return true; }
            number_end(s);
            continue;
        case J_NUM_E:
            if (c == '+' || c == '-') { s->mode = J_NUM_ESIGN; return true; }
            // fall through
        case J_NUM_ESIGN:
            if (!is_digit(c)) return false;
            s->mode = J_NUM_EXP;
            return true;
        case J_NUM_EXP:
            if (is_digit(c)) return true;
            number_end(s);
            continue;
        case J_LIT: {
            const char *lit = literals[s->aux];
            if (c != (unsigned char)lit[s->aux2]) return false;
            if (!lit[++s->aux2]) value_done(s);
            return true;
        }
        case J_DONE:
            return take_ws(s, c);
        default:
            ST_ASSERT(!"a JSON state's mode is out of range");
            return false;
        }
    }
}

void st_json_init(st_json_state *s) { memset(s, 0, sizeof *s); }

bool st_json_feed(st_json_state *s, const void *bytes, size_t n) {
    st_json_state t = *s;
    const unsigned char *b = bytes;
    for (size_t i = 0; i < n; i++)
        if (!step(&t, b[i])) return false;
    *s = t;
    return true;
}

bool st_json_complete(const st_json_state *s) { return s->mode == J_DONE; }

// ---------------------------------------------------------------------------------------------
// The vocabulary, indexed once per model: text tokens grouped by their first byte (a state
// refuses most first bytes, and with them whole groups at once), and which tokens are plain
// string text (inside a string they change nothing, so that state, the most common one, needs
// no walk over their bytes).

struct st_json_vocab {
    const st_tokenizer *tok;
    int32_t n_tok;          // the tokenizer's vocabulary (a model's logits may have more rows)
    int32_t *order;         // (n_text) text tokens, grouped by first byte
    int32_t first[257];     // order[first[b] .. first[b + 1]) begin with byte b
    int32_t *special;       // (n_special) control, user-defined, unused and empty tokens
    int32_t n_special;
    uint8_t *plain;         // (n_tok) 1: the bytes are whole string characters, no '"', '\\' or control
};

// Text tokens: what plain text tokenizes to. The end-of-generation tokens are never text here,
// whatever their type says.
static bool is_text(const st_tokenizer *tok, int32_t id) {
    st_token_type ty = st_token_get_type(tok, id);
    return (ty == ST_TOKEN_NORMAL || ty == ST_TOKEN_BYTE || ty == ST_TOKEN_UNDEFINED) && !st_token_is_eog(tok, id);
}

// Whether bytes[0..n) could sit in the middle of a string without changing its state.
static bool plain_string_text(const unsigned char *b, size_t n) {
    st_json_state s = {.mode = J_STR, .depth = 1, .stack = 1};
    for (size_t i = 0; i < n; i++)
        if (b[i] == '"' || b[i] == '\\' || !step(&s, b[i])) return false;
    return s.mode == J_STR;
}

void st_json_vocab_free(st_json_vocab *v) {
    if (!v) return;
    st_free(v->order);
    st_free(v->special);
    st_free(v->plain);
    st_free(v);
}

st_status st_json_vocab_create(const st_tokenizer *tok, st_json_vocab **out) {
    *out = NULL;
    st_json_vocab *v = st_calloc(1, sizeof *v);
    if (!v) return ST_ERR_NOMEM;
    v->tok = tok;
    v->n_tok = st_tokenizer_n_vocab(tok);
    size_t n = (size_t)(v->n_tok > 0 ? v->n_tok : 1);
    v->order = st_alloc(sizeof(int32_t) * n);
    v->special = st_alloc(sizeof(int32_t) * n);
    v->plain = st_calloc(n, 1);
    if (!v->order || !v->special || !v->plain) {
        st_json_vocab_free(v);
        return st_fail(ST_ERR_NOMEM, "JSON constraint: out of memory indexing %d tokens", v->n_tok);
    }
    int32_t count[256] = {0};
    for (int32_t id = 0; id < v->n_tok; id++) {
        size_t len;
        const char *b = st_token_bytes(tok, id, &len);
        if (!is_text(tok, id) || !b || !len) {
            v->special[v->n_special++] = id;
            continue;
        }
        count[(unsigned char)b[0]]++;
        v->plain[id] = plain_string_text((const unsigned char *)b, len);
    }
    v->first[0] = 0;
    for (int c = 0; c < 256; c++) v->first[c + 1] = v->first[c] + count[c];
    int32_t at[256];
    memcpy(at, v->first, sizeof at);
    for (int32_t id = 0, k = 0; id < v->n_tok; id++) {
        if (k < v->n_special && v->special[k] == id) { // special ids are in increasing order
            k++;
            continue;
        }
        size_t len;
        const char *b = st_token_bytes(tok, id, &len);
        v->order[at[(unsigned char)b[0]]++] = id;
    }
    *out = v;
    return ST_OK;
}

// ---------------------------------------------------------------------------------------------
// The mask.

int st_json_mask(const st_json_vocab *v, const st_json_state *s, float *logits, int n_logits) {
    int allowed = 0;
    bool in_string = s->mode == J_STR;
    for (int c = 0; c < 256; c++) {
        const int32_t *ids = v->order + v->first[c];
        int n = v->first[c + 1] - v->first[c];
        if (!n) continue;
        st_json_state after = *s; // the state after this first byte, shared by the whole group
        if (!step(&after, (unsigned)c)) {
            for (int i = 0; i < n; i++)
                if (ids[i] < n_logits) logits[ids[i]] = -INFINITY;
            continue;
        }
        for (int i = 0; i < n; i++) {
            int32_t id = ids[i];
            if (id >= n_logits) continue;
            if (in_string && v->plain[id]) {
                allowed++;
                continue;
            }
            size_t len;
            const char *b = st_token_bytes(v->tok, id, &len);
            st_json_state t = after;
            bool ok = true;
            for (size_t k = 1; ok && k < len; k++) ok = step(&t, (unsigned char)b[k]);
            if (ok) allowed++;
            else logits[id] = -INFINITY;
        }
    }
    // Special tokens: never text; the end of generation only once the object is complete.
    bool done = st_json_complete(s);
    for (int i = 0; i < v->n_special; i++) {
        int32_t id = v->special[i];
        if (id >= n_logits) continue;
        if (done && st_token_is_eog(v->tok, id)) allowed++;
        else logits[id] = -INFINITY;
    }
    for (int id = v->n_tok; id < n_logits; id++) logits[id] = -INFINITY; // rows past the vocabulary
    return allowed;
}

bool st_json_token_ok(const st_json_vocab *v, const st_json_state *s, int32_t id) {
    if (id < 0 || id >= v->n_tok) return false;
    if (st_token_is_eog(v->tok, id) && st_json_complete(s)) return true;
    if (!is_text(v->tok, id)) return false;
    size_t len;
    const char *b = st_token_bytes(v->tok, id, &len);
    st_json_state t = *s;
    return b && len && st_json_feed(&t, b, len);
}
