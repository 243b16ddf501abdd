// cli: the strata command-line program. One file per subcommand; main.c dispatches.
#pragma once

#include <stdbool.h>
#include <stdint.h>
#include "util/util.h"

// Every subcommand: argv[0] is the subcommand name. Returns the process exit code
// (0 ok, 1 failure with a message already printed, 2 usage error).
typedef int (*st_cmd_fn)(int argc, char **argv);

int st_cmd_inspect(int argc, char **argv);
int st_cmd_tensor(int argc, char **argv);
int st_cmd_bench(int argc, char **argv);
int st_cmd_eval(int argc, char **argv);
int st_cmd_generate(int argc, char **argv);   // cmd_generate.c
int st_cmd_chat(int argc, char **argv);       // cmd_generate.c (shares generate's options)
int st_cmd_perplexity(int argc, char **argv);
int st_cmd_profile(int argc, char **argv);    // cmd_profile.c
int st_bench_model(int argc, char **argv);     // bench_model.c: `strata bench -m FILE`
// Shared by the benchmarks (cmd_bench.c): memory-read GB/s with n threads (a streaming sum over
// a buffer far larger than the caches), and the commit the binary was built from.
double st_bench_read_gbs(int n_threads);
void st_bench_commit(char *buf, size_t size);
extern const char st_build_commit[]; // written at build time by cmake/build_commit.cmake
extern const char st_build_version[];     // the release (CMakeLists.txt writes build_info.c)
extern const char st_build_cuda_archs[];  // e.g. "sm_75, sm_86, sm_90"; empty without CUDA
extern const char st_build_no_cuda_why[]; // why there is no CUDA backend; empty with one
int st_cmd_tokenize(int argc, char **argv);   // cmd_tokenize.c
int st_cmd_detokenize(int argc, char **argv); // cmd_tokenize.c
int st_cmd_template(int argc, char **argv);   // cmd_template.c
int st_cmd_quantize(int argc, char **argv);   // cmd_quantize.c
int st_cmd_serve(int argc, char **argv);      // cmd_serve.c
int st_bench_tokenizer(int argc, char **argv); // bench_tokenizer.c: `strata bench tokenizer`
// Loads a tokenizer from a GGUF (gguf_path) or a tokenizer.json (json_path, if not NULL).
typedef struct st_tokenizer st_tokenizer;
st_status st_cli_load_tokenizer(const char *gguf_path, const char *json_path, st_tokenizer **out);

// `strata devices`, and the device flags of the subcommands that run a model (cmd_devices.c):
// --gpu auto|cpu|N and --vram-reserve-mib N into mp; true when argv[*i] was one of them.
int st_cmd_devices(int argc, char **argv);
typedef struct strata_model_params strata_model_params;
bool st_cli_device_opt(int argc, char **argv, int *i, strata_model_params *mp, bool *bad);
#define ST_CLI_DEVICE_HELP                                                                     \
    "  --gpu auto|cpu|N       where the model runs (default auto: the first usable GPU when\n" \
    "                         its dense weights fit, else the CPU; env STRATA_GPU)\n"          \
    "  --vram-reserve-mib N   VRAM to leave free on the GPU (default 384)\n"                   \
    "  --vram-budget-gib G    plan for a GPU of G GiB: what is already in use on the card\n" \
    "                         counts against it (default: the whole card)\n"                \
    "  --expert-cache auto|N  experts kept on the GPU (default auto: as many as fit)\n"      \
    "  --expert-profile FILE  routing counts choosing them (default MODEL.profile if any)\n" \
    "  --resident-experts     page-locked copies of the experts the GPU lacks (faster to\n"  \
    "                         stream; default: read them from the file's mapping)\n"        \
    "  --resident-budget-gib G  only G GiB of such copies, busiest layers first\n"           \
    "  --mmap-experts         no copies: the mapping only (the default)\n"                   \
    "  --pool-workers N       CPU threads computing experts beside the GPU (default physical cores-1)\n" \
    "  --adapt-every N        windows between expert cache swaps (default 32; 0 = off)\n"     \
    "  --adapt-swaps K        swaps at most each time (default 8)\n"                         \
    "  --adapt-decay F        per-window decay of the routing counts (default 0.95)\n"      \
    "  --pcie-frac F          share (0..1) of a decode window's missed experts copied to the\n" \
    "                         GPU and computed there, the rest on the CPU (default: a probe\n" \
    "                         of the link and the CPU at start picks; 0 = all on the CPU)\n" \
    "  --no-mmap              read the model into memory (huge pages) instead of mapping it:\n" \
    "                         the CPU streams weights faster; slower start, a copy in RAM\n"

// Prints "strata: <message>" for a failed status and returns exit code 1.
int st_cli_fail(st_status s);
// "--flag" matching helpers: true when argv[*i] is `name` (or one of its other spellings:
// --ctx also answers to --ctx-size and -c); then *value is the next argument (a missing value
// prints a usage error and sets *bad).
bool st_cli_opt(int argc, char **argv, int *i, const char *name, const char **value, bool *bad);
// Parses an integer / float argument, printing a clear error naming the flag when malformed.
bool st_cli_int(const char *flag, const char *text, int64_t lo, int64_t hi, int64_t *out);
bool st_cli_float(const char *flag, const char *text, double *out);
// The embedded default model (models/tiny-coder.gguf), looked up in the current folder, then
// beside the binary's repository (build/strata -> ../models/).
const char *st_cli_default_model(void);
