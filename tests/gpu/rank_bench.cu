// rank_bench: how long the routing folded into the one-row gate/up kernel takes on its own: each
// block loads the router's logits (route_load), ranks them (route_rank, the code the kernel
// runs) and, in block 0, writes the ids and weights (route_weights). The gate/up kernel's trace
// gives the ranking (its marks 1 -> 2) ~1.4 us at the Qwen3-30B-A3B shape (128 logits, top 8)
// and ~2.5 us at the Next-80B-A3B shape (512, top 10) on an H200. Here the same code runs with
// nothing beside it, so the difference is what the kernel around it costs the ranking.
// Per shape and grid (blocks of 256 threads, as the gate/up kernel's), the mean over blocks of
// each phase in ns (%globaltimer): the logits' loads to the barrier, the ranking, and the whole
// block. The rows of logits hold ties, -inf and NaN as well.
//   nvcc -O3 -arch=sm_90 -std=c++17 -I src -I include -o rank_bench tests/gpu/rank_bench.cu && ./rank_bench
#include "backend/cuda/cuda_common.cuh"
#include "bench_graph.cuh"
#include <vector>

// times[blockIdx.x * 3 + {0, 1, 2}]: loaded, ranked, done (ns after the block's start). Block b
// ranks row b % rows of logits; block 0 writes row 0's ids.
__global__ void __launch_bounds__(256) rank_kernel(const float *logits, int rows, int E, int k, bool pairs, int32_t *ids,
                                                   float *w, unsigned long long *times) {
    __shared__ st_route_smem rs;
    unsigned long long t0 = st_globaltimer();
    route_load(logits + (size_t)(blockIdx.x % rows) * E, E, rs);
    __syncthreads();
    unsigned long long t1 = st_globaltimer();
    route_rank(E, k, rs, pairs);
    unsigned long long t2 = st_globaltimer();
    if (blockIdx.x == 0) route_weights(E, k, rs, ids, w, NULL);
    __syncthreads();
    if (threadIdx.x == 0) {
        times[3 * blockIdx.x + 0] = t1 - t0;
        times[3 * blockIdx.x + 1] = t2 - t1;
        times[3 * blockIdx.x + 2] = st_globaltimer() - t0;
    }
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("rank_bench: %s, %d multiprocessors; ns a block (mean over blocks, best of 20 launches by the whole)\n",
           prop.name, prop.multiProcessorCount);
    printf("%-22s %6s %6s %9s %9s %9s\n", "shape", "grid", "pairs", "load", "rank", "block");
    struct { const char *name; int E, k; } shapes[] = {{"30B-A3B (128, top 8)", 128, 8}, {"Next (512, top 10)", 512, 10}};
    int grids[] = {1, 132, 192, 264};
    // Rows of logits: random, some rounded to a coarse grid (ties), some with -inf and NaN.
    const int rows = 264;
    float *logits;
    int32_t *ids;
    float *w;
    unsigned long long *times;
    CK(cudaMalloc(&logits, sizeof(float) * 512 * rows));
    CK(cudaMalloc(&ids, sizeof(int32_t) * 16));
    CK(cudaMalloc(&w, sizeof(float) * 16));
    CK(cudaMalloc(&times, sizeof(unsigned long long) * 3 * 1024));
    std::vector<float> h((size_t)512 * rows);
    srand(1);
    for (int r = 0; r < rows; r++)
        for (int e = 0; e < 512; e++) {
            float v = (float)rand() / RAND_MAX * 8.0f - 4.0f;
            if (r % 3 == 1) v = (float)(int)(v * 2.0f) / 2.0f; // many ties
            if (r % 7 == 2 && e % 5 == 0) v = -INFINITY;
            if (r % 11 == 3 && e % 9 == 0) v = NAN;
            h[(size_t)r * 512 + e] = v;
        }
    CK(cudaMemcpy(logits, h.data(), sizeof(float) * h.size(), cudaMemcpyHostToDevice));
    std::vector<unsigned long long> t(3 * 1024);
    for (auto &s : shapes)
        for (int pairs = 0; pairs < 2; pairs++)
            for (int g : grids) {
                double best[3] = {1e30, 1e30, 1e30};
                for (int rep = 0; rep < 20; rep++) {
                    rank_kernel<<<g, 256>>>(logits, g < rows ? g : rows, s.E, s.k, pairs != 0, ids, w, times);
                    CK(cudaGetLastError());
                    CK(cudaDeviceSynchronize());
                    CK(cudaMemcpy(t.data(), times, sizeof(unsigned long long) * 3 * g, cudaMemcpyDeviceToHost));
                    double m[3] = {0, 0, 0};
                    for (int b = 0; b < g; b++)
                        for (int j = 0; j < 3; j++) m[j] += (double)t[3 * b + j] / g;
                    if (m[2] < best[2]) best[0] = m[0], best[1] = m[1], best[2] = m[2];
                }
                printf("%-22s %6d %6d %9.0f %9.0f %9.0f\n", s.name, g, pairs, best[0], best[1], best[2]);
            }
    return 0;
}
