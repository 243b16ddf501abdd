// tokenizer: byte-level BPE built from GGUF metadata or a Hugging Face tokenizer.json, a
// streaming UTF-8-safe decoder, and chat templates (the Jinja subset real templates use).
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "gguf/gguf.h"
#include "util/util.h"

// =============================================================================================
// BPE tokenizer
// =============================================================================================

// =============================================================================================
// Chat templates
// =============================================================================================

// A chat template: the Jinja subset real chat templates use (if/elif/else, for with loop.* and
// else, set and namespace, macro and call, whitespace control, filters, tests, string methods,
// slicing), rendered byte for byte as Hugging Face's apply_chat_template renders it (Jinja2
// sandbox, trim_blocks, lstrip_blocks, loop controls, tojson without ASCII escaping,
// raise_exception, strftime_now). docs/TEMPLATES.md lists the subset and the limits.
typedef struct st_chat_template st_chat_template;

// Bounds on one render; zero fields take the defaults shown.
typedef struct st_chat_limits {
    size_t max_output;    // bytes of rendered text (default 16 MiB)
    uint64_t max_steps;   // loop iterations + calls + filters + outputs (default 2 million)
    int max_depth;        // nested macro calls / loops (default 64)
    size_t max_memory;    // bytes for values built while rendering (default 512 MiB)
} st_chat_limits;

// Parses a template. `name` names it in error messages ("<file>:<line>:<col>: ...").
st_status st_chat_template_parse(const char *src, size_t len, const char *name,
                                 st_chat_template **out);
// The template a GGUF stores in tokenizer.chat_template; ST_ERR_FORMAT if it has none.
st_status st_chat_template_from_gguf(const st_gguf *g, st_chat_template **out);
void st_chat_template_free(st_chat_template *t);

// Renders with `vars`, a JSON object (jansson json_t*) holding the template variables:
// messages, tools, add_generation_prompt, enable_thinking, bos_token, ... as
// apply_chat_template would pass them. *out is malloc'd and NUL-terminated (free() it). Errors
// (raise_exception, a type error, a limit reached) say what happened and on which line.
struct json_t;
st_status st_chat_template_render(const st_chat_template *t, const struct json_t *vars,
                                  const st_chat_limits *limits, char **out, size_t *len);

// Convenience for the common call: messages and tools are JSON arrays (tools may be NULL:
// the template sees `tools` = none, as transformers passes it), `extra` an optional object of
// more variables (enable_thinking, bos_token, ...).
st_status st_chat_apply(const st_chat_template *t, const struct json_t *messages,
                        const struct json_t *tools, bool add_generation_prompt,
                        const struct json_t *extra, char **out, size_t *len);
