// Unit tests for expert profiles (round trip, one file per validation rule), the cache plan
// (budgets, tie spreading, per-layer sizes, against a brute-force reference) and the adaptive
// swaps (convergence, hysteresis, max_swaps, slot reuse, argument checks); what a VRAM budget
// leaves, and the --pcie-frac split of a layer's misses and the probe's pick.
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "experts/experts.h"

// A failing call must return `code` with a message holding every one of the NULL-terminated parts.
static void expect_msg(st_status s, st_status code, ...) {
    const char *msg = st_error();
    if (getenv("ST_TEST_VERBOSE")) fprintf(stderr, "  %s\n", msg);
    va_list ap;
    va_start(ap, code);
    for (const char *part; (part = va_arg(ap, const char *));) {
        if (!strstr(msg, part)) {
            fprintf(stderr, "message: %s\nmissing: %s\n", msg, part);
            fail();
        }
    }
    va_end(ap);
    if (s != code) fprintf(stderr, "status %d, message: %s\n", s, msg);
    assert_int_equal(s, code);
}

// ---------------------------------------------------------------------------------------------
// Profiles

typedef struct tmpdir {
    char dir[64];
    char path[128];
} tmpdir;

static void tmp_open(tmpdir *t) {
    strcpy(t->dir, "/tmp/st_profile_XXXXXX");
    assert_non_null(mkdtemp(t->dir));
    snprintf(t->path, sizeof t->path, "%s/m.profile", t->dir);
}

static void tmp_close(tmpdir *t) {
    unlink(t->path);
    rmdir(t->dir);
}

// Writes a hand-made profile: header fields as given, then n_counts counts i * 3 + 1, then
// `extra` stray bytes.
static void write_raw(const char *path, const char *magic, uint32_t version, uint32_t nl, uint32_t ne,
                      size_t n_counts, size_t extra) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint32_t h[3] = {version, nl, ne}; // the test machines are little-endian, like the format
    assert_int_equal(fwrite(magic, 1, 4, f), 4);
    assert_int_equal(fwrite(h, 4, 3, f), 3);
    for (size_t i = 0; i < n_counts; i++) {
        uint64_t c = i * 3 + 1;
        assert_int_equal(fwrite(&c, 8, 1, f), 1);
    }
    for (size_t i = 0; i < extra; i++) fputc(0, f);
    assert_int_equal(fclose(f), 0);
}

static void test_profile_roundtrip(void **state) {
    (void)state;
    tmpdir t;
    tmp_open(&t);
    enum { L = 3, MTP = 1, E = 5, R = L + MTP };
    uint64_t c[R * E], back[R * E];
    for (int i = 0; i < R * E; i++) c[i] = ((uint64_t)i << 40) + (uint64_t)i * 977 + (i == 7 ? UINT64_MAX - 8 : 0);
    assert_int_equal(st_profile_save(t.path, R, E, c), ST_OK);
    struct stat sb;
    assert_int_equal(stat(t.path, &sb), 0);
    assert_int_equal(sb.st_size, 16 + 8 * R * E);
    char tmp[160];
    snprintf(tmp, sizeof tmp, "%s.tmp", t.path);
    assert_int_equal(access(tmp, F_OK), -1); // the temporary file was renamed
    // The bytes are the documented layout.
    FILE *f = fopen(t.path, "rb");
    unsigned char h[24];
    assert_int_equal(fread(h, 1, sizeof h, f), sizeof h);
    fclose(f);
    assert_memory_equal(h, "STXP\x01\0\0\0\x04\0\0\0\x05\0\0\0", 16);
    uint64_t first = 0;
    for (int i = 0; i < 8; i++) first |= (uint64_t)h[16 + i] << (8 * i);
    assert_true(first == c[0]);

    memset(back, 0xab, sizeof back);
    assert_int_equal(st_profile_load(t.path, L, MTP, E, back), ST_OK);
    assert_memory_equal(back, c, sizeof c);

    // Saving again replaces the file whole.
    for (int i = 0; i < R * E; i++) c[i] = (uint64_t)i;
    assert_int_equal(st_profile_save(t.path, R, E, c), ST_OK);
    assert_int_equal(st_profile_load(t.path, L, MTP, E, back), ST_OK);
    assert_memory_equal(back, c, sizeof c);
    tmp_close(&t);
}

static void test_profile_without_mtp_row(void **state) {
    (void)state;
    tmpdir t;
    tmp_open(&t);
    enum { L = 4, E = 3 };
    uint64_t c[L * E], back[(L + 1) * E];
    for (int i = 0; i < L * E; i++) c[i] = 100 + (uint64_t)i;
    assert_int_equal(st_profile_save(t.path, L, E, c), ST_OK);
    memset(back, 0xff, sizeof back);
    assert_int_equal(st_profile_load(t.path, L, 1, E, back), ST_OK);
    assert_memory_equal(back, c, sizeof c);
    for (int e = 0; e < E; e++) assert_true(back[L * E + e] == 0); // the MTP row is zero
    // The same file for a model without an MTP layer.
    assert_int_equal(st_profile_load(t.path, L, 0, E, back), ST_OK);
    assert_memory_equal(back, c, sizeof c);
    tmp_close(&t);
}

static void test_profile_corrupt(void **state) {
    (void)state;
    tmpdir t;
    tmp_open(&t);
    enum { L = 2, E = 4 };
    uint64_t c[(L + 1) * E];
    // Missing, and not a file.
    expect_msg(st_profile_load(t.path, L, 1, E, c), ST_ERR_IO, t.path, "cannot open", "No such file", NULL);
    expect_msg(st_profile_load(t.dir, L, 1, E, c), ST_ERR_IO, t.dir, "not a regular file", NULL);
    // Unreadable (permissions do not stop root, so only when they apply).
    write_raw(t.path, "STXP", 1, L, E, L * E, 0);
    chmod(t.path, 0);
    if (access(t.path, R_OK) != 0)
        expect_msg(st_profile_load(t.path, L, 1, E, c), ST_ERR_IO, t.path, "Permission denied", NULL);
    chmod(t.path, 0644);
    // Shorter than the header; empty.
    write_raw(t.path, "STXP", 1, L, E, 0, 0);
    assert_int_equal(truncate(t.path, 10), 0);
    expect_msg(st_profile_load(t.path, L, 1, E, c), ST_ERR_FORMAT, t.path, "10 bytes", "too short", NULL);
    assert_int_equal(truncate(t.path, 0), 0);
    expect_msg(st_profile_load(t.path, L, 1, E, c), ST_ERR_FORMAT, t.path, "0 bytes", "too short", NULL);
    // Wrong magic (a GGUF given by mistake).
    write_raw(t.path, "GGUF", 1, L, E, L * E, 0);
    expect_msg(st_profile_load(t.path, L, 1, E, c), ST_ERR_FORMAT, t.path, "not an expert profile",
               "47 47 55 46", "STXP", NULL);
    // Unknown version.
    write_raw(t.path, "STXP", 2, L, E, L * E, 0);
    expect_msg(st_profile_load(t.path, L, 1, E, c), ST_ERR_UNSUPPORTED, t.path, "version 2", "version 1", NULL);
    // Sizes that disagree with the header: a count short, a byte extra, a header too large.
    write_raw(t.path, "STXP", 1, L, E, L * E - 1, 0);
    expect_msg(st_profile_load(t.path, L, 1, E, c), ST_ERR_FORMAT, t.path, "72 bytes", "n_layer 2 x n_expert 4",
               "16 + 8 x 8", NULL);
    write_raw(t.path, "STXP", 1, L, E, L * E, 1);
    expect_msg(st_profile_load(t.path, L, 1, E, c), ST_ERR_FORMAT, t.path, "81 bytes", "needs exactly", NULL);
    write_raw(t.path, "STXP", 1, 0xffffffffu, 0xffffffffu, L * E, 0);
    expect_msg(st_profile_load(t.path, L, 1, E, c), ST_ERR_FORMAT, t.path, "n_layer 4294967295", NULL);
    // Made for another model: experts per layer, layers.
    write_raw(t.path, "STXP", 1, L, E + 2, L * (E + 2), 0);
    expect_msg(st_profile_load(t.path, L, 1, E, c), ST_ERR_FORMAT, t.path, "n_expert is 6", "4 experts", NULL);
    write_raw(t.path, "STXP", 1, L + 2, E, (L + 2) * E, 0);
    expect_msg(st_profile_load(t.path, L, 1, E, c), ST_ERR_FORMAT, t.path, "n_layer is 4", "2 layers",
               "3 with its MTP layer", NULL);
    write_raw(t.path, "STXP", 1, L - 1, E, (L - 1) * E, 0);
    expect_msg(st_profile_load(t.path, L, 1, E, c), ST_ERR_FORMAT, t.path, "n_layer is 1", NULL);
    // An MTP row for a model without an MTP layer.
    write_raw(t.path, "STXP", 1, L + 1, E, (L + 1) * E, 0);
    expect_msg(st_profile_load(t.path, L, 0, E, c), ST_ERR_FORMAT, t.path, "n_layer is 3", "2 layers", NULL);
    // ... which is right for a model with one.
    assert_int_equal(st_profile_load(t.path, L, 1, E, c), ST_OK);
    for (int i = 0; i < (L + 1) * E; i++) assert_true(c[i] == (uint64_t)i * 3 + 1);
    tmp_close(&t);
}

static void test_profile_save_errors(void **state) {
    (void)state;
    tmpdir t;
    tmp_open(&t);
    uint64_t c[4] = {1, 2, 3, 4};
    char bad[200];
    snprintf(bad, sizeof bad, "%s/no/such/dir/x.profile", t.dir);
    expect_msg(st_profile_save(bad, 2, 2, c), ST_ERR_IO, bad, "No such file or directory", NULL);
    // A directory where the profile should go: the rename fails and the temporary file goes.
    assert_int_equal(mkdir(t.path, 0755), 0);
    expect_msg(st_profile_save(t.path, 2, 2, c), ST_ERR_IO, t.path, "renaming", "Is a directory", NULL);
    char tmp[160];
    snprintf(tmp, sizeof tmp, "%s.tmp", t.path);
    assert_int_equal(access(tmp, F_OK), -1);
    rmdir(t.path);
    expect_msg(st_profile_save(t.path, 0, 2, c), ST_ERR_ARG, t.path, NULL);
    tmp_close(&t);
}

// ---------------------------------------------------------------------------------------------
// The plan

static st_placement *placement(int L, int E) {
    st_placement *p;
    assert_int_equal(st_placement_create_host(L, E, &p), ST_OK);
    return p;
}

// Every layer's cached experts hold slots 0 .. n_slots-1, each once.
static void check_slots(const st_placement *p) {
    for (int l = 0; l < p->n_layer; l++) {
        int seen[4096] = {0}, n = 0;
        assert_true(p->n_slots[l] >= 0 && p->n_slots[l] <= p->n_expert);
        for (int e = 0; e < p->n_expert; e++) {
            int32_t s = st_placement_get(p, l, e);
            if (s == ST_PLACE_HOST) continue;
            assert_true(s >= 0 && s < p->n_slots[l]);
            assert_int_equal(seen[s]++, 0);
            n++;
        }
        assert_int_equal(n, p->n_slots[l]);
    }
}

// Slots in expert order: a layer's cached experts, in id order, hold 0, 1, 2, ...
static void check_slot_order(const st_placement *p) {
    for (int l = 0; l < p->n_layer; l++)
        for (int e = 0, next = 0; e < p->n_expert; e++)
            if (st_placement_get(p, l, e) != ST_PLACE_HOST) assert_int_equal(st_placement_get(p, l, e), next++);
}

static void test_plan_budget_zero_and_all(void **state) {
    (void)state;
    enum { L = 3, E = 6 };
    st_placement *p = placement(L, E);
    size_t bytes[L] = {100, 100, 100};
    uint64_t c[L * E];
    for (int i = 0; i < L * E; i++) c[i] = (uint64_t)(i * 7 % 5);
    assert_int_equal(st_placement_plan(p, c, bytes, 0), 0);
    assert_int_equal(st_placement_plan(p, c, bytes, 99), 0);
    for (int i = 0; i < L * E; i++) assert_int_equal(p->slot[i], ST_PLACE_HOST);
    for (int l = 0; l < L; l++) assert_int_equal(p->n_slots[l], 0);
    // Everything fits (exactly, and with room to spare): slot = expert id.
    assert_int_equal(st_placement_plan(p, c, bytes, 100 * L * E), L * E);
    for (int l = 0; l < L; l++) {
        assert_int_equal(p->n_slots[l], E);
        for (int e = 0; e < E; e++) assert_int_equal(st_placement_get(p, l, e), e);
    }
    assert_int_equal(st_placement_plan(p, NULL, bytes, SIZE_MAX), L * E);
    check_slots(p);
    // A smaller plan afterwards replaces the map whole.
    assert_int_equal(st_placement_plan(p, c, bytes, 100), 1);
    check_slots(p);
    st_placement_free(p);
}

static void test_plan_ties_spread_over_layers(void **state) {
    (void)state;
    enum { L = 4, E = 8 };
    st_placement *p = placement(L, E);
    size_t bytes[L] = {1, 1, 1, 1};
    // No counts: expert 0 of every layer, then expert 1 of layers 0 and 1.
    assert_int_equal(st_placement_plan(p, NULL, bytes, 6), 6);
    for (int l = 0; l < L; l++) {
        assert_int_equal(p->n_slots[l], l < 2 ? 2 : 1);
        assert_int_equal(st_placement_get(p, l, 0), 0);
        assert_int_equal(st_placement_get(p, l, 1), l < 2 ? 1 : ST_PLACE_HOST);
        for (int e = 2; e < E; e++) assert_int_equal(st_placement_get(p, l, e), ST_PLACE_HOST);
    }
    // Equal counts behave the same as none.
    uint64_t c[L * E];
    for (int i = 0; i < L * E; i++) c[i] = 42;
    st_placement *q = placement(L, E);
    assert_int_equal(st_placement_plan(q, c, bytes, 6), 6);
    assert_memory_equal(p->slot, q->slot, sizeof(int32_t) * L * E);
    st_placement_free(p);
    st_placement_free(q);
}

static void test_plan_counts_order(void **state) {
    (void)state;
    enum { L = 2, E = 5 };
    st_placement *p = placement(L, E);
    size_t bytes[L] = {10, 10};
    uint64_t c[L * E] = {
        5, 90, 1, 70, 70, // layer 0
        80, 0, 3, 70, 2,  // layer 1
    };
    // 90 (0,1), 80 (1,0), then the 70s: (0,3) before (1,3) before (0,4) by expert id, then layer.
    assert_int_equal(st_placement_plan(p, c, bytes, 45), 4);
    int32_t want[L * E] = {
        -1, 0, -1, 1, -1, // experts 1, 3 in slots 0, 1 (expert order, not heat order)
        0, -1, -1, 1, -1,
    };
    assert_memory_equal(p->slot, want, sizeof want);
    assert_int_equal(p->n_slots[0], 2);
    assert_int_equal(p->n_slots[1], 2);
    assert_int_equal(st_placement_plan(p, c, bytes, 50), 5);
    assert_int_equal(st_placement_get(p, 0, 4), 2);
    check_slots(p);
    st_placement_free(p);
}

static void test_plan_layer_bytes(void **state) {
    (void)state;
    enum { L = 3, E = 4 };
    st_placement *p = placement(L, E);
    uint64_t c[L * E] = {
        100, 90, 5, 1, // layer 0: 10 bytes an expert
        1000, 999, 998, 997, // layer 1: no experts (a dense layer), however hot its counts say
        95, 80, 70, 2, // layer 2: 3 bytes an expert
    };
    size_t bytes[L] = {10, 0, 3};
    // 100 (10, 6 left), 95 (3, 3 left), 90 does not fit, 80 (3, 0 left).
    assert_int_equal(st_placement_plan(p, c, bytes, 16), 3);
    int32_t want[L * E] = {0, -1, -1, -1, -1, -1, -1, -1, 0, 1, -1, -1};
    assert_memory_equal(p->slot, want, sizeof want);
    assert_int_equal(p->n_slots[1], 0);
    // With any budget, layer 1 stays on the host.
    assert_int_equal(st_placement_plan(p, c, bytes, SIZE_MAX), 2 * E);
    for (int e = 0; e < E; e++) assert_int_equal(st_placement_get(p, 1, e), ST_PLACE_HOST);
    assert_int_equal(p->n_slots[0], E);
    assert_int_equal(p->n_slots[1], 0);
    assert_int_equal(p->n_slots[2], E);
    // No layer with experts at all.
    size_t none[L] = {0, 0, 0};
    assert_int_equal(st_placement_plan(p, c, none, SIZE_MAX), 0);
    for (int i = 0; i < L * E; i++) assert_int_equal(p->slot[i], ST_PLACE_HOST);
    st_placement_free(p);
}

static uint64_t rng_state = 88172645463325252ull;
static uint64_t rnd(void) { // xorshift64
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

// The rule the header states, brute force: repeatedly the hottest expert not yet looked at
// (ties: lower expert, then lower layer), taken when it fits.
static void plan_reference(int L, int E, const uint64_t *c, const size_t *bytes, size_t budget, bool *chosen) {
    bool *seen = calloc((size_t)L * E, 1);
    memset(chosen, 0, (size_t)L * E);
    for (;;) {
        int best = -1;
        for (int e = 0; e < E; e++)
            for (int l = 0; l < L; l++) {
                int i = l * E + e;
                if (seen[i] || !bytes[l]) continue;
                if (best < 0 || c[i] > c[best]) best = i; // visiting (e, l) in order keeps the first on ties
            }
        if (best < 0) break;
        seen[best] = true;
        if (bytes[best / E] <= budget) budget -= bytes[best / E], chosen[best] = true;
    }
    free(seen);
}

static void test_plan_matches_reference(void **state) {
    (void)state;
    enum { L = 7, E = 40 };
    uint64_t c[L * E];
    bool chosen[L * E];
    for (int round = 0; round < 30; round++) {
        size_t bytes[L];
        for (int l = 0; l < L; l++) bytes[l] = round % 3 == 0 ? 8 : (rnd() % 4 == 0 ? 0 : 4 + rnd() % 13);
        for (int i = 0; i < L * E; i++) c[i] = rnd() % (round % 2 ? 6 : 1000); // many ties on odd rounds
        size_t budget = rnd() % (L * E * 10);
        st_placement *p = placement(L, E);
        int64_t n = st_placement_plan(p, c, bytes, budget);
        plan_reference(L, E, c, bytes, budget, chosen);
        int64_t want = 0;
        size_t used = 0;
        for (int i = 0; i < L * E; i++) {
            assert_int_equal(st_placement_get(p, i / E, i % E) != ST_PLACE_HOST, chosen[i]);
            want += chosen[i];
            used += chosen[i] ? bytes[i / E] : 0;
        }
        assert_int_equal(n, want);
        assert_true(used <= budget);
        check_slots(p);
        check_slot_order(p);
        st_placement_free(p);
    }
}

// A real model's shape (49 expert layers x 512 experts): sub-quadratic, so this is instant.
static void test_plan_large(void **state) {
    (void)state;
    enum { L = 49, E = 512 };
    uint64_t *c = malloc(sizeof(uint64_t) * L * E);
    size_t bytes[L];
    for (int l = 0; l < L; l++) bytes[l] = 3 << 20;
    for (int i = 0; i < L * E; i++) c[i] = rnd() % 100000;
    st_placement *p = placement(L, E);
    assert_int_equal(st_placement_plan(p, c, bytes, (size_t)10000 * (3 << 20) + 5), 10000);
    check_slots(p);
    check_slot_order(p);
    // Every cached expert is at least as hot as every host one.
    uint64_t min_in = UINT64_MAX, max_out = 0;
    for (int i = 0; i < L * E; i++) {
        if (p->slot[i] != ST_PLACE_HOST) min_in = c[i] < min_in ? c[i] : min_in;
        else max_out = c[i] > max_out ? c[i] : max_out;
    }
    assert_true(min_in >= max_out);
    st_placement_free(p);
    free(c);
}

// ---------------------------------------------------------------------------------------------
// Adaptive swaps

// Adds window counts w (n values) to the cumulative counts c.
static void add(uint64_t *c, const uint64_t *w, int n) {
    for (int i = 0; i < n; i++) c[i] += w[i];
}

static bool cached(const st_placement *p, int l, int e) { return st_placement_get(p, l, e) != ST_PLACE_HOST; }

static void test_adapt_args(void **state) {
    (void)state;
    st_placement *p = placement(2, 4);
    st_adapt *a = (st_adapt *)1;
    expect_msg(st_adapt_create(p, 4, 8, 0.0, NULL, &a), ST_ERR_ARG, "decay 0", "(0, 1]", NULL);
    assert_null(a);
    expect_msg(st_adapt_create(p, 4, 8, 1.5, NULL, &a), ST_ERR_ARG, "decay 1.5", NULL);
    expect_msg(st_adapt_create(p, 4, 8, -0.5, NULL, &a), ST_ERR_ARG, "decay -0.5", NULL);
    expect_msg(st_adapt_create(p, 4, 8, NAN, NULL, &a), ST_ERR_ARG, "decay nan", NULL);
    expect_msg(st_adapt_create(p, -1, 8, 0.9, NULL, &a), ST_ERR_ARG, "every -1", NULL);
    expect_msg(st_adapt_create(p, 4, -2, 0.9, NULL, &a), ST_ERR_ARG, "-2 swaps", NULL);
    expect_msg(st_adapt_create(NULL, 4, 2, 0.9, NULL, &a), ST_ERR_ARG, "no placement", NULL);
    assert_int_equal(st_adapt_create(p, 0, 0, 1.0, NULL, &a), ST_OK);
    st_adapt_free(a);
    st_adapt_free(NULL);
    st_placement_free(p);
}

// A cache of 8 of 32 experts; experts 20..27 are routed most. With max_swaps 8 or fewer, the
// cache becomes exactly the hot set, and then stays as it is.
static void converge(int max_swaps, int every) {
    enum { E = 32, L = 2 };
    st_placement *p = placement(L, E);
    size_t bytes[L] = {1, 1};
    assert_int_equal(st_placement_plan(p, NULL, bytes, 16), 16); // experts 0..7 of both layers
    st_adapt *a;
    assert_int_equal(st_adapt_create(p, every, max_swaps, 0.9, NULL, &a), ST_OK);
    uint64_t c[L * E] = {0}, w[L * E];
    st_swap sw[8];
    int converged_at = -1, total = 0;
    for (int win = 0; win < 200; win++) {
        for (int i = 0; i < L * E; i++) {
            int e = i % E;
            w[i] = e >= 20 && e < 28 ? 8 + rnd() % 5 : rnd() % 3; // hot, or a little noise
        }
        add(c, w, L * E);
        int n = st_adapt_window(a, p, c, sw, true);
        assert_true(n >= 0 && n <= max_swaps);
        if (win % every != every - 1) assert_int_equal(n, 0); // decisions only every `every` windows
        for (int i = 0; i < n; i++) {
            assert_int_equal(st_placement_get(p, sw[i].layer, sw[i].in), sw[i].slot);
            assert_int_equal(st_placement_get(p, sw[i].layer, sw[i].out), ST_PLACE_HOST);
            assert_true(sw[i].in >= 20 && sw[i].in < 28); // only hot experts come in
        }
        total += n;
        check_slots(p);
        bool hot_set = true;
        for (int l = 0; l < L; l++)
            for (int e = 0; e < E; e++) hot_set = hot_set && cached(p, l, e) == (e >= 20 && e < 28);
        if (converged_at < 0 && hot_set) converged_at = win;
        if (converged_at >= 0) {
            assert_true(hot_set);     // stays converged
            if (win > converged_at) assert_int_equal(n, 0); // and swaps nothing more
        }
    }
    assert_true(converged_at >= 0 && converged_at < 50);
    assert_int_equal(total, 16); // 8 per layer, none wasted
    for (int l = 0; l < L; l++) assert_int_equal(p->n_slots[l], 8);
    st_adapt_free(a);
    st_placement_free(p);
}

static void test_adapt_converges(void **state) {
    (void)state;
    converge(8, 4);
    converge(3, 2); // several decisions, several swaps in one layer within one decision
    converge(1, 1);
}

static void test_adapt_every_zero_never_swaps(void **state) {
    (void)state;
    enum { E = 16 };
    st_placement *p = placement(1, E);
    size_t bytes[1] = {1};
    st_placement_plan(p, NULL, bytes, 4);
    int32_t before[E];
    memcpy(before, p->slot, sizeof before);
    st_adapt *a;
    assert_int_equal(st_adapt_create(p, 0, 8, 0.5, NULL, &a), ST_OK);
    uint64_t c[E] = {0};
    st_swap sw[8];
    for (int win = 0; win < 100; win++) {
        c[15] += 1000;
        assert_int_equal(st_adapt_window(a, p, c, sw, true), 0);
    }
    assert_memory_equal(p->slot, before, sizeof before);
    st_adapt_free(a);
    // max_swaps 0 likewise.
    assert_int_equal(st_adapt_create(p, 1, 0, 0.5, NULL, &a), ST_OK);
    for (int win = 0; win < 10; win++) {
        c[15] += 1000;
        assert_int_equal(st_adapt_window(a, p, c, NULL, true), 0);
    }
    assert_memory_equal(p->slot, before, sizeof before);
    st_adapt_free(a);
    st_placement_free(p);
}

// Two experts of nearly equal heat take turns being the hotter one: the slot must not follow
// them back and forth. A clear winner does take it.
static void test_adapt_hysteresis(void **state) {
    (void)state;
    st_placement *p = placement(1, 2);
    size_t bytes[1] = {1};
    st_placement_plan(p, NULL, bytes, 1); // expert 0 cached
    st_adapt *a;
    assert_int_equal(st_adapt_create(p, 1, 4, 0.5, NULL, &a), ST_OK);
    uint64_t c[2] = {0};
    st_swap sw[4];
    for (int win = 0; win < 200; win++) {
        bool one_hotter = (win / 10) % 2 == 0; // 10 windows each way
        c[0] += one_hotter ? 10 : 12;
        c[1] += one_hotter ? 12 : 10;
        assert_int_equal(st_adapt_window(a, p, c, sw, true), 0);
        assert_true(cached(p, 0, 0));
    }
    for (int win = 0; win < 5; win++) {
        c[0] += 10;
        c[1] += 30;
        st_adapt_window(a, p, c, sw, true);
    }
    assert_true(cached(p, 0, 1) && !cached(p, 0, 0));
    assert_int_equal(st_placement_get(p, 0, 1), 0);
    st_adapt_free(a);
    // Near zero the "+ 1" holds: a single routing to an uncached expert moves nothing.
    st_placement_plan(p, NULL, bytes, 1);
    assert_int_equal(st_adapt_create(p, 1, 4, 1.0, NULL, &a), ST_OK);
    c[0] = c[1] = 0;
    c[1] = 1;
    assert_int_equal(st_adapt_window(a, p, c, sw, true), 0);
    st_adapt_free(a);
    // While an earlier decision's copies are on their way (may_swap false) the scores still move
    // but nothing is decided; the next decision window swaps.
    st_placement_plan(p, NULL, bytes, 1);
    assert_int_equal(st_adapt_create(p, 2, 4, 1.0, NULL, &a), ST_OK);
    c[0] = 0, c[1] = 100;
    assert_int_equal(st_adapt_window(a, p, c, sw, false), 0);
    assert_int_equal(st_adapt_window(a, p, c, sw, false), 0); // a decision window, held
    assert_true(cached(p, 0, 0));
    assert_int_equal(st_adapt_window(a, p, c, sw, true), 0);  // not a decision window
    assert_int_equal(st_adapt_window(a, p, c, sw, true), 1);
    assert_true(cached(p, 0, 1) && !cached(p, 0, 0));
    st_adapt_free(a);
    st_placement_free(p);
}

// max_swaps bounds each decision over all layers; the largest gains go first.
static void test_adapt_max_swaps(void **state) {
    (void)state;
    enum { L = 4, E = 8 };
    st_placement *p = placement(L, E);
    size_t bytes[L] = {1, 1, 1, 1};
    st_placement_plan(p, NULL, bytes, 8); // experts 0, 1 of every layer
    st_adapt *a;
    assert_int_equal(st_adapt_create(p, 1, 3, 1.0, NULL, &a), ST_OK);
    uint64_t c[L * E] = {0};
    for (int l = 0; l < L; l++) {
        c[l * E + 6] = 100 * (l + 1);
        c[l * E + 7] = 100 * (l + 1) + 10;
    }
    st_swap sw[3];
    assert_int_equal(st_adapt_window(a, p, c, sw, true), 3);
    // Layer 3: 7 (410) and 6 (400) replace 0 and 1; then layer 2's 7 (310) replaces 0.
    assert_int_equal(sw[0].layer, 3);
    assert_int_equal(sw[0].in, 7);
    assert_int_equal(sw[0].out, 0);
    assert_int_equal(sw[0].slot, 0);
    assert_int_equal(sw[1].layer, 3);
    assert_int_equal(sw[1].in, 6);
    assert_int_equal(sw[1].out, 1);
    assert_int_equal(sw[1].slot, 1);
    assert_int_equal(sw[2].layer, 2);
    assert_int_equal(sw[2].in, 7);
    assert_int_equal(sw[2].out, 0);
    check_slots(p);
    // The next windows (no new routing) finish the job, 3 at a time at most.
    int n2 = st_adapt_window(a, p, c, sw, true);
    int n3 = st_adapt_window(a, p, c, sw, true);
    assert_int_equal(n2, 3);
    assert_int_equal(n3, 2);
    assert_int_equal(st_adapt_window(a, p, c, sw, true), 0);
    for (int l = 0; l < L; l++)
        for (int e = 0; e < E; e++) assert_int_equal(cached(p, l, e), e >= 6);
    st_adapt_free(a);
    st_placement_free(p);
}

// The prior seeds the scores; counts that go down (a new session's counter) count from zero.
static void test_adapt_prior_and_restart(void **state) {
    (void)state;
    enum { E = 6 };
    st_placement *p = placement(1, E);
    size_t bytes[1] = {1};
    st_placement_plan(p, NULL, bytes, 2); // 0, 1
    uint64_t prior[E] = {0, 50, 0, 0, 0, 400};
    st_adapt *a;
    assert_int_equal(st_adapt_create(p, 1, 4, 1.0, prior, &a), ST_OK);
    uint64_t c[E] = {0};
    st_swap sw[4];
    assert_int_equal(st_adapt_window(a, p, c, sw, true), 1);
    assert_int_equal(sw[0].in, 5);
    assert_int_equal(sw[0].out, 0);
    // Cumulative counts 1000 for expert 3, then a restarted counter at 900: 1900 in all.
    c[3] = 1000;
    st_adapt_window(a, p, c, sw, true);
    c[3] = 900;
    assert_int_equal(st_adapt_window(a, p, c, sw, true), 0);
    assert_true(cached(p, 0, 3) && cached(p, 0, 5));
    st_adapt_free(a);
    st_placement_free(p);
}

// Random traces over layers of different cache sizes: after every decision each layer's slots
// are used exactly once, and each reported swap matches the map.
static void test_adapt_slot_reuse(void **state) {
    (void)state;
    enum { L = 6, E = 24 };
    st_placement *p = placement(L, E);
    size_t bytes[L] = {5, 1, 3, 0, 2, 7};
    uint64_t prof[L * E];
    for (int i = 0; i < L * E; i++) prof[i] = rnd() % 50;
    st_placement_plan(p, prof, bytes, 200);
    check_slots(p);
    int32_t n_slots[L];
    memcpy(n_slots, p->n_slots, sizeof n_slots);
    st_adapt *a;
    assert_int_equal(st_adapt_create(p, 1, 5, 0.7, prof, &a), ST_OK);
    uint64_t c[L * E] = {0};
    st_swap sw[5];
    int total = 0;
    for (int win = 0; win < 300; win++) {
        int phase = win / 30; // the hot experts move every 30 windows
        for (int i = 0; i < L * E; i++) c[i] += (i * 7 + phase * 5) % E < 6 ? 20 + rnd() % 10 : rnd() % 4;
        int32_t before[L * E];
        memcpy(before, p->slot, sizeof before);
        int n = st_adapt_window(a, p, c, sw, true);
        assert_true(n >= 0 && n <= 5);
        total += n;
        for (int i = 0; i < n; i++) {
            assert_int_equal(before[sw[i].layer * E + sw[i].out], sw[i].slot);
            assert_int_equal(before[sw[i].layer * E + sw[i].in], ST_PLACE_HOST);
            assert_int_equal(st_placement_get(p, sw[i].layer, sw[i].in), sw[i].slot);
            assert_int_equal(st_placement_get(p, sw[i].layer, sw[i].out), ST_PLACE_HOST);
        }
        check_slots(p);
        assert_memory_equal(p->n_slots, n_slots, sizeof n_slots);
    }
    assert_true(total > 20);
    for (int e = 0; e < E; e++) assert_false(cached(p, 3, e)); // the layer without experts
    st_adapt_free(a);
    st_placement_free(p);
}

// ---------------------------------------------------------------------------------------------
// --vram-budget-gib as the card's size, and the --pcie-frac split and pick

static void test_vram_allowance(void **state) {
    (void)state;
    const size_t G = (size_t)1 << 30, M = (size_t)1 << 20;
    size_t total = 141 * G;
    // The H200 case: 0.7 GiB taken by the context and the reserve when placement starts; a budget
    // of 16 leaves 15.3 for Strata, so the card shows 16 in use at most.
    size_t avail = total - 700 * M;
    assert_true(st_vram_allowance(16 * G, total, avail) == 16 * G - 700 * M);
    assert_true(st_vram_allowance(12 * G, total, avail) == 12 * G - 700 * M);
    // No budget: what is free. A budget as large as the card: the same.
    assert_true(st_vram_allowance(0, total, avail) == avail);
    assert_true(st_vram_allowance(total, total, avail) == avail);
    assert_true(st_vram_allowance(200 * G, total, avail) == avail);
    // Another program holding 10 GiB of the card counts against a budget too.
    assert_true(st_vram_allowance(16 * G, total, avail - 10 * G) == 6 * G - 700 * M);
    // Taken already beyond the budget: nothing.
    assert_true(st_vram_allowance(500 * M, total, avail) == 0);
    assert_true(st_vram_allowance(700 * M, total, avail) == 0);
    // The device's size unknown: the budget as a cap on what is free.
    assert_true(st_vram_allowance(16 * G, 0, avail) == 16 * G);
    assert_true(st_vram_allowance(16 * G, 0, 8 * G) == 8 * G);
    // mem_free larger than the total (an odd driver): nothing counted as taken.
    assert_true(st_vram_allowance(16 * G, 8 * G, 12 * G) == 12 * G);
}

static void test_pcie_split(void **state) {
    (void)state;
    enum { E = 10 };
    uint8_t gpu[E];
    // Missed: expert 1 (3 rows), 4 (1), 5 (3), 7 (2), 9 (1); the others cached or not routed.
    int32_t rows[E] = {0, 3, 0, 0, 1, 3, 0, 2, 0, 1};
    memset(gpu, 7, sizeof gpu);
    assert_int_equal(st_pcie_split(rows, E, 0, gpu), 0);
    for (int e = 0; e < E; e++) assert_int_equal(gpu[e], 0);
    assert_int_equal(st_pcie_split(rows, E, 1, gpu), 5);
    for (int e = 0; e < E; e++) assert_int_equal(gpu[e], rows[e] > 0);
    // 0.5 of 5 rounds to 3: the most rows first, ties to the lower id (1 and 5, then 7).
    assert_int_equal(st_pcie_split(rows, E, 0.5, gpu), 3);
    uint8_t want[E] = {0, 1, 0, 0, 0, 1, 0, 1, 0, 0};
    assert_memory_equal(gpu, want, E);
    // 0.3 of 5 = 1.5 rounds to 2: experts 1 and 5; 0.25 of 5 = 1.25 rounds to 1: expert 1.
    assert_int_equal(st_pcie_split(rows, E, 0.3, gpu), 2);
    assert_true(gpu[1] && gpu[5] && !gpu[7]);
    assert_int_equal(st_pcie_split(rows, E, 0.25, gpu), 1);
    assert_true(gpu[1] && !gpu[5]);
    // 0.09 of 5 rounds to 0; beyond 1, negative and NaN are clamped.
    assert_int_equal(st_pcie_split(rows, E, 0.09, gpu), 0);
    assert_int_equal(st_pcie_split(rows, E, 3, gpu), 5);
    assert_int_equal(st_pcie_split(rows, E, -1, gpu), 0);
    assert_int_equal(st_pcie_split(rows, E, NAN, gpu), 0);
    // Decode: one row, each missed expert once: ties all the way, the lowest ids go.
    int32_t one[E] = {0, 0, 1, 0, 1, 0, 1, 1, 0, 0};
    assert_int_equal(st_pcie_split(one, E, 0.5, gpu), 2);
    uint8_t want1[E] = {0, 0, 1, 0, 1, 0, 0, 0, 0, 0};
    assert_memory_equal(gpu, want1, E);
    // Nothing missed.
    int32_t none[E] = {0};
    assert_int_equal(st_pcie_split(none, E, 1, gpu), 0);
}

static void test_pcie_pick(void **state) {
    (void)state;
    // A fast link next to a slow CPU: 50 GB/s against 10; 10 MiB of misses a layer. The split
    // 0.85 (50/60 rounded to 0.05) takes ~0.18 ms + the fixed cost against 1.05 ms.
    st_pcie_probe p = {.link_gbs = 50, .cpu_gbs = 10, .miss_bytes = 10 << 20, .sync_s = ST_PCIE_SYNC_S};
    assert_true(fabs(st_pcie_pick(&p) - 0.85) < 1e-9);
    assert_true(fabs(p.cpu_s - (10 << 20) / 10e9) < 1e-12);
    assert_true(p.split_s < ST_PCIE_MARGIN * p.cpu_s && p.split_s > ST_PCIE_SYNC_S);
    // A link as fast as the pool: half each, a clear win when a layer misses 20 MiB.
    p = (st_pcie_probe){.link_gbs = 50, .cpu_gbs = 50, .miss_bytes = 20 << 20, .sync_s = ST_PCIE_SYNC_S};
    assert_true(fabs(st_pcie_pick(&p) - 0.5) < 1e-9);
    // Small misses: the fixed cost eats the gain.
    p.miss_bytes = 1 << 20;
    assert_true(st_pcie_pick(&p) == 0);
    assert_true(p.split_s >= ST_PCIE_MARGIN * p.cpu_s);
    // A slow link (from the mapping) next to a fast CPU: under 0.025 rounds to 0.
    p = (st_pcie_probe){.link_gbs = 1, .cpu_gbs = 60, .miss_bytes = 10 << 20, .sync_s = ST_PCIE_SYNC_S};
    assert_true(st_pcie_pick(&p) == 0);
    // A failed probe picks 0.
    p = (st_pcie_probe){.link_gbs = 0, .cpu_gbs = 10, .miss_bytes = 10 << 20};
    assert_true(st_pcie_pick(&p) == 0);
    p = (st_pcie_probe){.link_gbs = 50, .cpu_gbs = 0, .miss_bytes = 10 << 20};
    assert_true(st_pcie_pick(&p) == 0);
    p = (st_pcie_probe){.link_gbs = 50, .cpu_gbs = 10, .miss_bytes = 0};
    assert_true(st_pcie_pick(&p) == 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_profile_roundtrip),
        cmocka_unit_test(test_profile_without_mtp_row),
        cmocka_unit_test(test_profile_corrupt),
        cmocka_unit_test(test_profile_save_errors),
        cmocka_unit_test(test_plan_budget_zero_and_all),
        cmocka_unit_test(test_plan_ties_spread_over_layers),
        cmocka_unit_test(test_plan_counts_order),
        cmocka_unit_test(test_plan_layer_bytes),
        cmocka_unit_test(test_plan_matches_reference),
        cmocka_unit_test(test_plan_large),
        cmocka_unit_test(test_adapt_args),
        cmocka_unit_test(test_adapt_converges),
        cmocka_unit_test(test_adapt_every_zero_never_swaps),
        cmocka_unit_test(test_adapt_hysteresis),
        cmocka_unit_test(test_adapt_max_swaps),
        cmocka_unit_test(test_adapt_prior_and_restart),
        cmocka_unit_test(test_adapt_slot_reuse),
        cmocka_unit_test(test_vram_allowance),
        cmocka_unit_test(test_pcie_split),
        cmocka_unit_test(test_pcie_pick),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
