// server: the HTTP side (libmicrohttpd, a thread per connection): routing, the API key, CORS,
// body limits, errors in OpenAI's shape, the generation endpoints (a connection's thread waits
// on its job and notices a client that went away), /health /metrics /props /status /v1/models,
// and the embedded web page.

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "server/server.h"

#define POLL_MS 100         // how often a waiting connection checks its job and its client
#define KEEPALIVE_S 5.0     // a silent stream sends an SSE comment this often (proxies, timeouts)
#define MAX_CONNECTIONS 256 // a thread each

struct st_server {
    const st_server_config *cfg;
    strata_model *m;
    strata_model_info info;
    char model_id[256];       // the file's name without .gguf
    char *model_path;
    st_sched *sched;
    struct MHD_Daemon *daemon;
    double t_start;           // monotonic, for the uptime
    time_t started;           // wall clock, for /v1/models' "created"
    volatile bool draining, stopping;
    pthread_mutex_t mu;       // the counters below
    uint64_t requests, errors;
    int active;
    int exchanges;            // requests whose answer is not yet sent (MHD reports each completed)
};

// Per request: the body as it arrives.
typedef struct conn_ctx {
    char *body;
    size_t len, cap;
    bool too_big, counted;
} conn_ctx;

// ---------------------------------------------------------------------------------------------
// Responses

static const char *header(struct MHD_Connection *c, const char *name) {
    return MHD_lookup_connection_value(c, MHD_HEADER_KIND, name);
}

// The request's Origin when the config lets it call the API from a browser, else NULL.
static const char *allowed_origin(st_server *s, struct MHD_Connection *c) {
    const char *o = header(c, "Origin");
    if (!o) return NULL;
    size_t i;
    json_t *x;
    json_array_foreach(s->cfg->cors_origins, i, x) {
        const char *a = json_string_value(x);
        if (!strcmp(a, "*") || !strcmp(a, o)) return o;
    }
    return NULL;
}

static void add_cors(struct MHD_Response *r, const char *origin) {
    if (!origin) return;
    MHD_add_response_header(r, "Access-Control-Allow-Origin", origin);
    MHD_add_response_header(r, "Vary", "Origin");
}

static void count_error(st_server *s, int status, conn_ctx *cc) {
    if (status < 400 || !cc || !cc->counted) return;
    pthread_mutex_lock(&s->mu);
    s->errors++;
    pthread_mutex_unlock(&s->mu);
}

static enum MHD_Result send_bytes(st_server *s, struct MHD_Connection *c, conn_ctx *cc, int status, const char *mime,
                                  const void *data, size_t len, bool copy) {
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, (void *)data, copy ? MHD_RESPMEM_MUST_COPY : MHD_RESPMEM_PERSISTENT);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, "Content-Type", mime);
    add_cors(r, allowed_origin(s, c));
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    count_error(s, status, cc);
    return ret;
}

static enum MHD_Result send_json(st_server *s, struct MHD_Connection *c, conn_ctx *cc, int status, json_t *v) {
    char *text = json_dumps(v, JSON_COMPACT | JSON_REAL_PRECISION(9)); // floats read as written (0.7, not 0.69999...)
    json_decref(v);
    if (!text) return MHD_NO;
    enum MHD_Result r = send_bytes(s, c, cc, status, "application/json", text, strlen(text), true);
    free(text);
    return r;
}

// An error in OpenAI's shape ({"error": {message, type, param, code}}), with Anthropic's
// {"type": "error"} beside it so both SDKs read it.
static json_t *error_json(const char *type, const char *param, const char *message) {
    return json_pack("{s:s,s:{s:s,s:s,s:s?,s:s}}", "type", "error", "error", "message", message, "type", type, "param",
                     param && *param ? param : NULL, "code", type);
}

__attribute__((format(printf, 6, 7))) static enum MHD_Result send_error(st_server *s, struct MHD_Connection *c,
                                                                        conn_ctx *cc, int status, const char *param,
                                                                        const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    const char *type = status == 401 ? "authentication_error" : status == 404 ? "not_found_error"
                       : status == 413 ? "request_too_large" : status == 503 ? "overloaded_error"
                       : status >= 500 ? "server_error" : "invalid_request_error";
    json_t *v = error_json(type, param, msg);
    char *body = json_dumps(v, JSON_COMPACT);
    json_decref(v);
    struct MHD_Response *r = MHD_create_response_from_buffer(body ? strlen(body) : 0, body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", "application/json");
    if (status == 503) MHD_add_response_header(r, "Retry-After", "2");
    if (status == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    add_cors(r, allowed_origin(s, c));
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    count_error(s, status, cc);
    return ret;
}

// ---------------------------------------------------------------------------------------------
// Generation

// True when the client closed its side (a peek finds the end of the stream).
static bool client_gone(int fd) {
    if (fd < 0) return false;
    struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
    char b;
    return (p.revents & POLLIN) && recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

static int conn_fd(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

// A generation in flight, for a streamed response.
typedef struct stream_ctx {
    st_server *s;
    st_job *job;
    st_gen_request req;
    st_api_writer *w;
    int fd;
    char *pend;               // bytes not yet handed to MHD
    size_t pend_len, pend_off;
    double last_sent;
    bool finished;
} stream_ctx;

static void request_end(st_server *s, bool error) {
    pthread_mutex_lock(&s->mu);
    s->active--;
    if (error) s->errors++;
    pthread_mutex_unlock(&s->mu);
}

static ssize_t stream_read(void *cls, uint64_t pos, char *out, size_t max) {
    (void)pos;
    stream_ctx *sc = cls;
    for (;;) {
        if (sc->pend_off < sc->pend_len) {
            size_t n = sc->pend_len - sc->pend_off < max ? sc->pend_len - sc->pend_off : max;
            memcpy(out, sc->pend + sc->pend_off, n);
            sc->pend_off += n;
            sc->last_sent = st_time_s();
            return (ssize_t)n;
        }
        free(sc->pend);
        sc->pend = NULL, sc->pend_len = sc->pend_off = 0;
        if (sc->finished) return MHD_CONTENT_READER_END_OF_STREAM;
        if (sc->s->stopping) {
            st_job_cancel(sc->job);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        st_job_update u;
        st_job_poll(sc->job, POLL_MS, &u);
        char *bytes;
        size_t n;
        st_api_writer_update(sc->w, &u, &bytes, &n);
        free(u.text);
        if (u.done) {
            sc->finished = true;
            request_end(sc->s, u.error[0] != 0);
        }
        if (n) {
            sc->pend = bytes, sc->pend_len = n;
            continue;
        }
        if (client_gone(sc->fd)) { // nobody reads: stop generating for them
            st_job_cancel(sc->job);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (st_time_s() - sc->last_sent > KEEPALIVE_S && (sc->pend = strdup(": keep-alive\n\n")))
            sc->pend_len = strlen(sc->pend);
    }
}

static void stream_free(void *cls) {
    stream_ctx *sc = cls;
    if (!sc->finished) request_end(sc->s, true); // cut short (the client left, or shutdown)
    st_job_release(sc->job);
    st_api_writer_free(sc->w);
    st_gen_request_free(&sc->req);
    free(sc->pend);
    free(sc);
}

static enum MHD_Result generate(st_server *s, struct MHD_Connection *c, conn_ctx *cc, st_api api) {
    pthread_mutex_lock(&s->mu);
    s->requests++;
    s->active++;
    pthread_mutex_unlock(&s->mu);
    cc->counted = true;
    // From here every way out either ends the request (request_end) or hands it to a stream.
    if (s->draining) {
        request_end(s, false);
        return send_error(s, c, cc, 503, NULL, "the server is shutting down");
    }
    json_error_t je;
    json_t *body = json_loadb(cc->body ? cc->body : "", cc->len, 0, &je);
    if (!body) {
        request_end(s, false);
        return send_error(s, c, cc, 400, NULL, "the body is not valid JSON: %s (line %d, column %d)", je.text, je.line,
                          je.column);
    }
    stream_ctx *sc = calloc(1, sizeof *sc);
    st_http_error err;
    if (!sc) {
        json_decref(body);
        request_end(s, false);
        return send_error(s, c, cc, 500, NULL, "out of memory");
    }
    bool ok = st_api_parse(api, body, s->m, s->cfg, &sc->req, &err);
    json_decref(body);
    st_sched_stats ss;
    st_sched_get_stats(s->sched, &ss, NULL);
    if (ok && sc->req.n_ids >= ss.ctx) {
        ok = false;
        err = (st_http_error){.status = 400, .type = "invalid_request_error"};
        snprintf(err.param, sizeof err.param, "%s", api == ST_API_COMPLETION ? "prompt" : "messages");
        snprintf(err.message, sizeof err.message, "%s: the prompt has %d tokens; the context holds %d (one more is "
                 "needed for the answer)", err.param, sc->req.n_ids, ss.ctx);
        st_gen_request_free(&sc->req);
    }
    if (!ok) {
        free(sc);
        request_end(s, false);
        return send_error(s, c, cc, err.status, err.param, "%s", err.message);
    }
    st_job_params jp = {.ids = sc->req.ids, .n_ids = sc->req.n_ids, .turn = sc->req.turn, .gen = sc->req.gen};
    st_status st = st_sched_submit(s->sched, &jp, &sc->job);
    if (!st) st = st_api_writer_create(&sc->req, &sc->w);
    if (st) {
        int status = st == ST_ERR_RANGE ? 503 : 500;
        char msg[512];
        snprintf(msg, sizeof msg, "%s", st_error());
        st_job_release(sc->job);
        st_gen_request_free(&sc->req);
        free(sc);
        request_end(s, false);
        return send_error(s, c, cc, status, NULL, "%s", msg);
    }
    sc->s = s;
    sc->fd = conn_fd(c);
    sc->last_sent = st_time_s();
    if (sc->req.stream) {
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_read, sc, stream_free);
        if (!r) {
            stream_free(sc);
            return MHD_NO;
        }
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        MHD_add_response_header(r, "X-Accel-Buffering", "no");
        add_cors(r, allowed_origin(s, c));
        enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, r);
        MHD_destroy_response(r);
        return ret;
    }
    // Not streamed: this connection's thread waits for the whole answer, watching the client.
    char *out = NULL;
    size_t out_len = 0;
    st_job_update u = {0};
    for (;;) {
        st_job_poll(sc->job, POLL_MS, &u);
        char *bytes;
        size_t n;
        st_api_writer_update(sc->w, &u, &bytes, &n);
        free(u.text);
        if (n) {
            free(out);
            out = bytes, out_len = n;
        }
        if (u.done) break;
        if (s->stopping || client_gone(sc->fd)) {
            st_job_cancel(sc->job);
            free(out);
            stream_free(sc);
            return MHD_NO; // closes the connection
        }
    }
    sc->finished = true;
    enum MHD_Result ret;
    if (u.error[0]) {
        request_end(s, true);
        ret = send_error(s, c, NULL, 500, NULL, "generation failed: %s", u.error);
    } else {
        request_end(s, false);
        ret = send_bytes(s, c, cc, 200, "application/json", out ? out : "{}", out ? out_len : 2, true);
    }
    free(out);
    stream_free(sc);
    // The wait counted as silence to the connection timeout: reset it, so the answer goes out.
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned)s->cfg->timeout);
    return ret;
}

// ---------------------------------------------------------------------------------------------
// Information

static json_t *model_entry(st_server *s) {
    return json_pack("{s:s,s:s,s:I,s:s,s:{s:s,s:i,s:i,s:I}}", "id", s->model_id, "object", "model", "created",
                     (json_int_t)s->started, "owned_by", "strata", "meta", "arch", s->info.arch, "n_ctx_train",
                     s->info.n_ctx_train, "n_vocab", s->info.n_vocab, "size", (json_int_t)s->info.file_bytes);
}

static json_t *status_json(st_server *s) {
    st_sched_stats ss;
    st_slot_info *slots = calloc((size_t)s->cfg->parallel, sizeof *slots);
    st_sched_get_stats(s->sched, &ss, slots);
    st_sys_info sys;
    st_sys_read(&sys);
    json_t *sl = json_array();
    for (int i = 0; slots && i < ss.parallel; i++)
        json_array_append_new(sl, json_pack("{s:i,s:s,s:i}", "id", i, "state", slots[i].state, "n_past", slots[i].n_past));
    free(slots);
    pthread_mutex_lock(&s->mu);
    uint64_t total = s->requests, errors = s->errors;
    int active = s->active;
    pthread_mutex_unlock(&s->mu);
    json_t *gpus = json_array();
    strata_gpu_stats gs[8];
    int n_gpu = strata_model_gpu_stats(s->m, gs, 8);
    for (int i = 0; i < n_gpu; i++)
        json_array_append_new(gpus, json_pack("{s:i,s:s,s:I,s:I}", "index", gs[i].index, "name", gs[i].name,
                                              "vram_used_bytes", (json_int_t)gs[i].vram_used, "vram_total_bytes",
                                              (json_int_t)gs[i].vram_total));
    // The hybrid expert cache, when some experts stay off the GPU (null otherwise).
    strata_expert_stats es = strata_model_expert_stats(s->m);
    json_t *ec = json_null();
    if (es.cached < es.total && s->info.gpu >= 0)
        ec = json_pack("{s:I,s:I,s:f,s:I,s:I,s:f,s:I,s:f,s:f,s:I,s:I,s:f}", "cached", (json_int_t)es.cached, "total",
                       (json_int_t)es.total, "hit_rate",
                       es.hits + es.misses ? (double)es.hits / (double)(es.hits + es.misses) : 0.0, "hits",
                       (json_int_t)es.hits, "misses", (json_int_t)es.misses, "cpu_seconds", es.cpu_s,
                       "cpu_jobs", (json_int_t)es.cpu_jobs, "gpu_wait_seconds", es.gpu_wait_s, "stream_seconds", es.stream_s, "streamed_bytes", (json_int_t)es.streamed_bytes, "swaps",
                       (json_int_t)es.swaps, "pcie_frac", es.pcie_frac);
    return json_pack("{s:s,s:s,s:i,s:i,s:f,s:o,s:{s:i,s:i},s:{s:I,s:i,s:I},s:{s:I,s:I},s:{s:f,s:f},s:{s:I,s:I},"
                     "s:o,s:{s:f,s:I,s:I,s:I,s:o}}",
                     "model", s->model_id, "backend", s->info.backend ? s->info.backend : "cpu", "ctx", ss.ctx, "parallel", ss.parallel, "uptime_s",
                     st_time_s() - s->t_start, "slots", sl, "queue", "depth", ss.queue_depth, "limit", ss.queue_limit,
                     "requests", "total", (json_int_t)total, "active", active, "errors", (json_int_t)errors, "tokens",
                     "prompt", (json_int_t)ss.prompt_tokens, "generated", (json_int_t)ss.generated_tokens, "speed",
                     "prompt_tps", ss.prompt_tps, "decode_tps", ss.decode_tps, "prompt_cache", "hits",
                     (json_int_t)ss.cache_hits, "misses", (json_int_t)ss.cache_misses, "expert_cache", ec, "system",
                     "cpu_percent", sys.cpu_percent, "ram_used_bytes", (json_int_t)sys.ram_used, "ram_total_bytes",
                     (json_int_t)sys.ram_total, "process_rss_bytes", (json_int_t)sys.rss, "gpus", gpus);
}

static json_t *props_json(st_server *s) {
    const st_server_config *c = s->cfg;
    st_sched_stats ss;
    st_sched_get_stats(s->sched, &ss, NULL);
    const strata_sampling *sp = &c->sampling;
    json_t *sampling = json_pack("{s:f,s:i,s:f,s:f,s:f,s:f,s:f,s:i}", "temperature", sp->temperature, "top_k", sp->top_k,
                                 "top_p", sp->top_p, "min_p", sp->min_p, "repeat_penalty", sp->repeat_penalty,
                                 "presence_penalty", sp->presence_penalty, "frequency_penalty", sp->frequency_penalty,
                                 "repeat_last_n", sp->penalty_last_n);
    if (c->seed_set) json_object_set_new(sampling, "seed", json_integer((json_int_t)sp->seed));
    return json_pack("{s:s,s:s,s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:b,s:I,s:s,s:{s:s,s:i,s:i,s:i,s:i,s:s,s:i,s:i,s:i,s:i,s:i,"
                     "s:s,s:s,s:b,s:O,s:o},s:s}",
                     "model", s->model_id, "model_path", s->model_path, "arch", s->info.arch, "n_ctx", ss.ctx,
                     "n_ctx_train", s->info.n_ctx_train, "n_vocab", s->info.n_vocab, "n_layer", s->info.n_layer,
                     "n_expert", s->info.n_expert, "n_expert_used", s->info.n_expert_used, "has_mtp", s->info.has_mtp,
                     "file_bytes", (json_int_t)s->info.file_bytes, "backend", s->info.backend ? s->info.backend : "cpu", "settings", "host", c->host, "port",
                     c->port, "parallel", c->parallel, "queue", c->queue, "batch", c->batch, "kv", c->kv, "prompt_cache",
                     c->prompt_cache, "max_body_mib", c->max_body_mib, "timeout", c->timeout, "max_tokens", c->max_tokens,
                     "threads", c->threads, "gpu", c->gpu, "thinking", c->thinking < 0 ? "auto" : c->thinking ? "on" : "off",
                     "api_key", c->api_key && *c->api_key, "cors_origins", c->cors_origins, "sampling", sampling,
                     "version", "0.1.0");
}

static void metric(FILE *f, const char *name, const char *type, const char *help, double v) {
    fprintf(f, "# HELP strata_%s %s\n# TYPE strata_%s %s\nstrata_%s %.17g\n", name, help, name, type, name, v);
}

static char *metrics_text(st_server *s, size_t *len) {
    char *text = NULL;
    FILE *f = open_memstream(&text, len);
    if (!f) return NULL;
    st_sched_stats ss;
    st_sched_get_stats(s->sched, &ss, NULL);
    pthread_mutex_lock(&s->mu);
    uint64_t total = s->requests, errors = s->errors;
    int active = s->active;
    pthread_mutex_unlock(&s->mu);
    metric(f, "requests_total", "counter", "Generation requests received.", (double)total);
    metric(f, "requests_errors_total", "counter", "Generation requests answered with an error.", (double)errors);
    metric(f, "requests_active", "gauge", "Generation requests queued or running.", active);
    metric(f, "prompt_tokens_total", "counter", "Prompt tokens read (cached ones not counted).", (double)ss.prompt_tokens);
    metric(f, "generated_tokens_total", "counter", "Tokens generated.", (double)ss.generated_tokens);
    metric(f, "prompt_tokens_per_second", "gauge", "Prompt speed of the last request.", ss.prompt_tps);
    metric(f, "decode_tokens_per_second", "gauge", "Generation speed of the last request.", ss.decode_tps);
    metric(f, "queue_depth", "gauge", "Requests waiting for a slot.", ss.queue_depth);
    metric(f, "queue_limit", "gauge", "Requests that may wait before 503.", ss.queue_limit);
    metric(f, "slots", "gauge", "Slots (--parallel).", ss.parallel);
    metric(f, "slots_busy", "gauge", "Slots generating.", ss.active);
    metric(f, "prompt_cache_hits_total", "counter", "Requests that reused a cached prompt prefix.", (double)ss.cache_hits);
    metric(f, "prompt_cache_misses_total", "counter", "Requests read from the start.", (double)ss.cache_misses);
    metric(f, "prompt_cache_tokens_total", "counter", "Prompt tokens reused from the cache.", (double)ss.cache_tokens);
    metric(f, "uptime_seconds", "gauge", "Seconds since the server started.", st_time_s() - s->t_start);
    strata_expert_stats es = strata_model_expert_stats(s->m);
    if (es.cached < es.total && s->info.gpu >= 0) { // the hybrid expert cache
        metric(f, "expert_cache_experts", "gauge", "Experts in the GPU's cache.", (double)es.cached);
        metric(f, "expert_cache_hits_total", "counter", "Routed choices the GPU's cache held.", (double)es.hits);
        metric(f, "expert_cache_misses_total", "counter", "Routed choices computed elsewhere.", (double)es.misses);
        metric(f, "expert_cache_hit_rate", "gauge", "Hits over all routed choices so far.",
               es.hits + es.misses ? (double)es.hits / (double)(es.hits + es.misses) : 0.0);
        metric(f, "expert_cpu_seconds_total", "counter", "CPU-pool seconds computing missed experts.", es.cpu_s);
        metric(f, "expert_cpu_jobs_total", "counter", "Layer calls whose missed experts the CPU pool computed.",
               (double)es.cpu_jobs);
        metric(f, "expert_gpu_wait_seconds_total", "counter", "GPU seconds spent waiting for the CPU pool's experts.",
               es.gpu_wait_s);
        metric(f, "expert_streamed_bytes_total", "counter", "Expert bytes copied to the GPU for prompts.",
               (double)es.streamed_bytes);
        metric(f, "expert_swaps_total", "counter", "Adaptive expert cache swaps.", (double)es.swaps);
    }
    fclose(f);
    return text;
}

static const st_web_asset *find_asset(const char *url) {
    if (!strcmp(url, "/")) url = "/index.html";
    for (size_t i = 0; i < st_web_n_assets; i++)
        if (!strcmp(st_web_assets[i].path, url)) return &st_web_assets[i];
    return NULL;
}

// ---------------------------------------------------------------------------------------------
// Routing

static bool auth_ok(st_server *s, struct MHD_Connection *c) {
    const char *key = s->cfg->api_key;
    if (!key || !*key) return true;
    const char *given = header(c, "x-api-key"), *auth = header(c, "Authorization");
    if (!given && auth && !strncasecmp(auth, "Bearer ", 7)) given = auth + 7;
    if (!given) return false;
    size_t n = strlen(key);
    if (strlen(given) != n) return false;
    unsigned char diff = 0; // the same time whatever the first wrong byte
    for (size_t i = 0; i < n; i++) diff |= (unsigned char)(key[i] ^ given[i]);
    return diff == 0;
}

static enum MHD_Result route(st_server *s, struct MHD_Connection *c, const char *url, const char *method, conn_ctx *cc) {
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD"), post = !strcmp(method, "POST");
    if (!strcmp(method, "OPTIONS")) { // a browser's preflight: answered for the configured origins only
        const char *origin = allowed_origin(s, c);
        if (header(c, "Origin") && !origin)
            return send_error(s, c, cc, 403, NULL, "origin %s is not in the server's cors_origins", header(c, "Origin"));
        struct MHD_Response *r = MHD_create_response_from_buffer(0, NULL, MHD_RESPMEM_PERSISTENT);
        add_cors(r, origin);
        MHD_add_response_header(r, "Access-Control-Allow-Methods", "GET, POST, OPTIONS");
        MHD_add_response_header(r, "Access-Control-Allow-Headers",
                                "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta");
        MHD_add_response_header(r, "Access-Control-Max-Age", "600");
        enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_NO_CONTENT, r);
        MHD_destroy_response(r);
        return ret;
    }
    bool api = !strncmp(url, "/v1/", 4) || !strcmp(url, "/metrics") || !strcmp(url, "/props") ||
               !strcmp(url, "/status") || !strcmp(url, "/models");
    if (cc->too_big)
        return send_error(s, c, cc, 413, NULL, "the request body is larger than %d MiB (--max-body-mib)", s->cfg->max_body_mib);
    if (api && !auth_ok(s, c))
        return send_error(s, c, cc, 401, NULL, "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)");
    static const struct { const char *path; st_api api; } gen[] = {
        {"/v1/chat/completions", ST_API_CHAT}, {"/v1/completions", ST_API_COMPLETION}, {"/v1/messages", ST_API_ANTHROPIC},
    };
    for (size_t i = 0; i < sizeof gen / sizeof gen[0]; i++)
        if (!strcmp(url, gen[i].path)) {
            if (!post) return send_error(s, c, cc, 405, NULL, "%s takes POST", url);
            return generate(s, c, cc, gen[i].api);
        }
    if (!strcmp(url, "/health")) {
        if (!get) return send_error(s, c, cc, 405, NULL, "%s takes GET", url);
        return send_json(s, c, cc, s->draining ? 503 : 200, json_pack("{s:s}", "status", s->draining ? "shutting down" : "ok"));
    }
    if (!strcmp(url, "/v1/models") || !strcmp(url, "/models")) {
        if (!get) return send_error(s, c, cc, 405, NULL, "%s takes GET", url);
        return send_json(s, c, cc, 200, json_pack("{s:s,s:[o]}", "object", "list", "data", model_entry(s)));
    }
    if (!strcmp(url, "/status") || !strcmp(url, "/props")) {
        if (!get) return send_error(s, c, cc, 405, NULL, "%s takes GET", url);
        return send_json(s, c, cc, 200, url[1] == 's' ? status_json(s) : props_json(s));
    }
    if (!strcmp(url, "/metrics")) {
        if (!get) return send_error(s, c, cc, 405, NULL, "%s takes GET", url);
        size_t len;
        char *text = metrics_text(s, &len);
        if (!text) return send_error(s, c, cc, 500, NULL, "out of memory");
        enum MHD_Result r = send_bytes(s, c, cc, 200, "text/plain; version=0.0.4", text, len, true);
        free(text);
        return r;
    }
    if (get && !api) {
        const st_web_asset *a = find_asset(url);
        if (a) return send_bytes(s, c, cc, 200, a->mime, a->data, a->len, false);
    }
    return send_error(s, c, cc, 404, NULL, "no such endpoint: %s %s", method, url);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    (void)version;
    st_server *s = cls;
    conn_ctx *cc = *con_cls;
    size_t limit = (size_t)s->cfg->max_body_mib << 20;
    if (!cc) {
        if (!(cc = calloc(1, sizeof *cc))) return MHD_NO;
        *con_cls = cc;
        pthread_mutex_lock(&s->mu);
        s->exchanges++;
        pthread_mutex_unlock(&s->mu);
        const char *cl = header(c, "Content-Length");
        unsigned long long n = cl ? strtoull(cl, NULL, 10) : 0;
        if (n > limit) cc->too_big = true;
        // A body a little too large is read and dropped, so the client can read the 413; a far
        // larger one is refused at once (the connection closes under it).
        if (n > limit + ((size_t)64 << 20)) return route(s, c, url, method, cc);
        return MHD_YES;
    }
    if (*upload_size) {
        if (!cc->too_big && cc->len + *upload_size > limit) { // a chunked body that grew too large
            cc->too_big = true;
            free(cc->body);
            cc->body = NULL, cc->len = cc->cap = 0;
        }
        if (!cc->too_big) {
            if (cc->len + *upload_size + 1 > cc->cap) {
                size_t cap = (cc->len + *upload_size + 1) * 2;
                char *nb = realloc(cc->body, cap < limit + 1 ? cap : limit + 1);
                if (!nb) return MHD_NO;
                cc->body = nb, cc->cap = cap < limit + 1 ? cap : limit + 1;
            }
            memcpy(cc->body + cc->len, upload, *upload_size);
            cc->len += *upload_size;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    return route(s, c, url, method, cc);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode code) {
    (void)c, (void)code;
    st_server *s = cls;
    conn_ctx *cc = *con_cls;
    if (!cc) return;
    pthread_mutex_lock(&s->mu);
    s->exchanges--;
    pthread_mutex_unlock(&s->mu);
    free(cc->body);
    free(cc);
    *con_cls = NULL;
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    msg[strcspn(msg, "\n")] = 0;
    st_log_debug("http: %s", msg);
}

// ---------------------------------------------------------------------------------------------
// Start and stop

// The listening socket, made here so that a taken port or a wrong address is said plainly.
static st_status listen_socket(const char *host, int port, int *out) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *ai;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int rc = getaddrinfo(host, ps, &hints, &ai);
    if (rc) return st_fail(ST_ERR_ARG, "host '%s': %s", host, gai_strerror(rc));
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    st_status st = ST_OK;
    if (fd < 0) st = st_fail(ST_ERR_IO, "socket: %s", strerror(errno));
    if (!st) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (!st && bind(fd, ai->ai_addr, ai->ai_addrlen))
        st = st_fail(ST_ERR_IO, "cannot listen on %s:%d: %s%s", host, port, strerror(errno),
                     errno == EADDRINUSE ? " (is another server running? choose another with --port)" : "");
    if (!st && listen(fd, 128)) st = st_fail(ST_ERR_IO, "listen on %s:%d: %s", host, port, strerror(errno));
    freeaddrinfo(ai);
    if (st && fd >= 0) close(fd);
    if (!st) *out = fd;
    return st;
}

st_status st_server_start(const st_server_config *c, strata_model *m, const char *model_path, st_server **out) {
    *out = NULL;
    st_server *s = calloc(1, sizeof *s);
    if (!s) return st_fail(ST_ERR_NOMEM, "out of memory");
    s->cfg = c;
    s->m = m;
    s->info = strata_model_get_info(m);
    s->t_start = st_time_s();
    s->model_path = strdup(model_path);
    pthread_mutex_init(&s->mu, NULL);
    const char *base = strrchr(model_path, '/');
    snprintf(s->model_id, sizeof s->model_id, "%s", base ? base + 1 : model_path);
    size_t idl = strlen(s->model_id);
    if (idl > 5 && !strcmp(s->model_id + idl - 5, ".gguf")) s->model_id[idl - 5] = 0;
    st_sched_params sp = {.parallel = c->parallel, .queue = c->queue, .ctx = c->ctx, .batch = c->batch,
                          .prompt_cache = c->prompt_cache, .kv = strcmp(c->kv, "q8_0") ? STRATA_KV_F16 : STRATA_KV_Q8_0};
    int fd = -1;
    st_status st = st_sched_create(m, &sp, &s->sched);
    if (!st) st = listen_socket(c->host, c->port, &fd);
    if (!st) {
        // The uptime counts from when requests can come.
        s->t_start = st_time_s();
        s->started = time(NULL);
        s->daemon = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL |
                                         MHD_USE_ERROR_LOG,
                                     0, NULL, NULL, on_request, s, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
                                     MHD_OPTION_LISTEN_SOCKET, fd, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)c->timeout,
                                     MHD_OPTION_CONNECTION_LIMIT, (unsigned)MAX_CONNECTIONS, MHD_OPTION_NOTIFY_COMPLETED,
                                     on_completed, s, MHD_OPTION_END);
        if (!s->daemon) {
            close(fd);
            st = st_fail(ST_ERR_IO, "cannot start the HTTP server on %s:%d", c->host, c->port);
        }
    }
    if (st) {
        st_server_free(s);
        return st;
    }
    *out = s;
    return ST_OK;
}

static bool answers_sent(st_server *s) {
    pthread_mutex_lock(&s->mu);
    bool done = s->exchanges == 0;
    pthread_mutex_unlock(&s->mu);
    return done;
}

bool st_server_drain(st_server *s, double timeout_s) {
    s->draining = true;
    double until = st_time_s() + timeout_s;
    // Every job done and every answer sent: a job's end comes before its connection's thread
    // has written the answer, and stopping the daemon then would cut it off.
    while (!st_sched_idle(s->sched) || !answers_sent(s)) {
        if (st_time_s() >= until) return false;
        usleep(50 * 1000);
    }
    return true;
}

void st_server_free(st_server *s) {
    if (!s) return;
    s->draining = s->stopping = true;
    // Connections first (their threads let go of their jobs), then the slots.
    if (s->daemon) MHD_stop_daemon(s->daemon);
    st_sched_free(s->sched);
    pthread_mutex_destroy(&s->mu);
    free(s->model_path);
    free(s);
}
