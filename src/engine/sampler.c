// engine: the one sampler. Order as Hugging Face's generate applies its processors:
// penalties (repetition, presence, frequency over the last penalty_last_n tokens), then
// temperature, then top-k, top-p and min-p on the tempered distribution, then a draw from a
// seeded generator. Temperature 0 is greedy (argmax after the penalties; ties: lowest id).

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"

struct st_sampler {
    strata_sampling p;
    int n_vocab;
    uint64_t rng[4];      // xoshiro256** state
    float *prob;          // (n_vocab) scratch
    int32_t *idx;         // (n_vocab) candidate ids
    uint16_t *seen;       // (n_vocab) counts in the penalty window
};

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t rng_next(uint64_t s[4]) {
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0], s[3] ^= s[1], s[1] ^= s[2], s[0] ^= s[3], s[2] ^= t, s[3] = rotl(s[3], 45);
    return r;
}

static double rng_uniform(uint64_t s[4]) { return (rng_next(s) >> 11) * (1.0 / 9007199254740992.0); }

// The first setting out of its range, named alone (the comparisons are written so NaN fails).
static st_status check_sampling(const strata_sampling *p) {
    const char *m = "sampling: %s %g must be %s";
    if (!(p->temperature >= 0)) return st_fail(ST_ERR_ARG, m, "temperature", p->temperature, ">= 0 (0: greedy)");
    if (p->top_k < 0) return st_fail(ST_ERR_ARG, m, "top_k", (double)p->top_k, ">= 0 (0: off)");
    if (!(p->top_p > 0 && p->top_p <= 1)) return st_fail(ST_ERR_ARG, m, "top_p", p->top_p, "in (0, 1] (1: off)");
    if (!(p->min_p >= 0 && p->min_p <= 1)) return st_fail(ST_ERR_ARG, m, "min_p", p->min_p, "in [0, 1] (0: off)");
    if (!(p->repeat_penalty > 0))
        return st_fail(ST_ERR_ARG, m, "repeat_penalty", p->repeat_penalty, "> 0 (1: off)");
    if (p->penalty_last_n < 0) return st_fail(ST_ERR_ARG, m, "penalty_last_n", (double)p->penalty_last_n, ">= 0");
    return ST_OK;
}

st_status st_sampler_create(const strata_sampling *p, int n_vocab, st_sampler **out) {
    *out = NULL;
    st_status st = check_sampling(p);
    if (st != ST_OK) return st;
    st_sampler *s = st_calloc(1, sizeof *s);
    if (!s) return ST_ERR_NOMEM;
    s->p = *p;
    s->n_vocab = n_vocab;
    s->prob = st_alloc(sizeof(float) * n_vocab);
    s->idx = st_alloc(sizeof(int32_t) * n_vocab);
    s->seen = st_calloc((size_t)n_vocab, sizeof(uint16_t));
    if (!s->prob || !s->idx || !s->seen) {
        st_sampler_free(s);
        return ST_ERR_NOMEM;
    }
    uint64_t z = p->seed;
    for (int i = 0; i < 4; i++) { // splitmix64 to seed the generator
        z += 0x9e3779b97f4a7c15ull;
        uint64_t x = z;
        x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
        x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
        s->rng[i] = x ^ (x >> 31);
    }
    *out = s;
    return ST_OK;
}

void st_sampler_free(st_sampler *s) {
    if (!s) return;
    st_free(s->prob);
    st_free(s->idx);
    st_free(s->seen);
    st_free(s);
}

static void penalize(st_sampler *s, float *logits, const int32_t *history, int n) {
    const strata_sampling *p = &s->p;
    if (p->repeat_penalty == 1.0f && p->presence_penalty == 0 && p->frequency_penalty == 0) return;
    int from = p->penalty_last_n > 0 && n > p->penalty_last_n ? n - p->penalty_last_n : 0;
    if (p->penalty_last_n == 0) from = n; // an empty window
    for (int i = from; i < n; i++)
        if (history[i] >= 0 && history[i] < s->n_vocab && s->seen[history[i]] < UINT16_MAX) s->seen[history[i]]++;
    for (int i = from; i < n; i++) {
        int32_t t = history[i];
        if (t < 0 || t >= s->n_vocab || !s->seen[t]) continue;
        float l = logits[t];
        l = l > 0 ? l / p->repeat_penalty : l * p->repeat_penalty;
        logits[t] = l - p->presence_penalty - p->frequency_penalty * s->seen[t];
        s->seen[t] = 0; // each token once; also clears the counts for the next call
    }
}

static int cmp_desc(const void *a, const void *b, void *ctx) {
    const float *pr = ctx;
    float x = pr[*(const int32_t *)a], y = pr[*(const int32_t *)b];
    if (x != y) return x < y ? 1 : -1;
    return *(const int32_t *)a - *(const int32_t *)b;
}

int32_t st_sampler_sample(st_sampler *s, float *logits, const int32_t *history, int n) {
    const strata_sampling *p = &s->p;
    int V = s->n_vocab;
    penalize(s, logits, history, n);
    if (p->temperature <= 0) {
        int best = 0;
        for (int i = 1; i < V; i++)
            if (logits[i] > logits[best]) best = i;
        return best;
    }
    // Tempered softmax.
    float mx = -INFINITY;
    for (int i = 0; i < V; i++) mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0;
    for (int i = 0; i < V; i++) sum += s->prob[i] = expf((logits[i] - mx) / p->temperature);
    // Candidates: the top_k most likely (a min-heap of k over the vocabulary), or all.
    int n_cand = 0;
    if (p->top_k > 0 && p->top_k < V) {
        int k = p->top_k;
        int32_t *h = s->idx;
        for (int i = 0; i < V; i++) {
            if (n_cand < k) { // sift up
                int c = n_cand++;
                h[c] = i;
                while (c > 0 && s->prob[h[(c - 1) / 2]] > s->prob[h[c]]) {
                    int32_t t = h[c]; h[c] = h[(c - 1) / 2]; h[(c - 1) / 2] = t;
                    c = (c - 1) / 2;
                }
            } else if (s->prob[i] > s->prob[h[0]]) { // replace the smallest, sift down
                h[0] = i;
                for (int c = 0;;) {
                    int l = 2 * c + 1, r = l + 1, m = c;
                    if (l < k && s->prob[h[l]] < s->prob[h[m]]) m = l;
                    if (r < k && s->prob[h[r]] < s->prob[h[m]]) m = r;
                    if (m == c) break;
                    int32_t t = h[c]; h[c] = h[m]; h[m] = t;
                    c = m;
                }
            }
        }
    } else {
        for (int i = 0; i < V; i++) s->idx[n_cand++] = i;
    }
    qsort_r(s->idx, (size_t)n_cand, sizeof(int32_t), cmp_desc, s->prob);
    // top-p: the smallest prefix whose mass reaches top_p (of the whole distribution).
    if (p->top_p < 1.0f) {
        double acc = 0;
        for (int i = 0; i < n_cand; i++) {
            acc += s->prob[s->idx[i]] / sum;
            if (acc >= p->top_p) {
                n_cand = i + 1;
                break;
            }
        }
    }
    // min-p: drop candidates below min_p times the most likely one.
    if (p->min_p > 0) {
        float lim = s->prob[s->idx[0]] * p->min_p;
        int keep = 1;
        while (keep < n_cand && s->prob[s->idx[keep]] >= lim) keep++;
        n_cand = keep;
    }
    double total = 0;
    for (int i = 0; i < n_cand; i++) total += s->prob[s->idx[i]];
    double r = rng_uniform(s->rng) * total;
    for (int i = 0; i < n_cand; i++) {
        r -= s->prob[s->idx[i]];
        if (r <= 0) return s->idx[i];
    }
    return s->idx[n_cand - 1];
}
