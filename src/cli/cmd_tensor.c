// cli: `strata tensor FILE NAME [--rows A:B] --out F`: one tensor (or a range of its rows)
// dequantized to little-endian float32, for parity checks against other implementations.

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "gguf/gguf.h"

// Why: elements converted per step; a multiple of every block size (32, 256), small enough to
// stay in cache, large enough that the write calls do not dominate.
#define CHUNK 65536

static void tensor_usage(FILE *f) {
    fprintf(f, "usage: strata tensor FILE NAME [--rows A:B] --out F\n"
               "  Writes tensor NAME dequantized to little-endian float32, ne0 values per row, rows\n"
               "  one after the other (ggml order: ne0 is contiguous).\n"
               "  --rows A:B  only rows A (inclusive) to B (exclusive). A row is one ne0-long vector;\n"
               "              a tensor of ne = {ne0, ne1, ne2, ne3} has ne1*ne2*ne3 rows, row r being\n"
               "              (i1, i2, i3) with r = i1 + ne1*(i2 + ne2*i3). A or B may be left out\n"
               "              (A:, :B). A 1-D tensor has one row.\n"
               "  --out F     output file ('-' for standard output)\n");
}

static size_t edit_distance(const char *a, const char *b) {
    size_t n = strlen(a), m = strlen(b);
    if (n > 256 || m > 256) return (size_t)-1;
    size_t row[257];
    for (size_t j = 0; j <= m; j++) row[j] = j;
    for (size_t i = 1; i <= n; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= m; j++) {
            size_t up = row[j], best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            diag = up;
            row[j] = best;
        }
    }
    return row[m];
}

// "tensor 'x' not found in m.gguf (N tensors); similar: a, b, c"
static int not_found(const st_gguf *g, const char *name) {
    enum { SHOW = 5 };
    int64_t best[SHOW];
    size_t dist[SHOW];
    int nb = 0;
    for (int64_t i = 0; i < st_gguf_tensor_count(g); i++) {
        const char *tn = st_gguf_tensor_at(g, i)->name;
        size_t d = edit_distance(name, tn);
        if (strstr(tn, name) || strstr(name, tn)) d = d / 4; // a part of the name counts as close
        int k = nb < SHOW ? nb++ : SHOW;
        if (k == SHOW && d >= dist[SHOW - 1]) continue;
        if (k == SHOW) k = SHOW - 1;
        while (k > 0 && dist[k - 1] > d) {
            best[k] = best[k - 1];
            dist[k] = dist[k - 1];
            k--;
        }
        best[k] = i;
        dist[k] = d;
    }
    fprintf(stderr, "strata: tensor '%s' not found in %s (%lld tensors)", name, st_gguf_path(g),
            (long long)st_gguf_tensor_count(g));
    for (int k = 0; k < nb; k++)
        fprintf(stderr, "%s%s", k ? ", " : "; similar: ", st_gguf_tensor_at(g, best[k])->name);
    fputc('\n', stderr);
    return 1;
}

// Parses "A:B", "A:", ":B" into [*a, *b) within [0, rows].
static int parse_rows(const char *text, int64_t rows, int64_t *a, int64_t *b) {
    const char *colon = strchr(text, ':');
    if (!colon) {
        fprintf(stderr, "strata tensor: --rows '%s' is not A:B\n", text);
        return 2;
    }
    *a = 0;
    *b = rows;
    char *end;
    if (colon != text) {
        errno = 0;
        *a = strtoll(text, &end, 10);
        if (errno || end != colon) {
            fprintf(stderr, "strata tensor: --rows '%s': '%.*s' is not an integer\n", text,
                    (int)(colon - text), text);
            return 2;
        }
    }
    if (colon[1]) {
        errno = 0;
        *b = strtoll(colon + 1, &end, 10);
        if (errno || *end) {
            fprintf(stderr, "strata tensor: --rows '%s': '%s' is not an integer\n", text, colon + 1);
            return 2;
        }
    }
    if (*a < 0 || *a >= *b || *b > rows) {
        fprintf(
            stderr,
            "strata tensor: --rows %s is not a non-empty range within 0:%lld (the tensor has %lld rows)\n",
            text, (long long)rows, (long long)rows);
        return 1;
    }
    return 0;
}

// Converts n elements of the plain integer / f64 types (no quant kernels handle those).
static void plain_to_f32(st_type type, const uint8_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        switch (type) {
        case ST_TYPE_I8: dst[i] = (int8_t)src[i]; break;
        case ST_TYPE_I16: {
            int16_t v;
            memcpy(&v, src + 2 * i, 2);
            dst[i] = v;
            break;
        }
        case ST_TYPE_I32: {
            int32_t v;
            memcpy(&v, src + 4 * i, 4);
            dst[i] = (float)v;
            break;
        }
        case ST_TYPE_I64: {
            int64_t v;
            memcpy(&v, src + 8 * i, 8);
            dst[i] = (float)v;
            break;
        }
        case ST_TYPE_F64: {
            double v;
            memcpy(&v, src + 8 * i, 8);
            dst[i] = (float)v;
            break;
        }
        default: ST_ASSERT(!"not a plain type");
        }
    }
}

static bool is_plain(st_type t) {
    return t == ST_TYPE_I8 || t == ST_TYPE_I16 || t == ST_TYPE_I32 || t == ST_TYPE_I64 || t == ST_TYPE_F64;
}

// Types st_dequantize handles: those with kernels plus the activation formats.
static bool has_dequant(st_type t) {
    const st_type_info *ti = st_type_get(t);
    return ti && (ti->compute || t == ST_TYPE_Q8_1 || t == ST_TYPE_Q8_K);
}

static int write_tensor(const st_gguf_tensor *t, int64_t r0, int64_t r1, FILE *f, const char *out) {
    const st_type_info *ti = st_type_get(t->type);
    size_t row_bytes = st_row_bytes(t->type, t->ne[0]);
    const uint8_t *src = (const uint8_t *)t->data + (size_t)r0 * row_bytes;
    int64_t total = (r1 - r0) * t->ne[0], done = 0;
    float *buf = st_alloc(CHUNK * sizeof(float));
    if (!buf) return st_cli_fail(ST_ERR_NOMEM);
    while (done < total) {
        int64_t n =
            total - done < CHUNK ? total - done : CHUNK; // a multiple of the block: total and CHUNK are
        if (is_plain(t->type))
            plain_to_f32(t->type, src, buf, n);
        else
            st_dequantize(t->type, src, buf, n);
        src += (size_t)(n / ti->block) * (size_t)ti->block_bytes;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        for (int64_t i = 0; i < n; i++) {
            uint32_t v;
            memcpy(&v, &buf[i], 4);
            v = __builtin_bswap32(v);
            memcpy(&buf[i], &v, 4);
        }
#endif
        if (fwrite(buf, sizeof(float), (size_t)n, f) != (size_t)n) {
            fprintf(stderr, "strata: %s: write failed: %s\n", out, strerror(errno));
            st_free(buf);
            return 1;
        }
        done += n;
    }
    st_free(buf);
    return 0;
}

int st_cmd_tensor(int argc, char **argv) {
    const char *path = NULL, *name = NULL, *rows = NULL, *out = NULL;
    bool bad = false;
    for (int i = 1; i < argc && !bad; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            tensor_usage(stdout);
            return 0;
        }
        if (st_cli_opt(argc, argv, &i, "--rows", &rows, &bad) ||
            st_cli_opt(argc, argv, &i, "--out", &out, &bad) || st_cli_opt(argc, argv, &i, "-o", &out, &bad))
            continue;
        if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "strata tensor: unknown option '%s'\n", argv[i]);
            bad = true;
        } else if (!path) {
            path = argv[i];
        } else if (!name) {
            name = argv[i];
        } else {
            fprintf(stderr, "strata tensor: unexpected argument '%s'\n", argv[i]);
            bad = true;
        }
    }
    if (!bad && (!path || !name || !out)) {
        fprintf(stderr, "strata tensor: %s\n",
                !path   ? "FILE is missing"
                : !name ? "NAME is missing"
                        : "--out F is missing");
        bad = true;
    }
    if (bad) {
        tensor_usage(stderr);
        return 2;
    }
    st_gguf *g;
    st_status s = st_gguf_open(path, &g);
    if (s != ST_OK) return st_cli_fail(s);
    int rc = 0;
    const st_gguf_tensor *t = st_gguf_find_tensor(g, name);
    if (!t) {
        rc = not_found(g, name);
        st_gguf_free(g);
        return rc;
    }
    int64_t nrows = t->ne[1] * t->ne[2] * t->ne[3], r0 = 0, r1 = nrows;
    if (rows && (rc = parse_rows(rows, nrows, &r0, &r1)) != 0) {
        st_gguf_free(g);
        return rc;
    }
    if (!is_plain(t->type) && !has_dequant(t->type)) {
        fprintf(stderr, "strata: tensor '%s' has type %s, which Strata cannot dequantize\n", name,
                st_type_name(t->type));
        st_gguf_free(g);
        return 1;
    }
    bool to_stdout = !strcmp(out, "-");
    FILE *f = to_stdout ? stdout : fopen(out, "wb");
    if (!f) {
        fprintf(stderr, "strata: cannot open '%s' for writing: %s\n", out, strerror(errno));
        st_gguf_free(g);
        return 1;
    }
    rc = write_tensor(t, r0, r1, f, out);
    if (!to_stdout) {
        if (fclose(f) != 0 && rc == 0) {
            fprintf(stderr, "strata: %s: write failed: %s\n", out, strerror(errno));
            rc = 1;
        }
        if (rc) unlink(out);
    } else if (fflush(stdout) != 0 && rc == 0) {
        fprintf(stderr, "strata: standard output: write failed: %s\n", strerror(errno));
        rc = 1;
    }
    if (rc == 0)
        fprintf(stderr, "strata: wrote rows %lld:%lld of '%s' (%s, %lld x %lld floats) to %s\n",
                (long long)r0, (long long)r1, name, st_type_name(t->type), (long long)(r1 - r0),
                (long long)t->ne[0], to_stdout ? "standard output" : out);
    st_gguf_free(g);
    return rc;
}
