// server: the configuration of `strata serve`. Every setting is one row of one table, reachable
// as a flag and as a key of strata-NAME.json; both go through the same checks, and every wrong
// key or value is named before the model loads.

#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "server/server.h"

typedef enum kind {
    K_STR, K_INT, K_FLOAT, K_BOOL, K_SEED, K_KV, K_THINK, K_GPU, K_SPLIT, K_ORIGINS, K_SAMPLING, K_ARGS,
} kind;

typedef struct key {
    const char *name;         // the config key
    const char *flag;         // its flag (NULL: config only)
    const char *alt;          // a short flag, or another accepted key (NULL)
    kind kind;
    size_t off;               // the field in st_server_config
    double lo, hi;            // K_INT / K_FLOAT range
    bool sampling;            // also a key of the "sampling" block
    const char *help;
} key;

#define OFF(f) offsetof(st_server_config, f)
static const key keys[] = {
    {"model", "--model", "-m", K_STR, OFF(model), 0, 0, false, "FILE    GGUF model (default: the embedded tiny-coder)"},
    {"host", "--host", NULL, K_STR, OFF(host), 0, 0, false, "ADDR     address to listen on (default 127.0.0.1)"},
    {"port", "--port", NULL, K_INT, OFF(port), 1, 65535, false, "N        port (default 8080)"},
    {"api_key", "--api-key", NULL, K_STR, OFF(api_key), 0, 0, false,
     "KEY   required on the API routes (Authorization: Bearer KEY or x-api-key: KEY)"},
    {"parallel", "--parallel", "-np", K_INT, OFF(parallel), 1, 64, false, "N    slots generating at once (default 1)"},
    {"queue", "--queue", NULL, K_INT, OFF(queue), 0, 100000, false,
     "N       requests that may wait for a slot; beyond, 503 (default 64)"},
    {"ctx", "--ctx", "-c", K_INT, OFF(ctx), 0, 1 << 24, false,
     "N         context per slot (default: the model's, capped by RAM)"},
    {"batch", "--batch", NULL, K_INT, OFF(batch), 1, 65536, false, "N       prompt tokens per step (default 512)"},
    {"threads", "--threads", "-t", K_INT, OFF(threads), 0, 1024, false, "N     CPU threads (default: all cores)"},
    {"kv", "--kv", NULL, K_KV, OFF(kv), 0, 0, false, "f16|q8_0   KV cache type (default f16)"},
    {"prompt_cache", "--prompt-cache", NULL, K_INT, OFF(prompt_cache), 0, 256, false,
     "N  session snapshots kept per slot for follow-up turns (default 4; 0 = off)"},
    {"max_body_mib", "--max-body-mib", NULL, K_INT, OFF(max_body_mib), 1, 4096, false,
     "N  largest request body in MiB (default 8)"},
    {"timeout", "--timeout", NULL, K_INT, OFF(timeout), 5, 86400, false,
     "S     seconds an idle or stalled connection is kept (default 60)"},
    {"max_tokens", "--max-tokens", NULL, K_INT, OFF(max_tokens), 0, 1 << 24, false,
     "N  tokens a reply may have when the request does not say (default 0 = up to the context)"},
    {"drain_timeout", "--drain-timeout", NULL, K_INT, OFF(drain_timeout), 0, 86400, false,
     "S  seconds SIGINT/SIGTERM waits for running requests (default 30)"},
    {"thinking", "--thinking", NULL, K_THINK, OFF(thinking), 0, 0, false,
     "on|off|auto  enable_thinking for requests that do not say (default auto: the template's)"},
    {"gpu", "--gpu", NULL, K_GPU, OFF(gpu), 0, 0, false,
     "N|cpu|auto  where the model runs (default auto: the first usable GPU it fits, else the CPU)"},
    {"vram_reserve_mib", "--vram-reserve-mib", NULL, K_INT, OFF(vram_reserve_mib), 0, 1 << 20, false,
     "N  VRAM left free on the GPU in MiB (default 0: the engine's, 384)"},
    {"expert_cache", "--expert-cache", NULL, K_STR, OFF(expert_cache), 0, 0, false,
     "auto|N  experts kept on the GPU (default auto: as many as fit)"},
    {"expert_profile", "--expert-profile", NULL, K_STR, OFF(expert_profile), 0, 0, false,
     "FILE  routing counts choosing them (default MODEL.profile when present)"},
    {"vram_budget_gib", "--vram-budget-gib", NULL, K_FLOAT, OFF(vram_budget_gib), 0, 1e6, false,
     "G  GPU memory Strata may use in all (default 0: what is free)"},
    {"resident_gib", "--resident-budget-gib", NULL, K_FLOAT, OFF(resident_gib), -1, 1e6, false,
     "G  page-locked copies of the experts the GPU lacks (0 = the file's mapping; -1 = all)"},
    {"pool_workers", "--pool-workers", NULL, K_INT, OFF(pool_workers), 0, 1024, false,
     "N  CPU threads computing experts beside the GPU (default 0: physical cores - 1)"},
    {"adapt_every", "--adapt-every", NULL, K_INT, OFF(adapt_every), -1, 1 << 30, false,
     "N  windows between expert cache swaps (default 0: 32; -1 = off)"},
    {"pcie_frac", "--pcie-frac", NULL, K_FLOAT, OFF(pcie_frac), 0, 1, false,
     "F  share (0..1) of decode misses copied to the GPU (default: a start-up probe picks)"},
    {"no_mmap", "--no-mmap", NULL, K_BOOL, OFF(no_mmap), 0, 0, false,
     "  read the model into memory (huge pages) instead of mapping it: faster CPU decode, slower start"},
    {"layer_split", "--layer-split", NULL, K_SPLIT, OFF(layer_split), 0, 0, false,
     "L,...  where each later GPU's layers start (several GPUs; not built yet)"},
    {"cors_origins", "--cors-origin", NULL, K_ORIGINS, OFF(cors_origins), 0, 0, false,
     "URL  a browser origin allowed to call the API (repeatable; \"*\" = any)"},
    {"temperature", "--temp", "temp", K_FLOAT, OFF(sampling.temperature), 0, 100, true,
     "T         default temperature (0.7; 0 = greedy)"},
    {"top_p", "--top-p", NULL, K_FLOAT, OFF(sampling.top_p), 1e-9, 1, true, "P        default top-p (0.8)"},
    {"top_k", "--top-k", NULL, K_INT, OFF(sampling.top_k), 0, 1 << 24, true, "N        default top-k (20; 0 = off)"},
    {"min_p", "--min-p", NULL, K_FLOAT, OFF(sampling.min_p), 0, 1, true, "P        default min-p (0)"},
    {"repeat_penalty", "--repeat-penalty", NULL, K_FLOAT, OFF(sampling.repeat_penalty), 1e-9, 100, true,
     "F  default repetition penalty (1 = off)"},
    {"presence_penalty", "--presence-penalty", NULL, K_FLOAT, OFF(sampling.presence_penalty), -100, 100, true,
     "F  default presence penalty (0)"},
    {"frequency_penalty", "--frequency-penalty", NULL, K_FLOAT, OFF(sampling.frequency_penalty), -100, 100, true,
     "F  default frequency penalty (0)"},
    {"repeat_last_n", "--repeat-last-n", NULL, K_INT, OFF(sampling.penalty_last_n), 0, 1 << 24, true,
     "N  tokens the penalties look back over (64)"},
    {"seed", "--seed", NULL, K_SEED, OFF(sampling.seed), 0, 0, true,
     "N         seed for requests without one (default: a new one per request)"},
    {"sampling", NULL, NULL, K_SAMPLING, 0, 0, 0, false, NULL},
    {"args", NULL, NULL, K_ARGS, 0, 0, 0, false, NULL},
};
#define N_KEYS (sizeof keys / sizeof keys[0])

void st_server_config_init(st_server_config *c) {
    *c = (st_server_config){
        .host = strdup("127.0.0.1"), .port = 8080, .parallel = 1, .queue = 64, .batch = 512,
        .kv = strdup("f16"), .prompt_cache = 4, .max_body_mib = 8, .timeout = 60, .drain_timeout = 30,
        .thinking = -1, .gpu = strdup("auto"), .cors_origins = json_array(), .pcie_frac = -1,
        .sampling = strata_sampling_default(),
    };
}

void st_server_config_free(st_server_config *c) {
    free(c->model);
    free(c->host);
    free(c->api_key);
    free(c->kv);
    free(c->gpu);
    free(c->expert_cache);
    free(c->expert_profile);
    json_decref(c->layer_split);
    json_decref(c->cors_origins);
    memset(c, 0, sizeof *c);
}

// Problems found so far, one line each.
typedef struct errs {
    char buf[4096];
    size_t len;
    int n;
} errs;

// Returns 0, so a check can read `return err_add(...)`.
__attribute__((format(printf, 2, 3))) static int err_add(errs *e, const char *fmt, ...) {
    e->n++;
    if (e->len >= sizeof e->buf - 1) return 0;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(e->buf + e->len, sizeof e->buf - e->len, fmt, ap);
    va_end(ap);
    if (w > 0) e->len += (size_t)w;
    if (e->len < sizeof e->buf - 1) e->buf[e->len++] = '\n', e->buf[e->len] = 0;
    else e->len = sizeof e->buf - 1;
    return 0;
}

static const key *find_key(const char *name, bool sampling_only) {
    for (size_t i = 0; i < N_KEYS; i++)
        if ((!strcmp(keys[i].name, name) || (keys[i].alt && !strcmp(keys[i].alt, name))) &&
            (!sampling_only || keys[i].sampling))
            return &keys[i];
    return NULL;
}

static const key *find_flag(const char *flag) {
    for (size_t i = 0; i < N_KEYS; i++)
        if (keys[i].flag && (!strcmp(keys[i].flag, flag) || (keys[i].alt && keys[i].alt[0] == '-' && !strcmp(keys[i].alt, flag))))
            return &keys[i];
    return NULL;
}

static bool is_digits(const char *s) {
    if (!*s) return false;
    for (; *s; s++)
        if (*s < '0' || *s > '9') return false;
    return true;
}

static int set_str(char **dst, const char *v) {
    free(*dst);
    *dst = strdup(v);
    return 0;
}

// Sets one key from a JSON value; `where` names it in messages ("port", "sampling.top_p",
// "--port"). append: a repeatable flag adds to the list instead of replacing it.
static int set_value(st_server_config *c, const key *k, json_t *v, const char *where, bool append, errs *e) {
    char *base = (char *)c;
    switch (k->kind) {
    case K_STR:
        if (!json_is_string(v)) return err_add(e, "%s: expected a string", where);
        if (!json_string_length(v) && strcmp(k->name, "api_key")) return err_add(e, "%s: must not be empty", where);
        return set_str((char **)(base + k->off), json_string_value(v));
    case K_INT: {
        if (!json_is_integer(v)) return err_add(e, "%s: expected an integer in [%.0f, %.0f]", where, k->lo, k->hi);
        json_int_t x = json_integer_value(v);
        if (x < k->lo || x > k->hi) return err_add(e, "%s: %lld is not in [%.0f, %.0f]", where, (long long)x, k->lo, k->hi);
        *(int *)(base + k->off) = (int)x;
        return 0;
    }
    case K_FLOAT: {
        if (!json_is_number(v)) return err_add(e, "%s: expected a number in [%g, %g]", where, k->lo, k->hi);
        double x = json_number_value(v);
        if (!(x >= k->lo && x <= k->hi)) return err_add(e, "%s: %g is not in [%g, %g]", where, x, k->lo, k->hi);
        *(float *)(base + k->off) = (float)x;
        return 0;
    }
    case K_BOOL:
        if (!json_is_boolean(v)) return err_add(e, "%s: expected true or false", where);
        *(bool *)(base + k->off) = json_is_true(v);
        return 0;
    case K_SEED:
        if (!json_is_integer(v) || json_integer_value(v) < 0) return err_add(e, "%s: expected a non-negative integer", where);
        c->sampling.seed = (uint64_t)json_integer_value(v);
        c->seed_set = true;
        return 0;
    case K_KV:
        if (!json_is_string(v) || (strcmp(json_string_value(v), "f16") && strcmp(json_string_value(v), "q8_0")))
            return err_add(e, "%s: expected \"f16\" or \"q8_0\"", where);
        return set_str(&c->kv, json_string_value(v));
    case K_THINK:
        if (json_is_boolean(v)) c->thinking = json_is_true(v);
        else if (json_is_string(v) && !strcmp(json_string_value(v), "on")) c->thinking = 1;
        else if (json_is_string(v) && !strcmp(json_string_value(v), "off")) c->thinking = 0;
        else if (json_is_string(v) && !strcmp(json_string_value(v), "auto")) c->thinking = -1;
        else err_add(e, "%s: expected \"on\", \"off\", \"auto\" or a boolean", where);
        return 0;
    case K_GPU: {
        char num[32];
        if (json_is_integer(v) && json_integer_value(v) >= 0) {
            snprintf(num, sizeof num, "%lld", (long long)json_integer_value(v));
            return set_str(&c->gpu, num);
        }
        const char *s = json_string_value(v);
        if (s && (!strcmp(s, "auto") || !strcmp(s, "cpu") || is_digits(s))) return set_str(&c->gpu, s);
        return err_add(e, "%s: expected a GPU number, \"cpu\" or \"auto\"", where);
    }
    case K_SPLIT: {
        bool ok = json_is_string(v) || json_is_null(v);
        if (json_is_array(v)) {
            size_t i;
            json_t *x;
            ok = true;
            json_array_foreach(v, i, x) ok = ok && json_is_integer(x) && json_integer_value(x) >= 0;
        }
        if (!ok) return err_add(e, "%s: expected a string or an array of layer numbers", where);
        json_decref(c->layer_split);
        c->layer_split = json_is_null(v) ? NULL : json_incref(v);
        return 0;
    }
    case K_ORIGINS: {
        if (append && json_is_string(v)) {
            json_array_append(c->cors_origins, v);
            return 0;
        }
        bool ok = json_is_array(v);
        size_t i;
        json_t *x;
        if (ok) json_array_foreach(v, i, x) ok = ok && json_is_string(x) && json_string_length(x);
        if (!ok) return err_add(e, "%s: expected an array of origins (\"https://host:port\" or \"*\")", where);
        json_decref(c->cors_origins);
        c->cors_origins = json_copy(v);
        return 0;
    }
    case K_SAMPLING: {
        if (!json_is_object(v)) return err_add(e, "%s: expected an object of sampling settings", where);
        const char *name;
        json_t *x;
        json_object_foreach(v, name, x) {
            char w[160];
            snprintf(w, sizeof w, "%s.%s", where, name);
            const key *sk = find_key(name, true);
            if (!sk) err_add(e, "%s: unknown sampling key (temperature, top_p, top_k, min_p, repeat_penalty, "
                             "presence_penalty, frequency_penalty, repeat_last_n, seed)", w);
            else set_value(c, sk, x, w, false, e);
        }
        return 0;
    }
    case K_ARGS:
        return 0; // handled by the loader, after the keys
    }
    return 0;
}

// A flag's text as the JSON value its key takes.
static json_t *flag_value(const key *k, const char *text) {
    char *end;
    errno = 0;
    switch (k->kind) {
    case K_INT: {
        long long x = strtoll(text, &end, 10);
        return errno || end == text || *end ? json_string(text) : json_integer(x);
    }
    case K_FLOAT: {
        double x = strtod(text, &end);
        return errno || end == text || *end ? json_string(text) : json_real(x);
    }
    case K_SEED: {
        if (!is_digits(text)) return json_string(text);
        unsigned long long x = strtoull(text, &end, 10);
        return errno || x > (unsigned long long)INT64_MAX ? json_string(text) : json_integer((json_int_t)x);
    }
    case K_GPU:
        return is_digits(text) ? json_integer(strtoll(text, NULL, 10)) : json_string(text);
    default:
        return json_string(text);
    }
}

static void apply_args(st_server_config *c, int argc, char **argv, const char *where, errs *e) {
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        char w[160];
        if (where) snprintf(w, sizeof w, "%s[%d] %s", where, i, a);
        else snprintf(w, sizeof w, "%s", a);
        const key *k = find_flag(a);
        if (!k) {
            err_add(e, "%s: unknown flag (see strata serve --help)", w);
            if (i + 1 < argc && argv[i + 1][0] != '-') i++; // its value, most likely
            continue;
        }
        if (k->kind == K_BOOL) { // a switch: no value
            set_value(c, k, json_true(), w, true, e);
            continue;
        }
        if (i + 1 >= argc) {
            err_add(e, "%s: needs a value", w);
            break;
        }
        json_t *v = flag_value(k, argv[++i]);
        char wv[256];
        snprintf(wv, sizeof wv, "%s '%s'", w, argv[i]);
        if (v) set_value(c, k, v, wv, true, e);
        json_decref(v);
    }
}

// what: NULL, or where the problems are ("config strata-x.json").
static st_status report(const errs *e, const char *what) {
    if (!e->n) return ST_OK;
    return st_fail(ST_ERR_ARG, "%s%s%d problem%s:\n%.*s", what ? what : "", what ? ": " : "", e->n, e->n > 1 ? "s" : "",
                   (int)(e->len ? e->len - 1 : 0), e->buf);
}

st_status st_server_config_args(st_server_config *c, int argc, char **argv) {
    errs e = {.len = 0};
    apply_args(c, argc, argv, NULL, &e);
    return report(&e, NULL);
}

st_status st_server_config_load(st_server_config *c, const char *path) {
    json_error_t je;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        if (access(path, R_OK)) return st_fail(ST_ERR_IO, "config %s: %s", path, strerror(errno));
        return st_fail(ST_ERR_FORMAT, "config %s: not valid JSON: %s (line %d, column %d)", path, je.text, je.line,
                       je.column);
    }
    if (!json_is_object(root)) {
        json_decref(root);
        return st_fail(ST_ERR_FORMAT, "config %s: expected a JSON object of settings", path);
    }
    errs e = {.len = 0};
    const char *name;
    json_t *v, *args = NULL;
    json_object_foreach(root, name, v) {
        const key *k = find_key(name, false);
        if (!k) err_add(&e, "%s: unknown key (see docs/SERVER.md or strata serve --help)", name);
        else if (k->kind == K_ARGS) args = v;
        else set_value(c, k, v, name, false, &e);
    }
    if (args) { // extra flags, as on the command line, after the keys
        size_t n = json_array_size(args), i;
        json_t *x;
        bool ok = json_is_array(args);
        if (ok) json_array_foreach(args, i, x) ok = ok && json_is_string(x);
        if (!ok) err_add(&e, "args: expected an array of strings (flags and their values)");
        else {
            char **argv = calloc(n + 1, sizeof *argv);
            if (!argv) {
                json_decref(root);
                return st_fail(ST_ERR_NOMEM, "out of memory");
            }
            json_array_foreach(args, i, x) argv[i] = (char *)json_string_value(x);
            apply_args(c, (int)n, argv, "args", &e);
            free(argv);
        }
    }
    json_decref(root);
    char what[1100];
    snprintf(what, sizeof what, "config %s", path);
    return report(&e, what);
}

st_status st_server_config_check(const st_server_config *c) {
    errs e = {.len = 0};
    if (!c->model) err_add(&e, "model: no model given (--model FILE or \"model\" in the config)");
    else if (access(c->model, R_OK)) err_add(&e, "model: %s: %s", c->model, strerror(errno));
    if (c->sampling.top_p <= 0) err_add(&e, "top_p: must be above 0");
    size_t i;
    json_t *x;
    json_array_foreach(c->cors_origins, i, x) {
        const char *o = json_string_value(x);
        if (strcmp(o, "*") && strncmp(o, "http://", 7) && strncmp(o, "https://", 8))
            err_add(&e, "cors_origins[%zu]: '%s' is not an origin (http://host[:port], https://... or *)", i, o);
    }
    return report(&e, NULL);
}

void st_server_config_help(FILE *f) {
    for (size_t i = 0; i < N_KEYS; i++) {
        const key *k = &keys[i];
        if (!k->flag) continue;
        // help is "VALUE  what it does": the value goes beside the flag, the rest in a column.
        const char *gap = strstr(k->help, "  ");
        int vlen = gap ? (int)(gap - k->help) : 0;
        const char *desc = gap ? gap : k->help;
        while (*desc == ' ') desc++;
        char fl[80];
        snprintf(fl, sizeof fl, "%s%s%s %.*s", k->alt && k->alt[0] == '-' ? k->alt : "",
                 k->alt && k->alt[0] == '-' ? ", " : "", k->flag, vlen, k->help);
        fprintf(f, "  %-30s %s\n", fl, desc);
    }
}
