// util: the thread pool. Persistent workers wait on a generation counter: they spin on it for a
// short while (so back-to-back calls during decode cost microseconds), then sleep on a futex.
// The caller runs thread 0 itself and waits for the others the same way (spin, then futex).
// st_pool_barrier separates phases inside one job the same way (a round counter, spin, futex).

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "util/util.h"

// How long a waiting thread spins before it sleeps. Decode calls the pool hundreds of times a
// token with short gaps between calls; 200 us covers those gaps without burning a core for long
// when the pool is idle (a futex wake costs tens of microseconds, which is what spinning saves).
#define POOL_SPIN_NS 200000

struct st_pool {
    int n;                   // threads including the caller
    pthread_t *threads;      // (n - 1) workers
    st_pool_fn fn;           // the current job, published by the release store to gen
    void *ctx;
    _Atomic uint32_t gen;    // bumped once per st_pool_run; workers wait for it to change
    _Atomic uint32_t pending;// workers still running the current job
    _Atomic int sleepers;    // workers asleep (or about to sleep) on gen
    _Atomic int caller_asleep; // the caller sleeps on pending
    _Atomic int stop;
    _Atomic int hold;        // st_pool_hold: waiting threads spin instead of sleeping
    // st_pool_barrier: arrivals in the current round, and the round's number (each on its own
    // cache line: every arrival writes bar_count, every waiter reads bar_gen).
    _Alignas(64) _Atomic uint32_t bar_count;
    _Alignas(64) _Atomic uint32_t bar_gen;
    _Atomic int bar_sleepers;   // waiters asleep (or about to sleep) on bar_gen
};

typedef struct worker_arg {
    st_pool *pool;
    int ith;
} worker_arg;

static void futex_wait(_Atomic uint32_t *addr, uint32_t expect) {
    // Returns at once if *addr != expect; spurious wake-ups are handled by the callers' loops.
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, expect, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *addr, int n) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

// Spins until *addr != value or the spin time is over (never, while the pool is held); returns
// the last value read.
static uint32_t spin_while_equal(st_pool *pool, _Atomic uint32_t *addr, uint32_t value) {
    uint32_t v = atomic_load_explicit(addr, memory_order_acquire);
    if (v != value) return v;
    int64_t until = now_ns() + POOL_SPIN_NS;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            cpu_relax();
            v = atomic_load_explicit(addr, memory_order_acquire);
            if (v != value) return v;
        }
        if (now_ns() > until && !atomic_load_explicit(&pool->hold, memory_order_relaxed)) return v;
        // Let another thread run: when the machine has more runnable threads than cores, the
        // one we wait for may be waiting for this core, and pure spinning would cost it a
        // whole time slice (measured: 10x slower decode on 2 loaded cores). Costs ~0.3 us.
        sched_yield();
    }
}

static void *worker_main(void *p) {
    worker_arg *wa = p;
    st_pool *pool = wa->pool;
    int ith = wa->ith;
    free(wa);
    uint32_t seen = 0;
    for (;;) {
        uint32_t g = spin_while_equal(pool, &pool->gen, seen);
        if (g == seen) {
            // Announce the sleep before re-checking gen: st_pool_run bumps gen and then reads
            // sleepers (both sequentially consistent), so either we see the new gen here or it
            // sees us and wakes the futex. st_pool_hold wakes sleepers the same way.
            atomic_fetch_add(&pool->sleepers, 1);
            while ((g = atomic_load(&pool->gen)) == seen && !atomic_load(&pool->hold)) futex_wait(&pool->gen, seen);
            atomic_fetch_sub(&pool->sleepers, 1);
            if (g == seen) continue; // held: back to spinning
        }
        seen = g;
        if (atomic_load_explicit(&pool->stop, memory_order_acquire)) break;
        pool->fn(pool->ctx, ith, pool->n);
        if (atomic_fetch_sub(&pool->pending, 1) == 1 && atomic_load(&pool->caller_asleep))
            futex_wake(&pool->pending, 1);
    }
    return NULL;
}

st_pool *st_pool_create(int n_threads) {
    if (n_threads < 1) {
        st_fail(ST_ERR_ARG, "thread pool: %d threads asked (need at least 1)", n_threads);
        return NULL;
    }
    st_pool *pool = st_calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->n = n_threads;
    if (n_threads > 1) {
        pool->threads = st_calloc((size_t)n_threads - 1, sizeof *pool->threads);
        if (!pool->threads) {
            st_free(pool);
            return NULL;
        }
    }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        int rc = ENOMEM;
        if (wa) {
            *wa = (worker_arg){pool, i};
            rc = pthread_create(&pool->threads[i - 1], NULL, worker_main, wa);
        }
        if (rc != 0) {
            free(wa);
            pool->n = i; // workers 1..i-1 exist; shut them down
            st_pool_free(pool);
            st_fail(ST_ERR_NOMEM, "thread pool: cannot start thread %d of %d: %s", i, n_threads,
                    strerror(rc));
            return NULL;
        }
    }
    return pool;
}

void st_pool_free(st_pool *pool) {
    if (!pool) return;
    atomic_store_explicit(&pool->stop, 1, memory_order_release);
    atomic_fetch_add(&pool->gen, 1);
    futex_wake(&pool->gen, INT_MAX);
    for (int i = 1; i < pool->n; i++) pthread_join(pool->threads[i - 1], NULL);
    st_free(pool->threads);
    st_free(pool);
}

int st_pool_size(const st_pool *pool) { return pool ? pool->n : 1; }

void st_pool_hold(st_pool *pool, bool on) {
    if (!pool || pool->n == 1) return;
    atomic_store(&pool->hold, on ? 1 : 0);
    if (on && atomic_load(&pool->sleepers) > 0) futex_wake(&pool->gen, INT_MAX);
}

void st_pool_run(st_pool *pool, st_pool_fn fn, void *ctx) {
    if (!pool || pool->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    atomic_store_explicit(&pool->pending, (uint32_t)(pool->n - 1), memory_order_relaxed);
    atomic_fetch_add(&pool->gen, 1); // seq_cst: publishes fn, ctx and pending
    if (atomic_load(&pool->sleepers) > 0) futex_wake(&pool->gen, INT_MAX);
    fn(ctx, 0, pool->n);
    uint32_t p = atomic_load_explicit(&pool->pending, memory_order_acquire);
    while (p != 0) {
        uint32_t q = spin_while_equal(pool, &pool->pending, p);
        if (q == p) { // no worker finished within the spin time: sleep until one does
            atomic_store(&pool->caller_asleep, 1);
            // Re-read after announcing: the last worker reads caller_asleep after its decrement.
            q = atomic_load(&pool->pending);
            if (q != 0) futex_wait(&pool->pending, q);
            atomic_store(&pool->caller_asleep, 0);
            q = atomic_load_explicit(&pool->pending, memory_order_acquire);
        }
        p = q;
    }
    atomic_thread_fence(memory_order_acquire); // the workers' writes are visible to the caller
}

void st_pool_barrier(st_pool *pool) {
    if (!pool || pool->n == 1) return;
    // The round cannot end before this thread arrives, so the number read first is the round's.
    uint32_t g = atomic_load_explicit(&pool->bar_gen, memory_order_acquire);
    // acq_rel: the arrivals form one release sequence the last arrival acquires, then publishes
    // to the waiters with its store to bar_gen, so every thread's writes before the barrier are
    // visible to every thread after it.
    if (atomic_fetch_add_explicit(&pool->bar_count, 1, memory_order_acq_rel) == (uint32_t)pool->n - 1) {
        atomic_store_explicit(&pool->bar_count, 0, memory_order_relaxed); // before the next round:
        atomic_store(&pool->bar_gen, g + 1); // a thread reads the new number before it arrives again
        if (atomic_load(&pool->bar_sleepers) > 0) futex_wake(&pool->bar_gen, INT_MAX);
        return;
    }
    if (spin_while_equal(pool, &pool->bar_gen, g) == g) { // a long wait: sleep (as the workers do on gen)
        atomic_fetch_add(&pool->bar_sleepers, 1);
        while (atomic_load(&pool->bar_gen) == g) futex_wait(&pool->bar_gen, g);
        atomic_fetch_sub(&pool->bar_sleepers, 1);
    }
    atomic_thread_fence(memory_order_acquire);
}
