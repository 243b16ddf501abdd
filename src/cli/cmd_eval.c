// cli: `strata eval` writes every position's logits for a token sequence (for parity checks and
// for users comparing engines).

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "strata.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: strata eval -m FILE (--tokens 1,2,3 | --text T) --logits OUT.f32 [options]\n\n"
            "Runs the tokens through the model from position 0 and writes every position's logits\n"
            "as little-endian float32, row-major [positions x vocabulary].\n\n"
            "  -m, --model FILE     GGUF model\n"
            "  --tokens LIST        comma-separated token ids\n"
            "  --text T             text, tokenized with the model's tokenizer (no special tokens)\n"
            "  --logits FILE        output file\n"
            "  --batch N            rows per forward call (default 512; 1 = token by token)\n"
            "  -c, --ctx N          context size (default: the number of tokens)\n"
            "  --kv f16|q8_0        KV cache type (default f16)\n"
            "  -t, --threads N      CPU threads (default: all cores)\n"
            ST_CLI_DEVICE_HELP
            "  --hidden FILE        also write every position's final hidden state [positions x n_embd]\n"
            "  --mtp-logits FILE    models with an MTP layer: run it on (hidden of t, token t+1) for\n"
            "                       t = 0 .. n-2 and write its draft logits [n-1 x vocabulary]\n"
            "  --mtp-hidden FILE    the MTP layer's output hidden states [n-1 x n_embd]\n"
            "  --mtp-chain K        then K chained drafts (each step takes the previous one's MTP hidden\n"
            "                       and greedy draft token), appended to both MTP files as K more rows\n"
            "  --rollback P         snapshot the session at position P, run to the end, restore the\n"
            "                       snapshot and run positions P.. again (the MTP layer too); the files\n"
            "                       hold the second run\n");
}

static bool write_f32(const char *path, const float *x, size_t count) {
    FILE *f = fopen(path, "wb");
    bool ok = f && fwrite(x, sizeof(float), count, f) == count;
    if (f && fclose(f)) ok = false;
    if (!ok) fprintf(stderr, "strata eval: cannot write %s: %s\n", path, strerror(errno));
    return ok;
}

static bool parse_tokens(const char *text, int32_t **out, int *n) {
    int cap = 16, count = 0;
    int32_t *ids = malloc(sizeof(int32_t) * cap);
    const char *p = text;
    while (ids && *p) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            fprintf(stderr, "strata eval: --tokens: '%s' is not a comma-separated list of token ids\n", text);
            free(ids);
            return false;
        }
        if (count == cap) {
            int32_t *nids = realloc(ids, sizeof(int32_t) * (cap *= 2));
            if (!nids) break;
            ids = nids;
        }
        ids[count++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    *out = ids;
    *n = count;
    return ids != NULL;
}

int st_cmd_eval(int argc, char **argv) {
    const char *model = NULL, *tokens_text = NULL, *text = NULL, *out_path = NULL, *v;
    const char *hidden_path = NULL, *mtp_logits_path = NULL, *mtp_hidden_path = NULL;
    int64_t batch = 512, ctx = 0, threads = 0, rollback = -1, chain = 0;
    const char *kv = "f16";
    bool bad = false;
    strata_model_params mp = {0};
    for (int i = 1; i < argc && !bad; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else if (st_cli_device_opt(argc, argv, &i, &mp, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "-m", &model, &bad) || st_cli_opt(argc, argv, &i, "--model", &model, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "--tokens", &tokens_text, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "--text", &text, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "--logits", &out_path, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "--kv", &kv, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "--hidden", &hidden_path, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "--mtp-logits", &mtp_logits_path, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "--mtp-hidden", &mtp_hidden_path, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "--mtp-chain", &v, &bad)) {
            bad = bad || !st_cli_int("--mtp-chain", v, 0, 1 << 16, &chain);
        } else if (st_cli_opt(argc, argv, &i, "--rollback", &v, &bad)) {
            bad = bad || !st_cli_int("--rollback", v, 0, 1 << 24, &rollback);
        } else if (st_cli_opt(argc, argv, &i, "--batch", &v, &bad)) {
            bad = bad || !st_cli_int("--batch", v, 1, 65536, &batch);
        } else if (st_cli_opt(argc, argv, &i, "--ctx", &v, &bad)) {
            bad = bad || !st_cli_int("--ctx", v, 1, 1 << 30, &ctx);
        } else if (st_cli_opt(argc, argv, &i, "-t", &v, &bad) || st_cli_opt(argc, argv, &i, "--threads", &v, &bad)) {
            bad = bad || !st_cli_int("--threads", v, 1, 1024, &threads);
        } else {
            fprintf(stderr, "strata eval: unknown option '%s' (see strata eval --help)\n", argv[i]);
            return 2;
        }
    }
    if (bad) return 2;
    if (!model || !tokens_text == !text || !out_path) {
        fprintf(stderr, "strata eval: -m, --logits and one of --tokens or --text are required (see strata eval --help)\n");
        return 2;
    }
    strata_kv_type kv_type;
    if (!strcmp(kv, "f16")) kv_type = STRATA_KV_F16;
    else if (!strcmp(kv, "q8_0")) kv_type = STRATA_KV_Q8_0;
    else {
        fprintf(stderr, "strata eval: --kv: '%s' is not a KV cache type (f16, q8_0)\n", kv);
        return 2;
    }
    int32_t *ids = NULL;
    int n = 0;
    if (tokens_text && !parse_tokens(tokens_text, &ids, &n)) return 2;
    int rc = 1;
    strata_model *m = NULL;
    strata_session *s = NULL;
    float *logits = NULL, *hidden = NULL, *mtp_logits = NULL, *mtp_hidden = NULL;
    strata_snapshot *snap = NULL;
    bool mtp = mtp_logits_path || mtp_hidden_path;
    mp.path = model;
    mp.n_threads = (int)threads;
    if (strata_model_open(&mp, &m)) goto fail;
    if (text && strata_tokenize(m, text, strlen(text), false, &ids, &n)) goto fail;
    if (n == 0 || rollback > n || (mtp && n < 2)) {
        fprintf(stderr, "strata eval: %s\n", n == 0 ? "no tokens to evaluate" : rollback > n ?
                "--rollback: the position is past the last token" : "the MTP outputs need at least 2 tokens");
        rc = 2;
        goto done;
    }
    strata_model_info info = strata_model_get_info(m);
    strata_session_params sp = {.n_ctx = ctx ? (int)ctx : n + (int)chain, .n_batch = (int)batch, .kv_type = kv_type};
    if (strata_session_open(m, &sp, &s)) goto fail;
    if (mtp && !info.has_mtp) {
        fprintf(stderr, "strata eval: %s has no MTP layer\n", model);
        goto done;
    }
    size_t V = (size_t)info.n_vocab, E = (size_t)info.n_embd;
    logits = malloc(sizeof(float) * n * V);
    if (hidden_path || mtp) hidden = malloc(sizeof(float) * n * E);
    size_t n_mtp = (size_t)(n - 1 + chain); // MTP rows: one per prompt position but the last, then the chain
    if (mtp) mtp_logits = malloc(sizeof(float) * n_mtp * V), mtp_hidden = malloc(sizeof(float) * n_mtp * E);
    if (!logits || ((hidden_path || mtp) && !hidden) || (mtp && (!mtp_logits || !mtp_hidden))) {
        fprintf(stderr, "strata eval: out of memory for %d x %d logits\n", n, info.n_vocab);
        goto done;
    }
    int first = rollback >= 0 ? (int)rollback : n; // the tokens before the snapshot
    if (strata_session_eval_hidden(s, ids, first, logits, hidden)) goto fail;
    if (rollback >= 0) {
        if (strata_session_save(s, &snap) ||
            strata_session_eval_hidden(s, ids + first, n - first, logits + first * V, hidden ? hidden + first * E : NULL) ||
            strata_session_restore(s, snap) ||
            strata_session_eval_hidden(s, ids + first, n - first, logits + first * V, hidden ? hidden + first * E : NULL))
            goto fail;
    }
    if (mtp && strata_session_mtp_draft(s, 0, hidden, ids + 1, n - 1, mtp_logits, mtp_hidden)) goto fail;
    if (mtp && rollback >= 0 && first < n - 1) { // the MTP cache goes back by running from P again
        if (strata_session_mtp_draft(s, first, hidden + first * E, ids + first + 1, n - 1 - first,
                                     mtp_logits + first * V, mtp_hidden + first * E))
            goto fail;
    }
    for (int row = n - 1; mtp && row < (int)n_mtp; row++) { // row t takes row t-1's MTP hidden and draft
        const float *prev = mtp_logits + (row - 1) * V;
        int32_t draft = 0;
        for (size_t j = 1; j < V; j++)
            if (prev[j] > prev[draft]) draft = (int32_t)j;
        if (strata_session_mtp_draft(s, row, mtp_hidden + (row - 1) * E, &draft, 1, mtp_logits + row * V,
                                     mtp_hidden + row * E))
            goto fail;
    }
    if (!write_f32(out_path, logits, n * V) || (hidden_path && !write_f32(hidden_path, hidden, n * E)) ||
        (mtp_logits_path && !write_f32(mtp_logits_path, mtp_logits, n_mtp * V)) ||
        (mtp_hidden_path && !write_f32(mtp_hidden_path, mtp_hidden, n_mtp * E)))
        goto done;
    fprintf(stderr, "strata eval: %d positions x %d logits -> %s\n", n, info.n_vocab, out_path);
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "strata: %s\n", strata_error());
done:
    strata_snapshot_free(snap);
    free(logits);
    free(hidden);
    free(mtp_logits);
    free(mtp_hidden);
    free(ids);
    strata_session_close(s);
    strata_model_close(m);
    return rc;
}
