// experts: the placement map, the router, and the routed-expert FFN on the CPU pool. Rows are
// grouped by expert so each chosen expert's gate, up and down matrices are read once per batch,
// and the work of all experts of a layer is spread over the pool in two passes (gate+up, down);
// a small window (decode) runs the whole layer as one pool job with barriers between its phases.

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "experts/experts.h"

st_status st_placement_create_host(int n_layer, int n_expert, st_placement **out) {
    *out = NULL;
    st_placement *p = st_calloc(1, sizeof *p);
    if (!p) return ST_ERR_NOMEM;
    p->n_layer = n_layer;
    p->n_expert = n_expert;
    p->slot = st_alloc(sizeof(int32_t) * (size_t)(n_layer > 0 ? n_layer : 1) * (n_expert > 0 ? n_expert : 1));
    p->n_slots = st_calloc((size_t)(n_layer > 0 ? n_layer : 1), sizeof(int32_t));
    if (!p->slot || !p->n_slots) {
        st_free(p->slot);
        st_free(p->n_slots);
        st_free(p);
        return ST_ERR_NOMEM;
    }
    for (size_t i = 0; i < (size_t)n_layer * n_expert; i++) p->slot[i] = ST_PLACE_HOST;
    *out = p;
    return ST_OK;
}

void st_placement_free(st_placement *p) {
    if (!p) return;
    st_free(p->slot);
    st_free(p->n_slots);
    st_free(p);
}

// ---------------------------------------------------------------------------------------------

struct st_experts {
    st_experts_params p;
    st_backend *b;           // the device backend its buffers belong to (NULL: none yet)
    uint64_t *counts;        // (n_layer, n_expert)
    st_experts_stats stats;
    // Workspace of the CPU pool, grown to the largest batch seen.
    size_t ws_bytes;
    char *ws;
    // Prompt chunks on a device: a page-locked copy of a layer's routing, and the staging
    // stacks missed experts are streamed into.
    size_t pin_bytes;
    char *pin;
    st_expert_weights stage; // ST_STAGE_BYTES worth of slots (n = how many of this shape fit)
    void *stage_mem;
    size_t stage_bytes;
    int32_t *stage_map_dev;  // (n_expert)
    int32_t *stage_map;      // (n_expert) host
    uint32_t *counts_dev;    // (n_layer, n_expert) routing counted on the device
    // Which of a layer's experts a step computes: the CPU pool's share (host_moe) and the share
    // streamed to the device (stream_misses); the routed rows of each missed expert.
    uint8_t *take_cpu, *take_gpu; // (n_expert)
    int32_t *miss_rows;           // (n_expert)
    float *y_dev;            // (ST_GRAPH_ROWS, d) backend memory: the CPU's share of a streamed window
    // Decode windows on a device: per layer a mapped page-locked slot the queued work publishes
    // the layer's routing and rows into and a host thread answers in (st_experts_serve), so
    // the window stays one recording the device replays.
    char *hand;              // (n_layer) slots of hand_bytes
    size_t hand_bytes, hand_ids, hand_w, hand_x, hand_y; // slot size and offsets of its parts
    uint32_t *seq_dev;       // backend memory: the current window's number
    int32_t *need_dev;       // (n_layer) backend memory: whether a layer's window has misses
    uint32_t seq;
    int win_n, win_k, win_first, win_end; // the current window: rows, choices, layer range
    bool win_sync;           // the current window streams a share of its misses (--pcie-frac)
    int job_n, job_k, job_first, job_end; // the serving thread's copy (taken under mu)
    int job_layer;           // >= 0: the job is that layer's CPU share of a streamed window
    double job_cpu_s;        // what that share took
    // The serving thread: it answers the window's layers while the thread that queued the
    // work goes on (that thread may wait for the device, e.g. when a scratch buffer grows, and
    // the device may be waiting for an answer).
    pthread_t server;
    bool server_up, job, quit;
    int abort_job;           // atomic: the queuing failed; release the device and stop
    st_status job_status;
    char job_error[512];
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

#define HAND_PUB 0  // u32s at the start of a slot: the device's "published" flag, then
#define HAND_NEED 1 // whether the host has work (a chosen expert is missing from the device),
#define HAND_DONE 2 // and the host's "answered" flag; a u64 at u32 4: the ns the device waited
#define HAND_WAIT 4 // for the answer (written by the device, summed and cleared after the window)

// Device memory for experts streamed to the GPU per prompt chunk (planned with the KV cache).
#define ST_STAGE_BYTES ((size_t)512 << 20)
size_t st_experts_stage_bytes(void) { return ST_STAGE_BYTES; }

st_status st_experts_create(const st_experts_params *p, st_experts **out) {
    *out = NULL;
    st_experts *ex = st_calloc(1, sizeof *ex);
    if (!ex) return ST_ERR_NOMEM;
    ex->p = *p;
    int E = p->placement->n_expert > 0 ? p->placement->n_expert : 1;
    ex->counts = st_calloc((size_t)p->placement->n_layer * p->placement->n_expert, sizeof(uint64_t));
    ex->take_cpu = st_calloc((size_t)E, 1);
    ex->take_gpu = st_calloc((size_t)E, 1);
    ex->miss_rows = st_calloc((size_t)E, sizeof(int32_t));
    if (!ex->counts || !ex->take_cpu || !ex->take_gpu || !ex->miss_rows) {
        st_experts_free(ex);
        return ST_ERR_NOMEM;
    }
    *out = ex;
    return ST_OK;
}

static void free_device(st_experts *ex, st_backend *b) {
    if (!b) return;
    b->ops->free(b, ex->stage_mem);
    b->ops->free(b, ex->stage_map_dev);
    b->ops->free(b, ex->counts_dev);
    b->ops->free(b, ex->seq_dev);
    b->ops->free(b, ex->need_dev);
    b->ops->free(b, ex->y_dev);
    if (ex->pin) b->ops->host_free(b, ex->pin);
    if (ex->hand) b->ops->host_free(b, ex->hand);
}

void st_experts_free(st_experts *ex) {
    if (!ex) return;
    if (ex->server_up) {
        pthread_mutex_lock(&ex->mu);
        ex->quit = true;
        pthread_cond_broadcast(&ex->cv);
        pthread_mutex_unlock(&ex->mu);
        pthread_join(ex->server, NULL);
        pthread_mutex_destroy(&ex->mu);
        pthread_cond_destroy(&ex->cv);
    }
    free_device(ex, ex->b);
    st_free(ex->stage_map);
    st_free(ex->counts);
    st_free(ex->take_cpu);
    st_free(ex->take_gpu);
    st_free(ex->miss_rows);
    st_free(ex->ws);
    st_free(ex);
}

st_experts_stats st_experts_get_stats(const st_experts *ex) { return ex->stats; }

// The element-wise steps between the passes, split over the pool by assignment.
typedef struct act_job {
    const float *x;        // (n_rows, d) inputs, with order[] and k: assignment -> row
    const int32_t *order;
    int k, d;
    float *g, *u;          // (n, f) gate and up outputs
    int f;
    st_type type;          // quantized type of the results
    char *q;               // (n, qs) quantized rows
    size_t qs;
    int n;
} act_job;

// Work of one pass: for each active expert, its rows [r0, r1) of a weight matrix in chunks.
typedef struct moe_pass {
    const st_mat3 *w[2];    // one or two matrices sharing the input (gate and up)
    float *y[2];            // (assignments, w->rows) outputs
    const char *xq;         // (assignments, xs) quantized inputs grouped by expert
    size_t xs;
    const int32_t *experts; // (n_active) expert ids
    const int32_t *start;   // (n_active + 1) first assignment of each active expert
    int n_active, chunk, n_chunks_per_expert;
    bool row_exact;         // a window's rows: each row's bits as alone (st_matmul_args)
} moe_pass;

static void moe_pass_worker(void *ctx, int ith, int nth) {
    const moe_pass *p = ctx;
    int per = p->n_chunks_per_expert, total = p->n_active * per;
    for (int t = ith; t < total; t += nth) {
        int a = t / per, c = t % per;
        int e = p->experts[a], m = p->start[a + 1] - p->start[a];
        const char *xq = p->xq + (size_t)p->start[a] * p->xs;
        for (int wi = 0; wi < 2 && p->w[wi]; wi++) {
            const st_mat3 *w = p->w[wi];
            int64_t r0 = (int64_t)c * p->chunk, r1 = r0 + p->chunk < w->rows ? r0 + p->chunk : w->rows;
            if (r0 >= r1) continue;
            st_matmul_args ma = {
                .type = w->type,
                .w = (const char *)w->data + (size_t)e * w->mat_bytes + (size_t)r0 * w->row_bytes,
                .n = w->cols, .rows = r1 - r0,
                .x = xq, .x_stride = p->xs, .nx = m,
                .y = p->y[wi] + (size_t)p->start[a] * w->rows + r0, .ldy = w->rows, .row_exact = p->row_exact,
            };
            st_matmul(NULL, &ma);
        }
    }
}

static void quantize_inputs(void *ctx, int ith, int nth) {
    const act_job *j = ctx;
    for (int i = ith; i < j->n; i += nth)
        st_quantize(j->type, j->x + (size_t)(j->order[i] / j->k) * j->d, j->q + (size_t)i * j->qs, j->d);
}

static void swiglu_quantize(void *ctx, int ith, int nth) {
    const act_job *j = ctx;
    for (int i = ith; i < j->n; i += nth) {
        float *g = j->g + (size_t)i * j->f, *u = j->u + (size_t)i * j->f;
        for (int c = 0; c < j->f; c++) g[c] = g[c] / (1.0f + expf(-g[c])) * u[c];
        st_quantize(j->type, g, j->q + (size_t)i * j->qs, j->f);
    }
}

// Assignments (rows times choices) up to which a batch is a small window: one pool job a layer.
#define SMALL_ASSIGNMENTS 64

// Elements of a row quantized as one unit of the small path's make steps: rows are split so
// every thread can help make them (a Q8_K row of 2048 costs ~10 us on one core). A multiple of
// every activation type's block (1, 32, 256), and blocks are quantized independently, so a row
// made in units has the same bytes as a row made whole.
#define SMALL_SEG 256
// Work items per thread in a pass of the small path (claimed from a counter; a thread that is
// descheduled or slow leaves its items to the others instead of holding up the barrier).
#define SMALL_ITEMS_PER_THREAD 4

// A small window's layer as one pool job, three phases split by st_pool_barrier:
//  1. each routed input row quantized once, in units of SMALL_SEG elements spread over the
//     threads, each unit copied to every assignment of the row (grouped order);
//  2. gate+up items (a chunk of an expert's weight rows, for all its assignments) claimed from
//     a counter; whoever finishes the last chunk covering a SMALL_SEG unit of an expert's hidden
//     columns makes that unit's down input (silu(gate)·up, quantized) for the expert's rows;
//  3. down items claimed the same way.
// Each product is the same st_matmul call as the other paths (one expert, all its assignments,
// chunks of multiples of 16 rows), so the results are bit-identical to them.
typedef struct small_job {
    st_pool *pool;
    const st_mat3 *gate, *up, *down;
    const float *x;           // (n, d) inputs
    int n, k, d, F;
    const int32_t *inv;       // (n * k) an assignment's grouped index, -1: not computed here
    const int32_t *experts;   // (n_active) expert ids
    const int32_t *start;     // (n_active + 1) first grouped assignment of each active expert
    int n_active;
    st_type gdt, ddt;         // activation types of gate/up and of down
    char *xq;                 // (valid, xs) quantized inputs
    size_t xs;
    float *hg, *hu;           // (valid, F) gate and up outputs; hg becomes silu(gate)·up
    char *hq;                 // (valid, hs) quantized down inputs
    size_t hs;
    float *yo;                // (valid, d) down outputs
    int chunk1, per1;         // gate+up items: weight rows per item, items per expert
    int chunk2, per2;         // down items
    int nseg;                 // SMALL_SEG units of F
    _Atomic int *left;        // (n_active, nseg) gate+up items still to finish over each unit
    _Alignas(64) _Atomic int next1; // the next unclaimed item of each pass (own cache lines:
    _Alignas(64) _Atomic int next2; // every claim writes them)
    char pad[64 - sizeof(int)];
} small_job;

// Unit s of the down inputs of active expert a (every input of phase 2 over it is written).
static void small_make_down(const small_job *j, int a, int s) {
    int c0 = s * SMALL_SEG, len = j->F - c0 < SMALL_SEG ? j->F - c0 : SMALL_SEG;
    size_t off = st_row_bytes(j->ddt, c0);
    for (int gi = j->start[a]; gi < j->start[a + 1]; gi++) {
        float *g = j->hg + (size_t)gi * j->F + c0;
        const float *u = j->hu + (size_t)gi * j->F + c0;
        for (int c = 0; c < len; c++) g[c] = g[c] / (1.0f + expf(-g[c])) * u[c];
        st_quantize(j->ddt, g, j->hq + (size_t)gi * j->hs + off, len);
    }
}

// Rows [r0, r1) of expert a's matrix w times its assignments' rows of xq (stride xs) into y.
static void small_product(const st_mat3 *w, int e, int64_t r0, int64_t r1, const char *xq, size_t xs, int m,
                          float *y, int64_t ldy, bool row_exact) {
    st_matmul_args ma = {
        .type = w->type,
        .w = (const char *)w->data + (size_t)e * w->mat_bytes + (size_t)r0 * w->row_bytes,
        .n = w->cols, .rows = r1 - r0,
        .x = xq, .x_stride = xs, .nx = m,
        .y = y + r0, .ldy = ldy, .row_exact = row_exact,
    };
    st_matmul(NULL, &ma);
}

static void small_worker(void *ctx, int ith, int nth) {
    small_job *j = ctx;
    // 1. The inputs, unit by unit.
    int dseg = (j->d + SMALL_SEG - 1) / SMALL_SEG;
    for (int t = ith; t < j->n * dseg; t += nth) {
        int i = t / dseg, c0 = t % dseg * SMALL_SEG, len = j->d - c0 < SMALL_SEG ? j->d - c0 : SMALL_SEG;
        size_t off = st_row_bytes(j->gdt, c0), bytes = st_row_bytes(j->gdt, len);
        const char *made = NULL;
        for (int q = 0; q < j->k; q++) {
            int gi = j->inv[i * j->k + q];
            if (gi < 0) continue;
            char *dst = j->xq + (size_t)gi * j->xs + off;
            if (made) {
                memcpy(dst, made, bytes);
            } else {
                st_quantize(j->gdt, j->x + (size_t)i * j->d + c0, dst, len);
                made = dst;
            }
        }
    }
    st_pool_barrier(j->pool);
    // 2. Gate and up; each unit's down inputs as soon as its last item is done.
    for (int t = ith; t < j->n_active * j->per1; t = atomic_fetch_add_explicit(&j->next1, 1, memory_order_relaxed)) {
        int a = t / j->per1, g0 = j->start[a], m = j->start[a + 1] - g0;
        int r0 = t % j->per1 * j->chunk1, r1 = r0 + j->chunk1 < j->F ? r0 + j->chunk1 : j->F;
        const char *xq = j->xq + (size_t)g0 * j->xs;
        small_product(j->gate, j->experts[a], r0, r1, xq, j->xs, m, j->hg + (size_t)g0 * j->F, j->F, st_row_exact(j->n));
        small_product(j->up, j->experts[a], r0, r1, xq, j->xs, m, j->hu + (size_t)g0 * j->F, j->F, st_row_exact(j->n));
        // acq_rel: the last finisher of a unit sees the other items' outputs over it.
        for (int s = r0 / SMALL_SEG; s * SMALL_SEG < r1; s++)
            if (atomic_fetch_sub_explicit(&j->left[a * j->nseg + s], 1, memory_order_acq_rel) == 1)
                small_make_down(j, a, s);
    }
    st_pool_barrier(j->pool);
    // 3. Down.
    for (int t = ith; t < j->n_active * j->per2; t = atomic_fetch_add_explicit(&j->next2, 1, memory_order_relaxed)) {
        int a = t / j->per2, g0 = j->start[a], m = j->start[a + 1] - g0;
        int r0 = t % j->per2 * j->chunk2, r1 = r0 + j->chunk2 < j->d ? r0 + j->chunk2 : j->d;
        small_product(j->down, j->experts[a], r0, r1, j->hq + (size_t)g0 * j->hs, j->hs, m,
                      j->yo + (size_t)g0 * j->d, j->d, st_row_exact(j->n));
    }
}

// Weight rows per item so a pass over `rows` rows of n_active experts gives every thread about
// SMALL_ITEMS_PER_THREAD items: a multiple of 16 (as run_pass, so GEMM tiles fall on the same rows).
static int small_chunk(int rows, int n_active, int nth) {
    int want = (SMALL_ITEMS_PER_THREAD * nth + n_active - 1) / n_active;
    int chunk = (rows + want - 1) / want;
    chunk = (chunk + 15) / 16 * 16;
    return chunk < 16 ? 16 : chunk;
}

static void run_pass(st_pool *pool, moe_pass *p, int64_t rows) {
    // Enough chunks to keep every thread busy even when few experts are active.
    int nth = st_pool_size(pool) > 0 ? st_pool_size(pool) : 1;
    int want = (4 * nth + p->n_active - 1) / p->n_active;
    int64_t chunk = (rows + want - 1) / want;
    chunk = (chunk + 15) / 16 * 16;
    if (chunk < 16) chunk = 16;
    p->chunk = (int)chunk;
    p->n_chunks_per_expert = (int)((rows + chunk - 1) / chunk);
    st_pool_run(pool, moe_pass_worker, p);
}

// y (n, d) = the experts of w chosen by ids (n, k), weighted; with `take` set (n_expert flags),
// just the assignments whose expert is flagged (the rest add nothing). Host memory; rows
// grouped by expert so each expert's weights are read once, the work spread over the pool.
static st_status host_moe(st_experts *ex, st_pool *pool, const st_expert_weights *w, int layer, const float *x,
                          const int32_t *ids, const float *weights, int n, int k, const uint8_t *take, float *y) {
    const st_mat3 *gate = &w->gate, *up = &w->up, *down = &w->down;
    int d = (int)gate->cols, F = (int)gate->rows, E = (int)gate->n;
    int na = n * k;
    st_type gdt = st_type_get(gate->type)->dot_type, ddt = st_type_get(down->type)->dot_type;
    if (st_type_get(up->type)->dot_type != gdt)
        return st_fail(ST_ERR_UNSUPPORTED, "layer %d: expert gate (%s) and up (%s) need different "
                       "activation types", layer, st_type_name(gate->type), st_type_name(up->type));
    size_t xs = st_row_bytes(gdt, d), hs = st_row_bytes(ddt, F);

    // Small batches run as one pool job (small_job), larger ones as four pool runs.
    int nth = st_pool_size(pool) > 0 ? st_pool_size(pool) : 1;
    bool small = na <= SMALL_ASSIGNMENTS;
    int nseg = (F + SMALL_SEG - 1) / SMALL_SEG;
    // Workspace: expert lists, assignment lists, quantized inputs, gate/up/act outputs, down
    // outputs; the unit counters of a small job.
    size_t need = sizeof(int32_t) * ((size_t)E + 1) * 3 + sizeof(int32_t) * na * 2 + xs * na +
                  sizeof(float) * (size_t)na * (2 * F + d) + hs * na + 64 * 11 +
                  (small ? sizeof(int) * (size_t)na * nseg : 0);
    if (need > ex->ws_bytes) {
        st_free(ex->ws);
        ex->ws = st_alloc(need);
        if (!ex->ws) {
            ex->ws_bytes = 0;
            return st_fail(ST_ERR_NOMEM, "expert workspace: %zu bytes", need);
        }
        ex->ws_bytes = need;
    }
    char *p = ex->ws;
#define TAKE(ptr, bytes) do { ptr = (void *)p; p += ((bytes) + 63) / 64 * 64; } while (0)
    int32_t *count, *start, *experts, *order, *inv;
    char *xq, *hq;
    float *hg, *hu, *yo;
    TAKE(count, sizeof(int32_t) * E);
    TAKE(start, sizeof(int32_t) * (E + 1));
    TAKE(experts, sizeof(int32_t) * E);
    TAKE(order, sizeof(int32_t) * na);
    TAKE(inv, sizeof(int32_t) * na);
    TAKE(xq, xs * na);
    TAKE(hg, sizeof(float) * (size_t)na * F);
    TAKE(hu, sizeof(float) * (size_t)na * F);
    TAKE(hq, hs * na);
    TAKE(yo, sizeof(float) * (size_t)na * d);
    _Atomic int *left = NULL;
    if (small) TAKE(left, sizeof(int) * (size_t)na * nseg);
#undef TAKE

    // Group the (row, slot) assignments by expert: order[] lists them expert by expert, and
    // start[j] .. start[j+1] is active expert j's range of it. Assignments left out (another
    // device computes them) come last and are not computed.
    memset(count, 0, sizeof(int32_t) * E);
    for (int i = 0; i < na; i++) {
        ST_ASSERT(ids[i] >= 0 && ids[i] < E);
        if (!take || take[ids[i]]) count[ids[i]]++;
    }
    int n_active = 0, pos = 0;
    for (int e = 0; e < E; e++) {
        if (!count[e]) continue;
        experts[n_active] = e;
        start[n_active++] = pos;
        int c = count[e];
        count[e] = pos; // becomes the insert cursor
        pos += c;
    }
    start[n_active] = pos;
    int valid = pos;
    memset(y, 0, sizeof(float) * (size_t)n * d);
    if (valid == 0) return ST_OK;
    for (int i = 0; i < na; i++)
        if (!take || take[ids[i]]) order[count[ids[i]]++] = i;
    // inv[assignment] = its grouped index or -1.
    for (int i = 0; i < na; i++) inv[i] = -1;
    for (int gi = 0; gi < valid; gi++) inv[order[gi]] = gi;

    if (small) {
        small_job j = {.pool = pool, .gate = gate, .up = up, .down = down, .x = x, .n = n, .k = k, .d = d, .F = F,
                       .inv = inv, .experts = experts, .start = start, .n_active = n_active, .gdt = gdt,
                       .ddt = ddt, .xq = xq, .xs = xs, .hg = hg, .hu = hu, .hq = hq, .hs = hs, .yo = yo,
                       .nseg = nseg, .left = left};
        j.chunk1 = small_chunk(F, n_active, nth);
        j.per1 = (F + j.chunk1 - 1) / j.chunk1;
        j.chunk2 = small_chunk(d, n_active, nth);
        j.per2 = (d + j.chunk2 - 1) / j.chunk2;
        for (int s = 0; s < nseg; s++) { // gate+up items over unit s: those of its first and last column
            int c1 = (s + 1) * SMALL_SEG < F ? (s + 1) * SMALL_SEG : F;
            int items = (c1 - 1) / j.chunk1 - s * SMALL_SEG / j.chunk1 + 1;
            for (int a = 0; a < n_active; a++) atomic_init(&left[a * nseg + s], items);
        }
        atomic_init(&j.next1, nth); // items 0..nth-1 go to threads 0..nth-1
        atomic_init(&j.next2, nth);
        st_pool_run(pool, small_worker, &j);
    } else {
        // Quantize each assignment's input row in grouped order.
        act_job qj = {.x = x, .order = order, .k = k, .d = d, .type = gdt, .q = xq, .qs = xs, .n = valid};
        st_pool_run(pool, quantize_inputs, &qj);

        moe_pass p1 = {.w = {gate, up}, .y = {hg, hu}, .xq = xq, .xs = xs, .experts = experts,
                       .start = start, .n_active = n_active, .row_exact = st_row_exact(n)};
        run_pass(pool, &p1, F);

        act_job aj = {.g = hg, .u = hu, .f = F, .type = ddt, .q = hq, .qs = hs, .n = valid};
        st_pool_run(pool, swiglu_quantize, &aj);

        moe_pass p2 = {.w = {down, NULL}, .y = {yo, NULL}, .xq = hq, .xs = hs, .experts = experts,
                       .start = start, .n_active = n_active, .row_exact = st_row_exact(n)};
        run_pass(pool, &p2, d);
    }

    // Weighted sum back into rows, slot by slot in a fixed order so the result does not depend
    // on how rows were grouped.
    for (int i = 0; i < n; i++) {
        float *yr = y + (size_t)i * d;
        for (int j = 0; j < k; j++) {
            if (inv[i * k + j] < 0) continue;
            const float *o = yo + (size_t)inv[i * k + j] * d;
            float wt = weights[i * k + j];
            for (int c = 0; c < d; c++) yr[c] += wt * o[c];
        }
    }
    return ST_OK;
}

static void count_routing(st_experts *ex, int layer, const int32_t *ids, int na, int n_expert) {
    for (int i = 0; i < na; i++)
        if (ids[i] >= 0 && ids[i] < n_expert) ex->counts[(size_t)layer * n_expert + ids[i]]++;
}

// The shared expert of x (the backend's shared_ffn: a device may run it beside the routed experts
// until their combine reads sh->o and sh->s).
static void shared_expert(st_backend *b, const st_moe_shared *sh, const float *x, int n) {
    st_shared_ffn_args a = {.gate = sh->gate, .up = sh->up, .down = sh->down, .gate_inp = sh->gate_inp, .x = x,
                            .g = sh->g, .u = sh->u, .s = sh->s, .o = sh->o, .n = n};
    b->ops->shared_ffn(b, &a);
}

// Grows a device buffer (contents lost); false with the error set when the device is full.
static bool grow(st_backend *b, void **buf, size_t *have, size_t need) {
    if (need <= *have) return true;
    b->ops->free(b, *buf);
    *have = 0;
    if (!(*buf = b->ops->alloc(b, need))) return false;
    *have = need;
    return true;
}

// The experts of a layer flagged in need (n_expert flags: ones the device's cache lacks),
// streamed to the device in runs of consecutive ids (one copy per matrix per run) and computed
// there, adding into a->y.
static st_status stream_misses(st_experts *ex, st_backend *b, const st_moe_args *a, const uint8_t *need) {
    const st_expert_weights *w = &ex->p.arena->w[a->layer];
    int E = (int)w->gate.n;
    size_t per = st_expert_bytes(w);
    int cap = (int)(ST_STAGE_BYTES / per);
    if (cap < 1) cap = 1;
    if (cap > E) cap = E;
    if (!ex->stage_map && !(ex->stage_map = st_alloc(sizeof(int32_t) * (size_t)E))) return ST_ERR_NOMEM;
    if (!ex->stage_map_dev && !(ex->stage_map_dev = b->ops->alloc(b, sizeof(int32_t) * (size_t)E)))
        return st_fail_prefix(ST_ERR_NOMEM, "expert staging map");
    if (!grow(b, &ex->stage_mem, &ex->stage_bytes, (size_t)cap * per))
        return st_fail_prefix(ST_ERR_NOMEM, "expert staging (%d experts)", cap);
    double t0 = st_time_s();
    st_expert_weights st = st_expert_stack(w, cap, ex->stage_mem);
    for (int e0 = 0; e0 < E;) {
        // The next batch: up to cap needed experts, copied in runs.
        for (int e = 0; e < E; e++) ex->stage_map[e] = -1;
        int used = 0, e = e0;
        while (e < E && used < cap) {
            if (!need[e]) {
                e++;
                continue;
            }
            int run = 0;
            while (e + run < E && need[e + run] && used + run < cap) {
                ex->stage_map[e + run] = used + run;
                run++;
            }
            st_expert_upload(b, &st, w, used, e, run);
            ex->stats.streamed_bytes += (uint64_t)run * per;
            used += run;
            e += run;
        }
        e0 = e;
        if (!used) break;
        b->ops->from_host(b, ex->stage_map_dev, ex->stage_map, sizeof(int32_t) * (size_t)E);
        st.gate.n = st.up.n = st.down.n = used;
        st_moe_args m = *a;
        m.gate = &st.gate;
        m.up = &st.up;
        m.down = &st.down;
        m.slot_map = ex->stage_map_dev;
        m.n_expert = E;
        m.accumulate = true;
        m.counts = NULL;
        b->ops->moe(b, &m);
    }
    ST_TRY(b->ops->sync(b));
    ex->stats.stream_s += st_time_s() - t0;
    return ST_OK;
}

// y = the layer's experts the device's cache holds (the others add nothing).
static void cached_moe(st_experts *ex, st_backend *b, const st_moe_args *a, uint32_t *counts) {
    const st_expert_cache *c = ex->p.cache;
    int l = a->layer, E = ex->p.placement->n_expert;
    st_moe_args g = *a;
    g.gate = &c->slots[l].gate;
    g.up = &c->slots[l].up;
    g.down = &c->slots[l].down;
    g.slot_map = c->map_dev + (size_t)l * E;
    g.n_expert = E;
    g.accumulate = false;
    g.counts = counts;
    b->ops->moe(b, &g);
}

// Rows of a window at most this big hand their missed experts to the CPU pool inside the
// recorded window (ST_GRAPH_ROWS); larger batches (prompt chunks) stream them to the device.
#define HAND_ROWS ST_GRAPH_ROWS

static bool layer_hybrid(const st_placement *p, int l) { return p->n_slots[l] < p->n_expert; }

// Whether the device computes expert e of layer l in a window now: its cache's live map (the
// placement, less the swaps whose copies are on their way).
static bool on_device(const st_experts *ex, int l, int e) {
    return ex->p.cache->map_host[(size_t)l * ex->p.placement->n_expert + e] >= 0;
}

static uint32_t *hand_flag(const st_experts *ex, int l, int which) {
    return (uint32_t *)(ex->hand + (size_t)l * ex->hand_bytes) + which;
}

// A decode window's layer: queued work only (recordable). The routing and rows go to the
// layer's hand-off slot, the device computes the shared and the cached experts, then waits for
// the host's answer (st_experts_serve computes the missed experts meanwhile) and adds it.
static void hybrid_window(st_experts *ex, st_backend *b, const st_moe_args *a, const st_moe_shared *sh) {
    const st_expert_cache *c = ex->p.cache;
    int l = a->layer, n = a->n, d = (int)a->gate->cols, E = ex->p.placement->n_expert;
    char *h = ex->hand + (size_t)l * ex->hand_bytes;
    st_hand_args ha = {.ids = a->ids, .weights = a->weights, .x = a->x, .slot_map = c->map_dev + (size_t)l * E,
                       .n = n, .k = a->k, .d = d, .n_expert = E, .seq = ex->seq_dev, .need = ex->need_dev + l,
                       .pub = hand_flag(ex, l, HAND_PUB), .done = hand_flag(ex, l, HAND_DONE),
                       .h_ids = (int32_t *)(h + ex->hand_ids), .h_w = (float *)(h + ex->hand_w),
                       .h_x = (float *)(h + ex->hand_x), .h_y = (const float *)(h + ex->hand_y), .y = a->y,
                       .wait_ns = (uint64_t *)hand_flag(ex, l, HAND_WAIT), .logits = a->logits};
    b->ops->hand_publish(b, &ha); // routes for the host, given the logits
    if (sh) shared_expert(b, sh, a->x, n);
    cached_moe(ex, b, a, NULL); // routes for the device
    b->ops->hand_collect(b, &ha);
    if (sh) b->ops->add_gated_rows(b, a->y, sh->o, sh->s, n, d);
}

static void *server_main(void *arg);

// The hand-off slots for the largest window (made once, never while recording), and the
// serving thread.
static st_status hand_init(st_experts *ex, st_backend *b, int k, int d) {
    const st_placement *pl = ex->p.placement;
    if (!ex->hand) {
        size_t ids = 64, w = ids + (sizeof(int32_t) * HAND_ROWS * k + 63) / 64 * 64;
        size_t x = w + (sizeof(float) * HAND_ROWS * k + 63) / 64 * 64, y = x + sizeof(float) * HAND_ROWS * (size_t)d;
        size_t bytes = y + sizeof(float) * HAND_ROWS * (size_t)d;
        ex->hand = b->ops->host_alloc(b, bytes * pl->n_layer);
        ex->seq_dev = b->ops->alloc(b, sizeof(uint32_t));
        ex->need_dev = b->ops->alloc(b, sizeof(int32_t) * pl->n_layer);
        if (!ex->hand || !ex->seq_dev || !ex->need_dev)
            return st_fail_prefix(ST_ERR_NOMEM, "expert hand-off buffers");
        memset(ex->hand, 0, bytes * pl->n_layer);
        ex->hand_bytes = bytes, ex->hand_ids = ids, ex->hand_w = w, ex->hand_x = x, ex->hand_y = y;
    }
    if (!ex->server_up) {
        pthread_mutex_init(&ex->mu, NULL);
        pthread_cond_init(&ex->cv, NULL);
        if (pthread_create(&ex->server, NULL, server_main, ex)) {
            pthread_mutex_destroy(&ex->mu);
            pthread_cond_destroy(&ex->cv);
            return st_fail(ST_ERR_NOMEM, "cannot start the expert serving thread");
        }
        ex->server_up = true;
    }
    return ST_OK;
}

// Hands the serving thread a job: a window (layer < 0) or one layer's CPU share.
static void post_job(st_experts *ex, int n, int k, int first_layer, int end_layer, int layer) {
    pthread_mutex_lock(&ex->mu);
    __atomic_store_n(&ex->abort_job, 0, __ATOMIC_RELAXED);
    ex->job_n = n, ex->job_k = k, ex->job_first = first_layer, ex->job_end = end_layer, ex->job_layer = layer;
    ex->job = true;
    pthread_cond_broadcast(&ex->cv);
    pthread_mutex_unlock(&ex->mu);
}

// Waits for the job posted last; its status.
static st_status wait_job(st_experts *ex) {
    pthread_mutex_lock(&ex->mu);
    while (ex->job) pthread_cond_wait(&ex->cv, &ex->mu);
    st_status s = ex->job_status;
    ex->job_status = ST_OK;
    pthread_mutex_unlock(&ex->mu);
    return s ? st_fail(s, "%s", ex->job_error) : ST_OK;
}

st_status st_experts_begin(st_experts *ex, st_backend *b, int n, int k, int d, int first_layer, int end_layer) {
    const st_placement *pl = ex->p.placement;
    ex->win_n = 0;
    ex->win_sync = false;
    b->eager = false;
    if (b->ops->host_memory || !ex->p.cache || n > HAND_ROWS) return ST_OK;
    bool any = false;
    for (int l = first_layer; l < end_layer; l++) any = any || layer_hybrid(pl, l);
    if (!any) return ST_OK;
    ex->b = b;
    ST_TRY(hand_init(ex, b, k, d));
    if (ex->p.cache->pcie_frac > 0) {
        // A share of the misses streams to the device: each hybrid layer reads its routing back,
        // so the window runs as it comes (never recorded).
        if (!ex->y_dev && !(ex->y_dev = b->ops->alloc(b, sizeof(float) * HAND_ROWS * (size_t)d)))
            return st_fail_prefix(ST_ERR_NOMEM, "expert window buffers");
        ex->win_sync = true;
        b->eager = true;
        return ST_OK;
    }
    ex->seq++;
    b->ops->from_host(b, ex->seq_dev, &ex->seq, sizeof(uint32_t));
    ex->win_n = n, ex->win_k = k, ex->win_first = first_layer, ex->win_end = end_layer;
    post_job(ex, n, k, first_layer, end_layer, -1);
    return ST_OK;
}

static void answer(st_experts *ex, int l) { __atomic_store_n(hand_flag(ex, l, HAND_DONE), ex->seq, __ATOMIC_RELEASE); }

// The serving thread's work for one window: each hybrid layer of the range in order, as the
// device publishes it. An abort (or an error) answers the remaining layers at once so the device
// never waits for nothing.
static st_status serve_window(st_experts *ex) {
    const st_placement *pl = ex->p.placement;
    int n = ex->job_n, k = ex->job_k, na = n * k, E = pl->n_expert;
    st_status s = ST_OK;
    for (int l = ex->job_first; l < ex->job_end; l++) {
        if (!layer_hybrid(pl, l)) continue;
        if (s || __atomic_load_n(&ex->abort_job, __ATOMIC_ACQUIRE)) {
            answer(ex, l);
            continue;
        }
        char *h = ex->hand + (size_t)l * ex->hand_bytes;
        double t0 = st_time_s();
        while (__atomic_load_n(hand_flag(ex, l, HAND_PUB), __ATOMIC_ACQUIRE) != ex->seq) {
            if (__atomic_load_n(&ex->abort_job, __ATOMIC_ACQUIRE)) break;
            if (st_time_s() - t0 > ST_HOST_WAIT_S) {
                s = st_fail(ST_ERR_IO, "layer %d: the GPU did not hand over its routing within %d s", l, ST_HOST_WAIT_S);
                break;
            }
        }
        double t1 = st_time_s();
        ex->stats.wait_s += t1 - t0;
        if (s || __atomic_load_n(hand_flag(ex, l, HAND_PUB), __ATOMIC_ACQUIRE) != ex->seq) {
            answer(ex, l);
            continue;
        }
        const int32_t *ids = (const int32_t *)(h + ex->hand_ids);
        float *x = (float *)(h + ex->hand_x), *y = (float *)(h + ex->hand_y);
        const float *w = (const float *)(h + ex->hand_w);
        count_routing(ex, l, ids, na, E);
        ex->stats.layers++;
        if (!__atomic_load_n(hand_flag(ex, l, HAND_NEED), __ATOMIC_ACQUIRE)) { // all on the device
            ex->stats.hits += (uint64_t)na;
            continue;
        }
        int miss = 0;
        for (int i = 0; i < na; i++) miss += ids[i] >= 0 && ids[i] < E && !on_device(ex, l, ids[i]);
        ex->stats.hits += (uint64_t)(na - miss);
        ex->stats.misses += (uint64_t)miss;
        const st_expert_weights *ew = &ex->p.arena->w[l];
        for (int e = 0; e < E; e++) ex->take_cpu[e] = !on_device(ex, l, e);
        if (miss) s = host_moe(ex, ex->b->pool, ew, l, x, ids, w, n, k, ex->take_cpu, y);
        else memset(y, 0, sizeof(float) * (size_t)n * ew->gate.cols);
        ex->stats.cpu_s += st_time_s() - t1;
        ex->stats.cpu_jobs += miss > 0;
        answer(ex, l);
    }
    return s;
}

// The serving thread's work for one layer's CPU share of a streamed window (hybrid_sync): the
// experts flagged in take_cpu, from the rows read back into the layer's hand-off slot.
static st_status serve_share(st_experts *ex) {
    int l = ex->job_layer;
    char *h = ex->hand + (size_t)l * ex->hand_bytes;
    double t0 = st_time_s();
    st_status s = host_moe(ex, ex->b->pool, &ex->p.arena->w[l], l, (const float *)(h + ex->hand_x),
                           (const int32_t *)(h + ex->hand_ids), (const float *)(h + ex->hand_w), ex->job_n,
                           ex->job_k, ex->take_cpu, (float *)(h + ex->hand_y));
    ex->job_cpu_s = st_time_s() - t0;
    return s;
}

static void *server_main(void *arg) {
    st_experts *ex = arg;
    pthread_mutex_lock(&ex->mu);
    for (;;) {
        while (!ex->job && !ex->quit) pthread_cond_wait(&ex->cv, &ex->mu);
        if (ex->quit) break;
        pthread_mutex_unlock(&ex->mu);
        // A window's misses come a few layers apart, longer than the pool's spin: held, its
        // workers wait spinning, not asleep (a wake costs a job tens of microseconds).
        bool hold = ex->job_layer < 0;
        if (hold) st_pool_hold(ex->b->pool, true);
        st_status s = hold ? serve_window(ex) : serve_share(ex);
        if (hold) st_pool_hold(ex->b->pool, false);
        pthread_mutex_lock(&ex->mu);
        ex->job_status = s;
        if (s) snprintf(ex->job_error, sizeof ex->job_error, "%s", st_error());
        ex->job = false;
        pthread_cond_broadcast(&ex->cv);
    }
    pthread_mutex_unlock(&ex->mu);
    return NULL;
}

st_status st_experts_serve(st_experts *ex, bool failed) {
    if (ex->win_sync) { // every layer was answered as it ran
        ex->win_sync = false;
        ex->b->eager = false;
    }
    if (!ex->win_n) return ST_OK;
    ex->win_n = 0;
    if (failed) __atomic_store_n(&ex->abort_job, 1, __ATOMIC_RELEASE);
    return wait_job(ex);
}

// A decode window's layer with --pcie-frac: the routing and rows read back into the layer's
// hand-off slot while the device computes the shared and the cached experts; of the missed
// experts, the share with the most rows is streamed to the device and computed there while the
// serving thread computes the rest on the CPU pool; then the CPU's rows are added.
static st_status hybrid_sync(st_experts *ex, st_backend *b, const st_moe_args *a, const st_moe_shared *sh) {
    const st_placement *pl = ex->p.placement;
    int l = a->layer, n = a->n, k = a->k, na = n * k, E = pl->n_expert, d = (int)a->gate->cols;
    ST_ASSERT(n <= HAND_ROWS);
    char *h = ex->hand + (size_t)l * ex->hand_bytes;
    int32_t *h_ids = (int32_t *)(h + ex->hand_ids);
    double t0 = st_time_s();
    b->ops->to_host_async(b, h_ids, a->ids, sizeof(int32_t) * (size_t)na);
    b->ops->to_host_async(b, h + ex->hand_w, a->weights, sizeof(float) * (size_t)na);
    b->ops->to_host_async(b, h + ex->hand_x, a->x, sizeof(float) * (size_t)n * d);
    // Queued behind those copies: the shared expert and the cached experts.
    if (sh) shared_expert(b, sh, a->x, n);
    cached_moe(ex, b, a, NULL);
    b->ops->wait_copies(b);
    ex->stats.wait_s += st_time_s() - t0;
    count_routing(ex, l, h_ids, na, E);
    memset(ex->miss_rows, 0, sizeof(int32_t) * (size_t)E);
    int miss = 0;
    for (int i = 0; i < na; i++)
        if (h_ids[i] >= 0 && h_ids[i] < E && !on_device(ex, l, h_ids[i])) {
            ex->miss_rows[h_ids[i]]++;
            miss++;
        }
    ex->stats.hits += (uint64_t)(na - miss);
    ex->stats.misses += (uint64_t)miss;
    ex->stats.layers++;
    st_status s = ST_OK;
    if (miss) {
        int n_gpu = st_pcie_split(ex->miss_rows, E, ex->p.cache->pcie_frac, ex->take_gpu);
        bool cpu = false;
        for (int e = 0; e < E; e++) {
            ex->take_cpu[e] = ex->miss_rows[e] > 0 && !ex->take_gpu[e];
            cpu = cpu || ex->take_cpu[e];
        }
        if (cpu) post_job(ex, n, k, l, l + 1, l);
        if (n_gpu) s = stream_misses(ex, b, a, ex->take_gpu);
        if (cpu) {
            st_status cs = wait_job(ex); // always: the serving thread is using the slot
            ex->stats.cpu_s += ex->job_cpu_s;
            ex->stats.cpu_jobs++;
            if (!s) s = cs;
            if (!s) {
                b->ops->from_host(b, ex->y_dev, h + ex->hand_y, sizeof(float) * (size_t)n * d);
                b->ops->add(b, a->y, ex->y_dev, (int64_t)n * d);
            }
        }
    }
    if (sh) b->ops->add_gated_rows(b, a->y, sh->o, sh->s, n, d);
    return s;
}

// A prompt chunk's layer some of whose experts the device lacks: the shared and the cached
// experts on the device, the missed ones streamed to it (the routing read back first).
static st_status hybrid_chunk(st_experts *ex, st_backend *b, const st_moe_args *a, const st_moe_shared *sh) {
    const st_placement *pl = ex->p.placement;
    int l = a->layer, n = a->n, k = a->k, na = n * k, E = pl->n_expert;
    int d = (int)a->gate->cols;
    ex->b = b;
    size_t ids_b = sizeof(int32_t) * (size_t)na;
    if (ids_b > ex->pin_bytes) {
        if (ex->pin) b->ops->host_free(b, ex->pin);
        ex->pin_bytes = 0;
        if (!(ex->pin = b->ops->host_alloc(b, ids_b))) return st_fail_prefix(ST_ERR_NOMEM, "expert routing buffers");
        ex->pin_bytes = ids_b;
    }
    int32_t *h_ids = (int32_t *)ex->pin;
    b->ops->to_host_async(b, h_ids, a->ids, ids_b);
    // Queued behind that copy: the shared expert and the cached experts.
    if (sh) shared_expert(b, sh, a->x, n);
    cached_moe(ex, b, a, NULL);
    b->ops->wait_copies(b);
    count_routing(ex, l, h_ids, na, E);
    int miss = 0;
    for (int i = 0; i < na; i++) miss += h_ids[i] >= 0 && h_ids[i] < E && !on_device(ex, l, h_ids[i]);
    ex->stats.hits += (uint64_t)(na - miss);
    ex->stats.misses += (uint64_t)miss;
    ex->stats.layers++;
    if (miss) {
        memset(ex->take_gpu, 0, (size_t)E);
        for (int i = 0; i < na; i++)
            if (h_ids[i] >= 0 && h_ids[i] < E && !on_device(ex, l, h_ids[i])) ex->take_gpu[h_ids[i]] = 1;
        ST_TRY(stream_misses(ex, b, a, ex->take_gpu));
    }
    if (sh) b->ops->add_gated_rows(b, a->y, sh->o, sh->s, n, d);
    return ST_OK;
}

st_status st_experts_compute(st_experts *ex, st_backend *b, const st_moe_args *a, const st_moe_shared *sh) {
    const st_placement *pl = ex->p.placement;
    int l = a->layer, n = a->n, d = (int)a->gate->cols, E = pl->n_expert;
    // Route here unless the device's kernels can: the moe op of a layer the device holds whole,
    // or a decode window's hand-off (each folds the routing into a kernel it runs anyway, one
    // launch fewer a layer). The CPU and the other hybrid paths need the ids first.
    bool hand = !b->ops->host_memory && ex->p.cache && layer_hybrid(pl, l);
    bool window = hand && n <= HAND_ROWS && !ex->win_sync;
    st_moe_args routed;
    if (a->logits && (b->ops->host_memory || !ex->p.cache || (hand && !window))) {
        b->ops->moe_route(b, a->logits, n, E, a->k, (int32_t *)a->ids, (float *)a->weights);
        routed = *a;
        routed.logits = NULL;
        a = &routed;
    }
    if (b->ops->host_memory) { // the CPU: every expert here
        count_routing(ex, l, a->ids, n * a->k, E);
        st_expert_weights w = {*a->gate, *a->up, *a->down};
        ST_TRY(host_moe(ex, b->pool, &w, l, a->x, a->ids, a->weights, n, a->k, NULL, a->y));
    } else {
        if (!ex->p.cache)
            return st_fail(ST_ERR_UNSUPPORTED, "layer %d: no expert cache on the %s backend", l, b->ops->name);
        if (layer_hybrid(pl, l)) { // these compute the shared expert in between
            if (n > HAND_ROWS) return hybrid_chunk(ex, b, a, sh);
            if (ex->win_sync) return hybrid_sync(ex, b, a, sh);
            if (!ex->win_n) return st_fail(ST_ERR_ARG, "layer %d: a window without st_experts_begin", l);
            hybrid_window(ex, b, a, sh);
            return ST_OK;
        }
        // Every expert of the layer on the device.
        uint32_t *counts = NULL;
        if (ex->p.count_on_device) {
            ex->b = b;
            size_t cb = sizeof(uint32_t) * (size_t)pl->n_layer * E;
            if (!ex->counts_dev) {
                if (!(ex->counts_dev = b->ops->alloc(b, cb))) return st_fail_prefix(ST_ERR_NOMEM, "routing counts");
                b->ops->zero(b, ex->counts_dev, cb);
            }
            counts = ex->counts_dev + (size_t)l * E;
        }
        // The shared expert first (it needs only x), so the experts' op can add its gated
        // output in its own last step (add_gated_rows' arithmetic, one launch fewer a layer).
        st_moe_args g = *a;
        if (sh) {
            shared_expert(b, sh, a->x, n);
            g.gated_o = sh->o;
            g.gated_s = sh->s;
        }
        cached_moe(ex, b, &g, counts);
        return ST_OK;
    }
    if (sh) { // the CPU
        shared_expert(b, sh, a->x, n);
        b->ops->add_gated_rows(b, a->y, sh->o, sh->s, n, d);
    }
    return ST_OK;
}

const uint64_t *st_experts_counts(st_experts *ex) {
    const st_placement *pl = ex->p.placement;
    if (ex->counts_dev && ex->b) { // the device's counts of fully cached layers join the host's
        size_t n = (size_t)pl->n_layer * pl->n_expert;
        uint32_t *tmp = st_alloc(sizeof(uint32_t) * n);
        if (tmp) {
            ex->b->ops->to_host(ex->b, tmp, ex->counts_dev, sizeof(uint32_t) * n);
            ex->b->ops->zero(ex->b, ex->counts_dev, sizeof(uint32_t) * n);
            for (size_t i = 0; i < n; i++) ex->counts[i] += tmp[i];
            st_free(tmp);
        }
    }
    return ex->counts;
}

void st_experts_window_done(st_experts *ex, st_backend *b) {
    // The device's waits for the host in the window just finished (its work is done: the
    // forward synchronized), layer by layer from the hand-off slots.
    for (int l = 0; ex->hand && l < ex->p.placement->n_layer; l++) {
        uint64_t *w = (uint64_t *)hand_flag(ex, l, HAND_WAIT);
        ex->stats.gpu_wait_s += (double)*w * 1e-9;
        *w = 0;
    }
    st_adapt *ad = ex->p.adapt;
    if (!ad || !ex->p.cache || b->ops->host_memory) return;
    // The swaps of an earlier decision go live once their copies are done (the device is idle
    // here: the window synchronized); until then the CPU computes their incoming experts. So a
    // decision costs the decode a few small map copies, not its experts' weights (at 16 GiB, 30B-A3B:
    // decode 295-299 tokens/s with the copies waited for, 312 without swaps).
    // (The pending swaps belong to the cache, which every session of the model shares.)
    st_expert_cache *c = ex->p.cache;
    bool idle = st_expert_cache_land(b, c);
    st_swap sw[64];
    int ns = st_adapt_window(ad, ex->p.placement, st_experts_counts(ex), sw, idle);
    for (int i = 0; i < ns; i++) st_expert_cache_swap_begin(b, c, ex->p.arena->w, &sw[i]);
    st_expert_cache_land(b, c); // at once where the copies were waited for
    ex->stats.swaps += (uint64_t)ns;
}

double st_experts_cpu_gbs(st_pool *pool, const st_placement *p, const st_expert_weights *w, int layer, int k) {
    int E = (int)w->gate.n, d = (int)w->gate.cols;
    if (E <= 0 || d <= 0 || k <= 0) return 0;
    if (k > E) k = E;
    st_experts *ex = NULL;
    st_experts_params ep = {.placement = (st_placement *)p};
    if (st_experts_create(&ep, &ex)) return 0;
    float *x = st_alloc(sizeof(float) * (size_t)d * 2), *y = x ? x + d : NULL, *wt = st_alloc(sizeof(float) * (size_t)k);
    int32_t *ids = st_alloc(sizeof(int32_t) * (size_t)k);
    double best = 0;
    if (x && wt && ids) {
        int n = 0; // the experts the cache lacks first (the ones the pool will compute), then any
        for (int e = 0; e < E && n < k; e++)
            if (st_placement_get(p, layer, e) == ST_PLACE_HOST) ids[n++] = e;
        for (int e = 0; e < E && n < k; e++)
            if (st_placement_get(p, layer, e) != ST_PLACE_HOST) ids[n++] = e;
        for (int i = 0; i < d; i++) x[i] = sinf(0.37f * (float)i);
        for (int j = 0; j < k; j++) wt[j] = 1.0f / (float)k;
        // The first run reads the weights in (from the disk, for a cold mapping); the best of the
        // next ones counts.
        for (int r = 0; r < 4; r++) {
            double t0 = st_time_s();
            if (host_moe(ex, pool, w, layer, x, ids, wt, 1, k, NULL, y)) {
                best = 0;
                break;
            }
            double dt = st_time_s() - t0;
            if (r > 0 && (best == 0 || dt < best)) best = dt;
        }
    }
    st_free(x);
    st_free(wt);
    st_free(ids);
    st_experts_free(ex);
    return best > 0 ? (double)k * st_expert_bytes(w) / best / 1e9 : 0;
}
