// cli: `strata bench <what>`: the benchmark dispatcher, and `strata bench kernels` (CPU
// matrix-vector throughput per type and path, next to the memory-read bandwidth measured with
// the same thread pool).

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "quant/quant.h"

static int bench_kernels(int argc, char **argv);

// A benchmark from another file that may not be linked into every build yet.
int st_bench_tokenizer(int argc, char **argv) __attribute__((weak));

typedef struct bench_entry {
    const char *name;
    int (*fn)(int argc, char **argv); // argv[0] is the benchmark's name
    const char *summary;
} bench_entry;

// Add a benchmark here (and declare its function in cli.h).
static const bench_entry benches[] = {
    {"kernels", bench_kernels, "CPU dot kernels: GB/s of weights per type and path vs memory bandwidth"},
    {"tokenizer", st_bench_tokenizer, "tokenizer throughput"},
};
#define N_BENCHES (int)(sizeof benches / sizeof benches[0])

static void bench_usage(FILE *f) {
    fprintf(f, "usage: strata bench -m FILE [options]   (a model: prompt and decode tokens/s)\n"
               "       strata bench <what> [options]\n\nbenchmarks:\n");
    for (int i = 0; i < N_BENCHES; i++)
        if (benches[i].fn) fprintf(f, "  %-12s %s\n", benches[i].name, benches[i].summary);
    fprintf(f, "\n`strata bench <what> --help` describes its options.\n");
}

int st_cmd_bench(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        bench_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (argv[1][0] == '-') return st_bench_model(argc, argv); // strata bench -m FILE ...
    for (int i = 0; i < N_BENCHES; i++)
        if (benches[i].fn && !strcmp(benches[i].name, argv[1])) return benches[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "strata bench: unknown benchmark '%s'\n", argv[1]);
    bench_usage(stderr);
    return 2;
}

// ---------------------------------------------------------------------------------------------
// bench kernels

static uint64_t rng = 0x2545f4914f6cdd1dull;
static uint64_t rnd64(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

// Byte offsets of a block's fp16 scale fields, so random blocks get normal (not denormal, inf
// or NaN) scales: a denormal operand would slow the float code and skew the timing.
static int scale_offsets(st_type t, int off[2]) {
    switch (t) {
    case ST_TYPE_Q4_1: case ST_TYPE_Q5_1: case ST_TYPE_Q4_K: case ST_TYPE_Q5_K:
        off[0] = 0, off[1] = 2;
        return 2;
    case ST_TYPE_Q2_K: off[0] = 80, off[1] = 82; return 2;
    case ST_TYPE_Q3_K: off[0] = 108; return 1;
    case ST_TYPE_Q6_K: off[0] = 208; return 1;
    case ST_TYPE_IQ1_M: return 0; // scale in nibbles of the scale words: fixed below
    default: off[0] = 0; return 1;
    }
}

// Fills rows x n weights of type t with random quants and sane scales.
static void fill_weights(st_type t, uint8_t *w, int64_t rows, int64_t n) {
    const st_type_info *ti = st_type_get(t);
    size_t bytes = st_row_bytes(t, n) * (size_t)rows;
    if (!ti->quantized) {
        // f32 / f16 / bf16: values in [-1, 1] converted, chunk by chunk
        float buf[1024];
        size_t esz = (size_t)ti->block_bytes, total = bytes / esz;
        for (size_t i = 0; i < total; i += 1024) {
            size_t m = total - i < 1024 ? total - i : 1024;
            for (size_t k = 0; k < m; k++) buf[k] = (float)((rnd64() >> 40) / 8388608.0 - 1.0);
            st_quantize(t, buf, w + i * esz, (int64_t)m);
        }
        return;
    }
    for (size_t i = 0; i + 8 <= bytes; i += 8) {
        uint64_t v = rnd64();
        memcpy(w + i, &v, 8);
    }
    int off[2];
    int k = scale_offsets(t, off);
    st_f16 d = st_f32_to_f16(0.01f);
    for (size_t b = 0; b < bytes / (size_t)ti->block_bytes; b++) {
        uint8_t *blk = w + b * (size_t)ti->block_bytes;
        for (int j = 0; j < k; j++) memcpy(blk + off[j], &d, 2);
        if (t == ST_TYPE_IQ1_M) // fp16 spread over the top nibbles of the 4 u16 scale words
            for (int j = 0; j < 4; j++) blk[48 + 2 * j + 1] = (uint8_t)((blk[48 + 2 * j + 1] & 15) | (((d >> 4 * j) & 15) << 4));
    }
}

// Memory-read bandwidth: each pool thread sums its share of a buffer much larger than the
// caches, with 16-byte vector loads into independent accumulators (GCC vector extensions, so
// this file needs no instruction-set flags): enough loads in flight to reach the memory bound.
typedef uint64_t v2u64 __attribute__((vector_size(16)));

typedef struct stream_ctx {
    const v2u64 *buf;
    size_t vecs;
    uint64_t out[256];
} stream_ctx;

static void stream_task(void *p, int ith, int nth) {
    stream_ctx *c = p;
    size_t a = c->vecs * (size_t)ith / (size_t)nth, b = c->vecs * (size_t)(ith + 1) / (size_t)nth;
    v2u64 s0 = {0, 0}, s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    size_t i = a;
    for (; i + 8 <= b; i += 8) {
        s0 += c->buf[i], s1 += c->buf[i + 1], s2 += c->buf[i + 2], s3 += c->buf[i + 3];
        s4 += c->buf[i + 4], s5 += c->buf[i + 5], s6 += c->buf[i + 6], s7 += c->buf[i + 7];
    }
    for (; i < b; i++) s0 += c->buf[i];
    v2u64 t = s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7;
    c->out[ith & 255] = t[0] + t[1];
}

// Best GB/s of `reps` passes over `bytes`.
static double measure_stream(st_pool *pool, const void *buf, size_t bytes, int reps) {
    stream_ctx c = {.buf = buf, .vecs = bytes / sizeof(v2u64)};
    double best = 0;
    st_pool_run(pool, stream_task, &c); // warm: page tables, workers awake
    for (int r = 0; r < reps; r++) {
        double t0 = st_time_s();
        st_pool_run(pool, stream_task, &c);
        double gbs = (double)bytes / (st_time_s() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    return best;
}

static void noop_task(void *p, int ith, int nth) {
    (void)p;
    (void)ith;
    (void)nth;
}

// Microseconds per empty st_pool_run, back to back (best of 5 batches).
static double pool_overhead_us(st_pool *pool) {
    double best = 1e9;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = st_time_s();
        for (int i = 0; i < 2000; i++) st_pool_run(pool, noop_task, NULL);
        double us = (st_time_s() - t0) / 2000 * 1e6;
        if (us < best) best = us;
    }
    return best;
}

typedef struct shape {
    const char *name;
    int64_t rows, n; // rows 0: enough rows of n for `big_bytes` of weights
} shape;

static const shape shapes[] = {
    {"4096x4096", 4096, 4096}, // a dense projection
    {"768x2048", 768, 2048},   // one routed expert (Qwen3-30B-A3B: 768 x 2048)
    {"big", 0, 4096},          // far larger than L3: the memory-bandwidth case
};
#define N_SHAPES 3

// Weight-bytes GB/s of y = W x (nx activation rows), best of timed batches of about 0.2 s.
static double time_matmul(st_pool *pool, st_type t, const void *w, int64_t rows, int64_t n,
                          const void *x, size_t xs, int nx, float *y, double budget_s) {
    st_matmul_args a = {.type = t, .w = w, .n = n, .rows = rows, .x = x, .x_stride = xs,
                        .nx = nx, .y = y, .ldy = rows};
    double bytes = (double)st_row_bytes(t, n) * (double)rows;
    st_matmul(pool, &a); // warm
    double t0 = st_time_s();
    st_matmul(pool, &a);
    double once = st_time_s() - t0;
    int per = once > 0 ? (int)(0.05 / once) : 1000;
    if (per < 1) per = 1;
    double best = 0, start = st_time_s();
    do {
        t0 = st_time_s();
        for (int i = 0; i < per; i++) st_matmul(pool, &a);
        double gbs = bytes * per / (st_time_s() - t0) / 1e9;
        if (gbs > best) best = gbs;
    } while (st_time_s() - start < budget_s);
    return best;
}

static void cpu_model(char *out, size_t size) {
    snprintf(out, size, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, "model name", 10)) {
            char *p = strchr(line, ':');
            if (p) {
                p += 1 + (p[1] == ' ');
                p[strcspn(p, "\n")] = 0;
                snprintf(out, size, "%s", p);
            }
            break;
        }
    }
    fclose(f);
}

void st_bench_commit(char *buf, size_t size) { snprintf(buf, size, "%s", st_build_commit); }

// Memory-read GB/s with n threads over a buffer far larger than the caches (as bench kernels
// measures it), for the other benchmarks' bounds.
double st_bench_read_gbs(int n_threads) {
    size_t bytes = (size_t)1 << 30;
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (l3 > 0 && (size_t)l3 * 4 > bytes) bytes = (size_t)l3 * 4;
    size_t avail = st_ram_available();
    if (avail && bytes > avail / 4) bytes = avail / 4 & ~(size_t)4095;
    st_pool *pool = st_pool_create(n_threads);
    uint8_t *buf = st_alloc(bytes);
    double gbs = 0;
    if (pool && buf) {
        memset(buf, 1, bytes);
        gbs = measure_stream(pool, buf, bytes, 5);
    }
    st_free(buf);
    st_pool_free(pool);
    return gbs;
}

static void kernels_usage(FILE *f) {
    fprintf(f,
            "usage: strata bench kernels [-t N] [--type T[,T...]] [--path P] [--shape S] [--nx K]\n"
            "                            [--time SECONDS]\n\n"
            "Matrix-vector throughput of the CPU dot kernels, in GB/s of weight bytes read,\n"
            "for each type and path with 1 and N threads, next to the plain memory-read\n"
            "bandwidth measured with the same pool.\n\n"
            "  -t N          threads (default: all CPUs)\n"
            "  --type T      weight types, comma-separated (default: the main types; 'all')\n"
            "  --path P      scalar, avx2, avx512 or all (default: all this CPU runs)\n"
            "  --shape S     4096x4096, 768x2048, big (>= 1 GiB and 4x L3, n = 4096) or all\n"
            "  --nx K        activation rows per product (default 1; K > 1 uses dot_multi)\n"
            "  --time S      seconds per measurement (default 0.3)\n");
}

static const st_type main_types[] = {ST_TYPE_Q8_0, ST_TYPE_Q4_K, ST_TYPE_Q5_K, ST_TYPE_Q6_K,
                                     ST_TYPE_IQ4_XS};

static int bench_kernels(int argc, char **argv) {
    int64_t threads = st_cpu_count(), nx = 1;
    double budget = 0.3;
    const char *types_arg = NULL, *path_arg = "all", *shape_arg = "all";
    bool bad = false;
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            kernels_usage(stdout);
            return 0;
        } else if (st_cli_opt(argc, argv, &i, "-t", &v, &bad)) {
            if (bad || !st_cli_int("-t", v, 1, 256, &threads)) return 2;
        } else if (st_cli_opt(argc, argv, &i, "--nx", &v, &bad)) {
            if (bad || !st_cli_int("--nx", v, 1, 4096, &nx)) return 2;
        } else if (st_cli_opt(argc, argv, &i, "--time", &v, &bad)) {
            if (bad || !st_cli_float("--time", v, &budget) || budget <= 0) return 2;
        } else if (st_cli_opt(argc, argv, &i, "--type", &v, &bad)) {
            if (bad) return 2;
            types_arg = v;
        } else if (st_cli_opt(argc, argv, &i, "--path", &v, &bad)) {
            if (bad) return 2;
            path_arg = v;
        } else if (st_cli_opt(argc, argv, &i, "--shape", &v, &bad)) {
            if (bad) return 2;
            shape_arg = v;
        } else {
            fprintf(stderr, "strata bench kernels: unknown option '%s'\n", argv[i]);
            kernels_usage(stderr);
            return 2;
        }
    }

    st_type types[ST_TYPE_COUNT];
    int n_types = 0;
    if (!types_arg) {
        for (size_t i = 0; i < sizeof main_types / sizeof main_types[0]; i++) types[n_types++] = main_types[i];
    } else if (!strcmp(types_arg, "all")) {
        for (int t = 0; t < ST_TYPE_COUNT; t++) {
            const st_type_info *ti = st_type_get(t);
            if (ti && ti->compute) types[n_types++] = (st_type)t;
        }
    } else {
        char buf[256];
        snprintf(buf, sizeof buf, "%s", types_arg);
        for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
            st_type t;
            if (!st_type_from_name(tok, &t) || !st_type_get(t)->compute) {
                fprintf(stderr, "strata bench kernels: --type: '%s' is not a weight type with CPU kernels\n", tok);
                return 2;
            }
            if (n_types < ST_TYPE_COUNT) types[n_types++] = t;
        }
    }
    bool want_path[ST_CPU_PATH_COUNT] = {false};
    for (int p = 0; p < ST_CPU_PATH_COUNT; p++) {
        if (!strcmp(path_arg, "all") || !strcmp(path_arg, st_cpu_path_name((st_cpu_path)p))) want_path[p] = true;
    }
    bool any = false;
    for (int p = 0; p < ST_CPU_PATH_COUNT; p++) any |= want_path[p];
    if (!any) {
        fprintf(stderr, "strata bench kernels: --path: '%s' is not scalar, avx2, avx512 or all\n", path_arg);
        return 2;
    }
    bool want_shape[N_SHAPES];
    any = false;
    for (int s = 0; s < N_SHAPES; s++) any |= want_shape[s] = !strcmp(shape_arg, "all") || !strcmp(shape_arg, shapes[s].name);
    if (!any) {
        fprintf(stderr, "strata bench kernels: --shape: '%s' is not one of 4096x4096, 768x2048, big, all\n", shape_arg);
        return 2;
    }

    char model[256], commit[128];
    cpu_model(model, sizeof model);
    st_bench_commit(commit, sizeof commit);
    printf("cpu: %s, %d logical CPUs; paths:", model, st_cpu_count());
    for (int p = 0; p < ST_CPU_PATH_COUNT; p++)
        printf(" %s%s", st_cpu_path_name((st_cpu_path)p), st_cpu_path_supported((st_cpu_path)p) ? "" : "(no)");
    printf("\ncommit: %s; threads: 1 and %d; activation rows: %d\n", commit, (int)threads, (int)nx);

    st_pool *pool = st_pool_create((int)threads);
    if (!pool) return st_cli_fail(ST_ERR_NOMEM);
    int rc = 0;
    // The big case and the bandwidth measurement: at least 1 GiB and 4x the L3 (servers have
    // hundreds of MiB of L3), or a quarter of the free RAM if that is less.
    size_t big_bytes = (size_t)1 << 30;
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (l3 > 0 && (size_t)l3 * 4 > big_bytes) big_bytes = (size_t)l3 * 4;
    size_t avail = st_ram_available();
    if (avail && big_bytes > avail / 4) big_bytes = avail / 4 & ~(size_t)4095;
    size_t stream_bytes = big_bytes;
    uint8_t *sbuf = st_alloc(stream_bytes);
    if (!sbuf) {
        st_pool_free(pool);
        return st_cli_fail(ST_ERR_NOMEM);
    }
    memset(sbuf, 1, stream_bytes);
    double bw1 = measure_stream(NULL, sbuf, stream_bytes, 3);
    double bwn = measure_stream(pool, sbuf, stream_bytes, 5);
    st_free(sbuf);
    printf("memory read (streaming sum over %.0f MiB): 1 thread %.1f GB/s, %d threads %.1f GB/s\n",
           stream_bytes / 1048576.0, bw1, (int)threads, bwn);
    printf("thread pool: %.2f us per empty call with %d threads\n\n", pool_overhead_us(pool), (int)threads);

    printf("| type    | path   | shape        | MiB    | 1 thr GB/s | %3d thr GB/s | %% of mem bw (%d thr) |\n", (int)threads, (int)threads);
    printf("|---------|--------|--------------|--------|------------|--------------|---------------------|\n");
    st_cpu_path saved = st_cpu_path_get();
    char big_name[32];
    for (int ti = 0; ti < n_types && rc == 0; ti++) {
        st_type t = types[ti];
        st_type dt = st_type_get(t)->dot_type;
        for (int s = 0; s < N_SHAPES && rc == 0; s++) {
            if (!want_shape[s]) continue;
            shape big = shapes[s];
            if (!big.rows) {
                big.rows = (int64_t)((big_bytes / st_row_bytes(t, big.n) + 63) & ~(size_t)63);
                snprintf(big_name, sizeof big_name, "%lldx%lld", (long long)big.rows, (long long)big.n);
                big.name = big_name;
            }
            const shape *sh = &big;
            size_t wbytes = st_row_bytes(t, sh->n) * (size_t)sh->rows, xs = st_row_bytes(dt, sh->n);
            uint8_t *w = st_alloc(wbytes);
            uint8_t *x = st_alloc(xs * (size_t)nx);
            float *xf = st_alloc(sizeof(float) * (size_t)sh->n);
            float *y = st_alloc(sizeof(float) * (size_t)sh->rows * (size_t)nx);
            if (!w || !x || !xf || !y) {
                rc = st_cli_fail(ST_ERR_NOMEM);
            } else {
                fill_weights(t, w, sh->rows, sh->n);
                for (int r = 0; r < nx; r++) {
                    for (int64_t i = 0; i < sh->n; i++) xf[i] = (float)((rnd64() >> 40) / 8388608.0 - 1.0);
                    st_quantize(dt, xf, x + (size_t)r * xs, sh->n);
                }
                for (int p = 0; p < ST_CPU_PATH_COUNT; p++) {
                    if (!want_path[p] || !st_cpu_path_supported((st_cpu_path)p)) continue;
                    st_cpu_path_set((st_cpu_path)p);
                    double g1 = time_matmul(NULL, t, w, sh->rows, sh->n, x, xs, (int)nx, y, budget);
                    double gn = threads > 1 ? time_matmul(pool, t, w, sh->rows, sh->n, x, xs, (int)nx, y, budget) : g1;
                    printf("| %-7s | %-6s | %-12s | %6.1f | %10.2f | %12.2f | %18.0f%% |\n", st_type_name(t),
                           st_cpu_path_name((st_cpu_path)p), sh->name, wbytes / 1048576.0, g1, gn, 100.0 * gn / bwn);
                    fflush(stdout);
                }
            }
            st_free(w);
            st_free(x);
            st_free(xf);
            st_free(y);
        }
    }
    st_cpu_path_set(saved);
    st_pool_free(pool);
    return rc;
}
