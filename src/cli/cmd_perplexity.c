// cli: `strata perplexity`: exp(mean negative log-likelihood) of a text file, read in windows
// of --ctx tokens, each from an empty context; every token after the first of a window counts.

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "strata.h"

static void usage(FILE *f) {
    fprintf(f, "usage: strata perplexity -m FILE -f TEXT [--ctx N] [--batch N] [-t N]\n\n"
               "Splits the text's tokens into windows of N (default 512), runs each from an empty\n"
               "context and scores every token after the window's first: perplexity =\n"
               "exp(mean of -log p(token | the tokens before it in its window)).\n\n"
               ST_CLI_DEVICE_HELP);
}

int st_cmd_perplexity(int argc, char **argv) {
    const char *model = NULL, *file = NULL, *v;
    int64_t ctx = 512, batch = 512, threads = 0;
    bool bad = false;
    strata_model_params mp = {0};
    for (int i = 1; i < argc && !bad; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else if (st_cli_opt(argc, argv, &i, "-m", &model, &bad) || st_cli_opt(argc, argv, &i, "--model", &model, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "-f", &file, &bad) || st_cli_opt(argc, argv, &i, "--file", &file, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "--ctx", &v, &bad)) {
            bad = bad || !st_cli_int("--ctx", v, 2, 1 << 24, &ctx);
        } else if (st_cli_opt(argc, argv, &i, "--batch", &v, &bad)) {
            bad = bad || !st_cli_int("--batch", v, 1, 65536, &batch);
        } else if (st_cli_device_opt(argc, argv, &i, &mp, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "-t", &v, &bad) || st_cli_opt(argc, argv, &i, "--threads", &v, &bad)) {
            bad = bad || !st_cli_int("--threads", v, 1, 1024, &threads);
        } else {
            fprintf(stderr, "strata perplexity: unknown option '%s' (see strata perplexity --help)\n", argv[i]);
            return 2;
        }
    }
    if (bad) return 2;
    if (!model || !file) {
        usage(stderr);
        return 2;
    }
    char *text;
    size_t len;
    st_status st = st_read_file(file, &text, &len);
    if (st) return st_cli_fail(st);
    strata_model *m = NULL;
    mp.path = model;
    mp.n_threads = (int)threads;
    int32_t *ids = NULL;
    int n = 0, rc = 1;
    float *logits = NULL;
    if (strata_model_open(&mp, &m) || strata_tokenize(m, text, len, false, &ids, &n)) {
        fprintf(stderr, "strata: %s\n", strata_error());
        goto done;
    }
    if (n < 2) {
        fprintf(stderr, "strata perplexity: %s has %d tokens; at least 2 are needed\n", file, n);
        goto done;
    }
    strata_model_info info = strata_model_get_info(m);
    int w = (int)(ctx < n ? ctx : n);
    logits = malloc(sizeof(float) * (size_t)w * info.n_vocab);
    if (!logits) {
        fprintf(stderr, "strata perplexity: out of memory for %d x %d logits\n", w, info.n_vocab);
        goto done;
    }
    double nll = 0;
    long scored = 0;
    for (int start = 0; start + 1 < n; start += w) {
        int len_w = n - start < w ? n - start : w;
        if (len_w < 2) break;
        strata_session *s;
        strata_session_params sp = {.n_ctx = len_w, .n_batch = (int)batch};
        if (strata_session_open(m, &sp, &s) || strata_session_eval(s, ids + start, len_w, logits)) {
            fprintf(stderr, "strata: %s\n", strata_error());
            goto done;
        }
        strata_session_close(s);
        for (int i = 0; i + 1 < len_w; i++) {
            const float *l = logits + (size_t)i * info.n_vocab;
            float mx = l[0];
            for (int j = 1; j < info.n_vocab; j++) mx = l[j] > mx ? l[j] : mx;
            double sum = 0;
            for (int j = 0; j < info.n_vocab; j++) sum += exp((double)l[j] - mx);
            nll += log(sum) + mx - l[ids[start + i + 1]];
            scored++;
        }
        fprintf(stderr, "[%d/%d tokens] perplexity so far %.4f\n", start + len_w, n, exp(nll / scored));
    }
    printf("perplexity: %.6f over %ld tokens (windows of %d)\n", exp(nll / scored), scored, w);
    rc = 0;
done:
    free(logits);
    free(ids);
    free(text);
    strata_model_close(m);
    return rc;
}
