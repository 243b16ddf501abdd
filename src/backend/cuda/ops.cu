// backend/cuda: the small ops (norms, RoPE, conv, element-wise, DeltaNet gates, column copies,
// the MoE router and argmax), each a kernel plus its launcher, with cpu.c's math (expf, IEEE
// division; no fast-math intrinsics) so results match the CPU up to summation order.

#include <float.h>
#include <math.h>
#include <stdlib.h>

#include <cooperative_groups.h>

#include "backend/cuda/cuda_common.cuh"

namespace cg = cooperative_groups;

// ---------------------------------------------------------------------------------------------
// Reductions

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// (value, index) pairs: a beats b when larger, or equal with a lower index (the CPU's first max).
// idx < 0 marks "no candidate".
__device__ __forceinline__ void argmax_merge(float &v, int &i, float ov, int oi) {
    if (oi >= 0 && (i < 0 || ov > v || (ov == v && oi < i))) v = ov, i = oi;
}

__device__ __forceinline__ void warp_argmax(float &v, int &i) {
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        argmax_merge(v, i, ov, oi);
    }
}


// Grid size for a grid-stride loop over n items of 256 threads each (capped: the loop covers
// the rest).
static unsigned grid_for(int64_t n) {
    int64_t b = (n + 255) / 256;
    return (unsigned)(b < 1 ? 1 : b > 65535 ? 65535 : b);
}

// ---------------------------------------------------------------------------------------------
// Norms

// One warp per row (short rows: head-sized norms over thousands of rows). With gate, each value
// is then multiplied by silu(gate) as mul_silu does (rmsnorm_silu).
__global__ void rmsnorm_warp_kernel(const float *x, const float *w, const float *gate, float *y, int n, int d,
                                    float eps) {
    st_pdl_begin();
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= n) return;
    const float *xr = x + (size_t)row * d;
    float ss = 0;
    for (int j = lane; j < d; j += 32) ss += xr[j] * xr[j];
    ss = warp_sum(ss);
    float s = 1.0f / sqrtf(ss / d + eps);
    float *yr = y + (size_t)row * d;
    const float *gr = gate ? gate + (size_t)row * d : NULL;
    for (int j = lane; j < d; j += 32) {
        float v = xr[j] * s * (w ? w[j] : 1.0f);
        if (gr) v *= gr[j] / (1.0f + expf(-gr[j]));
        yr[j] = v;
    }
}

// One block per row (model-width rows), optionally with the residual add before it (y != NULL:
// xo = x + y is written, xo may alias x), then normalized: rms_row.
__global__ void rmsnorm_row_kernel(const float *x, const float *y, float *xo, const float *w, float *out, int d,
                                   float eps, bool vec4) {
    st_pdl_begin();
    size_t off = (size_t)blockIdx.x * d;
    rms_row(x + off, y ? y + off : NULL, y ? xo + off : NULL, w, out + off, d, eps, vec4);
}

static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

void st_cuda_rmsnorm_silu(st_backend *b, const float *x, const float *w, const float *gate, float *y, int n, int d,
                          float eps) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0 || d <= 0) return;
    const char *split = getenv("STRATA_GATED_NORM_SPLIT"); // (two kernels, for measuring)
    if (d < 1024 && !(split && split[0] == '1')) {
        st_launch(c, rmsnorm_warp_kernel, (n + 7) / 8, 256, 0, x, w, gate, y, n, d, eps);
        ST_CU_LAUNCHED(c, "rmsnorm_silu");
        return;
    }
    st_cuda_rmsnorm(b, x, w, y, n, d, eps);
    st_cuda_mul_silu(b, y, gate, (int64_t)n * d);
}

static void rmsnorm_rows(st_cuda *c, const float *x, const float *y, float *xo, const float *w, float *out, int n,
                         int d, float eps) {
    bool vec4 = (d & 3) == 0 && aligned16(x) && (!y || (aligned16(y) && aligned16(xo))) && aligned16(out) &&
                (!w || aligned16(w));
    st_launch(c, rmsnorm_row_kernel, n, st_rms_threads(d), 0, x, y, xo, w, out, d, eps, vec4);
}

void st_cuda_rmsnorm(st_backend *b, const float *x, const float *w, float *y, int n, int d, float eps) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0 || d <= 0) return;
    // Short rows (head-sized norms over many rows): a warp each. x is only read below (no y).
    if (d < 1024) st_launch(c, rmsnorm_warp_kernel, (n + 7) / 8, 256, 0, x, w, (const float *)NULL, y, n, d, eps);
    else rmsnorm_rows(c, x, NULL, NULL, w, y, n, d, eps);
    ST_CU_LAUNCHED(c, "rmsnorm");
}

void st_cuda_add_rmsnorm(st_cuda *c, const float *x, const float *y, float *xo, const float *w, float *xn, int n,
                         int d, float eps) {
    if (n <= 0 || d <= 0) return;
    rmsnorm_rows(c, x, y, xo, w, xn, n, d, eps);
    ST_CU_LAUNCHED(c, "add_rmsnorm");
}

__global__ void l2norm_kernel(float *x, int n, int d, float eps, float scale) {
    st_pdl_begin();
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= n) return;
    float *xr = x + (size_t)row * d;
    float ss = 0;
    for (int j = lane; j < d; j += 32) ss += xr[j] * xr[j];
    float norm = sqrtf(warp_sum(ss));
    float s = scale / (norm > eps ? norm : eps);
    for (int j = lane; j < d; j += 32) xr[j] *= s;
}

void st_cuda_l2norm(st_backend *b, float *x, int n, int d, float eps, float scale) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0 || d <= 0) return;
    st_launch(c, l2norm_kernel, (n + 7) / 8, 256, 0, x, n, d, eps, scale);
    ST_CU_LAUNCHED(c, "l2norm");
}

// ---------------------------------------------------------------------------------------------
// RoPE: block (row i, group of heads), a thread per rotated pair. The angles are computed in
// double as the CPU does (positions reach tens of thousands of radians, where float angles would
// be off by 1e-3), once per block into shared memory. Several heads per block so a decode row
// spreads over a few blocks instead of looping in one.
#define ROPE_THREADS 256

__global__ void rope_kernel(float *x, int n_head, int head_dim, int n_rot, const int32_t *pos, float base, int hpb) {
    st_pdl_begin();
    extern __shared__ float cs[]; // (half) cos, then (half) sin
    int i = blockIdx.x, half = n_rot / 2;
    int h0 = blockIdx.y * hpb, nh = min(n_head - h0, hpb);
    // This thread's first pair is loaded before the angles are computed (the loads fly meanwhile).
    int e0 = threadIdx.x, k0 = e0 % half;
    bool first = e0 < nh * half;
    float *xh0 = x + ((size_t)i * n_head + h0 + (first ? e0 / half : 0)) * head_dim;
    float a0 = first ? xh0[k0] : 0.0f, a1 = first ? xh0[k0 + half] : 0.0f;
    double p = (double)pos[i];
    for (int k = threadIdx.x; k < half; k += blockDim.x) {
        double sn, cn;
        sincos(p * pow((double)base, -2.0 * k / n_rot), &sn, &cn);
        cs[k] = (float)cn;
        cs[half + k] = (float)sn;
    }
    __syncthreads();
    if (first) {
        float c = cs[k0], s = cs[half + k0];
        xh0[k0] = a0 * c - a1 * s;
        xh0[k0 + half] = a1 * c + a0 * s;
    }
    for (int e = threadIdx.x + blockDim.x; e < nh * half; e += blockDim.x) {
        int h = h0 + e / half, k = e % half;
        float *xh = x + ((size_t)i * n_head + h) * head_dim;
        float c = cs[k], s = cs[half + k];
        float x0 = xh[k], x1 = xh[k + half];
        xh[k] = x0 * c - x1 * s;
        xh[k + half] = x1 * c + x0 * s;
    }
}

void st_cuda_rope(st_backend *b, float *x, int n, int n_head, int head_dim, int n_rot,
                  const int32_t *pos, float base) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0 || n_head <= 0 || n_rot < 2) return;
    int half = n_rot / 2, hpb = half >= ROPE_THREADS ? 1 : ROPE_THREADS / half;
    dim3 grid((unsigned)n, (unsigned)((n_head + hpb - 1) / hpb));
    st_launch(c, rope_kernel, grid, ROPE_THREADS, sizeof(float) * 2 * (size_t)half, x, n_head, head_dim, n_rot, pos,
                                                                                     base, hpb);
    ST_CU_LAUNCHED(c, "rope");
}

// Per-head rmsnorm then rope (Qwen3's q / k norms), one kernel: block (row i, group of heads),
// a warp per head. The head's values are loaded into registers first (in flight while the
// row's angles are computed, in double as rope_kernel does), normalized into shared memory (the
// same float rounding as rmsnorm writing x, then rope reading it), then rotated.
#define NORM_ROPE_WARPS 8
#define NORM_ROPE_EPL 8 // values per lane in registers: head_dim up to 256

// Two head sets in one launch (q and k): blocks y >= groups1 work on x2 (n_head2 heads, w2).
// Head h of row i of x is at x + (i * n_head + h) * x_hs: x_hs = head_dim for (n, n_head,
// head_dim), 2 head_dim for the gated attention's queries (each followed by its gate, untouched);
// x2's heads are contiguous.
__global__ void norm_rope_kernel(float *x, const float *w, int n_head, int head_dim, int n_rot, const int32_t *pos,
                                 float base, float eps, float *x2, const float *w2, int n_head2, int groups1,
                                 int x_hs) {
    st_pdl_begin();
    extern __shared__ float sm[]; // (n_rot/2) cos, (n_rot/2) sin, then (warps, head_dim) heads
    int i = blockIdx.x, half = n_rot / 2, lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    float *cs = sm, *hs = sm + 2 * half + wp * head_dim;
    int grp = blockIdx.y;
    if (grp >= groups1) x = x2, w = w2, n_head = n_head2, grp -= groups1, x_hs = head_dim;
    int h = grp * NORM_ROPE_WARPS + wp;
    bool live = h < n_head; // whole warps
    float *xh = x + ((size_t)i * n_head + (live ? h : 0)) * x_hs;
    float v[NORM_ROPE_EPL];
#pragma unroll
    for (int k = 0; k < NORM_ROPE_EPL; k++) {
        int j = lane + 32 * k;
        v[k] = live && j < head_dim ? xh[j] : 0.0f;
    }
    double p = (double)pos[i];
    for (int k = threadIdx.x; k < half; k += blockDim.x) {
        double sn, cn;
        sincos(p * pow((double)base, -2.0 * k / n_rot), &sn, &cn);
        cs[k] = (float)cn;
        cs[half + k] = (float)sn;
    }
    float ss = 0;
#pragma unroll
    for (int k = 0; k < NORM_ROPE_EPL; k++) ss += v[k] * v[k];
    ss = warp_sum(ss);
    float s = 1.0f / sqrtf(ss / head_dim + eps);
#pragma unroll
    for (int k = 0; k < NORM_ROPE_EPL; k++) {
        int j = lane + 32 * k;
        if (live && j < head_dim) hs[j] = v[k] * s * (w ? w[j] : 1.0f);
    }
    __syncthreads(); // the angles and this warp's head are ready
    if (!live) return;
    for (int k = lane; k < half; k += 32) {
        float c = cs[k], sn = cs[half + k], x0 = hs[k], x1 = hs[k + half];
        // The contractions written out, as the fused attention's attn_norm_rope writes them (the
        // ones ptxas had chosen here): the two kernels' values must not rest on its choice.
        xh[k] = __fmaf_rn(x0, c, -__fmul_rn(x1, sn));
        xh[k + half] = __fmaf_rn(x0, sn, __fmul_rn(x1, c));
    }
    for (int j = 2 * half + lane; j < head_dim; j += 32) xh[j] = hs[j];
}

// x (n_head heads, x_hs floats apart as norm_rope_kernel's) and, when x2 is given, x2 (n_head2
// heads) in one launch.
static void norm_rope2(st_backend *b, float *x, const float *w, int n_head, int x_hs, float *x2, const float *w2,
                       int n_head2, int n, int head_dim, int n_rot, const int32_t *pos, float base, float eps) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0 || head_dim <= 0) return;
    // Nothing to rotate, or a head too large: two kernels, for contiguous heads. Strided heads (the
    // gated attention's queries) always take the one kernel, which rotates nothing at n_rot < 2
    // too; the attention op takes heads of up to 256 values.
    if (x_hs != head_dim && head_dim > 32 * NORM_ROPE_EPL) {
        st_cuda_fail_msg(c, __FILE__, __LINE__, "norm_rope: heads of %d values %d apart: unsupported", head_dim, x_hs);
        return;
    }
    if ((n_rot < 2 && x_hs == head_dim) || head_dim > 32 * NORM_ROPE_EPL) {
        st_cuda_rmsnorm(b, x, w, x, n * n_head, head_dim, eps);
        st_cuda_rope(b, x, n, n_head, head_dim, n_rot, pos, base);
        if (x2) norm_rope2(b, x2, w2, n_head2, head_dim, NULL, NULL, 0, n, head_dim, n_rot, pos, base, eps);
        return;
    }
    if (!x2) n_head2 = 0;
    int groups = (n_head + NORM_ROPE_WARPS - 1) / NORM_ROPE_WARPS, groups2 = (n_head2 + NORM_ROPE_WARPS - 1) / NORM_ROPE_WARPS;
    int most = n_head > n_head2 ? n_head : n_head2;
    int warps = most < NORM_ROPE_WARPS ? most : NORM_ROPE_WARPS;
    size_t smem = sizeof(float) * ((size_t)2 * (n_rot / 2) + (size_t)warps * head_dim);
    st_launch(c, norm_rope_kernel, dim3(n, groups + groups2), 32 * warps, smem, x, w, n_head, head_dim, n_rot, pos,
              base, eps, x2, w2, n_head2, groups, x_hs);
    ST_CU_LAUNCHED(c, "norm_rope");
}

void st_cuda_norm_rope(st_backend *b, float *x, const float *w, int n, int n_head, int head_dim, int n_rot,
                       const int32_t *pos, float base, float eps) {
    if (n_head > 0) norm_rope2(b, x, w, n_head, head_dim, NULL, NULL, 0, n, head_dim, n_rot, pos, base, eps);
}

void st_cuda_norm_rope_qk(st_backend *b, const st_attn_args *a) {
    int D = a->kv->head_dim;
    norm_rope2(b, a->q, a->q_norm, a->n_head, a->gated ? 2 * D : D, a->k, a->k_norm, a->kv->n_head_kv, a->n, D,
               a->n_rot, a->pos, a->rope_base, a->eps);
}

// ---------------------------------------------------------------------------------------------
// Depthwise causal conv + SiLU. Outputs first (every (row, channel) in parallel, reading the
// old state), then the state update in a second kernel, so no output reads a state row that was
// already replaced.
__global__ void conv_kernel(st_conv_args a) {
    st_pdl_begin();
    int C = a.channels, K = a.kernel;
    int64_t total = (int64_t)a.n * C;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
        int t = (int)(e / C), ch = (int)(e % C);
        float s = 0;
        for (int j = 0; j < K; j++) {
            int src = t - (K - 1) + j; // < 0: from the state
            float xv = src >= 0 ? a.x[(size_t)src * C + ch] : a.state[(size_t)(K - 1 + src) * C + ch];
            s += a.w[(size_t)ch * K + j] * xv;
        }
        a.y[e] = s / (1.0f + expf(-s));
    }
}

// The new state is the last K-1 raw rows of [state; x]. Ascending r reads old row n + r > r
// (when it comes from the state), which is not yet overwritten: safe in place, per channel.
__global__ void conv_state_kernel(st_conv_args a) {
    st_pdl_begin();
    int C = a.channels, K = a.kernel;
    for (int ch = blockIdx.x * blockDim.x + threadIdx.x; ch < C; ch += gridDim.x * blockDim.x)
        for (int r = 0; r < K - 1; r++) {
            int src = a.n - (K - 1) + r;
            a.state[(size_t)r * C + ch] = src >= 0 ? a.x[(size_t)src * C + ch] : a.state[(size_t)(K - 1 + src) * C + ch];
        }
}

// Decode / verify windows: a thread per channel computes its n outputs from the old state, then
// shifts that channel's state (the same arithmetic as the two kernels above, in one launch).
__global__ void conv_window_kernel(st_conv_args a) {
    st_pdl_begin();
    int C = a.channels, K = a.kernel;
    for (int ch = blockIdx.x * blockDim.x + threadIdx.x; ch < C; ch += gridDim.x * blockDim.x) {
        const float *w = a.w + (size_t)ch * K;
        for (int t = 0; t < a.n; t++) {
            float s = 0;
            for (int j = 0; j < K; j++) {
                int src = t - (K - 1) + j;
                float xv = src >= 0 ? a.x[(size_t)src * C + ch] : a.state[(size_t)(K - 1 + src) * C + ch];
                s += w[j] * xv;
            }
            a.y[(size_t)t * C + ch] = s / (1.0f + expf(-s));
        }
        for (int r = 0; r < K - 1; r++) {
            int src = a.n - (K - 1) + r;
            a.state[(size_t)r * C + ch] = src >= 0 ? a.x[(size_t)src * C + ch] : a.state[(size_t)(K - 1 + src) * C + ch];
        }
    }
}

void st_cuda_conv(st_backend *b, const st_conv_args *a) {
    st_cuda *c = st_cuda_of(b);
    if (a->n <= 0 || a->channels <= 0) return;
    if (a->n <= ST_CUDA_GRAPH_ROWS) {
        st_launch(c, conv_window_kernel, (a->channels + 127) / 128, 128, 0, *a);
        ST_CU_LAUNCHED(c, "conv");
        return;
    }
    st_launch(c, conv_kernel, grid_for((int64_t)a->n * a->channels), 256, 0, *a);
    ST_CU_LAUNCHED(c, "conv");
    if (a->kernel > 1) {
        st_launch(c, conv_state_kernel, grid_for(a->channels), 256, 0, *a);
        ST_CU_LAUNCHED(c, "conv state");
    }
}

// ---------------------------------------------------------------------------------------------
// Element-wise

#define GRID_STRIDE(i, n) \
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

__global__ void add_kernel(float *y, const float *x, int64_t n) {
    st_pdl_begin();
    GRID_STRIDE(i, n) y[i] += x[i];
}

__global__ void swiglu_kernel(const float *gate, const float *up, float *y, int64_t n) {
    st_pdl_begin();
    GRID_STRIDE(i, n) y[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

__global__ void mul_sigmoid_kernel(float *y, const float *gate, int64_t n) {
    st_pdl_begin();
    GRID_STRIDE(i, n) y[i] *= sigmoidf_(gate[i]);
}

__global__ void mul_silu_kernel(float *y, const float *gate, int64_t n) {
    st_pdl_begin();
    GRID_STRIDE(i, n) y[i] *= gate[i] / (1.0f + expf(-gate[i]));
}

void st_cuda_add(st_backend *b, float *y, const float *x, int64_t n) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0) return;
    st_launch(c, add_kernel, grid_for(n), 256, 0, y, x, n);
    ST_CU_LAUNCHED(c, "add");
}

void st_cuda_swiglu(st_backend *b, const float *gate, const float *up, float *y, int64_t n) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0) return;
    st_launch(c, swiglu_kernel, grid_for(n), 256, 0, gate, up, y, n);
    ST_CU_LAUNCHED(c, "swiglu");
}

void st_cuda_mul_sigmoid(st_backend *b, float *y, const float *gate, int64_t n) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0) return;
    st_launch(c, mul_sigmoid_kernel, grid_for(n), 256, 0, y, gate, n);
    ST_CU_LAUNCHED(c, "mul_sigmoid");
}

void st_cuda_mul_silu(st_backend *b, float *y, const float *gate, int64_t n) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0) return;
    st_launch(c, mul_silu_kernel, grid_for(n), 256, 0, y, gate, n);
    ST_CU_LAUNCHED(c, "mul_silu");
}

__global__ void add_gated_rows_kernel(float *y, const float *x, const float *g, int n, int d) {
    st_pdl_begin();
    int64_t total = (int64_t)n * d;
    GRID_STRIDE(e, total) y[e] += sigmoidf_(g[e / d]) * x[e];
}

void st_cuda_add_gated_rows(st_backend *b, float *y, const float *x, const float *g, int n, int d) {
    st_cuda *c = st_cuda_of(b);
    st_cuda_join_shared(c); // (x and g: the shared expert's output, perhaps on the side stream)
    if (n <= 0 || d <= 0) return;
    st_launch(c, add_gated_rows_kernel, grid_for((int64_t)n * d), 256, 0, y, x, g, n, d);
    ST_CU_LAUNCHED(c, "add_gated_rows");
}

__global__ void gdn_gates_kernel(const float *ba, const float *ssm_a, const float *dt_bias, float *beta,
                                 float *g, int n, int h_k, int h_v) {
    st_pdl_begin();
    int r = h_v / h_k;
    int64_t total = (int64_t)n * h_v;
    GRID_STRIDE(e, total) {
        int i = (int)(e / h_v), j = (int)(e % h_v), grp = j / r, w = j % r;
        const float *row = ba + (size_t)i * 2 * h_v;
        float bj = row[grp * 2 * r + w], aj = row[grp * 2 * r + r + w];
        beta[e] = sigmoidf_(bj);
        g[e] = ssm_a[j] * softplusf_(aj + dt_bias[j]);
    }
}

void st_cuda_gdn_gates(st_backend *b, const float *ba, const float *ssm_a, const float *dt_bias,
                       float *beta, float *g, int n, int h_k, int h_v) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0 || h_v <= 0) return;
    st_launch(c, gdn_gates_kernel, grid_for((int64_t)n * h_v), 256, 0, ba, ssm_a, dt_bias, beta, g, n, h_k, h_v);
    ST_CU_LAUNCHED(c, "gdn_gates");
}

// ---------------------------------------------------------------------------------------------
// Copies

__global__ void split_heads_kernel(const float *x, float *ya, float *yb, int64_t rows, int a, int bdim) {
    st_pdl_begin();
    int w = a + bdim;
    int64_t total = rows * w;
    GRID_STRIDE(e, total) {
        int64_t i = e / w;
        int col = (int)(e % w);
        if (col < a) ya[i * a + col] = x[e];
        else yb[i * bdim + col - a] = x[e];
    }
}

void st_cuda_split_heads(st_backend *b, const float *x, float *ya, float *yb, int n, int heads, int a,
                         int bdim) {
    st_cuda *c = st_cuda_of(b);
    int64_t rows = (int64_t)n * heads;
    if (rows <= 0 || a + bdim <= 0) return;
    st_launch(c, split_heads_kernel, grid_for(rows * (a + bdim)), 256, 0, x, ya, yb, rows, a, bdim);
    ST_CU_LAUNCHED(c, "split_heads");
}

// blockIdx.y strides over rows, x over columns.
__global__ void copy_cols_kernel(const float *x, int64_t ldx, float *y, int64_t ldy, int n, int64_t w) {
    st_pdl_begin();
    for (int i = blockIdx.y; i < n; i += gridDim.y) {
        const float *xr = x + (size_t)i * ldx;
        float *yr = y + (size_t)i * ldy;
        for (int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; j < w; j += (int64_t)gridDim.x * blockDim.x)
            yr[j] = xr[j];
    }
}

void st_cuda_copy_cols(st_backend *b, const float *x, int64_t ldx, int64_t x_from, float *y, int64_t ldy,
                       int64_t y_from, int n, int64_t w) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0 || w <= 0) return;
    int64_t bx = (w + 255) / 256;
    dim3 grid((unsigned)(bx > 1024 ? 1024 : bx), (unsigned)(n > 65535 ? 65535 : n));
    st_launch(c, copy_cols_kernel, grid, 256, 0, x + x_from, ldx, y + y_from, ldy, n, w);
    ST_CU_LAUNCHED(c, "copy_cols");
}

// ---------------------------------------------------------------------------------------------
// Router: one warp per row, the row's logits in registers (expert e = 32 j + lane in slot j).
// The softmax sum is in double as on the CPU. Top-k is k rounds of a warp argmax over each
// lane's best expert not yet taken (ties: lower id, as the CPU's selection keeps the first
// maximum); only the lane that lost its best rescans its slots. Choice r lives in lane r % 32
// (slot r / 32) until the k weights are renormalized, in the CPU's order of operations.
#define ROUTE_MAX_K 64   // two choice slots per lane
#define ROUTE_MAX_E 1024 // 32 logits per lane in registers
#define ROUTE_WARPS 4    // rows per block

template <int EPL>
__global__ void __launch_bounds__(ROUTE_WARPS * 32) moe_route_kernel(const float *logits, int n, int E, int k,
                                                                     int32_t *ids, float *weights) {
    st_pdl_begin();
    int row = blockIdx.x * ROUTE_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= n) return; // the whole warp leaves
    const float *l = logits + (size_t)row * E;
    float v[EPL];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        int e = 32 * j + lane;
        v[j] = e < E ? l[e] : -INFINITY;
        mx = fmaxf(mx, v[j]);
    }
    mx = warp_max(mx);
    double sum = 0;
#pragma unroll
    for (int j = 0; j < EPL; j++)
        if (32 * j + lane < E) sum += exp((double)v[j] - mx);
    sum = warp_sum_d(sum);

    unsigned taken = 0; // bit j: slot j already chosen
    float lbv = -INFINITY;
    int lbi = -1;
    auto rescan = [&]() {
        lbv = -INFINITY, lbi = -1;
#pragma unroll
        for (int j = 0; j < EPL; j++)
            if (32 * j + lane < E && !(taken >> j & 1)) argmax_merge(lbv, lbi, v[j], 32 * j + lane);
    };
    rescan();
    float cv[2] = {0.0f, 0.0f}; // the logits of this lane's choices
    int ci[2] = {0, 0};
    for (int r = 0; r < k; r++) {
        float bv = lbv;
        int bi = lbi;
        warp_argmax(bv, bi);
        if (lane == (r & 31)) { // (constant slot indices keep cv, ci in registers)
            if (r < 32) cv[0] = bv, ci[0] = bi;
            else cv[1] = bv, ci[1] = bi;
        }
        if (bi >= 0 && (bi & 31) == lane) {
            taken |= 1u << (bi >> 5);
            rescan();
        }
    }
    // w_r = e^{l_r − max} / sum as a float, then renormalized by their sum in double.
    float w[2];
    double ws = 0;
#pragma unroll
    for (int s = 0; s < 2; s++) {
        bool mine = 32 * s + lane < k;
        w[s] = mine ? (float)(exp((double)cv[s] - mx) / sum) : 0.0f;
        ws += w[s];
    }
    ws = warp_sum_d(ws);
    if (ws < 6.1e-5) ws = 6.1e-5; // llama.cpp's clamp, as on the CPU
#pragma unroll
    for (int s = 0; s < 2; s++) {
        int r = 32 * s + lane;
        if (r < k) {
            ids[(size_t)row * k + r] = ci[s];
            weights[(size_t)row * k + r] = (float)(w[s] / ws);
        }
    }
}

// The block router (k <= 16): one block per row, one expert per thread, so the double-precision
// exponentials run side by side instead of 16 deep in one warp. Top-k without k dependent rounds:
// each warp sorts its 32 (logit, id) pairs with a bitonic network in registers (descending; ties:
// lower id first, the CPU's order), then the warps' top-16 lists merge pairwise in a tree (one
// bitonic merge of 32 per pair, one barrier per level). The top 16 of the union of lists is the
// union's top 16, so the root holds the row's top k in order.
#define ROUTE_BLOCK_MAX_K 16

__global__ void __launch_bounds__(1024) moe_route_block_kernel(const float *logits, int E, int k, int32_t *ids,
                                                               float *weights) {
    st_pdl_begin();
    __shared__ float sv[32 * 16]; // (warp, 16) the lists handed up the tree
    __shared__ int si[32 * 16];
    __shared__ float smax[32];
    __shared__ double ssum[32];
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, w = tid >> 5, nw = blockDim.x >> 5;
    const float *l = logits + (size_t)row * E;
    // Padding (ids >= E) holds -inf and sorts after every expert, -inf logits included.
    float v = tid < E ? l[tid] : -INFINITY;
    int i = tid;
    float mx = warp_max(v);
    if (lane == 0) smax[w] = mx;
    route_sort_warp(v, i);
    __syncthreads();
    mx = -INFINITY;
    for (int u = 0; u < nw; u++) mx = fmaxf(mx, smax[u]);
    // The softmax sum in double, as the CPU: each thread its expert, then the warps in order.
    double ex = tid < E ? exp((double)l[tid] - mx) : 0.0;
    ex = warp_sum_d(ex);
    if (lane == 0) ssum[w] = ex;
    // Merge tree: at stride st, warp w (a multiple of 2 st) takes the list of warp w + st. Lanes
    // 0-15 keep their own top 16 (descending), lanes 16-31 take the other's reversed (ascending):
    // a bitonic sequence, which half-cleaners at 16, 8, 4, 2, 1 sort descending.
    for (int st = 1; st < nw; st <<= 1) {
        if (w % (2 * st) == st && lane < 16) sv[w * 16 + lane] = v, si[w * 16 + lane] = i;
        __syncthreads();
        if (w % (2 * st) == 0 && w + st < nw) {
            if (lane >= 16) v = sv[(w + st) * 16 + 31 - lane], i = si[(w + st) * 16 + 31 - lane];
#pragma unroll
            for (int j = 16; j > 0; j >>= 1) route_exchange(v, i, j, (lane & j) == 0);
        }
    }
    __syncthreads(); // ssum is complete (also when there is one warp and no merge)
    if (w != 0) return;
    double sum = 0;
    for (int u = 0; u < nw; u++) sum += ssum[u];
    // w_r = e^{l_r − max} / sum as a float, then renormalized by their sum in double.
    float wr = lane < k ? (float)(exp((double)v - mx) / sum) : 0.0f;
    double ws = warp_sum_d((double)wr);
    if (ws < 6.1e-5) ws = 6.1e-5; // llama.cpp's clamp, as on the CPU
    if (lane < k) {
        ids[(size_t)row * k + lane] = i;
        weights[(size_t)row * k + lane] = (float)(wr / ws);
    }
}

void st_cuda_moe_route(st_backend *b, const float *logits, int n, int n_expert, int k, int32_t *ids,
                       float *weights) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0) return;
    if (k < 1 || k > ROUTE_MAX_K || k > n_expert || n_expert > ROUTE_MAX_E) {
        st_cuda_fail_msg(c, __FILE__, __LINE__, "moe_route: %d experts, top %d: unsupported (top-k at most %d, "
                         "at most %d experts)", n_expert, k, ROUTE_MAX_K, ROUTE_MAX_E);
        return;
    }
    int epl = (n_expert + 31) / 32;
    if (k <= ROUTE_BLOCK_MAX_K) {
        st_launch(c, moe_route_block_kernel, n, 32 * epl, 0, logits, n_expert, k, ids, weights);
        ST_CU_LAUNCHED(c, "moe_route");
        return;
    }
    dim3 grid((unsigned)((n + ROUTE_WARPS - 1) / ROUTE_WARPS)), block(32 * (n < ROUTE_WARPS ? n : ROUTE_WARPS));
    // Slots per lane: the next power of two (a few instantiations; unused slots cost a compare).
    if (epl <= 1) st_launch(c, moe_route_kernel<1>, grid, block, 0, logits, n, n_expert, k, ids, weights);
    else if (epl <= 2) st_launch(c, moe_route_kernel<2>, grid, block, 0, logits, n, n_expert, k, ids, weights);
    else if (epl <= 4) st_launch(c, moe_route_kernel<4>, grid, block, 0, logits, n, n_expert, k, ids, weights);
    else if (epl <= 8) st_launch(c, moe_route_kernel<8>, grid, block, 0, logits, n, n_expert, k, ids, weights);
    else if (epl <= 16) st_launch(c, moe_route_kernel<16>, grid, block, 0, logits, n, n_expert, k, ids, weights);
    else st_launch(c, moe_route_kernel<32>, grid, block, 0, logits, n, n_expert, k, ids, weights);
    ST_CU_LAUNCHED(c, "moe_route");
}

// ---------------------------------------------------------------------------------------------
// Argmax over vocabulary-sized rows. Each thread scans its strided share in ascending order (so
// its own ties keep the first), then a block reduction with ties to the lower index. One block
// of 1024 threads streams only ~100 GB/s, so on sm_90 a cluster of ARGMAX_CLUSTER blocks splits
// the row and block 0 merges the others' results through distributed shared memory (one
// kernel, nothing to reset between calls); older GPUs use one block per row.
#define ARGMAX_CLUSTER 8

// The best (value, index) of r[from, to) over the block (every thread of warp 0 gets it).
// vec4: 16-byte loads (from, to multiples of 4 or to == d, r 16-byte aligned).
__device__ void argmax_block(const float *r, int from, int to, bool vec4, float &bv, int &bi) {
    __shared__ float pv[32];
    __shared__ int pi[32];
    bv = -INFINITY, bi = -1;
    if (vec4) {
        const float4 *r4 = (const float4 *)r;
#pragma unroll 4
        for (int j = from / 4 + threadIdx.x; j < to / 4; j += blockDim.x) {
            float4 v = r4[j];
            argmax_merge(bv, bi, v.x, 4 * j);
            argmax_merge(bv, bi, v.y, 4 * j + 1);
            argmax_merge(bv, bi, v.z, 4 * j + 2);
            argmax_merge(bv, bi, v.w, 4 * j + 3);
        }
    } else {
        for (int j = from + threadIdx.x; j < to; j += blockDim.x) argmax_merge(bv, bi, r[j], j);
    }
    warp_argmax(bv, bi);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) pv[w] = bv, pi[w] = bi;
    __syncthreads();
    if (w == 0) {
        bv = lane < (int)(blockDim.x >> 5) ? pv[lane] : -INFINITY;
        bi = lane < (int)(blockDim.x >> 5) ? pi[lane] : -1;
        warp_argmax(bv, bi);
    }
}

// Row `row` whole, by one block.
__device__ void argmax_kernel_row(const float *x, int d, int32_t *ids, bool vec4, int row) {
    float bv;
    int bi;
    argmax_block(x + (size_t)row * d, 0, d, vec4, bv, bi);
    if (threadIdx.x == 0) ids[row] = bi < 0 ? 0 : bi; // all NaN: 0, as the CPU's start
}

__global__ void __launch_bounds__(1024) argmax_kernel(const float *x, int d, int32_t *ids, bool vec4) {
    st_pdl_begin();
    argmax_kernel_row(x, d, ids, vec4, blockIdx.x);
}

// Grid (ARGMAX_CLUSTER, n), launched as clusters of ARGMAX_CLUSTER blocks along x.
__global__ void __launch_bounds__(1024) argmax_cluster_kernel(const float *x, int d, int32_t *ids, bool vec4) {
    st_pdl_begin();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ float best_v;
    __shared__ int best_i;
    cg::cluster_group cl = cg::this_cluster();
    int rank = (int)cl.block_rank();
    // Slices of a multiple of 4 values, so each block's 16-byte loads stay whole.
    int per = (d / 4 + ARGMAX_CLUSTER - 1) / ARGMAX_CLUSTER * 4;
    if (!vec4) per = (d + ARGMAX_CLUSTER - 1) / ARGMAX_CLUSTER;
    int from = min(d, rank * per), to = min(d, from + per);
    float bv;
    int bi;
    argmax_block(x + (size_t)blockIdx.y * d, from, to, vec4, bv, bi);
    if (threadIdx.x == 0) best_v = bv, best_i = bi;
    cl.sync(); // every block's result is visible to the cluster
    if (rank == 0 && threadIdx.x < 32) {
        int lane = threadIdx.x;
        float v = -INFINITY;
        int i = -1;
        if (lane < ARGMAX_CLUSTER) v = *cl.map_shared_rank(&best_v, lane), i = *cl.map_shared_rank(&best_i, lane);
        warp_argmax(v, i);
        if (lane == 0) ids[blockIdx.y] = i < 0 ? 0 : i;
    }
    cl.sync(); // no block leaves (freeing its shared memory) before block 0 has read it
#else
    // Compiled for an older target but run on sm_90 (PTX): block 0 does the whole row.
    if (blockIdx.x == 0) argmax_kernel_row(x, d, ids, vec4, blockIdx.y);
#endif
}

void st_cuda_argmax(st_backend *b, const float *x, int n, int d, int32_t *ids) {
    st_cuda *c = st_cuda_of(b);
    if (n <= 0 || d <= 0) return;
    bool vec4 = (d & 3) == 0 && aligned16(x);
    if (c->prop.major >= 9 && d >= 4096 && n <= 65535) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(ARGMAX_CLUSTER, (unsigned)n);
        cfg.blockDim = dim3(1024);
        cfg.stream = c->stream;
        cudaLaunchAttribute attr[2];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = ARGMAX_CLUSTER;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[1].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = c->pdl ? 2 : 1;
        ST_CU(c, cudaLaunchKernelEx(&cfg, argmax_cluster_kernel, x, d, ids, vec4));
    } else {
        st_launch(c, argmax_kernel, n, 1024, 0, x, d, ids, vec4);
    }
    ST_CU_LAUNCHED(c, "argmax");
}

// STRATA_CUDA_TRACE: binds this file's copy of st_trace (cuda_common.cuh).
cudaError_t st_trace_bind_ops(const st_trace_dev *t) { return st_trace_bind_unit(t); }
