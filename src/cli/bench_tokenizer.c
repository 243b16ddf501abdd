// bench_tokenizer: `strata bench tokenizer`: single-threaded tokenizing MB/s on a code + prose
// corpus, next to Hugging Face `tokenizers` (single-threaded, run through bench/tokenizer_hf.py)
// on the same documents in the same run, with a check that both produced the same ids.

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "tokenizer/tokenizer.h"

#define DOC_SEP '\x1e' // between documents in the corpus file (never inside one)

// Default corpus sources: (folder, file suffix, kind). Missing folders are skipped.
static const struct {
    const char *dir, *suffix, *kind;
} sources[] = {
    {"/usr/lib/python3.11", ".py", "code"},
    {"/usr/include", ".h", "code"},
    {"src", ".c", "code"},
    {"/usr/share/doc/nodejs/api", ".md", "prose"},
    {"/usr/share/vim/vim90/doc", ".txt", "prose"},
    {"/usr/share/common-licenses", "", "prose"},
};
#define N_SOURCES (int)(sizeof sources / sizeof sources[0])

typedef struct pathlist {
    char **v;
    size_t n, cap;
} pathlist;

static pathlist walk_list; // nftw has no user pointer
static const char *walk_suffix;

static int walk_cb(const char *path, const struct stat *sb, int type, struct FTW *ftw) {
    (void)ftw;
    size_t len = strlen(path), sl = strlen(walk_suffix);
    if (type != FTW_F || sb->st_size <= 0 || sb->st_size > (1 << 20)) return 0;
    if (len < sl || strcmp(path + len - sl, walk_suffix)) return 0;
    if (walk_list.n == walk_list.cap) {
        size_t c = walk_list.cap ? walk_list.cap * 2 : 256;
        char **p = realloc(walk_list.v, c * sizeof *p);
        if (!p) return 1;
        walk_list.v = p, walk_list.cap = c;
    }
    walk_list.v[walk_list.n] = strdup(path);
    return walk_list.v[walk_list.n++] ? 0 : 1;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static bool valid_utf8(const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        unsigned b = s[i];
        int len = b < 0x80 ? 1 : b >= 0xC2 && b <= 0xDF ? 2 : b >= 0xE0 && b <= 0xEF ? 3
                : b >= 0xF0 && b <= 0xF4 ? 4 : 0;
        if (!len || i + (size_t)len > n) return false;
        for (int k = 1; k < len; k++)
            if ((s[i + k] & 0xC0) != 0x80) return false;
        if ((b == 0xE0 && s[i + 1] < 0xA0) || (b == 0xED && s[i + 1] > 0x9F) ||
            (b == 0xF0 && s[i + 1] < 0x90) || (b == 0xF4 && s[i + 1] > 0x8F))
            return false;
        i += (size_t)len;
    }
    return true;
}

typedef struct corpus {
    char *data; // documents separated by DOC_SEP
    size_t len, cap;
    size_t n_docs, code_bytes, prose_bytes;
} corpus;

static bool corpus_add(corpus *c, const char *doc, size_t n) {
    if (c->len + n + 2 > c->cap) {
        size_t cap = c->cap ? c->cap * 2 : 1 << 24;
        while (cap < c->len + n + 2) cap *= 2;
        char *p = realloc(c->data, cap);
        if (!p) return false;
        c->data = p, c->cap = cap;
    }
    if (c->n_docs) c->data[c->len++] = DOC_SEP;
    memcpy(c->data + c->len, doc, n);
    c->len += n;
    c->data[c->len] = 0;
    c->n_docs++;
    return true;
}

// Takes files from every source in turn until `limit` bytes: a fixed mix of code and prose.
static st_status corpus_build(corpus *c, size_t limit) {
    pathlist lists[N_SOURCES] = {{0}};
    for (int s = 0; s < N_SOURCES; s++) {
        walk_list = (pathlist){0};
        walk_suffix = sources[s].suffix;
        nftw(sources[s].dir, walk_cb, 16, FTW_PHYS);
        qsort(walk_list.v, walk_list.n, sizeof *walk_list.v, cmp_str);
        lists[s] = walk_list;
    }
    size_t next[N_SOURCES] = {0};
    bool progress = true;
    st_status st = ST_OK;
    while (c->len < limit && progress && st == ST_OK) {
        progress = false;
        for (int s = 0; s < N_SOURCES && c->len < limit; s++) {
            while (next[s] < lists[s].n) {
                char *data;
                size_t size;
                const char *path = lists[s].v[next[s]++];
                if (st_read_file(path, &data, &size) != ST_OK) continue;
                bool ok = size > 0 && !memchr(data, DOC_SEP, size) &&
                          valid_utf8((const unsigned char *)data, size);
                if (ok) {
                    if (!corpus_add(c, data, size)) st = st_fail(ST_ERR_NOMEM, "corpus: out of memory");
                    if (!strcmp(sources[s].kind, "code")) c->code_bytes += size;
                    else c->prose_bytes += size;
                }
                st_free(data);
                if (ok) {
                    progress = true;
                    break;
                }
            }
        }
    }
    for (int s = 0; s < N_SOURCES; s++) {
        for (size_t i = 0; i < lists[s].n; i++) free(lists[s].v[i]);
        free(lists[s].v);
    }
    if (st == ST_OK && c->len == 0)
        st = st_fail(ST_ERR_IO, "no corpus files found (give one with --corpus FILE)");
    return st;
}

static void cpu_name(char *buf, size_t size) {
    snprintf(buf, size, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10) && strchr(line, ':')) {
            snprintf(buf, size, "%s", strchr(line, ':') + 2);
            buf[strcspn(buf, "\n")] = 0;
            break;
        }
    fclose(f);
}

static void bench_usage(FILE *f) {
    fprintf(f,
            "usage: strata bench tokenizer (--tokenizer-json FILE | -m GGUF [--hf-json FILE])\n"
            "                              [--corpus FILE] [--mb N] [--repeat N] [--no-hf]\n\n"
            "Tokenizes a code + prose corpus single-threaded and reports MB/s, then runs\n"
            "Hugging Face tokenizers (single-threaded) on the same documents through\n"
            "bench/tokenizer_hf.py and reports its MB/s and whether the ids are identical.\n"
            "  --corpus FILE  documents separated by the byte 0x1E (default: files found on this\n"
            "                 machine: Python and C sources, Markdown and text docs)\n"
            "  --mb N         size of the default corpus (default 16)\n"
            "  --repeat N     passes; the best counts (default 3)\n"
            "  --hf-json FILE the tokenizer.json for the HF side when -m is used\n"
            "  --no-hf        skip the HF comparison\n"
            "  env STRATA_PYTHON: the python with `tokenizers` (default .venv/bin/python)\n");
}

int st_bench_tokenizer(int argc, char **argv) {
    const char *gguf = NULL, *json = NULL, *hf_json = NULL, *corpus_path = NULL, *v;
    int64_t mb = 16, repeat = 3;
    bool no_hf = false, bad = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            bench_usage(stdout);
            return 0;
        }
        if (st_cli_opt(argc, argv, &i, "-m", &gguf, &bad)) continue;
        if (st_cli_opt(argc, argv, &i, "--tokenizer-json", &json, &bad)) continue;
        if (st_cli_opt(argc, argv, &i, "--hf-json", &hf_json, &bad)) continue;
        if (st_cli_opt(argc, argv, &i, "--corpus", &corpus_path, &bad)) continue;
        if (st_cli_opt(argc, argv, &i, "--mb", &v, &bad)) {
            if (v && !st_cli_int("--mb", v, 1, 4096, &mb)) return 2;
            continue;
        }
        if (st_cli_opt(argc, argv, &i, "--repeat", &v, &bad)) {
            if (v && !st_cli_int("--repeat", v, 1, 100, &repeat)) return 2;
            continue;
        }
        if (!strcmp(argv[i], "--no-hf")) no_hf = true;
        else {
            fprintf(stderr, "strata bench tokenizer: unknown option '%s'\n", argv[i]);
            return 2;
        }
    }
    if (bad || !gguf == !json) {
        bench_usage(stderr);
        return 2;
    }
    if (!hf_json) hf_json = json;
    if (!hf_json) no_hf = true;

    double t0 = st_time_s();
    st_tokenizer *tok;
    st_status st = st_cli_load_tokenizer(gguf, json, &tok);
    if (st != ST_OK) return st_cli_fail(st);
    double t_load = st_time_s() - t0;

    corpus c = {0};
    if (corpus_path) {
        size_t size;
        st = st_read_file(corpus_path, &c.data, &size);
        c.len = size;
        c.n_docs = 1;
        for (size_t i = 0; i < size; i++) c.n_docs += c.data[i] == DOC_SEP;
    } else
        st = corpus_build(&c, (size_t)mb << 20);
    if (st != ST_OK) {
        st_tokenizer_free(tok);
        return st_cli_fail(st);
    }

    char cpu[256], commit[128] = "unknown";
    cpu_name(cpu, sizeof cpu);
    st_bench_commit(commit, sizeof commit);
    printf("strata bench tokenizer\n  cpu:     %s\n  commit:  %s\n  tokenizer: %s (loaded in "
           "%.2f s)\n  corpus:  %s, %.2f MB in %zu documents", cpu, commit, gguf ? gguf : json,
           t_load, corpus_path ? corpus_path : "default mix", c.len / 1e6, c.n_docs);
    if (!corpus_path) printf(" (code %.1f MB, prose %.1f MB)", c.code_bytes / 1e6, c.prose_bytes / 1e6);
    printf("\n");

    // Strata: each document tokenized on its own, one thread; best of `repeat` passes.
    double best = 1e30;
    size_t n_ids = 0;
    uint64_t hash = 1469598103934665603ull;
    for (int64_t r = 0; r < repeat && st == ST_OK; r++) {
        size_t total = 0;
        uint64_t h = 1469598103934665603ull;
        double ts = st_time_s();
        for (size_t off = 0; off <= c.len && st == ST_OK;) {
            const char *e = memchr(c.data + off, DOC_SEP, c.len - off);
            size_t dl = e ? (size_t)(e - (c.data + off)) : c.len - off;
            int32_t *ids;
            size_t n;
            st = st_tokenize(tok, c.data + off, dl, ST_TOKENIZE_SPECIAL, &ids, &n);
            if (st != ST_OK) break;
            for (size_t k = 0; k < n; k++) h = (h ^ (uint32_t)ids[k]) * 1099511628211ull;
            total += n;
            free(ids);
            off += dl + 1;
        }
        double dt = st_time_s() - ts;
        if (dt < best) best = dt;
        n_ids = total, hash = h;
    }
    st_tokenizer_free(tok);
    if (st != ST_OK) {
        free(c.data);
        return st_cli_fail(st);
    }
    double strata_mbs = c.len / 1e6 / best;
    printf("  strata:  %8.2f MB/s  (%.3f s, %zu tokens, %.2f bytes/token, ids hash %016llx)\n",
           strata_mbs, best, n_ids, (double)c.len / (double)(n_ids ? n_ids : 1),
           (unsigned long long)hash);

    int rc = 0;
    if (!no_hf) {
        char tmp[] = "/tmp/strata-bench-tok-XXXXXX";
        int fd = mkstemp(tmp);
        FILE *f = fd >= 0 ? fdopen(fd, "wb") : NULL;
        bool ok = f && fwrite(c.data, 1, c.len, f) == c.len;
        if (f) ok = fclose(f) == 0 && ok;
        if (!ok) {
            fprintf(stderr, "strata bench tokenizer: cannot write %s\n", tmp);
            rc = 1;
        } else {
            const char *py = getenv("STRATA_PYTHON");
            if (!py) py = access(".venv/bin/python", X_OK) == 0 ? ".venv/bin/python" : "python3";
            char cmd[4096];
            snprintf(cmd, sizeof cmd, "RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false '%s' "
                     "bench/tokenizer_hf.py '%s' '%s' %d", py, hf_json, tmp, (int)repeat);
            FILE *p = popen(cmd, "r");
            double hf_mbs = 0, hf_s = 0;
            unsigned long long hf_hash = 0;
            size_t hf_n = 0;
            char line[512];
            bool got = false;
            while (p && fgets(line, sizeof line, p))
                if (sscanf(line, "hf mbs=%lf s=%lf tokens=%zu hash=%llx", &hf_mbs, &hf_s, &hf_n,
                           &hf_hash) == 4)
                    got = true;
            int prc = p ? pclose(p) : -1;
            if (!got || prc != 0) {
                fprintf(stderr, "strata bench tokenizer: `%s` failed (run from the repository "
                        "root; needs tokenizers)\n", cmd);
                rc = 1;
            } else {
                printf("  hf:      %8.2f MB/s  (%.3f s, %zu tokens, ids hash %016llx; tokenizers, "
                       "1 thread)\n", hf_mbs, hf_s, hf_n, hf_hash);
                printf("  ratio:   strata / hf = %.2fx; ids %s\n", strata_mbs / hf_mbs,
                       hf_n == n_ids && hf_hash == hash ? "identical" : "DIFFER");
                if (hf_n != n_ids || hf_hash != hash) rc = 1;
            }
        }
        unlink(tmp);
    }
    free(c.data);
    return rc;
}
