// backend/cuda: matmul, get_rows and the routed experts over quantized weights. Decode windows
// (n <= 16): one launch per matrix, each block quantizing its x rows to int8 in shared memory,
// then warps of __dp4a dots with lanes over consecutive chunks (mmv2, moe2); prompt chunks: a
// tensor-core tile GEMM over weights dequantized in shared memory (quant_gemm.cuh) for the
// experts, cuBLAS for dense and float weights. Unpacking of each type lives in quant_unpack.cuh.

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/quant_unpack.cuh"
#include "backend/cuda/quant_gemm.cuh"

extern "C" {
#include "quant/iq_tables.h"
}

// Rows from which matmul dequantizes and calls cuBLAS instead of the matrix-vector kernels.
// Must be > ST_CUDA_GRAPH_ROWS (cuBLAS and piecewise dequant are not capture-safe here).
// 17 is the smallest legal value, and the H200 agrees: 4096x4096 Q4_K takes 35.6 us at 16 rows in
// the matrix-vector kernel and 62 us at 17 through cuBLAS, whose time then barely grows to 64 rows.
#define ST_CUQ_GEMM_FROM (ST_CUDA_GRAPH_ROWS + 1)
// The bf16 copy of a weight is made in pieces of rows no bigger than this (the 151936-row
// head would take 622 MB at once).
#define ST_CUQ_DEQ_BYTES ((size_t)128 << 20)
#define ST_CUQ_WARPS 4 // warps per block of the matrix-vector kernels, one weight row each
#define ST_CUQ_MAX_DEV 64

#define CUQ_FAIL(c, ...) st_cuda_fail_msg((c), __FILE__, __LINE__, __VA_ARGS__)

// ---------------------------------------------------------------------------------------------
// Tables: copied once per device from the CPU's, outside graph recording (an op's first call
// is never recorded).

// Switches for comparisons (see the functions that read them).
static bool env_on(const char *name) {
    const char *v = getenv(name);
    return v && v[0] == '1';
}
static bool env_is_0(const char *name) {
    const char *v = getenv(name);
    return v && v[0] == '0';
}

static bool quant_tables_ready[ST_CUQ_MAX_DEV];

// Weights are streamed with an evict-first L2 policy (st_l2_evict_first); STRATA_L2_HINT=0 turns
// it off for comparisons. Read once per device with the tables.
static __constant__ int cuq_l2_hint;

static bool quant_tables(st_cuda *c) {
    if (c->device < 0 || c->device >= ST_CUQ_MAX_DEV) {
        CUQ_FAIL(c, "device index %d out of range for the quant tables", c->device);
        return false;
    }
    if (quant_tables_ready[c->device]) return true;
    if (c->capturing) {
        CUQ_FAIL(c, "quant tables first needed while recording a graph");
        return false;
    }
    uint32_t kv[4];
    memcpy(kv, st_kvalues_iq4nl, sizeof kv);
    static int hint; // (static: the copy below is asynchronous from pageable memory)
    hint = !env_is_0("STRATA_L2_HINT");
    ST_CU(c, cudaMemcpyToSymbolAsync(cuq_l2_hint, &hint, sizeof hint, 0, cudaMemcpyHostToDevice, c->stream));
    // Copied on first use: an op's first call is never recorded into a graph (cuda.cu runs a
    // window's work eagerly before recording it), so this never runs inside a capture.
    ST_CU(c, cudaMemcpyToSymbolAsync(st_dq_iq2xxs, st_iq2xxs_grid, sizeof st_iq2xxs_grid, 0, cudaMemcpyHostToDevice, c->stream));
    ST_CU(c, cudaMemcpyToSymbolAsync(st_dq_iq2xs, st_iq2xs_grid, sizeof st_iq2xs_grid, 0, cudaMemcpyHostToDevice, c->stream));
    ST_CU(c, cudaMemcpyToSymbolAsync(st_dq_iq2s, st_iq2s_grid, sizeof st_iq2s_grid, 0, cudaMemcpyHostToDevice, c->stream));
    ST_CU(c, cudaMemcpyToSymbolAsync(st_dq_iq3xxs, st_iq3xxs_grid, sizeof st_iq3xxs_grid, 0, cudaMemcpyHostToDevice, c->stream));
    ST_CU(c, cudaMemcpyToSymbolAsync(st_dq_iq3s, st_iq3s_grid, sizeof st_iq3s_grid, 0, cudaMemcpyHostToDevice, c->stream));
    ST_CU(c, cudaMemcpyToSymbolAsync(st_dq_iq1s, st_iq1s_grid, sizeof st_iq1s_grid, 0, cudaMemcpyHostToDevice, c->stream));
    ST_CU(c, cudaMemcpyToSymbolAsync(st_dq_ksigns, st_ksigns_iq2xs, sizeof st_ksigns_iq2xs, 0, cudaMemcpyHostToDevice, c->stream));
    ST_CU(c, cudaMemcpyToSymbolAsync(st_dq_kvalues, kv, sizeof kv, 0, cudaMemcpyHostToDevice, c->stream));
    // The host sources are pageable, so the copies are staged before returning; still, wait so
    // kv (on the stack) is certainly consumed.
    ST_CU(c, cudaStreamSynchronize(c->stream));
    if (c->err) return false;
    quant_tables_ready[c->device] = true;
    return true;
}

bool st_cuda_type_supported(st_type t) {
    switch (t) {
#define CASE(T) case T:
        ST_CUQ_QUANT_TYPES(CASE)
#undef CASE
    case ST_TYPE_F32:
    case ST_TYPE_F16:
    case ST_TYPE_BF16: return true;
    default: return false;
    }
}

// ---------------------------------------------------------------------------------------------
// Activations: rows of floats to int8 blocks of 32 with a float scale and the float sum of the
// block (q8_1 style, scale amax/127, round half away from zero as the CPU's q8_0).

// (rows, cols) int8 values followed by (rows, cols / 32) float2 {scale, sum}.
struct st_act {
    const int8_t *q;
    const float2 *ds;
    int cols; // multiple of 32
};

static size_t align_up16(size_t b) { return (b + 15) / 16 * 16; }

static size_t act_bytes(int rows, int cols) {
    size_t qb = ((size_t)rows * cols + 255) / 256 * 256;
    return qb + sizeof(float2) * (size_t)rows * (cols / 32);
}

static st_act act_view(void *buf, int rows, int cols) {
    size_t qb = ((size_t)rows * cols + 255) / 256 * 256;
    st_act a = {(const int8_t *)buf, (const float2 *)((char *)buf + qb), cols};
    return a;
}

// One warp per block of 32: blockDim 256 = 8 blocks.
__global__ void quantize_q8_kernel(const float *x, int64_t nblocks, int8_t *q, float2 *ds) {
    st_pdl_begin();
    int64_t blk = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (blk >= nblocks) return;
    int lane = threadIdx.x & 31;
    float v = x[blk * 32 + lane];
    float amax = fabsf(v), sum = v;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    float id, d = st_q8_scale(amax, &id);
    q[blk * 32 + lane] = (int8_t)st_q8_byte(v, id);
    if (lane == 0) ds[blk] = make_float2(d, sum);
}

// Quantizes x (rows, cols) into scratch slot `slot`; NULL view (q == NULL) on failure.
static st_act quantize_act(st_cuda *c, int slot, const float *x, int rows, int cols) {
    st_act a = {NULL, NULL, cols};
    void *buf = st_cuda_scratch(c, slot, act_bytes(rows, cols));
    if (!buf) return a;
    a = act_view(buf, rows, cols);
    int64_t nb = (int64_t)rows * (cols / 32);
    if (nb == 0) return a;
    st_launch(c, quantize_q8_kernel, (unsigned)((nb + 7) / 8), 256, 0, x, nb, (int8_t *)a.q, (float2 *)a.ds);
    ST_CU_LAUNCHED(c, "quantize_q8");
    return a;
}

// ---------------------------------------------------------------------------------------------
// The warp dot: one weight row against up to NX activation rows (row xr[j] of the activations
// for j < nx), each lane taking every 32nd chunk of 32 weights. Sums are left per lane.

// Activation row of member j: j itself (matmul) or a list in shared memory (experts).
struct st_xrows {
    const int *p;
    __device__ __forceinline__ int operator[](int j) const { return p ? p[j] : j; }
};

__device__ __forceinline__ float warp_sum_q(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// The same over each half of the warp, where the other half's lanes held zeros in warp_sum_q:
// its first step's x + 0 (a -0 becomes +0) then the same partners, so the same bits.
__device__ __forceinline__ float half_sum_q(float v) {
    v += 0.0f;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Adds one unpacked chunk times activation row xr's chunk c to acc.
template <int T>
__device__ __forceinline__ float chunk_dot(const st_wchunk &w, const st_act &a, int xr, int nchunk, int c) {
    const int4 *p = (const int4 *)(a.q + (size_t)xr * a.cols + (size_t)c * 32);
    int4 x0 = p[0], x1 = p[1];
    int d0 = __dp4a(w.q[0], x0.x, __dp4a(w.q[1], x0.y, __dp4a(w.q[2], x0.z, __dp4a(w.q[3], x0.w, 0))));
    int d1 = __dp4a(w.q[4], x1.x, __dp4a(w.q[5], x1.y, __dp4a(w.q[6], x1.z, __dp4a(w.q[7], x1.w, 0))));
    float2 ds = a.ds[(size_t)xr * nchunk + c];
    float v = w.s0 * (float)d0 + w.s1 * (float)d1;
    if (st_qt<T>::HAS_MIN) {
        // Offsets times the sums of the quantized activations (per 16: Q2_K's mins are per 16).
        const int ones = 0x01010101;
        int s0 = __dp4a(ones, x0.x, __dp4a(ones, x0.y, __dp4a(ones, x0.z, __dp4a(ones, x0.w, 0))));
        int s1 = __dp4a(ones, x1.x, __dp4a(ones, x1.y, __dp4a(ones, x1.z, __dp4a(ones, x1.w, 0))));
        v += w.m0 * (float)s0 + w.m1 * (float)s1;
    }
    return ds.x * v;
}

// Weight rows are streamed through shared memory 32 chunks at a time: the warp copies the
// span with 16-byte loads (coalesced whatever the block size: Q8_0's 34-byte blocks would
// otherwise be read with scattered 2-byte loads), each lane then unpacks its chunk there. The
// copy keeps the global address modulo 16, so the unpackers' alignment assumptions hold, and
// the next span is loaded into registers while the current one is computed.
template <int T> struct st_span {
    static constexpr int CPB = st_qt<T>::QK / 32;            // chunks per block
    static constexpr int BYTES = 32 / CPB * st_qt<T>::BS;    // bytes of 32 chunks
    static constexpr int WORDS = (BYTES + 15) / 16 + 1;      // 16-byte words, one more for the skew
    static constexpr int PL = (WORDS + 31) / 32;             // words per lane
};

// Loads the words of the span starting at chunk c0 (a multiple of 32) into buf.
template <int T>
__device__ __forceinline__ void span_load(const uint8_t *row, int c0, int nchunk, uint4 (&buf)[st_span<T>::PL]) {
    constexpr int CPB = st_span<T>::CPB, BS = st_qt<T>::BS;
    int c1 = c0 + 32 < nchunk ? c0 + 32 : nchunk;
    const uint8_t *A = row + (size_t)(c0 / CPB) * BS, *B = row + (size_t)((c1 + CPB - 1) / CPB) * BS;
    const uint8_t *A0 = (const uint8_t *)((uintptr_t)A & ~(uintptr_t)15);
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int p = 0; p < st_span<T>::PL; p++) {
        const uint8_t *v = A0 + 16 * (size_t)(lane + 32 * p);
        uint4 w = make_uint4(0, 0, 0, 0);
        if (v + 16 <= B) {
            w = *(const uint4 *)v;
        } else if (v < B) { // the span's last partial word: never read past the matrix
            uint32_t u[4] = {0, 0, 0, 0};
            int nh = (int)(B - v) / 2; // halfwords left (B is even: blocks have even sizes)
#pragma unroll
            for (int k = 0; k < 8; k++)
                if (k < nh) u[k / 2] |= (uint32_t)((const uint16_t *)v)[k] << (16 * (k & 1));
            w = make_uint4(u[0], u[1], u[2], u[3]);
        }
        buf[p] = w;
    }
}

// Stores buf to the warp's shared words; returns where chunk c0's block starts there.
template <int T>
__device__ __forceinline__ const uint8_t *span_store(const uint8_t *row, int c0, const uint4 (&buf)[st_span<T>::PL],
                                                     uint4 *sm) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int p = 0; p < st_span<T>::PL; p++) sm[lane + 32 * p] = buf[p];
    const uint8_t *A = row + (size_t)(c0 / st_span<T>::CPB) * st_qt<T>::BS;
    return (const uint8_t *)sm + ((uintptr_t)A & 15);
}

template <int T, int NX>
__device__ __forceinline__ void row_dot(const uint8_t *wrow, int nchunk, const st_act &a, const st_xrows &xr,
                                        int nx, float (&acc)[NX], uint4 *sm) {
    int lane = threadIdx.x & 31;
    uint4 buf[st_span<T>::PL];
    span_load<T>(wrow, 0, nchunk, buf);
    for (int c0 = 0; c0 < nchunk; c0 += 32) {
        const uint8_t *base = span_store<T>(wrow, c0, buf, sm);
        __syncwarp();
        if (c0 + 32 < nchunk) span_load<T>(wrow, c0 + 32, nchunk, buf);
        int c = c0 + lane;
        if (c < nchunk) {
            st_wchunk w;
            st_qt<T>::unpack(base, c - c0, w);
#pragma unroll
            for (int j = 0; j < NX; j++)
                if (j < nx) acc[j] += chunk_dot<T>(w, a, xr[j], nchunk, c);
        }
        __syncwarp();
    }
}

// gate and up rows share the activation loads.
template <int T, int NX>
__device__ __forceinline__ void row_dot2(const uint8_t *grow, const uint8_t *urow, int nchunk, const st_act &a,
                                         const st_xrows &xr, int nx, float (&ag)[NX], float (&au)[NX], uint4 *smg,
                                         uint4 *smu) {
    int lane = threadIdx.x & 31;
    uint4 bg[st_span<T>::PL], bu[st_span<T>::PL];
    span_load<T>(grow, 0, nchunk, bg);
    span_load<T>(urow, 0, nchunk, bu);
    for (int c0 = 0; c0 < nchunk; c0 += 32) {
        const uint8_t *base_g = span_store<T>(grow, c0, bg, smg), *base_u = span_store<T>(urow, c0, bu, smu);
        __syncwarp();
        if (c0 + 32 < nchunk) {
            span_load<T>(grow, c0 + 32, nchunk, bg);
            span_load<T>(urow, c0 + 32, nchunk, bu);
        }
        int c = c0 + lane;
        if (c < nchunk) {
            st_wchunk g, u;
            st_qt<T>::unpack(base_g, c - c0, g);
            st_qt<T>::unpack(base_u, c - c0, u);
#pragma unroll
            for (int j = 0; j < NX; j++)
                if (j < nx) {
                    ag[j] += chunk_dot<T>(g, a, xr[j], nchunk, c);
                    au[j] += chunk_dot<T>(u, a, xr[j], nchunk, c);
                }
        }
        __syncwarp();
    }
}

// Float weights against float activations: 8 elements per lane and step when rows and x are
// 16-byte aligned, one element otherwise.
template <int T> __device__ __forceinline__ float ld_wf(const uint8_t *row, int64_t e) {
    if (T == ST_TYPE_F32) return ((const float *)row)[e];
    if (T == ST_TYPE_F16) return __half2float(((const __half *)row)[e]);
    return __uint_as_float((uint32_t)((const uint16_t *)row)[e] << 16);
}

template <int T> __device__ __forceinline__ void ld_wf8(const uint8_t *p, float v[8]) {
    if (T == ST_TYPE_F32) {
        float4 a = ((const float4 *)p)[0], b = ((const float4 *)p)[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
        uint4 a = *(const uint4 *)p;
        uint32_t u[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (T == ST_TYPE_F16) {
                float2 f = __half22float2(*(const __half2 *)&u[i]);
                v[2 * i] = f.x;
                v[2 * i + 1] = f.y;
            } else {
                v[2 * i] = __uint_as_float(u[i] << 16);
                v[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
            }
        }
    }
}

template <int T, int NX>
__device__ __forceinline__ void row_dot_f(const uint8_t *wrow, int cols, const float *x, int64_t ldx,
                                          const st_xrows &xr, int nx, float (&acc)[NX]) {
    int lane = threadIdx.x & 31;
    bool vec = cols % 8 == 0 && ((uintptr_t)wrow & 15) == 0 && ((uintptr_t)x & 15) == 0 && ldx % 4 == 0;
    if (vec) {
        // Unrolled so four steps' loads are in flight together (a router row of 2,048 floats is
        // eight steps: two round trips instead of eight).
#pragma unroll 4
        for (int e = lane * 8; e < cols; e += 256) {
            float wv[8];
            ld_wf8<T>(wrow + (size_t)e * (T == ST_TYPE_F32 ? 4 : 2), wv);
#pragma unroll
            for (int j = 0; j < NX; j++)
                if (j < nx) {
                    const float4 *px = (const float4 *)(x + xr[j] * ldx + e);
                    float4 a = px[0], b = px[1];
                    acc[j] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w + wv[4] * b.x + wv[5] * b.y +
                              wv[6] * b.z + wv[7] * b.w;
                }
        }
    } else {
        for (int e = lane; e < cols; e += 32) {
            float wv = ld_wf<T>(wrow, e);
#pragma unroll
            for (int j = 0; j < NX; j++)
                if (j < nx) acc[j] += wv * x[xr[j] * ldx + e];
        }
    }
}

// The norm a product's blocks apply to their input themselves (norm_matmul, windows of a few
// rows): each block sums the squares of its rows x (+ y) as the norm kernel does (rms_sumsq,
// the same block size), so it scales them to the bits that kernel writes; block 0 also writes
// the sum (xo, when y) and the normed rows (xn) for the ops after it. x == NULL: no norm.
struct st_norm_in {
    const float *x, *y;
    float *xo, *xn;
    const float *w;
    float eps;
};

// One row x (+ y) normed and quantized from registers (decode: d / 4 <= ST_NQ_KEEP · blockDim):
// the sums of rms_sumsq, the values of quant_split with the norm's scale (a · s · w), quantized
// eight lanes a chunk (one float4 each) with quant_chunk4's operations in its order (the sum's
// halves meet at lane ^ 4 first, then 2 and 1 as there): the same bits as norm_scales then
// quant_split, with one round trip to L2 instead of two and the norm's weights (g, this thread's
// float4 j = threadIdx.x + k · blockDim.x) loaded before the wait. Block 0 writes xo and xn.
#define ST_NQ_KEEP 4 // float4 a thread: rows of up to 2,048 over 128 threads
// ts: st_pdl_begin's slot (trace mark 7: the sum of squares done).
__device__ __forceinline__ void norm_quant_regs(const st_norm_in &nm, int d, const float4 (&g)[ST_NQ_KEEP], int8_t *q,
                                                float2 *ds, unsigned ts) {
    float4 keep[ST_NQ_KEEP];
    const bool b0 = blockIdx.x == 0;
    float s = rms_scale(rms_sumsq<ST_NQ_KEEP>(nm.x, nm.y, b0 && nm.y ? nm.xo : NULL, d, true, keep), d, nm.eps);
    st_trace_mark(ts, 7);
    const int d4 = d / 4, i8 = threadIdx.x & 7;
    float4 *xn4 = b0 ? (float4 *)nm.xn : NULL;
#pragma unroll
    for (int k = 0; k < ST_NQ_KEEP; k++) {
        if (k * (int)blockDim.x >= d4) break; // (the same for the whole block)
        int j = threadIdx.x + k * blockDim.x;
        bool ok = j < d4; // (the same for a chunk's eight lanes: d4 % 8 == 0)
        float4 a = keep[k], w = g[k];
        float4 v = make_float4(a.x * s * w.x, a.y * s * w.y, a.z * s * w.z, a.w * s * w.w);
        if (xn4 && ok) xn4[j] = v;
        float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
        float sum = v.x + v.y + v.z + v.w;
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
        sum += __shfl_xor_sync(0xffffffffu, sum, 4);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        float id, dq = st_q8_scale(amax, &id);
        if (!ok) continue;
        int c = j >> 3;
        uint32_t b = st_q8_byte(v.x, id) | st_q8_byte(v.y, id) << 8 | st_q8_byte(v.z, id) << 16 | st_q8_byte(v.w, id) << 24;
        *(uint32_t *)(q + (i8 < 4 ? c * 16 + 4 * i8 : d / 2 + c * 16 + 4 * (i8 - 4))) = b;
        if (i8 == 0) ds[c] = make_float2(dq, sum);
    }
    __syncthreads(); // (the products read q and ds)
}

// The rows' scales into sc (nx, shared memory); block 0 writes xo and xn on the way.
__device__ __forceinline__ void norm_scales(const st_norm_in &nm, int nx, int d, float *sc) {
    for (int j = 0; j < nx; j++) {
        size_t off = (size_t)j * d;
        const float *y = nm.y ? nm.y + off : NULL;
        float s;
        if (blockIdx.x == 0) {
            s = rms_row(nm.x + off, y, y ? nm.xo + off : NULL, nm.w, nm.xn + off, d, nm.eps, true);
        } else {
            float4 keep[RMS_KEEP];
            s = rms_scale(rms_sumsq(nm.x + off, y, NULL, d, true, keep), d, nm.eps);
        }
        if (threadIdx.x == 0) sc[j] = s;
    }
    __syncthreads();
}

// The activations a matrix-vector kernel reads: quantized blocks, or floats for float weights.
struct st_mv_in {
    st_act a;
    const float *x; // (rows, ldx) floats
    int64_t ldx;
};

template <int T, int NX>
__device__ __forceinline__ void any_row_dot(const uint8_t *wrow, int cols, const st_mv_in &in, const st_xrows &xr,
                                            int nx, float (&acc)[NX]) {
    if constexpr (T == ST_TYPE_F32 || T == ST_TYPE_F16 || T == ST_TYPE_BF16) {
        row_dot_f<T, NX>(wrow, cols, in.x, in.ldx, xr, nx, acc);
    } else {
        __shared__ uint4 sm[ST_CUQ_WARPS][32 * st_span<T>::PL];
        row_dot<T, NX>(wrow, cols / 32, in.a, xr, nx, acc, sm[threadIdx.x >> 5]);
    }
}

// ---------------------------------------------------------------------------------------------
// matmul, n <= 16: y (n, rows); warp w of block b computes row 4b + w for every x row.

// One row normed into shared memory (rows: xn for block 0) and its product with this warp's
// float weight row r (the routers), both loaded into registers before the wait: their loads
// overlap the kernel before, and after the wait only x's (+ y's) remain, one L2 round trip
// where rms_row then row_dot_f waited three (the norm's weights after the sum, the weight row
// after the barrier). The arithmetic of rms_row and row_dot_f in their order: the same bits.
// Rows of up to ST_MVF_KEEP · 256 floats (cols % 256 == 0), 16-byte aligned.
#define ST_MVF_KEEP 8
template <int T>
__device__ __forceinline__ void mmv_norm_regs(const uint8_t *w, size_t row_bytes, int64_t rows, int cols, float *y,
                                              const st_norm_in &nm, float *rows_) {
    const int lane = threadIdx.x & 31, d4 = cols / 4;
    const int64_t r = (int64_t)blockIdx.x * ST_CUQ_WARPS + (threadIdx.x >> 5);
    const uint8_t *wrow = w + (size_t)min(r, rows - 1) * row_bytes;
    float wv[ST_MVF_KEEP][8];
#pragma unroll
    for (int k = 0; k < ST_MVF_KEEP; k++)
        if (lane * 8 + 256 * k < cols) ld_wf8<T>(wrow + (size_t)(lane * 8 + 256 * k) * (T == ST_TYPE_F32 ? 4 : 2), wv[k]);
    const float4 *w4 = (const float4 *)nm.w;
    float4 g[ST_NQ_KEEP];
#pragma unroll
    for (int k = 0; k < ST_NQ_KEEP; k++) g[k] = w4[min((int)(threadIdx.x + k * blockDim.x), d4 - 1)];
    st_pdl_begin();
    float4 keep[ST_NQ_KEEP];
    float s = rms_scale(rms_sumsq<ST_NQ_KEEP>(nm.x, nm.y, blockIdx.x == 0 && nm.y ? nm.xo : NULL, cols, true, keep),
                        cols, nm.eps);
    float4 *n4 = (float4 *)rows_;
    rms_scale_kept<ST_NQ_KEEP>(keep, g, s, n4, d4);
    __syncthreads();
    if (r >= rows) return;
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < ST_MVF_KEEP; k++) {
        int e = lane * 8 + 256 * k;
        if (e < cols) {
            const float *v = wv[k];
            float4 a = n4[e / 4], b = n4[e / 4 + 1];
            acc += v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w + v[4] * b.x + v[5] * b.y + v[6] * b.z + v[7] * b.w;
        }
    }
    float sum = warp_sum_q(acc);
    if (lane == 0) y[r] = sum;
}

// With nm.x (float weights only), the block norms its input into shared memory first; regs
// (one row, mmv_norm_regs' shapes): from registers.
template <int T, int NX>
__global__ void __launch_bounds__(32 * ST_CUQ_WARPS)
    mmv_kernel(const uint8_t *w, size_t row_bytes, int64_t rows, int cols, st_mv_in in, int nx, float *y,
               st_norm_in nm, bool regs) {
    extern __shared__ __align__(16) float mv_rows[];
    int64_t rb0 = (int64_t)blockIdx.x * ST_CUQ_WARPS;
    const uint8_t *wb = w + (size_t)rb0 * row_bytes;
    size_t wn = (size_t)(min(rb0 + ST_CUQ_WARPS, rows) - rb0) * row_bytes;
    if constexpr (NX == 1 && (T == ST_TYPE_F32 || T == ST_TYPE_F16 || T == ST_TYPE_BF16)) {
        if (regs) {
            mmv_norm_regs<T>(w, row_bytes, rows, cols, y, nm, blockIdx.x == 0 ? nm.xn : mv_rows);
            st_trace_end();
            return;
        }
    }
    if (cuq_l2_hint) prefetch_l2_stream(wb, wn);
    else prefetch_l2(wb, wn);
    st_pdl_begin();
    if (nm.x) { // the normed rows in shared memory (block 0: in xn, which later ops read)
        float *rows = blockIdx.x == 0 ? nm.xn : mv_rows;
        for (int j = 0; j < nx; j++) {
            size_t off = (size_t)j * cols;
            const float *y = nm.y ? nm.y + off : NULL;
            rms_row(nm.x + off, y, y && blockIdx.x == 0 ? nm.xo + off : NULL, nm.w, rows + off, cols, nm.eps, true);
        }
        __syncthreads();
        in.x = rows;
        in.ldx = cols;
    }
    int64_t r = (int64_t)blockIdx.x * ST_CUQ_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    st_xrows xr = {NULL};
    float acc[NX];
#pragma unroll
    for (int j = 0; j < NX; j++) acc[j] = 0.0f;
    any_row_dot<T, NX>(w + (size_t)r * row_bytes, cols, in, xr, nx, acc);
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < NX; j++) {
        float s = warp_sum_q(acc[j]);
        if (lane == j && j < nx) y[(size_t)j * rows + r] = s;
    }
    st_trace_end();
}

template <int T>
static void mmv_launch(st_cuda *c, const st_mat *w, const st_mv_in &in, int n, float *y, const st_norm_in *nm = NULL) {
    dim3 grid((unsigned)((w->rows + ST_CUQ_WARPS - 1) / ST_CUQ_WARPS));
    const uint8_t *wd = (const uint8_t *)w->data;
    int cols = (int)w->cols;
    st_norm_in none = {};
    size_t smem = nm ? sizeof(float) * (size_t)n * cols : 0;
    // One normed row of a float matrix (the routers): from registers (STRATA_MVF_REGS=0: rms_row
    // then row_dot_f, the same bits).
    bool regs = nm && n == 1 && st_cuda_float_type(w->type) && cols % 256 == 0 && cols <= 256 * ST_MVF_KEEP &&
                cols / 4 <= ST_NQ_KEEP * 32 * ST_CUQ_WARPS && w->row_bytes % 16 == 0 && ((uintptr_t)wd & 15) == 0 &&
                ((uintptr_t)nm->x & 15) == 0 && ((uintptr_t)nm->y & 15) == 0 && ((uintptr_t)nm->w & 15) == 0 &&
                nm->w && !env_is_0("STRATA_MVF_REGS");
#define L(NX)                                                                                      \
    do {                                                                                           \
        if (smem) st_allow_smem(c, mmv_kernel<T, NX>, smem);                                       \
        st_launch(c, mmv_kernel<T, NX>, grid, 32 * ST_CUQ_WARPS, smem, wd, w->row_bytes, w->rows, cols, in, n, y, \
                  nm ? *nm : none, regs);                                                          \
    } while (0)
    if (n == 1) L(1);
    else if (n == 2) L(2);
    else if (n <= 4) L(4);
    else if (n <= 8) L(8);
    else L(16);
#undef L
    ST_CU_LAUNCHED(c, "mmv_kernel");
}

// ---------------------------------------------------------------------------------------------
// matmul, n <= 16, one launch (mmv2): each block quantizes the x rows into shared memory
// itself (windows of up to ST_MV_FUSED_MAX rows; larger ones read x quantized once by a
// separate kernel into the same layout in global memory), then each warp computes R (ST_MV_R)
// weight rows: lanes take consecutive chunks, so the warp's loads cover consecutive blocks of
// the rows, read straight from global memory; each x chunk read serves R rows. For one x row,
// R is doubled (or quadrupled) where the blocks would not all be resident at once: the q/k/v product of the
// 30B-A3B (640 blocks of 112 registers a thread, 4 a multiprocessor: 528 at once) ran its last
// 112 blocks as a second wave after the first, whose weights no early start had fetched (the
// trace: nine tenths of its blocks ended 10.1 us after its release, block 0 at 5.0 us).

#define ST_MV_WARPS 4
#define ST_MV_R 2
#define ST_MV_FUSED_MAX 4          // beyond: redundant per-block quantization costs more L2 reads than it saves
#define ST_MV_SMEM_MAX (48 * 1024) // static limit of dynamic shared memory without an opt-in
#define ST_MV_TILE_MAX (40 * 1024) // staged weight rows of a block: rows of up to ~9,600 Q8_0 columns
#define ST_MV_TILE_WIDE (96 * 1024) // the same at more rows a warp (fewer blocks a multiprocessor)

// One chunk of 32 values quantized by four lanes (l4 = lane & 3): lane l4 holds values 4·l4 ..
// 4·l4+3 (v0) and 16+4·l4 .. 16+4·l4+3 (v1). Every lane of the warp calls it (shuffles within
// groups of four). The sum is that of eight lanes of four values butterflied at 4, 2, 1 (an
// earlier layout's order: the same bits); scale amax/127, round half away from zero. With
// store, 4 bytes go to each half (q0: the first 16 values, q1: the second) and lane l4 == 0
// writes {scale, sum} to *ds.
__device__ __forceinline__ void quant_chunk4(float4 v0, float4 v1, int l4, bool store, int8_t *q0, int8_t *q1,
                                             float2 *ds) {
    float amax = fmaxf(fmaxf(fmaxf(fabsf(v0.x), fabsf(v0.y)), fmaxf(fabsf(v0.z), fabsf(v0.w))),
                       fmaxf(fmaxf(fabsf(v1.x), fabsf(v1.y)), fmaxf(fabsf(v1.z), fabsf(v1.w))));
    float sum = (v0.x + v0.y + v0.z + v0.w) + (v1.x + v1.y + v1.z + v1.w);
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    float id, d = st_q8_scale(amax, &id);
    if (!store) return;
    uint32_t a0 = st_q8_byte(v0.x, id), a1 = st_q8_byte(v0.y, id), a2 = st_q8_byte(v0.z, id), a3 = st_q8_byte(v0.w, id);
    uint32_t b0 = st_q8_byte(v1.x, id), b1 = st_q8_byte(v1.y, id), b2 = st_q8_byte(v1.z, id), b3 = st_q8_byte(v1.w, id);
    *(uint32_t *)q0 = a0 | a1 << 8 | a2 << 16 | a3 << 24;
    *(uint32_t *)q1 = b0 | b1 << 8 | b2 << 16 | b3 << 24;
    if (l4 == 0) *ds = make_float2(d, sum);
}

// Quantized x in the split layout: row j's q (cols bytes) holds the first 16 values of every
// chunk (16 bytes per chunk), then the second 16 of every chunk, so lanes reading consecutive
// chunks read consecutive 16-byte words (no bank conflicts); ds (nchunk float2) per row.
// Values as quantize_q8_kernel: scale amax/127, round half away from zero (quant_chunk4).
// Row j of the window is x row j, or rl[j] / rdiv when a row list is given (experts' members).
// With sc (the norm's scales, one per row): x (+ y) · sc[row] · gw (gw NULL: 1), the norm's own
// operations (rms_row), quantized. Four lanes a chunk, all of a thread's loads issued together
// (H200: a block of 128 threads quantizes 4,096 values in one round trip to L2).
__device__ __forceinline__ void quant_split(const float *x, int64_t ldx, const int *rl, int rdiv, int nx, int cols,
                                            int8_t *q, float2 *ds, int tid, int nthreads, const float *y = NULL,
                                            const float *gw = NULL, const float *sc = NULL) {
    int nchunk = cols / 32, groups = nx * nchunk;
    int l4 = tid & 3;
    constexpr int U = 4;
    int stride = nthreads >> 2; // chunks a step
    for (int g0 = tid >> 2; g0 - (tid >> 2) < groups; g0 += stride * U) {
        float4 v[U][2];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int g = g0 + u * stride;
            v[u][0] = v[u][1] = make_float4(0, 0, 0, 0);
            if (g < groups) {
                int j = g / nchunk, c = g % nchunk, xrow = rl ? rl[j] / rdiv : j;
                size_t at = (size_t)xrow * ldx + (size_t)c * 32 + 4 * l4;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    float4 a = *(const float4 *)(x + at + 16 * h);
                    if (sc) {
                        float4 w4 = gw ? *(const float4 *)(gw + (size_t)c * 32 + 4 * l4 + 16 * h) : make_float4(1, 1, 1, 1);
                        if (y) {
                            float4 b = *(const float4 *)(y + at + 16 * h);
                            a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
                        }
                        float s = sc[j];
                        a = make_float4(a.x * s * w4.x, a.y * s * w4.y, a.z * s * w4.z, a.w * s * w4.w);
                    }
                    v[u][h] = a;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (g0 - (tid >> 2) + u * stride >= groups) break; // (the same for the whole block)
            int g = g0 + u * stride;
            bool ok = g < groups;
            int j = ok ? g / nchunk : 0, c = ok ? g % nchunk : 0;
            int8_t *q0 = q + (size_t)j * cols + c * 16 + 4 * l4;
            quant_chunk4(v[u][0], v[u][1], l4, ok, q0, q0 + cols / 2, ds + (size_t)j * nchunk + c);
        }
    }
}

__global__ void quant_split_kernel(const float *x, int nx, int cols, int8_t *q, float2 *ds) {
    st_pdl_begin();
    // One block per x row.
    int j = blockIdx.x;
    quant_split(x + (size_t)j * cols, cols, NULL, 1, 1, cols, q + (size_t)j * cols, ds + (size_t)j * (cols / 32),
                threadIdx.x, blockDim.x);
    (void)nx;
}

// Chunk dot with the x chunk given (split halves x0, x1 and its {scale, sum}).
template <int T>
__device__ __forceinline__ float chunk_dot_x(const st_wchunk &w, int4 x0, int4 x1, float2 ds) {
    int d0 = __dp4a(w.q[0], x0.x, __dp4a(w.q[1], x0.y, __dp4a(w.q[2], x0.z, __dp4a(w.q[3], x0.w, 0))));
    int d1 = __dp4a(w.q[4], x1.x, __dp4a(w.q[5], x1.y, __dp4a(w.q[6], x1.z, __dp4a(w.q[7], x1.w, 0))));
    float v = w.s0 * (float)d0 + w.s1 * (float)d1;
    if (st_qt<T>::HAS_MIN) {
        const int ones = 0x01010101;
        int s0 = __dp4a(ones, x0.x, __dp4a(ones, x0.y, __dp4a(ones, x0.z, __dp4a(ones, x0.w, 0))));
        int s1 = __dp4a(ones, x1.x, __dp4a(ones, x1.y, __dp4a(ones, x1.z, __dp4a(ones, x1.w, 0))));
        v += w.m0 * (float)s0 + w.m1 * (float)s1;
    }
    return ds.x * v;
}

// Asks L2 for the bytes of chunk c of a weight row (its share of the block, headers for the
// first chunk of a block): issued before a block quantizes x, so the first weight loads after
// it find their lines on the way.
template <int T> __device__ __forceinline__ void prefetch_chunk(const uint8_t *row, int c) {
    constexpr int CPB = st_qt<T>::QK / 32, BS = st_qt<T>::BS;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(row + (size_t)(c / CPB) * BS + (c % CPB) * BS / CPB));
}

// Q8_0 rows of an even chunk count, a lane two consecutive chunks at a time: 68 bytes from a
// 4-byte aligned offset, 17 word loads that no two lanes take from one bank of shared memory.
// A chunk a lane (34 bytes apart) took 10 word and 2 halfword loads a chunk, two lanes to a
// bank: ~2.6 times the shared memory's wavefronts (H100, 30B-A3B decode: the staged q/k/v
// products 1.53 -> 1.22 us, the output projection's 1.93 -> 1.14; decode +2.3%).
__device__ __forceinline__ void q8_pair(const uint8_t *row, int j, st_wchunk &a, st_wchunk &b) {
    const uint32_t *p = (const uint32_t *)(row + (size_t)j * 68);
    uint32_t u[17];
#pragma unroll
    for (int i = 0; i < 17; i++) u[i] = p[i];
    a.s0 = a.s1 = __half2float(__ushort_as_half((unsigned short)(u[0] & 0xffffu)));
    b.s0 = b.s1 = __half2float(__ushort_as_half((unsigned short)(u[8] >> 16)));
    a.m0 = a.m1 = b.m0 = b.m1 = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        a.q[i] = (int)__funnelshift_r(u[i], u[i + 1], 16);
        b.q[i] = (int)u[9 + i];
    }
}

// The products of mmv2_kernel over Q8_0 rows by chunk pairs (q8_pair): lane l takes pairs l,
// l + 32, ..., each row's sum adding chunk 2j then 2j + 1, in every NX alike (the same bits for
// a row whatever the window). One x row: x's pair is loaded once and the rows stream past it.
template <int R, int NX>
__device__ __forceinline__ void mv_q8_pairs(const uint8_t *const (&wr)[R], int nchunk, const int8_t *xq,
                                            const float2 *xds, int cols, int nx, int lane, float (&acc)[R][NX]) {
    const int half = cols / 2;
    for (int j = lane; j < nchunk / 2; j += 32) {
        const int c = 2 * j;
        if constexpr (NX == 1) {
            const int8_t *q = xq + c * 16;
            int4 a0 = *(const int4 *)q, b0 = *(const int4 *)(q + 16);
            int4 a1 = *(const int4 *)(q + half), b1 = *(const int4 *)(q + half + 16);
            float4 ds = *(const float4 *)(xds + c); // chunks c and c + 1 (c even: 16-byte aligned)
#pragma unroll
            for (int i = 0; i < R; i++) {
                st_wchunk wa, wb;
                q8_pair(wr[i], j, wa, wb);
                acc[i][0] += chunk_dot_x<ST_TYPE_Q8_0>(wa, a0, a1, make_float2(ds.x, ds.y));
                acc[i][0] += chunk_dot_x<ST_TYPE_Q8_0>(wb, b0, b1, make_float2(ds.z, ds.w));
            }
        } else {
            st_wchunk wa[R], wb[R];
#pragma unroll
            for (int i = 0; i < R; i++) q8_pair(wr[i], j, wa[i], wb[i]);
#pragma unroll
            for (int k = 0; k < NX; k++) {
                if (k < nx) {
                    const int8_t *q = xq + (size_t)k * cols + c * 16;
                    int4 a0 = *(const int4 *)q, b0 = *(const int4 *)(q + 16);
                    int4 a1 = *(const int4 *)(q + half), b1 = *(const int4 *)(q + half + 16);
                    float4 ds = *(const float4 *)(xds + (size_t)k * nchunk + c);
#pragma unroll
                    for (int i = 0; i < R; i++) {
                        acc[i][k] += chunk_dot_x<ST_TYPE_Q8_0>(wa[i], a0, a1, make_float2(ds.x, ds.y));
                        acc[i][k] += chunk_dot_x<ST_TYPE_Q8_0>(wb[i], b0, b1, make_float2(ds.z, ds.w));
                    }
                }
            }
        }
    }
}

// One matrix of an mmv2 launch: its blocks are blockIdx.x = first .. the next matrix's first.
struct st_mv2_mat {
    const uint8_t *w;
    size_t row_bytes;
    int64_t rows;
    float *y;           // (nx, rows)
    unsigned first;
};

struct st_mv2_args {
    st_mv2_mat m[ST_MATMUL_MANY]; // matrices of one type and width sharing x (matmul_many)
    int nm;
    int cols, nx;
    const float *x;     // (nx, cols) floats: quantized by each block when fused
    const int8_t *xq;   // otherwise: quantized x in the split layout (global memory)
    const float2 *xds;
    bool fused;
    // Staged: each block copies its weight rows (contiguous) into shared memory at offset xbytes
    // with asynchronous copies issued before it waits for the kernel before (weights are never
    // written by a kernel), so they arrive while that kernel finishes.
    bool stage;
    int xbytes;
    // With norm.x (fused only): x (+ norm.y) scaled by the rows' norms and norm.w, quantized.
    st_norm_in norm;
    bool regs; // one row, normed and quantized from registers (norm_quant_regs)
    // ns over which the blocks spread their staged copies (block b waits b / blocks of it): the
    // decode output projection's, whose blocks stage beside attention (attention.cu).
    unsigned spread;
    // Q8_0 of an even chunk count: a lane takes chunk pairs (mv_q8_pairs; STRATA_MV_PAIRS=0: a
    // chunk at a time).
    bool pairs;
};

template <int T, int NX, int R>
__global__ void __launch_bounds__(32 * ST_MV_WARPS) mmv2_kernel(st_mv2_args p) {
    constexpr int ROWS = ST_MV_WARPS * R; // a block's rows
    extern __shared__ __align__(16) uint8_t mv_smem[];
    int nchunk = p.cols / 32, nx = p.nx;
    st_mv2_mat m = p.m[0]; // (constant indices: the parameters stay in the constant bank)
#pragma unroll
    for (int i = 1; i < ST_MATMUL_MANY; i++)
        if (i < p.nm && blockIdx.x >= p.m[i].first) m = p.m[i];
    const uint8_t *W = m.w;
    const size_t row_bytes = m.row_bytes;
    const int64_t rows = m.rows, blk = blockIdx.x - m.first;
    // The block's weight rows (contiguous) arrive while the kernel before finishes: into shared
    // memory, or at least into L2.
    const int64_t rb = blk * ROWS, nb = min(rb + ROWS, rows) - rb;
    const uint8_t *src = W + (size_t)rb * row_bytes;
    const size_t bytes = (size_t)nb * row_bytes;
    const bool staged = p.stage && ((uintptr_t)src & 15) == 0 && bytes % 16 == 0;
    uint8_t *tile = mv_smem + p.xbytes;
    if (p.spread) __nanosleep((unsigned)((unsigned long long)p.spread * blockIdx.x / gridDim.x));
    if (staged) {
        if (cuq_l2_hint) {
            unsigned long long pol = st_l2_evict_first();
            for (size_t o = threadIdx.x * (size_t)16; o < bytes; o += blockDim.x * (size_t)16) st_cp_async16_pol(tile + o, src + o, pol);
        } else {
            for (size_t o = threadIdx.x * (size_t)16; o < bytes; o += blockDim.x * (size_t)16) st_cp_async16(tile + o, src + o, true);
        }
        st_cp_commit();
    } else if (cuq_l2_hint) {
        prefetch_l2_stream(src, bytes);
    } else {
        prefetch_l2(src, bytes);
    }
    float4 g[ST_NQ_KEEP]; // the norm's weights (never written by a kernel): loaded before the wait
    if (NX == 1 && p.regs) {
        const float4 *w4 = (const float4 *)p.norm.w;
#pragma unroll
        for (int k = 0; k < ST_NQ_KEEP; k++)
            g[k] = w4 ? w4[min((int)(threadIdx.x + k * blockDim.x), p.cols / 4 - 1)] : make_float4(1, 1, 1, 1);
    }
    // STRATA_CUDA_TRACE marks: 0 a first read of x arrived, 7 (regs) the sum of squares, 1 norm
    // scales, 2 x quantized, 3 weights landed, 4 input ready (barrier), 5 products done, 6 stored
    unsigned ts = st_pdl_begin();
    const int8_t *xq = p.xq;
    const float2 *xds = p.xds;
    st_trace_probe(ts, 0, p.fused ? p.norm.x ? p.norm.x : p.x : (const float *)p.xds);
    if (p.fused) {
        int8_t *sq = (int8_t *)mv_smem;
        float2 *sds = (float2 *)(mv_smem + (size_t)nx * p.cols);
        if (NX == 1 && p.regs) {
            norm_quant_regs(p.norm, p.cols, g, sq, sds, ts);
            st_trace_mark(ts, 1);
        } else if (p.norm.x) {
            __shared__ float sc[ST_MV_FUSED_MAX];
            norm_scales(p.norm, nx, p.cols, sc);
            st_trace_mark(ts, 1);
            quant_split(p.x, p.cols, NULL, 1, nx, p.cols, sq, sds, threadIdx.x, blockDim.x, p.norm.y, p.norm.w, sc);
        } else {
            quant_split(p.x, p.cols, NULL, 1, nx, p.cols, sq, sds, threadIdx.x, blockDim.x);
        }
        xq = sq;
        xds = sds;
    }
    st_trace_mark(ts, 2);
    if (staged) st_cp_wait<0>(); // this thread's copies have landed
    st_trace_mark(ts, 3);
    if (p.fused || staged) __syncthreads();
    st_trace_mark(ts, 4);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int64_t r0 = blk * ROWS + warp * R;
    if (r0 >= rows) return;
    const uint8_t *wr[R];
#pragma unroll
    for (int i = 0; i < R; i++) {
        int64_t r = r0 + i < rows ? r0 + i : r0;
        wr[i] = staged ? tile + (size_t)(r - rb) * row_bytes : W + (size_t)r * row_bytes;
    }
    float acc[R][NX];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int j = 0; j < NX; j++) acc[i][j] = 0.0f;
    int half = p.cols / 2;
    if constexpr (T == ST_TYPE_Q8_0)
        if (p.pairs) mv_q8_pairs<R, NX>(wr, nchunk, xq, xds, p.cols, nx, lane, acc);
    for (int c = (T == ST_TYPE_Q8_0 && p.pairs) ? nchunk : lane; c < nchunk; c += 32) {
        st_wchunk w[R];
#pragma unroll
        for (int i = 0; i < R; i++) st_qt<T>::unpack(wr[i], c, w[i]);
#pragma unroll
        for (int j = 0; j < NX; j++) {
            if (j < nx) {
                const int8_t *q = xq + (size_t)j * p.cols + c * 16;
                int4 x0 = *(const int4 *)q, x1 = *(const int4 *)(q + half);
                float2 ds = xds[(size_t)j * nchunk + c];
#pragma unroll
                for (int i = 0; i < R; i++) acc[i][j] += chunk_dot_x<T>(w[i], x0, x1, ds);
            }
        }
    }
    st_trace_mark(ts, 5);
    float *y = m.y;
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int j = 0; j < NX; j++) {
            float s = warp_sum_q(acc[i][j]);
            if (lane == 0 && j < nx && r0 + i < rows) y[(size_t)j * rows + r0 + i] = s;
        }
    st_trace_mark(ts, 6);
    st_trace_end();
}

// STRATA_MV_WIDE=0 keeps R = ST_MV_R whatever the waves (for A/B runs); read once.
static bool mv_wide_off(void) {
    static int off = -1;
    if (off < 0) off = env_is_0("STRATA_MV_WIDE");
    return off;
}

// Quantized weights of type T, all nw matrices cols wide, n <= 16: one launch; false when this
// path does not apply (x not 16-byte aligned).
// With nm, the blocks norm x themselves first (n <= ST_MV_FUSED_MAX: false otherwise).
// With xq (and xds), x arrives quantized already (quant_split's layout) and x is not read.
template <int T>
static bool mmv2_launch(st_cuda *c, int nw, const st_mat *const *w, const float *x, int n, float *const *y,
                        const st_norm_in *nm = NULL, const int8_t *xq = NULL, const float2 *xds = NULL,
                        unsigned spread = 0) {
    int64_t cols = w[0]->cols;
    if (((uintptr_t)x & 15) || cols % 32 || nw > ST_MATMUL_MANY) return false;
    if (nm && (n > ST_MV_FUSED_MAX || (size_t)n * cols + sizeof(float2) * (size_t)n * (cols / 32) > ST_MV_SMEM_MAX))
        return false;
    st_mv2_args p = {};
    p.nm = nw, p.cols = (int)cols, p.nx = n, p.x = x;
    size_t xbytes = (size_t)n * cols + sizeof(float2) * (size_t)n * (cols / 32);
    size_t smem = 0;
    if (xq) {
        p.xq = xq, p.xds = xds;
    } else if (n <= ST_MV_FUSED_MAX && xbytes <= ST_MV_SMEM_MAX) {
        if (nm) p.norm = *nm;
        p.fused = true;
        // One row: normed and quantized from registers where they hold it (STRATA_NORM_REGS=0:
        // never, for A/B runs; read at each launch, as decode records its launches once).
        p.regs = nm && n == 1 && cols % 32 == 0 && cols / 4 <= ST_NQ_KEEP * 32 * ST_MV_WARPS && !env_is_0("STRATA_NORM_REGS");
        smem = align_up16(xbytes);
    } else {
        char *buf = (char *)st_cuda_scratch(c, ST_SCR_ACT, align_up16((size_t)n * cols) + sizeof(float2) * (size_t)n * (cols / 32));
        if (!buf) return true; // error kept
        p.xq = (const int8_t *)buf;
        p.xds = (const float2 *)(buf + align_up16((size_t)n * cols));
        st_launch(c, quant_split_kernel, n, 256, 0, x, n, (int)cols, (int8_t *)p.xq, (float2 *)p.xds);
        ST_CU_LAUNCHED(c, "quant_split_kernel");
    }
    p.xbytes = (int)smem;
    p.spread = spread;
    // (pairs: every row 4-byte aligned, x's scales 16: the loads of two chunks at once)
    p.pairs = T == ST_TYPE_Q8_0 && cols % 64 == 0 && (p.fused || ((uintptr_t)p.xds & 15) == 0) && !env_is_0("STRATA_MV_PAIRS");
    for (int i = 0; i < nw; i++) p.pairs = p.pairs && ((uintptr_t)w[i]->data & 3) == 0;
    // The blocks (each matrix's first) and shared memory at R rows a warp. Staged where a
    // block's rows fit in ST_MV_TILE_MAX bytes (ST_MV_TILE_WIDE at more rows a warp; sm_80 and
    // newer).
    auto plan = [&](int R, st_mv2_args &q, size_t &bytes) {
        unsigned blocks = 0;
        for (int i = 0; i < nw; i++) {
            q.m[i] = {(const uint8_t *)w[i]->data, w[i]->row_bytes, w[i]->rows, y[i], blocks};
            blocks += (unsigned)((w[i]->rows + ST_MV_WARPS * R - 1) / (ST_MV_WARPS * R));
        }
        size_t tile = (size_t)ST_MV_WARPS * R * w[0]->row_bytes;
        q.stage = c->prop.major >= 8 && tile <= (R > ST_MV_R ? ST_MV_TILE_WIDE : ST_MV_TILE_MAX) &&
                  smem + tile <= c->prop.sharedMemPerBlockOptin;
        bytes = smem + (q.stage ? tile : 0);
        return blocks;
    };
    size_t bytes;
    unsigned blocks = plan(ST_MV_R, p, bytes);
    if (n == 1 && !mv_wide_off()) {
        // The fewest rows a warp at which every block is resident at once (else the most).
        auto fits = [&](void (*k)(st_mv2_args), unsigned nb, size_t b) { return st_one_wave(c, k, nb, 32 * ST_MV_WARPS, b); };
        st_mv2_args q4 = p, q8 = p;
        size_t b4, b8;
        unsigned n4 = plan(2 * ST_MV_R, q4, b4), n8 = plan(4 * ST_MV_R, q8, b8);
        if (!fits(mmv2_kernel<T, 1, ST_MV_R>, blocks, bytes)) {
            if (fits(mmv2_kernel<T, 1, 2 * ST_MV_R>, n4, b4)) {
                st_launch(c, mmv2_kernel<T, 1, 2 * ST_MV_R>, n4, 32 * ST_MV_WARPS, b4, q4);
            } else {
                st_allow_smem(c, mmv2_kernel<T, 1, 4 * ST_MV_R>, b8);
                st_launch(c, mmv2_kernel<T, 1, 4 * ST_MV_R>, n8, 32 * ST_MV_WARPS, b8, q8);
            }
            ST_CU_LAUNCHED(c, "mmv2_kernel");
            return true;
        }
    }
#define L(NX)                                                                                      \
    do {                                                                                           \
        st_allow_smem(c, mmv2_kernel<T, NX, ST_MV_R>, bytes);                                      \
        st_launch(c, mmv2_kernel<T, NX, ST_MV_R>, blocks, 32 * ST_MV_WARPS, bytes, p);             \
    } while (0)
    if (n == 1) L(1);
    else if (n == 2) L(2);
    else if (n <= 4) L(4);
    else if (n <= 8) L(8);
    else L(16);
#undef L
    ST_CU_LAUNCHED(c, "mmv2_kernel");
    return true;
}

// ---------------------------------------------------------------------------------------------
// Dequantization: chunk by chunk (one thread per 32 elements) to f32 or bf16.

template <typename O> __device__ __forceinline__ void store8(O *y, const float v[8]);
template <> __device__ __forceinline__ void store8<float>(float *y, const float v[8]) {
    float4 *p = (float4 *)y;
    p[0] = make_float4(v[0], v[1], v[2], v[3]);
    p[1] = make_float4(v[4], v[5], v[6], v[7]);
}
template <> __device__ __forceinline__ void store8<__nv_bfloat16>(__nv_bfloat16 *y, const float v[8]) {
    uint32_t u[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
        u[i] = *(uint32_t *)&h;
    }
    *(uint4 *)y = make_uint4(u[0], u[1], u[2], u[3]);
}

// Dequantizes chunk c of a row into y (32 values, 16-byte aligned), exactly as dequant.c.
template <int T, typename O> __device__ __forceinline__ void dequant_chunk(const uint8_t *row, int c, O *y) {
    st_wchunk w;
    st_qt<T>::unpack(row, c, w);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float v[4];
        float s = i < 4 ? w.s0 : w.s1, m = i < 4 ? w.m0 : w.m1;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float p = __fmul_rn(s, (float)(int8_t)(w.q[i] >> (8 * k)));
            v[k] = st_qt<T>::HAS_MIN ? __fadd_rn(p, m) : p;
        }
        if (sizeof(O) == 4) {
            *(float4 *)((float *)y + 4 * i) = make_float4(v[0], v[1], v[2], v[3]);
        } else {
            __nv_bfloat162 h0 = __floats2bfloat162_rn(v[0], v[1]), h1 = __floats2bfloat162_rn(v[2], v[3]);
            uint2 u = make_uint2(*(uint32_t *)&h0, *(uint32_t *)&h1);
            *(uint2 *)((__nv_bfloat16 *)y + 4 * i) = u;
        }
    }
}

// Rows of (possibly several stacked) matrices: flat row i = (matrix mi, row r) with mi picked
// from mats (a device list) or i / rows directly. y (nrows, cols) dense.
struct st_deq_src {
    const uint8_t *data;
    size_t row_bytes, mat_bytes;
    int64_t rows;        // rows per matrix
    int64_t row0;        // first row (matmul pieces)
    const int32_t *mats; // NULL: matrix 0 (or i / rows)
    const int32_t *ids;  // rows picked by id (get_rows), NULL otherwise
    int64_t id_rows;     // bound on ids
};

__device__ __forceinline__ const uint8_t *deq_row(const st_deq_src &s, int64_t i) {
    if (s.ids) {
        int32_t id = s.ids[i];
        if (id < 0 || id >= s.id_rows) return NULL;
        return s.data + (size_t)id * s.row_bytes;
    }
    int64_t mi = i / s.rows, r = i % s.rows + s.row0;
    int64_t m = s.mats ? s.mats[mi] : mi;
    return s.data + (size_t)m * s.mat_bytes + (size_t)r * s.row_bytes;
}

template <int T, typename O>
__global__ void dequant_kernel(st_deq_src s, int64_t nrows, int cols, O *y) {
    st_pdl_begin();
    int nchunk = cols / 32;
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= nrows * nchunk) return;
    int64_t i = t / nchunk;
    int c = (int)(t % nchunk);
    const uint8_t *row = deq_row(s, i);
    O *out = y + (size_t)i * cols + (size_t)c * 32;
    if (!row) { // an id out of range: zeros (the CPU stops on it; a kernel cannot)
        float z[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int k = 0; k < 4; k++) store8<O>(out + 8 * k, z);
        return;
    }
    dequant_chunk<T, O>(row, c, out);
}

// Float types element by element (exact conversions).
template <int T, typename O>
__global__ void dequant_float_kernel(st_deq_src s, int64_t nrows, int64_t cols, O *y) {
    st_pdl_begin();
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= nrows * cols) return;
    int64_t i = t / cols, e = t % cols;
    const uint8_t *row = deq_row(s, i);
    float v = row ? ld_wf<T>(row, e) : 0.0f;
    if (sizeof(O) == 4) ((float *)y)[t] = v;
    else ((__nv_bfloat16 *)y)[t] = __float2bfloat16_rn(v);
}

template <typename O>
static void dequant_launch(st_cuda *c, st_type type, const st_deq_src &s, int64_t nrows, int64_t cols, O *y) {
    if (nrows == 0 || cols == 0) return;
    switch (type) {
#define CASE(T)                                                                                        \
    case T: {                                                                                          \
        int64_t nt = nrows * (cols / 32);                                                              \
        st_launch(c, dequant_kernel<T, O>, (unsigned)((nt + 255) / 256), 256, 0, s, nrows, (int)cols, y); \
        break;                                                                                         \
    }
        ST_CUQ_QUANT_TYPES(CASE)
#undef CASE
#define CASEF(T)                                                                                       \
    case T:                                                                                            \
        st_launch(c, dequant_float_kernel<T, O>, (unsigned)((nrows * cols + 255) / 256), 256, 0, s, nrows, cols, y); \
        break;
        CASEF(ST_TYPE_F32) CASEF(ST_TYPE_F16) CASEF(ST_TYPE_BF16)
#undef CASEF
    default: CUQ_FAIL(c, "dequantize: weight type %s not supported on the GPU", st_type_name(type)); return;
    }
    ST_CU_LAUNCHED(c, "dequant_kernel");
}

// ---------------------------------------------------------------------------------------------
// Shared checks

static bool check_mat(st_cuda *c, const char *op, st_type type, int64_t cols, int64_t rows, const void *data,
                      size_t row_bytes) {
    const st_type_info *info = st_type_get(type);
    if (!info || !st_cuda_type_supported(type)) {
        CUQ_FAIL(c, "%s: weight type %s not supported on the GPU", op, st_type_name(type));
        return false;
    }
    if (cols <= 0 || rows <= 0 || cols % info->block != 0 || cols > INT32_MAX ||
        row_bytes < st_row_bytes(type, cols)) {
        CUQ_FAIL(c, "%s: bad %s matrix %lld x %lld (row bytes %zu)", op, info->name, (long long)rows,
                 (long long)cols, row_bytes);
        return false;
    }
    // Quantized blocks are read with wide loads whose alignment follows from a 16-byte base.
    if (info->quantized && (((uintptr_t)data & 15) || row_bytes % info->block_bytes)) {
        CUQ_FAIL(c, "%s: %s weights at %p (row bytes %zu) not 16-byte aligned", op, info->name, data, row_bytes);
        return false;
    }
    return true;
}

// Casts f32 to bf16 or f16 (the cuBLAS input type).
template <typename O> __global__ void convert_kernel(const float *x, int64_t n, O *y) {
    st_pdl_begin();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    if constexpr (sizeof(O) == 2 && std::is_same<O, __half>::value) y[i] = __float2half_rn(x[i]);
    else y[i] = __float2bfloat16_rn(x[i]);
}

template <typename O> static void convert(st_cuda *c, const float *x, int64_t n, O *y) {
    if (n == 0) return;
    st_launch(c, convert_kernel<O>, (unsigned)((n + 255) / 256), 256, 0, x, n, y);
    ST_CU_LAUNCHED(c, "convert_kernel");
}

static const char *cublas_name(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_NOT_INITIALIZED: return "not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "alloc failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "invalid value";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "arch mismatch";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "execution failed";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "not supported";
    default: return "error";
    }
}

// Y (n, m) rows ldc apart = X (n, k) · Wᵀ, W (m, k) row-major: in cuBLAS's column-major terms
// Yᵀ = op_T(W as (k, m)) · Xᵀ.
static void gemm(st_cuda *c, const void *w, cudaDataType wt, const void *x, cudaDataType xt, float *y, int64_t m,
                 int64_t n, int64_t k, int64_t ldc) {
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t s = cublasGemmEx(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, (int)m, (int)n, (int)k, &one, w, wt, (int)k, x,
                                    xt, (int)k, &zero, y, CUDA_R_32F, (int)ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
        CUQ_FAIL(c, "cublasGemmEx %lld x %lld x %lld: %s", (long long)m, (long long)n, (long long)k, cublas_name(s));
}

// Y (n, m) = X (n, k) · Wᵀ for f32 weights W (m, k), rows ldw floats apart, in exact fp32: tiles
// of 64 weight rows x 64 x rows, 32 columns deep, through shared memory; each of 256 threads
// keeps a 4 x 4 block of sums. For the routers of 64-128 experts: cuBLAS's SGEMM took ~0.8 ms for
// the 30B-A3B's 128 x 2048 router at n = 2048 on the H200 (1.3 TFLOPS, a fifth of the prompt);
// with this kernel the prompt ran 21% faster. For the Next's 512 x 2048 router cuBLAS was the
// faster (that prompt 7% slower with this kernel), so wider f32 matrices stay with cuBLAS.
#define ST_SG_T 64
#define ST_SG_K 32

// Split K (blockIdx.z: columns [z·kspan, (z+1)·kspan) into y + z·n·m, summed after by
// sgemm_sum_kernel in split order): the router's 128 rows make only 2 row tiles, so at 512 x rows
// the grid was 16 blocks, each walking all 64 steps of 32 columns one after another: 182 us
// a layer, an eighth of the 30B-A3B's prompt 512.
__global__ void __launch_bounds__(256)
    sgemm_kernel(const float *__restrict__ w, int64_t ldw, const float *__restrict__ x, int64_t m, int64_t n, int64_t k,
                 int64_t kspan, float *__restrict__ y) {
    st_pdl_begin();
    __shared__ float ws[ST_SG_K][ST_SG_T + 4], xs[ST_SG_K][ST_SG_T + 4]; // [depth][row]: rows contiguous
    int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
    int64_t r0 = (int64_t)blockIdx.y * ST_SG_T, c0 = (int64_t)blockIdx.x * ST_SG_T;
    int64_t kb = (int64_t)blockIdx.z * kspan, ke = kb + kspan < k ? kb + kspan : k;
    y += (size_t)blockIdx.z * n * m;
    float acc[4][4] = {};
    for (int64_t k0 = kb; k0 < ke; k0 += ST_SG_K) {
        // 64 x 32 of each operand: 8 elements a thread, 32 consecutive columns a row (coalesced).
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int e = tid + 256 * i, row = e / ST_SG_K, kk = e % ST_SG_K;
            int64_t kc = k0 + kk, wr = r0 + row, xr = c0 + row;
            ws[kk][row] = wr < m && kc < ke ? w[wr * ldw + kc] : 0.0f;
            xs[kk][row] = xr < n && kc < ke ? x[xr * k + kc] : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < ST_SG_K; kk++) {
            float4 a = *(const float4 *)&ws[kk][tr * 4], b = *(const float4 *)&xs[kk][tc * 4];
            float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        int64_t xr = c0 + tc * 4 + j;
        if (xr >= n) break;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int64_t wr = r0 + tr * 4 + i;
            if (wr < m) y[xr * m + wr] = acc[i][j];
        }
    }
}

// y = Σ_z part[z] over the splits, in split order (the same sums every run).
__global__ void sgemm_sum_kernel(const float *__restrict__ part, int splits, int64_t len, float *__restrict__ y) {
    st_pdl_begin();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    float s = part[i];
    for (int z = 1; z < splits; z++) s += part[(size_t)z * len + i];
    y[i] = s;
}

// Splits of K until the grid has about two blocks a multiprocessor, each at least 4 steps of
// ST_SG_K columns (at most 16 splits). STRATA_SGEMM_SPLIT=0: one (A/B runs; read at each call).
static void sgemm(st_cuda *c, const st_mat *w, const float *x, int n, float *y) {
    dim3 grid((unsigned)((n + ST_SG_T - 1) / ST_SG_T), (unsigned)((w->rows + ST_SG_T - 1) / ST_SG_T));
    int64_t k = w->cols, steps = (k + ST_SG_K - 1) / ST_SG_K, blocks = (int64_t)grid.x * grid.y;
    int64_t splits = (2 * c->prop.multiProcessorCount + blocks - 1) / blocks;
    splits = splits < steps / 4 ? splits : steps / 4;
    splits = splits < 16 ? splits : 16;
    if (splits < 2 || env_is_0("STRATA_SGEMM_SPLIT")) splits = 1;
    int64_t kspan = (steps + splits - 1) / splits * ST_SG_K;
    splits = (k + kspan - 1) / kspan;
    int64_t len = (int64_t)n * w->rows;
    float *part = y;
    if (splits > 1) {
        part = (float *)st_cuda_scratch(c, ST_SCR_DEQ, sizeof(float) * (size_t)splits * len);
        if (!part) return;
    }
    grid.z = (unsigned)splits;
    st_launch(c, sgemm_kernel, grid, 256, 0, (const float *)w->data, (int64_t)(w->row_bytes / 4), x, w->rows,
              (int64_t)n, k, kspan, part);
    ST_CU_LAUNCHED(c, "sgemm_kernel");
    if (splits > 1) {
        st_launch(c, sgemm_sum_kernel, (unsigned)((len + 255) / 256), 256, 0, (const float *)part, (int)splits, len, y);
        ST_CU_LAUNCHED(c, "sgemm_sum_kernel");
    }
}

// ---------------------------------------------------------------------------------------------
// matmul

// The tensor-core GEMM over quantized tiles: grid (tiles, row tiles).
static void gmm_launch(st_cuda *c, st_type t, const st_gmm_args &g, int nblocks) {
    if (nblocks <= 0) return;
    int bm = g.w2 ? ST_GM_BM / 2 : ST_GM_BM; // weight rows per block (gate+up: 64 of each)
    dim3 grid((unsigned)nblocks, (unsigned)((g.rows + bm - 1) / bm));
    bool staged = !env_is_0("STRATA_GMM_STAGED"); // (read at each call: prompt chunks only)
    const char *occ = getenv("STRATA_GMM_OCC"); // 2: the staged kernel at two blocks a multiprocessor
    bool occ3 = !(occ && occ[0] == '2');
    switch (t) {
#define CASE(T)                                                                             \
    case T:                                                                                 \
        if (staged && occ3) {                                                               \
            st_allow_smem(c, gmm_staged_kernel<T, 3>, gmm_stage<T>::SMEM);                  \
            st_launch(c, gmm_staged_kernel<T, 3>, grid, ST_GM_THREADS, gmm_stage<T>::SMEM, g); \
        } else if (staged) {                                                                \
            st_allow_smem(c, gmm_staged_kernel<T, 2>, gmm_stage<T>::SMEM);                  \
            st_launch(c, gmm_staged_kernel<T, 2>, grid, ST_GM_THREADS, gmm_stage<T>::SMEM, g); \
        } else {                                                                            \
            st_launch(c, gmm_kernel<T>, grid, ST_GM_THREADS, 0, g);                         \
        }                                                                                   \
        break;
        ST_CUQ_QUANT_TYPES(CASE)
#undef CASE
    default: CUQ_FAIL(c, "gmm: weight type %s is not quantized", st_type_name(t)); return;
    }
    ST_CU_LAUNCHED(c, "gmm_kernel");
}

// A/B switches for the prompt paths, read at each call (prompt calls synchronize anyway):
// STRATA_GMM_STAGED=0 runs the tile GEMM that reads the weights from memory each step
// (gmm_kernel) instead of the one that stages their raw blocks in shared memory a span ahead
// (gmm_staged_kernel: the experts' GEMM 8-9% faster, prompts +6% on the 30B-A3B);
// STRATA_CUQ_OLD=1 dequantizes to bf16 and loops cuBLAS per expert (the previous path);
// STRATA_CUQ_DENSE_MMA=1 sends dense quantized matmuls through the tile GEMM too.
static void matmul_gemm(st_cuda *c, const st_mat *w, const float *x, int n, float *y) {
    int64_t cols = w->cols, rows = w->rows;
    if (w->type == ST_TYPE_F32) {
        // Own kernel where cuBLAS's SGEMM measured slow (see sgemm_kernel): 64-128 rows.
        if (rows >= ST_SG_T && rows <= 2 * ST_SG_T) {
            sgemm(c, w, x, n, y);
            return;
        }
        if (w->row_bytes != (size_t)cols * 4) goto strided;
        gemm(c, w->data, CUDA_R_32F, x, CUDA_R_32F, y, rows, n, cols, rows);
        return;
    }
    if (w->type == ST_TYPE_F16) {
        if (w->row_bytes != (size_t)cols * 2) goto strided;
        __half *xh = (__half *)st_cuda_scratch(c, ST_SCR_ACT, sizeof(__half) * (size_t)n * cols);
        if (!xh) return;
        convert(c, x, (int64_t)n * cols, xh);
        gemm(c, w->data, CUDA_R_16F, xh, CUDA_R_16F, y, rows, n, cols, rows);
        return;
    }
    if (w->type == ST_TYPE_BF16 && w->row_bytes == (size_t)cols * 2) {
        __nv_bfloat16 *xb = (__nv_bfloat16 *)st_cuda_scratch(c, ST_SCR_ACT, sizeof(__nv_bfloat16) * (size_t)n * cols);
        if (!xb) return;
        convert(c, x, (int64_t)n * cols, xb);
        gemm(c, w->data, CUDA_R_16BF, xb, CUDA_R_16BF, y, rows, n, cols, rows);
        return;
    }
strided:
    if (st_cuda_float_type(w->type)) {
        // Padded float rows: f32 pieces and exact SGEMMs.
        int64_t piece = (int64_t)(ST_CUQ_DEQ_BYTES / (sizeof(float) * (size_t)cols));
        piece = piece < 128 ? 128 : piece / 128 * 128;
        if (piece > rows) piece = rows;
        float *wf = (float *)st_cuda_scratch(c, ST_SCR_DEQ, sizeof(float) * (size_t)piece * cols);
        if (!wf) return;
        for (int64_t r0 = 0; r0 < rows; r0 += piece) {
            int64_t m = rows - r0 < piece ? rows - r0 : piece;
            st_deq_src s = {(const uint8_t *)w->data, w->row_bytes, 0, m, r0, NULL, NULL, 0};
            dequant_launch(c, w->type, s, m, cols, wf);
            gemm(c, wf, CUDA_R_32F, x, CUDA_R_32F, y + r0, m, n, cols, rows);
        }
        return;
    }
    {
    // Quantized weights: the tile GEMM (STRATA_CUQ_DENSE_MMA=1), or bf16 pieces of rows and one
    // cuBLAS GEMM per piece.
    __nv_bfloat16 *xb = (__nv_bfloat16 *)st_cuda_scratch(c, ST_SCR_ACT, sizeof(__nv_bfloat16) * (size_t)n * cols);
    if (!xb) return;
    convert(c, x, (int64_t)n * cols, xb);
    if (c->prop.major >= 8 && env_on("STRATA_CUQ_DENSE_MMA")) {
        st_gmm_args g = {(const uint8_t *)w->data, w->row_bytes, 0, rows, (int)cols, xb, y, rows, NULL, n, NULL, 0, 0, NULL};
        gmm_launch(c, w->type, g, (n + ST_GM_BN - 1) / ST_GM_BN);
        return;
    }
    int64_t piece = (int64_t)(ST_CUQ_DEQ_BYTES / (sizeof(__nv_bfloat16) * (size_t)cols));
    piece = piece < 128 ? 128 : piece / 128 * 128;
    if (piece > rows) piece = rows;
    __nv_bfloat16 *wb = (__nv_bfloat16 *)st_cuda_scratch(c, ST_SCR_DEQ, sizeof(__nv_bfloat16) * (size_t)piece * cols);
    if (!wb) return;
    for (int64_t r0 = 0; r0 < rows; r0 += piece) {
        int64_t m = rows - r0 < piece ? rows - r0 : piece;
        st_deq_src s = {(const uint8_t *)w->data, w->row_bytes, 0, m, r0, NULL, NULL, 0};
        dequant_launch(c, w->type, s, m, cols, wb);
        gemm(c, wb, CUDA_R_16BF, xb, CUDA_R_16BF, y + r0, m, n, cols, rows);
    }
}
}

void st_cuda_matmul(st_backend *b, const st_mat *w, const float *x, int n, float *y) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0 || c->err) return;
    if (!check_mat(c, "matmul", w->type, w->cols, w->rows, w->data, w->row_bytes) || !quant_tables(c)) return;
    if (n >= ST_CUQ_GEMM_FROM) {
        if (c->capturing) {
            CUQ_FAIL(c, "matmul of %d rows while recording a graph (at most %d)", n, ST_CUDA_GRAPH_ROWS);
            return;
        }
        matmul_gemm(c, w, x, n, y);
        return;
    }
    if (!st_cuda_float_type(w->type) && !env_on("STRATA_CUQ_OLD")) {
        bool done = false;
        switch (w->type) {
#define CASE(T) case T: done = mmv2_launch<T>(c, 1, &w, x, n, &y); break;
            ST_CUQ_QUANT_TYPES(CASE)
#undef CASE
        default: break;
        }
        if (done) return;
    }
    st_mv_in in = {{NULL, NULL, 0}, x, w->cols};
    if (!st_cuda_float_type(w->type)) {
        in.a = quantize_act(c, ST_SCR_ACT, x, n, (int)w->cols);
        if (!in.a.q) return;
    }
    switch (w->type) {
#define CASE(T) case T: mmv_launch<T>(c, w, in, n, y); break;
        ST_CUQ_QUANT_TYPES(CASE)
        CASE(ST_TYPE_F32) CASE(ST_TYPE_F16) CASE(ST_TYPE_BF16)
#undef CASE
    default: break; // check_mat refused it
    }
}

bool st_cuda_q8_takes(const st_mat *w, int n) {
    return n <= ST_CUDA_GRAPH_ROWS && !st_cuda_float_type(w->type) && w->cols % 32 == 0 && !env_on("STRATA_CUQ_OLD");
}

bool st_cuda_matmul_q8(st_backend *b, const st_mat *w, const int8_t *xq, const float2 *xds, int n, float *y,
                       unsigned spread_ns) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0 || c->err) return true;
    if (!st_cuda_q8_takes(w, n)) return false;
    if (!check_mat(c, "matmul", w->type, w->cols, w->rows, w->data, w->row_bytes) || !quant_tables(c)) return true;
    bool done = false;
    switch (w->type) {
#define CASE(T) case T: done = mmv2_launch<T>(c, 1, &w, NULL, n, &y, NULL, xq, xds, spread_ns); break;
        ST_CUQ_QUANT_TYPES(CASE)
#undef CASE
    default: break;
    }
    return done;
}

int8_t *st_cuda_proj_buf(st_cuda *c, int n, size_t cols, float2 **ds) {
    size_t qb = ((size_t)n * cols + 255) / 256 * 256;
    char *buf = (char *)st_cuda_scratch(c, ST_SCR_ATTQ, qb + sizeof(float2) * (size_t)n * (cols / 32));
    *ds = buf ? (float2 *)(buf + qb) : NULL;
    return (int8_t *)buf;
}

// ns over which the decode output projection's blocks spread their weights' staged copies. They
// launch early and stage beside the mixer; all at once, that 8.9 MB burst (30B-A3B) slowed
// attention's blocks by ~3 us (they end 3.2 us sooner when the projection launches after them,
// though that loses more than it saves). Spread over 4 us: attention's blocks end 1.3 us sooner,
// 30B-A3B decode +1.9% on an H100, Next +0.4% (bench/results/2026-12-05-prepared-measured.md).
// STRATA_O_SPREAD_NS=N for A/B runs (0: all at once); read once.
static unsigned o_spread(void) {
    static int ns = -1;
    if (ns < 0) {
        const char *e = getenv("STRATA_O_SPREAD_NS");
        ns = e ? atoi(e) : 4000;
        ns = ns < 0 ? 0 : ns > 100000 ? 100000 : ns;
    }
    return (unsigned)ns;
}

void st_cuda_project(st_backend *b, const st_mat *w, const int8_t *q, const float2 *ds, const float *x, int n,
                     float *y) {
    if (q && st_cuda_matmul_q8(b, w, q, ds, n, y, n == 1 ? o_spread() : 0)) return;
    st_cuda_matmul(b, w, x, n, y);
}

void st_cuda_matmul_many(st_backend *b, int nw, const st_mat *const *w, const float *x, int n, float *const *y) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0 || nw <= 0 || nw > ST_MATMUL_MANY || c->err) return;
    // Windows: the matrices that share a quantized type and width as one launch of the n <= 16
    // matrix-vector kernel; the rest (and prompt chunks) one product after another.
    bool done[ST_MATMUL_MANY] = {false};
    bool windows = n < ST_CUQ_GEMM_FROM && !env_on("STRATA_CUQ_OLD");
    for (int i = 0; i < nw; i++) {
        if (done[i] || !windows || st_cuda_float_type(w[i]->type)) continue;
        const st_mat *gw[ST_MATMUL_MANY];
        float *gy[ST_MATMUL_MANY];
        int g = 0;
        for (int j = i; j < nw; j++)
            if (!done[j] && w[j]->type == w[i]->type && w[j]->cols == w[i]->cols) gw[g] = w[j], gy[g++] = y[j];
        if (g < 2) continue;
        for (int k = 0; k < g; k++)
            if (!check_mat(c, "matmul", gw[k]->type, gw[k]->cols, gw[k]->rows, gw[k]->data, gw[k]->row_bytes)) return;
        if (!quant_tables(c)) return;
        bool ok = false;
        switch (w[i]->type) {
#define CASE(T) case T: ok = mmv2_launch<T>(c, g, gw, x, n, gy); break;
            ST_CUQ_QUANT_TYPES(CASE)
#undef CASE
        default: break;
        }
        if (!ok) continue;
        for (int j = i; j < nw; j++)
            if (w[j]->type == w[i]->type && w[j]->cols == w[i]->cols) done[j] = true;
    }
    for (int i = 0; i < nw; i++)
        if (!done[i]) st_cuda_matmul(b, w[i], x, n, y[i]);
}

// Windows of up to ST_MV_FUSED_MAX rows: the first product's blocks (w[0] and the matrices of
// its type and width: q, k and v; or a float router) norm their input themselves, which saves
// the norm's launch and its wait in the decode step's chain; the other products read xn. Rows
// wider than a 128-thread norm takes (st_rms_threads), other shapes and prompt chunks run the
// norm kernel, then the products. STRATA_NORM_UNFUSED=1 always does (A/B runs).
void st_cuda_norm_matmul(st_backend *b, const float *x, const float *y, float *xo, const float *norm_w, float eps,
                         float *xn, int n, int d, int nw, const st_mat *const *w, float *const *out) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0 || d <= 0 || nw < 0 || nw > ST_MATMUL_MANY || c->err) return;
    static_assert(32 * ST_MV_WARPS == 128 && 32 * ST_CUQ_WARPS == 128, "the fused norm's block is the norm kernel's");
    auto a16 = [](const void *p) { return ((uintptr_t)p & 15) == 0; };
    bool fuse = nw > 0 && n <= ST_MV_FUSED_MAX && d % 4 == 0 && st_rms_threads(d) == 128 && w[0]->cols == d &&
                a16(x) && (!y || (a16(y) && a16(xo))) && a16(xn) && (!norm_w || a16(norm_w)) &&
                !env_on("STRATA_NORM_UNFUSED");
    if (fuse && !check_mat(c, "matmul", w[0]->type, w[0]->cols, w[0]->rows, w[0]->data, w[0]->row_bytes)) return;
    if (fuse && !quant_tables(c)) return;
    st_norm_in nm = {x, y, xo, xn, norm_w, eps};
    bool done[ST_MATMUL_MANY] = {false}, fused = false;
    if (fuse && !st_cuda_float_type(w[0]->type)) {
        const st_mat *gw[ST_MATMUL_MANY];
        float *gy[ST_MATMUL_MANY];
        int g = 0;
        for (int j = 0; j < nw; j++)
            if (w[j]->type == w[0]->type && w[j]->cols == d) gw[g] = w[j], gy[g++] = out[j];
        for (int k = 1; k < g; k++)
            if (!check_mat(c, "matmul", gw[k]->type, gw[k]->cols, gw[k]->rows, gw[k]->data, gw[k]->row_bytes)) return;
        switch (w[0]->type) {
#define CASE(T) case T: fused = mmv2_launch<T>(c, g, gw, x, n, gy, &nm); break;
            ST_CUQ_QUANT_TYPES(CASE)
#undef CASE
        default: break;
        }
        if (fused)
            for (int j = 0; j < nw; j++) done[j] = w[j]->type == w[0]->type && w[j]->cols == d;
    } else if (fuse) {
        st_mv_in in = {{NULL, NULL, 0}, x, d};
        switch (w[0]->type) {
#define CASE(T) case T: mmv_launch<T>(c, w[0], in, n, out[0], &nm); fused = true; break;
            CASE(ST_TYPE_F32) CASE(ST_TYPE_F16) CASE(ST_TYPE_BF16)
#undef CASE
        default: break;
        }
        done[0] = fused;
    }
    if (fused) ST_CU_LAUNCHED(c, "norm_matmul");
    else st_cuda_add_rmsnorm(c, x, y, xo, norm_w, xn, n, d, eps);
    const st_mat *rw[ST_MATMUL_MANY];
    float *ry[ST_MATMUL_MANY];
    int r = 0;
    for (int j = 0; j < nw; j++)
        if (!done[j]) rw[r] = w[j], ry[r++] = out[j];
    if (r) st_cuda_matmul_many(b, r, rw, xn, n, ry);
}

// ---------------------------------------------------------------------------------------------
// get_rows

// Grid (n ids, pieces of the row): blockIdx.x picks the id, so the work is O(n · cols) whatever
// the table's size; each thread dequantizes one chunk of 32 (quantized) or one element (floats).
#define ST_CUQ_GR_THREADS 128

template <int T>
__global__ void __launch_bounds__(ST_CUQ_GR_THREADS)
    get_rows_kernel(const uint8_t *w, size_t row_bytes, int64_t nrows, const int32_t *ids, int cols, float *y) {
    st_pdl_begin();
    int i = blockIdx.x;
    int c = blockIdx.y * ST_CUQ_GR_THREADS + threadIdx.x;
    int32_t id = ids[i];
    if constexpr (T == ST_TYPE_F32 || T == ST_TYPE_F16 || T == ST_TYPE_BF16) {
        if (c >= cols) return;
        y[(size_t)i * cols + c] = id >= 0 && id < nrows ? ld_wf<T>(w + (size_t)id * row_bytes, c) : 0.0f;
    } else {
        if (c >= cols / 32) return;
        float *out = y + (size_t)i * cols + (size_t)c * 32;
        if (id < 0 || id >= nrows) { // an id out of range: zeros (the CPU stops on it; a kernel cannot)
            float z[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int k = 0; k < 4; k++) store8<float>(out + 8 * k, z);
            return;
        }
        dequant_chunk<T, float>(w + (size_t)id * row_bytes, c, out);
    }
}

void st_cuda_get_rows(st_backend *b, const st_mat *w, const int32_t *ids, int n, float *y) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0 || c->err) return;
    if (!check_mat(c, "get_rows", w->type, w->cols, w->rows, w->data, w->row_bytes) || !quant_tables(c)) return;
    bool quant = st_type_get(w->type)->quantized;
    if (quant && ((uintptr_t)y & 15)) { // chunks are stored 16 bytes at a time
        CUQ_FAIL(c, "get_rows: output %p not 16-byte aligned", (void *)y);
        return;
    }
    int per_row = quant ? (int)(w->cols / 32) : (int)w->cols;
    dim3 grid((unsigned)n, (unsigned)((per_row + ST_CUQ_GR_THREADS - 1) / ST_CUQ_GR_THREADS));
    const uint8_t *wd = (const uint8_t *)w->data;
    switch (w->type) {
#define CASE(T)                                                                                        \
    case T:                                                                                            \
        st_launch(c, get_rows_kernel<T>, grid, ST_CUQ_GR_THREADS, 0, wd, w->row_bytes, w->rows, ids, (int)w->cols, y); \
        break;
        ST_CUQ_QUANT_TYPES(CASE)
        CASE(ST_TYPE_F32) CASE(ST_TYPE_F16) CASE(ST_TYPE_BF16)
#undef CASE
    default: return; // check_mat refused it
    }
    ST_CU_LAUNCHED(c, "get_rows_kernel");
}

// ---------------------------------------------------------------------------------------------
// Routed experts, n <= 16 (graph-safe). A plan kernel groups the n*k (row, slot) assignments by
// expert on the device; the gate/up and down kernels run a grid over (weight rows, unique-expert
// slot u < n*k), where slots past the number of distinct experts exit at once, so the launch
// does not depend on the ids and each distinct expert's weights are read by one set of blocks.

// plan (ints): [0] distinct experts U, [1 ..] uniq[na] expert of slot u, off[na + 1] its first
// member in members[na] (assignment indices i*k + j grouped by expert, ascending).
#define ST_CUQ_PLAN_MAX 1024 // assignments one plan block handles (n <= 16 rows times k <= 64)

__global__ void moe_plan_kernel(const int32_t *ids, int na, int n_expert, int *plan) {
    st_pdl_begin();
    __shared__ int s_e[ST_CUQ_PLAN_MAX], s_lead[ST_CUQ_PLAN_MAX];
    int a = threadIdx.x;
    int *uniq = plan + 1, *off = uniq + na, *members = off + na + 1;
    int e = -1;
    if (a < na) {
        e = ids[a];
        if (e < 0 || e >= n_expert) e = -1; // out of range: dropped (contributes nothing)
        s_e[a] = e;
    }
    __syncthreads();
    // The leader of an assignment is the first assignment with the same expert.
    int lead = -1;
    if (a < na && e >= 0) {
        lead = a;
        for (int i = 0; i < a; i++)
            if (s_e[i] == e) {
                lead = i;
                break;
            }
    }
    if (a < na) s_lead[a] = lead;
    __syncthreads();
    if (a >= na) return;
    if (e >= 0) {
        // Grouped position: members of earlier groups (ordered by leader), then earlier members
        // of this group; the slot of the group is the number of earlier leaders.
        int pos = 0, u = 0;
        for (int i = 0; i < na; i++) {
            int li = s_lead[i];
            if (li < 0) continue;
            if (li < lead || (li == lead && i < a)) pos++;
            if (li == i && i < lead) u++;
        }
        members[pos] = a;
        if (lead == a) {
            uniq[u] = e;
            off[u] = pos;
        }
    }
    if (a == 0) {
        int u = 0, valid = 0;
        for (int i = 0; i < na; i++) {
            if (s_lead[i] < 0) continue;
            valid++;
            if (s_lead[i] == i) u++;
        }
        plan[0] = u;
        off[u] = valid;
    }
}

struct st_moe_small {
    const int *plan;
    int na, k;
    // gate/up pass
    const uint8_t *wg, *wu; // expert 0 of each stack
    size_t g_row_bytes, g_mat, u_row_bytes, u_mat;
    int64_t rows; // output rows of this pass (F for gate/up, d for down)
    int cols;
    st_mv_in in;  // gate/up: x rows; down: h rows (assignment-indexed)
    float *out;   // (na, rows) by assignment
};

// Slot u's members (assignments) and their activation rows, in shared memory for the block:
// every warp of a block works for the same slot. Returns the member count (0: idle slot).
__device__ __forceinline__ int moe_members(const st_moe_small &p, bool by_row, int *s_asg, int *s_xr, int *e_out) {
    int u = blockIdx.y;
    if (u >= p.plan[0]) return 0; // uniform over the block
    const int *uniq = p.plan + 1, *off = uniq + p.na, *members = off + p.na + 1;
    int m0 = off[u], m = off[u + 1] - m0;
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
        int a = members[m0 + i];
        s_asg[i] = a;
        s_xr[i] = by_row ? a / p.k : a;
    }
    *e_out = uniq[u];
    __syncthreads();
    return m;
}

template <int T, int NX>
__global__ void __launch_bounds__(32 * ST_CUQ_WARPS) moe_gate_up_kernel(st_moe_small p) {
    st_pdl_begin();
    __shared__ int s_asg[ST_CUQ_PLAN_MAX], s_xr[ST_CUQ_PLAN_MAX];
    int e, m = moe_members(p, true, s_asg, s_xr, &e);
    int64_t r = (int64_t)blockIdx.x * ST_CUQ_WARPS + (threadIdx.x >> 5);
    if (m == 0 || r >= p.rows) return;
    const uint8_t *g = p.wg + (size_t)e * p.g_mat + (size_t)r * p.g_row_bytes;
    const uint8_t *up = p.wu + (size_t)e * p.u_mat + (size_t)r * p.u_row_bytes;
    int lane = threadIdx.x & 31;
    // A group of NX members at a time: more than one group only when a row repeats an expert.
    for (int grp = 0; grp < m; grp += NX) {
        st_xrows xr = {s_xr + grp};
        int nx = m - grp < NX ? m - grp : NX;
        float ag[NX], au[NX];
#pragma unroll
        for (int j = 0; j < NX; j++) ag[j] = au[j] = 0.0f;
        if constexpr (T == ST_TYPE_F32 || T == ST_TYPE_F16 || T == ST_TYPE_BF16) {
            row_dot_f<T, NX>(g, p.cols, p.in.x, p.in.ldx, xr, nx, ag);
            row_dot_f<T, NX>(up, p.cols, p.in.x, p.in.ldx, xr, nx, au);
        } else {
            __shared__ uint4 smg[ST_CUQ_WARPS][32 * st_span<T>::PL], smu[ST_CUQ_WARPS][32 * st_span<T>::PL];
            row_dot2<T, NX>(g, up, p.cols / 32, p.in.a, xr, nx, ag, au, smg[threadIdx.x >> 5], smu[threadIdx.x >> 5]);
        }
#pragma unroll
        for (int j = 0; j < NX; j++) {
            float sg = warp_sum_q(ag[j]), su = warp_sum_q(au[j]);
            if (lane == j && j < nx) p.out[(size_t)s_asg[grp + j] * p.rows + r] = sg / (1.0f + expf(-sg)) * su;
        }
    }
}

// One matrix per expert (down; or gate and up separately when their types differ): raw dots.
template <int T, int NX>
__global__ void __launch_bounds__(32 * ST_CUQ_WARPS) moe_mv_kernel(st_moe_small p, bool by_row) {
    st_pdl_begin();
    __shared__ int s_asg[ST_CUQ_PLAN_MAX], s_xr[ST_CUQ_PLAN_MAX];
    int e, m = moe_members(p, by_row, s_asg, s_xr, &e);
    int64_t r = (int64_t)blockIdx.x * ST_CUQ_WARPS + (threadIdx.x >> 5);
    if (m == 0 || r >= p.rows) return;
    const uint8_t *wr = p.wg + (size_t)e * p.g_mat + (size_t)r * p.g_row_bytes;
    int lane = threadIdx.x & 31;
    for (int grp = 0; grp < m; grp += NX) {
        st_xrows xr = {s_xr + grp};
        int nx = m - grp < NX ? m - grp : NX;
        float acc[NX];
#pragma unroll
        for (int j = 0; j < NX; j++) acc[j] = 0.0f;
        any_row_dot<T, NX>(wr, p.cols, p.in, xr, nx, acc);
#pragma unroll
        for (int j = 0; j < NX; j++) {
            float s = warp_sum_q(acc[j]);
            if (lane == j && j < nx) p.out[(size_t)s_asg[grp + j] * p.rows + r] = s;
        }
    }
}

// h (na, F) = silu(g) * u from two raw passes (g in h already, u in u).
__global__ void silu_mul_kernel(float *h, const float *u, int64_t n) {
    st_pdl_begin();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = h[i];
    h[i] = g / (1.0f + expf(-g)) * u[i];
}

// y[i] = Σ_j weights[i][j] · o[inv(i k + j)], j in order (inv NULL: o is by assignment).
__global__ void moe_combine_kernel(const float *o, const int32_t *inv, const int32_t *ids, const float *wts, int n,
                                   int k, int n_expert, int d, float *y, bool add) {
    st_pdl_begin();
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (int64_t)n * d) return;
    int i = (int)(t / d), col = (int)(t % d);
    float acc = 0.0f;
    for (int j = 0; j < k; j++) {
        int a = i * k + j, e = ids[a];
        if (e < 0 || e >= n_expert) continue;
        int gi = inv ? inv[a] : a;
        acc += wts[a] * o[(size_t)gi * d + col];
    }
    y[t] = add ? y[t] + acc : acc;
}

template <int T>
static void moe_gate_up_launch(st_cuda *c, const st_moe_small &p, int n) {
    dim3 grid((unsigned)((p.rows + ST_CUQ_WARPS - 1) / ST_CUQ_WARPS), (unsigned)p.na);
#define L(NX) st_launch(c, moe_gate_up_kernel<T, NX>, grid, 32 * ST_CUQ_WARPS, 0, p)
    if (n == 1) L(1);
    else if (n <= 4) L(4);
    else L(16);
#undef L
    ST_CU_LAUNCHED(c, "moe_gate_up_kernel");
}

template <int T>
static void moe_mv_launch(st_cuda *c, const st_moe_small &p, int n, bool by_row) {
    dim3 grid((unsigned)((p.rows + ST_CUQ_WARPS - 1) / ST_CUQ_WARPS), (unsigned)p.na);
#define L(NX) st_launch(c, moe_mv_kernel<T, NX>, grid, 32 * ST_CUQ_WARPS, 0, p, by_row)
    if (n == 1) L(1);
    else if (n <= 4) L(4);
    else L(16);
#undef L
    ST_CU_LAUNCHED(c, "moe_mv_kernel");
}

static void moe_mv_any(st_cuda *c, st_type t, const st_moe_small &p, int n, bool by_row) {
    switch (t) {
#define CASE(T) case T: moe_mv_launch<T>(c, p, n, by_row); break;
        ST_CUQ_QUANT_TYPES(CASE)
        CASE(ST_TYPE_F32) CASE(ST_TYPE_F16) CASE(ST_TYPE_BF16)
#undef CASE
    default: break;
    }
}

static size_t align256(size_t b) { return (b + 255) / 256 * 256; }

// ---------------------------------------------------------------------------------------------
// Routed experts, n <= 16, three launches (moe2): the gate/up kernel and the down kernel each
// work out their slot's expert and members from ids themselves (the plan is a few hundred
// comparisons in shared memory; for one row there is none, moe2_one) and quantize only their
// members' rows into shared memory; the combine kernel sums the weighted outputs. Grid (row
// tiles, slot u < n*k) as before.

#define ST_MOE2_WARPS 8
// The one-row down kernel's blocks have four warps, held to 96 registers a thread so that five
// fit a multiprocessor: with eight warps (two a multiprocessor by registers) the Next-80B-A3B's
// 320 blocks ran a second wave (the trace: half its blocks ended 8 us after the release, nine
// tenths at 17.8 us). Weight types whose kernel spills at 96 registers (Q6_K, Q8_0, ... : their
// unpacking holds more) keep eight warps.
#define ST_MOE2_DOWN_WARPS 4
#define ST_MOE2_SMEM_MAX (32 * 1024) // dynamic: the quantized member rows (static: the plan, 12 KB)

struct st_moe2_args {
    const int32_t *ids;      // (na) router ids; with slot_map, matrix slot_map[id] (-1: not here)
    const int32_t *slot_map; // (n_route) or NULL: id = matrix
    int na, k, n_expert;     // n_expert: matrices in the stacks
    int n_route;             // the router's expert count (slot_map's length, counts' range)
    uint32_t *counts;        // gate/up only: counts[id] += 1 per valid assignment (or NULL)
    const uint8_t *wg, *wu; // expert 0 of gate and up (gate/up kernel) or of down (wg only)
    size_t g_row_bytes, g_mat, u_row_bytes, u_mat;
    int64_t rows;
    int cols;
    const float *x;  // gate/up: x (n, cols), member a reads row a / k; down: h (na, cols), row a
    int rdiv;        // k (gate/up) or 1 (down)
    int gcap;        // members quantized and computed at a time (<= NX; shared memory bound)
    float *out;      // (na, rows) by assignment
    // Down only, or NULL: the last block of each row tile sums the weighted outputs of the
    // tile's rows into y (n, rows) (= or += with add), as moe_combine_kernel does.
    float *y;
    const float *wts; // (na)
    bool add;
    // Gate/up of one row only, or NULL: the router's logits (n_route); every block routes for
    // itself (moe2_route_one) and block (0, 0) writes the ids and weights to route_ids, route_w.
    const float *logits;
    int32_t *route_ids;
    float *route_w;
    // Routing: a warp sorts two groups at once where there are more groups than warps
    // (route_rank's pairs; STRATA_RANK_PAIRS=0: one at a time).
    bool rank_pairs;
    // One row, down only: each block learns its expert (from the ids, or from the logits it
    // ranks itself where the gate/up kernel routes) and asks L2 for its weight rows before it
    // waits for the gate/up kernel.
    bool early;
    // One row, down only, where the gate/up kernel routes and early does not apply (on unless
    // STRATA_MOE_HINT=0): each block reads its slot's id before it waits (moe2_expert_hint) and
    // asks L2 for that expert's rows; the id read after the wait decides.
    bool hint;
    // Down's combine, or NULL: y += sigmoid(gated_s[i]) · gated_o row i after the routed sum
    // (the shared expert's output; add_gated_rows' arithmetic).
    const float *gated_o, *gated_s;
    // One row, or NULL: h quantized (na, rows of gate/up, split layout) and its {scale, sum}.
    // Each gate/up block quantizes the chunk of 32 outputs it computed (its row tile) and writes
    // it here; the down kernel reads it instead of quantizing h in every block.
    int8_t *hq;
    float2 *hds;
    // Row tiles a block computes one after another (moe2_tiles): windows share a block's set-up
    // (its expert and members, their rows quantized into shared memory) among several.
    int tiles;
    // Down of one row with y: the k blocks of a row tile run as a cluster (st_cluster_fits), keep
    // their outputs in shared memory and sum them there (moe2_cluster_combine), instead of
    // counting in and the last block reading the outputs back from L2.
    bool cluster;
    // In the cluster, each block stores its outputs into the shared memory of the blocks that sum
    // them (moe2_cluster_combine), and each summing block counts the bytes that land in it on an
    // mbarrier instead of the cluster's barrier publishing them (STRATA_MOE_COUNTED=0: the barrier).
    bool counted;
    // Gate/up of one row where it routes: each block starts its expert's rows on their way as
    // soon as it has ranked, and quantizes x after that, while they stream
    // (STRATA_MOE_RANK_FIRST=0: x is quantized with the logits' loads, before the ranking, and
    // the rows asked of L2 after it).
    bool rank_first;
    // With rank_first, where the gate and up rows are 16-byte aligned and of one size: each warp
    // copies its rows into shared memory (cp.async, moe2_tile) instead of asking L2 for them, and
    // the products read them there (STRATA_MOE_STAGE=0: asked of L2, read from there).
    bool stage;
    // With stage: the products wait for all the rows at once (STRATA_MOE_STAGE_ALL=1, for A/B
    // runs) instead of starting on each group of rows as it lands.
    bool stage_all;
    // With stage, sm_90: the copy engine copies each pair's rows (cp.async.bulk, counted on the
    // warp's mbarrier of that group) so the warps go on at once to quantize x; else the warps'
    // lanes copy them (cp.async) and stall until most have landed (STRATA_MOE_BULK=0).
    bool bulk;
    // With rank_first, one row of at most 8 values a thread: each thread loads its chunk of x
    // with the logits and quantizes it from registers after asking for its rows
    // (STRATA_MOE_XREG=0: quant_split loads x after the ask).
    bool xreg;
    // With bulk: the groups of rows each warp asks for before its products (default 1); the
    // others one at a time, each as its products finish a group. Asking for all eight rows at
    // once held the warps 3.6 us in the copy engine's issue (STRATA_MOE_AHEAD=N, 1-4: N at once).
    int ahead;
    // With bulk and one group ahead: each later group is asked for as soon as the one before has
    // landed, before that one's products, so its flight overlaps them (STRATA_MOE_ASK_LANDED=0:
    // after them).
    bool ask_landed;
};

// Row tiles of the down kernel's combine: zero at load; the last block of a tile puts its
// counter back to zero (kernels on the stream never overlap, so one array serves every layer).
#define ST_MOE2_MAX_TILES 4096
#define ST_MOE2_EARLY_RANK 128
__device__ unsigned moe2_counters[ST_MOE2_MAX_TILES];

// The matrix of router id v in this stack, or -1 (not here, or out of range).
__device__ __forceinline__ int moe2_matrix(const st_moe2_args &p, int v) {
    if (p.slot_map) v = v >= 0 && v < p.n_route ? p.slot_map[v] : -1;
    return v >= 0 && v < p.n_expert ? v : -1;
}

// Slot blockIdx.y's expert (*e) and members (s_asg, ascending): the u-th distinct valid expert
// in order of first appearance, as moe_plan_kernel numbers them. Returns the member count
// (0: an idle slot, the same for every thread of the block). Each router id's first assignment
// comes from an atomicMin in shared memory, then warp 0 counts those leaders 32 assignments a
// ballot up to slot u's: a few barriers, where comparing every pair of assignments took ~6 us
// a block at 16 rows (128 assignments) and every block of the window's grid paid it.
#define ST_MOE2_ROUTE_MAX 1024 // router ids the window kernels look up in shared memory
__device__ int moe2_members(const st_moe2_args &p, int *s_asg, int *e) {
    __shared__ int s_sel, s_m, s_v[ST_CUQ_PLAN_MAX], s_first[ST_MOE2_ROUTE_MAX];
    int tid = threadIdx.x, nt = blockDim.x, na = p.na;
    for (int v = tid; v < p.n_route; v += nt) s_first[v] = INT_MAX;
    __syncthreads();
    for (int a = tid; a < na; a += nt) {
        int v = p.ids[a];
        v = moe2_matrix(p, v) >= 0 ? v : -1; // (valid: 0 <= v < n_route)
        s_v[a] = v;
        if (v >= 0) atomicMin(&s_first[v], a);
    }
    __syncthreads();
    if (tid < 32) {
        int u = blockIdx.y, seen = 0, sel = -1;
        for (int a0 = 0; a0 < na && sel < 0; a0 += 32) {
            int a = a0 + tid, v = a < na ? s_v[a] : -1;
            unsigned lead = __ballot_sync(0xffffffffu, v >= 0 && s_first[v] == a);
            int c = __popc(lead);
            if (u < seen + c) sel = __shfl_sync(0xffffffffu, v, __fns(lead, 0, u - seen + 1));
            seen += c;
        }
        int cnt = 0;
        if (sel >= 0)
            for (int a0 = 0; a0 < na; a0 += 32) {
                int a = a0 + tid;
                bool hit = a < na && s_v[a] == sel;
                unsigned mask = __ballot_sync(0xffffffffu, hit);
                if (hit) s_asg[cnt + __popc(mask & ((1u << tid) - 1))] = a;
                cnt += __popc(mask);
            }
        if (tid == 0) s_sel = sel >= 0 ? moe2_matrix(p, sel) : -1, s_m = cnt;
    }
    __syncthreads();
    *e = s_sel;
    return s_sel >= 0 ? s_m : 0;
}

// One row (n == 1): slot u is assignment u alone (no plan: a row's k experts are distinct, and
// were two the same, each slot would still compute its own assignment). Its input row (x row 0
// for gate/up, h row u for down) does not depend on the expert, so it is quantized into shared
// memory while the id loads, and one barrier serves both. Returns 1, or 0 for an idle slot.
__device__ int moe2_one(const st_moe2_args &p, int *s_asg, int *e, uint8_t *moe2_smem, bool quantized) {
    __shared__ int s_sel;
    int u = blockIdx.y;
    if (threadIdx.x == 0) {
        s_sel = moe2_matrix(p, p.ids[u]);
        s_asg[0] = u;
    }
    if (!quantized) // (else the down kernel's h is in p.hq)
        quant_split(p.x + (size_t)(u / p.rdiv) * p.cols, p.cols, NULL, 1, 1, p.cols, (int8_t *)moe2_smem,
                    (float2 *)(moe2_smem + (size_t)p.gcap * p.cols), threadIdx.x, blockDim.x);
    __syncthreads();
    *e = s_sel;
    return s_sel >= 0;
}

// The down kernel's hint (p.hint): slot blockIdx.y's expert from the ids as they are before the
// wait, unordered with the gate/up kernel's block (0, 0) that writes them: a block that becomes
// resident after that reads this layer's ids, one before it an earlier layer's, whose rows it
// asks for in vain. (H100, Next-80B-A3B shape: the down kernel 12.58 -> 11.53 us a layer,
// decode +2.2%. Waiting for a flag that block (0, 0) set once the ids were written gained
// nothing more and cost the gate/up kernel 0.5 us: bench/results/2026-12-05-moe-hint.md.)
__device__ __forceinline__ int moe2_expert_hint(const st_moe2_args &p) {
    __shared__ int s_hint;
    if (threadIdx.x == 0) s_hint = moe2_matrix(p, __ldcg(p.ids + blockIdx.y));
    __syncthreads();
    return s_hint;
}

// Weight row i (of the warp's output rows for down, its 2P gate and up rows for gate/up) of this
// warp in row tile tt of the block's TT (moe2_rows' layout; HW: a half-warp's rows); rows past
// the matrix read row 0.
template <bool GATE, int P, int W, bool HW>
__device__ __forceinline__ const uint8_t *moe2_row_ptr(const st_moe2_args &p, int e, int TT, int tt, int i) {
    constexpr int WR = GATE ? P : HW ? 4 * P : 2 * P;
    int64_t r0 = ((int64_t)blockIdx.x * TT + tt) * (W * WR) + (threadIdx.x >> 5) * WR;
    if (GATE) {
        int64_t r = r0 + i / 2 < p.rows ? r0 + i / 2 : 0;
        return (i & 1) ? p.wu + (size_t)e * p.u_mat + (size_t)r * p.u_row_bytes
                       : p.wg + (size_t)e * p.g_mat + (size_t)r * p.g_row_bytes;
    }
    return p.wg + (size_t)e * p.g_mat + (size_t)(r0 + i < p.rows ? r0 + i : 0) * p.g_row_bytes;
}

// Asks L2 for the rows of expert e that this warp computes in its block's TT tiles, all at once
// (lane j: row j % PR of tile j / PR), with the streaming policy; without it, this lane's first
// chunk of each row of the first tile.
template <int T, int NX, bool GATE, int P, int W, bool HW = false>
__device__ __forceinline__ void moe2_ask_rows(const st_moe2_args &p, int e, int TT) {
    constexpr int R = 2 * P, WR = GATE ? P : HW ? 4 * P : 2 * P, PR = GATE ? R : WR;
    int lane = threadIdx.x & 31, half = HW ? lane >> 4 : 0, lc = HW ? lane & 15 : lane;
    const int64_t rb = (int64_t)blockIdx.x * TT * (W * WR) + (threadIdx.x >> 5) * WR;
    if (cuq_l2_hint) {
        if (lane < PR * TT && rb + (int64_t)(lane / PR) * (W * WR) < p.rows)
            prefetch_l2_bulk(moe2_row_ptr<GATE, P, W, HW>(p, e, TT, lane / PR, lane % PR),
                             GATE && (lane & 1) ? p.u_row_bytes : p.g_row_bytes);
    } else if (rb < p.rows && lc < p.cols / 32) {
#pragma unroll
        for (int i = 0; i < R; i++) prefetch_chunk<T>(moe2_row_ptr<GATE, P, W, HW>(p, e, TT, 0, half * R + i), lc);
    }
}

// The groups of rows a staged gate/up warp copies and computes in turn (moe2_route_one, moe2_rows).
#define ST_MOE2_STAGES 4
// The weight types whose one-row gate/up kernel stages its rows (p.stage): those measured
// faster so (Q4_K, 2026-12-05). The staged code costs other types' kernels registers and spills
// (Q5_K's, Q6_K's 80 -> 112 and 56 -> 104 bytes of stack), so they keep their old code until
// an A/B shows the staging pays for them too.
template <int T> constexpr bool moe2_stages = T == ST_TYPE_Q4_K;

// The mbarriers the staged rows' groups land on with p.bulk: ST_MOE2_STAGES a warp.
__device__ __forceinline__ unsigned long long *moe2_stage_bars() {
    __shared__ unsigned long long bars[ST_MOE2_WARPS * ST_MOE2_STAGES];
    return bars + (threadIdx.x >> 5) * ST_MOE2_STAGES;
}

#if defined(ST_CLUSTERS)
// Lane 0 of a staged gate/up warp asks the copy engine for its rows of group g (rows g·RG ..,
// moe2_row_ptr's order) into tile, counted on the warp's mbarrier g.
template <int P, int W>
__device__ __forceinline__ void moe2_bulk_group(const st_moe2_args &p, int ex, uint8_t *tile, int g,
                                                unsigned long long pol) {
    constexpr int RG = 2 * P >= ST_MOE2_STAGES ? 2 * P / ST_MOE2_STAGES : 1; // rows a group
    unsigned long long *bar = moe2_stage_bars() + g;
    st_mbar_expect(bar, (unsigned)(RG * p.g_row_bytes));
#pragma unroll
    for (int i = g * RG; i < g * RG + RG; i++)
        st_bulk_copy(tile + i * p.g_row_bytes, moe2_row_ptr<true, P, W, false>(p, ex, 1, 0, i), (unsigned)p.g_row_bytes,
                     bar, pol);
}
#endif

// Where p.stage puts warp w's 2P gate and up rows (moe2_row_ptr's order) in the dynamic shared
// memory: after the quantized input and its scales.
__host__ __device__ __forceinline__ size_t moe2_tile_off(const st_moe2_args &p) {
    return ((size_t)p.gcap * p.cols + sizeof(float2) * (size_t)p.gcap * (p.cols / 32) + 15) & ~(size_t)15;
}

// One row with the routing folded in (p.logits): every block ranks the row's logits itself
// (route_rank) and takes the expert of rank blockIdx.y; block (0, 0) also writes the row's ids
// and weights and counts them. The row's x is quantized with the logits' loads, as moe2_one
// does, or (p.rank_first) after the ranking, once the block's rows are on their way: copied into
// shared memory in ST_MOE2_STAGES groups (p.stage; moe2_rows waits for each), else asked of L2.
template <int T, int P, int W>
__device__ int moe2_route_one(const st_moe2_args &p, int *s_asg, int *e, uint8_t *moe2_smem, st_route_smem &rs,
                               unsigned ts) {
    // With p.xreg, this thread's chunk of x (quant_split's: chunk tid / 4, lanes of four) is
    // loaded with the logits and quantized from registers once the rows are asked for: loaded
    // after that ask, x's values had come back behind the rows' burst (H100 trace, Next-80B-A3B:
    // the ranking done at 3.4 us, x quantized at 11.2).
    const int xc = threadIdx.x >> 2, l4 = threadIdx.x & 3;
    const bool xok = p.xreg && xc < p.cols / 32;
    float4 xv0 = make_float4(0, 0, 0, 0), xv1 = xv0;
    if (xok) {
        xv0 = *(const float4 *)(p.x + (size_t)xc * 32 + 4 * l4);
        xv1 = *(const float4 *)(p.x + (size_t)xc * 32 + 16 + 4 * l4);
    }
    route_load(p.logits, p.n_route, rs);
    if (!p.rank_first)
        quant_split(p.x, p.cols, NULL, 1, 1, p.cols, (int8_t *)moe2_smem,
                    (float2 *)(moe2_smem + (size_t)p.gcap * p.cols), threadIdx.x, blockDim.x);
    __syncthreads();
    st_trace_mark(ts, 1);
    route_rank(p.n_route, p.k, rs, p.rank_pairs);
    st_trace_mark(ts, 2);
    if (p.rank_first) { // the rows asked for first; x quantized while they stream
        int ex = moe2_matrix(p, rs.top[blockIdx.y]);
        if (moe2_stages<T> && ex >= 0 && p.stage) {
            uint8_t *tile = moe2_smem + moe2_tile_off(p) + (size_t)(threadIdx.x >> 5) * 2 * P * p.g_row_bytes;
            unsigned long long pol = st_l2_evict_first();
            constexpr int RG = 2 * P >= ST_MOE2_STAGES ? 2 * P / ST_MOE2_STAGES : 1; // rows a group
#if defined(ST_CLUSTERS)
            if (p.bulk) {
                // Lane 0 asks the copy engine for the warp's rows, group g counted on bar[g]; the
                // lanes wait on them in moe2_rows, after this block's barrier below.
                unsigned long long *bar = moe2_stage_bars();
                // The first p.ahead groups now, the others as the products finish a group
                // (moe2_rows).
                if ((threadIdx.x & 31) == 0) {
                    for (int g = 0; g < ST_MOE2_STAGES; g++) st_mbar_init(bar + g, 1);
                    st_mbar_init_fence();
                    for (int g = 0; g < p.ahead; g++) moe2_bulk_group<P, W>(p, ex, tile, g, pol);
                }
                st_trace_mark(ts, 8);
            } else
#endif
            {
#pragma unroll
                for (int i = 0; i < 2 * P; i++) {
                    const uint8_t *src = moe2_row_ptr<true, P, W, false>(p, ex, 1, 0, i);
                    for (size_t o = (size_t)(threadIdx.x & 31) * 16; o < p.g_row_bytes; o += 32 * 16)
                        st_cp_async16_pol(tile + i * p.g_row_bytes + o, src + o, pol);
                    if ((i + 1) % RG == 0) st_cp_commit();
                }
            }
        } else if (ex >= 0) {
            moe2_ask_rows<T, 1, true, P, W>(p, ex, 1);
        }
        if (p.xreg) { // quant_split's arithmetic and layout for one row, from the registers
            int8_t *q0 = (int8_t *)moe2_smem + (size_t)(xok ? xc : 0) * 16 + 4 * l4;
            quant_chunk4(xv0, xv1, l4, xok, q0, q0 + p.cols / 2,
                         (float2 *)(moe2_smem + (size_t)p.gcap * p.cols) + (xok ? xc : 0));
        } else {
            quant_split(p.x, p.cols, NULL, 1, 1, p.cols, (int8_t *)moe2_smem,
                        (float2 *)(moe2_smem + (size_t)p.gcap * p.cols), threadIdx.x, blockDim.x);
        }
    }
    if (blockIdx.x == 0 && blockIdx.y == 0) route_weights(p.n_route, p.k, rs, p.route_ids, p.route_w, p.counts);
    st_trace_mark(ts, 3);
    int u = blockIdx.y;
    if (threadIdx.x == 0) s_asg[0] = u;
    *e = moe2_matrix(p, rs.top[u]);
    __syncthreads(); // s_asg
    return *e >= 0;
}

// GATE: out = silu(gate · x) · (up · x), P gate/up row pairs per warp; else out = W · x, 2P
// rows per warp. More rows per warp keep more loads in flight per lane and share each block's
// member plan and quantized rows among more weight rows (at one row the down product, whose
// rows are only 24 chunks long at the 30B shape, is otherwise mostly the block's set-up).
// The rows of one expert (e, with m members s_asg) a block of moe2_kernel computes; with ready,
// the members' rows are in shared memory already (moe2_one), or in p.hq (down, one row). With
// sh (gate/up, one row), the outputs also go to sh[row within the tile].
// HW (one row's down, rows of at most 16 chunks): each half of a warp computes R rows of its
// own, lane c of the half taking chunk c (rows of 32 chunks or fewer left half the lanes idle:
// the Next-80B-A3B's down rows are 16 chunks long). A half's sums are the whole warp's were
// (the idle lanes added zeros), so the outputs keep their bits.
template <int T, int NX, bool GATE, int P, int W, bool HW = false>
__device__ __forceinline__ void moe2_rows(const st_moe2_args &p, int e, int m, const int *s_asg, uint8_t *moe2_smem,
                                          bool ready, unsigned ts, float *sh) {
    static_assert(!HW || (!GATE && NX == 1), "half-warp rows: one row's down only");
    constexpr int R = 2 * P;                         // weight rows per warp (a half: HW)
    constexpr int WR = GATE ? P : HW ? 4 * P : 2 * P; // output rows per warp
    constexpr int CL = HW ? 16 : 32;                 // lanes a row
    const int TT = NX == 1 ? 1 : p.tiles; // row tiles a block computes, one after another
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int half = HW ? lane >> 4 : 0, lc = HW ? lane & 15 : lane; // this lane's rows half * R .., its chunk
    auto row_ptr = [&](int tt, int i) { return moe2_row_ptr<GATE, P, W, HW>(p, e, TT, tt, i); };
    int nchunk = p.cols / 32, hcols = p.cols / 2;
    const int64_t rb = (int64_t)blockIdx.x * TT * (W * WR) + warp * WR;
    if (!p.early && !(GATE && NX == 1 && p.logits && p.rank_first)) moe2_ask_rows<T, NX, GATE, P, W, HW>(p, e, TT);
    int8_t *sq = (int8_t *)moe2_smem;
    float2 *sds = (float2 *)(moe2_smem + (size_t)p.gcap * p.cols);
    const int8_t *xq = sq;
    const float2 *xds = sds;
    if (!GATE && NX == 1 && p.hq) xq = p.hq + (size_t)s_asg[0] * p.cols, xds = p.hds + (size_t)s_asg[0] * nchunk;
    for (int g0 = 0; g0 < m; g0 += p.gcap) {
        int gn = m - g0 < p.gcap ? m - g0 : p.gcap;
        if (!ready) {
            if (g0 > 0) __syncthreads(); // the previous group's rows are no longer read
            quant_split(p.x, p.cols, s_asg + g0, p.rdiv, gn, p.cols, sq, sds, threadIdx.x, blockDim.x);
            __syncthreads();
        }
#pragma unroll 1
        for (int tt = 0; tt < TT; tt++) {
            int64_t r0 = rb + (int64_t)tt * (W * WR);
            if (r0 >= p.rows) break;
            const uint8_t *wr[R];
            // (moe2_route_one copied them)
            const bool staged = GATE && NX == 1 && moe2_stages<T> && p.logits && p.stage;
#pragma unroll
            for (int i = 0; i < R; i++)
                wr[i] = staged ? moe2_smem + moe2_tile_off(p) + (size_t)(warp * R + i) * p.g_row_bytes
                               : row_ptr(tt, half * R + i);
            float acc[R][NX];
#pragma unroll
            for (int i = 0; i < R; i++)
#pragma unroll
                for (int j = 0; j < NX; j++) acc[i][j] = 0.0f;
            if constexpr (GATE && NX == 1 && moe2_stages<T>) {
                // Staged rows land in ST_MOE2_STAGES groups of rows (moe2_route_one's commits):
                // each group's products start once its copies have landed, while the next ones
                // land. Each row's sum runs over its chunks in the same order: the same bits.
                constexpr int RG = R / ST_MOE2_STAGES;
                static_assert(ST_MOE2_STAGES == 4 && R % ST_MOE2_STAGES == 0, "staged row groups");
#pragma unroll
                for (int g = 0; g < ST_MOE2_STAGES && staged; g++) {
#if defined(ST_CLUSTERS)
                    if (p.bulk) {
                        for (int h = g; h < (p.stage_all && g == 0 ? ST_MOE2_STAGES : g + 1); h++)
                            st_mbar_wait(moe2_stage_bars() + h, 0);
                    } else
#endif
                    {
                        if (g == 0 && p.stage_all) st_cp_wait<0>();
                        else if (g == 0) st_cp_wait<3>();
                        else if (g == 1) st_cp_wait<2>();
                        else if (g == 2) st_cp_wait<1>();
                        else st_cp_wait<0>();
                        __syncwarp(); // the warp's other lanes copied parts of these rows
                    }
                    st_trace_mark(ts, g == 0 ? 7 : 8 + g); // (block 0, warp 0: group g has landed)
#if defined(ST_CLUSTERS)
                    if (p.bulk && p.ask_landed && g + 1 < ST_MOE2_STAGES && lane == 0)
                        moe2_bulk_group<P, W>(p, e, (uint8_t *)wr[0], g + 1, st_l2_evict_first());
#endif
                    for (int c = lc; c < nchunk; c += CL) {
                        const int8_t *q = xq + c * 16;
                        int4 x0 = *(const int4 *)q, x1 = *(const int4 *)(q + hcols);
                        float2 ds = xds[c];
#pragma unroll
                        for (int i = g * RG; i < g * RG + RG; i++) {
                            st_wchunk w;
                            st_qt<T>::unpack(wr[i], c, w);
                            acc[i][0] += chunk_dot_x<T>(w, x0, x1, ds);
                        }
                    }
#if defined(ST_CLUSTERS)
                    if (p.bulk && !p.ask_landed && g + p.ahead < ST_MOE2_STAGES && lane == 0)
                        moe2_bulk_group<P, W>(p, e, (uint8_t *)wr[0], g + p.ahead, st_l2_evict_first());
#endif
                }
            }
            for (int c = lc; c < nchunk && !(GATE && NX == 1 && staged); c += CL) {
                st_wchunk w[R];
#pragma unroll
                for (int i = 0; i < R; i++) st_qt<T>::unpack(wr[i], c, w[i]);
#pragma unroll
                for (int j = 0; j < NX; j++) {
                    if (j < gn) {
                        const int8_t *q = xq + (size_t)j * p.cols + c * 16;
                        int4 x0 = *(const int4 *)q, x1 = *(const int4 *)(q + hcols);
                        float2 ds = xds[(size_t)j * nchunk + c];
#pragma unroll
                        for (int i = 0; i < R; i++) acc[i][j] += chunk_dot_x<T>(w[i], x0, x1, ds);
                    }
                }
            }
            st_trace_mark(ts, 5); // (block 0: its dot products done)
#pragma unroll
            for (int j = 0; j < NX; j++) {
                float s[R];
#pragma unroll
                for (int i = 0; i < R; i++) s[i] = HW ? half_sum_q(acc[i][j]) : warp_sum_q(acc[i][j]);
                if (lc == 0 && j < gn) {
                    float *o = p.out + (size_t)s_asg[g0 + j] * p.rows + r0 + half * R;
                    float *shr = sh ? sh + half * R : NULL;
#pragma unroll
                    for (int i = 0; i < (HW ? R : WR); i++) {
                        if (r0 + half * R + i >= p.rows) break;
                        if (GATE) {
                            float v = s[2 * i] / (1.0f + expf(-s[2 * i])) * s[2 * i + 1];
                            o[i] = v;
                            if (sh) sh[warp * WR + i] = v;
                        } else if (sh) {
                            shr[warp * WR + i] = s[i]; // (the cluster's combine reads them there)
                        } else {
                            o[i] = s[i];
                        }
                    }
                }
            }
        }
    }
}

// The down kernel's expert of slot blockIdx.y for one row, before the wait (p.early): from the
// ids, or from the logits it ranks itself where the gate/up kernel routes (that kernel writes
// the ids only after its own wait). Both were written before the gate/up kernel, which could
// let this one launch only after its own wait, when every kernel before it had completed.
// __ldcg: from L2, where those writes are.
__device__ __forceinline__ int moe2_expert_early(const st_moe2_args &p, st_route_smem &rs) {
    __shared__ int s_sel;
    if (p.logits) {
        for (int i = threadIdx.x; i < (p.n_route + 31) / 32 * 32; i += blockDim.x)
            rs.l[i] = i < p.n_route ? route_logit(__ldcg(p.logits + i)) : -INFINITY;
        __syncthreads();
        route_rank(p.n_route, p.k, rs, p.rank_pairs);
        return moe2_matrix(p, rs.top[blockIdx.y]);
    }
    if (threadIdx.x == 0) s_sel = moe2_matrix(p, __ldcg(p.ids + blockIdx.y));
    __syncthreads();
    return s_sel;
}

// The one-row down kernel's combine in a cluster of its row tile's k blocks (rank = slot =
// blockIdx.y): each block's outputs of the tile (ROWS) are in its s_o. Block u sums rows u, u + k,
// ... over the valid slots in slot order, with moe_combine_kernel's arithmetic (the same bits
// as the counting path). Each block stores its row j into block j % k's s_in (every block
// arrived at the cluster's barrier at its start, so the wait here says they have all started),
// and each block sums from its own shared memory and leaves. With p.counted the stores are
// counted on the summing block's mbarrier (bar, set up at the kernel's start), which completes
// when its k * (its rows) floats have landed: no cluster barrier, and no fence after the stores
// (the barrier's release waits for every store of the thread to complete first); else one
// cluster barrier publishes them.
#if defined(ST_CLUSTERS)
template <int ROWS>
__device__ __forceinline__ void moe2_cluster_combine(const st_moe2_args &p, const float *s_o, unsigned long long *bar) {
    __shared__ float s_cw[16];
    __shared__ unsigned char s_ok[16];
    __shared__ float s_in[16 * ROWS]; // slot a's row j at a * ROWS + j
    const int k = p.k, t = threadIdx.x, j = blockIdx.y + t * k; // (k <= 16: st_cluster_fits)
    const int64_t r = (int64_t)blockIdx.x * ROWS + j;
    const bool mine = j < ROWS && r < p.rows;
    float y0 = 0.0f, go = 0.0f, gs = 0.0f; // (these loads fly across the barrier)
    if (mine && p.add) y0 = p.y[r];
    if (mine && p.gated_o) go = p.gated_o[r], gs = p.gated_s[0];
    if (t >= 32 && t - 32 < k) {
        bool ok = moe2_matrix(p, p.ids[t - 32]) >= 0;
        s_ok[t - 32] = ok;
        s_cw[t - 32] = ok ? p.wts[t - 32] : 0.0f;
    }
    if (p.counted && t == 0) st_mbar_expect(bar, 4u * k * ((ROWS - blockIdx.y + k - 1) / k));
    st_cluster_wait(); // every block of the cluster has started (its arrival in moe2_body)
    __syncthreads();   // this block's s_o (and s_ok, s_cw)
    if (t < ROWS && p.counted) st_store_counted(s_in + blockIdx.y * ROWS + t, bar, (unsigned)(t % k), s_o[t]);
    else if (t < ROWS) *st_cluster_peer(s_in + blockIdx.y * ROWS + t, (unsigned)(t % k)) = s_o[t];
    if (p.counted) {
        // Every slot's rows of this block; thread 0 waits too, so that a block whose rows are all
        // past the matrix does not leave while the others' stores are still on their way to it.
        if (mine || t == 0) st_mbar_wait(bar, 0);
    } else {
        st_cluster_sync(); // every slot's outputs (and s_ok, s_cw here)
    }
    if (mine) {
        float v[16];
#pragma unroll
        for (int a = 0; a < 16; a++)
            v[a] = a < k && s_ok[a] ? s_in[a * ROWS + j] : 0.0f;
        float acc = 0.0f;
#pragma unroll
        for (int a = 0; a < 16; a++)
            if (a < k && s_ok[a]) acc += s_cw[a] * v[a];
        float out = p.add ? y0 + acc : acc;
        if (p.gated_o) out += sigmoidf_(gs) * go;
        p.y[r] = out;
    }
}
#endif

// The body of both kernels below (W warps a block).
template <int T, int NX, bool GATE, int P, int W, bool HW = false>
__device__ __forceinline__ void moe2_body(const st_moe2_args &p) {
    constexpr int DR = W * (HW ? 4 : 2) * P; // a block's row tile (down)
    const bool routes = GATE && NX == 1 && p.logits;
    __shared__ int s_asg[ST_CUQ_PLAN_MAX];
    __shared__ st_route_smem rs;
    extern __shared__ __align__(16) uint8_t moe2_smem[];
    int e = -1, m = 0;
    // STRATA_CUDA_TRACE marks: 0 a first read of the input (the logits where it routes) arrived;
    // routing: 1 logits and x loaded, 2 ranked, 3 ids written (block 0); 4 expert and input
    // ready, 5 products done, 6 stored, 7 counted in (down); 8 the first rows asked for (gate/up,
    // the copy engine); staged gate/up: 7, 9, 10, 11 warp 0's groups 0-3 landed.
    unsigned ts;
#if defined(ST_CLUSTERS)
    __shared__ unsigned long long s_bar; // (p.counted) the combine's stores land counted on it
    if (!GATE && NX == 1 && p.cluster) st_cluster_started(&s_bar, p.counted); // others may store into s_in
#endif
    // The down kernel's rows of expert ex asked of L2 before the wait.
    auto ask_down = [&](int ex) {
        int64_t rb = (int64_t)blockIdx.x * DR, nb = (rb + DR < p.rows ? rb + DR : p.rows) - rb;
        const uint8_t *rows0 = p.wg + (size_t)ex * p.g_mat + (size_t)rb * p.g_row_bytes;
        if (ex >= 0 && cuq_l2_hint) prefetch_l2_stream(rows0, (size_t)nb * p.g_row_bytes);
        else if (ex >= 0) prefetch_l2(rows0, (size_t)nb * p.g_row_bytes);
    };
    if (!GATE && NX == 1 && p.early) {
        e = moe2_expert_early(p, rs);
        ask_down(e);
        ts = st_pdl_begin();
        st_trace_probe(ts, 0, p.x + (size_t)blockIdx.y * p.cols);
        if (threadIdx.x == 0) s_asg[0] = blockIdx.y;
        if (!p.hq)
            quant_split(p.x + (size_t)blockIdx.y * p.cols, p.cols, NULL, 1, 1, p.cols, (int8_t *)moe2_smem,
                        (float2 *)(moe2_smem + (size_t)p.gcap * p.cols), threadIdx.x, blockDim.x);
        st_trace_mark(ts, 2);
        __syncthreads();
        m = e >= 0;
    } else {
        if (!GATE && NX == 1 && p.hint) ask_down(moe2_expert_hint(p));
        ts = st_pdl_begin();
        st_trace_probe(ts, 0, routes ? p.logits : p.x);
        if (GATE && !routes && p.counts && blockIdx.x == 0 && blockIdx.y == 0)
            for (int a = threadIdx.x; a < p.na; a += blockDim.x) {
                int v = p.ids[a];
                if (v >= 0 && v < p.n_route) atomicAdd(&p.counts[v], 1u);
            }
        m = NX != 1 ? moe2_members(p, s_asg, &e)
          : routes  ? moe2_route_one<T, P, W>(p, s_asg, &e, moe2_smem, rs, ts)
                    : moe2_one(p, s_asg, &e, moe2_smem, !GATE && p.hq);
    }
    st_trace_mark(ts, 4);
    // One row's gate/up: the tile's outputs (one chunk, W * P == 32 rows) quantized
    // by warp 0 for the down kernel.
    constexpr bool HQ = GATE && NX == 1 && W * P == 32;
    // One row's down in a cluster: the tile's outputs stay in shared memory.
    constexpr bool CL = !GATE && NX == 1;
    __shared__ __align__(16) float s_h[HQ ? 32 : CL ? DR : 1];
    float *sh = HQ && p.hq ? s_h : CL && p.cluster ? s_h : NULL;
    if (m > 0) moe2_rows<T, NX, GATE, P, W, HW>(p, e, m, s_asg, moe2_smem, NX == 1, ts, sh);
    st_trace_mark(ts, 6);
    if (HQ && p.hq && m > 0) {
        __syncthreads();
        if (threadIdx.x < 32) {
            int l4 = threadIdx.x & 3, c = blockIdx.x;
            float4 v0 = *(const float4 *)(s_h + 4 * l4), v1 = *(const float4 *)(s_h + 16 + 4 * l4);
            int8_t *q0 = p.hq + (size_t)blockIdx.y * p.rows + c * 16 + 4 * l4;
            quant_chunk4(v0, v1, l4, threadIdx.x < 4, q0, q0 + p.rows / 2, p.hds + (size_t)blockIdx.y * (p.rows / 32) + c);
        }
    }
    if (GATE || !p.y) {
        st_trace_end();
        return;
    }
#if defined(ST_CLUSTERS)
    if (CL && p.cluster) {
        moe2_cluster_combine<DR>(p, s_h, &s_bar);
        st_trace_mark(ts, 7);
        st_trace_end();
        return;
    }
#endif

    // Last block of the row tile combines: y[i][r] = Σ_j wts[i k + j] · out[i k + j][r] over the
    // valid assignments, in the order moe_combine_kernel sums them. Every block of the tile
    // (idle slots too) counts itself in after its outputs are published. Meanwhile the other
    // warps look up which assignments are valid and their weights (ids, then the slot map: two
    // round trips that thread 0's fence and count hide), so the last block's sum issues all of
    // a row's output loads at once instead of a chain of dependent loads per expert.
    __shared__ unsigned s_last;
    __shared__ float s_cw[ST_CUQ_PLAN_MAX];
    __shared__ unsigned char s_ok[ST_CUQ_PLAN_MAX];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned prev = atomicAdd(&moe2_counters[blockIdx.x], 1u);
        s_last = prev == gridDim.y - 1;
        if (s_last) moe2_counters[blockIdx.x] = 0;
    } else if (threadIdx.x >= 32) {
        for (int a = threadIdx.x - 32; a < p.na; a += blockDim.x - 32) {
            bool ok = moe2_matrix(p, p.ids[a]) >= 0;
            s_ok[a] = ok;
            s_cw[a] = ok ? p.wts[a] : 0.0f;
        }
    }
    st_trace_mark(ts, 7);
    __syncthreads();
    if (!s_last) {
        st_trace_end();
        return;
    }
    __threadfence();
    const int TILE = (NX == 1 ? 1 : p.tiles) * DR;
    constexpr int KB = 8; // outputs loaded at once
    int n = p.na / p.k;
    for (int t = threadIdx.x; t < n * TILE; t += blockDim.x) {
        int i = t / TILE;
        int64_t r = (int64_t)blockIdx.x * TILE + t % TILE;
        if (r >= p.rows) continue;
        float *yr = p.y + (size_t)i * p.rows + r;
        float y0 = p.add ? *yr : 0.0f; // (these loads fly with the outputs')
        float go = p.gated_o ? p.gated_o[(size_t)i * p.rows + r] : 0.0f, gs = p.gated_o ? p.gated_s[i] : 0.0f;
        float acc = 0.0f;
        for (int j0 = 0; j0 < p.k; j0 += KB) {
            float v[KB];
#pragma unroll
            for (int j = 0; j < KB; j++) {
                int a = i * p.k + j0 + j;
                v[j] = j0 + j < p.k && s_ok[a] ? __ldcg(p.out + (size_t)a * p.rows + r) : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < KB; j++) {
                int a = i * p.k + j0 + j;
                if (j0 + j < p.k && s_ok[a]) acc += s_cw[a] * v[j];
            }
        }
        float v = p.add ? y0 + acc : acc;
        if (p.gated_o) v += sigmoidf_(gs) * go;
        *yr = v;
    }
    st_trace_end();
}

// Two kernels for their bounds: eight warps with the compiler's own register choice (a minimum
// of one block a multiprocessor in the bounds let it take 150 registers for the one-row Q4_K
// gate/up, one block a multiprocessor, and its 192 blocks ran in two waves), and the one-row
// down kernel's four warps held to 96 registers (five a multiprocessor).
template <int T, int NX, bool GATE, int P>
__global__ void __launch_bounds__(32 * ST_MOE2_WARPS) moe2_kernel(st_moe2_args p) {
    moe2_body<T, NX, GATE, P, ST_MOE2_WARPS>(p);
}
// With half-warp rows (HW: half the blocks, four a multiprocessor are enough for one wave) it
// keeps 128 registers: at 96 the halves' row offsets spilled and the launcher fell back.
template <int T, int P, bool HW>
__global__ void __launch_bounds__(32 * ST_MOE2_DOWN_WARPS, HW ? 4 : 5) moe2_down4_kernel(st_moe2_args p) {
    moe2_body<T, 1, false, P, ST_MOE2_DOWN_WARPS, HW>(p);
}
// The one-row eight-warp kernels of types that take more than 128 registers with the plain
// bounds (Q8_0 194, Q6_K 183 for the gate/up: one block a multiprocessor, so the 30B-A3B's 192
// gate/up blocks run in two waves), held to two blocks a multiprocessor, spilling what does not
// fit (30B-A3B decode, 2026-12-01: Q8_0, 88 bytes spilled, 287.3 -> 313.6 tok/s, gate/up 25.6 ->
// 22.2 us a layer; Q6_K, 224 bytes spilled, 249.5 -> 256.5). STRATA_MOE_CAP2=0: never.
template <int T, bool GATE, int P>
__global__ void __launch_bounds__(32 * ST_MOE2_WARPS, 2) moe2_cap2_kernel(st_moe2_args p) {
    moe2_body<T, 1, GATE, P, ST_MOE2_WARPS>(p);
}
// Four row pairs a warp for one row (H200, a 4-layer 30B-shape model, Q4_K experts: decode
// 2,380 -> 2,500 tok/s); windows keep one, whose R x NX sums would fill the registers.
// (Again on 2026-11-30, 30B shape, whole card: one or two row pairs a warp decode 295 and 314
// tok/s against 334 with four; staging the rows in shared memory as mmv2 does changed nothing
// here, 320 against 321: these blocks wait on their plan and x, not on their weight loads.)
// Warps of a block: ST_MOE2_DOWN_WARPS for the one-row down kernel (STRATA_MOE_DOWN_W8=1: eight,
// for A/B runs; read once).
static int moe2_warps(bool gate, int n) {
    static int w8 = -1;
    if (w8 < 0) w8 = env_on("STRATA_MOE_DOWN_W8");
    return !gate && n == 1 && !w8 ? ST_MOE2_DOWN_WARPS : ST_MOE2_WARPS;
}

// Whether the four-warp down kernel of type T holds its values in 96 registers (no spill).
template <int T, int P, bool HW = false> static bool moe2_down_fits(void) {
    static int fits = -1;
    if (fits < 0) {
        cudaFuncAttributes a;
        fits = cudaFuncGetAttributes(&a, moe2_down4_kernel<T, P, HW>) == cudaSuccess &&
               a.localSizeBytes <= 16;
        cudaGetLastError();
    }
    return fits;
}

// Whether the one-row eight-warp kernel of type T runs held to two blocks a multiprocessor (its
// plain kernel takes more than 128 registers a thread; STRATA_MOE_CAP2=0: never).
template <int T, bool GATE, int P> static bool moe2_cap2(void) {
    static int cap = -1;
    if (cap < 0) {
        cudaFuncAttributes a;
        cap = !env_is_0("STRATA_MOE_CAP2") && cudaFuncGetAttributes(&a, moe2_kernel<T, 1, GATE, P>) == cudaSuccess &&
              a.numRegs > 128;
        cudaGetLastError();
    }
    return cap;
}

// Row tiles a window's block computes (one row: 1). More rows a warp at once (4 gate/up pairs
// at 2-4 rows, 2 at 5-16) took 160-230 registers, one block a multiprocessor, and ran 11-25%
// slower (2026-12-01); tiles one after another keep the registers. STRATA_MOE2_TILES=N (1-16)
// for A/B runs (read once).
static int moe2_tiles(int n) {
    static int t = -1;
    if (t < 0) {
        const char *v = getenv("STRATA_MOE2_TILES");
        t = v ? atoi(v) : 4;
        t = t < 1 ? 1 : t > 16 ? 16 : t;
    }
    return n == 1 ? 1 : t;
}

template <int T, bool GATE> static void moe2_launch(st_cuda *c, const st_moe2_args &p, int n) {
    // Row pairs a warp computes (gate/up pairs, or 2P down rows): four at one row, one in
    // windows, whose blocks take p.tiles row tiles in turn instead (see moe2_tiles).
    constexpr int P1 = 4;
    int W = moe2_warps(GATE, n);
    bool hw = false; // the four-warp down kernel with half-warp rows (moe2_rows: HW)
    if constexpr (!GATE) {
        if (W == ST_MOE2_DOWN_WARPS && !moe2_down_fits<T, P1>()) W = ST_MOE2_WARPS;
        hw = W == ST_MOE2_DOWN_WARPS && p.cols <= 16 * 32 && !env_is_0("STRATA_MOE_HALF") && moe2_down_fits<T, P1, true>();
    }
    int rows_per_block = W * (GATE ? 1 : hw ? 4 : 2) * (n == 1 ? P1 : 1) * p.tiles;
    dim3 grid((unsigned)((p.rows + rows_per_block - 1) / rows_per_block), (unsigned)p.na);
    size_t smem = (size_t)p.gcap * p.cols + sizeof(float2) * (size_t)p.gcap * (p.cols / 32);
    if (n == 1) {
        auto k = GATE ? (moe2_cap2<T, GATE, P1>() ? moe2_cap2_kernel<T, GATE, P1> : moe2_kernel<T, 1, GATE, P1>)
               : hw ? moe2_down4_kernel<T, P1, true> : W == ST_MOE2_DOWN_WARPS ? moe2_down4_kernel<T, P1, false>
               : moe2_cap2<T, GATE, P1>() ? moe2_cap2_kernel<T, GATE, P1> : moe2_kernel<T, 1, GATE, P1>;
        st_moe2_args q = p;
        // The gate/up rows staged in shared memory (p.stage) where that leaves as many blocks a
        // multiprocessor as without (Q8_0's rows at 2,048 columns would halve them).
        q.stage = GATE && moe2_stages<T> && p.logits && p.stage;
        if (q.stage) {
            size_t s2 = moe2_tile_off(p) + (size_t)W * 2 * P1 * p.g_row_bytes;
            int b1 = st_resident_blocks(c, k, 32 * W, s2);
            q.stage = b1 > 0 && b1 >= st_resident_blocks(c, k, 32 * W, smem);
            if (q.stage) smem = s2;
        }
        q.bulk = q.stage && c->prop.major >= 9 && !env_is_0("STRATA_MOE_BULK");
        // The down kernel's combine in clusters of the k slots where they fit.
        if (!GATE && p.y)
            q.cluster = !env_is_0("STRATA_MOE_CLUSTER") && st_cluster_fits(c, k, dim3(1, p.na), grid, 32 * W, smem);
        q.counted = q.cluster && !env_is_0("STRATA_MOE_COUNTED");
        if (q.cluster) st_launch_cluster(c, dim3(1, p.na), k, grid, 32 * W, smem, q);
        else st_launch(c, k, grid, 32 * W, smem, q);
        ST_CU_LAUNCHED(c, "moe2_kernel");
        return;
    }
#define L(NX, PP) st_launch(c, moe2_kernel<T, NX, GATE, PP>, grid, 32 * ST_MOE2_WARPS, smem, p)
    if (n <= 4) L(4, 1);
    else L(16, 1);
#undef L
    ST_CU_LAUNCHED(c, "moe2_kernel");
}

// ids -> cache slots (slot_map; -1: not in this stack), counting the routed experts on the way.
__global__ void moe_map_kernel(const int32_t *ids, int na, int n_expert, const int32_t *slot_map, uint32_t *counts,
                               int32_t *out) {
    st_pdl_begin();
    int a = blockIdx.x * blockDim.x + threadIdx.x;
    if (a >= na) return;
    int e = ids[a];
    bool ok = e >= 0 && e < n_expert;
    if (ok && counts) atomicAdd(&counts[e], 1u);
    out[a] = !ok ? -1 : slot_map ? slot_map[e] : e;
}

// The router's expert count of a moe op (slot_map's length, else the stack's matrices).
static int moe_route_count(const st_moe_args *a) { return a->slot_map ? a->n_expert : (int)a->gate->n; }

// Whether moe_small2 applies: a window, quantized gate == up types and a quantized down, x
// 16-byte aligned, the rows in shared memory.
static bool moe2_fits(const st_moe_args *a) {
    const st_mat3 *gate = a->gate, *up = a->up, *down = a->down;
    int64_t d = gate->cols, F = gate->rows;
    return a->n <= ST_CUDA_GRAPH_ROWS && gate->n > 0 && !env_on("STRATA_CUQ_OLD") && gate->type == up->type &&
           !st_cuda_float_type(gate->type) && !st_cuda_float_type(down->type) && !((uintptr_t)a->x & 15) &&
           a->n * a->k <= ST_CUQ_PLAN_MAX && (a->n == 1 || moe_route_count(a) <= ST_MOE2_ROUTE_MAX) && d % 32 == 0 &&
           F % 32 == 0 && ST_MOE2_SMEM_MAX / (d + d / 4) >= 1 && ST_MOE2_SMEM_MAX / (F + F / 4) >= 1;
}

// Whether moe_small2's gate/up kernel routes a->logits itself (one row, a router it can rank).
static bool moe2_routes(const st_moe_args *a) {
    return a->logits && a->n == 1 && moe2_fits(a) && route_folds(moe_route_count(a), a->k) &&
           !env_on("STRATA_MOE_NOFOLD");
}

// The one-launch-per-matrix experts. False when they do not apply (the caller runs moe_small).
static bool moe_small2(st_cuda *c, const st_moe_args *a, bool *gated) {
    const st_mat3 *gate = a->gate, *up = a->up, *down = a->down;
    int n = a->n, k = a->k, na = n * k, E = (int)gate->n;
    int64_t d = gate->cols, F = gate->rows;
    if (!moe2_fits(a)) return false;
    int nxt = n == 1 ? 1 : n <= 4 ? 4 : 16;
    int cap_g = (int)(ST_MOE2_SMEM_MAX / (d + d / 4)), cap_d = (int)(ST_MOE2_SMEM_MAX / (F + F / 4));
    // MOE: h (na, F) | o (na, d) | one row: h quantized (na, F) | its {scale, sum} (na, F / 32)
    size_t h_b = align256(sizeof(float) * (size_t)na * F), o_b = align256(sizeof(float) * (size_t)na * d);
    size_t hq_b = align256((size_t)na * F);
    bool hq = n == 1 && !env_is_0("STRATA_MOE_HQ");
    char *m = (char *)st_cuda_scratch(c, ST_SCR_MOE, h_b + o_b + (hq ? hq_b + sizeof(float2) * (size_t)na * (F / 32) : 0));
    if (!m) return true; // error kept
    float *h = (float *)m, *o = (float *)(m + h_b);

    st_moe2_args p = {};
    p.ids = a->ids;
    p.slot_map = a->slot_map;
    p.n_route = moe_route_count(a);
    p.counts = a->counts;
    if (a->logits) { // moe2_routes(a)
        p.logits = a->logits;
        p.route_ids = (int32_t *)a->ids;
        p.route_w = (float *)a->weights;
    }
    p.rank_pairs = !env_is_0("STRATA_RANK_PAIRS");
    p.rank_first = !env_is_0("STRATA_MOE_RANK_FIRST");
    p.stage_all = env_on("STRATA_MOE_STAGE_ALL");
    const char *ahead = getenv("STRATA_MOE_AHEAD");
    p.ahead = p.stage_all ? ST_MOE2_STAGES : ahead ? atoi(ahead) : 1; // (stage_all waits for all at once)
    p.ahead = p.ahead < 1 ? 1 : p.ahead > ST_MOE2_STAGES ? ST_MOE2_STAGES : p.ahead;
    p.ask_landed = p.ahead == 1 && !env_is_0("STRATA_MOE_ASK_LANDED");
    p.xreg = p.rank_first && n == 1 && d / 32 <= 32 * ST_MOE2_WARPS / 4 && !env_is_0("STRATA_MOE_XREG");
    p.stage = p.rank_first && !env_is_0("STRATA_MOE_STAGE") && gate->row_bytes == up->row_bytes &&
              gate->row_bytes % 16 == 0 && gate->mat_bytes % 16 == 0 && up->mat_bytes % 16 == 0 &&
              ((uintptr_t)gate->data & 15) == 0 && ((uintptr_t)up->data & 15) == 0;
    p.na = na;
    p.k = k;
    p.n_expert = E;
    p.wg = (const uint8_t *)gate->data;
    p.wu = (const uint8_t *)up->data;
    p.g_row_bytes = gate->row_bytes;
    p.g_mat = gate->mat_bytes;
    p.u_row_bytes = up->row_bytes;
    p.u_mat = up->mat_bytes;
    p.rows = F;
    p.cols = (int)d;
    p.x = a->x;
    p.rdiv = k;
    p.gcap = cap_g < nxt ? cap_g : nxt;
    p.out = h;
    p.tiles = moe2_tiles(n);
    if (hq) p.hq = (int8_t *)(m + h_b + o_b), p.hds = (float2 *)(m + h_b + o_b + hq_b);
    switch (gate->type) {
#define CASE(T) case T: moe2_launch<T, true>(c, p, n); break;
        ST_CUQ_QUANT_TYPES(CASE)
#undef CASE
    default: break;
    }

    st_cuda_join_shared(c); // (the down kernel's combine adds the shared expert's output)
    st_moe2_args q = p;
    q.counts = NULL;
    // One row: the down kernel's blocks take their expert before they wait, where that is
    // cheap: the ids, or ranking at most ST_MOE2_EARLY_RANK logits. (H200, whole card: the
    // 30B-A3B shape's 128 logits +0.9-1.1% decode; the Next-80B-A3B's 512 -3.4%, its down
    // blocks became resident only ~2 us before their release, so the ranking was not hidden.)
    q.early = n == 1 && (!q.logits || q.n_route <= ST_MOE2_EARLY_RANK) && !env_on("STRATA_MOE_LATE");
    q.hint = n == 1 && q.logits && !q.early && !env_is_0("STRATA_MOE_HINT");
    q.wg = (const uint8_t *)down->data;
    q.wu = NULL;
    q.g_row_bytes = down->row_bytes;
    q.g_mat = down->mat_bytes;
    q.rows = d;
    q.cols = (int)F;
    q.x = h;
    q.rdiv = 1;
    q.gcap = cap_d < nxt ? cap_d : nxt;
    q.out = o;
    // The down kernel's last blocks combine (its row tiles: see moe2_launch), else a kernel does.
    int tile = moe2_warps(false, n) * 2 * (n == 1 ? 4 : 1) * p.tiles;
    bool fused = (d + tile - 1) / tile <= ST_MOE2_MAX_TILES;
    if (fused) q.y = a->y, q.wts = a->weights, q.add = a->accumulate, q.gated_o = a->gated_o, q.gated_s = a->gated_s;
    switch (down->type) {
#define CASE(T) case T: moe2_launch<T, false>(c, q, n); break;
        ST_CUQ_QUANT_TYPES(CASE)
#undef CASE
    default: break;
    }

    *gated = fused;
    if (fused) return true;
    int64_t ny = (int64_t)n * d;
    const int32_t *ids = a->ids;
    if (a->slot_map) { // the combine reads slots
        int32_t *mapped = (int32_t *)st_cuda_scratch(c, ST_SCR_MOEMAP, sizeof(int32_t) * (size_t)na);
        if (!mapped) return true;
        st_launch(c, moe_map_kernel, (unsigned)((na + 127) / 128), 128, 0, a->ids, na, a->n_expert, a->slot_map,
                  (uint32_t *)NULL, mapped);
        ST_CU_LAUNCHED(c, "moe_map_kernel");
        ids = mapped;
    }
    st_launch(c, moe_combine_kernel, (unsigned)((ny + 255) / 256), 256, 0, o, nullptr, ids, a->weights, n, k, E,
                                                                              (int)d, a->y, a->accumulate);
    ST_CU_LAUNCHED(c, "moe_combine_kernel");
    return true;
}

static void moe_small(st_cuda *c, const st_moe_args *a) {
    const st_mat3 *gate = a->gate, *up = a->up, *down = a->down;
    int n = a->n, k = a->k, na = n * k, E = (int)gate->n;
    int64_t d = gate->cols, F = gate->rows;
    if (na > ST_CUQ_PLAN_MAX) {
        CUQ_FAIL(c, "moe: %d assignments in a window (at most %d)", na, ST_CUQ_PLAN_MAX);
        return;
    }
    // MOE: plan, h (na, F), u (na, F) when gate and up differ, o (na, d).
    size_t plan_b = align256(sizeof(int) * (size_t)(3 * na + 2));
    size_t h_b = align256(sizeof(float) * (size_t)na * F), o_b = align256(sizeof(float) * (size_t)na * d);
    bool fused = gate->type == up->type;
    char *m = (char *)st_cuda_scratch(c, ST_SCR_MOE, plan_b + h_b * (fused ? 1 : 2) + o_b);
    if (!m) return;
    int *plan = (int *)m;
    float *h = (float *)(m + plan_b), *u = (float *)(m + plan_b + h_b);
    float *o = (float *)(m + plan_b + h_b * (fused ? 1 : 2));

    st_launch(c, moe_plan_kernel, 1, (na + 31) / 32 * 32, 0, a->ids, na, E, plan);
    ST_CU_LAUNCHED(c, "moe_plan_kernel");

    st_moe_small p = {};
    p.plan = plan;
    p.na = na;
    p.k = k;
    p.in.x = a->x;
    p.in.ldx = d;
    if (!st_cuda_float_type(gate->type) || !st_cuda_float_type(up->type)) {
        p.in.a = quantize_act(c, ST_SCR_ACT, a->x, n, (int)d);
        if (!p.in.a.q) return;
    }
    p.rows = F;
    p.cols = (int)d;
    if (fused) {
        p.wg = (const uint8_t *)gate->data;
        p.wu = (const uint8_t *)up->data;
        p.g_row_bytes = gate->row_bytes;
        p.g_mat = gate->mat_bytes;
        p.u_row_bytes = up->row_bytes;
        p.u_mat = up->mat_bytes;
        p.out = h;
        switch (gate->type) {
#define CASE(T) case T: moe_gate_up_launch<T>(c, p, n); break;
            ST_CUQ_QUANT_TYPES(CASE)
            CASE(ST_TYPE_F32) CASE(ST_TYPE_F16) CASE(ST_TYPE_BF16)
#undef CASE
        default: break;
        }
    } else {
        // Gate and up of different types (rare): two passes, then silu · up.
        st_moe_small q = p;
        q.wg = (const uint8_t *)gate->data;
        q.g_row_bytes = gate->row_bytes;
        q.g_mat = gate->mat_bytes;
        q.out = h;
        moe_mv_any(c, gate->type, q, n, true);
        q.wg = (const uint8_t *)up->data;
        q.g_row_bytes = up->row_bytes;
        q.g_mat = up->mat_bytes;
        q.out = u;
        moe_mv_any(c, up->type, q, n, true);
        int64_t nh = (int64_t)na * F;
        st_launch(c, silu_mul_kernel, (unsigned)((nh + 255) / 256), 256, 0, h, u, nh);
        ST_CU_LAUNCHED(c, "silu_mul_kernel");
    }

    // down over h (by assignment).
    st_moe_small q = p;
    q.in.x = h;
    q.in.ldx = F;
    q.in.a.q = NULL;
    if (!st_cuda_float_type(down->type)) {
        q.in.a = quantize_act(c, ST_SCR_MOE2, h, na, (int)F);
        if (!q.in.a.q) return;
    }
    q.wg = (const uint8_t *)down->data;
    q.g_row_bytes = down->row_bytes;
    q.g_mat = down->mat_bytes;
    q.rows = d;
    q.cols = (int)F;
    q.out = o;
    moe_mv_any(c, down->type, q, n, false);

    int64_t ny = (int64_t)n * d;
    st_launch(c, moe_combine_kernel, (unsigned)((ny + 255) / 256), 256, 0, o, nullptr, a->ids, a->weights, n, k, E,
                                                                              (int)d, a->y, a->accumulate);
    ST_CU_LAUNCHED(c, "moe_combine_kernel");
}

// ---------------------------------------------------------------------------------------------
// Routed experts, prompt chunks: group assignments by expert on the device, read the counts on
// the host, then per expert dequantized weights (many experts per dequant launch) and cuBLAS.

// One warp per expert: count[e] = assignments with id e.
__global__ void moe_count_kernel(const int32_t *ids, int na, int *count) {
    st_pdl_begin();
    int e = blockIdx.x, lane = threadIdx.x;
    int cnt = 0;
    for (int i0 = 0; i0 < na; i0 += 32) {
        int i = i0 + lane;
        cnt += __popc(__ballot_sync(0xffffffffu, i < na && ids[i] == e));
    }
    if (lane == 0) count[e] = cnt;
}

// One warp per expert: its start (sum of earlier counts), its index among used experts, and a
// stable scatter of its assignments: order[g] = assignment, inv[assignment] = g.
__global__ void moe_scatter_kernel(const int32_t *ids, int na, int n_expert, const int *count, int *start,
                                   int *used, int *order, int *inv) {
    st_pdl_begin();
    int e = blockIdx.x, lane = threadIdx.x;
    int s = 0, nu = 0;
    for (int i = lane; i < e; i += 32) {
        s += count[i];
        nu += count[i] > 0;
    }
    for (int o = 16; o > 0; o >>= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, o);
        nu += __shfl_xor_sync(0xffffffffu, nu, o);
    }
    if (lane == 0) {
        start[e] = s;
        if (count[e] > 0) used[nu] = e;
        if (e == n_expert - 1) start[n_expert] = s + count[e];
    }
    int pos = s;
    for (int i0 = 0; i0 < na; i0 += 32) {
        int i = i0 + lane;
        bool hit = i < na && ids[i] == e;
        unsigned mask = __ballot_sync(0xffffffffu, hit);
        if (hit) {
            int g = pos + __popc(mask & ((1u << lane) - 1));
            order[g] = i;
            inv[i] = g;
        }
        pos += __popc(mask);
    }
}

// How a prompt-chunk pass feeds its GEMM: f32 activations for F32 weights (exact SGEMM, also
// for float weights with padded rows, dequantized to f32), f16 / bf16 for F16 / BF16 weights
// used in place, bf16 for quantized weights.
enum st_in_kind { ST_IN_F32, ST_IN_F16, ST_IN_BF16 };

static st_in_kind pass_in(st_type t, int64_t cols, size_t row_bytes) {
    if (t == ST_TYPE_F16 && row_bytes == 2 * (size_t)cols) return ST_IN_F16;
    if (t == ST_TYPE_BF16 && row_bytes == 2 * (size_t)cols) return ST_IN_BF16;
    if (st_cuda_float_type(t)) return ST_IN_F32;
    return ST_IN_BF16;
}
static size_t in_size(st_in_kind k) { return k == ST_IN_F32 ? 4 : 2; }
static cudaDataType in_cuda(st_in_kind k) {
    return k == ST_IN_F32 ? CUDA_R_32F : k == ST_IN_F16 ? CUDA_R_16F : CUDA_R_16BF;
}

template <typename O> __device__ __forceinline__ O to_in(float v);
template <> __device__ __forceinline__ float to_in<float>(float v) { return v; }
template <> __device__ __forceinline__ __half to_in<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 to_in<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// xg (na, d) = x row of each grouped assignment, in the pass's input type.
template <typename O>
__global__ void moe_gather_kernel(const float *x, const int *order, int na, int k, int d, O *xg) {
    st_pdl_begin();
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (int64_t)na * d) return;
    int g = (int)(t / d), col = (int)(t % d);
    xg[t] = to_in<O>(x[(size_t)(order[g] / k) * d + col]);
}

template <typename O> __global__ void silu_mul_to_kernel(const float *g, const float *u, int64_t n, O *h) {
    st_pdl_begin();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = g[i];
    h[i] = to_in<O>(v / (1.0f + expf(-v)) * u[i]);
}

static void moe_gather(st_cuda *c, st_in_kind kind, const float *x, const int *order, int valid, int k, int d,
                       void *xg) {
    int64_t nx = (int64_t)valid * d;
    unsigned blocks = (unsigned)((nx + 255) / 256);
    if (kind == ST_IN_F32) st_launch(c, moe_gather_kernel<float>, blocks, 256, 0, x, order, valid, k, d, (float *)xg);
    else if (kind == ST_IN_F16) st_launch(c, moe_gather_kernel<__half>, blocks, 256, 0, x, order, valid, k, d, (__half *)xg);
    else st_launch(c, moe_gather_kernel<__nv_bfloat16>, blocks, 256, 0, x, order, valid, k, d, (__nv_bfloat16 *)xg);
    ST_CU_LAUNCHED(c, "moe_gather_kernel");
}

static void silu_mul_to(st_cuda *c, st_in_kind kind, const float *g, const float *u, int64_t n, void *h) {
    unsigned blocks = (unsigned)((n + 255) / 256);
    if (kind == ST_IN_F32) st_launch(c, silu_mul_to_kernel<float>, blocks, 256, 0, g, u, n, (float *)h);
    else if (kind == ST_IN_F16) st_launch(c, silu_mul_to_kernel<__half>, blocks, 256, 0, g, u, n, (__half *)h);
    else st_launch(c, silu_mul_to_kernel<__nv_bfloat16>, blocks, 256, 0, g, u, n, (__nv_bfloat16 *)h);
    ST_CU_LAUNCHED(c, "silu_mul_to_kernel");
}

static bool use_gmm(st_cuda *c) { return c->prop.major >= 8 && !env_on("STRATA_CUQ_OLD"); }

#define ST_CUQ_MAX_EXPERTS 1024

// The grouping a prompt chunk's passes share: per expert its count and first grouped row, the
// used experts (host and device), and the tile list of the tensor-core GEMM (device).
struct st_moe_groups {
    int count[ST_CUQ_MAX_EXPERTS], start[ST_CUQ_MAX_EXPERTS + 1], used[ST_CUQ_MAX_EXPERTS];
    int n_used;
    const int *used_dev;
    const int4 *tiles;
    int ntiles;
};

// out (grouped rows, w->rows) = xin (grouped rows, w->cols) · W_eᵀ per used expert.
static void moe_big_pass(st_cuda *c, const st_mat3 *w, const st_moe_groups *gr, bool gmm, const void *xin,
                         float *out) {
    int64_t rows = w->rows, cols = w->cols;
    st_in_kind kind = pass_in(w->type, cols, w->row_bytes);
    size_t esz = in_size(kind);
    cudaDataType xt = in_cuda(kind);
    if (!st_cuda_float_type(w->type) && gmm) {
        st_gmm_args g = {(const uint8_t *)w->data, w->row_bytes, w->mat_bytes, rows, (int)cols,
                         (const __nv_bfloat16 *)xin, out, rows, gr->tiles, 0, NULL, 0, 0, NULL};
        gmm_launch(c, w->type, g, gr->ntiles);
        return;
    }
    if (st_cuda_float_type(w->type) && (size_t)cols * st_type_get(w->type)->block_bytes == w->row_bytes) {
        // Float weights in place: one GEMM per expert with the weights' own type.
        for (int i = 0; i < gr->n_used; i++) {
            int e = gr->used[i];
            gemm(c, (const char *)w->data + (size_t)e * w->mat_bytes, xt, (const char *)xin + (size_t)gr->start[e] * cols * esz,
                 xt, out + (size_t)gr->start[e] * rows, rows, gr->count[e], cols, rows);
        }
        return;
    }
    // Dequantized copies of several experts at a time (bf16, or f32 for padded float rows).
    size_t mat_b = esz * (size_t)rows * cols;
    int per = (int)(ST_CUQ_DEQ_BYTES / mat_b);
    if (per < 1) per = 1;
    if (per > gr->n_used) per = gr->n_used;
    void *wb = st_cuda_scratch(c, ST_SCR_DEQ, mat_b * (size_t)per);
    if (!wb) return;
    for (int u0 = 0; u0 < gr->n_used; u0 += per) {
        int nb = gr->n_used - u0 < per ? gr->n_used - u0 : per;
        st_deq_src s = {(const uint8_t *)w->data, w->row_bytes, w->mat_bytes, rows, 0, gr->used_dev + u0, NULL, 0};
        if (kind == ST_IN_F32) dequant_launch(c, w->type, s, (int64_t)nb * rows, cols, (float *)wb);
        else dequant_launch(c, w->type, s, (int64_t)nb * rows, cols, (__nv_bfloat16 *)wb);
        for (int i = 0; i < nb; i++) {
            int e = gr->used[u0 + i];
            gemm(c, (const char *)wb + (size_t)i * mat_b, xt, (const char *)xin + (size_t)gr->start[e] * cols * esz, xt,
                 out + (size_t)gr->start[e] * rows, rows, gr->count[e], cols, rows);
        }
    }
}

static void moe_big(st_cuda *c, const st_moe_args *a) {
    const st_mat3 *gate = a->gate, *up = a->up, *down = a->down;
    int n = a->n, k = a->k, na = n * k, E = (int)gate->n;
    int64_t d = gate->cols, F = gate->rows;
    if (E > ST_CUQ_MAX_EXPERTS) {
        CUQ_FAIL(c, "moe: %d experts (at most %d)", E, ST_CUQ_MAX_EXPERTS);
        return;
    }
    st_in_kind kg = pass_in(gate->type, d, gate->row_bytes), ku = pass_in(up->type, d, up->row_bytes),
               kd = pass_in(down->type, F, down->row_bytes);
    // MOE: count E, start E+1, used E, order na, inv na | tiles (at most na / BN + E) | g (na, F)
    // | u (na, F) | o (na, d)
    int max_tiles = na / ST_GM_BN + E + 1;
    size_t ints_b = align256(sizeof(int) * (size_t)(3 * E + 1 + 2 * na));
    size_t tiles_b = align256(sizeof(int4) * (size_t)max_tiles);
    size_t gf_b = align256(sizeof(float) * (size_t)na * F), o_b = align256(sizeof(float) * (size_t)na * d);
    char *m = (char *)st_cuda_scratch(c, ST_SCR_MOE, ints_b + tiles_b + 2 * gf_b + o_b);
    // MOE2: x for gate (na, d) | x for up when its input type differs | h (na, F)
    size_t xg_b = align256(in_size(kg) * (size_t)na * d), xu_b = ku != kg ? align256(in_size(ku) * (size_t)na * d) : 0;
    char *m2 = (char *)st_cuda_scratch(c, ST_SCR_MOE2, xg_b + xu_b + in_size(kd) * (size_t)na * F);
    if (!m || !m2) return;
    int *count_d = (int *)m, *start_d = count_d + E, *used_d = start_d + E + 1, *order = used_d + E, *inv = order + na;
    int4 *tiles_d = (int4 *)(m + ints_b);
    float *g = (float *)(m + ints_b + tiles_b), *u = (float *)(m + ints_b + tiles_b + gf_b);
    float *o = (float *)(m + ints_b + tiles_b + 2 * gf_b);
    void *xg = m2, *xu = ku != kg ? (void *)(m2 + xg_b) : xg, *h = m2 + xg_b + xu_b;

    ST_CU(c, cudaMemsetAsync(inv, 0xff, sizeof(int) * (size_t)na, c->stream)); // -1: dropped ids
    st_launch(c, moe_count_kernel, E, 32, 0, a->ids, na, count_d);
    ST_CU_LAUNCHED(c, "moe_count_kernel");
    st_launch(c, moe_scatter_kernel, E, 32, 0, a->ids, na, E, count_d, start_d, used_d, order, inv);
    ST_CU_LAUNCHED(c, "moe_scatter_kernel");
    st_moe_groups gr;
    ST_CU(c, cudaMemcpyAsync(gr.count, count_d, sizeof(int) * (size_t)E, cudaMemcpyDeviceToHost, c->stream));
    ST_CU(c, cudaStreamSynchronize(c->stream));
    if (c->err) return;
    int pos = 0;
    gr.n_used = 0;
    for (int e = 0; e < E; e++) {
        gr.start[e] = pos;
        pos += gr.count[e];
        if (gr.count[e]) gr.used[gr.n_used++] = e;
    }
    int valid = pos;
    if (valid == 0) {
        if (!a->accumulate) ST_CU(c, cudaMemsetAsync(a->y, 0, sizeof(float) * (size_t)n * d, c->stream));
        return;
    }
    gr.used_dev = used_d;
    gr.tiles = tiles_d;
    gr.ntiles = 0;
    bool gmm = use_gmm(c);
    if (gmm) {
        // Tiles of up to ST_GM_BN grouped rows, expert by expert (neighbouring blocks share an
        // expert's weights in L2). Built here in pieces; a pageable copy is staged before
        // cudaMemcpyAsync returns, so the piece buffer can be refilled at once.
        int4 piece[256];
        int np = 0;
        for (int i = 0; i < gr.n_used; i++) {
            int e = gr.used[i], end = gr.start[e] + gr.count[e];
            for (int x0 = gr.start[e]; x0 < end; x0 += ST_GM_BN) {
                if (np == 256) {
                    ST_CU(c, cudaMemcpyAsync(tiles_d + gr.ntiles, piece, sizeof piece, cudaMemcpyHostToDevice, c->stream));
                    gr.ntiles += np;
                    np = 0;
                }
                piece[np++] = make_int4(e, x0, end - x0 < ST_GM_BN ? end - x0 : ST_GM_BN, 0);
            }
        }
        if (np > 0) {
            ST_CU(c, cudaMemcpyAsync(tiles_d + gr.ntiles, piece, sizeof(int4) * (size_t)np, cudaMemcpyHostToDevice,
                                     c->stream));
            gr.ntiles += np;
        }
    }

    moe_gather(c, kg, a->x, order, valid, k, (int)d, xg);
    if (ku != kg) moe_gather(c, ku, a->x, order, valid, k, (int)d, xu);
    if (gmm && gate->type == up->type && !st_cuda_float_type(gate->type) && kd == ST_IN_BF16) {
        // Gate and up in one launch, h = silu(gate) · up written as bf16 by the GEMM.
        st_gmm_args gg = {(const uint8_t *)gate->data, gate->row_bytes, gate->mat_bytes, F, (int)d,
                          (const __nv_bfloat16 *)xg, NULL, F, gr.tiles, 0,
                          (const uint8_t *)up->data, up->row_bytes, up->mat_bytes, (__nv_bfloat16 *)h};
        gmm_launch(c, gate->type, gg, gr.ntiles);
    } else {
        moe_big_pass(c, gate, &gr, gmm, xg, g);
        moe_big_pass(c, up, &gr, gmm, xu, u);
        silu_mul_to(c, kd, g, u, (int64_t)valid * F, h);
    }
    moe_big_pass(c, down, &gr, gmm, h, o);

    int64_t ny = (int64_t)n * d;
    st_launch(c, moe_combine_kernel, (unsigned)((ny + 255) / 256), 256, 0, o, inv, a->ids, a->weights, n, k, E,
                                                                              (int)d, a->y, a->accumulate);
    ST_CU_LAUNCHED(c, "moe_combine_kernel");
}


static void moe_dispatch(st_cuda *c, const st_moe_args *a, bool *gated);

// y = the routed experts' sum (+ y with accumulate) (+ the shared expert's gated output: the
// one-row down kernel adds it in its combine, else add_gated_rows after).
void st_cuda_moe(st_backend *b, const st_moe_args *a) {
    st_cuda *c = st_cuda_of(b);
    bool gated = false;
    moe_dispatch(c, a, &gated);
    if (a->gated_o && !gated && !c->err) st_cuda_add_gated_rows(b, a->y, a->gated_o, a->gated_s, a->n, (int)a->gate->cols);
    st_cuda_join_shared(c); // (a no-op where the output was read above; else ready for the ops after)
}

static void moe_dispatch(st_cuda *c, const st_moe_args *a, bool *gated) {
    st_backend *b = &c->base;
    if (a->n <= 0 || c->err) return;
    const st_mat3 *g = a->gate, *u = a->up, *dn = a->down;
    if (g->n > 0) {
        if (a->k <= 0 || g->cols != u->cols || g->rows != u->rows || g->n != u->n || dn->n != g->n ||
            dn->cols != g->rows || dn->rows != g->cols) {
            CUQ_FAIL(c, "moe: layer %d: mismatched expert shapes", a->layer);
            return;
        }
        if (!check_mat(c, "moe gate", g->type, g->cols, g->rows, g->data, g->row_bytes) ||
            !check_mat(c, "moe up", u->type, u->cols, u->rows, u->data, u->row_bytes) ||
            !check_mat(c, "moe down", dn->type, dn->cols, dn->rows, dn->data, dn->row_bytes) || !quant_tables(c))
            return;
        // Activations are quantized in blocks of 32 along d (gate, up) and F (down).
        if ((!st_cuda_float_type(g->type) && g->cols % 32) || (!st_cuda_float_type(dn->type) && dn->cols % 32)) {
            CUQ_FAIL(c, "moe: layer %d: sizes not multiples of 32", a->layer);
            return;
        }
    }
    st_moe_args routed;
    if (a->logits && !moe2_routes(a)) { // the router's own kernel first
        st_cuda_moe_route(b, a->logits, a->n, moe_route_count(a), a->k, (int32_t *)a->ids, (float *)a->weights);
        routed = *a;
        routed.logits = NULL;
        a = &routed;
    }
    // Windows: two launches that map and count the ids themselves.
    if (g->n > 0 && moe_small2(c, a, gated)) return;
    st_moe_args mapped;
    if (a->slot_map || a->counts) {
        int na = a->n * a->k, E = a->slot_map ? a->n_expert : (int)a->gate->n;
        int32_t *ids = (int32_t *)st_cuda_scratch(c, ST_SCR_MOEMAP, sizeof(int32_t) * (size_t)na);
        if (!ids) return;
        st_launch(c, moe_map_kernel, (unsigned)((na + 127) / 128), 128, 0, a->ids, na, E, a->slot_map, a->counts, ids);
        ST_CU_LAUNCHED(c, "moe_map_kernel");
        mapped = *a;
        mapped.ids = ids;
        mapped.slot_map = NULL;
        mapped.counts = NULL;
        a = &mapped;
    }
    if (g->n == 0) { // an empty cache stack: nothing here
        if (!a->accumulate) ST_CU(c, cudaMemsetAsync(a->y, 0, sizeof(float) * (size_t)a->n * a->gate->cols, c->stream));
        return;
    }
    if (a->n <= ST_CUDA_GRAPH_ROWS) {
        moe_small(c, a);
    } else {
        if (c->capturing) {
            CUQ_FAIL(c, "moe of %d rows while recording a graph (at most %d)", a->n, ST_CUDA_GRAPH_ROWS);
            return;
        }
        moe_big(c, a);
    }
}


// STRATA_CUDA_TRACE: binds this file's copy of st_trace (cuda_common.cuh).
cudaError_t st_trace_bind_quant(const st_trace_dev *t) { return st_trace_bind_unit(t); }
