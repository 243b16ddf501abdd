// Unit tests for chat templates: rendering (expected texts produced by jinja2 in Hugging Face's
// configuration), error messages with line and column, the render limits, and the GGUF source.

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "tokenizer/tokenizer.h"

// Parses `src`, renders with the JSON variables `vars` and returns the text (NULL on failure,
// with *status set).
static char *render(const char *src, const char *vars, const st_chat_limits *lim, st_status *status) {
    st_chat_template *t = NULL;
    char *out = NULL;
    size_t len = 0;
    *status = st_chat_template_parse(src, strlen(src), "t.jinja", &t);
    if (*status != ST_OK) return NULL;
    json_error_t e;
    json_t *v = json_loads(vars, 0, &e);
    assert_non_null(v);
    *status = st_chat_template_render(t, v, lim, &out, &len);
    json_decref(v);
    st_chat_template_free(t);
    if (*status == ST_OK) assert_int_equal(strlen(out), len);
    return out;
}

static void expect(const char *src, const char *vars, const char *want) {
    st_status s;
    char *got = render(src, vars, NULL, &s);
    if (s != ST_OK) fail_msg("render failed: %s", st_error());
    assert_string_equal(got, want);
    free(got);
}

static void test_render(void **state) {
    (void)state;
    expect("{% for m in messages %}{{ loop.index }}:{{ m.role }}={{ m.content | trim }}{{ ';' if not loop.last }}{% endfor %}",
           "{\"messages\": [{\"role\": \"user\", \"content\": \" hi \"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}",
           "1:user=hi;2:assistant=yo");
    expect("{%- set ns = namespace(n=0) -%}\n{%- for x in xs -%}\n  {%- set ns.n = ns.n + x -%}\n{%- endfor -%}\n{{ ns.n }}",
           "{\"xs\": [1, 2, 3]}", "6");
    expect("{{ d | tojson }}|{{ d | tojson(indent=2) }}",
           "{\"d\": {\"a\": [1, 2.5, null, true], \"\\u00e9\": \"\\\"q\\\"\\n\"}}",
           "{\"a\": [1, 2.5, null, true], \"\u00e9\": \"\\\"q\\\"\\n\"}|{\n  \"a\": [\n    1,\n    2.5,\n    null,\n"
           "    true\n  ],\n  \"\u00e9\": \"\\\"q\\\"\\n\"\n}");
    expect("{{ s[::-1] }}|{{ s.split('</think>')[-1].lstrip('\\n') }}|{{ s | length }}",
           "{\"s\": \"<think>x</think>\\n\\nh\\u00e9\"}", "\u00e9h\n\n>kniht/<x>kniht<|h\u00e9|20");
    expect("  {% if x is defined and x is not none %}\n  yes {{ x }}\n  {% else %}\n  no\n  {% endif %}\n",
           "{\"x\": 1.0}", "  yes 1.0\n");
    expect("{% macro tag(name, body='') %}<{{ name }}>{{ body }}</{{ name }}>{% endmacro %}{{ tag('a') }}{{ tag('b', body=[1, 'x']) }}",
           "{}", "<a></a><b>[1, 'x']</b>");
    expect("{{ missing }}{{ missing | length }}{% for x in missing %}x{% endfor %}", "{}", "0");
}

// An error's message must name the template, the line and the column.
static void expect_error(const char *src, const char *vars, const st_chat_limits *lim, const char *needle) {
    st_status s;
    char *got = render(src, vars, lim, &s);
    if (s == ST_OK) fail_msg("expected an error containing '%s', got '%s'", needle, got);
    assert_null(got);
    const char *msg = st_error();
    if (!strstr(msg, needle)) fail_msg("error '%s' does not contain '%s'", msg, needle);
    assert_non_null(strstr(msg, "t.jinja"));
}

static void test_syntax_errors(void **state) {
    (void)state;
    expect_error("{% if x %}\nno end", "{}", NULL, "missing {% endif %}");
    expect_error("a\nb {{ x | nofilter }}", "{}", NULL, "t.jinja:2:");
    expect_error("a\nb {{ x | nofilter }}", "{}", NULL, "no filter named 'nofilter'");
    expect_error("{{ x is nosuchtest }}", "{}", NULL, "t.jinja:1:");
    expect_error("{% for %}", "{}", NULL, "t.jinja:1:8");
    expect_error("{{ 'open }}", "{}", NULL, "unterminated string");
    expect_error("{% endif %}", "{}", NULL, "unexpected 'endif'");
    expect_error("{{ a ]] }}", "{}", NULL, "t.jinja:1:");
    expect_error("{% extends 'base' %}", "{}", NULL, "not supported");
    expect_error("{# never closed", "{}", NULL, "missing end of comment");
}

static void test_runtime_errors(void **state) {
    (void)state;
    expect_error("line1\n{{ raise_exception('no system prompt allowed') }}", "{}", NULL,
                 "t.jinja:2:4: template raised an exception: no system prompt allowed");
    expect_error("{{ x.y.z }}", "{\"x\": {}}", NULL, "'dict object' has no attribute 'y'");
    expect_error("{{ 'a' + 1 }}", "{}", NULL, "can only concatenate str");
    expect_error("{{ 1 // 0 }}", "{}", NULL, "by zero");
    expect_error("{% for x in 5 %}{% endfor %}", "{}", NULL, "'int' object is not iterable");
    expect_error("{% set l = [1] %}{{ l.append(2) }}", "{}", NULL, "unsafe");
}

static void test_limits(void **state) {
    (void)state;
    st_chat_limits lim = {.max_output = 100};
    expect_error("{% for i in range(1000) %}xx{% endfor %}", "{}", &lim, "output is longer than 100 bytes");
    lim = (st_chat_limits){.max_steps = 1000};
    expect_error("{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}", "{}", &lim,
                 "more than 1000 steps");
    lim = (st_chat_limits){.max_depth = 10};
    expect_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "{}", &lim, "nested deeper than 10");
    lim = (st_chat_limits){.max_memory = 1 << 20};
    expect_error("{% set s = namespace(x='ab') %}{% for i in range(40) %}{% set s.x = s.x ~ s.x %}{% endfor %}",
                 "{}", &lim, "memory budget");
    expect_error("{{ range(1000000) | length }}", "{}", NULL, "range too big");
    // deep structures a template builds, and very tall expressions, are refused, not recursed
    expect_error("{% set ns = namespace(x=[]) %}{% for i in range(2000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}",
                 "{}", NULL, "nested deeper than 512");
    expect_error("{% set ns = namespace(x=[]) %}{% for i in range(2000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x < ns.x }}",
                 "{}", NULL, "nested deeper than 512");
    char *chain = malloc(6 * 3000 + 16);
    size_t k = 0;
    k += (size_t)sprintf(chain + k, "{{ 'a'");
    for (int i = 0; i < 1500; i++) k += (size_t)sprintf(chain + k, " ~ 'a'");
    sprintf(chain + k, " }}");
    expect_error(chain, "{}", NULL, "expression nested deeper than 1000");
    free(chain);
    // within the limits, the same kind of template renders
    lim = (st_chat_limits){.max_steps = 100000};
    st_status s;
    char *ok = render("{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}done", "{}", &lim, &s);
    assert_int_equal(s, ST_OK);
    assert_string_equal(ok, "done");
    free(ok);
}

static char *read_template(const char *name) {
    const char *root = getenv("STRATA_SOURCE_DIR");
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/data/templates/%s", root ? root : ".", name);
    char *src;
    size_t n;
    if (st_read_file(path, &src, &n) != ST_OK) return NULL;
    return src;
}

// The real Qwen3 template through st_chat_apply: the thinking switch and a tool round trip.
static void test_qwen3_apply(void **state) {
    (void)state;
    char *src = read_template("qwen3.jinja");
    if (!src) skip();
    st_chat_template *t;
    assert_int_equal(st_chat_template_parse(src, strlen(src), "qwen3.jinja", &t), ST_OK);
    free(src);
    json_t *msgs = json_loads("[{\"role\": \"system\", \"content\": \"Be brief.\"},"
                              " {\"role\": \"user\", \"content\": \"Weather in Paris?\"},"
                              " {\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"type\": \"function\","
                              "  \"function\": {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}}]},"
                              " {\"role\": \"tool\", \"content\": \"sunny\"}]", 0, NULL);
    json_t *extra = json_pack("{s:b}", "enable_thinking", 0);
    assert_non_null(msgs);
    char *out;
    size_t len;
    assert_int_equal(st_chat_apply(t, msgs, NULL, true, extra, &out, &len), ST_OK);
    assert_string_equal(out, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                             "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                             "{\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n"
                             "sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
    free(out);
    assert_int_equal(st_chat_apply(t, msgs, NULL, false, NULL, &out, &len), ST_OK);
    static const char tail[] = "</tool_response><|im_end|>\n"; // no generation prompt after it
    assert_true(len >= sizeof tail - 1);
    assert_string_equal(out + len - (sizeof tail - 1), tail);
    free(out);
    json_decref(msgs);
    json_decref(extra);
    st_chat_template_free(t);
}

static void test_from_gguf(void **state) {
    (void)state;
    char path[] = "/tmp/strata_chat_test_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    st_gguf_writer *w = st_gguf_writer_create();
    assert_int_equal(st_gguf_writer_add_str(w, "general.architecture", "qwen3"), ST_OK);
    assert_int_equal(st_gguf_writer_add_str(w, "tokenizer.chat_template",
                                            "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"), ST_OK);
    assert_int_equal(st_gguf_writer_write(w, path), ST_OK);
    st_gguf_writer_free(w);
    st_gguf *g;
    assert_int_equal(st_gguf_open(path, &g), ST_OK);
    st_chat_template *t;
    assert_int_equal(st_chat_template_from_gguf(g, &t), ST_OK);
    st_gguf_free(g);
    json_t *msgs = json_loads("[{\"role\": \"user\", \"content\": \"x\"}]", 0, NULL);
    char *out;
    size_t len;
    assert_int_equal(st_chat_apply(t, msgs, NULL, true, NULL, &out, &len), ST_OK);
    assert_string_equal(out, "[user]x");
    free(out);
    json_decref(msgs);
    st_chat_template_free(t);

    // a GGUF without a template: a clear error
    w = st_gguf_writer_create();
    assert_int_equal(st_gguf_writer_add_str(w, "general.architecture", "qwen3"), ST_OK);
    assert_int_equal(st_gguf_writer_write(w, path), ST_OK);
    st_gguf_writer_free(w);
    assert_int_equal(st_gguf_open(path, &g), ST_OK);
    assert_int_equal(st_chat_template_from_gguf(g, &t), ST_ERR_FORMAT);
    assert_non_null(strstr(st_error(), "tokenizer.chat_template"));
    st_gguf_free(g);
    unlink(path);
}

// Random byte soup and mutated real templates must parse or fail cleanly, and render or fail
// cleanly: never crash (run under ASan/UBSan).
static void test_garbage_never_crashes(void **state) {
    (void)state;
    char *src = read_template("qwen3-coder-v1.jinja");
    if (!src) skip();
    size_t n = strlen(src);
    char *buf = malloc(n + 1);
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    static const char pieces[] = "{}%#-+|.()[]'\"~:,=!<>\n ";
    json_t *vars = json_loads("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\","
                              " \"content\": \"yo\", \"tool_calls\": [{\"function\": {\"name\": \"f\", \"arguments\": {\"a\": 1}}}]}],"
                              " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": \"d\","
                              " \"parameters\": {\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}}}}}],"
                              " \"add_generation_prompt\": true}", 0, NULL);
    assert_non_null(vars);
    st_chat_limits lim = {.max_steps = 20000, .max_output = 1 << 20, .max_memory = 64 << 20};
    int parsed = 0, rendered = 0;
    for (int iter = 0; iter < 300; iter++) {
        memcpy(buf, src, n + 1);
        int edits = 1 + iter % 4;
        for (int e = 0; e < edits; e++) {
            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
            size_t at = (size_t)(rng % n);
            buf[at] = pieces[(rng >> 32) % (sizeof pieces - 1)];
        }
        st_chat_template *t;
        if (st_chat_template_parse(buf, n, "fuzz", &t) != ST_OK) {
            assert_true(strlen(st_error()) > 0);
            continue;
        }
        parsed++;
        char *out = NULL;
        size_t len;
        if (st_chat_template_render(t, vars, &lim, &out, &len) == ST_OK) rendered++;
        free(out);
        st_chat_template_free(t);
    }
    assert_true(parsed > 0);
    (void)rendered;
    json_decref(vars);
    free(buf);
    free(src);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_render),
        cmocka_unit_test(test_syntax_errors),
        cmocka_unit_test(test_runtime_errors),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_qwen3_apply),
        cmocka_unit_test(test_from_gguf),
        cmocka_unit_test(test_garbage_never_crashes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
