// backend/cuda: what the CUDA backend's files share: the backend object, error handling, scratch
// memory, and the ops each kernel file provides (same signatures as st_backend_ops).
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "backend/backend.h"
#include "quant/blocks.h"
}

// Scratch buffers, one per op family, so ops never overwrite each other's live data.
enum {
    ST_SCR_ACT,   // quantized activations of matmul
    ST_SCR_DEQ,   // dequantized weights (prompt-chunk GEMMs)
    ST_SCR_ATTN,  // attention partial results
    ST_SCR_MOE,   // expert grouping, intermediate activations
    ST_SCR_MOE2,
    ST_SCR_GDN,   // chunked DeltaNet buffers
    ST_SCR_MISC,
    ST_SCR_MOEMAP, // expert ids mapped to cache slots
    ST_SCR_ATTQ,   // a mixer's output (attention, DeltaNet) quantized for its output projection
    ST_SCR_COUNT
};

#define ST_STAGE_SLOTS 32
#define ST_STAGE_BYTES 1024
typedef struct st_cuda {
    st_backend base;             // first: an st_backend * is an st_cuda *
    int device;
    cudaDeviceProp prop;
    cudaStream_t stream;         // every op runs on it, in order
    cublasHandle_t cublas;       // bound to stream
    size_t reserve;              // VRAM left free for the driver and other programs
    st_status err;               // first error since the last sync (ops are void)
    char err_msg[512];
    bool capturing;              // recording a graph: no allocation, no synchronization
    bool pdl;                    // programmatic dependent launch (Hopper and newer; st_launch)
    cudaEvent_t copies;          // recorded after each to_host_async copy
    // A hybrid layer's publish runs on side, beside the layer's expert kernels (fork, then
    // join before collect): its fences to host memory stay off the decode step's chain.
    cudaStream_t side;
    cudaEvent_t fork, join;
    bool joining;                // a publish on side that collect has not joined yet
    // A decode window's shared expert also runs on side (st_cuda_shared_ffn), beside the routed
    // experts' gate/up kernel, joined before the first kernel that reads its output.
    cudaEvent_t sh_fork, sh_join;
    bool sh_pending;             // forked, not joined yet
    // Small copies to the device (up to ST_STAGE_BYTES: a step's ids and positions) go through
    // pinned slots and return without waiting (cuda_from_host); slot i is written again only
    // once stage_ev[i], recorded behind its last copy, has completed.
    uint8_t *stage;              // ST_STAGE_SLOTS x ST_STAGE_BYTES, pinned; NULL: every copy waits
    cudaEvent_t stage_ev[ST_STAGE_SLOTS];
    unsigned stage_next, stage_used; // the next slot; the slots with a copy recorded (bits)
    // from_host_async's copies (adaptive expert swaps) run on h2d, after the work queued on
    // stream before each (h2d_start); h2d_end marks the last one.
    cudaStream_t h2d;
    cudaEvent_t h2d_start, h2d_end;
    unsigned scratch_gen;        // bumped when a scratch buffer moves: older recordings are stale
    void *scratch[ST_SCR_COUNT];
    size_t scratch_bytes[ST_SCR_COUNT];
    // STRATA_CUDA_TRACE (profile.cu): the op being issued, its launches so far, and the labels
    // of the launches recorded into the graph being captured.
    bool trace;
    char trace_op[96];
    int trace_k;
    struct st_trace_labels *trace_labels;
} st_cuda;

static inline st_cuda *st_cuda_of(st_backend *b) { return (st_cuda *)b; }
// STRATA_CUDA_TRACE: kernel k was launched on c->stream with these dimensions.
void st_cuda_trace_launch(st_cuda *c, const void *k, dim3 grid, dim3 block, size_t smem);

// Records a failed CUDA call (the first one since the last sync is kept and reported by sync).
void st_cuda_fail(st_cuda *c, cudaError_t e, const char *what, const char *file, int line);
void st_cuda_fail_msg(st_cuda *c, const char *file, int line, const char *fmt, ...);
#define ST_CU(c, call)                                                                      \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        if (e_ != cudaSuccess) st_cuda_fail((c), e_, #call, __FILE__, __LINE__);            \
    } while (0)
// After a kernel launch: a bad configuration shows up here.
#define ST_CU_LAUNCHED(c, what) ST_CU(c, cudaPeekAtLastError())

// Programmatic dependent launch (sm_90 and newer): st_launch lets a kernel's blocks start while
// the kernel before it on the stream finishes, so the launch and the block set-up of one overlap
// the tail of the other (decode runs ~16 small kernels a layer). Every kernel therefore calls
// st_pdl_begin() before it touches memory that an earlier kernel writes or reads: it waits until
// the earlier kernels have completed and their writes are visible, then lets the next kernel's
// blocks launch. Reads of data no kernel writes (weights) may come before it. A no-op on older
// cards and when the kernel was launched without the attribute.
//
// STRATA_CUDA_TRACE=1 (profile.cu) times the kernels inside a replayed decode graph: block 0 of
// each kernel notes when it became resident and when its wait returned, that is when the kernel
// before it had finished. The next kernel's release minus this one's is this kernel's share of
// the step, overlap included, which neither timing a kernel alone nor ncu shows.
typedef struct st_trace_dev {
    unsigned *seq;           // records written since the replay began; NULL: not tracing
    unsigned cap;
    unsigned long long *rec; // (cap, 2): resident, released (%globaltimer, ns)
    unsigned long long *marks; // (cap, ST_TRACE_MARKS): st_trace_mark's times, 0 where none
    unsigned *ends;            // (ST_TRACE_BINS): blocks that ended in each 256 ns of %globaltimer (a ring)
    unsigned *sm_ends;         // (ST_TRACE_SMS, ST_TRACE_SM_BINS): the same by multiprocessor, or NULL
    // STRATA_CUDA_TRACE_BLOCKS: one record a block (st_trace_end): its release, its end, where it
    // ran and which block it was; blk_n counts them (a round trip at each block's end). Or NULL.
    unsigned long long *blk;   // (blk_cap, 3)
    unsigned *blk_n;
    unsigned blk_cap;
    // STRATA_CUDA_TRACE_MARK_BLOCK=X,Y,Z: the block that takes each kernel's record and marks
    // (each index clipped to the grid), so the marks can follow a block other than block 0.
    unsigned mark_at[3];
} st_trace_dev;
// Points inside a kernel that block 0 may time (st_trace_mark), reported after its release.
#define ST_TRACE_MARKS 12
// st_trace_end's histogram: 2^16 bins of 2^8 ns, a ring of 16.8 ms (a replay is a few ms).
#define ST_TRACE_BINS 65536
#define ST_TRACE_BIN_SHIFT 8
// And by multiprocessor (STRATA_CUDA_TRACE_SM): 2^15 bins (8.4 ms) for each %smid below 256.
#define ST_TRACE_SMS 256
#define ST_TRACE_SM_BINS 32768
// One copy per translation unit (no relocatable device code): each kernel file binds its own
// (st_trace_bind_<file>, called by profile.cu).
static __constant__ st_trace_dev st_trace;
static inline cudaError_t st_trace_bind_unit(const st_trace_dev *t) { return cudaMemcpyToSymbol(st_trace, t, sizeof *t); }
cudaError_t st_trace_bind_attention(const st_trace_dev *t);
cudaError_t st_trace_bind_cuda(const st_trace_dev *t);
cudaError_t st_trace_bind_gdn(const st_trace_dev *t);
cudaError_t st_trace_bind_ops(const st_trace_dev *t);
cudaError_t st_trace_bind_quant(const st_trace_dev *t);

__device__ __forceinline__ unsigned long long st_globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// STRATA_CUDA_TRACE_BLOCKS: when this block's wait returned (thread 0's, for st_trace_end).
static __shared__ unsigned long long st_blk_release;

// Block 0 takes its record's slot when it becomes resident, so after the wait it only stores
// (an atomic's round trip there would delay every kernel's end by ~1.6 us). Slots follow launch
// order: kernel i + 1 becomes resident only after every block of kernel i has passed its wait.
// Returns the slot to block 0 (or the one STRATA_CUDA_TRACE_MARK_BLOCK names) while tracing
// (else ~0u), for st_trace_mark.
__device__ __forceinline__ unsigned st_pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const bool first = (threadIdx.x | threadIdx.y | threadIdx.z) == 0 &&
                       blockIdx.x == min(st_trace.mark_at[0], gridDim.x - 1) &&
                       blockIdx.y == min(st_trace.mark_at[1], gridDim.y - 1) &&
                       blockIdx.z == min(st_trace.mark_at[2], gridDim.z - 1);
    unsigned long long resident = 0;
    unsigned slot = ~0u;
    if (first && st_trace.seq) {
        resident = st_globaltimer();
        slot = atomicAdd(st_trace.seq, 1u);
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
    if (st_trace.blk && threadIdx.x == 0) st_blk_release = st_globaltimer();
    if (slot < st_trace.cap) {
        st_trace.rec[2 * slot] = resident;
        st_trace.rec[2 * slot + 1] = st_globaltimer();
    }
    return slot;
#else
    return ~0u;
#endif
}

// STRATA_CUDA_TRACE: block 0's thread 0 notes when it reached point k (< ST_TRACE_MARKS) of its
// kernel; slot is what st_pdl_begin returned (a no-op for other blocks and when not tracing).
// The table reports each point's mean time after the kernel's release.
__device__ __forceinline__ void st_trace_mark(unsigned slot, int k) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (slot < st_trace.cap && threadIdx.x == 0) st_trace.marks[(size_t)slot * ST_TRACE_MARKS + k] = st_globaltimer();
#endif
}

// STRATA_CUDA_TRACE: every block's thread 0 counts its end in the histogram of end times (a
// reduction, not waited for). Block 0 alone can say when it ended; the kernel ends with its
// last block, and kernel i's blocks all end between its release and kernel i + 1's, so the
// histogram's bins in that window are kernel i's (profile.cu: when half, nine tenths and all
// of its blocks had ended).
// (Out of line: inlined, its records' registers raised some kernels' counts past an occupancy
// step, e.g. attention at head dim 256, two queries a warp: 128 -> 144.)
static __device__ __noinline__ void st_trace_end_record() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned long long now = st_globaltimer(), b = now >> ST_TRACE_BIN_SHIFT;
    atomicAdd(st_trace.ends + (b & (ST_TRACE_BINS - 1)), 1u);
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    if (st_trace.sm_ends && sm < ST_TRACE_SMS)
        atomicAdd(st_trace.sm_ends + (size_t)sm * ST_TRACE_SM_BINS + (b & (ST_TRACE_SM_BINS - 1)), 1u);
    if (st_trace.blk) {
        unsigned i = atomicAdd(st_trace.blk_n, 1u);
        if (i < st_trace.blk_cap) {
            unsigned long long *r = st_trace.blk + 3 * (size_t)i;
            r[0] = st_blk_release;
            r[1] = now;
            r[2] = (unsigned long long)(sm & 0xffu) | (unsigned long long)(blockIdx.x & 0xffffffu) << 8 |
                   (unsigned long long)(blockIdx.y & 0xffffu) << 32 | (unsigned long long)(blockIdx.z & 0xffffu) << 48;
        }
    }
#endif
}
__device__ __forceinline__ void st_trace_end() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (st_trace.seq && threadIdx.x == 0) st_trace_end_record();
#endif
}

// STRATA_CUDA_TRACE: block 0's thread 0 loads *p (from L2) and notes point k once the value
// has arrived: how long a first read of the kernel before's output takes after the wait.
__device__ __forceinline__ void st_trace_probe(unsigned slot, int k, const float *p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (slot < st_trace.cap && threadIdx.x == 0) {
        float v = __ldcg(p);
        if (__float_as_uint(v) != 0x7fbadbadu) // (a branch on the value waits for it)
            st_trace.marks[(size_t)slot * ST_TRACE_MARKS + k] = st_globaltimer();
    }
#endif
}

// The router's selection order, shared by the router kernels (ops.cu) and the experts' kernels
// that route for themselves (quant_matmul.cu): (v, i) comes before (ov, oi) when its logit is
// larger, or equal with a lower id (the CPU's order).
__device__ __forceinline__ bool route_before(float v, int i, float ov, int oi) {
    return v > ov || (v == ov && i < oi);
}

// One compare-exchange of a bitonic network over a warp's (logit, id) pairs: this lane and
// lane ^ j; `first` is whether this lane keeps the pair's first element (in the order above).
__device__ __forceinline__ void route_exchange(float &v, int &i, int j, bool first) {
    float ov = __shfl_xor_sync(0xffffffffu, v, j);
    int oi = __shfl_xor_sync(0xffffffffu, i, j);
    bool other_first = route_before(ov, oi, v, i);
    if (other_first == first) v = ov, i = oi;
}

// Sorts a warp's 32 (logit, id) pairs in the router's order (lane 0 first): runs of `size`
// alternate direction until the last.
__device__ __forceinline__ void route_sort_warp(float &v, int &i) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int size = 2; size <= 32; size <<= 1)
#pragma unroll
        for (int j = size >> 1; j > 0; j >>= 1) {
            bool desc = (lane & size) == 0 || size == 32, lower = (lane & j) == 0;
            route_exchange(v, i, j, lower == desc);
        }
}

// Two groups of 32 sorted at once (their exchanges interleave, one network's latency for both),
// then merged: lane i keeps the earlier of A[i] and B[31 - i], which leaves the pair's first 32
// as a bitonic sequence, and one more pass of half-cleaners sorts it. The result is the union's
// first 32 in the router's order, in v, i (vb, ib are clobbered).
__device__ __forceinline__ void route_sort_warp2(float &v, int &i, float &vb, int &ib) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int size = 2; size <= 32; size <<= 1)
#pragma unroll
        for (int j = size >> 1; j > 0; j >>= 1) {
            bool desc = (lane & size) == 0 || size == 32, lower = (lane & j) == 0;
            route_exchange(v, i, j, lower == desc);
            route_exchange(vb, ib, j, lower == desc);
        }
    float ov = __shfl_sync(0xffffffffu, vb, 31 - lane);
    int oi = __shfl_sync(0xffffffffu, ib, 31 - lane);
    if (route_before(ov, oi, v, i)) v = ov, i = oi;
#pragma unroll
    for (int j = 16; j > 0; j >>= 1) route_exchange(v, i, j, (lane & j) == 0);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over a block of blockDim.x (a multiple of 32, at most 1024) threads; every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads(); // part may still be read by a previous call
    if (lane == 0) part[w] = v;
    __syncthreads();
    v = lane < nw ? part[lane] : 0.0f;
    return warp_sum(v);
}

// Threads of a block that norms a model-width row (rms_row): the norm kernels' block, and the
// width up to which a product's 128-thread block norms its input itself with the same sums.
__host__ __device__ constexpr int st_rms_threads(int d) { return d >= 4096 ? 256 : 128; }
#define RMS_KEEP 8

// ss + a·a with the roundings spelled out: a plain expression leaves the compiler free to fuse
// a different product into each add wherever it is inlined, so the norm kernel and a product
// that norms its input itself could disagree in the last bit (seen as a rare test failure).
__device__ __forceinline__ float sumsq4(float ss, float4 a) {
    return fmaf(a.w, a.w, fmaf(a.z, a.z, fmaf(a.y, a.y, fmaf(a.x, a.x, ss))));
}

// The sum of squares of one row a = x (+ y when given) of d floats, by the whole block (every
// thread gets it); a written to xo when given. With vec4 (d % 4 == 0, 16-byte aligned rows)
// 16-byte accesses, and the first RMS_KEEP float4 of each thread are kept in registers for the
// scaling (a 2048-wide row over 128 threads is 4 each). The same blockDim gives the same bits
// wherever this runs (the norm kernels, and the products that norm their input themselves).
// A thread issues all of its kept loads before it uses any: loaded inside the loop below, each
// float4 sat in its own branch under the store to xo before it (xo may alias x), and the SASS
// waited one L2 round trip per float4 (~4 us of a q/k/v kernel; H200, 2026-12-01: 30B-A3B
// +6.0%, Next-80B-A3B +3.0% decode).
template <int K = RMS_KEEP>
__device__ __forceinline__ float rms_sumsq(const float *x, const float *y, float *xo, int d, bool vec4, float4 (&keep)[K]) {
    float ss = 0;
    if (vec4) {
        const float4 *x4 = (const float4 *)x, *y4 = (const float4 *)y;
        float4 *xo4 = (float4 *)xo;
        const int d4 = d / 4, kept = K * blockDim.x;
        // (an index past the row reads its last float4, unused)
        float4 yk[K];
#pragma unroll
        for (int k = 0; k < K; k++) {
            int j = min((int)(threadIdx.x + k * blockDim.x), d4 - 1);
            keep[k] = x4[j];
            yk[k] = y4 ? y4[j] : make_float4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < K; k++) {
            int j = threadIdx.x + k * blockDim.x;
            if (j < d4) {
                float4 a = keep[k];
                if (y4) {
                    float4 c = yk[k];
                    a.x += c.x, a.y += c.y, a.z += c.z, a.w += c.w;
                    if (xo4) xo4[j] = a;
                }
                keep[k] = a;
                ss = sumsq4(ss, a);
            }
        }
        for (int j = kept + threadIdx.x; j < d4; j += blockDim.x) {
            float4 a = x4[j];
            if (y4) {
                float4 c = y4[j];
                a.x += c.x, a.y += c.y, a.z += c.z, a.w += c.w;
                if (xo4) xo4[j] = a;
            }
            ss = sumsq4(ss, a);
        }
    } else {
        for (int j = threadIdx.x; j < d; j += blockDim.x) {
            float a = x[j];
            if (y) {
                a += y[j];
                if (xo) xo[j] = a;
            }
            ss = fmaf(a, a, ss);
        }
    }
    return block_sum(ss);
}

// The norm's scale of a row whose sum of squares is ss.
__device__ __forceinline__ float rms_scale(float ss, int d, float eps) { return 1.0f / sqrtf(ss / d + eps); }

// out[j] = a · s · g for rms_sumsq's kept float4 a (j = threadIdx.x + k · blockDim.x < d4): the
// normed values of every norm that keeps its row in registers, so all of them get one set of bits.
template <int K>
__device__ __forceinline__ void rms_scale_kept(const float4 (&keep)[K], const float4 (&g)[K], float s, float4 *out,
                                               int d4) {
#pragma unroll
    for (int k = 0; k < K; k++) {
        int j = threadIdx.x + k * blockDim.x;
        if (j < d4) {
            float4 a = keep[k], gk = g[k];
            out[j] = make_float4(a.x * s * gk.x, a.y * s * gk.y, a.z * s * gk.z, a.w * s * gk.w);
        }
    }
}

// One row by the whole block: a = x (+ y), written to xo when given (xo may alias x: each
// thread rereads only what it wrote), then out = a · s · w (w NULL: 1), s = rms_scale. Returns s.
__device__ __forceinline__ float rms_row(const float *x, const float *y, float *xo, const float *w, float *out, int d,
                                         float eps, bool vec4) {
    float4 keep[RMS_KEEP];
    float s = rms_scale(rms_sumsq(x, y, xo, d, vec4, keep), d, eps);
    if (vec4) {
        const float4 *x4 = (const float4 *)x, *y4 = (const float4 *)y, *w4 = (const float4 *)w;
        float4 *xo4 = (float4 *)xo, *n4 = (float4 *)out;
        const int d4 = d / 4, kept = RMS_KEEP * blockDim.x;
        float4 g[RMS_KEEP]; // (every load first, as in rms_sumsq)
#pragma unroll
        for (int k = 0; k < RMS_KEEP; k++)
            g[k] = w4 ? w4[min((int)(threadIdx.x + k * blockDim.x), d4 - 1)] : make_float4(1, 1, 1, 1);
        rms_scale_kept<RMS_KEEP>(keep, g, s, n4, d4);
        for (int j = kept + threadIdx.x; j < d4; j += blockDim.x) {
            float4 a = y4 && xo4 ? xo4[j] : x4[j], g = w4 ? w4[j] : make_float4(1, 1, 1, 1);
            if (y4 && !xo4) {
                float4 c = y4[j];
                a.x += c.x, a.y += c.y, a.z += c.z, a.w += c.w;
            }
            n4[j] = make_float4(a.x * s * g.x, a.y * s * g.y, a.z * s * g.z, a.w * s * g.w);
        }
        return s;
    }
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float a = !y ? x[j] : xo ? xo[j] : x[j] + y[j];
        out[j] = a * s * (w ? w[j] : 1.0f);
    }
    return s;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
// softplus as PyTorch computes it: linear above 20.
__device__ __forceinline__ float softplusf_(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Routing one row inside another kernel's block (the experts' gate/up kernel, the hybrid
// hand-off), so the router needs no launch of its own (a kernel boundary costs ~3 us a layer).
// route_load, a barrier, route_rank: s.top[r] (and s.tv[r], its logit) is the expert of rank r
// < k. Each warp sorts groups of 32 experts; the row's top k is among the groups' top k, and
// each of those candidates counts the candidates before it. With more groups than warps (the
// Next-80B-A3B's 512 logits: 16 groups, 8 warps) and pairs, a warp sorts two groups at once and
// keeps their merged top k (route_sort_warp2): half the candidates to count, and one sort's
// latency where each warp sorted two in turn. Either way the same top k in the same order.
// route_weights then writes the k ids and weights with moe_route_block_kernel's arithmetic
// (ops.cu), so they match it bit for bit: the softmax sum in double over groups of 32 in order,
// the k weights renormalized.
#define ST_ROUTE_FOLD_MAX_E 512
#define ST_ROUTE_FOLD_MAX_K 16
struct st_route_smem {
    float l[ST_ROUTE_FOLD_MAX_E], cv[ST_ROUTE_FOLD_MAX_E / 32 * ST_ROUTE_FOLD_MAX_K], tv[ST_ROUTE_FOLD_MAX_K];
    int ci[ST_ROUTE_FOLD_MAX_E / 32 * ST_ROUTE_FOLD_MAX_K], top[ST_ROUTE_FOLD_MAX_K];
    double sum[ST_ROUTE_FOLD_MAX_E / 32];
};

__host__ __device__ __forceinline__ bool route_folds(int E, int k) {
    return E >= k && E <= ST_ROUTE_FOLD_MAX_E && k >= 1 && k <= ST_ROUTE_FOLD_MAX_K;
}

// A logit as the ranking reads it: NaN as -inf. The candidates' counts need a total order: a
// NaN is before nothing and nothing is before it, so two candidates could take one rank and
// leave another unwritten, whose stale id would index the counts and the slot map.
__device__ __forceinline__ float route_logit(float v) { return v == v ? v : -INFINITY; }

__device__ __forceinline__ void route_load(const float *logits, int E, st_route_smem &s) {
    // Padding (ids >= E) holds -inf and sorts after every expert.
    for (int i = threadIdx.x; i < (E + 31) / 32 * 32; i += blockDim.x) s.l[i] = i < E ? route_logit(logits[i]) : -INFINITY;
}

__device__ __forceinline__ void route_rank(int E, int k, st_route_smem &s, bool pairs) {
    int lane = threadIdx.x & 31, nw = blockDim.x >> 5, ng = (E + 31) / 32;
    int gw = pairs && ng > nw ? 2 : 1, nm = (ng + gw - 1) / gw, nc = nm * k; // groups a sort, sorts
    for (int g = threadIdx.x >> 5; g < nm; g += nw) {
        int i = 32 * gw * g + lane;
        float v = s.l[i];
        if (gw == 2) {
            int ib = i + 32; // (past the last group: -inf, after every expert)
            float vb = ib < 32 * ng ? s.l[ib] : -INFINITY;
            route_sort_warp2(v, i, vb, ib);
        } else {
            route_sort_warp(v, i);
        }
        if (lane < k) s.cv[g * k + lane] = v, s.ci[g * k + lane] = i;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < nc; c += blockDim.x) {
        float v = s.cv[c];
        int i = s.ci[c], r = 0;
        for (int o = 0; o < nc; o++) r += route_before(s.cv[o], s.ci[o], v, i);
        if (r < k) s.top[r] = i, s.tv[r] = v;
    }
    __syncthreads();
}

// Every thread of the block calls it (a barrier inside); counts (or NULL) += 1 per choice.
__device__ __forceinline__ void route_weights(int E, int k, st_route_smem &s, int32_t *ids, float *w,
                                              uint32_t *counts) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, ng = (E + 31) / 32;
    float mx = s.tv[0];
    for (int g = warp; g < ng; g += blockDim.x >> 5) {
        int i = 32 * g + lane;
        double ex = warp_sum_d(i < E ? exp((double)s.l[i] - mx) : 0.0);
        if (lane == 0) s.sum[g] = ex;
    }
    __syncthreads();
    if (warp != 0) return;
    double sum = 0;
    for (int g = 0; g < ng; g++) sum += s.sum[g];
    float wr = lane < k ? (float)(exp((double)s.tv[lane] - mx) / sum) : 0.0f;
    double ws = warp_sum_d((double)wr);
    if (ws < 6.1e-5) ws = 6.1e-5; // llama.cpp's clamp, as on the CPU
    if (lane < k) {
        ids[lane] = s.top[lane];
        w[lane] = (float)(wr / ws);
        if (counts) atomicAdd(&counts[s.top[lane]], 1u);
    }
}

// Asks L2 for bytes [0, n) at p, the block's threads taking 128-byte lines in turn. Weight
// kernels call it before st_pdl_begin (weights are never written by a kernel), so the lines
// stream in while the kernel before finishes.
__device__ __forceinline__ void prefetch_l2(const void *p, size_t n) {
    for (size_t off = (size_t)threadIdx.x * 128; off < n; off += (size_t)blockDim.x * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"((const char *)p + off));
}

// Activations to 8 bits (q8_1 style, as the CPU's q8_0): the scale of a block of 32 whose
// largest magnitude is amax, its inverse, and one value rounded half away from zero. Every
// kernel that quantizes activations goes through these, so each gets the same bits.
__device__ __forceinline__ float st_q8_scale(float amax, float *inv) {
    float d = amax / 127.0f;
    *inv = d != 0.0f ? 1.0f / d : 0.0f;
    return d;
}
__device__ __forceinline__ uint32_t st_q8_byte(float x, float inv) { return (uint8_t)(int8_t)roundf(x * inv); }

// One chunk of 32 values of a row cols wide (x: a whole warp's lane's value c·32 + lane) into q
// and ds, the row's values and {scale, sum}s, in quant_split's layout and order (lanes of four
// consecutive values, butterflied at 4, 2, 1 of those lanes): a kernel whose output feeds a
// product hands it quantized (st_cuda_matmul_q8), with the bits the product's own quantization
// would give.
__device__ __forceinline__ void st_quant_chunk32(float x, int8_t *q, float2 *ds, int cols, int c, int lane) {
    float amax = fabsf(x);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float x1 = __shfl_down_sync(0xffffffffu, x, 1), x2 = __shfl_down_sync(0xffffffffu, x, 2);
    float x3 = __shfl_down_sync(0xffffffffu, x, 3);
    float sum = x + x1 + x2 + x3; // (lanes 4l: values 4l .. 4l+3)
    sum += __shfl_xor_sync(0xffffffffu, sum, 16);
    sum += __shfl_xor_sync(0xffffffffu, sum, 8);
    sum += __shfl_xor_sync(0xffffffffu, sum, 4);
    float id, d = st_q8_scale(amax, &id);
    uint32_t b = st_q8_byte(x, id);
    uint32_t b1 = __shfl_down_sync(0xffffffffu, b, 1), b2 = __shfl_down_sync(0xffffffffu, b, 2);
    uint32_t b3 = __shfl_down_sync(0xffffffffu, b, 3);
    if ((lane & 3) == 0)
        *(uint32_t *)(q + (lane < 16 ? c * 16 + lane : cols / 2 + c * 16 + lane - 16)) = b | b1 << 8 | b2 << 16 | b3 << 24;
    if (lane == 0) ds[c] = make_float2(d, sum);
}

// An L2 policy for weights read once a token: their lines are evicted first, so the kernels'
// code, the activations and the KV cache are not pushed out of L2 by the ~40 MB a layer streams.
__device__ __forceinline__ unsigned long long st_l2_evict_first() {
    unsigned long long pol = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
#endif
    return pol;
}
// One thread asks L2 for bytes [0, n) at p with that policy (sm_90: bulk prefetches, the copy
// engine walking the lines; elsewhere one line at a time, without the policy).
__device__ __forceinline__ void prefetch_l2_bulk(const void *p, size_t n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned long long pol = st_l2_evict_first();
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)15, e = ((uintptr_t)p + n + 15) & ~(uintptr_t)15;
    for (; a < e; a += 65536) {
        unsigned sz = (unsigned)(e - a < 65536 ? e - a : 65536);
        asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(a), "r"(sz), "l"(pol) : "memory");
    }
#else
    for (size_t off = 0; off < n; off += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"((const char *)p + off));
#endif
}
// prefetch_l2 with the streaming policy: thread 0 of the block issues it.
__device__ __forceinline__ void prefetch_l2_stream(const void *p, size_t n) {
    if (threadIdx.x == 0) prefetch_l2_bulk(p, n);
}

// Asynchronous copies global -> shared (sm_80 and newer): 16 bytes, zeros when !valid (no global
// read); a thread's copies so far form a group (commit), and wait<N> waits until at most N of its
// groups are still in flight. Both addresses 16-byte aligned.
__device__ __forceinline__ void st_cp_async16(void *dst, const void *src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned addr = (unsigned)__cvta_generic_to_shared(dst);
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src), "r"(n));
#else
    *(uint4 *)dst = valid ? *(const uint4 *)src : make_uint4(0, 0, 0, 0);
#endif
}
// st_cp_async16 (valid) with an L2 policy (st_l2_evict_first).
__device__ __forceinline__ void st_cp_async16_pol(void *dst, const void *src, unsigned long long pol) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned addr = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src), "l"(pol));
#else
    (void)pol;
    *(uint4 *)dst = *(const uint4 *)src;
#endif
}
__device__ __forceinline__ void st_cp_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N> __device__ __forceinline__ void st_cp_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// Lets kernel k take dyn bytes of dynamic shared memory: beyond the default (48 KB including the
// kernel's static shared memory) it must opt in, a function attribute (fine while recording).
template <typename... P> static inline void st_allow_smem(st_cuda *c, void (*k)(P...), size_t dyn) {
    cudaFuncAttributes fa;
    if (cudaFuncGetAttributes(&fa, (const void *)k) != cudaSuccess) {
        cudaGetLastError();
        return;
    }
    if (dyn > (size_t)fa.maxDynamicSharedSizeBytes)
        ST_CU(c, cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dyn));
}

// Whether environment variable name is set to exactly value (the backend's switches, each read
// once by its caller).
static inline bool st_env_is(const char *name, const char *value) {
    const char *v = getenv(name);
    return v && !strcmp(v, value);
}

// Launches kernel k on c->stream (with programmatic dependent launch when c->pdl); a failed
// launch is kept as the backend's error. Arguments convert implicitly to the kernel's parameter
// types, as in a call (a null pointer is nullptr here: NULL would arrive as an integer).
template <typename T> static inline T st_arg(T v) { return v; }
// st_launch_on: on stream s, with programmatic dependent launch when pdl (the side stream's
// kernels follow an event, not a kernel, and take none).
// A launch's configuration: with programmatic dependent launch when pdl, and in clusters of
// that shape when it holds more than one block (st_cluster_fits).
static inline cudaLaunchConfig_t st_launch_cfg(cudaStream_t s, bool pdl, dim3 cluster, dim3 grid, dim3 block,
                                               size_t smem, cudaLaunchAttribute *attr) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = attr;
    if (pdl) {
        attr[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[cfg.numAttrs++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (cluster.x * cluster.y * cluster.z > 1) {
        attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
        attr[cfg.numAttrs].val.clusterDim.x = cluster.x;
        attr[cfg.numAttrs].val.clusterDim.y = cluster.y;
        attr[cfg.numAttrs++].val.clusterDim.z = cluster.z;
    }
    return cfg;
}
template <typename... P, typename... A>
static inline void st_launch_ex(st_cuda *c, cudaStream_t s, bool pdl, dim3 cluster, void (*k)(P...), dim3 grid,
                                dim3 block, size_t smem, A... args) {
    cudaLaunchAttribute attr[2];
    cudaLaunchConfig_t cfg = st_launch_cfg(s, pdl, cluster, grid, block, smem, attr);
    ST_CU(c, cudaLaunchKernelEx(&cfg, k, st_arg<P>(args)...));
    if (c->trace && s == c->stream) st_cuda_trace_launch(c, (const void *)k, grid, block, smem);
}
template <typename... P, typename... A>
static inline void st_launch_on(st_cuda *c, cudaStream_t s, bool pdl, void (*k)(P...), dim3 grid, dim3 block,
                                size_t smem, A... args) {
    st_launch_ex(c, s, pdl, dim3(1), k, grid, block, smem, args...);
}
template <typename... P, typename... A>
static inline void st_launch(st_cuda *c, void (*k)(P...), dim3 grid, dim3 block, size_t smem, A... args) {
    st_launch_on(c, c->stream, c->pdl, k, grid, block, smem, args...);
}
// st_launch in clusters of that shape (the grid a multiple of it; st_cluster_fits).
template <typename... P, typename... A>
static inline void st_launch_cluster(st_cuda *c, dim3 cluster, void (*k)(P...), dim3 grid, dim3 block, size_t smem,
                                     A... args) {
    st_launch_ex(c, c->stream, c->pdl, cluster, k, grid, block, smem, args...);
}

// Thread block clusters (sm_90 and newer): the blocks of a cluster are resident together and
// read each other's shared memory. Where several blocks' partial results are summed (decode
// attention's context splits, the experts' k slots of a row tile), a cluster's barrier and
// reads from its blocks' shared memory replace publishing to L2 with fences, counting in with
// an atomic and reading back by the last block (H200, 2026-12-01: 30B-A3B decode +5%).
// st_cluster_on: false with STRATA_CLUSTER=0 (the counting path everywhere, as on GPUs before
// sm_90: for tests and A/B runs). st_cluster_fits: whether kernel k can run in clusters of
// that shape (e.g. dim3(1, 4): four blocks along y) with every cluster resident at once (sizes over 8 need
// the non-portable opt-in, allowed up to 16 on Hopper). A grid whose clusters would run in two
// waves counts in instead: the Next-80B-A3B's 64 clusters of 10 down blocks did not fit at once,
// and the second wave cost that kernel 4 us (decode -5%).
bool st_cluster_on(void);
// The most clusters of (device, kernel, cluster size, block, shared memory) resident at once,
// asked of the runtime once (windows that run eagerly launch these kernels every step): with
// max >= 0 it is recorded; returns the recorded value, or -1 if none. Clusters of one block are
// single blocks (st_one_wave).
int st_cluster_known(int device, const void *k, dim3 cluster, unsigned block, size_t smem, int max);
// How many blocks of kernel k (threads each, smem bytes of dynamic shared memory) are resident
// at once on the card: 0 where a block cannot take smem bytes at all. Lets the kernel take them;
// asked of the runtime once (st_cluster_known).
template <typename... P> static inline int st_resident_blocks(st_cuda *c, void (*k)(P...), unsigned threads, size_t smem) {
    int n = st_cluster_known(c->device, (const void *)k, dim3(1), threads, smem, -1);
    if (n < 0) {
        cudaFuncAttributes fa;
        int per_sm = 0;
        if (cudaFuncGetAttributes(&fa, (const void *)k) != cudaSuccess) {
            cudaGetLastError();
        } else if (fa.sharedSizeBytes + smem <= c->prop.sharedMemPerBlockOptin) {
            st_allow_smem(c, k, smem);
            if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, (int)threads, smem) != cudaSuccess)
                cudaGetLastError(), per_sm = 0;
        }
        n = per_sm * c->prop.multiProcessorCount;
        st_cluster_known(c->device, (const void *)k, dim3(1), threads, smem, n);
    }
    return n;
}
// Whether `blocks` blocks of kernel k are all resident at once (st_resident_blocks).
template <typename... P>
static inline bool st_one_wave(st_cuda *c, void (*k)(P...), unsigned long blocks, unsigned threads, size_t smem) {
    int n = st_resident_blocks(c, k, threads, smem);
    return n > 0 && blocks <= (unsigned long)n;
}
template <typename... P>
static inline bool st_cluster_fits(st_cuda *c, void (*k)(P...), dim3 cluster, dim3 grid, dim3 block, size_t smem) {
    unsigned size = cluster.x * cluster.y * cluster.z;
    if (!st_cluster_on() || c->prop.major < 9 || size < 2 || size > 16 || grid.x % cluster.x || grid.y % cluster.y ||
        grid.z % cluster.z)
        return false;
    unsigned threads = block.x * block.y * block.z;
    long clusters = (long)grid.x * grid.y * grid.z / size;
    int n = st_cluster_known(c->device, (const void *)k, cluster, threads, smem, -1);
    if (n < 0) {
        n = 0;
        if (size > 8 && cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
            cudaGetLastError();
        } else {
            cudaLaunchAttribute attr[2];
            cudaLaunchConfig_t cfg = st_launch_cfg(c->stream, false, cluster, grid, block, smem, attr);
            if (cudaOccupancyMaxActiveClusters(&n, (const void *)k, &cfg) != cudaSuccess) cudaGetLastError(), n = 0;
        }
        st_cluster_known(c->device, (const void *)k, cluster, threads, smem, n);
    }
    return n > 0 && clusters <= n;
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define ST_CLUSTERS 1
// The cluster's barrier: every thread of every block arrives (its shared-memory writes
// released) and waits (the others' acquired). Also a barrier of this block's threads.
__device__ __forceinline__ void st_cluster_sync() {
    __cluster_barrier_arrive();
    __cluster_barrier_wait();
}
// The two halves of a barrier apart: arriving without ordering memory (this block has started),
// and waiting for the others' arrivals (their released writes acquired).
__device__ __forceinline__ void st_cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory"); }
__device__ __forceinline__ void st_cluster_wait() { asm volatile("barrier.cluster.wait;" ::: "memory"); }
// p (this block's shared memory) in block `rank` of the cluster: a generic address to load from.
template <typename T> __device__ __forceinline__ const T *st_cluster_peer(const T *p, unsigned rank) {
    return (const T *)__cluster_map_shared_rank((const void *)p, rank);
}
// The same, to store to.
template <typename T> __device__ __forceinline__ T *st_cluster_peer(T *p, unsigned rank) {
    return (T *)__cluster_map_shared_rank((void *)p, rank);
}

// Stores into the cluster's blocks that count their own arrival: a block's mbarrier (in its
// shared memory) completes its phase once its own arrival is in and the bytes it expects have
// landed, whichever block stored them, with no cluster barrier and no fence on the storing side.
// The mbarrier is set up before the block's arrival at the cluster's barrier
// (st_cluster_started), and the peers store only after waiting on that barrier.
__device__ __forceinline__ unsigned st_smem_addr(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void st_mbar_init(unsigned long long *bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(st_smem_addr(bar)), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void st_mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// This thread's arrival, with the bytes the phase waits for (before or after they land).
__device__ __forceinline__ void st_mbar_expect(unsigned long long *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(st_smem_addr(bar)), "r"(bytes) : "memory");
}
// Until phase `parity` of bar has completed (what its stores wrote is then visible here).
__device__ __forceinline__ void st_mbar_wait(unsigned long long *bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done)
                     : "r"(st_smem_addr(bar)), "r"(parity)
                     : "memory");
    } while (!done);
}
// n bytes (a multiple of 16, both addresses 16-byte aligned) from global memory into this
// block's shared memory by the copy engine, counted on bar (this block's) as they land: the
// issuing thread does not wait for them, where the load path's copies (st_cp_async16) stall it
// once its queue is full.
__device__ __forceinline__ void st_bulk_copy(void *dst, const void *src, unsigned n, unsigned long long *bar,
                                             unsigned long long pol) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                 ::"r"(st_smem_addr(dst)), "l"(src), "r"(n), "r"(st_smem_addr(bar)), "l"(pol)
                 : "memory");
}
// A cluster kernel's start where its blocks store into each other later: this block arrives at
// the cluster's barrier (it has started; with counted, its mbarrier bar is set up first), and a
// peer's st_cluster_wait before its first store says every block of the cluster is ready.
__device__ __forceinline__ void st_cluster_started(unsigned long long *bar, bool counted) {
    if (counted && threadIdx.x == 0) {
        st_mbar_init(bar, 1);
        st_mbar_init_fence();
    }
    st_cluster_arrive_relaxed();
}
// v stored at p's place in block `rank`'s shared memory, counted (4 bytes) on that block's bar
// (bar's place there).
__device__ __forceinline__ void st_store_counted(float *p, unsigned long long *bar, unsigned rank, float v) {
    unsigned a, b;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(st_smem_addr(p)), "r"(rank));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(b) : "r"(st_smem_addr(bar)), "r"(rank));
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(a),
                 "r"(__float_as_uint(v)), "r"(b)
                 : "memory");
}
#endif

// A scratch buffer of at least `bytes` (contents undefined). Grows outside graph recording
// only; a window's first run is never recorded, so recordings see buffers already grown.
// NULL (and the error kept) when the GPU is out of memory or a recording would need to grow.
void *st_cuda_scratch(st_cuda *c, int slot, size_t bytes);

// profile.cu: STRATA_CUDA_PROFILE=1 wraps every op with CUDA-event timing (graphs off); the
// table is printed when the backend is freed.
const st_backend_ops *st_cuda_profile_ops(const st_backend_ops *real, bool time_ops, const char *skip_keys);
void st_cuda_profile_report(const st_cuda *c);
// STRATA_CUDA_TRACE: start (false and a message when it cannot); a recording's launch labels,
// handed to its graph; records reset before a replay and read after it; the table, at close.
bool st_cuda_trace_start(st_cuda *c);
struct st_trace_labels *st_cuda_trace_take(st_cuda *c);
void st_cuda_trace_reset(st_cuda *c);
void st_cuda_trace_replayed(st_cuda *c, const struct st_trace_labels *l);
void st_cuda_trace_free(struct st_trace_labels *l);
void st_cuda_trace_stop(st_cuda *c); // prints the table

// ---------------------------------------------------------------------------------------------
// Ops, by file. Rules for every op (see DESIGN.md and backend.h):
// - Run on c->stream, asynchronously; report errors through st_cuda_fail, never exit.
// - With n <= ST_CUDA_GRAPH_ROWS rows (a decode / verify window) an op may be recorded into a
//   CUDA graph: no host synchronization, no allocation except st_cuda_scratch, and a launch
//   configuration that depends only on the arguments' sizes, never on values in device memory
//   (positions come from pos_dev / pos ids in device memory, expert ids from ids).
// - With more rows (prompt chunks) an op may synchronize and read device values on the host.
#define ST_CUDA_GRAPH_ROWS 16

// cuda.cu: the shared expert (on the side stream for decode windows), and the join every reader
// of its output calls first (the moe op's down kernel, add_gated_rows, the copies to the host,
// sync and the end of a recording).
void st_cuda_shared_ffn(st_backend *b, const st_shared_ffn_args *a);
void st_cuda_join_shared(st_cuda *c);

// quant_matmul.cu: quantized weights
void st_cuda_matmul(st_backend *b, const st_mat *w, const float *x, int n, float *y);
void st_cuda_matmul_many(st_backend *b, int nw, const st_mat *const *w, const float *x, int n, float *const *y);
// Weights kept as floats (f32, f16, bf16): the quantized-activation kernels do not take them.
static inline bool st_cuda_float_type(st_type t) { return t == ST_TYPE_F32 || t == ST_TYPE_F16 || t == ST_TYPE_BF16; }
// y = w · x for x given quantized (n rows of w->cols in quant_split's layout: int8 values, then
// {scale, sum} per 32), where st_cuda_q8_takes(w, n) (quantized weights, n <= ST_CUDA_GRAPH_ROWS,
// w->cols a multiple of 32); false where it does not apply, and the caller multiplies the floats
// instead. The blocks spread their weights' staged copies over spread_ns (0: all at once).
bool st_cuda_q8_takes(const st_mat *w, int n);
bool st_cuda_matmul_q8(st_backend *b, const st_mat *w, const int8_t *xq, const float2 *xds, int n, float *y,
                       unsigned spread_ns);
// A mixer's (attention's, DeltaNet's) output projection. The mixer may write its n rows of cols
// outputs quantized too, into st_cuda_proj_buf's scratch (ST_SCR_ATTQ: the values, then *ds;
// NULL with the error kept where it fails); st_cuda_project then multiplies those (q given: the
// same bits as quantizing x, and its blocks stage their weights while the mixer runs), else x.
int8_t *st_cuda_proj_buf(st_cuda *c, int n, size_t cols, float2 **ds);
void st_cuda_project(st_backend *b, const st_mat *w, const int8_t *q, const float2 *ds, const float *x, int n,
                     float *y);
void st_cuda_norm_matmul(st_backend *b, const float *x, const float *y, float *xo, const float *norm_w, float eps,
                         float *xn, int n, int d, int nw, const st_mat *const *w, float *const *out);
void st_cuda_get_rows(st_backend *b, const st_mat *w, const int32_t *ids, int n, float *y);
void st_cuda_moe(st_backend *b, const st_moe_args *a);
bool st_cuda_type_supported(st_type t);  // matmul / get_rows / moe handle this weight type

// ops.cu: element-wise, norms, rope, router, argmax, conv
void st_cuda_rmsnorm(st_backend *b, const float *x, const float *w, float *y, int n, int d, float eps);
void st_cuda_l2norm(st_backend *b, float *x, int n, int d, float eps, float scale);
// The residual sum xo = x + y (with y; xo may alias x) and xn = rmsnorm(sum) · w, a block a row.
void st_cuda_add_rmsnorm(st_cuda *c, const float *x, const float *y, float *xo, const float *w, float *xn, int n,
                         int d, float eps);
void st_cuda_norm_rope(st_backend *b, float *x, const float *w, int n, int n_head, int head_dim, int n_rot,
                       const int32_t *pos, float base, float eps);
void st_cuda_rope(st_backend *b, float *x, int n, int n_head, int head_dim, int n_rot,
                  const int32_t *pos, float base);
void st_cuda_norm_rope_qk(st_backend *b, const st_attn_args *a); // a's q and k norms and rope, one launch
void st_cuda_conv(st_backend *b, const st_conv_args *a);
void st_cuda_add(st_backend *b, float *y, const float *x, int64_t n);
void st_cuda_swiglu(st_backend *b, const float *gate, const float *up, float *y, int64_t n);
void st_cuda_mul_sigmoid(st_backend *b, float *y, const float *gate, int64_t n);
void st_cuda_mul_silu(st_backend *b, float *y, const float *gate, int64_t n);
void st_cuda_rmsnorm_silu(st_backend *b, const float *x, const float *w, const float *gate, float *y, int n, int d,
                          float eps);
void st_cuda_add_gated_rows(st_backend *b, float *y, const float *x, const float *g, int n, int d);
void st_cuda_gdn_gates(st_backend *b, const float *ba, const float *ssm_a, const float *dt_bias,
                       float *beta, float *g, int n, int h_k, int h_v);
void st_cuda_split_heads(st_backend *b, const float *x, float *ya, float *yb, int n, int heads, int a,
                         int bdim);
void st_cuda_copy_cols(st_backend *b, const float *x, int64_t ldx, int64_t x_from, float *y, int64_t ldy,
                       int64_t y_from, int n, int64_t w);
void st_cuda_moe_route(st_backend *b, const float *logits, int n, int n_expert, int k, int32_t *ids,
                       float *weights);
void st_cuda_argmax(st_backend *b, const float *x, int n, int d, int32_t *ids);

// attention.cu
void st_cuda_attention(st_backend *b, const st_attn_args *a);

// gdn.cu: the Gated DeltaNet recurrence
void st_cuda_gdn(st_backend *b, const st_gdn_args *a);
void st_cuda_gdn_chunked(st_backend *b, const st_gdn_args *a);
void st_cuda_deltanet(st_backend *b, const st_deltanet_args *a);
bool st_cuda_deltanet_fuses(const st_deltanet_args *a); // the one-kernel path applies (else the ops)
#define ST_CUDA_GDN_CHUNKED_FROM 32 // rows from which the forward uses the chunked form
