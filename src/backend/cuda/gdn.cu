// backend/cuda: the Gated DeltaNet recurrence (REFERENCE.md §3.3): the step form, row by row with
// the state in registers (decode, verify windows), and the chunked WY form (prompt chunks), which
// turns each chunk of 64 rows into small matrix products in shared memory.

#include <math.h>

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

template <int EPL, int R>
__global__ void __launch_bounds__(GDN_STEP_WARPS * 32) gdn_step_kernel(st_gdn_args a) {
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
        float kq = 0, sk[R], sq[R];
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
        for (int o = 16; o > 0; o >>= 1) {
            kq += __shfl_xor_sync(0xffffffffu, kq, o);
#pragma unroll
            for (int rr = 0; rr < R; rr++) {
                sk[rr] += __shfl_xor_sync(0xffffffffu, sk[rr], o);
                sq[rr] += __shfl_xor_sync(0xffffffffu, sq[rr], o);
            }
        }
        float *out = a.out + ((size_t)t * a.h_v + j) * D + v0;
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            float delta = cb * (__shfl_sync(0xffffffffu, cv, rr) - sk[rr]);
#pragma unroll
            for (int e = 0; e < EPL; e++) s[rr][e] += delta * ck[e];
            if (lane == rr && v0 + rr < D) out[rr] = sq[rr] + delta * kq;
        }
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
#define CASE(E) case E: gdn_step_kernel<E, GDN_STEP_ROWS><<<grid, block, 0, c->stream>>>(*a); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
    ST_CU_LAUNCHED(c, "gdn");
}

// ---------------------------------------------------------------------------------------------
// Chunked form (cpu.c gdn_chunk has the same steps, one value head at a time). Per chunk of
// GC rows with γ_i = Σ_{l≤i} g_l:
//   A  = strict_lower(−diag(β) (K Kᵀ) ⊙ D),  D_il = exp(γ_i − γ_l)
//   T  = (I − A)⁻¹, so W = T diag(β e^γ) K and U = T diag(β) V (the forward substitution
//        row i = rhs_i + Σ_{l<i} A_il row_l);   V' = U − W Sᵀ = T (diag(β) V − diag(β e^γ) K Sᵀ)
//   O  = diag(e^γ) Q Sᵀ + lower_incl((Q Kᵀ) ⊙ D) V'
//   S ← e^{γ_c} S + V'ᵀ (diag(e^{γ_c − γ}) K)
// Only V', O and S involve value dims, each column on its own, so a block owns one head and a
// slice of GSV value rows of its state (in shared memory across all chunks); the value-free parts
// (A, T, the Q Kᵀ mask) are recomputed by each slice, which costs less than a second pass
// through global memory. Rows past the end of the last chunk are zeros (g = 0, β = 0: no-ops).
//
// Shared memory, D = 128: ~94 KB (fits the opt-in limit of sm_80 and newer, sm_86/89 included);
// where it does not fit (sm_75), the chunked op runs the step kernel instead.
#define GC ST_GDN_CHUNK
#define GSV 16                    // value rows per block
#define GDN_CHUNK_THREADS 256

static size_t gdn_chunk_smem(int d) {
    int dp = d + 1;
    return sizeof(float) * ((size_t)2 * GC * dp + (size_t)GC * GC + (size_t)GC * GSV + (size_t)GSV * dp + 4 * GC);
}

template <int D>
__global__ void __launch_bounds__(GDN_CHUNK_THREADS) gdn_chunk_kernel(st_gdn_args a) {
    static_assert(GC == 64 && GSV == 16 && GDN_CHUNK_THREADS == 256, "the micro-tiles below assume these");
    constexpr int DP = D + 1; // padded rows: column walks over different rows hit different banks
    extern __shared__ float sm[];
    float *Ks = sm;            // (GC, DP) keys
    float *X = Ks + GC * DP;   // (GC, DP) W, then queries
    float *A = X + GC * DP;    // (GC, GC) substitution coefficients, then the output mask
    float *U = A + GC * GC;    // (GC, GSV) U, then V'
    float *S = U + GC * GSV;   // (GSV, DP) the state slice: value rows vs0.., key dims
    float *gam = S + GSV * DP; // (GC) γ
    float *bet = gam + GC;     // (GC) β
    float *eg = bet + GC;      // (GC) e^{γ_i}
    float *ek = eg + GC;       // (GC) e^{γ_c − γ_i}
    const int tid = threadIdx.x, j = blockIdx.y, vs0 = blockIdx.x * GSV;
    const int hk = j / (a.h_v / a.h_k), H = a.h_v, HK = a.h_k;
    float *Sg = a.state + (size_t)j * D * D + (size_t)vs0 * D;
    for (int e = tid; e < GSV * D; e += GDN_CHUNK_THREADS) S[(e / D) * DP + e % D] = Sg[e];
    // The micro-tile owners: (ti + 16p, tl + 16q) of a GC x GC product, (ib + 16p, vs) of GC x GSV.
    const int ti = tid / 16, tl = tid % 16;

    for (int t0 = 0; t0 < a.n; t0 += GC) {
        const int c = a.n - t0 < GC ? a.n - t0 : GC;
        __syncthreads(); // the previous chunk is done with every buffer
        for (int e = tid; e < GC * D; e += GDN_CHUNK_THREADS) {
            int i = e / D, x = e % D;
            Ks[i * DP + x] = i < c ? a.k[((size_t)(t0 + i) * HK + hk) * D + x] : 0.0f;
        }
        if (tid < GC) {
            bet[tid] = tid < c ? a.beta[(size_t)(t0 + tid) * H + j] : 0.0f;
            gam[tid] = tid < c ? a.g[(size_t)(t0 + tid) * H + j] : 0.0f;
        }
        __syncthreads();
        if (tid == 0) // the cumulative sum in the CPU's order
            for (int i = 1; i < GC; i++) gam[i] += gam[i - 1];
        __syncthreads();
        if (tid < GC) {
            eg[tid] = expf(gam[tid]);
            ek[tid] = expf(gam[GC - 1] - gam[tid]);
        }
        // A_il = −β_i (k_i·k_l) e^{γ_i − γ_l} for l < i.
        {
            float acc[4][4] = {};
            for (int x = 0; x < D; x++) {
                float ka[4], kb[4];
#pragma unroll
                for (int p = 0; p < 4; p++) ka[p] = Ks[(ti + 16 * p) * DP + x], kb[p] = Ks[(tl + 16 * p) * DP + x];
#pragma unroll
                for (int p = 0; p < 4; p++)
#pragma unroll
                    for (int q = 0; q < 4; q++) acc[p][q] += ka[p] * kb[q];
            }
#pragma unroll
            for (int p = 0; p < 4; p++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    int i = ti + 16 * p, l = tl + 16 * q;
                    A[i * GC + l] = l < i ? -bet[i] * acc[p][q] * expf(gam[i] - gam[l]) : 0.0f;
                }
        }
        for (int e = tid; e < GC * GSV; e += GDN_CHUNK_THREADS) {
            int i = e / GSV, vs = e % GSV;
            U[e] = i < c ? bet[i] * a.v[((size_t)(t0 + i) * H + j) * D + vs0 + vs] : 0.0f;
        }
        __syncthreads(); // eg ready; A ready
        // T = (I − A)⁻¹ (unit lower triangular) in X, by blocks of 16 (the row-by-row substitution
        // is a chain of 64 dependent steps; this is 1 + 3 levels of parallel 16 x 16 products):
        //   diagonal blocks: a column per thread, solved in registers;
        //   T_ij = T_ii Σ_{k=j}^{i−1} A_ik T_kj for i > j, one diagonal distance d = i − j a level.
        // Then W = T (β e^γ K) and U = T (β v) give V' = U − W Sᵀ = T (β v − β e^γ K Sᵀ), so W
        // is never formed.
        float *Tm = X;           // (GC, GC)
        float *Z = X + GC * GC;  // (3, 16, 16) one level's sums
        if (tid < GC) {
            const int r0 = (tid / 16) * 16, col = tid % 16;
            float t[16];
#pragma unroll
            for (int r = 0; r < 16; r++) {
                float v = r == col ? 1.0f : 0.0f;
#pragma unroll
                for (int l = 0; l < r; l++) v += A[(r0 + r) * GC + r0 + l] * t[l];
                t[r] = v; // 0 above the diagonal (r < col)
            }
#pragma unroll
            for (int r = 0; r < 16; r++) Tm[(r0 + r) * GC + r0 + col] = t[r];
        }
        __syncthreads();
        {
            const int tr = tid / 16, tc = tid % 16;
            for (int d = 1; d < 4; d++) {
                for (int i = d; i < 4; i++) {
                    int jb = i - d;
                    float z = 0;
                    for (int k = jb; k < i; k++)
#pragma unroll
                        for (int x = 0; x < 16; x++)
                            z += A[(16 * i + tr) * GC + 16 * k + x] * Tm[(16 * k + x) * GC + 16 * jb + tc];
                    Z[(i - d) * 256 + tid] = z;
                }
                __syncthreads();
                for (int i = d; i < 4; i++) {
                    int jb = i - d;
                    float t = 0;
                    for (int x = 0; x <= tr; x++) t += Tm[(16 * i + tr) * GC + 16 * i + x] * Z[(i - d) * 256 + x * 16 + tc];
                    Tm[(16 * i + tr) * GC + 16 * jb + tc] = t;
                }
                __syncthreads();
            }
        }
        // Y = β v − β e^γ (K Sᵀ), with the state entering the chunk, in U.
        {
            float acc[4] = {};
            for (int x = 0; x < D; x++) {
                float sv = S[tl * DP + x];
#pragma unroll
                for (int p = 0; p < 4; p++) acc[p] += Ks[(ti + 16 * p) * DP + x] * sv;
            }
#pragma unroll
            for (int p = 0; p < 4; p++) {
                int i = ti + 16 * p;
                U[i * GSV + tl] -= bet[i] * eg[i] * acc[p];
            }
        }
        __syncthreads();
        // V' = T Y (T is lower triangular: l <= i).
        {
            float acc[4] = {};
#pragma unroll
            for (int p = 0; p < 4; p++) {
                int i = ti + 16 * p;
                for (int l = 0; l <= i; l++) acc[p] += Tm[i * GC + l] * U[l * GSV + tl];
            }
            __syncthreads(); // every read of Y is done
#pragma unroll
            for (int p = 0; p < 4; p++) U[(ti + 16 * p) * GSV + tl] = acc[p];
        }
        __syncthreads(); // T is no longer needed: queries replace it
        for (int e = tid; e < GC * D; e += GDN_CHUNK_THREADS) {
            int i = e / D, x = e % D;
            X[i * DP + x] = i < c ? a.q[((size_t)(t0 + i) * HK + hk) * D + x] : 0.0f;
        }
        __syncthreads();
        // The intra-chunk output mask M_il = (q_i·k_l) e^{γ_i − γ_l} for l ≤ i, into A.
        {
            float acc[4][4] = {};
            for (int x = 0; x < D; x++) {
                float qa[4], kb[4];
#pragma unroll
                for (int p = 0; p < 4; p++) qa[p] = X[(ti + 16 * p) * DP + x], kb[p] = Ks[(tl + 16 * p) * DP + x];
#pragma unroll
                for (int p = 0; p < 4; p++)
#pragma unroll
                    for (int q = 0; q < 4; q++) acc[p][q] += qa[p] * kb[q];
            }
#pragma unroll
            for (int p = 0; p < 4; p++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    int i = ti + 16 * p, l = tl + 16 * q;
                    A[i * GC + l] = l <= i ? acc[p][q] * expf(gam[i] - gam[l]) : 0.0f;
                }
        }
        __syncthreads();
        // O = diag(e^γ) Q Sᵀ + M V'.
        {
            float acc[4] = {};
            for (int x = 0; x < D; x++) {
                float sv = S[tl * DP + x];
#pragma unroll
                for (int p = 0; p < 4; p++) acc[p] += X[(ti + 16 * p) * DP + x] * sv;
            }
#pragma unroll
            for (int p = 0; p < 4; p++) {
                int i = ti + 16 * p;
                if (i >= c) continue;
                float o = eg[i] * acc[p];
                for (int l = 0; l <= i; l++) o += A[i * GC + l] * U[l * GSV + tl];
                a.out[((size_t)(t0 + i) * H + j) * D + vs0 + tl] = o;
            }
        }
        __syncthreads(); // every read of the entering state is done
        // S ← e^{γ_c} S + V'ᵀ (diag(e^{γ_c − γ}) K); γ_c = γ of the last row (padding adds 0).
        {
            float ec = expf(gam[GC - 1]);
            for (int e = tid; e < GSV * D; e += GDN_CHUNK_THREADS) {
                int vs = e / D, x = e % D;
                float acc = 0;
                for (int i = 0; i < c; i++) acc += U[i * GSV + vs] * ek[i] * Ks[i * DP + x];
                S[vs * DP + x] = ec * S[vs * DP + x] + acc;
            }
        }
    }
    __syncthreads();
    for (int e = tid; e < GSV * D; e += GDN_CHUNK_THREADS) Sg[e] = S[(e / D) * DP + e % D];
}

void st_cuda_gdn_chunked(st_backend *b, const st_gdn_args *a) {
    st_cuda *c = st_cuda_of(b);
    if (a->n <= 0 || !gdn_check(c, a)) return;
    size_t smem = gdn_chunk_smem(a->d);
    // The chunked kernel is written for Qwen3-Next's head size; other sizes, and GPUs whose
    // shared memory is too small for it, take the step form (same results up to rounding).
    if (a->d != 128 || smem > c->prop.sharedMemPerBlockOptin) {
        st_cuda_gdn(b, a);
        return;
    }
    ST_CU(c, cudaFuncSetAttribute(gdn_chunk_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    dim3 grid((unsigned)(a->d / GSV), (unsigned)a->h_v);
    gdn_chunk_kernel<128><<<grid, GDN_CHUNK_THREADS, smem, c->stream>>>(*a);
    ST_CU_LAUNCHED(c, "gdn_chunked");
}
