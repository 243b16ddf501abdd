// strata.h: the engine's public C API. The CLI and the server include only this: an opaque
// model (a GGUF file bound to a backend), sessions (one sequence's state), and generation.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// 0 on success; otherwise an error whose message strata_error() returns (thread-local).
typedef int strata_status;
#define STRATA_OK 0
const char *strata_error(void);

typedef struct strata_model strata_model;
typedef struct strata_session strata_session;

typedef struct strata_model_params {
    const char *path;   // GGUF file (any shard of a split model)
    int n_threads;      // CPU threads; 0 = all cores
    // Where the model runs: NULL or "auto" (the first usable GPU when the model's dense weights
    // fit on it, the experts that do not fit staying in RAM; else the CPU, saying why), "cpu", or a GPU index ("0", "1", ...: that GPU or an error).
    // The environment variable STRATA_GPU gives the default when this is NULL.
    const char *gpu;
    int vram_reserve_mib;   // VRAM left free on the GPU; 0 = the default (STRATA_VRAM_RESERVE_MIB)
    // The hybrid expert cache (docs/HYBRID.md): the GPU holds the dense weights and the experts
    // routed to most; the CPU pool computes the rest from host memory.
    const char *expert_cache;   // NULL or "auto": as many experts as fit; "N": at most N ("0": none)
    const char *expert_profile; // routing counts (strata profile); NULL: MODEL.profile beside the
                                // GGUF when there is one, else all experts equally hot
    double vram_budget_gib;     // the GPU's size to plan for (a card of that size emulated): what
                                // is in use before Strata starts (CUDA context, other programs)
                                // and the reserve count against it; 0 = the whole card
    int n_ctx;                  // context the GPU memory is planned for; 0 = the model's, at most 8192
    int n_batch;                // prompt chunk rows planned for; 0 = the default: 2048 on a GPU
                                // that holds the whole model with room for them, else 512
    int n_seq;                  // sessions open at once planned for (server slots); 0 = 1
    double resident_gib;        // page-locked copies of the experts the GPU lacks, hottest layers
                                // first: 0 = none (read from the mapping), < 0 = all of them
    int pool_workers;           // CPU threads computing experts beside a GPU; 0 = cores - 1
    int adapt_every;            // windows between adaptive swaps; 0 = the default (32), < 0 = off
    int adapt_swaps;            // swaps at most per decision; 0 = the default (8)
    double adapt_decay;         // per-window decay of the routing scores; 0 = the default (0.95)
    // Share of a decode window's missed experts copied to the GPU and computed there, the rest on
    // the CPU pool (docs/HYBRID.md): 0 = what a probe of the link and the CPU at start picks,
    // < 0 = none (every miss on the CPU: windows stay CUDA graphs), (0, 1] = that share.
    double pcie_frac;
    // Read the file into memory (transparent huge pages where the kernel gives them) instead of
    // mapping it: the CPU streams the weights faster (fewer TLB misses), at the cost of reading
    // the whole file at start and holding a copy in RAM.
    bool no_mmap;
} strata_model_params;
#define STRATA_VRAM_RESERVE_MIB 384

typedef struct strata_model_info {
    const char *arch;   // "qwen3moe" / "qwen3next"
    int n_vocab, n_embd, n_layer, n_ctx_train, n_expert, n_expert_used;
    bool has_mtp;
    const char *backend;        // "cpu" or "cuda"
    int gpu;                    // the GPU's index, -1 on the CPU
    uint64_t file_bytes;        // the GGUF's size (all shards)
    uint64_t decode_bytes;      // weight bytes one decoded token reads (dense + k experts a layer + head)
    int n_batch;                // the prompt chunk a session gets when it asks for none
} strata_model_info;

strata_status strata_model_open(const strata_model_params *p, strata_model **out);
void strata_model_close(strata_model *m);
strata_model_info strata_model_get_info(const strata_model *m);

// The GPUs the model runs on (none on the CPU) and their memory now: returns how many were
// written (at most max). For monitors (the server's /status).
typedef struct strata_gpu_stats {
    int index;
    char name[256];
    uint64_t vram_used, vram_total;  // bytes, the whole card (all processes)
} strata_gpu_stats;
int strata_model_gpu_stats(const strata_model *m, strata_gpu_stats *out, int max);

typedef enum strata_kv_type { STRATA_KV_F16, STRATA_KV_Q8_0 } strata_kv_type;

typedef struct strata_session_params {
    int n_ctx;          // 0: the model's context, capped by available memory
    int n_batch;        // rows per forward call (prompt chunk); 0 = the model's (strata_model_info.n_batch)
    strata_kv_type kv_type;
    bool count_experts; // count routing on the GPU too (strata profile); costs a little per layer
} strata_session_params;

strata_status strata_session_open(strata_model *m, const strata_session_params *p, strata_session **out);
void strata_session_close(strata_session *s);
int strata_session_pos(const strata_session *s);
int strata_session_ctx(const strata_session *s);
// The tokens the session holds (its position's worth), oldest first; valid until the next call.
int strata_session_tokens(const strata_session *s, const int32_t **tokens);

// Feeds n tokens (in chunks of n_batch). logits: NULL, or (n, n_vocab) floats receiving every
// position's logits.
strata_status strata_session_eval(strata_session *s, const int32_t *tokens, int n, float *logits);
// The same, also writing each position's final hidden state to hidden: NULL, or (n, n_embd)
// floats (the vector the head reads, and the MTP layer's input).
strata_status strata_session_eval_hidden(strata_session *s, const int32_t *tokens, int n, float *logits,
                                         float *hidden);

// Feeds n tokens like strata_session_eval and writes the greedy next token (the argmax of the
// last position's logits; ties: the lowest id) to *best. On a GPU only the id leaves the device.
strata_status strata_session_eval_argmax(strata_session *s, const int32_t *tokens, int n, int32_t *best);

// Drafting with the model's MTP layer (strata_model_info.has_mtp). Row i takes hidden[i], the
// final hidden state of position t = pos + i (from strata_session_eval_hidden, or hidden_out of
// an earlier call when chaining drafts), and tokens[i], the token at t+1; it writes logits[i]
// (n_vocab floats), the draft for the token at t+2, and hidden_out[i] (n_embd floats), the next
// step's hidden when chaining; either may be NULL. The MTP layer keeps its own cache, a row per
// t: pos may be at most the end of the previous call (0 at first), and rows from pos on are
// replaced, so after a rejected draft one simply runs again from the accepted position.
strata_status strata_session_mtp_draft(strata_session *s, int pos, const float *hidden, const int32_t *tokens,
                                       int n, float *logits, float *hidden_out);

// Snapshots of a session (KV caches, recurrent state, MTP cache, token record): restoring one
// taken earlier rolls the session back to that position, exactly; the recurrent state cannot be
// truncated like a KV cache, so this is how speculative decoding and prompt reuse go back.
typedef struct strata_snapshot strata_snapshot;
strata_status strata_session_save(const strata_session *s, strata_snapshot **out);
// snap must come from a session of the same model and KV cache type, with room for its position.
strata_status strata_session_restore(strata_session *s, const strata_snapshot *snap);
void strata_snapshot_free(strata_snapshot *snap);

// The session's routing counts since it was opened: for each (layer, expert), how many times the
// router chose it (one per token and top-k choice); rows are the main layers then the MTP layer,
// row-major, (n_layer + MTP layers) * n_expert values. n is counts' capacity; an error when it
// is too small. These are what an expert profile holds (docs/EXPERT_PROFILE.md).
strata_status strata_session_expert_counts(strata_session *s, uint64_t *counts, size_t n);

// What the hybrid expert cache did for this session (all zero when every expert is on the GPU or
// the model runs on the CPU): routed (row, choice) pairs the GPU's cache held (hits) or not
// (misses), expert bytes streamed to the GPU for prompt chunks, adaptive swaps, seconds the CPU
// pool computed misses (in cpu_jobs layer calls: cpu_s / cpu_jobs is the cost of one), seconds
// the host then waited for the GPU's share (the GPU was the longer side), seconds streaming and
// computing prompt-chunk misses.
typedef struct strata_expert_stats {
    uint64_t hits, misses, streamed_bytes, swaps, cpu_jobs;
    double cpu_s, wait_s, stream_s;
    double gpu_wait_s;              // the GPU waiting for the CPU pool's answers (decode windows)
    int64_t cached, total;          // experts in the GPU's cache, experts in the model
    double pcie_frac;               // share of decode misses streamed to the GPU (--pcie-frac, or the probe's)
} strata_expert_stats;
strata_expert_stats strata_session_expert_stats(const strata_session *s);
// The same summed over every session of the model since it was opened (thread-safe: for
// monitors such as the server's /status and /metrics).
strata_expert_stats strata_model_expert_stats(strata_model *m);

// ---------------------------------------------------------------------------------------------
// Text: the model's tokenizer and chat template (from the GGUF).

// Tokenizes text; special: parse control tokens written in the text (<|im_start|>, ...), which
// only prompts built by a template should do. *ids is malloc'd (free() it).
strata_status strata_tokenize(const strata_model *m, const char *text, size_t len, bool special,
                              int32_t **ids, int *n);
// Decodes ids to bytes (control tokens written as text). *out is malloc'd, NUL-terminated.
strata_status strata_detokenize(const strata_model *m, const int32_t *ids, int n, char **out);
// Renders the model's chat template. messages_json: a JSON array of {role, content}; tools_json
// NULL or a JSON array of tools; thinking: -1 (template default), 0 or 1 (enable_thinking).
strata_status strata_chat_render(const strata_model *m, const char *messages_json, const char *tools_json,
                                 bool add_generation_prompt, int thinking, char **out);

// ---------------------------------------------------------------------------------------------
// Generation

typedef struct strata_sampling {
    float temperature;      // 0 = greedy
    int top_k;              // 0 = off
    float top_p;            // 1 = off
    float min_p;            // 0 = off
    float repeat_penalty;   // 1 = off (divides positive logits, multiplies negative ones)
    float presence_penalty; // subtracted once from each token in the window
    float frequency_penalty;// subtracted per occurrence in the window
    int penalty_last_n;     // window of recent tokens the penalties look at
    uint64_t seed;
} strata_sampling;
// Qwen3's recommended settings: temperature 0.7, top_k 20, top_p 0.8, min_p 0, no penalties.
strata_sampling strata_sampling_default(void);

// Called with each piece of text as it becomes final (always whole UTF-8 characters, never
// part of a stop string); return false to stop generating.
typedef bool (*strata_text_fn)(void *ctx, const char *text, size_t len);

typedef struct strata_generate_params {
    int max_tokens;              // <= 0: until end of generation or the context is full
    strata_sampling sampling;
    const char *const *stop;     // stop strings (not included in the output)
    int n_stop;
    // Constrained decoding: only tokens that keep the output a prefix of one JSON object
    // (RFC 8259; at most 64 nested containers and 20 whitespace bytes in a row outside strings)
    // may be chosen, and the generation ends with stop_reason "eog" as soon as the object is
    // complete. Sampling draws from the masked distribution; greedy then reads the logits on
    // the host.
    bool json_object;
} strata_generate_params;

typedef struct strata_generate_stats {
    int n_prompt, n_generated;
    double prompt_s, generate_s;
    const char *stop_reason;     // "eog", "stop", "length", "context", "callback"
} strata_generate_stats;

// Reads prompt[0..n) after what the session holds, then samples up to max_tokens tokens,
// streaming text through on_text.
strata_status strata_generate(strata_session *s, const int32_t *prompt, int n_prompt,
                              const strata_generate_params *p, strata_text_fn on_text, void *ctx,
                              strata_generate_stats *stats);

// ---------------------------------------------------------------------------------------------
// Step-wise generation (src/engine/step.c), for a caller that interleaves several sessions on one
// thread (the server): sessions of one model share its backend and CPU pool, so their forwards
// must never overlap; each call below does one bounded piece of work.

// One generation, advanced a step at a time: strata_generate's loop cut into steps.
typedef struct strata_step strata_step;

typedef struct strata_step_params {
    strata_generate_params gen;  // the stop strings are copied
    int prompt_chunk;            // prompt tokens per step; <= 0: the session's chunk (n_batch)
    int checkpoint;              // a prompt offset where a chunk ends, so the caller can save the
                                 // session there (strata_step_prompt_read() == checkpoint); 0: none
} strata_step_params;

// Starts reading prompt[0..n_prompt) after what the session holds (nothing runs yet). The
// penalties see the session's whole token record, as if the prompt had been read in one go.
strata_status strata_step_begin(strata_session *s, const int32_t *prompt, int n_prompt,
                                const strata_step_params *p, strata_step **out);
// Runs one step: the next prompt chunk, or one generated token (its final text goes through
// on_text, which returns false to stop). *done turns true when the generation ended; the stats
// are then complete (stop_reason "error" after a failed step). Calling again after done does
// nothing.
strata_status strata_step_next(strata_step *g, strata_text_fn on_text, void *ctx, bool *done);
// Prompt tokens read so far (of stats.n_prompt), for progress reports.
int strata_step_prompt_read(const strata_step *g);
void strata_step_stats(const strata_step *g, strata_generate_stats *stats);
void strata_step_free(strata_step *g);

// True for tokens that end a generation (end of text, end of turn).
bool strata_token_is_eog(const strata_model *m, int32_t token);

#ifdef __cplusplus
}
#endif
