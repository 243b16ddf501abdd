// Unit tests for the hybrid expert cache's data movement, with the CPU backend standing in for
// the device (its alloc is host memory and from_host a copy): compact stacks and uploads of
// expert runs, merged gate_up sources (views into one tensor per expert, read to its exact end
// under ASan), the cache filled from a plan (per-layer types, slot counts, layers without slots),
// swaps, running out of backend memory, and the host arena (the mapping on a backend that cannot
// lock memory; resident copies through a backend that can); the --pcie-frac probe's CPU and link
// measurements.
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "experts/experts.h"
#include "quant/quant.h"

enum { E = 8 }; // experts per layer in every fixture

// ---------------------------------------------------------------------------------------------
// Host stacks of random bytes

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static void fill_random(void *p, size_t n) {
    unsigned char *c = p;
    for (size_t i = 0; i < n; i++) {
        rng_state ^= rng_state << 13;
        rng_state ^= rng_state >> 7;
        rng_state ^= rng_state << 17;
        c[i] = (unsigned char)(rng_state >> 32);
    }
}

// One layer's routed experts in host memory: gate and up (F, d) and down (d, F) per expert,
// either three separate stacks or, merged, one (2F, d) tensor per expert whose first F rows are
// gate and last F rows up (as model.c binds ffn_gate_up_exps). Buffers are malloc'd at their
// exact size, so ASan catches a read past the end.
typedef struct host_layer {
    st_expert_weights w;
    void *gate_up;    // (E, 2F, d) merged, or NULL
    void *gate, *up;  // (E, F, d) each, when not merged
    void *down;       // (E, d, F)
    size_t gate_up_bytes;
} host_layer;

static void layer_init(host_layer *h, st_type type, int d, int F, bool merged) {
    memset(h, 0, sizeof *h);
    size_t rb_d = st_row_bytes(type, d), rb_f = st_row_bytes(type, F);
    st_mat3 gate = {type, d, F, E, rb_d, (size_t)F * rb_d, NULL};
    st_mat3 down = {type, F, d, E, rb_f, (size_t)d * rb_f, NULL};
    if (merged) {
        h->gate_up_bytes = (size_t)E * 2 * F * rb_d;
        h->gate_up = malloc(h->gate_up_bytes);
        assert_non_null(h->gate_up);
        fill_random(h->gate_up, h->gate_up_bytes);
        gate.mat_bytes = (size_t)2 * F * rb_d;
        gate.data = h->gate_up;
        h->w.gate = gate;
        h->w.up = gate;
        h->w.up.data = (const char *)h->gate_up + (size_t)F * rb_d;
    } else {
        size_t bytes = (size_t)E * F * rb_d;
        h->gate = malloc(bytes);
        h->up = malloc(bytes);
        assert_non_null(h->gate);
        assert_non_null(h->up);
        fill_random(h->gate, bytes);
        fill_random(h->up, bytes);
        h->w.gate = gate;
        h->w.gate.data = h->gate;
        h->w.up = gate;
        h->w.up.data = h->up;
    }
    size_t db = (size_t)E * d * rb_f;
    h->down = malloc(db);
    assert_non_null(h->down);
    fill_random(h->down, db);
    down.data = h->down;
    h->w.down = down;
}

// A layer without routed experts (a dense layer): every stack empty, 0 bytes an expert.
static void layer_init_empty(host_layer *h) { memset(h, 0, sizeof *h); }

static void layer_free(host_layer *h) {
    free(h->gate_up);
    free(h->gate);
    free(h->up);
    free(h->down);
}

// ---------------------------------------------------------------------------------------------
// Checks

// Matrix `slot` of the compact stack dst holds matrix e of src (its own rows only).
static void expect_mat(const st_mat3 *dst, int slot, const st_mat3 *src, int e) {
    size_t cb = (size_t)src->rows * src->row_bytes;
    assert_true(slot >= 0 && slot < dst->n);
    assert_true(dst->mat_bytes == cb);
    const char *d = (const char *)dst->data + (size_t)slot * cb;
    assert_memory_equal(d, (const char *)src->data + (size_t)e * src->mat_bytes, cb);
}

static void expect_expert(const st_expert_weights *dst, int slot, const st_expert_weights *src, int e) {
    expect_mat(&dst->gate, slot, &src->gate, e);
    expect_mat(&dst->up, slot, &src->up, e);
    expect_mat(&dst->down, slot, &src->down, e);
}

// A compact stack of n experts shaped like `like`, laid out in mem as the header says.
static void expect_stack_layout(const st_expert_weights *s, const st_expert_weights *like, int n, const void *mem) {
    const char *m = mem;
    size_t gb = (size_t)like->gate.rows * like->gate.row_bytes, ub = (size_t)like->up.rows * like->up.row_bytes,
           db = (size_t)like->down.rows * like->down.row_bytes;
    const st_mat3 *got[3] = {&s->gate, &s->up, &s->down}, *want[3] = {&like->gate, &like->up, &like->down};
    size_t cb[3] = {gb, ub, db};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(got[i]->type, want[i]->type);
        assert_int_equal(got[i]->cols, want[i]->cols);
        assert_int_equal(got[i]->rows, want[i]->rows);
        assert_int_equal(got[i]->n, n);
        assert_true(got[i]->row_bytes == want[i]->row_bytes);
        assert_true(got[i]->mat_bytes == cb[i]);
    }
    assert_ptr_equal(s->gate.data, m);
    assert_ptr_equal(s->up.data, m + (size_t)n * gb);
    assert_ptr_equal(s->down.data, m + (size_t)n * (gb + ub));
    assert_true((size_t)n * (gb + ub + db) == (size_t)n * st_expert_bytes(like));
}

// The bytes of matrices [from, to) of a compact stack are all `v` (untouched by an upload).
static void expect_mats_untouched(const st_mat3 *m, int from, int to, unsigned char v) {
    const unsigned char *p = (const unsigned char *)m->data + (size_t)from * m->mat_bytes;
    for (size_t i = 0; i < (size_t)(to - from) * m->mat_bytes; i++)
        if (p[i] != v) fail_msg("byte %zu of matrices %d..%d was overwritten", i, from, to);
}

// ---------------------------------------------------------------------------------------------
// Stacks and uploads

// Uploads the runs {slot, e, count} into a fresh stack of n slots and checks every slot.
static void check_uploads(st_backend *b, const st_expert_weights *src, int n) {
    size_t bytes = (size_t)n * st_expert_bytes(src);
    void *mem = malloc(bytes);
    assert_non_null(mem);
    memset(mem, 0xcd, bytes);
    st_expert_weights s = st_expert_stack(src, n, mem);
    expect_stack_layout(&s, src, n, mem);

    // Runs of 2 (experts 3, 4 -> slots 1, 2), 1 (the last expert -> slot 0) and 1 (expert 0 ->
    // the last slot); slot 3 stays empty.
    ST_ASSERT(n == 5);
    st_expert_upload(b, &s, src, 1, 3, 2);
    expect_expert(&s, 1, src, 3);
    expect_expert(&s, 2, src, 4);
    expect_mats_untouched(&s.gate, 0, 1, 0xcd);
    expect_mats_untouched(&s.gate, 3, 5, 0xcd);
    expect_mats_untouched(&s.up, 0, 1, 0xcd);
    expect_mats_untouched(&s.up, 3, 5, 0xcd);
    expect_mats_untouched(&s.down, 0, 1, 0xcd);
    expect_mats_untouched(&s.down, 3, 5, 0xcd);
    st_expert_upload(b, &s, src, 0, E - 1, 1);
    st_expert_upload(b, &s, src, 4, 0, 1);
    expect_expert(&s, 0, src, E - 1);
    expect_expert(&s, 1, src, 3);
    expect_expert(&s, 2, src, 4);
    expect_expert(&s, 4, src, 0);
    expect_mats_untouched(&s.gate, 3, 4, 0xcd);
    expect_mats_untouched(&s.up, 3, 4, 0xcd);
    expect_mats_untouched(&s.down, 3, 4, 0xcd);
    // A run over the last experts (5, 6, 7 -> slots 2, 3, 4) overwrites what was there.
    st_expert_upload(b, &s, src, 2, E - 3, 3);
    expect_expert(&s, 0, src, E - 1);
    expect_expert(&s, 1, src, 3);
    for (int i = 0; i < 3; i++) expect_expert(&s, 2 + i, src, E - 3 + i);
    free(mem);

    // A stack of all E experts, filled with one run, is the source compacted.
    bytes = (size_t)E * st_expert_bytes(src);
    mem = malloc(bytes);
    assert_non_null(mem);
    s = st_expert_stack(src, E, mem);
    expect_stack_layout(&s, src, E, mem);
    st_expert_upload(b, &s, src, 0, 0, E);
    for (int e = 0; e < E; e++) expect_expert(&s, e, src, e);
    free(mem);
}

static void test_stack_upload(void **state) {
    (void)state;
    st_backend *b;
    assert_int_equal(st_backend_cpu_create(1, &b), ST_OK);
    host_layer q8, f32;
    layer_init(&q8, ST_TYPE_Q8_0, 64, 96, false);
    layer_init(&f32, ST_TYPE_F32, 12, 20, false);
    assert_true(q8.w.gate.row_bytes == 2 * 34 && q8.w.down.row_bytes == 3 * 34);
    assert_true(st_expert_bytes(&q8.w) == (size_t)96 * 68 * 2 + (size_t)64 * 102);
    assert_true(st_expert_bytes(&f32.w) == (size_t)20 * 48 * 2 + (size_t)12 * 80);
    check_uploads(b, &q8.w, 5);
    check_uploads(b, &f32.w, 5);
    layer_free(&q8);
    layer_free(&f32);
    st_backend_free(b);
}

// A merged gate_up source: the compact copies hold each expert's gate rows and up rows (checked
// against the raw merged tensor), and no copy reads past the tensor's end (ASan).
static void test_merged_gate_up(void **state) {
    (void)state;
    st_backend *b;
    assert_int_equal(st_backend_cpu_create(1, &b), ST_OK);
    const st_type types[2] = {ST_TYPE_Q8_0, ST_TYPE_F32};
    for (int t = 0; t < 2; t++) {
        int d = 32, F = 64;
        host_layer h;
        layer_init(&h, types[t], d, F, true);
        size_t rb = st_row_bytes(types[t], d), fb = (size_t)F * rb;
        assert_true(h.w.gate.mat_bytes == 2 * fb && h.w.up.mat_bytes == 2 * fb);
        assert_true(st_expert_bytes(&h.w) == 2 * fb + (size_t)d * st_row_bytes(types[t], F));
        check_uploads(b, &h.w, 5);

        // Every expert, against the raw tensor: gate = rows 0..F-1, up = rows F..2F-1.
        void *mem = malloc((size_t)E * st_expert_bytes(&h.w));
        assert_non_null(mem);
        st_expert_weights s = st_expert_stack(&h.w, E, mem);
        assert_true(s.gate.mat_bytes == fb && s.up.mat_bytes == fb);
        // In two runs, the second ending at the merged tensor's last byte.
        st_expert_upload(b, &s, &h.w, 0, 0, 3);
        st_expert_upload(b, &s, &h.w, 3, 3, E - 3);
        const char *raw = h.gate_up;
        for (int e = 0; e < E; e++) {
            assert_memory_equal((const char *)s.gate.data + (size_t)e * fb, raw + (size_t)e * 2 * fb, fb);
            assert_memory_equal((const char *)s.up.data + (size_t)e * fb, raw + (size_t)e * 2 * fb + fb, fb);
            expect_mat(&s.down, e, &h.w.down, e);
        }
        assert_ptr_equal(raw + (size_t)(E - 1) * 2 * fb + 2 * fb, raw + h.gate_up_bytes);
        free(mem);
        layer_free(&h);
    }
    st_backend_free(b);
}

// ---------------------------------------------------------------------------------------------
// The cache, from a plan

// Six layers of different shapes and types:
//   0  Q8_0, separate, hot {1, 2, 5}          -> 3 slots
//   1  F32, merged, hot {0, 3, 4, 6}          -> 4 slots (runs 0 | 3 4 | 6; 7 stays out)
//   2  no experts                              -> 0 slots
//   3  Q8_0, merged, hot {6, 7}               -> 2 slots (the last expert of the tensor)
//   4  F32, separate, all hot                  -> 8 slots (one run, one copy a matrix)
//   5  Q8_0, separate, cold                    -> 0 slots although it has experts
// The budget is exactly the hot experts' bytes, so the plan takes those and nothing else.
enum { L = 6 };

typedef struct fixture {
    st_backend *b;
    host_layer h[L];
    st_expert_weights w[L];
    size_t expert_bytes[L];
    uint64_t counts[L * E];
    st_placement *p;
} fixture;

static const int32_t fixture_slots[L] = {3, 4, 0, 2, 8, 0};

static void fixture_init(fixture *f) {
    memset(f, 0, sizeof *f);
    assert_int_equal(st_backend_cpu_create(1, &f->b), ST_OK);
    layer_init(&f->h[0], ST_TYPE_Q8_0, 64, 32, false);
    layer_init(&f->h[1], ST_TYPE_F32, 16, 24, true);
    layer_init_empty(&f->h[2]);
    layer_init(&f->h[3], ST_TYPE_Q8_0, 32, 64, true);
    layer_init(&f->h[4], ST_TYPE_F32, 8, 16, false);
    layer_init(&f->h[5], ST_TYPE_Q8_0, 32, 32, false);
    for (int l = 0; l < L; l++) {
        f->w[l] = f->h[l].w;
        f->expert_bytes[l] = st_expert_bytes(&f->w[l]);
    }
    assert_true(f->expert_bytes[2] == 0);
    const int hot[][E] = {{1, 2, 5, -1}, {0, 3, 4, 6, -1}, {-1}, {6, 7, -1}, {0, 1, 2, 3, 4, 5, 6, 7}, {-1}};
    size_t budget = 0;
    for (int l = 0; l < L; l++)
        for (int i = 0; i < E && hot[l][i] >= 0; i++) {
            f->counts[l * E + hot[l][i]] = 100 + (uint64_t)(l * E + i);
            budget += f->expert_bytes[l];
        }
    assert_int_equal(st_placement_create_host(L, E, &f->p), ST_OK);
    assert_int_equal(st_placement_plan(f->p, f->counts, f->expert_bytes, budget), 3 + 4 + 2 + 8);
    assert_memory_equal(f->p->n_slots, fixture_slots, sizeof fixture_slots);
    assert_int_equal(st_placement_get(f->p, 1, 6), 3);
    assert_int_equal(st_placement_get(f->p, 1, 7), ST_PLACE_HOST);
    assert_int_equal(st_placement_get(f->p, 3, 7), 1);
}

static void fixture_free(fixture *f) {
    st_placement_free(f->p);
    for (int l = 0; l < L; l++) layer_free(&f->h[l]);
    st_backend_free(f->b);
}

// Everything the cache holds agrees with placement p and the host stacks.
static void expect_cache(const st_expert_cache *c, const st_placement *p, const st_expert_weights *w) {
    assert_int_equal(c->n_layer, p->n_layer);
    assert_int_equal(c->n_expert, p->n_expert);
    // map_dev is host memory on the CPU backend.
    assert_memory_equal(c->map_dev, p->slot, sizeof(int32_t) * (size_t)p->n_layer * p->n_expert);
    size_t bytes = 0;
    for (int l = 0; l < p->n_layer; l++) {
        const st_expert_weights *s = &c->slots[l];
        int ns = p->n_slots[l];
        assert_int_equal(s->gate.n, ns);
        assert_int_equal(s->up.n, ns);
        assert_int_equal(s->down.n, ns);
        if (ns == 0) {
            assert_null(s->gate.data);
            assert_null(s->up.data);
            assert_null(s->down.data);
            continue;
        }
        bytes += (size_t)ns * st_expert_bytes(&w[l]);
        int seen = 0;
        for (int e = 0; e < p->n_expert; e++) {
            int slot = st_placement_get(p, l, e);
            if (slot == ST_PLACE_HOST) continue;
            expect_expert(s, slot, &w[l], e);
            seen++;
        }
        assert_int_equal(seen, ns);
    }
    assert_true(c->bytes == bytes);
}

static void test_cache_create(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    st_expert_cache *c = (st_expert_cache *)1;
    assert_int_equal(st_expert_cache_create(f.b, f.p, f.w, &c), ST_OK);
    assert_non_null(c);
    expect_cache(c, f.p, f.w);
    size_t want = 3 * f.expert_bytes[0] + 4 * f.expert_bytes[1] + 2 * f.expert_bytes[3] + 8 * f.expert_bytes[4];
    assert_true(c->bytes == want);
    // The compact stacks of merged layers have their own rows' stride, not the tensor's.
    assert_true(c->slots[1].gate.mat_bytes == (size_t)24 * f.w[1].gate.row_bytes);
    assert_true(c->slots[3].up.mat_bytes == (size_t)64 * f.w[3].up.row_bytes);
    st_expert_cache_free(f.b, c);
    st_expert_cache_free(f.b, NULL);

    // A placement with nothing on the device: an empty cache and a map of ST_PLACE_HOST.
    st_placement *none;
    assert_int_equal(st_placement_create_host(L, E, &none), ST_OK);
    assert_int_equal(st_expert_cache_create(f.b, none, f.w, &c), ST_OK);
    expect_cache(c, none, f.w);
    assert_true(c->bytes == 0);
    st_expert_cache_free(f.b, c);
    st_placement_free(none);
    fixture_free(&f);
}

// A swap decided by st_adapt_window: expert 2 of layer 1 (merged) becomes hot and replaces the
// coldest cached expert, 0, in slot 0. Then swaps by hand: the merged tensor's last expert into
// layer 1, and a Q8_0 layer's.
static void test_cache_swap(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    st_expert_cache *c;
    assert_int_equal(st_expert_cache_create(f.b, f.p, f.w, &c), ST_OK);

    st_adapt *a;
    assert_int_equal(st_adapt_create(f.p, 1, 1, 1.0, NULL, &a), ST_OK);
    uint64_t counts[L * E] = {0};
    counts[1 * E + 2] = 1000;
    st_swap sw[1];
    assert_int_equal(st_adapt_window(a, f.p, counts, sw, true), 1);
    assert_int_equal(sw[0].layer, 1);
    assert_int_equal(sw[0].slot, 0);
    assert_int_equal(sw[0].in, 2);
    assert_int_equal(sw[0].out, 0);
    assert_int_equal(st_placement_get(f.p, 1, 2), 0);
    assert_int_equal(st_placement_get(f.p, 1, 0), ST_PLACE_HOST);
    // Before the swap the device map still has the old slots.
    assert_int_equal(c->map_dev[1 * E + 0], 0);
    assert_int_equal(c->map_dev[1 * E + 2], ST_PLACE_HOST);
    st_expert_cache_swap(f.b, c, f.w, &sw[0]);
    assert_int_equal(c->map_dev[1 * E + 2], 0);
    assert_int_equal(c->map_dev[1 * E + 0], ST_PLACE_HOST);
    expect_expert(&c->slots[1], 0, &f.w[1], 2);
    expect_cache(c, f.p, f.w); // the other slots and layers are as they were
    st_adapt_free(a);

    // By hand: layer 1's expert 7 (the last of the merged tensor) replaces expert 3 in slot 1.
    st_swap hand = {.layer = 1, .slot = 1, .in = 7, .out = 3};
    f.p->slot[1 * E + 7] = 1;
    f.p->slot[1 * E + 3] = ST_PLACE_HOST;
    st_expert_cache_swap(f.b, c, f.w, &hand);
    assert_int_equal(c->map_dev[1 * E + 7], 1);
    assert_int_equal(c->map_dev[1 * E + 3], ST_PLACE_HOST);
    expect_expert(&c->slots[1], 1, &f.w[1], 7);
    expect_cache(c, f.p, f.w);

    // Layer 0 (Q8_0, separate stacks): expert 7 replaces expert 5 in the last slot.
    hand = (st_swap){.layer = 0, .slot = 2, .in = 7, .out = 5};
    f.p->slot[0 * E + 7] = 2;
    f.p->slot[0 * E + 5] = ST_PLACE_HOST;
    st_expert_cache_swap(f.b, c, f.w, &hand);
    expect_expert(&c->slots[0], 2, &f.w[0], 7);
    expect_cache(c, f.p, f.w);
    st_expert_cache_free(f.b, c);

    // A cache made from the swapped placement, whose slots no longer follow expert order (layer
    // 1: experts 6, 7 in slots 3, 1), copies each expert into its own slot.
    assert_int_equal(st_placement_get(f.p, 1, 6), 3);
    assert_int_equal(st_placement_get(f.p, 1, 7), 1);
    assert_int_equal(st_expert_cache_create(f.b, f.p, f.w, &c), ST_OK);
    expect_cache(c, f.p, f.w);
    st_expert_cache_free(f.b, c);

    // Slots in reverse expert order in every layer that has slots.
    for (int l = 0; l < L; l++) {
        int ns = f.p->n_slots[l];
        for (int e = 0; e < E; e++) f.p->slot[l * E + e] = e < ns ? ns - 1 - e : ST_PLACE_HOST;
    }
    assert_int_equal(st_expert_cache_create(f.b, f.p, f.w, &c), ST_OK);
    expect_cache(c, f.p, f.w);
    st_expert_cache_free(f.b, c);
    fixture_free(&f);
}

// A swap in two steps on a backend whose copies run later (queued by from_host_async, done when
// the test says): begin unmaps the leaving expert at once and leaves the slot alone until the
// copy runs; land maps the incoming expert only once the copies are done.
typedef struct pending_copy {
    void *dst;
    const void *src;
    size_t bytes;
} pending_copy;
static pending_copy queued[8];
static int n_queued;
static void queue_copy(st_backend *b, void *dst, const void *src, size_t bytes) {
    (void)b;
    assert_true(n_queued < 8);
    queued[n_queued++] = (pending_copy){dst, src, bytes};
}
static bool queue_empty(st_backend *b) {
    (void)b;
    return n_queued == 0;
}

static void test_cache_swap_async(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    st_backend_ops ops = *f.b->ops;
    ops.from_host_async = queue_copy;
    ops.h2d_done = queue_empty;
    st_backend fake = *f.b;
    fake.ops = &ops;
    st_expert_cache *c;
    assert_int_equal(st_expert_cache_create(&fake, f.p, f.w, &c), ST_OK);
    // Layer 1: expert 7 replaces expert 3 in slot 1 (the placement decided so).
    st_swap sw = {.layer = 1, .slot = 1, .in = 7, .out = 3};
    f.p->slot[1 * E + 7] = 1;
    f.p->slot[1 * E + 3] = ST_PLACE_HOST;
    expect_expert(&c->slots[1], 1, &f.w[1], 3);
    n_queued = 0;
    assert_true(st_expert_cache_land(&fake, c)); // nothing pending
    st_expert_cache_swap_begin(&fake, c, f.w, &sw);
    assert_int_equal(c->n_pending, 1);
    assert_int_equal(c->map_dev[1 * E + 3], ST_PLACE_HOST);
    assert_int_equal(c->map_host[1 * E + 3], ST_PLACE_HOST);
    assert_int_equal(c->map_dev[1 * E + 7], ST_PLACE_HOST); // not live before its copy is done
    assert_int_equal(c->map_host[1 * E + 7], ST_PLACE_HOST);
    assert_int_equal(n_queued, 3);                          // gate, up, down, none run yet
    expect_expert(&c->slots[1], 1, &f.w[1], 3);
    assert_false(st_expert_cache_land(&fake, c)); // the copies are still queued: nothing changes
    assert_int_equal(c->map_host[1 * E + 7], ST_PLACE_HOST);
    for (int i = 0; i < n_queued; i++) memcpy(queued[i].dst, queued[i].src, queued[i].bytes);
    n_queued = 0;
    assert_true(st_expert_cache_land(&fake, c));
    assert_int_equal(c->n_pending, 0);
    assert_int_equal(c->map_dev[1 * E + 7], 1);
    assert_int_equal(c->map_host[1 * E + 7], 1);
    expect_expert(&c->slots[1], 1, &f.w[1], 7);
    expect_cache(c, f.p, f.w);
    for (size_t i = 0; i < (size_t)L * E; i++) assert_int_equal(c->map_host[i], c->map_dev[i]);
    st_expert_cache_free(&fake, c);
    fixture_free(&f);
}

// Backend memory running out at every allocation in turn: the cache fails with ST_ERR_NOMEM and
// a message naming it, sets *out NULL and frees what it had (LSan).
static int allocs_left;

static void *failing_alloc(st_backend *b, size_t bytes) {
    (void)b;
    if (allocs_left-- <= 0) {
        st_fail(ST_ERR_NOMEM, "out of device memory for %zu bytes (test)", bytes);
        return NULL;
    }
    return st_alloc(bytes);
}

static void test_cache_out_of_memory(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    st_backend_ops ops = *f.b->ops;
    ops.alloc = failing_alloc;
    st_backend fake = *f.b;
    fake.ops = &ops;
    int n_allocs = 1 + 3 * 4; // the map, and gate, up, down of the 4 layers with slots
    for (int k = 0; k < n_allocs; k++) {
        allocs_left = k;
        st_expert_cache *c = (st_expert_cache *)1;
        assert_int_equal(st_expert_cache_create(&fake, f.p, f.w, &c), ST_ERR_NOMEM);
        assert_null(c);
        assert_non_null(strstr(st_error(), "expert cache"));
    }
    allocs_left = n_allocs;
    st_expert_cache *c;
    assert_int_equal(st_expert_cache_create(&fake, f.p, f.w, &c), ST_OK);
    assert_int_equal(allocs_left, 0);
    expect_cache(c, f.p, f.w);
    st_expert_cache_free(&fake, c);
    fixture_free(&f);
}

// ---------------------------------------------------------------------------------------------
// The arena

static void expect_arena_mapping(const st_expert_arena *a, const st_expert_weights *w, int l) {
    assert_null(a->resident[l]);
    assert_ptr_equal(a->w[l].gate.data, w[l].gate.data);
    assert_ptr_equal(a->w[l].up.data, w[l].up.data);
    assert_ptr_equal(a->w[l].down.data, w[l].down.data);
    assert_true(a->w[l].gate.mat_bytes == w[l].gate.mat_bytes);
    assert_true(a->w[l].up.mat_bytes == w[l].up.mat_bytes);
    assert_true(a->w[l].down.mat_bytes == w[l].down.mat_bytes);
    assert_int_equal(a->w[l].gate.n, w[l].gate.n);
}

// The CPU backend cannot lock memory (no host_alloc): any budget leaves the mapping in use.
static void test_arena_cpu_backend(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    assert_null(f.b->ops->host_alloc);
    const size_t budgets[3] = {0, 1, (size_t)1 << 40};
    for (int i = 0; i < 3; i++)
        for (int with_counts = 0; with_counts < 2; with_counts++) {
            st_expert_arena *a = (st_expert_arena *)1;
            assert_int_equal(st_expert_arena_create(f.b, f.p, f.w, with_counts ? f.counts : NULL, budgets[i], &a),
                             ST_OK);
            assert_non_null(a);
            assert_int_equal(a->n_layer, L);
            assert_true(a->resident_bytes == 0);
            for (int l = 0; l < L; l++) expect_arena_mapping(a, f.w, l);
            st_expert_arena_free(f.b, a);
        }
    st_expert_arena_free(f.b, NULL);
    fixture_free(&f);
}

// A backend that can lock memory: the CPU's ops with host_alloc (refusing once `refuse` is set).
static bool refuse;
static int host_allocs;

static void *fake_host_alloc(st_backend *b, size_t bytes) {
    (void)b;
    if (refuse) {
        st_fail(ST_ERR_NOMEM, "cannot lock %zu bytes (test)", bytes);
        return NULL;
    }
    host_allocs++;
    return malloc(bytes); // exact size: the copies must stay inside
}

static void fake_host_free(st_backend *b, void *p) {
    (void)b;
    host_allocs--;
    free(p);
}

static void test_arena_resident(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    st_backend_ops ops = *f.b->ops;
    ops.host_alloc = fake_host_alloc;
    ops.host_free = fake_host_free;
    st_backend fake = *f.b;
    fake.ops = &ops;

    // Without counts a layer's misses are its uncached experts: 5 (3), 3 (6), 0 (5), 1 (4); layers
    // 2 (no experts) and 4 (all cached) are never copied. The budget fits layers 5 and 3 and
    // neither 0 nor 1 after them.
    size_t b5 = E * f.expert_bytes[5], b3 = E * f.expert_bytes[3], b0 = E * f.expert_bytes[0],
           b1 = E * f.expert_bytes[1];
    size_t budget = b5 + b3 + (b0 < b1 ? b0 : b1) - 1;
    refuse = false;
    host_allocs = 0;
    st_expert_arena *a;
    assert_int_equal(st_expert_arena_create(&fake, f.p, f.w, NULL, budget, &a), ST_OK);
    assert_int_equal(host_allocs, 2);
    assert_true(a->resident_bytes == b5 + b3);
    const int resident[2] = {3, 5};
    for (int i = 0; i < 2; i++) {
        int l = resident[i];
        assert_non_null(a->resident[l]);
        expect_stack_layout(&a->w[l], &f.w[l], E, a->resident[l]);
        for (int e = 0; e < E; e++) expect_expert(&a->w[l], e, &f.w[l], e);
    }
    for (int l = 0; l < L; l++)
        if (l != 3 && l != 5) expect_arena_mapping(a, f.w, l);
    st_expert_arena_free(&fake, a);
    assert_int_equal(host_allocs, 0);

    // A layer that does not fit is skipped, not the end: with room for 5 and 1, layers 3 and 0
    // (more misses, larger) are passed over and 1 (merged: copied compact) still gets its copy.
    assert_true(b3 > b1 && b0 > b1);
    assert_int_equal(st_expert_arena_create(&fake, f.p, f.w, NULL, b5 + b1, &a), ST_OK);
    assert_int_equal(host_allocs, 2);
    assert_true(a->resident_bytes == b5 + b1);
    assert_non_null(a->resident[1]);
    assert_non_null(a->resident[5]);
    expect_stack_layout(&a->w[1], &f.w[1], E, a->resident[1]);
    for (int e = 0; e < E; e++) expect_expert(&a->w[1], e, &f.w[1], e);
    for (int l = 0; l < L; l++)
        if (l != 1 && l != 5) expect_arena_mapping(a, f.w, l);
    st_expert_arena_free(&fake, a);
    assert_int_equal(host_allocs, 0);

    // With the counts, routing to uncached experts ranks the layers: the fixture routes to cached
    // experts only, so give one uncached expert of layer 0 some routing; room for one layer.
    uint64_t counts[L * E];
    memcpy(counts, f.counts, sizeof counts);
    counts[0 * E + 0] = 7; // expert 0 of layer 0 is not cached
    assert_int_equal(st_placement_get(f.p, 0, 0), ST_PLACE_HOST);
    assert_int_equal(st_expert_arena_create(&fake, f.p, f.w, counts, b0, &a), ST_OK);
    assert_int_equal(host_allocs, 1);
    assert_true(a->resident_bytes == b0);
    assert_non_null(a->resident[0]);
    for (int e = 0; e < E; e++) expect_expert(&a->w[0], e, &f.w[0], e);
    for (int l = 1; l < L; l++) expect_arena_mapping(a, f.w, l);
    st_expert_arena_free(&fake, a);
    assert_int_equal(host_allocs, 0);

    // Counts that see none of the uncached experts (the cache holds all the profile saw): every
    // layer with uncached experts still becomes resident when there is room.
    assert_int_equal(st_expert_arena_create(&fake, f.p, f.w, f.counts, (size_t)1 << 40, &a), ST_OK);
    for (int l = 0; l < L; l++)
        if (f.p->n_slots[l] < E && (f.w[l].gate.data || f.w[l].gate.n)) assert_non_null(a->resident[l]);
    assert_true(a->resident_bytes > 0);
    st_expert_arena_free(&fake, a);
    assert_int_equal(host_allocs, 0);

    // An OS that refuses to lock: the mapping stays in use, and creating the arena still succeeds.
    refuse = true;
    assert_int_equal(st_expert_arena_create(&fake, f.p, f.w, NULL, (size_t)1 << 40, &a), ST_OK);
    assert_true(a->resident_bytes == 0);
    for (int l = 0; l < L; l++) expect_arena_mapping(a, f.w, l);
    st_expert_arena_free(&fake, a);
    refuse = false;
    fixture_free(&f);
}

// The --pcie-frac probe's measurements: the CPU pool's expert speed on real (finite) weights,
// and the link speed through a backend's copies (0 without a device; no buffer left behind).
static void quantize_stack(const st_mat3 *m) {
    float *row = malloc(sizeof(float) * (size_t)m->cols);
    assert_non_null(row);
    for (int64_t r = 0; r < m->n * m->rows; r++) {
        for (int64_t c = 0; c < m->cols; c++) row[c] = 0.01f * (float)((r * 31 + c * 7) % 17 - 8);
        st_quantize(m->type, row, (char *)m->data + r * m->row_bytes, m->cols);
    }
    free(row);
}

static void test_probe(void **state) {
    (void)state;
    st_backend *b;
    assert_int_equal(st_backend_cpu_create(2, &b), ST_OK);
    host_layer h;
    layer_init(&h, ST_TYPE_Q8_0, 64, 96, false);
    quantize_stack(&h.w.gate);
    quantize_stack(&h.w.up);
    quantize_stack(&h.w.down);
    st_placement *p;
    assert_int_equal(st_placement_create_host(1, E, &p), ST_OK);
    size_t eb = st_expert_bytes(&h.w);
    assert_int_equal(st_placement_plan(p, NULL, &eb, 3 * eb), 3);
    assert_true(st_experts_cpu_gbs(b->pool, p, &h.w, 0, 4) > 0);
    assert_true(st_experts_cpu_gbs(b->pool, p, &h.w, 0, 2 * E) > 0); // k beyond the experts: all of them
    assert_true(st_experts_cpu_gbs(b->pool, p, &h.w, 0, 0) == 0);
    // The CPU backend has no device to copy to.
    assert_true(st_expert_link_gbs(b, true, (size_t)64 << 20) == 0);
    // A backend that can lock memory (the CPU's copies standing in for the link).
    st_backend_ops ops = *b->ops;
    ops.host_memory = false;
    ops.host_alloc = fake_host_alloc;
    ops.host_free = fake_host_free;
    st_backend fake = *b;
    fake.ops = &ops;
    refuse = false;
    host_allocs = 0;
    assert_true(st_expert_link_gbs(&fake, true, (size_t)64 << 20) > 0);
    assert_true(st_expert_link_gbs(&fake, false, (size_t)64 << 20) > 0);
    assert_int_equal(host_allocs, 0);
    refuse = true; // no page-locked memory: no figure
    assert_true(st_expert_link_gbs(&fake, true, (size_t)64 << 20) == 0);
    refuse = false;
    st_placement_free(p);
    layer_free(&h);
    st_backend_free(b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stack_upload),
        cmocka_unit_test(test_merged_gate_up),
        cmocka_unit_test(test_cache_create),
        cmocka_unit_test(test_cache_swap), cmocka_unit_test(test_cache_swap_async),
        cmocka_unit_test(test_cache_out_of_memory),
        cmocka_unit_test(test_arena_cpu_backend),
        cmocka_unit_test(test_arena_resident),
        cmocka_unit_test(test_probe),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
