// cli: `strata devices` (the GPUs and whether Strata can use them) and the device flags the
// model-running subcommands share (--gpu, --vram-reserve-mib).

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "cli/cli.h"
#include "strata.h"

bool st_cli_device_opt(int argc, char **argv, int *i, strata_model_params *mp, bool *bad) {
    const char *v;
    if (st_cli_opt(argc, argv, i, "--gpu", &v, bad)) {
        if (*bad) return true;
        char *end;
        long idx = strtol(v, &end, 10);
        if (strcmp(v, "auto") && strcmp(v, "cpu") && (*end || end == v || idx < 0 || idx > 1023)) {
            fprintf(stderr, "strata: --gpu: '%s' is not auto, cpu or a GPU index (0, 1, ...)\n", v);
            *bad = true;
        }
        mp->gpu = v;
        return true;
    }
    if (st_cli_opt(argc, argv, i, "--vram-reserve-mib", &v, bad)) {
        int64_t mib = 0;
        if (!*bad && !st_cli_int("--vram-reserve-mib", v, 1, 1 << 20, &mib)) *bad = true;
        mp->vram_reserve_mib = (int)mib;
        return true;
    }
    // The hybrid expert cache (docs/HYBRID.md).
    if (st_cli_opt(argc, argv, i, "--expert-cache", &v, bad)) {
        int64_t n = 0;
        if (!*bad && strcmp(v, "auto") && !st_cli_int("--expert-cache", v, 0, INT64_MAX / 2, &n)) *bad = true;
        mp->expert_cache = v;
        return true;
    }
    if (st_cli_opt(argc, argv, i, "--expert-profile", &v, bad)) {
        mp->expert_profile = v;
        return true;
    }
    double f = 0;
    int64_t n = 0;
    if (st_cli_opt(argc, argv, i, "--vram-budget-gib", &v, bad)) {
        if (!*bad && (!st_cli_float("--vram-budget-gib", v, &f) || f <= 0)) {
            if (f <= 0) fprintf(stderr, "strata: --vram-budget-gib: '%s' must be a positive number of GiB\n", v);
            *bad = true;
        }
        mp->vram_budget_gib = f;
        return true;
    }
    if (!strcmp(argv[*i], "--resident-experts")) {
        mp->resident_gib = -1;
        return true;
    }
    if (!strcmp(argv[*i], "--no-mmap")) {
        mp->no_mmap = true;
        return true;
    }
    if (!strcmp(argv[*i], "--mmap-experts")) {
        mp->resident_gib = 0;
        return true;
    }
    if (st_cli_opt(argc, argv, i, "--resident-budget-gib", &v, bad)) {
        if (!*bad && (!st_cli_float("--resident-budget-gib", v, &f) || f < 0)) {
            if (f < 0) fprintf(stderr, "strata: --resident-budget-gib: '%s' must be 0 or more GiB\n", v);
            *bad = true;
        }
        mp->resident_gib = f;
        return true;
    }
    if (st_cli_opt(argc, argv, i, "--pool-workers", &v, bad)) {
        if (!*bad && !st_cli_int("--pool-workers", v, 1, 1024, &n)) *bad = true;
        mp->pool_workers = (int)n;
        return true;
    }
    if (st_cli_opt(argc, argv, i, "--adapt-every", &v, bad)) {
        if (!*bad && !st_cli_int("--adapt-every", v, 0, 1 << 30, &n)) *bad = true;
        mp->adapt_every = n ? (int)n : -1;
        return true;
    }
    if (st_cli_opt(argc, argv, i, "--adapt-swaps", &v, bad)) {
        if (!*bad && !st_cli_int("--adapt-swaps", v, 1, 64, &n)) *bad = true;
        mp->adapt_swaps = (int)n;
        return true;
    }
    if (st_cli_opt(argc, argv, i, "--adapt-decay", &v, bad)) {
        if (!*bad && (!st_cli_float("--adapt-decay", v, &f) || f <= 0 || f > 1)) {
            if (f <= 0 || f > 1) fprintf(stderr, "strata: --adapt-decay: '%s' must be in (0, 1]\n", v);
            *bad = true;
        }
        mp->adapt_decay = f;
        return true;
    }
    if (st_cli_opt(argc, argv, i, "--pcie-frac", &v, bad)) {
        if (!*bad && (!st_cli_float("--pcie-frac", v, &f) || !(f >= 0 && f <= 1))) {
            if (!(f >= 0 && f <= 1)) fprintf(stderr, "strata: --pcie-frac: '%s' must be in 0 .. 1\n", v);
            *bad = true;
        }
        mp->pcie_frac = f > 0 ? f : -1; // 0 asked: none (0 in the params is the probe's pick)
        return true;
    }
    return false;
}

static void print_gpu(const st_gpu_info *g, bool verbose) {
    printf("GPU %d: %s, %.0f GB VRAM - %s\n", g->index, g->name, g->vram_total / 1073741824.0,
           g->usable ? "can be used" : g->why);
    if (!verbose) return;
    printf("  VRAM: %.1f GiB total, %.1f GiB free; compute capability %d.%d; %d multiprocessors at %d MHz",
           g->vram_total / 1073741824.0, g->vram_free / 1073741824.0, g->cc_major, g->cc_minor, g->sm_count,
           g->clock_mhz);
    if (g->pcie_gen) printf("; PCIe %d.0 x%d", g->pcie_gen, g->pcie_width);
    printf("\n");
}

int st_cmd_devices(int argc, char **argv) {
    bool brief = false, json = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("usage: strata devices [--brief] [--json]\n\n"
                   "Lists the NVIDIA GPUs: name, VRAM total and free, compute capability, multiprocessors,\n"
                   "clock, PCIe link, and whether Strata can use the card (compute capability 7.5 or newer).\n"
                   "  --brief   one line per GPU\n"
                   "  --json    machine-readable\n");
            return 0;
        } else if (!strcmp(argv[i], "--brief")) {
            brief = true;
        } else if (!strcmp(argv[i], "--json")) {
            json = true;
        } else {
            fprintf(stderr, "strata devices: unknown option '%s' (see strata devices --help)\n", argv[i]);
            return 2;
        }
    }
    st_gpu_info gpus[64];
    int n = 0;
    char why[512] = "";
    st_status s = st_cuda_devices(gpus, 64, &n, why, sizeof why);
    if (s) return st_cli_fail(s);
    if (json) {
        printf("[");
        for (int i = 0; i < n; i++) {
            const st_gpu_info *g = &gpus[i];
            printf("%s{\"index\": %d, \"name\": \"", i ? ", " : "", g->index);
            for (const char *c = g->name; *c; c++) printf(*c == '"' || *c == '\\' ? "\\%c" : "%c", *c);
            printf("\", \"vram_total\": %zu, \"vram_free\": %zu, \"compute_capability\": \"%d.%d\", "
                   "\"multiprocessors\": %d, \"clock_mhz\": %d, \"pcie_gen\": %d, \"pcie_width\": %d, "
                   "\"usable\": %s}", g->vram_total, g->vram_free, g->cc_major, g->cc_minor, g->sm_count,
                   g->clock_mhz, g->pcie_gen, g->pcie_width, g->usable ? "true" : "false");
        }
        printf("]\n");
        return 0;
    }
    if (n == 0) {
        printf("No GPU Strata can use: %s. Strata runs on the CPU.\n", why);
        return 0;
    }
    bool any = false;
    for (int i = 0; i < n; i++) {
        print_gpu(&gpus[i], !brief);
        any |= gpus[i].usable;
    }
    if (!any) printf("No GPU Strata can use: it runs on the CPU.\n");
    return 0;
}
