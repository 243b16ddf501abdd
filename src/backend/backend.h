// backend: the op interface the model forwards are written over, the CPU backend and the CUDA
// backend. Ops work on rows of float activations held in the backend's memory; weights are
// matrices in any ggml type. cpu.c is the reference every other backend is tested against;
// cuda/ fills the same table on an NVIDIA GPU.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "quant/quant.h"
#include "util/util.h"

// A weight matrix (rows, cols): row r is the contiguous bytes data + r * row_bytes, with quant
// blocks along cols. As stored in GGUF: ne = {cols, rows}.
typedef struct st_mat {
    st_type type;
    int64_t cols, rows;
    size_t row_bytes;
    const void *data;
} st_mat;

// A stack of n equally shaped matrices (ggml ne = {cols, rows, n}): the routed experts.
typedef struct st_mat3 {
    st_type type;
    int64_t cols, rows, n;
    size_t row_bytes, mat_bytes;
    const void *data;
} st_mat3;

static inline st_mat st_mat3_get(const st_mat3 *m, int64_t i) {
    st_mat r = {m->type, m->cols, m->rows, m->row_bytes, (const char *)m->data + i * m->mat_bytes};
    return r;
}

// KV cache element types.
typedef enum st_kv_type { ST_KV_F16, ST_KV_Q8_0, ST_KV_F32 } st_kv_type;

// One attention layer's cache: rows of n_head_kv * head_dim values for K and for V.
typedef struct st_kv_layer {
    st_kv_type type;
    int n_ctx, n_head_kv, head_dim;
    size_t row_bytes;  // bytes of one position's K (or V) row
    void *k, *v;       // (n_ctx, row_bytes)
} st_kv_layer;

// Causal attention for n new rows at positions pos0 .. pos0+n-1: stores k and v in the cache,
// then each query row attends to cache rows 0 .. its own position. out = softmax(q·kᵀ·scale)·v.
// pos0 is also in backend memory at *pos_dev: a backend that replays recorded work (CUDA
// graphs) reads it there, so one recording serves every position.
// With q_norm set, q and k are the raw projections: the op first applies Qwen3's per-head norms
// and the rotary embedding, as norm_rope does (q_norm / k_norm, n_rot, rope_base, eps, row i at
// position pos[i]), overwriting q and k.
// With gated set (Qwen3-Next's gated attention), q is the gated q projection's rows as they are:
// (n, n_head, 2 head_dim), each head's query followed by its gate. The norms and RoPE apply to
// the queries only, and out = softmax(query·kᵀ·scale)·v ⊙ sigmoid(gate) per head, elementwise
// (mul_sigmoid's arithmetic), before the output projection: the values of split_heads,
// attention, mul_sigmoid and matmul one after another, in one op.
typedef struct st_attn_args {
    st_kv_layer *kv;
    const int32_t *pos_dev; // (1) pos0, backend memory
    float *q;          // (n, n_head, head_dim); with gated (n, n_head, 2 head_dim): [query | gate]
    float *k;          // (n, n_head_kv, head_dim)
    const float *v;    // (n, n_head_kv, head_dim)
    float *out;        // (n, n_head, head_dim)
    int n, pos0, n_head;
    float scale;
    const float *q_norm, *k_norm; // (head_dim) or NULL: q and k are ready
    const int32_t *pos;           // (n) backend memory
    int n_rot;
    float rope_base, eps;
    bool gated;                   // q holds [query | gate] per head: out is gated (see above)
    // The output projection, or NULL: y (n, wo->rows) = wo · out after the attention (and the
    // gate; out is still written). A backend may hand out to it quantized as it writes it.
    const st_mat *wo;
    float *y;
} st_attn_args;

// Gated DeltaNet recurrence (REFERENCE.md §3.3) over n rows for h_v value heads of size d,
// key heads h_k (value head j reads key head j / (h_v / h_k)). q and k are already L2-normed
// (q scaled by 1/sqrt(d)). state (h_v, d_v, d_k): for each value index the key dims are
// contiguous. Updated in place.
typedef struct st_gdn_args {
    const float *q, *k;   // (n, h_k, d)
    const float *v;       // (n, h_v, d)
    const float *beta;    // (n, h_v) in (0, 1)
    const float *g;       // (n, h_v) log-decay <= 0
    float *state;         // (h_v, d, d)
    float *out;           // (n, h_v, d)
    int n, h_k, h_v, d;
} st_gdn_args;

// The chunked form of the same recurrence (REFERENCE.md §3.3 step 8) works on chunks of
// ST_GDN_CHUNK rows at a time; its per-chunk buffers are (chunk, d) rows on the stack, hence the
// cap on d (Qwen3-Next has d = 128; the model loader rejects larger heads).
#define ST_GDN_CHUNK 64
#define ST_GDN_MAX_D 256

// Depthwise causal conv over time + SiLU: y[t][c] = silu(Σ_j w[c][j] · x[t-K+1+j][c]), where
// rows before t=0 come from state (the K-1 raw rows before this call), updated in place.
typedef struct st_conv_args {
    const float *x;     // (n, channels) raw rows
    const float *w;     // (channels, K) taps, w[c][K-1] multiplies the current row
    float *state;       // (K-1, channels)
    float *y;           // (n, channels)
    int n, channels, kernel;
} st_conv_args;

// The Gated DeltaNet mixer between its input products and its output product, over n rows
// (REFERENCE.md §3.3): u = conv(qkv) + SiLU (conv_state updated); q and k, u's first two groups
// of h_k heads of d, l2-normalized (q also scaled by 1/sqrt(d)), v its h_v heads after them;
// beta and g from ba (gdn_gates); o = the delta rule (state updated); out = rmsnorm(o) · norm_w
// ⊙ silu(z) per value head; then, with wo, y = wo · out. The values of conv, copy_cols, l2norm,
// gdn_gates, gdn (or gdn_chunked from gdn_chunked_from rows), rmsnorm_silu and matmul in that
// order (st_deltanet_ops); a device may run a decode window as one kernel and the product.
typedef struct st_deltanet_args {
    const float *qkv;             // (n, conv_dim) raw rows, conv_dim = 2 h_k d + h_v d
    const float *conv_w;          // (conv_dim, kernel)
    float *conv_state;            // (kernel - 1, conv_dim)
    const float *ba;              // (n, h_k, [b (r), a (r)]), r = h_v / h_k
    const float *ssm_a, *dt_bias; // (h_v)
    const float *z;               // (n, h_v d) the output gate
    const float *norm_w;          // (d)
    float *state;                 // (h_v, d, d) as st_gdn_args
    float *out;                   // (n, h_v d)
    // The output projection, or NULL: y (n, wo->rows) = wo · out after the mixer (a device may
    // hand it the mixer's output as the product's own quantization would).
    const st_mat *wo;
    float *y;
    // Work buffers of the ops one after another (backend memory): u (n, conv_dim), q and k
    // (n, h_k d), v (n, h_v d), beta and g (n, h_v).
    float *u, *q, *k, *v, *beta, *g;
    int n, h_k, h_v, d, kernel;
    float eps;
} st_deltanet_args;

// The routed experts of one layer (the experts module computes host-placed experts on the CPU
// pool; a backend whose memory holds the experts computes them with its moe op).
typedef struct st_moe_args {
    int layer;
    const st_mat3 *gate, *up, *down; // (F, d), (F, d), (d, F) per expert
    const float *x;                  // (n, d) normed input
    const int32_t *ids;              // (n, k) chosen experts
    const float *weights;            // (n, k) their weights
    // Or NULL. The router's logits (n, the router's expert count): the op routes first, as
    // moe_route does, writing ids and weights (writable backend memory then), so a backend may
    // fold the routing into its expert kernels (st_experts_compute passes it on for layers the
    // device holds whole and for decode windows' hybrid layers; elsewhere it routes first).
    const float *logits;
    int n, k;
    float *y;                        // (n, d) output
    bool accumulate;                 // y += the experts' sum (else y =)
    // Or NULL (backend memory): y += sigmoid(gated_s[i]) · gated_o row i after the experts (the
    // shared expert's output and gate logit, as add_gated_rows), so a backend may fold it into
    // its last kernel.
    const float *gated_o, *gated_s;
    // Optional, backend memory. slot_map (n_expert): expert e is matrix slot_map[e] of the
    // gate/up/down stacks (whose n is then the slot count), or -1: not here, skipped (it adds
    // nothing; the experts module computes it elsewhere). NULL: expert e is matrix e.
    const int32_t *slot_map;
    int n_expert;                    // with slot_map: the router's expert count
    uint32_t *counts;                // (n_expert) += 1 per routed (row, choice); NULL: not counted
} st_moe_args;

// The shared expert of n rows (Qwen3-Next's MoE blocks): g = x · gateᵀ, u = x · upᵀ, s = x ·
// gate_inp (its gate logit, one a row), o = (silu(g) · u) · downᵀ (swiglu into g): the values of
// matmul_many, swiglu and matmul in that order (st_shared_ffn_ops). A device may run it beside
// the ops after it up to the first that reads o or s, which must be the moe op given them as
// gated_o / gated_s, or add_gated_rows; the ops in between write none of x, g, u, s and o.
typedef struct st_shared_ffn_args {
    const st_mat *gate, *up, *down; // (F, d), (F, d), (d, F)
    const float *gate_inp;          // (d) f32
    const float *x;                 // (n, d) normed input
    float *g, *u, *s, *o;           // (n, F), (n, F) work; (n) gate logits; (n, d) output
    int n;
} st_shared_ffn_args;

typedef struct st_backend st_backend;

// One hybrid layer's hand-off (host_alloc memory is mapped into the device).
typedef struct st_hand_args {
    const int32_t *ids;      // (n, k) backend memory: the chosen experts
    const float *weights;    // (n, k)
    // Or NULL. The router's logits (n, n_expert): publish routes the rows itself, as moe_route
    // does, for the host (ids and weights may be used as scratch; the moe op, given the same
    // logits, fills them for the device), so it need not run before the device's experts.
    const float *logits;
    const float *x;          // (n, d) the rows' input
    const int32_t *slot_map; // (n_expert) backend memory: slot or -1 (missing)
    int n, k, d, n_expert;
    const uint32_t *seq;     // backend memory: the window's number
    int32_t *need;           // backend memory: publish's finding, read by collect
    // The slot in host_alloc memory: header flags and the copies.
    uint32_t *pub;           // = *seq once published; pub[1] = 1 when the host has work
    uint32_t *done;          // = *seq once the host answered
    int32_t *h_ids;
    float *h_w, *h_x;
    const float *h_y;        // (n, d) the host's result
    float *y;                // (n, d) backend memory: += h_y
    uint64_t *wait_ns;       // host_alloc memory or NULL: collect writes the ns it waited for the host
} st_hand_args;

// How long a device waits for a host thread's answer (hand_collect) before it gives up.
#define ST_HOST_WAIT_S 60

// Matrices one matmul_many call takes.
#define ST_MATMUL_MANY 4

// Windows of at most this many rows (decode, verify) may be recorded and replayed; larger
// calls (prompt chunks) always run as they come.
#define ST_GRAPH_ROWS 16
// A window's rows get the bits each row gets alone (exact verification): its products are
// row-exact (st_matmul_args.row_exact); prompt chunks may sum in any order.
static inline bool st_row_exact(int n) { return n <= ST_GRAPH_ROWS; }

// A recorded window is planned for a context of st_graph_ctx(pos_end, n_ctx) positions: 256, then
// doubling past the window's last position pos_end, at most the cache's n_ctx. So a short
// context's kernels (attention's splits of the context) are sized for it, not for the whole
// cache. The caller keeps a recording per window size and plan (st_graph_plan, < ST_GRAPH_PLANS),
// so a context that outgrows its plan is recorded anew.
#define ST_GRAPH_PLANS 20
static inline int st_graph_plan(int pos_end) {
    int k = 0;
    while (k < ST_GRAPH_PLANS - 1 && (256 << k) < pos_end) k++;
    return k;
}
static inline int st_graph_ctx(int pos_end, int n_ctx) {
    int c = 256 << st_graph_plan(pos_end);
    return c < n_ctx ? c : n_ctx;
}

// Work a backend may record once and replay (a CUDA graph of a decode step): see run.
typedef st_status (*st_work_fn)(void *ctx);

typedef struct st_backend_ops {
    const char *name;
    // Backend memory is host memory (the CPU): weights are used in place, never uploaded.
    bool host_memory;
    void (*destroy)(st_backend *b);
    void *(*alloc)(st_backend *b, size_t bytes);  // NULL + st_error on failure
    void (*free)(st_backend *b, void *p);
    // A copy of host bytes in backend memory (weights); NULL + st_error on failure. Only for
    // backends without host_memory; freed with free.
    void *(*upload)(st_backend *b, const void *host, size_t bytes);
    // Waits for queued work; returns the first error since the last sync (ops are void: a
    // device fault is kept and reported here).
    st_status (*sync)(st_backend *b);
    // Runs fn(ctx), whose ops only ever see the same pointers and sizes for a given *slot: a
    // backend may record the work the first times and replay the recording later (fn is then
    // not called). *slot (NULL at first) holds the recording; release it with graph_free. The
    // host values fn's ops read must come from backend memory (positions: pos_dev, pos ids).
    // With b->eager set, fn just runs (see st_backend).
    st_status (*run)(st_backend *b, void **slot, st_work_fn fn, void *ctx);
    void (*graph_free)(st_backend *b, void *graph);
    void (*zero)(st_backend *b, void *p, size_t bytes);
    size_t (*mem_free)(st_backend *b);           // bytes the backend can still allocate; 0 = unknown
    // The device's memory in all (free or not, every process's); NULL on backends without a
    // device memory of their own (the CPU). With mem_free it gives what is in use before Strata
    // allocates: the CUDA context, other programs (what --vram-budget-gib counts as taken).
    size_t (*mem_total)(st_backend *b);
    // y (n, w.rows) = x (n, w.cols) · wᵀ
    void (*matmul)(st_backend *b, const st_mat *w, const float *x, int n, float *y);
    // Products of one input with up to ST_MATMUL_MANY matrices: y[i] = x · w[i]ᵀ (q, k and v of
    // a normed input; a device backend runs matrices of one type and width as one launch).
    void (*matmul_many)(st_backend *b, int nw, const st_mat *const *w, const float *x, int n, float *const *y);
    // y (n, w.cols) = rows ids[i] of w, dequantized (the embedding lookup)
    void (*get_rows)(st_backend *b, const st_mat *w, const int32_t *ids, int n, float *y);
    // y (n, d) = x / sqrt(mean(x²) + eps) · w per row; w (d) or NULL for no scale
    void (*rmsnorm)(st_backend *b, const float *x, const float *w, float *y, int n, int d, float eps);
    // y (n, d) = rmsnorm(x) · w ⊙ silu(gate) (Qwen3-Next's gated norm of the DeltaNet output):
    // the values of rmsnorm then mul_silu (a device runs it as one kernel); y may alias x.
    void (*rmsnorm_silu)(st_backend *b, const float *x, const float *w, const float *gate, float *y, int n, int d,
                         float eps);
    // The residual add, the norm after it and the products that read the normed rows, as one
    // op: with y, xo (n, d) = x + y (else x is the sum, and xo is not written); xn =
    // rmsnorm(sum) · norm_w (norm_w (d) or NULL); then out[i] = xn · w[i]ᵀ for i < nw
    // (nw 0 .. ST_MATMUL_MANY, every w[i] d wide). xo must not alias x: a device computes the
    // sum in many blocks that each read all of it. The values are those of the add, rmsnorm
    // and matmul_many one after another (a device may fold the first two into the products).
    void (*norm_matmul)(st_backend *b, const float *x, const float *y, float *xo, const float *norm_w, float eps,
                        float *xn, int n, int d, int nw, const st_mat *const *w, float *const *out);
    // Per head of x (n, n_head, head_dim), in place: rmsnorm with w (head_dim), then rope as below
    // (Qwen3's q and k norms followed by the rotary embedding).
    void (*norm_rope)(st_backend *b, float *x, const float *w, int n, int n_head, int head_dim, int n_rot,
                      const int32_t *pos, float base, float eps);
    // x (n, d) /= max(||x||, eps) per row, then *= scale
    void (*l2norm)(st_backend *b, float *x, int n, int d, float eps, float scale);
    // NeoX rotary embedding in place on x (n, n_head, head_dim), row i at position pos[i]:
    // dims i and i + n_rot/2 (i < n_rot/2) rotate by pos · base^(-2i/n_rot); the rest pass.
    void (*rope)(st_backend *b, float *x, int n, int n_head, int head_dim, int n_rot,
                 const int32_t *pos, float base);
    void (*attention)(st_backend *b, const st_attn_args *a);
    void (*conv)(st_backend *b, const st_conv_args *a);
    // The delta rule one row at a time (decode), and chunk by chunk (prompt chunks); both give
    // the same outputs and final state up to float rounding.
    void (*gdn)(st_backend *b, const st_gdn_args *a);
    void (*gdn_chunked)(st_backend *b, const st_gdn_args *a);
    int gdn_chunked_from; // rows from which st_deltanet_ops calls gdn_chunked (measured); 0: never
    // The DeltaNet mixer (st_deltanet_args); st_deltanet_ops on the CPU.
    void (*deltanet)(st_backend *b, const st_deltanet_args *a);
    // y (n) += x (n)
    void (*add)(st_backend *b, float *y, const float *x, int64_t n);
    // y (n) = silu(gate) · up
    void (*swiglu)(st_backend *b, const float *gate, const float *up, float *y, int64_t n);
    // y (n) *= sigmoid(gate)
    void (*mul_sigmoid)(st_backend *b, float *y, const float *gate, int64_t n);
    // y (n) *= silu(gate)
    void (*mul_silu)(st_backend *b, float *y, const float *gate, int64_t n);
    // y (n, d) += sigmoid(g[i]) · x (n, d): one gate logit per row (the shared expert's gate)
    void (*add_gated_rows)(st_backend *b, float *y, const float *x, const float *g, int n, int d);
    // The shared expert (st_shared_ffn_args); st_shared_ffn_ops on the CPU.
    void (*shared_ffn)(st_backend *b, const st_shared_ffn_args *a);
    // DeltaNet gates from ba (n, h_k, [b(r), a(r)]) with r = h_v / h_k, per value head j:
    // beta = sigmoid(b_j), g = ssm_a[j] · softplus(a_j + dt_bias[j]). beta, g (n, h_v).
    void (*gdn_gates)(st_backend *b, const float *ba, const float *ssm_a, const float *dt_bias,
                      float *beta, float *g, int n, int h_k, int h_v);
    // Split rows of (n, heads, a + b) into (n, heads, a) and (n, heads, b).
    void (*split_heads)(st_backend *b, const float *x, float *ya, float *yb, int n, int heads,
                        int a, int bdim);
    // Copy a column range between row-major matrices:
    // y[i][y_from + j] = x[i][x_from + j] for i < n, j < w; rows ldx and ldy floats long.
    void (*copy_cols)(st_backend *b, const float *x, int64_t ldx, int64_t x_from, float *y,
                      int64_t ldy, int64_t y_from, int n, int64_t w);
    void (*copy)(st_backend *b, float *dst, const float *src, int64_t n);
    // Router: softmax over E logits per row, the k largest (ties: lower id first), weights
    // renormalized over the chosen k. logits (n, E) -> ids (n, k), weights (n, k).
    void (*moe_route)(st_backend *b, const float *logits, int n, int n_expert, int k, int32_t *ids,
                      float *weights);
    // The routed-expert FFN with every expert of the layer in backend memory:
    // y[i] = Σ_j weights[i][j] · down_e(silu(gate_e(x_i)) · up_e(x_i)), e = ids[i][j]. NULL on
    // backends whose experts the experts module computes (the CPU).
    void (*moe)(st_backend *b, const st_moe_args *a);
    // ids[i] = the index of the largest of row i of x (n, d); the first on ties. ids is
    // backend memory.
    void (*argmax)(st_backend *b, const float *x, int n, int d, int32_t *ids);
    // Host <-> backend copies (identity copies on the CPU).
    void (*to_host)(st_backend *b, void *host, const void *src, size_t bytes);
    void (*from_host)(st_backend *b, void *dst, const void *host, size_t bytes);
    // Device backends only (NULL on the CPU). Page-locked host memory, which the device reads and
    // writes at the link's full speed; NULL + st_error when the OS refuses to lock that much.
    void *(*host_alloc)(st_backend *b, size_t bytes);
    void (*host_free)(st_backend *b, void *p);
    // Starts copying backend memory to host memory (host_alloc memory: truly asynchronous) after
    // the work queued so far, and returns at once; wait_copies waits for every copy started.
    void (*to_host_async)(st_backend *b, void *host, const void *src, size_t bytes);
    void (*wait_copies)(st_backend *b);
    // Starts copying host memory into backend memory on a copy stream of its own, after the work
    // queued so far, and returns at once (truly asynchronous from host_alloc memory); the host
    // bytes must stay as they are, and nothing may read dst, until h2d_done says the copies
    // started so far have all finished (it does not wait). Device backends only (NULL on the CPU).
    void (*from_host_async)(st_backend *b, void *dst, const void *host, size_t bytes);
    bool (*h2d_done)(st_backend *b);
    // The hand-off of one hybrid layer between queued (recordable) device work and a host
    // thread: see st_hand_args. publish (routing first, given the logits) copies the layer's
    // routing and input rows into the host slot, notes whether any chosen expert is missing
    // from the device (slot -1), and raises the slot's published flag; collect, when one was
    // missing, waits until the host answered (done flag = *seq; it gives up after
    // ST_HOST_WAIT_S seconds) and adds the host's rows.
    void (*hand_publish)(st_backend *b, const st_hand_args *h);
    void (*hand_collect)(st_backend *b, const st_hand_args *h);
} st_backend_ops;

struct st_backend {
    const st_backend_ops *ops;
    st_pool *pool;       // CPU threads (the CPU backend's workers; the CPU pool for others)
    // Set before run: the next run calls fn as it comes, neither recording nor replaying (its
    // work reads device results back midway, e.g. decode windows that stream missed experts to
    // the device, --pcie-frac). The experts module sets it for each window (st_experts_begin).
    bool eager;
    void *scratch;       // quantized activations for matmul
    size_t scratch_bytes;
};

// The CPU backend: n_threads workers (including the caller).
st_status st_backend_cpu_create(int n_threads, st_backend **out);
void st_backend_free(st_backend *b);

// The router's math on host memory (the CPU backend's moe_route).
void st_moe_route(const float *logits, int n, int n_expert, int k, int32_t *ids, float *weights);

// The DeltaNet mixer as the ops it is made of, on backend b (the CPU's deltanet op, and a
// device's where it does not run one kernel).
void st_deltanet_ops(st_backend *b, const st_deltanet_args *a);
// The shared expert as its ops (the CPU's shared_ffn op, and a device's where it runs in line).
void st_shared_ffn_ops(st_backend *b, const st_shared_ffn_args *a);

// ---------------------------------------------------------------------------------------------
// CUDA (cuda/). Built when nvcc is found; without it st_cuda_available() is false and the
// create call fails with a message saying so.

typedef struct st_gpu_info {
    int index;
    char name[256];
    size_t vram_total, vram_free;
    int cc_major, cc_minor, sm_count, clock_mhz;
    int pcie_gen, pcie_width;     // 0 when unknown
    bool usable;                  // compute capability >= 7.5
    char why[160];                // why not, when !usable
} st_gpu_info;

bool st_cuda_available(void);     // compiled in
// Lists the GPUs (up to max); *n = how many. A machine with no driver or no GPU gives *n = 0 and
// ST_OK, with the reason in *why (may be NULL).
st_status st_cuda_devices(st_gpu_info *out, int max, int *n, char *why, size_t why_len);
// GPU `device`'s memory bandwidth as a large device-to-device copy measures it: bytes read plus
// bytes written per second, in GB/s (the bound decode speeds are compared with); 0 on failure.
double st_cuda_copy_gbs(int device);
// A CUDA backend on GPU `device`, keeping reserve_bytes of VRAM free; n_threads CPU workers
// for the pool (experts the GPU does not hold).
st_status st_backend_cuda_create(int device, size_t reserve_bytes, int n_threads, st_backend **out);

// Bytes one KV row (n_head_kv * head_dim values) takes in a cache of this type.
size_t st_kv_row_bytes(st_kv_type type, int n_values);
