// backend: the CPU backend, the scalar reference of every op. Heavy ops (matmul, attention,
// the DeltaNet recurrence) split their work over the thread pool; the rest are plain loops.

#include <math.h>
#include <string.h>

#include "backend/backend.h"
#include "quant/blocks.h"

static void *cpu_alloc(st_backend *b, size_t bytes) {
    (void)b;
    return st_alloc(bytes);
}

static void cpu_free(st_backend *b, void *p) {
    (void)b;
    st_free(p);
}

static void cpu_zero(st_backend *b, void *p, size_t bytes) {
    (void)b;
    memset(p, 0, bytes);
}

static size_t cpu_mem_free(st_backend *b) {
    (void)b;
    return st_ram_available();
}

// Scratch for quantized activations, grown when a larger batch arrives (a session reserves
// its largest batch up front, so this does not allocate while decoding).
static void *scratch_get(st_backend *b, size_t bytes) {
    if (bytes > b->scratch_bytes) {
        st_free(b->scratch);
        b->scratch = st_alloc(bytes);
        ST_ASSERT(b->scratch); // reserved at session creation; failing here is a planning bug
        b->scratch_bytes = bytes;
    }
    return b->scratch;
}


// The products of one input as one pool run (st_matmul_many). x is quantized once per activation
// type and width the matrices take, each copy in its own part of the scratch.
static void cpu_matmul_many(st_backend *b, int nw, const st_mat *const *w, const float *x, int n, float *const *y) {
    ST_ASSERT(nw >= 1 && nw <= ST_MATMUL_MANY);
    size_t off[ST_MATMUL_MANY], xs[ST_MATMUL_MANY], bytes = 0;
    int same[ST_MATMUL_MANY]; // the first matrix whose copy of x this one uses
    for (int i = 0; i < nw; i++) {
        st_type dt = st_type_get(w[i]->type)->dot_type;
        xs[i] = st_row_bytes(dt, w[i]->cols);
        same[i] = i;
        for (int j = 0; j < i && same[i] == i; j++)
            if (st_type_get(w[j]->type)->dot_type == dt && w[j]->cols == w[i]->cols) same[i] = j;
        off[i] = same[i] < i ? off[same[i]] : bytes;
        if (same[i] == i) bytes += (xs[i] * (size_t)n + 63) / 64 * 64;
    }
    char *xq = scratch_get(b, bytes);
    st_matmul_args a[ST_MATMUL_MANY];
    for (int i = 0; i < nw; i++) {
        st_type dt = st_type_get(w[i]->type)->dot_type;
        if (same[i] == i)
            for (int r = 0; r < n; r++) st_quantize(dt, x + (size_t)r * w[i]->cols, xq + off[i] + r * xs[i], w[i]->cols);
        a[i] = (st_matmul_args){.type = w[i]->type, .w = w[i]->data, .n = w[i]->cols, .rows = w[i]->rows,
                                .x = xq + off[i], .x_stride = xs[i], .nx = n, .y = y[i], .ldy = w[i]->rows,
                                .row_exact = st_row_exact(n)};
    }
    st_matmul_many(b->pool, nw, a);
}

static void cpu_matmul(st_backend *b, const st_mat *w, const float *x, int n, float *y) {
    cpu_matmul_many(b, 1, &w, x, n, &y);
}

static void cpu_get_rows(st_backend *b, const st_mat *w, const int32_t *ids, int n, float *y) {
    (void)b;
    for (int i = 0; i < n; i++) {
        ST_ASSERT(ids[i] >= 0 && ids[i] < w->rows);
        st_dequantize(w->type, (const char *)w->data + (size_t)ids[i] * w->row_bytes,
                      y + (size_t)i * w->cols, w->cols);
    }
}

static void cpu_rmsnorm(st_backend *b, const float *x, const float *w, float *y, int n, int d,
                        float eps) {
    (void)b;
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * d;
        float *yi = y + (size_t)i * d;
        double ss = 0;
        for (int j = 0; j < d; j++) ss += (double)xi[j] * xi[j];
        float s = 1.0f / sqrtf((float)(ss / d) + eps);
        for (int j = 0; j < d; j++) yi[j] = xi[j] * s * (w ? w[j] : 1.0f);
    }
}

static void cpu_mul_silu(st_backend *b, float *y, const float *gate, int64_t n);

static void cpu_rmsnorm_silu(st_backend *b, const float *x, const float *w, const float *gate, float *y, int n, int d,
                             float eps) {
    cpu_rmsnorm(b, x, w, y, n, d, eps);
    cpu_mul_silu(b, y, gate, (int64_t)n * d);
}

static void cpu_norm_matmul(st_backend *b, const float *x, const float *y, float *xo, const float *norm_w, float eps,
                            float *xn, int n, int d, int nw, const st_mat *const *w, float *const *out) {
    if (y) {
        for (size_t i = 0; i < (size_t)n * d; i++) xo[i] = x[i] + y[i];
        x = xo;
    }
    cpu_rmsnorm(b, x, norm_w, xn, n, d, eps);
    if (nw > 0) cpu_matmul_many(b, nw, w, xn, n, out);
}

// RoPE (cpu_rope) on heads hs floats apart: head h of row i at x + (i * n_head + h) * hs, so
// hs = head_dim for (n, n_head, head_dim) and 2 head_dim for the gated attention's queries, each
// followed by its gate.
static void rope_heads(float *x, int n, int n_head, int hs, int n_rot, const int32_t *pos, float base) {
    int half = n_rot / 2;
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < half; k++) {
            double theta = pos[i] * pow(base, -2.0 * k / n_rot);
            float c = (float)cos(theta), s = (float)sin(theta);
            for (int h = 0; h < n_head; h++) {
                float *xh = x + ((size_t)i * n_head + h) * hs;
                float x0 = xh[k], x1 = xh[k + half];
                xh[k] = x0 * c - x1 * s;
                xh[k + half] = x1 * c + x0 * s;
            }
        }
    }
}

// norm_rope on heads hs floats apart (as rope_heads): the rmsnorm of each head, then the rotation.
static void norm_rope_heads(st_backend *b, float *x, const float *w, int n, int n_head, int head_dim, int hs,
                            int n_rot, const int32_t *pos, float base, float eps) {
    for (int i = 0; i < n * n_head; i++) cpu_rmsnorm(b, x + (size_t)i * hs, w, x + (size_t)i * hs, 1, head_dim, eps);
    rope_heads(x, n, n_head, hs, n_rot, pos, base);
}

static void cpu_norm_rope(st_backend *b, float *x, const float *w, int n, int n_head, int head_dim, int n_rot,
                          const int32_t *pos, float base, float eps) {
    norm_rope_heads(b, x, w, n, n_head, head_dim, head_dim, n_rot, pos, base, eps);
}

static void cpu_l2norm(st_backend *b, float *x, int n, int d, float eps, float scale) {
    (void)b;
    for (int i = 0; i < n; i++) {
        float *xi = x + (size_t)i * d;
        double ss = 0;
        for (int j = 0; j < d; j++) ss += (double)xi[j] * xi[j];
        float norm = sqrtf((float)ss);
        float s = scale / (norm > eps ? norm : eps);
        for (int j = 0; j < d; j++) xi[j] *= s;
    }
}

static void cpu_rope(st_backend *b, float *x, int n, int n_head, int head_dim, int n_rot,
                     const int32_t *pos, float base) {
    (void)b;
    rope_heads(x, n, n_head, head_dim, n_rot, pos, base);
}

// ---------------------------------------------------------------------------------------------
// Attention

size_t st_kv_row_bytes(st_kv_type type, int n_values) {
    switch (type) {
    case ST_KV_F16: return (size_t)n_values * 2;
    case ST_KV_Q8_0: return st_row_bytes(ST_TYPE_Q8_0, n_values);
    case ST_KV_F32: return (size_t)n_values * 4;
    }
    return 0;
}

static st_type kv_st_type(st_kv_type t) {
    return t == ST_KV_F16 ? ST_TYPE_F16 : t == ST_KV_Q8_0 ? ST_TYPE_Q8_0 : ST_TYPE_F32;
}

// Reads head h of cache row t into out (head_dim floats).
static void kv_read(const st_kv_layer *kv, const void *base, int t, int h, float *out) {
    const char *row = (const char *)base + (size_t)t * kv->row_bytes;
    st_type ty = kv_st_type(kv->type);
    size_t off = st_row_bytes(ty, (int64_t)h * kv->head_dim);
    st_dequantize(ty, row + off, out, kv->head_dim);
}

// Eight partial sums: independent chains the CPU overlaps, and which the compiler turns into
// two SIMD accumulators (the order differs from a plain loop only by float rounding).
static float dot(const float *restrict x, const float *restrict y, int n) {
    float s[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += x[i + j] * y[i + j];
    for (; i < n; i++) s[0] += x[i] * y[i];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// y (n) += a · x, in blocks of eight the compiler vectorizes
static void axpy(float *restrict y, float a, const float *restrict x, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) y[i + j] += a * x[i + j];
    for (; i < n; i++) y[i] += a * x[i];
}

// Work unit: one KV head and a block of query rows, so each cache row is converted to f32 once
// per tile for all the query heads that share it (GQA) and all rows of the block.
#define ATTN_TILE 128 // cache positions converted at a time (bounds the scratch for any context)
#define ATTN_ROWS 32  // query rows per task: each converted K/V tile serves rows x heads queries

typedef struct attn_job {
    const st_attn_args *a;
    float *scratch;       // per thread: K tile, V tile, then (rows, group) x [m, l, acc[d]]
    size_t per_thread;    // floats
    int n_blocks;
} attn_job;

// Online softmax over the cache, tile by tile: no score buffer whatever the context length.
static void attn_worker(void *ctx, int ith, int nth) {
    const attn_job *job = ctx;
    const st_attn_args *a = job->a;
    const st_kv_layer *kv = a->kv;
    int d = kv->head_dim, G = a->n_head / kv->n_head_kv, H = a->n_head;
    int qs = a->gated ? 2 * d : d; // from one (row, head)'s query to the next
    float *kt = job->scratch + (size_t)ith * job->per_thread, *vt = kt + ATTN_TILE * d, *st = vt + ATTN_TILE * d;
    for (int task = ith; task < kv->n_head_kv * job->n_blocks; task += nth) {
        int hk = task % kv->n_head_kv, r0 = task / kv->n_head_kv * ATTN_ROWS;
        int nr = a->n - r0 < ATTN_ROWS ? a->n - r0 : ATTN_ROWS, end = a->pos0 + r0 + nr;
        for (int x = 0; x < nr * G; x++) {
            float *S = st + (size_t)x * (d + 2);
            S[0] = -INFINITY, S[1] = 0;
            memset(S + 2, 0, sizeof(float) * d);
        }
        for (int t0 = 0; t0 < end; t0 += ATTN_TILE) {
            int tn = end - t0 < ATTN_TILE ? end - t0 : ATTN_TILE;
            for (int t = 0; t < tn; t++) {
                kv_read(kv, kv->k, t0 + t, hk, kt + (size_t)t * d);
                kv_read(kv, kv->v, t0 + t, hk, vt + (size_t)t * d);
            }
            for (int r = 0; r < nr; r++) {
                int seen = a->pos0 + r0 + r - t0 + 1; // this row attends to positions <= its own
                int tmax = seen < tn ? seen : tn;
                for (int g = 0; g < G && tmax > 0; g++) {
                    const float *q = a->q + ((size_t)(r0 + r) * H + hk * G + g) * qs;
                    float *S = st + (size_t)(r * G + g) * (d + 2), *acc = S + 2, m = S[0], l = S[1];
                    // The tile's scores first, then one rescale for the tile's maximum (not
                    // one per key that raises it).
                    float sc[ATTN_TILE], mx = m;
                    for (int t = 0; t < tmax; t++) {
                        sc[t] = dot(q, kt + (size_t)t * d, d) * a->scale;
                        mx = sc[t] > mx ? sc[t] : mx;
                    }
                    if (mx > m) {
                        float c = expf(m - mx); // 0 for the first tile (m = -inf; acc and l are 0)
                        l *= c;
                        for (int j = 0; j < d; j++) acc[j] *= c;
                        m = mx;
                    }
                    for (int t = 0; t < tmax; t++) {
                        float p = expf(sc[t] - m);
                        l += p;
                        axpy(acc, p, vt + (size_t)t * d, d);
                    }
                    S[0] = m, S[1] = l;
                }
            }
        }
        for (int r = 0; r < nr; r++)
            for (int g = 0; g < G; g++) {
                const float *S = st + (size_t)(r * G + g) * (d + 2);
                size_t rh = (size_t)(r0 + r) * H + hk * G + g; // (row, head)
                float *o = a->out + rh * d;
                for (int j = 0; j < d; j++) o[j] = S[2 + j] / S[1];
                if (!a->gated) continue;
                const float *gate = a->q + rh * qs + d; // cpu_mul_sigmoid's arithmetic on the stored value
                for (int j = 0; j < d; j++) o[j] *= 1.0f / (1.0f + expf(-gate[j]));
            }
    }
}

static void cpu_attention(st_backend *b, const st_attn_args *a) {
    st_kv_layer *kv = a->kv;
    int nv = kv->n_head_kv * kv->head_dim;
    if (a->q_norm) {
        int qs = a->gated ? 2 * kv->head_dim : kv->head_dim; // the queries only, not their gates
        norm_rope_heads(b, a->q, a->q_norm, a->n, a->n_head, kv->head_dim, qs, a->n_rot, a->pos, a->rope_base, a->eps);
        cpu_norm_rope(b, a->k, a->k_norm, a->n, kv->n_head_kv, kv->head_dim, a->n_rot, a->pos, a->rope_base, a->eps);
    }
    ST_ASSERT(a->pos0 >= 0 && a->pos0 + a->n <= kv->n_ctx);
    st_type ty = kv_st_type(kv->type);
    for (int i = 0; i < a->n; i++) {
        size_t off = (size_t)(a->pos0 + i) * kv->row_bytes;
        st_quantize(ty, a->k + (size_t)i * nv, (char *)kv->k + off, nv);
        st_quantize(ty, a->v + (size_t)i * nv, (char *)kv->v + off, nv);
    }
    int d = kv->head_dim, G = a->n_head / kv->n_head_kv, nth = st_pool_size(b->pool);
    attn_job job = {.a = a, .n_blocks = (a->n + ATTN_ROWS - 1) / ATTN_ROWS,
                    .per_thread = (size_t)2 * ATTN_TILE * d + (size_t)ATTN_ROWS * G * (d + 2)};
    job.scratch = scratch_get(b, sizeof(float) * job.per_thread * (nth > 0 ? nth : 1));
    st_pool_run(b->pool, attn_worker, &job);
    if (a->wo) cpu_matmul(b, a->wo, a->out, a->n, a->y);
}

// ---------------------------------------------------------------------------------------------
// Gated DeltaNet

static void cpu_conv(st_backend *b, const st_conv_args *a) {
    (void)b;
    int K = a->kernel, C = a->channels;
    for (int t = 0; t < a->n; t++) {
        for (int c = 0; c < C; c++) {
            float s = 0;
            for (int j = 0; j < K; j++) {
                int src = t - (K - 1) + j; // < 0: from the state
                float xv = src >= 0 ? a->x[(size_t)src * C + c] : a->state[(size_t)(K - 1 + src) * C + c];
                s += a->w[(size_t)c * K + j] * xv;
            }
            a->y[(size_t)t * C + c] = s / (1.0f + expf(-s));
        }
    }
    // The new state: the last K-1 raw rows of [state; x].
    for (int r = 0; r < K - 1; r++) {
        int src = a->n - (K - 1) + r;
        float *dst = a->state + (size_t)r * C;
        if (src >= 0) memcpy(dst, a->x + (size_t)src * C, sizeof(float) * C);
        else memmove(dst, a->state + (size_t)(K - 1 + src) * C, sizeof(float) * C);
    }
}


// y (n) *= a
static void scale(float *y, float a, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) y[i + j] *= a;
    for (; i < n; i++) y[i] *= a;
}

typedef struct gdn_job {
    const st_gdn_args *a;
} gdn_job;

// One value head per task: S ← e^g S; m = S k; S ← S + (β (v − m)) kᵀ; o = S q, rows of S being
// value indices with contiguous key dims.
static void gdn_worker(void *ctx, int ith, int nth) {
    const st_gdn_args *a = ((gdn_job *)ctx)->a;
    int d = a->d, r = a->h_v / a->h_k;
    for (int j = ith; j < a->h_v; j += nth) {
        float *S = a->state + (size_t)j * d * d;
        for (int t = 0; t < a->n; t++) {
            const float *q = a->q + ((size_t)t * a->h_k + j / r) * d;
            const float *k = a->k + ((size_t)t * a->h_k + j / r) * d;
            const float *v = a->v + ((size_t)t * a->h_v + j) * d;
            float beta = a->beta[(size_t)t * a->h_v + j];
            float decay = expf(a->g[(size_t)t * a->h_v + j]);
            float *o = a->out + ((size_t)t * a->h_v + j) * d;
            for (int vi = 0; vi < d; vi++) {
                float *row = S + (size_t)vi * d;
                scale(row, decay, d);
                float m = dot(row, k, d);
                axpy(row, beta * (v[vi] - m), k, d);
                o[vi] = dot(row, q, d);
            }
        }
    }
}

static void cpu_gdn(st_backend *b, const st_gdn_args *a) {
    gdn_job job = {a};
    st_pool_run(b->pool, gdn_worker, &job);
}

// y (d) += Σ_{l<m} coef[l] · X[l], X's rows ld floats apart: eight columns at a time held in
// registers across all m rows, so y is loaded and stored once instead of m times.
static void combine(float *restrict y, const float *restrict coef, const float *restrict X, int ld,
                    int m, int d) {
    int x = 0;
    for (; x + 8 <= d; x += 8) {
        float acc[8];
        for (int j = 0; j < 8; j++) acc[j] = y[x + j];
        for (int l = 0; l < m; l++)
            for (int j = 0; j < 8; j++) acc[j] += coef[l] * X[(size_t)l * ld + x + j];
        for (int j = 0; j < 8; j++) y[x + j] = acc[j];
    }
    for (; x < d; x++)
        for (int l = 0; l < m; l++) y[x] += coef[l] * X[(size_t)l * ld + x];
}

// One chunk of c rows (t0 .. t0+c-1) of value head j, with S the head's state (rows are value
// indices, key dims contiguous, so S[vi] · k is (Sᵀk)[vi] in REFERENCE's notation). With the
// in-chunk cumulative log-decay γ_i = Σ_{l≤i} g_l and D_il = exp(γ_i − γ_l) (≤ 1 for l ≤ i):
//   A  = strict_lower( (diag(β) K Kᵀ) ⊙ D )
//   (I + A) U = diag(β) V,  (I + A) W = diag(β ⊙ exp(γ)) K     forward substitution, = T Vβ, T Kβ e^γ
//   V' = U − W S
//   O  = diag(exp(γ)) Q S + lower_incl( (Q Kᵀ) ⊙ D ) V'
//   S ← exp(γ_c) S + (diag(exp(γ_c − γ)) K)ᵀ V'
static void gdn_chunk(const st_gdn_args *a, int j, int t0, int c, float *S) {
    enum { C = ST_GDN_CHUNK, DM = ST_GDN_MAX_D };
    int d = a->d, r = a->h_v / a->h_k, hk = j / r;
    float gam[C] = {0}, coef[C];
    float U[C][DM], W[C][DM]; // U then V'; W then the decayed keys of the state update
#define Q_(i) (a->q + ((size_t)(t0 + (i)) * a->h_k + hk) * d)
#define K_(i) (a->k + ((size_t)(t0 + (i)) * a->h_k + hk) * d)
#define V_(i) (a->v + ((size_t)(t0 + (i)) * a->h_v + j) * d)
#define O_(i) (a->out + ((size_t)(t0 + (i)) * a->h_v + j) * d)
#define BETA_(i) (a->beta[(size_t)(t0 + (i)) * a->h_v + j])
    for (int i = 0; i < c; i++) gam[i] = (i ? gam[i - 1] : 0.0f) + a->g[(size_t)(t0 + i) * a->h_v + j];
    // U and W row by row: row i = its right-hand side − Σ_{l<i} A_il (row l).
    for (int i = 0; i < c; i++) {
        float beta = BETA_(i), bdecay = beta * expf(gam[i]);
        const float *ki = K_(i), *vi = V_(i);
        for (int x = 0; x < d; x++) {
            U[i][x] = beta * vi[x];
            W[i][x] = bdecay * ki[x];
        }
        for (int l = 0; l < i; l++) coef[l] = -beta * dot(ki, K_(l), d) * expf(gam[i] - gam[l]);
        combine(U[i], coef, U[0], DM, i, d);
        combine(W[i], coef, W[0], DM, i, d);
    }
    // With the state entering the chunk: V' = U − W S (in U), and O's inter-chunk term.
    for (int i = 0; i < c; i++) {
        const float *qi = Q_(i);
        float *oi = O_(i), e = expf(gam[i]);
        for (int vi = 0; vi < d; vi++) {
            const float *row = S + (size_t)vi * d;
            U[i][vi] -= dot(W[i], row, d);
            oi[vi] = e * dot(qi, row, d);
        }
    }
    // O's intra-chunk term.
    for (int i = 0; i < c; i++) {
        const float *qi = Q_(i);
        for (int l = 0; l <= i; l++) coef[l] = dot(qi, K_(l), d) * expf(gam[i] - gam[l]);
        combine(O_(i), coef, U[0], DM, i + 1, d);
    }
    // The state update, row vi of S taking column vi of V' as coefficients.
    float ec = expf(gam[c - 1]);
    for (int i = 0; i < c; i++) {
        const float *ki = K_(i);
        float e = expf(gam[c - 1] - gam[i]);
        for (int x = 0; x < d; x++) W[i][x] = e * ki[x];
    }
    for (int vi = 0; vi < d; vi++) {
        float *row = S + (size_t)vi * d;
        scale(row, ec, d);
        for (int i = 0; i < c; i++) coef[i] = U[i][vi];
        combine(row, coef, W[0], DM, c, d);
    }
#undef Q_
#undef K_
#undef V_
#undef O_
#undef BETA_
}

// One value head per task, its rows in chunks of ST_GDN_CHUNK; a last partial chunk of c rows
// is the same as one padded with no-op rows (g = 0, β = 0).
static void gdn_chunked_worker(void *ctx, int ith, int nth) {
    const st_gdn_args *a = ((gdn_job *)ctx)->a;
    for (int j = ith; j < a->h_v; j += nth) {
        float *S = a->state + (size_t)j * a->d * a->d;
        for (int t0 = 0; t0 < a->n; t0 += ST_GDN_CHUNK)
            gdn_chunk(a, j, t0, a->n - t0 < ST_GDN_CHUNK ? a->n - t0 : ST_GDN_CHUNK, S);
    }
}

static void cpu_gdn_chunked(st_backend *b, const st_gdn_args *a) {
    ST_ASSERT(a->d <= ST_GDN_MAX_D);
    gdn_job job = {a};
    st_pool_run(b->pool, gdn_chunked_worker, &job);
}

// ---------------------------------------------------------------------------------------------
// Elementwise

static void cpu_add(st_backend *b, float *y, const float *x, int64_t n) {
    (void)b;
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
}

static void cpu_swiglu(st_backend *b, const float *gate, const float *up, float *y, int64_t n) {
    (void)b;
    for (int64_t i = 0; i < n; i++) y[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

static void cpu_mul_sigmoid(st_backend *b, float *y, const float *gate, int64_t n) {
    (void)b;
    for (int64_t i = 0; i < n; i++) y[i] *= 1.0f / (1.0f + expf(-gate[i]));
}

static void cpu_mul_silu(st_backend *b, float *y, const float *gate, int64_t n) {
    (void)b;
    for (int64_t i = 0; i < n; i++) y[i] *= gate[i] / (1.0f + expf(-gate[i]));
}

static void cpu_add_gated_rows(st_backend *b, float *y, const float *x, const float *g, int n, int d) {
    (void)b;
    for (int i = 0; i < n; i++) {
        float s = 1.0f / (1.0f + expf(-g[i]));
        for (int j = 0; j < d; j++) y[(size_t)i * d + j] += s * x[(size_t)i * d + j];
    }
}

// softplus as PyTorch computes it: linear above 20.
static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static void cpu_gdn_gates(st_backend *b, const float *ba, const float *ssm_a, const float *dt_bias,
                          float *beta, float *g, int n, int h_k, int h_v) {
    (void)b;
    int r = h_v / h_k;
    for (int i = 0; i < n; i++) {
        const float *row = ba + (size_t)i * 2 * h_v;
        for (int j = 0; j < h_v; j++) {
            int grp = j / r, w = j % r;
            float bj = row[grp * 2 * r + w], aj = row[grp * 2 * r + r + w];
            beta[(size_t)i * h_v + j] = 1.0f / (1.0f + expf(-bj));
            g[(size_t)i * h_v + j] = ssm_a[j] * softplus(aj + dt_bias[j]);
        }
    }
}

void st_deltanet_ops(st_backend *b, const st_deltanet_args *a) {
    const st_backend_ops *ops = b->ops;
    int n = a->n, d = a->d, hk = a->h_k, hv = a->h_v, kd = hk * d, vd = hv * d, cd = 2 * kd + vd;
    st_conv_args ca = {.x = a->qkv, .w = a->conv_w, .state = a->conv_state, .y = a->u, .n = n, .channels = cd,
                       .kernel = a->kernel};
    ops->conv(b, &ca);
    ops->copy_cols(b, a->u, cd, 0, a->q, kd, 0, n, kd);
    ops->copy_cols(b, a->u, cd, kd, a->k, kd, 0, n, kd);
    ops->copy_cols(b, a->u, cd, 2 * kd, a->v, vd, 0, n, vd);
    ops->l2norm(b, a->q, n * hk, d, a->eps, 1.0f / sqrtf((float)d));
    ops->l2norm(b, a->k, n * hk, d, a->eps, 1.0f);
    ops->gdn_gates(b, a->ba, a->ssm_a, a->dt_bias, a->beta, a->g, n, hk, hv);
    st_gdn_args ga = {.q = a->q, .k = a->k, .v = a->v, .beta = a->beta, .g = a->g, .state = a->state, .out = a->out,
                      .n = n, .h_k = hk, .h_v = hv, .d = d};
    bool chunked = ops->gdn_chunked_from > 0 && n >= ops->gdn_chunked_from; // prompt chunks, where it pays
    (chunked ? ops->gdn_chunked : ops->gdn)(b, &ga);
    ops->rmsnorm_silu(b, a->out, a->norm_w, a->z, a->out, n * hv, d, a->eps);
    if (a->wo) ops->matmul(b, a->wo, a->out, n, a->y);
}

void st_shared_ffn_ops(st_backend *b, const st_shared_ffn_args *a) {
    const st_backend_ops *ops = b->ops;
    int64_t d = a->gate->cols;
    st_mat gate_inp = {ST_TYPE_F32, d, 1, sizeof(float) * (size_t)d, a->gate_inp};
    const st_mat *w[3] = {a->gate, a->up, &gate_inp};
    float *y[3] = {a->g, a->u, a->s};
    ops->matmul_many(b, 3, w, a->x, a->n, y);
    ops->swiglu(b, a->g, a->u, a->g, (int64_t)a->n * a->gate->rows);
    ops->matmul(b, a->down, a->g, a->n, a->o);
}

static void cpu_split_heads(st_backend *b, const float *x, float *ya, float *yb, int n, int heads,
                            int a, int bdim) {
    (void)b;
    for (int i = 0; i < n * heads; i++) {
        memcpy(ya + (size_t)i * a, x + (size_t)i * (a + bdim), sizeof(float) * a);
        memcpy(yb + (size_t)i * bdim, x + (size_t)i * (a + bdim) + a, sizeof(float) * bdim);
    }
}

static void cpu_copy_cols(st_backend *b, const float *x, int64_t ldx, int64_t x_from, float *y,
                          int64_t ldy, int64_t y_from, int n, int64_t w) {
    (void)b;
    for (int i = 0; i < n; i++)
        memcpy(y + (size_t)i * ldy + y_from, x + (size_t)i * ldx + x_from, sizeof(float) * w);
}

static void cpu_copy(st_backend *b, float *dst, const float *src, int64_t n) {
    (void)b;
    memmove(dst, src, sizeof(float) * n);
}

static void cpu_bytes_copy(st_backend *b, void *dst, const void *src, size_t bytes) {
    (void)b;
    memmove(dst, src, bytes);
}

// ---------------------------------------------------------------------------------------------
// Router, argmax, and the work hooks (the CPU runs everything as it comes)

void st_moe_route(const float *logits, int n, int n_expert, int k, int32_t *ids, float *weights) {
    for (int i = 0; i < n; i++) {
        const float *l = logits + (size_t)i * n_expert;
        float mx = -INFINITY;
        for (int e = 0; e < n_expert; e++) mx = l[e] > mx ? l[e] : mx;
        double sum = 0;
        for (int e = 0; e < n_expert; e++) sum += exp((double)l[e] - mx);
        // top-k by repeated selection over the logits (softmax is monotonic); k is small.
        int32_t *id = ids + (size_t)i * k;
        float *w = weights + (size_t)i * k;
        double wsum = 0;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < n_expert; e++) {
                bool taken = false;
                for (int q = 0; q < j; q++) taken |= id[q] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            id[j] = best;
            w[j] = (float)(exp((double)l[best] - mx) / sum);
            wsum += w[j];
        }
        if (wsum < 6.1e-5) wsum = 6.1e-5; // llama.cpp's clamp; unreachable with softmax weights
        for (int j = 0; j < k; j++) w[j] = (float)(w[j] / wsum);
    }
}

static void cpu_moe_route(st_backend *b, const float *logits, int n, int n_expert, int k, int32_t *ids,
                          float *weights) {
    (void)b;
    st_moe_route(logits, n, n_expert, k, ids, weights);
}

// The index `for (j) if (r[j] > r[best]) best = j` finds (the first of the largest values; a NaN
// only from r[0]), in two passes the compiler vectorizes: the largest value over eight lanes,
// then its first position. The plain loop reloads r[best] each step, a chain of dependent loads:
// 0.4-0.5 ms a token over a 151,936-word vocabulary on the 2-thread Xeon VM.
static int argmax_row(const float *restrict r, int d) {
    if (d < 8 || r[0] != r[0]) {
        int best = 0;
        for (int j = 1; j < d; j++) best = r[j] > r[best] ? j : best;
        return best;
    }
    float m[8]; // from r[0], not a NaN: a NaN never enters a lane
    for (int j = 0; j < 8; j++) m[j] = r[0];
    int i = 0;
    for (; i + 8 <= d; i += 8)
        for (int j = 0; j < 8; j++) m[j] = r[i + j] > m[j] ? r[i + j] : m[j];
    for (; i < d; i++) m[0] = r[i] > m[0] ? r[i] : m[0];
    float mx = m[0];
    for (int j = 1; j < 8; j++) mx = m[j] > mx ? m[j] : mx;
    int best = 0;
    while (!(r[best] == mx)) best++; // mx is one of the values (r[0] is not a NaN)
    return best;
}

static void cpu_argmax(st_backend *b, const float *x, int n, int d, int32_t *ids) {
    (void)b;
    for (int i = 0; i < n; i++) ids[i] = argmax_row(x + (size_t)i * d, d);
}

static st_status cpu_sync(st_backend *b) {
    (void)b;
    return ST_OK;
}

static st_status cpu_run(st_backend *b, void **slot, st_work_fn fn, void *ctx) {
    (void)b, (void)slot;
    return fn(ctx);
}

static void cpu_graph_free(st_backend *b, void *graph) { (void)b, (void)graph; }

static void cpu_destroy(st_backend *b) {
    st_pool_free(b->pool);
    st_free(b->scratch);
    st_free(b);
}

static const st_backend_ops cpu_ops = {
    .name = "cpu",
    .host_memory = true,
    .destroy = cpu_destroy,
    .sync = cpu_sync,
    .run = cpu_run,
    .graph_free = cpu_graph_free,
    .moe_route = cpu_moe_route,
    .argmax = cpu_argmax,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .zero = cpu_zero,
    .mem_free = cpu_mem_free,
    .matmul = cpu_matmul,
    .matmul_many = cpu_matmul_many,
    .get_rows = cpu_get_rows,
    .rmsnorm = cpu_rmsnorm,
    .rmsnorm_silu = cpu_rmsnorm_silu,
    .norm_matmul = cpu_norm_matmul,
    .norm_rope = cpu_norm_rope,
    .l2norm = cpu_l2norm,
    .rope = cpu_rope,
    .attention = cpu_attention,
    .conv = cpu_conv,
    .gdn = cpu_gdn,
    .gdn_chunked = cpu_gdn_chunked,
    // Timed at Qwen3-Next's shape (test_backend_gdn --bench), the step form is as fast or faster
    // for every row count on this scalar code (512 rows: 0.45 vs 0.47-0.55 ms CPU per row): the
    // chunked form saves no work on a CPU (both ~4 d² multiply-adds per row and head), it only
    // turns the work into matrix products, which pay on a GPU. So the CPU forward steps, which
    // also keeps the logits bit-identical whatever the prompt chunking. (The two forms differ by
    // float rounding, which quantized activations can amplify: chunking from 8 rows moved a
    // q8_0/q4_K tiny-next's logits by 1.1% of the largest and flipped 1 top-1 of 70 at a
    // near-tie, --batch 512 against --batch 1.)
    .gdn_chunked_from = 0,
    .deltanet = st_deltanet_ops,
    .shared_ffn = st_shared_ffn_ops,
    .add = cpu_add,
    .swiglu = cpu_swiglu,
    .mul_sigmoid = cpu_mul_sigmoid,
    .mul_silu = cpu_mul_silu,
    .add_gated_rows = cpu_add_gated_rows,
    .gdn_gates = cpu_gdn_gates,
    .split_heads = cpu_split_heads,
    .copy_cols = cpu_copy_cols,
    .copy = cpu_copy,
    .to_host = cpu_bytes_copy,
    .from_host = cpu_bytes_copy,
};

st_status st_backend_cpu_create(int n_threads, st_backend **out) {
    *out = NULL;
    if (n_threads < 1) return st_fail(ST_ERR_ARG, "threads: %d (must be at least 1)", n_threads);
    st_backend *b = st_calloc(1, sizeof *b);
    if (!b) return ST_ERR_NOMEM;
    b->ops = &cpu_ops;
    b->pool = st_pool_create(n_threads);
    if (!b->pool) {
        st_free(b);
        return st_fail(ST_ERR_NOMEM, "cannot start %d CPU threads", n_threads);
    }
    *out = b;
    return ST_OK;
}

void st_backend_free(st_backend *b) {
    if (b) b->ops->destroy(b);
}
