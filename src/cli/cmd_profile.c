// cli: `strata profile` runs prompt files through the model and writes the routing counts per
// (layer, expert) as an expert profile (docs/EXPERT_PROFILE.md), the data the GPU expert cache
// starts from; it ends with how much of the routing a cache of the hottest experts would serve.

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "cli/cli.h"
#include "experts/experts.h"
#include "strata.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: strata profile -m MODEL.gguf -f PROMPTS [-f PROMPTS ...] [-o OUT] [options]\n\n"
            "Runs each prompt file (plain text) through the model from an empty context and counts how\n"
            "often the router chose each expert of each layer (the MTP layer too, when the model has\n"
            "one); the sums over all files are written as an expert profile, which the engine uses\n"
            "to choose the experts a GPU's cache starts with (docs/EXPERT_PROFILE.md). Use text like\n"
            "what the model will serve: the hot experts depend on it.\n\n"
            "  -m, --model FILE     GGUF model\n"
            "  -f, --file FILE      a prompt file (- for stdin); give -f several times for several\n"
            "  -o, --out FILE       the profile to write (default: the model's path with .gguf\n"
            "                       replaced by .profile, where the engine looks for it)\n"
            "  -c, --ctx N          tokens of each file that are used (default 4096; the rest is cut)\n"
            "  --batch N            rows per forward call (default 512)\n"
            "  --chat               wrap each file as one user message in the model's chat template\n"
            "  -t, --threads N      CPU threads (default: all cores)\n"
            ST_CLI_DEVICE_HELP);
}

// The model's path with .gguf replaced by .profile (appended when the name has no .gguf).
static char *default_out(const char *model) {
    size_t n = strlen(model), base = n > 5 && !strcmp(model + n - 5, ".gguf") ? n - 5 : n;
    char *out = malloc(base + sizeof ".profile");
    if (!out) return NULL;
    memcpy(out, model, base);
    strcpy(out + base, ".profile");
    return out;
}

// The output's folder must exist and be writable: said before the run, not after it.
static bool out_writable(const char *out) {
    struct stat sb;
    if (stat(out, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        fprintf(stderr, "strata profile: cannot write %s: it is a folder\n", out);
        return false;
    }
    char dir[4096];
    const char *slash = strrchr(out, '/');
    if (!slash) strcpy(dir, ".");
    else snprintf(dir, sizeof dir, "%.*s", slash == out ? 1 : (int)(slash - out), out);
    const char *why = NULL;
    if (stat(dir, &sb) != 0) why = strerror(errno);
    else if (!S_ISDIR(sb.st_mode)) why = "not a folder";
    else if (access(dir, W_OK) != 0) why = strerror(errno);
    if (why) {
        fprintf(stderr, "strata profile: cannot write %s: folder %s: %s\n", out, dir, why);
        return false;
    }
    return true;
}

// A chat prompt of one user message, rendered by the model's template (NULL on failure).
static char *chat_prompt(strata_model *m, const char *user) {
    json_t *msgs = json_pack("[{s:s,s:s}]", "role", "user", "content", user);
    char *js = msgs ? json_dumps(msgs, 0) : NULL, *out = NULL;
    json_decref(msgs);
    if (!js || strata_chat_render(m, js, NULL, true, -1, &out)) out = NULL;
    free(js);
    return out;
}

typedef struct prompt {
    const char *file;
    char *text;
    size_t len;
    int32_t *ids; // (n) tokens, cut to --ctx
    int n;
} prompt;

// Shares of the routing the hottest 10% / 25% / 50% of a layer's experts take, averaged over the
// main layers that saw any routing; returns how many did.
static const double fracs[3] = {0.10, 0.25, 0.50};
static int cache_shares(const uint64_t *counts, int n_layer, int E, double share[3]) {
    uint64_t *row = malloc(sizeof(uint64_t) * E);
    int used = 0;
    share[0] = share[1] = share[2] = 0;
    for (int l = 0; row && l < n_layer; l++) {
        uint64_t sum = 0;
        for (int e = 0; e < E; e++) sum += row[e] = counts[(size_t)l * E + e];
        if (!sum) continue;
        // Descending insertion sort: E is at most a few hundred and this runs once per layer.
        for (int i = 1; i < E; i++)
            for (int j = i; j > 0 && row[j] > row[j - 1]; j--) {
                uint64_t t = row[j];
                row[j] = row[j - 1];
                row[j - 1] = t;
            }
        for (int k = 0; k < 3; k++) {
            int top = (int)ceil(fracs[k] * E);
            uint64_t s = 0;
            for (int e = 0; e < top; e++) s += row[e];
            share[k] += (double)s / (double)sum;
        }
        used++;
    }
    free(row);
    for (int k = 0; used && k < 3; k++) share[k] /= used;
    return used;
}

static void progress(int64_t done, int64_t total, bool file_done) {
    if (isatty(2)) fprintf(stderr, "\rstrata profile: %lld/%lld tokens", (long long)done, (long long)total);
    else if (file_done) fprintf(stderr, "strata profile: %lld/%lld tokens\n", (long long)done, (long long)total);
}

// Runs one prompt through a fresh session and adds its routing counts to total. The MTP layer,
// when there is one, runs over the same positions as drafting would: position t with the
// token at t+1, so the last position has none.
static int run_prompt(strata_model *m, const strata_model_info *info, const prompt *pr, int batch, float *hidden,
                      uint64_t *cnt, uint64_t *total, size_t n_cells, int64_t *done, int64_t all) {
    strata_session *s;
    strata_session_params sp = {.n_ctx = pr->n, .n_batch = batch, .count_experts = true};
    if (strata_session_open(m, &sp, &s)) return 1;
    int rc = 1;
    for (int a = 0; a < pr->n; a += batch) {
        int rows = pr->n - a < batch ? pr->n - a : batch;
        if (strata_session_eval_hidden(s, pr->ids + a, rows, NULL, info->has_mtp ? hidden : NULL)) goto done;
        int mtp_rows = (a + rows < pr->n - 1 ? a + rows : pr->n - 1) - a;
        if (info->has_mtp && mtp_rows > 0 &&
            strata_session_mtp_draft(s, a, hidden, pr->ids + a + 1, mtp_rows, NULL, NULL))
            goto done;
        *done += rows;
        progress(*done, all, a + rows == pr->n);
    }
    if (strata_session_expert_counts(s, cnt, n_cells)) goto done;
    for (size_t i = 0; i < n_cells; i++) total[i] += cnt[i];
    rc = 0;
done:
    strata_session_close(s);
    return rc;
}

int st_cmd_profile(int argc, char **argv) {
    const char *model = NULL, *out_arg = NULL, *v;
    const char **files = calloc((size_t)argc, sizeof *files);
    int n_files = 0;
    int64_t ctx = 4096, batch = 512, threads = 0;
    bool bad = !files, chat = false;
    strata_model_params mp = {0};
    for (int i = 1; i < argc && !bad; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            free(files);
            return 0;
        } else if (st_cli_opt(argc, argv, &i, "-m", &model, &bad) || st_cli_opt(argc, argv, &i, "--model", &model, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "-f", &v, &bad) || st_cli_opt(argc, argv, &i, "--file", &v, &bad)) {
            if (!bad) files[n_files++] = v;
        } else if (st_cli_opt(argc, argv, &i, "-o", &out_arg, &bad) || st_cli_opt(argc, argv, &i, "--out", &out_arg, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "--ctx", &v, &bad)) {
            bad = bad || !st_cli_int("--ctx", v, 1, 1 << 24, &ctx);
        } else if (st_cli_opt(argc, argv, &i, "--batch", &v, &bad)) {
            bad = bad || !st_cli_int("--batch", v, 1, 65536, &batch);
        } else if (!strcmp(argv[i], "--chat")) {
            chat = true;
        } else if (st_cli_device_opt(argc, argv, &i, &mp, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "-t", &v, &bad) || st_cli_opt(argc, argv, &i, "--threads", &v, &bad)) {
            bad = bad || !st_cli_int("--threads", v, 1, 1024, &threads);
        } else {
            fprintf(stderr, "strata profile: unknown option '%s' (see strata profile --help)\n", argv[i]);
            free(files);
            return 2;
        }
    }
    int stdin_uses = 0;
    for (int i = 0; i < n_files; i++) stdin_uses += !strcmp(files[i], "-");
    if (!bad && (!model || !n_files || stdin_uses > 1)) {
        fprintf(stderr, "strata profile: %s (see strata profile --help)\n",
                !model ? "the model is missing: -m MODEL.gguf" : !n_files ? "no prompt file: give -f FILE (one or more)"
                                                               : "stdin (-f -) can be read only once");
        bad = true;
    }
    if (bad) {
        free(files);
        return 2;
    }

    int rc = 1;
    char *out = out_arg ? strdup(out_arg) : default_out(model);
    prompt *prompts = calloc((size_t)n_files, sizeof *prompts);
    strata_model *m = NULL;
    float *hidden = NULL;
    uint64_t *cnt = NULL, *total = NULL;
    if (!out || !prompts) {
        fprintf(stderr, "strata profile: out of memory\n");
        goto done;
    }
    if (!out_writable(out)) goto done;
    // Every file is read before the model is loaded, so a wrong name fails at once.
    for (int i = 0; i < n_files; i++) {
        prompts[i].file = strcmp(files[i], "-") ? files[i] : "stdin";
        st_status st = st_read_file(files[i], &prompts[i].text, &prompts[i].len);
        if (st) {
            rc = st_cli_fail(st);
            goto done;
        }
    }
    mp.path = model;
    mp.n_ctx = (int)ctx;
    mp.n_batch = (int)batch;
    mp.n_threads = (int)threads;
    if (strata_model_open(&mp, &m)) {
        fprintf(stderr, "strata: %s\n", strata_error());
        goto done;
    }
    strata_model_info info = strata_model_get_info(m);
    int n_rows = info.n_layer + (info.has_mtp ? 1 : 0), E = info.n_expert, k = info.n_expert_used;
    size_t n_cells = (size_t)n_rows * E;
    int64_t all = 0;
    for (int i = 0; i < n_files; i++) {
        prompt *pr = &prompts[i];
        char *rendered = chat ? chat_prompt(m, pr->text) : NULL;
        if (chat && !rendered) {
            fprintf(stderr, "strata profile: %s: cannot apply the chat template: %s\n", pr->file, strata_error());
            goto done;
        }
        const char *text = chat ? rendered : pr->text;
        size_t len = chat ? strlen(rendered) : pr->len;
        int fail = strata_tokenize(m, text, len, chat, &pr->ids, &pr->n);
        free(rendered);
        if (fail) {
            fprintf(stderr, "strata profile: %s: %s\n", pr->file, strata_error());
            goto done;
        }
        if (pr->n > ctx) {
            fprintf(stderr, "strata profile: %s: %d tokens; only the first %lld are used (--ctx)\n", pr->file, pr->n,
                    (long long)ctx);
            pr->n = (int)ctx;
        }
        if (pr->n == 0) fprintf(stderr, "strata profile: %s: no tokens, skipped\n", pr->file);
        all += pr->n;
    }
    if (all == 0) {
        fprintf(stderr, "strata profile: the prompt files hold no tokens\n");
        goto done;
    }
    hidden = info.has_mtp ? malloc(sizeof(float) * (size_t)batch * info.n_embd) : NULL;
    cnt = malloc(sizeof(uint64_t) * n_cells);
    total = calloc(n_cells, sizeof(uint64_t));
    if ((info.has_mtp && !hidden) || !cnt || !total) {
        fprintf(stderr, "strata profile: out of memory\n");
        goto done;
    }
    fprintf(stderr, "strata profile: %lld tokens from %d file%s through %s (%s)\n", (long long)all, n_files,
            n_files == 1 ? "" : "s", model, info.backend);
    double t0 = st_time_s();
    int64_t done_tokens = 0, mtp_positions = 0;
    for (int i = 0; i < n_files; i++) {
        if (!prompts[i].n) continue;
        if (run_prompt(m, &info, &prompts[i], (int)batch, hidden, cnt, total, n_cells, &done_tokens, all)) {
            if (isatty(2)) fputc('\n', stderr);
            fprintf(stderr, "strata: %s: %s\n", prompts[i].file, strata_error());
            goto done;
        }
        mtp_positions += prompts[i].n - 1;
    }
    double secs = st_time_s() - t0;
    if (isatty(2)) fputc('\n', stderr);

    // Each routed token adds one to k experts of every layer: the main rows must sum to tokens x k.
    uint64_t sum_all = 0;
    int off_rows = 0;
    for (int l = 0; l < n_rows; l++) {
        uint64_t sum = 0;
        for (int e = 0; e < E; e++) sum += total[(size_t)l * E + e];
        sum_all += sum;
        uint64_t want = (uint64_t)(l < info.n_layer ? all : mtp_positions) * (uint64_t)k;
        off_rows += sum != want;
    }
    if (sum_all == 0) {
        fprintf(stderr, "strata profile: no routing was counted (the %s backend did not report its expert choices); "
                "nothing written. Try --gpu cpu\n", info.backend);
        goto done;
    }
    if (off_rows)
        fprintf(stderr, "strata profile: warning: %d of %d rows do not sum to tokens x %d (some routing was not "
                "counted)\n", off_rows, n_rows, k);
    st_status st = st_profile_save(out, n_rows, E, total);
    if (st) {
        rc = st_cli_fail(st);
        goto done;
    }
    double share[3];
    int layers = cache_shares(total, info.n_layer, E, share);
    printf("profile: %s\n", out);
    printf("tokens: %lld from %d file%s in %.1f s (%.0f tokens/s)\n", (long long)all, n_files, n_files == 1 ? "" : "s",
           secs, secs > 0 ? all / secs : 0);
    printf("rows: %d (%d layers%s) x %d experts, %d chosen per token\n", n_rows, info.n_layer,
           info.has_mtp ? " + the MTP layer" : "", E, k);
    printf("share of the routing the hottest experts of a layer take (mean over %d layers), i.e. the hit rate of "
           "a cache of that size:\n", layers);
    for (int i = 0; i < 3; i++) {
        char what[64];
        snprintf(what, sizeof what, "%.0f%% (%d of %d):", fracs[i] * 100, (int)ceil(fracs[i] * E), E);
        printf("  %-20s %5.1f%%\n", what, share[i] * 100);
    }
    rc = 0;
done:
    for (int i = 0; prompts && i < n_files; i++) {
        free(prompts[i].text);
        free(prompts[i].ids);
    }
    free(prompts);
    free(hidden);
    free(cnt);
    free(total);
    free(out);
    free(files);
    strata_model_close(m);
    return rc;
}
