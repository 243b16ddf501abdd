// bench: the CPU pool's routed experts for decode windows (host_moe's small path, through
// st_experts_compute on the CPU backend), timed per layer call on synthetic Q4_K experts held in
// memory (more than the caches hold, so weights come from DRAM as in decode). Prints the time
// per layer, the expert bytes per second, and a checksum of the outputs (two versions of the
// path must print the same). Not part of the build; from the repository root, with /tmp/bh a
// Release build:
//   cc -O2 -std=c11 -D_GNU_SOURCE bench/host_moe_bench.c -Isrc /tmp/bh/libst_experts.a
//      /tmp/bh/libst_backend.a /tmp/bh/libst_quant.a /tmp/bh/libst_util.a -lm -lpthread -o /tmp/hmb
//   usage: hmb THREADS D F E K N[,N...] [CALLS]      e.g. hmb 2 2048 768 128 8 1,2,4,8
// Interleave the runs of two builds on a shared machine. HMB_THP=1 / 0: the experts in 2 MiB / 4 KiB
// pages (grep AnonHugePages /proc/meminfo shows what the system gave).

#include <math.h>
#include <stdint.h>
#include <sys/mman.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "experts/experts.h"
#include "quant/quant.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next_u64(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

// A stack of E Q4_K matrices (rows, cols) of random codes with sane scales.
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static st_mat3 q4k_stack(int64_t rows, int64_t cols, int E) {
    size_t rb = st_row_bytes(ST_TYPE_Q4_K, cols), bytes = rb * (size_t)rows * E;
    // HMB_THP=1: 2 MiB pages (transparent huge pages by madvise), HMB_THP=0: 4 KiB pages forced;
    // unset: whatever the allocator and the system's THP setting give.
    const char *thp = getenv("HMB_THP");
    uint8_t *p;
    if (thp) {
        size_t len = (bytes + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
        p = mmap(NULL, len + (2u << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) exit(1);
        p = (uint8_t *)(((uintptr_t)p + (2u << 20) - 1) & ~(uintptr_t)((2u << 20) - 1));
        madvise(p, len, atoi(thp) ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    } else {
        p = st_alloc(bytes);
    }
    if (!p) exit(1);
    for (size_t i = 0; i + 8 <= bytes; i += 8) {
        uint64_t v = next_u64();
        memcpy(p + i, &v, 8);
    }
    for (size_t b = 0; b < bytes / 144; b++) { // d, dmin: the first two f16 of each block
        st_f16 d = st_f32_to_f16(0.002f + 0.001f * (float)(b % 7)), dm = st_f32_to_f16(0.001f);
        memcpy(p + b * 144, &d, 2);
        memcpy(p + b * 144 + 2, &dm, 2);
    }
    st_mat3 m = {ST_TYPE_Q4_K, cols, rows, E, rb, rb * (size_t)rows, p};
    return m;
}

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s THREADS D F E K N[,N...] [CALLS]\n", argv[0]);
        return 2;
    }
    int nth = atoi(argv[1]), d = atoi(argv[2]), F = atoi(argv[3]), E = atoi(argv[4]), k = atoi(argv[5]);
    int calls = argc > 7 ? atoi(argv[7]) : 400;
    st_backend *b;
    if (st_backend_cpu_create(nth, &b)) return 1;
    st_mat3 gate = q4k_stack(F, d, E), up = q4k_stack(F, d, E), down = q4k_stack(d, F, E);
    st_placement *pl;
    st_experts *ex;
    if (st_placement_create_host(1, E, &pl)) return 1;
    st_experts_params ep = {.placement = pl};
    if (st_experts_create(&ep, &ex)) return 1;
    int nmax = 64;
    float *x = st_alloc(sizeof(float) * (size_t)nmax * d), *y = st_alloc(sizeof(float) * (size_t)nmax * d);
    float *wt = st_alloc(sizeof(float) * (size_t)nmax * k);
    int32_t *ids = st_alloc(sizeof(int32_t) * (size_t)calls * nmax * k);
    double *times = st_alloc(sizeof(double) * (size_t)calls);
    for (int i = 0; i < nmax * d; i++) x[i] = sinf(0.37f * (float)i) + 0.1f * cosf(0.013f * (float)i);
    for (int i = 0; i < nmax * k; i++) wt[i] = 1.0f / (float)k;
    double gb_expert = (double)(gate.mat_bytes + up.mat_bytes + down.mat_bytes) / 1e9;
    printf("host_moe_bench: %d threads, d=%d F=%d E=%d k=%d q4_K, %d calls (%.0f MB of experts)\n", nth, d, F, E, k,
           calls, gb_expert * E * 1e3);
    FILE *sm = fopen("/proc/self/smaps_rollup", "r");
    for (char line[256]; sm && fgets(line, sizeof line, sm);)
        if (!strncmp(line, "AnonHugePages:", 14)) printf("%s", line);
    if (sm) fclose(sm);
    for (char *tok = strtok(argv[6], ","); tok; tok = strtok(NULL, ",")) {
        int n = atoi(tok);
        if (n < 1 || n > nmax) continue;
        for (int c = 0; c < calls; c++) // distinct experts within a row, as the router's top-k
            for (int i = 0; i < n; i++)
                for (int j = 0; j < k; j++) {
                    int32_t e, dup;
                    do {
                        e = (int32_t)(next_u64() % (uint64_t)E);
                        dup = 0;
                        for (int q = 0; q < j; q++) dup |= ids[((size_t)c * nmax + i) * k + q] == e;
                    } while (dup);
                    ids[((size_t)c * nmax + i) * k + j] = e;
                }
        double sum = 0, t_total = 0, best = 1e9, experts = 0;
        uint64_t hash = 1469598103934665603ull;
        for (int c = -20; c < calls; c++) { // 20 warm-up calls
            const int32_t *id = ids + (size_t)(c < 0 ? 0 : c) * nmax * k;
            st_moe_args a = {.layer = 0, .gate = &gate, .up = &up, .down = &down, .x = x, .ids = id,
                             .weights = wt, .n = n, .k = k, .y = y};
            double t0 = st_time_s();
            if (st_experts_compute(ex, b, &a, NULL)) {
                fprintf(stderr, "%s\n", st_error());
                return 1;
            }
            double dt = st_time_s() - t0;
            if (c < 0) continue;
            t_total += dt;
            times[c] = dt;
            if (dt < best) best = dt;
            uint8_t seen[4096] = {0};
            for (int i = 0; i < n * k; i++) experts += !seen[id[i]]++;
            for (int i = 0; i < n * d; i++) {
                uint32_t u;
                memcpy(&u, &y[i], 4);
                hash = (hash ^ u) * 1099511628211ull;
                sum += y[i];
            }
        }
        double mean = t_total / calls;
        qsort(times, (size_t)calls, sizeof(double), cmp_double);
        printf("n=%2d: %8.1f us/layer mean, %8.1f best, %8.1f median, %6.1f GB/s (%.1f experts/call), checksum %016llx\n",
               n, mean * 1e6, best * 1e6, times[calls / 2] * 1e6, experts / calls * gb_expert / mean, experts / calls,
               (unsigned long long)hash);
    }
    st_free(times);
    st_experts_free(ex);
    st_placement_free(pl);
    st_backend_free(b);
    return 0;
}
