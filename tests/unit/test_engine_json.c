// Unit tests for JSON-constrained decoding: the validator on valid and invalid documents (every
// prefix of a valid one accepted, an invalid one refused at exactly its first bad byte), escapes,
// numbers, the depth and whitespace caps; the mask on a hand-made and the real Qwen3 vocabulary.
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine.h"
#include "tokenizer/tokenizer.h"

// ---------------------------------------------------------------------------------------------
// The validator

// Feeds doc byte by byte: every prefix must be accepted; complete only once the object closed.
static void check_valid(const char *doc) {
    st_json_state s;
    st_json_init(&s);
    size_t n = strlen(doc), end = n;
    while (end && strchr(" \t\r\n", doc[end - 1])) end--; // trailing whitespace follows completion
    for (size_t i = 0; i < n; i++) {
        if (!st_json_feed(&s, doc + i, 1)) fail_msg("valid document refused at byte %zu: %s", i, doc);
        if (st_json_complete(&s) != (i + 1 >= end)) fail_msg("completion wrong after byte %zu: %s", i, doc);
    }
    st_json_state w;
    st_json_init(&w);
    assert_true(st_json_feed(&w, doc, n)); // the same in one go
    assert_true(st_json_complete(&w));
}

// Expects the longest accepted prefix of doc to be bad bytes long (the first refused byte is
// doc[bad]); a failed feed leaves the state as it was.
static void check_invalid(const char *doc, size_t bad) {
    st_json_state s;
    st_json_init(&s);
    size_t n = strlen(doc);
    for (size_t i = 0; i < n; i++) {
        st_json_state before = s;
        if (!st_json_feed(&s, doc + i, 1)) {
            if (i != bad) fail_msg("'%s': refused at byte %zu, expected %zu", doc, i, bad);
            assert_memory_equal(&s, &before, sizeof s);
            return;
        }
    }
    if (bad != n) fail_msg("'%s': every byte accepted, expected a refusal at %zu", doc, bad);
    assert_false(st_json_complete(&s)); // bad == n: a prefix that is not a whole object
}

static void test_valid_documents(void **state) {
    (void)state;
    static const char *docs[] = {
        "{}",
        "  \n\t\r{ }",
        "{} \n",
        "{\"a\":1}",
        "{\"a\": [1, 2.5, -3, true, false, null, \"x\", {}, []], \"b\": {\"c\": {\"d\": []}}}",
        "{\"\":\"\"}",
        "{\"k\" : [ [ [ ] ] , { } ] }",
        "{\"n\": [0, -0, 0.0, -0.5e+10, 1E5, 1e-3, 123456789012345678901234567890, 2.5E+07]}",
        "{\"esc\": \"\\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u00e9 \\u0000 \\uFFFF \\uD83D\\uDE00 \\ud83d\\ude00\"}",
        "{\"utf8\": \"é ü € 𝄞 \xF4\x8F\xBF\xBF\"}",
        "{\"t\":true,\"f\":false,\"z\":null}",
    };
    for (size_t i = 0; i < sizeof docs / sizeof *docs; i++) check_valid(docs[i]);
}

static void test_invalid_documents(void **state) {
    (void)state;
    static const struct { const char *doc; size_t bad; } cases[] = {
        {"[1]", 0},            // the top level is an object
        {"\"a\"", 0},
        {"1", 0},
        {"x{}", 0},
        {"{}x", 2},            // nothing after the object but whitespace
        {"{}{}", 2},
        {"{1:2}", 1},          // keys are strings
        {"{\"a\" 1}", 5},
        {"{\"a\":}", 5},
        {"{\"a\":1,}", 7},     // no trailing comma
        {"{,}", 1},
        {"{\"a\":[1,]}", 8},
        {"{\"a\":[1}", 7},     // closers must match
        {"{\"a\":{]}", 6},
        {"{\"a\":tru}", 8},
        {"{\"a\":truex}", 9},
        {"{\"a\":nul", 8},     // a prefix only
        {"{\"a\":True}", 5},
        {"{\"a\":'x'}", 5},
        {"{\"a\":\"x\ny\"}", 7}, // raw control characters in strings
        {"{\"a\":\"\\x\"}", 7},  // unknown escape
        {"{\"a\":\"\\u12G4\"}", 10},
        {"{\"a\":\"\\uDE00\"}", 9},          // a lone low surrogate
        {"{\"a\":\"\\uD83D\"}", 12},         // a high one not followed by its low half
        {"{\"a\":\"\\uD83D\\n\"}", 13},
        {"{\"a\":\"\\uD83D\\uD83D\"}", 15},
        {"{\"a\":\"\\uD83D\\u0041\"}", 14},
        {"{\"a\":\"\xC0\x80\"}", 6},         // an overlong form
        {"{\"a\":\"\xED\xA0\x80\"}", 7},     // an encoded surrogate
        {"{\"a\":\"\xF5\x80\x80\x80\"}", 6}, // past U+10FFFF
        {"{\"a\":\"\xF4\x90\x80\x80\"}", 7},
        {"{\"a\":\"\xC3\"}", 7},             // a character cut short
        {"{\"a\":\"\x80\"}", 6},
        {"{\"a\":\"x\"", 8},   // unfinished: a prefix
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) check_invalid(cases[i].doc, cases[i].bad);
}

static void test_numbers(void **state) {
    (void)state;
    static const char *good[] = {"0", "-0", "-0.5e+10", "1.25", "10", "1e5", "1E-5", "-12.0e0", "0.0001"};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        char doc[64];
        snprintf(doc, sizeof doc, "{\"n\":%s}", good[i]);
        check_valid(doc);
        snprintf(doc, sizeof doc, "{\"n\":[%s ,%s]}", good[i], good[i]);
        check_valid(doc);
    }
    // Refused at the byte shown (the prefix "{\"n\":" is 5 bytes).
    static const struct { const char *num; size_t bad; } bad[] = {
        {"01", 1}, {"-01", 2}, {"00", 1}, {"1.}", 2}, {".5", 0}, {"+1", 0}, {"1e}", 2}, {"1e+}", 3},
        {"-}", 1}, {"0x10", 1}, {"1.e5", 2}, {"1.5.2", 3}, {"1e5e", 3}, {"--1", 1}, {"- 1", 1}, {"1 2", 2},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char doc[64];
        snprintf(doc, sizeof doc, "{\"n\":%s}", bad[i].num);
        check_invalid(doc, 5 + bad[i].bad);
    }
}

static void test_depth_limit(void **state) {
    (void)state;
    // The top-level object and 63 arrays: 64 open containers, the most allowed.
    char doc[512], *p = doc;
    p += sprintf(p, "{\"a\":");
    for (int i = 1; i < ST_JSON_MAX_DEPTH; i++) *p++ = '[';
    for (int i = 1; i < ST_JSON_MAX_DEPTH; i++) *p++ = ']';
    strcpy(p, "}");
    check_valid(doc);
    // One more is refused, at that opening bracket.
    p = doc;
    p += sprintf(p, "{\"a\":");
    for (int i = 0; i < ST_JSON_MAX_DEPTH; i++) *p++ = '[';
    *p = 0;
    check_invalid(doc, 5 + ST_JSON_MAX_DEPTH - 1);
    // Objects and arrays alternating deep down keep their kinds (the stack's bits).
    p = doc;
    for (int i = 0; i < ST_JSON_MAX_DEPTH / 2; i++) p += sprintf(p, "{\"k\":[");
    for (int i = 0; i < ST_JSON_MAX_DEPTH / 2; i++) p += sprintf(p, "]}");
    check_valid(doc);
    p = doc;
    for (int i = 0; i < ST_JSON_MAX_DEPTH / 2; i++) p += sprintf(p, "{\"k\":[");
    size_t at = (size_t)(p - doc);
    strcpy(p, "}");
    check_invalid(doc, at);
}

static void test_whitespace_cap(void **state) {
    (void)state;
    // ST_JSON_MAX_WS bytes of whitespace in a row pass anywhere between tokens; one more does not.
    char doc[256], *p = doc;
    memset(p, ' ', ST_JSON_MAX_WS), p += ST_JSON_MAX_WS;
    p += sprintf(p, "{");
    memset(p, '\n', ST_JSON_MAX_WS), p += ST_JSON_MAX_WS;
    p += sprintf(p, "\"a\":1");
    memset(p, '\t', ST_JSON_MAX_WS), p += ST_JSON_MAX_WS;
    strcpy(p, "}");
    check_valid(doc);
    memset(doc, ' ', ST_JSON_MAX_WS + 1);
    strcpy(doc + ST_JSON_MAX_WS + 1, "{}");
    check_invalid(doc, ST_JSON_MAX_WS);
    p = doc + sprintf(doc, "{\"a\": 12");
    size_t at = (size_t)(p - doc) + ST_JSON_MAX_WS; // after a number too
    memset(p, ' ', ST_JSON_MAX_WS + 1), p += ST_JSON_MAX_WS + 1;
    strcpy(p, "}");
    check_invalid(doc, at);
    // Inside strings whitespace is text: no cap.
    p = doc + sprintf(doc, "{\"a\": \"");
    memset(p, ' ', 3 * ST_JSON_MAX_WS), p += 3 * ST_JSON_MAX_WS;
    strcpy(p, "\"}");
    check_valid(doc);
}

// ---------------------------------------------------------------------------------------------
// The mask

static const char *byte_form(int b, char *buf) { // GPT-2's byte -> code point, UTF-8 encoded
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

static void write_piece(FILE *f, const char *bytes) { // as a JSON string of byte-level characters
    fputc('"', f);
    for (const unsigned char *b = (const unsigned char *)bytes; *b; b++) {
        char buf[4];
        const char *s = byte_form(*b, buf);
        if (*s == '"' || *s == '\\') fputc('\\', f);
        fputs(s, f);
    }
    fputc('"', f);
}

// A small vocabulary: the 256 bytes, then words that cross the grammar's boundaries, then a
// control token (<|endoftext|>, the end of generation) and a user-defined one (<think>).
static const char *words[] = {
    "{\"", "\":", " true", "true", "}\n", "\"}", "abc", "12", "-0", ".5", "e+", "\\u", "D83D", "\\uDE00", "\\n",
    "\xC3\xA9", "},", "]}", "[{", "  ", "\n}", "null}", " {\"a\": 1}", "\"\"", ":\"", "}}", "nul", "01", "\"a\\",
    "\xE2\x82", "\x82\xAC", "a\"b", "\t\n", "{}", "{} ",
};
#define N_WORDS (sizeof words / sizeof *words)

static st_tokenizer *small_vocab(void) {
    char dir[] = "/tmp/strata-test-json-XXXXXX", path[64];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    int n = 256 + (int)N_WORDS;
    fprintf(f, "{\"version\": \"1.0\", \"added_tokens\": ["
               "{\"id\": %d, \"content\": \"<|endoftext|>\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, "
               "\"normalized\": false, \"special\": true}, "
               "{\"id\": %d, \"content\": \"<think>\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, "
               "\"normalized\": false, \"special\": false}], "
               "\"normalizer\": null, \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, "
               "\"trim_offsets\": true, \"use_regex\": true}, \"post_processor\": null, \"decoder\": {\"type\": \"ByteLevel\"}, "
               "\"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, \"byte_fallback\": false, \"vocab\": {",
            n, n + 1);
    for (int b = 0; b < 256; b++) {
        char s[2] = {(char)b, 0}, buf[4];
        if (b == 0) { // the NUL byte cannot go through a C string: write its form directly
            fprintf(f, "\"%s\": 0", byte_form(0, buf));
            continue;
        }
        fprintf(f, ", ");
        write_piece(f, s);
        fprintf(f, ": %d", b);
    }
    for (size_t i = 0; i < N_WORDS; i++) {
        fprintf(f, ", ");
        write_piece(f, words[i]);
        fprintf(f, ": %zu", 256 + i);
    }
    fprintf(f, "}, \"merges\": []}}\n");
    fclose(f);
    st_tokenizer *t;
    st_status st = st_tokenizer_load_json(path, &t);
    unlink(path);
    rmdir(dir);
    if (st) fail_msg("load: %s", st_error());
    return t;
}

// The mask must leave exactly the tokens that a feed of their bytes accepts (the end of
// generation: only once complete). Returns the count left.
static int check_mask_against_feed(const st_json_vocab *v, const st_tokenizer *tok, const st_json_state *s, int n_logits) {
    float *l = malloc(sizeof(float) * (size_t)n_logits);
    assert_non_null(l);
    for (int i = 0; i < n_logits; i++) l[i] = (float)(i % 7);
    int left = st_json_mask(v, s, l, n_logits), count = 0;
    int n_tok = st_tokenizer_n_vocab(tok);
    for (int id = 0; id < n_logits; id++) {
        bool want = false;
        if (id < n_tok) {
            st_token_type ty = st_token_get_type(tok, id);
            size_t len;
            const char *b = st_token_bytes(tok, id, &len);
            st_json_state t = *s;
            if (st_token_is_eog(tok, id)) want = st_json_complete(s);
            else if (ty == ST_TOKEN_NORMAL || ty == ST_TOKEN_BYTE) want = len && st_json_feed(&t, b, len);
        }
        bool kept = l[id] != -INFINITY;
        if (kept != want) fail_msg("token %d: the mask %s it, a feed says %s", id, kept ? "keeps" : "drops", want ? "yes" : "no");
        if (kept && l[id] != (float)(id % 7)) fail_msg("token %d: a kept logit changed", id);
        assert_int_equal(st_json_token_ok(v, s, id), want);
        count += kept;
    }
    assert_int_equal(left, count);
    free(l);
    return left;
}

static const char *mask_docs[] = {
    "  {\"a\": [1, -0.5e+10, true, null, {\"b\": \"x\\u00e9\\uD83D\\uDE00 \xC3\xA9\xE2\x82\xAC\"}], \"c\": {}} \n",
    "{\"\":[[],{}],\"k\":\"\\n\\\"\"}",
};

static void test_mask_small_vocab(void **state) {
    (void)state;
    st_tokenizer *tok = small_vocab();
    st_json_vocab *v;
    assert_int_equal(st_json_vocab_create(tok, &v), ST_OK);
    int n_logits = st_tokenizer_n_vocab(tok) + 3; // a model's head may have rows past the vocabulary
    for (size_t d = 0; d < sizeof mask_docs / sizeof *mask_docs; d++) {
        st_json_state s;
        st_json_init(&s);
        const char *doc = mask_docs[d];
        for (size_t i = 0;; i++) { // every prefix's state
            int left = check_mask_against_feed(v, tok, &s, n_logits);
            assert_true(left > 0);
            if (!doc[i]) break;
            assert_true(st_json_feed(&s, doc + i, 1));
        }
        assert_true(st_json_complete(&s));
    }
    // Spot checks by name.
    int32_t eog = st_token_find(tok, "<|endoftext|>", 13), think = st_token_find(tok, "<think>", 7);
    assert_true(eog >= 0 && think >= 0 && st_token_is_eog(tok, eog));
    st_json_state s;
    st_json_init(&s);
    assert_false(st_json_token_ok(v, &s, eog));
    assert_false(st_json_token_ok(v, &s, think));
    assert_true(st_json_token_ok(v, &s, 256 + 0));  // {"
    assert_true(st_json_token_ok(v, &s, 256 + 33)); // {}
    assert_false(st_json_token_ok(v, &s, 256 + 3)); // true
    assert_true(st_json_feed(&s, "{}", 2));
    assert_true(st_json_token_ok(v, &s, eog));
    assert_false(st_json_token_ok(v, &s, think));
    assert_true(st_json_token_ok(v, &s, 256 + 32));  // "\t\n"
    assert_false(st_json_token_ok(v, &s, 256 + 34)); // "{} "
    st_json_vocab_free(v);
    st_tokenizer_free(tok);
}

// ---------------------------------------------------------------------------------------------
// The real Qwen3 vocabulary (151,643 tokens + specials): the mask is exact on sampled states,
// and its cost per token is printed (skipped when the file is not there).

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void test_mask_qwen3_vocab(void **state) {
    (void)state;
    const char *root = getenv("STRATA_SOURCE_DIR");
    char path[1024];
    snprintf(path, sizeof path, "%s/../shared/data/qwen3-tokenizer/tokenizer.json", root ? root : ".");
    if (access(path, R_OK)) skip();
    st_tokenizer *tok;
    if (st_tokenizer_load_json(path, &tok)) fail_msg("load: %s", st_error());
    double t0 = now_s();
    st_json_vocab *v;
    assert_int_equal(st_json_vocab_create(tok, &v), ST_OK);
    double t_index = now_s() - t0;
    int n_logits = 151936; // Qwen3's head
    const char *doc = "{\"name\": \"Ada Lovelace\", \"born\": 1815, \"tags\": [\"math\", \"poetry\\n\", true, null],"
                      " \"ratio\": -0.5e+10, \"nested\": {\"k\": {}}}";
    float *l = malloc(sizeof(float) * (size_t)n_logits);
    assert_non_null(l);
    st_json_state s;
    st_json_init(&s);
    double t_mask = 0, worst = 0;
    int n_mask = 0;
    for (size_t i = 0; doc[i]; i++) {
        if (i % 9 == 0) check_mask_against_feed(v, tok, &s, n_logits); // exact on a sample of states
        for (int k = 0; k < n_logits; k++) l[k] = 0;
        double a = now_s();
        int left = st_json_mask(v, &s, l, n_logits);
        double dt = now_s() - a;
        t_mask += dt, worst = dt > worst ? dt : worst, n_mask++;
        assert_true(left > 0);
        assert_true(st_json_feed(&s, doc + i, 1));
    }
    assert_true(st_json_complete(&s));
    print_message("qwen3 vocabulary (%d tokens): index built in %.1f ms; mask %.3f ms per token on average, %.3f ms at "
                  "worst, over %d states\n", st_tokenizer_n_vocab(tok), t_index * 1e3, t_mask / n_mask * 1e3, worst * 1e3,
                  n_mask);
    free(l);
    st_json_vocab_free(v);
    st_tokenizer_free(tok);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_documents),
        cmocka_unit_test(test_invalid_documents),
        cmocka_unit_test(test_numbers),
        cmocka_unit_test(test_depth_limit),
        cmocka_unit_test(test_whitespace_cap),
        cmocka_unit_test(test_mask_small_vocab),
        cmocka_unit_test(test_mask_qwen3_vocab),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
