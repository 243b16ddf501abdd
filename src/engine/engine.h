// engine (internal): the sampler and the JSON constraint. The public API is include/strata.h.
#pragma once

#include <stdint.h>
#include "strata.h"
#include "util/util.h"

typedef struct st_sampler st_sampler;

st_status st_sampler_create(const strata_sampling *p, int n_vocab, st_sampler **out);
void st_sampler_free(st_sampler *s);
// Picks the next token from logits (n_vocab floats, modified in place by the penalties and
// temperature) given the recent tokens history[0..n) (oldest first).
int32_t st_sampler_sample(st_sampler *s, float *logits, const int32_t *history, int n);

// The model's tokenizer, or NULL with a message naming the file when it has none (step.c).
typedef struct st_tokenizer st_tokenizer;
st_status st_engine_tokenizer(const strata_model *m, st_tokenizer **out);
strata_model *st_engine_session_model(const strata_session *s); // the model a session belongs to
int st_engine_session_batch(const strata_session *s);            // its prompt chunk (n_batch)

// ---- JSON-constrained decoding (json_constraint.c): response_format json_object.
// An incremental validator of one JSON object (RFC 8259; leading and trailing whitespace
// allowed, up to ST_JSON_MAX_WS bytes in a row). Copyable: checking a token runs its bytes on a copy.
#define ST_JSON_MAX_DEPTH 64 // nested containers: the stack is one bit a level in a uint64_t
#define ST_JSON_MAX_WS 20    // whitespace bytes in a row outside strings: a newline and 4 levels of 4-space indent
typedef struct st_json_state {
    uint64_t stack;         // bit i: level i is an object (1) or an array (0)
    uint16_t u;             // a \u escape's value so far
    uint8_t mode, depth;    // the automaton's state; open containers
    uint8_t aux, aux2;      // per mode: hex digits / UTF-8 bytes to come / the literal and its position
    uint8_t lo, hi;         // the next UTF-8 continuation byte's range
    uint8_t key, low;       // the string is an object's key; the \u is a surrogate's low half
    uint8_t ws;             // whitespace bytes in a row (outside strings)
} st_json_state;
void st_json_init(st_json_state *s);
// Feeds bytes; false (s unchanged) when they would leave the valid prefixes of one JSON object.
bool st_json_feed(st_json_state *s, const void *bytes, size_t n);
bool st_json_complete(const st_json_state *s); // the top-level object is closed

// A model's vocabulary indexed for the mask (built once per model, read-only afterwards).
typedef struct st_json_vocab st_json_vocab;
st_status st_json_vocab_create(const st_tokenizer *tok, st_json_vocab **out);
void st_json_vocab_free(st_json_vocab *v);
// Sets logits[id] (n_logits floats) to -INFINITY for every token whose bytes would leave the
// language from state s: control and other special tokens always, the end-of-generation tokens
// until the object is complete, ids past the tokenizer's vocabulary. Returns how many are left.
int st_json_mask(const st_json_vocab *v, const st_json_state *s, float *logits, int n_logits);
// Whether token id may follow state s (what st_json_mask leaves).
bool st_json_token_ok(const st_json_vocab *v, const st_json_state *s, int32_t id);
// The model's index, built on first use and kept until the model is closed (engine.c).
st_status st_engine_json_vocab(strata_model *m, const st_json_vocab **out);
