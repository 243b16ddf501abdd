// Unit tests for the server's output parser (src/server/parse.c): reasoning and Qwen3 / Qwen3-Coder
// tool calls out of canned model outputs, fed whole, byte by byte and split at every point (markup
// split across streamed pieces must never reach the content).
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "server/server.h"

typedef struct result {
    char content[4096], reasoning[4096];
    char names[8][64], args[8][512];
    int n_calls;
    int order[32]; // kinds in the order they came (consecutive text of one kind counted once)
    int n_order;
} result;

static void collect(void *ctx, const st_out_event *ev) {
    result *r = ctx;
    if (!r->n_order || r->order[r->n_order - 1] != (int)ev->kind || ev->kind == ST_OUT_TOOL_CALL)
        if (r->n_order < 32) r->order[r->n_order++] = (int)ev->kind;
    if (ev->kind == ST_OUT_TOOL_CALL) {
        assert_true(r->n_calls < 8);
        snprintf(r->names[r->n_calls], 64, "%s", ev->name);
        snprintf(r->args[r->n_calls], 512, "%s", ev->arguments);
        r->n_calls++;
        return;
    }
    assert_true(ev->len > 0); // no empty pieces
    char *dst = ev->kind == ST_OUT_CONTENT ? r->content : r->reasoning;
    strncat(dst, ev->text, ev->len);
}

static json_t *tools(void) {
    return json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\","
                      "\"properties\":{\"city\":{\"type\":\"string\"},\"days\":{\"type\":\"integer\"},"
                      "\"opts\":{\"type\":\"object\"},\"note\":{\"type\":[\"string\",\"null\"]}}}}}]",
                      0, NULL);
}

// Feeds text cut at the given points (sorted, within the text).
static void run_split(const char *text, bool in_reasoning, const json_t *t, const size_t *cuts, int n_cuts, result *r) {
    memset(r, 0, sizeof *r);
    st_out_parser *p;
    assert_int_equal(st_out_parser_create(in_reasoning, t, &p), ST_OK);
    size_t at = 0, len = strlen(text);
    for (int i = 0; i <= n_cuts; i++) {
        size_t to = i < n_cuts ? cuts[i] : len;
        assert_int_equal(st_out_parser_push(p, text + at, to - at, collect, r), ST_OK);
        at = to;
    }
    assert_int_equal(st_out_parser_finish(p, collect, r), ST_OK);
    st_out_parser_free(p);
}

static void run(const char *text, bool in_reasoning, const json_t *t, result *r) { run_split(text, in_reasoning, t, NULL, 0, r); }

static void assert_same(const result *a, const result *b) {
    assert_string_equal(a->content, b->content);
    assert_string_equal(a->reasoning, b->reasoning);
    assert_int_equal(a->n_calls, b->n_calls);
    for (int i = 0; i < a->n_calls; i++) {
        assert_string_equal(a->names[i], b->names[i]);
        assert_string_equal(a->args[i], b->args[i]);
    }
}

// The same result whether the text comes whole, a byte at a time, or in two pieces cut anywhere.
static void check_streaming(const char *text, bool in_reasoning, const json_t *t, const result *whole) {
    size_t len = strlen(text);
    result r;
    size_t *cuts = calloc(len + 1, sizeof(size_t));
    for (size_t i = 0; i < len; i++) cuts[i] = i + 1;
    run_split(text, in_reasoning, t, cuts, len ? (int)len - 1 : 0, &r);
    assert_same(whole, &r);
    for (size_t c = 1; c < len; c++) {
        run_split(text, in_reasoning, t, &c, 1, &r);
        assert_same(whole, &r);
        assert_null(strstr(r.content, "<tool_call>"));
        assert_null(strstr(r.content, "<think>"));
    }
    free(cuts);
}

static void test_plain_content(void **state) {
    (void)state;
    result r;
    run("Hello, world!\n\nHow are you?", false, NULL, &r);
    assert_string_equal(r.content, "Hello, world!\n\nHow are you?");
    assert_string_equal(r.reasoning, "");
    assert_int_equal(r.n_calls, 0);
    check_streaming("Hello, world!\n\nHow are you?", false, NULL, &r);
}

static void test_reasoning(void **state) {
    (void)state;
    const char *text = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello there.";
    result r;
    run(text, false, NULL, &r);
    assert_string_equal(r.reasoning, "The user greets me.\nI greet back.");
    assert_string_equal(r.content, "Hello there.");
    assert_int_equal(r.n_order, 2);
    assert_int_equal(r.order[0], ST_OUT_REASONING);
    check_streaming(text, false, NULL, &r);
}

static void test_reasoning_opened_by_prompt(void **state) {
    (void)state;
    const char *text = "thinking hard</think>\n\nanswer";
    result r;
    run(text, true, NULL, &r);
    assert_string_equal(r.reasoning, "thinking hard");
    assert_string_equal(r.content, "answer");
    check_streaming(text, true, NULL, &r);
}

static void test_think_after_content_is_text(void **state) {
    (void)state;
    result r;
    run("Use the <think> tag like this.", false, NULL, &r);
    assert_string_equal(r.content, "Use the <think> tag like this.");
    assert_string_equal(r.reasoning, "");
}

static void test_qwen3_json_tool_call(void **state) {
    (void)state;
    json_t *t = tools();
    const char *text = "<think>\nI need the weather.\n</think>\n\nLet me check.\n<tool_call>\n"
                       "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>";
    result r;
    run(text, false, t, &r);
    assert_string_equal(r.reasoning, "I need the weather.");
    assert_string_equal(r.content, "Let me check.");
    assert_int_equal(r.n_calls, 1);
    assert_string_equal(r.names[0], "get_weather");
    assert_string_equal(r.args[0], "{\"city\":\"Paris\",\"days\":3}");
    check_streaming(text, false, t, &r);
    json_decref(t);
}

static void test_qwen3_coder_xml_tool_call(void **state) {
    (void)state;
    json_t *t = tools();
    const char *text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
                       "<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"units\": \"metric\"}\n</parameter>\n"
                       "<parameter=note>\n42\nlines two\n</parameter>\n</function>\n</tool_call>";
    result r;
    run(text, false, t, &r);
    assert_string_equal(r.content, "");
    assert_int_equal(r.n_calls, 1);
    assert_string_equal(r.names[0], "get_weather");
    // Typed parameters are JSON, strings stay text (also a number-looking one), newlines inside kept.
    assert_string_equal(r.args[0], "{\"city\":\"New York\",\"days\":3,\"opts\":{\"units\":\"metric\"},\"note\":\"42\\nlines two\"}");
    check_streaming(text, false, t, &r);
    json_decref(t);
}

static void test_two_calls_and_text_between(void **state) {
    (void)state;
    json_t *t = tools();
    const char *text = "First.<tool_call>{\"name\":\"get_weather\",\"arguments\":{\"city\":\"A\"}}</tool_call>\n\n"
                       "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\": \\\"B\\\"}\"}\n</tool_call>\n";
    result r;
    run(text, false, t, &r);
    assert_string_equal(r.content, "First.");
    assert_int_equal(r.n_calls, 2);
    assert_string_equal(r.args[0], "{\"city\":\"A\"}");
    assert_string_equal(r.args[1], "{\"city\":\"B\"}"); // arguments given as a JSON string
    check_streaming(text, false, t, &r);
    json_decref(t);
}

static void test_no_tools_leaves_markup_as_text(void **state) {
    (void)state;
    const char *text = "<tool_call>\n{\"name\": \"x\"}\n</tool_call>";
    result r;
    run(text, false, NULL, &r);
    assert_int_equal(r.n_calls, 0);
    assert_string_equal(r.content, text);
}

static void test_unfinished_and_malformed_calls(void **state) {
    (void)state;
    json_t *t = tools();
    result r;
    // Cut off after a complete body (the closing tag never came): still a call.
    run("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n", false, t, &r);
    assert_int_equal(r.n_calls, 1);
    assert_string_equal(r.args[0], "{}");
    // A body that is no call is given back as text rather than lost.
    run("<tool_call>\nnot a call\n</tool_call>", false, t, &r);
    assert_int_equal(r.n_calls, 0);
    assert_non_null(strstr(r.content, "not a call"));
    run("<tool_call>{\"arguments\": {}}</tool_call>", false, t, &r); // no name
    assert_int_equal(r.n_calls, 0);
    json_decref(t);
}

static void test_parse_tool_call_errors(void **state) {
    (void)state;
    char *name, *args;
    assert_int_equal(st_parse_tool_call("{\"name\":\"f\",\"arguments\":[1]}", 28, NULL, &name, &args), ST_ERR_FORMAT);
    assert_null(name);
    assert_int_equal(st_parse_tool_call("<function=f", 11, NULL, &name, &args), ST_ERR_FORMAT);
    const char *x = "<function=f>\n<parameter=a>\n1\n</function>";
    assert_int_equal(st_parse_tool_call(x, strlen(x), NULL, &name, &args), ST_OK); // unclosed value: up to </function>
    assert_string_equal(name, "f");
    assert_string_equal(args, "{\"a\":\"1\"}"); // no schema: text
    free(name), free(args);
    const char *y = "{\"name\":\"g\"}";
    assert_int_equal(st_parse_tool_call(y, strlen(y), NULL, &name, &args), ST_OK);
    assert_string_equal(args, "{}");
    free(name), free(args);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plain_content),
        cmocka_unit_test(test_reasoning),
        cmocka_unit_test(test_reasoning_opened_by_prompt),
        cmocka_unit_test(test_think_after_content_is_text),
        cmocka_unit_test(test_qwen3_json_tool_call),
        cmocka_unit_test(test_qwen3_coder_xml_tool_call),
        cmocka_unit_test(test_two_calls_and_text_between),
        cmocka_unit_test(test_no_tools_leaves_markup_as_text),
        cmocka_unit_test(test_unfinished_and_malformed_calls),
        cmocka_unit_test(test_parse_tool_call_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
