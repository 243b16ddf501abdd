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
