// bench: one core, strata's dot kernels next to ggml's (llama.cpp) on the same weight rows, timed
// in thread CPU time (so a loaded, shared machine still gives usable ratios), and the two results
// compared as a cross-check of the formats. Weights: 1024 random rows of 4096 (cache-resident
// on purpose: this measures the kernels' arithmetic, not memory). Not part of the build; from
// the repository root, with build/ a Release build and ggml built from a llama.cpp checkout:
//   cc -O2 -std=c11 -D_GNU_SOURCE bench/llamacpp_dot.c -Isrc -I$LLAMA/ggml/include
//      build/libst_quant.a build/libst_util.a -L<ggml libs> -lggml-cpu -lggml-base -lm -lpthread
//   usage: llamacpp_dot [avx2|avx512|scalar] TYPE[,TYPE...]

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-cpu.h"
#include "ggml.h"
#include "quant/quant.h"

#define N 4096
#define ROWS 1024

static double cpu_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

static uint64_t rng = 0x2545f4914f6cdd1dull;
static uint64_t rnd64(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

// Random blocks with normal fp16 scales (the same offsets as src/cli/cmd_bench.c).
static void fill(st_type t, uint8_t *w, size_t bytes) {
    const st_type_info *ti = st_type_get(t);
    if (!ti->quantized) {
        float *f = malloc(sizeof(float) * (bytes / (size_t)ti->block_bytes));
        for (size_t i = 0; i < bytes / (size_t)ti->block_bytes; i++) f[i] = (float)((rnd64() >> 40) / 8388608.0 - 1.0);
        st_quantize(t, f, w, (int64_t)(bytes / (size_t)ti->block_bytes));
        free(f);
        return;
    }
    for (size_t i = 0; i + 8 <= bytes; i += 8) {
        uint64_t v = rnd64();
        memcpy(w + i, &v, 8);
    }
    int off[2] = {0, 0}, k = 1;
    switch (t) {
    case ST_TYPE_Q4_1: case ST_TYPE_Q5_1: case ST_TYPE_Q4_K: case ST_TYPE_Q5_K: off[1] = 2, k = 2; break;
    case ST_TYPE_Q2_K: off[0] = 80, off[1] = 82, k = 2; break;
    case ST_TYPE_Q3_K: off[0] = 108; break;
    case ST_TYPE_Q6_K: off[0] = 208; break;
    case ST_TYPE_IQ1_M: k = 0; break;
    default: break;
    }
    st_f16 d = st_f32_to_f16(0.01f);
    for (size_t b = 0; b < bytes / (size_t)ti->block_bytes; b++) {
        uint8_t *blk = w + b * (size_t)ti->block_bytes;
        for (int j = 0; j < k; j++) memcpy(blk + off[j], &d, 2);
        if (t == ST_TYPE_IQ1_M)
            for (int j = 0; j < 4; j++) blk[48 + 2 * j + 1] = (uint8_t)((blk[48 + 2 * j + 1] & 15) | (((d >> 4 * j) & 15) << 4));
    }
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s scalar|avx2|avx512 TYPE[,TYPE...]\n", argv[0]);
        return 2;
    }
    st_cpu_path path = ST_CPU_SCALAR;
    for (int p = 0; p < ST_CPU_PATH_COUNT; p++)
        if (!strcmp(argv[1], st_cpu_path_name((st_cpu_path)p))) path = (st_cpu_path)p;
    if (st_cpu_path_set(path) != ST_OK) {
        fprintf(stderr, "%s\n", st_error());
        return 1;
    }
    ggml_cpu_init();
    printf("| type    | strata %-6s GB/s | ggml GB/s | strata/ggml | max rel diff of results |\n", argv[1]);
    printf("|---------|------------------|-----------|-------------|-------------------------|\n");
    char buf[512];
    snprintf(buf, sizeof buf, "%s", argv[2]);
    static float xf[N], ys[ROWS], yg[ROWS];
    for (int i = 0; i < N; i++) xf[i] = (float)((rnd64() >> 40) / 8388608.0 - 1.0);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        st_type t;
        if (!st_type_from_name(tok, &t)) {
            fprintf(stderr, "unknown type %s\n", tok);
            return 2;
        }
        const st_type_info *ti = st_type_get(t);
        const struct ggml_type_traits_cpu *gt = ggml_get_type_traits_cpu((enum ggml_type)t);
        const struct ggml_type_traits_cpu *gdt = ggml_get_type_traits_cpu(gt->vec_dot_type);
        size_t rb = st_row_bytes(t, N);
        uint8_t *w = malloc(rb * ROWS);
        uint8_t *xs = malloc(st_row_bytes(ti->dot_type, N) + 64), *xg = malloc(ggml_row_size(gt->vec_dot_type, N) + 64);
        fill(t, w, rb * ROWS);
        st_quantize(ti->dot_type, xf, xs, N);
        if (gdt->from_float) gdt->from_float(xf, xg, N);
        else memcpy(xg, xf, sizeof xf); // f32
        double best_s = 1e9, best_g = 1e9;
        for (int rep = 0; rep < 20; rep++) {
            double t0 = cpu_s();
            for (int o = 0; o < ROWS; o++) ys[o] = st_vec_dot(t, N, w + (size_t)o * rb, xs);
            double t1 = cpu_s();
            for (int o = 0; o < ROWS; o++) gt->vec_dot(N, &yg[o], 0, w + (size_t)o * rb, 0, xg, 0, 1);
            double t2 = cpu_s();
            if (t1 - t0 < best_s) best_s = t1 - t0;
            if (t2 - t1 < best_g) best_g = t2 - t1;
        }
        double worst = 0, mag = 0;
        for (int o = 0; o < ROWS; o++) mag = fmax(mag, fabs(yg[o]));
        for (int o = 0; o < ROWS; o++) worst = fmax(worst, fabs(ys[o] - yg[o]) / (mag > 0 ? mag : 1));
        double bytes = (double)rb * ROWS;
        printf("| %-7s | %16.2f | %9.2f | %11.2f | %23.2g |\n", tok, bytes / best_s / 1e9, bytes / best_g / 1e9,
               best_g / best_s, worst);
        free(w);
        free(xs);
        free(xg);
    }
    return 0;
}
