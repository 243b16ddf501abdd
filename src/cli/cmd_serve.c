// cli: `strata serve`: reads the configuration (strata-NAME.json, then flags), checks all of it
// before the model loads, runs the HTTP server until SIGINT/SIGTERM, then drains and exits.

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli.h"
#include "server/server.h"

static void help(void) {
    printf("usage: strata serve [--config strata-NAME.json] [options]\n\n"
           "Serves the model over HTTP: the OpenAI API (/v1/chat/completions, /v1/completions,\n"
           "/v1/models), the Anthropic API (/v1/messages), /health, /metrics, /props, /status and\n"
           "the web page at /. Every option is also a key of the config file (\"--max-body-mib 8\" is\n"
           "\"max_body_mib\": 8); options on the command line win over the file. docs/SERVER.md has\n"
           "the details.\n\n"
           "  %-30s %s\n", "--config FILE", "a strata-NAME.json (its \"args\" are extra flags)");
    st_server_config_help(stdout);
}

int st_cmd_serve(int argc, char **argv) {
    const char *config = NULL;
    char **rest = calloc((size_t)argc + 1, sizeof *rest);
    int n_rest = 0;
    if (!rest) return st_cli_fail(ST_ERR_NOMEM);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            help();
            free(rest);
            return 0;
        }
        if (!strcmp(argv[i], "--config")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "strata serve: --config needs a file\n");
                free(rest);
                return 2;
            }
            config = argv[++i];
            continue;
        }
        rest[n_rest++] = argv[i];
    }
    // Every problem of the config, the flags and the result is said at once, before loading.
    st_server_config cfg;
    st_server_config_init(&cfg);
    bool bad = false;
    if (config && st_server_config_load(&cfg, config)) bad = true, fprintf(stderr, "strata serve: %s\n", st_error());
    if (st_server_config_args(&cfg, n_rest, rest)) bad = true, fprintf(stderr, "strata serve: flags: %s\n", st_error());
    free(rest);
    if (!cfg.model) cfg.model = strdup(st_cli_default_model());
    if (st_server_config_check(&cfg)) bad = true, fprintf(stderr, "strata serve: %s\n", st_error());
    if (bad) {
        st_server_config_free(&cfg);
        return 2;
    }
    if (cfg.layer_split) st_log_warn("serve: layer_split is kept for several GPUs, which this build does not run yet");

    // SIGINT/SIGTERM go to this thread only (sigwait below): every thread started from here on
    // inherits the mask. A closed socket must not kill the process.
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    double t0 = st_time_s();
    fprintf(stderr, "strata serve: loading %s\n", cfg.model);
    strata_model *m = NULL;
    strata_model_params mp = {.path = cfg.model, .n_threads = cfg.threads, .gpu = cfg.gpu,
                              .vram_reserve_mib = cfg.vram_reserve_mib, .expert_cache = cfg.expert_cache,
                              .expert_profile = cfg.expert_profile, .vram_budget_gib = cfg.vram_budget_gib,
                              .n_ctx = cfg.ctx, .n_batch = cfg.batch, .n_seq = cfg.parallel, .resident_gib = cfg.resident_gib,
                              .pool_workers = cfg.pool_workers, .adapt_every = cfg.adapt_every,
                              // the config's 0 is "none", the engine's 0 "the probe's pick"
                              .pcie_frac = cfg.pcie_frac < 0 ? 0 : cfg.pcie_frac > 0 ? cfg.pcie_frac : -1,
                              .no_mmap = cfg.no_mmap};
    if (strata_model_open(&mp, &m)) {
        int rc = st_cli_fail(ST_ERR_IO);
        st_server_config_free(&cfg);
        return rc;
    }
    st_server *srv;
    if (st_server_start(&cfg, m, cfg.model, &srv)) {
        int rc = st_cli_fail(ST_ERR_IO);
        strata_model_close(m);
        st_server_config_free(&cfg);
        return rc;
    }
    strata_model_info info = strata_model_get_info(m);
    char where[32] = "the CPU";
    if (info.gpu >= 0) snprintf(where, sizeof where, "GPU %d", info.gpu);
    fprintf(stderr, "strata serve: ready in %.1f s on %s: http://%s%s%s:%d/ (API at /v1, %d slot%s%s)\n", st_time_s() - t0, where,
            strchr(cfg.host, ':') ? "[" : "", cfg.host, strchr(cfg.host, ':') ? "]" : "", cfg.port, cfg.parallel,
            cfg.parallel > 1 ? "s" : "", cfg.api_key && *cfg.api_key ? ", API key required" : "");

    int sig = 0;
    while (sigwait(&sigs, &sig)) {}
    fprintf(stderr, "strata serve: %s: finishing the running requests (up to %d s; again to stop now)\n",
            sig == SIGINT ? "SIGINT" : "SIGTERM", cfg.drain_timeout);
    double until = st_time_s() + cfg.drain_timeout;
    bool drained = false;
    while (!drained && st_time_s() < until) {
        drained = st_server_drain(srv, 0.1);
        struct timespec zero = {0, 0};
        if (!drained && sigtimedwait(&sigs, NULL, &zero) > 0) break; // a second signal: stop now
    }
    st_server_free(srv);
    strata_model_close(m);
    st_server_config_free(&cfg);
    fprintf(stderr, "strata serve: stopped%s\n", drained ? "" : " (requests still running were cancelled)");
    return 0;
}
