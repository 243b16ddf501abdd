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
} strata_model_params;

typedef struct strata_model_info {
    const char *arch;   // "qwen3moe" / "qwen3next"
    int n_vocab, n_embd, n_layer, n_ctx_train, n_expert, n_expert_used;
    bool has_mtp;
    uint64_t file_bytes;        // the GGUF's size (all shards)
    uint64_t decode_bytes;      // weight bytes one decoded token reads (dense + k experts a layer + head)
} strata_model_info;

strata_status strata_model_open(const strata_model_params *p, strata_model **out);
void strata_model_close(strata_model *m);
strata_model_info strata_model_get_info(const strata_model *m);

typedef enum strata_kv_type { STRATA_KV_F16, STRATA_KV_Q8_0 } strata_kv_type;

typedef struct strata_session_params {
    int n_ctx;          // 0: the model's context, capped by available memory
    int n_batch;        // rows per forward call (prompt chunk); 0 = 512
    strata_kv_type kv_type;
} strata_session_params;

strata_status strata_session_open(strata_model *m, const strata_session_params *p, strata_session **out);
void strata_session_close(strata_session *s);
int strata_session_pos(const strata_session *s);
int strata_session_ctx(const strata_session *s);

// Feeds n tokens (in chunks of n_batch). logits: NULL, or (n, n_vocab) floats receiving every
// position's logits.
strata_status strata_session_eval(strata_session *s, const int32_t *tokens, int n, float *logits);

#ifdef __cplusplus
}
#endif
