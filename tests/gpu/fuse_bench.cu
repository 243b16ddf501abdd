// fuse_bench: would one kernel for a decode row's routed experts (gate/up and down together, in
// clusters) beat the two kernels Strata runs? A skeleton of both at the Qwen3-30B-A3B and
// Qwen3-Next-80B-A3B shapes, with the real kernels' data movement (Q4_K rows of 1,152 bytes
// copied by the copy engine into shared memory, 192 / 160 gate/up blocks, down rows of 432 / 288
// bytes, the fixed-order combine of the experts by the last block of each row range, the real
// kernels' registers held so the same blocks can be resident together) and stand-in arithmetic
// (a fold of the bytes, not Q4_K dot products), so only the structure is measured:
//   gu only  the gate/up kernel alone: a warp's 8 rows asked at once, or in four groups of two
//            rows, each asked when the one before has landed (Strata's kernel)
//   two      the gate/up kernel (8 experts x 24 row tiles of 32 h values; writes h to global
//            memory), then the down kernel (4 warps a block, 32 / 64 output rows of one expert;
//            each asks L2 for its rows before its wait, then reads h and its rows; the blocks of
//            a row tile count in, the last sums them), as Strata runs them
//   fused    one kernel of the gate/up blocks in clusters of 8 (expert, chunk of 256 h values):
//            each block copies its gate/up rows and loads its slice of the down matrix (256
//            output rows x the chunk's 256 columns: one 144-byte super-block a row) at the same
//            time; the cluster's blocks hand each other their 32 h values through shared memory
//            (one cluster barrier), each block sums its rows' products over the chunk, and the
//            blocks of (expert, chunk) sharing a range of output rows count in; the last sums
//            them in a fixed order. The down slice: into registers; repacked contiguously and
//            copied by the copy engine; in the file's layout by cp.async (16 bytes, nine a
//            thread); or not read at all (what the bytes cost). "ring3": the gate/up rows in a
//            ring of three group buffers (55 KB instead of 74), so that with the down slice a
//            block's shared memory still lets two blocks share a multiprocessor.
//   cs16     (Next) clusters of 16, the non-portable size: one cluster holds a whole expert's h,
//            each block sums 128 output rows over all columns, no per-chunk partials
// A graph of L layers of each (PDL, each kernel waiting first), experts drawn at random from 6
// layers' stacks (cold in L2); the best of 10 replays, us a layer.
//   nvcc -O3 -arch=sm_90 -o fuse_bench tests/gpu/fuse_bench.cu && ./fuse_bench [L]
#include "bench_graph.cuh"
#include <cstdint>
#include <cstring>

// The two shapes: experts a layer, experts a row, h values an expert, down rows a block of the
// two-kernel down kernel (64 at the Next's 512 columns: its half-warp rows).
struct s30b { static constexpr int NE = 128, TOPK = 8, HF = 768, RPB = 32; static constexpr const char *name = "30B-A3B"; };
struct snext { static constexpr int NE = 512, TOPK = 10, HF = 512, RPB = 64; static constexpr const char *name = "Next-80B-A3B"; };
#define DM 2048         // model width
#define GROW 1152       // a gate/up row: Q4_K, 2,048 columns
#define SB 144          // one Q4_K super-block (256 columns); a down row is HF / 256 of them
#define STACK_LAYERS 6  // expert stacks the layers cycle through

__device__ __forceinline__ float as_f(unsigned u) { return __int_as_float((int)(u & 0x007fffffu) | 0x3f800000); }
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ void st_peer(const float *local, unsigned rank, float v) {
    unsigned a = (unsigned)__cvta_generic_to_shared(local), r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(r), "f"(v) : "memory");
}

struct layer_args {
    const uint8_t *gate, *up, *down; // this layer's stacks: (NE, HF, GROW), (NE, HF, GROW), (NE, DM, HF / 256 x SB)
    const uint8_t *downpk;           // the repacked down stack: (NE, HF / 256 chunks, 8 ranks, 256 rows x SB)
    const int *ids;                  // (TOPK) this layer's experts
    float *h;                        // (TOPK, HF)
    float *part;                     // (TOPK, DM) two; (TOPK, HF / 256, DM) fused
    float *y;                        // (DM)
    unsigned *counters;              // (64) zero at rest
    int ballast;                     // 0 (see ballast)
};

// Registers the real kernels hold (the gate/up and fused kernels 128 a thread, two blocks a
// multiprocessor; the down kernel 96), which decide which blocks can be resident together: a
// loop that never runs (n = 0) but keeps N values live.
template <int N> __device__ __forceinline__ void ballast(int n, float seed, float *sink) {
    if (n == 0) return;
    float r[N];
#pragma unroll
    for (int j = 0; j < N; j++) r[j] = seed * (float)(j + 1);
    for (int it = 0; it < n; it++)
#pragma unroll
        for (int j = 0; j < N; j++) r[j] = r[j] * r[(j + 1) % N] + 1.0f;
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < N; j++) s += r[j];
    sink[threadIdx.x] = s;
}

// Shared memory of a block's staged gate/up rows: all 64 (PIPE 0 and 4), or a ring of three
// groups of two rows a warp (PIPE 3).
__host__ __device__ constexpr int gu_smem(int pipe) { return (pipe == 3 ? 3 : 4) * 8 * 2 * GROW; }

// A block's 32 gate and 32 up rows of expert e, tile t, into shared memory: warp w copies rows
// 8w .. 8w + 7 (gate rows for w < 4, up rows after) and reads them; returns the warp's four h
// values' stand-in (lanes 0-3). PIPE 0: the warp's 8 rows asked at once; 4: in four groups of
// two rows, each asked when the one before has landed (as Strata's kernel does); 3: the same in
// a ring of three group buffers. bars: 4 mbarriers a warp (this warp's at bars + 4 w). With extra,
// warp 0 also copies xbytes from xsrc to xdst (counted on xbar).
template <class S, int PIPE>
__device__ __forceinline__ float gate_up_rows(const layer_args &a, int e, int t, uint8_t *sm, unsigned long long *bars,
                                              unsigned long long pol, bool extra, const uint8_t *xsrc, unsigned xbytes,
                                              uint8_t *xdst, unsigned xbar) {
    constexpr int NS = PIPE == 0 ? 1 : PIPE, GR = PIPE == 0 ? 8 : 2, NG = 8 / GR; // slots, rows a group, groups
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const uint8_t *stack = w < 4 ? a.gate : a.up;
    const uint8_t *rows = stack + ((size_t)e * S::HF + (size_t)t * 32 + (w & 3) * 8) * GROW;
    uint8_t *ws = sm + (size_t)w * (PIPE == 0 ? 8 : NS * GR) * GROW;
    unsigned long long *wb = bars + 4 * w;
    auto ask = [&](int g) {
        unsigned bar = (unsigned)__cvta_generic_to_shared(&wb[g]);
        mbar_init(bar, GR * GROW);
        for (int r = 0; r < GR; r++)
            bulk((unsigned)__cvta_generic_to_shared(ws + ((g % NS) * GR + r) * GROW), rows + (g * GR + r) * GROW, GROW,
                 bar, pol);
    };
    if (lane == 0) {
        ask(0);
        if (extra && w == 0) {
            mbar_init(xbar, xbytes);
            for (unsigned o = 0; o < xbytes; o += 9216)
                bulk((unsigned)__cvta_generic_to_shared(xdst + o), xsrc + o, xbytes - o < 9216 ? xbytes - o : 9216, xbar, pol);
        }
    }
    __syncwarp();
    unsigned f = 0;
    for (int g = 0; g < NG; g++) {
        mbar_wait((unsigned)__cvta_generic_to_shared(&wb[g]));
        if (lane == 0 && g + 1 < NG) { // (the ring's slot of group g - 2: read by every lane, below)
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            ask(g + 1);
        }
        const uint4 *s4 = (const uint4 *)(ws + (g % NS) * GR * GROW);
        for (int i = lane; i < GR * GROW / 16; i += 32) f += fold(s4[i]);
        __syncwarp();
    }
    for (int o = 16; o > 0; o >>= 1) f += __shfl_xor_sync(0xffffffffu, f, o);
    return as_f(f + lane);
}

// ---- two kernels (as now) ----
template <class S, int PIPE> __global__ void __launch_bounds__(256) k_gu(layer_args a) {
    extern __shared__ __align__(128) uint8_t sm[];
    __shared__ alignas(8) unsigned long long bars[32];
    pdl_begin();
    constexpr int TT = S::HF / 32; // row tiles an expert
    const int slot = blockIdx.x / TT, t = blockIdx.x % TT, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int e = a.ids[slot];
    float hv = gate_up_rows<S, PIPE>(a, e, t, sm, bars, evict_first(), false, NULL, 0, NULL, 0);
    if (lane < 4) a.h[slot * S::HF + t * 32 + w * 4 + lane] = hv; // (the real kernel: swiglu of gate and up, quantized)
    ballast<116>(a.ballast, hv, a.y);
}

template <class S> __global__ void __launch_bounds__(128) k_down(layer_args a) {
    constexpr int DROW = S::HF / 256 * SB, RPW = S::RPB / 4, TPE = DM / S::RPB; // row bytes, rows a warp, tiles an expert
    const int slot = blockIdx.x / TPE, t = blockIdx.x % TPE, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int e = a.ids[slot]; // (the real kernel ranks the logits before its wait)
    const uint8_t *rows = a.down + ((size_t)e * DM + (size_t)t * S::RPB) * DROW;
    if (threadIdx.x == 0)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(rows), "r"(S::RPB * DROW) : "memory");
    pdl_begin();
    __shared__ float hs[S::HF];
    for (int i = threadIdx.x; i < S::HF; i += 128) hs[i] = __ldcg(a.h + slot * S::HF + i);
    __syncthreads();
    // warp w: rows RPW w .. RPW w + RPW - 1, a row's words over the lanes
    float out = 0.0f;
    for (int r = 0; r < RPW; r++) {
        const uint4 *rw = (const uint4 *)(rows + (size_t)(w * RPW + r) * DROW);
        float s = lane < DROW / 16 ? as_f(fold(__ldg(rw + lane))) * hs[lane * 16] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == r) out = s;
    }
    if (lane < RPW) a.part[slot * DM + t * S::RPB + w * RPW + lane] = out;
    // count in: the last of the tile's TOPK blocks sums the experts' outputs in order
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned prev = atomicAdd(a.counters + t, 1u);
        last = prev == S::TOPK - 1;
        if (last) a.counters[t] = 0;
    }
    __syncthreads();
    if (last) {
        __threadfence();
        if (threadIdx.x < S::RPB) {
            float s = 0.0f;
            for (int k = 0; k < S::TOPK; k++) s += 0.125f * __ldcg(a.part + k * DM + t * S::RPB + threadIdx.x);
            a.y[t * S::RPB + threadIdx.x] += s;
        }
    }
    ballast<84>(a.ballast, out, a.y);
}

// ---- one kernel in clusters of CS blocks: (expert, chunk of CS x 32 h values) ----
// MODE 0: the down slice in registers (strided rows); 1: repacked, copied into shared memory by
// the copy engine; 2: no down bytes; 3: the file's layout, copied into shared memory with
// cp.async (16 bytes, nine a thread). Block rank r of a cluster sums output rows r RB .. r RB +
// RB - 1 (RB = DM / CS) over the chunk's columns, NCH super-blocks a row, a thread each.
template <class S, int MODE, int CS, int PIPE> __global__ void __launch_bounds__(256) k_fused(layer_args a) {
    extern __shared__ __align__(128) uint8_t sm[];
    __shared__ alignas(8) unsigned long long bars[33];
    constexpr int GU_SMEM = gu_smem(PIPE);
    constexpr int HC = CS * 32, NC = S::HF / HC, NCH = HC / 256, RB = DM / CS, DROW = S::HF / 256 * SB;
    static_assert(RB * NCH == 256, "a thread a super-block of the block's rows");
    __shared__ float hs[HC]; // the chunk's h values, from the cluster's blocks
    cluster_arrive_relaxed(); // started: the others may store into hs once they have waited
    pdl_begin();
    const int c = blockIdx.x / CS, rank = (int)cluster_rank(), slot = c / NC, chunk = c % NC;
    const int t = chunk * CS + rank, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int row = rank * RB + threadIdx.x / NCH, piece = threadIdx.x % NCH;
    const int e = a.ids[slot];
    unsigned long long pol = evict_first();
    uint4 d[9];
    const uint8_t *dsrc = a.downpk + (((size_t)e * NC + chunk) * CS + rank) * 256 * SB;
    const uint4 *dr = (const uint4 *)(a.down + ((size_t)e * DM + row) * DROW + (chunk * NCH + piece) * SB);
    if (MODE == 0) {
#pragma unroll
        for (int j = 0; j < 9; j++) d[j] = __ldcs(dr + j);
    }
    uint4 *dsm = (uint4 *)(sm + GU_SMEM) + threadIdx.x * 9;
    if (MODE == 3) {
#pragma unroll
        for (int j = 0; j < 9; j++)
            asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(
                             (unsigned)__cvta_generic_to_shared(dsm + j)),
                         "l"(dr + j), "l"(pol));
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    float hv = gate_up_rows<S, PIPE>(a, e, t, sm, bars, pol, MODE == 1, dsrc, 256 * SB, sm + GU_SMEM,
                                     (unsigned)__cvta_generic_to_shared(&bars[32]));
    cluster_wait(); // every block of the cluster has started
    if (lane < 4)
        for (unsigned r = 0; r < CS; r++) st_peer(&hs[rank * 32 + w * 4 + lane], r, hv);
    cluster_arrive();
    cluster_wait(); // hs complete in every block
    if (MODE == 1) mbar_wait((unsigned)__cvta_generic_to_shared(&bars[32]));
    if (MODE == 3) asm volatile("cp.async.wait_all;" ::: "memory");
    if (MODE == 1 || MODE == 3) {
        const uint4 *s4 = MODE == 3 ? dsm : (const uint4 *)(sm + GU_SMEM) + threadIdx.x * 9;
#pragma unroll
        for (int j = 0; j < 9; j++) d[j] = s4[j];
    }
    float s = 0.0f;
    if (MODE != 2) {
#pragma unroll
        for (int j = 0; j < 9; j++) s += as_f(fold(d[j])) * hs[piece * 256 + j * 28];
    } else {
        s = hs[threadIdx.x % HC];
    }
    if (NCH == 2) s += __shfl_xor_sync(0xffffffffu, s, 1);
    if (piece == 0) a.part[((size_t)slot * NC + chunk) * DM + row] = s;
    // count in: the TOPK x NC blocks of output rows rank RB .. + RB - 1; the last sums them
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned prev = atomicAdd(a.counters + rank, 1u);
        last = prev == S::TOPK * NC - 1;
        if (last) a.counters[rank] = 0;
    }
    __syncthreads();
    if (last && threadIdx.x < RB) {
        __threadfence();
        float v = 0.0f;
        for (int k = 0; k < S::TOPK; k++) {
            const float *p = a.part + (size_t)k * NC * DM + rank * RB + threadIdx.x;
            float u = __ldcg(p);
            for (int j = 1; j < NC; j++) u += __ldcg(p + j * DM);
            v += 0.125f * u;
        }
        a.y[rank * RB + threadIdx.x] += v;
    }
    ballast<116>(a.ballast, s, a.y);
}

static void launch(cudaStream_t st, void *fn, int grid, int block, size_t smem, int cluster, void **args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(block);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute at[2];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    at[1].id = cudaLaunchAttributeClusterDimension;
    at[1].val.clusterDim.x = cluster, at[1].val.clusterDim.y = 1, at[1].val.clusterDim.z = 1;
    cfg.attrs = at;
    cfg.numAttrs = cluster > 1 ? 2 : 1;
    CK(cudaLaunchKernelExC(&cfg, fn, args));
}

template <class S> static void run(cudaStream_t st, int L) {
    constexpr int NC = S::HF / 256;
    const size_t gmat = (size_t)S::HF * GROW, dmat = (size_t)DM * NC * SB;
    const size_t stack = S::NE * (2 * gmat + 2 * dmat); // gate, up, down, repacked down
    uint8_t *w;
    CK(cudaMalloc(&w, stack * STACK_LAYERS));
    CK(cudaMemset(w, 0x35, stack * STACK_LAYERS));
    int *ids;
    float *h, *part, *y;
    unsigned *counters;
    CK(cudaMalloc(&ids, sizeof(int) * S::TOPK * L));
    CK(cudaMalloc(&h, sizeof(float) * S::TOPK * S::HF));
    CK(cudaMalloc(&part, sizeof(float) * S::TOPK * NC * DM));
    CK(cudaMalloc(&y, sizeof(float) * DM));
    CK(cudaMalloc(&counters, sizeof(unsigned) * 64));
    CK(cudaMemset(counters, 0, sizeof(unsigned) * 64));
    CK(cudaMemset(y, 0, sizeof(float) * DM));
    int *hid = (int *)malloc(sizeof(int) * S::TOPK * L);
    srand(7);
    for (int l = 0; l < L; l++)
        for (int k = 0; k < S::TOPK; k++) {
            int e, dup;
            do {
                e = rand() % S::NE, dup = 0;
                for (int j = 0; j < k; j++) dup |= hid[l * S::TOPK + j] == e;
            } while (dup);
            hid[l * S::TOPK + k] = e;
        }
    CK(cudaMemcpy(ids, hid, sizeof(int) * S::TOPK * L, cudaMemcpyHostToDevice));
    free(hid);
    // The variants: name, the first kernel, the down kernel (or NULL), its cluster size, the
    // first kernel's shared memory, and whether the down bytes are read.
    struct variant {
        const char *name;
        void *k1, *k2;
        int cs;
        int smem;
        bool down;
    };
    constexpr int DS = 256 * SB; // a block's down slice
    constexpr bool cs16 = S::HF % 512 == 0; // clusters of 16 (non-portable): a whole expert's h at the Next's 512
    const variant vs[] = {
        {"gu only (all rows asked at once)", (void *)k_gu<S, 0>, NULL, 1, gu_smem(0), false},
        {"gu only (groups, one ahead)", (void *)k_gu<S, 4>, NULL, 1, gu_smem(4), false},
        {"two (all at once)", (void *)k_gu<S, 0>, (void *)k_down<S>, 1, gu_smem(0), true},
        {"two (groups, as Strata)", (void *)k_gu<S, 4>, (void *)k_down<S>, 1, gu_smem(4), true},
        {"fused, down in registers", (void *)k_fused<S, 0, 8, 0>, NULL, 8, gu_smem(0), true},
        {"fused, down repacked, bulk", (void *)k_fused<S, 1, 8, 0>, NULL, 8, gu_smem(0) + DS, true},
        {"fused, no down bytes", (void *)k_fused<S, 2, 8, 0>, NULL, 8, gu_smem(0), false},
        {"fused, down cp.async", (void *)k_fused<S, 3, 8, 0>, NULL, 8, gu_smem(0) + DS, true},
        {"fused ring3, down repacked, bulk", (void *)k_fused<S, 1, 8, 3>, NULL, 8, gu_smem(3) + DS, true},
        {"fused ring3, down cp.async", (void *)k_fused<S, 3, 8, 3>, NULL, 8, gu_smem(3) + DS, true},
        {"cs16, down repacked, bulk", cs16 ? (void *)k_fused<S, 1, 16, 0> : NULL, NULL, 16, gu_smem(0) + DS, true},
        {"cs16 ring3, down cp.async", cs16 ? (void *)k_fused<S, 3, 16, 3> : NULL, NULL, 16, gu_smem(3) + DS, true},
    };
    const int gu_blocks = S::TOPK * S::HF / 32;
    printf("%s: %d layers a graph (%.1f MB of experts a layer; gate/up %d blocks, down %d), best of 10 replays\n",
           S::name, L, S::TOPK * (2 * gmat + dmat) / 1e6, gu_blocks, S::TOPK * DM / S::RPB);
    printf("%-34s %7s %9s %6s\n", "variant", "smem KB", "us/layer", "TB/s");
    for (const variant &v : vs) {
        if (!v.k1) continue;
        CK(cudaFuncSetAttribute(v.k1, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem));
        if (v.cs > 8) CK(cudaFuncSetAttribute(v.k1, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        for (int l = 0; l < L; l++) {
            const uint8_t *base = w + stack * (l % STACK_LAYERS);
            layer_args a = {base, base + S::NE * gmat, base + 2 * S::NE * gmat, base + 2 * S::NE * gmat + S::NE * dmat,
                            ids + S::TOPK * l, h, part, y, counters, 0};
            void *args[] = {&a};
            launch(st, v.k1, gu_blocks, 256, v.smem, v.cs, args);
            if (v.k2) launch(st, v.k2, S::TOPK * DM / S::RPB, 128, 0, 1, args);
        }
        CK(cudaStreamEndCapture(st, &g));
        float us = bench_replay_ms(st, g, 10) * 1000.0f / L;
        double mb = S::TOPK * ((v.down ? dmat : 0) + 2 * gmat) / 1e6;
        printf("%-34s %7.1f %9.2f %6.2f\n", v.name, v.smem / 1024.0, us, mb / us);
    }
    CK(cudaFree(w));
    CK(cudaFree(ids));
    CK(cudaFree(h));
    CK(cudaFree(part));
    CK(cudaFree(y));
    CK(cudaFree(counters));
}

int main(int argc, char **argv) {
    int L = argc > 1 ? atoi(argv[1]) : 48;
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    printf("fuse_bench: %d multiprocessors\n", sms);
    run<s30b>(st, L);
    run<snext>(st, L);
    return 0;
}
