// experts: the cache plan (which experts start in a device's cache, from a profile's counts) and
// the adaptive swaps that keep the cache following the routing while the model runs (decayed
// counts; every few windows the hottest uncached experts replace the coldest cached ones).

#include <stdlib.h>
#include <string.h>

#include "experts/experts.h"

// ---------------------------------------------------------------------------------------------
// The plan

typedef struct hot_order {
    const uint64_t *counts; // (n_layer, n_expert) or NULL: all equally hot
    int n_expert;
} hot_order;

// Hottest first; ties go to the lower expert id, then the lower layer, so that equal counts
// (and no profile at all) spread the cache over the layers instead of filling the first ones.
static int cmp_hot(const void *pa, const void *pb, void *ctx) {
    const hot_order *h = ctx;
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    uint64_t ca = h->counts ? h->counts[a] : 0, cb = h->counts ? h->counts[b] : 0;
    if (ca != cb) return ca > cb ? -1 : 1;
    int ea = a % h->n_expert, eb = b % h->n_expert;
    if (ea != eb) return ea < eb ? -1 : 1;
    return (a > b) - (a < b); // the same expert id: index order is layer order
}

static int cmp_index(const void *pa, const void *pb) {
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    return (a > b) - (a < b);
}

int64_t st_placement_plan(st_placement *p, const uint64_t *counts, const size_t *expert_bytes, size_t budget) {
    int L = p->n_layer, E = p->n_expert;
    ST_ASSERT(L >= 0 && E >= 0 && (int64_t)L * E <= INT32_MAX && expert_bytes);
    int64_t N = (int64_t)L * E;
    // p->slot (N values) is the scratch list of (layer, expert) indices until the map is written
    // at the end, so the plan needs no memory of its own and cannot fail.
    int32_t *order = p->slot;
    int64_t n = 0;
    size_t smallest = SIZE_MAX;
    for (int l = 0; l < L; l++) {
        if (!expert_bytes[l]) continue; // a layer without experts is never placed
        if (expert_bytes[l] < smallest) smallest = expert_bytes[l];
        for (int e = 0; e < E; e++) order[n++] = (int32_t)((int64_t)l * E + e);
    }
    hot_order h = {.counts = counts, .n_expert = E};
    qsort_r(order, (size_t)n, sizeof *order, cmp_hot, &h);

    // Hottest first while the budget lasts; an expert too large for what is left is skipped, as a
    // smaller one of another layer may still fit. The chosen ones move to the front of order[].
    int64_t n_chosen = 0;
    size_t left = budget;
    for (int64_t i = 0; i < n && left >= smallest; i++) {
        size_t bytes = expert_bytes[order[i] / E];
        if (bytes > left) continue;
        left -= bytes;
        order[n_chosen++] = order[i];
    }

    // Index order is layer by layer, expert by expert: slots 0, 1, ... go in expert order.
    qsort(order, (size_t)n_chosen, sizeof *order, cmp_index);
    if (L) memset(p->n_slots, 0, sizeof(int32_t) * (size_t)L);
    for (int64_t i = 0; i < n_chosen; i++) p->n_slots[order[i] / E]++;
    // Write the map from the back: the chosen list is ascending and distinct, so order[j] >= j,
    // and every position written (order[j] and above) has already been read.
    int64_t end = N; // positions from end on are final
    int layer = -1;
    int32_t slot = 0;
    for (int64_t j = n_chosen - 1; j >= 0; j--) {
        int32_t idx = order[j];
        if (idx / E != layer) layer = idx / E, slot = p->n_slots[layer];
        for (int64_t k = idx + 1; k < end; k++) p->slot[k] = ST_PLACE_HOST;
        p->slot[idx] = --slot;
        end = idx;
    }
    for (int64_t k = 0; k < end; k++) p->slot[k] = ST_PLACE_HOST;
    return n_chosen;
}

size_t st_vram_allowance(size_t budget, size_t total, size_t avail) {
    if (!budget) return avail;
    if (!total) return budget < avail ? budget : avail;
    size_t taken = total > avail ? total - avail : 0; // in use already, and the reserve
    size_t left = budget > taken ? budget - taken : 0;
    return left < avail ? left : avail;
}

// ---------------------------------------------------------------------------------------------
// --pcie-frac

int st_pcie_split(const int32_t *rows, int n_expert, double frac, uint8_t *gpu) {
    if (!(frac > 0)) frac = 0; // also NaN
    if (frac > 1) frac = 1;
    int missed = 0;
    for (int e = 0; e < n_expert; e++) {
        gpu[e] = 0;
        missed += rows[e] > 0;
    }
    int want = (int)(frac * missed + 0.5);
    // A selection over the few missed experts of a layer (at most a window's rows times k): the
    // one with the most rows not taken yet, lower id on ties, want times.
    for (int t = 0; t < want; t++) {
        int best = -1;
        for (int e = 0; e < n_expert; e++)
            if (rows[e] > 0 && !gpu[e] && (best < 0 || rows[e] > rows[best])) best = e;
        gpu[best] = 1;
    }
    return want;
}

double st_pcie_pick(st_pcie_probe *p) {
    p->cpu_s = p->split_s = 0;
    p->frac = 0;
    if (!(p->link_gbs > 0 && p->cpu_gbs > 0 && p->miss_bytes > 0)) return 0;
    double link = p->link_gbs * 1e9, cpu = p->cpu_gbs * 1e9;
    p->cpu_s = p->miss_bytes / cpu;
    // Balanced, both sides finish together: frac / link = (1 - frac) / cpu.
    double f = (double)(int)(link / (link + cpu) / 0.05 + 0.5) * 0.05;
    if (f <= 0) return 0;
    if (f > 1) f = 1;
    double t_link = f * p->miss_bytes / link, t_cpu = (1 - f) * p->miss_bytes / cpu;
    p->split_s = (t_link > t_cpu ? t_link : t_cpu) + p->sync_s;
    if (p->split_s < ST_PCIE_MARGIN * p->cpu_s) p->frac = f;
    return p->frac;
}

// ---------------------------------------------------------------------------------------------
// Adaptive swaps

typedef struct swap_cand {
    double gain; // score of the incoming expert - score of the outgoing one
    int layer, rank, in, out;
} swap_cand;

struct st_adapt {
    int n_layer, n_expert, every, max_swaps;
    double decay;
    int64_t windows;            // windows seen
    double *score;              // (n_layer, n_expert) decayed routing counts
    uint64_t *last;             // (n_layer, n_expert) the cumulative counts at the previous window
    int32_t *cached, *uncached; // (n_expert) one layer's experts, scratch of a decision
    swap_cand *cand;            // (n_layer * per_layer) the candidate swaps of a decision
};

st_status st_adapt_create(const st_placement *p, int every, int max_swaps, double decay, const uint64_t *prior,
                          st_adapt **out) {
    *out = NULL;
    if (!p || p->n_layer < 0 || p->n_expert < 0)
        return st_fail(ST_ERR_ARG, "expert cache swaps: no placement to adapt");
    if (!(decay > 0 && decay <= 1)) // also refuses NaN
        return st_fail(ST_ERR_ARG, "expert cache swaps: decay %g is not in (0, 1] (the factor each window "
                       "multiplies the old routing counts by)", decay);
    if (every < 0)
        return st_fail(ST_ERR_ARG, "expert cache swaps: every %d windows: must be 0 (never swap) or more", every);
    if (max_swaps < 0)
        return st_fail(ST_ERR_ARG, "expert cache swaps: at most %d swaps per decision: must be 0 or more", max_swaps);
    int L = p->n_layer, E = p->n_expert;
    size_t N = (size_t)L * E;
    // A layer's swaps pair distinct cached and uncached experts: at most E / 2 of them.
    size_t per_layer = (size_t)(max_swaps < E / 2 ? max_swaps : E / 2);
    st_adapt *a = st_calloc(1, sizeof *a);
    if (!a) return ST_ERR_NOMEM;
    *a = (st_adapt){.n_layer = L, .n_expert = E, .every = every, .max_swaps = max_swaps, .decay = decay};
    a->score = st_calloc(N ? N : 1, sizeof(double));
    a->last = st_calloc(N ? N : 1, sizeof(uint64_t));
    a->cached = st_calloc(E ? E : 1, sizeof(int32_t));
    a->uncached = st_calloc(E ? E : 1, sizeof(int32_t));
    size_t n_cand = (size_t)L * per_layer;
    a->cand = st_calloc(n_cand ? n_cand : 1, sizeof(swap_cand));
    if (!a->score || !a->last || !a->cached || !a->uncached || !a->cand) {
        st_adapt_free(a);
        return st_fail_prefix(ST_ERR_NOMEM, "expert cache swaps for %d layers x %d experts", L, E);
    }
    for (size_t i = 0; prior && i < N; i++) a->score[i] = (double)prior[i];
    *out = a;
    return ST_OK;
}

void st_adapt_free(st_adapt *a) {
    if (!a) return;
    st_free(a->score);
    st_free(a->last);
    st_free(a->cached);
    st_free(a->uncached);
    st_free(a->cand);
    st_free(a);
}

// Sorts one layer's experts by score, coldest first (cmp_cold) or hottest first (cmp_warm);
// ties go to the lower expert id either way, so decisions are deterministic.
static int cmp_cold(const void *pa, const void *pb, void *ctx) {
    const double *s = ctx;
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    if (s[a] != s[b]) return s[a] < s[b] ? -1 : 1;
    return (a > b) - (a < b);
}
static int cmp_warm(const void *pa, const void *pb, void *ctx) {
    const double *s = ctx;
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    if (s[a] != s[b]) return s[a] > s[b] ? -1 : 1;
    return (a > b) - (a < b);
}

static int cmp_gain(const void *pa, const void *pb) {
    const swap_cand *a = pa, *b = pb;
    if (a->gain != b->gain) return a->gain > b->gain ? -1 : 1;
    if (a->layer != b->layer) return a->layer < b->layer ? -1 : 1;
    return (a->rank > b->rank) - (a->rank < b->rank);
}

static int decide(st_adapt *a, st_placement *p, st_swap *out) {
    int E = a->n_expert, n_cand = 0;
    for (int l = 0; l < a->n_layer; l++) {
        int ns = p->n_slots[l];
        if (ns <= 0 || ns >= E) continue; // nothing cached, or everything: nothing to swap
        const double *s = a->score + (size_t)l * E;
        int nc = 0, nu = 0;
        for (int e = 0; e < E; e++) {
            if (st_placement_get(p, l, e) == ST_PLACE_HOST) a->uncached[nu++] = e;
            else a->cached[nc++] = e;
        }
        ST_ASSERT(nc == ns);
        qsort_r(a->cached, (size_t)nc, sizeof(int32_t), cmp_cold, (void *)s);
        qsort_r(a->uncached, (size_t)nu, sizeof(int32_t), cmp_warm, (void *)s);
        // Pair the r-th hottest uncached expert with the r-th coldest cached one. A pair is a
        // candidate only when the incoming expert is clearly hotter: 25% more plus one routing.
        // The hysteresis keeps two experts of nearly equal heat from trading the slot back and
        // forth every decision (each swap copies an expert's weights over PCIe). The gains fall
        // with r, so the first pair that fails ends the layer's list.
        int max_r = nc < nu ? nc : nu;
        if (max_r > a->max_swaps) max_r = a->max_swaps;
        for (int r = 0; r < max_r; r++) {
            int in = a->uncached[r], o = a->cached[r];
            if (!(s[in] > 1.25 * s[o] + 1)) break;
            a->cand[n_cand++] = (swap_cand){.gain = s[in] - s[o], .layer = l, .rank = r, .in = in, .out = o};
        }
    }
    // The largest gains first over all layers; within a layer gains fall with rank, so taking a
    // layer's pair r means its pairs before r were taken too.
    qsort(a->cand, (size_t)n_cand, sizeof *a->cand, cmp_gain);
    int n = n_cand < a->max_swaps ? n_cand : a->max_swaps;
    for (int i = 0; i < n; i++) {
        const swap_cand *c = &a->cand[i];
        int32_t *row = p->slot + (size_t)c->layer * E;
        int slot = row[c->out];
        row[c->in] = slot;
        row[c->out] = ST_PLACE_HOST;
        out[i] = (st_swap){.layer = c->layer, .slot = slot, .in = c->in, .out = c->out};
    }
    return n;
}

// out needs room for max_swaps swaps.
int st_adapt_window(st_adapt *a, st_placement *p, const uint64_t *counts, st_swap *out, bool may_swap) {
    ST_ASSERT(p->n_layer == a->n_layer && p->n_expert == a->n_expert);
    size_t N = (size_t)a->n_layer * a->n_expert;
    for (size_t i = 0; i < N; i++) {
        // Cumulative counts that went down were restarted (a new session): all of them are new.
        uint64_t c = counts[i], delta = c >= a->last[i] ? c - a->last[i] : c;
        double s = a->score[i] * a->decay + (double)delta;
        a->score[i] = s < 1e-30 ? 0 : s; // long-unused experts must not sink into slow subnormals
        a->last[i] = c;
    }
    a->windows++;
    if (!may_swap || a->every == 0 || a->max_swaps == 0 || a->windows % a->every) return 0;
    return decide(a, p, out);
}
