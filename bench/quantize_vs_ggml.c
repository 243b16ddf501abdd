// bench: Strata's weight quantizers (st_quantize_weights) against ggml's (ggml_quantize_chunk
// without an importance matrix, what `llama-quantize` does by default) on the same Gaussian
// rows: relative RMSE (both decoded by st_dequantize), whether the bytes are identical, and
// single-thread throughput in MB/s of f32 input (process CPU time, so a loaded machine still
// gives comparable figures). Results: bench/results/2026-11-29-quantize.md.
// Not part of the build: compile it against a llama.cpp build and a Strata Release build:
//   cc -O2 -std=gnu11 bench/quantize_vs_ggml.c -Isrc -I$LLAMA/ggml/include $B/libst_quant.a
//      $B/libst_util.a -L$LB/bin -lggml -lggml-base -lggml-cpu -lm -lpthread -Wl,-rpath,$LB/bin
//   usage: quantize_vs_ggml [ROWS [N]]   (default 256 rows of 4096)

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml.h"
#include "quant/quant.h"

static uint64_t rng = 0x1234567887654321ull;

static double uniform(void) { // splitmix64 -> (0, 1)
    uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return ((double)((z ^ (z >> 31)) >> 11) + 0.5) / 9007199254740992.0;
}

static double rel_rmse(st_type t, const void *q, const float *x, float *y, int64_t n) {
    st_dequantize(t, q, y, n);
    double se = 0, ss = 0;
    for (int64_t i = 0; i < n; i++) {
        se += ((double)y[i] - x[i]) * ((double)y[i] - x[i]);
        ss += (double)x[i] * x[i];
    }
    return sqrt(se / ss);
}

int main(int argc, char **argv) {
    int64_t rows = argc > 1 ? atoll(argv[1]) : 256, n = argc > 2 ? atoll(argv[2]) : 4096;
    if (rows < 1 || n < 256 || n % 256) {
        fprintf(stderr, "usage: quantize_vs_ggml [ROWS [N]] (N a multiple of 256)\n");
        return 2;
    }
    float *x = malloc((size_t)(rows * n) * sizeof *x), *y = malloc((size_t)(rows * n) * sizeof *y);
    for (int64_t i = 0; i < rows * n; i += 2) { // Box-Muller pairs
        double r = sqrt(-2.0 * log(uniform())), a = 6.283185307179586 * uniform();
        x[i] = (float)(r * cos(a));
        if (i + 1 < rows * n) x[i + 1] = (float)(r * sin(a));
    }
    static const char *names[] = {"q8_0", "q6_K", "q5_K", "q5_1", "q5_0", "q4_K", "q4_1",
                                  "q4_0", "iq4_nl", "iq4_xs", "q3_K", "q2_K"};
    ggml_quantize_init(GGML_TYPE_IQ4_XS); // ggml's IQ tables
    ggml_quantize_init(GGML_TYPE_IQ4_NL);
    printf("%-7s %12s %12s %11s %11s  %s\n", "type", "ggml rmse", "strata rmse", "ggml MB/s", "strata MB/s",
           "bytes");
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        st_type t;
        if (!st_type_from_name(names[k], &t)) return 1;
        size_t bytes = st_row_bytes(t, n) * (size_t)rows;
        void *qg = malloc(bytes), *qs = malloc(bytes);
        clock_t c0 = clock();
        ggml_quantize_chunk((enum ggml_type)t, x, qg, 0, rows, n, NULL); // same ids as ggml
        double tg = (double)(clock() - c0) / CLOCKS_PER_SEC;
        c0 = clock();
        st_quantize_weights(t, x, qs, rows, n);
        double ts = (double)(clock() - c0) / CLOCKS_PER_SEC;
        double mb = (double)(rows * n) * 4 / 1e6;
        printf("%-7s %12.4e %12.4e %11.1f %11.1f  %s\n", names[k], rel_rmse(t, qg, x, y, rows * n),
               rel_rmse(t, qs, x, y, rows * n), mb / tg, mb / ts, memcmp(qg, qs, bytes) ? "differ" : "identical");
        free(qg);
        free(qs);
    }
    free(x);
    free(y);
    return 0;
}
