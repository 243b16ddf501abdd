// model: hyper-parameters and weights of the two architectures (qwen3moe, qwen3next), bound as
// views into the GGUF mapping, the per-sequence state (KV cache, DeltaNet conv and delta-rule
// state), and the forward over a batch of rows written once over the backend ops.
#pragma once

#include <stdbool.h>
#include <stdint.h>
#include "backend/backend.h"
#include "experts/experts.h"
#include "gguf/gguf.h"
#include "util/util.h"

typedef enum st_arch { ST_ARCH_QWEN3MOE, ST_ARCH_QWEN3NEXT } st_arch;

typedef struct st_hparams {
    st_arch arch;
    int n_vocab, n_embd, n_layer, n_ctx_train;
    int n_head, n_head_kv, head_dim;  // attention: query heads, kv heads, head size
    int n_rot;                        // rotary dims per head (NeoX pairs i, i + n_rot/2)
    float rope_base, eps;
    int n_expert, n_expert_used, n_ff_exp, n_ff_shexp; // n_ff_shexp 0: no shared expert
    // qwen3next Gated DeltaNet
    int ssm_kernel;   // conv taps K
    int ssm_d;        // head size d (key = value head size)
    int ssm_h_k;      // key heads
    int ssm_h_v;      // value heads
    int full_attn_interval;
    int n_mtp;        // MTP layers in the file (0 or 1)
} st_hparams;

// One decoder layer's weights (views into the mapping; small vectors are f32 copies).
typedef struct st_layer {
    bool recurrent;                   // Gated DeltaNet mixer (qwen3next), else attention
    float *attn_norm, *ffn_norm;      // (n_embd)
    // attention
    st_mat wq;                        // (n_head * head_dim [* 2 with the qwen3next gate], n_embd)
    st_mat wk, wv;                    // (n_head_kv * head_dim, n_embd)
    st_mat wo;                        // (n_embd, n_head * head_dim)
    float *q_norm, *k_norm;           // (head_dim)
    // Gated DeltaNet
    st_mat wqkv;                      // (2 * h_k * d + h_v * d, n_embd)
    st_mat wz;                        // (h_v * d, n_embd) output gate
    st_mat w_ssm_in;                  // legacy fused input (2 h_k d + 2 h_v d, n_embd); rows 0 if absent
    st_mat wba;                       // (2 * h_v, n_embd), grouped per key head [b(r), a(r)]
    st_mat wout;                      // (n_embd, h_v * d)
    float *conv;                      // (conv_dim, K)
    float *dt_bias, *ssm_a;           // (h_v)
    float *ssm_norm;                  // (d)
    // MoE
    st_mat router;                    // (n_expert, n_embd)
    st_mat3 gate_exps, up_exps;       // n_expert x (n_ff_exp, n_embd)
    st_mat3 down_exps;                // n_expert x (n_embd, n_ff_exp)
    st_mat sh_gate, sh_up, sh_down;   // shared expert (rows 0 if absent)
    float *sh_gate_inp;               // (n_embd) scalar sigmoid gate of the shared expert
    // MTP layer only
    float *mtp_enorm, *mtp_hnorm, *mtp_head_norm; // (n_embd)
    st_mat mtp_eh;                    // (n_embd, 2 * n_embd), input [embedding, hidden]
} st_layer;

typedef struct st_model {
    st_hparams hp;
    const st_gguf *gguf;
    st_mat tok_embd;                  // (n_vocab, n_embd)
    float *output_norm;               // (n_embd)
    st_mat output;                    // (n_vocab, n_embd)
    st_layer *layers;                 // (n_layer + n_mtp)
    st_placement *placement;
    st_expert_cache *cache;           // the device's routed experts (NULL on the CPU)
    st_expert_arena *arena;           // where the CPU reads the experts the device lacks
    st_adapt *adapt;                  // adaptive swaps (NULL: off)
    st_backend *placed;               // the backend holding the weights (NULL: the mapping)
    void **dev;                       // (n_dev) its copies, freed with the model
    int n_dev;
} st_model;

// Binds a model to an open GGUF (which must outlive it). Every tensor is checked for presence,
// type and shape; a problem names the tensor and the expected shape.
st_status st_model_load(const st_gguf *g, st_model **out);
void st_model_free(st_model *m);
// Puts the weights into b's memory: nothing to do on the CPU (the mapping is used in place); on
// a GPU, every dense tensor is copied once after checking it fits, and the routed experts fill
// the device's expert cache as far as pp allows (hottest first by the profile); the others stay
// in host memory for the CPU pool. A model placed on a GPU runs only with states of that backend.
typedef struct st_place_params {
    int64_t expert_slots;     // experts the device's cache may hold; -1 = as many as fit
    size_t vram_budget;       // bytes of device memory to use in all; 0 = what is free
    size_t keep_bytes;        // bytes to leave for the KV cache, activations and scratch
    const uint64_t *profile;  // (n_layer + n_mtp, n_expert) routing counts; NULL = all equal
    size_t resident_bytes;    // page-locked copies of the experts the device lacks; 0 = the mapping
    int adapt_every, adapt_swaps; // adaptive swaps (every 0: off)
    double adapt_decay;
    double pcie_frac;         // share of decode misses streamed to the device; < 0: a probe picks
} st_place_params;
st_status st_model_place(st_model *m, st_backend *b, const st_place_params *pp);
const char *st_arch_name(st_arch a);

// ---------------------------------------------------------------------------------------------
// Per-sequence state and the forward.

typedef struct st_state st_state;

typedef struct st_state_params {
    int n_ctx;            // positions the KV cache holds
    int n_batch;          // largest number of rows one forward call takes
    st_kv_type kv_type;
    bool count_experts;   // count routing on the device too (profiles); the CPU always counts
} st_state_params;

// Device memory n_seq states with these parameters take (KV cache, recurrent state,
// activations, expert staging) with the backend's work buffers, for planning before the model
// is placed.
size_t st_state_plan_bytes(const st_model *m, const st_state_params *p, int n_seq);

st_status st_state_create(const st_model *m, st_backend *b, const st_state_params *p, st_state **out);
void st_state_free(st_state *s);
int st_state_pos(const st_state *s);      // tokens consumed so far
int st_state_mtp_pos(const st_state *s);  // rows in the MTP layer's KV cache
size_t st_state_bytes(const st_state *s); // memory held (caches + buffers)
// Routing counts since the state was created: (n_layer + n_mtp, n_expert).
const uint64_t *st_state_expert_counts(st_state *s);
st_experts_stats st_state_expert_stats(const st_state *s);

// Snapshots: the KV rows up to the position and the recurrent state, restorable later.
typedef struct st_snapshot st_snapshot;
st_status st_state_save(const st_state *s, st_snapshot **out);
st_status st_state_restore(st_state *s, const st_snapshot *snap);
void st_snapshot_free(st_snapshot *snap);

// Runs tokens[0..n) at positions pos .. pos+n-1 (n <= n_batch), advancing the state.
// logits: NULL, or (n, n_vocab) host floats for every row (want_all) or (1, n_vocab) for the
// last row only. hidden: NULL or (n, n_embd) host floats, the final-normed hidden states (what
// the head and the MTP layer read).
// argmax: NULL, or host ids receiving each row's greedy token (the rows logits would cover);
// with logits NULL the logits never leave the backend (a GPU sends only the ids).
typedef struct st_forward_out {
    float *logits;
    bool want_all;
    float *hidden;
    int32_t *argmax;
} st_forward_out;
st_status st_model_forward(const st_model *m, st_state *s, const int32_t *tokens, int n,
                           const st_forward_out *out);

// The MTP layer (REFERENCE.md §3.3) on n rows: row i takes hidden[i] (n_embd host floats), the
// final-normed hidden state of position t = pos + i (from st_model_forward, or out->hidden of an
// earlier MTP step when chaining drafts), and tokens[i], the token at t+1; it runs the MTP
// decoder layer at position t+1 and writes out->logits, the draft logits for the token at t+2,
// and out->hidden, the MTP output after shared_head_norm (the next step's input when chaining).
// The MTP KV cache keeps a row per t: pos may be at most st_state_mtp_pos (rows from pos on are
// overwritten, so re-running from an accepted position needs no rollback), and becomes pos + n.
st_status st_model_mtp(const st_model *m, st_state *s, int pos, const float *hidden, const int32_t *tokens,
                       int n, const st_forward_out *out);
