// quant: CPU path selection (cpuid, STRATA_CPU override), the per-path kernel tables laid
// scalar -> AVX2 -> AVX-512, and the dispatching entry points st_vec_dot and st_matmul.

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "quant/kernels.h"
#include "quant/quant.h"

static const char *const path_names[ST_CPU_PATH_COUNT] = {"scalar", "avx2", "avx512"};

static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;
static bool path_ok[ST_CPU_PATH_COUNT];
static st_quant_kernels tables[ST_CPU_PATH_COUNT];
static _Atomic int current_path;


#if defined(__x86_64__) || defined(__i386__)
static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

// What the instruction set files were compiled for (CMakeLists.txt): AVX2 + FMA + F16C + BMI2
// for dot_avx2.c; AVX-512 F/BW/VL/DQ/VNNI on top of that for dot_avx512.c. The OS must also
// save the wider registers (XCR0), or the instructions fault.
static void detect(bool ok[ST_CPU_PATH_COUNT]) {
    uint32_t a, b, c, d;
    ok[ST_CPU_SCALAR] = true;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29);
    if (!osxsave) return;
    uint64_t xcr0 = xgetbv0();
    bool ymm_os = (xcr0 & 0x6) == 0x6;
    bool zmm_os = (xcr0 & 0xe6) == 0xe6; // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return;
    bool avx2 = b & (1u << 5), bmi2 = b & (1u << 8);
    bool avx512f = b & (1u << 16), avx512dq = b & (1u << 17), avx512bw = b & (1u << 30);
    bool avx512vl = b & (1u << 31), avx512vnni = c & (1u << 11);
    ok[ST_CPU_AVX2] = ymm_os && avx2 && fma && f16c && bmi2;
    ok[ST_CPU_AVX512] = ok[ST_CPU_AVX2] && zmm_os && avx512f && avx512dq && avx512bw &&
                        avx512vl && avx512vnni;
}
#else
static void detect(bool ok[ST_CPU_PATH_COUNT]) { ok[ST_CPU_SCALAR] = true; }
#endif

static void cpu_init(void) {
    detect(path_ok);
    st_quant_kernels_scalar(&tables[ST_CPU_SCALAR]);
    // The table fillers are compiled for their instruction sets (the compiler may use them even
    // to copy a table), so each runs only on a CPU that has them.
    tables[ST_CPU_AVX2] = tables[ST_CPU_SCALAR];
    if (path_ok[ST_CPU_AVX2]) st_quant_kernels_avx2(&tables[ST_CPU_AVX2]);
    tables[ST_CPU_AVX512] = tables[ST_CPU_AVX2];
    if (path_ok[ST_CPU_AVX512]) st_quant_kernels_avx512(&tables[ST_CPU_AVX512]);

    int best = ST_CPU_SCALAR;
    for (int p = 0; p < ST_CPU_PATH_COUNT; p++)
        if (path_ok[p]) best = p;
    // STRATA_CPU is for experiments and tests: pin a slower path, never a faster one.
    const char *env = getenv("STRATA_CPU");
    if (env && *env) {
        int want = -1;
        for (int p = 0; p < ST_CPU_PATH_COUNT; p++)
            if (!strcmp(env, path_names[p])) want = p;
        if (want < 0)
            st_log_warn("STRATA_CPU=%s is not scalar, avx2 or avx512; using %s", env,
                        path_names[best]);
        else if (!path_ok[want])
            st_log_warn("STRATA_CPU=%s: this CPU cannot run it; using %s", env, path_names[best]);
        else
            best = want;
    }
    atomic_store(&current_path, best);
}

static void ensure_init(void) { pthread_once(&cpu_once, cpu_init); }

const char *st_cpu_path_name(st_cpu_path path) {
    return (unsigned)path < ST_CPU_PATH_COUNT ? path_names[path] : "unknown";
}

bool st_cpu_path_supported(st_cpu_path path) {
    ensure_init();
    return (unsigned)path < ST_CPU_PATH_COUNT && path_ok[path];
}

st_cpu_path st_cpu_path_get(void) {
    ensure_init();
    return (st_cpu_path)atomic_load_explicit(&current_path, memory_order_relaxed);
}

st_status st_cpu_path_set(st_cpu_path path) {
    ensure_init();
    if ((unsigned)path >= ST_CPU_PATH_COUNT)
        return st_fail(ST_ERR_ARG, "cpu path %d does not exist", (int)path);
    if (!path_ok[path])
        return st_fail(ST_ERR_UNSUPPORTED, "this CPU cannot run the %s kernels", path_names[path]);
    atomic_store(&current_path, (int)path);
    return ST_OK;
}

const st_quant_kernels *st_quant_kernels_now(void) {
    ensure_init();
    return &tables[atomic_load_explicit(&current_path, memory_order_relaxed)];
}

float st_vec_dot(st_type type, int64_t n, const void *w, const void *x) {
    ST_ASSERT((unsigned)type < ST_TYPE_COUNT);
    ST_ASSERT(st_type_get(type) && n % st_type_get(type)->block == 0); // kernels drop a remainder
    st_dot_fn fn = st_quant_kernels_now()->dot[type];
    ST_ASSERT(fn != NULL);
    float s;
    fn(n, &s, w, x);
    return s;
}

// ---------------------------------------------------------------------------------------------
// st_matmul

// Activation rows handled per dot_multi call. A verify window (up to 16 rows) is one group; a
// prompt chunk is tiled so the group's activations stay in L1/L2 while the weights stream.
#define MM_X_GROUP 16
// Weight rows per tile when there are several activation groups: the tile is reused from L2 by
// every group, so it is read from memory once (256 KiB fits the L2 of current x86 cores).
#define MM_TILE_BYTES (256 * 1024)
// Software prefetch distance for weights. Measured on a 16-core Sapphire Rapids VM (1.2 GB
// matrices, 16 threads): 86-105% of the streaming-read bandwidth with it, 71-78% without; a core
// busy with dot arithmetic keeps too few loads in flight for the hardware prefetchers alone.
#define MM_PREFETCH_BYTES 8192
// One activation row (decode): before each weight row's dot, every line up to this many bytes
// past that row's end is prefetched (so the row itself is requested at once, plus a little of
// the next). A whole row 8 KiB ahead instead: 2-thread Xeon VM (AVX-512; 1 GiB matrices, one
// thread) q8_0 n=2048 8.3 -> 11.0 GB/s, q4_K n=2048 7.7 -> 11.0, n=768 8.6 -> 9.9, q8_0 n=4096
// 10.0 -> 10.5 (a plain sum streams ~14.5 GB/s a core there): a core has few line-fill buffers,
// and prefetches far ahead of a row that is still being computed take them from the row's own
// loads (a dot keeps too few loads in flight to cover the latency without any prefetch: 7.2).
#define MM_DOT_PREFETCH_BYTES 1536
// Work items per thread of a product (claimed from a shared counter): the last ones to finish
// leave the other threads idle for about half an item, which compute-bound types (the IQ grids)
// feel in full; memory-bound ones make it up in bandwidth. 16 rather than 4: 2 threads on the
// AMD machine, 1024 MiB matrices: IQ3_S +15%, IQ1_M +10%, Q4_K unchanged; 30B-shape decode
// 14.5-14.9 -> 14.8-16.6 tokens/s (three interleaved A/B rounds).
#define MM_CHUNKS_PER_THREAD 16
// At most this many weight bytes per work item: the head's 330 MB (151,936 rows) in 32 items made
// items of 10 MB, ~0.8 ms on one thread, and the last one left the other thread idle for about
// half of that each token. A 1 MiB item streams as fast as larger ones (two threads, consecutive
// 8.9 MB products: 16 items a thread or 4 alike, 64 slower).
#define MM_CHUNK_MAX_BYTES (1 << 20)

static inline void prefetch_row(const uint8_t *p, size_t bytes) {
    for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

// Activation rows from which st_matmul packs 8 weight rows at a time for the GEMM kernels
// (where the path has them): below it, packing costs more than it saves.
#define MM_GEMM_MIN_NX 4
// Packed weights of one 8-row tile, on the worker's stack: a K chunk of at most this many bytes
// (n = 2048 needs 20 KiB for q4_K, 18 KiB for q8_0) so the tile stays in L1 while every
// activation row passes; a longer row is done in K chunks that add into y.
#define MM_GEMM_PACK_BYTES (32 * 1024)

typedef struct mm_job {
    st_matmul_args a;
    st_dot_fn dot;
    st_dot_multi_fn multi;
    st_gemm_pack_fn gemm_pack; // NULL: no GEMM for this type on this path, or too few rows
    st_gemm_fn gemm;
    size_t gemm_block_bytes;   // packed bytes per block of 8 rows
    size_t w_row_bytes;
    size_t w_block_bytes;      // one weight block; x_block_bytes: its activation block
    size_t x_block_bytes;
    int64_t chunk; // rows per work item
} mm_job;

// The products of one pool run. Work items are chunks of a product's rows, numbered product
// after product: item t is in job p when first[p] <= t < first[p + 1].
typedef struct mm_ctx {
    int n_jobs;
    mm_job job[ST_MATMUL_MANY];
    int64_t first[ST_MATMUL_MANY + 1];
    // On its own cache line: every claim writes it, and the job fields are read all the time.
    _Alignas(64) _Atomic int64_t next; // first item not yet claimed
    char pad[64 - sizeof(int64_t)];
} mm_ctx;

static void mm_rows_multi(const mm_job *j, int64_t r0, int64_t r1) {
    const st_matmul_args *a = &j->a;
    const uint8_t *w = a->w;
    const uint8_t *x = a->x;
    const size_t rb = j->w_row_bytes;
    const int64_t ahead = rb ? (int64_t)((MM_PREFETCH_BYTES + rb - 1) / rb) : 1;
    if (a->nx == 1) {
        // Two streams: rows [r0, mid) and [mid, r1) taken in turns, each prefetched up to
        // MM_DOT_PREFETCH_BYTES past the end of its row being computed. The hardware prefetcher
        // follows each stream on its own, so a core has about twice the reads in flight: 30B-shape
        // decode on the 2-thread Xeon VM 20.8 -> 24.1-24.8 tokens/s (one stream, same prefetch;
        // three or four streams, or 768 or 3072 prefetch bytes: 24.2-25.3 against 26.0-26.2).
        // Byte offsets into w: pf* the next line to prefetch, end* the end of each stream.
        int64_t mid = r0 + (r1 - r0 + 1) / 2;
        size_t pf0 = (size_t)r0 * rb, end0 = (size_t)mid * rb;
        size_t pf1 = end0, end1 = (size_t)r1 * rb;
        for (int64_t o = r0, p = mid; o < mid; o++, p++) {
            size_t want = (size_t)(o + 1) * rb + MM_DOT_PREFETCH_BYTES;
            if (want > end0) want = end0;
            for (; pf0 < want; pf0 += 64) __builtin_prefetch(w + pf0, 0, 3);
            j->dot(a->n, &a->y[o], w + o * rb, x);
            if (p >= r1) break;
            want = (size_t)(p + 1) * rb + MM_DOT_PREFETCH_BYTES;
            if (want > end1) want = end1;
            for (; pf1 < want; pf1 += 64) __builtin_prefetch(w + pf1, 0, 3);
            j->dot(a->n, &a->y[p], w + p * rb, x);
        }
        return;
    }
    int64_t tile = (int64_t)(MM_TILE_BYTES / (rb ? rb : 1));
    if (tile < 1) tile = 1;
    float s[MM_X_GROUP];
    for (int64_t t0 = r0; t0 < r1; t0 += tile) {
        int64_t t1 = t0 + tile < r1 ? t0 + tile : r1;
        for (int g0 = 0; g0 < a->nx; g0 += MM_X_GROUP) {
            int g = a->nx - g0 < MM_X_GROUP ? a->nx - g0 : MM_X_GROUP;
            const uint8_t *xg = x + (size_t)g0 * a->x_stride;
            for (int64_t o = t0; o < t1; o++) {
                const uint8_t *wr = w + o * rb;
                if (g0 == 0 && o + ahead < r1) prefetch_row(w + (o + ahead) * rb, rb); // from DRAM
                if (j->multi) {
                    j->multi(a->n, g, s, wr, xg, a->x_stride);
                } else {
                    for (int r = 0; r < g; r++) j->dot(a->n, &s[r], wr, xg + (size_t)r * a->x_stride);
                }
                for (int r = 0; r < g; r++) a->y[(int64_t)(g0 + r) * a->ldy + o] = s[r];
            }
        }
    }
}

// Whole 8-row tiles through the GEMM kernel (each tile packed once, then every activation row
// against it); a remainder of fewer than 8 rows through dot_multi. Not inlined into mm_rows:
// its 32 KiB stack frame is for prompt chunks only, not for every decode call.
__attribute__((noinline)) static void mm_rows_gemm(const mm_job *j, int64_t r0, int64_t r1) {
    const st_matmul_args *a = &j->a;
    const uint8_t *w = a->w;
    const uint8_t *x = a->x;
    const size_t rb = j->w_row_bytes;
    const int64_t nb = a->n / st_type_get(a->type)->block;
    const int64_t kc = (int64_t)(MM_GEMM_PACK_BYTES / j->gemm_block_bytes); // blocks per K chunk
    _Alignas(64) uint8_t packed[MM_GEMM_PACK_BYTES];
    int64_t o = r0;
    for (; o + ST_GEMM_ROWS <= r1; o += ST_GEMM_ROWS) {
        if (o + 2 * ST_GEMM_ROWS <= r1) prefetch_row(w + (o + ST_GEMM_ROWS) * rb, ST_GEMM_ROWS * rb);
        for (int64_t k0 = 0; k0 < nb; k0 += kc) {
            int64_t kn = nb - k0 < kc ? nb - k0 : kc;
            j->gemm_pack(kn, packed, w + o * rb + (size_t)k0 * j->w_block_bytes, rb);
            j->gemm(kn, a->nx, a->y + o, a->ldy, packed, x + (size_t)k0 * j->x_block_bytes,
                    a->x_stride, k0 > 0);
        }
    }
    if (o < r1) mm_rows_multi(j, o, r1);
}

static void mm_rows(const mm_job *j, int64_t r0, int64_t r1) {
    if (j->gemm_pack && r1 - r0 >= ST_GEMM_ROWS) mm_rows_gemm(j, r0, r1);
    else mm_rows_multi(j, r0, r1);
}

// Thread ith first takes item ith, then claims further items from a shared counter: on shared
// or virtual machines a thread can be descheduled for a while, and with a purely static split
// every call would wait for the slowest thread. A thread's items only go forward, product after
// product, so it moves to the next product without waiting for the others.
static void mm_task(void *ctx, int ith, int nth) {
    mm_ctx *c = ctx;
    int p = -1;
    mm_job j; // a private copy of the current job: the calls below cannot make us re-read c
    for (int64_t t = ith; t < c->first[c->n_jobs]; t = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed)) {
        if (p < 0 || t >= c->first[p + 1]) {
            while (t >= c->first[p + 1]) p++;
            j = c->job[p];
        }
        int64_t r0 = (t - c->first[p]) * j.chunk;
        mm_rows(&j, r0, r0 + j.chunk < j.a.rows ? r0 + j.chunk : j.a.rows);
    }
    (void)nth;
}

// The job of one product, its chunk size left to the caller.
static mm_job mm_job_make(const st_matmul_args *args) {
    ST_ASSERT((unsigned)args->type < ST_TYPE_COUNT);
    ST_ASSERT(args->nx >= 1 && args->rows >= 0 && args->n >= 0);
    ST_ASSERT(args->nx == 1 || args->ldy >= args->rows);
    ST_ASSERT(st_type_get(args->type) && args->n % st_type_get(args->type)->block == 0);
    const st_quant_kernels *k = st_quant_kernels_now();
    const st_type_info *ti = st_type_get(args->type);
    bool gemm = k->gemm_pack[args->type] && args->nx >= MM_GEMM_MIN_NX && !args->row_exact;
    mm_job j = {
        .a = *args,
        .dot = k->dot[args->type],
        .multi = k->dot_multi[args->type],
        .gemm_pack = gemm ? k->gemm_pack[args->type] : NULL,
        .gemm = k->gemm[args->type],
        .gemm_block_bytes = (size_t)k->gemm_block_bytes[args->type],
        .w_row_bytes = st_row_bytes(args->type, args->n),
        .w_block_bytes = (size_t)ti->block_bytes,
        .x_block_bytes = st_row_bytes(ti->dot_type, ti->block),
    };
    ST_ASSERT(j.dot != NULL);
    ST_ASSERT(!gemm || (j.gemm && j.gemm_block_bytes > 0 && j.gemm_block_bytes <= MM_GEMM_PACK_BYTES));
    return j;
}

void st_matmul_many(st_pool *pool, int n, const st_matmul_args *args) {
    ST_ASSERT(n >= 1 && n <= ST_MATMUL_MANY);
    mm_ctx c = {.n_jobs = n};
    int64_t work = 0, rows = 0;
    for (int p = 0; p < n; p++) {
        c.job[p] = mm_job_make(&args[p]);
        work += args[p].rows * args[p].n * args[p].nx;
        rows += args[p].rows;
    }
    if (rows == 0) return;
    // Tiny products are not worth waking the pool for.
    int nth = pool && work >= 32 * 1024 ? st_pool_size(pool) : 1;
    // About MM_CHUNKS_PER_THREAD items per thread in all, shared out by work; chunks of at least
    // 16 rows and a multiple of 16, so they start on whole cache lines of the output for nx == 1
    // (and GEMM tiles fall on the same rows whatever the split).
    int64_t items = (int64_t)MM_CHUNKS_PER_THREAD * nth;
    for (int p = 0; p < n; p++) {
        const st_matmul_args *a = &args[p];
        int64_t share = work ? (items * a->rows * a->n * a->nx + work / 2) / work : 1;
        if (share < 1) share = 1;
        int64_t chunk = (a->rows + share - 1) / share;
        int64_t cap = (int64_t)(MM_CHUNK_MAX_BYTES / c.job[p].w_row_bytes);
        if (chunk > cap) chunk = cap;
        chunk = chunk < 16 ? 16 : (chunk + 15) / 16 * 16;
        c.job[p].chunk = chunk;
        c.first[p + 1] = c.first[p] + (a->rows + chunk - 1) / chunk;
    }
    atomic_init(&c.next, (int64_t)nth); // items 0..nth-1 go to threads 0..nth-1
    if (nth == 1) mm_task(&c, 0, 1);
    else st_pool_run(pool, mm_task, &c);
}

void st_matmul(st_pool *pool, const st_matmul_args *args) { st_matmul_many(pool, 1, args); }
