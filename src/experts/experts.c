// experts: the placement map, the router, and the routed-expert FFN on the CPU pool. Rows are
// grouped by expert so each chosen expert's gate, up and down matrices are read once per batch,
// and the work of all experts of a layer is spread over the pool in two passes (gate+up, down).

#include <math.h>
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
    const st_placement *placement;
    uint64_t *counts;        // (n_layer, n_expert)
    // Workspace, grown to the largest batch seen (a session reserves it before decoding).
    size_t ws_bytes;
    char *ws;
};

st_status st_experts_create(const st_placement *placement, st_experts **out) {
    *out = NULL;
    st_experts *ex = st_calloc(1, sizeof *ex);
    if (!ex) return ST_ERR_NOMEM;
    ex->placement = placement;
    ex->counts = st_calloc((size_t)placement->n_layer * placement->n_expert, sizeof(uint64_t));
    if (!ex->counts) {
        st_free(ex);
        return ST_ERR_NOMEM;
    }
    *out = ex;
    return ST_OK;
}

void st_experts_free(st_experts *ex) {
    if (!ex) return;
    st_free(ex->counts);
    st_free(ex->ws);
    st_free(ex);
}

const uint64_t *st_experts_counts(st_experts *ex) { return ex->counts; }

// Work of one pass: for each active expert, its rows [r0, r1) of a weight matrix in chunks.
typedef struct moe_pass {
    const st_mat3 *w[2];    // one or two matrices sharing the input (gate and up)
    float *y[2];            // (assignments, w->rows) outputs
    const char *xq;         // (assignments, xs) quantized inputs grouped by expert
    size_t xs;
    const int32_t *experts; // (n_active) expert ids
    const int32_t *start;   // (n_active + 1) first assignment of each active expert
    int n_active, chunk, n_chunks_per_expert;
} moe_pass;

static void moe_pass_worker(void *ctx, int ith, int nth) {
    const moe_pass *p = ctx;
    int per = p->n_chunks_per_expert, total = p->n_active * per;
    for (int t = ith; t < total; t += nth) {
        int a = t / per, c = t % per;
        int e = p->experts[a], m = p->start[a + 1] - p->start[a];
        for (int wi = 0; wi < 2 && p->w[wi]; wi++) {
            const st_mat3 *w = p->w[wi];
            int64_t r0 = (int64_t)c * p->chunk, r1 = r0 + p->chunk < w->rows ? r0 + p->chunk : w->rows;
            if (r0 >= r1) continue;
            st_matmul_args ma = {
                .type = w->type,
                .w = (const char *)w->data + (size_t)e * w->mat_bytes + (size_t)r0 * w->row_bytes,
                .n = w->cols, .rows = r1 - r0,
                .x = p->xq + (size_t)p->start[a] * p->xs, .x_stride = p->xs, .nx = m,
                .y = p->y[wi] + (size_t)p->start[a] * w->rows + r0, .ldy = w->rows,
            };
            st_matmul(NULL, &ma);
        }
    }
}

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

// Every expert of the layer has a device slot: the backend computes the layer on its own.
static bool layer_on_device(const st_placement *p, int layer) {
    for (int e = 0; e < p->n_expert; e++)
        if (st_placement_get(p, layer, e) == ST_PLACE_HOST) return false;
    return true;
}

st_status st_experts_compute(st_experts *ex, st_backend *b, const st_moe_args *a) {
    if (b->ops->moe && layer_on_device(ex->placement, a->layer)) {
        b->ops->moe(b, a);
        return ST_OK;
    }
    if (!b->ops->host_memory)
        return st_fail(ST_ERR_UNSUPPORTED, "layer %d: experts kept in host memory with the %s backend are not "
                       "supported yet (the hybrid expert cache); the whole model must fit on the GPU",
                       a->layer, b->ops->name);
    const st_mat3 *gate = a->gate, *up = a->up, *down = a->down;
    int n = a->n, k = a->k, d = (int)gate->cols, F = (int)gate->rows, E = (int)gate->n;
    int na = n * k;
    st_type gdt = st_type_get(gate->type)->dot_type, ddt = st_type_get(down->type)->dot_type;
    if (st_type_get(up->type)->dot_type != gdt)
        return st_fail(ST_ERR_UNSUPPORTED, "layer %d: expert gate (%s) and up (%s) need different "
                       "activation types", a->layer, st_type_name(gate->type), st_type_name(up->type));
    size_t xs = st_row_bytes(gdt, d), hs = st_row_bytes(ddt, F);

    // Workspace: expert lists, quantized inputs, gate/up/act outputs, down outputs.
    size_t need = sizeof(int32_t) * ((size_t)E + 1) * 3 + sizeof(int32_t) * na + xs * na +
                  sizeof(float) * (size_t)na * (2 * F + d) + hs * na + 64 * 8;
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
    int32_t *count, *start, *experts, *order;
    char *xq, *hq;
    float *hg, *hu, *yo;
    TAKE(count, sizeof(int32_t) * E);
    TAKE(start, sizeof(int32_t) * (E + 1));
    TAKE(experts, sizeof(int32_t) * E);
    TAKE(order, sizeof(int32_t) * na);
    TAKE(xq, xs * na);
    TAKE(hg, sizeof(float) * (size_t)na * F);
    TAKE(hu, sizeof(float) * (size_t)na * F);
    TAKE(hq, hs * na);
    TAKE(yo, sizeof(float) * (size_t)na * d);
#undef TAKE

    // Group the (row, slot) assignments by expert: order[] lists them expert by expert, and
    // start[j] .. start[j+1] is active expert j's range of it.
    memset(count, 0, sizeof(int32_t) * E);
    for (int i = 0; i < na; i++) {
        ST_ASSERT(a->ids[i] >= 0 && a->ids[i] < E);
        count[a->ids[i]]++;
    }
    int n_active = 0, pos = 0;
    for (int e = 0; e < E; e++) {
        if (!count[e]) continue;
        ex->counts[(size_t)a->layer * E + e] += (uint64_t)count[e];
        experts[n_active] = e;
        start[n_active++] = pos;
        int c = count[e];
        count[e] = pos; // becomes the insert cursor
        pos += c;
    }
    start[n_active] = na;
    for (int i = 0; i < na; i++) order[count[a->ids[i]]++] = i;

    // Quantize each assignment's input row in grouped order.
    act_job qj = {.x = a->x, .order = order, .k = k, .d = d, .type = gdt, .q = xq, .qs = xs, .n = na};
    st_pool_run(b->pool, quantize_inputs, &qj);

    moe_pass p1 = {.w = {gate, up}, .y = {hg, hu}, .xq = xq, .xs = xs, .experts = experts,
                   .start = start, .n_active = n_active};
    run_pass(b->pool, &p1, F);

    act_job aj = {.g = hg, .u = hu, .f = F, .type = ddt, .q = hq, .qs = hs, .n = na};
    st_pool_run(b->pool, swiglu_quantize, &aj);

    moe_pass p2 = {.w = {down, NULL}, .y = {yo, NULL}, .xq = hq, .xs = hs, .experts = experts,
                   .start = start, .n_active = n_active};
    run_pass(b->pool, &p2, d);

    // Weighted sum back into rows, slot by slot in a fixed order so the result does not depend
    // on how rows were grouped. inv[assignment] = its grouped index (hu is free now).
    int32_t *inv = (int32_t *)hu;
    for (int gi = 0; gi < na; gi++) inv[order[gi]] = gi;
    memset(a->y, 0, sizeof(float) * (size_t)n * d);
    for (int i = 0; i < n; i++) {
        float *y = a->y + (size_t)i * d;
        for (int j = 0; j < k; j++) {
            const float *o = yo + (size_t)inv[i * k + j] * d;
            float w = a->weights[i * k + j];
            for (int c = 0; c < d; c++) y[c] += w * o[c];
        }
    }
    return ST_OK;
}
