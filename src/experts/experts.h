// experts: where each routed expert lives (the placement map) and the routed-expert FFN over a
// batch of rows, computed expert by expert so each expert's weights are read once per batch.
// On the CPU-only path every expert is "host" and the CPU pool computes all of them.
#pragma once

#include <stdint.h>
#include "backend/backend.h"
#include "util/util.h"

#define ST_PLACE_HOST (-1)

// (layer, expert) -> slot >= 0 in the layer's device cache stack, or ST_PLACE_HOST. The forward
// asks; it never assumes. Each layer has its own stack of n_slots[layer] slots (one expert's
// gate, up and down each, in the layer's own types); swaps keep a layer's slot count.
typedef struct st_placement {
    int n_layer, n_expert;
    int32_t *slot;    // (n_layer, n_expert)
    int32_t *n_slots; // (n_layer)
} st_placement;

st_status st_placement_create_host(int n_layer, int n_expert, st_placement **out);
void st_placement_free(st_placement *p);
static inline int32_t st_placement_get(const st_placement *p, int layer, int expert) {
    return p->slot[(size_t)layer * p->n_expert + expert];
}

// ---------------------------------------------------------------------------------------------
// Expert profiles (docs/EXPERT_PROFILE.md): routing counts per (layer, expert).

// Reads the profile at path for a model of n_layer main layers, n_mtp MTP layers and n_expert
// experts into counts (n_layer + n_mtp, n_expert); a profile without the MTP row leaves that
// row zero. A file that is not a profile, or one made for another shape, is an error naming
// the file and what differs.
st_status st_profile_load(const char *path, int n_layer, int n_mtp, int n_expert, uint64_t *counts);
// Writes counts (n_rows, n_expert) as a version-1 profile (through a temporary file and a
// rename, so a failed write never leaves a truncated profile behind).
st_status st_profile_save(const char *path, int n_rows, int n_expert, const uint64_t *counts);

// ---------------------------------------------------------------------------------------------
// The cache plan: which experts a device's cache holds.

// The hottest experts by counts (NULL: all equally hot) over all layers, as many as fit in
// budget bytes (expert_bytes[l]: one expert of layer l, gate + up + down; 0 = the layer has no
// experts). Ties go to the lower expert id, then the lower layer, so equal counts spread over the
// layers. Sets p->slot (a layer's chosen experts get slots 0, 1, ... in expert order, the rest
// ST_PLACE_HOST) and p->n_slots; returns the number of experts placed.
int64_t st_placement_plan(st_placement *p, const uint64_t *counts, const size_t *expert_bytes, size_t budget);

// ---------------------------------------------------------------------------------------------
// Adaptive swaps: decayed routing counts, and every few windows the experts routed often but not
// cached replace cached ones routed less, in the same layer (the slot is reused).

typedef struct st_swap {
    int layer, slot;
    int in, out; // expert coming into the slot, expert leaving it
} st_swap;

typedef struct st_adapt st_adapt;
// every: windows between decisions (0: never swap); max_swaps per decision; decay in (0, 1]:
// the factor old scores are multiplied by each window. prior (NULL or (n_layer, n_expert)
// counts, e.g. the profile) seeds the scores.
st_status st_adapt_create(const st_placement *p, int every, int max_swaps, double decay, const uint64_t *prior,
                          st_adapt **out);
void st_adapt_free(st_adapt *a);
// One window happened; counts are the cumulative routing counts (st_experts_counts), of which
// the adapt object takes the difference since its last call. When a decision is due, up to
// max_swaps swaps are applied to p and written to out (the caller then copies the incoming
// experts' weights into their slots); returns how many.
int st_adapt_window(st_adapt *a, st_placement *p, const uint64_t *counts, st_swap *out);

// ---------------------------------------------------------------------------------------------
typedef struct st_experts st_experts;
st_status st_experts_create(const st_placement *placement, st_experts **out);
void st_experts_free(st_experts *ex);
// Computes the routed-expert FFN of a->n rows (host activations on the CPU path).
st_status st_experts_compute(st_experts *ex, st_backend *b, const st_moe_args *a);


// Counts of routed (layer, expert) pairs since the last reset, for profiles and cache stats.
const uint64_t *st_experts_counts(st_experts *ex); // (n_layer, n_expert)
