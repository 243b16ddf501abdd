// bpe_load: builds the BPE tokenizer from a GGUF's tokenizer.ggml.* metadata or from a Hugging
// Face tokenizer.json (+ tokenizer_config.json beside it), through one common builder.

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/bpe_internal.h"

// The pre-tokenizer patterns, as the Hugging Face tokenizer.json files write them.
static const char PAT_QWEN2[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char PAT_LLAMA3[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char PAT_GPT2[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

const uint16_t st_bpe_byte_to_cp[256] = {
#define R(b) (uint16_t)(b)
    // 0..32 -> U+0100..U+0120
    0x100, 0x101, 0x102, 0x103, 0x104, 0x105, 0x106, 0x107, 0x108, 0x109, 0x10A, 0x10B, 0x10C,
    0x10D, 0x10E, 0x10F, 0x110, 0x111, 0x112, 0x113, 0x114, 0x115, 0x116, 0x117, 0x118, 0x119,
    0x11A, 0x11B, 0x11C, 0x11D, 0x11E, 0x11F, 0x120,
    // 33..126 map to themselves
    R(33), R(34), R(35), R(36), R(37), R(38), R(39), R(40), R(41), R(42), R(43), R(44), R(45),
    R(46), R(47), R(48), R(49), R(50), R(51), R(52), R(53), R(54), R(55), R(56), R(57), R(58),
    R(59), R(60), R(61), R(62), R(63), R(64), R(65), R(66), R(67), R(68), R(69), R(70), R(71),
    R(72), R(73), R(74), R(75), R(76), R(77), R(78), R(79), R(80), R(81), R(82), R(83), R(84),
    R(85), R(86), R(87), R(88), R(89), R(90), R(91), R(92), R(93), R(94), R(95), R(96), R(97),
    R(98), R(99), R(100), R(101), R(102), R(103), R(104), R(105), R(106), R(107), R(108), R(109),
    R(110), R(111), R(112), R(113), R(114), R(115), R(116), R(117), R(118), R(119), R(120),
    R(121), R(122), R(123), R(124), R(125), R(126),
    // 127..160 -> U+0121..U+0142
    0x121, 0x122, 0x123, 0x124, 0x125, 0x126, 0x127, 0x128, 0x129, 0x12A, 0x12B, 0x12C, 0x12D,
    0x12E, 0x12F, 0x130, 0x131, 0x132, 0x133, 0x134, 0x135, 0x136, 0x137, 0x138, 0x139, 0x13A,
    0x13B, 0x13C, 0x13D, 0x13E, 0x13F, 0x140, 0x141, 0x142,
    // 161..172 map to themselves
    R(161), R(162), R(163), R(164), R(165), R(166), R(167), R(168), R(169), R(170), R(171), R(172),
    // 173 -> U+0143
    0x143,
    // 174..255 map to themselves
    R(174), R(175), R(176), R(177), R(178), R(179), R(180), R(181), R(182), R(183), R(184),
    R(185), R(186), R(187), R(188), R(189), R(190), R(191), R(192), R(193), R(194), R(195),
    R(196), R(197), R(198), R(199), R(200), R(201), R(202), R(203), R(204), R(205), R(206),
    R(207), R(208), R(209), R(210), R(211), R(212), R(213), R(214), R(215), R(216), R(217),
    R(218), R(219), R(220), R(221), R(222), R(223), R(224), R(225), R(226), R(227), R(228),
    R(229), R(230), R(231), R(232), R(233), R(234), R(235), R(236), R(237), R(238), R(239),
    R(240), R(241), R(242), R(243), R(244), R(245), R(246), R(247), R(248), R(249), R(250),
    R(251), R(252), R(253), R(254), R(255),
#undef R
};

#define UNSET UINT32_MAX

// ---------------------------------------------------------------------------------------------
// Builder

static st_status tok_alloc(int64_t n, const char *src, st_tokenizer **out) {
    if (n <= 256 || n > (1 << 24))
        return st_fail(ST_ERR_FORMAT, "%s: vocabulary of %lld tokens (expected 257..16M)", src,
                       (long long)n);
    st_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return st_fail(ST_ERR_NOMEM, "%s: out of memory", src);
    t->n_vocab = (int32_t)n;
    t->piece_off = malloc(n * sizeof *t->piece_off);
    t->piece_len = malloc(n * sizeof *t->piece_len);
    t->bytes_off = malloc(n * sizeof *t->bytes_off);
    t->bytes_len = malloc(n * sizeof *t->bytes_len);
    t->type = malloc((size_t)n);
    t->bos = t->eos = t->eot = t->pad = -1;
    t->added_single_first = -1;
    *out = t;
    if (!t->piece_off || !t->piece_len || !t->bytes_off || !t->bytes_len || !t->type)
        return st_fail(ST_ERR_NOMEM, "%s: out of memory for %lld tokens", src, (long long)n);
    for (int64_t i = 0; i < n; i++) t->piece_len[i] = UNSET, t->type[i] = ST_TOKEN_NORMAL;
    return ST_OK;
}

static st_status text_append(st_tokenizer *t, const char *s, size_t len, uint32_t *off) {
    if (t->text_len + len + 1 > t->text_cap) {
        size_t c = t->text_cap ? t->text_cap : 1 << 20;
        while (c < t->text_len + len + 1) c *= 2;
        if (c > UINT32_MAX) return st_fail(ST_ERR_RANGE, "tokenizer: vocabulary text over 4 GiB");
        char *p = realloc(t->text, c);
        if (!p) return st_fail(ST_ERR_NOMEM, "tokenizer: out of memory (%zu bytes)", c);
        t->text = p, t->text_cap = c;
    }
    *off = (uint32_t)t->text_len;
    memcpy(t->text + t->text_len, s, len);
    t->text[t->text_len + len] = 0;
    t->text_len += len + 1;
    return ST_OK;
}

static st_status tok_set(st_tokenizer *t, int64_t id, const char *s, size_t len, int type,
                         const char *src) {
    if (id < 0 || id >= t->n_vocab)
        return st_fail(ST_ERR_FORMAT, "%s: token id %lld out of range", src, (long long)id);
    if (t->piece_len[id] != UNSET)
        return st_fail(ST_ERR_FORMAT, "%s: token id %lld given twice", src, (long long)id);
    if (type < ST_TOKEN_NORMAL || type > ST_TOKEN_BYTE)
        return st_fail(ST_ERR_FORMAT, "%s: token %lld has unknown type %d", src, (long long)id,
                       type);
    if (len >= UINT32_MAX) return st_fail(ST_ERR_FORMAT, "%s: token %lld too long", src, (long long)id);
    ST_TRY(text_append(t, s, len, &t->piece_off[id]));
    t->piece_len[id] = (uint32_t)len;
    t->type[id] = (uint8_t)type;
    return ST_OK;
}

static int cmp_added(const void *pa, const void *pb, void *ctx) {
    const st_tokenizer *t = ctx;
    const st_bpe_added *a = pa, *b = pb;
    unsigned char fa = (unsigned char)t->text[t->piece_off[a->id]];
    unsigned char fb = (unsigned char)t->text[t->piece_off[b->id]];
    if (fa != fb) return fa < fb ? -1 : 1;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

static const char *const EOG_PIECES[] = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>",
                                         "<|eom_id|>", "<|end|>", "<end_of_turn>",
                                         "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"};

static void add_eog(st_tokenizer *t, int32_t id) {
    if (id < 0) return;
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return;
    if (t->n_eog < ST_BPE_MAX_EOG) t->eog[t->n_eog++] = id;
}

// Fills gaps, decodes every token to bytes, builds the piece hash, the byte tokens and the
// added-token index.
static st_status tok_finish_vocab(st_tokenizer *t, const char *src) {
    int32_t n = t->n_vocab;
    for (int32_t i = 0; i < n; i++)
        if (t->piece_len[i] == UNSET) ST_TRY(tok_set(t, i, "", 0, ST_TOKEN_UNUSED, src));

    // Decoded bytes: a piece whose characters all come from the byte table decodes through it;
    // any other piece (added tokens in plain text) is its own bytes.
    int16_t inv[324];
    for (int i = 0; i < 324; i++) inv[i] = -1;
    for (int b = 0; b < 256; b++) inv[st_bpe_byte_to_cp[b]] = (int16_t)b;
    t->bytes = malloc(t->text_len ? t->text_len : 1);
    if (!t->bytes) return st_fail(ST_ERR_NOMEM, "%s: out of memory", src);
    size_t bo = 0;
    for (int32_t id = 0; id < n; id++) {
        const unsigned char *p = (const unsigned char *)t->text + t->piece_off[id];
        size_t len = t->piece_len[id], k = 0;
        t->bytes_off[id] = (uint32_t)bo;
        bool mapped = true;
        for (size_t i = 0; i < len;) {
            uint32_t cp;
            int m = st_utf8_decode(p + i, len - i, &cp);
            if (m == 0 || cp >= 324 || inv[cp] < 0) {
                mapped = false;
                break;
            }
            t->bytes[bo + k++] = (char)inv[cp];
            i += (size_t)m;
        }
        if (!mapped) memcpy(t->bytes + bo, p, len), k = len;
        t->bytes_len[id] = (uint32_t)k;
        bo += k;
    }

    uint32_t slots = 1024;
    while (slots < 2u * (uint32_t)n) slots *= 2;
    t->vocab_mask = slots - 1;
    t->vocab_hash = malloc(slots * sizeof *t->vocab_hash);
    if (!t->vocab_hash) return st_fail(ST_ERR_NOMEM, "%s: out of memory", src);
    memset(t->vocab_hash, 0xFF, slots * sizeof *t->vocab_hash);
    for (int32_t id = 0; id < n; id++) {
        if (t->type[id] == ST_TOKEN_UNUSED && t->piece_len[id] == 0) continue;
        const char *p = t->text + t->piece_off[id];
        if (st_token_find(t, p, t->piece_len[id]) >= 0) continue; // a duplicate keeps the first id
        uint64_t h = st_bpe_hash(p, t->piece_len[id]);
        uint32_t i = (uint32_t)h & t->vocab_mask;
        while (t->vocab_hash[i] >= 0) i = (i + 1) & t->vocab_mask;
        t->vocab_hash[i] = id;
    }

    for (int b = 0; b < 256; b++) {
        char s[3];
        uint16_t cp = st_bpe_byte_to_cp[b];
        size_t len = 1;
        if (cp < 0x80) s[0] = (char)cp;
        else s[0] = (char)(0xC0 | (cp >> 6)), s[1] = (char)(0x80 | (cp & 0x3F)), len = 2;
        t->byte_tok[b] = st_token_find(t, s, len);
        if (t->byte_tok[b] < 0)
            return st_fail(ST_ERR_UNSUPPORTED, "%s: no token for byte 0x%02X; not a byte-level "
                           "BPE vocabulary", src, b);
    }

    int na = 0;
    for (int32_t id = 0; id < n; id++)
        if ((t->type[id] == ST_TOKEN_CONTROL || t->type[id] == ST_TOKEN_USER_DEFINED) &&
            t->piece_len[id] > 0)
            na++;
    t->added = malloc((na ? na : 1) * sizeof *t->added);
    if (!t->added) return st_fail(ST_ERR_NOMEM, "%s: out of memory", src);
    for (int32_t id = 0; id < n; id++)
        if ((t->type[id] == ST_TOKEN_CONTROL || t->type[id] == ST_TOKEN_USER_DEFINED) &&
            t->piece_len[id] > 0)
            t->added[t->n_added++] = (st_bpe_added){id, t->piece_len[id]};
    qsort_r(t->added, (size_t)t->n_added, sizeof *t->added, cmp_added, t);
    int k = 0, distinct = 0, last = -1;
    for (int b = 0; b < 256; b++) {
        t->added_first[b] = k;
        while (k < t->n_added && (unsigned char)t->text[t->piece_off[t->added[k].id]] == b) k++;
        if (k > t->added_first[b]) distinct++, last = b;
    }
    t->added_first[256] = k;
    t->added_single_first = distinct == 1 ? last : -1;
    return ST_OK;
}

static st_status tok_finish_specials(st_tokenizer *t, const char *src) {
    int32_t *ids[] = {&t->bos, &t->eos, &t->eot, &t->pad};
    const char *names[] = {"bos", "eos", "eot", "pad"};
    for (int i = 0; i < 4; i++)
        if (*ids[i] >= t->n_vocab)
            return st_fail(ST_ERR_FORMAT, "%s: %s token id %d is outside the vocabulary (%d)", src,
                           names[i], *ids[i], t->n_vocab);
    if (t->eot < 0) {
        static const char *const eot_pieces[] = {"<|im_end|>", "<|eot_id|>", "<|end|>",
                                                 "<end_of_turn>"};
        for (size_t i = 0; i < sizeof eot_pieces / sizeof *eot_pieces && t->eot < 0; i++)
            t->eot = st_token_find(t, eot_pieces[i], strlen(eot_pieces[i]));
    }
    add_eog(t, t->eos);
    add_eog(t, t->eot);
    for (size_t i = 0; i < sizeof EOG_PIECES / sizeof *EOG_PIECES; i++) {
        int32_t id = st_token_find(t, EOG_PIECES[i], strlen(EOG_PIECES[i]));
        if (id >= 0 && (t->type[id] == ST_TOKEN_CONTROL || t->type[id] == ST_TOKEN_USER_DEFINED))
            add_eog(t, id);
    }
    return ST_OK;
}

static st_status tok_alloc_merges(st_tokenizer *t, uint64_t n, const char *src) {
    if (n > (1u << 26)) return st_fail(ST_ERR_FORMAT, "%s: %llu merges is too many", src,
                                       (unsigned long long)n);
    uint32_t slots = 1024;
    while (slots < 2 * n) slots *= 2;
    t->merge_mask = slots - 1;
    t->merges = malloc(slots * sizeof *t->merges);
    if (!t->merges) return st_fail(ST_ERR_NOMEM, "%s: out of memory for %llu merges", src,
                                    (unsigned long long)n);
    for (uint32_t i = 0; i < slots; i++) t->merges[i].key = ST_BPE_EMPTY_KEY;
    return ST_OK;
}

static st_status tok_merge(st_tokenizer *t, const char *a, size_t alen, const char *b, size_t blen,
                           char **buf, size_t *cap, const char *src) {
    int32_t rank = t->n_merges;
    int32_t ia = st_token_find(t, a, alen), ib = st_token_find(t, b, blen);
    if (ia < 0 || ib < 0)
        return st_fail(ST_ERR_FORMAT, "%s: merge %d: '%.*s' is not in the vocabulary", src, rank,
                       (int)(ia < 0 ? alen : blen), ia < 0 ? a : b);
    if (alen + blen > *cap) {
        size_t c = (alen + blen) * 2;
        char *p = realloc(*buf, c);
        if (!p) return st_fail(ST_ERR_NOMEM, "%s: out of memory", src);
        *buf = p, *cap = c;
    }
    memcpy(*buf, a, alen);
    memcpy(*buf + alen, b, blen);
    int32_t im = st_token_find(t, *buf, alen + blen);
    if (im < 0)
        return st_fail(ST_ERR_FORMAT, "%s: merge %d: result '%.*s' is not in the vocabulary", src,
                       rank, (int)(alen + blen), *buf);
    t->n_merges++;
    return st_bpe_merge_insert(t, ia, ib, rank, im);
}

// Growable string for the expanded pattern.
typedef struct strbuf {
    char *s;
    size_t n, cap;
    bool oom;
} strbuf;

static void sb_put(strbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap * 2 : 4096;
        while (c < b->n + n + 1) c *= 2;
        char *p = realloc(b->s, c);
        if (!p) {
            b->oom = true;
            return;
        }
        b->s = p, b->cap = c;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}

static void sb_ranges(strbuf *b, const uint32_t (*r)[2], int n) {
    char tmp[40];
    for (int i = 0; i < n; i++) {
        int k = r[i][0] == r[i][1] ? snprintf(tmp, sizeof tmp, "\\x{%X}", r[i][0])
                                   : snprintf(tmp, sizeof tmp, "\\x{%X}-\\x{%X}", r[i][0], r[i][1]);
        sb_put(b, tmp, (size_t)k);
    }
}

// Rewrites \p{L}, \p{N}, \s and \S as explicit ranges of Hugging Face's Unicode data, so the
// split does not depend on the Unicode version PCRE2 was built with (see unicode_classes.c).
static st_status expand_classes(const char *pat, const char *src, char **out) {
    strbuf b = {0};
    bool in_class = false;
    for (const char *p = pat; *p;) {
        const uint32_t (*r)[2] = NULL;
        int n = 0, len = 0;
        bool negate = false;
        if (p[0] == '\\' && p[1]) {
            if (!strncmp(p, "\\p{L}", 5)) r = st_uc_letter, n = st_uc_n_letter, len = 5;
            else if (!strncmp(p, "\\p{N}", 5)) r = st_uc_number, n = st_uc_n_number, len = 5;
            else if (p[1] == 's') r = st_uc_space, n = st_uc_n_space, len = 2;
            else if (p[1] == 'S') r = st_uc_space, n = st_uc_n_space, len = 2, negate = true;
            else if (p[1] == 'p' || p[1] == 'P') {
                free(b.s);
                return st_fail(ST_ERR_UNSUPPORTED, "%s: pre-tokenizer regex uses '%.6s', which "
                               "Strata cannot map to Hugging Face's Unicode data", src, p);
            }
            if (!r) {
                sb_put(&b, p, 2);
                p += 2;
                continue;
            }
            if (negate && in_class) {
                free(b.s);
                return st_fail(ST_ERR_UNSUPPORTED, "%s: pre-tokenizer regex uses \\S inside a "
                               "class", src);
            }
            if (!in_class) sb_put(&b, negate ? "[^" : "[", negate ? 2 : 1);
            sb_ranges(&b, r, n);
            if (!in_class) sb_put(&b, "]", 1);
            p += len;
            continue;
        }
        if (*p == '[' && !in_class) in_class = true;
        else if (*p == ']' && in_class) in_class = false;
        sb_put(&b, p, 1);
        p++;
    }
    if (b.oom || !b.s) {
        free(b.s);
        return st_fail(ST_ERR_NOMEM, "%s: out of memory expanding the regex", src);
    }
    *out = b.s;
    return ST_OK;
}

static st_status tok_compile(st_tokenizer *t, const char *pattern, const char *src) {
    char *full;
    ST_TRY(expand_classes(pattern, src, &full));
    int err;
    PCRE2_SIZE eoff;
    t->re = pcre2_compile((PCRE2_SPTR)full, PCRE2_ZERO_TERMINATED,
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &eoff, NULL);
    free(full);
    if (!t->re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(err, msg, sizeof msg);
        return st_fail(ST_ERR_FORMAT, "%s: pre-tokenizer regex: %s at offset %zu", src,
                       (const char *)msg, (size_t)eoff);
    }
    t->jit = pcre2_jit_compile(t->re, PCRE2_JIT_COMPLETE) == 0;
    if (!t->jit) st_log_warn("%s: PCRE2 JIT unavailable; the pre-tokenizer runs interpreted", src);
    return st_bpe_init_internal(t);
}

void st_tokenizer_free(st_tokenizer *t) {
    if (!t) return;
    if (t->re) {
        st_bpe_free_internal(t);
        pcre2_code_free(t->re);
    }
    free(t->text);
    free(t->piece_off);
    free(t->piece_len);
    free(t->bytes);
    free(t->bytes_off);
    free(t->bytes_len);
    free(t->type);
    free(t->vocab_hash);
    free(t->merges);
    free(t->added);
    free(t);
}

// ---------------------------------------------------------------------------------------------
// GGUF

static int32_t gguf_id(const st_gguf *g, const char *key) {
    uint32_t v;
    return st_gguf_get_u32(g, key, &v) && v <= INT32_MAX ? (int32_t)v : -1;
}

st_status st_tokenizer_load_gguf(const st_gguf *g, st_tokenizer **out) {
    *out = NULL;
    const char *src = st_gguf_path(g);
    const char *s;
    size_t len;
    if (!st_gguf_get_str(g, "tokenizer.ggml.model", &s, &len))
        return st_fail(ST_ERR_FORMAT, "%s: tokenizer.ggml.model is missing", src);
    if (len != 4 || memcmp(s, "gpt2", 4) != 0)
        return st_fail(ST_ERR_UNSUPPORTED, "%s: tokenizer.ggml.model is '%.*s'; only 'gpt2' "
                       "(byte-level BPE) is supported", src, (int)len, s);
    st_pretok pre = ST_PRETOK_GPT2;
    const char *pattern = PAT_GPT2;
    if (st_gguf_get_str(g, "tokenizer.ggml.pre", &s, &len)) {
        if (len == 5 && !memcmp(s, "qwen2", 5)) pre = ST_PRETOK_QWEN2, pattern = PAT_QWEN2;
        else if (len == 9 && !memcmp(s, "llama-bpe", 9)) pre = ST_PRETOK_LLAMA3, pattern = PAT_LLAMA3;
        else if (!((len == 5 && !memcmp(s, "gpt-2", 5)) || (len == 7 && !memcmp(s, "default", 7))))
            return st_fail(ST_ERR_UNSUPPORTED, "%s: tokenizer.ggml.pre '%.*s' is not supported "
                           "(qwen2, llama-bpe, gpt-2, default)", src, (int)len, s);
    }
    st_gguf_vtype et;
    uint64_t n, nt = 0, nm = 0;
    const void *data;
    if (!st_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n, &data) || et != ST_GGUF_STRING)
        return st_fail(ST_ERR_FORMAT, "%s: tokenizer.ggml.tokens is missing or not a string array",
                       src);
    bool has_types = st_gguf_get_arr(g, "tokenizer.ggml.token_type", &et, &nt, &data);
    if (has_types && nt != n)
        return st_fail(ST_ERR_FORMAT, "%s: tokenizer.ggml.token_type has %llu entries for %llu "
                       "tokens", src, (unsigned long long)nt, (unsigned long long)n);
    if (!st_gguf_get_arr(g, "tokenizer.ggml.merges", &et, &nm, &data) || et != ST_GGUF_STRING)
        return st_fail(ST_ERR_FORMAT, "%s: tokenizer.ggml.merges is missing or not a string array",
                       src);

    st_tokenizer *t = NULL;
    st_status st = tok_alloc((int64_t)n, src, &t);
    char *buf = NULL;
    size_t cap = 0;
    for (uint64_t i = 0; st == ST_OK && i < n; i++) {
        int64_t ty = ST_TOKEN_NORMAL;
        if (!st_gguf_arr_str(g, "tokenizer.ggml.tokens", i, &s, &len) ||
            (has_types && !st_gguf_arr_i64(g, "tokenizer.ggml.token_type", i, &ty)))
            st = st_fail(ST_ERR_FORMAT, "%s: tokenizer.ggml.tokens/token_type entry %llu unreadable",
                         src, (unsigned long long)i);
        else
            st = tok_set(t, (int64_t)i, s, len, (int)ty, src);
    }
    if (st == ST_OK) st = tok_finish_vocab(t, src);
    if (st == ST_OK) st = tok_alloc_merges(t, nm, src);
    for (uint64_t i = 0; st == ST_OK && i < nm; i++) {
        if (!st_gguf_arr_str(g, "tokenizer.ggml.merges", i, &s, &len)) {
            st = st_fail(ST_ERR_FORMAT, "%s: tokenizer.ggml.merges entry %llu unreadable", src,
                         (unsigned long long)i);
            break;
        }
        // "A B": the separator is the first space after the first character.
        const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
        if (!sp) {
            st = st_fail(ST_ERR_FORMAT, "%s: tokenizer.ggml.merges entry %llu ('%.*s') has no "
                         "space", src, (unsigned long long)i, (int)len, s);
            break;
        }
        st = tok_merge(t, s, (size_t)(sp - s), sp + 1, len - (size_t)(sp - s) - 1, &buf, &cap, src);
    }
    free(buf);
    if (st == ST_OK) {
        t->pretok = pre;
        // Qwen's Hugging Face tokenizer NFC-normalizes; Llama 3's and GPT-2's do not.
        t->nfc = pre == ST_PRETOK_QWEN2;
        t->ignore_merges = pre == ST_PRETOK_LLAMA3;
        t->bos = gguf_id(g, "tokenizer.ggml.bos_token_id");
        t->eos = gguf_id(g, "tokenizer.ggml.eos_token_id");
        t->eot = gguf_id(g, "tokenizer.ggml.eot_token_id");
        t->pad = gguf_id(g, "tokenizer.ggml.padding_token_id");
        bool b;
        t->add_bos = st_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &b) && b;
        t->add_eos = st_gguf_get_bool(g, "tokenizer.ggml.add_eos_token", &b) && b;
        st = tok_finish_specials(t, src);
    }
    if (st == ST_OK) st = tok_compile(t, pattern, src);
    if (st != ST_OK) {
        st_tokenizer_free(t);
        return st;
    }
    *out = t;
    return ST_OK;
}

// ---------------------------------------------------------------------------------------------
// tokenizer.json

static bool looks_special(const char *s, size_t len) {
    return len >= 4 && s[0] == '<' && s[1] == '|' && s[len - 2] == '|' && s[len - 1] == '>';
}

// A token named in tokenizer_config.json: a string, {"content": ...}, or null.
static int32_t config_token(st_tokenizer *t, json_t *cfg, const char *key) {
    json_t *v = json_object_get(cfg, key);
    if (json_is_object(v)) v = json_object_get(v, "content");
    if (!json_is_string(v)) return -1;
    return st_token_find(t, json_string_value(v), json_string_length(v));
}

static st_status json_pretok(json_t *root, const char *src, const char **pattern) {
    json_t *pt = json_object_get(root, "pre_tokenizer");
    const char *type = json_string_value(json_object_get(pt, "type"));
    if (type && !strcmp(type, "ByteLevel")) {
        json_t *ur = json_object_get(pt, "use_regex");
        if (json_is_false(ur))
            return st_fail(ST_ERR_UNSUPPORTED, "%s: ByteLevel pre-tokenizer without a regex", src);
        if (json_is_true(json_object_get(pt, "add_prefix_space")))
            return st_fail(ST_ERR_UNSUPPORTED, "%s: add_prefix_space is not supported", src);
        *pattern = PAT_GPT2;
        return ST_OK;
    }
    json_t *seq = json_object_get(pt, "pretokenizers");
    if (type && !strcmp(type, "Sequence") && json_array_size(seq) == 2) {
        json_t *sp = json_array_get(seq, 0), *bl = json_array_get(seq, 1);
        const char *t0 = json_string_value(json_object_get(sp, "type"));
        const char *t1 = json_string_value(json_object_get(bl, "type"));
        const char *beh = json_string_value(json_object_get(sp, "behavior"));
        const char *re = json_string_value(json_object_get(json_object_get(sp, "pattern"), "Regex"));
        if (t0 && t1 && !strcmp(t0, "Split") && !strcmp(t1, "ByteLevel") && re && beh &&
            !strcmp(beh, "Isolated") && !json_is_true(json_object_get(sp, "invert")) &&
            json_is_false(json_object_get(bl, "use_regex")) &&
            !json_is_true(json_object_get(bl, "add_prefix_space"))) {
            *pattern = re;
            return ST_OK;
        }
    }
    return st_fail(ST_ERR_UNSUPPORTED, "%s: pre_tokenizer is neither ByteLevel nor "
                   "Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)]", src);
}

static st_status json_load(json_t *root, json_t *cfg, const char *src, st_tokenizer **out) {
    json_t *model = json_object_get(root, "model");
    json_t *vocab = json_object_get(model, "vocab");
    json_t *merges = json_object_get(model, "merges");
    const char *mtype = json_string_value(json_object_get(model, "type"));
    if (!json_is_object(vocab) || !json_is_array(merges) || (mtype && strcmp(mtype, "BPE")))
        return st_fail(ST_ERR_UNSUPPORTED, "%s: model is not BPE with vocab and merges", src);
    if (json_is_true(json_object_get(model, "byte_fallback")))
        return st_fail(ST_ERR_UNSUPPORTED, "%s: byte_fallback BPE is not supported", src);
    const char *pfx = json_string_value(json_object_get(model, "continuing_subword_prefix"));
    const char *sfx = json_string_value(json_object_get(model, "end_of_word_suffix"));
    if ((pfx && *pfx) || (sfx && *sfx))
        return st_fail(ST_ERR_UNSUPPORTED, "%s: subword prefixes/suffixes are not supported", src);
    json_t *norm = json_object_get(root, "normalizer");
    bool nfc = false;
    if (json_is_object(norm)) {
        const char *nt = json_string_value(json_object_get(norm, "type"));
        json_t *list = json_object_get(norm, "normalizers");
        if (nt && !strcmp(nt, "NFC")) nfc = true;
        else if (!(nt && !strcmp(nt, "Sequence") && json_array_size(list) == 0))
            return st_fail(ST_ERR_UNSUPPORTED, "%s: normalizer '%s' is not supported (NFC or "
                           "none)", src, nt ? nt : "?");
    } else if (!json_is_null(norm) && norm)
        return st_fail(ST_ERR_FORMAT, "%s: normalizer is not an object", src);
    const char *pattern = NULL;
    ST_TRY(json_pretok(root, src, &pattern));

    // Vocabulary size: the highest id among the model's vocab and the added tokens, plus one.
    int64_t maxid = -1;
    const char *key;
    json_t *v;
    json_object_foreach(vocab, key, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0)
            return st_fail(ST_ERR_FORMAT, "%s: vocab entry '%s' has no valid id", src, key);
        if (json_integer_value(v) > maxid) maxid = json_integer_value(v);
    }
    json_t *added = json_object_get(root, "added_tokens");
    size_t i;
    json_array_foreach(added, i, v) {
        json_t *id = json_object_get(v, "id"), *content = json_object_get(v, "content");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || !json_is_string(content))
            return st_fail(ST_ERR_FORMAT, "%s: added_tokens[%zu] lacks id or content", src, i);
        if (json_integer_value(id) > maxid) maxid = json_integer_value(id);
        const char *opts[] = {"lstrip", "rstrip", "single_word"};
        for (int k = 0; k < 3; k++)
            if (json_is_true(json_object_get(v, opts[k])))
                return st_fail(ST_ERR_UNSUPPORTED, "%s: added token '%s' uses %s, which is not "
                               "supported", src, json_string_value(content), opts[k]);
    }

    st_tokenizer *t = NULL;
    st_status st = tok_alloc(maxid + 1, src, &t);
    *out = t;
    if (st != ST_OK) return st;
    // Added tokens first, so that one also present in the vocab keeps its added-token type.
    json_array_foreach(added, i, v) {
        json_t *content = json_object_get(v, "content");
        int64_t id = json_integer_value(json_object_get(v, "id"));
        const char *c = json_string_value(content);
        size_t len = json_string_length(content);
        // Tokens that are special, or look special (<|...|>), are CONTROL: parsed from text only
        // on request. That is also how llama.cpp's converter types them in a GGUF.
        int type = json_is_true(json_object_get(v, "special")) || looks_special(c, len)
                       ? ST_TOKEN_CONTROL
                       : ST_TOKEN_USER_DEFINED;
        ST_TRY(tok_set(t, id, c, len, type, src));
    }
    json_object_foreach(vocab, key, v) {
        int64_t id = json_integer_value(v);
        size_t len = strlen(key); // jansson keys are NUL-terminated; vocab pieces hold no NUL
        if (t->piece_len[id] != UNSET) {
            if (t->piece_len[id] != len || memcmp(t->text + t->piece_off[id], key, len))
                return st_fail(ST_ERR_FORMAT, "%s: id %lld is both vocab '%s' and added '%s'", src,
                               (long long)id, key, t->text + t->piece_off[id]);
            continue;
        }
        ST_TRY(tok_set(t, id, key, len, ST_TOKEN_NORMAL, src));
    }
    ST_TRY(tok_finish_vocab(t, src));

    ST_TRY(tok_alloc_merges(t, json_array_size(merges), src));
    char *buf = NULL;
    size_t cap = 0;
    json_array_foreach(merges, i, v) {
        const char *a, *b;
        size_t alen, blen;
        if (json_is_string(v)) { // older format: "A B"
            const char *s = json_string_value(v);
            size_t len = json_string_length(v);
            const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
            if (!sp) {
                st = st_fail(ST_ERR_FORMAT, "%s: merges[%zu] has no space", src, i);
                break;
            }
            a = s, alen = (size_t)(sp - s), b = sp + 1, blen = len - alen - 1;
        } else if (json_is_array(v) && json_array_size(v) == 2 &&
                   json_is_string(json_array_get(v, 0)) && json_is_string(json_array_get(v, 1))) {
            a = json_string_value(json_array_get(v, 0));
            alen = json_string_length(json_array_get(v, 0));
            b = json_string_value(json_array_get(v, 1));
            blen = json_string_length(json_array_get(v, 1));
        } else {
            st = st_fail(ST_ERR_FORMAT, "%s: merges[%zu] is neither \"A B\" nor [A, B]", src, i);
            break;
        }
        st = tok_merge(t, a, alen, b, blen, &buf, &cap, src);
        if (st != ST_OK) break;
    }
    free(buf);
    ST_TRY(st);

    t->nfc = nfc;
    t->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    t->pretok = !strcmp(pattern, PAT_QWEN2)    ? ST_PRETOK_QWEN2
                : !strcmp(pattern, PAT_LLAMA3) ? ST_PRETOK_LLAMA3
                : !strcmp(pattern, PAT_GPT2)   ? ST_PRETOK_GPT2
                                               : ST_PRETOK_CUSTOM;
    if (cfg) {
        t->bos = config_token(t, cfg, "bos_token");
        t->eos = config_token(t, cfg, "eos_token");
        t->pad = config_token(t, cfg, "pad_token");
        t->add_bos = json_is_true(json_object_get(cfg, "add_bos_token"));
        t->add_eos = json_is_true(json_object_get(cfg, "add_eos_token"));
    }
    ST_TRY(tok_finish_specials(t, src));
    return tok_compile(t, pattern, src);
}

st_status st_tokenizer_load_json(const char *path, st_tokenizer **out) {
    *out = NULL;
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    if (!root)
        return st_fail(ST_ERR_FORMAT, "%s: line %d: %s", path, err.line, err.text);
    // tokenizer_config.json beside it names BOS/EOS (tokenizer.json does not).
    json_t *cfg = NULL;
    size_t plen = strlen(path);
    char *dir = malloc(plen + 32);
    if (!dir) {
        json_decref(root);
        return st_fail(ST_ERR_NOMEM, "%s: out of memory", path);
    }
    memcpy(dir, path, plen + 1);
    char *slash = strrchr(dir, '/');
    strcpy(slash ? slash + 1 : dir, "tokenizer_config.json");
    cfg = json_load_file(dir, 0, &err);
    free(dir);
    st_tokenizer *t = NULL;
    st_status st = json_load(root, cfg, path, &t);
    json_decref(root);
    if (cfg) json_decref(cfg);
    if (st != ST_OK) {
        st_tokenizer_free(t);
        return st;
    }
    *out = t;
    return ST_OK;
}
