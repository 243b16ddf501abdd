// model: the per-sequence state and the forward of both architectures over a batch of rows.
// Written once over the backend ops; the experts module decides where each expert runs.
//
//   qwen3moe:  h = x + Attn(norm(x));           out = h + MoE(norm(h))
//   qwen3next: h = x + Mixer(norm(x));          out = h + MoE(norm(h)) + shared expert
//              Mixer = gated attention every full_attention_interval-th layer, else DeltaNet

#include <math.h>
#include <string.h>

#include "model/model.h"

// Calls an op of the state's backend.
#define OP(op, ...) s->b->ops->op(s->b, __VA_ARGS__)

struct st_state {
    const st_model *m;
    st_backend *b;
    st_experts *ex;
    int n_ctx, n_batch, pos;
    int mtp_pos;              // rows in the MTP layer's KV cache (row t: hidden of t, token t+1)
    st_kv_layer *kv;          // (n_layer + n_mtp), used by attention layers
    float **conv;             // (n_layer) (K-1, conv_dim) for DeltaNet layers, else NULL
    float **ssm;              // (n_layer) (h_v, d, d) for DeltaNet layers, else NULL
    size_t bytes;
    // Activations for n_batch rows (backend memory).
    // The residual stream x (n_batch, n_embd), the other buffer its next value goes to (the
    // two swap roles at each residual add, an even number of times a forward), its normed rows
    // xn, and y, what the last block adds to it.
    float *x, *x_alt, *xn, *y;
    float *big;               // (n_batch, max projection width): q+gate, qkv, ssm_in
    float *qkv;               // (n_batch, conv_dim) raw DeltaNet input
    float *q, *k, *v, *gate;  // (n_batch, widest head set); q also holds the conv output
    float *qh;                // (n_batch, widest head set) DeltaNet queries
    float *att;               // (n_batch, widest head set)
    float *beta, *g;          // (n_batch, h_v)
    float *ba;                // (n_batch, 2 h_v)
    float *logits_r;          // (n_batch, n_expert) router logits
    float *sh_g, *sh_u;       // (n_batch, n_ff_shexp)
    float *sh_s;              // (n_batch) shared expert gate logits
    int32_t *ids;             // (n_batch, k)
    float *weights;           // (n_batch, k)
    // A call's inputs, one buffer copied in once (step_inputs): the first row's cache position
    // (graph replays read it here), then the rows' positions and tokens, placed by the call's
    // row count n (the same for every call of n rows, so a recording of n rows reads them there).
    int32_t *in;              // (4 + n_batch rounded up to 4 + n_batch)
    int32_t *kv_pos;          // in: (1)
    int32_t *pos_ids;         // in + 4: (n) the rows' positions
    int32_t *tok_ids;         // after pos_ids, n rounded up to 4: (n) the rows' tokens
    float *logits;            // (HEAD_ROWS, n_vocab) head output on backends without host memory;
                              // (1, n_vocab) on host memory, the row whose argmax alone is wanted
    int32_t *best;            // (HEAD_ROWS) their argmax
    void *graphs[3][ST_GRAPH_ROWS + 1][ST_GRAPH_PLANS]; // recordings per (logits wanted: none / last / all,
                                                       // rows, plan of the context: st_graph_plan)
};

// Rows of logits a device backend computes per head call (bounds the buffer for long chunks).
#define HEAD_ROWS 16

static int conv_dim(const st_hparams *hp) { return 2 * hp->ssm_h_k * hp->ssm_d + hp->ssm_h_v * hp->ssm_d; }

static int imax(int a, int b) { return a > b ? a : b; }

int st_state_pos(const st_state *s) { return s->pos; }
int st_state_mtp_pos(const st_state *s) { return s->mtp_pos; }
size_t st_state_bytes(const st_state *s) { return s->bytes; }
const uint64_t *st_state_expert_counts(st_state *s) { return st_experts_counts(s->ex); }
st_experts_stats st_state_expert_stats(const st_state *s) { return st_experts_get_stats(s->ex); }

static void *take(st_state *s, size_t bytes, st_status *err) {
    if (*err) return NULL;
    void *p = s->b->ops->alloc(s->b, bytes ? bytes : 1);
    if (!p) {
        *err = ST_ERR_NOMEM;
        return NULL;
    }
    s->b->ops->zero(s->b, p, bytes);
    s->bytes += bytes;
    return p;
}

// Bytes the KV cache and the recurrent state take for n_ctx positions.
static size_t state_bytes(const st_model *m, const st_state_params *p) {
    const st_hparams *hp = &m->hp;
    size_t total = 0;
    for (int i = 0; i < hp->n_layer + hp->n_mtp; i++) {
        if (m->layers[i].recurrent)
            total += sizeof(float) * ((size_t)(hp->ssm_kernel - 1) * conv_dim(hp) + (size_t)hp->ssm_h_v * hp->ssm_d * hp->ssm_d);
        else
            total += 2 * st_kv_row_bytes(p->kv_type, hp->n_head_kv * hp->head_dim) * (size_t)p->n_ctx;
    }
    return total;
}

// Bytes of the activation buffers for n_batch rows (st_state_create takes them).
static size_t activation_bytes(const st_hparams *hp, size_t nb) {
    size_t E = (size_t)hp->n_expert, K = (size_t)hp->n_expert_used;
    int heads = imax(hp->n_head * hp->head_dim, hp->ssm_h_v * hp->ssm_d);
    int big = imax(hp->n_head * hp->head_dim * 2, conv_dim(hp) + hp->ssm_h_v * hp->ssm_d);
    big = imax(big, hp->n_mtp ? 2 * hp->n_embd : 0);
    size_t floats = nb * (4 * (size_t)hp->n_embd + big + imax(heads, conv_dim(hp)) + imax(conv_dim(hp), 1) +
                          5 * (size_t)heads + 4 * (size_t)imax(hp->ssm_h_v, 1) + E + 2 * (size_t)imax(hp->n_ff_shexp, 1) +
                          1 + 2 * K + 2) + HEAD_ROWS * (size_t)hp->n_vocab;
    return sizeof(float) * floats;
}

// The device's work buffers for chunks of nb rows, which the sessions of a backend share
// (quantized activations, dequantized weight pieces, attention partials, DeltaNet chunk buffers,
// and the routed experts' grouping and intermediates of prompt chunks, which grow with the rows).
// Peaks measured on the H200 at chunks of 2048 rows (STRATA_CUDA_PROFILE,
// bench/results/2026-11-30-fold-pool-next-llama.md): 430 MiB at the 30B-A3B shape (experts'
// 390), 525 at the Next-80B-A3B (425); the experts' part is 1.4-1.5x k · (3F + d) floats a row.
// Allowed: 192 MiB + twice that a row (736 and 752 MiB for those shapes at 2048 rows, about the
// flat 768 MiB checked at 12 and 16 GiB before; 328 / 332 MiB at the default 512, where the flat
// allowance left ~1 GiB of a 16 GiB card unused).
static size_t work_bytes(const st_hparams *hp, size_t nb) {
    size_t expert_row = sizeof(float) * (size_t)hp->n_expert_used * (3 * (size_t)hp->n_ff_exp + (size_t)hp->n_embd);
    return ((size_t)192 << 20) + nb * 2 * expert_row;
}

size_t st_state_plan_bytes(const st_model *m, const st_state_params *p, int n_seq) {
    // Each session: its KV cache and state, activations and expert staging; once: the work
    // buffers, with 20% of a session's activations for what the estimate misses.
    size_t act = activation_bytes(&m->hp, (size_t)p->n_batch);
    size_t per = state_bytes(m, p) + act + st_experts_stage_bytes();
    return per * (size_t)(n_seq > 1 ? n_seq : 1) + act / 5 + work_bytes(&m->hp, (size_t)p->n_batch);
}

st_status st_state_create(const st_model *m, st_backend *b, const st_state_params *p, st_state **out) {
    *out = NULL;
    const st_hparams *hp = &m->hp;
    if (p->n_ctx < 1) return st_fail(ST_ERR_ARG, "context size %d: must be at least 1", p->n_ctx);
    if (p->n_batch < 1) return st_fail(ST_ERR_ARG, "batch size %d: must be at least 1", p->n_batch);
    // Plan before allocating: with overcommit, an allocation too large for the machine would
    // succeed and fail later, so compare with what the backend has free.
    size_t need = state_bytes(m, p), avail = b->ops->mem_free(b);
    if (avail && need > avail)
        return st_fail(ST_ERR_NOMEM, "the KV cache and state for %d positions need %.1f MiB, but only %.1f MiB "
                       "is available: lower --ctx (or use --kv q8_0)", p->n_ctx, need / 1048576.0, avail / 1048576.0);
    st_state *s = st_calloc(1, sizeof *s);
    if (!s) return ST_ERR_NOMEM;
    s->m = m;
    s->b = b;
    s->n_ctx = p->n_ctx;
    s->n_batch = p->n_batch;
    st_experts_params ep = {.placement = m->placement, .cache = m->cache, .arena = m->arena, .adapt = m->adapt,
                            .count_on_device = p->count_experts};
    st_status err = st_experts_create(&ep, &s->ex);
    int n_total = hp->n_layer + hp->n_mtp;
    s->kv = st_calloc((size_t)n_total, sizeof(st_kv_layer));
    s->conv = st_calloc((size_t)n_total, sizeof(float *));
    s->ssm = st_calloc((size_t)n_total, sizeof(float *));
    if (!err && (!s->kv || !s->conv || !s->ssm)) err = ST_ERR_NOMEM;
    int kv_values = hp->n_head_kv * hp->head_dim;
    for (int i = 0; i < n_total && !err; i++) {
        if (m->layers[i].recurrent) {
            s->conv[i] = take(s, sizeof(float) * (size_t)(hp->ssm_kernel - 1) * conv_dim(hp), &err);
            s->ssm[i] = take(s, sizeof(float) * (size_t)hp->ssm_h_v * hp->ssm_d * hp->ssm_d, &err);
        } else {
            st_kv_layer *kv = &s->kv[i];
            kv->type = p->kv_type;
            kv->n_ctx = p->n_ctx;
            kv->n_head_kv = hp->n_head_kv;
            kv->head_dim = hp->head_dim;
            kv->row_bytes = st_kv_row_bytes(p->kv_type, kv_values);
            kv->k = take(s, kv->row_bytes * (size_t)p->n_ctx, &err);
            kv->v = take(s, kv->row_bytes * (size_t)p->n_ctx, &err);
        }
    }
    if (err) {
        st_state_free(s);
        return st_fail(ST_ERR_NOMEM, "cannot allocate the KV cache and state for %d positions (%.1f MiB; "
                       "%.1f MiB available): lower --ctx", p->n_ctx, need / 1048576.0, avail / 1048576.0);
    }
    size_t nb = (size_t)p->n_batch, E = (size_t)hp->n_expert, K = (size_t)hp->n_expert_used;
    int heads = imax(hp->n_head * hp->head_dim, hp->ssm_h_v * hp->ssm_d);
    int big = imax(hp->n_head * hp->head_dim * 2, conv_dim(hp) + hp->ssm_h_v * hp->ssm_d);
    big = imax(big, hp->n_mtp ? 2 * hp->n_embd : 0); // the MTP input [embedding, hidden]
    s->x = take(s, sizeof(float) * nb * hp->n_embd, &err);
    s->x_alt = take(s, sizeof(float) * nb * hp->n_embd, &err);
    s->xn = take(s, sizeof(float) * nb * hp->n_embd, &err);
    s->y = take(s, sizeof(float) * nb * hp->n_embd, &err);
    s->big = take(s, sizeof(float) * nb * big, &err);
    s->q = take(s, sizeof(float) * nb * imax(heads, conv_dim(hp)), &err);
    s->qkv = take(s, sizeof(float) * nb * imax(conv_dim(hp), 1), &err);
    s->qh = take(s, sizeof(float) * nb * heads, &err);
    s->k = take(s, sizeof(float) * nb * heads, &err);
    s->v = take(s, sizeof(float) * nb * heads, &err);
    s->gate = take(s, sizeof(float) * nb * heads, &err);
    s->att = take(s, sizeof(float) * nb * heads, &err);
    s->beta = take(s, sizeof(float) * nb * imax(hp->ssm_h_v, 1), &err);
    s->g = take(s, sizeof(float) * nb * imax(hp->ssm_h_v, 1), &err);
    s->ba = take(s, sizeof(float) * nb * imax(2 * hp->ssm_h_v, 1), &err);
    s->logits_r = take(s, sizeof(float) * nb * E, &err);
    s->sh_g = take(s, sizeof(float) * nb * imax(hp->n_ff_shexp, 1), &err);
    s->sh_u = take(s, sizeof(float) * nb * imax(hp->n_ff_shexp, 1), &err);
    s->sh_s = take(s, sizeof(float) * nb, &err);
    s->ids = take(s, sizeof(int32_t) * nb * K, &err);
    s->weights = take(s, sizeof(float) * nb * K, &err);
    s->in = take(s, sizeof(int32_t) * (4 + (nb + 3) / 4 * 4 + nb), &err);
    s->logits = take(s, sizeof(float) * (b->ops->host_memory ? 1 : HEAD_ROWS) * (size_t)hp->n_vocab, &err);
    s->best = take(s, sizeof(int32_t) * HEAD_ROWS, &err);
    if (err) {
        st_state_free(s);
        return st_fail(ST_ERR_NOMEM, "cannot allocate activation buffers for a batch of %d rows", p->n_batch);
    }
    *out = s;
    return ST_OK;
}

void st_state_free(st_state *s) {
    if (!s) return;
    int n_total = s->m->hp.n_layer + s->m->hp.n_mtp;
    for (int i = 0; s->kv && i < n_total; i++) {
        s->b->ops->free(s->b, s->kv[i].k);
        s->b->ops->free(s->b, s->kv[i].v);
        if (s->conv) s->b->ops->free(s->b, s->conv[i]);
        if (s->ssm) s->b->ops->free(s->b, s->ssm[i]);
    }
    float *bufs[] = {s->x, s->x_alt, s->xn, s->y, s->big, s->qkv, s->qh, s->q, s->k, s->v, s->gate, s->att, s->beta, s->g,
                     s->ba, s->logits_r, s->sh_g, s->sh_u, s->sh_s, s->weights};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) s->b->ops->free(s->b, bufs[i]);
    s->b->ops->free(s->b, s->ids);
    s->b->ops->free(s->b, s->in);
    s->b->ops->free(s->b, s->logits);
    s->b->ops->free(s->b, s->best);
    for (int i = 0; i < 3; i++)
        for (int j = 0; j <= ST_GRAPH_ROWS; j++)
            for (int k = 0; k < ST_GRAPH_PLANS; k++) s->b->ops->graph_free(s->b, s->graphs[i][j][k]);
    st_free(s->kv);
    st_free(s->conv);
    st_free(s->ssm);
    st_experts_free(s->ex);
    st_free(s);
}

// A call's inputs to the device in one copy (each copy may cost the step a round trip): cache
// position kv, the positions of rows 0 .. n-1 from first on, their tokens. s->kv_pos, pos_ids
// and tok_ids point at them for the ops.
static st_status step_inputs(st_state *s, int kv, int first, const int32_t *tokens, int n) {
    int n4 = (n + 3) / 4 * 4, len = 4 + n4 + n;
    int32_t small[4 + 2 * ST_GRAPH_ROWS], *host = small; // (a window's on the stack, a chunk's on the heap)
    if (len > (int)(sizeof small / sizeof small[0]) && !(host = st_calloc((size_t)len, sizeof(int32_t))))
        return st_fail(ST_ERR_NOMEM, "out of memory for the positions of %d rows", n);
    memset(host, 0, sizeof(int32_t) * (size_t)(4 + n4));
    host[0] = kv;
    for (int i = 0; i < n; i++) host[4 + i] = first + i, host[4 + n4 + i] = tokens[i];
    s->kv_pos = s->in;
    s->pos_ids = s->in + 4;
    s->tok_ids = s->in + 4 + n4;
    s->b->ops->from_host(s->b, s->in, host, sizeof(int32_t) * (size_t)len);
    if (host != small) st_free(host);
    return ST_OK;
}

// ---------------------------------------------------------------------------------------------
// Blocks

// A block's input: with add, the residual stream takes the last block's output (x += y, into
// the other buffer, which becomes x), then xn = rmsnorm(x) · norm_w and the block's first
// products out[i] = xn · w[i]ᵀ, as one op (a device folds the add and the norm into the
// products' launch).
static void block_input(st_state *s, bool add, const float *norm_w, int n, int nw, const st_mat *const *w,
                        float *const *out) {
    const st_hparams *hp = &s->m->hp;
    OP(norm_matmul, s->x, add ? s->y : NULL, s->x_alt, norm_w, hp->eps, s->xn, n, hp->n_embd, nw, w, out);
    if (add) {
        float *t = s->x;
        s->x = s->x_alt;
        s->x_alt = t;
    }
}

// Attention (qwen3moe) or gated attention (qwen3next) of n rows: block_input (norm_w) -> y. The rows go to cache
// rows pos0 .. pos0+n-1; RoPE takes their positions from s->pos_ids.
static void attention(st_state *s, int il, const st_layer *l, int n, int pos0, bool add) {
    const st_hparams *hp = &s->m->hp;
    int H = hp->n_head, hd = hp->head_dim;
    bool gated = hp->arch == ST_ARCH_QWEN3NEXT;
    // The gated form's q projection holds [query | gate] per head; the op reads both in place and
    // gates its output before the output projection.
    float *q = gated ? s->big : s->q;
    const st_mat *w[] = {&l->wq, &l->wk, &l->wv};
    float *y[] = {q, s->k, s->v};
    block_input(s, add, l->attn_norm, n, 3, w, y);
    st_attn_args a = {.kv = &s->kv[il], .pos_dev = s->kv_pos, .q = q, .k = s->k, .v = s->v, .out = s->att,
                      .n = n, .pos0 = pos0, .n_head = H, .scale = 1.0f / sqrtf((float)hd),
                      .q_norm = l->q_norm, .k_norm = l->k_norm, .pos = s->pos_ids, .n_rot = hp->n_rot,
                      .rope_base = hp->rope_base, .eps = hp->eps, .gated = gated, .wo = &l->wo, .y = s->y};
    OP(attention, &a);
}

// Gated DeltaNet (qwen3next) of n rows and its output projection: block_input -> y.
static void deltanet(st_state *s, int il, const st_layer *l, int n, bool add) {
    const st_hparams *hp = &s->m->hp;
    int d = hp->ssm_d, hk = hp->ssm_h_k, hv = hp->ssm_h_v, r = hv / hk;
    int kd = hk * d, vd = hv * d, cd = conv_dim(hp);
    float *z = s->gate, *u = s->q;
    if (l->wqkv.data) {
        const st_mat *w[] = {&l->wqkv, &l->wz, &l->wba};
        float *y[] = {s->qkv, z, s->ba};
        block_input(s, add, l->attn_norm, n, 3, w, y);
    } else { // legacy ssm_in: per key head g, [q_g, k_g, v (r heads), z (r heads)]
        int gw = 2 * d + 2 * r * d;
        const st_mat *w[] = {&l->w_ssm_in, &l->wba};
        float *y[] = {s->big, s->ba};
        block_input(s, add, l->attn_norm, n, 2, w, y);
        for (int g = 0; g < hk; g++) {
            int64_t src = (int64_t)g * gw;
            OP(copy_cols, s->big, cd + vd, src, s->qkv, cd, (int64_t)g * d, n, d);
            OP(copy_cols, s->big, cd + vd, src + d, s->qkv, cd, kd + (int64_t)g * d, n, d);
            OP(copy_cols, s->big, cd + vd, src + 2 * d, s->qkv, cd, 2 * kd + (int64_t)g * r * d, n, r * d);
            OP(copy_cols, s->big, cd + vd, src + 2 * d + r * d, z, vd, (int64_t)g * r * d, n, r * d);
        }
    }
    // conv + SiLU, q and k l2-normed, the gates, the delta rule, the gated norm, the out projection
    st_deltanet_args da = {.qkv = s->qkv, .conv_w = l->conv, .conv_state = s->conv[il], .ba = s->ba,
                           .ssm_a = l->ssm_a, .dt_bias = l->dt_bias, .z = z, .norm_w = l->ssm_norm,
                           .state = s->ssm[il], .out = s->att, .u = u, .q = s->qh, .k = s->k, .v = s->v,
                           .beta = s->beta, .g = s->g, .n = n, .h_k = hk, .h_v = hv, .d = d,
                           .kernel = hp->ssm_kernel, .eps = hp->eps, .wo = &l->wout, .y = s->y};
    OP(deltanet, &da);
}

// Routed experts plus the shared expert (when the model has one) of n rows: block_input
// (the attention's output added) -> y.
static st_status moe(st_state *s, int il, const st_layer *l, int n) {
    const st_hparams *hp = &s->m->hp;
    int K = hp->n_expert_used;
    const st_mat *router = &l->router;
    block_input(s, true, l->ffn_norm, n, 1, &router, &s->logits_r);
    // The experts module routes (softmax, top K, renormalized) into ids and weights.
    st_moe_args ma = {.layer = il, .gate = &l->gate_exps, .up = &l->up_exps, .down = &l->down_exps, .x = s->xn,
                      .ids = s->ids, .weights = s->weights, .logits = s->logits_r, .n = n, .k = K, .y = s->y};
    st_moe_shared sh = {.gate = &l->sh_gate, .up = &l->sh_up, .down = &l->sh_down, .gate_inp = l->sh_gate_inp,
                        .g = s->sh_g, .u = s->sh_u, .o = s->att, .s = s->sh_s};
    return st_experts_compute(s->ex, s->b, &ma, hp->n_ff_shexp > 0 ? &sh : NULL);
}

// One decoder layer on the residual stream (n rows, attention cache rows from pos0): with add,
// s->y holds the output of the block before, which joins s->x first; on return s->y holds the
// layer's experts' output, not yet added (each residual add is folded into the next block's
// input, or into the final norm).
static st_status layer(st_state *s, int il, int n, int pos0, bool add) {
    const st_layer *l = &s->m->layers[il];
    if (l->recurrent) deltanet(s, il, l, n, add);
    else attention(s, il, l, n, pos0, add);
    return moe(s, il, l, n);
}

// Logits of rows first .. n-1 of the final-normed s->xn into dst: the caller's buffer on a
// host-memory backend, else s->logits (at most HEAD_ROWS rows).
static void head_logits(st_state *s, int first, int n, float *dst) {
    OP(matmul, &s->m->output, s->xn + (size_t)first * s->m->hp.n_embd, n - first, dst);
}

// The final-normed rows s->xn (n) to the caller: hidden states and logits. On a device backend
// the logits of a window of up to HEAD_ROWS rows are already in s->logits when done (the
// recorded work computed them).
static void head(st_state *s, int n, const st_forward_out *out, bool done) {
    const st_model *m = s->m;
    int E = m->hp.n_embd, V = m->hp.n_vocab;
    if (out && out->hidden) s->b->ops->to_host(s->b, out->hidden, s->xn, sizeof(float) * (size_t)n * E);
    if (!out || (!out->logits && !out->argmax)) return;
    int first = out->want_all ? 0 : n - 1;
    if (s->b->ops->host_memory && out->logits) { // straight into the caller's rows
        head_logits(s, first, n, out->logits);
        if (out->argmax) OP(argmax, out->logits, n - first, V, out->argmax);
        return;
    }
    for (int r = first; r < n; r += HEAD_ROWS) {
        int e = r + HEAD_ROWS < n ? r + HEAD_ROWS : n;
        float *dst = s->logits;
        if (s->b->ops->host_memory) { // ids only: the rows one at a time, each into s->logits
            for (int i = r; i < e; i++) {
                head_logits(s, i, i + 1, dst);
                OP(argmax, dst, 1, V, out->argmax + (i - first));
            }
            continue;
        }
        if (!done) head_logits(s, r, e, dst);
        if (out->argmax) {
            OP(argmax, dst, e - r, V, s->best);
            s->b->ops->to_host(s->b, out->argmax + (r - first), s->best, sizeof(int32_t) * (size_t)(e - r));
        }
        if (out->logits)
            s->b->ops->to_host(s->b, out->logits + (size_t)(r - first) * V, s->logits, sizeof(float) * (size_t)(e - r) * V);
    }
}

// The layers of one forward call: what a device backend may record once per window size.
typedef struct fwd_work {
    st_state *s;
    int n, pos0;
    int head_first; // >= 0: also the logits of rows head_first .. n-1 into s->logits
} fwd_work;

static st_status forward_work(void *ctx) {
    fwd_work *w = ctx;
    st_state *s = w->s;
    const st_hparams *hp = &s->m->hp;
    OP(get_rows, &s->m->tok_embd, s->tok_ids, w->n, s->x);
    for (int il = 0; il < hp->n_layer; il++) ST_TRY(layer(s, il, w->n, w->pos0, il > 0));
    block_input(s, true, s->m->output_norm, w->n, 0, NULL, NULL);
    if (w->head_first >= 0) head_logits(s, w->head_first, w->n, s->logits);
    return ST_OK;
}

st_status st_model_forward(const st_model *m, st_state *s, const int32_t *tokens, int n,
                           const st_forward_out *out) {
    const st_hparams *hp = &m->hp;
    if (n < 1 || n > s->n_batch)
        return st_fail(ST_ERR_ARG, "forward of %d rows: must be 1 .. %d (the batch size)", n, s->n_batch);
    if (s->pos + n > s->n_ctx)
        return st_fail(ST_ERR_RANGE, "the context is full: %d positions used, %d more asked, %d available",
                       s->pos, n, s->n_ctx);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= hp->n_vocab)
            return st_fail(ST_ERR_ARG, "token id %d at row %d is outside the vocabulary (0 .. %d)",
                           tokens[i], i, hp->n_vocab - 1);
    ST_TRY(step_inputs(s, s->pos, s->pos, tokens, n));

    // Windows of a few rows may be recorded and replayed (with their logits on a device). The
    // recording computes the head whenever the caller wants logits or only their argmax: head()
    // takes a recorded window's logits as done.
    bool logits = out && (out->logits || out->argmax);
    int mode = !logits ? 0 : out->want_all ? 2 : 1;
    bool small = n <= ST_GRAPH_ROWS && !s->b->ops->host_memory;
    fwd_work w = {.s = s, .n = n, .pos0 = s->pos, .head_first = small && logits ? (mode == 2 ? 0 : n - 1) : -1};
    ST_TRY(st_experts_begin(s->ex, s->b, n, hp->n_expert_used, hp->n_embd, 0, hp->n_layer));
    st_status rs = small ? s->b->ops->run(s->b, &s->graphs[mode][n][st_graph_plan(s->pos + n)], forward_work, &w)
                         : forward_work(&w);
    st_status ss = st_experts_serve(s->ex, rs != ST_OK); // the CPU's experts, before anything waits
    ST_TRY(rs);
    ST_TRY(ss);
    head(s, n, out, small);
    ST_TRY(s->b->ops->sync(s->b));
    s->pos += n;
    st_experts_window_done(s->ex, s->b);
    return ST_OK;
}

st_status st_model_mtp(const st_model *m, st_state *s, int pos, const float *hidden, const int32_t *tokens,
                       int n, const st_forward_out *out) {
    const st_hparams *hp = &m->hp;
    int E = hp->n_embd;
    if (hp->n_mtp < 1) return st_fail(ST_ERR_UNSUPPORTED, "this model has no MTP layer (blk.%d.nextn.*)", hp->n_layer);
    if (n < 1 || n > s->n_batch)
        return st_fail(ST_ERR_ARG, "MTP step of %d rows: must be 1 .. %d (the batch size)", n, s->n_batch);
    if (pos < 0 || pos > s->mtp_pos)
        return st_fail(ST_ERR_ARG, "MTP step at position %d: must be 0 .. %d (the MTP cache holds %d rows)",
                       pos, s->mtp_pos, s->mtp_pos);
    if (pos + n > s->n_ctx)
        return st_fail(ST_ERR_RANGE, "the context is full: MTP step at positions %d .. %d, %d available",
                       pos, pos + n - 1, s->n_ctx);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= hp->n_vocab)
            return st_fail(ST_ERR_ARG, "token id %d at row %d is outside the vocabulary (0 .. %d)",
                           tokens[i], i, hp->n_vocab - 1);
    const st_layer *l = &m->layers[hp->n_layer];
    ST_TRY(step_inputs(s, pos, pos + 1, tokens, n)); // REFERENCE §3.3: position t+1

    // u = eh_proj [norm(embed(token)), norm(hidden)], then the MTP decoder layer.
    OP(get_rows, &m->tok_embd, s->tok_ids, n, s->y);
    OP(rmsnorm, s->y, l->mtp_enorm, s->y, n, E, hp->eps);
    s->b->ops->from_host(s->b, s->x, hidden, sizeof(float) * (size_t)n * E);
    OP(rmsnorm, s->x, l->mtp_hnorm, s->xn, n, E, hp->eps);
    OP(copy_cols, s->y, E, 0, s->big, 2 * E, 0, n, E);
    OP(copy_cols, s->xn, E, 0, s->big, 2 * E, E, n, E);
    OP(matmul, &l->mtp_eh, s->big, n, s->x);
    ST_TRY(st_experts_begin(s->ex, s->b, n, hp->n_expert_used, E, hp->n_layer, hp->n_layer + 1));
    st_status rs = layer(s, hp->n_layer, n, pos, false);
    if (!rs) block_input(s, true, l->mtp_head_norm, n, 0, NULL, NULL);
    st_status ss = st_experts_serve(s->ex, rs != ST_OK);
    ST_TRY(rs);
    ST_TRY(ss);
    head(s, n, out, false);
    ST_TRY(s->b->ops->sync(s->b));
    s->mtp_pos = pos + n;
    return ST_OK;
}

// ---------------------------------------------------------------------------------------------
// Snapshots: the KV rows in use and the recurrent state, copied to host memory.

struct st_snapshot {
    int pos, mtp_pos;
    size_t bytes;
    char *data;
};

// Visits every piece of state (KV rows up to pos, the MTP layer's up to mtp_pos, conv and
// delta-rule state) in a fixed order.
typedef void (*state_fn)(void *ctx, void *state_ptr, size_t bytes);
static void state_walk(const st_state *s, int pos, int mtp_pos, state_fn fn, void *ctx) {
    const st_hparams *hp = &s->m->hp;
    for (int i = 0; i < hp->n_layer + hp->n_mtp; i++) {
        size_t rows = (size_t)(i < hp->n_layer ? pos : mtp_pos);
        if (s->conv[i]) {
            fn(ctx, s->conv[i], sizeof(float) * (size_t)(hp->ssm_kernel - 1) * conv_dim(hp));
            fn(ctx, s->ssm[i], sizeof(float) * (size_t)hp->ssm_h_v * hp->ssm_d * hp->ssm_d);
        } else {
            fn(ctx, s->kv[i].k, s->kv[i].row_bytes * rows);
            fn(ctx, s->kv[i].v, s->kv[i].row_bytes * rows);
        }
    }
}

typedef struct walk_ctx {
    const st_state *s;
    char *p;
    size_t bytes;
    bool save;
} walk_ctx;

static void count_fn(void *ctx, void *ptr, size_t bytes) {
    (void)ptr;
    ((walk_ctx *)ctx)->bytes += bytes;
}

static void copy_fn(void *ctx, void *ptr, size_t bytes) {
    walk_ctx *w = ctx;
    st_backend *b = w->s->b;
    if (w->save) b->ops->to_host(b, w->p, ptr, bytes);
    else b->ops->from_host(b, ptr, w->p, bytes);
    w->p += bytes;
}

st_status st_state_save(const st_state *s, st_snapshot **out) {
    *out = NULL;
    walk_ctx w = {.s = s};
    state_walk(s, s->pos, s->mtp_pos, count_fn, &w);
    st_snapshot *snap = st_calloc(1, sizeof *snap);
    if (!snap) return ST_ERR_NOMEM;
    snap->data = st_alloc(w.bytes);
    if (!snap->data) {
        st_free(snap);
        return st_fail(ST_ERR_NOMEM, "snapshot of %zu bytes: out of memory", w.bytes);
    }
    snap->pos = s->pos;
    snap->mtp_pos = s->mtp_pos;
    snap->bytes = w.bytes;
    w.p = snap->data;
    w.save = true;
    state_walk(s, s->pos, s->mtp_pos, copy_fn, &w);
    *out = snap;
    return ST_OK;
}

st_status st_state_restore(st_state *s, const st_snapshot *snap) {
    walk_ctx w = {.s = s};
    state_walk(s, snap->pos, snap->mtp_pos, count_fn, &w);
    if (w.bytes != snap->bytes || snap->pos > s->n_ctx || snap->mtp_pos > s->n_ctx)
        return st_fail(ST_ERR_ARG, "snapshot does not match this state (%zu bytes at position %d)", snap->bytes, snap->pos);
    w.p = snap->data;
    w.save = false;
    state_walk(s, snap->pos, snap->mtp_pos, copy_fn, &w);
    s->pos = snap->pos;
    s->mtp_pos = snap->mtp_pos;
    return ST_OK;
}

void st_snapshot_free(st_snapshot *snap) {
    if (!snap) return;
    st_free(snap->data);
    st_free(snap);
}
