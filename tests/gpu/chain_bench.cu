// chain_bench: what one kernel boundary costs on this GPU, for the decode graph's design.
// A CUDA graph of K small kernels, each reading what the one before wrote, timed per kernel:
//   plain  stream order, no programmatic dependent launch (PDL)
//   pdl    PDL; each kernel waits with griddepcontrol.wait (what Strata's kernels do)
//   flag   PDL, but each kernel waits for the one before by polling a counter its blocks
//          raise as they finish (release / acquire), not for the grid's completion
//   barrier one persistent kernel, K steps separated by a grid-wide barrier
// Also each with a realistic block: BYTES of weights read per block (prefetched before the
// wait, as Strata's matrix-vector kernels do).
//   nvcc -O3 -arch=sm_90 -o chain_bench tests/gpu/chain_bench.cu && ./chain_bench
#include "bench_graph.cuh"

__device__ __forceinline__ unsigned ld_acquire(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Weights a block reads (uint4 per thread per step), so the step is not empty.
__device__ __forceinline__ float read_w(const uint4 *w, int words) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < words; i += blockDim.x) {
        uint4 v = __ldg(w + i);
        s += __int_as_float((int)(v.x ^ v.y ^ v.z ^ v.w) & 0x3f800000);
    }
    return s;
}

__device__ __forceinline__ void prefetch(const uint4 *w, int words) {
    for (int i = threadIdx.x * 8; i < words; i += blockDim.x * 8)
        asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(w + i));
}

__global__ void k_plain(const float *in, float *out, const uint4 *w, int words) {
    const uint4 *mw = w + (size_t)blockIdx.x * words;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = in[i] + 1.0f + read_w(mw, words) * 0.0f;
}

__global__ void k_pdl(const float *in, float *out, const uint4 *w, int words) {
    const uint4 *mw = w + (size_t)blockIdx.x * words;
    prefetch(mw, words);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = in[i] + 1.0f + read_w(mw, words) * 0.0f;
}

// wait: the counter the kernel before raises (NULL for the first), target its block count.
__global__ void k_flag(const float *in, float *out, const uint4 *w, int words, const unsigned *wait, unsigned target,
                       unsigned *sig) {
    const uint4 *mw = w + (size_t)blockIdx.x * words;
    prefetch(mw, words);
    if (wait && threadIdx.x == 0)
        while (ld_acquire(wait) < target) {
        }
    __syncthreads();
    asm volatile("griddepcontrol.launch_dependents;" :::);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = __ldcg(in + i) + 1.0f + read_w(mw, words) * 0.0f;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(sig, 1u);
    }
}

__global__ void k_barrier(float *a, float *b, const uint4 *w, int words, int steps, unsigned *bar) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    for (int s = 0; s < steps; s++) {
        const uint4 *mw = w + ((size_t)s * gridDim.x + blockIdx.x) * words;
        prefetch(mw, words);
        float *in = s & 1 ? b : a, *out = s & 1 ? a : b;
        out[i] = __ldcg(in + i) + 1.0f + read_w(mw, words) * 0.0f;
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(bar, 1u);
            unsigned t = (unsigned)(s + 1) * gridDim.x;
            while (ld_acquire(bar) < t) {
            }
        }
        __syncthreads();
    }
}

static void launch(cudaStream_t st, bool pdl, void *fn, dim3 g, dim3 b, void **args) {
    bench_launch(st, fn, g, b, 0, pdl, args);
}

int main(int argc, char **argv) {
    int K = argc > 1 ? atoi(argv[1]) : 256;
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const int T = 256;
    int grids[] = {sms, 2 * sms};
    int bytes_list[] = {0, 32768, 98304};
    size_t wmax = (size_t)K * 2 * sms * 98304 / 16 + 1;
    uint4 *w;
    CK(cudaMalloc(&w, wmax * 16));
    CK(cudaMemset(w, 1, wmax * 16));
    float *a, *b;
    unsigned *ctr;
    CK(cudaMalloc(&a, sizeof(float) * 2 * sms * T));
    CK(cudaMalloc(&b, sizeof(float) * 2 * sms * T));
    CK(cudaMalloc(&ctr, sizeof(unsigned) * (K + 1)));
    printf("chain_bench: %d kernels a graph, %d threads a block, %d multiprocessors; us a kernel (best of 20 replays)\n",
           K, T, sms);
    printf("%-8s %-6s %-10s %8s\n", "variant", "grid", "KiB/block", "us");
    for (int gi = 0; gi < 2; gi++)
        for (int bi = 0; bi < 3; bi++) {
            int grid = grids[gi], words = bytes_list[bi] / 16;
            if (gi == 1 && bi == 2) continue; // 2 x 132 x 96 KiB x K > the buffer
            for (int v = 0; v < 4; v++) {
                const char *name[] = {"plain", "pdl", "flag", "barrier"};
                cudaGraph_t g;
                CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
                CK(cudaMemsetAsync(ctr, 0, sizeof(unsigned) * (K + 1), st));
                CK(cudaMemsetAsync(a, 0, sizeof(float) * 2 * sms * T, st));
                if (v == 3) {
                    int steps = K;
                    void *args[] = {&a, &b, &w, &words, &steps, &ctr};
                    launch(st, false, (void *)k_barrier, dim3(grid), dim3(T), args);
                } else {
                    for (int k = 0; k < K; k++) {
                        float *in = k & 1 ? b : a, *out = k & 1 ? a : b;
                        const uint4 *mw = w + (size_t)k * grid * words;
                        if (v == 2) {
                            const unsigned *wait = k ? ctr + k - 1 : NULL;
                            unsigned target = grid;
                            unsigned *sig = ctr + k;
                            void *args[] = {&in, &out, &mw, &words, &wait, &target, &sig};
                            launch(st, k > 0, (void *)k_flag, dim3(grid), dim3(T), args);
                        } else {
                            void *args[] = {&in, &out, &mw, &words};
                            launch(st, v == 1 && k > 0, v == 1 ? (void *)k_pdl : (void *)k_plain, dim3(grid), dim3(T), args);
                        }
                    }
                }
                CK(cudaStreamEndCapture(st, &g));
                float best = bench_replay_ms(st, g, 20);
                // Every step added 1 to every element from 0: the last holds K if the chain ran in order.
                float h = 0;
                CK(cudaMemcpy(&h, K & 1 ? b : a, sizeof(float), cudaMemcpyDeviceToHost));
                printf("%-8s %-6d %-10d %8.2f%s\n", name[v], grid, bytes_list[bi] / 1024, best * 1000.0f / K,
                       h == K ? "" : "  (order broken)");
            }
        }
    return 0;
}
