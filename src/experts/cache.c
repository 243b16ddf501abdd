// experts: a device's expert cache (per layer a stack of slots holding the hottest experts, and
// the device copy of the slot map) and the host arena the CPU pool reads every other expert from.

#include <string.h>

#include "experts/experts.h"

// Bytes of one expert's matrix in a compact stack (a view into a merged gate_up tensor has a
// larger stride, mat_bytes, than its own rows).
static size_t compact_bytes(const st_mat3 *m) { return (size_t)m->rows * m->row_bytes; }

typedef void (*copy_fn)(st_backend *b, void *dst, const void *src, size_t bytes);

static void host_copy(st_backend *b, void *dst, const void *src, size_t bytes) {
    (void)b;
    memcpy(dst, src, bytes);
}

static void device_copy(st_backend *b, void *dst, const void *src, size_t bytes) { b->ops->from_host(b, dst, src, bytes); }
static void device_copy_async(st_backend *b, void *dst, const void *src, size_t bytes) {
    b->ops->from_host_async(b, dst, src, bytes);
}

// Copies `count` consecutive experts from e of stack src into matrices slot.. of the compact
// stack dst: one copy when src is compact too (consecutive experts are contiguous).
static void copy_run(st_backend *b, copy_fn fn, const st_mat3 *dst, const st_mat3 *src, int slot, int e, int count) {
    size_t cb = compact_bytes(src);
    char *d = (char *)dst->data + (size_t)slot * cb;
    const char *s = (const char *)src->data + (size_t)e * src->mat_bytes;
    if (src->mat_bytes == cb) {
        fn(b, d, s, (size_t)count * cb);
        return;
    }
    for (int i = 0; i < count; i++) fn(b, d + (size_t)i * cb, s + (size_t)i * src->mat_bytes, cb);
}

static void copy_experts(st_backend *b, copy_fn fn, const st_expert_weights *dst, const st_expert_weights *src,
                         int slot, int e, int count) {
    copy_run(b, fn, &dst->gate, &src->gate, slot, e, count);
    copy_run(b, fn, &dst->up, &src->up, slot, e, count);
    copy_run(b, fn, &dst->down, &src->down, slot, e, count);
}

static st_mat3 stack_of(const st_mat3 *like, int n, void *data) {
    st_mat3 m = *like;
    m.n = n;
    m.mat_bytes = compact_bytes(like);
    m.data = data;
    return m;
}

st_expert_weights st_expert_stack(const st_expert_weights *like, int n, void *mem) {
    char *p = mem;
    st_expert_weights w;
    w.gate = stack_of(&like->gate, n, p);
    w.up = stack_of(&like->up, n, p + (size_t)n * compact_bytes(&like->gate));
    w.down = stack_of(&like->down, n, p + (size_t)n * (compact_bytes(&like->gate) + compact_bytes(&like->up)));
    return w;
}

void st_expert_upload(st_backend *b, const st_expert_weights *dst, const st_expert_weights *src, int slot, int e,
                      int count) {
    copy_experts(b, device_copy, dst, src, slot, e, count);
}

st_status st_expert_cache_create(st_backend *b, const st_placement *p, const st_expert_weights *w,
                                 st_expert_cache **out) {
    *out = NULL;
    st_expert_cache *c = st_calloc(1, sizeof *c);
    if (!c) return ST_ERR_NOMEM;
    c->n_layer = p->n_layer;
    c->n_expert = p->n_expert;
    c->slots = st_calloc((size_t)p->n_layer, sizeof *c->slots);
    size_t map_bytes = sizeof(int32_t) * (size_t)p->n_layer * p->n_expert;
    c->map_host = st_alloc(map_bytes);
    if (!c->slots || !c->map_host || !(c->map_dev = b->ops->alloc(b, map_bytes))) {
        st_expert_cache_free(b, c);
        return st_fail_prefix(ST_ERR_NOMEM, "expert cache");
    }
    memcpy(c->map_host, p->slot, map_bytes);
    b->ops->from_host(b, c->map_dev, p->slot, map_bytes);
    for (int l = 0; l < p->n_layer; l++) {
        int ns = p->n_slots[l];
        const st_expert_weights *src = &w[l];
        st_expert_weights *dst = &c->slots[l];
        dst->gate = stack_of(&src->gate, 0, NULL);
        dst->up = stack_of(&src->up, 0, NULL);
        dst->down = stack_of(&src->down, 0, NULL);
        if (ns <= 0) continue;
        size_t gb = (size_t)ns * compact_bytes(&src->gate), ub = (size_t)ns * compact_bytes(&src->up),
               db = (size_t)ns * compact_bytes(&src->down);
        void *g = b->ops->alloc(b, gb), *u = g ? b->ops->alloc(b, ub) : NULL, *d = u ? b->ops->alloc(b, db) : NULL;
        if (!d) {
            b->ops->free(b, g);
            b->ops->free(b, u);
            st_expert_cache_free(b, c);
            return st_fail_prefix(ST_ERR_NOMEM, "expert cache, layer %d (%d slots, %.1f MiB)", l, ns,
                                  (gb + ub + db) / 1048576.0);
        }
        dst->gate = stack_of(&src->gate, ns, g);
        dst->up = stack_of(&src->up, ns, u);
        dst->down = stack_of(&src->down, ns, d);
        c->bytes += gb + ub + db;
        // Runs of experts with consecutive ids in consecutive slots (slots follow expert order).
        for (int e = 0; e < p->n_expert;) {
            int slot = st_placement_get(p, l, e);
            if (slot < 0) {
                e++;
                continue;
            }
            int run = 1;
            while (e + run < p->n_expert && st_placement_get(p, l, e + run) == slot + run) run++;
            copy_experts(b, device_copy, dst, src, slot, e, run);
            e += run;
        }
    }
    *out = c;
    return ST_OK;
}

void st_expert_cache_free(st_backend *b, st_expert_cache *c) {
    if (!c) return;
    for (int l = 0; c->slots && l < c->n_layer; l++) {
        b->ops->free(b, (void *)c->slots[l].gate.data);
        b->ops->free(b, (void *)c->slots[l].up.data);
        b->ops->free(b, (void *)c->slots[l].down.data);
    }
    b->ops->free(b, c->map_dev);
    st_free(c->map_host);
    st_free(c->slots);
    st_free(c);
}

// Expert e of layer l to slot (or ST_PLACE_HOST) in both maps.
static void set_map(st_backend *b, st_expert_cache *c, int l, int e, int32_t slot) {
    size_t i = (size_t)l * c->n_expert + e;
    c->map_host[i] = slot;
    b->ops->from_host(b, c->map_dev + i, &c->map_host[i], sizeof(int32_t));
}

static void swap_begin(st_backend *b, st_expert_cache *c, const st_expert_weights *w, const st_swap *sw, bool async) {
    set_map(b, c, sw->layer, sw->out, ST_PLACE_HOST); // queued before the copy: no window reads the slot
    copy_experts(b, async ? device_copy_async : device_copy, &c->slots[sw->layer], &w[sw->layer], sw->slot, sw->in,
                 1);
}

void st_expert_cache_swap_begin(st_backend *b, st_expert_cache *c, const st_expert_weights *w, const st_swap *sw) {
    ST_ASSERT(c->n_pending < (int)(sizeof c->pending / sizeof c->pending[0]));
    swap_begin(b, c, w, sw, b->ops->from_host_async != NULL);
    c->pending[c->n_pending++] = *sw;
}

bool st_expert_cache_land(st_backend *b, st_expert_cache *c) {
    if (!c->n_pending) return true;
    if (b->ops->h2d_done && !b->ops->h2d_done(b)) return false;
    for (int i = 0; i < c->n_pending; i++) set_map(b, c, c->pending[i].layer, c->pending[i].in, c->pending[i].slot);
    c->n_pending = 0;
    return true;
}

void st_expert_cache_swap(st_backend *b, st_expert_cache *c, const st_expert_weights *w, const st_swap *sw) {
    swap_begin(b, c, w, sw, false);
    set_map(b, c, sw->layer, sw->in, sw->slot);
}

double st_expert_link_gbs(st_backend *b, bool pinned, size_t total) {
    if (b->ops->host_memory || !b->ops->host_alloc) return 0;
    size_t chunk = (size_t)16 << 20;
    void *dev = b->ops->alloc(b, chunk);
    char *host = !dev ? NULL : pinned ? b->ops->host_alloc(b, chunk) : st_alloc(chunk);
    double gbs = 0;
    if (host) {
        memset(host, 1, chunk);
        b->ops->from_host(b, dev, host, chunk); // warm-up: the first copy sets up the path
        int n = (int)((total + chunk - 1) / chunk);
        double t0 = st_time_s();
        for (int i = 0; i < n; i++) b->ops->from_host(b, dev, host, chunk); // each waits for its copy
        double dt = st_time_s() - t0;
        if (!b->ops->sync(b) && dt > 0) gbs = (double)n * chunk / dt / 1e9;
        if (pinned) b->ops->host_free(b, host);
        else st_free(host);
    }
    b->ops->free(b, dev);
    return gbs;
}

// ---------------------------------------------------------------------------------------------

st_status st_expert_arena_create(st_backend *b, const st_placement *p, const st_expert_weights *mapped,
                                 const uint64_t *counts, size_t resident_budget, st_expert_arena **out) {
    *out = NULL;
    int L = p->n_layer, E = p->n_expert;
    st_expert_arena *a = st_calloc(1, sizeof *a);
    if (!a) return ST_ERR_NOMEM;
    a->n_layer = L;
    a->w = st_calloc((size_t)L, sizeof *a->w);
    a->resident = st_calloc((size_t)L, sizeof *a->resident);
    double *miss = st_calloc((size_t)L, sizeof(double));
    if (!a->w || !a->resident || !miss) {
        st_free(miss);
        st_expert_arena_free(b, a);
        return ST_ERR_NOMEM;
    }
    memcpy(a->w, mapped, sizeof *a->w * (size_t)L);
    // A layer's routing to experts the cache lacks (how much the CPU and the link read from it).
    // Each count is taken one higher: an expert the profile never saw is still routed to now and
    // then, so when the cache holds everything the profile saw (the 30B-A3B shape at 16 GiB) the
    // rest still becomes resident, instead of all of it staying in the mapping (prompt 512 there:
    // 3,500-3,670 tokens/s streaming from page-locked memory, 1,600-1,860 from the mapping).
    for (int l = 0; l < L; l++)
        for (int e = 0; e < E; e++)
            if (st_placement_get(p, l, e) == ST_PLACE_HOST) miss[l] += counts ? (double)counts[(size_t)l * E + e] + 1 : 1.0;
    bool refused = false;
    while (resident_budget > 0 && b->ops->host_alloc && !refused) {
        int best = -1;
        for (int l = 0; l < L; l++)
            if (!a->resident[l] && miss[l] > 0 && st_expert_bytes(&mapped[l]) &&
                (best < 0 || miss[l] > miss[best]))
                best = l;
        if (best < 0) break;
        const st_expert_weights *m = &mapped[best];
        size_t bytes = (size_t)E * st_expert_bytes(m);
        if (a->resident_bytes + bytes > resident_budget) {
            miss[best] = 0; // does not fit: a smaller layer still may
            continue;
        }
        char *r = b->ops->host_alloc(b, bytes);
        if (!r) {
            st_log_info("resident experts: %s; the rest are read from the mapping", st_error());
            refused = true;
            break;
        }
        a->w[best] = st_expert_stack(m, E, r);
        copy_experts(b, host_copy, &a->w[best], m, 0, 0, E);
        a->resident[best] = r;
        a->resident_bytes += bytes;
        miss[best] = 0;
    }
    st_free(miss);
    *out = a;
    return ST_OK;
}

void st_expert_arena_free(st_backend *b, st_expert_arena *a) {
    if (!a) return;
    for (int l = 0; a->resident && l < a->n_layer; l++)
        if (a->resident[l]) b->ops->host_free(b, a->resident[l]);
    st_free(a->resident);
    st_free(a->w);
    st_free(a);
}
