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

// Token types, as GGUF stores them (tokenizer.ggml.token_type).
typedef enum st_token_type {
    ST_TOKEN_UNDEFINED = 0,
    ST_TOKEN_NORMAL = 1,
    ST_TOKEN_UNKNOWN = 2,
    ST_TOKEN_CONTROL = 3,      // parsed from text only with ST_TOKENIZE_SPECIAL
    ST_TOKEN_USER_DEFINED = 4, // always parsed from text (e.g. <think>, <tool_call>)
    ST_TOKEN_UNUSED = 5,       // never produced by tokenizing (e.g. [PAD151669])
    ST_TOKEN_BYTE = 6,
} st_token_type;

// Pre-tokenizer regexes, chosen by tokenizer.ggml.pre (or recognized in a tokenizer.json).
typedef enum st_pretok {
    ST_PRETOK_GPT2 = 0,  // the original GPT-2 pattern ("gpt-2", "default" or absent)
    ST_PRETOK_QWEN2 = 1, // "qwen2": Qwen2/2.5/3, Qwen3-Next
    ST_PRETOK_LLAMA3 = 2, // "llama-bpe": Llama 3
    ST_PRETOK_CUSTOM = 3, // another Split regex from a tokenizer.json, compiled as given
} st_pretok;

typedef struct st_tokenizer st_tokenizer;

// Builds the tokenizer from a GGUF's tokenizer.ggml.* keys (model "gpt2" only). Everything
// needed is copied: the GGUF may be closed afterwards.
st_status st_tokenizer_load_gguf(const st_gguf *g, st_tokenizer **out);
// Builds it from a Hugging Face tokenizer.json (BPE model, ByteLevel, one of the regexes above;
// NFC normalizer honoured). BOS/EOS come from tokenizer_config.json in the same folder, when
// present.
st_status st_tokenizer_load_json(const char *path, st_tokenizer **out);
void st_tokenizer_free(st_tokenizer *tok);

int32_t st_tokenizer_n_vocab(const st_tokenizer *tok);
st_pretok st_tokenizer_pretok(const st_tokenizer *tok);
bool st_tokenizer_nfc(const st_tokenizer *tok); // whether text is NFC-normalized first
int32_t st_tokenizer_bos(const st_tokenizer *tok); // -1 when the vocabulary has none
int32_t st_tokenizer_eos(const st_tokenizer *tok);
int32_t st_tokenizer_eot(const st_tokenizer *tok); // end of turn (<|im_end|> for Qwen); or eos
int32_t st_tokenizer_pad(const st_tokenizer *tok);
bool st_tokenizer_add_bos(const st_tokenizer *tok); // metadata asks for BOS to be prepended
// True for tokens that end generation: eos, eot, and <|endoftext|>-like tokens.
bool st_token_is_eog(const st_tokenizer *tok, int32_t id);
st_token_type st_token_get_type(const st_tokenizer *tok, int32_t id); // UNDEFINED if out of range
// The token's text as the vocabulary stores it (byte-level form: "Ġthe"); NUL-terminated.
// NULL if id is out of range.
const char *st_token_piece(const st_tokenizer *tok, int32_t id);
// The bytes the token decodes to ("Ġthe" -> " the"); NULL if out of range.
const char *st_token_bytes(const st_tokenizer *tok, int32_t id, size_t *len);
int32_t st_token_find(const st_tokenizer *tok, const char *piece, size_t len); // -1 if absent

// Tokenize flags.
#define ST_TOKENIZE_SPECIAL 1u // parse CONTROL tokens written in the text (<|im_start|>, ...)
#define ST_TOKENIZE_ADD_BOS 2u // prepend BOS (and append EOS) as the metadata asks

// Tokenizes text[0..len) (any bytes: invalid UTF-8 is kept byte for byte, see
// docs/TOKENIZER.md). *ids is allocated (free() it); *n is the count. Thread-safe: concurrent
// calls on one tokenizer are allowed (one of them uses the word cache, the others go without).
st_status st_tokenize(st_tokenizer *tok, const char *text, size_t len, unsigned flags,
                      int32_t **ids, size_t *n);

// Decodes ids to the exact bytes they stand for (not necessarily valid UTF-8). Control tokens
// are written as their text unless skip_control. *out is allocated (free() it), NUL-terminated.
st_status st_detokenize(const st_tokenizer *tok, const int32_t *ids, size_t n, bool skip_control,
                        char **out, size_t *len);

// Streaming decoder: feed ids one by one; each push returns only complete UTF-8 characters, so
// everything emitted so far is always valid UTF-8. Bytes that can never form a character become
// U+FFFD, as a whole decode followed by a lossy UTF-8 conversion would give.
typedef struct st_detok_stream st_detok_stream;
st_detok_stream *st_detok_stream_create(const st_tokenizer *tok, bool skip_control); // NULL: OOM
void st_detok_stream_free(st_detok_stream *s);
// *out points into the stream's buffer, valid until the next call; *len may be 0.
st_status st_detok_stream_push(st_detok_stream *s, int32_t id, const char **out, size_t *len);
// Ends the stream: an unfinished character at the end becomes U+FFFD. The stream can be reused.
st_status st_detok_stream_flush(st_detok_stream *s, const char **out, size_t *len);


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
    uint64_t max_steps;   // evaluations + loop iterations + calls + outputs (default 20 million)
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
