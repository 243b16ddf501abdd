// cli: `strata template` renders a chat template (the one stored in a GGUF, or a file) with
// messages and tools from JSON files, and prints the prompt exactly as the model would see it.

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: strata template (-m MODEL.gguf | --template FILE.jinja) --messages FILE.json\n"
            "                       [--tools FILE.json] [--no-generation-prompt] [--thinking on|off]\n"
            "                       [--var KEY=JSON]...\n\n"
            "Renders the chat template with the given conversation and prints the prompt.\n"
            "  -m FILE               use the GGUF's tokenizer.chat_template (bos_token / eos_token\n"
            "                        come from its vocabulary)\n"
            "  --template FILE       use a Jinja template file\n"
            "  --messages FILE       a JSON array of messages, or an object with \"messages\" (and\n"
            "                        optionally \"tools\")\n"
            "  --tools FILE          a JSON array of tools (JSON Schema function descriptions)\n"
            "  --no-generation-prompt  do not open an assistant turn at the end\n"
            "  --thinking on|off     sets enable_thinking (left undefined when not given)\n"
            "  --var KEY=JSON        any other template variable, e.g. --var 'bos_token=\"<s>\"'\n");
}

static json_t *load_json(const char *path) {
    json_error_t e;
    json_t *j = json_load_file(path, JSON_DECODE_ANY, &e);
    if (!j) fprintf(stderr, "strata template: %s:%d:%d: %s\n", path, e.line, e.column, e.text);
    return j;
}

// A token's text from the GGUF vocabulary, set as `key` (bos_token / eos_token) when present.
static void set_token_var(const st_gguf *g, json_t *vars, const char *id_key, const char *var) {
    uint32_t id;
    const char *s;
    size_t len;
    if (st_gguf_get_u32(g, id_key, &id) && st_gguf_arr_str(g, "tokenizer.ggml.tokens", id, &s, &len))
        json_object_set_new(vars, var, json_stringn(s, len));
}

int st_cmd_template(int argc, char **argv) {
    const char *model = NULL, *tpl = NULL, *msgs = NULL, *tools_path = NULL, *thinking = NULL;
    bool gen = true, bad = false;
    int rc = 1;
    json_t *vars = json_object(), *extra_vars = json_object();
    for (int i = 1; i < argc && !bad; i++) {
        const char *v;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            json_decref(vars);
            json_decref(extra_vars);
            return 0;
        } else if (st_cli_opt(argc, argv, &i, "-m", &v, &bad) || st_cli_opt(argc, argv, &i, "--model", &v, &bad)) {
            model = v;
        } else if (st_cli_opt(argc, argv, &i, "--template", &v, &bad)) {
            tpl = v;
        } else if (st_cli_opt(argc, argv, &i, "--messages", &v, &bad)) {
            msgs = v;
        } else if (st_cli_opt(argc, argv, &i, "--tools", &v, &bad)) {
            tools_path = v;
        } else if (st_cli_opt(argc, argv, &i, "--thinking", &v, &bad)) {
            thinking = v;
        } else if (!strcmp(argv[i], "--no-generation-prompt")) {
            gen = false;
        } else if (st_cli_opt(argc, argv, &i, "--var", &v, &bad)) {
            if (!v) break;
            const char *eq = strchr(v, '=');
            json_error_t e;
            json_t *jv = eq ? json_loads(eq + 1, JSON_DECODE_ANY, &e) : NULL;
            if (!eq || eq == v || !jv) {
                fprintf(stderr, "strata template: --var '%s': expected KEY=JSON (%s)\n", v,
                        eq && eq != v ? e.text : "missing '='");
                bad = true;
                break;
            }
            char key[256];
            snprintf(key, sizeof key, "%.*s", (int)(eq - v), v);
            json_object_set_new(extra_vars, key, jv);
        } else {
            fprintf(stderr, "strata template: unknown option '%s'\n", argv[i]);
            bad = true;
        }
    }
    if (!bad && (!model == !tpl)) {
        fprintf(stderr, "strata template: give exactly one of -m MODEL.gguf or --template FILE\n");
        bad = true;
    }
    if (!bad && !msgs) {
        fprintf(stderr, "strata template: --messages FILE.json is required\n");
        bad = true;
    }
    if (!bad && thinking && strcmp(thinking, "on") && strcmp(thinking, "off")) {
        fprintf(stderr, "strata template: --thinking takes on or off, not '%s'\n", thinking);
        bad = true;
    }
    if (bad) {
        usage(stderr);
        json_decref(vars);
        json_decref(extra_vars);
        return 2;
    }

    st_chat_template *t = NULL;
    json_t *mj = NULL, *tj = NULL;
    char *out = NULL;
    size_t len = 0;
    st_status s;
    if (model) {
        st_gguf *g;
        if ((s = st_gguf_open(model, &g)) != ST_OK) goto fail;
        s = st_chat_template_from_gguf(g, &t);
        if (s == ST_OK) {
            set_token_var(g, vars, "tokenizer.ggml.bos_token_id", "bos_token");
            set_token_var(g, vars, "tokenizer.ggml.eos_token_id", "eos_token");
        }
        st_gguf_free(g);
        if (s != ST_OK) goto fail;
    } else {
        char *src;
        size_t n;
        if ((s = st_read_file(tpl, &src, &n)) != ST_OK) goto fail;
        s = st_chat_template_parse(src, n, tpl, &t);
        free(src);
        if (s != ST_OK) goto fail;
    }
    if (!(mj = load_json(msgs))) goto done;
    if (json_is_object(mj)) { // {"messages": [...], "tools": [...]}
        json_t *m = json_object_get(mj, "messages"), *tl = json_object_get(mj, "tools");
        if (tl && !json_is_null(tl)) tj = json_incref(tl);
        json_incref(m);
        json_decref(mj);
        mj = m;
    }
    if (!json_is_array(mj)) {
        fprintf(stderr, "strata template: %s: expected a JSON array of messages\n", msgs);
        goto done;
    }
    if (tools_path) {
        json_decref(tj);
        if (!(tj = load_json(tools_path))) goto done;
        if (!json_is_array(tj)) {
            fprintf(stderr, "strata template: %s: expected a JSON array of tools\n", tools_path);
            goto done;
        }
    }
    if (thinking) json_object_set_new(vars, "enable_thinking", json_boolean(!strcmp(thinking, "on")));
    json_object_update(vars, extra_vars);
    if ((s = st_chat_apply(t, mj, tj, gen, vars, &out, &len)) != ST_OK) goto fail;
    fwrite(out, 1, len, stdout);
    fflush(stdout);
    rc = 0;
    goto done;
fail:
    rc = st_cli_fail(s);
done:
    free(out);
    json_decref(mj);
    json_decref(tj);
    json_decref(vars);
    json_decref(extra_vars);
    st_chat_template_free(t);
    return rc;
}
