// model: reads the hyper-parameters of a qwen3moe / qwen3next GGUF and binds every weight as a
// view into the mapping, checking each tensor's presence, type and shape once at load.

#include <stdio.h>
#include <string.h>

#include "model/model.h"

const char *st_arch_name(st_arch a) { return a == ST_ARCH_QWEN3NEXT ? "qwen3next" : "qwen3moe"; }

// ---------------------------------------------------------------------------------------------
// Metadata

typedef struct loader {
    const st_gguf *g;
    const char *arch;
    st_model *m;
} loader;

static st_status key_u32(const loader *L, const char *suffix, bool required, int dflt, int *out) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", L->arch, suffix);
    uint32_t v;
    if (st_gguf_get_u32(L->g, key, &v)) {
        *out = (int)v;
        return ST_OK;
    }
    // Some keys may be per-layer arrays (llama.cpp's get_key_or_arr): take the first element.
    st_gguf_vtype et;
    uint64_t count;
    const void *data;
    int64_t first;
    if (st_gguf_get_arr(L->g, key, &et, &count, &data) && count > 0 &&
        st_gguf_arr_i64(L->g, key, 0, &first) && first >= 0 && first <= INT32_MAX) {
        *out = (int)first;
        return ST_OK;
    }
    if (required) return st_fail(ST_ERR_FORMAT, "%s: missing metadata key '%s'", st_gguf_path(L->g), key);
    *out = dflt;
    return ST_OK;
}

static st_status key_f32(const loader *L, const char *suffix, float dflt, float *out) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", L->arch, suffix);
    if (!st_gguf_get_f32(L->g, key, out)) *out = dflt;
    return ST_OK;
}

static st_status read_hparams(loader *L) {
    st_hparams *hp = &L->m->hp;
    ST_TRY(key_u32(L, "context_length", false, 4096, &hp->n_ctx_train));
    ST_TRY(key_u32(L, "embedding_length", true, 0, &hp->n_embd));
    ST_TRY(key_u32(L, "block_count", true, 0, &hp->n_layer));
    ST_TRY(key_u32(L, "attention.head_count", true, 0, &hp->n_head));
    ST_TRY(key_u32(L, "attention.head_count_kv", false, hp->n_head, &hp->n_head_kv));
    int dflt_hd = hp->n_head ? hp->n_embd / hp->n_head : 0, vlen;
    ST_TRY(key_u32(L, "attention.key_length", false, dflt_hd, &hp->head_dim));
    ST_TRY(key_u32(L, "attention.value_length", false, hp->head_dim, &vlen));
    ST_TRY(key_u32(L, "rope.dimension_count", false, hp->head_dim, &hp->n_rot));
    ST_TRY(key_f32(L, "rope.freq_base", 10000.0f, &hp->rope_base));
    ST_TRY(key_f32(L, "attention.layer_norm_rms_epsilon", 1e-6f, &hp->eps));
    ST_TRY(key_u32(L, "expert_count", true, 0, &hp->n_expert));
    ST_TRY(key_u32(L, "expert_used_count", true, 0, &hp->n_expert_used));
    ST_TRY(key_u32(L, "expert_feed_forward_length", true, 0, &hp->n_ff_exp));
    ST_TRY(key_u32(L, "expert_shared_feed_forward_length", false, 0, &hp->n_ff_shexp));
    ST_TRY(key_u32(L, "nextn_predict_layers", false, 0, &hp->n_mtp));
    const char *path = st_gguf_path(L->g);
    if (hp->arch == ST_ARCH_QWEN3NEXT) {
        int inner;
        ST_TRY(key_u32(L, "ssm.conv_kernel", true, 0, &hp->ssm_kernel));
        ST_TRY(key_u32(L, "ssm.state_size", true, 0, &hp->ssm_d));
        ST_TRY(key_u32(L, "ssm.group_count", true, 0, &hp->ssm_h_k));
        ST_TRY(key_u32(L, "ssm.time_step_rank", true, 0, &hp->ssm_h_v));
        ST_TRY(key_u32(L, "ssm.inner_size", true, 0, &inner));
        ST_TRY(key_u32(L, "full_attention_interval", false, 4, &hp->full_attn_interval));
        if (hp->ssm_h_k <= 0 || hp->ssm_h_v <= 0 || hp->ssm_h_v % hp->ssm_h_k || hp->ssm_d <= 0 ||
            hp->ssm_d > ST_GDN_MAX_D ||
            inner != hp->ssm_h_v * hp->ssm_d || hp->ssm_kernel < 1 || hp->ssm_kernel > 16 ||
            hp->full_attn_interval < 1)
            return st_fail(ST_ERR_FORMAT,
                           "%s: inconsistent DeltaNet shape: conv_kernel %d, state_size %d (at most %d), group_count %d, "
                           "time_step_rank %d, inner_size %d, full_attention_interval %d",
                           path, hp->ssm_kernel, hp->ssm_d, ST_GDN_MAX_D, hp->ssm_h_k, hp->ssm_h_v, inner,
                           hp->full_attn_interval);
    }
    if (hp->n_embd <= 0 || hp->n_layer <= 0 || hp->n_head <= 0 || hp->n_head_kv <= 0 ||
        hp->n_head % hp->n_head_kv || hp->head_dim <= 0 || hp->head_dim > 512 || vlen != hp->head_dim ||
        hp->n_rot <= 0 || hp->n_rot > hp->head_dim || hp->n_rot % 2 || hp->n_expert <= 0 ||
        hp->n_expert_used <= 0 || hp->n_expert_used > hp->n_expert || hp->n_ff_exp <= 0 ||
        hp->n_mtp < 0 || hp->n_mtp > 1)
        return st_fail(ST_ERR_FORMAT,
                       "%s: inconsistent hyper-parameters: embedding %d, blocks %d, heads %d/%d, head size "
                       "%d/%d, rope dims %d, experts %d used %d, expert width %d, MTP layers %d",
                       path, hp->n_embd, hp->n_layer, hp->n_head, hp->n_head_kv, hp->head_dim, vlen,
                       hp->n_rot, hp->n_expert, hp->n_expert_used, hp->n_ff_exp, hp->n_mtp);
    return ST_OK;
}

// ---------------------------------------------------------------------------------------------
// Tensors

static void shape_str(char *buf, size_t size, const int64_t *ne, int n) {
    int o = snprintf(buf, size, "{");
    for (int i = 0; i < n && o < (int)size; i++)
        o += snprintf(buf + o, size - o, "%s%lld", i ? ", " : "", (long long)ne[i]);
    if (o < (int)size) snprintf(buf + o, size - o, "}");
}

// Finds tensor `name` and checks its shape against want[0..n) (trailing 1s ignored).
static st_status find(const loader *L, const char *name, const int64_t *want, int n, bool optional,
                      const st_gguf_tensor **out) {
    *out = st_gguf_find_tensor(L->g, name);
    char ws[96], fs[96];
    shape_str(ws, sizeof ws, want, n);
    if (!*out) {
        if (optional) return ST_OK;
        return st_fail(ST_ERR_FORMAT, "%s: missing tensor '%s' (expected shape %s)", st_gguf_path(L->g), name, ws);
    }
    const st_gguf_tensor *t = *out;
    bool ok = true;
    for (int i = 0; i < ST_GGUF_MAX_DIMS; i++) ok &= t->ne[i] == (i < n ? want[i] : 1);
    if (!ok) {
        shape_str(fs, sizeof fs, t->ne, t->n_dims);
        return st_fail(ST_ERR_FORMAT, "%s: tensor '%s' has shape %s, expected %s", st_gguf_path(L->g), name, fs, ws);
    }
    const st_type_info *ti = st_type_get(t->type);
    if (!ti || !ti->compute)
        return st_fail(ST_ERR_UNSUPPORTED, "%s: tensor '%s' has type %s, which Strata cannot compute with",
                       st_gguf_path(L->g), name, st_type_name(t->type));
    return ST_OK;
}

static st_status get_mat(const loader *L, const char *name, int64_t cols, int64_t rows, bool optional, st_mat *m) {
    const st_gguf_tensor *t;
    int64_t want[2] = {cols, rows};
    memset(m, 0, sizeof *m);
    ST_TRY(find(L, name, want, 2, optional, &t));
    if (!t) return ST_OK;
    *m = (st_mat){t->type, cols, rows, st_row_bytes(t->type, cols), t->data};
    return ST_OK;
}

static st_status get_mat3(const loader *L, const char *name, int64_t cols, int64_t rows, int64_t n, st_mat3 *m) {
    const st_gguf_tensor *t;
    int64_t want[3] = {cols, rows, n};
    ST_TRY(find(L, name, want, 3, false, &t));
    size_t rb = st_row_bytes(t->type, cols);
    *m = (st_mat3){t->type, cols, rows, n, rb, rb * rows, t->data};
    return ST_OK;
}

// Small vectors (norm weights, biases, conv taps) become f32 copies owned by the model.
static st_status get_vec(const loader *L, const char *name, int64_t n0, int64_t n1, bool optional, float **out) {
    const st_gguf_tensor *t;
    int64_t want[2] = {n0, n1};
    *out = NULL;
    ST_TRY(find(L, name, want, n1 > 1 ? 2 : 1, optional, &t));
    if (!t) return ST_OK;
    float *v = st_alloc(sizeof(float) * n0 * n1);
    if (!v) return ST_ERR_NOMEM;
    st_dequantize(t->type, t->data, v, n0 * n1);
    *out = v;
    return ST_OK;
}

#define BLK(buf, i, suffix) (snprintf(buf, sizeof buf, "blk.%d.%s", i, suffix), buf)

static st_status bind_attention(const loader *L, int i, st_layer *l) {
    const st_hparams *hp = &L->m->hp;
    char nb[128];
    int q_rows = hp->n_head * hp->head_dim * (hp->arch == ST_ARCH_QWEN3NEXT ? 2 : 1);
    ST_TRY(get_mat(L, BLK(nb, i, "attn_q.weight"), hp->n_embd, q_rows, false, &l->wq));
    ST_TRY(get_mat(L, BLK(nb, i, "attn_k.weight"), hp->n_embd, hp->n_head_kv * hp->head_dim, false, &l->wk));
    ST_TRY(get_mat(L, BLK(nb, i, "attn_v.weight"), hp->n_embd, hp->n_head_kv * hp->head_dim, false, &l->wv));
    ST_TRY(get_mat(L, BLK(nb, i, "attn_output.weight"), hp->n_head * hp->head_dim, hp->n_embd, false, &l->wo));
    ST_TRY(get_vec(L, BLK(nb, i, "attn_q_norm.weight"), hp->head_dim, 1, false, &l->q_norm));
    ST_TRY(get_vec(L, BLK(nb, i, "attn_k_norm.weight"), hp->head_dim, 1, false, &l->k_norm));
    return ST_OK;
}

static st_status bind_deltanet(const loader *L, int i, st_layer *l) {
    const st_hparams *hp = &L->m->hp;
    char nb[128];
    int d = hp->ssm_d, kd = hp->ssm_h_k * d, vd = hp->ssm_h_v * d, conv_dim = 2 * kd + vd;
    ST_TRY(get_mat(L, BLK(nb, i, "attn_qkv.weight"), hp->n_embd, conv_dim, true, &l->wqkv));
    if (l->wqkv.data) {
        ST_TRY(get_mat(L, BLK(nb, i, "attn_gate.weight"), hp->n_embd, vd, false, &l->wz));
    } else { // the legacy fused layout
        ST_TRY(get_mat(L, BLK(nb, i, "ssm_in.weight"), hp->n_embd, 2 * kd + 2 * vd, true, &l->w_ssm_in));
        if (!l->w_ssm_in.data)
            return st_fail(ST_ERR_FORMAT, "%s: layer %d has neither 'blk.%d.attn_qkv.weight' (expected {%d, %d}) "
                           "nor the legacy 'blk.%d.ssm_in.weight'", st_gguf_path(L->g), i, i, hp->n_embd, conv_dim, i);
    }
    ST_TRY(get_mat(L, BLK(nb, i, "ssm_ba.weight"), hp->n_embd, 2 * hp->ssm_h_v, false, &l->wba));
    ST_TRY(get_mat(L, BLK(nb, i, "ssm_out.weight"), vd, hp->n_embd, false, &l->wout));
    ST_TRY(get_vec(L, BLK(nb, i, "ssm_conv1d.weight"), hp->ssm_kernel, conv_dim, false, &l->conv));
    ST_TRY(get_vec(L, BLK(nb, i, "ssm_dt.bias"), hp->ssm_h_v, 1, false, &l->dt_bias));
    ST_TRY(get_vec(L, BLK(nb, i, "ssm_a"), hp->ssm_h_v, 1, false, &l->ssm_a));
    ST_TRY(get_vec(L, BLK(nb, i, "ssm_norm.weight"), d, 1, false, &l->ssm_norm));
    return ST_OK;
}

static st_status bind_moe(const loader *L, int i, st_layer *l) {
    const st_hparams *hp = &L->m->hp;
    char nb[128];
    int E = hp->n_expert, F = hp->n_ff_exp;
    ST_TRY(get_mat(L, BLK(nb, i, "ffn_gate_inp.weight"), hp->n_embd, E, false, &l->router));
    if (st_gguf_find_tensor(L->g, BLK(nb, i, "ffn_gate_up_exps.weight"))) {
        st_mat3 gu; // merged: per expert, F gate rows then F up rows
        ST_TRY(get_mat3(L, nb, hp->n_embd, 2 * F, E, &gu));
        l->gate_exps = (st_mat3){gu.type, gu.cols, F, E, gu.row_bytes, gu.mat_bytes, gu.data};
        l->up_exps = l->gate_exps;
        l->up_exps.data = (const char *)gu.data + (size_t)F * gu.row_bytes;
    } else {
        ST_TRY(get_mat3(L, BLK(nb, i, "ffn_gate_exps.weight"), hp->n_embd, F, E, &l->gate_exps));
        ST_TRY(get_mat3(L, BLK(nb, i, "ffn_up_exps.weight"), hp->n_embd, F, E, &l->up_exps));
    }
    ST_TRY(get_mat3(L, BLK(nb, i, "ffn_down_exps.weight"), F, hp->n_embd, E, &l->down_exps));
    if (hp->n_ff_shexp > 0) {
        int Fs = hp->n_ff_shexp;
        ST_TRY(get_mat(L, BLK(nb, i, "ffn_gate_shexp.weight"), hp->n_embd, Fs, false, &l->sh_gate));
        ST_TRY(get_mat(L, BLK(nb, i, "ffn_up_shexp.weight"), hp->n_embd, Fs, false, &l->sh_up));
        ST_TRY(get_mat(L, BLK(nb, i, "ffn_down_shexp.weight"), Fs, hp->n_embd, false, &l->sh_down));
        ST_TRY(get_vec(L, BLK(nb, i, "ffn_gate_inp_shexp.weight"), hp->n_embd, 1, false, &l->sh_gate_inp));
    }
    return ST_OK;
}

static st_status bind_layer(const loader *L, int i, bool mtp) {
    st_model *m = L->m;
    const st_hparams *hp = &m->hp;
    st_layer *l = &m->layers[i];
    char nb[128];
    l->recurrent = hp->arch == ST_ARCH_QWEN3NEXT && !mtp && (i + 1) % hp->full_attn_interval != 0;
    ST_TRY(get_vec(L, BLK(nb, i, "attn_norm.weight"), hp->n_embd, 1, false, &l->attn_norm));
    const char *post = hp->arch == ST_ARCH_QWEN3NEXT ? "post_attention_norm.weight" : "ffn_norm.weight";
    ST_TRY(get_vec(L, BLK(nb, i, post), hp->n_embd, 1, false, &l->ffn_norm));
    ST_TRY(l->recurrent ? bind_deltanet(L, i, l) : bind_attention(L, i, l));
    ST_TRY(bind_moe(L, i, l));
    if (mtp) {
        ST_TRY(get_vec(L, BLK(nb, i, "nextn.enorm.weight"), hp->n_embd, 1, false, &l->mtp_enorm));
        ST_TRY(get_vec(L, BLK(nb, i, "nextn.hnorm.weight"), hp->n_embd, 1, false, &l->mtp_hnorm));
        ST_TRY(get_vec(L, BLK(nb, i, "nextn.shared_head_norm.weight"), hp->n_embd, 1, false, &l->mtp_head_norm));
        ST_TRY(get_mat(L, BLK(nb, i, "nextn.eh_proj.weight"), 2 * hp->n_embd, hp->n_embd, false, &l->mtp_eh));
    }
    return ST_OK;
}

st_status st_model_load(const st_gguf *g, st_model **out) {
    *out = NULL;
    const char *arch;
    size_t alen;
    if (!st_gguf_get_str(g, "general.architecture", &arch, &alen))
        return st_fail(ST_ERR_FORMAT, "%s: missing metadata key 'general.architecture'", st_gguf_path(g));
    st_arch a;
    if (alen == 8 && !memcmp(arch, "qwen3moe", 8)) a = ST_ARCH_QWEN3MOE;
    else if (alen == 9 && !memcmp(arch, "qwen3next", 9)) a = ST_ARCH_QWEN3NEXT;
    else
        return st_fail(ST_ERR_UNSUPPORTED, "%s: architecture '%.*s' is not supported (Strata runs qwen3moe and qwen3next)",
                       st_gguf_path(g), (int)(alen > 64 ? 64 : alen), arch);
    st_model *m = st_calloc(1, sizeof *m);
    if (!m) return ST_ERR_NOMEM;
    m->gguf = g;
    m->hp.arch = a;
    loader L = {g, a == ST_ARCH_QWEN3NEXT ? "qwen3next" : "qwen3moe", m};
    st_status s = read_hparams(&L);
    if (s) goto fail;
    st_hparams *hp = &m->hp;
    if (hp->n_mtp > 0) { // where the MTP layer is (REFERENCE §2.4), if the file has one
        char nb[128];
        if (!st_gguf_find_tensor(g, BLK(nb, hp->n_layer, "nextn.eh_proj.weight"))) {
            if (hp->n_layer > hp->n_mtp && st_gguf_find_tensor(g, BLK(nb, hp->n_layer - hp->n_mtp, "nextn.eh_proj.weight"))) {
                hp->n_layer -= hp->n_mtp; // newer llama.cpp counts the MTP layers in block_count
            } else { // e.g. llama.cpp's qwen3next converter keeps the key but drops mtp.* tensors
                st_log_info("%s: nextn_predict_layers is %d but the file has no blk.%d.nextn.* tensors: "
                            "running without MTP drafting", st_gguf_path(g), hp->n_mtp, hp->n_layer);
                hp->n_mtp = 0;
            }
        }
    }

    const st_gguf_tensor *te = st_gguf_find_tensor(g, "token_embd.weight");
    if (!te) {
        s = st_fail(ST_ERR_FORMAT, "%s: missing tensor 'token_embd.weight'", st_gguf_path(g));
        goto fail;
    }
    hp->n_vocab = (int)te->ne[1];
    if ((s = get_mat(&L, "token_embd.weight", hp->n_embd, hp->n_vocab, false, &m->tok_embd))) goto fail;
    if ((s = get_vec(&L, "output_norm.weight", hp->n_embd, 1, false, &m->output_norm))) goto fail;
    if ((s = get_mat(&L, "output.weight", hp->n_embd, hp->n_vocab, true, &m->output))) goto fail;
    if (!m->output.data) m->output = m->tok_embd; // tied embeddings

    int n_total = hp->n_layer + hp->n_mtp;
    m->layers = st_calloc((size_t)n_total, sizeof(st_layer));
    if (!m->layers) {
        s = ST_ERR_NOMEM;
        goto fail;
    }
    for (int i = 0; i < n_total; i++)
        if ((s = bind_layer(&L, i, i >= hp->n_layer))) goto fail;
    if ((s = st_placement_create_host(n_total, hp->n_expert, &m->placement))) goto fail;
    *out = m;
    return ST_OK;
fail:
    st_model_free(m);
    return s;
}

void st_model_free(st_model *m) {
    if (!m) return;
    if (m->placed) { // the vectors were moved to the device with the rest
        st_adapt_free(m->adapt);
        st_expert_arena_free(m->placed, m->arena);
        st_expert_cache_free(m->placed, m->cache);
        for (int i = 0; i < m->n_dev; i++) m->placed->ops->free(m->placed, m->dev[i]);
        st_free(m->dev);
        st_free(m->layers);
        st_placement_free(m->placement);
        st_free(m);
        return;
    }
    if (m->layers) {
        for (int i = 0; i < m->hp.n_layer + m->hp.n_mtp; i++) {
            st_layer *l = &m->layers[i];
            float *vecs[] = {l->attn_norm, l->ffn_norm, l->q_norm, l->k_norm, l->conv, l->dt_bias,
                             l->ssm_a, l->ssm_norm, l->sh_gate_inp, l->mtp_enorm, l->mtp_hnorm, l->mtp_head_norm};
            for (size_t j = 0; j < sizeof vecs / sizeof vecs[0]; j++) st_free(vecs[j]);
        }
        st_free(m->layers);
    }
    st_free(m->output_norm);
    st_placement_free(m->placement);
    st_free(m);
}
