// cli: `strata bench -m FILE`: prompt and decode tokens/s of a model on this machine, next to
// the decode bound (memory-read bandwidth / weight bytes a decoded token reads).

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "cli/cli.h"
#include "strata.h"

static void usage(FILE *f) {
    fprintf(f, "usage: strata bench -m FILE [-t N] [--prompt 512,2048] [--decode 128] [--kv f16|q8_0] [--ctx N]\n\n"
               "Prompt tokens/s for each prompt length (one chunk of up to --batch rows at a time; each\n"
               "timed after an untimed prompt of the same length, as llama-bench warms up, whose own\n"
               "rate is shown too) and decode tokens/s (greedy, one token per step after a short\n"
               "warm-up), next to the decode bound: the machine's memory-read bandwidth / the weight\n"
               "bytes one decoded token reads.\n\n"
               "  -m, --model FILE   GGUF model\n"
               "  -t, --threads N    CPU threads (default: all cores)\n"
               ST_CLI_DEVICE_HELP
               "  --prompt LIST      prompt lengths (default 512,2048; 0 to skip)\n"
               "  --decode N         decoded tokens (default 128; 0 to skip)\n"
               "  --batch N          prompt chunk (default: 2048 on a GPU that holds the whole model,\n"
               "                     else 512)\n"
               "  --kv f16|q8_0      KV cache type (default f16)\n"
               "  -c, --ctx N        context the GPU's memory is planned for (default: the longest test\n"
               "                     + 16, the context each test opens, as llama-bench sizes its own;\n"
               "                     what is not planned for the KV cache goes to the expert cache)\n");
}

int st_bench_model(int argc, char **argv) {
    const char *model = NULL, *prompts = "512,2048", *kv = "f16", *v;
    int64_t threads = 0, decode = 128, batch = 0, ctx = 0;
    bool bad = false;
    strata_model_params mp = {0};
    for (int i = 1; i < argc && !bad; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else if (st_cli_opt(argc, argv, &i, "-m", &model, &bad) || st_cli_opt(argc, argv, &i, "--model", &model, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "--prompt", &prompts, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "--kv", &kv, &bad)) {
        } else if (st_cli_device_opt(argc, argv, &i, &mp, &bad)) {
        } else if (st_cli_opt(argc, argv, &i, "-t", &v, &bad) || st_cli_opt(argc, argv, &i, "--threads", &v, &bad)) {
            bad = bad || !st_cli_int("--threads", v, 1, 1024, &threads);
        } else if (st_cli_opt(argc, argv, &i, "--decode", &v, &bad)) {
            bad = bad || !st_cli_int("--decode", v, 0, 1 << 20, &decode);
        } else if (st_cli_opt(argc, argv, &i, "--batch", &v, &bad)) {
            bad = bad || !st_cli_int("--batch", v, 1, 65536, &batch);
        } else if (st_cli_opt(argc, argv, &i, "--ctx", &v, &bad)) {
            bad = bad || !st_cli_int("--ctx", v, 1, 1 << 24, &ctx);
        } else {
            fprintf(stderr, "strata bench: unknown option '%s' (see strata bench --help)\n", argv[i]);
            return 2;
        }
    }
    if (bad) return 2;
    if (!model) {
        usage(stderr);
        return 2;
    }
    int64_t lens[16];
    int n_lens = 0;
    for (const char *p = prompts; *p && n_lens < 16;) {
        char tok[32];
        size_t l = strcspn(p, ",");
        snprintf(tok, sizeof tok, "%.*s", (int)(l < 31 ? l : 31), p);
        if (!st_cli_int("--prompt", tok, 0, 1 << 20, &lens[n_lens])) return 2;
        if (lens[n_lens] > 0) n_lens++;
        p += l + (p[l] == ',');
    }
    strata_kv_type kv_type = !strcmp(kv, "q8_0") ? STRATA_KV_Q8_0 : STRATA_KV_F16;
    if (strcmp(kv, "q8_0") && strcmp(kv, "f16")) {
        fprintf(stderr, "strata bench: --kv: '%s' is not f16 or q8_0\n", kv);
        return 2;
    }

    // Each test opens a session of its length + 16 (the warm-up one of 80).
    int64_t longest = 80;
    for (int i = 0; i < n_lens; i++) longest = lens[i] + 16 > longest ? lens[i] + 16 : longest;
    if (decode + 16 > longest) longest = decode + 16;
    if (ctx && ctx < longest) {
        fprintf(stderr, "strata bench: --ctx %lld: the tests need %lld positions\n", (long long)ctx, (long long)longest);
        return 2;
    }
    strata_model *m = NULL;
    mp.path = model;
    mp.n_ctx = (int)(ctx ? ctx : longest);
    mp.n_threads = (int)threads;
    mp.n_batch = (int)batch;
    if (strata_model_open(&mp, &m)) return st_cli_fail(ST_ERR_IO);
    strata_model_info info = strata_model_get_info(m);
    int nth = threads ? (int)threads : st_cpu_count();
    char commit[128];
    st_bench_commit(commit, sizeof commit);
    // The bound: the memory the weights are read from (the GPU's when the model runs there).
    double bw = info.gpu >= 0 ? st_cuda_copy_gbs(info.gpu) : st_bench_read_gbs(nth);
    printf("model: %s (%s, %d layers, %d experts top-%d, %.2f GiB)\n", model, info.arch, info.n_layer,
           info.n_expert, info.n_expert_used, info.file_bytes / 1073741824.0);
    if (info.gpu >= 0)
        printf("commit: %s; backend: cuda, GPU %d; kv: %s, planned for %d positions; prompt chunk %d; GPU memory "
               "copy %.0f GB/s (read + write)\n", commit, info.gpu, kv, mp.n_ctx, info.n_batch, bw);
    else
        printf("commit: %s; backend: cpu; threads: %d; kv: %s; prompt chunk %d; memory read %.1f GB/s\n", commit, nth,
               kv, info.n_batch, bw);
    printf("decode reads %.1f MiB of weights per token: bound %.1f tokens/s\n", info.decode_bytes / 1048576.0,
           bw * 1e9 / (double)info.decode_bytes);
    strata_expert_stats ec = strata_model_expert_stats(m);
    if (info.gpu >= 0 && ec.cached < ec.total)
        printf("(%lld of %lld experts are on the GPU, the rest in host memory: the bound takes them all on the "
               "GPU)\n", (long long)ec.cached, (long long)ec.total);
    printf("\n");
    printf("%-14s %8s %10s %12s\n", "test", "tokens", "seconds", "tokens/s");

    // A warm-up outside the timings: the first call of each kernel and library pays one-time
    // costs (lazy module loading, cuBLAS set-up, tables; ~0.25 s on a GPU) that no later
    // prompt or token does.
    int rc = 0;
    {
        strata_session *w = NULL;
        strata_session_params wp = {.n_ctx = 80, .n_batch = (int)batch, .kv_type = kv_type};
        int32_t toks[64], best;
        for (int i = 0; i < 64; i++) toks[i] = (int32_t)((i * 7919u) % (unsigned)info.n_vocab);
        rc = strata_session_open(m, &wp, &w) || strata_session_eval(w, toks, 64, NULL) ||
             strata_session_eval_argmax(w, toks, 1, &best);
        if (rc) fprintf(stderr, "strata: warm-up: %s\n", strata_error());
        strata_session_close(w);
    }
    uint64_t seed = 0x9e3779b97f4a7c15ull;
    for (int li = 0; li < n_lens + (decode > 0) && !rc; li++) {
        bool is_decode = li == n_lens;
        int n = is_decode ? (int)decode : (int)lens[li];
        strata_session *s = NULL;
        strata_session_params sp = {.n_ctx = n + 16, .n_batch = (int)batch, .kv_type = kv_type};
        int32_t *toks = malloc(sizeof(int32_t) * (size_t)(n + 16));
        if (!toks || strata_session_open(m, &sp, &s)) {
            fprintf(stderr, "strata: %s\n", toks ? strata_error() : "out of memory");
            rc = 1;
        }
        for (int i = 0; !rc && i < n + 16; i++) {
            seed ^= seed << 13, seed ^= seed >> 7, seed ^= seed << 17;
            toks[i] = (int32_t)(seed % (uint64_t)info.n_vocab);
        }
        double t0 = 0, t1 = 0, first = 0;
        if (!rc && !is_decode) {
            // The same prompt once untimed, in a session of its own: a length's first prompt
            // pays one-time costs (kernels and library paths of its sizes loaded and set up)
            // that the following ones do not.
            strata_session *w = NULL;
            double w0 = st_time_s();
            rc = strata_session_open(m, &sp, &w) || strata_session_eval(w, toks, n, NULL);
            first = st_time_s() - w0;
            strata_session_close(w);
            t0 = st_time_s();
            rc = rc || strata_session_eval(s, toks, n, NULL) != 0;
            t1 = st_time_s();
        } else if (!rc) {
            rc = strata_session_eval(s, toks, 8, NULL) != 0; // warm-up context
            int32_t tok = toks[8];
            t0 = st_time_s();
            for (int i = 0; i < n && !rc; i++) // greedy, as generate does it (on a GPU: the id only)
                rc = strata_session_eval_argmax(s, &tok, 1, &tok) != 0;
            t1 = st_time_s();
        }
        if (rc) fprintf(stderr, "strata: %s\n", strata_error());
        else {
            char name[32];
            snprintf(name, sizeof name, is_decode ? "decode" : "prompt %d", n);
            printf("%-14s %8d %10.3f %12.1f\n", name, n, t1 - t0, n / (t1 - t0));
            if (!is_decode)
                printf("  the untimed first prompt of this length before it: %.3f s, %.1f tokens/s (session "
                       "opening included)\n", first, n / first);
            strata_expert_stats es = strata_session_expert_stats(s);
            if (es.hits + es.misses) {
                printf("  experts: %lld of %lld cached, hit rate %.1f%%; CPU pool %.3f s (%llu layer calls, %.0f us "
                       "each), then waiting for the GPU %.3f s; streamed %.2f GiB in %.3f s; %llu swaps\n",
                       (long long)es.cached, (long long)es.total, 100.0 * es.hits / (double)(es.hits + es.misses),
                       es.cpu_s, (unsigned long long)es.cpu_jobs, es.cpu_jobs ? es.cpu_s / es.cpu_jobs * 1e6 : 0.0,
                       es.wait_s, es.streamed_bytes / 1073741824.0, es.stream_s, (unsigned long long)es.swaps);
                // Overlap: the share of the pool's time the GPU spent on its own work rather than
                // waiting for the answer (the wait includes the hand-off's latency).
                if (es.cpu_s > 0) {
                    double ov = 1.0 - es.gpu_wait_s / es.cpu_s;
                    printf("  the GPU waited %.3f s for the CPU pool: %.0f%% of the pool's time overlapped GPU work\n",
                           es.gpu_wait_s, 100.0 * (ov < 0 ? 0 : ov > 1 ? 1 : ov));
                }
            }
            strata_gpu_stats gs;
            if (strata_model_gpu_stats(m, &gs, 1) == 1) // with this test's session still open
                printf("  GPU memory in use: %.2f of %.2f GiB (the whole card, all processes)\n",
                       gs.vram_used / 1073741824.0, gs.vram_total / 1073741824.0);
            if (is_decode)
                printf("\ndecode at %.0f%% of the bound\n", 100.0 * n / (t1 - t0) / (bw * 1e9 / (double)info.decode_bytes));
        }
        strata_session_close(s);
        free(toks);
    }
    strata_model_close(m);
    return rc;
}
