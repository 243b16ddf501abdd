// Unit tests for the server's response writer (src/server/api.c): canned model output with
// reasoning and a tool call, turned into OpenAI and Anthropic responses, whole and streamed (the
// tool call's markup split across updates).
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "server/server.h"

static const char OUTPUT[] = "<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n"
                             "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

static st_gen_request request(st_api api, bool stream) {
    st_gen_request r = {.api = api, .stream = stream, .include_usage = true, .model_name = "m"};
    r.tools = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{}}}]", 0, NULL);
    return r;
}

// Runs the output through a writer in updates cut at `cut` (0: one update); returns all bytes.
static char *write_all(const st_gen_request *r, size_t cut) {
    st_api_writer *w;
    assert_int_equal(st_api_writer_create(r, &w), ST_OK);
    size_t n = strlen(OUTPUT), total = 0;
    char *all = calloc(1, 1);
    size_t pieces[2][2] = {{0, cut ? cut : n}, {cut ? cut : n, n}};
    for (int i = 0; i < 2; i++) {
        st_job_update u = {.prompt_total = 30, .prompt_cached = 10, .prompt_read = 30, .started = true};
        u.len = pieces[i][1] - pieces[i][0];
        u.text = u.len ? strndup(OUTPUT + pieces[i][0], u.len) : NULL;
        u.done = i == 1;
        u.stats = (strata_generate_stats){.n_prompt = 20, .n_generated = 25, .stop_reason = "eog"};
        char *out;
        size_t len;
        assert_int_equal(st_api_writer_update(w, &u, &out, &len), ST_OK);
        free(u.text);
        if (len) {
            all = realloc(all, total + len + 1);
            memcpy(all + total, out, len);
            total += len;
            all[total] = 0;
        }
        free(out);
    }
    st_api_writer_free(w);
    return all;
}

static void test_openai_whole(void **state) {
    (void)state;
    st_gen_request r = request(ST_API_CHAT, false);
    char *body = write_all(&r, 0);
    json_t *v = json_loads(body, 0, NULL);
    assert_non_null(v);
    json_t *choice = json_array_get(json_object_get(v, "choices"), 0), *msg = json_object_get(choice, "message");
    assert_string_equal(json_string_value(json_object_get(choice, "finish_reason")), "tool_calls");
    assert_string_equal(json_string_value(json_object_get(msg, "content")), "Checking.");
    assert_string_equal(json_string_value(json_object_get(msg, "reasoning_content")), "The user wants weather.");
    json_t *call = json_array_get(json_object_get(msg, "tool_calls"), 0), *f = json_object_get(call, "function");
    assert_string_equal(json_string_value(json_object_get(f, "name")), "get_weather");
    assert_string_equal(json_string_value(json_object_get(f, "arguments")), "{\"city\":\"Paris\"}");
    assert_string_equal(json_string_value(json_object_get(call, "type")), "function");
    assert_true(!strncmp(json_string_value(json_object_get(call, "id")), "call_", 5));
    json_t *usage = json_object_get(v, "usage");
    assert_int_equal(json_integer_value(json_object_get(usage, "prompt_tokens")), 30);
    assert_int_equal(json_integer_value(json_object_get(usage, "completion_tokens")), 25);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(usage, "prompt_tokens_details"), "cached_tokens")), 10);
    json_decref(v);
    free(body);
    json_decref(r.tools);
}

static void test_openai_stream_split_everywhere(void **state) {
    (void)state;
    st_gen_request r = request(ST_API_CHAT, true);
    for (size_t cut = 1; cut < strlen(OUTPUT); cut++) {
        char *sse = write_all(&r, cut);
        // Every event is a chunk; the deltas add up; the markup never shows.
        char content[256] = "", reasoning[256] = "", *p = sse, *end;
        int calls = 0;
        const char *finish = NULL;
        bool usage = false, done = false;
        while ((end = strstr(p, "\n\n"))) {
            *end = 0;
            assert_true(!strncmp(p, "data: ", 6));
            if (!strcmp(p + 6, "[DONE]")) done = true;
            else {
                json_t *v = json_loads(p + 6, 0, NULL);
                assert_non_null(v);
                json_t *c = json_array_get(json_object_get(v, "choices"), 0), *d = json_object_get(c, "delta");
                if (json_string_value(json_object_get(d, "content"))) strcat(content, json_string_value(json_object_get(d, "content")));
                if (json_string_value(json_object_get(d, "reasoning_content")))
                    strcat(reasoning, json_string_value(json_object_get(d, "reasoning_content")));
                json_t *tc = json_array_get(json_object_get(d, "tool_calls"), 0);
                if (tc) {
                    calls++;
                    assert_int_equal(json_integer_value(json_object_get(tc, "index")), 0);
                    assert_string_equal(json_string_value(json_object_get(json_object_get(tc, "function"), "arguments")),
                                        "{\"city\":\"Paris\"}");
                }
                if (json_string_value(json_object_get(c, "finish_reason"))) finish = "tool_calls";
                if (json_object_get(v, "usage")) usage = true;
                json_decref(v);
            }
            p = end + 2;
        }
        assert_string_equal(content, "Checking.");
        assert_string_equal(reasoning, "The user wants weather.");
        assert_int_equal(calls, 1);
        assert_non_null(finish);
        assert_true(usage && done);
        free(sse);
    }
    json_decref(r.tools);
}

static void test_anthropic_stream_and_whole(void **state) {
    (void)state;
    st_gen_request r = request(ST_API_ANTHROPIC, true);
    char *sse = write_all(&r, 57);
    const char *order[] = {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
                           "content_block_start", "content_block_delta", "content_block_stop", "content_block_start",
                           "content_block_delta", "content_block_stop", "message_delta", "message_stop"};
    char *p = sse;
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
        p = strstr(p, "event: ");
        assert_non_null(p);
        p += 7;
        assert_true(!strncmp(p, order[i], strlen(order[i])));
    }
    assert_non_null(strstr(sse, "\"thinking_delta\""));
    assert_non_null(strstr(sse, "\"type\":\"tool_use\""));
    assert_non_null(strstr(sse, "\"partial_json\":\"{\\\"city\\\":\\\"Paris\\\"}\""));
    assert_non_null(strstr(sse, "\"stop_reason\":\"tool_use\""));
    assert_null(strstr(sse, "<tool_call>"));
    free(sse);
    r.stream = false;
    char *body = write_all(&r, 0);
    json_t *v = json_loads(body, 0, NULL), *blocks = json_object_get(v, "content");
    assert_int_equal(json_array_size(blocks), 3);
    assert_string_equal(json_string_value(json_object_get(json_array_get(blocks, 0), "type")), "thinking");
    assert_string_equal(json_string_value(json_object_get(json_array_get(blocks, 1), "text")), "Checking.");
    json_t *tu = json_array_get(blocks, 2);
    assert_string_equal(json_string_value(json_object_get(tu, "type")), "tool_use");
    assert_string_equal(json_string_value(json_object_get(json_object_get(tu, "input"), "city")), "Paris");
    assert_string_equal(json_string_value(json_object_get(v, "stop_reason")), "tool_use");
    json_decref(v);
    free(body);
    json_decref(r.tools);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_openai_whole),
        cmocka_unit_test(test_openai_stream_split_everywhere),
        cmocka_unit_test(test_anthropic_stream_and_whole),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
