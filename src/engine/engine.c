// engine: the public API (strata.h) over the modules: a model is a mapped GGUF bound to a
// backend; a session is one sequence's state fed in prompt chunks.

#include <string.h>

#include "strata.h"
#include "backend/backend.h"
#include "gguf/gguf.h"
#include "model/model.h"

struct strata_model {
    st_gguf *gguf;
    st_model *model;
    st_backend *backend;
};

struct strata_session {
    strata_model *m;
    st_state *state;
    int n_batch, n_ctx;
};

const char *strata_error(void) { return st_error(); }

strata_status strata_model_open(const strata_model_params *p, strata_model **out) {
    *out = NULL;
    strata_model *m = st_calloc(1, sizeof *m);
    if (!m) return ST_ERR_NOMEM;
    st_status s = st_gguf_open(p->path, &m->gguf);
    if (!s) s = st_model_load(m->gguf, &m->model);
    int threads = p->n_threads > 0 ? p->n_threads : st_cpu_count();
    if (!s) s = st_backend_cpu_create(threads, &m->backend);
    if (s) {
        strata_model_close(m);
        return s;
    }
    *out = m;
    return ST_OK;
}

void strata_model_close(strata_model *m) {
    if (!m) return;
    st_backend_free(m->backend);
    st_model_free(m->model);
    st_gguf_free(m->gguf);
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
        .file_bytes = st_gguf_file_bytes(m->gguf), .decode_bytes = decode_bytes(m->model),
    };
}

strata_status strata_session_open(strata_model *m, const strata_session_params *p, strata_session **out) {
    *out = NULL;
    const st_hparams *hp = &m->model->hp;
    int n_ctx = p->n_ctx > 0 ? p->n_ctx : hp->n_ctx_train;
    if (p->n_ctx <= 0) { // the model's context, capped so the KV cache takes at most half the free RAM
        int attn_layers = 0;
        for (int i = 0; i < hp->n_layer + hp->n_mtp; i++) attn_layers += !m->model->layers[i].recurrent;
        size_t per_pos = (size_t)attn_layers * 2 *
                         st_kv_row_bytes(p->kv_type == STRATA_KV_Q8_0 ? ST_KV_Q8_0 : ST_KV_F16,
                                         hp->n_head_kv * hp->head_dim);
        size_t avail = st_ram_available() / 2;
        if (per_pos && avail && (size_t)n_ctx * per_pos > avail) {
            int capped = (int)(avail / per_pos);
            st_log_info("context: the model's %d positions would need %.0f MiB of KV cache; using %d "
                        "(half the available RAM); set --ctx to choose", n_ctx,
                        (double)n_ctx * per_pos / 1048576.0, capped);
            n_ctx = capped;
        }
    }
    st_state_params sp = {
        .n_ctx = n_ctx,
        .n_batch = p->n_batch > 0 ? p->n_batch : 512,
        .kv_type = p->kv_type == STRATA_KV_Q8_0 ? ST_KV_Q8_0 : ST_KV_F16,
    };
    strata_session *s = st_calloc(1, sizeof *s);
    if (!s) return ST_ERR_NOMEM;
    s->m = m;
    s->n_batch = sp.n_batch;
    s->n_ctx = sp.n_ctx;
    st_status st = st_state_create(m->model, m->backend, &sp, &s->state);
    if (st) {
        st_free(s);
        return st;
    }
    *out = s;
    return ST_OK;
}

void strata_session_close(strata_session *s) {
    if (!s) return;
    st_state_free(s->state);
    st_free(s);
}

int strata_session_pos(const strata_session *s) { return st_state_pos(s->state); }
int strata_session_ctx(const strata_session *s) { return s->n_ctx; }

strata_status strata_session_eval(strata_session *s, const int32_t *tokens, int n, float *logits) {
    int n_vocab = s->m->model->hp.n_vocab;
    for (int i = 0; i < n; i += s->n_batch) {
        int rows = n - i < s->n_batch ? n - i : s->n_batch;
        st_forward_out out = {.logits = logits ? logits + (size_t)i * n_vocab : NULL, .want_all = true};
        ST_TRY(st_model_forward(s->m->model, s->state, tokens + i, rows, &out));
    }
    return ST_OK;
}
