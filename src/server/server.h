// server: `strata serve`, an HTTP server (libmicrohttpd) speaking the OpenAI and Anthropic APIs
// over the engine: slots run by one inference thread, a FIFO queue, the prompt cache, metrics,
// and the web page embedded at build time. docs/SERVER.md is the user's side of this file.
#pragma once

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "strata.h"
#include "util/util.h"

// =============================================================================================
// What the CLI calls
// =============================================================================================

// ---- configuration (config.c): flags and strata-NAME.json keys are one table.
typedef struct st_server_config {
    char *model;              // GGUF path
    char *host;               // address to bind ("127.0.0.1", "0.0.0.0", "::1", ...)
    int port;
    char *api_key;            // NULL or "": no key asked
    int parallel;             // slots: sessions generating at the same time
    int queue;                // requests that may wait for a slot (beyond: 503)
    int ctx;                  // context per slot; 0: the model's, capped by RAM
    int batch;                // prompt tokens per step
    int threads;              // CPU threads; 0: all cores
    char *kv;                 // "f16" | "q8_0"
    int prompt_cache;         // snapshots kept per slot; 0: no prompt cache
    int max_body_mib;         // request bodies beyond are refused (413)
    int timeout;              // seconds an idle connection is kept
    int max_tokens;           // default when a request gives none; 0: until the end or the context
    int drain_timeout;        // seconds SIGINT/SIGTERM waits for running requests
    int thinking;             // -1: the template's default, 0 off, 1 on
    char *gpu;                // "auto", "cpu" or a device number (as text): strata_model_params.gpu
    int vram_reserve_mib;     // VRAM left free on the GPU; 0: the engine's default
    // The hybrid expert cache (docs/HYBRID.md): strata_model_params' fields of the same names.
    char *expert_cache;       // NULL / "auto" or a number of experts
    char *expert_profile;     // NULL: MODEL.profile beside the model when present
    float vram_budget_gib;    // 0: what is free
    float resident_gib;       // 0: the mapping; < 0: page-locked copies of all experts the GPU lacks
    int pool_workers;         // 0: physical cores - 1
    int adapt_every;          // 0: the default (32); -1: off
    float pcie_frac;          // share of decode misses streamed to the GPU, 0 .. 1; < 0: unset (a probe picks)
    bool no_mmap;             // the model read into memory (huge pages) instead of mapped
    json_t *layer_split;      // NULL, a string or an array of layer numbers (several GPUs)
    json_t *cors_origins;     // array of origins allowed to call the API from a browser
    strata_sampling sampling; // defaults for requests that leave a field out
    bool seed_set;            // sampling.seed given: requests without a seed use it (else random)
} st_server_config;

void st_server_config_init(st_server_config *c);
void st_server_config_free(st_server_config *c);
// Applies a strata-NAME.json: every key is checked and every wrong key or value is named; the
// config's "args" (extra flags) are applied after its keys.
st_status st_server_config_load(st_server_config *c, const char *path);
// Applies flags argv[0..argc) (no program name). Unknown flags and bad values are errors.
st_status st_server_config_args(st_server_config *c, int argc, char **argv);
// Final checks that need every key (the model file readable, ...).
st_status st_server_config_check(const st_server_config *c);
// The flags and keys, for --help.
void st_server_config_help(FILE *f);

// ---- the server (http.c)
typedef struct st_server st_server;
// Binds, starts the HTTP threads and the inference thread; the model stays the caller's.
st_status st_server_start(const st_server_config *c, strata_model *m, const char *model_path, st_server **out);
// Stops taking requests (new ones get 503) and waits up to timeout_s for the running and
// queued ones and for their answers to be sent; returns whether all finished.
bool st_server_drain(st_server *s, double timeout_s);
void st_server_free(st_server *s); // cancels what still runs

// =============================================================================================
// Inside the module
// =============================================================================================

// ---- model output parsing (parse.c): reasoning and tool calls out of the generated text.
typedef enum st_out_kind { ST_OUT_CONTENT, ST_OUT_REASONING, ST_OUT_TOOL_CALL } st_out_kind;

typedef struct st_out_event {
    st_out_kind kind;
    const char *text;         // CONTENT / REASONING: the piece (not NUL-terminated)
    size_t len;
    const char *name;         // TOOL_CALL: the function's name
    const char *arguments;    // TOOL_CALL: its arguments, a JSON object as text
} st_out_event;
typedef void (*st_out_fn)(void *ctx, const st_out_event *ev);

typedef struct st_out_parser st_out_parser;
// in_reasoning: the prompt already opened <think> (thinking templates end it so). tools: the
// request's tools, OpenAI form (borrowed; their schemas type Qwen3-Coder's XML parameters), or
// NULL: then <tool_call> is left as text.
st_status st_out_parser_create(bool in_reasoning, const json_t *tools, st_out_parser **out);
void st_out_parser_free(st_out_parser *p);
// Feeds generated text; events go to fn as soon as they are certain (markup split across
// pieces is held back until it is complete, so it never reaches the content).
st_status st_out_parser_push(st_out_parser *p, const char *text, size_t len, st_out_fn fn, void *ctx);
// The end of the text: what was held back goes out (an unfinished tool call that does not
// parse is given back as content).
st_status st_out_parser_finish(st_out_parser *p, st_out_fn fn, void *ctx);
// Parses one tool call's body (between <tool_call> and </tool_call>): Qwen3's JSON or
// Qwen3-Coder's <function=...> XML. *name and *arguments are malloc'd.
st_status st_parse_tool_call(const char *body, size_t len, const json_t *tools, char **name, char **arguments);

// ---- scheduling (sched.c): slots, the queue, the inference thread, the prompt cache.
typedef struct st_sched st_sched;
typedef struct st_job st_job;

typedef struct st_sched_params {
    int parallel, queue, ctx, batch, prompt_cache;
    strata_kv_type kv;
} st_sched_params;

typedef struct st_job_params {
    const int32_t *ids;       // the whole prompt (copied)
    int n_ids;
    int turn;                 // prompt tokens up to the end of the last turn before the answer
                              // (a prompt-cache snapshot is taken there); 0: n_ids - 1
    strata_generate_params gen; // stop strings copied
} st_job_params;

// What a job did since the last poll.
typedef struct st_job_update {
    char *text;               // generated text since the last poll (malloc'd, NULL if none)
    size_t len;
    int prompt_total;         // prompt tokens, of which cached were reused from the cache
    int prompt_cached, prompt_read; // and read so far (cached included)
    bool started;             // a slot took the job
    bool done;
    strata_generate_stats stats; // when done (stop_reason "cancelled" if cancelled)
    char error[256];          // when done with an engine error: the message ("" if none)
} st_job_update;

st_status st_sched_create(strata_model *m, const st_sched_params *p, st_sched **out);
void st_sched_free(st_sched *s);
// Queues a generation. ST_ERR_RANGE when the queue is full (the caller answers 503).
st_status st_sched_submit(st_sched *s, const st_job_params *p, st_job **out);
// Waits up to timeout_ms for something new (text, progress, the end), then reports it.
void st_job_poll(st_job *j, int timeout_ms, st_job_update *u);
void st_job_cancel(st_job *j);   // stops it at its next step (a queued job never starts)
void st_job_release(st_job *j);  // the caller's reference; cancels a job still running

typedef struct st_slot_info {
    const char *state;        // "idle" | "prompt" | "generating"
    int n_past;               // positions the slot's session holds
} st_slot_info;

typedef struct st_sched_stats {
    int parallel, queue_depth, queue_limit, active, ctx;
    uint64_t cache_hits, cache_misses, cache_tokens; // requests reusing a prefix, not; tokens reused
    uint64_t prompt_tokens, generated_tokens;        // read / generated, all requests
    double prompt_tps, decode_tps;                   // the last finished request's
} st_sched_stats;
// slots: parallel entries, or NULL.
void st_sched_get_stats(st_sched *s, st_sched_stats *st, st_slot_info *slots);
bool st_sched_idle(st_sched *s);   // nothing queued or running

// ---- the APIs (api.c): requests to prompts, results to the OpenAI / Anthropic shapes.
typedef enum st_api { ST_API_CHAT, ST_API_COMPLETION, ST_API_ANTHROPIC } st_api;

// An error to answer with: HTTP status, OpenAI error type, the field at fault (or NULL).
typedef struct st_http_error {
    int status;
    const char *type;
    char param[96];
    char message[512];
} st_http_error;

// One parsed generation request.
typedef struct st_gen_request {
    st_api api;
    bool stream, include_usage, return_progress, json_mode;
    char *model_name;         // echoed back
    int32_t *ids;             // the prompt's tokens (malloc'd)
    int n_ids, turn;
    bool in_reasoning;        // the prompt opened <think>
    json_t *tools;            // OpenAI form, or NULL
    strata_generate_params gen;
    char **stop;              // gen.stop's storage
} st_gen_request;

// Parses and renders a request body. On failure fills err (4xx) and returns false.
bool st_api_parse(st_api api, const json_t *body, strata_model *m, const st_server_config *cfg,
                  st_gen_request *r, st_http_error *err);
void st_gen_request_free(st_gen_request *r);

// Builds responses as the job's updates arrive: SSE events when streaming, else one JSON body.
typedef struct st_api_writer st_api_writer;
st_status st_api_writer_create(const st_gen_request *r, st_api_writer **out);
void st_api_writer_free(st_api_writer *w);
// Turns an update into bytes to send (streaming: SSE events; otherwise nothing until done, then
// the whole JSON body). *out is malloc'd (NULL when nothing to send).
st_status st_api_writer_update(st_api_writer *w, const st_job_update *u, char **out, size_t *len);

// ---- the embedded web page (generated at build time from web/ by cmake/embed_web.cmake).
typedef struct st_web_asset {
    const char *path;         // "/index.html"
    const char *mime;
    const unsigned char *data;
    size_t len;
} st_web_asset;
extern const st_web_asset st_web_assets[];
extern const size_t st_web_n_assets;

// ---- machine numbers for /status (sys.c)
typedef struct st_sys_info {
    double cpu_percent;       // all cores, since the previous call (0 at the first)
    uint64_t ram_used, ram_total, rss;
} st_sys_info;
void st_sys_read(st_sys_info *out);
