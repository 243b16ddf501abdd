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

// What --vram-budget-gib G leaves Strata, G read as the size of the whole card (a card of G GiB
// emulated): G less what is already taken when placement starts (the CUDA context, other
// programs, the reserve), i.e. budget - (total - avail), and never more than avail. avail: bytes
// the device can still give now, after the reserve (mem_free); total: the device's memory (0 =
// unknown: then min(budget, avail)). budget 0: no budget, avail.
size_t st_vram_allowance(size_t budget, size_t total, size_t avail);

// ---------------------------------------------------------------------------------------------
// --pcie-frac: a share of a decode window's missed experts copied to the device and computed
// there, the rest on the CPU pool at the same time.

// Splits one layer's missed experts: rows[e] is the routed rows of expert e the device's cache
// lacks (0: not missed). round(frac * missed) of them, those with the most rows first (ties:
// the lower id), get gpu[e] = 1; every other expert gets 0. Returns how many went to the GPU.
// frac is clamped to [0, 1].
int st_pcie_split(const int32_t *rows, int n_expert, double frac, uint8_t *gpu);

// The start-up probe's figures and what they predict for a decode token's hybrid layer.
typedef struct st_pcie_probe {
    double link_gbs;   // host -> device copies of experts, GB/s (from where the arena keeps them)
    double cpu_gbs;    // expert bytes the CPU pool computes per second for one row, GB/s
    double miss_bytes; // expert bytes a decode token misses in a hybrid layer, on average
    double sync_s;     // the streaming path's fixed cost per layer (read-back, eager launches)
    // Results of st_pcie_pick:
    double cpu_s;      // the layer's misses all on the CPU (--pcie-frac 0)
    double split_s;    // split at frac: the longer of the two sides, plus sync_s
    double frac;       // the pick
} st_pcie_probe;
// The share that balances the link and the CPU (link / (link + cpu), in steps of 0.05), when the
// split beats the CPU alone by a clear margin (ST_PCIE_MARGIN) after the fixed cost; else 0.
// Measured on the H200 machine (PCIe 5, 30B-A3B shape at 12 GiB): the streaming path moved a
// token's misses at 21 GB/s against the probe's 53.7 (copies of single experts between eager
// launches), so the probe's figure is derated by ST_PCIE_LINK_EFF; and F = 0.5 / 1 decoded at
// 84.5 / 82.5 tok/s against 125.8 with every miss on the CPU pool: windows without a CUDA graph
// plus a read-back per layer cost ~100 us a layer, not the 30 first assumed.
#define ST_PCIE_MARGIN 0.8
#define ST_PCIE_SYNC_S 100e-6
#define ST_PCIE_LINK_EFF 0.4
double st_pcie_pick(st_pcie_probe *p);

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
// may_swap false: the scores only (swaps of an earlier decision are still on their way).
int st_adapt_window(st_adapt *a, st_placement *p, const uint64_t *counts, st_swap *out, bool may_swap);

// ---------------------------------------------------------------------------------------------
// ---------------------------------------------------------------------------------------------
// A device's expert cache and the host arena.

// One layer's routed experts: stacks of n matrices (gate, up: (F, d); down: (d, F)).
typedef struct st_expert_weights {
    st_mat3 gate, up, down;
} st_expert_weights;

// Bytes of one expert (gate + up + down rows; 0 for a layer without experts).
static inline size_t st_expert_bytes(const st_expert_weights *w) {
    return w->gate.n ? (size_t)w->gate.rows * w->gate.row_bytes + (size_t)w->up.rows * w->up.row_bytes +
                           (size_t)w->down.rows * w->down.row_bytes
                     : 0;
}
// Compact stacks of n experts shaped like `like`, gate then up then down in mem (n *
// st_expert_bytes(like) bytes).
st_expert_weights st_expert_stack(const st_expert_weights *like, int n, void *mem);
// Copies experts e .. e+count-1 of host stacks src into slots slot.. of device stacks dst.
void st_expert_upload(st_backend *b, const st_expert_weights *dst, const st_expert_weights *src, int slot, int e,
                      int count);

// Per layer, a stack of n_slots[l] experts for each of gate, up and down in backend memory, and
// the device copy of the placement's slot map (what ops->moe reads).
typedef struct st_expert_cache {
    int n_layer, n_expert;
    st_expert_weights *slots;     // (n_layer) stacks, n = the layer's slot count (data NULL: none)
    int32_t *map_dev;             // (n_layer, n_expert) backend memory: the slots the device uses
    // (n_layer, n_expert) host memory: map_dev's values, what a window's misses are counted
    // against. It differs from the placement while a swap's copy is on its way: the placement
    // has the incoming expert in its slot already, the maps not yet.
    int32_t *map_host;
    // Swaps begun whose copies may still be on their way, for every session that uses the cache:
    // they go live at a window boundary after the copies are done (st_expert_cache_land).
    st_swap pending[64];
    int n_pending;
    size_t bytes;                 // backend memory held by the stacks
    // Share of a decode window's missed experts streamed to the device and computed there
    // (--pcie-frac); 0: all on the CPU pool, inside the window's recorded graph.
    double pcie_frac;
} st_expert_cache;

// Host -> device copy speed in GB/s: `total` bytes in copies of a 16 MiB buffer, from
// page-locked memory (pinned) or from ordinary memory (as from the file's mapping); 0 when the
// backend has no device or the buffers cannot be had.
double st_expert_link_gbs(st_backend *b, bool pinned, size_t total);

// Allocates the stacks placement p asks for and copies the chosen experts of w (n_layer host
// stacks) into them.
st_status st_expert_cache_create(st_backend *b, const st_placement *p, const st_expert_weights *w,
                                 st_expert_cache **out);
void st_expert_cache_free(st_backend *b, st_expert_cache *c);
// Carries out a swap st_adapt_window decided (p already updated) in two steps, so decoding
// never waits for the copy: begin unmaps the leaving expert (from here on the CPU computes it)
// and starts copying the incoming one's weights into the slot, asynchronously where the backend
// can (nothing reads the slot meanwhile), and adds the swap to c->pending; land maps the pending
// swaps' incoming experts once the backend says their copies are done (h2d_done; at once without
// it) and returns whether none is pending any more. Call both between windows. (At most 64
// pending.) st_expert_cache_swap does a swap whole, waiting for its copy.
void st_expert_cache_swap_begin(st_backend *b, st_expert_cache *c, const st_expert_weights *w, const st_swap *sw);
bool st_expert_cache_land(st_backend *b, st_expert_cache *c);
void st_expert_cache_swap(st_backend *b, st_expert_cache *c, const st_expert_weights *w, const st_swap *sw);

// Where the CPU reads experts (the arena): the GGUF mapping (page cache), or page-locked copies
// of whole layers' stacks (faster to stream to the GPU, never evicted by the OS).
typedef struct st_expert_arena {
    int n_layer;
    st_expert_weights *w;         // (n_layer) host stacks: the mapping or a resident copy
    void **resident;              // (n_layer) host_alloc copies (NULL: the mapping)
    size_t resident_bytes;
} st_expert_arena;

// resident_budget: bytes of page-locked copies to make, layers with the most routing to experts
// the cache lacks first (counts: NULL = all equal); 0 = none (the mapping only). A backend that
// cannot lock memory, or an OS that refuses, leaves the mapping in use and says so once.
st_status st_expert_arena_create(st_backend *b, const st_placement *p, const st_expert_weights *mapped,
                                 const uint64_t *counts, size_t resident_budget, st_expert_arena **out);
void st_expert_arena_free(st_backend *b, st_expert_arena *a);

// ---------------------------------------------------------------------------------------------
// The routed-expert FFN of one layer over a batch of rows.

typedef struct st_experts st_experts;
// Everything the experts of one state (one sequence) use: the placement, and on a device
// backend its cache and the host arena (both NULL on the CPU). adapt (may be NULL) swaps experts
// in the cache from this state's routing.
typedef struct st_experts_params {
    st_placement *placement;
    st_expert_cache *cache;
    const st_expert_arena *arena;
    st_adapt *adapt;
    bool count_on_device;         // count routing to cached experts too (profiles); costs a launch
} st_experts_params;

// The shared expert of a layer (qwen3next), computed with the routed ones:
// y += sigmoid(gate_inp · x) · down(silu(gate(x)) · up(x)). Buffers in backend memory.
typedef struct st_moe_shared {
    const st_mat *gate, *up, *down;
    const float *gate_inp;        // (d)
    float *g, *u;                 // (n, F) work
    float *o;                     // (n, d) work
    float *s;                     // (n) gate logits
} st_moe_shared;

st_status st_experts_create(const st_experts_params *p, st_experts **out);
void st_experts_free(st_experts *ex);
// y = the routed experts of a->n rows (+ the shared expert when sh is not NULL). a->gate/up/down
// are the layer's host stacks; the experts module decides where each expert is computed.
st_status st_experts_compute(st_experts *ex, st_backend *b, const st_moe_args *a, const st_moe_shared *sh);

// What the experts did since the state was created (hybrid placement).
typedef struct st_experts_stats {
    uint64_t hits, misses;        // routed (row, choice) pairs on the device's cache / elsewhere
    uint64_t streamed_bytes;      // expert bytes copied to the device for prompt chunks
    uint64_t swaps;               // adaptive swaps done
    double cpu_s;                 // the CPU pool computing misses
    uint64_t cpu_jobs;            // hybrid layer calls whose misses the CPU pool computed
    double wait_s;                // the host waiting for the GPU to hand over a layer's routing
    double gpu_wait_s;            // the GPU waiting for the host's answer (decode windows)
    double stream_s;              // copying experts to the device and computing them there
    int64_t layers;               // hybrid layer calls
} st_experts_stats;
st_experts_stats st_experts_get_stats(const st_experts *ex);
// A forward window of n rows (k choices, width d) through layers [first_layer, end_layer) is
// about to be queued: on a device with a hybrid cache, windows of up to ST_GRAPH_ROWS rows hand
// their missed experts to the host inside the queued (and recordable) work. A serving thread
// computes them on the CPU pool, layer by layer as the device publishes them, while the device
// computes the cached ones; call st_experts_serve after queuing the window.
st_status st_experts_begin(st_experts *ex, st_backend *b, int n, int k, int d, int first_layer, int end_layer);
// Waits until the serving thread has answered every layer of the window. failed: queuing went
// wrong; the serving thread releases the device without computing anything.
st_status st_experts_serve(st_experts *ex, bool failed);
// Device memory the streaming of experts for prompt chunks takes (planned with the KV cache).
size_t st_experts_stage_bytes(void);
// The CPU pool's speed on the experts of layer `layer` of w (the host stacks): one row through k
// of them (those placement p leaves on the host first), timed after a warm-up; expert bytes per
// second in GB/s, 0 on failure. The start-up probe of --pcie-frac.
double st_experts_cpu_gbs(st_pool *pool, const st_placement *p, const st_expert_weights *w, int layer, int k);
// Called after each forward window: feeds the adaptive swaps (when on) with this window's routing.
void st_experts_window_done(st_experts *ex, st_backend *b);


// Counts of routed (layer, expert) pairs since the last reset, for profiles and cache stats.
const uint64_t *st_experts_counts(st_experts *ex); // (n_layer, n_expert)
