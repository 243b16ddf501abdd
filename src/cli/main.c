// cli: the strata program's entry point: finds the subcommand and runs it.

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>

#include "backend/backend.h"
#include "cli/cli.h"

typedef struct cmd {
    const char *name;
    st_cmd_fn fn;
    const char *summary;
} cmd;

static const cmd cmds[] = {
    {"inspect", st_cmd_inspect, "show a GGUF file's metadata, tokenizer and tensors"},
    {"tensor", st_cmd_tensor, "write one tensor dequantized to float32"},
    {"generate", st_cmd_generate, "stream a continuation of a prompt (or a chat reply with --chat)"},
    {"chat", st_cmd_chat, "interactive chat in the terminal"},
    {"perplexity", st_cmd_perplexity, "perplexity of a text file"},
    {"eval", st_cmd_eval, "write every position's logits for a token sequence"},
    {"profile", st_cmd_profile, "count the experts the router picks over prompt files (an expert profile)"},
    {"devices", st_cmd_devices, "list the GPUs and whether Strata can use them"},
    {"bench", st_cmd_bench, "benchmarks (bench kernels, ...)"},
    {"tokenize", st_cmd_tokenize, "text to token ids (GGUF or tokenizer.json)"},
    {"detokenize", st_cmd_detokenize, "token ids to text"},
    {"template", st_cmd_template, "render a chat template with messages and tools"},
    {"quantize", st_cmd_quantize, "rewrite a GGUF with its weights in another type (q4_K, q8_0, ...)"},
    {"serve", st_cmd_serve, "serve the model over HTTP (OpenAI and Anthropic APIs, web page)"},
};
#define N_CMDS (int)(sizeof cmds / sizeof cmds[0])

static void usage(FILE *f) {
    fprintf(f, "strata - run large Mixture-of-Experts models on ordinary PCs\n\n"
               "usage: strata <command> [options]\n\ncommands:\n");
    for (int i = 0; i < N_CMDS; i++) fprintf(f, "  %-12s %s\n", cmds[i].name, cmds[i].summary);
    fprintf(f, "  %-12s %s\n", "version", "the release, the commit and the backends this build has");
    fprintf(f, "  %-12s %s\n", "help", "this list, or `strata help <command>`");
    fprintf(f, "\n`strata <command> --help` describes a command's options.\n");
}

// `strata version`: what a bug report needs to name the build.
static int version(void) {
    printf("strata %s (commit %s)\n", st_build_version, st_build_commit);
    if (st_cuda_available())
        printf("CUDA backend: built for %s; `strata devices` lists the GPUs\n", st_build_cuda_archs);
    else
        printf("CUDA backend: not built (%s); the CPU backend runs everything\n",
               st_build_no_cuda_why[0] ? st_build_no_cuda_why : "no CUDA compiler was found");
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *name = argv[1];
    if (!strcmp(name, "help") || !strcmp(name, "--help") || !strcmp(name, "-h")) {
        if (argc >= 3 && strcmp(name, "help") == 0) {
            for (int i = 0; i < N_CMDS; i++)
                if (!strcmp(cmds[i].name, argv[2])) {
                    char *hargv[] = {argv[2], "--help", NULL};
                    return cmds[i].fn(2, hargv);
                }
            fprintf(stderr, "strata: unknown command '%s'\n", argv[2]);
            return 2;
        }
        usage(stdout);
        return 0;
    }
    if (!strcmp(name, "version") || !strcmp(name, "--version") || !strcmp(name, "-V")) return version();
    for (int i = 0; i < N_CMDS; i++)
        if (!strcmp(cmds[i].name, name)) return cmds[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "strata: unknown command '%s' (see `strata help`)\n", name);
    return 2;
}

// ---------------------------------------------------------------------------------------------
// Helpers shared by the subcommands.

int st_cli_fail(st_status s) {
    fprintf(stderr, "strata: %s\n", st_error()[0] ? st_error() : st_status_name(s));
    return 1;
}

// Other spellings of a flag, for users coming from llama.cpp (-c, --ctx-size).
static const char *const cli_aliases[][3] = {{"--ctx", "--ctx-size", "-c"}};

static bool cli_flag_is(const char *arg, const char *name) {
    if (!strcmp(arg, name)) return true;
    for (size_t k = 0; k < sizeof cli_aliases / sizeof cli_aliases[0]; k++)
        if (!strcmp(cli_aliases[k][0], name) && (!strcmp(arg, cli_aliases[k][1]) || !strcmp(arg, cli_aliases[k][2])))
            return true;
    return false;
}

bool st_cli_opt(int argc, char **argv, int *i, const char *name, const char **value, bool *bad) {
    if (!cli_flag_is(argv[*i], name)) return false;
    if (*i + 1 >= argc) {
        fprintf(stderr, "strata %s: %s needs a value\n", argv[0], argv[*i]);
        *bad = true;
        *value = NULL;
        return true;
    }
    *value = argv[++*i];
    return true;
}

bool st_cli_int(const char *flag, const char *text, int64_t lo, int64_t hi, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (errno || end == text || *end || v < lo || v > hi) {
        fprintf(stderr, "strata: %s: '%s' is not an integer in [%lld, %lld]\n", flag, text,
                (long long)lo, (long long)hi);
        return false;
    }
    *out = v;
    return true;
}

bool st_cli_float(const char *flag, const char *text, double *out) {
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (errno || end == text || *end) {
        fprintf(stderr, "strata: %s: '%s' is not a number\n", flag, text);
        return false;
    }
    *out = v;
    return true;
}

const char *st_cli_default_model(void) {
    static const char rel[] = "models/tiny-coder.gguf";
    static char path[4096];
    if (access(rel, R_OK) == 0) return rel;
    char exe[4000];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return rel;
    exe[n] = 0;
    char *slash = strrchr(exe, '/');
    if (!slash) return rel;
    *slash = 0;
    snprintf(path, sizeof path, "%s/../%s", exe, rel);
    return access(path, R_OK) == 0 ? path : rel;
}
