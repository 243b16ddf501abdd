// backend/cuda: the prompt-chunk GEMM over quantized weights: tiles of weights dequantized to
// bf16 in shared memory and multiplied with tensor cores (mma.sync, sm_80+), many matrices (the
// used experts) and row groups in one launch. Included by quant_matmul.cu only (the IQ tables).
#pragma once

#include "backend/cuda/quant_unpack.cuh"

// Block tile: GM_BM weight rows x GM_BN activation rows, GM_BK columns per step (two chunks of
// 32). 8 warps, each a 32 x 32 piece of the tile as 2 x 4 m16n8k16 tensor-core products, their
// operands read from shared memory with ldmatrix.
#define ST_GM_BM 128
#define ST_GM_BN 64
#define ST_GM_BK 64
#define ST_GM_LDS (ST_GM_BK + 8)   // bf16 row stride in shared memory: 144 bytes, spreads banks
#define ST_GM_LDC (ST_GM_BM + 4)   // float column stride of the staged output tile
#define ST_GM_THREADS 256

// One block's work: a matrix, its first activation row (in the grouped order) and the count.
// tiles == NULL: matrix 0, rows ST_GM_BN * blockIdx.x onwards (a dense matmul).
struct st_gmm_args {
    const uint8_t *w;       // matrix 0; matrix m at w + m * mat_bytes
    size_t row_bytes, mat_bytes;
    int64_t rows;           // M: weight rows = output columns
    int cols;               // K: multiple of 32
    const __nv_bfloat16 *x; // (nx_total, cols)
    float *y;               // (nx_total, ldy), columns 0 .. rows - 1 written
    int64_t ldy;
    const int4 *tiles;      // {matrix, first row, rows <= ST_GM_BN, 0} per blockIdx.x
    int nx_total;
    // Gate and up at once (w2 != NULL): a block's 128 weight rows are 64 rows of w (gate) and
    // the same 64 rows of w2 (up); it writes h = silu(gate) · up as bf16 (nx_total, ldy)
    // instead of y.
    const uint8_t *w2;
    size_t row_bytes2, mat_bytes2;
    __nv_bfloat16 *h;
};

// Shared memory: the A (weights) and B (activations) tiles, reused for the float output tile.
#define ST_GM_SMEM_AB ((ST_GM_BM + ST_GM_BN) * ST_GM_LDS * 2)
#define ST_GM_SMEM_C (ST_GM_BN * ST_GM_LDC * 4)
#define ST_GM_SMEM (ST_GM_SMEM_AB > ST_GM_SMEM_C ? ST_GM_SMEM_AB : ST_GM_SMEM_C)

// The float of signed byte k of q ^ 0x80808080 (a chunk word with every byte's sign flipped):
// the byte, now 0 .. 255, becomes the low mantissa bits of 2^23 and the subtraction leaves the
// signed value exactly. A byte permute and an add on the full-rate pipes, where a conversion
// instruction (I2F) runs at a quarter of the rate and was the dequantization's slowest step.
template <int K> __device__ __forceinline__ float gmm_byte_f(uint32_t flipped) {
    return __uint_as_float(__byte_perm(flipped, 0x4B000000u, 0x7540u + K)) - 8388736.0f; // 2^23 + 128
}

// Chunk c of a weight row to 32 bf16 at dst (16-byte aligned); zeros when !ok. The values are
// dequant.c's floats rounded to bf16, as the old dequantize-then-cuBLAS path had them.
template <int T>
__device__ __forceinline__ void gmm_load_a(const uint8_t *row, int c, bool ok, __nv_bfloat16 *dst) {
    uint32_t u[16];
    if (ok) {
        st_wchunk w;
        st_qt<T>::unpack(row, c, w);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float s = i < 4 ? w.s0 : w.s1, m = i < 4 ? w.m0 : w.m1;
            uint32_t f = (uint32_t)w.q[i] ^ 0x80808080u;
            float q[4] = {gmm_byte_f<0>(f), gmm_byte_f<1>(f), gmm_byte_f<2>(f), gmm_byte_f<3>(f)};
            float v[4];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                float p = __fmul_rn(s, q[k]);
                v[k] = st_qt<T>::HAS_MIN ? __fadd_rn(p, m) : p;
            }
            __nv_bfloat162 h0 = __floats2bfloat162_rn(v[0], v[1]), h1 = __floats2bfloat162_rn(v[2], v[3]);
            u[2 * i] = *(uint32_t *)&h0;
            u[2 * i + 1] = *(uint32_t *)&h1;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 16; i++) u[i] = 0;
    }
    uint4 *d = (uint4 *)dst;
#pragma unroll
    for (int j = 0; j < 4; j++) d[j] = make_uint4(u[4 * j], u[4 * j + 1], u[4 * j + 2], u[4 * j + 3]);
}

// The pieces both GEMM kernels share. A block's tile: its matrix, first activation row and
// row count (tiles, or row blocks of matrix 0 for a dense matmul).
__device__ __forceinline__ void gmm_tile(const st_gmm_args &p, int &mat, int &x0, int &nx) {
    if (p.tiles) {
        int4 t = p.tiles[blockIdx.x];
        mat = t.x, x0 = t.y, nx = t.z;
    } else {
        mat = 0;
        x0 = blockIdx.x * ST_GM_BN;
        nx = p.nx_total - x0 < ST_GM_BN ? p.nx_total - x0 : ST_GM_BN;
    }
}

// Weight row of tile row am (0 .. BM-1) from the block's first row r0: with glu the first 64
// are gate rows r0 + am, the rest up rows r0 + am - 64. *ok: the row exists.
__device__ __forceinline__ const uint8_t *gmm_wrow(const st_gmm_args &p, int mat, int64_t r0, int am, bool *ok) {
    bool up = p.w2 && am >= ST_GM_BM / 2;
    int64_t r = r0 + (up ? am - ST_GM_BM / 2 : am);
    *ok = r < p.rows;
    if (!*ok) r = 0;
    return up ? p.w2 + (size_t)mat * p.mat_bytes2 + (size_t)r * p.row_bytes2
              : p.w + (size_t)mat * p.mat_bytes + (size_t)r * p.row_bytes;
}

// B: 64 rows x 64 bf16 = 512 16-byte pieces, two per thread, zeros past the data (the
// products with zero weights must not meet garbage NaNs). Loaded into registers a step ahead.
__device__ __forceinline__ void gmm_load_b(const st_gmm_args &p, int x0, int nx, int k0, uint4 (&b)[2]) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int v = threadIdx.x + ST_GM_THREADS * h, j = v >> 3, k = k0 + (v & 7) * 8;
        b[h] = make_uint4(0, 0, 0, 0);
        if (j < nx && k < p.cols) b[h] = *(const uint4 *)(p.x + (size_t)(x0 + j) * p.cols + k);
    }
}
__device__ __forceinline__ void gmm_store_b(__nv_bfloat16 *sb, const uint4 (&b)[2]) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int v = threadIdx.x + ST_GM_THREADS * h;
        *(uint4 *)(sb + (v >> 3) * ST_GM_LDS + (v & 7) * 8) = b[h];
    }
}

#if __CUDA_ARCH__ >= 800
// A warp's 32 x 32 piece of the tile: 2 x 4 m16n8 accumulators, in mma.sync's layout (lane l
// holds rows l / 4 and l / 4 + 8 of each, columns 2 (l % 4) and the one after).
struct gmm_acc {
    float c[2][4][4];
};

__device__ __forceinline__ void gmm_zero(gmm_acc &acc) {
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) acc.c[i][j][r] = 0.0f;
}

// Four 8 x 8 bf16 matrices from shared memory (lanes 8 m .. 8 m + 7 address matrix m's rows).
__device__ __forceinline__ void gmm_ldsm4(uint32_t addr, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// One 64-column step of the warp's piece (rows wr.., columns wc..) from sa and sb (shared-memory
// addresses of the tiles): per 16 columns, the A fragments of its two 16-row tiles and the B
// fragments of its four 8-column tiles, then the eight products. Column tiles at or past nx (the
// block's activation rows) hold zeros and are skipped: a prompt chunk's experts get ~32 rows
// each at 512 rows, half a tile.
__device__ __forceinline__ void gmm_mma(uint32_t sa, uint32_t sb, int wr, int wc, int nx, gmm_acc &acc) {
    if (wc >= nx) return;
    const int lane = threadIdx.x & 31;
    // A (row-major, 16 x 16): lanes 0-15 rows 0-15 at column 0, lanes 16-31 the same at 8.
    const uint32_t a0 = sa + 2 * ((wr + (lane & 15)) * ST_GM_LDS + (lane >> 4) * 8);
    // B (activation rows, columns contiguous: column-major for the product), two 8-row tiles
    // a load: lanes 0-7 rows 0-7 at column 0, 8-15 the same at 8, 16-31 rows 8-15 likewise.
    const uint32_t b0 = sb + 2 * ((wc + (lane & 7) + ((lane >> 4) << 3)) * ST_GM_LDS + ((lane >> 3) & 1) * 8);
#pragma unroll
    for (int kk = 0; kk < ST_GM_BK; kk += 16) {
        uint32_t fa[2][4], fb[2][4] = {};
#pragma unroll
        for (int i = 0; i < 2; i++) gmm_ldsm4(a0 + 2 * (16 * i * ST_GM_LDS + kk), fa[i]);
        gmm_ldsm4(b0 + 2 * kk, fb[0]);
        if (wc + 16 < nx) gmm_ldsm4(b0 + 2 * (16 * ST_GM_LDS + kk), fb[1]);
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                if (wc + 8 * j >= nx) continue;
                float *d = acc.c[i][j];
                asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                             "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                             : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                             : "r"(fa[i][0]), "r"(fa[i][1]), "r"(fa[i][2]), "r"(fa[i][3]), "r"(fb[j >> 1][2 * (j & 1)]),
                               "r"(fb[j >> 1][2 * (j & 1) + 1]));
            }
    }
}

// The tile staged column-major in sc (output row j's values contiguous), then coalesced stores:
// y, or with glu h = silu(gate) · up as bf16. sc may alias the A / B tiles (the loop is done).
__device__ __forceinline__ void gmm_epilogue(const st_gmm_args &p, float *sc, int wr, int wc, const gmm_acc &acc,
                                             int64_t r0, int x0, int nx) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int m = wr + 16 * i + g, n = wc + 8 * j + 2 * t;
            sc[n * ST_GM_LDC + m] = acc.c[i][j][0];
            sc[(n + 1) * ST_GM_LDC + m] = acc.c[i][j][1];
            sc[n * ST_GM_LDC + m + 8] = acc.c[i][j][2];
            sc[(n + 1) * ST_GM_LDC + m + 8] = acc.c[i][j][3];
        }
    __syncthreads();
    const int tid = threadIdx.x;
    if (p.w2) {
        constexpr int HB = ST_GM_BM / 2;
        for (int v = tid; v < ST_GM_BN * HB; v += ST_GM_THREADS) {
            int j = v / HB, i = v % HB;
            if (j < nx && r0 + i < p.rows) {
                float g = sc[j * ST_GM_LDC + i], u = sc[j * ST_GM_LDC + HB + i];
                p.h[(size_t)(x0 + j) * p.ldy + r0 + i] = __float2bfloat16_rn(g / (1.0f + expf(-g)) * u);
            }
        }
    } else {
        for (int v = tid; v < ST_GM_BN * ST_GM_BM; v += ST_GM_THREADS) {
            int j = v / ST_GM_BM, i = v % ST_GM_BM;
            if (j < nx && r0 + i < p.rows) p.y[(size_t)(x0 + j) * p.ldy + r0 + i] = sc[j * ST_GM_LDC + i];
        }
    }
}
#endif

// y[x0 + j][r0 + i] = Σ_k W_m[r0 + i][k] · x[x0 + j][k] for the block's tile.
template <int T>
__global__ void __launch_bounds__(ST_GM_THREADS) gmm_kernel(st_gmm_args p) {
    st_pdl_begin();
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(128) uint8_t smem[ST_GM_SMEM];
    __nv_bfloat16 *sa = (__nv_bfloat16 *)smem;       // (BM, LDS) weights, row-major
    __nv_bfloat16 *sb = sa + ST_GM_BM * ST_GM_LDS;    // (BN, LDS) activations, row-major
    int mat, x0, nx;
    gmm_tile(p, mat, x0, nx);
    int64_t r0 = (int64_t)blockIdx.y * (p.w2 ? ST_GM_BM / 2 : ST_GM_BM);
    int tid = threadIdx.x, warp = tid >> 5;
    int nchunk = p.cols / 32;

    // A: thread t dequantizes chunk (t & 1) of the step for tile row t >> 1.
    int am = tid >> 1, akc = tid & 1;
    bool arow_ok;
    const uint8_t *arow = gmm_wrow(p, mat, r0, am, &arow_ok);

    int wr = (warp & 3) * 32, wc = (warp >> 2) * 32; // the warp's rows (weights) and columns (x rows)
    const uint32_t sa_s = (uint32_t)__cvta_generic_to_shared(sa), sb_s = (uint32_t)__cvta_generic_to_shared(sb);
    gmm_acc acc;
    gmm_zero(acc);

    // The next step's B pieces are loaded into registers, and its weight bytes prefetched into
    // L2, while this step multiplies.
    uint4 bnext[2];
    constexpr int CPB = st_qt<T>::QK / 32, BS = st_qt<T>::BS;
    gmm_load_b(p, x0, nx, 0, bnext);
    for (int k0 = 0; k0 < p.cols; k0 += ST_GM_BK) {
        int c = k0 / 32 + akc;
        gmm_load_a<T>(arow, c, arow_ok && c < nchunk, sa + am * ST_GM_LDS + akc * 32);
        gmm_store_b(sb, bnext);
        __syncthreads();
        if (k0 + ST_GM_BK < p.cols) {
            gmm_load_b(p, x0, nx, k0 + ST_GM_BK, bnext);
            int cn = c + 2;
            if (arow_ok && cn < nchunk) // the chunk's share of its block: headers for the first
                asm volatile("prefetch.global.L2 [%0];" ::"l"(arow + (size_t)(cn / CPB) * BS + (cn % CPB) * BS / CPB));
        }
        gmm_mma(sa_s, sb_s, wr, wc, nx, acc);
        __syncthreads();
    }
    gmm_epilogue(p, (float *)smem, wr, wc, acc, r0, x0, nx);
#endif
}

// The staged variant (the default; STRATA_GMM_STAGED=0 runs gmm_kernel). gmm_kernel reads
// each step's weight chunks from L2 / HBM right before it dequantizes them, so every 64-column
// step waits out a memory round trip (the L2 prefetch a step ahead only shortens it): at 512
// rows of the 30B-A3B shape the experts' GEMM ran at ~10% of the bf16 tensor-core rate. Here
// the raw blocks of all the tile's rows for the next span of columns (one 256-column block of
// a K-quant or an IQ type, two 32-column blocks of the others) are copied to shared memory with
// cp.async while the current span is dequantized and multiplied, so dequantizing reads shared
// memory. Each row's copy starts at the 16-byte boundary at or before its span (cp.async moves
// 16 aligned bytes; blocks of 34, 210, ... bytes are only 2-byte aligned; the bytes before the
// span are the row's or the row before's) and keeps the address's offset within 16 bytes, so
// unpack sees the alignment it sees in global memory; the last piece ends at the span's end.
// Same dequantized values, same products in the same order: the same bits as gmm_kernel.
template <int T> struct gmm_stage {
    static constexpr int QK = st_qt<T>::QK, BS = st_qt<T>::BS, CPB = QK / 32;
    static constexpr int SPAN = QK > ST_GM_BK ? QK : ST_GM_BK;   // columns a stage holds
    static constexpr int NB = SPAN / QK;                        // blocks of a row it holds
    static constexpr int RS = (NB * BS + 30) / 16 * 16;         // bytes a row: the 16-aligned cover
    static constexpr int PIECES = RS / 16;
    static constexpr size_t BYTES = (size_t)ST_GM_BM * RS;      // one stage
    static constexpr size_t OFF = ST_GM_SMEM_AB;                // after the A and B tiles
    static constexpr size_t SMEM = OFF + 2 * BYTES > ST_GM_SMEM_C ? OFF + 2 * BYTES : ST_GM_SMEM_C;
};
static_assert(ST_GM_SMEM_AB % 16 == 0, "the stages start 16-byte aligned");

// MINB: blocks a multiprocessor the registers must allow. 3 (the default): held to 80 registers
// (32-40 bytes of stack), three blocks and 24 warps a multiprocessor, where the compiler's own
// choice of 128 allowed two and the schedulers found no ready warp 37% of the time (ncu, 30B-A3B
// experts at 512 rows): the experts' GEMM 632 -> 602 us at 512 rows, 1,737 -> 1,661 at 2048
// (H200, 2026-12-01). STRATA_GMM_OCC=2: the other.
template <int T, int MINB>
__global__ void __launch_bounds__(ST_GM_THREADS, MINB) gmm_staged_kernel(st_gmm_args p) {
    st_pdl_begin();
#if __CUDA_ARCH__ >= 800
    typedef gmm_stage<T> G;
    extern __shared__ __align__(128) uint8_t smem_dyn[];
    __nv_bfloat16 *sa = (__nv_bfloat16 *)smem_dyn;
    __nv_bfloat16 *sb = sa + ST_GM_BM * ST_GM_LDS;
    uint8_t *stages = smem_dyn + G::OFF;
    int mat, x0, nx;
    gmm_tile(p, mat, x0, nx);
    int64_t r0 = (int64_t)blockIdx.y * (p.w2 ? ST_GM_BM / 2 : ST_GM_BM);
    int tid = threadIdx.x, warp = tid >> 5;
    const int nchunk = p.cols / 32, nst = (p.cols + G::SPAN - 1) / G::SPAN;

    // Stage s of every tile row into buffer s & 1: the blocks holding columns s·SPAN onwards.
    auto issue = [&](int s) {
        const int b0 = s * G::SPAN / G::QK, nb = min(G::NB, (p.cols - s * G::SPAN + G::QK - 1) / G::QK);
        uint8_t *buf = stages + (size_t)(s & 1) * G::BYTES;
        for (int v = tid; v < ST_GM_BM * G::PIECES; v += ST_GM_THREADS) {
            int r = v / G::PIECES, j = v % G::PIECES;
            bool ok;
            const uint8_t *src = gmm_wrow(p, mat, r0, r, &ok) + (size_t)b0 * G::BS;
            // (the last piece stops at the span's end: past the matrix's last row there may be
            // no memory; compute-sanitizer's memcheck found that read)
            uintptr_t end = (uintptr_t)src + (size_t)nb * G::BS, a = (uintptr_t)src & ~(uintptr_t)15;
            uintptr_t at = a + 16 * (uintptr_t)j;
            if (!ok || at >= end) continue;
            if (end - at >= 16) {
                st_cp_async16(buf + r * G::RS + 16 * j, (const void *)at, true);
            } else { // halfwords up to the end (blocks have even sizes), zeros after
                uint32_t u[4] = {0, 0, 0, 0};
                const int nh = (int)(end - at) / 2;
#pragma unroll
                for (int k = 0; k < 8; k++)
                    if (k < nh) u[k / 2] |= (uint32_t)((const uint16_t *)at)[k] << (16 * (k & 1));
                *(uint4 *)(buf + r * G::RS + 16 * j) = make_uint4(u[0], u[1], u[2], u[3]);
            }
        }
        st_cp_commit();
    };

    int am = tid >> 1, akc = tid & 1;
    bool arow_ok;
    const uint8_t *arow = gmm_wrow(p, mat, r0, am, &arow_ok);
    int wr = (warp & 3) * 32, wc = (warp >> 2) * 32;
    const uint32_t sa_s = (uint32_t)__cvta_generic_to_shared(sa), sb_s = (uint32_t)__cvta_generic_to_shared(sb);
    gmm_acc acc;
    gmm_zero(acc);

    uint4 bnext[2];
    issue(0);
    gmm_load_b(p, x0, nx, 0, bnext);
    for (int s = 0; s < nst; s++) {
        if (s + 1 < nst) {
            issue(s + 1); // into the buffer stage s - 1 used: read before the last step's barriers
            st_cp_wait<1>();
        } else {
            st_cp_wait<0>();
        }
        __syncthreads(); // stage s has landed, every thread's copies
        const int b0 = s * G::SPAN / G::QK;
        const uint8_t *src = arow + (size_t)b0 * G::BS; // this row's span in global memory
        const uint8_t *row = stages + (size_t)(s & 1) * G::BYTES + am * G::RS + ((uintptr_t)src & 15);
        const int kend = min(p.cols, (s + 1) * G::SPAN);
        for (int k0 = s * G::SPAN; k0 < kend; k0 += ST_GM_BK) {
            int c = k0 / 32 + akc;
            gmm_load_a<T>(row + (size_t)(c / G::CPB - b0) * G::BS, c % G::CPB, arow_ok && c < nchunk,
                          sa + am * ST_GM_LDS + akc * 32);
            gmm_store_b(sb, bnext);
            __syncthreads();
            if (k0 + ST_GM_BK < p.cols) gmm_load_b(p, x0, nx, k0 + ST_GM_BK, bnext);
            gmm_mma(sa_s, sb_s, wr, wc, nx, acc);
            __syncthreads();
        }
    }
    gmm_epilogue(p, (float *)smem_dyn, wr, wc, acc, r0, x0, nx);
#endif
}
