// Unit tests for the BPE tokenizer on small synthetic vocabularies: heap-ordered merges against
// a naive reference, added/control token matching, GGUF vs tokenizer.json loading, NFC, the
// streaming decoder against an independent lossy UTF-8 reference, threads, and load errors.
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tokenizer/bpe_nfc.h"
#include "tokenizer/tokenizer.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(uint32_t n) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state % n);
}

// ---------------------------------------------------------------------------------------------
// A synthetic byte-level vocabulary: the 256 byte tokens, then tokens made by merging random
// pairs over the letters a-e (so long random words exercise many merges), then added tokens.

#define MAXTOK 2048
static char *tok_str[MAXTOK]; // byte-level form
static int n_tok;
static int merge_a[MAXTOK], merge_b[MAXTOK], n_merge;

static const char *byte_form(int b, char *buf) { // GPT-2 byte -> code point, UTF-8 encoded
    int cp;
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255)) cp = b;
    else {
        int n = 0;
        for (int x = 0; x < b; x++)
            if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) n++;
        cp = 256 + n;
    }
    if (cp < 0x80) buf[0] = (char)cp, buf[1] = 0;
    else buf[0] = (char)(0xC0 | (cp >> 6)), buf[1] = (char)(0x80 | (cp & 0x3F)), buf[2] = 0;
    return buf;
}

static int find_tok(const char *s) {
    for (int i = 0; i < n_tok; i++)
        if (!strcmp(tok_str[i], s)) return i;
    return -1;
}

static void build_vocab(void) {
    if (n_tok) return;
    char buf[4];
    for (int b = 0; b < 256; b++) tok_str[n_tok++] = strdup(byte_form(b, buf));
    // Letters a-e are tokens 'a'..'e' (ids 97..101 in this table). Merge random pairs of
    // existing letter tokens; the result joins the vocabulary.
    int letters[MAXTOK], n_letters = 0;
    for (int c = 'a'; c <= 'e'; c++) letters[n_letters++] = c;
    while (n_merge < 600) {
        int a = letters[rnd((uint32_t)n_letters)], b = letters[rnd((uint32_t)n_letters)];
        size_t la = strlen(tok_str[a]), lb = strlen(tok_str[b]);
        if (la + lb > 12) continue;
        char s[32];
        memcpy(s, tok_str[a], la);
        memcpy(s + la, tok_str[b], lb + 1);
        bool dup = false;
        for (int m = 0; m < n_merge; m++) dup |= merge_a[m] == a && merge_b[m] == b;
        if (dup) continue;
        int id = find_tok(s);
        if (id < 0) {
            id = n_tok;
            tok_str[n_tok++] = strdup(s);
            letters[n_letters++] = id;
        }
        merge_a[n_merge] = a, merge_b[n_merge] = b, n_merge++;
    }
}

static const char *added[] = {"<|ctl|>", "<|ctl|>x", "<u>", "<u>v", "<|end|>"};
static const bool added_special[] = {true, true, false, false, true};
#define N_ADDED 5

static void json_escape(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

static const char *pretok_json = "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, "
                                 "\"trim_offsets\": true, \"use_regex\": true}";

// Writes the vocabulary as a tokenizer.json (GPT-2 pattern unless pretok_json is changed).
static void write_json(const char *path, bool nfc) {
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "{\"version\": \"1.0\", \"added_tokens\": [");
    for (int i = 0; i < N_ADDED; i++) {
        fprintf(f, "%s{\"id\": %d, \"content\": ", i ? ", " : "", n_tok + i);
        json_escape(f, added[i]);
        fprintf(f, ", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, "
                   "\"normalized\": false, \"special\": %s}", added_special[i] ? "true" : "false");
    }
    fprintf(f, "], \"normalizer\": %s, \"pre_tokenizer\": %s, \"post_processor\": null, \"decoder\": {\"type\": \"ByteLevel\"}, "
               "\"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, "
               "\"byte_fallback\": false, \"vocab\": {", nfc ? "{\"type\": \"NFC\"}" : "null", pretok_json);
    for (int i = 0; i < n_tok; i++) {
        if (i) fprintf(f, ", ");
        json_escape(f, tok_str[i]);
        fprintf(f, ": %d", i);
    }
    fprintf(f, "}, \"merges\": [");
    for (int m = 0; m < n_merge; m++) {
        fprintf(f, m ? ", [" : "[");
        json_escape(f, tok_str[merge_a[m]]);
        fprintf(f, ", ");
        json_escape(f, tok_str[merge_b[m]]);
        fprintf(f, "]");
    }
    fprintf(f, "]}}\n");
    fclose(f);
}

static char tmpdir[64];

static st_tokenizer *load_synthetic(bool nfc) {
    build_vocab();
    if (!tmpdir[0]) {
        snprintf(tmpdir, sizeof tmpdir, "/tmp/strata-test-bpe-XXXXXX");
        assert_non_null(mkdtemp(tmpdir));
    }
    char path[128];
    snprintf(path, sizeof path, "%s/tokenizer.json", tmpdir);
    write_json(path, nfc);
    st_tokenizer *t;
    st_status st = st_tokenizer_load_json(path, &t);
    if (st != ST_OK) fail_msg("load: %s", st_error());
    unlink(path);
    return t;
}

// The textbook algorithm: repeatedly merge the lowest-rank adjacent pair, leftmost on ties.
static size_t naive_bpe(const char *word, size_t n, int32_t *out) {
    size_t k = n;
    for (size_t i = 0; i < n; i++) {
        char buf[4];
        out[i] = find_tok(byte_form((unsigned char)word[i], buf));
    }
    for (;;) {
        int best = -1;
        size_t at = 0;
        for (size_t i = 0; i + 1 < k; i++)
            for (int m = 0; m < n_merge; m++)
                if (merge_a[m] == out[i] && merge_b[m] == out[i + 1] && (best < 0 || m < best)) {
                    best = m, at = i;
                    break;
                }
        if (best < 0) return k;
        char s[64];
        snprintf(s, sizeof s, "%s%s", tok_str[merge_a[best]], tok_str[merge_b[best]]);
        out[at] = find_tok(s);
        memmove(out + at + 1, out + at + 2, (k - at - 2) * sizeof *out);
        k--;
    }
}

static void test_merges_match_naive(void **state) {
    (void)state;
    st_tokenizer *t = load_synthetic(false);
    char word[700];
    int32_t ref[700];
    for (int iter = 0; iter < 400; iter++) {
        // Short words hit the cache on repeats; words over 256 bytes bypass it.
        size_t n = iter % 10 == 0 ? 257 + rnd(400) : 1 + rnd(40);
        for (size_t i = 0; i < n; i++) word[i] = (char)('a' + rnd(iter % 3 == 0 ? 2 : 5));
        size_t nref = naive_bpe(word, n, ref);
        for (int rep = 0; rep < 2; rep++) {
            int32_t *ids;
            size_t nids;
            assert_int_equal(st_tokenize(t, word, n, 0, &ids, &nids), ST_OK);
            assert_int_equal(nids, nref);
            assert_memory_equal(ids, ref, nref * sizeof *ids);
            free(ids);
        }
    }
    st_tokenizer_free(t);
}

static void tokens_of(st_tokenizer *t, const char *text, unsigned flags, int32_t *out, size_t *n) {
    int32_t *ids;
    assert_int_equal(st_tokenize(t, text, strlen(text), flags, &ids, n), ST_OK);
    memcpy(out, ids, *n * sizeof *ids);
    free(ids);
}

static void test_added_tokens(void **state) {
    (void)state;
    st_tokenizer *t = load_synthetic(false);
    int32_t ctl = n_tok, ctlx = n_tok + 1, u = n_tok + 2, uv = n_tok + 3, end = n_tok + 4;
    assert_int_equal(st_token_get_type(t, ctl), ST_TOKEN_CONTROL);
    assert_int_equal(st_token_get_type(t, u), ST_TOKEN_USER_DEFINED);
    assert_int_equal(st_token_get_type(t, 97), ST_TOKEN_NORMAL);
    int32_t ids[64];
    size_t n;
    // Leftmost-longest: "<|ctl|>x" beats "<|ctl|>"; "<u>v" beats "<u>".
    tokens_of(t, "<|ctl|>x<u>v<u><|ctl|>", ST_TOKENIZE_SPECIAL, ids, &n);
    assert_int_equal(n, 4);
    assert_int_equal(ids[0], ctlx);
    assert_int_equal(ids[1], uv);
    assert_int_equal(ids[2], u);
    assert_int_equal(ids[3], ctl);
    // Without special parsing control tokens are text; user-defined ones still match.
    tokens_of(t, "<|ctl|>x<u>", 0, ids, &n);
    assert_true(n > 2);
    assert_int_equal(ids[n - 1], u);
    for (size_t i = 0; i + 1 < n; i++) assert_true(ids[i] < n_tok);
    // Decoding gives the text back; skip_control drops control tokens only.
    tokens_of(t, "ab<|end|>cd<u>", ST_TOKENIZE_SPECIAL, ids, &n);
    char *out;
    size_t len;
    assert_int_equal(st_detokenize(t, ids, n, false, &out, &len), ST_OK);
    assert_string_equal(out, "ab<|end|>cd<u>");
    free(out);
    assert_int_equal(st_detokenize(t, ids, n, true, &out, &len), ST_OK);
    assert_string_equal(out, "abcd<u>");
    free(out);
    assert_true(st_token_is_eog(t, end)); // "<|end|>" is an end-of-generation name
    assert_false(st_token_is_eog(t, u));
    assert_int_equal(st_token_find(t, "<u>", 3), u);
    assert_int_equal(st_token_find(t, "nope", 4), -1);
    int32_t bad = 1 << 30;
    assert_int_equal(st_detokenize(t, &bad, 1, false, &out, &len), ST_ERR_RANGE);
    st_tokenizer_free(t);
}

// The same vocabulary through a GGUF (written with the gguf writer) tokenizes identically.
static void test_gguf_matches_json(void **state) {
    (void)state;
    st_tokenizer *tj = load_synthetic(false);
    int n = n_tok + N_ADDED;
    const char **toks = malloc(n * sizeof *toks);
    int32_t *types = malloc(n * sizeof *types);
    char **merges = malloc(n_merge * sizeof *merges);
    for (int i = 0; i < n_tok; i++) toks[i] = tok_str[i], types[i] = ST_TOKEN_NORMAL;
    for (int i = 0; i < N_ADDED; i++)
        toks[n_tok + i] = added[i],
        types[n_tok + i] = added_special[i] ? ST_TOKEN_CONTROL : ST_TOKEN_USER_DEFINED;
    for (int m = 0; m < n_merge; m++) {
        merges[m] = malloc(strlen(tok_str[merge_a[m]]) + strlen(tok_str[merge_b[m]]) + 2);
        sprintf(merges[m], "%s %s", tok_str[merge_a[m]], tok_str[merge_b[m]]);
    }
    st_gguf_writer *w = st_gguf_writer_create();
    assert_int_equal(st_gguf_writer_add_str(w, "tokenizer.ggml.model", "gpt2"), ST_OK);
    assert_int_equal(st_gguf_writer_add_str(w, "tokenizer.ggml.pre", "gpt-2"), ST_OK);
    assert_int_equal(st_gguf_writer_add_str_arr(w, "tokenizer.ggml.tokens", toks, (uint64_t)n), ST_OK);
    assert_int_equal(st_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", ST_GGUF_I32, types,
                                            (uint64_t)n), ST_OK);
    assert_int_equal(st_gguf_writer_add_str_arr(w, "tokenizer.ggml.merges",
                                                (const char *const *)merges, (uint64_t)n_merge), ST_OK);
    assert_int_equal(st_gguf_writer_add_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)(n - 1)), ST_OK);
    assert_int_equal(st_gguf_writer_add_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)n_tok), ST_OK);
    assert_int_equal(st_gguf_writer_add_bool(w, "tokenizer.ggml.add_bos_token", true), ST_OK);
    char path[128];
    snprintf(path, sizeof path, "%s/tok.gguf", tmpdir);
    assert_int_equal(st_gguf_writer_write(w, path), ST_OK);
    st_gguf_writer_free(w);
    st_gguf *g;
    assert_int_equal(st_gguf_open(path, &g), ST_OK);
    st_tokenizer *tg;
    st_status st = st_tokenizer_load_gguf(g, &tg);
    if (st != ST_OK) fail_msg("gguf load: %s", st_error());
    st_gguf_free(g);
    unlink(path);
    assert_int_equal(st_tokenizer_eos(tg), n - 1);
    assert_int_equal(st_tokenizer_bos(tg), n_tok);
    assert_true(st_tokenizer_add_bos(tg));
    {   // BOS only when asked for, and only because the metadata says so
        int32_t a[16];
        size_t na;
        tokens_of(tg, "ab", ST_TOKENIZE_ADD_BOS, a, &na);
        assert_true(na >= 2);
        assert_int_equal(a[0], n_tok);
        assert_int_not_equal(a[na - 1], n - 1); // add_eos_token is absent: no EOS
        tokens_of(tg, "ab", 0, a, &na);
        assert_int_not_equal(a[0], n_tok);
        tokens_of(tj, "ab", ST_TOKENIZE_ADD_BOS, a, &na); // the JSON has no tokenizer_config
        assert_int_not_equal(a[0], n_tok);
    }
    assert_int_equal(st_tokenizer_n_vocab(tg), n);
    const char *texts[] = {"abcabcdeed  ee\n\n<|ctl|>x<u>v caf\xc3\xa9 12345 'll!!", "",
                           "deadbeef <|end|> a\xff\xfe b", "   \t\t\r\n"};
    for (unsigned flags = 0; flags < 2; flags++)
        for (size_t k = 0; k < sizeof texts / sizeof *texts; k++) {
            int32_t a[128], b[128];
            size_t na, nb;
            tokens_of(tj, texts[k], flags, a, &na);
            tokens_of(tg, texts[k], flags, b, &nb);
            assert_int_equal(na, nb);
            assert_memory_equal(a, b, na * sizeof *a);
        }
    st_tokenizer_free(tg);
    st_tokenizer_free(tj);
    for (int m = 0; m < n_merge; m++) free(merges[m]);
    free(merges);
    free(types);
    free(toks);
}

// Concurrent calls on one tokenizer: one uses the shared cache, the others their own memory.
typedef struct thread_arg {
    st_tokenizer *t;
    const char *text;
    int32_t *ids;
    size_t n;
    st_status st;
} thread_arg;

static void *thread_fn(void *p) {
    thread_arg *a = p;
    for (int i = 0; i < 20; i++) {
        free(a->ids);
        a->st = st_tokenize(a->t, a->text, strlen(a->text), 0, &a->ids, &a->n);
        if (a->st != ST_OK) break;
    }
    return NULL;
}

static void test_threads(void **state) {
    (void)state;
    st_tokenizer *t = load_synthetic(false);
    static char text[20000];
    for (size_t i = 0; i + 1 < sizeof text; i++) text[i] = "abcde  ab\n"[rnd(10)];
    thread_arg args[4] = {{0}};
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        args[i].t = t, args[i].text = text;
        assert_int_equal(pthread_create(&th[i], NULL, thread_fn, &args[i]), 0);
    }
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(args[i].st, ST_OK);
        assert_int_equal(args[i].n, args[0].n);
        assert_memory_equal(args[i].ids, args[0].ids, args[0].n * sizeof(int32_t));
    }
    for (int i = 0; i < 4; i++) free(args[i].ids);
    st_tokenizer_free(t);
}

// ---------------------------------------------------------------------------------------------
// NFC

static void check_nfc(const char *in, const char *want) {
    st_nfc_scratch s = {0};
    const char *out;
    size_t len;
    int r = st_nfc(in, strlen(in), &s, &out, &len);
    assert_true(r >= 0);
    if (r == 0) out = in, len = strlen(in);
    if (len != strlen(want) || memcmp(out, want, len)) fail_msg("NFC of '%s' is '%.*s'", in, (int)len, out);
    st_nfc_scratch_free(&s);
}

static void test_nfc(void **state) {
    (void)state;
    check_nfc("plain ascii", "plain ascii");
    check_nfc("caf\xc3\xa9", "caf\xc3\xa9");                              // already NFC
    check_nfc("cafe\xcc\x81", "caf\xc3\xa9");                             // e + acute
    check_nfc("\xe2\x84\xab", "\xc3\x85");                                // U+212B -> U+00C5
    check_nfc("a\xcc\x81\xcc\xa3", "\xe1\xba\xa1\xcc\x81");               // reorder, then compose
    check_nfc("\xc3\x84\xcc\xa3", "\xe1\xba\xa0\xcc\x88");                // A-umlaut + dot below
    check_nfc("\xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8", "\xea\xb0\x81");  // jamo L V T -> syllable
    check_nfc("\xea\xb0\x80\xe1\x86\xa8", "\xea\xb0\x81");              // LV + T
    check_nfc("\xcc\x81x", "\xcc\x81x");                                  // leading mark stays
    check_nfc("e\xff\xcc\x81", "e\xff\xcc\x81");                          // invalid byte blocks
    check_nfc("\xe0\xa5\x98", "\xe0\xa4\x95\xe0\xa4\xbc");                // exclusion U+0958
}

// ---------------------------------------------------------------------------------------------
// Streaming decoder

// Independent reference: Unicode's "maximal subpart" replacement, written from Table 3-7
// (well-formed byte sequences) as an explicit list of ranges.
static size_t ref_lossy(const unsigned char *s, size_t n, char *out) {
    static const unsigned char rows[][8] = {
        // lead lo, lead hi, then (lo, hi) for each continuation byte; 0,0 = none
        {0xC2, 0xDF, 0x80, 0xBF, 0, 0, 0, 0},       {0xE0, 0xE0, 0xA0, 0xBF, 0x80, 0xBF, 0, 0},
        {0xE1, 0xEC, 0x80, 0xBF, 0x80, 0xBF, 0, 0}, {0xED, 0xED, 0x80, 0x9F, 0x80, 0xBF, 0, 0},
        {0xEE, 0xEF, 0x80, 0xBF, 0x80, 0xBF, 0, 0}, {0xF0, 0xF0, 0x90, 0xBF, 0x80, 0xBF, 0x80, 0xBF},
        {0xF1, 0xF3, 0x80, 0xBF, 0x80, 0xBF, 0x80, 0xBF}, {0xF4, 0xF4, 0x80, 0x8F, 0x80, 0xBF, 0x80, 0xBF},
    };
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        if (s[i] < 0x80) {
            out[o++] = (char)s[i++];
            continue;
        }
        const unsigned char *row = NULL;
        for (size_t r = 0; r < sizeof rows / sizeof *rows; r++)
            if (s[i] >= rows[r][0] && s[i] <= rows[r][1]) row = rows[r];
        size_t k = 1;
        if (row)
            for (int c = 0; c < 3 && row[2 + 2 * c]; c++) {
                if (i + k >= n || s[i + k] < row[2 + 2 * c] || s[i + k] > row[3 + 2 * c]) break;
                k++;
            }
        size_t full = row ? (size_t)(1 + (row[4] ? 1 : 0) + (row[6] ? 1 : 0) + 1) : 1;
        if (row && k == full) memcpy(out + o, s + i, k), o += k;
        else memcpy(out + o, "\xEF\xBF\xBD", 3), o += 3;
        i += k;
    }
    return o;
}

static bool valid_utf8(const char *s, size_t n) {
    char tmp[4096];
    assert_true(n * 3 < sizeof tmp);
    return ref_lossy((const unsigned char *)s, n, tmp) == n && !memcmp(tmp, s, n);
}

static void test_stream_decoder(void **state) {
    (void)state;
    st_tokenizer *t = load_synthetic(false);
    st_detok_stream *ds = st_detok_stream_create(t, false);
    assert_non_null(ds);
    // Byte tokens of random byte strings, biased to UTF-8-looking sequences.
    static const unsigned char pool[] = {'a', ' ', 0xC3, 0xA9, 0xE4, 0xBD, 0xA0, 0xF0, 0x9F,
                                         0x98, 0x80, 0xED, 0xA0, 0x80, 0xBF, 0xF4, 0x90, 0xC0,
                                         0xFF, 0xE0, 0x9F, 0xF5, 0x8F};
    char buf[4096], ref[4096];
    for (int iter = 0; iter < 3000; iter++) {
        unsigned char bytes[64];
        size_t n = 1 + rnd(40), o = 0;
        for (size_t i = 0; i < n; i++) bytes[i] = pool[rnd(sizeof pool)];
        for (size_t i = 0; i < n; i++) {
            char b[4];
            byte_form(bytes[i], b);
            int32_t id = st_token_find(t, b, strlen(b));
            const char *out;
            size_t len;
            assert_int_equal(st_detok_stream_push(ds, id, &out, &len), ST_OK);
            assert_true(valid_utf8(out, len));
            memcpy(buf + o, out, len), o += len;
        }
        const char *out;
        size_t len;
        assert_int_equal(st_detok_stream_flush(ds, &out, &len), ST_OK);
        assert_true(valid_utf8(out, len));
        memcpy(buf + o, out, len), o += len;
        size_t nref = ref_lossy(bytes, n, ref);
        if (o != nref || memcmp(buf, ref, o)) fail_msg("stream decode differs at iteration %d", iter);
    }
    int32_t bad = -1;
    const char *out;
    size_t len;
    assert_int_equal(st_detok_stream_push(ds, bad, &out, &len), ST_ERR_RANGE);
    st_detok_stream_free(ds);
    st_tokenizer_free(t);
}

// ---------------------------------------------------------------------------------------------
// Load errors name the file and the problem.

static void expect_load_error(const char *json, const char *needle) {
    char path[128];
    snprintf(path, sizeof path, "%s/bad.json", tmpdir);
    FILE *f = fopen(path, "w");
    fputs(json, f);
    fclose(f);
    st_tokenizer *t = (st_tokenizer *)1;
    assert_int_not_equal(st_tokenizer_load_json(path, &t), ST_OK);
    assert_null(t);
    if (!strstr(st_error(), needle)) fail_msg("error '%s' lacks '%s'", st_error(), needle);
    assert_non_null(strstr(st_error(), "bad.json"));
    unlink(path);
}

static void test_load_errors(void **state) {
    (void)state;
    build_vocab();
    if (!tmpdir[0]) {
        snprintf(tmpdir, sizeof tmpdir, "/tmp/strata-test-bpe-XXXXXX");
        assert_non_null(mkdtemp(tmpdir));
    }
    expect_load_error("{", "line");
    expect_load_error("{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}", "BPE");
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []},"
                      " \"pre_tokenizer\": {\"type\": \"ByteLevel\"}}", "vocabulary");
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}, "
                      "\"normalizer\": {\"type\": \"NFKC\"}, \"pre_tokenizer\": null}", "NFKC");
    st_tokenizer *t;
    assert_int_equal(st_tokenizer_load_json("/nonexistent/tokenizer.json", &t), ST_ERR_FORMAT);
    assert_non_null(strstr(st_error(), "/nonexistent/tokenizer.json"));
}

// A tokenizer.json regex that can match empty text: empty matches make no pieces, unmatched text
// is kept, and decoding gives the text back.
static void test_custom_regex_empty_matches(void **state) {
    (void)state;
    const char *saved = pretok_json;
    pretok_json = "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", "
                  "\"pattern\": {\"Regex\": \"a*\"}, \"behavior\": \"Isolated\", \"invert\": false}, "
                  "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": false}]}";
    st_tokenizer *t = load_synthetic(true);
    pretok_json = saved;
    assert_int_equal(st_tokenizer_pretok(t), ST_PRETOK_CUSTOM);
    assert_true(st_tokenizer_nfc(t));
    const char *texts[] = {"bab", "aaaa", "b", "xyz\xff", "baab cafe\xcc\x81"};
    const char *want[] = {"bab", "aaaa", "b", "xyz\xff", "baab caf\xc3\xa9"};
    for (size_t k = 0; k < sizeof texts / sizeof *texts; k++) {
        int32_t *ids;
        size_t n;
        assert_int_equal(st_tokenize(t, texts[k], strlen(texts[k]), 0, &ids, &n), ST_OK);
        char *out;
        size_t len;
        assert_int_equal(st_detokenize(t, ids, n, false, &out, &len), ST_OK);
        assert_string_equal(out, want[k]);
        free(out);
        free(ids);
    }
    st_tokenizer_free(t);
}

static int teardown(void **state) {
    (void)state;
    if (tmpdir[0]) rmdir(tmpdir);
    for (int i = 0; i < n_tok; i++) free(tok_str[i]);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_merges_match_naive), cmocka_unit_test(test_added_tokens),
        cmocka_unit_test(test_gguf_matches_json),  cmocka_unit_test(test_threads),
        cmocka_unit_test(test_nfc),                cmocka_unit_test(test_stream_decoder),
        cmocka_unit_test(test_load_errors),        cmocka_unit_test(test_custom_regex_empty_matches),
    };
    return cmocka_run_group_tests(tests, NULL, teardown);
}
