// experts: where each routed expert lives (the placement map) and the routed-expert FFN over a
// batch of rows, computed expert by expert so each expert's weights are read once per batch.
// On the CPU-only path every expert is "host" and the CPU pool computes all of them.
#pragma once

#include <stdint.h>
#include "backend/backend.h"
#include "util/util.h"

#define ST_PLACE_HOST (-1)

// (layer, expert) -> device slot >= 0, or ST_PLACE_HOST. The forward asks; it never assumes.
typedef struct st_placement {
    int n_layer, n_expert;
    int32_t *slot; // (n_layer, n_expert)
} st_placement;

st_status st_placement_create_host(int n_layer, int n_expert, st_placement **out);
void st_placement_free(st_placement *p);
static inline int32_t st_placement_get(const st_placement *p, int layer, int expert) {
    return p->slot[(size_t)layer * p->n_expert + expert];
}

typedef struct st_experts st_experts;
st_status st_experts_create(const st_placement *placement, st_experts **out);
void st_experts_free(st_experts *ex);
// Computes the routed-expert FFN of a->n rows (host activations on the CPU path).
st_status st_experts_compute(st_experts *ex, st_backend *b, const st_moe_args *a);


// Counts of routed (layer, expert) pairs since the last reset, for profiles and cache stats.
const uint64_t *st_experts_counts(const st_experts *ex); // (n_layer, n_expert)
