// bench: the llama.cpp side of bench/results/2026-11-29-cpu-kernels.md. Times ggml's CPU
// matrix-vector product (ggml_mul_mat, one f32 activation row, a persistent ggml threadpool) on
// the shapes `strata bench kernels` uses, and prints GB/s of weight bytes in the same table.
// Not part of the build: compile it against a llama.cpp checkout (see the results file):
//   cc -O2 bench/llamacpp_matvec.c -I$LLAMA/ggml/include -L$B/bin -lggml -lggml-base -lggml-cpu
//   usage: llamacpp_matvec THREADS BIG_MIB TYPE[,TYPE...] [SECONDS]

#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-cpu.h"
#include "ggml.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t rng = 0x2545f4914f6cdd1dull;
static uint64_t rnd64(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

// Random quants with normal fp16 scales (offsets of the scale fields per block, as in
// src/cli/cmd_bench.c; the layouts are ggml's).
static void fill(enum ggml_type t, uint8_t *w, size_t bytes, int64_t n_elems) {
    if (t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16) {
        float *f = malloc(sizeof(float) * (size_t)n_elems);
        for (int64_t i = 0; i < n_elems; i++) f[i] = (float)((rnd64() >> 40) / 8388608.0 - 1.0);
        if (t == GGML_TYPE_F32) memcpy(w, f, bytes);
        else if (t == GGML_TYPE_F16) ggml_fp32_to_fp16_row(f, (ggml_fp16_t *)w, n_elems);
        else ggml_fp32_to_bf16_row(f, (ggml_bf16_t *)w, n_elems);
        free(f);
        return;
    }
    for (size_t i = 0; i + 8 <= bytes; i += 8) {
        uint64_t v = rnd64();
        memcpy(w + i, &v, 8);
    }
    int off[2] = {0, 0}, k = 1;
    off[0] = 0;
    switch (t) {
    case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_1: case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K:
        off[1] = 2, k = 2;
        break;
    case GGML_TYPE_Q2_K: off[0] = 80, off[1] = 82, k = 2; break;
    case GGML_TYPE_Q3_K: off[0] = 108; break;
    case GGML_TYPE_Q6_K: off[0] = 208; break;
    case GGML_TYPE_IQ1_M: k = 0; break;
    default: break;
    }
    ggml_fp16_t d = ggml_fp32_to_fp16(0.01f);
    size_t bb = ggml_type_size(t);
    for (size_t b = 0; b < bytes / bb; b++) {
        uint8_t *blk = w + b * bb;
        for (int j = 0; j < k; j++) memcpy(blk + off[j], &d, 2);
        if (t == GGML_TYPE_IQ1_M)
            for (int j = 0; j < 4; j++) blk[48 + 2 * j + 1] = (uint8_t)((blk[48 + 2 * j + 1] & 15) | (((d >> 4 * j) & 15) << 4));
    }
}

static double time_one(enum ggml_type t, int64_t rows, int64_t n, int threads, double budget) {
    size_t wbytes = ggml_row_size(t, n) * (size_t)rows;
    struct ggml_init_params ip = {.mem_size = wbytes + (size_t)n * 4 + (size_t)rows * 4 + (1 << 20), .mem_buffer = NULL, .no_alloc = false};
    struct ggml_context *ctx = ggml_init(ip);
    struct ggml_tensor *w = ggml_new_tensor_2d(ctx, t, n, rows);
    struct ggml_tensor *x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, 1);
    fill(t, w->data, wbytes, n * rows);
    for (int64_t i = 0; i < n; i++) ((float *)x->data)[i] = (float)((rnd64() >> 40) / 8388608.0 - 1.0);
    struct ggml_tensor *y = ggml_mul_mat(ctx, w, x);
    struct ggml_cgraph *gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    struct ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
    struct ggml_threadpool *tp = ggml_threadpool_new(&tpp);
    struct ggml_cplan plan = ggml_graph_plan(gf, threads, tp);
    uint8_t *work = malloc(plan.work_size + 64);
    plan.work_data = work;
    ggml_graph_compute(gf, &plan); // warm
    double t0 = now_s();
    ggml_graph_compute(gf, &plan);
    double once = now_s() - t0;
    int per = once > 0 ? (int)(0.05 / once) : 1000;
    if (per < 1) per = 1;
    double best = 0, start = now_s();
    do {
        t0 = now_s();
        for (int i = 0; i < per; i++) ggml_graph_compute(gf, &plan);
        double gbs = (double)wbytes * per / (now_s() - t0) / 1e9;
        if (gbs > best) best = gbs;
    } while (now_s() - start < budget);
    free(work);
    ggml_threadpool_free(tp);
    ggml_free(ctx);
    return best;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s THREADS BIG_MIB TYPE[,TYPE...] [SECONDS]\n", argv[0]);
        return 2;
    }
    int threads = atoi(argv[1]);
    size_t big_bytes = (size_t)atol(argv[2]) << 20;
    double budget = argc > 4 ? atof(argv[4]) : 0.3;
    ggml_cpu_init();
    printf("| type    | shape        | MiB    | 1 thr GB/s | %3d thr GB/s |\n", threads);
    printf("|---------|--------------|--------|------------|--------------|\n");
    char buf[512];
    snprintf(buf, sizeof buf, "%s", argv[3]);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        int t = -1;
        for (int i = 0; i < GGML_TYPE_COUNT; i++) {
            const char *nm = ggml_type_name((enum ggml_type)i);
            if (nm && ggml_type_size((enum ggml_type)i) && !strcmp(nm, tok)) t = i;
        }
        if (t < 0) {
            fprintf(stderr, "unknown type %s\n", tok);
            return 2;
        }
        int64_t shapes[3][2] = {{4096, 4096}, {768, 2048}, {0, 4096}};
        for (int s = 0; s < 3; s++) {
            int64_t rows = shapes[s][0], n = shapes[s][1];
            if (!rows) rows = (int64_t)((big_bytes / ggml_row_size((enum ggml_type)t, n) + 63) & ~(size_t)63);
            double g1 = time_one((enum ggml_type)t, rows, n, 1, budget);
            double gn = threads > 1 ? time_one((enum ggml_type)t, rows, n, threads, budget) : g1;
            char shape[32];
            snprintf(shape, sizeof shape, "%lldx%lld", (long long)rows, (long long)n);
            printf("| %-7s | %-12s | %6.1f | %10.2f | %12.2f |\n", tok, shape,
                   ggml_row_size((enum ggml_type)t, n) * (double)rows / 1048576.0, g1, gn);
            fflush(stdout);
        }
    }
    return 0;
}
