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
            "usage: strata eval -m FILE --tokens 1,2,3 --logits OUT.f32 [options]\n\n"
            "Runs the tokens through the model from position 0 and writes every position's logits\n"
            "as little-endian float32, row-major [positions x vocabulary].\n\n"
            "  -m, --model FILE     GGUF model\n"
            "  --tokens LIST        comma-separated token ids\n"
            "  --logits FILE        output file\n"
            "  --batch N            rows per forward call (default 512; 1 = token by token)\n"
            "  --ctx N              context size (default: the number of tokens)\n"
            "  --kv f16|q8_0        KV cache type (default f16)\n"
            "  -t, --threads N      CPU threads (default: all cores)\n");
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
    const char *model = NULL, *tokens_text = NULL, *out_path = NULL, *v;
    int64_t batch = 512, ctx = 0, threads = 0;
    const char *kv = "f16";
    bool bad = false;
    for (int i = 1; i < argc && !bad; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else if (st_cli_opt(argc, argv, &i, "-m", &model, &bad) || st_cli_opt(argc, argv, &i, "--model", &model, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "--tokens", &tokens_text, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "--logits", &out_path, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "--kv", &kv, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "--batch", &v, &bad)) {
            bad = bad || !st_cli_int("--batch", v, 1, 65536, &batch);
        } else if (st_cli_opt(argc, argv, &i, "--ctx", &v, &bad)) {
            bad = bad || !st_cli_int("--ctx", v, 1, 1 << 24, &ctx);
        } else if (st_cli_opt(argc, argv, &i, "-t", &v, &bad) || st_cli_opt(argc, argv, &i, "--threads", &v, &bad)) {
            bad = bad || !st_cli_int("--threads", v, 1, 1024, &threads);
        } else {
            fprintf(stderr, "strata eval: unknown option '%s' (see strata eval --help)\n", argv[i]);
            return 2;
        }
    }
    if (bad) return 2;
    if (!model || !tokens_text || !out_path) {
        fprintf(stderr, "strata eval: -m, --tokens and --logits are required (see strata eval --help)\n");
        return 2;
    }
    strata_kv_type kv_type;
    if (!strcmp(kv, "f16")) kv_type = STRATA_KV_F16;
    else if (!strcmp(kv, "q8_0")) kv_type = STRATA_KV_Q8_0;
    else {
        fprintf(stderr, "strata eval: --kv: '%s' is not a KV cache type (f16, q8_0)\n", kv);
        return 2;
    }
    int32_t *ids;
    int n;
    if (!parse_tokens(tokens_text, &ids, &n)) return 2;
    if (n == 0) {
        fprintf(stderr, "strata eval: --tokens is empty\n");
        free(ids);
        return 2;
    }
    int rc = 1;
    strata_model *m = NULL;
    strata_session *s = NULL;
    float *logits = NULL;
    FILE *f = NULL;
    strata_model_params mp = {.path = model, .n_threads = (int)threads};
    if (strata_model_open(&mp, &m)) goto fail;
    strata_model_info info = strata_model_get_info(m);
    strata_session_params sp = {.n_ctx = ctx ? (int)ctx : n, .n_batch = (int)batch, .kv_type = kv_type};
    if (strata_session_open(m, &sp, &s)) goto fail;
    logits = malloc(sizeof(float) * (size_t)n * info.n_vocab);
    if (!logits) {
        fprintf(stderr, "strata eval: out of memory for %d x %d logits\n", n, info.n_vocab);
        goto done;
    }
    if (strata_session_eval(s, ids, n, logits)) goto fail;
    f = fopen(out_path, "wb");
    if (!f || fwrite(logits, sizeof(float), (size_t)n * info.n_vocab, f) != (size_t)n * info.n_vocab) {
        fprintf(stderr, "strata eval: cannot write %s: %s\n", out_path, strerror(errno));
        goto done;
    }
    fprintf(stderr, "strata eval: %d positions x %d logits -> %s\n", n, info.n_vocab, out_path);
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "strata: %s\n", strata_error());
done:
    if (f && fclose(f) && rc == 0) {
        fprintf(stderr, "strata eval: cannot write %s\n", out_path);
        rc = 1;
    }
    free(logits);
    free(ids);
    strata_session_close(s);
    strata_model_close(m);
    return rc;
}
