// engine (internal): the sampler. The public API is include/strata.h.
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
