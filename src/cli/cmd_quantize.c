// cli: `strata quantize IN OUT --type T [--experts T] [--dense T]`: rewrites a GGUF with its
// weight matrices in another type. Tensors stream from the mapped input through the pool's
// threads into the writer a chunk of rows at a time, so a model larger than RAM works.

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "gguf/gguf.h"

// Why: rows per chunk are chosen so a chunk holds about this many f32 input bytes: large enough
// that the pool's threads each get real work, small enough that the buffers stay modest.
#define CHUNK_BYTES (32u << 20)

static const st_type weight_types[] = {
    ST_TYPE_F32,  ST_TYPE_F16,  ST_TYPE_BF16, ST_TYPE_Q8_0,   ST_TYPE_Q6_K,
    ST_TYPE_Q5_K, ST_TYPE_Q5_1, ST_TYPE_Q5_0, ST_TYPE_Q4_K,   ST_TYPE_Q4_1,
    ST_TYPE_Q4_0, ST_TYPE_Q3_K, ST_TYPE_Q2_K, ST_TYPE_IQ4_NL, ST_TYPE_IQ4_XS,
};
#define N_WEIGHT_TYPES (int)(sizeof weight_types / sizeof weight_types[0])

static void quantize_usage(FILE *f) {
    fprintf(f, "usage: strata quantize IN.gguf OUT.gguf --type TYPE [--experts TYPE] [--dense TYPE] [-t N]\n"
               "  Writes OUT with every weight matrix of IN converted to TYPE.\n"
               "  --type TYPE     for all matrices (2-D and up)\n"
               "  --experts TYPE  for the stacked routed experts (ffn_*_exps), overriding --type\n"
               "  --dense TYPE    for every other matrix (attention, shared expert, token_embd,\n"
               "                  output, ...), overriding --type\n"
               "  -t, --threads N CPU threads (default: all cores)\n"
               "  TYPE: ");
    for (int i = 0; i < N_WEIGHT_TYPES; i++)
        fprintf(f, "%s%s", i ? ", " : "", st_type_name(weight_types[i]));
    fprintf(f, "\n"
               "  Kept as they are: 1-D tensors (norms, biases, ssm_a, ssm_dt), ssm_conv1d, the router\n"
               "  (ffn_gate_inp) and the shared-expert gate (ffn_gate_inp_shexp). A matrix whose rows\n"
               "  do not fit TYPE's block size gets the nearest type that fits (said once per tensor).\n"
               "  Metadata are copied; general.file_type follows the type of most weights. Inputs\n"
               "  may be f32, f16, bf16 or quantized (decoded first). The file is written as\n"
               "  OUT.part and renamed when complete.\n");
}

static bool parse_type(const char *flag, const char *text, st_type *out) {
    st_type t;
    if (st_type_from_name(text, &t) && st_quantize_weights_supported(t)) {
        *out = t;
        return true;
    }
    fprintf(stderr, "strata quantize: %s: '%s' is not a type strata can quantize to; choose one of ", flag,
            text);
    for (int i = 0; i < N_WEIGHT_TYPES; i++)
        fprintf(stderr, "%s%s", i ? ", " : "", st_type_name(weight_types[i]));
    fputc('\n', stderr);
    return false;
}

// llama_ftype (general.file_type) for a model mostly of type t; -1 where none exists. K types
// take the "_S" variants: one type throughout is the small mix.
static int file_type_of(st_type t) {
    switch (t) {
    case ST_TYPE_F32: return 0;
    case ST_TYPE_F16: return 1;
    case ST_TYPE_Q4_0: return 2;
    case ST_TYPE_Q4_1: return 3;
    case ST_TYPE_Q8_0: return 7;
    case ST_TYPE_Q5_0: return 8;
    case ST_TYPE_Q5_1: return 9;
    case ST_TYPE_Q2_K: return 10;
    case ST_TYPE_Q3_K: return 11;
    case ST_TYPE_Q4_K: return 14;
    case ST_TYPE_Q5_K: return 16;
    case ST_TYPE_Q6_K: return 18;
    case ST_TYPE_IQ4_NL: return 25;
    case ST_TYPE_IQ4_XS: return 30;
    case ST_TYPE_BF16: return 32;
    default: return -1;
    }
}

// ---------------------------------------------------------------------------------------------
// Which type each tensor gets.

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && !strcmp(s + n - m, suffix);
}

// Dimensions that count (trailing 1s do not: the shared-expert gate {H, 1} is a vector).
static int real_dims(const st_gguf_tensor *t) {
    int n = 1;
    for (int d = 1; d < t->n_dims; d++)
        if (t->ne[d] > 1) n = d + 1;
    return n;
}

// What llama.cpp keeps unquantized for these architectures: anything not a ".weight" matrix,
// norms, the router and the shared-expert gate (small, and routing is sensitive to them), and the
// DeltaNet convolution (its rows are 4 long).
static bool keep_as_is(const st_gguf_tensor *t) {
    const st_type_info *info = st_type_get(t->type);
    if (!info || !info->compute) return true; // integer or unknown types: nothing to convert from
    if (real_dims(t) < 2 || !ends_with(t->name, ".weight")) return true;
    static const char *const kept[] = {"norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight",
                                       "ssm_conv1d.weight", "ssm_dt.weight"};
    for (size_t i = 0; i < sizeof kept / sizeof kept[0]; i++)
        if (strstr(t->name, kept[i])) return true;
    return false;
}

// The nearest type with a smaller block when rows do not fit: K types fall back to the 32-element
// type of about the same size (as llama.cpp does), 32-element types to f16.
static st_type fallback_type(st_type t) {
    switch (t) {
    case ST_TYPE_Q2_K:
    case ST_TYPE_Q3_K:
    case ST_TYPE_IQ4_XS: return ST_TYPE_IQ4_NL;
    case ST_TYPE_Q4_K: return ST_TYPE_Q5_0;
    case ST_TYPE_Q5_K: return ST_TYPE_Q5_1;
    case ST_TYPE_Q6_K: return ST_TYPE_Q8_0;
    default: return ST_TYPE_F16;
    }
}

typedef struct plan {
    st_type out;
    int64_t ne0, rows; // row length, rows (all dimensions past the first)
    size_t bytes;      // output bytes
} plan;

// ---------------------------------------------------------------------------------------------
// Streaming conversion: the writer calls fill() for each tensor in order.

typedef struct job {
    const st_gguf *in;
    const plan *plans;
    int64_t n_tensors;
    st_pool *pool;
    int n_threads;
    // One chunk of rows: `cap` bytes each, at least one row of the longest ne0 as f32. No output
    // type takes more than 4 bytes an element, so the output buffer holds whatever fits the input.
    float *f32;   // (chunk rows, ne0) dequantized input, when the source is not aligned f32
    uint8_t *out; // (chunk rows, output row bytes)
    size_t cap;
    double t0, last_print;
    uint64_t in_done; // input bytes converted so far
    bool tty;
    // The chunk the workers are on.
    const st_gguf_tensor *t;
    const plan *p;
    int64_t row0, nrows;
} job;

// Worker: rows [row0, row0 + nrows) of the current tensor, split evenly over the threads.
static void convert_rows(void *ctx, int ith, int nth) {
    job *j = ctx;
    int64_t per = (j->nrows + nth - 1) / nth, a = ith * per, b = a + per < j->nrows ? a + per : j->nrows;
    if (a >= b) return;
    int64_t ne0 = j->p->ne0;
    size_t src_row = st_row_bytes(j->t->type, ne0), dst_row = st_row_bytes(j->p->out, ne0);
    const uint8_t *in = (const uint8_t *)j->t->data + (size_t)(j->row0 + a) * src_row;
    const float *x;
    if (j->t->type == ST_TYPE_F32 && (uintptr_t)in % sizeof(float) == 0) {
        x = (const float *)in;
    } else {
        float *buf = j->f32 + a * ne0;
        for (int64_t r = 0; r < b - a; r++)
            st_dequantize(j->t->type, in + r * src_row, buf + r * ne0, ne0);
        x = buf;
    }
    st_quantize_weights(j->p->out, x, j->out + a * dst_row, b - a, ne0);
}

// One line per tensor; on a terminal, also a line rewritten twice a second while one converts.
static void progress(job *j, int64_t index, bool done) {
    double now = st_time_s();
    if (!done && (!j->tty || now - j->last_print < 0.5)) return;
    j->last_print = now;
    const plan *p = &j->plans[index];
    const st_gguf_tensor *t = st_gguf_tensor_at(j->in, index);
    double mbs = (double)j->in_done / 1e6 / (now - j->t0 > 1e-9 ? now - j->t0 : 1e-9);
    int pct = done || !p->rows ? 100 : (int)(100 * (j->row0 + j->nrows) / p->rows);
    fprintf(stderr, "%s[%lld/%lld] %-36s %-7s -> %-7s %3d%%  %6.0f MB/s%s", j->tty ? "\r\033[K" : "",
            (long long)index + 1, (long long)j->n_tensors, t->name, st_type_name(t->type),
            st_type_name(p->out), pct, mbs, done ? "\n" : "");
    fflush(stderr);
}

static st_status fill(void *ctx, int64_t index, st_gguf_put_fn put, void *sink) {
    job *j = ctx;
    const st_gguf_tensor *t = st_gguf_tensor_at(j->in, index);
    const plan *p = &j->plans[index];
    j->t = t;
    j->p = p;
    j->row0 = j->nrows = 0;
    if (p->out == t->type) { // copied as is
        ST_TRY(put(sink, t->data, t->bytes));
        j->in_done += t->bytes;
        progress(j, index, true);
        return ST_OK;
    }
    size_t src_row = st_row_bytes(t->type, p->ne0), dst_row = st_row_bytes(p->out, p->ne0);
    int64_t chunk = (int64_t)(j->cap / ((size_t)p->ne0 * sizeof(float)));
    ST_ASSERT(chunk >= 1);
    for (int64_t r = 0; r < p->rows; r += chunk) {
        j->row0 = r;
        j->nrows = p->rows - r < chunk ? p->rows - r : chunk;
        st_pool_run(j->pool, convert_rows, j);
        ST_TRY(put(sink, j->out, (size_t)j->nrows * dst_row));
        j->in_done += (uint64_t)j->nrows * src_row;
        progress(j, index, r + j->nrows >= p->rows);
    }
    return ST_OK;
}

// ---------------------------------------------------------------------------------------------

// True when `out` is the input file or one of its shards (by device and inode: links count).
static bool same_file(const char *out, const st_gguf *in) {
    struct stat so;
    if (stat(out, &so) != 0) return false;
    for (int i = 0; i < st_gguf_shard_count(in); i++) {
        struct stat si;
        if (stat(st_gguf_shard_path(in, i), &si) == 0 && si.st_dev == so.st_dev && si.st_ino == so.st_ino)
            return true;
    }
    return false;
}

static bool skip_key(const char *key) {
    // A split input becomes one file; the file type and quantization version are rewritten.
    return !strncmp(key, "split.", 6) || !strcmp(key, "general.file_type") ||
           !strcmp(key, "general.quantization_version");
}

int st_cmd_quantize(int argc, char **argv) {
    const char *in_path = NULL, *out_path = NULL, *v;
    bool bad = false, have_type = false, have_experts = false, have_dense = false;
    st_type type = ST_TYPE_F32, experts = ST_TYPE_F32, dense = ST_TYPE_F32;
    int64_t threads = 0;
    for (int i = 1; i < argc && !bad; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            quantize_usage(stdout);
            return 0;
        } else if (st_cli_opt(argc, argv, &i, "--type", &v, &bad)) {
            bad = bad || !parse_type("--type", v, &type);
            have_type = true;
        } else if (st_cli_opt(argc, argv, &i, "--experts", &v, &bad)) {
            bad = bad || !parse_type("--experts", v, &experts);
            have_experts = true;
        } else if (st_cli_opt(argc, argv, &i, "--dense", &v, &bad)) {
            bad = bad || !parse_type("--dense", v, &dense);
            have_dense = true;
        } else if (st_cli_opt(argc, argv, &i, "-t", &v, &bad) ||
                   st_cli_opt(argc, argv, &i, "--threads", &v, &bad)) {
            bad = bad || !st_cli_int("--threads", v, 1, 1024, &threads);
        } else if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "strata quantize: unknown option '%s' (see --help)\n", argv[i]);
            bad = true;
        } else if (!in_path) {
            in_path = argv[i];
        } else if (!out_path) {
            out_path = argv[i];
        } else {
            fprintf(stderr, "strata quantize: unexpected argument '%s'\n", argv[i]);
            bad = true;
        }
    }
    if (!bad && (!in_path || !out_path)) {
        fprintf(stderr, "strata quantize: needs an input and an output file\n");
        bad = true;
    }
    if (!bad && !have_type && !(have_experts && have_dense)) {
        fprintf(stderr, "strata quantize: --type is required (or both --experts and --dense)\n");
        bad = true;
    }
    if (bad) {
        quantize_usage(stderr);
        return 2;
    }
    if (!have_experts) experts = type;
    if (!have_dense) dense = type;

    st_gguf *in = NULL;
    st_status s = st_gguf_open(in_path, &in);
    if (s != ST_OK) return st_cli_fail(s);
    if (!strcmp(in_path, out_path) || same_file(out_path, in)) {
        fprintf(stderr, "strata quantize: the output %s is the input file; choose another name\n", out_path);
        st_gguf_free(in);
        return 2;
    }

    // Plan every tensor, and size the chunk buffers for the largest row.
    int64_t n = st_gguf_tensor_count(in);
    plan *plans = st_calloc(n ? (size_t)n : 1, sizeof *plans);
    st_gguf_writer *w = st_gguf_writer_create();
    char *part = NULL;
    job j = {.in = in, .plans = plans, .n_tensors = n, .tty = isatty(2)};
    if (!plans || !w) {
        s = ST_ERR_NOMEM;
        goto done;
    }
    int64_t max_ne0 = 1, elems[ST_TYPE_COUNT] = {0};
    bool requant = false;
    for (int64_t i = 0; i < n; i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(in, i);
        plan *p = &plans[i];
        p->ne0 = t->ne[0];
        p->rows = 1;
        for (int d = 1; d < t->n_dims; d++)
            p->rows *= t->ne[d];
        p->out = t->type;
        if (!keep_as_is(t)) {
            st_type want = strstr(t->name, "_exps.") ? experts : dense;
            p->out = want;
            while (p->ne0 % st_type_get(p->out)->block)
                p->out = fallback_type(p->out);
            if (p->out != want)
                fprintf(stderr, "strata quantize: %s: rows of %lld do not fit %s's block of %d; using %s\n",
                        t->name, (long long)p->ne0, st_type_name(want), st_type_get(want)->block,
                        st_type_name(p->out));
            if (p->out != t->type) {
                if (p->ne0 > max_ne0) max_ne0 = p->ne0;
                requant = requant || st_type_get(t->type)->quantized;
            }
        }
        p->bytes = (size_t)p->rows * st_row_bytes(p->out, p->ne0);
        elems[p->out] += p->ne0 * p->rows;
    }
    if (requant)
        fprintf(stderr,
                "strata quantize: note: some inputs are already quantized; converting them again adds "
                "their error to the new type's (quantize from f32/bf16/f16 when you can)\n");

    // Metadata: everything but the split keys, with the new file type.
    int dominant = 0;
    for (int t = 1; t < ST_TYPE_COUNT; t++)
        if (elems[t] > elems[dominant]) dominant = t;
    for (int64_t i = 0; i < st_gguf_kv_count(in) && s == ST_OK; i++)
        if (!skip_key(st_gguf_key(in, i))) s = st_gguf_writer_copy_kv(w, in, i);
    if (s == ST_OK) s = st_gguf_writer_add_u32(w, "general.quantization_version", 2);
    if (s == ST_OK && file_type_of((st_type)dominant) >= 0)
        s = st_gguf_writer_add_u32(w, "general.file_type", (uint32_t)file_type_of((st_type)dominant));
    for (int64_t i = 0; i < n && s == ST_OK; i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(in, i);
        s = st_gguf_writer_add_tensor_fn(w, t->name, plans[i].out, t->n_dims, t->ne, plans[i].bytes, fill,
                                         &j);
    }
    if (s != ST_OK) goto done;

    j.n_threads = threads > 0 ? (int)threads : st_cpu_count();
    j.pool = j.n_threads > 1 ? st_pool_create(j.n_threads) : NULL;
    if (j.n_threads > 1 && !j.pool) {
        s = st_fail(ST_ERR_NOMEM, "cannot start %d threads", j.n_threads);
        goto done;
    }
    j.cap = (size_t)max_ne0 * sizeof(float);
    if (j.cap < CHUNK_BYTES) j.cap = CHUNK_BYTES / j.cap * j.cap;
    j.f32 = st_alloc(j.cap);
    j.out = st_alloc(j.cap);
    if (!j.f32 || !j.out) {
        s = ST_ERR_NOMEM;
        goto done;
    }
    // Written beside the output and renamed at the end, so a failed or interrupted run never
    // leaves a truncated OUT (or destroys a good one).
    size_t plen = strlen(out_path) + sizeof ".part";
    part = st_alloc(plen);
    if (!part) {
        s = ST_ERR_NOMEM;
        goto done;
    }
    snprintf(part, plen, "%s.part", out_path);
    j.t0 = j.last_print = st_time_s();
    s = st_gguf_writer_write(w, part);
    if (s == ST_OK && rename(part, out_path) != 0) {
        s = st_fail(ST_ERR_IO, "%s: cannot rename to %s: %s", part, out_path, strerror(errno));
        unlink(part);
    }
    if (s == ST_OK) {
        double dt = st_time_s() - j.t0;
        struct stat so;
        double out_mb = stat(out_path, &so) == 0 ? (double)so.st_size / 1e6 : 0.0;
        fprintf(stderr,
                "strata quantize: %s -> %s: %lld tensors, %.1f MB -> %.1f MB in %.1f s (%.0f MB/s read)\n",
                in_path, out_path, (long long)n, (double)st_gguf_file_bytes(in) / 1e6, out_mb, dt,
                (double)j.in_done / 1e6 / (dt > 1e-9 ? dt : 1e-9));
    }

done:
    if (j.tty && s != ST_OK) fputc('\n', stderr);
    st_free(part);
    st_free(j.f32);
    st_free(j.out);
    st_pool_free(j.pool);
    st_gguf_writer_free(w);
    st_free(plans);
    st_gguf_free(in);
    return s == ST_OK ? 0 : st_cli_fail(s);
}
