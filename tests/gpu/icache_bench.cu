// icache_bench: what a decode kernel pays for running code that is not in the multiprocessors'
// instruction caches. A decode layer runs six kernels of 60-110 KB of SASS each (cuobjdump), so
// each one's code is likely gone by the time the next layer runs it again, and ncu counts 5-43%
// of their warps' stalls as "no instruction". Here: a CUDA graph of K PDL kernels (each waits
// first, as Strata's do), every kernel a straight run of S bytes of independent FMAs (4 chains a
// thread, ~76 bytes of SASS a step). Warm: the same kernel K times (its code stays cached). Cold:
// 32 different kernels of the same size in turn (32 x S evicts each before its next turn, for S
// of a few KB and up). us a kernel, best of 10 replays; cold minus warm is what fetching S bytes
// of code from L2 costs a kernel that runs it once, per block count (one or two blocks a
// multiprocessor share its caches).
//   nvcc -O3 -arch=sm_90 -o icache_bench tests/gpu/icache_bench.cu && ./icache_bench [K]
#include "bench_graph.cuh"
#include <utility>

#define T 256
#define NK 32 // different kernels of one size

// N steps of 4 FMAs with immediates that differ by step and by SALT (~76 bytes of SASS a step), and
// no two kernels share code. The dependent chains keep the compiler from folding anything.
template <int N, int SALT> __global__ void __launch_bounds__(T) k_code(float *out, float seed) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
    float a0 = seed + threadIdx.x, a1 = a0 + 1.0f, a2 = a0 + 2.0f, a3 = a0 + 3.0f;
#pragma unroll
    for (int i = 0; i < N; i++) {
        const float c = 1.0f + (float)((i * 7 + SALT * 131) % 997) * 1e-7f;
        a0 = fmaf(a0, c, 0.5f);
        a1 = fmaf(a1, c, 0.25f);
        a2 = fmaf(a2, c, 0.125f);
        a3 = fmaf(a3, c, 0.0625f);
    }
    if (a0 + a1 + a2 + a3 == 1234.5f) out[threadIdx.x] = a0; // (never: keeps the chains)
}

__global__ void k_empty(float *out, float seed) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
    if (seed == 1234.5f) out[threadIdx.x] = seed;
}

template <int N, int... S> static void table(void **t, std::integer_sequence<int, S...>) {
    void *v[] = {(void *)k_code<N, S>...};
    for (int i = 0; i < (int)sizeof...(S); i++) t[i] = v[i];
}

// us a kernel of a graph of K launches, kernel k being fns[k % nf].
static float graph_us(cudaStream_t st, void *const *fns, int nf, int K, int grid, float *out) {
    float seed = 0.5f;
    void *args[] = {&out, &seed};
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int k = 0; k < K; k++) bench_launch(st, fns[k % nf], dim3(grid), dim3(T), 0, true, args);
    CK(cudaStreamEndCapture(st, &g));
    return bench_replay_ms(st, g, 10) * 1000.0f / K;
}

int main(int argc, char **argv) {
    int K = argc > 1 ? atoi(argv[1]) : 128;
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    float *out;
    CK(cudaMalloc(&out, T * sizeof(float)));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    static void *t1[NK], *t2[NK], *t3[NK], *t4[NK];
    auto seq = std::make_integer_sequence<int, NK>();
    table<32>(t1, seq);
    table<128>(t2, seq);
    table<384>(t3, seq);
    table<1024>(t4, seq);
    void **tabs[] = {t1, t2, t3, t4};
    int steps[] = {32, 128, 384, 1024};
    // Their SASS (cuobjdump -sass, sm_90, CUDA 13.0; the immediates take a MOV each 8 FMAs).
    double sass_kb[] = {3.0, 10.5, 30.25, 77.6};
    void *empty = (void *)k_empty;
    int grids[] = {sms, 2 * sms};
    printf("K = %d kernels a graph, %d threads a block, %d multiprocessors\n", K, T, sms);
    for (int gi = 0; gi < 2; gi++) {
        int grid = grids[gi];
        float e = graph_us(st, &empty, 1, K, grid, out);
        printf("\n%d blocks: empty kernel %.2f us\n", grid, e);
        printf("%-9s %9s %9s %9s %9s %14s\n", "steps", "sass_KB", "warm_us", "cold_us", "cold-warm", "ns per KB");
        for (int s = 0; s < 4; s++) {
            float w = graph_us(st, tabs[s], 1, K, grid, out), c = graph_us(st, tabs[s], NK, K, grid, out);
            double kb = sass_kb[s];
            printf("%-9d %9.1f %9.2f %9.2f %9.2f %14.1f\n", steps[s], kb, w, c, c - w, (c - w) * 1000.0 / kb);
        }
    }
    CK(cudaFree(out));
    return 0;
}
