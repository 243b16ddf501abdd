// model: puts a bound model's weights into a backend's memory. On the CPU nothing moves (the
// mapping is used in place); on a GPU every tensor the model uses is copied once, planned first.

#include <string.h>
#include <unistd.h>

#include "model/model.h"

// Every pointer in the model that names dense weights: matrices and small vectors (the routed
// experts go to the expert cache, below).
typedef struct weight_refs {
    const void **ptr[64 * 1024];
    int n;
} weight_refs;

static void add_ref(weight_refs *r, const void **p) {
    if (*p) r->ptr[r->n++] = p;
}

static void collect(st_model *m, weight_refs *r) {
    add_ref(r, &m->tok_embd.data);
    add_ref(r, &m->output.data);
    add_ref(r, (const void **)&m->output_norm);
    for (int i = 0; i < m->hp.n_layer + m->hp.n_mtp; i++) {
        st_layer *l = &m->layers[i];
        st_mat *mats[] = {&l->wq, &l->wk, &l->wv, &l->wo, &l->wqkv, &l->wz, &l->w_ssm_in, &l->wba, &l->wout,
                          &l->router, &l->sh_gate, &l->sh_up, &l->sh_down, &l->mtp_eh};
        for (size_t j = 0; j < sizeof mats / sizeof mats[0]; j++) add_ref(r, &mats[j]->data);
        float **vecs[] = {&l->attn_norm, &l->ffn_norm, &l->q_norm, &l->k_norm, &l->conv, &l->dt_bias,
                          &l->ssm_a, &l->ssm_norm, &l->sh_gate_inp, &l->mtp_enorm, &l->mtp_hnorm, &l->mtp_head_norm};
        for (size_t j = 0; j < sizeof vecs / sizeof vecs[0]; j++) add_ref(r, (const void **)vecs[j]);
    }
}

// The GGUF tensor whose data holds p, or NULL (the small f32 vectors are model-owned copies).
static const st_gguf_tensor *tensor_of(const st_gguf *g, const void *p) {
    for (int64_t i = 0; i < st_gguf_tensor_count(g); i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        if ((const char *)p >= (const char *)t->data && (const char *)p < (const char *)t->data + t->bytes) return t;
    }
    return NULL;
}

// Bytes of the model-owned vector at p (its size from the layer's shape).
static size_t vec_bytes(const st_model *m, const st_layer *l, const void *p) {
    const st_hparams *hp = &m->hp;
    int cd = 2 * hp->ssm_h_k * hp->ssm_d + hp->ssm_h_v * hp->ssm_d;
    if (p == m->output_norm) return sizeof(float) * hp->n_embd;
    if (!l) return 0;
    if (p == l->q_norm || p == l->k_norm) return sizeof(float) * hp->head_dim;
    if (p == l->conv) return sizeof(float) * (size_t)cd * hp->ssm_kernel;
    if (p == l->dt_bias || p == l->ssm_a) return sizeof(float) * hp->ssm_h_v;
    if (p == l->ssm_norm) return sizeof(float) * hp->ssm_d;
    return sizeof(float) * hp->n_embd; // the norms and the shared expert's gate vector
}

static const st_layer *layer_of_vec(const st_model *m, const void *p) {
    for (int i = 0; i < m->hp.n_layer + m->hp.n_mtp; i++) {
        const st_layer *l = &m->layers[i];
        const float *vecs[] = {l->attn_norm, l->ffn_norm, l->q_norm, l->k_norm, l->conv, l->dt_bias,
                               l->ssm_a, l->ssm_norm, l->sh_gate_inp, l->mtp_enorm, l->mtp_hnorm, l->mtp_head_norm};
        for (size_t j = 0; j < sizeof vecs / sizeof vecs[0]; j++)
            if (vecs[j] == p) return l;
    }
    return NULL;
}

// Progress of the copy: a bar redrawn in place on a terminal, a log line every few seconds
// otherwise (a log file or a service manager).
typedef struct progress {
    bool tty;
    double t0, last;
    size_t total;
} progress;

static void progress_show(progress *p, size_t done, const char *what, bool final) {
    double now = st_time_s(), dt = now - p->t0;
    if (!final && now - p->last < (p->tty ? 0.1 : 3.0)) return;
    p->last = now;
    double gbs = dt > 0 ? done / 1e9 / dt : 0;
    if (p->tty) {
        int width = 30, fill = p->total ? (int)((double)done / p->total * width) : width;
        char bar[64];
        for (int i = 0; i < width; i++) bar[i] = i < fill ? '#' : '.';
        bar[width] = 0;
        fprintf(stderr, "\rstrata: weights to the GPU [%s] %5.1f / %.1f GiB %5.1f GB/s %-28.28s%s", bar,
                done / 1073741824.0, p->total / 1073741824.0, gbs, final ? "" : what, final ? "\n" : "");
        fflush(stderr);
    } else if (!final) {
        st_log_info("weights to the GPU: %.1f of %.1f GiB (%.1f GB/s), now %s", done / 1073741824.0,
                    p->total / 1073741824.0, gbs, what);
    }
}

static st_status place_experts(st_model *m, st_backend *b, const st_place_params *pp, size_t avail0, size_t allow);

st_status st_model_place(st_model *m, st_backend *b, const st_place_params *pp) {
    static const st_place_params defaults = {.expert_slots = -1, .adapt_decay = 1.0};
    if (!pp) pp = &defaults;
    if (b->ops->host_memory) {
        st_log_info("weights: %.2f GiB used in place from the file's mapping (%s backend)",
                    st_gguf_file_bytes(m->gguf) / 1073741824.0, b->ops->name);
        return ST_OK;
    }
    if (m->placed) return st_fail(ST_ERR_ARG, "the model is already placed on a backend");
    weight_refs *r = st_calloc(1, sizeof *r);
    if (!r) return ST_ERR_NOMEM;
    collect(m, r);
    // One upload per GGUF tensor (a view such as the up half of a merged gate_up stack, or a
    // tied head, shares its tensor's copy), one per model-owned vector.
    const st_gguf_tensor **tens = st_calloc((size_t)r->n, sizeof *tens);
    m->dev = st_calloc((size_t)r->n, sizeof *m->dev);
    st_status s = tens && m->dev ? ST_OK : ST_ERR_NOMEM;
    size_t total = 0;
    int n_up = 0;
    for (int i = 0; i < r->n && !s; i++) {
        const st_gguf_tensor *t = tensor_of(m->gguf, *r->ptr[i]);
        tens[i] = t;
        bool seen = false;
        for (int j = 0; j < i && !seen; j++) seen = t ? tens[j] == t : *r->ptr[j] == *r->ptr[i];
        if (!seen) total += t ? t->bytes : vec_bytes(m, layer_of_vec(m, *r->ptr[i]), *r->ptr[i]);
    }
    // What Strata may allocate: the free memory less the reserve; with --vram-budget-gib, the
    // budget read as the card's size, less what is taken before anything of ours is on it.
    size_t avail0 = b->ops->mem_free(b), total_b = b->ops->mem_total ? b->ops->mem_total(b) : 0;
    size_t avail = st_vram_allowance(pp->vram_budget, total_b, avail0);
    if (pp->vram_budget)
        st_log_info("VRAM budget %.2f GiB (a card of that size): %.2f GiB of it already in use or reserved (the CUDA "
                    "context, other programs, --vram-reserve-mib), %.2f GiB left for Strata",
                    pp->vram_budget / 1073741824.0,
                    total_b ? (total_b > avail0 ? total_b - avail0 : 0) / 1073741824.0 : 0.0, avail / 1073741824.0);
    if (!s && total + pp->keep_bytes > avail)
        s = st_fail(ST_ERR_NOMEM, "the model's dense weights need %.2f GiB of GPU memory and the KV cache and "
                    "buffers %.2f GiB, but %.2f GiB is available (free after the reserve, --vram-reserve-mib, or "
                    "--vram-budget-gib): lower --ctx, use a smaller quantization, or the CPU (--gpu cpu)",
                    total / 1073741824.0, pp->keep_bytes / 1073741824.0, avail / 1073741824.0);
    // Upload, remembering host -> device for every pointer so views map to their copies.
    const void **host = st_calloc((size_t)r->n, sizeof *host);
    if (!s && !host) s = ST_ERR_NOMEM;
    double t0 = st_time_s();
    progress prog = {.tty = isatty(2), .t0 = t0, .last = t0, .total = total};
    size_t done = 0;
    for (int i = 0; i < r->n && !s; i++) {
        const void *p = *r->ptr[i];
        host[i] = p;
        const st_gguf_tensor *t = tens[i];
        const char *base = t ? (const char *)t->data : (const char *)p;
        int j = 0;
        for (; j < i; j++)
            if (t ? tens[j] == t : host[j] == p) break;
        char *dev;
        if (j < i) { // shares an earlier upload: same offset into it
            const char *base_j = tens[j] ? (const char *)tens[j]->data : (const char *)host[j];
            dev = (char *)*r->ptr[j] - ((const char *)host[j] - base_j);
        } else {
            size_t bytes = t ? t->bytes : vec_bytes(m, layer_of_vec(m, p), p);
            dev = b->ops->upload(b, base, bytes);
            if (!dev) {
                s = st_fail_prefix(ST_ERR_NOMEM, "placing %s", t ? t->name : "a norm vector");
                break;
            }
            m->dev[n_up++] = dev;
            done += bytes;
            progress_show(&prog, done, t ? t->name : "norm vectors", false);
        }
        *r->ptr[i] = dev + ((const char *)p - base);
    }
    m->n_dev = n_up;
    if (!s) {
        if (prog.tty) progress_show(&prog, done, "", true);
        double dt = st_time_s() - t0;
        st_log_info("dense weights on the GPU: %.2f GiB in %d tensors, %.1f s (%.1f GB/s)", done / 1073741824.0,
                    n_up, dt, dt > 0 ? done / 1e9 / dt : 0.0);
        s = place_experts(m, b, pp, avail0, avail);
    }
    if (!s) {
        m->placed = b;
        // The host copies of the vectors are not needed any more.
        for (int i = 0; i < r->n; i++)
            if (!tens[i]) {
                bool first = true;
                for (int j = 0; j < i && first; j++) first = tens[j] || host[j] != host[i];
                if (first) st_free((void *)host[i]);
            }
    } else {
        // Back to the host pointers; the copies made so far go.
        for (int i = 0; host && i < r->n; i++)
            if (host[i]) *r->ptr[i] = host[i];
        for (int i = 0; i < n_up; i++) b->ops->free(b, m->dev[i]);
        st_free(m->dev);
        m->dev = NULL;
        m->n_dev = 0;
    }
    st_free(host);
    st_free(tens);
    st_free(r);
    return s;
}

// --pcie-frac when not given: the link's and the CPU pool's speeds measured, and the share of a
// decode token's misses that balances them when that clearly beats the CPU alone (st_pcie_pick).
static double probe_pcie_frac(st_model *m, st_backend *b, const size_t *eb, const uint64_t *prof) {
    const st_placement *p = m->placement;
    const st_expert_arena *a = m->arena;
    int L = p->n_layer, E = p->n_expert, k = m->hp.n_expert_used;
    // The misses a decode token makes per hybrid layer (k choices less the cache's share of the
    // routing, by the profile when there is one), and how many of their bytes are page-locked.
    double miss_b = 0, pinned_b = 0;
    int hybrid = 0, probe_layer = -1;
    for (int l = 0; l < L; l++) {
        if (!eb[l] || p->n_slots[l] >= E) continue;
        double hot = 0, tot = 0;
        for (int e = 0; e < E; e++) {
            double c = prof ? (double)prof[(size_t)l * E + e] + 1 : 1.0; // + 1: as the arena counts
            tot += c;
            if (st_placement_get(p, l, e) != ST_PLACE_HOST) hot += c;
        }
        double mb = k * (tot > 0 ? 1 - hot / tot : 1) * (double)eb[l];
        miss_b += mb;
        if (a->resident[l]) pinned_b += mb;
        if (probe_layer < 0 || eb[l] > eb[probe_layer]) probe_layer = l;
        hybrid++;
    }
    if (!hybrid) return 0;
    st_pcie_probe pr = {.miss_bytes = miss_b / hybrid, .sync_s = ST_PCIE_SYNC_S};
    size_t bytes = (size_t)256 << 20;
    double pinned = pinned_b > 0 ? st_expert_link_gbs(b, true, bytes) : 0;
    double paged = pinned_b < miss_b ? st_expert_link_gbs(b, false, bytes) : 0;
    // The time per byte of each source, weighted by the share of the misses it serves.
    double sp = miss_b > 0 ? pinned_b / miss_b : 0;
    if ((sp > 0 && pinned <= 0) || (sp < 1 && paged <= 0)) pr.link_gbs = 0;
    else pr.link_gbs = ST_PCIE_LINK_EFF / ((sp > 0 ? sp / pinned : 0) + (sp < 1 ? (1 - sp) / paged : 0));
    pr.cpu_gbs = st_experts_cpu_gbs(b->pool, p, &a->w[probe_layer], probe_layer, k);
    double f = st_pcie_pick(&pr);
    char link[96] = "";
    if (pinned > 0) snprintf(link, sizeof link, "%.1f GB/s from page-locked memory", pinned);
    if (paged > 0)
        snprintf(link + strlen(link), sizeof link - strlen(link), "%s%.1f GB/s from ordinary memory",
                 pinned > 0 ? ", " : "", paged);
    st_log_info("experts: link probe: %s; the CPU pool computes experts at %.1f GB/s; a decode token misses "
                "%.2f MiB a hybrid layer: %.0f us on the CPU alone, %.0f us split (at %.1f GB/s streamed, plus %.0f us "
                "of the streaming path's fixed cost) -> --pcie-frac %.2f%s",
                link[0] ? link : "failed", pr.cpu_gbs, pr.miss_bytes / 1048576.0, pr.cpu_s * 1e6, pr.split_s * 1e6,
                pr.link_gbs, pr.sync_s * 1e6, f, f > 0 ? "" : " (every miss on the CPU pool)");
    return f;
}

// The routed experts: the cache plan (hottest first, as many as the memory left and
// pp->expert_slots allow), the cache filled, the host arena for the rest, adaptive swaps.
// avail0: what the device could give before the dense weights; allow: what Strata may use in all.
static st_status place_experts(st_model *m, st_backend *b, const st_place_params *pp, size_t avail0, size_t allow) {
    st_placement *p = m->placement;
    int L = p->n_layer, E = p->n_expert;
    st_expert_weights *w = st_calloc((size_t)L, sizeof *w);
    size_t *eb = st_calloc((size_t)L, sizeof *eb);
    if (!w || !eb) {
        st_free(w);
        st_free(eb);
        return ST_ERR_NOMEM;
    }
    size_t all = 0;
    for (int l = 0; l < L; l++) {
        w[l] = (st_expert_weights){m->layers[l].gate_exps, m->layers[l].up_exps, m->layers[l].down_exps};
        eb[l] = st_expert_bytes(&w[l]);
        all += eb[l] * (size_t)E;
    }
    // What the cache may take: the free memory less what the states will need, within what
    // Strata may use less what the dense weights took (measured: allocations round up).
    size_t free_b = b->ops->mem_free(b), budget = free_b > pp->keep_bytes ? free_b - pp->keep_bytes : 0;
    size_t used = avail0 > free_b ? avail0 - free_b : 0;
    size_t left = allow > used + pp->keep_bytes ? allow - used - pp->keep_bytes : 0;
    if (left < budget) budget = left;
    if (pp->vram_budget)
        st_log_info("VRAM budget: %.2f GiB for the expert cache (of %.2f GiB for Strata: %.2f taken by the dense "
                    "weights, %.2f kept for the KV cache and buffers)", budget / 1073741824.0, allow / 1073741824.0,
                    used / 1073741824.0, pp->keep_bytes / 1073741824.0);
    if (pp->expert_slots >= 0 && pp->expert_slots < (int64_t)L * E) { // the hottest N, if they fit
        size_t max_e = 0;
        for (int l = 0; l < L; l++) max_e = eb[l] > max_e ? eb[l] : max_e;
        size_t want = (size_t)pp->expert_slots * max_e;
        if (want < budget) budget = want;
    }
    int64_t placed = st_placement_plan(p, pp->profile, eb, budget);
    if (pp->expert_slots >= 0 && placed < pp->expert_slots && placed < (int64_t)L * E) {
        st_free(w);
        st_free(eb);
        return st_fail(ST_ERR_NOMEM, "--expert-cache %lld: only %lld experts fit in the %.2f GiB left on the GPU "
                       "(after the dense weights, %.2f GiB kept for the KV cache and buffers, and the budget)",
                       (long long)pp->expert_slots, (long long)placed, budget / 1073741824.0,
                       pp->keep_bytes / 1073741824.0);
    }
    double t0 = st_time_s();
    size_t cache_b = 0;
    for (int l = 0; l < L; l++) cache_b += (size_t)p->n_slots[l] * eb[l];
    st_log_info("experts: copying %lld of %lld (%.2f GiB) into the GPU's cache%s", (long long)placed,
                (long long)L * E, cache_b / 1073741824.0,
                placed < (int64_t)L * E && pp->resident_bytes ? "; then page-locked copies of the rest" : "");
    st_status s = st_expert_cache_create(b, p, w, &m->cache);
    size_t resident = placed < (int64_t)L * E ? pp->resident_bytes : 0;
    if (!s) s = st_expert_arena_create(b, p, w, pp->profile, resident, &m->arena);
    if (!s && pp->adapt_every > 0 && placed > 0 && placed < (int64_t)L * E)
        s = st_adapt_create(p, pp->adapt_every, pp->adapt_swaps, pp->adapt_decay, pp->profile, &m->adapt);
    if (s) {
        st_adapt_free(m->adapt);
        st_expert_arena_free(b, m->arena);
        st_expert_cache_free(b, m->cache);
        m->adapt = NULL;
        m->arena = NULL;
        m->cache = NULL;
    } else {
        // The share of the profile's routing the cache covers (of all routing when uniform).
        double hot = 0, tot = 0;
        for (int l = 0; l < L; l++)
            for (int e = 0; e < E; e++) {
                double c = pp->profile ? (double)pp->profile[(size_t)l * E + e] : 1.0;
                tot += c;
                if (st_placement_get(p, l, e) != ST_PLACE_HOST) hot += c;
            }
        double dt = st_time_s() - t0;
        if (placed == (int64_t)L * E)
            st_log_info("experts: all %lld on the GPU (%.2f GiB, %.1f s)", (long long)placed,
                        m->cache->bytes / 1073741824.0, dt);
        else
            st_log_info("experts: %lld of %lld in the GPU's cache (%.2f of %.2f GiB, %.1f s), covering %.1f%% of "
                        "the %s routing; the rest from %s, computed by the CPU pool (%d threads)%s",
                        (long long)placed, (long long)L * E, m->cache->bytes / 1073741824.0, all / 1073741824.0, dt,
                        tot > 0 ? 100.0 * hot / tot : 0.0, pp->profile ? "profile's" : "(assumed uniform)",
                        m->arena->resident_bytes ? "page-locked memory" : "the file's mapping", st_pool_size(b->pool),
                        m->adapt ? "; adaptive swaps on" : "");
        if (m->arena->resident_bytes)
            st_log_info("experts: %.2f GiB of them resident in page-locked memory", m->arena->resident_bytes / 1073741824.0);
        if (placed < (int64_t)L * E) {
            m->cache->pcie_frac = pp->pcie_frac < 0 ? probe_pcie_frac(m, b, eb, pp->profile)
                                                    : pp->pcie_frac > 1 ? 1 : pp->pcie_frac;
            if (pp->pcie_frac > 0)
                st_log_info("experts: --pcie-frac %.2f: that share of a decode window's misses is copied to the GPU "
                            "and computed there (windows are not recorded as CUDA graphs)", m->cache->pcie_frac);
        }
    }
    st_free(w);
    st_free(eb);
    return s;
}
