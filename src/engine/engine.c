// engine: the public API (strata.h) over the modules: a model is a mapped GGUF bound to a
// backend; a session is one sequence's state fed in prompt chunks.

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "strata.h"
#include "backend/backend.h"
#include "engine/engine.h"
#include "experts/experts.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

struct strata_model {
    st_gguf *gguf;
    st_model *model;
    st_backend *backend;
    int gpu;                      // -1: the CPU backend
    int plan_ctx;                 // the context the GPU's memory was planned for (0: none)
    int n_batch;                  // the prompt chunk sessions get when they ask for none
    pthread_mutex_t stats_mu;     // guards experts: every session's expert stats, summed
    strata_expert_stats experts;
    st_tokenizer *tok;            // NULL when the file has no (usable) tokenizer
    char tok_error[256];          // why, for the first call that needs it
    st_chat_template *tmpl;       // NULL when the file has no chat template
    char tmpl_error[256];
    _Atomic(st_json_vocab *) json_vocab; // built by the first JSON-constrained generation
};

struct strata_session {
    strata_model *m;
    st_state *state;
    int n_batch, n_ctx;
    int32_t *tokens;              // (n_ctx) what the state holds, oldest first
    st_experts_stats counted;     // the part of the state's expert stats added to the model's
};

const char *strata_error(void) { return st_error(); }

// The prompt chunk when none is asked for (n_batch 0): 512 rows on the CPU and on a card that
// caches only part of the experts; 2048 on a card that holds the whole model, whose experts'
// tile GEMMs then take four times the rows for each expert's weights they dequantize (30B-A3B on
// an H100, prompt 2048: 9,858 tokens/s in chunks of 512, 16,403 in one chunk:
// bench/results/2026-12-06-xreg-chunk.md).
enum { ST_CHUNK_CPU = 512, ST_CHUNK_GPU = 2048 };

// The expert profile for a model: the file asked for, or MODEL.profile beside the GGUF.
static st_status load_profile(const st_model *mo, const char *gguf_path, const char *asked, uint64_t **out) {
    *out = NULL;
    const st_hparams *hp = &mo->hp;
    char path[4096];
    if (asked) {
        snprintf(path, sizeof path, "%s", asked);
    } else {
        size_t n = strlen(gguf_path);
        if (n > 5 && !strcmp(gguf_path + n - 5, ".gguf")) n -= 5;
        snprintf(path, sizeof path, "%.*s.profile", (int)n, gguf_path);
        if (access(path, R_OK)) return ST_OK; // none: all experts equally hot
    }
    uint64_t *c = st_calloc((size_t)(hp->n_layer + hp->n_mtp) * hp->n_expert, sizeof(uint64_t));
    if (!c) return ST_ERR_NOMEM;
    st_status s = st_profile_load(path, hp->n_layer, hp->n_mtp, hp->n_expert, c);
    if (s) {
        st_free(c);
        if (asked) return st_fail_prefix(s, "--expert-profile");
        // One found beside the model but unusable (stale, or being rewritten by strata profile):
        // said once, and every expert is taken as equally hot.
        st_log_info("expert profile beside the model not used: %s; all experts taken as equally hot", st_error());
        return ST_OK;
    }
    st_log_info("expert profile: %s", path);
    *out = c;
    return ST_OK;
}

// What the GPU's memory is planned for (strata_model_params -> st_place_params).
static st_status place_params(strata_model *m, const strata_model_params *p, st_place_params *pp, uint64_t **profile) {
    const st_model *mo = m->model;
    *pp = (st_place_params){.expert_slots = -1};
    const char *ec = p->expert_cache;
    if (ec && strcmp(ec, "auto")) {
        char *end;
        long long v = strtoll(ec, &end, 10);
        if (*end || end == ec || v < 0)
            return st_fail(ST_ERR_ARG, "--expert-cache '%s': expected auto or a number of experts (0 = none)", ec);
        pp->expert_slots = v;
    }
    if (p->vram_budget_gib < 0 || p->vram_budget_gib > 1e6)
        return st_fail(ST_ERR_ARG, "--vram-budget-gib %g: must be positive", p->vram_budget_gib);
    pp->vram_budget = (size_t)(p->vram_budget_gib * 1073741824.0);
    int n_ctx = p->n_ctx > 0 ? p->n_ctx : mo->hp.n_ctx_train < 8192 ? mo->hp.n_ctx_train : 8192;
    st_state_params sp = {.n_ctx = n_ctx, .n_batch = p->n_batch > 0 ? p->n_batch : ST_CHUNK_GPU, .kv_type = ST_KV_F16};
    if (p->n_batch <= 0) {
        // No chunk asked for: ST_CHUNK_GPU rows where the card holds the whole file with that
        // chunk's buffers beside it. A card that caches only part of the experts keeps that
        // memory for them instead, and its chunks stay ST_CHUNK_CPU rows.
        size_t total_b = m->backend->ops->mem_total ? m->backend->ops->mem_total(m->backend) : 0;
        size_t avail = st_vram_allowance(pp->vram_budget, total_b, m->backend->ops->mem_free(m->backend));
        size_t need = st_gguf_file_bytes(m->gguf) + st_state_plan_bytes(mo, &sp, p->n_seq);
        int64_t experts = (int64_t)(mo->hp.n_layer + mo->hp.n_mtp) * mo->hp.n_expert;
        if ((pp->expert_slots >= 0 && pp->expert_slots < experts) || need > avail) sp.n_batch = ST_CHUNK_CPU;
        st_log_info("prompt chunks of %d rows (%d where the GPU holds the whole model beside them; --batch N to "
                    "choose)", sp.n_batch, ST_CHUNK_GPU);
    }
    m->n_batch = sp.n_batch;
    pp->keep_bytes = st_state_plan_bytes(mo, &sp, p->n_seq);
    m->plan_ctx = n_ctx;
    pp->resident_bytes = p->resident_gib < 0 ? SIZE_MAX : (size_t)(p->resident_gib * 1073741824.0);
    pp->adapt_every = p->adapt_every < 0 ? 0 : p->adapt_every > 0 ? p->adapt_every : 32;
    pp->adapt_swaps = p->adapt_swaps > 0 ? (p->adapt_swaps < 64 ? p->adapt_swaps : 64) : 8;
    pp->adapt_decay = p->adapt_decay > 0 ? p->adapt_decay : 0.95;
    if (p->adapt_decay < 0 || p->adapt_decay > 1)
        return st_fail(ST_ERR_ARG, "--adapt-decay %g: must be in (0, 1]", p->adapt_decay);
    if (!(p->pcie_frac <= 1)) // also NaN
        return st_fail(ST_ERR_ARG, "--pcie-frac %g: must be in 0 .. 1 (the share of missed experts copied to "
                       "the GPU)", p->pcie_frac);
    pp->pcie_frac = p->pcie_frac > 0 ? p->pcie_frac : p->pcie_frac < 0 ? 0 : -1;
    ST_TRY(load_profile(mo, p->path, p->expert_profile, profile));
    pp->profile = *profile;
    return ST_OK;
}

// Picks the backend (strata_model_params.gpu) and places the weights on it.
static st_status open_backend(strata_model *m, const strata_model_params *p, int threads) {
    const char *gpu = p->gpu ? p->gpu : getenv("STRATA_GPU");
    if (!gpu || !*gpu) gpu = "auto";
    bool autopick = !strcmp(gpu, "auto");
    m->gpu = -1;
    if (!strcmp(gpu, "cpu")) return st_backend_cpu_create(threads, &m->backend);
    int index = -1;
    if (autopick) {
        st_gpu_info gpus[16];
        int n = 0;
        char why[512] = "no usable GPU";
        st_cuda_devices(gpus, 16, &n, why, sizeof why);
        for (int i = 0; i < n && index < 0; i++)
            if (gpus[i].usable) index = i;
        if (index < 0) {
            if (n > 0) snprintf(why, sizeof why, "GPU 0 (%s): %s", gpus[0].name, gpus[0].why);
            st_log_info("running on the CPU: %s", why);
            return st_backend_cpu_create(threads, &m->backend);
        }
    } else {
        char *end;
        long v = strtol(gpu, &end, 10);
        if (*end || end == gpu || v < 0 || v > 1023)
            return st_fail(ST_ERR_ARG, "--gpu '%s': expected auto, cpu or a GPU index (0, 1, ...)", gpu);
        index = (int)v;
    }
    size_t reserve = (size_t)(p->vram_reserve_mib > 0 ? p->vram_reserve_mib : STRATA_VRAM_RESERVE_MIB) << 20;
    // The CPU pool: physical cores less the one that serves the GPU (SMT siblings add little to
    // memory-bound products and cost the pool's barriers), or --threads less one when given.
    int cores = p->n_threads > 0 ? threads : st_cpu_cores();
    int workers = p->pool_workers > 0 ? p->pool_workers : cores > 1 ? cores - 1 : 1;
    st_status s = st_backend_cuda_create(index, reserve, workers, &m->backend);
    uint64_t *profile = NULL;
    st_place_params pp;
    if (!s) s = place_params(m, p, &pp, &profile);
    if (!s) s = st_model_place(m->model, m->backend, &pp);
    st_free(profile);
    if (s && autopick) { // the model or the card is not fit: the CPU runs it, and says why
        st_log_info("running on the CPU: %s", st_error());
        st_backend_free(m->backend);
        m->backend = NULL;
        return st_backend_cpu_create(threads, &m->backend);
    }
    if (!s) m->gpu = index;
    return s;
}

strata_status strata_model_open(const strata_model_params *p, strata_model **out) {
    *out = NULL;
    strata_model *m = st_calloc(1, sizeof *m);
    if (!m) return ST_ERR_NOMEM;
    pthread_mutex_init(&m->stats_mu, NULL);
    double t0 = st_time_s();
    st_status s = st_gguf_open_ex(p->path, p->no_mmap, &m->gguf);
    if (!s && p->no_mmap)
        st_log_info("read %.2f GiB of weights into memory (--no-mmap) in %.1f s", st_gguf_file_bytes(m->gguf) / 1073741824.0,
                    st_time_s() - t0);
    if (!s) s = st_model_load(m->gguf, &m->model);
    int threads = p->n_threads > 0 ? p->n_threads : st_cpu_count();
    if (!s) s = open_backend(m, p, threads);
    if (!s && m->gpu < 0) s = st_model_place(m->model, m->backend, NULL); // says where the weights are
    if (m->gpu < 0) m->n_batch = p->n_batch > 0 ? p->n_batch : ST_CHUNK_CPU;
    if (!s && st_tokenizer_load_gguf(m->gguf, &m->tok))
        snprintf(m->tok_error, sizeof m->tok_error, "%s", st_error());
    if (!s && st_chat_template_from_gguf(m->gguf, &m->tmpl))
        snprintf(m->tmpl_error, sizeof m->tmpl_error, "%s", st_error());
    if (s) {
        strata_model_close(m);
        return s;
    }
    *out = m;
    return ST_OK;
}

void strata_model_close(strata_model *m) {
    if (!m) return;
    st_chat_template_free(m->tmpl);
    st_json_vocab_free(atomic_load(&m->json_vocab));
    st_tokenizer_free(m->tok);
    st_model_free(m->model); // before its backend: a GPU's weight copies go back through it
    st_backend_free(m->backend);
    st_gguf_free(m->gguf);
    pthread_mutex_destroy(&m->stats_mu);
    st_free(m);
}

static uint64_t mat_bytes(const st_mat *w) { return w->data ? (uint64_t)w->row_bytes * w->rows : 0; }

// Weight bytes one decoded token reads: every dense matrix of the main layers, k of the E
// experts per layer, one embedding row and the head (the MTP layer is not counted).
static uint64_t decode_bytes(const st_model *m) {
    const st_hparams *hp = &m->hp;
    uint64_t b = m->tok_embd.row_bytes + mat_bytes(&m->output);
    for (int i = 0; i < hp->n_layer; i++) {
        const st_layer *l = &m->layers[i];
        const st_mat *mats[] = {&l->wq, &l->wk, &l->wv, &l->wo, &l->wqkv, &l->wz, &l->w_ssm_in, &l->wba,
                                &l->wout, &l->router, &l->sh_gate, &l->sh_up, &l->sh_down};
        for (size_t j = 0; j < sizeof mats / sizeof mats[0]; j++) b += mat_bytes(mats[j]);
        b += (uint64_t)hp->n_expert_used *
             (l->gate_exps.rows * l->gate_exps.row_bytes + l->up_exps.rows * l->up_exps.row_bytes +
              l->down_exps.rows * l->down_exps.row_bytes);
    }
    return b;
}

strata_model_info strata_model_get_info(const strata_model *m) {
    const st_hparams *hp = &m->model->hp;
    return (strata_model_info){
        .arch = st_arch_name(hp->arch), .n_vocab = hp->n_vocab, .n_embd = hp->n_embd,
        .n_layer = hp->n_layer, .n_ctx_train = hp->n_ctx_train, .n_expert = hp->n_expert,
        .n_expert_used = hp->n_expert_used, .has_mtp = hp->n_mtp > 0,
        .backend = m->backend->ops->name, .gpu = m->gpu,
        .file_bytes = st_gguf_file_bytes(m->gguf), .decode_bytes = decode_bytes(m->model),
        .n_batch = m->n_batch,
    };
}

int strata_model_gpu_stats(const strata_model *m, strata_gpu_stats *out, int max) {
    if (m->gpu < 0 || max < 1) return 0;
    st_gpu_info gpus[16];
    int n = 0;
    if (st_cuda_devices(gpus, 16, &n, NULL, 0) || m->gpu >= n) return 0;
    const st_gpu_info *g = &gpus[m->gpu];
    out[0].index = g->index;
    snprintf(out[0].name, sizeof out[0].name, "%s", g->name);
    out[0].vram_total = g->vram_total;
    out[0].vram_used = g->vram_total > g->vram_free ? g->vram_total - g->vram_free : 0;
    return 1;
}

strata_status strata_session_open(strata_model *m, const strata_session_params *p, strata_session **out) {
    *out = NULL;
    const st_hparams *hp = &m->model->hp;
    int n_ctx = p->n_ctx > 0 ? p->n_ctx : m->plan_ctx > 0 ? m->plan_ctx : hp->n_ctx_train;
    if (p->n_ctx <= 0 && m->plan_ctx <= 0) { // the model's context, capped so the KV cache takes at most half the free memory
        int attn_layers = 0;
        for (int i = 0; i < hp->n_layer + hp->n_mtp; i++) attn_layers += !m->model->layers[i].recurrent;
        size_t per_pos = (size_t)attn_layers * 2 *
                         st_kv_row_bytes(p->kv_type == STRATA_KV_Q8_0 ? ST_KV_Q8_0 : ST_KV_F16,
                                         hp->n_head_kv * hp->head_dim);
        bool host = m->backend->ops->host_memory;
        size_t avail = (host ? st_ram_available() : m->backend->ops->mem_free(m->backend)) / 2;
        if (per_pos && avail && (size_t)n_ctx * per_pos > avail) {
            int capped = (int)(avail / per_pos);
            st_log_info("context: the model's %d positions would need %.0f MiB of KV cache; using %d "
                        "(half the available %s); set --ctx to choose", n_ctx,
                        (double)n_ctx * per_pos / 1048576.0, capped, host ? "RAM" : "GPU memory");
            n_ctx = capped;
        }
    }
    st_state_params sp = {
        .n_ctx = n_ctx,
        .n_batch = p->n_batch > 0 ? p->n_batch : m->n_batch,
        .kv_type = p->kv_type == STRATA_KV_Q8_0 ? ST_KV_Q8_0 : ST_KV_F16,
        .count_experts = p->count_experts,
    };
    strata_session *s = st_calloc(1, sizeof *s);
    if (!s) return ST_ERR_NOMEM;
    s->m = m;
    s->n_batch = sp.n_batch;
    s->n_ctx = sp.n_ctx;
    st_status st = st_state_create(m->model, m->backend, &sp, &s->state);
    if (!st && !(s->tokens = st_alloc(sizeof(int32_t) * (size_t)sp.n_ctx))) st = ST_ERR_NOMEM;
    if (st) {
        st_state_free(s->state);
        st_free(s);
        return st;
    }
    *out = s;
    return ST_OK;
}

void strata_session_close(strata_session *s) {
    if (!s) return;
    st_state_free(s->state);
    st_free(s->tokens);
    st_free(s);
}

int strata_session_pos(const strata_session *s) { return st_state_pos(s->state); }
strata_model *st_engine_session_model(const strata_session *s) { return s->m; }
int strata_session_ctx(const strata_session *s) { return s->n_ctx; }
int st_engine_session_batch(const strata_session *s) { return s->n_batch; }

// The cache's size: experts on the GPU, experts in all.
static void cache_size(const strata_model *m, strata_expert_stats *r) {
    const st_placement *p = m->model->placement;
    r->total = (int64_t)p->n_layer * p->n_expert;
    r->cached = 0;
    for (int l = 0; l < p->n_layer; l++) r->cached += p->n_slots[l];
    r->pcie_frac = m->model->cache ? m->model->cache->pcie_frac : 0;
}

strata_expert_stats strata_session_expert_stats(const strata_session *s) {
    st_experts_stats x = st_state_expert_stats(s->state);
    strata_expert_stats r = {.hits = x.hits, .misses = x.misses, .streamed_bytes = x.streamed_bytes,
                             .swaps = x.swaps, .cpu_jobs = x.cpu_jobs, .cpu_s = x.cpu_s, .wait_s = x.wait_s,
                             .stream_s = x.stream_s, .gpu_wait_s = x.gpu_wait_s};
    cache_size(s->m, &r);
    return r;
}

strata_expert_stats strata_model_expert_stats(strata_model *m) {
    pthread_mutex_lock(&m->stats_mu);
    strata_expert_stats r = m->experts;
    pthread_mutex_unlock(&m->stats_mu);
    cache_size(m, &r);
    return r;
}

// Adds what the session's experts did since the last call to the model's sums.
static void count_experts(strata_session *s) {
    st_experts_stats x = st_state_expert_stats(s->state), *c = &s->counted;
    strata_model *m = s->m;
    pthread_mutex_lock(&m->stats_mu);
    m->experts.hits += x.hits - c->hits;
    m->experts.misses += x.misses - c->misses;
    m->experts.streamed_bytes += x.streamed_bytes - c->streamed_bytes;
    m->experts.swaps += x.swaps - c->swaps;
    m->experts.cpu_s += x.cpu_s - c->cpu_s;
    m->experts.cpu_jobs += x.cpu_jobs - c->cpu_jobs;
    m->experts.wait_s += x.wait_s - c->wait_s;
    m->experts.gpu_wait_s += x.gpu_wait_s - c->gpu_wait_s;
    m->experts.stream_s += x.stream_s - c->stream_s;
    pthread_mutex_unlock(&m->stats_mu);
    *c = x;
}

strata_status strata_session_expert_counts(strata_session *s, uint64_t *counts, size_t n) {
    const st_hparams *hp = &s->m->model->hp;
    size_t need = (size_t)(hp->n_layer + hp->n_mtp) * hp->n_expert;
    if (n < need) return st_fail(ST_ERR_ARG, "expert counts: room for %zu values, %zu needed", n, need);
    memcpy(counts, st_state_expert_counts(s->state), sizeof(uint64_t) * need);
    return ST_OK;
}

int strata_session_tokens(const strata_session *s, const int32_t **tokens) {
    *tokens = s->tokens;
    return st_state_pos(s->state);
}

// One forward call of up to n_batch rows, keeping the token record in step with the state.
static st_status forward(strata_session *s, const int32_t *tokens, int n, const st_forward_out *out) {
    int pos = st_state_pos(s->state);
    ST_TRY(st_model_forward(s->m->model, s->state, tokens, n, out));
    memcpy(s->tokens + pos, tokens, sizeof(int32_t) * n);
    count_experts(s);
    return ST_OK;
}

strata_status strata_session_eval(strata_session *s, const int32_t *tokens, int n, float *logits) {
    return strata_session_eval_hidden(s, tokens, n, logits, NULL);
}

strata_status strata_session_eval_hidden(strata_session *s, const int32_t *tokens, int n, float *logits,
                                         float *hidden) {
    const st_hparams *hp = &s->m->model->hp;
    for (int i = 0; i < n; i += s->n_batch) {
        int rows = n - i < s->n_batch ? n - i : s->n_batch;
        st_forward_out out = {.logits = logits ? logits + (size_t)i * hp->n_vocab : NULL, .want_all = true,
                              .hidden = hidden ? hidden + (size_t)i * hp->n_embd : NULL};
        ST_TRY(forward(s, tokens + i, rows, &out));
    }
    return ST_OK;
}

strata_status strata_session_mtp_draft(strata_session *s, int pos, const float *hidden, const int32_t *tokens,
                                       int n, float *logits, float *hidden_out) {
    const st_hparams *hp = &s->m->model->hp;
    if (n < 0 || (n > 0 && (!hidden || !tokens)))
        return st_fail(ST_ERR_ARG, "MTP draft: %d rows with hidden %s and tokens %s", n, hidden ? "set" : "NULL",
                       tokens ? "set" : "NULL");
    for (int i = 0; i < n; i += s->n_batch) {
        int rows = n - i < s->n_batch ? n - i : s->n_batch;
        st_forward_out out = {.logits = logits ? logits + (size_t)i * hp->n_vocab : NULL, .want_all = true,
                              .hidden = hidden_out ? hidden_out + (size_t)i * hp->n_embd : NULL};
        ST_TRY(st_model_mtp(s->m->model, s->state, pos + i, hidden + (size_t)i * hp->n_embd, tokens + i, rows, &out));
        count_experts(s);
    }
    return ST_OK;
}

// A snapshot: the state's and the token record up to its position.
struct strata_snapshot {
    st_snapshot *state;
    int32_t *tokens;              // (pos)
};

strata_status strata_session_save(const strata_session *s, strata_snapshot **out) {
    *out = NULL;
    strata_snapshot *snap = st_calloc(1, sizeof *snap);
    if (!snap) return ST_ERR_NOMEM;
    int pos = st_state_pos(s->state);
    st_status st = st_state_save(s->state, &snap->state);
    if (!st && !(snap->tokens = st_alloc(sizeof(int32_t) * (size_t)(pos ? pos : 1)))) st = ST_ERR_NOMEM;
    if (st) {
        strata_snapshot_free(snap);
        return st;
    }
    memcpy(snap->tokens, s->tokens, sizeof(int32_t) * (size_t)pos);
    *out = snap;
    return ST_OK;
}

strata_status strata_session_restore(strata_session *s, const strata_snapshot *snap) {
    ST_TRY(st_state_restore(s->state, snap->state));
    memcpy(s->tokens, snap->tokens, sizeof(int32_t) * (size_t)st_state_pos(s->state));
    return ST_OK;
}

void strata_snapshot_free(strata_snapshot *snap) {
    if (!snap) return;
    st_snapshot_free(snap->state);
    st_free(snap->tokens);
    st_free(snap);
}

// ---------------------------------------------------------------------------------------------
// Text

static st_status need_tokenizer(const strata_model *m) {
    if (m->tok) return ST_OK;
    return st_fail(ST_ERR_UNSUPPORTED, "%s: no usable tokenizer: %s", st_gguf_path(m->gguf), m->tok_error);
}

st_status st_engine_tokenizer(const strata_model *m, st_tokenizer **out) {
    *out = m->tok;
    return need_tokenizer(m);
}

// Built lazily (most models never serve a JSON request); two threads racing here both build,
// and the one that loses frees its copy.
st_status st_engine_json_vocab(strata_model *m, const st_json_vocab **out) {
    st_json_vocab *v = atomic_load(&m->json_vocab), *expected = NULL;
    if (!v) {
        ST_TRY(need_tokenizer(m));
        ST_TRY(st_json_vocab_create(m->tok, &v));
        if (!atomic_compare_exchange_strong(&m->json_vocab, &expected, v)) {
            st_json_vocab_free(v);
            v = expected;
        }
    }
    *out = v;
    return ST_OK;
}

strata_status strata_tokenize(const strata_model *m, const char *text, size_t len, bool special,
                              int32_t **ids, int *n) {
    ST_TRY(need_tokenizer(m));
    size_t count;
    ST_TRY(st_tokenize(m->tok, text, len, special ? ST_TOKENIZE_SPECIAL : 0, ids, &count));
    *n = (int)count;
    return ST_OK;
}

strata_status strata_detokenize(const strata_model *m, const int32_t *ids, int n, char **out) {
    ST_TRY(need_tokenizer(m));
    size_t len;
    return st_detokenize(m->tok, ids, (size_t)n, false, out, &len);
}

strata_status strata_chat_render(const strata_model *m, const char *messages_json, const char *tools_json,
                                 bool add_generation_prompt, int thinking, char **out) {
    if (!m->tmpl)
        return st_fail(ST_ERR_UNSUPPORTED, "%s: no usable chat template: %s", st_gguf_path(m->gguf), m->tmpl_error);
    json_error_t je;
    json_t *msgs = json_loads(messages_json, 0, &je), *tools = NULL, *extra = json_object();
    st_status s = ST_OK;
    if (!msgs || !json_is_array(msgs))
        s = st_fail(ST_ERR_ARG, "messages: not a JSON array (%s at line %d)", msgs ? "an object" : je.text, je.line);
    if (!s && tools_json && !(tools = json_loads(tools_json, 0, &je)))
        s = st_fail(ST_ERR_ARG, "tools: not valid JSON (%s at line %d)", je.text, je.line);
    if (!s && thinking >= 0) json_object_set_new(extra, "enable_thinking", json_boolean(thinking));
    if (!s && m->tok) {
        int32_t bos = st_tokenizer_bos(m->tok), eos = st_tokenizer_eos(m->tok);
        if (bos >= 0) json_object_set_new(extra, "bos_token", json_string(st_token_piece(m->tok, bos)));
        if (eos >= 0) json_object_set_new(extra, "eos_token", json_string(st_token_piece(m->tok, eos)));
    }
    size_t len;
    if (!s) s = st_chat_apply(m->tmpl, msgs, tools, add_generation_prompt, extra, out, &len);
    json_decref(msgs);
    json_decref(tools);
    json_decref(extra);
    return s;
}

// ---------------------------------------------------------------------------------------------
// Generation

strata_sampling strata_sampling_default(void) {
    return (strata_sampling){.temperature = 0.7f, .top_k = 20, .top_p = 0.8f, .min_p = 0.0f,
                             .repeat_penalty = 1.0f, .penalty_last_n = 64, .seed = 0};
}

// Feeds tokens and leaves the last row's logits in `logits` and / or its greedy token in *best
// (either may be NULL; with logits NULL a GPU sends back only the token).
static st_status feed(strata_session *s, const int32_t *tokens, int n, float *logits, int32_t *best) {
    for (int i = 0; i < n; i += s->n_batch) {
        int rows = n - i < s->n_batch ? n - i : s->n_batch;
        bool last = i + rows >= n;
        st_forward_out out = {.logits = last ? logits : NULL, .want_all = false, .argmax = last ? best : NULL};
        ST_TRY(forward(s, tokens + i, rows, &out));
    }
    return ST_OK;
}

strata_status strata_session_eval_argmax(strata_session *s, const int32_t *tokens, int n, int32_t *best) {
    if (n < 1) return st_fail(ST_ERR_ARG, "eval: no tokens");
    return feed(s, tokens, n, NULL, best);
}

// The whole generation as one call: the step-wise loop of step.c run to the end.
strata_status strata_generate(strata_session *s, const int32_t *prompt, int n_prompt,
                              const strata_generate_params *p, strata_text_fn on_text, void *ctx,
                              strata_generate_stats *stats) {
    memset(stats, 0, sizeof *stats);
    strata_step_params sp = {.gen = *p, .prompt_chunk = s->n_batch};
    strata_step *g;
    ST_TRY(strata_step_begin(s, prompt, n_prompt, &sp, &g));
    bool done = false;
    st_status st = ST_OK;
    while (!done && !(st = strata_step_next(g, on_text, ctx, &done))) {}
    strata_step_stats(g, stats);
    strata_step_free(g);
    return st;
}
