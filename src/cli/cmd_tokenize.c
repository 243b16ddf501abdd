// cmd_tokenize: `strata tokenize` (text -> ids) and `strata detokenize` (ids -> text), with the
// tokenizer taken from a GGUF (-m) or a Hugging Face tokenizer.json (--tokenizer-json).

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "cli/cli.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

st_status st_cli_load_tokenizer(const char *gguf_path, const char *json_path, st_tokenizer **out) {
    *out = NULL;
    if (json_path) return st_tokenizer_load_json(json_path, out);
    st_gguf *g;
    ST_TRY(st_gguf_open(gguf_path, &g));
    st_status st = st_tokenizer_load_gguf(g, out);
    st_gguf_free(g);
    return st;
}

// Reads all of stdin (binary-safe; NUL-terminated after the *size bytes).
static st_status read_stdin(char **data, size_t *size) {
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    if (!buf) return st_fail(ST_ERR_NOMEM, "stdin: out of memory");
    for (;;) {
        if (n + 1 >= cap) { // room for the terminating NUL the id parser relies on
            char *p = realloc(buf, cap * 2);
            if (!p) {
                free(buf);
                return st_fail(ST_ERR_NOMEM, "stdin: out of memory for %zu bytes", cap * 2);
            }
            buf = p, cap *= 2;
        }
        size_t r = fread(buf + n, 1, cap - n, stdin);
        n += r;
        if (r == 0) break;
    }
    if (ferror(stdin)) {
        free(buf);
        return st_fail(ST_ERR_IO, "stdin: read error");
    }
    buf[n] = 0;
    *data = buf;
    *size = n;
    return ST_OK;
}

static void tokenize_usage(FILE *f) {
    fprintf(f, "usage: strata tokenize (-m GGUF | --tokenizer-json FILE) [--special] [--bos]\n"
               "                       [--ids | --pieces] TEXT|-\n\n"
               "Prints the tokens of TEXT (or of stdin with -): one `id<TAB>piece` line each, or\n"
               "with --ids the ids on one line, or with --pieces the pieces one per line. Pieces\n"
               "are the vocabulary's byte-level form (\"Ġthe\").\n"
               "  --special  parse control tokens written in the text (<|im_start|>, ...);\n"
               "             without it they are tokenized as plain text\n"
               "  --bos      add BOS/EOS as the tokenizer's metadata asks\n"
               "  --batch    TEXT is a JSON array of strings (- for stdin); prints a JSON array\n"
               "             of id arrays, one per string (for tests and tools)\n");
}

// --batch: one tokenizer load for many texts.
static int tokenize_batch(st_tokenizer *tok, const char *input, size_t len, unsigned flags) {
    json_error_t err;
    json_t *arr = json_loadb(input, len, 0, &err);
    if (!json_is_array(arr)) {
        fprintf(stderr, "strata tokenize --batch: input is not a JSON array of strings (%s)\n",
                arr ? "not an array" : err.text);
        json_decref(arr);
        return 2;
    }
    int rc = 0;
    size_t i;
    json_t *v;
    putchar('[');
    json_array_foreach(arr, i, v) {
        if (!json_is_string(v)) {
            fprintf(stderr, "strata tokenize --batch: element %zu is not a string\n", i);
            rc = 2;
            break;
        }
        int32_t *ids;
        size_t n;
        st_status st = st_tokenize(tok, json_string_value(v), json_string_length(v), flags, &ids, &n);
        if (st != ST_OK) {
            rc = st_cli_fail(st);
            break;
        }
        printf(i ? ",[" : "[");
        for (size_t k = 0; k < n; k++) printf(k ? ",%d" : "%d", ids[k]);
        putchar(']');
        free(ids);
    }
    printf("]\n");
    json_decref(arr);
    return rc;
}

int st_cmd_tokenize(int argc, char **argv) {
    const char *gguf = NULL, *json = NULL, *text = NULL;
    bool special = false, bos = false, ids_only = false, pieces = false, batch = false, bad = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            tokenize_usage(stdout);
            return 0;
        }
        if (st_cli_opt(argc, argv, &i, "-m", &gguf, &bad)) continue;
        if (st_cli_opt(argc, argv, &i, "--tokenizer-json", &json, &bad)) continue;
        if (!strcmp(argv[i], "--special")) special = true;
        else if (!strcmp(argv[i], "--bos")) bos = true;
        else if (!strcmp(argv[i], "--ids")) ids_only = true;
        else if (!strcmp(argv[i], "--pieces")) pieces = true;
        else if (!strcmp(argv[i], "--batch")) batch = true;
        else if (argv[i][0] == '-' && argv[i][1] && !text) {
            fprintf(stderr, "strata tokenize: unknown option '%s'\n", argv[i]);
            return 2;
        } else if (!text) text = argv[i];
        else {
            fprintf(stderr, "strata tokenize: more than one TEXT (quote it)\n");
            return 2;
        }
    }
    if (bad) return 2;
    if (!text || (!gguf == !json) || (ids_only && pieces)) {
        tokenize_usage(stderr);
        return 2;
    }
    st_tokenizer *tok;
    st_status st = st_cli_load_tokenizer(gguf, json, &tok);
    if (st != ST_OK) return st_cli_fail(st);
    char *input = NULL;
    size_t len;
    if (!strcmp(text, "-")) {
        st = read_stdin(&input, &len);
        if (st != ST_OK) {
            st_tokenizer_free(tok);
            return st_cli_fail(st);
        }
    } else
        len = strlen(text);
    int32_t *ids;
    size_t n;
    unsigned flags = (special ? ST_TOKENIZE_SPECIAL : 0) | (bos ? ST_TOKENIZE_ADD_BOS : 0);
    if (batch) {
        int rc = tokenize_batch(tok, input ? input : text, len, flags);
        free(input);
        st_tokenizer_free(tok);
        return rc;
    }
    st = st_tokenize(tok, input ? input : text, len, flags, &ids, &n);
    free(input);
    if (st != ST_OK) {
        st_tokenizer_free(tok);
        return st_cli_fail(st);
    }
    for (size_t i = 0; i < n; i++) {
        if (ids_only) printf(i ? " %d" : "%d", ids[i]);
        else if (pieces) printf("%s\n", st_token_piece(tok, ids[i]));
        else printf("%d\t%s\n", ids[i], st_token_piece(tok, ids[i]));
    }
    if (ids_only) printf("\n");
    free(ids);
    st_tokenizer_free(tok);
    return fflush(stdout) == 0 ? 0 : 1;
}

static void detokenize_usage(FILE *f) {
    fprintf(f, "usage: strata detokenize (-m GGUF | --tokenizer-json FILE) [--skip-special]\n"
               "                         [ID ... | -]\n\n"
               "Writes the exact bytes the ids stand for. Ids come from the arguments (spaces or\n"
               "commas between them) or, with - or none, from stdin.\n"
               "  --skip-special  leave out control tokens\n"
               "  --stream        decode id by id through the streaming decoder, as a server\n"
               "                  streams a reply: output is always valid UTF-8 (U+FFFD for\n"
               "                  bytes that form no character)\n");
}

// Appends the ids in `s` (separated by spaces, commas, brackets or newlines).
static bool parse_ids(const char *s, int32_t **ids, size_t *n, size_t *cap) {
    while (*s) {
        if (strchr(" ,\t\r\n[]", *s)) {
            s++;
            continue;
        }
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || v < 0 || v > INT32_MAX || (*end && !strchr(" ,\t\r\n[]", *end))) {
            fprintf(stderr, "strata detokenize: '%.20s' is not a token id\n", s);
            return false;
        }
        if (*n == *cap) {
            size_t c = *cap ? *cap * 2 : 256;
            int32_t *p = realloc(*ids, c * sizeof *p);
            if (!p) {
                fprintf(stderr, "strata detokenize: out of memory\n");
                return false;
            }
            *ids = p, *cap = c;
        }
        (*ids)[(*n)++] = (int32_t)v;
        s = end;
    }
    return true;
}

int st_cmd_detokenize(int argc, char **argv) {
    const char *gguf = NULL, *json = NULL;
    bool skip = false, bad = false, from_stdin = false, stream = false;
    int32_t *ids = NULL;
    size_t n = 0, cap = 0;
    for (int i = 1; i < argc && !bad; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            detokenize_usage(stdout);
            free(ids);
            return 0;
        }
        if (st_cli_opt(argc, argv, &i, "-m", &gguf, &bad)) continue;
        if (st_cli_opt(argc, argv, &i, "--tokenizer-json", &json, &bad)) continue;
        if (!strcmp(argv[i], "--skip-special")) skip = true;
        else if (!strcmp(argv[i], "--stream")) stream = true;
        else if (!strcmp(argv[i], "-")) from_stdin = true;
        else if (argv[i][0] == '-') {
            fprintf(stderr, "strata detokenize: unknown option '%s'\n", argv[i]);
            bad = true;
        } else if (!parse_ids(argv[i], &ids, &n, &cap))
            bad = true;
    }
    if (!bad && !gguf == !json) {
        detokenize_usage(stderr);
        bad = true;
    }
    if (!bad && (from_stdin || n == 0)) {
        char *in;
        size_t len;
        st_status st = read_stdin(&in, &len);
        if (st != ST_OK) {
            free(ids);
            return st_cli_fail(st);
        }
        bad = !parse_ids(in, &ids, &n, &cap);
        free(in);
    }
    if (bad) {
        free(ids);
        return 2;
    }
    st_tokenizer *tok;
    st_status st = st_cli_load_tokenizer(gguf, json, &tok);
    if (st == ST_OK && stream) {
        st_detok_stream *ds = st_detok_stream_create(tok, skip);
        st = ds ? ST_OK : ST_ERR_NOMEM;
        const char *piece;
        size_t plen;
        for (size_t i = 0; st == ST_OK && i <= n; i++) {
            st = i < n ? st_detok_stream_push(ds, ids[i], &piece, &plen)
                       : st_detok_stream_flush(ds, &piece, &plen);
            if (st == ST_OK && fwrite(piece, 1, plen, stdout) != plen) st = ST_ERR_IO;
            fflush(stdout);
        }
        st_detok_stream_free(ds);
        free(ids);
        st_tokenizer_free(tok);
        return st == ST_OK ? 0 : st_cli_fail(st);
    }
    char *out = NULL;
    size_t len = 0;
    if (st == ST_OK) st = st_detokenize(tok, ids, n, skip, &out, &len);
    free(ids);
    st_tokenizer_free(tok);
    if (st != ST_OK) return st_cli_fail(st);
    size_t w = fwrite(out, 1, len, stdout);
    free(out);
    return w == len && fflush(stdout) == 0 ? 0 : 1;
}
