// engine: step-wise generation (strata_step_*): strata_generate's loop cut into bounded steps (a
// prompt chunk or one token), so one thread can interleave several sessions of a model.

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "strata.h"
#include "engine/engine.h"
#include "tokenizer/tokenizer.h"

struct strata_step {
    strata_session *s;
    st_tokenizer *tok;
    st_sampler *smp;
    st_detok_stream *ds;
    int n_vocab, chunk;
    int checkpoint;         // a prompt offset a chunk must end at (0: none)
    int32_t *prompt;        // (n_prompt) copied: the caller's buffer may go
    int n_prompt, n_read;   // prompt tokens, and how many the session has read
    int max_new;            // tokens that may be generated (the limit or the room left)
    int max_tokens;         // as asked (<= 0: none)
    float *logits;          // (n_vocab) the last position's
    bool dev_greedy;        // plain greedy on a GPU: the device picks the token (best), no logits
    int32_t best;
    int32_t *hist;          // (n_hist + max_new) the session's tokens then the generated ones
    int n_hist;
    char **stop;            // (n_stop) copies
    int n_stop;
    char *held;             // text held back while it could still begin a stop string
    size_t held_len, held_cap;
    bool done;
    strata_generate_stats stats;
    double t_prompt, t_gen; // when each phase began
    // JSON-constrained decoding (gen.json_object): the text so far as the validator read it.
    const st_json_vocab *json; // NULL: unconstrained
    st_json_state js;
};

static st_status held_append(strata_step *g, const char *text, size_t len) {
    if (g->held_len + len + 1 > g->held_cap) {
        size_t cap = (g->held_len + len + 1) * 2;
        char *nb = realloc(g->held, cap);
        if (!nb) return st_fail(ST_ERR_NOMEM, "generation: out of memory (%zu bytes of text)", cap);
        g->held = nb, g->held_cap = cap;
    }
    memcpy(g->held + g->held_len, text, len);
    g->held_len += len;
    g->held[g->held_len] = 0;
    return ST_OK;
}

// How many bytes at the front of the held text are final; *hit when a stop string completed
// (then only the text before it is final).
static size_t held_final(const strata_step *g, bool *hit) {
    size_t keep_from = g->held_len;
    *hit = false;
    for (int i = 0; i < g->n_stop; i++) {
        size_t sl = strlen(g->stop[i]);
        const char *at = memmem(g->held, g->held_len, g->stop[i], sl);
        if (at) {
            *hit = true;
            return (size_t)(at - g->held);
        }
        for (size_t k = sl - 1; k > 0; k--) // the longest end of the text that begins stop[i]
            if (k <= g->held_len && !memcmp(g->held + g->held_len - k, g->stop[i], k)) {
                if (g->held_len - k < keep_from) keep_from = g->held_len - k;
                break;
            }
    }
    return keep_from;
}

void strata_step_free(strata_step *g) {
    if (!g) return;
    st_sampler_free(g->smp);
    st_detok_stream_free(g->ds);
    for (int i = 0; i < g->n_stop; i++) free(g->stop[i]);
    free(g->stop);
    free(g->held);
    st_free(g->prompt);
    st_free(g->logits);
    st_free(g->hist);
    st_free(g);
}

strata_status strata_step_begin(strata_session *s, const int32_t *prompt, int n_prompt,
                                const strata_step_params *p, strata_step **out) {
    *out = NULL;
    strata_model *m = st_engine_session_model(s);
    st_tokenizer *tok;
    ST_TRY(st_engine_tokenizer(m, &tok));
    if (n_prompt < 1) return st_fail(ST_ERR_ARG, "the prompt is empty");
    int n_ctx = strata_session_ctx(s), pos = strata_session_pos(s), room = n_ctx - pos;
    if (n_prompt >= room)
        return st_fail(ST_ERR_RANGE, "the prompt (%d tokens) does not fit the context (%d positions free of %d)",
                       n_prompt, room, n_ctx);
    strata_step *g = st_calloc(1, sizeof *g);
    if (!g) return ST_ERR_NOMEM;
    g->s = s, g->tok = tok;
    g->n_vocab = strata_model_get_info(m).n_vocab;
    g->chunk = p->prompt_chunk > 0 ? p->prompt_chunk : st_engine_session_batch(s);
    g->checkpoint = p->checkpoint > 0 && p->checkpoint < n_prompt ? p->checkpoint : 0;
    g->max_tokens = p->gen.max_tokens;
    g->max_new = p->gen.max_tokens > 0 && p->gen.max_tokens < room - n_prompt ? p->gen.max_tokens : room - n_prompt;
    g->n_prompt = n_prompt;
    g->stats.n_prompt = n_prompt;
    g->stats.stop_reason = "length";
    // Plain greedy decoding (no penalty changes the logits) takes the argmax, which a GPU picks
    // itself: only the token id crosses PCIe.
    const strata_sampling *sm = &p->gen.sampling;
    g->dev_greedy = sm->temperature <= 0 && sm->repeat_penalty == 1 && sm->presence_penalty == 0 &&
                    sm->frequency_penalty == 0 && strata_model_get_info(m).gpu >= 0 && !p->gen.json_object;
    st_status st = p->gen.json_object ? st_engine_json_vocab(m, &g->json) : ST_OK;
    st_json_init(&g->js);
    if (!st) st = st_sampler_create(&p->gen.sampling, g->n_vocab, &g->smp);
    const int32_t *held;
    int n_held = strata_session_tokens(s, &held);
    if (!st) {
        g->prompt = st_alloc(sizeof(int32_t) * (size_t)n_prompt);
        g->logits = st_alloc(sizeof(float) * (size_t)g->n_vocab);
        g->hist = st_alloc(sizeof(int32_t) * ((size_t)n_held + n_prompt + g->max_new + 1));
        g->ds = st_detok_stream_create(tok, true);
        g->stop = calloc((size_t)(p->gen.n_stop > 0 ? p->gen.n_stop : 1), sizeof *g->stop);
        if (!g->prompt || !g->logits || !g->hist || !g->ds || !g->stop)
            st = st_fail(ST_ERR_NOMEM, "generation: out of memory");
    }
    for (int i = 0; !st && i < p->gen.n_stop; i++) {
        if (!p->gen.stop[i] || !p->gen.stop[i][0]) continue; // an empty stop string stops nothing
        if (!(g->stop[g->n_stop] = strdup(p->gen.stop[i]))) st = st_fail(ST_ERR_NOMEM, "generation: out of memory");
        else g->n_stop++;
    }
    if (st) {
        strata_step_free(g);
        return st;
    }
    memcpy(g->prompt, prompt, sizeof(int32_t) * (size_t)n_prompt);
    memcpy(g->hist, held, sizeof(int32_t) * (size_t)n_held);
    memcpy(g->hist + n_held, prompt, sizeof(int32_t) * (size_t)n_prompt);
    g->n_hist = n_held + n_prompt;
    *out = g;
    return ST_OK;
}

int strata_step_prompt_read(const strata_step *g) { return g->n_read; }

void strata_step_stats(const strata_step *g, strata_generate_stats *stats) { *stats = g->stats; }

// Feeds one token: the next one's logits, or (dev_greedy) just its greedy choice.
static st_status eval_next(strata_step *g, const int32_t *tok) {
    return g->dev_greedy ? strata_session_eval_argmax(g->s, tok, 1, &g->best) : strata_session_eval(g->s, tok, 1, g->logits);
}

// Reads the next prompt chunk. Only the last position's logits are needed: the final chunk's
// last token goes through alone, so no (rows, n_vocab) buffer is ever made.
static st_status read_chunk(strata_step *g) {
    if (g->n_read == 0) g->t_prompt = st_time_s();
    int n = g->n_prompt - g->n_read < g->chunk ? g->n_prompt - g->n_read : g->chunk;
    if (g->n_read < g->checkpoint && g->n_read + n > g->checkpoint) n = g->checkpoint - g->n_read;
    bool last = g->n_read + n == g->n_prompt;
    const int32_t *t = g->prompt + g->n_read;
    if (!last) ST_TRY(strata_session_eval(g->s, t, n, NULL));
    else {
        if (n > 1) ST_TRY(strata_session_eval(g->s, t, n - 1, NULL));
        ST_TRY(eval_next(g, t + n - 1));
    }
    g->n_read += n;
    if (last) {
        g->stats.prompt_s = st_time_s() - g->t_prompt;
        g->t_gen = st_time_s();
    }
    return ST_OK;
}

// The end: the detokenizer's and the stop filter's remains are final unless a stop string or
// the caller ended it.
static st_status finish(strata_step *g, strata_text_fn on_text, void *ctx) {
    g->done = true;
    st_status st = ST_OK;
    if (strcmp(g->stats.stop_reason, "stop") && strcmp(g->stats.stop_reason, "callback")) {
        const char *text;
        size_t len;
        st = st_detok_stream_flush(g->ds, &text, &len);
        if (!st && len) st = held_append(g, text, len);
        bool hit;
        size_t final = st ? 0 : held_final(g, &hit);
        if (!st && hit) g->held_len = final;
        if (!st && g->held_len) on_text(ctx, g->held, g->held_len);
    }
    g->held_len = 0;
    g->stats.generate_s = g->t_gen > 0 ? st_time_s() - g->t_gen : 0;
    return st;
}

// ---- JSON constraint: the mask before sampling, the validator after.

// Picks the token from the masked logits and advances the validator over its bytes.
static st_status json_sample(strata_step *g, int32_t *tok) {
    if (!st_json_mask(g->json, &g->js, g->logits, g->n_vocab))
        return st_fail(ST_ERR_UNSUPPORTED, "JSON constraint: no token of the vocabulary can continue the JSON");
    *tok = st_sampler_sample(g->smp, g->logits, g->hist, g->n_hist);
    if (!st_json_token_ok(g->json, &g->js, *tok)) { // a draw that rounding sent onto a masked token: the best left
        int best = -1;
        for (int i = 0; i < g->n_vocab; i++)
            if (g->logits[i] != -INFINITY && (best < 0 || g->logits[i] > g->logits[best])) best = i;
        ST_ASSERT(best >= 0 && st_json_token_ok(g->json, &g->js, best));
        *tok = best;
    }
    size_t len;
    const char *b = st_token_bytes(g->tok, *tok, &len);
    bool fed = st_token_is_eog(g->tok, *tok) || st_json_feed(&g->js, b, len);
    ST_ASSERT(fed); // the mask let only such tokens through
    return ST_OK;
}

// ----

// Samples one token, hands its final text on, and feeds it unless generation ends there.
static st_status next_token(strata_step *g, strata_text_fn on_text, void *ctx) {
    int32_t tok;
    if (g->json) ST_TRY(json_sample(g, &tok));
    else tok = g->dev_greedy ? g->best : st_sampler_sample(g->smp, g->logits, g->hist, g->n_hist);
    if (st_token_is_eog(g->tok, tok)) {
        g->stats.stop_reason = "eog";
        return finish(g, on_text, ctx);
    }
    g->hist[g->n_hist++] = tok;
    g->stats.n_generated++;
    const char *text;
    size_t len;
    ST_TRY(st_detok_stream_push(g->ds, tok, &text, &len));
    ST_TRY(held_append(g, text, len));
    bool hit, go_on = true;
    size_t final = held_final(g, &hit);
    if (final) go_on = on_text(ctx, g->held, final);
    memmove(g->held, g->held + final, g->held_len - final);
    g->held_len -= final;
    if (hit) {
        g->stats.stop_reason = "stop";
        return finish(g, on_text, ctx);
    }
    if (!go_on) {
        g->stats.stop_reason = "callback";
        return finish(g, on_text, ctx);
    }
    if (g->json && st_json_complete(&g->js)) { // the object is closed: as if the model ended its turn
        g->stats.stop_reason = "eog";
        return finish(g, on_text, ctx);
    }
    if (g->stats.n_generated == g->max_new) { // the limit asked for, or the end of the context
        g->stats.stop_reason = g->max_tokens > 0 && g->max_new == g->max_tokens ? "length" : "context";
        return finish(g, on_text, ctx);
    }
    return eval_next(g, &tok);
}

strata_status strata_step_next(strata_step *g, strata_text_fn on_text, void *ctx, bool *done) {
    st_status st = ST_OK;
    if (!g->done) {
        st = g->n_read < g->n_prompt ? read_chunk(g) : next_token(g, on_text, ctx);
        if (st) { // a failed step ends the generation; the session's state is the caller's to reset
            g->done = true;
            g->stats.stop_reason = "error";
        }
    }
    *done = g->done;
    return st;
}

bool strata_token_is_eog(const strata_model *m, int32_t token) {
    st_tokenizer *tok;
    return !st_engine_tokenizer(m, &tok) && st_token_is_eog(tok, token);
}
