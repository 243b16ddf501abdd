// backend/cuda: the Gated DeltaNet recurrence (REFERENCE.md §3.3): the step form, row by row with
// the state in registers (decode, verify windows), and the chunked WY form (prompt chunks), which
// turns each chunk of 64 rows into small matrix products in shared memory (state-free ones for all
// chunks at once, then the state's chunk after chunk).

#include <math.h>
#include <stdlib.h>

#include "backend/cuda/cuda_common.cuh"

// ---------------------------------------------------------------------------------------------
// Step form. Value rows of the state (S[vi] holds the key dims of value index vi) evolve
// independently: row vi needs only k, q, v[vi], β and g. So a warp owns R value rows of one
// head, each lane EPL = d/32 key dims of each row, in registers for the whole call: the state is
// read and written once per call, whatever n.
//   S ← e^g S;  m = S k;  δ = β (v − m);  S ← S + δ kᵀ;  o = S q = (e^g S) q + δ (k·q)
// so both dot products of a row reduce together.
#define GDN_STEP_WARPS 4
#define GDN_STEP_ROWS 4 // value rows per warp

// One row's step on a warp's R state rows s (lane: key dims e·32 + lane), the row's k and q in
// ck, cq (the same layout), lane rr holding v[rr] in cv, beta cb and e^g decay: returns o of row
// rr in lane rr (lanes past R: 0).
template <int EPL, int R>
__device__ __forceinline__ float gdn_rows(float (&s)[R][EPL], const float (&ck)[EPL], const float (&cq)[EPL], float cv,
                                          float cb, float decay) {
    int lane = threadIdx.x & 31;
    float kq = 0, sk[R], sq[R], o = 0;
#pragma unroll
    for (int e = 0; e < EPL; e++) kq += ck[e] * cq[e];
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        sk[rr] = 0, sq[rr] = 0;
#pragma unroll
        for (int e = 0; e < EPL; e++) {
            s[rr][e] *= decay;
            sk[rr] += s[rr][e] * ck[e];
            sq[rr] += s[rr][e] * cq[e];
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        kq += __shfl_xor_sync(0xffffffffu, kq, off);
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            sk[rr] += __shfl_xor_sync(0xffffffffu, sk[rr], off);
            sq[rr] += __shfl_xor_sync(0xffffffffu, sq[rr], off);
        }
    }
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        float delta = cb * (__shfl_sync(0xffffffffu, cv, rr) - sk[rr]);
#pragma unroll
        for (int e = 0; e < EPL; e++) s[rr][e] += delta * ck[e];
        if (lane == rr) o = sq[rr] + delta * kq;
    }
    return o;
}

template <int EPL, int R>
__global__ void __launch_bounds__(GDN_STEP_WARPS * 32) gdn_step_kernel(st_gdn_args a) {
    st_pdl_begin();
    constexpr int D = EPL * 32;
    int j = blockIdx.y, lane = threadIdx.x & 31;
    int v0 = (blockIdx.x * GDN_STEP_WARPS + (threadIdx.x >> 5)) * R; // this warp's first value row
    if (v0 >= D) return;                                             // the whole warp leaves
    int hk = j / (a.h_v / a.h_k);
    float *S = a.state + (size_t)j * D * D;
    float s[R][EPL];
#pragma unroll
    for (int rr = 0; rr < R; rr++)
#pragma unroll
        for (int e = 0; e < EPL; e++) s[rr][e] = v0 + rr < D ? S[(size_t)(v0 + rr) * D + e * 32 + lane] : 0.0f;

    // Inputs of row t + 1 are loaded while row t is computed (the loop is latency-bound).
    float kk[EPL], qq[EPL], vv = 0, beta = 0, g = 0;
    auto load = [&](int t) {
        const float *q = a.q + ((size_t)t * a.h_k + hk) * D, *k = a.k + ((size_t)t * a.h_k + hk) * D;
#pragma unroll
        for (int e = 0; e < EPL; e++) kk[e] = k[e * 32 + lane], qq[e] = q[e * 32 + lane];
        vv = lane < R && v0 + lane < D ? a.v[((size_t)t * a.h_v + j) * D + v0 + lane] : 0.0f; // lane rr: v[v0+rr]
        beta = a.beta[(size_t)t * a.h_v + j];
        g = a.g[(size_t)t * a.h_v + j];
    };
    if (a.n > 0) load(0);
    for (int t = 0; t < a.n; t++) {
        float ck[EPL], cq[EPL], cv = vv, cb = beta, decay = expf(g);
#pragma unroll
        for (int e = 0; e < EPL; e++) ck[e] = kk[e], cq[e] = qq[e];
        if (t + 1 < a.n) load(t + 1);
        float o = gdn_rows<EPL, R>(s, ck, cq, cv, cb, decay);
        if (lane < R && v0 + lane < D) a.out[((size_t)t * a.h_v + j) * D + v0 + lane] = o;
    }
#pragma unroll
    for (int rr = 0; rr < R; rr++)
#pragma unroll
        for (int e = 0; e < EPL; e++)
            if (v0 + rr < D) S[(size_t)(v0 + rr) * D + e * 32 + lane] = s[rr][e];
}

static bool gdn_check(st_cuda *c, const st_gdn_args *a) {
    if (a->d % 32 || a->d < 32 || a->d > ST_GDN_MAX_D || a->h_k < 1 || a->h_v % a->h_k) {
        st_cuda_fail_msg(c, __FILE__, __LINE__, "gdn: head size %d with %d key / %d value heads: unsupported "
                         "(a multiple of 32 up to %d, value heads a multiple of key heads)", a->d, a->h_k, a->h_v,
                         ST_GDN_MAX_D);
        return false;
    }
    return true;
}

void st_cuda_gdn(st_backend *b, const st_gdn_args *a) {
    st_cuda *c = st_cuda_of(b);
    if (a->n <= 0 || !gdn_check(c, a)) return;
    int rows_per_block = GDN_STEP_WARPS * GDN_STEP_ROWS;
    dim3 grid((unsigned)((a->d + rows_per_block - 1) / rows_per_block), (unsigned)a->h_v);
    dim3 block(GDN_STEP_WARPS * 32);
    switch (a->d / 32) {
#define CASE(E) case E: st_launch(c, gdn_step_kernel<E, GDN_STEP_ROWS>, grid, block, 0, *a); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
    ST_CU_LAUNCHED(c, "gdn");
}

// ---------------------------------------------------------------------------------------------
// The DeltaNet mixer of a decode window (st_deltanet_args) in one launch where it took ten (the
// conv, three copies, two l2 norms, the gates, the step and the gated norm; each a kernel
// boundary and a round trip to L2, ~2-3 us a layer at the Next-80B-A3B shape). A block owns one
// value head j (grid: key heads x r, j = x r + y): its threads compute the conv of the head's
// channels (q and k of key head j / r, and v of head j) from the raw rows, two warps l2-normalize
// q and k into shared memory, one works out the head's gates, every warp runs the delta rule on
// DN_ROWS state rows (gdn_step_kernel's gdn_rows), and one applies the gated norm to the head's
// outputs: the operations of the ten kernels in their order, so the same bits. The r value heads
// of a key head share its q and k conv state rows: the block of rank 0 writes them, after a
// barrier of the r blocks' cluster (sm_90+) that follows every block's read of them. Without
// clusters (r > 1 on older GPUs, or none that fits) the conv runs as its own kernel first
// (CONV false) and the blocks read its output. With oq, warp 0 also quantizes the head's outputs
// into oq, ods (st_quant_chunk32: four chunks of the row's h_v · d) for the output projection.
#define DN_D 128      // head size the fused kernel serves (Qwen3-Next's)
#define DN_ROWS 4     // state rows a warp
#define DN_WARPS (DN_D / DN_ROWS)
#define DN_MAX_K 4    // conv taps the fused conv serves (Qwen3-Next: 4)
#define DN_FUSED_ROWS 4 // window rows it serves: its one block a head runs the rows in turn, where
                        // the step kernel spreads a head over eight blocks

template <bool CONV>
__global__ void __launch_bounds__(DN_WARPS * 32) deltanet_head_kernel(st_deltanet_args a, int8_t *oq, float2 *ods) {
    constexpr int D = DN_D, EPL = D / 32, R = DN_ROWS, KW = DN_MAX_K;
    __shared__ float s_q[D], s_k[D], s_v[D], s_o[D]; // the head's raw (conv'd) q, k, v; its outputs
    __shared__ float s_w[CONV ? 3 * D * KW : 1], s_win[CONV ? 3 * D * (KW - 1) : 1]; // a thread's channel's taps, rows
    const int r = a.h_v / a.h_k, hk = blockIdx.x, wi = blockIdx.y, j = hk * r + wi, tid = threadIdx.x;
    const int lane = tid & 31, w = tid >> 5, K = a.kernel;
    const int kd = a.h_k * D, vd = a.h_v * D, cd = 2 * kd + vd, v0 = w * R;
    // The head's state rows and conv state: last written by this kernel a step ago, many launches
    // back (every kernel before the one ahead of this has completed once this one runs), so before
    // the wait, with the weights. Thread c < 3 D owns channel ch: q, k of key head hk, then v of
    // head j.
    const bool mine = tid < 3 * D;
    const int ch = tid < D ? hk * D + tid : tid < 2 * D ? kd + hk * D + tid - D : 2 * kd + j * D + tid - 2 * D;
    float *tw = CONV && mine ? s_w + tid * KW : NULL, *win = CONV && mine ? s_win + tid * (KW - 1) : NULL;
    float *raw = !mine ? NULL : tid < D ? s_q + tid : tid < 2 * D ? s_k + (tid - D) : s_v + (tid - 2 * D);
    if (CONV && mine) {
        for (int q = 0; q < K; q++) tw[q] = a.conv_w[(size_t)ch * K + q];
        for (int q = 0; q < K - 1; q++) win[q] = a.conv_state[(size_t)q * cd + ch];
    }
    const float ssm_a = a.ssm_a[j], dt_bias = a.dt_bias[j];
    float nw[EPL]; // warp 0: the gated norm's weights
    if (w == 0)
#pragma unroll
        for (int e = 0; e < EPL; e++) nw[e] = a.norm_w[e * 32 + lane];
    float *S = a.state + (size_t)j * D * D;
    float s[R][EPL];
#pragma unroll
    for (int rr = 0; rr < R; rr++)
#pragma unroll
        for (int e = 0; e < EPL; e++) s[rr][e] = S[(size_t)(v0 + rr) * D + e * 32 + lane];
    // STRATA_CUDA_TRACE marks (row 0): 1 q, k, v in shared memory, 2 the step's outputs, 3 the
    // head's outputs stored, 4 the state stored.
    unsigned ts = st_pdl_begin();
    st_trace_probe(ts, 0, CONV ? a.qkv : a.u);
    for (int t = 0; t < a.n; t++) {
        // Every read of the in-projection's outputs at once: this thread's channel, the head's
        // gate inputs (every thread: each warp works out the gates itself), warp 0's z.
        float x = 0.0f, zz[EPL];
        if (mine) x = CONV ? a.qkv[(size_t)t * cd + ch] : a.u[(size_t)t * cd + ch];
        const float *row = a.ba + (size_t)t * 2 * a.h_v;
        float bj = row[hk * 2 * r + wi], aj = row[hk * 2 * r + r + wi];
        if (w == 0)
#pragma unroll
            for (int e = 0; e < EPL; e++) zz[e] = a.z[(size_t)t * vd + (size_t)j * D + e * 32 + lane];
        if (CONV && mine) { // conv_window_kernel's arithmetic: the K-1 rows before, then this one
            float sum = 0;
            for (int q = 0; q < K - 1; q++) sum += tw[q] * win[q];
            sum += tw[K - 1] * x;
            for (int q = 0; q + 1 < K - 1; q++) win[q] = win[q + 1];
            if (K > 1) win[K - 2] = x;
            x = sum / (1.0f + expf(-sum));
        }
        if (mine) *raw = x;
        __syncthreads();
        if (t == 0) st_trace_mark(ts, 1);
        // q (scaled by 1/sqrt(d)) and k, l2-normed as l2norm_kernel does, and the gates as
        // gdn_gates_kernel works them out: each warp alike, so no barrier hands them over.
        float ck[EPL], cq[EPL];
#pragma unroll
        for (int qk = 0; qk < 2; qk++) {
            const float *src = qk ? s_k : s_q;
            float v[EPL], ss = 0;
#pragma unroll
            for (int e = 0; e < EPL; e++) v[e] = src[e * 32 + lane];
#pragma unroll
            for (int e = 0; e < EPL; e++) ss += v[e] * v[e];
            float norm = sqrtf(warp_sum(ss));
            float sc = (qk ? 1.0f : 1.0f / sqrtf((float)D)) / (norm > a.eps ? norm : a.eps);
#pragma unroll
            for (int e = 0; e < EPL; e++) (qk ? ck : cq)[e] = v[e] * sc;
        }
        float beta = sigmoidf_(bj), g = ssm_a * softplusf_(aj + dt_bias);
        // The step (gdn_step_kernel's).
        float cv = lane < R ? s_v[v0 + lane] : 0.0f;
        float o = gdn_rows<EPL, R>(s, ck, cq, cv, beta, expf(g));
        if (lane < R) s_o[v0 + lane] = o;
        __syncthreads(); // (the next row's writes of s_q, s_k, s_v come after every warp's reads)
        if (t == 0) st_trace_mark(ts, 2);
        if (w == 0) { // the gated norm: rmsnorm_warp_kernel's arithmetic with the gate
            float v[EPL], ss = 0;
#pragma unroll
            for (int e = 0; e < EPL; e++) v[e] = s_o[e * 32 + lane];
#pragma unroll
            for (int e = 0; e < EPL; e++) ss += v[e] * v[e];
            ss = warp_sum(ss);
            float sc = 1.0f / sqrtf(ss / D + a.eps);
            float *out = a.out + (size_t)t * vd + (size_t)j * D;
#pragma unroll
            for (int e = 0; e < EPL; e++) {
                float y = v[e] * sc * nw[e];
                y *= zz[e] / (1.0f + expf(-zz[e]));
                out[e * 32 + lane] = y;
                if (oq) st_quant_chunk32(y, oq + (size_t)t * vd, ods + (size_t)t * (vd / 32), vd, j * EPL + e, lane);
            }
            if (t == 0) st_trace_mark(ts, 3);
        }
        // (s_o is rewritten by the next row only after its first barrier, which warp 0 reaches
        // after its reads.)
    }
#pragma unroll
    for (int rr = 0; rr < R; rr++)
#pragma unroll
        for (int e = 0; e < EPL; e++) S[(size_t)(v0 + rr) * D + e * 32 + lane] = s[rr][e];
    st_trace_mark(ts, 4);
    if (CONV) { // the new conv state: the last K-1 raw rows
#if defined(ST_CLUSTERS)
        if (r > 1) st_cluster_sync(); // every block of the key head has read its q / k rows
#endif
        if (mine && (tid >= 2 * D || blockIdx.y == 0))
            for (int q = 0; q < K - 1; q++) a.conv_state[(size_t)q * cd + ch] = win[q];
    }
    st_trace_end();
}

// Decode windows of the DeltaNet mixer run deltanet_head_kernel (H200, 2026-12-01: 18.8 -> 8.5 us
// a DeltaNet layer, Next-80B-A3B decode +9%); STRATA_DN_FUSED=0 runs the ops one after another
// (for tests and A/B runs); read once.
static bool dn_fused_on(void) {
    static int on = -1;
    if (on < 0) on = !st_env_is("STRATA_DN_FUSED", "0");
    return on == 1;
}

// STRATA_DN_WO=0: the fused mixer's output projection quantizes the floats itself (read once).
static bool dn_wo_q8_on(void) {
    static int on = -1;
    if (on < 0) on = !st_env_is("STRATA_DN_WO", "0");
    return on == 1;
}

bool st_cuda_deltanet_fuses(const st_deltanet_args *a) {
    return dn_fused_on() && a->n >= 1 && a->n <= DN_FUSED_ROWS && a->d == DN_D && a->h_k >= 1 && a->h_v % a->h_k == 0;
}

void st_cuda_deltanet(st_backend *b, const st_deltanet_args *a) {
    st_cuda *c = st_cuda_of(b);
    if (!st_cuda_deltanet_fuses(a)) {
        st_deltanet_ops(b, a);
        return;
    }
    int r = a->h_v / a->h_k;
    dim3 grid((unsigned)a->h_k, (unsigned)r);
    // A quantized output projection gets the outputs quantized by the kernel (as attention's):
    // its blocks then need no quantization of their own, so they stage their weights while the
    // mixer runs (st_cuda_project) and start their products at once (the same bits).
    const st_mat *wo = a->wo;
    int8_t *oq = NULL;
    float2 *ods = NULL;
    if (wo && st_cuda_q8_takes(wo, a->n) && wo->cols == (int64_t)a->h_v * a->d && dn_wo_q8_on() &&
        !(oq = st_cuda_proj_buf(c, a->n, (size_t)wo->cols, &ods)))
        return; // error kept
    // The conv inside where each block owns its channels' state rows (r = 1), or in clusters of
    // the r heads of a key head.
    bool conv_in = a->kernel >= 1 && a->kernel <= DN_MAX_K &&
                   (r == 1 || st_cluster_fits(c, deltanet_head_kernel<true>, dim3(1, r), grid, DN_WARPS * 32, 0));
    if (conv_in) {
        if (r == 1) st_launch(c, deltanet_head_kernel<true>, grid, DN_WARPS * 32, 0, *a, oq, ods);
        else st_launch_cluster(c, dim3(1, r), deltanet_head_kernel<true>, grid, DN_WARPS * 32, 0, *a, oq, ods);
    } else {
        st_conv_args ca = {.x = a->qkv, .w = a->conv_w, .state = a->conv_state, .y = a->u, .n = a->n,
                           .channels = 2 * a->h_k * a->d + a->h_v * a->d, .kernel = a->kernel};
        st_cuda_conv(b, &ca);
        st_launch(c, deltanet_head_kernel<false>, grid, DN_WARPS * 32, 0, *a, oq, ods);
    }
    ST_CU_LAUNCHED(c, "deltanet");
    if (wo) st_cuda_project(b, wo, oq, ods, a->out, a->n, a->y);
}

// ---------------------------------------------------------------------------------------------
// Chunked form (cpu.c gdn_chunk has the same steps, one value head at a time). Per chunk of
// GC rows with γ_i = Σ_{l≤i} g_l:
//   A  = strict_lower(−diag(β) (K Kᵀ) ⊙ D),  D_il = exp(γ_i − γ_l)
//   T  = (I − A)⁻¹, so W = T diag(β e^γ) K and U = T diag(β) V (the forward substitution
//        row i = rhs_i + Σ_{l<i} A_il row_l);   V' = U − W Sᵀ = T (diag(β) V − diag(β e^γ) K Sᵀ)
//   M  = lower_incl((Q Kᵀ) ⊙ D);   O = diag(e^γ) Q Sᵀ + M V'
//   S ← e^{γ_c} S + V'ᵀ (diag(e^{γ_c − γ}) K)
// T and M do not involve the state, so gdn_prep_kernel computes them for every (chunk, value
// head) at once, in parallel, into a scratch buffer (2 x GC x GC floats each). What involves
// the state runs chunk after chunk in gdn_chunk_kernel, where a block owns one head and a slice
// of GSV value rows of its state (in shared memory across all chunks), each value column being
// independent. Rows past the end of the last chunk are zeros (g = 0, β = 0: no-ops).
//
// Shared memory, D = 128: ~96 KB per kernel (fits the opt-in limit of sm_80 and newer, sm_86/89
// included); where it does not fit (sm_75), the chunked op runs the step kernel instead. Row
// strides of D + 4 and GC + 4 floats keep 16-byte accesses aligned and the rows of a warp's
// loads in different banks.
#define GC ST_GDN_CHUNK
#define GSV 16 // value rows per block of the chunk kernel
#define GDN_CHUNK_THREADS 256
#define GTP (GC + 4) // row stride of A, T and M in shared memory

static size_t gdn_prep_smem(int d) {
    return sizeof(float) * ((size_t)2 * GC * (d + 4) + (size_t)GC * GTP + 2 * GC);
}

static size_t gdn_chunk_smem(int d) {
    return sizeof(float) * ((size_t)2 * GC * (d + 4) + (size_t)GC * GTP + (size_t)GC * GSV + (size_t)GSV * (d + 4) +
                            4 * GC);
}

__device__ __forceinline__ float gdn_dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }

// Loads rows t0 .. t0+GC-1 of key head hk of x (n, HK, D) into dst (GC, D + 4); zeros from c on.
template <int D>
__device__ __forceinline__ void gdn_load_rows(float *dst, const float *x, int t0, int c, int HK, int hk) {
    constexpr int KP = D + 4, Q4 = D / 4;
    for (int e = threadIdx.x; e < GC * Q4; e += GDN_CHUNK_THREADS) {
        int i = e / Q4, x4 = (e % Q4) * 4;
        float4 v = make_float4(0, 0, 0, 0);
        if (i < c) v = *(const float4 *)(x + ((size_t)(t0 + i) * HK + hk) * D + x4);
        *(float4 *)(dst + i * KP + x4) = v;
    }
}

// γ (the cumulative sum in the CPU's order) and β of rows t0 .. t0+GC-1 of value head j.
__device__ __forceinline__ void gdn_load_gates(float *gam, float *bet, const st_gdn_args &a, int t0, int c, int j) {
    int tid = threadIdx.x;
    if (tid < GC) {
        bet[tid] = tid < c ? a.beta[(size_t)(t0 + tid) * a.h_v + j] : 0.0f;
        gam[tid] = tid < c ? a.g[(size_t)(t0 + tid) * a.h_v + j] : 0.0f;
    }
    __syncthreads();
    if (tid == 0)
        for (int i = 1; i < GC; i++) gam[i] += gam[i - 1];
    __syncthreads();
}

// Grid (chunks, value heads): T and M of one chunk of one value head, into
// tm + (chunk * h_v + j) * 2 * GC * GC: T (GC, GC), then M (GC, GC), row-major, zeros above the
// diagonal.
template <int D>
__global__ void __launch_bounds__(GDN_CHUNK_THREADS) gdn_prep_kernel(st_gdn_args a, float *tm) {
    st_pdl_begin();
    static_assert(GC == 64 && GDN_CHUNK_THREADS == 256, "the micro-tiles below assume these");
    constexpr int KP = D + 4;
    extern __shared__ float4 gdn_sm4[];
    float *Ks = (float *)gdn_sm4; // (GC, KP) keys
    float *Qs = Ks + GC * KP;     // (GC, KP) queries, then T and the level sums
    float *A = Qs + GC * KP;      // (GC, GTP)
    float *gam = A + GC * GTP;    // (GC) γ
    float *bet = gam + GC;        // (GC) β
    const int tid = threadIdx.x, ch = blockIdx.x, j = blockIdx.y, t0 = ch * GC;
    const int hk = j / (a.h_v / a.h_k), c = min(GC, a.n - t0);
    float *Tg = tm + ((size_t)ch * a.h_v + j) * 2 * GC * GC, *Mg = Tg + GC * GC;

    gdn_load_rows<D>(Ks, a.k, t0, c, a.h_k, hk);
    gdn_load_rows<D>(Qs, a.q, t0, c, a.h_k, hk);
    gdn_load_gates(gam, bet, a, t0, c, j); // (its barriers also publish Ks, Qs)

    // K Kᵀ and Q Kᵀ together: thread (ti, tl) owns rows ti + 16p and columns tl + 16q.
    const int ti = tid / 16, tl = tid % 16;
    {
        float aa[4][4] = {}, mm[4][4] = {};
        for (int x = 0; x < D; x += 4) {
            float4 kr[4], qr[4], kc[4];
#pragma unroll
            for (int p = 0; p < 4; p++) {
                kr[p] = *(const float4 *)(Ks + (ti + 16 * p) * KP + x);
                qr[p] = *(const float4 *)(Qs + (ti + 16 * p) * KP + x);
                kc[p] = *(const float4 *)(Ks + (tl + 16 * p) * KP + x);
            }
#pragma unroll
            for (int p = 0; p < 4; p++)
#pragma unroll
                for (int q = 0; q < 4; q++) aa[p][q] += gdn_dot4(kr[p], kc[q]), mm[p][q] += gdn_dot4(qr[p], kc[q]);
        }
#pragma unroll
        for (int p = 0; p < 4; p++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                int i = ti + 16 * p, l = tl + 16 * q;
                float dec = l <= i ? expf(gam[i] - gam[l]) : 0.0f;
                A[i * GTP + l] = l < i ? -bet[i] * aa[p][q] * dec : 0.0f; // A_il = −β_i (k_i·k_l) e^{γ_i − γ_l}
                Mg[i * GC + l] = l <= i ? mm[p][q] * dec : 0.0f;           // M_il = (q_i·k_l) e^{γ_i − γ_l}
            }
    }
    __syncthreads(); // A complete; the queries are no longer needed
    // T = (I − A)⁻¹ (unit lower triangular) by blocks of 16: the row-by-row substitution is a
    // chain of 64 dependent steps, this is 1 + 3 levels of parallel 16 x 16 products:
    //   diagonal blocks: a column per thread, solved in registers;
    //   T_ij = T_ii Σ_{k=j}^{i−1} A_ik T_kj for i > j, one diagonal distance d = i − j a level.
    float *Tm = Qs;            // (GC, GTP)
    float *Z = Qs + GC * GTP;  // (3, 16, 16) one level's sums
    if (tid < GC) {
        const int r0 = (tid / 16) * 16, col = tid % 16;
        float t[16];
#pragma unroll
        for (int r = 0; r < 16; r++) {
            float v = r == col ? 1.0f : 0.0f;
#pragma unroll
            for (int l = 0; l < r; l++) v += A[(r0 + r) * GTP + r0 + l] * t[l];
            t[r] = v; // 0 above the diagonal (r < col)
        }
#pragma unroll
        for (int r = 0; r < 16; r++) Tm[(r0 + r) * GTP + r0 + col] = t[r];
    }
    __syncthreads();
    for (int d = 1; d < 4; d++) {
        for (int i = d; i < 4; i++) {
            int jb = i - d;
            float z = 0;
            for (int k = jb; k < i; k++)
#pragma unroll
                for (int x = 0; x < 16; x++) z += A[(16 * i + ti) * GTP + 16 * k + x] * Tm[(16 * k + x) * GTP + 16 * jb + tl];
            Z[(i - d) * 256 + tid] = z;
        }
        __syncthreads();
        for (int i = d; i < 4; i++) {
            int jb = i - d;
            float t = 0;
            for (int x = 0; x <= ti; x++) t += Tm[(16 * i + ti) * GTP + 16 * i + x] * Z[(i - d) * 256 + x * 16 + tl];
            Tm[(16 * i + ti) * GTP + 16 * jb + tl] = t;
        }
        __syncthreads();
    }
    for (int e = tid; e < GC * GC; e += GDN_CHUNK_THREADS) {
        int i = e / GC, l = e % GC;
        Tg[e] = l <= i ? Tm[i * GTP + l] : 0.0f; // the blocks above the diagonal were never written
    }
}

// Grid (D / GSV value slices, value heads), chunk after chunk with the state slice in shared
// memory. Thread (ri, vq) owns row ri of the (GC, GSV) products with the state, columns vq + 4r;
// thread (sv, sx) owns state row sv, columns 4 sx + 64 m + {0..3} of the update.
template <int D>
__global__ void __launch_bounds__(GDN_CHUNK_THREADS) gdn_chunk_kernel(st_gdn_args a, const float *tm) {
    st_pdl_begin();
    static_assert(GC == 64 && GSV == 16 && GDN_CHUNK_THREADS == 256 && D % 64 == 0, "the tiles below assume these");
    constexpr int KP = D + 4, SM = D / 64;
    extern __shared__ float4 gdn_sm4[];
    float *Ks = (float *)gdn_sm4; // (GC, KP) keys
    float *Qs = Ks + GC * KP;     // (GC, KP) queries
    float *TM = Qs + GC * KP;     // (GC, GTP) T, then M
    float *U = TM + GC * GTP;     // (GC, GSV) β v, then Y, then V'
    float *S = U + GC * GSV;      // (GSV, KP) the state slice: value rows vs0.., key dims
    float *gam = S + GSV * KP;    // (GC) γ
    float *bet = gam + GC;        // (GC) β
    float *eg = bet + GC;         // (GC) e^{γ_i}
    float *ek = eg + GC;          // (GC) e^{γ_c − γ_i}
    const int tid = threadIdx.x, j = blockIdx.y, vs0 = blockIdx.x * GSV;
    const int hk = j / (a.h_v / a.h_k), H = a.h_v;
    const int ri = tid / 4, vq = tid % 4, sv = tid / 16, sx = tid % 16;
    float *Sg = a.state + (size_t)j * D * D + (size_t)vs0 * D;
    for (int e = tid; e < GSV * D / 4; e += GDN_CHUNK_THREADS) {
        int r = e / (D / 4), x4 = (e % (D / 4)) * 4;
        *(float4 *)(S + r * KP + x4) = *(const float4 *)(Sg + r * D + x4);
    }

    for (int ch = 0, t0 = 0; t0 < a.n; ch++, t0 += GC) {
        const int c = min(GC, a.n - t0);
        const float *Tg = tm + ((size_t)ch * H + j) * 2 * GC * GC, *Mg = Tg + GC * GC;
        __syncthreads(); // the previous chunk is done with every buffer
        gdn_load_rows<D>(Ks, a.k, t0, c, a.h_k, hk);
        gdn_load_rows<D>(Qs, a.q, t0, c, a.h_k, hk);
        for (int e = tid; e < GC * GC / 4; e += GDN_CHUNK_THREADS) {
            int i = e / (GC / 4), l4 = (e % (GC / 4)) * 4;
            *(float4 *)(TM + i * GTP + l4) = *(const float4 *)(Tg + i * GC + l4);
        }
        gdn_load_gates(gam, bet, a, t0, c, j);
        if (tid < GC) {
            eg[tid] = expf(gam[tid]);
            ek[tid] = expf(gam[GC - 1] - gam[tid]);
        }
        for (int e = tid; e < GC * GSV; e += GDN_CHUNK_THREADS) {
            int i = e / GSV, vs = e % GSV;
            U[e] = i < c ? bet[i] * a.v[((size_t)(t0 + i) * H + j) * D + vs0 + vs] : 0.0f;
        }
        __syncthreads();
        // Y = β v − β e^γ (K Sᵀ), with the state entering the chunk.
        {
            float acc[4] = {};
            for (int x = 0; x < D; x += 4) {
                float4 k4 = *(const float4 *)(Ks + ri * KP + x);
#pragma unroll
                for (int r = 0; r < 4; r++) acc[r] += gdn_dot4(k4, *(const float4 *)(S + (vq + 4 * r) * KP + x));
            }
            float f = bet[ri] * eg[ri];
#pragma unroll
            for (int r = 0; r < 4; r++) U[ri * GSV + vq + 4 * r] -= f * acc[r];
        }
        __syncthreads();
        // V' = T Y (T is lower triangular: l <= ri).
        {
            float acc[4] = {};
            for (int l = 0; l <= ri; l++) {
                float t = TM[ri * GTP + l];
#pragma unroll
                for (int r = 0; r < 4; r++) acc[r] += t * U[l * GSV + vq + 4 * r];
            }
            __syncthreads(); // every read of Y and T is done
#pragma unroll
            for (int r = 0; r < 4; r++) U[ri * GSV + vq + 4 * r] = acc[r];
        }
        for (int e = tid; e < GC * GC / 4; e += GDN_CHUNK_THREADS) { // M replaces T
            int i = e / (GC / 4), l4 = (e % (GC / 4)) * 4;
            *(float4 *)(TM + i * GTP + l4) = *(const float4 *)(Mg + i * GC + l4);
        }
        __syncthreads();
        // O = diag(e^γ) Q Sᵀ + M V'.
        {
            float acc[4] = {};
            for (int x = 0; x < D; x += 4) {
                float4 q4 = *(const float4 *)(Qs + ri * KP + x);
#pragma unroll
                for (int r = 0; r < 4; r++) acc[r] += gdn_dot4(q4, *(const float4 *)(S + (vq + 4 * r) * KP + x));
            }
            float o[4];
#pragma unroll
            for (int r = 0; r < 4; r++) o[r] = eg[ri] * acc[r];
            for (int l = 0; l <= ri; l++) {
                float m = TM[ri * GTP + l];
#pragma unroll
                for (int r = 0; r < 4; r++) o[r] += m * U[l * GSV + vq + 4 * r];
            }
            if (ri < c) {
                float *out = a.out + ((size_t)(t0 + ri) * H + j) * D + vs0 + vq;
#pragma unroll
                for (int r = 0; r < 4; r++) out[4 * r] = o[r];
            }
        }
        __syncthreads(); // every read of the entering state is done
        // S ← e^{γ_c} S + V'ᵀ (diag(e^{γ_c − γ}) K); γ_c = γ of the last row (padding adds 0).
        {
            float ec = expf(gam[GC - 1]);
            float4 acc[SM];
#pragma unroll
            for (int m = 0; m < SM; m++) acc[m] = make_float4(0, 0, 0, 0);
            for (int i = 0; i < c; i++) {
                float u = U[i * GSV + sv] * ek[i];
#pragma unroll
                for (int m = 0; m < SM; m++) {
                    float4 k4 = *(const float4 *)(Ks + i * KP + 4 * sx + 64 * m);
                    acc[m].x += u * k4.x, acc[m].y += u * k4.y, acc[m].z += u * k4.z, acc[m].w += u * k4.w;
                }
            }
#pragma unroll
            for (int m = 0; m < SM; m++) {
                float4 *sp = (float4 *)(S + sv * KP + 4 * sx + 64 * m), s4 = *sp;
                *sp = make_float4(ec * s4.x + acc[m].x, ec * s4.y + acc[m].y, ec * s4.z + acc[m].z, ec * s4.w + acc[m].w);
            }
        }
    }
    __syncthreads();
    for (int e = tid; e < GSV * D / 4; e += GDN_CHUNK_THREADS) {
        int r = e / (D / 4), x4 = (e % (D / 4)) * 4;
        *(float4 *)(Sg + r * D + x4) = *(const float4 *)(S + r * KP + x4);
    }
}

static bool gdn_aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

void st_cuda_gdn_chunked(st_backend *b, const st_gdn_args *a) {
    st_cuda *c = st_cuda_of(b);
    if (a->n <= 0 || !gdn_check(c, a)) return;
    size_t smem = gdn_chunk_smem(a->d), psmem = gdn_prep_smem(a->d);
    // The chunked kernels are written for Qwen3-Next's head size and 16-byte aligned rows;
    // other sizes, and GPUs whose shared memory is too small for them, take the step form (same
    // results up to rounding).
    if (a->d != 128 || smem > c->prop.sharedMemPerBlockOptin || psmem > c->prop.sharedMemPerBlockOptin ||
        !gdn_aligned16(a->q) || !gdn_aligned16(a->k) || !gdn_aligned16(a->state)) {
        st_cuda_gdn(b, a);
        return;
    }
    int nch = (a->n + GC - 1) / GC;
    float *tm = (float *)st_cuda_scratch(c, ST_SCR_GDN, sizeof(float) * (size_t)nch * a->h_v * 2 * GC * GC);
    if (!tm) return; // the error is kept
    ST_CU(c, cudaFuncSetAttribute(gdn_prep_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)psmem));
    ST_CU(c, cudaFuncSetAttribute(gdn_chunk_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    st_launch(c, gdn_prep_kernel<128>, dim3((unsigned)nch, (unsigned)a->h_v), GDN_CHUNK_THREADS, psmem, *a, tm);
    ST_CU_LAUNCHED(c, "gdn_chunked prep");
    dim3 grid((unsigned)(a->d / GSV), (unsigned)a->h_v);
    st_launch(c, gdn_chunk_kernel<128>, grid, GDN_CHUNK_THREADS, smem, *a, tm);
    ST_CU_LAUNCHED(c, "gdn_chunked");
}

// STRATA_CUDA_TRACE: binds this file's copy of st_trace (cuda_common.cuh).
cudaError_t st_trace_bind_gdn(const st_trace_dev *t) { return st_trace_bind_unit(t); }
