// bpe: byte-level BPE tokenizer: vocabulary and merge tables, added-token matching, NFC, PCRE2
// pre-tokenization, rank-ordered merges (heap, no rescans) with a word cache, and decoding.
// Loading from GGUF / tokenizer.json lives in bpe_load.c; both build through bpe_build.

#include <stdlib.h>
#include <string.h>

#include "tokenizer/bpe_internal.h"

// ---------------------------------------------------------------------------------------------
// Hashing

uint64_t st_bpe_hash(const void *data, size_t len) {
    const unsigned char *p = data;
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (len * 0xFF51AFD7ED558CCDull);
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        h = (h ^ v) * 0xC2B2AE3D27D4EB4Full;
        h ^= h >> 29;
        p += 8, len -= 8;
    }
    uint64_t v = 0;
    for (size_t i = 0; i < len; i++) v |= (uint64_t)p[i] << (8 * i);
    h = (h ^ v) * 0x165667B19E3779F9ull;
    h ^= h >> 32;
    h *= 0xD6E8FEB86659FD93ull;
    h ^= h >> 32;
    return h;
}

static inline uint64_t pair_key(int32_t a, int32_t b) {
    return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
}

static inline uint32_t mix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xFF51AFD7ED558CCDull;
    k ^= k >> 33;
    return (uint32_t)k;
}

static inline const st_bpe_merge *merge_find(const st_tokenizer *t, int32_t a, int32_t b) {
    uint64_t key = pair_key(a, b);
    for (uint32_t i = mix64(key) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        const st_bpe_merge *m = &t->merges[i];
        if (m->key == key) return m;
        if (m->key == ST_BPE_EMPTY_KEY) return NULL;
    }
}

st_status st_bpe_merge_insert(st_tokenizer *t, int32_t a, int32_t b, int32_t rank, int32_t id) {
    uint64_t key = pair_key(a, b);
    for (uint32_t i = mix64(key) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        st_bpe_merge *m = &t->merges[i];
        if (m->key == key) return ST_OK; // a repeated merge keeps its first (best) rank
        if (m->key == ST_BPE_EMPTY_KEY) {
            m->key = key, m->rank = rank, m->id = id;
            return ST_OK;
        }
    }
}

int32_t st_token_find(const st_tokenizer *t, const char *piece, size_t len) {
    uint64_t h = st_bpe_hash(piece, len);
    for (uint32_t i = (uint32_t)h & t->vocab_mask;; i = (i + 1) & t->vocab_mask) {
        int32_t id = t->vocab_hash[i];
        if (id < 0) return -1;
        if (t->piece_len[id] == len && memcmp(t->text + t->piece_off[id], piece, len) == 0)
            return id;
    }
}

// ---------------------------------------------------------------------------------------------
// Per-call working memory. The tokenizer owns one set (with the word cache) behind a mutex; a
// call that finds it busy makes a private set without cache, so calls never wait on each other.

static void scratch_free(st_bpe_scratch *s) {
    if (s->md) pcre2_match_data_free(s->md);
    if (s->mctx) pcre2_match_context_free(s->mctx);
    if (s->jit) pcre2_jit_stack_free(s->jit);
    st_nfc_scratch_free(&s->nfc);
    free(s->sym);
    free(s->heap);
    free(s->uni);
    free(s->cache_slots);
    free(s->cache_arena);
    memset(s, 0, sizeof *s);
}

static st_status scratch_init(const st_tokenizer *t, st_bpe_scratch *s, bool with_cache) {
    memset(s, 0, sizeof *s);
    s->md = pcre2_match_data_create(2, NULL);
    s->mctx = pcre2_match_context_create(NULL);
    // Long runs (a 1 MB line of letters) need more than the default 32 KiB JIT stack.
    s->jit = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, NULL);
    if (!s->md || !s->mctx || !s->jit) goto nomem;
    pcre2_jit_stack_assign(s->mctx, NULL, s->jit);
    if (with_cache) {
        s->cache_slots = calloc(ST_BPE_CACHE_SLOTS, sizeof *s->cache_slots);
        s->cache_arena = malloc(ST_BPE_CACHE_ARENA);
        if (!s->cache_slots || !s->cache_arena) goto nomem;
    }
    (void)t;
    return ST_OK;
nomem:
    scratch_free(s);
    return st_fail(ST_ERR_NOMEM, "tokenizer: out of memory for working buffers");
}

void st_bpe_free_internal(st_tokenizer *t) {
    scratch_free(&t->scratch);
    pthread_mutex_destroy(&t->lock);
}

st_status st_bpe_init_internal(st_tokenizer *t) {
    pthread_mutex_init(&t->lock, NULL);
    return scratch_init(t, &t->scratch, true);
}

static st_status grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return ST_OK;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q) return st_fail(ST_ERR_NOMEM, "tokenizer: out of memory (%zu bytes)", c * elem);
    *p = q, *cap = c;
    return ST_OK;
}

// Output id vector.
typedef struct idvec {
    int32_t *v;
    size_t n, cap;
} idvec;

static inline st_status push_id(idvec *o, int32_t id) {
    if (o->n == o->cap) ST_TRY(grow((void **)&o->v, &o->cap, o->n + 1, sizeof *o->v));
    o->v[o->n++] = id;
    return ST_OK;
}

// ---------------------------------------------------------------------------------------------
// Word cache: piece bytes -> ids, open addressing over an arena; cleared wholesale when full.

static void cache_clear(st_bpe_scratch *s) {
    memset(s->cache_slots, 0, ST_BPE_CACHE_SLOTS * sizeof *s->cache_slots);
    s->cache_used = 0;
    s->cache_count = 0;
}

static const int32_t *cache_get(st_bpe_scratch *s, uint64_t h, const char *p, size_t n,
                                size_t *nids) {
    for (uint32_t i = (uint32_t)h & (ST_BPE_CACHE_SLOTS - 1);; i = (i + 1) & (ST_BPE_CACHE_SLOTS - 1)) {
        st_bpe_cache_slot *c = &s->cache_slots[i];
        if (c->nbytes == 0) return NULL;
        if (c->hash == h && c->nbytes == n && memcmp(s->cache_arena + c->off, p, n) == 0) {
            *nids = c->nids;
            return (const int32_t *)(s->cache_arena + c->off + ((n + 3) & ~(size_t)3));
        }
    }
}

static void cache_put(st_bpe_scratch *s, uint64_t h, const char *p, size_t n, const int32_t *ids,
                      size_t nids) {
    size_t pad = (n + 3) & ~(size_t)3;
    size_t need = pad + nids * sizeof(int32_t);
    if (s->cache_count >= ST_BPE_CACHE_SLOTS / 2 || s->cache_used + need > ST_BPE_CACHE_ARENA)
        cache_clear(s);
    uint32_t i = (uint32_t)h & (ST_BPE_CACHE_SLOTS - 1);
    while (s->cache_slots[i].nbytes) i = (i + 1) & (ST_BPE_CACHE_SLOTS - 1);
    st_bpe_cache_slot *c = &s->cache_slots[i];
    c->hash = h, c->off = (uint32_t)s->cache_used, c->nbytes = (uint16_t)n, c->nids = (uint16_t)nids;
    memcpy(s->cache_arena + s->cache_used, p, n);
    memcpy(s->cache_arena + s->cache_used + pad, ids, nids * sizeof(int32_t));
    s->cache_used += need;
    s->cache_count++;
}

// ---------------------------------------------------------------------------------------------
// Merging one piece. Symbols form a linked list; candidate pairs sit in a min-heap ordered by
// (rank, position), so the lowest rank merges first and ties go to the leftmost pair. Entries
// made stale by earlier merges are recognized when popped and skipped: O(n log n) per piece.

static inline bool heap_less(const st_bpe_heap_item *a, const st_bpe_heap_item *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void heap_push(st_bpe_heap_item *h, size_t *n, st_bpe_heap_item it) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&it, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = it;
}

static st_bpe_heap_item heap_pop(st_bpe_heap_item *h, size_t *n) {
    st_bpe_heap_item top = h[0], last = h[--*n];
    size_t i = 0, m = *n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && heap_less(&h[c + 1], &h[c])) c++;
        if (!heap_less(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (m) h[i] = last;
    return top;
}

static inline void try_pair(const st_tokenizer *t, st_bpe_scratch *s, size_t *nh, int32_t l) {
    int32_t r = s->sym[l].next;
    if (l < 0 || r < 0) return;
    const st_bpe_merge *m = merge_find(t, s->sym[l].id, s->sym[r].id);
    if (m) heap_push(s->heap, nh, (st_bpe_heap_item){m->rank, l, r});
}

// Appends the ids of one pre-tokenized piece.
static st_status bpe_piece(const st_tokenizer *t, st_bpe_scratch *s, const char *p, size_t n,
                           idvec *out) {
    const unsigned char *u = (const unsigned char *)p;
    if (n == 1) return push_id(out, t->byte_tok[u[0]]);

    if (t->ignore_merges) { // Llama 3: a piece that is a whole vocabulary token stays whole
        ST_TRY(grow((void **)&s->uni, &s->cap_uni, n * 2 + 1, 1));
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
            uint32_t cp = st_bpe_byte_to_cp[u[i]];
            if (cp < 0x80) s->uni[k++] = (char)cp;
            else s->uni[k++] = (char)(0xC0 | (cp >> 6)), s->uni[k++] = (char)(0x80 | (cp & 0x3F));
        }
        int32_t id = st_token_find(t, s->uni, k);
        if (id >= 0 && t->type[id] == ST_TOKEN_NORMAL) return push_id(out, id);
    }

    uint64_t h = 0;
    bool cacheable = s->cache_slots && n <= ST_BPE_CACHE_MAX_BYTES;
    if (cacheable) {
        h = st_bpe_hash(p, n);
        size_t nids;
        const int32_t *ids = cache_get(s, h, p, n, &nids);
        if (ids) {
            if (out->n + nids > out->cap)
                ST_TRY(grow((void **)&out->v, &out->cap, out->n + nids, sizeof *out->v));
            memcpy(out->v + out->n, ids, nids * sizeof *ids);
            out->n += nids;
            return ST_OK;
        }
    }

    ST_TRY(grow((void **)&s->sym, &s->cap_sym, n, sizeof *s->sym));
    ST_TRY(grow((void **)&s->heap, &s->cap_heap, 2 * n, sizeof *s->heap));
    for (size_t i = 0; i < n; i++) {
        s->sym[i].id = t->byte_tok[u[i]];
        s->sym[i].prev = (int32_t)i - 1;
        s->sym[i].next = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    size_t nh = 0;
    for (size_t i = 0; i + 1 < n; i++) try_pair(t, s, &nh, (int32_t)i);
    while (nh) {
        st_bpe_heap_item it = heap_pop(s->heap, &nh);
        st_bpe_sym *l = &s->sym[it.left];
        if (l->id < 0 || l->next != it.right) continue;
        st_bpe_sym *r = &s->sym[it.right];
        const st_bpe_merge *m = merge_find(t, l->id, r->id);
        if (!m || m->rank != it.rank) continue; // stale: one side merged since
        l->id = m->id;
        r->id = -1;
        l->next = r->next;
        if (r->next >= 0) s->sym[r->next].prev = it.left;
        // Each merge adds at most two pairs and removes one symbol, so the heap stays < 2n.
        if (l->prev >= 0) try_pair(t, s, &nh, l->prev);
        try_pair(t, s, &nh, it.left);
    }
    size_t start = out->n;
    for (int32_t i = 0; i >= 0; i = s->sym[i].next) ST_TRY(push_id(out, s->sym[i].id));
    if (cacheable && out->n - start <= 0xFFFF) cache_put(s, h, p, n, out->v + start, out->n - start);
    return ST_OK;
}

// Pre-tokenizes one stretch of text between added tokens and merges every piece.
static st_status encode_segment(const st_tokenizer *t, st_bpe_scratch *s, const char *text,
                                size_t len, idvec *out) {
    if (len == 0) return ST_OK;
    if (t->nfc) {
        const char *norm;
        size_t nlen;
        int r = st_nfc(text, len, &s->nfc, &norm, &nlen);
        if (r < 0) return ST_ERR_NOMEM;
        if (r > 0) text = norm, len = nlen;
    }
    PCRE2_SPTR subj = (PCRE2_SPTR)text;
    // Text the regex does not match (only invalid UTF-8 for the built-in patterns) forms pieces
    // of its own between the matches, as Hugging Face's "Isolated" split keeps it.
    size_t gap = 0, pos = 0;
    while (pos < len) {
        int rc = t->jit ? pcre2_jit_match(t->re, subj, len, pos, 0, s->md, s->mctx)
                        : pcre2_match(t->re, subj, len, pos, 0, s->md, s->mctx);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return st_fail(ST_ERR_RANGE, "tokenizer: pre-tokenizer regex failed at byte %zu: %s",
                           pos, (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(s->md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) { // an empty match (possible in a tokenizer.json regex) is no piece
            uint32_t cp;
            int k = ms < len ? st_utf8_decode((const unsigned char *)text + ms, len - ms, &cp) : 0;
            pos = ms + (k > 0 ? (size_t)k : 1);
            continue;
        }
        if (ms > gap) ST_TRY(bpe_piece(t, s, text + gap, ms - gap, out));
        ST_TRY(bpe_piece(t, s, text + ms, me - ms, out));
        gap = pos = me;
    }
    if (gap < len) ST_TRY(bpe_piece(t, s, text + gap, len - gap, out));
    return ST_OK;
}

// Finds the leftmost added token at or after `from`, the longest one there.
static bool find_added(const st_tokenizer *t, const char *text, size_t len, size_t from,
                       bool special, size_t *at, int32_t *id) {
    const unsigned char *u = (const unsigned char *)text;
    for (size_t i = from; i < len; i++) {
        if (t->added_single_first >= 0) { // every added token starts with one byte: memchr
            const void *q = memchr(u + i, t->added_single_first, len - i);
            if (!q) return false;
            i = (size_t)((const unsigned char *)q - u);
        } else if (t->added_first[u[i]] == t->added_first[u[i] + 1])
            continue;
        for (int k = t->added_first[u[i]]; k < t->added_first[u[i] + 1]; k++) {
            const st_bpe_added *a = &t->added[k];
            if (!special && t->type[a->id] == ST_TOKEN_CONTROL) continue;
            if (a->len <= len - i && memcmp(text + i, t->text + t->piece_off[a->id], a->len) == 0) {
                *at = i;
                *id = a->id;
                return true; // sorted longest first
            }
        }
    }
    return false;
}

st_status st_tokenize(st_tokenizer *t, const char *text, size_t len, unsigned flags,
                      int32_t **ids, size_t *n) {
    *ids = NULL;
    *n = 0;
    st_bpe_scratch local, *s = &t->scratch;
    bool own = pthread_mutex_trylock(&t->lock) == 0;
    if (!own) {
        s = &local;
        ST_TRY(scratch_init(t, s, false));
    }
    idvec out = {0};
    st_status st = ST_OK;
    bool special = flags & ST_TOKENIZE_SPECIAL;
    if ((flags & ST_TOKENIZE_ADD_BOS) && t->add_bos && t->bos >= 0) st = push_id(&out, t->bos);
    size_t pos = 0;
    while (st == ST_OK && pos < len) {
        size_t at = len;
        int32_t id = -1;
        bool found = t->n_added && find_added(t, text, len, pos, special, &at, &id);
        st = encode_segment(t, s, text + pos, at - pos, &out);
        if (st != ST_OK || !found) break;
        st = push_id(&out, id);
        pos = at + t->piece_len[id];
    }
    if (st == ST_OK && (flags & ST_TOKENIZE_ADD_BOS) && t->add_eos && t->eos >= 0)
        st = push_id(&out, t->eos);
    if (own) pthread_mutex_unlock(&t->lock);
    else scratch_free(&local);
    if (st != ST_OK) {
        free(out.v);
        return st;
    }
    if (!out.v) { // empty input: still hand back a valid allocation
        out.v = malloc(sizeof *out.v);
        if (!out.v) return st_fail(ST_ERR_NOMEM, "tokenizer: out of memory");
    }
    *ids = out.v;
    *n = out.n;
    return ST_OK;
}

// ---------------------------------------------------------------------------------------------
// Accessors

int32_t st_tokenizer_n_vocab(const st_tokenizer *t) { return t->n_vocab; }
st_pretok st_tokenizer_pretok(const st_tokenizer *t) { return t->pretok; }
bool st_tokenizer_nfc(const st_tokenizer *t) { return t->nfc; }
int32_t st_tokenizer_bos(const st_tokenizer *t) { return t->bos; }
int32_t st_tokenizer_eos(const st_tokenizer *t) { return t->eos; }
int32_t st_tokenizer_eot(const st_tokenizer *t) { return t->eot >= 0 ? t->eot : t->eos; }
int32_t st_tokenizer_pad(const st_tokenizer *t) { return t->pad; }
bool st_tokenizer_add_bos(const st_tokenizer *t) { return t->add_bos; }

bool st_token_is_eog(const st_tokenizer *t, int32_t id) {
    if (id < 0) return false;
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return true;
    return false;
}

st_token_type st_token_get_type(const st_tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_vocab ? (st_token_type)t->type[id] : ST_TOKEN_UNDEFINED;
}

const char *st_token_piece(const st_tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_vocab ? t->text + t->piece_off[id] : NULL;
}

const char *st_token_bytes(const st_tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->n_vocab) return NULL;
    *len = t->bytes_len[id];
    return t->bytes + t->bytes_off[id];
}

// ---------------------------------------------------------------------------------------------
// Decoding

st_status st_detokenize(const st_tokenizer *t, const int32_t *ids, size_t n, bool skip_control,
                        char **out, size_t *len) {
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab)
            return st_fail(ST_ERR_RANGE, "detokenize: id %d at position %zu is outside the "
                           "vocabulary (0..%d)", ids[i], i, t->n_vocab - 1);
        if (!(skip_control && t->type[ids[i]] == ST_TOKEN_CONTROL)) total += t->bytes_len[ids[i]];
    }
    char *o = malloc(total + 1);
    if (!o) return st_fail(ST_ERR_NOMEM, "detokenize: out of memory for %zu bytes", total + 1);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (skip_control && t->type[ids[i]] == ST_TOKEN_CONTROL) continue;
        memcpy(o + k, t->bytes + t->bytes_off[ids[i]], t->bytes_len[ids[i]]);
        k += t->bytes_len[ids[i]];
    }
    o[k] = 0;
    *out = o;
    *len = k;
    return ST_OK;
}

struct st_detok_stream {
    const st_tokenizer *tok;
    bool skip_control;
    unsigned char pend[4]; // the start of a character not complete yet
    int npend;
    unsigned char *work; // pending + new bytes
    size_t cap_work;
    char *buf; // what the last call emitted
    size_t cap;
};

st_detok_stream *st_detok_stream_create(const st_tokenizer *tok, bool skip_control) {
    st_detok_stream *s = calloc(1, sizeof *s);
    if (!s) {
        st_fail(ST_ERR_NOMEM, "detokenize: out of memory");
        return NULL;
    }
    s->tok = tok;
    s->skip_control = skip_control;
    return s;
}

void st_detok_stream_free(st_detok_stream *s) {
    if (!s) return;
    free(s->work);
    free(s->buf);
    free(s);
}

// How many bytes of s[0..n) form a valid prefix of one UTF-8 character: returns the character's
// full length when complete, 0 when s[0..k) is a valid but unfinished start (k = n), or -k when
// the first k bytes (k >= 1) are the maximal invalid subpart to replace with one U+FFFD.
static int utf8_step(const unsigned char *s, size_t n) {
    unsigned b = s[0];
    if (b < 0x80) return 1;
    int len;
    unsigned lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) len = 2;
    else if (b >= 0xE0 && b <= 0xEF) {
        len = 3;
        if (b == 0xE0) lo = 0xA0;
        if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
        len = 4;
        if (b == 0xF0) lo = 0x90;
        if (b == 0xF4) hi = 0x8F;
    } else
        return -1;
    for (int i = 1; i < len; i++) {
        if ((size_t)i >= n) return 0;
        unsigned c = s[i];
        unsigned l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
        if (c < l || c > h) return -i;
    }
    return len;
}

static st_status stream_emit(st_detok_stream *s, const unsigned char *in, size_t n, bool final,
                             size_t *olen) {
    size_t m = (size_t)s->npend + n;
    if (m > s->cap_work) {
        unsigned char *p = realloc(s->work, m);
        if (!p) return st_fail(ST_ERR_NOMEM, "detokenize: out of memory for %zu bytes", m);
        s->work = p, s->cap_work = m;
    }
    memcpy(s->work, s->pend, (size_t)s->npend);
    if (n) memcpy(s->work + s->npend, in, n);
    s->npend = 0;
    size_t need = m * 3 + 1; // at most one U+FFFD (3 bytes) per input byte
    if (need > s->cap) {
        char *p = realloc(s->buf, need);
        if (!p) return st_fail(ST_ERR_NOMEM, "detokenize: out of memory for %zu bytes", need);
        s->buf = p, s->cap = need;
    }
    const unsigned char *w = s->work;
    size_t i = 0, o = 0;
    while (i < m) {
        int r = utf8_step(w + i, m - i);
        if (r == 0) { // an unfinished character (at most 3 bytes) at the end
            if (!final) {
                while (i < m) s->pend[s->npend++] = w[i++];
                break;
            }
            r = -(int)(m - i);
        }
        size_t used = r > 0 ? (size_t)r : (size_t)-r;
        if (r > 0) memcpy(s->buf + o, w + i, used), o += used;
        else memcpy(s->buf + o, "\xEF\xBF\xBD", 3), o += 3;
        i += used;
    }
    *olen = o;
    return ST_OK;
}

st_status st_detok_stream_push(st_detok_stream *s, int32_t id, const char **out, size_t *len) {
    const st_tokenizer *t = s->tok;
    *out = s->buf ? s->buf : "";
    *len = 0;
    if (id < 0 || id >= t->n_vocab)
        return st_fail(ST_ERR_RANGE, "detokenize: id %d is outside the vocabulary (0..%d)", id,
                       t->n_vocab - 1);
    if (s->skip_control && t->type[id] == ST_TOKEN_CONTROL) return ST_OK;
    ST_TRY(stream_emit(s, (const unsigned char *)t->bytes + t->bytes_off[id], t->bytes_len[id],
                       false, len));
    *out = s->buf;
    return ST_OK;
}

st_status st_detok_stream_flush(st_detok_stream *s, const char **out, size_t *len) {
    *out = s->buf ? s->buf : "";
    *len = 0;
    if (s->npend == 0) return ST_OK;
    ST_TRY(stream_emit(s, NULL, 0, true, len));
    *out = s->buf;
    return ST_OK;
}
