// server: the OpenAI (chat completions, completions) and Anthropic (messages) request shapes
// turned into a rendered, tokenized prompt and generation parameters, with every malformed field
// named; and the job's output turned back into their response shapes, streamed (SSE) or whole.

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/server.h"

#define MAX_STOP 16 // stop strings a request may give (OpenAI allows 4)

__attribute__((format(printf, 4, 5))) static bool fail(st_http_error *e, int status, const char *param,
                                                       const char *fmt, ...) {
    e->status = status;
    e->type = status == 400 ? "invalid_request_error" : status == 503 ? "server_busy" : "server_error";
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return false;
}

// A field's value when present and not null, else NULL.
static json_t *field(const json_t *o, const char *name) {
    json_t *v = json_object_get(o, name);
    return json_is_null(v) ? NULL : v;
}

static const char *type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE: case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

static bool get_bool(const json_t *o, const char *name, bool *out, st_http_error *e) {
    json_t *v = field(o, name);
    if (!v) return true;
    if (!json_is_boolean(v)) return fail(e, 400, name, "%s: expected a boolean, got %s", name, type_name(v));
    *out = json_is_true(v);
    return true;
}

static bool get_num(const json_t *o, const char *name, double lo, double hi, float *out, st_http_error *e) {
    json_t *v = field(o, name);
    if (!v) return true;
    if (!json_is_number(v)) return fail(e, 400, name, "%s: expected a number, got %s", name, type_name(v));
    double x = json_number_value(v);
    if (!(x >= lo && x <= hi)) return fail(e, 400, name, "%s: %g is not in [%g, %g]", name, x, lo, hi);
    *out = (float)x;
    return true;
}

static bool get_int(const json_t *o, const char *name, long long lo, long long hi, int *out, st_http_error *e) {
    json_t *v = field(o, name);
    if (!v) return true;
    if (!json_is_integer(v)) return fail(e, 400, name, "%s: expected an integer, got %s", name, type_name(v));
    long long x = json_integer_value(v);
    if (x < lo || x > hi) return fail(e, 400, name, "%s: %lld is not in [%lld, %lld]", name, x, lo, hi);
    *out = (int)x;
    return true;
}

// Sampling and length fields shared by the three APIs (each reads its own names; an absent
// field keeps the server's default).
static bool parse_sampling(const json_t *b, const st_server_config *cfg, st_gen_request *r, st_http_error *e) {
    strata_sampling *s = &r->gen.sampling;
    *s = cfg->sampling;
    if (!cfg->seed_set) { // no configured seed: a new one per request, as the APIs behave
        static uint64_t counter;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        s->seed = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ __atomic_add_fetch(&counter, 0x9e3779b97f4a7c15ull, __ATOMIC_RELAXED);
    }
    if (!get_num(b, "temperature", 0, 100, &s->temperature, e) || !get_num(b, "top_p", 0, 1, &s->top_p, e) ||
        !get_num(b, "min_p", 0, 1, &s->min_p, e) || !get_int(b, "top_k", 0, 1 << 24, &s->top_k, e) ||
        !get_num(b, "presence_penalty", -100, 100, &s->presence_penalty, e) ||
        !get_num(b, "frequency_penalty", -100, 100, &s->frequency_penalty, e) ||
        !get_num(b, "repeat_penalty", 0, 100, &s->repeat_penalty, e) ||
        !get_num(b, "repetition_penalty", 0, 100, &s->repeat_penalty, e) ||
        !get_int(b, "repeat_last_n", 0, 1 << 24, &s->penalty_last_n, e) ||
        !get_int(b, "penalty_last_n", 0, 1 << 24, &s->penalty_last_n, e))
        return false;
    if (field(b, "top_p") && s->top_p <= 0) return fail(e, 400, "top_p", "top_p: must be above 0");
    if ((field(b, "repeat_penalty") || field(b, "repetition_penalty")) && s->repeat_penalty <= 0)
        return fail(e, 400, "repetition_penalty", "repetition_penalty: must be above 0");
    json_t *seed = field(b, "seed");
    if (seed && !json_is_integer(seed)) return fail(e, 400, "seed", "seed: expected an integer, got %s", type_name(seed));
    if (seed) s->seed = (uint64_t)json_integer_value(seed);
    r->gen.max_tokens = cfg->max_tokens;
    json_t *n = field(b, "n");
    if (n && (!json_is_integer(n) || json_integer_value(n) != 1))
        return fail(e, 400, "n", "n: only 1 choice per request is supported");
    return true;
}

// "stop" / "stop_sequences": a string or an array of strings.
static bool parse_stop(const json_t *b, const char *name, bool allow_string, st_gen_request *r, st_http_error *e) {
    json_t *v = field(b, name);
    if (!v) return true;
    size_t n = json_is_array(v) ? json_array_size(v) : 1;
    if (!(json_is_array(v) || (allow_string && json_is_string(v))))
        return fail(e, 400, name, "%s: expected %san array of strings, got %s", name, allow_string ? "a string or " : "",
                    type_name(v));
    if (n > MAX_STOP) return fail(e, 400, name, "%s: at most %d stop strings", name, MAX_STOP);
    r->stop = calloc(n + 1, sizeof *r->stop);
    if (!r->stop) return fail(e, 500, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_is_array(v) ? json_array_get(v, i) : v;
        if (!json_is_string(x)) return fail(e, 400, name, "%s[%zu]: expected a string, got %s", name, i, type_name(x));
        if (!json_string_length(x)) continue;
        r->stop[r->gen.n_stop++] = strdup(json_string_value(x));
    }
    r->gen.stop = (const char *const *)r->stop;
    return true;
}

void st_gen_request_free(st_gen_request *r) {
    for (int i = 0; r->stop && i < r->gen.n_stop; i++) free(r->stop[i]);
    free(r->stop);
    free(r->ids);
    free(r->model_name);
    json_decref(r->tools);
    memset(r, 0, sizeof *r);
}

// ---------------------------------------------------------------------------------------------
// Messages

// A content field as one string: a string, or text parts joined ("text" parts; OpenAI's
// {"type":"text","text":...} and Anthropic's text blocks have the same shape).
static bool content_text(const json_t *c, const char *where, char **out, st_http_error *e) {
    if (!c) return (*out = strdup("")) != NULL || fail(e, 500, NULL, "out of memory");
    if (json_is_string(c)) return (*out = strdup(json_string_value(c))) != NULL || fail(e, 500, NULL, "out of memory");
    if (!json_is_array(c))
        return fail(e, 400, where, "%s: expected a string or an array of content parts, got %s", where, type_name(c));
    size_t len = 0, i;
    json_t *p;
    json_array_foreach(c, i, p) {
        const char *type = json_string_value(json_object_get(p, "type"));
        json_t *t = json_object_get(p, "text");
        if (!json_is_object(p) || !type)
            return fail(e, 400, where, "%s[%zu]: expected a content part {\"type\": ..., ...}", where, i);
        if (strcmp(type, "text"))
            return fail(e, 400, where, "%s[%zu]: content parts of type '%s' are not supported (text only)", where, i, type);
        if (!json_is_string(t)) return fail(e, 400, where, "%s[%zu].text: expected a string", where, i);
        len += json_string_length(t) + 1;
    }
    char *s = malloc(len + 1);
    if (!s) return fail(e, 500, NULL, "out of memory");
    size_t at = 0;
    json_array_foreach(c, i, p) {
        json_t *t = json_object_get(p, "text");
        if (at) s[at++] = '\n';
        memcpy(s + at, json_string_value(t), json_string_length(t));
        at += json_string_length(t);
    }
    s[at] = 0;
    *out = s;
    return true;
}

// A tool call's arguments as the templates want them: an object (Qwen3-Coder's iterates its
// items); text that is not a JSON object stays text.
static json_t *arguments_value(json_t *a) {
    if (json_is_string(a)) {
        json_t *o = json_loads(json_string_value(a), 0, NULL);
        if (json_is_object(o)) return o;
        json_decref(o);
        return json_incref(a);
    }
    return a ? json_incref(a) : json_object();
}

// OpenAI messages -> the template's messages: content always a string, developer as system,
// tool calls' arguments as objects.
static bool openai_messages(const json_t *msgs, json_t *out, st_http_error *e) {
    if (!json_is_array(msgs)) return fail(e, 400, "messages", "messages: expected an array, got %s", msgs ? type_name(msgs) : "nothing");
    if (!json_array_size(msgs)) return fail(e, 400, "messages", "messages: must not be empty");
    size_t i;
    json_t *m;
    json_array_foreach(msgs, i, m) {
        char where[64];
        snprintf(where, sizeof where, "messages[%zu]", i);
        if (!json_is_object(m)) return fail(e, 400, "messages", "%s: expected an object, got %s", where, type_name(m));
        const char *role = json_string_value(json_object_get(m, "role"));
        if (!role) return fail(e, 400, "messages", "%s.role: expected a string", where);
        if (!strcmp(role, "developer")) role = "system";
        if (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant") && strcmp(role, "tool"))
            return fail(e, 400, "messages", "%s.role: '%s' is not system, developer, user, assistant or tool", where, role);
        char cw[80], *text;
        snprintf(cw, sizeof cw, "%s.content", where);
        json_t *content = field(m, "content");
        if (!content && strcmp(role, "assistant")) return fail(e, 400, "messages", "%s: missing", cw);
        if (!content_text(content, cw, &text, e)) return false;
        json_t *o = json_pack("{s:s,s:s}", "role", role, "content", text);
        free(text);
        json_array_append_new(out, o);
        if (!strcmp(role, "assistant")) {
            json_t *rc = field(m, "reasoning_content");
            if (rc && !json_is_string(rc)) return fail(e, 400, "messages", "%s.reasoning_content: expected a string", where);
            if (rc) json_object_set(o, "reasoning_content", rc);
            json_t *tcs = field(m, "tool_calls");
            if (tcs && !json_is_array(tcs)) return fail(e, 400, "messages", "%s.tool_calls: expected an array", where);
            if (tcs && json_array_size(tcs)) {
                json_t *list = json_array();
                json_object_set_new(o, "tool_calls", list);
                size_t k;
                json_t *tc;
                json_array_foreach(tcs, k, tc) {
                    json_t *f = json_object_get(tc, "function");
                    const char *name = json_string_value(json_object_get(f, "name"));
                    if (!name) return fail(e, 400, "messages", "%s.tool_calls[%zu].function.name: expected a string", where, k);
                    json_t *args = arguments_value(json_object_get(f, "arguments"));
                    json_t *id = json_object_get(tc, "id");
                    json_array_append_new(list, json_pack("{s:O?,s:s,s:{s:s,s:o}}", "id", id, "type", "function",
                                                          "function", "name", name, "arguments", args));
                }
            }
        }
        if (!strcmp(role, "tool")) {
            json_t *id = field(m, "tool_call_id");
            if (id && !json_is_string(id)) return fail(e, 400, "messages", "%s.tool_call_id: expected a string", where);
            if (id) json_object_set(o, "tool_call_id", id);
            json_t *nm = field(m, "name");
            if (json_is_string(nm)) json_object_set(o, "name", nm);
        }
    }
    return true;
}

// OpenAI tools (validated) and tool_choice: the tools the model is shown, or NULL.
static bool openai_tools(const json_t *b, json_t **out, st_http_error *e) {
    *out = NULL;
    json_t *tools = field(b, "tools"), *choice = field(b, "tool_choice");
    if (!tools) return true;
    if (!json_is_array(tools)) return fail(e, 400, "tools", "tools: expected an array, got %s", type_name(tools));
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        json_t *f = json_object_get(t, "function");
        const char *type = json_string_value(json_object_get(t, "type"));
        if (!json_is_object(t) || !type || strcmp(type, "function"))
            return fail(e, 400, "tools", "tools[%zu]: expected {\"type\": \"function\", \"function\": {...}}", i);
        if (!json_is_object(f) || !json_is_string(json_object_get(f, "name")))
            return fail(e, 400, "tools", "tools[%zu].function.name: expected a string", i);
        json_t *params = json_object_get(f, "parameters");
        if (params && !json_is_object(params) && !json_is_null(params))
            return fail(e, 400, "tools", "tools[%zu].function.parameters: expected a JSON Schema object", i);
    }
    const char *mode = json_string_value(choice);
    if (choice && !mode && !json_is_object(choice))
        return fail(e, 400, "tool_choice", "tool_choice: expected \"none\", \"auto\", \"required\" or {\"type\": \"function\", ...}");
    if (mode && strcmp(mode, "none") && strcmp(mode, "auto") && strcmp(mode, "required"))
        return fail(e, 400, "tool_choice", "tool_choice: '%s' is not none, auto or required", mode);
    if (mode && !strcmp(mode, "none")) return true;
    if (json_is_object(choice)) { // one named function: show the model only that one
        const char *name = json_string_value(json_object_get(json_object_get(choice, "function"), "name"));
        if (!name) return fail(e, 400, "tool_choice", "tool_choice.function.name: expected a string");
        json_array_foreach(tools, i, t) {
            if (!strcmp(json_string_value(json_object_get(json_object_get(t, "function"), "name")), name)) {
                *out = json_pack("[O]", t);
                return true;
            }
        }
        return fail(e, 400, "tool_choice", "tool_choice: no tool named '%s' in tools", name);
    }
    *out = json_copy(tools);
    return true;
}

// ---------------------------------------------------------------------------------------------
// Rendering

// Adds text to the system message (the first message, made when there is none).
static void add_system(json_t *msgs, const char *text) {
    json_t *first = json_array_get(msgs, 0);
    const char *role = json_string_value(json_object_get(first, "role"));
    if (role && !strcmp(role, "system")) {
        const char *old = json_string_value(json_object_get(first, "content"));
        size_t n = strlen(old) + strlen(text) + 3;
        char *s = malloc(n);
        if (!s) return;
        snprintf(s, n, "%s%s%s", old, *old ? "\n\n" : "", text);
        json_object_set_new(first, "content", json_string(s));
        free(s);
    } else {
        json_array_insert_new(msgs, 0, json_pack("{s:s,s:s}", "role", "system", "content", text));
    }
}

// Qwen3's own tool instructions, for templates that do not render tools themselves (the prompt
// then still tells the model about them, in the format the parser reads back).
static char *tools_instruction(const json_t *tools) {
    static const char head[] =
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
    static const char tail[] =
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
        "</tool_call>";
    size_t n = sizeof head + sizeof tail, i;
    json_t *t;
    char **lines = calloc(json_array_size(tools) + 1, sizeof *lines);
    if (!lines) return NULL;
    json_array_foreach(tools, i, t) {
        lines[i] = json_dumps(t, JSON_COMPACT | JSON_ENSURE_ASCII);
        n += (lines[i] ? strlen(lines[i]) : 0) + 1;
    }
    char *s = malloc(n), *p = s;
    if (s) {
        p += sprintf(p, "%s", head);
        for (i = 0; i < json_array_size(tools); i++)
            if (lines[i]) p += sprintf(p, "\n%s", lines[i]);
        sprintf(p, "%s", tail);
    }
    for (i = 0; i < json_array_size(tools); i++) free(lines[i]);
    free(lines);
    return s;
}

static bool render(strata_model *m, json_t *msgs, const json_t *tools, bool gen_prompt, int thinking, char **out,
                   st_http_error *e) {
    char *mj = json_dumps(msgs, JSON_COMPACT), *tj = tools ? json_dumps(tools, JSON_COMPACT) : NULL;
    strata_status st = mj && (!tools || tj) ? strata_chat_render(m, mj, tj, gen_prompt, thinking, out) : ST_ERR_NOMEM;
    free(mj);
    free(tj);
    if (st) return fail(e, 400, "messages", "the chat template failed on these messages: %s", strata_error());
    return true;
}

// Renders and tokenizes a conversation: the prompt's tokens, where the last turn before the
// answer ends (for the prompt cache), and whether the prompt opened a <think> block.
static bool prompt_from_messages(strata_model *m, json_t *msgs, json_t *tools, int thinking, st_gen_request *r,
                                 st_http_error *e) {
    char *text = NULL, *plain = NULL, *no_gen = NULL;
    bool ok = true;
    if (tools) { // a template that ignores tools renders the same without them: tell the model in the system message
        ok = render(m, msgs, tools, true, thinking, &text, e) && render(m, msgs, NULL, true, thinking, &plain, e);
        if (ok && !strcmp(text, plain)) {
            char *inst = tools_instruction(tools);
            if (inst) add_system(msgs, inst);
            free(inst);
            free(text);
            text = NULL;
            ok = render(m, msgs, NULL, true, thinking, &text, e);
            tools = NULL;
        }
    } else {
        ok = render(m, msgs, NULL, true, thinking, &text, e);
    }
    if (ok) ok = render(m, msgs, tools, false, thinking, &no_gen, e);
    if (ok && strata_tokenize(m, text, strlen(text), true, &r->ids, &r->n_ids))
        ok = fail(e, 400, "messages", "tokenizing the prompt: %s", strata_error());
    if (ok) {
        size_t n = strlen(text);
        while (n && (text[n - 1] == '\n' || text[n - 1] == ' ')) n--;
        r->in_reasoning = n >= 7 && !memcmp(text + n - 7, "<think>", 7);
        int32_t *ids;
        int k;
        size_t nl = strlen(no_gen);
        if (nl < strlen(text) && !strncmp(text, no_gen, nl) && !strata_tokenize(m, no_gen, nl, true, &ids, &k)) {
            if (k < r->n_ids && !memcmp(ids, r->ids, sizeof(int32_t) * (size_t)k)) r->turn = k;
            free(ids);
        }
    }
    free(text);
    free(plain);
    free(no_gen);
    return ok;
}

static int thinking_of(const json_t *b, const st_server_config *cfg, st_http_error *e, bool *ok) {
    *ok = true;
    json_t *kw = field(b, "chat_template_kwargs"), *effort = field(b, "reasoning_effort");
    if (kw && !json_is_object(kw)) return *ok = fail(e, 400, "chat_template_kwargs", "chat_template_kwargs: expected an object"), 0;
    json_t *et = field(kw, "enable_thinking");
    if (et && !json_is_boolean(et))
        return *ok = fail(e, 400, "chat_template_kwargs", "chat_template_kwargs.enable_thinking: expected a boolean"), 0;
    if (et) return json_is_true(et);
    if (effort && !json_is_string(effort)) return *ok = fail(e, 400, "reasoning_effort", "reasoning_effort: expected a string"), 0;
    if (effort) return strcmp(json_string_value(effort), "none") != 0;
    return cfg->thinking;
}

// response_format: {"type": "text" | "json_object" | "json_schema", ...}. JSON is asked for in
// the system message (it helps the model); json_object is also enforced while decoding
// (strata_generate_params.json_object), json_schema only checked afterwards.
static bool response_format(const json_t *b, json_t *msgs, st_gen_request *r, st_http_error *e) {
    json_t *rf = field(b, "response_format");
    if (!rf) return true;
    const char *type = json_string_value(json_object_get(rf, "type"));
    if (!json_is_object(rf) || !type) return fail(e, 400, "response_format", "response_format: expected {\"type\": ...}");
    if (!strcmp(type, "text")) return true;
    if (strcmp(type, "json_object") && strcmp(type, "json_schema"))
        return fail(e, 400, "response_format", "response_format.type: '%s' is not text, json_object or json_schema", type);
    json_t *schema = json_object_get(json_object_get(rf, "json_schema"), "schema");
    if (!strcmp(type, "json_schema") && !json_is_object(schema))
        return fail(e, 400, "response_format", "response_format.json_schema.schema: expected a JSON Schema object");
    char *sj = schema ? json_dumps(schema, JSON_COMPACT) : NULL;
    size_t n = 256 + (sj ? strlen(sj) : 0);
    char *inst = malloc(n);
    if (inst) {
        snprintf(inst, n, "Answer with one JSON object and nothing else (no code fences, no text around it).%s%s",
                 sj ? " It must follow this JSON Schema: " : "", sj ? sj : "");
        add_system(msgs, inst);
    }
    free(inst);
    free(sj);
    r->json_mode = true;
    r->gen.json_object = !strcmp(type, "json_object");
    return true;
}

static bool check_fits(const st_gen_request *r, const st_server_config *cfg, int ctx, const char *param, st_http_error *e) {
    (void)cfg;
    if (r->n_ids < 1) return fail(e, 400, param, "%s: the prompt is empty", param);
    if (r->n_ids >= ctx)
        return fail(e, 400, param, "%s: the prompt has %d tokens; the context holds %d (one more is needed for the answer)",
                    param, r->n_ids, ctx);
    return true;
}

static bool common_fields(const json_t *b, st_gen_request *r, st_http_error *e) {
    json_t *model = field(b, "model");
    if (model && !json_is_string(model)) return fail(e, 400, "model", "model: expected a string, got %s", type_name(model));
    r->model_name = strdup(model ? json_string_value(model) : "strata");
    if (!get_bool(b, "stream", &r->stream, e) || !get_bool(b, "return_progress", &r->return_progress, e)) return false;
    json_t *so = field(b, "stream_options");
    if (so && !json_is_object(so)) return fail(e, 400, "stream_options", "stream_options: expected an object");
    if (so && !get_bool(so, "include_usage", &r->include_usage, e)) return false;
    json_t *lp = field(b, "logprobs");
    if (lp && !json_is_false(lp) && !(json_is_integer(lp) && !json_integer_value(lp)))
        return fail(e, 400, "logprobs", "logprobs: not supported");
    return true;
}

static bool parse_chat(const json_t *b, strata_model *m, const st_server_config *cfg, int ctx, st_gen_request *r,
                       st_http_error *e) {
    if (!common_fields(b, r, e) || !parse_sampling(b, cfg, r, e) || !parse_stop(b, "stop", true, r, e)) return false;
    int mt = r->gen.max_tokens;
    if (!get_int(b, "max_tokens", 1, 1 << 30, &mt, e) || !get_int(b, "max_completion_tokens", 1, 1 << 30, &mt, e))
        return false;
    r->gen.max_tokens = mt;
    json_t *msgs = json_array(), *tools = NULL;
    bool ok = openai_messages(field(b, "messages"), msgs, e) && openai_tools(b, &tools, e) && response_format(b, msgs, r, e);
    int thinking = ok ? thinking_of(b, cfg, e, &ok) : -1;
    // Constrained JSON leaves no room for a <think> block: the answer is the object alone. A
    // template that opens one anyway gets the unconstrained way (asked for, then checked).
    if (r->gen.json_object) thinking = 0;
    if (ok) ok = prompt_from_messages(m, msgs, tools, thinking, r, e);
    if (r->in_reasoning) r->gen.json_object = false;
    r->tools = tools;
    json_decref(msgs);
    return ok && check_fits(r, cfg, ctx, "messages", e);
}

static bool parse_completion(const json_t *b, strata_model *m, const st_server_config *cfg, int ctx,
                             st_gen_request *r, st_http_error *e) {
    if (!common_fields(b, r, e) || !parse_sampling(b, cfg, r, e) || !parse_stop(b, "stop", true, r, e)) return false;
    r->gen.max_tokens = 16; // OpenAI's default for completions
    if (cfg->max_tokens) r->gen.max_tokens = cfg->max_tokens;
    if (!get_int(b, "max_tokens", 1, 1 << 30, &r->gen.max_tokens, e)) return false;
    json_t *p = field(b, "prompt");
    if (json_is_array(p) && json_array_size(p) == 1 && json_is_string(json_array_get(p, 0))) p = json_array_get(p, 0);
    if (json_is_string(p)) {
        if (strata_tokenize(m, json_string_value(p), json_string_length(p), true, &r->ids, &r->n_ids))
            return fail(e, 400, "prompt", "prompt: %s", strata_error());
    } else if (json_is_array(p) && json_array_size(p)) { // token ids
        int V = strata_model_get_info(m).n_vocab;
        size_t n = json_array_size(p), i;
        json_t *x;
        if (!(r->ids = malloc(sizeof(int32_t) * n))) return fail(e, 500, NULL, "out of memory");
        json_array_foreach(p, i, x) {
            if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= V)
                return fail(e, 400, "prompt", "prompt[%zu]: expected a token id in [0, %d) (or give one string)", i, V);
            r->ids[i] = (int32_t)json_integer_value(x);
        }
        r->n_ids = (int)n;
    } else {
        return fail(e, 400, "prompt", "prompt: expected a string (or one string in an array, or token ids), got %s",
                    p ? type_name(p) : "nothing");
    }
    json_t *echo = field(b, "echo"), *suffix = field(b, "suffix");
    if (echo && !json_is_false(echo)) return fail(e, 400, "echo", "echo: not supported");
    if (suffix) return fail(e, 400, "suffix", "suffix: not supported");
    return check_fits(r, cfg, ctx, "prompt", e);
}

// Anthropic messages -> the template's messages (tool_use as tool calls, tool_result as tool
// messages, thinking blocks as reasoning_content).
static bool anthropic_messages(const json_t *b, json_t *out, st_http_error *e) {
    json_t *sys = field(b, "system"), *msgs = field(b, "messages");
    if (sys) {
        char *text;
        if (!content_text(sys, "system", &text, e)) return false;
        json_array_append_new(out, json_pack("{s:s,s:s}", "role", "system", "content", text));
        free(text);
    }
    if (!json_is_array(msgs)) return fail(e, 400, "messages", "messages: expected an array, got %s", msgs ? type_name(msgs) : "nothing");
    if (!json_array_size(msgs)) return fail(e, 400, "messages", "messages: must not be empty");
    size_t i;
    json_t *m;
    json_array_foreach(msgs, i, m) {
        char where[64];
        snprintf(where, sizeof where, "messages[%zu]", i);
        const char *role = json_string_value(json_object_get(m, "role"));
        if (!json_is_object(m) || !role) return fail(e, 400, "messages", "%s: expected {\"role\": ..., \"content\": ...}", where);
        if (strcmp(role, "user") && strcmp(role, "assistant"))
            return fail(e, 400, "messages", "%s.role: '%s' is not user or assistant", where, role);
        json_t *c = field(m, "content");
        if (json_is_string(c)) {
            json_array_append_new(out, json_pack("{s:s,s:O}", "role", role, "content", c));
            continue;
        }
        if (!json_is_array(c)) return fail(e, 400, "messages", "%s.content: expected a string or an array of blocks", where);
        // Text blocks join into one message; tool results become tool messages before it.
        size_t len = 0, k;
        json_t *blk;
        char *text = calloc(1, 1), *reasoning = NULL;
        json_t *calls = json_array();
        bool ok = text != NULL;
        json_array_foreach(c, k, blk) {
            const char *type = json_string_value(json_object_get(blk, "type"));
            if (!ok) break;
            if (!type) {
                ok = fail(e, 400, "messages", "%s.content[%zu]: expected a block with a \"type\"", where, k);
            } else if (!strcmp(type, "text")) {
                const char *t = json_string_value(json_object_get(blk, "text"));
                if (!t) { ok = fail(e, 400, "messages", "%s.content[%zu].text: expected a string", where, k); break; }
                size_t tl = strlen(t);
                char *nt = realloc(text, len + tl + 2);
                if (!nt) { ok = fail(e, 500, NULL, "out of memory"); break; }
                text = nt;
                if (len) text[len++] = '\n';
                memcpy(text + len, t, tl + 1);
                len += tl;
            } else if (!strcmp(type, "tool_use") && !strcmp(role, "assistant")) {
                const char *name = json_string_value(json_object_get(blk, "name"));
                json_t *input = json_object_get(blk, "input"), *id = json_object_get(blk, "id");
                if (!name) { ok = fail(e, 400, "messages", "%s.content[%zu].name: expected a string", where, k); break; }
                json_array_append_new(calls, json_pack("{s:O?,s:s,s:{s:s,s:O}}", "id", id, "type", "function", "function",
                                                       "name", name, "arguments", input ? input : json_object()));
            } else if (!strcmp(type, "tool_result") && !strcmp(role, "user")) {
                char *rt, cw[128];
                snprintf(cw, sizeof cw, "%s.content[%zu].content", where, k);
                if (!content_text(field(blk, "content"), cw, &rt, e)) { ok = false; break; }
                json_t *id = json_object_get(blk, "tool_use_id");
                json_array_append_new(out, json_pack("{s:s,s:s,s:O?}", "role", "tool", "content", rt, "tool_call_id", id));
                free(rt);
            } else if (!strcmp(type, "thinking") && !strcmp(role, "assistant")) {
                const char *t = json_string_value(json_object_get(blk, "thinking"));
                free(reasoning);
                reasoning = t ? strdup(t) : NULL;
            } else if (!strcmp(type, "redacted_thinking")) {
                continue;
            } else {
                ok = fail(e, 400, "messages", "%s.content[%zu]: blocks of type '%s' are not supported here", where, k, type);
            }
        }
        if (ok && (len || json_array_size(calls) || !strcmp(role, "assistant"))) {
            json_t *o = json_pack("{s:s,s:s}", "role", role, "content", text);
            if (json_array_size(calls)) json_object_set(o, "tool_calls", calls);
            if (reasoning) json_object_set_new(o, "reasoning_content", json_string(reasoning));
            json_array_append_new(out, o);
        }
        free(text);
        free(reasoning);
        json_decref(calls);
        if (!ok) return false;
    }
    return true;
}

static bool anthropic_tools(const json_t *b, json_t **out, st_http_error *e) {
    *out = NULL;
    json_t *tools = field(b, "tools"), *choice = field(b, "tool_choice");
    if (!tools) return true;
    if (!json_is_array(tools)) return fail(e, 400, "tools", "tools: expected an array, got %s", type_name(tools));
    const char *mode = json_string_value(json_object_get(choice, "type"));
    if (choice && (!json_is_object(choice) || !mode))
        return fail(e, 400, "tool_choice", "tool_choice: expected {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}");
    if (mode && strcmp(mode, "auto") && strcmp(mode, "any") && strcmp(mode, "tool") && strcmp(mode, "none"))
        return fail(e, 400, "tool_choice", "tool_choice.type: '%s' is not auto, any, tool or none", mode);
    const char *only = mode && !strcmp(mode, "tool") ? json_string_value(json_object_get(choice, "name")) : NULL;
    if (mode && !strcmp(mode, "tool") && !only) return fail(e, 400, "tool_choice", "tool_choice.name: expected a string");
    json_t *list = json_array();
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        const char *name = json_string_value(json_object_get(t, "name"));
        json_t *schema = json_object_get(t, "input_schema"), *desc = json_object_get(t, "description");
        if (!json_is_object(t) || !name) {
            json_decref(list);
            return fail(e, 400, "tools", "tools[%zu].name: expected a string", i);
        }
        if (schema && !json_is_object(schema)) {
            json_decref(list);
            return fail(e, 400, "tools", "tools[%zu].input_schema: expected a JSON Schema object", i);
        }
        if (only && strcmp(only, name)) continue;
        json_t *f = json_pack("{s:s}", "name", name);
        if (json_is_string(desc)) json_object_set(f, "description", desc);
        json_object_set(f, "parameters", schema ? schema : json_object());
        json_array_append_new(list, json_pack("{s:s,s:o}", "type", "function", "function", f));
    }
    if (only && !json_array_size(list)) {
        json_decref(list);
        return fail(e, 400, "tool_choice", "tool_choice: no tool named '%s' in tools", only);
    }
    if ((mode && !strcmp(mode, "none")) || !json_array_size(list)) json_decref(list), list = NULL;
    *out = list;
    return true;
}

static bool parse_anthropic(const json_t *b, strata_model *m, const st_server_config *cfg, int ctx,
                            st_gen_request *r, st_http_error *e) {
    if (!common_fields(b, r, e) || !parse_sampling(b, cfg, r, e) || !parse_stop(b, "stop_sequences", false, r, e))
        return false;
    if (!field(b, "max_tokens")) return fail(e, 400, "max_tokens", "max_tokens: required");
    if (!get_int(b, "max_tokens", 1, 1 << 30, &r->gen.max_tokens, e)) return false;
    int thinking = cfg->thinking;
    json_t *th = field(b, "thinking");
    const char *tt = json_string_value(json_object_get(th, "type"));
    if (th && (!tt || (strcmp(tt, "enabled") && strcmp(tt, "disabled") && strcmp(tt, "adaptive"))))
        return fail(e, 400, "thinking", "thinking: expected {\"type\": \"enabled\" | \"disabled\"}");
    if (tt) thinking = strcmp(tt, "disabled") != 0;
    json_t *msgs = json_array(), *tools = NULL;
    bool ok = anthropic_messages(b, msgs, e) && anthropic_tools(b, &tools, e);
    if (ok) ok = prompt_from_messages(m, msgs, tools, thinking, r, e);
    r->tools = tools;
    json_decref(msgs);
    return ok && check_fits(r, cfg, ctx, "messages", e);
}

bool st_api_parse(st_api api, const json_t *body, strata_model *m, const st_server_config *cfg, st_gen_request *r,
                  st_http_error *e) {
    memset(r, 0, sizeof *r);
    memset(e, 0, sizeof *e);
    r->api = api;
    if (!json_is_object(body)) return fail(e, 400, NULL, "the request body must be a JSON object");
    int ctx = cfg->ctx; // the slots' real context is checked again by the scheduler
    if (ctx <= 0) ctx = 1 << 30;
    bool ok = api == ST_API_CHAT ? parse_chat(body, m, cfg, ctx, r, e)
              : api == ST_API_COMPLETION ? parse_completion(body, m, cfg, ctx, r, e)
                                         : parse_anthropic(body, m, cfg, ctx, r, e);
    if (!ok) st_gen_request_free(r);
    return ok;
}

// =============================================================================================
// Responses

typedef struct buf {
    char *p;
    size_t len, cap;
} buf;

static void buf_add(buf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = (b->len + n + 1) * 2;
        char *np = realloc(b->p, cap);
        if (!np) return; // out of memory: the text is lost, the stream goes on
        b->p = np, b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void buf_str(buf *b, const char *s) { buf_add(b, s, strlen(s)); }

// One SSE event; takes the reference to v. event: Anthropic's event name, or NULL.
static void sse(buf *b, const char *event, json_t *v) {
    char *s = json_dumps(v, JSON_COMPACT);
    json_decref(v);
    if (!s) return;
    if (event) {
        buf_str(b, "event: ");
        buf_str(b, event);
        buf_str(b, "\n");
    }
    buf_str(b, "data: ");
    buf_str(b, s);
    buf_str(b, "\n\n");
    free(s);
}

struct st_api_writer {
    const st_gen_request *r;
    st_out_parser *parser;    // chat and Anthropic; NULL for completions
    char id[40];
    long created;
    buf out;                  // bytes for the caller (per update)
    buf content, reasoning;   // whole text (non-streaming)
    json_t *calls;            // tool calls so far (OpenAI form)
    bool began;               // the stream's opening was sent
    int block;                // Anthropic: the open content block's index, -1 none
    int block_kind;           // its kind (st_out_kind)
    int n_blocks;
    int last_read;            // prompt progress last reported
    bool finished;
};

static void make_id(char *out, size_t n, const char *prefix) {
    static uint64_t counter;
    uint64_t x = __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED) * 0x9e3779b97f4a7c15ull ^ (uint64_t)time(NULL) << 16;
    snprintf(out, n, "%s%016llx", prefix, (unsigned long long)x);
}

st_status st_api_writer_create(const st_gen_request *r, st_api_writer **out) {
    st_api_writer *w = calloc(1, sizeof *w);
    if (!w) return st_fail(ST_ERR_NOMEM, "out of memory");
    w->r = r;
    w->created = (long)time(NULL);
    w->block = -1;
    w->calls = json_array();
    make_id(w->id, sizeof w->id, r->api == ST_API_CHAT ? "chatcmpl-" : r->api == ST_API_COMPLETION ? "cmpl-" : "msg_");
    st_status st = r->api == ST_API_COMPLETION ? ST_OK : st_out_parser_create(r->in_reasoning, r->tools, &w->parser);
    if (st) {
        st_api_writer_free(w);
        return st;
    }
    *out = w;
    return ST_OK;
}

void st_api_writer_free(st_api_writer *w) {
    if (!w) return;
    st_out_parser_free(w->parser);
    free(w->out.p);
    free(w->content.p);
    free(w->reasoning.p);
    json_decref(w->calls);
    free(w);
}

static json_t *openai_chunk(st_api_writer *w, json_t *choices) {
    return json_pack("{s:s,s:s,s:i,s:s,s:s,s:o}", "id", w->id, "object",
                     w->r->api == ST_API_CHAT ? "chat.completion.chunk" : "text_completion", "created", (json_int_t)w->created,
                     "model", w->r->model_name, "system_fingerprint", "strata", "choices", choices);
}

// Anthropic: closes the open block and opens one of kind k (text, thinking or tool_use).
static void anthropic_block(st_api_writer *w, int kind, const st_out_event *ev) {
    if (w->block >= 0 && (w->block_kind != kind || kind == ST_OUT_TOOL_CALL)) {
        sse(&w->out, "content_block_stop", json_pack("{s:s,s:i}", "type", "content_block_stop", "index", w->block));
        w->block = -1;
    }
    if (w->block >= 0) return;
    w->block = w->n_blocks++;
    w->block_kind = kind;
    json_t *cb = kind == ST_OUT_REASONING ? json_pack("{s:s,s:s,s:s}", "type", "thinking", "thinking", "", "signature", "")
                 : kind == ST_OUT_CONTENT ? json_pack("{s:s,s:s}", "type", "text", "text", "")
                                          : json_pack("{s:s,s:s,s:s,s:{}}", "type", "tool_use", "id", json_string_value(json_object_get(json_array_get(w->calls, json_array_size(w->calls) - 1), "id")),
                                                      "name", ev->name, "input");
    sse(&w->out, "content_block_start", json_pack("{s:s,s:i,s:o}", "type", "content_block_start", "index", w->block,
                                                  "content_block", cb));
}

static void on_event(void *ctx, const st_out_event *ev) {
    st_api_writer *w = ctx;
    const st_gen_request *r = w->r;
    if (ev->kind == ST_OUT_TOOL_CALL) {
        char id[40];
        make_id(id, sizeof id, r->api == ST_API_ANTHROPIC ? "toolu_" : "call_");
        json_array_append_new(w->calls, json_pack("{s:s,s:s,s:{s:s,s:s}}", "id", id, "type", "function", "function",
                                                  "name", ev->name, "arguments", ev->arguments));
    }
    if (!r->stream) {
        if (ev->kind == ST_OUT_CONTENT) buf_add(&w->content, ev->text, ev->len);
        else if (ev->kind == ST_OUT_REASONING) buf_add(&w->reasoning, ev->text, ev->len);
        return;
    }
    if (r->api == ST_API_ANTHROPIC) {
        anthropic_block(w, ev->kind, ev);
        json_t *delta;
        if (ev->kind == ST_OUT_CONTENT) delta = json_pack("{s:s,s:s%}", "type", "text_delta", "text", ev->text, ev->len);
        else if (ev->kind == ST_OUT_REASONING)
            delta = json_pack("{s:s,s:s%}", "type", "thinking_delta", "thinking", ev->text, ev->len);
        else delta = json_pack("{s:s,s:s}", "type", "input_json_delta", "partial_json", ev->arguments);
        sse(&w->out, "content_block_delta", json_pack("{s:s,s:i,s:o}", "type", "content_block_delta", "index", w->block,
                                                      "delta", delta));
        return;
    }
    json_t *delta;
    if (ev->kind == ST_OUT_CONTENT) delta = json_pack("{s:s%}", "content", ev->text, ev->len);
    else if (ev->kind == ST_OUT_REASONING) delta = json_pack("{s:s%}", "reasoning_content", ev->text, ev->len);
    else {
        json_t *call = json_deep_copy(json_array_get(w->calls, json_array_size(w->calls) - 1));
        json_object_set_new(call, "index", json_integer((json_int_t)json_array_size(w->calls) - 1));
        delta = json_pack("{s:[o]}", "tool_calls", call);
    }
    sse(&w->out, NULL, openai_chunk(w, json_pack("[{s:i,s:o,s:n}]", "index", 0, "delta", delta, "finish_reason")));
}

static const char *finish_reason(const st_api_writer *w, const strata_generate_stats *st) {
    const char *sr = st->stop_reason ? st->stop_reason : "";
    bool length = !strcmp(sr, "length") || !strcmp(sr, "context");
    if (w->r->api == ST_API_ANTHROPIC) {
        if (json_array_size(w->calls)) return "tool_use";
        return length ? "max_tokens" : !strcmp(sr, "stop") ? "stop_sequence" : "end_turn";
    }
    if (json_array_size(w->calls)) return "tool_calls";
    return length ? "length" : "stop";
}

static json_t *openai_usage(const st_job_update *u) {
    return json_pack("{s:i,s:i,s:i,s:{s:i}}", "prompt_tokens", u->prompt_total, "completion_tokens",
                     u->stats.n_generated, "total_tokens", u->prompt_total + u->stats.n_generated,
                     "prompt_tokens_details", "cached_tokens", u->prompt_cached);
}

// The reply's text when JSON was asked for: the JSON object in it (fences or words around it
// dropped) when there is one; *valid says whether there was.
static char *json_content(const char *text, bool *valid) {
    *valid = false;
    json_t *v = json_loads(text, JSON_DECODE_ANY, NULL);
    if (json_is_object(v) || json_is_array(v)) {
        json_decref(v);
        *valid = true;
        return strdup(text);
    }
    json_decref(v);
    for (const char *p = strchr(text, '{'); p; p = strchr(p + 1, '{')) {
        json_error_t je;
        v = json_loads(p, JSON_DISABLE_EOF_CHECK, &je);
        if (json_is_object(v)) {
            char *s = json_dumps(v, JSON_COMPACT | JSON_PRESERVE_ORDER);
            json_decref(v);
            *valid = true;
            return s;
        }
        json_decref(v);
    }
    return strdup(text);
}

// The whole response (non-streaming).
static void final_body(st_api_writer *w, const st_job_update *u) {
    const st_gen_request *r = w->r;
    const char *content = w->content.p ? w->content.p : "";
    json_t *body;
    if (r->api == ST_API_ANTHROPIC) {
        json_t *blocks = json_array();
        if (w->reasoning.len)
            json_array_append_new(blocks, json_pack("{s:s,s:s,s:s}", "type", "thinking", "thinking", w->reasoning.p, "signature", ""));
        if (w->content.len) json_array_append_new(blocks, json_pack("{s:s,s:s}", "type", "text", "text", content));
        size_t i;
        json_t *c;
        json_array_foreach(w->calls, i, c) {
            json_t *f = json_object_get(c, "function");
            json_t *input = json_loads(json_string_value(json_object_get(f, "arguments")), 0, NULL);
            json_array_append_new(blocks, json_pack("{s:O,s:s,s:O,s:o}", "id", json_object_get(c, "id"), "type", "tool_use",
                                                    "name", json_object_get(f, "name"), "input", input ? input : json_object()));
        }
        body = json_pack("{s:s,s:s,s:s,s:s,s:o,s:s,s:n,s:{s:i,s:i,s:i}}", "id", w->id, "type", "message", "role", "assistant",
                         "model", r->model_name, "content", blocks, "stop_reason", finish_reason(w, &u->stats),
                         "stop_sequence", "usage", "input_tokens", u->prompt_total - u->prompt_cached, "output_tokens",
                         u->stats.n_generated, "cache_read_input_tokens", u->prompt_cached);
    } else if (r->api == ST_API_COMPLETION) {
        body = json_pack("{s:s,s:s,s:i,s:s,s:[{s:s,s:i,s:n,s:s}],s:o}", "id", w->id, "object", "text_completion", "created",
                         (json_int_t)w->created, "model", r->model_name, "choices", "text", content, "index", 0, "logprobs",
                         "finish_reason", finish_reason(w, &u->stats), "usage", openai_usage(u));
    } else {
        json_t *msg = json_pack("{s:s}", "role", "assistant");
        bool valid = true;
        char *text;
        if (r->gen.json_object) { // constrained: the text is one JSON object exactly when it was completed
            valid = !strcmp(u->stats.stop_reason ? u->stats.stop_reason : "", "eog");
            text = strdup(content);
        } else {
            text = r->json_mode ? json_content(content, &valid) : strdup(content);
        }
        json_object_set_new(msg, "content", w->content.len || !json_array_size(w->calls) ? json_string(text ? text : "") : json_null());
        free(text);
        if (w->reasoning.len) json_object_set_new(msg, "reasoning_content", json_string(w->reasoning.p));
        if (json_array_size(w->calls)) json_object_set(msg, "tool_calls", w->calls);
        body = json_pack("{s:s,s:s,s:i,s:s,s:s,s:[{s:i,s:o,s:n,s:s}],s:o}", "id", w->id, "object", "chat.completion", "created",
                         (json_int_t)w->created, "model", r->model_name, "system_fingerprint", "strata", "choices", "index", 0,
                         "message", msg, "logprobs", "finish_reason", finish_reason(w, &u->stats), "usage", openai_usage(u));
        if (r->json_mode) json_object_set_new(body, "strata_json_valid", json_boolean(valid));
    }
    char *s = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    if (s) buf_str(&w->out, s);
    free(s);
}

// The stream's end: closing events, usage, [DONE].
static void stream_end(st_api_writer *w, const st_job_update *u) {
    const st_gen_request *r = w->r;
    if (u->error[0]) { // an engine failure after the stream began: an error event ends it
        json_t *err = json_pack("{s:s,s:{s:s,s:s,s:n,s:n}}", "type", "error", "error", "message", u->error, "type",
                                "server_error", "param", "code");
        sse(&w->out, r->api == ST_API_ANTHROPIC ? "error" : NULL, err);
        if (r->api != ST_API_ANTHROPIC) buf_str(&w->out, "data: [DONE]\n\n");
        return;
    }
    if (r->api == ST_API_ANTHROPIC) {
        if (w->block >= 0)
            sse(&w->out, "content_block_stop", json_pack("{s:s,s:i}", "type", "content_block_stop", "index", w->block));
        sse(&w->out, "message_delta", json_pack("{s:s,s:{s:s,s:n},s:{s:i}}", "type", "message_delta", "delta", "stop_reason",
                                                finish_reason(w, &u->stats), "stop_sequence", "usage", "output_tokens",
                                                u->stats.n_generated));
        sse(&w->out, "message_stop", json_pack("{s:s}", "type", "message_stop"));
        return;
    }
    json_t *choice = r->api == ST_API_CHAT
                         ? json_pack("{s:i,s:{},s:s}", "index", 0, "delta", "finish_reason", finish_reason(w, &u->stats))
                         : json_pack("{s:i,s:s,s:n,s:s}", "index", 0, "text", "", "logprobs", "finish_reason",
                                     finish_reason(w, &u->stats));
    sse(&w->out, NULL, openai_chunk(w, json_pack("[o]", choice)));
    if (r->include_usage) {
        json_t *c = openai_chunk(w, json_array());
        json_object_set_new(c, "usage", openai_usage(u));
        sse(&w->out, NULL, c);
    }
    buf_str(&w->out, "data: [DONE]\n\n");
}

static void stream_begin(st_api_writer *w, const st_job_update *u) {
    const st_gen_request *r = w->r;
    w->began = true;
    if (r->api == ST_API_ANTHROPIC) {
        sse(&w->out, "message_start",
            json_pack("{s:s,s:{s:s,s:s,s:s,s:s,s:[],s:n,s:n,s:{s:i,s:i}}}", "type", "message_start", "message", "id", w->id,
                      "type", "message", "role", "assistant", "model", r->model_name, "content", "stop_reason",
                      "stop_sequence", "usage", "input_tokens", u->prompt_total, "output_tokens", 0));
    } else if (r->api == ST_API_CHAT) {
        sse(&w->out, NULL, openai_chunk(w, json_pack("[{s:i,s:{s:s,s:s},s:n}]", "index", 0, "delta", "role", "assistant",
                                                     "content", "", "finish_reason")));
    }
}

st_status st_api_writer_update(st_api_writer *w, const st_job_update *u, char **out, size_t *len) {
    const st_gen_request *r = w->r;
    *out = NULL, *len = 0;
    w->out.len = 0;
    if (w->finished) return ST_OK;
    if (r->stream && !w->began) stream_begin(w, u);
    if (r->stream && r->return_progress && u->started && u->prompt_read != w->last_read && r->api != ST_API_ANTHROPIC) {
        w->last_read = u->prompt_read;
        json_t *c = openai_chunk(w, json_array());
        json_object_set_new(c, "prompt_progress", json_pack("{s:i,s:i,s:i}", "total", u->prompt_total, "cache",
                                                            u->prompt_cached, "processed", u->prompt_read));
        sse(&w->out, NULL, c);
    }
    st_status st = ST_OK;
    if (u->len) {
        if (w->parser) st = st_out_parser_push(w->parser, u->text, u->len, on_event, w);
        else if (r->stream)
            sse(&w->out, NULL, openai_chunk(w, json_pack("[{s:s%,s:i,s:n,s:n}]", "text", u->text, u->len, "index", 0,
                                                          "logprobs", "finish_reason")));
        else buf_add(&w->content, u->text, u->len);
    }
    if (!st && u->done) {
        if (w->parser && !u->error[0]) st = st_out_parser_finish(w->parser, on_event, w);
        w->finished = true;
        if (r->stream) stream_end(w, u);
        else if (!u->error[0]) final_body(w, u);
    }
    if (w->out.len) {
        *out = w->out.p;
        *len = w->out.len;
        w->out = (buf){0};
    }
    return st;
}
