// server: the slots (one engine session each), the FIFO queue in front of them, and the one
// inference thread that runs every forward: sessions of a model share its backend and CPU pool,
// so the thread interleaves the busy slots a step (a prompt chunk or a token) at a time. Also the
// prompt cache: snapshots of each slot's session at turn boundaries, restored when a new prompt
// starts with their tokens (a hybrid model's recurrent state cannot be cut back like a KV cache).

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/server.h"

// A saved session: its snapshot and the tokens it holds.
typedef struct cache_entry {
    strata_snapshot *snap;
    int32_t *tokens;          // (n)
    int n;
    uint64_t used;            // tick of the last save or use (the least recent goes first)
} cache_entry;

enum { SLOT_IDLE, SLOT_PROMPT, SLOT_GEN };
static const char *const slot_state_name[] = {"idle", "prompt", "generating"};

typedef struct slot {
    strata_session *sess;
    strata_snapshot *empty;   // position 0: where the slot goes back to when nothing matches
    cache_entry *cache;       // (p.prompt_cache)
    int n_cache;
    uint64_t used;
    // Written by the inference thread only; read by others under the scheduler's lock.
    st_job *job;              // NULL: idle
    strata_step *step;
    int state, n_past;
    int reuse;                // what assignment chose: -1 live state, -2 empty, else a cache entry
    int checkpoint;           // offset in the step's prompt where to save (0: none)
} slot;

struct st_job {
    st_sched *sched;
    int32_t *ids;             // (n_ids)
    int n_ids, turn;
    strata_generate_params gen;
    char **stop;              // (gen.n_stop) copies
    st_job *next;             // the queue's link
    // Under mu:
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    bool cancel, started, done, changed, queued;
    char *text;               // generated text not polled yet
    size_t len, cap;
    int cached, read;
    strata_generate_stats stats;
    char error[256];
};

struct st_sched {
    strata_model *m;
    st_sched_params p;
    slot *slots;
    pthread_t thread;
    bool thread_started;
    // Under mu:
    pthread_mutex_t mu;
    pthread_cond_t work;
    bool stop;
    st_job *qhead, *qtail;
    int qlen, active;
    uint64_t tick;
    uint64_t cache_hits, cache_misses, cache_tokens, prompt_tokens, generated_tokens;
    double prompt_tps, decode_tps;
};

static void cond_init_monotonic(pthread_cond_t *c) {
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(c, &a);
    pthread_condattr_destroy(&a);
}

// ---------------------------------------------------------------------------------------------
// Jobs

static void job_free(st_job *j) {
    for (int i = 0; i < j->gen.n_stop; i++) free(j->stop[i]);
    free(j->stop);
    free(j->ids);
    free(j->text);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
}

static void job_unref(st_job *j) {
    pthread_mutex_lock(&j->mu);
    bool last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (last) job_free(j);
}

// Appends generated text for the poller; false when the job was cancelled (stops generating).
static bool job_text(void *ctx, const char *text, size_t len) {
    st_job *j = ctx;
    pthread_mutex_lock(&j->mu);
    if (j->len + len > j->cap) {
        size_t cap = (j->len + len) * 2 + 64;
        char *nb = realloc(j->text, cap);
        if (nb) j->text = nb, j->cap = cap;
    }
    if (j->len + len <= j->cap) {
        memcpy(j->text + j->len, text, len);
        j->len += len;
    }
    j->changed = true;
    bool go_on = !j->cancel;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    return go_on;
}

void st_job_poll(st_job *j, int timeout_ms, st_job_update *u) {
    memset(u, 0, sizeof *u);
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&j->mu);
    while (!j->changed && !j->done)
        if (pthread_cond_timedwait(&j->cv, &j->mu, &until)) break;
    j->changed = false;
    u->text = j->text, u->len = j->len;
    j->text = NULL, j->len = j->cap = 0;
    u->prompt_total = j->n_ids;
    u->prompt_cached = j->cached;
    u->prompt_read = j->read;
    u->started = j->started;
    u->done = j->done;
    u->stats = j->stats;
    snprintf(u->error, sizeof u->error, "%s", j->error);
    pthread_mutex_unlock(&j->mu);
}

void st_job_cancel(st_job *j) {
    st_sched *s = j->sched;
    pthread_mutex_lock(&s->mu);
    pthread_mutex_lock(&j->mu);
    j->cancel = true;
    bool drop = j->queued;
    if (drop) { // still waiting: leave the queue now, so it does not count against the limit
        st_job **pp = &s->qhead, *prev = NULL;
        while (*pp && *pp != j) prev = *pp, pp = &(*pp)->next;
        if (*pp) {
            *pp = j->next;
            if (s->qtail == j) s->qtail = prev;
            s->qlen--;
        }
        j->queued = false;
        j->done = true;
        j->stats.stop_reason = "cancelled";
        pthread_cond_broadcast(&j->cv);
    }
    pthread_mutex_unlock(&j->mu);
    pthread_mutex_unlock(&s->mu);
    if (drop) job_unref(j); // the queue's reference
}

void st_job_release(st_job *j) {
    if (!j) return;
    st_job_cancel(j);
    job_unref(j);
}

// ---------------------------------------------------------------------------------------------
// The prompt cache

// The longest prefix of ids[0..n) a slot can continue from without reading it again: its live
// state or a snapshot, each only when everything it holds is a prefix of ids, and shorter than
// ids (the prompt's last token must be read for the logits of the first new one).
static int slot_match(const slot *sl, const int32_t *ids, int n, int *which) {
    const int32_t *held;
    int best = 0;
    *which = -2;
    for (int i = 0; i < sl->n_cache; i++) {
        const cache_entry *e = &sl->cache[i];
        if (e->n > best && e->n < n && !memcmp(e->tokens, ids, sizeof(int32_t) * (size_t)e->n)) best = e->n, *which = i;
    }
    int live = strata_session_tokens(sl->sess, &held);
    if (live > 0 && live >= best && live < n && !memcmp(held, ids, sizeof(int32_t) * (size_t)live))
        best = live, *which = -1;
    return best;
}

// Saves the slot's session as a cache entry (the least recently used one goes when full).
static void cache_save(st_sched *s, slot *sl) {
    if (!s->p.prompt_cache) return;
    const int32_t *held;
    int n = strata_session_tokens(sl->sess, &held);
    if (n <= 0) return;
    for (int i = 0; i < sl->n_cache; i++) // already there
        if (sl->cache[i].n == n && !memcmp(sl->cache[i].tokens, held, sizeof(int32_t) * (size_t)n)) {
            sl->cache[i].used = ++s->tick;
            return;
        }
    strata_snapshot *snap;
    int32_t *tokens = malloc(sizeof(int32_t) * (size_t)n);
    if (!tokens || strata_session_save(sl->sess, &snap)) { // no room: serving goes on without it
        st_log_warn("serve: prompt cache: could not save %d tokens: %s", n, tokens ? strata_error() : "out of memory");
        free(tokens);
        return;
    }
    memcpy(tokens, held, sizeof(int32_t) * (size_t)n);
    int at = sl->n_cache;
    if (at == s->p.prompt_cache) {
        at = 0;
        for (int i = 1; i < sl->n_cache; i++)
            if (sl->cache[i].used < sl->cache[at].used) at = i;
        strata_snapshot_free(sl->cache[at].snap);
        free(sl->cache[at].tokens);
    } else {
        sl->n_cache++;
    }
    sl->cache[at] = (cache_entry){.snap = snap, .tokens = tokens, .n = n, .used = ++s->tick};
}

// ---------------------------------------------------------------------------------------------
// The inference thread

static void set_state(st_sched *s, slot *sl, int state) {
    pthread_mutex_lock(&s->mu);
    sl->state = state;
    sl->n_past = strata_session_pos(sl->sess);
    pthread_mutex_unlock(&s->mu);
}

// Ends the slot's job: its stats, the counters, and the slot free again.
static void finish_job(st_sched *s, slot *sl, const char *reason, const char *error) {
    st_job *j = sl->job;
    strata_generate_stats st = {0};
    if (sl->step) strata_step_stats(sl->step, &st);
    else st.n_prompt = j->n_ids - j->cached;
    if (reason) st.stop_reason = reason;
    if (!st.stop_reason) st.stop_reason = "cancelled";
    pthread_mutex_lock(&s->mu);
    s->prompt_tokens += (uint64_t)(sl->step ? strata_step_prompt_read(sl->step) : 0);
    s->generated_tokens += (uint64_t)st.n_generated;
    if (st.prompt_s > 0) s->prompt_tps = st.n_prompt / st.prompt_s;
    if (st.generate_s > 0 && st.n_generated > 0) s->decode_tps = st.n_generated / st.generate_s;
    s->active--;
    sl->job = NULL;
    sl->state = SLOT_IDLE;
    sl->n_past = strata_session_pos(sl->sess);
    sl->used = ++s->tick;
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_lock(&j->mu);
    j->stats = st;
    if (error) snprintf(j->error, sizeof j->error, "%s", error);
    j->done = j->changed = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    strata_step_free(sl->step);
    sl->step = NULL;
    job_unref(j);
}

// A failed step leaves the session in no known state: back to empty.
static void reset_slot(slot *sl) {
    if (strata_session_restore(sl->sess, sl->empty))
        st_log_warn("serve: a slot could not be reset: %s", strata_error());
}

// Hands queued jobs to idle slots, each to the slot that can reuse most of its prompt (ties:
// the slot idle longest). Called with mu held.
static void assign(st_sched *s) {
    while (s->qhead) {
        st_job *j = s->qhead;
        slot *best = NULL;
        int best_len = -1, best_which = -2;
        for (int i = 0; i < s->p.parallel; i++) {
            slot *sl = &s->slots[i];
            if (sl->job) continue;
            int which, len = slot_match(sl, j->ids, j->n_ids, &which);
            if (len > best_len || (len == best_len && sl->used < best->used))
                best = sl, best_len = len, best_which = which;
        }
        if (!best) return;
        s->qhead = j->next;
        if (!s->qhead) s->qtail = NULL;
        s->qlen--;
        s->active++;
        best->job = j;
        best->reuse = best_which;
        best->state = SLOT_PROMPT;
        pthread_mutex_lock(&j->mu);
        j->queued = false;
        j->started = j->changed = true;
        j->cached = j->read = best_len;
        pthread_cond_broadcast(&j->cv);
        pthread_mutex_unlock(&j->mu);
        if (best_len > 0) s->cache_hits++, s->cache_tokens += (uint64_t)best_len;
        else s->cache_misses++;
    }
}

// The first step of a job on its slot: restore what assignment chose, begin the generation.
static void begin_job(st_sched *s, slot *sl) {
    st_job *j = sl->job;
    st_status st = ST_OK;
    if (sl->reuse >= 0) {
        st = strata_session_restore(sl->sess, sl->cache[sl->reuse].snap);
        sl->cache[sl->reuse].used = ++s->tick;
    } else if (sl->reuse == -2 && strata_session_pos(sl->sess) > 0) {
        st = strata_session_restore(sl->sess, sl->empty);
    }
    if (st) {
        char msg[256];
        snprintf(msg, sizeof msg, "restoring the prompt cache: %s", strata_error());
        reset_slot(sl);
        finish_job(s, sl, "error", msg);
        return;
    }
    int cached = j->cached;
    strata_step_params sp = {.gen = j->gen, .prompt_chunk = s->p.batch};
    int turn = j->turn > 0 ? j->turn : j->n_ids - 1;
    sl->checkpoint = s->p.prompt_cache && turn > cached ? turn - cached : 0;
    sp.checkpoint = sl->checkpoint;
    if (strata_step_begin(sl->sess, j->ids + cached, j->n_ids - cached, &sp, &sl->step)) {
        char msg[256];
        snprintf(msg, sizeof msg, "%s", strata_error());
        finish_job(s, sl, "error", msg);
    }
}

static void step_slot(st_sched *s, slot *sl) {
    st_job *j = sl->job;
    pthread_mutex_lock(&j->mu);
    bool cancel = j->cancel;
    pthread_mutex_unlock(&j->mu);
    if (cancel) {
        finish_job(s, sl, "cancelled", NULL);
        return;
    }
    if (!sl->step) {
        begin_job(s, sl);
        return;
    }
    bool done;
    st_status st = strata_step_next(sl->step, job_text, j, &done);
    int read = strata_step_prompt_read(sl->step);
    pthread_mutex_lock(&j->mu);
    if (j->read != j->cached + read) j->changed = true;
    j->read = j->cached + read;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (st) {
        char msg[256];
        snprintf(msg, sizeof msg, "%s", strata_error());
        st_log_warn("serve: generation failed: %s", msg);
        finish_job(s, sl, "error", msg);
        reset_slot(sl);
        return;
    }
    if (sl->checkpoint && read == sl->checkpoint) { // the end of the last turn before the answer
        cache_save(s, sl);
        sl->checkpoint = 0;
    }
    set_state(s, sl, read < j->n_ids - j->cached ? SLOT_PROMPT : SLOT_GEN);
    if (done) {
        cache_save(s, sl); // the conversation so far, for its next turn
        finish_job(s, sl, NULL, NULL);
    }
}

// Ends every job still queued or running (shutting down).
static void cancel_all(st_sched *s) {
    for (int i = 0; i < s->p.parallel; i++)
        if (s->slots[i].job) finish_job(s, &s->slots[i], "cancelled", "the server is shutting down");
    pthread_mutex_lock(&s->mu);
    st_job *j = s->qhead;
    s->qhead = s->qtail = NULL;
    s->qlen = 0;
    pthread_mutex_unlock(&s->mu);
    while (j) {
        st_job *next = j->next;
        pthread_mutex_lock(&j->mu);
        j->queued = false;
        j->done = j->changed = true;
        j->stats.stop_reason = "cancelled";
        snprintf(j->error, sizeof j->error, "the server is shutting down");
        pthread_cond_broadcast(&j->cv);
        pthread_mutex_unlock(&j->mu);
        job_unref(j);
        j = next;
    }
}

static void *inference_thread(void *arg) {
    st_sched *s = arg;
    int turn = 0;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        assign(s);
        while (!s->stop && !s->active) {
            pthread_cond_wait(&s->work, &s->mu);
            assign(s);
        }
        bool stop = s->stop;
        pthread_mutex_unlock(&s->mu);
        if (stop) break;
        // One step for each busy slot, starting from a rotating one so none is always last.
        for (int k = 0; k < s->p.parallel; k++) {
            slot *sl = &s->slots[(turn + k) % s->p.parallel];
            if (sl->job) step_slot(s, sl);
        }
        turn++;
    }
    cancel_all(s);
    return NULL;
}

// ---------------------------------------------------------------------------------------------

st_status st_sched_submit(st_sched *s, const st_job_params *p, st_job **out) {
    *out = NULL;
    st_job *j = calloc(1, sizeof *j);
    if (!j) return st_fail(ST_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&j->mu, NULL);
    cond_init_monotonic(&j->cv);
    j->sched = s;
    j->refs = 2; // the caller's and the scheduler's
    j->n_ids = p->n_ids;
    j->turn = p->turn;
    j->gen = p->gen;
    j->gen.n_stop = 0;
    j->ids = malloc(sizeof(int32_t) * (size_t)(p->n_ids > 0 ? p->n_ids : 1));
    j->stop = calloc((size_t)(p->gen.n_stop > 0 ? p->gen.n_stop : 1), sizeof(char *));
    bool ok = j->ids && j->stop;
    for (int i = 0; ok && i < p->gen.n_stop; i++) ok = (j->stop[j->gen.n_stop++] = strdup(p->gen.stop[i])) != NULL;
    if (!ok) {
        job_free(j);
        return st_fail(ST_ERR_NOMEM, "out of memory");
    }
    memcpy(j->ids, p->ids, sizeof(int32_t) * (size_t)p->n_ids);
    j->gen.stop = (const char *const *)j->stop;
    pthread_mutex_lock(&s->mu);
    if (s->stop) {
        pthread_mutex_unlock(&s->mu);
        job_free(j);
        return st_fail(ST_ERR_RANGE, "the server is shutting down");
    }
    int free_slots = s->p.parallel - s->active;
    if (s->qlen - free_slots >= s->p.queue) { // every slot busy and the queue full
        int qlen = s->qlen;
        pthread_mutex_unlock(&s->mu);
        job_free(j);
        return st_fail(ST_ERR_RANGE, "the server is busy: %d slots generating and %d requests waiting (the queue "
                       "holds %d); try again shortly", s->p.parallel, qlen, s->p.queue);
    }
    j->queued = true;
    if (s->qtail) s->qtail->next = j;
    else s->qhead = j;
    s->qtail = j;
    s->qlen++;
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mu);
    *out = j;
    return ST_OK;
}

st_status st_sched_create(strata_model *m, const st_sched_params *p, st_sched **out) {
    *out = NULL;
    st_sched *s = calloc(1, sizeof *s);
    if (!s) return st_fail(ST_ERR_NOMEM, "out of memory");
    s->m = m;
    s->p = *p;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work, NULL);
    s->slots = calloc((size_t)p->parallel, sizeof *s->slots);
    st_status st = s->slots ? ST_OK : st_fail(ST_ERR_NOMEM, "out of memory");
    int ctx = p->ctx;
    for (int i = 0; !st && i < p->parallel; i++) {
        slot *sl = &s->slots[i];
        strata_session_params sp = {.n_ctx = ctx, .n_batch = p->batch, .kv_type = p->kv};
        st = strata_session_open(m, &sp, &sl->sess);
        if (st) {
            st_fail_prefix(st, "slot %d of %d", i, p->parallel);
            break;
        }
        ctx = strata_session_ctx(sl->sess); // the first slot's (capped) context for all
        st = strata_session_save(sl->sess, &sl->empty);
        if (!st && p->prompt_cache && !(sl->cache = calloc((size_t)p->prompt_cache, sizeof *sl->cache)))
            st = st_fail(ST_ERR_NOMEM, "out of memory");
    }
    s->p.ctx = ctx;
    if (!st) {
        if (pthread_create(&s->thread, NULL, inference_thread, s)) st = st_fail(ST_ERR_NOMEM, "cannot start the inference thread");
        else s->thread_started = true;
    }
    if (st) {
        st_sched_free(s);
        return st;
    }
    *out = s;
    return ST_OK;
}

void st_sched_free(st_sched *s) {
    if (!s) return;
    if (s->thread_started) {
        pthread_mutex_lock(&s->mu);
        s->stop = true;
        pthread_cond_signal(&s->work);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->thread, NULL);
    }
    for (int i = 0; s->slots && i < s->p.parallel; i++) {
        slot *sl = &s->slots[i];
        for (int k = 0; k < sl->n_cache; k++) {
            strata_snapshot_free(sl->cache[k].snap);
            free(sl->cache[k].tokens);
        }
        free(sl->cache);
        strata_snapshot_free(sl->empty);
        strata_session_close(sl->sess);
    }
    free(s->slots);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->work);
    free(s);
}

void st_sched_get_stats(st_sched *s, st_sched_stats *st, st_slot_info *slots) {
    pthread_mutex_lock(&s->mu);
    *st = (st_sched_stats){
        .parallel = s->p.parallel, .queue_depth = s->qlen, .queue_limit = s->p.queue, .active = s->active,
        .ctx = s->p.ctx, .cache_hits = s->cache_hits, .cache_misses = s->cache_misses,
        .cache_tokens = s->cache_tokens, .prompt_tokens = s->prompt_tokens,
        .generated_tokens = s->generated_tokens, .prompt_tps = s->prompt_tps, .decode_tps = s->decode_tps,
    };
    for (int i = 0; slots && i < s->p.parallel; i++)
        slots[i] = (st_slot_info){.state = slot_state_name[s->slots[i].state], .n_past = s->slots[i].n_past};
    pthread_mutex_unlock(&s->mu);
}

bool st_sched_idle(st_sched *s) {
    pthread_mutex_lock(&s->mu);
    bool idle = !s->qlen && !s->active;
    pthread_mutex_unlock(&s->mu);
    return idle;
}
