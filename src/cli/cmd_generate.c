// cli: `strata generate` (stream a continuation or a one-shot chat reply), `strata chat` (an
// interactive terminal chat with history), and `strata perplexity`.

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "cli/cli.h"
#include "strata.h"

// The embedded default model, looked up in the current folder, then beside the binary's
// repository (build/strata -> ../models/), so it is found from anywhere.
#define DEFAULT_MODEL "models/tiny-coder.gguf"

// Options shared by generate, chat and perplexity.
typedef struct gen_opts {
    const char *model, *prompt, *prompt_file, *system, *thinking;
    int64_t n_predict, ctx, batch, threads;
    const char *kv;
    strata_sampling sampling;
    const char *stop[16];
    int n_stop;
    bool chat;
    strata_model_params mp;     // --gpu, --vram-reserve-mib
} gen_opts;

static const char *common_help =
    "  -m, --model FILE       GGUF model (default " DEFAULT_MODEL ")\n"
    "  -t, --threads N        CPU threads (default: all cores)\n"
    "  -c, --ctx N            context size (default: the model's, capped by memory)\n"
    "  --batch N              prompt chunk size (default: 2048 on a GPU that holds the whole\n"
    "                         model, else 512)\n"
    "  --kv f16|q8_0          KV cache type (default f16)\n"
    ST_CLI_DEVICE_HELP;

static const char *sampling_help =
    "  --temp T               temperature (default 0.7; 0 = greedy)\n"
    "  --top-k N              keep the N most likely tokens (default 20; 0 = off)\n"
    "  --top-p P              nucleus sampling (default 0.8; 1 = off)\n"
    "  --min-p P              drop tokens below P x the most likely (default 0)\n"
    "  --repeat-penalty F     (default 1 = off)   --presence-penalty F   --frequency-penalty F\n"
    "  --repeat-last-n N      tokens the penalties look back over (default 64)\n"
    "  --seed N               random seed (default 0)\n"
    "  --stop TEXT            stop when TEXT is produced (repeatable, up to 16)\n";

// Each returns 1 when argv[*i] is the option (value parsed into dst), -1 for a bad value, and
// 0 when argv[*i] is another option.
static int opt_str(int argc, char **argv, int *i, const char *name, const char **dst) {
    bool bad = false;
    if (!st_cli_opt(argc, argv, i, name, dst, &bad)) return 0;
    return bad ? -1 : 1;
}

static int opt_int(int argc, char **argv, int *i, const char *name, int64_t lo, int64_t hi, int64_t *dst) {
    const char *v;
    int r = opt_str(argc, argv, i, name, &v);
    if (r == 1 && !st_cli_int(name, v, lo, hi, dst)) return -1;
    return r;
}

static int opt_int32(int argc, char **argv, int *i, const char *name, int64_t lo, int64_t hi, int *dst) {
    int64_t v;
    int r = opt_int(argc, argv, i, name, lo, hi, &v);
    if (r == 1) *dst = (int)v;
    return r;
}

static int opt_float(int argc, char **argv, int *i, const char *name, float *dst) {
    const char *v;
    double d;
    int r = opt_str(argc, argv, i, name, &v);
    if (r == 1 && !st_cli_float(name, v, &d)) return -1;
    if (r == 1) *dst = (float)d;
    return r;
}

// Parses one option into o: 1 consumed, 0 unknown, -1 a bad value (already reported).
static int parse_opt(int argc, char **argv, int *i, gen_opts *o) {
    strata_sampling *s = &o->sampling;
    const char *v;
    int r;
    bool bad = false;
    if (st_cli_device_opt(argc, argv, i, &o->mp, &bad)) return bad ? -1 : 1;
    if ((r = opt_str(argc, argv, i, "-m", &o->model)) || (r = opt_str(argc, argv, i, "--model", &o->model)) ||
        (r = opt_str(argc, argv, i, "--kv", &o->kv)) || (r = opt_str(argc, argv, i, "-p", &o->prompt)) ||
        (r = opt_str(argc, argv, i, "--prompt", &o->prompt)) || (r = opt_str(argc, argv, i, "-f", &o->prompt_file)) ||
        (r = opt_str(argc, argv, i, "--file", &o->prompt_file)) || (r = opt_str(argc, argv, i, "--system", &o->system)))
        return r;
    if ((r = opt_int(argc, argv, i, "-t", 1, 1024, &o->threads)) ||
        (r = opt_int(argc, argv, i, "--threads", 1, 1024, &o->threads)) ||
        (r = opt_int(argc, argv, i, "--ctx", 1, 1 << 24, &o->ctx)) ||
        (r = opt_int(argc, argv, i, "--batch", 1, 65536, &o->batch)) ||
        (r = opt_int(argc, argv, i, "-n", -1, 1 << 24, &o->n_predict)) ||
        (r = opt_int(argc, argv, i, "--n-predict", -1, 1 << 24, &o->n_predict)))
        return r;
    if ((r = opt_float(argc, argv, i, "--temp", &s->temperature)) ||
        (r = opt_float(argc, argv, i, "--top-p", &s->top_p)) ||
        (r = opt_float(argc, argv, i, "--min-p", &s->min_p)) ||
        (r = opt_float(argc, argv, i, "--repeat-penalty", &s->repeat_penalty)) ||
        (r = opt_float(argc, argv, i, "--presence-penalty", &s->presence_penalty)) ||
        (r = opt_float(argc, argv, i, "--frequency-penalty", &s->frequency_penalty)) ||
        (r = opt_int32(argc, argv, i, "--top-k", 0, 1 << 24, &s->top_k)) ||
        (r = opt_int32(argc, argv, i, "--repeat-last-n", 0, 1 << 24, &s->penalty_last_n)))
        return r;
    if ((r = opt_str(argc, argv, i, "--seed", &v))) {
        if (r < 0) return r;
        char *end;
        errno = 0;
        unsigned long long seed = strtoull(v, &end, 10);
        if (errno || *end || end == v || v[0] == '-') {
            fprintf(stderr, "strata: --seed: '%s' is not a non-negative integer\n", v);
            return -1;
        }
        s->seed = seed;
        return 1;
    }
    if ((r = opt_str(argc, argv, i, "--stop", &v))) {
        if (r < 0) return r;
        if (o->n_stop == 16) {
            fprintf(stderr, "strata: --stop: at most 16 stop strings\n");
            return -1;
        }
        o->stop[o->n_stop++] = v;
        return 1;
    }
    if ((r = opt_str(argc, argv, i, "--thinking", &o->thinking))) {
        if (r > 0 && strcmp(o->thinking, "on") && strcmp(o->thinking, "off")) {
            fprintf(stderr, "strata: --thinking: '%s' is not on or off\n", o->thinking);
            return -1;
        }
        return r;
    }
    if (!strcmp(argv[*i], "--chat")) return o->chat = true, 1;
    return 0;
}

static gen_opts opts_default(void) {
    return (gen_opts){.model = st_cli_default_model(), .n_predict = 256, .batch = 0, .kv = "f16",
                      .sampling = strata_sampling_default()};
}

// Opens model and session per the options; the context defaults to the model's (capped).
static int open_all(const gen_opts *o, int min_ctx, strata_model **m, strata_session **s) {
    *m = NULL, *s = NULL;
    if (strcmp(o->kv, "f16") && strcmp(o->kv, "q8_0")) {
        fprintf(stderr, "strata: --kv: '%s' is not f16 or q8_0\n", o->kv);
        return 2;
    }
    if (access(o->model, R_OK) != 0) {
        fprintf(stderr, "strata: model '%s': %s%s\n", o->model, strerror(errno),
                strstr(o->model, DEFAULT_MODEL) ? " (the embedded default model ships in the repository's models/: pass -m FILE)" : "");
        return 1;
    }
    strata_model_params mp = o->mp;
    mp.path = o->model;
    mp.n_threads = (int)o->threads;
    mp.n_ctx = (int)o->ctx;
    mp.n_batch = (int)o->batch;
    if (strata_model_open(&mp, m)) return st_cli_fail(ST_ERR_IO);
    int ctx = (int)o->ctx;
    if (ctx && ctx < min_ctx) ctx = min_ctx;
    strata_session_params sp = {.n_ctx = ctx, .n_batch = (int)o->batch,
                                .kv_type = strcmp(o->kv, "q8_0") ? STRATA_KV_F16 : STRATA_KV_Q8_0};
    if (strata_session_open(*m, &sp, s)) {
        strata_model_close(*m);
        *m = NULL;
        return st_cli_fail(ST_ERR_NOMEM);
    }
    return 0;
}

static volatile sig_atomic_t interrupted;
static void on_sigint(int sig) {
    (void)sig;
    interrupted = 1;
}

static bool print_text(void *ctx, const char *text, size_t len) {
    (void)ctx;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    return !interrupted;
}

// Writes to the FILE in ctx as well as the terminal (the chat keeps each reply).
static bool tee_text(void *ctx, const char *text, size_t len) {
    fwrite(text, 1, len, ctx);
    return print_text(NULL, text, len);
}

static void print_stats(const strata_generate_stats *st) {
    fprintf(stderr, "\nstrata: prompt %d tokens in %.2f s (%.1f tokens/s); generated %d tokens in %.2f s (%.1f tokens/s); stop: %s\n",
            st->n_prompt, st->prompt_s, st->prompt_s > 0 ? st->n_prompt / st->prompt_s : 0, st->n_generated,
            st->generate_s, st->generate_s > 0 ? st->n_generated / st->generate_s : 0, st->stop_reason);
}

// A chat prompt of one user message (and an optional system message), rendered by the template.
static char *chat_prompt(strata_model *m, const char *system, const char *user, int thinking) {
    json_t *msgs = json_array();
    if (system) json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "system", "content", system));
    json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "user", "content", user));
    char *js = json_dumps(msgs, 0), *out = NULL;
    json_decref(msgs);
    if (!js || strata_chat_render(m, js, NULL, true, thinking, &out)) out = NULL;
    free(js);
    return out;
}

int st_cmd_generate(int argc, char **argv) {
    gen_opts o = opts_default();
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("usage: strata generate [-m FILE] (-p TEXT | -f FILE) [-n N] [--chat] [options]\n\n"
                   "Streams a continuation of the prompt to stdout; speeds go to stderr at the end.\n\n"
                   "  -p, --prompt TEXT      the prompt\n"
                   "  -f, --file FILE        read the prompt from FILE (- for stdin)\n"
                   "  -n, --n-predict N      tokens to generate (default 256; -1 = until the end)\n"
                   "  --chat                 treat the prompt as a user message and apply the chat template\n"
                   "  --system TEXT          a system message (with --chat)\n"
                   "  --thinking on|off      enable_thinking for templates that have it (with --chat)\n"
                   "%s%s", common_help, sampling_help);
            return 0;
        }
        int r = parse_opt(argc, argv, &i, &o);
        if (r < 0) return 2;
        if (r == 0) {
            fprintf(stderr, "strata generate: unknown option '%s' (see strata generate --help)\n", argv[i]);
            return 2;
        }
    }
    if (!o.prompt == !o.prompt_file) {
        fprintf(stderr, "strata generate: give the prompt with -p TEXT or -f FILE (one of them)\n");
        return 2;
    }
    char *file_text = NULL;
    size_t file_len = 0;
    if (o.prompt_file) {
        st_status s = st_read_file(o.prompt_file, &file_text, &file_len);
        if (s) return st_cli_fail(s);
    }
    const char *text = o.prompt ? o.prompt : file_text;
    if (!*text) {
        fprintf(stderr, "strata generate: the prompt is empty\n");
        free(file_text);
        return 2;
    }
    strata_model *m;
    strata_session *s;
    int rc = open_all(&o, 0, &m, &s);
    if (rc) {
        free(file_text);
        return rc;
    }
    char *rendered = NULL;
    int32_t *ids = NULL;
    int n = 0;
    int thinking = o.thinking ? !strcmp(o.thinking, "on") : -1;
    if (o.chat && !(rendered = chat_prompt(m, o.system, text, thinking))) rc = st_cli_fail(ST_ERR_FORMAT);
    if (!rc && strata_tokenize(m, o.chat ? rendered : text, strlen(o.chat ? rendered : text), o.chat, &ids, &n))
        rc = st_cli_fail(ST_ERR_FORMAT);
    if (!rc) {
        strata_generate_params gp = {.max_tokens = (int)o.n_predict, .sampling = o.sampling,
                                     .stop = o.stop, .n_stop = o.n_stop};
        strata_generate_stats st;
        signal(SIGINT, on_sigint);
        if (strata_generate(s, ids, n, &gp, print_text, NULL, &st)) rc = st_cli_fail(ST_ERR_IO);
        else print_stats(&st);
    }
    free(ids);
    free(rendered);
    free(file_text);
    strata_session_close(s);
    strata_model_close(m);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// chat

int st_cmd_chat(int argc, char **argv) {
    gen_opts o = opts_default();
    o.n_predict = -1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("usage: strata chat [-m FILE] [options]\n\n"
                   "An interactive chat in the terminal, with the model's chat template and the whole\n"
                   "conversation as context. Ctrl-C stops a reply; Ctrl-D or /exit quits; /reset\n"
                   "starts a new conversation.\n\n"
                   "  --system TEXT          a system message\n"
                   "  --thinking on|off      enable_thinking for templates that have it\n"
                   "  -n, --n-predict N      most tokens per reply (default: until the end of the turn)\n"
                   "%s%s", common_help, sampling_help);
            return 0;
        }
        int r = parse_opt(argc, argv, &i, &o);
        if (r < 0) return 2;
        if (r == 0) {
            fprintf(stderr, "strata chat: unknown option '%s' (see strata chat --help)\n", argv[i]);
            return 2;
        }
    }
    strata_model *m;
    strata_session *s;
    int rc = open_all(&o, 0, &m, &s);
    if (rc) return rc;
    struct sigaction sa = {.sa_handler = on_sigint}; // no SA_RESTART: Ctrl-C interrupts a read
    sigaction(SIGINT, &sa, NULL);
    int thinking = o.thinking ? !strcmp(o.thinking, "on") : -1;
    json_t *msgs = json_array();
    if (o.system) json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "system", "content", o.system));
    bool tty = isatty(0);
    char line[65536];
    strata_model_info info = strata_model_get_info(m);
    fprintf(stderr, "strata chat: %s (%s), context %d; Ctrl-C stops a reply, Ctrl-D quits\n", o.model,
            info.arch, strata_session_ctx(s));
    for (;;) {
        if (tty) fprintf(stdout, "\n> "), fflush(stdout);
        interrupted = 0;
        if (!fgets(line, sizeof line, stdin)) {
            if (interrupted && !feof(stdin)) { // Ctrl-C at the prompt: a fresh line
                clearerr(stdin);
                continue;
            }
            break;
        }
        line[strcspn(line, "\n")] = 0;
        if (!strcmp(line, "/exit") || !strcmp(line, "/quit")) break;
        if (!strcmp(line, "/reset")) {
            json_array_clear(msgs);
            if (o.system) json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "system", "content", o.system));
            fprintf(stderr, "(new conversation)\n");
            continue;
        }
        if (!line[0]) continue;
        json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "user", "content", line));
        char *js = json_dumps(msgs, 0), *prompt = NULL;
        int32_t *ids = NULL;
        int n = 0;
        if (!js || strata_chat_render(m, js, NULL, true, thinking, &prompt) ||
            strata_tokenize(m, prompt, strlen(prompt), true, &ids, &n)) {
            st_cli_fail(ST_ERR_FORMAT);
            free(js), free(prompt), free(ids);
            json_array_remove(msgs, json_array_size(msgs) - 1);
            continue;
        }
        free(js), free(prompt);
        // Reuse the session when it holds a prefix of the new prompt (the usual case: the
        // previous turns); otherwise start it over.
        const int32_t *held;
        int n_held = strata_session_tokens(s, &held), common = 0;
        while (common < n_held && common < n && held[common] == ids[common]) common++;
        if (common < n_held || common == n) {
            strata_session_params sp = {.n_ctx = strata_session_ctx(s), .n_batch = (int)o.batch,
                                        .kv_type = strcmp(o.kv, "q8_0") ? STRATA_KV_F16 : STRATA_KV_Q8_0};
            strata_session_close(s);
            if (strata_session_open(m, &sp, &s)) {
                rc = st_cli_fail(ST_ERR_NOMEM);
                free(ids);
                break;
            }
            common = 0;
        }
        // Print the reply as it comes and keep it for the history.
        char *reply = NULL;
        size_t rlen = 0;
        FILE *rf = open_memstream(&reply, &rlen);
        strata_generate_params gp = {.max_tokens = (int)o.n_predict, .sampling = o.sampling,
                                     .stop = o.stop, .n_stop = o.n_stop};
        strata_generate_stats st;
        if (!rf || strata_generate(s, ids + common, n - common, &gp, tee_text, rf, &st)) {
            st_cli_fail(ST_ERR_IO);
            memset(&st, 0, sizeof st);
        }
        if (rf) fclose(rf);
        free(ids);
        fprintf(stderr, "\n[%d tokens, %.1f tokens/s%s]\n", st.n_generated,
                st.generate_s > 0 ? st.n_generated / st.generate_s : 0, interrupted ? ", stopped" : "");
        json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "assistant", "content", reply ? reply : ""));
        free(reply);
    }
    json_decref(msgs);
    strata_session_close(s);
    strata_model_close(m);
    return rc;
}
