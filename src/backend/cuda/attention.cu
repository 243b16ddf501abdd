// backend/cuda: causal attention over the KV cache (f16, q8_0 or f32 rows): the new rows are
// stored first, then a flash-attention kernel (FP32 for decode windows, tensor cores for prompt
// chunks and large windows; the context split across blocks when the grid would be small) and a
// combine kernel for the splits. Whichever writes the output applies Qwen3-Next's gate to it.

#include <math.h>
#include <stdlib.h>

#include <type_traits>

#include "backend/cuda/cuda_common.cuh"

// ---------------------------------------------------------------------------------------------
// Cache store: rows pos0 .. pos0+n-1 (pos0 read on the device, so a recording serves every
// position). A cache row is n_head_kv * head_dim values in order, quantized as st_quantize does.

// F16 / F32: one thread per value; which of K and V is blockIdx.y.
__global__ void kv_store_plain_kernel(st_kv_layer kv, const int32_t *pos_dev, const float *k, const float *v,
                                      int n, int nv) {
    st_pdl_begin();
    const float *src = blockIdx.y ? v : k;
    char *base = (char *)(blockIdx.y ? kv.v : kv.k);
    int pos0 = *pos_dev;
    int64_t total = (int64_t)n * nv;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
        int i = (int)(e / nv), x = (int)(e % nv);
        char *row = base + (size_t)(pos0 + i) * kv.row_bytes;
        if (kv.type == ST_KV_F16) ((__half *)row)[x] = __float2half_rn(src[e]);
        else ((float *)row)[x] = src[e];
    }
}

// Q8_0: one warp per block of 32 values (lane = value): d = amax/127, q = round(x/d) half away
// from zero, exactly as the CPU quantizer (same float operations, IEEE division).
__global__ void kv_store_q8_kernel(st_kv_layer kv, const int32_t *pos_dev, const float *k, const float *v,
                                   int n, int nv) {
    st_pdl_begin();
    const float *src = blockIdx.y ? v : k;
    char *base = (char *)(blockIdx.y ? kv.v : kv.k);
    int pos0 = *pos_dev, lane = threadIdx.x & 31, nb = nv / QK8_0;
    int64_t total = (int64_t)n * nb, warps = (int64_t)gridDim.x * (blockDim.x >> 5);
    for (int64_t wb = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5); wb < total; wb += warps) {
        int i = (int)(wb / nb), blk = (int)(wb % nb);
        float x = src[(size_t)i * nv + (size_t)blk * QK8_0 + lane];
        float amax = fabsf(x);
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        float id, d = st_q8_scale(amax, &id);
        char *b = base + (size_t)(pos0 + i) * kv.row_bytes + (size_t)blk * sizeof(block_q8_0);
        if (lane == 0) *(__half *)b = __float2half_rn(d);
        ((int8_t *)(b + 2))[lane] = (int8_t)st_q8_byte(x, id);
    }
}

// ---------------------------------------------------------------------------------------------
// Attention. A block owns one KV head, a tile of QB = 8 warps x QPW queries of that head's group
// (query index qi = row * G + head-in-group: every query of the window that reads this KV head),
// and one split of the context. Per KV tile of TK positions, staged as floats in shared memory:
//   scores: lane = position (two lanes per position, each half the dims, when head_dim > 128),
//           all QPW queries of the warp at once, so each K value loaded serves QPW queries;
//   online softmax per query (running max m, lane-partial sums l, rescaled accumulators);
//   P·V:    lane = head dims (EPL = head_dim / 32 each), p broadcast from shared memory.
// So each cache row is read once per query tile: once for the whole window when n·G <= 8·QPW.
// With several splits, each writes (m, l, acc) and attn_combine_kernel merges them.

#define ATTN_WARPS 8

typedef struct attn_params {
    const void *kc, *vc;   // cache bases
    size_t row_bytes;
    int kv_type;           // st_kv_type
    const int32_t *pos_dev;
    const float *q;        // (n, H, D); (n, H, 2 D) with the gates after the queries (gate)
    float *out;            // (n, H, D), written when ns == 1
    float *part;           // (ns, n, H, D + 2): m, l, acc of each split, when ns > 1
    // Fused store (FP32 kernel, f16 / f32 cache): the new rows pos0 .. pos0+n-1 come from these
    // inputs (rounded as the cache rounds them), never from the cache, and the blocks of split 0,
    // query tile 0 write them there. So no block reads a row another block is writing.
    const float *knew, *vnew; // (n, nv) or NULL: a separate store kernel ran first
    int nv;                   // values per cache row (n_head_kv * D)
    // Fused q / k norms and RoPE (Qwen3; fused store only): each block normalizes and rotates
    // its queries and its head's new k rows itself (norm_rope_kernel's arithmetic), so q and k
    // stay raw in memory. qn NULL: q and k arrive ready.
    const float *qn, *kn;     // (D) norm weights
    const int32_t *pos;       // (n) positions of the rows
    int n_rot;
    float rope_base, eps;
    size_t extra;             // dynamic shared memory beyond attn_shape::smem (the fused norms)
    // Last block combines: with ns > 1 the block that finishes last for its (query tile, kv
    // head) merges the splits (counter: attn_counters[hk * gridDim.x + query tile]; in clusters
    // one for each rank, [that · cs + rank]), so no combine kernel runs. NULL: attn_combine_kernel
    // runs after.
    unsigned *counters;
    // The first tile's rows of earlier steps are read before the wait even when the tile also
    // holds new rows (patched in after): STRATA_ATTN_EARLY=0 reads such a tile after (A/B).
    int early_mix;
    int n, H, G, nq, ns, min_chunk;
    float scale;
    // The FP32 kernel with its own combine, or NULL: out also quantized for the output
    // projection (n rows of H·D in quant_split's layout and arithmetic: the same bits).
    int8_t *oq;
    float2 *ods;
    // > 1: the splits run in clusters of cs blocks (ns a multiple of it, sm_90+), which merge
    // their partials through shared memory (attn_cluster_merge); where more than one cluster
    // holds positions, each cluster's merged partial counts in through L2 as one split did.
    int cs;
    // In a cluster: the partials that land in a merging block are counted on its mbarrier, which
    // it waits on instead of the cluster's barrier (STRATA_ATTN_COUNTED=0: the barrier).
    int counted;
    // The gated attention (st_attn_args.gated): q + D, so (row, head) rh's gate is at gate +
    // rh · 2 D, and whichever writes the output multiplies it by sigmoid(gate) (mul_sigmoid_kernel's
    // arithmetic, on the value out would hold). NULL: not gated. The attention kernels run their
    // GATE instances for it (queries 2 D apart), so the others' code and registers stay as they were.
    const float *gate;
} attn_params;

// The cluster merge's receiving area: for each query a block merges (ql = rank + k cs, k <
// ceil(qn / cs) for qn queries a tile, slot k cs + source rank), one partial of each split of its
// cluster of cs; past the tiles' shared memory (smem) and the fused norms' (extra).
__host__ __device__ constexpr int attn_recv_floats(int qn, int cs, int D) { return (qn + cs - 1) / cs * cs * (D + 2); }
__host__ __device__ constexpr size_t attn_recv_at(size_t smem, size_t extra) { return smem + (extra + 15) / 16 * 16; }

// Zero at load; the last block of each (query tile, kv head) puts its counter back to zero, so
// every launch (and every graph replay) starts from zero. Kernels on the one stream never
// overlap, so one array serves every layer.
#define ATTN_MAX_COUNTERS 4096
__device__ unsigned attn_counters[ATTN_MAX_COUNTERS];

// A tile of cache rows t0 .. t0+TK-1 of head hk as floats, 8 values per thread-step: fetched
// into registers (attn_fetch_tile) one tile ahead, so the loads of the next tile are in flight
// while this one is computed, then stored to shared memory (attn_store_tile). Zeros at and past
// t_end: masked scores never read garbage, and p = 0 times a zero stays 0.
template <int D, int TK>
struct attn_tile {
    static constexpr int G8 = D / 8;                                           // 8-value groups per row
    static constexpr int STEPS = (TK * G8 + ATTN_WARPS * 32 - 1) / (ATTN_WARPS * 32); // per thread
    float v[STEPS][8];
};

// Values x8 .. x8+7 of new row i (at fresh + i * fstride, this head's values) as the cache
// stores them: from the input, rounded as kv_store_plain_kernel rounds them.
__device__ __forceinline__ void attn_fresh8(float *v, const float *fresh, int fstride, int i, int x8, int kv_type) {
    const float4 *f = (const float4 *)(fresh + (size_t)i * fstride + x8);
    float4 a = f[0], b = f[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    if (kv_type == ST_KV_F16) {
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = __half2float(__float2half_rn(v[e]));
    }
}

// The rows pos0 .. t_end-1 of a tile fetched early (rows of earlier steps only, zeros past
// them), from the new rows once they exist.
template <int D, int TK>
__device__ __forceinline__ void attn_patch_tile(attn_tile<D, TK> &r, const float *fresh, int fstride, int kv_type,
                                                int t0, int t_end, int pos0) {
    typedef attn_tile<D, TK> R;
#pragma unroll
    for (int k = 0; k < R::STEPS; k++) {
        int gi = threadIdx.x + k * ATTN_WARPS * 32, t = t0 + gi / R::G8;
        if (gi < TK * R::G8 && t < t_end && t >= pos0) attn_fresh8(r.v[k], fresh, fstride, t - pos0, (gi % R::G8) * 8, kv_type);
    }
}

// fresh: the new rows (row t - pos0 at fresh + (t - pos0) * fstride), this head's values.
template <int D, int TK>
__device__ __forceinline__ void attn_fetch_tile(attn_tile<D, TK> &r, const void *cache, const float *fresh,
                                                int fstride, const attn_params &p, int hk, int t0, int t_end,
                                                int pos0) {
    typedef attn_tile<D, TK> R;
#pragma unroll
    for (int k = 0; k < R::STEPS; k++) {
        int gi = threadIdx.x + k * ATTN_WARPS * 32, tt = gi / R::G8, x8 = (gi % R::G8) * 8, t = t0 + tt;
        float *v = r.v[k];
        if (gi < TK * R::G8 && t < t_end && fresh && t >= pos0) {
            attn_fresh8(v, fresh, fstride, t - pos0, x8, p.kv_type);
        } else if (gi < TK * R::G8 && t < t_end) {
            const char *row = (const char *)cache + (size_t)t * p.row_bytes;
            int idx = hk * D + x8; // value index within the cache row
            if (p.kv_type == ST_KV_F16) {
                uint4 raw = *(const uint4 *)(row + (size_t)idx * 2);
                const __half2 *h = (const __half2 *)&raw;
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float2 f = __half22float2(h[e]);
                    v[2 * e] = f.x, v[2 * e + 1] = f.y;
                }
            } else if (p.kv_type == ST_KV_Q8_0) {
                const char *blk = row + (size_t)(idx / QK8_0) * sizeof(block_q8_0);
                float d = __half2float(*(const __half *)blk);
                const int8_t *qs = (const int8_t *)(blk + 2) + idx % QK8_0;
#pragma unroll
                for (int e = 0; e < 8; e++) v[e] = d * (float)qs[e];
            } else {
                const float4 *f = (const float4 *)(row + (size_t)idx * 4);
                float4 a = f[0], b = f[1];
                v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
            }
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] = 0.0f;
        }
    }
}

// dst (TK, stride).
template <int D, int TK>
__device__ __forceinline__ void attn_store_tile(float *dst, int stride, const attn_tile<D, TK> &r) {
    typedef attn_tile<D, TK> R;
#pragma unroll
    for (int k = 0; k < R::STEPS; k++) {
        int gi = threadIdx.x + k * ATTN_WARPS * 32, tt = gi / R::G8, x8 = (gi % R::G8) * 8;
        if (gi >= TK * R::G8) break;
        float4 *o = (float4 *)(dst + tt * stride + x8);
        o[0] = make_float4(r.v[k][0], r.v[k][1], r.v[k][2], r.v[k][3]);
        o[1] = make_float4(r.v[k][4], r.v[k][5], r.v[k][6], r.v[k][7]);
    }
}

template <int EPL, int QPW>
struct attn_shape {
    static constexpr int D = EPL * 32;
    static constexpr int LPP = D > 128 ? 2 : 1;  // lanes per position in the score phase
    static constexpr int TK = 32 / LPP;          // positions per KV tile
    static constexpr int HALF = D / LPP;         // dims each lane of a position sums
    static constexpr int KST = D + 4;            // K row stride: 16-byte loads of 8 lanes hit 8 bank groups
    static constexpr int QB = ATTN_WARPS * QPW;  // queries per block
    static constexpr size_t smem = sizeof(float) * ((size_t)TK * KST + (size_t)TK * D + (size_t)QB * D + (size_t)QB * TK);
};

__device__ __forceinline__ float attn_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The splits that hold positions of [0, T): chunks of ceil(T / ns) rounded up to `align`, as the
// attention kernels cut them (the rest return without writing).
__device__ __forceinline__ int attn_active_splits(int T, int ns, int align) {
    int chunk = (T + ns - 1) / ns;
    chunk = (chunk + align - 1) / align * align;
    return min(ns, (T + chunk - 1) / chunk);
}

// N heads of D values each (v: lane's elements e·32 + lane, loaded by the caller so that a block's
// loads fly together; the heads' chains interleaved, each head's operations unchanged) normalized
// with weights w (the same lanes' elements; NULL: none) and
// rotated with the row's angles cs ((half) cos, (half) sin) into out (shared memory), by one
// warp: norm_rope_kernel's operations in its order, so the values are the ones that kernel writes.
template <int EPL, int N>
__device__ __forceinline__ void attn_norm_rope(const float (&v)[N][EPL], const float (&w)[N][EPL],
                                               const float *const (&cs)[N], int half, float eps,
                                               float *const (&out)[N]) {
    constexpr int D = EPL * 32;
    int lane = threadIdx.x & 31;
    float ss[N];
#pragma unroll
    for (int h = 0; h < N; h++) {
        ss[h] = 0.0f;
#pragma unroll
        for (int e = 0; e < EPL; e++) ss[h] += v[h][e] * v[h][e];
    }
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
        for (int h = 0; h < N; h++) ss[h] += __shfl_xor_sync(0xffffffffu, ss[h], o);
    }
#pragma unroll
    for (int h = 0; h < N; h++) {
        float s = 1.0f / sqrtf(ss[h] / D + eps);
#pragma unroll
        for (int e = 0; e < EPL; e++) out[h][lane + 32 * e] = v[h][e] * s * w[h][e];
    }
    __syncwarp();
    for (int k = lane; k < half; k += 32) {
        float c[N], sn[N], x0[N], x1[N]; // every head's loads before the stores (which may alias them)
#pragma unroll
        for (int h = 0; h < N; h++)
            c[h] = cs[h][k], sn[h] = cs[h][half + k], x0[h] = out[h][k], x1[h] = out[h][k + half];
        // x0 c − x1 sn and x1 c + x0 sn with the contractions ptxas chose for one head (left to
        // itself it contracted the second differently for two: other bits).
#pragma unroll
        for (int h = 0; h < N; h++) {
            out[h][k] = __fmaf_rn(x0[h], c[h], -__fmul_rn(x1[h], sn[h]));
            out[h][k + half] = __fmaf_rn(x0[h], sn[h], __fmul_rn(x1[h], c[h]));
        }
    }
    __syncwarp();
}
// One head.
template <int EPL>
__device__ __forceinline__ void attn_norm_rope(const float (&v)[EPL], const float (&w)[EPL], const float *cs, int half,
                                               float eps, float *out) {
    float v1[1][EPL], w1[1][EPL];
#pragma unroll
    for (int e = 0; e < EPL; e++) v1[0][e] = v[e], w1[0][e] = w[e];
    const float *const cs1[1] = {cs};
    float *const out1[1] = {out};
    attn_norm_rope<EPL, 1>(v1, w1, cs1, half, eps, out1);
}

// A lane's elements e·32 + lane of a head (x, global), or of the norm weights (1 where none).
template <int EPL> __device__ __forceinline__ void attn_load_head(const float *x, float (&v)[EPL]) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int e = 0; e < EPL; e++) v[e] = x ? x[lane + 32 * e] : 1.0f;
}

// Chunk e of 32 of row-head rh's outputs (x: the lane's element e·32 + lane, g its gate), gated,
// stored and quantized as attn_store_out treats each e.
template <int EPL, bool GATE>
__device__ __forceinline__ void attn_store_chunk(const attn_params &p, size_t rh, float x, float g, int e, int lane) {
    constexpr int D = EPL * 32;
    const int cols = p.H * D;
    const size_t row = rh / p.H;
    const int head = (int)(rh % p.H);
    if constexpr (GATE) x *= sigmoidf_(g); // as mul_sigmoid_kernel multiplies the stored output
    p.out[rh * D + e * 32 + lane] = x;
    if (p.oq) st_quant_chunk32(x, p.oq + row * cols, p.ods + row * (cols / 32), cols, head * EPL + e, lane);
}
// A warp stores row-head rh's outputs (lane holding elements e·32 + lane: a[e]), with GATE times
// their gates, to out and, with p.oq, quantized (st_quant_chunk32): each e is one chunk of 32 of
// the row (H·D wide), so the output projection gets the bits it would have quantized itself.
// At head dim 256 the chunks run as a loop (one chunk's code eight times): unrolled, the gated
// store's ~10 KB of straight code ran once a launch from a cold instruction cache while the
// output projection's blocks streamed their weights, and took 6.8 us for one query (H100, Next-
// 80B-A3B; 3.2 us as a loop: its attention 14.4 -> 10.9 us a call). At 128 (four chunks) the
// loop's local copies cost more than they save (30B-A3B attention 10.0 -> 10.4 us).
template <int EPL, bool GATE>
__device__ __forceinline__ void attn_store_out(const attn_params &p, size_t rh, const float (&a)[EPL], int lane) {
    constexpr int D = EPL * 32;
    float v[EPL], g[EPL];
#pragma unroll
    for (int e = 0; e < EPL; e++) v[e] = a[e], g[e] = GATE ? p.gate[rh * 2 * D + e * 32 + lane] : 0.0f;
    if constexpr (EPL >= 8) {
#pragma unroll 1
        for (int e = 0; e < EPL; e++) attn_store_chunk<EPL, GATE>(p, rh, v[e], g[e], e, lane);
    } else {
        if constexpr (GATE) { // as mul_sigmoid_kernel multiplies the stored output
#pragma unroll
            for (int e = 0; e < EPL; e++) v[e] *= sigmoidf_(g[e]);
        }
#pragma unroll
        for (int e = 0; e < EPL; e++) p.out[rh * D + e * 32 + lane] = v[e];
        if (!p.oq) return;
        const int cols = p.H * D;
        const size_t row = rh / p.H;
        const int head = (int)(rh % p.H);
#pragma unroll
        for (int e = 0; e < EPL; e++)
            st_quant_chunk32(v[e], p.oq + row * cols, p.ods + row * (cols / 32), cols, head * EPL + e, lane);
    }
}

// Counts this block in for its (query tile, KV head) once its partials are out: true in the block
// that brings the count to target (it puts the counter back to zero for the next launch, and
// reads everyone's partials after its fence); the others have ended their trace and leave.
// sub, ways: counter sub of the tile's ways (the cluster merge counts each rank apart; 0 and 1
// elsewhere).
__device__ __forceinline__ bool attn_count_in(const attn_params &p, unsigned target, unsigned ts, int sub = 0,
                                              int ways = 1) {
    __shared__ unsigned s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned *ctr = p.counters + ((size_t)blockIdx.z * gridDim.x + blockIdx.x) * ways + sub;
        unsigned prev = atomicAdd(ctr, 1u);
        s_last = prev == target - 1;
        if (s_last) *ctr = 0; // every block of this tile has counted: ready for the next launch
    }
    st_trace_mark(ts, 5);
    __syncthreads();
    if (!s_last) {
        st_trace_end();
        return false;
    }
    __threadfence();
    return true;
}

// Merges the splits of one query for chunk e of its dims (lane's dim e·32 + lane): lane s < ns
// holds split s's (m, l) in ml, acc_of(s) gives a split's accumulators (lane's dim at
// [e·32 + lane]): out = Σ_s e^{m_s − M} acc_s / Σ_s e^{m_s − M} l_s, in the order and arithmetic
// of the in-kernel combine below (the same bits as it for up to 32 splits). Returns M and the
// sum L; *a gets the unnormalized sum.
template <typename F>
__device__ __forceinline__ float2 attn_merge(float2 ml, int ns, F acc_of, int e, float *a) {
    int lane = threadIdx.x & 31;
    float mx = attn_warp_max(lane < ns ? ml.x : -INFINITY); // finite: split 0 sees position 0
    float f = lane < ns && ml.x != -INFINITY ? expf(ml.x - mx) : 0.0f;
    float ls = lane < ns ? ml.y * f : 0.0f;
    for (int o = 16; o > 0; o >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, o);
    float sum = 0.0f;
    for (int s2 = 0; s2 < ns; s2++) sum += __shfl_sync(0xffffffffu, f, s2) * acc_of(s2)[e * 32 + lane];
    *a = sum;
    return make_float2(mx, ls);
}

#if defined(ST_CLUSTERS)
// After the cluster's exchange, block rank r merges its queries ql = r + k cs a chunk of 32 dims
// a warp (units (k, e) over the warps: at head dim 128 and cs 8, four warps for the one query,
// each warp's chain of shuffles, divisions and quantization a quarter of the four chunks' that
// a warp a query ran: 30B-A3B decode +2.4%, bench/results/2026-12-07-attention-chain.md), from its
// receiving area (here splits). Whole: those are the outputs. Else each chunk is a cluster's
// partial, written to L2; the nc blocks of rank r (one a cluster) count in on rank r's counter,
// and the last merges its queries' nc partials the same way.
template <int EPL, int QPW, bool GATE>
__device__ __forceinline__ void attn_cluster_finish(const attn_params &p, const float *recv, int here, bool whole,
                                                    int nc, unsigned ts) {
    typedef attn_shape<EPL, QPW> S;
    constexpr int D = S::D, QB = S::QB, PS = D + 2;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, qbase = blockIdx.x * QB, split = blockIdx.y;
    const int cs = p.cs, rank = split % cs, c0 = split - rank;
    int mine = 0; // this block's queries
    for (int ql = rank; ql < QB && qbase + ql < p.nq; ql += cs) mine++;
    // Unit u: chunk *e of query *ql = rank + cs (u / EPL); returns its (row, head).
    auto unit = [&](int u, int *ql, int *e) {
        *ql = rank + cs * (u / EPL), *e = u % EPL;
        const int qi = qbase + *ql;
        return (size_t)(qi / p.G) * p.H + (size_t)blockIdx.z * p.G + qi % p.G;
    };
    for (int u = w; u < mine * EPL; u += ATTN_WARPS) {
        int ql, e;
        const size_t rh = unit(u, &ql, &e);
        const float g = GATE && whole ? p.gate[rh * 2 * D + e * 32 + lane] : 0.0f;
        const float *base = recv + (ql / cs) * cs * PS;
        float2 ml = lane < here ? *(const float2 *)(base + lane * PS) : make_float2(-INFINITY, 0.0f);
        float a;
        float2 ML = attn_merge(ml, here, [&](int s2) { return base + s2 * PS + 2; }, e, &a);
        if (u == 0) st_trace_mark(ts, 6);
        if (whole) {
            attn_store_chunk<EPL, GATE>(p, rh, a / ML.y, g, e, lane);
        } else {
            float *pp = p.part + ((size_t)(c0 / cs) * p.n * p.H + rh) * PS;
            if (e == 0 && lane == 0) pp[0] = ML.x, pp[1] = ML.y;
            pp[2 + e * 32 + lane] = a;
        }
    }
    st_trace_mark(ts, 7);
    if (whole || !attn_count_in(p, (unsigned)nc, ts, rank, cs)) {
        if (whole) st_trace_end();
        return;
    }
    const size_t ss = (size_t)p.n * p.H * PS; // from one cluster's partials to the next
    for (int u = w; u < mine * EPL; u += ATTN_WARPS) {
        int ql, e;
        const size_t rh = unit(u, &ql, &e);
        const float g = GATE ? p.gate[rh * 2 * D + e * 32 + lane] : 0.0f;
        const float *base = p.part + rh * PS;
        float2 ml = lane < nc ? __ldcg((const float2 *)(base + lane * ss)) : make_float2(-INFINITY, 0.0f);
        float a;
        float2 ML = attn_merge(ml, nc, [&](int s2) { return base + s2 * ss + 2; }, e, &a); // (nc <= 32)
        attn_store_chunk<EPL, GATE>(p, rh, a / ML.y, g, e, lane);
    }
    st_trace_end();
}

// The splits of a cluster (p.cs consecutive splits of one query tile and KV head) merge their
// partials in shared memory. Block r merges queries r, r + cs, ... (attn_cluster_finish): each block
// with positions stores its queries' (m, l, acc) straight into the merging block's receiving
// area (attn_recv_floats, past the tiles and the norms', so a peer may store while this block
// still works on its tiles), one cluster barrier publishes them, and each block merges its
// queries from its own shared memory and leaves without waiting for the others. (Loading the
// peers' partials instead costs a round trip to each and a second barrier before a block may
// leave: 1.2 us more a call, bench/results/2026-12-03-attention-merge.md.) When all the
// positions are in this cluster (every short context), the merge is the output; else the merged
// partial counts in through L2, and the last block of each rank merges the clusters'.
// With p.counted the stores are st.async counted on the merging block's mbarrier (bar, set up
// at the kernel's start), which completes once the partials of all its queries have landed: no
// cluster barrier, whose release waits for every store of the thread to complete first.
template <int EPL, int QPW, bool GATE>
__device__ __forceinline__ void attn_cluster_merge(const attn_params &p, const float (&m)[QPW], const float (&l)[QPW],
                                              const float (&acc)[QPW][EPL], int T, unsigned ts,
                                              unsigned long long *bar) {
    typedef attn_shape<EPL, QPW> S;
    constexpr int D = S::D, QB = S::QB, PS = D + 2; // a query's partial: m, l, acc
    extern __shared__ float4 sm4[];
    float *recv = (float *)((char *)sm4 + attn_recv_at(S::smem, p.extra)); // (attn_cluster_size sizes it)
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, qbase = blockIdx.x * QB, split = blockIdx.y;
    const int cs = p.cs, rank = split % cs, c0 = split - rank;
    const int act = attn_active_splits(T, p.ns, p.min_chunk);
    const int here = min(cs, act - c0); // this cluster's splits with positions (>= 1)
    if (p.counted && threadIdx.x == 0) { // this block's queries' partials, one of each split with positions
        int mine = 0;
        for (int ql = rank; ql < QB && qbase + ql < p.nq; ql += cs) mine++;
        st_mbar_expect(bar, (unsigned)(sizeof(float) * PS * here * mine));
    }
    st_cluster_wait(); // every block of the cluster has started (attn_kernel's arrival at its start)
    if (rank < here) {
#pragma unroll
        for (int jj = 0; jj < QPW; jj++) {
            float lsum = l[jj];
            for (int o = 16; o > 0; o >>= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, o);
            int ql = w * QPW + jj;
            if (qbase + ql >= p.nq) continue;
            float *at = recv + ((ql / cs) * cs + rank) * PS;
            const unsigned to = (unsigned)(ql % cs);
            if (p.counted) {
                if (lane == 0) st_store_counted(at, bar, to, m[jj]), st_store_counted(at + 1, bar, to, lsum);
#pragma unroll
                for (int e = 0; e < EPL; e++) st_store_counted(at + 2 + e * 32 + lane, bar, to, acc[jj][e]);
                continue;
            }
            float *pp = st_cluster_peer(at, to);
            if (lane == 0) *(float2 *)pp = make_float2(m[jj], lsum);
#pragma unroll
            for (int e = 0; e < EPL; e++) pp[2 + e * 32 + lane] = acc[jj][e];
        }
    }
    st_trace_mark(ts, 10);
    if (p.counted) st_mbar_wait(bar, 0); // every partial of this block's queries
    else st_cluster_sync();              // every partial is in its merging block
    st_trace_mark(ts, 4);
    attn_cluster_finish<EPL, QPW, GATE>(p, recv, here, act <= cs, (act + cs - 1) / cs, ts);
}

#endif

// The cluster kernel's merge (sm_90+): true when it ran; the counting kernel goes on to its own.
template <int EPL, int QPW, bool CL, bool GATE>
__device__ __forceinline__ bool attn_merge_in_cluster(const attn_params &p, const float (&m)[QPW],
                                                      const float (&l)[QPW], const float (&acc)[QPW][EPL], int T,
                                                      unsigned ts, unsigned long long *bar) {
#if defined(ST_CLUSTERS)
    if constexpr (CL) {
        attn_cluster_merge<EPL, QPW, GATE>(p, m, l, acc, T, ts, bar);
        return true;
    }
#endif
    (void)p, (void)m, (void)l, (void)acc, (void)T, (void)ts, (void)bar;
    return false;
}

// CL: the splits run in clusters (p.cs > 1; a kernel of its own, so that the counting path's
// registers stay as they were). GATE: the gated attention (p.gate). Up to four values a lane
// (head dim 128, one query a warp: the 30B-A3B's decode) the kernel keeps to 80 registers,
// three blocks a multiprocessor: left to itself ptxas took 96-101 for code that had fitted 80.
template <int EPL, int QPW, bool CL, bool GATE>
__global__ void __launch_bounds__(ATTN_WARPS * 32, EPL * QPW <= 4 ? 3 : 0) attn_kernel(attn_params p) {
    typedef attn_shape<EPL, QPW> S;
    constexpr int D = S::D, TK = S::TK, HALF = S::HALF, KST = S::KST, QB = S::QB;
    constexpr int QS = GATE ? 2 * D : D; // from one (row, head)'s query to the next
    extern __shared__ float4 sm4[];
    float *Ks = (float *)sm4;  // (TK, KST)
    float *Vs = Ks + TK * KST; // (TK, D)
    float *Qs = Vs + TK * D;   // (QB, D)
    float *Ps = Qs + QB * D;   // (QB, TK) probabilities of the current tile
    // Query tiles vary fastest: the tiles reading the same cache rows run together (L2 hits).
    const int qbase = blockIdx.x * QB, split = blockIdx.y, hk = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    // The position and the rows' positions are copied from the host before a step's kernels
    // (no kernel writes them), so they are read before the wait: a split past the context leaves
    // at once, freeing its place for the next kernel's blocks, and the angles are ready early.
    const int pos0 = *p.pos_dev, T = pos0 + p.n;
    // This block's positions: its split of [0, T), cut at the last position its queries see.
    int last_q = min(qbase + QB, p.nq) - 1;
    int t_begin = 0, t_end = min(T, pos0 + last_q / p.G + 1);
    if (p.ns > 1) {
        int chunk = (T + p.ns - 1) / p.ns;
        chunk = (chunk + p.min_chunk - 1) / p.min_chunk * p.min_chunk;
        t_begin = split * chunk;
        // Past the context: the combine does not read this split. In a cluster only a cluster
        // that holds no position leaves (all its blocks alike); the others' idle blocks stay for
        // its barriers, with no positions.
        if (CL ? split / p.cs * p.cs * chunk >= T : t_begin >= T) return;
        t_end = t_begin >= T ? t_begin : min(t_end, t_begin + chunk);
    }
#if defined(ST_CLUSTERS)
    __shared__ unsigned long long s_bar; // (p.counted) the cluster merge's partials land counted on it
    if (CL) st_cluster_started(&s_bar, p.counted); // the cluster's others may store into this block
#endif
    const int half = p.n_rot / 2;
    float *Kn = Ps + QB * TK;      // fused norms: (n, D) this head's new k rows, normalized and rotated
    float *cs = Kn + p.n * D;      // (n, 2 half) each row's cos | sin
    if (p.qn)
        for (int e = tid; e < p.n * half; e += blockDim.x) { // in double as rope_kernel does
            int i = e / half, k = e % half;
            double sn, cn;
            sincos((double)p.pos[i] * pow((double)p.rope_base, -2.0 * k / p.n_rot), &sn, &cn);
            cs[i * 2 * half + k] = (float)cn;
            cs[i * 2 * half + half + k] = (float)sn;
        }
    // The first tile's rows that earlier steps wrote (before pos0) are read before the wait: the
    // kernels that wrote them finished before this one could start, and its loads then fly
    // while the kernel before finishes. Rows of this step come from knew / vnew after the wait
    // (patched into an early tile that holds both: the last split's, in decode).
    attn_tile<D, TK> kt, vt;
    const int t_old = min(t_end, pos0); // the rows of earlier steps end here
    const bool mixed = min(t_begin + TK, t_end) > pos0;
    const bool early = t_begin < t_old && (!mixed || (p.early_mix && p.knew)); // (else the store ran first)
    if (early) {
        attn_fetch_tile<D, TK>(kt, p.kc, NULL, 0, p, hk, t_begin, t_old, pos0);
        attn_fetch_tile<D, TK>(vt, p.vc, NULL, 0, p, hk, t_begin, t_old, pos0);
    }
    // The norm weights no kernel writes: read before the wait.
    float wq[EPL], wk[EPL];
    if (p.qn) {
        attn_load_head<EPL>(p.qn, wq);
        attn_load_head<EPL>(p.kn, wk);
    }
    // STRATA_CUDA_TRACE marks: 0 a first read of q arrived, 1 q and k normed and rotated, 2 the new
    // rows stored, 3 tiles done, 4 partials out, 5 counted in; in a cluster 6 its first chunk
    // merged, 7 all its chunks stored (outputs, or partials to L2), 10 its partials written (before
    // the cluster's barrier); 8 the first tile in shared memory, 9 its scores and weights done
    unsigned ts = st_pdl_begin();
    st_trace_probe(ts, 0, p.q);

    // Every read of the kernels' outputs before this one is issued at once (the warp's queries,
    // its first new k row, the storing block's first v values): one round trip, not one each.
    const bool stores = p.knew && blockIdx.x == 0 && split == 0; // the fused store: head hk of the new rows
    const float *kfresh = p.knew ? p.knew + hk * D : NULL;
    int kstride = p.nv;
    float v0 = 0.0f; // the store's first value of vnew for this thread
    if (stores && tid < p.n * D) v0 = p.vnew[(size_t)(tid / D) * p.nv + hk * D + tid % D];
    if (p.qn) {
        float qv[QPW][EPL], kv0[EPL];
#pragma unroll
        for (int jj = 0; jj < QPW; jj++) {
            int qi = qbase + w * QPW + jj;
            attn_load_head<EPL>(qi < p.nq ? p.q + ((size_t)(qi / p.G) * p.H + hk * p.G + qi % p.G) * QS : NULL, qv[jj]);
        }
        // The new k rows are normed where they are taken: by the storing block and the splits
        // whose tiles hold new positions (the others' tiles are all earlier rows).
        const bool need_k = stores || (t_begin < t_end && t_end > pos0);
        if (need_k && w < p.n) attn_load_head<EPL>(p.knew + (size_t)w * p.nv + hk * D, kv0);
        __syncthreads(); // the angles
        // A warp with a k row and a query norms the two together, their chains interleaved (warp
        // 0 had normed the k row, then its query, while the other warps waited: with the rows
        // normed only where taken, 30B-A3B decode +1.0%).
        const int q0 = qbase + w * QPW;
        const bool pair = need_k && w < p.n && q0 < p.nq;
        if (pair) {
            float v2[2][EPL], w2[2][EPL];
#pragma unroll
            for (int e = 0; e < EPL; e++) v2[0][e] = kv0[e], w2[0][e] = wk[e], v2[1][e] = qv[0][e], w2[1][e] = wq[e];
            const float *const cs2[2] = {cs + w * 2 * half, cs + (q0 / p.G) * 2 * half};
            float *const out2[2] = {Kn + w * D, Qs + (w * QPW) * D};
            attn_norm_rope<EPL, 2>(v2, w2, cs2, half, p.eps, out2);
        }
        for (int i = w + (pair ? ATTN_WARPS : 0); need_k && i < p.n; i += ATTN_WARPS) {
            if (i != w) attn_load_head<EPL>(p.knew + (size_t)i * p.nv + hk * D, kv0);
            attn_norm_rope<EPL>(kv0, wk, cs + i * 2 * half, half, p.eps, Kn + i * D);
        }
#pragma unroll
        for (int jj = pair ? 1 : 0; jj < QPW; jj++) {
            int qi = qbase + w * QPW + jj;
            float *qs = Qs + (w * QPW + jj) * D;
            if (qi < p.nq)
                attn_norm_rope<EPL>(qv[jj], wq, cs + (qi / p.G) * 2 * half, half, p.eps, qs);
            else
                for (int e = lane; e < D; e += 32) qs[e] = 0.0f;
        }
        __syncthreads(); // Kn for the store and the tiles
        st_trace_mark(ts, 1);
        kfresh = Kn, kstride = D;
    } else {
        for (int e = tid; e < QB * D; e += blockDim.x) {
            int qi = qbase + e / D;
            Qs[e] = qi < p.nq ? p.q[((size_t)(qi / p.G) * p.H + hk * p.G + qi % p.G) * QS + e % D] : 0.0f;
        }
    }
    if (stores) {
        for (int e = tid; e < p.n * D; e += blockDim.x) {
            int i = e / D, x = hk * D + e % D;
            float kv = kfresh[(size_t)i * kstride + e % D], vv = e == tid ? v0 : p.vnew[(size_t)i * p.nv + x];
            char *kr = (char *)p.kc + (size_t)(pos0 + i) * p.row_bytes, *vr = (char *)p.vc + (size_t)(pos0 + i) * p.row_bytes;
            if (p.kv_type == ST_KV_F16) {
                ((__half *)kr)[x] = __float2half_rn(kv);
                ((__half *)vr)[x] = __float2half_rn(vv);
            } else {
                ((float *)kr)[x] = kv;
                ((float *)vr)[x] = vv;
            }
        }
    }
    st_trace_mark(ts, 2);
    int lim[QPW]; // the last position each of this warp's queries sees; -1: no query
    int wlim = -1;
#pragma unroll
    for (int jj = 0; jj < QPW; jj++) {
        int qi = qbase + w * QPW + jj;
        lim[jj] = qi < p.nq ? pos0 + qi / p.G : -1;
        wlim = max(wlim, lim[jj]);
    }

    float m[QPW], l[QPW], acc[QPW][EPL];
#pragma unroll
    for (int jj = 0; jj < QPW; jj++) {
        m[jj] = -INFINITY, l[jj] = 0.0f;
#pragma unroll
        for (int e = 0; e < EPL; e++) acc[jj][e] = 0.0f;
    }
    const int tt = lane % TK, part = lane / TK;
    const float *vfresh = p.vnew ? p.vnew + hk * D : NULL;
    if (t_begin < t_end && !early) {
        attn_fetch_tile<D, TK>(kt, p.kc, kfresh, kstride, p, hk, t_begin, t_end, pos0);
        attn_fetch_tile<D, TK>(vt, p.vc, vfresh, p.nv, p, hk, t_begin, t_end, pos0);
    } else if (early && mixed) {
        attn_patch_tile<D, TK>(kt, kfresh, kstride, p.kv_type, t_begin, t_end, pos0);
        attn_patch_tile<D, TK>(vt, vfresh, p.nv, p.kv_type, t_begin, t_end, pos0);
    }
    for (int t0 = t_begin; t0 < t_end; t0 += TK) {
        __syncthreads(); // the previous tile is consumed (and Qs is written, the first time)
        attn_store_tile<D, TK>(Ks, KST, kt);
        attn_store_tile<D, TK>(Vs, D, vt);
        if (t0 + TK < t_end) { // the next tile's loads fly while this one is computed
            attn_fetch_tile<D, TK>(kt, p.kc, kfresh, kstride, p, hk, t0 + TK, t_end, pos0);
            attn_fetch_tile<D, TK>(vt, p.vc, vfresh, p.nv, p, hk, t0 + TK, t_end, pos0);
        }
        __syncthreads();
        if (t0 == t_begin) st_trace_mark(ts, 8);
        if (t0 > wlim) continue; // causal: none of this warp's queries sees this tile

        float s[QPW];
#pragma unroll
        for (int jj = 0; jj < QPW; jj++) s[jj] = 0.0f;
        const float4 *kr = (const float4 *)(Ks + tt * KST + part * HALF);
        const float *qw = Qs + (w * QPW) * D + part * HALF;
#pragma unroll 4
        for (int x4 = 0; x4 < HALF / 4; x4++) {
            float4 k4 = kr[x4];
#pragma unroll
            for (int jj = 0; jj < QPW; jj++) {
                float4 q4 = ((const float4 *)(qw + jj * D))[x4];
                s[jj] += q4.x * k4.x + q4.y * k4.y + q4.z * k4.z + q4.w * k4.w;
            }
        }
        const int t = t0 + tt;
#pragma unroll
        for (int jj = 0; jj < QPW; jj++) {
            if (S::LPP == 2) s[jj] += __shfl_xor_sync(0xffffffffu, s[jj], 16);
            bool valid = t < t_end && t <= lim[jj];
            float sc = valid ? s[jj] * p.scale : -INFINITY;
            float mnew = fmaxf(m[jj], attn_warp_max(sc));
            float corr = 1.0f, pr = 0.0f;
            if (mnew != -INFINITY) {
                corr = expf(m[jj] - mnew); // 0 when m was -inf
                pr = valid ? expf(sc - mnew) : 0.0f;
            }
            m[jj] = mnew;
            l[jj] = l[jj] * corr + (part == 0 ? pr : 0.0f);
#pragma unroll
            for (int e = 0; e < EPL; e++) acc[jj][e] *= corr;
            if (part == 0) Ps[(w * QPW + jj) * TK + tt] = pr;
        }
        __syncwarp();
        if (t0 == t_begin) st_trace_mark(ts, 9);
#pragma unroll 4
        for (int u = 0; u < TK; u++) {
            float vv[EPL];
#pragma unroll
            for (int e = 0; e < EPL; e++) vv[e] = Vs[u * D + e * 32 + lane];
#pragma unroll
            for (int jj = 0; jj < QPW; jj++) {
                float pr = Ps[(w * QPW + jj) * TK + u];
#pragma unroll
                for (int e = 0; e < EPL; e++) acc[jj][e] += pr * vv[e];
            }
        }
        __syncwarp(); // Ps is rewritten by the next tile
    }
    st_trace_mark(ts, 3);
#if defined(ST_CLUSTERS)
    if (attn_merge_in_cluster<EPL, QPW, CL, GATE>(p, m, l, acc, T, ts, &s_bar)) return;
#endif

#pragma unroll
    for (int jj = 0; jj < QPW; jj++) {
        float lsum = l[jj];
        for (int o = 16; o > 0; o >>= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, o);
        int qi = qbase + w * QPW + jj;
        if (qi >= p.nq) continue;
        size_t rh = (size_t)(qi / p.G) * p.H + hk * p.G + qi % p.G; // (row, head)
        if (p.ns == 1) {
            float inv = 1.0f / lsum, o[EPL]; // position 0 is always seen: lsum >= 1
#pragma unroll
            for (int e = 0; e < EPL; e++) o[e] = acc[jj][e] * inv;
            attn_store_out<EPL, GATE>(p, rh, o, lane);
        } else {
            float *pp = p.part + ((size_t)split * p.n * p.H + rh) * (D + 2);
            if (lane == 0) pp[0] = m[jj], pp[1] = lsum;
#pragma unroll
            for (int e = 0; e < EPL; e++) pp[2 + e * 32 + lane] = acc[jj][e];
        }
    }
    st_trace_mark(ts, 4);
    if (p.ns == 1 || !p.counters) {
        st_trace_end();
        return;
    }

    // Last block combines. Each block publishes its partials (fence), then counts itself in; the
    // one that brings the count to the number of active splits reads everyone's partials from L2
    // and writes this query tile's outputs: out = Σ_s e^{m_s − M} acc_s / Σ_s e^{m_s − M} l_s.
    const int act = attn_active_splits(T, p.ns, p.min_chunk); // the splits that get here (<= 256)
    if (!attn_count_in(p, (unsigned)act, ts)) return;
    static_assert(S::smem >= sizeof(float) * ATTN_WARPS * 256, "combine weights: 256 splits per warp");
    float *fw = (float *)sm4 + w * 256; // e^{m_s − M} of this warp's query (the tiles are done with)
    const size_t ss = (size_t)p.n * p.H * (D + 2); // from one split's partials to the next
#pragma unroll 1
    for (int jj = 0; jj < QPW; jj++) {
        int qi = qbase + w * QPW + jj;
        if (qi >= p.nq) break; // (warp-uniform)
        size_t rh = (size_t)(qi / p.G) * p.H + hk * p.G + qi % p.G;
        const float *base = p.part + rh * (D + 2);
        // A lane's first split's m and l in one load, kept for the weights: one round trip fewer
        // up to 32 splits (past them the loops load again).
        float2 ml = lane < act ? __ldcg((const float2 *)(base + lane * ss)) : make_float2(-INFINITY, 0.0f);
        float mx = ml.x;
        for (int s2 = lane + 32; s2 < act; s2 += 32) mx = fmaxf(mx, __ldcg(base + s2 * ss));
        mx = attn_warp_max(mx); // finite: split 0 sees position 0
        float ls = 0.0f;
        for (int s2 = lane; s2 < act; s2 += 32) {
            float2 v = s2 == lane ? ml : __ldcg((const float2 *)(base + s2 * ss));
            float f = v.x == -INFINITY ? 0.0f : expf(v.x - mx);
            fw[s2] = f;
            ls += v.y * f;
        }
        for (int o = 16; o > 0; o >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, o);
        __syncwarp(); // fw is written
        float a[EPL];
#pragma unroll
        for (int e = 0; e < EPL; e++) a[e] = 0.0f;
#pragma unroll 8
        for (int s2 = 0; s2 < act; s2++) { // (8 splits' loads in flight per lane)
            float f = fw[s2];
#pragma unroll
            for (int e = 0; e < EPL; e++) a[e] += f * __ldcg(base + s2 * ss + 2 + e * 32 + lane);
        }
#pragma unroll
        for (int e = 0; e < EPL; e++) a[e] = a[e] / ls;
        attn_store_out<EPL, GATE>(p, rh, a, lane);
        __syncwarp(); // fw is rewritten for the next query
    }
    st_trace_end();
}

// One block of ATTN_COMBINE_THREADS per (row, head): out = Σ_s e^{m_s − M} acc_s / Σ_s e^{m_s − M} l_s
// over the active splits (at most 256: the launchers cap ns), gated with gate (attn_params.gate,
// or NULL) as attn_store_out gates. Splits that saw no position (m = −inf) weigh 0; split 0
// always sees position 0. The splits are spread over the threads
// (weights first, then each dim's sum in ATTN_COMBINE_THREADS / D groups of splits), so a long
// context's hundred splits cost a few rounds of independent loads, not a hundred dependent ones.
#define ATTN_COMBINE_THREADS 256

__device__ float attn_block_reduce(float v, bool is_max, float *red) {
    for (int o = 16; o > 0; o >>= 1) {
        float u = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, u) : v + u;
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads(); // red may still be read by a previous call
    if (lane == 0) red[w] = v;
    __syncthreads();
    v = is_max ? -INFINITY : 0.0f;
    for (int i = 0; i < (int)(blockDim.x >> 5); i++) v = is_max ? fmaxf(v, red[i]) : v + red[i];
    return v;
}

__global__ void __launch_bounds__(ATTN_COMBINE_THREADS)
attn_combine_kernel(const float *part, float *out, int nh, int D, int ns, const int32_t *pos_dev, int n, int align,
                    const float *gate) {
    st_pdl_begin();
    __shared__ float fs[256];                    // e^{m_s − M}
    __shared__ float sums[ATTN_COMBINE_THREADS]; // (groups, D) partial sums
    __shared__ float red[32];
    const int rh = blockIdx.x, tid = threadIdx.x;
    const size_t ss = (size_t)nh * (D + 2); // from one split to the next
    const float *base = part + (size_t)rh * (D + 2);
    ns = attn_active_splits(*pos_dev + n, ns, align);
    float m = -INFINITY;
    for (int s = tid; s < ns; s += blockDim.x) m = fmaxf(m, base[s * ss]);
    const float M = attn_block_reduce(m, true, red);
    float l = 0.0f;
    for (int s = tid; s < ns; s += blockDim.x) {
        float ms = base[s * ss], f = ms == -INFINITY ? 0.0f : expf(ms - M);
        fs[s] = f;
        l += base[s * ss + 1] * f; // every active split wrote finite values (zeros when it saw nothing)
    }
    const float L = attn_block_reduce(l, false, red); // (its barriers publish fs)
    const int groups = blockDim.x / D, g = tid / D, x = tid % D; // D <= 256: at least one group
    float a = 0.0f;
    if (g < groups) {
#pragma unroll 4
        for (int s = g; s < ns; s += groups) a += base[s * ss + 2 + x] * fs[s];
        sums[g * D + x] = a;
    }
    __syncthreads();
    if (g == 0) {
        for (int k = 1; k < groups; k++) a += sums[k * D + x];
        float o = a / L;
        if (gate) o *= sigmoidf_(gate[(size_t)rh * 2 * D + x]);
        out[(size_t)rh * D + x] = o;
    }
}

// The in-kernel combine in clusters of up to 8 splits, where the GPU runs them (sm_90+) and for
// the models' head sizes (64, 128, 256; the others keep the counting path, and their cluster
// kernels are never built): *ns rounded down to a multiple of the size returned (so the grid
// still fits the GPU at once), at most 32 clusters; 1: no clusters. *csmem: the cluster kernel's
// shared memory, with the merge's receiving area (attn_cluster_merge).
#define ATTN_CLUSTER_EPL(EPL) ((EPL) == 2 || (EPL) == 4 || (EPL) == 8)
template <int EPL, int QPW>
static std::enable_if_t<ATTN_CLUSTER_EPL(EPL), int> attn_cluster_size(st_cuda *c, const attn_params *p, int qt,
                                                                      int *ns, int n_head_kv, size_t *csmem) {
    typedef attn_shape<EPL, QPW> S;
    // (the plain kernel's plan for the gated one too: see attn_launch)
    void (*plain)(attn_params) = attn_kernel<EPL, QPW, true, false>;
    int cs = *ns < 8 ? *ns : 8, nsc = *ns / cs * cs;
    int qn = p->nq < S::QB ? p->nq : S::QB;
    size_t smem = attn_recv_at(S::smem, p->extra) + sizeof(float) * attn_recv_floats(qn, cs, S::D);
    st_allow_smem(c, plain, smem);
    if (p->gate) st_allow_smem(c, attn_kernel<EPL, QPW, true, true>, smem);
    if (nsc > 256 ||
        !st_cluster_fits(c, plain, dim3(1, cs), dim3((unsigned)qt, (unsigned)nsc, (unsigned)n_head_kv), ATTN_WARPS * 32,
                         smem))
        return 1;
    *ns = nsc;
    *csmem = smem;
    return cs;
}
template <int EPL, int QPW>
static std::enable_if_t<!ATTN_CLUSTER_EPL(EPL), int> attn_cluster_size(st_cuda *, const attn_params *, int, int *,
                                                                       int, size_t *) {
    return 1;
}
template <int EPL, int QPW>
static std::enable_if_t<ATTN_CLUSTER_EPL(EPL), bool> attn_launch_clusters(st_cuda *c, attn_params *p, dim3 grid,
                                                                          size_t smem) {
    void (*k)(attn_params) = p->gate ? attn_kernel<EPL, QPW, true, true> : attn_kernel<EPL, QPW, true, false>;
    st_launch_cluster(c, dim3(1, p->cs), k, grid, ATTN_WARPS * 32, smem, *p);
    return true;
}
template <int EPL, int QPW>
static std::enable_if_t<!ATTN_CLUSTER_EPL(EPL), bool> attn_launch_clusters(st_cuda *, attn_params *, dim3, size_t) {
    return false;
}

// The cluster merge's partials counted on the merging block's mbarrier (attn_params.counted;
// STRATA_ATTN_COUNTED=0: published by the cluster's barrier instead); read once.
static bool attn_counted(void) {
    static int on = -1;
    if (on < 0) on = !st_env_is("STRATA_ATTN_COUNTED", "0");
    return on == 1;
}

template <int EPL, int QPW>
static void attn_launch(st_cuda *c, attn_params *p, int n_head_kv, int n_ctx) {
    typedef attn_shape<EPL, QPW> S;
    int qt = (p->nq + S::QB - 1) / S::QB;
    // Split the context when the grid would not fill the GPU (~4 blocks per multiprocessor):
    // decode and verify windows, and short chunks late in a long context. Sizes only, so a
    // recording stays valid; splits past the current context do no work.
    int base = n_head_kv * qt, sms = c->prop.multiProcessorCount;
    size_t smem = S::smem + p->extra, csmem = smem; // (csmem: the cluster kernel's)
    void (*k)(attn_params) = p->gate ? attn_kernel<EPL, QPW, false, true> : attn_kernel<EPL, QPW, false, false>;
    // At most what fits the GPU at once (blocks past it would start only when the first leave,
    // and the next kernel's blocks could not start early). The plan (splits, clusters) is the
    // plain kernel's for the gated one too, whose registers differ: the same splits merged in
    // the same order as the ops it folds, so the same bits (a plan of its own split a head_dim
    // 128 window's context differently: 1 ulp apart in test_attention_gated).
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, attn_kernel<EPL, QPW, false, false>, ATTN_WARPS * 32,
                                                      smem) != cudaSuccess)
        cudaGetLastError(), per_sm = 1;
    per_sm = per_sm < 4 ? (per_sm < 1 ? 1 : per_sm) : 4;
    int ns = (per_sm * sms + base - 1) / base;
    if (ns * base > per_sm * sms) ns = per_sm * sms / base;
    // A split of one tile: a block works through its tiles one after another (each ~500
    // dependent instructions a warp), so short contexts are fastest spread one tile a block.
    p->min_chunk = S::TK;
    int useful = (n_ctx + p->min_chunk - 1) / p->min_chunk;
    ns = ns < useful ? ns : useful;
    ns = ns < 256 ? ns : 256;
    ns = ns < 1 ? 1 : ns;
    if (ns == 1 || base > ATTN_MAX_COUNTERS) p->counters = NULL; // (no counter for each tile: combine kernel)
    // (clusters count in a counter per rank: up to 8 per query tile and KV head)
    bool clusters = ns > 1 && p->counters && (size_t)base * 8 <= ATTN_MAX_COUNTERS && st_cluster_on();
    p->cs = clusters ? attn_cluster_size<EPL, QPW>(c, p, qt, &ns, n_head_kv, &csmem) : 1;
    p->counted = p->cs > 1 && attn_counted();
    if (p->cs == 1) st_allow_smem(c, k, smem);
    p->ns = ns;
    if (ns > 1) {
        size_t bytes = sizeof(float) * (size_t)ns * p->n * p->H * (S::D + 2);
        p->part = (float *)st_cuda_scratch(c, ST_SCR_ATTN, bytes);
        if (!p->part) return; // the error is kept
    }
    dim3 grid((unsigned)qt, (unsigned)ns, (unsigned)n_head_kv);
    if (p->cs == 1 || !attn_launch_clusters<EPL, QPW>(c, p, grid, csmem))
        st_launch(c, k, grid, ATTN_WARPS * 32, smem, *p);
    ST_CU_LAUNCHED(c, "attention");
    if (ns > 1 && !p->counters) {
        st_launch(c, attn_combine_kernel, p->n * p->H, ATTN_COMBINE_THREADS, 0, p->part, p->out, p->n * p->H, S::D,
                  ns, p->pos_dev, p->n, p->min_chunk, p->gate);
        ST_CU_LAUNCHED(c, "attention combine");
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core attention for prompt chunks (n > ST_CUDA_GRAPH_ROWS; sm_80+, head_dim 64, 128 or
// 256, f16 or q8_0 cache). Same block shape as attn_kernel (one KV head, TC_BQ = 64 queries
// qi = row * G + head-in-group, one split of the context) with 4 warps of 16 queries each.
// Per KV tile of BK = 64 positions, staged in shared memory as f16 (cp.async, double
// buffered, for an f16 cache; dequantized through registers for q8_0):
//   S = Q Kᵀ and O += P V with mma.sync m16n8k16 (f16 inputs, f32 accumulation), the online
//   softmax on the S fragments in registers, P fed back as the A operand without shared memory.
// Accuracy: an f16 cache holds K and V exactly, but the f32 queries and probabilities do not fit
// f16's 11 bits. Each is split into hi = f16(x) and lo = f16(x − hi) and both multiply (two MMAs),
// which carries ~22 bits: results stay within float rounding of the FP32 kernel (the tests hold
// both to the same bounds). That doubles the tensor work, which is still far from the limit.
// BK is 32 instead where 64 does not fit the block's shared memory (sm_86 / sm_89: 99 KB; head_dim
// 256, ~135 KB: sm_80 and sm_90 only).
#define TC_BQ 64
#define TC_WARPS 4

template <int D, int BK>
struct tc_shape {
    static constexpr int ST = D + 8; // row stride in halves: 8 rows' fragment loads hit 32 banks
    static constexpr size_t smem = sizeof(__half) * ((size_t)2 * TC_BQ * ST + (size_t)4 * BK * ST);
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define ST_ATTN_TC_DEVICE 1
#endif

#ifdef ST_ATTN_TC_DEVICE
__device__ __forceinline__ void tc_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    // Not volatile: a pure register operation the compiler may schedule (ldmatrix stays ordered).
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// B fragments of two n-tiles from a row-major (k rows, n cols) f16 tile: lanes 0-15 give rows
// k0..k0+15 at column n0, lanes 16-31 the same rows at n0 + 8.
__device__ __forceinline__ void tc_ldmatrix_x4_trans(uint32_t (&r)[4], const __half *p) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ uint32_t tc_ld32(const __half *p) { return *(const uint32_t *)p; }

__device__ __forceinline__ uint32_t tc_pack(__half2 h) { return *(uint32_t *)&h; }

// hi / lo halves of two floats (the lower 16 bits hold the first, as the fragments expect).
__device__ __forceinline__ void tc_split(float a, float b, uint32_t &hi, uint32_t &lo) {
    __half2 h = __floats2half2_rn(a, b);
    hi = tc_pack(h);
    lo = tc_pack(__floats2half2_rn(a - __low2float(h), b - __high2float(h)));
}

// Cache rows t0 .. t0+BK-1 of head hk into dst (BK, ST) as f16; zeros from t_end on.
template <int D, int BK>
__device__ __forceinline__ void tc_load_tile(__half *dst, const void *cache, const attn_params &p, int hk, int t0,
                                             int t_end) {
    constexpr int ST = tc_shape<D, BK>::ST, C8 = D / 8; // 8-value chunks per row
    for (int c = threadIdx.x; c < BK * C8; c += TC_WARPS * 32) {
        int r = c / C8, x8 = (c % C8) * 8, t = t0 + r, idx = hk * D + x8;
        bool valid = t < t_end;
        const char *row = (const char *)cache + (size_t)(valid ? t : 0) * p.row_bytes;
        if (p.kv_type == ST_KV_F16) {
            st_cp_async16(dst + r * ST + x8, row + (size_t)idx * 2, valid);
        } else { // q8_0: d · q as f16 (within one rounding of the value; q8_0's own error is larger)
            uint4 out = make_uint4(0, 0, 0, 0);
            if (valid) {
                const char *blk = row + (size_t)(idx / QK8_0) * sizeof(block_q8_0);
                float d = __half2float(*(const __half *)blk);
                const unsigned short *qs = (const unsigned short *)(blk + 2 + idx % QK8_0); // 2-byte aligned
                uint32_t w[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    unsigned short two = qs[e];
                    w[e] = tc_pack(__floats2half2_rn(d * (float)(int8_t)(two & 0xff), d * (float)(int8_t)(two >> 8)));
                }
                out = make_uint4(w[0], w[1], w[2], w[3]);
            }
            *(uint4 *)(dst + r * ST + x8) = out;
        }
    }
}
#endif

// GATE: the gated attention (p.gate), as attn_kernel's.
template <int D, int BK, bool GATE>
__global__ void __launch_bounds__(TC_WARPS * 32) attn_tc_kernel(attn_params p) {
    st_pdl_begin();
#ifdef ST_ATTN_TC_DEVICE
    typedef tc_shape<D, BK> S;
    constexpr int ST = S::ST, NT = BK / 8, DT = D / 8;
    constexpr int QS = GATE ? 2 * D : D; // from one (row, head)'s query to the next
    extern __shared__ float4 tc_sm4[];
    __half *Qh = (__half *)tc_sm4;   // (TC_BQ, ST) queries, hi
    __half *Ql = Qh + TC_BQ * ST;    // (TC_BQ, ST) queries, lo
    __half *Kb = Ql + TC_BQ * ST;    // 2 x (BK, ST)
    __half *Vb = Kb + 2 * BK * ST; // 2 x (BK, ST)
    // Heaviest query tiles (latest rows: most positions) first, so the tail of the grid is short.
    const int qbase = (gridDim.x - 1 - blockIdx.x) * TC_BQ, hk = blockIdx.y, split = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tig = lane & 3;
    const int pos0 = *p.pos_dev, T = pos0 + p.n;

    for (int e = tid; e < TC_BQ * D / 4; e += TC_WARPS * 32) {
        int r = e / (D / 4), x = (e % (D / 4)) * 4, qi = qbase + r;
        float4 v = make_float4(0, 0, 0, 0);
        if (qi < p.nq) v = *(const float4 *)(p.q + ((size_t)(qi / p.G) * p.H + hk * p.G + qi % p.G) * QS + x);
        uint32_t h0, l0, h1, l1;
        tc_split(v.x, v.y, h0, l0);
        tc_split(v.z, v.w, h1, l1);
        *(uint2 *)(Qh + r * ST + x) = make_uint2(h0, h1);
        *(uint2 *)(Ql + r * ST + x) = make_uint2(l0, l1);
    }
    // This thread's two query rows (g and g + 8 of its warp's 16) and the last position each sees.
    const int qi0 = qbase + w * 16 + g, qi1 = qi0 + 8;
    const int lim0 = qi0 < p.nq ? pos0 + qi0 / p.G : -1, lim1 = qi1 < p.nq ? pos0 + qi1 / p.G : -1;
    const int wq_last = min(qbase + w * 16 + 15, p.nq - 1);
    const int wlim = qbase + w * 16 < p.nq ? pos0 + wq_last / p.G : -1;
    int t_begin = 0, t_end = min(T, pos0 + (min(qbase + TC_BQ, p.nq) - 1) / p.G + 1);
    if (p.ns > 1) {
        int chunk = (T + p.ns - 1) / p.ns;
        chunk = (chunk + BK - 1) / BK * BK;
        t_begin = split * chunk;
        t_end = min(t_end, t_begin + chunk);
        if (t_begin >= T) return; // past the context: the combine does not read this split
    }
    const int ntiles = t_begin < t_end ? (t_end - t_begin + BK - 1) / BK : 0;

    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

    if (ntiles > 0) {
        tc_load_tile<D, BK>(Kb, p.kc, p, hk, t_begin, t_end);
        tc_load_tile<D, BK>(Vb, p.vc, p, hk, t_begin, t_end);
    }
    st_cp_commit();
    for (int it = 0; it < ntiles; it++) {
        const int t0 = t_begin + it * BK, buf = it & 1;
        if (it + 1 < ntiles) { // the next tile streams in while this one is computed
            tc_load_tile<D, BK>(Kb + (buf ^ 1) * BK * ST, p.kc, p, hk, t0 + BK, t_end);
            tc_load_tile<D, BK>(Vb + (buf ^ 1) * BK * ST, p.vc, p, hk, t0 + BK, t_end);
        }
        st_cp_commit();
        st_cp_wait<1>(); // all but the group just issued: this tile has landed
        __syncthreads(); // ... for every thread's copies (and Q, the first time)
        if (t0 <= wlim) {
            const __half *K = Kb + buf * BK * ST, *V = Vb + buf * BK * ST;
            float s[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                const __half *qh = Qh + (w * 16 + g) * ST + kk * 16 + tig * 2;
                const __half *ql = Ql + (w * 16 + g) * ST + kk * 16 + tig * 2;
                uint32_t ah[4] = {tc_ld32(qh), tc_ld32(qh + 8 * ST), tc_ld32(qh + 8), tc_ld32(qh + 8 * ST + 8)};
                uint32_t al[4] = {tc_ld32(ql), tc_ld32(ql + 8 * ST), tc_ld32(ql + 8), tc_ld32(ql + 8 * ST + 8)};
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const __half *kp = K + (nt * 8 + g) * ST + kk * 16 + tig * 2;
                    uint32_t b0 = tc_ld32(kp), b1 = tc_ld32(kp + 8);
                    tc_mma(s[nt], ah, b0, b1);
                    tc_mma(s[nt], al, b0, b1);
                }
            }
            // Causal mask, scale, online softmax. s[nt][0..1]: row g, keys t0 + 8 nt + 2 tig + {0,1};
            // s[nt][2..3]: row g + 8, the same keys.
            float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    int t = t0 + nt * 8 + tig * 2 + c;
                    bool in = t < t_end;
                    s[nt][c] = in && t <= lim0 ? s[nt][c] * p.scale : -INFINITY;
                    s[nt][2 + c] = in && t <= lim1 ? s[nt][2 + c] * p.scale : -INFINITY;
                    mx0 = fmaxf(mx0, s[nt][c]);
                    mx1 = fmaxf(mx1, s[nt][2 + c]);
                }
#pragma unroll
            for (int o2 = 1; o2 <= 2; o2 <<= 1) { // the 4 lanes of a quad share the rows
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o2));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o2));
            }
            const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            // -inf - -inf is NaN: a row with nothing seen yet keeps corr 1 and p 0.
            const float c0 = mn0 == -INFINITY ? 1.0f : expf(m0 - mn0), c1 = mn1 == -INFINITY ? 1.0f : expf(m1 - mn1);
            m0 = mn0, m1 = mn1;
            float ls0 = 0.0f, ls1 = 0.0f;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    float p0 = s[nt][c] == -INFINITY ? 0.0f : expf(s[nt][c] - mn0);
                    float p1 = s[nt][2 + c] == -INFINITY ? 0.0f : expf(s[nt][2 + c] - mn1);
                    s[nt][c] = p0, s[nt][2 + c] = p1;
                    ls0 += p0, ls1 += p1;
                }
            l0 = l0 * c0 + ls0, l1 = l1 * c1 + ls1;
#pragma unroll
            for (int dt = 0; dt < DT; dt++) o[dt][0] *= c0, o[dt][1] *= c0, o[dt][2] *= c1, o[dt][3] *= c1;
            // O += P V, P's fragments straight from s (keys 16 kk .. 16 kk + 15 per step).
#pragma unroll
            for (int kk = 0; kk < BK / 16; kk++) {
                uint32_t ah[4], al[4];
                tc_split(s[2 * kk][0], s[2 * kk][1], ah[0], al[0]);
                tc_split(s[2 * kk][2], s[2 * kk][3], ah[1], al[1]);
                tc_split(s[2 * kk + 1][0], s[2 * kk + 1][1], ah[2], al[2]);
                tc_split(s[2 * kk + 1][2], s[2 * kk + 1][3], ah[3], al[3]);
#pragma unroll
                for (int d2 = 0; d2 < D / 16; d2++) {
                    uint32_t b[4];
                    tc_ldmatrix_x4_trans(b, V + (kk * 16 + (lane & 15)) * ST + d2 * 16 + (lane >> 4) * 8);
                    tc_mma(o[2 * d2], ah, b[0], b[1]);
                    tc_mma(o[2 * d2], al, b[0], b[1]);
                    tc_mma(o[2 * d2 + 1], ah, b[2], b[3]);
                    tc_mma(o[2 * d2 + 1], al, b[2], b[3]);
                }
            }
        }
        __syncthreads(); // every warp is done with this buffer before the next tile's copies reuse it
    }
    st_cp_wait<0>();

#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, o2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, o2);
    }
#pragma unroll
    for (int half = 0; half < 2; half++) {
        int qi = half ? qi1 : qi0;
        if (qi >= p.nq) continue;
        float mm = half ? m1 : m0, ll = half ? l1 : l0;
        size_t rh = (size_t)(qi / p.G) * p.H + hk * p.G + qi % p.G;
        if (p.ns == 1) {
            float inv = 1.0f / ll; // position 0 is always seen: ll >= 1
            float *dst = p.out + rh * D + tig * 2;
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                float2 v = make_float2(o[dt][2 * half] * inv, o[dt][2 * half + 1] * inv);
                if constexpr (GATE) { // as attn_store_out gates
                    float2 g = *(const float2 *)(p.gate + rh * 2 * D + tig * 2 + dt * 8);
                    v.x *= sigmoidf_(g.x), v.y *= sigmoidf_(g.y);
                }
                *(float2 *)(dst + dt * 8) = v;
            }
        } else {
            float *pp = p.part + ((size_t)split * p.n * p.H + rh) * (D + 2);
            if (tig == 0) pp[0] = mm, pp[1] = ll;
#pragma unroll
            for (int dt = 0; dt < DT; dt++)
                pp[2 + dt * 8 + tig * 2] = o[dt][2 * half], pp[2 + dt * 8 + tig * 2 + 1] = o[dt][2 * half + 1];
        }
    }
#endif
}

// Whether the tensor-core kernel was compiled for this GPU (a build for older targets only, run
// through PTX on a newer GPU, has an empty body: the FP32 kernel runs instead).
static bool attn_tc_built(void) {
    static int built = -1;
    if (built < 0) {
        cudaFuncAttributes fa;
        built = cudaFuncGetAttributes(&fa, attn_tc_kernel<128, 64, false>) == cudaSuccess && fa.ptxVersion >= 80 &&
                fa.binaryVersion >= 80;
        cudaGetLastError();
    }
    return built == 1;
}

template <int D, int BK>
// T: the context length the splits are sized for (the cache size for a window that may be
// recorded: sizes only, never the position).
static void attn_tc_launch(st_cuda *c, attn_params *p, int n_head_kv, int T) {
    typedef tc_shape<D, BK> S;
    int qt = (p->nq + TC_BQ - 1) / TC_BQ;
    // Splits only when the grid would not fill the GPU (~2 blocks per multiprocessor): verify
    // windows and short chunks late in a long context. Each split gets at least 4 tiles.
    int base = n_head_kv * qt, sms = c->prop.multiProcessorCount;
    int ns = (2 * sms + base - 1) / base, useful = (T + 4 * BK - 1) / (4 * BK);
    ns = ns < useful ? ns : useful;
    ns = ns < 64 ? ns : 64;
    ns = ns < 1 ? 1 : ns;
    p->ns = ns;
    if (ns > 1) {
        size_t bytes = sizeof(float) * (size_t)ns * p->n * p->H * (D + 2);
        p->part = (float *)st_cuda_scratch(c, ST_SCR_ATTN, bytes);
        if (!p->part) return; // the error is kept
    }
    void (*k)(attn_params) = p->gate ? attn_tc_kernel<D, BK, true> : attn_tc_kernel<D, BK, false>;
    ST_CU(c, cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)S::smem));
    dim3 grid((unsigned)qt, (unsigned)n_head_kv, (unsigned)ns);
    st_launch(c, k, grid, TC_WARPS * 32, S::smem, *p);
    ST_CU_LAUNCHED(c, "attention (tensor cores)");
    if (ns > 1) {
        st_launch(c, attn_combine_kernel, p->n * p->H, ATTN_COMBINE_THREADS, 0, p->part, p->out, p->n * p->H, D, ns,
                  p->pos_dev, p->n, BK, p->gate);
        ST_CU_LAUNCHED(c, "attention combine");
    }
}

// Queries per warp: enough for the whole window in one tile when possible (each cache row then
// read once), at most 4 (registers: 4 x EPL accumulators per lane), and fitting shared memory.
template <int EPL>
static void attn_dispatch(st_cuda *c, attn_params *p, int n_head_kv, int n_ctx) {
    size_t optin = c->prop.sharedMemPerBlockOptin;
    int want = p->nq <= ATTN_WARPS ? 1 : p->nq <= 2 * ATTN_WARPS ? 2 : 4;
    if (want == 4 && attn_shape<EPL, 4>::smem + p->extra <= optin) attn_launch<EPL, 4>(c, p, n_head_kv, n_ctx);
    else if (want >= 2 && attn_shape<EPL, 2>::smem + p->extra <= optin) attn_launch<EPL, 2>(c, p, n_head_kv, n_ctx);
    else attn_launch<EPL, 1>(c, p, n_head_kv, n_ctx);
}

// STRATA_ATTN_OLD=1: the separate store and combine kernels (the previous decode path), kept
// for an A/B on the GPU while the fused path is new; read once.
static bool attn_old(void) {
    static int old = -1;
    if (old < 0) {
        const char *e = getenv("STRATA_ATTN_OLD");
        old = e && atoi(e) != 0;
    }
    return old == 1;
}

// STRATA_ATTN_EARLY=0: a first tile with new rows is read after the wait (attn_params.early_mix).
static bool attn_early_mix(void) {
    static int mix = -1;
    if (mix < 0) mix = !st_env_is("STRATA_ATTN_EARLY", "0");
    return mix == 1;
}

// STRATA_ATTN_WO=0: the output projection quantizes the floats itself (for an A/B); read once.
static bool attn_wo_floats(void) {
    static int floats = -1;
    if (floats < 0) {
        const char *e = getenv("STRATA_ATTN_WO");
        floats = e && e[0] == '0';
    }
    return floats == 1;
}

// The device address of attn_counters (per device; looked up on the first, eager, call of a
// window, so never while recording).
static unsigned *attn_counters_of(st_cuda *c) {
    static void *addr[64];
    if (c->device < 0 || c->device >= 64) return NULL;
    if (!addr[c->device]) {
        if (cudaGetSymbolAddress(&addr[c->device], attn_counters) != cudaSuccess) {
            cudaGetLastError();
            addr[c->device] = NULL;
        }
    }
    return (unsigned *)addr[c->device];
}

void st_cuda_attention(st_backend *b, const st_attn_args *a) {
    st_cuda *c = st_cuda_of(b);
    st_kv_layer *kv = a->kv;
    int D = kv->head_dim, nv = kv->n_head_kv * D;
    if (a->n <= 0) return;
    if (D % 32 || D < 32 || D > 256 || a->n_head % kv->n_head_kv) {
        st_cuda_fail_msg(c, __FILE__, __LINE__, "attention: head size %d with %d query / %d kv heads: unsupported "
                         "(a multiple of 32 up to 256, query heads a multiple of kv heads)", D, a->n_head,
                         kv->n_head_kv);
        return;
    }
    // STRATA_ATTN_GATED=0: the gated attention as the ops it folds, in turn (split_heads, the
    // attention, mul_sigmoid, the output product), for A/B runs.
    if (a->gated && st_env_is("STRATA_ATTN_GATED", "0")) {
        size_t hn = (size_t)a->n * a->n_head * D;
        float *qs = (float *)st_cuda_scratch(c, ST_SCR_MISC, sizeof(float) * 2 * hn);
        if (!qs) return; // error kept
        st_cuda_split_heads(b, a->q, qs, qs + hn, a->n, a->n_head, D, D);
        st_attn_args u = *a;
        u.q = qs, u.gated = false, u.wo = NULL;
        st_cuda_attention(b, &u);
        st_cuda_mul_sigmoid(b, a->out, qs + hn, (int64_t)hn);
        if (a->wo) st_cuda_matmul(b, a->wo, a->out, a->n, a->y);
        return;
    }
    attn_params p = {};
    p.kc = kv->k, p.vc = kv->v, p.row_bytes = kv->row_bytes, p.kv_type = kv->type;
    p.pos_dev = a->pos_dev, p.q = a->q, p.out = a->out, p.nv = nv, p.gate = a->gated ? a->q + D : NULL;
    p.n = a->n, p.H = a->n_head, p.G = a->n_head / kv->n_head_kv, p.nq = a->n * p.G, p.scale = a->scale;
    // Tensor cores for prompt chunks and for windows of at least a block's 64 queries (a verify
    // window of 16 rows with 8 queries per KV head is compute-bound in FP32 at long contexts);
    // the FP32 kernel for smaller windows (memory-bound), an f32 cache, other head sizes and
    // older GPUs.
    bool tc = (a->n > ST_CUDA_GRAPH_ROWS || p.nq >= TC_BQ) && c->prop.major >= 8 &&
              (D == 64 || D == 128 || D == 256) && (kv->type == ST_KV_F16 || kv->type == ST_KV_Q8_0) &&
              ((uintptr_t)a->q & 15) == 0 && ((uintptr_t)a->out & 7) == 0 && attn_tc_built();
    // The FP32 kernel stores the new rows itself (f16 / f32 cache, 16-byte aligned inputs) and
    // its last block combines the splits: one launch instead of three.
    bool old = attn_old();
    bool fuse = !tc && !old && kv->type != ST_KV_Q8_0 && ((uintptr_t)a->k & 15) == 0 && ((uintptr_t)a->v & 15) == 0;
    if (!tc && !old) p.counters = attn_counters_of(c);
    p.early_mix = attn_early_mix();
    // The q / k norms and RoPE inside the kernel for decode and verify windows (one launch fewer
    // a layer); elsewhere a norm_rope launch first.
    if (a->q_norm && fuse && a->n <= ST_CUDA_GRAPH_ROWS && 2 * (a->n_rot / 2) <= D) {
        p.qn = a->q_norm, p.kn = a->k_norm, p.pos = a->pos, p.n_rot = a->n_rot, p.rope_base = a->rope_base;
        p.eps = a->eps;
        p.extra = sizeof(float) * ((size_t)a->n * D + (size_t)a->n * 2 * (a->n_rot / 2));
    } else if (a->q_norm) {
        st_cuda_norm_rope_qk(b, a);
    }
    if (fuse) {
        p.knew = a->k, p.vnew = a->v;
    } else if (kv->type == ST_KV_Q8_0) {
        int64_t blocks = (int64_t)a->n * (nv / QK8_0);
        int64_t grid = (blocks + 7) / 8;
        dim3 g((unsigned)(grid > 65535 ? 65535 : grid), 2);
        st_launch(c, kv_store_q8_kernel, g, 256, 0, *kv, a->pos_dev, a->k, a->v, a->n, nv);
    } else {
        int64_t grid = ((int64_t)a->n * nv + 255) / 256;
        dim3 g((unsigned)(grid > 65535 ? 65535 : grid), 2);
        st_launch(c, kv_store_plain_kernel, g, 256, 0, *kv, a->pos_dev, a->k, a->v, a->n, nv);
    }
    if (!fuse) ST_CU_LAUNCHED(c, "kv store");

    // The FP32 kernel with its own combine quantizes its output for a quantized projection.
    const st_mat *wo = a->wo;
    if (wo && !tc && fuse && !attn_wo_floats() && p.counters && st_cuda_q8_takes(wo, a->n) &&
        wo->cols == (int64_t)a->n_head * D && !(p.oq = st_cuda_proj_buf(c, a->n, (size_t)wo->cols, &p.ods)))
        return; // error kept

    // Tiles of 64 positions where they fit the shared memory, else 32 (head_dim 128 on sm_86/89,
    // 256 everywhere).
    size_t optin = c->prop.sharedMemPerBlockOptin;
    // Prompt chunks: the context so far. Decode and verify windows: the window's plan
    // (st_graph_ctx), which a recording keeps while the context stays within it.
    int T = a->n > ST_CUDA_GRAPH_ROWS ? a->pos0 + a->n : st_graph_ctx(a->pos0 + a->n, kv->n_ctx);
    if (tc && D == 64) attn_tc_launch<64, 64>(c, &p, kv->n_head_kv, T);
    else if (tc && D == 128 && tc_shape<128, 64>::smem <= optin) attn_tc_launch<128, 64>(c, &p, kv->n_head_kv, T);
    else if (tc && D == 128) attn_tc_launch<128, 32>(c, &p, kv->n_head_kv, T);
    else if (tc && tc_shape<256, 32>::smem <= optin) attn_tc_launch<256, 32>(c, &p, kv->n_head_kv, T);
    else switch (D / 32) {
#define CASE(E) case E: attn_dispatch<E>(c, &p, kv->n_head_kv, T); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
    bool q8 = p.oq && (p.ns == 1 || p.counters); // (else the combine kernel wrote out, as floats)
    if (wo) st_cuda_project(b, wo, q8 ? p.oq : NULL, p.ods, a->out, a->n, a->y);
}

// STRATA_CUDA_TRACE: binds this file's copy of st_trace (cuda_common.cuh).
cudaError_t st_trace_bind_attention(const st_trace_dev *t) { return st_trace_bind_unit(t); }
