// Unit tests for the thread pool: every thread runs each call exactly once, results are visible
// to the caller, back-to-back and sleeping workers both work, a held pool works through gaps,
// the per-call overhead (printed) stays in microseconds, and st_pool_barrier separates phases
// of one job (many rounds, fast and slow arrivals).
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "util/util.h"

typedef struct count_ctx {
    _Atomic int calls;
    int seen[64];       // per thread index: how many times it ran (plain writes, read after run)
    int nth_seen;
} count_ctx;

static void count_fn(void *p, int ith, int nth) {
    count_ctx *c = p;
    atomic_fetch_add(&c->calls, 1);
    c->seen[ith]++;
    if (ith == 0) c->nth_seen = nth;
}

static void test_each_thread_once(void **state) {
    (void)state;
    for (int n = 1; n <= 5; n++) {
        st_pool *pool = st_pool_create(n);
        assert_non_null(pool);
        assert_int_equal(st_pool_size(pool), n);
        count_ctx c;
        memset(&c, 0, sizeof c);
        for (int it = 0; it < 1000; it++) st_pool_run(pool, count_fn, &c);
        assert_int_equal(atomic_load(&c.calls), 1000 * n);
        for (int i = 0; i < n; i++) assert_int_equal(c.seen[i], 1000);
        assert_int_equal(c.nth_seen, n);
        st_pool_free(pool);
    }
}

static void test_null_pool(void **state) {
    (void)state;
    count_ctx c;
    memset(&c, 0, sizeof c);
    st_pool_run(NULL, count_fn, &c);
    assert_int_equal(c.calls, 1);
    assert_int_equal(c.nth_seen, 1);
    assert_int_equal(st_pool_size(NULL), 1);
    assert_null(st_pool_create(0));
    assert_true(st_cpu_count() >= 1);
}

// A fake sysfs topology: cpu c's thread_siblings_list is lists[c] (NULL: no file).
static void topology(const char *root, const char *const *lists, int n) {
    char path[512];
    for (int c = 0; c < n; c++) {
        snprintf(path, sizeof path, "%s/cpu%d/topology", root, c);
        char cmd[600];
        snprintf(cmd, sizeof cmd, "mkdir -p %s", path);
        assert_int_equal(system(cmd), 0);
        if (!lists[c]) continue;
        snprintf(path, sizeof path, "%s/cpu%d/topology/thread_siblings_list", root, c);
        FILE *f = fopen(path, "w");
        assert_non_null(f);
        fprintf(f, "%s\n", lists[c]);
        fclose(f);
    }
}

// Physical cores: SMT siblings count once (both list forms), a subset of the CPUs counts only
// its own cores, an unreadable topology gives the logical count, and a topology claiming more
// than two threads a core is not trusted.
static void test_cpu_cores(void **state) {
    (void)state;
    char root[] = "/tmp/strata-topo-XXXXXX";
    assert_non_null(mkdtemp(root));
    static const char *const smt[8] = {"0,4", "1,5", "2,6", "3,7", "0,4", "1,5", "2,6", "3,7"};
    static const char *const pairs[4] = {"0-1", "0-1", "2-3", "2-3"};
    static const char *const none[2] = {"0", NULL};
    static const char *const one[8] = {"0-7", "0-7", "0-7", "0-7", "0-7", "0-7", "0-7", "0-7"};
    int all[8] = {0, 1, 2, 3, 4, 5, 6, 7}, some[3] = {0, 4, 5};
    char dir[600];
    snprintf(dir, sizeof dir, "%s/smt", root);
    topology(dir, smt, 8);
    assert_int_equal(st_cpu_cores_at(dir, all, 8), 4);
    assert_int_equal(st_cpu_cores_at(dir, some, 3), 2);
    snprintf(dir, sizeof dir, "%s/pairs", root);
    topology(dir, pairs, 4);
    assert_int_equal(st_cpu_cores_at(dir, all, 4), 2);
    snprintf(dir, sizeof dir, "%s/none", root);
    topology(dir, none, 2);
    assert_int_equal(st_cpu_cores_at(dir, all, 2), 2);
    snprintf(dir, sizeof dir, "%s/one", root);
    topology(dir, one, 8);
    assert_int_equal(st_cpu_cores_at(dir, all, 8), 4);
    assert_int_equal(st_cpu_cores_at("/no/such/dir", all, 3), 3);
    int c = st_cpu_cores();
    assert_true(c >= 1 && c <= st_cpu_count());
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    assert_int_equal(system(cmd), 0);
}

// Workers write disjoint parts of an array; the caller reads all of it right after the call.
typedef struct sum_ctx {
    int64_t n;
    int32_t *v;
    int64_t part[64];
} sum_ctx;

static void fill_fn(void *p, int ith, int nth) {
    sum_ctx *c = p;
    int64_t a = c->n * ith / nth, b = c->n * (ith + 1) / nth, s = 0;
    for (int64_t i = a; i < b; i++) {
        c->v[i] = (int32_t)(i * 3 + 1);
        s += c->v[i];
    }
    c->part[ith] = s;
}

static void test_results_visible(void **state) {
    (void)state;
    st_pool *pool = st_pool_create(4);
    sum_ctx c = {.n = 100003};
    c.v = st_alloc(sizeof(int32_t) * (size_t)c.n);
    for (int it = 0; it < 50; it++) {
        memset(c.v, 0, sizeof(int32_t) * (size_t)c.n);
        st_pool_run(pool, fill_fn, &c);
        int64_t total = 0, want = 0;
        for (int i = 0; i < 4; i++) total += c.part[i];
        for (int64_t i = 0; i < c.n; i++) {
            assert_int_equal(c.v[i], i * 3 + 1);
            want += i * 3 + 1;
        }
        assert_true(total == want);
    }
    st_free(c.v);
    st_pool_free(pool);
}

// Calls after the workers went to sleep (longer than their spin time) still run everywhere.
static void test_after_sleep(void **state) {
    (void)state;
    st_pool *pool = st_pool_create(3);
    count_ctx c;
    memset(&c, 0, sizeof c);
    for (int it = 0; it < 5; it++) {
        usleep(3000);
        st_pool_run(pool, count_fn, &c);
    }
    assert_int_equal(atomic_load(&c.calls), 15);
    st_pool_free(pool);
}

// Held (st_pool_hold), workers that had gone to sleep are woken to spin, and calls with gaps
// longer than the spin time (a hybrid window's pattern) run everywhere; released, the pool works
// as before; a pool freed while held shuts down. The call latency after a gap is printed.
static void test_hold(void **state) {
    (void)state;
    st_pool_hold(NULL, true); // no pool, one thread: nothing to hold
    st_pool *one = st_pool_create(1);
    st_pool_hold(one, true);
    st_pool_free(one);
    st_pool *pool = st_pool_create(3);
    count_ctx c;
    memset(&c, 0, sizeof c);
    st_pool_run(pool, count_fn, &c);
    usleep(3000); // the workers sleep
    st_pool_hold(pool, true);
    double worst = 0;
    for (int it = 0; it < 20; it++) {
        usleep(1000);
        double t0 = st_time_s();
        st_pool_run(pool, count_fn, &c);
        double us = (st_time_s() - t0) * 1e6;
        if (us > worst) worst = us;
    }
    print_message("[    INFO  ] held pool of 3: slowest call after a 1 ms gap %.1f us\n", worst);
    st_pool_hold(pool, false);
    usleep(3000);
    st_pool_run(pool, count_fn, &c);
    assert_int_equal(atomic_load(&c.calls), 3 * 22);
    for (int i = 0; i < 3; i++) assert_int_equal(c.seen[i], 22);
    st_pool_hold(pool, true);
    st_pool_free(pool); // held: the spinning workers still see the stop
}

static void noop_fn(void *p, int ith, int nth) {
    (void)p;
    (void)ith;
    (void)nth;
}

// Per-call overhead of an empty job, back to back (the decode pattern). Printed; the bound is
// loose because CI machines are shared, but a sleep/wake per call (~50+ us) would show.
static void test_overhead(void **state) {
    (void)state;
    int n = st_cpu_count() < 4 ? st_cpu_count() : 4;
    st_pool *pool = st_pool_create(n);
    for (int i = 0; i < 1000; i++) st_pool_run(pool, noop_fn, NULL);
    int iters = 20000;
    double best = 1e9;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = st_time_s();
        for (int i = 0; i < iters; i++) st_pool_run(pool, noop_fn, NULL);
        double us = (st_time_s() - t0) / iters * 1e6;
        if (us < best) best = us;
    }
    print_message("[    INFO  ] pool of %d threads: %.2f us per empty call (best of 3 x %d)\n", n,
                  best, iters);
    assert_true(best < 200.0);
    st_pool_free(pool);
}

// Rounds of barrier-separated phases inside one job: in round r each thread writes its slot of
// buffer r % 2, waits, then checks every thread's slot of that buffer (it holds round r's value:
// nobody raced ahead into the next write of this buffer, and every write before the barrier is
// visible after it). The second barrier of a round keeps round r+2's writes away from readers
// still in round r. A slow thread (sleep > the spin time) makes the others sleep in the barrier.
enum { BAR_ROUNDS = 2000, BAR_MAX_THREADS = 8 };

typedef struct barrier_ctx {
    st_pool *pool;
    int rounds;
    int slow_every;                 // 0: never; else thread (r % nth) sleeps in rounds r % slow_every == 0
    int64_t slot[2][BAR_MAX_THREADS][8]; // a cache line per thread
    int errors[BAR_MAX_THREADS];
    int64_t sum[BAR_MAX_THREADS];
    int passes;
} barrier_ctx;

static int64_t bar_value(int r, int t) { return (int64_t)r * 1000003 + t * 7 + 1; }

static void barrier_fn(void *p, int ith, int nth) {
    barrier_ctx *c = p;
    for (int r = 0; r < c->rounds; r++) {
        if (c->slow_every && r % c->slow_every == 0 && r % nth == ith) usleep(1000);
        c->slot[r % 2][ith][0] = bar_value(r, ith);
        st_pool_barrier(c->pool);
        for (int t = 0; t < nth; t++) {
            int64_t v = c->slot[r % 2][t][0];
            if (v != bar_value(r, t)) c->errors[ith]++;
            c->sum[ith] += v;
        }
        st_pool_barrier(c->pool);
    }
    if (ith == 0) c->passes++;
}

static void test_barrier(void **state) {
    (void)state;
    for (int n = 1; n <= BAR_MAX_THREADS; n++) {
        st_pool *pool = st_pool_create(n);
        assert_non_null(pool);
        barrier_ctx *c = st_calloc(1, sizeof *c);
        assert_non_null(c);
        c->pool = pool;
        int64_t want = 0;
        for (int call = 0; call < 4; call++) { // back to back, then after the workers slept
            if (call == 3) usleep(3000);
            c->rounds = call == 2 ? 40 : BAR_ROUNDS;
            c->slow_every = call == 2 ? 4 : 0;
            st_pool_run(pool, barrier_fn, c);
            for (int r = 0; r < c->rounds; r++)
                for (int t = 0; t < n; t++) want += bar_value(r, t);
        }
        assert_int_equal(c->passes, 4);
        for (int t = 0; t < n; t++) {
            assert_int_equal(c->errors[t], 0);
            assert_true(c->sum[t] == want);
        }
        st_free(c);
        st_pool_free(pool);
    }
    st_pool_barrier(NULL); // no pool: nothing to wait for
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_each_thread_once),
        cmocka_unit_test(test_null_pool),
        cmocka_unit_test(test_cpu_cores),
        cmocka_unit_test(test_results_visible),
        cmocka_unit_test(test_after_sleep),
        cmocka_unit_test(test_hold),
        cmocka_unit_test(test_overhead),
        cmocka_unit_test(test_barrier),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
