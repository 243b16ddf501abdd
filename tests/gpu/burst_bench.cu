// burst_bench: how fast one decode kernel can read a burst of weights it learns only after its
// wait (the routed experts: ~14 MB of gate/up rows at the Qwen3-30B-A3B shape), cold in L2.
// A CUDA graph of K kernels (PDL, each waiting first, as Strata's gate/up kernel waits for the
// router), kernel k reading its own burst of BYTES: G blocks of 256 threads, each block a
// contiguous slice. The bursts lie far apart in a 2 GiB buffer, so none is in L2. Per way of
// reading, us a kernel and the burst's rate (TB/s; net_TB/s: the empty kernels' time subtracted):
//   loads     the threads' own 16-byte loads, 8 in flight a thread
//   loads32   32 in flight a thread (the block's slice at once where it fits)
//   bulkpf    cp.async.bulk.prefetch.L2 of the slice (one a warp, as the gate/up kernel's rows),
//             then the loads
//   linepf    prefetch.global.L2 of every line of the slice, then the loads
//   cpasync   cp.async of the slice into shared memory (16 bytes a thread a copy), then reads it
//   bulkcp    one cp.async.bulk copy a warp into shared memory (the copy engine), then reads it
//   bulkrows  the same bytes a warp in copies of 1,152 bytes (one Q4_K row of 2,048 columns each,
//             as the staged gate/up kernel copies them): what a copy's
//             size costs
// Also the rate of one kernel streaming 1 GiB (the copy-rate bound's figure), and the experts'
// layout: the 30B-A3B's gate/up kernel's 192 blocks (24 row tiles x 8 experts), each reading its
// 32 gate rows and 32 up rows (two 36 KiB slices) of 8 experts drawn at random from a layer's
// 128, layers one after another in a buffer of L layers (L = 6: 2 GB; L = 45: 15 GB, a 48-layer
// model's experts), against the same bytes as one contiguous slice a block. If the experts are
// slower than the contiguous burst, the scattered matrices (DRAM pages, address translation)
// cost the kernel; if not, its own structure does.
//   nvcc -O3 -arch=sm_90 -o burst_bench tests/gpu/burst_bench.cu && ./burst_bench [K]
#include "bench_graph.cuh"
#include <cstdint>

#define T 256
#define SMEM_MAX (200 * 1024)

__device__ __forceinline__ uint4 ld_ef(const uint4 *p, unsigned long long pol) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(pol));
    return v;
}

// The slice's words read with NF loads in flight a thread.
template <int NF> __device__ __forceinline__ unsigned read_loads(const uint4 *w, int words, unsigned long long pol) {
    unsigned s = 0;
    for (int i0 = threadIdx.x; i0 < words; i0 += T * NF) {
        uint4 v[NF];
#pragma unroll
        for (int j = 0; j < NF; j++) {
            int i = i0 + j * T;
            v[j] = i < words ? ld_ef(w + i, pol) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < NF; j++) s += fold(v[j]);
    }
    return s;
}

// Two slices of words each, a thread's loads of both in flight together.
template <int NF>
__device__ __forceinline__ unsigned read_loads2(const uint4 *a, const uint4 *b, int words, unsigned long long pol) {
    unsigned s = 0;
    for (int i0 = threadIdx.x; i0 < words; i0 += T * NF) {
        uint4 v[2 * NF];
#pragma unroll
        for (int j = 0; j < NF; j++) {
            int i = i0 + j * T;
            v[j] = i < words ? ld_ef(a + i, pol) : make_uint4(0, 0, 0, 0);
            v[NF + j] = i < words ? ld_ef(b + i, pol) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < 2 * NF; j++) s += fold(v[j]);
    }
    return s;
}

__device__ __forceinline__ unsigned read_smem(const uint4 *s, int words) {
    unsigned r = 0;
    for (int i = threadIdx.x; i < words; i += T) r += fold(s[i]);
    return r;
}

// Copies of `piece` 16-byte words at a time, n16 words from src into shared dst, counted on bar.
__device__ __forceinline__ void bulk_copy(unsigned dst, const uint4 *src, int n16, int piece, unsigned bar,
                                          unsigned long long pol) {
    for (int o = 0; o < n16; o += piece) {
        int n = n16 - o < piece ? n16 - o : piece;
        bulk(dst + 16 * o, src + o, n * 16, bar, pol);
    }
}

enum { V_EMPTY, V_LOADS, V_LOADS32, V_BULKPF, V_LINEPF, V_CPASYNC, V_BULKCP, V_BULKROWS, NV };
static const char *vname[NV] = {"empty", "loads", "loads32", "bulkpf", "linepf", "cpasync", "bulkcp", "bulkrows"};

// segs (or NULL: block b's slice is words at w + b * words): block b reads words / 2 at w + segs[2b]
// and words / 2 at w + segs[2b + 1] (its gate and up rows), both slices' loads in flight together
// (loads and loads32; bulkcp: a quarter of one slice a warp, by the copy engine, as the staged
// gate/up kernel copies them).
template <int V>
__global__ void __launch_bounds__(T) k_burst(const uint4 *w, int words, unsigned *out, const long long *segs) {
    extern __shared__ uint4 sm[];
    pdl_begin();
    const uint4 *mw = w + (size_t)blockIdx.x * words;
    if (segs) {
        const uint4 *a = w + segs[2 * blockIdx.x], *b = w + segs[2 * blockIdx.x + 1];
        unsigned long long pol = evict_first();
        if (V == V_BULKCP) { // as the staged gate/up kernel: a quarter of one slice a warp, the copy engine
            __shared__ alignas(8) unsigned long long bar[8];
            int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, per = words / 2 / 4;
            unsigned bb = (unsigned)__cvta_generic_to_shared(&bar[warp]);
            if (lane == 0) {
                mbar_init(bb, per * 16);
                bulk_copy((unsigned)__cvta_generic_to_shared(sm + warp * per), (warp < 4 ? a : b) + (warp & 3) * per, per,
                          per, bb, pol);
            }
            __syncwarp();
            mbar_wait(bb);
            unsigned s = 0;
            for (int i = lane; i < per; i += 32) s += fold(sm[warp * per + i]);
            if (s == 0x12345678u) out[blockIdx.x] = s;
            return;
        }
        // (8 or 32 loads in flight a thread, as the contiguous variants)
        unsigned s = V == V_LOADS32 ? read_loads2<16>(a, b, words / 2, pol) : read_loads2<4>(a, b, words / 2, pol);
        if (s == 0x12345678u) out[blockIdx.x] = s;
        return;
    }
    unsigned long long pol = evict_first();
    unsigned s = 0;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = T / 32;
    // A warp's share of the slice, in 16-byte words.
    int per = (words + nw - 1) / nw, w0 = warp * per, wn = words - w0 < per ? words - w0 : per;
    if (V == V_LOADS) s = read_loads<8>(mw, words, pol);
    if (V == V_LOADS32) s = read_loads<32>(mw, words, pol);
    if (V == V_BULKPF) {
        if (lane == 0 && wn > 0)
            asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(mw + w0), "r"(wn * 16),
                         "l"(pol)
                         : "memory");
        s = read_loads<8>(mw, words, pol);
    }
    if (V == V_LINEPF) {
        for (int i = threadIdx.x * 8; i < words; i += T * 8) asm volatile("prefetch.global.L2 [%0];" ::"l"(mw + i));
        s = read_loads<8>(mw, words, pol);
    }
    if (V == V_CPASYNC) {
        for (int i = threadIdx.x; i < words; i += T) {
            unsigned a = (unsigned)__cvta_generic_to_shared(sm + i);
            asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(a), "l"(mw + i), "l"(pol));
        }
        asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
        __syncthreads();
        s = read_smem(sm, words);
    }
    if (V == V_BULKCP || V == V_BULKROWS) {
        __shared__ alignas(8) unsigned long long bar[8];
        unsigned b = (unsigned)__cvta_generic_to_shared(&bar[warp]);
        if (lane == 0) mbar_init(b, wn > 0 ? wn * 16 : 0);
        __syncwarp();
        if (lane == 0 && wn > 0) // (V_BULKROWS: copies of 72 words, 1,152 bytes)
            bulk_copy((unsigned)__cvta_generic_to_shared(sm + w0), mw + w0, wn, V == V_BULKROWS ? 72 : wn, b, pol);
        if (wn > 0) mbar_wait(b);
        for (int i = lane; i < wn; i += 32) s += fold(sm[w0 + i]);
    }
    if (s == 0x12345678u) out[blockIdx.x] = s; // (keeps the reads)
}

static void *kernel_of(int v) {
    switch (v) {
    case V_EMPTY: return (void *)k_burst<V_EMPTY>;
    case V_LOADS: return (void *)k_burst<V_LOADS>;
    case V_LOADS32: return (void *)k_burst<V_LOADS32>;
    case V_BULKPF: return (void *)k_burst<V_BULKPF>;
    case V_LINEPF: return (void *)k_burst<V_LINEPF>;
    case V_CPASYNC: return (void *)k_burst<V_CPASYNC>;
    case V_BULKCP: return (void *)k_burst<V_BULKCP>;
    default: return (void *)k_burst<V_BULKROWS>;
    }
}

__global__ void k_stream(const uint4 *w, size_t words, unsigned *out) {
    unsigned s = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x)
        s += fold(__ldcs(w + i));
    if (s == 0x12345678u) out[0] = s;
}

// One graph of K launches of variant v (kernel k reading from w + k * stride words, with segment
// table segs + k * nseg when segs is given), replayed 10 times: the best replay's us a kernel.
static float graph_us(cudaStream_t st, int K, int v, int grid, size_t smem, const uint4 *w, size_t stride, int words,
                      unsigned *out, const long long *segs, size_t nseg) {
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int k = 0; k < K; k++) {
        const uint4 *mw = w + (size_t)k * stride;
        const long long *sk = segs ? segs + (size_t)k * nseg : NULL;
        void *args[] = {&mw, &words, &out, &sk};
        bench_launch(st, kernel_of(v), dim3(grid), dim3(T), smem, true, args);
    }
    CK(cudaStreamEndCapture(st, &g));
    return bench_replay_ms(st, g, 10) * 1000.0f / K;
}

// The experts' layout (see the top): the 30B-A3B's gate/up matrices, 768 rows of 1,152 bytes (Q4_K,
// 2,048 columns), gate stack then up stack then down stack a layer; kernel k reads layer k % L.
static void experts(cudaStream_t st, int K) {
    const size_t mat = 768 * 1152, layer = 128 * (2 * mat + mat / 2), tile = 32 * 1152;
    const int G = 192, words = (int)(2 * tile / 16);
    int layers[] = {6, 48};
    size_t total = layer * 48;
    uint4 *w;
    unsigned *out;
    if (cudaMalloc(&w, total) != cudaSuccess) {
        cudaGetLastError();
        printf("experts: %.1f GB not free, skipped\n", total / 1e9);
        return;
    }
    CK(cudaMemset(w, 1, total));
    CK(cudaMalloc(&out, 1 << 20));
    long long *segs;
    CK(cudaMalloc(&segs, sizeof(long long) * 2 * G * K));
    long long *h = (long long *)malloc(sizeof(long long) * 2 * G * K);
    printf("experts: %d kernels a graph, %d blocks of 2 x %zu KiB (%.1f MB a kernel); best of 10 replays\n", K, G,
           tile / 1024, G * 2 * tile / 1e6);
    printf("%-9s %-12s %9s %9s\n", "variant", "layout", "us", "TB/s");
    srand(7);
    for (int lay = 0; lay < 3; lay++) { // contiguous, then experts in 6 and in 48 layers
        for (int k = 0; k < K; k++) {
            int ex[8];
            for (int y = 0; y < 8; y++) { // 8 distinct experts of 128
                int e, dup;
                do {
                    e = rand() % 128, dup = 0;
                    for (int j = 0; j < y; j++) dup |= ex[j] == e;
                } while (dup);
                ex[y] = e;
            }
            for (int b = 0; b < G; b++) {
                long long *o = h + (size_t)k * 2 * G + 2 * b;
                if (lay == 0) {
                    size_t base = total / K / 4096 * 4096 * k + (size_t)b * 2 * tile;
                    o[0] = base / 16, o[1] = (base + tile) / 16;
                } else {
                    size_t base = layer * (k % layers[lay - 1]);
                    int x = b % 24, e = ex[b / 24];
                    o[0] = (base + e * mat + x * tile) / 16;
                    o[1] = (base + 128 * mat + e * mat + x * tile) / 16;
                }
            }
        }
        CK(cudaMemcpy(segs, h, sizeof(long long) * 2 * G * K, cudaMemcpyHostToDevice));
        char name[32];
        snprintf(name, sizeof name, lay == 0 ? "contiguous" : "experts/%d", lay == 0 ? 0 : layers[lay - 1]);
        for (int v : {V_LOADS, V_LOADS32, V_BULKCP}) {
            float us = graph_us(st, K, v, G, v == V_BULKCP ? (size_t)words * 16 : 0, w, 0, words, out, segs, 2 * G);
            printf("%-9s %-12s %9.2f %9.2f\n", vname[v], name, us, G * 2 * tile / 1e6 / us);
        }
    }
    free(h);
    CK(cudaFree(segs));
    CK(cudaFree(out));
    CK(cudaFree(w));
}

int main(int argc, char **argv) {
    int K = argc > 1 ? atoi(argv[1]) : 64;
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    size_t total = (size_t)2 << 30;
    uint4 *w;
    unsigned *out;
    CK(cudaMalloc(&w, total));
    CK(cudaMemset(w, 1, total));
    CK(cudaMalloc(&out, 1 << 20));
    for (int v = 0; v < NV; v++)
        CK(cudaFuncSetAttribute(kernel_of(v), cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_MAX));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));

    // The copy-rate figure: one kernel reading 1 GiB.
    {
        float best = 1e30f;
        for (int r = 0; r < 5; r++) {
            CK(cudaEventRecord(e0, st));
            k_stream<<<sms * 8, 256, 0, st>>>(w, (size_t)(1 << 30) / 16, out);
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            best = ms < best ? ms : best;
        }
        printf("burst_bench: %d multiprocessors; one kernel streaming 1 GiB: %.2f TB/s\n", sms,
               (double)(1 << 30) / (best * 1e-3) / 1e12);
    }
    printf("%d kernels a graph (PDL, each waiting first), 256 threads a block; best of 10 replays\n", K);
    printf("%-9s %9s %6s %10s %9s %9s %9s\n", "variant", "burst_MB", "grid", "KiB/block", "us", "TB/s", "net_TB/s");
    double bursts[] = {14.2e6, 7.1e6, 3.5e6};
    int grids[] = {sms, 192, 2 * sms, 4 * sms, 8 * sms};
    for (double bytes : bursts)
        for (int grid : grids) {
            int words = (int)(bytes / grid / 16);
            size_t slice = (size_t)words * 16;
            if (slice > SMEM_MAX) continue;
            // Burst k at k * stride: stride > the burst and the K bursts spread over the buffer.
            size_t stride = total / K / 4096 * 4096;
            if (stride < slice * grid) continue;
            float empty_us = 0;
            for (int v = 0; v < NV; v++) {
                size_t smem = v == V_CPASYNC || v == V_BULKCP || v == V_BULKROWS ? slice : 0;
                float us = graph_us(st, K, v, grid, smem, w, stride / 16, words, out, NULL, 0);
                if (v == V_EMPTY) empty_us = us;
                double net = us - empty_us;
                double mb = slice * (double)grid / 1e6;
                if (v == V_EMPTY)
                    printf("%-9s %9.1f %6d %10.1f %9.2f %9s %9s\n", vname[v], mb, grid, slice / 1024.0, us, "-", "-");
                else
                    printf("%-9s %9.1f %6d %10.1f %9.2f %9.2f %9.2f\n", vname[v], mb, grid, slice / 1024.0, us,
                           mb / us, net > 0 ? mb / net : 0.0);
            }
        }
    experts(st, K);
    return 0;
}
