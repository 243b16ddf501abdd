// bpe_nfc: NFC normalization (decompose, canonical order, recompose) over the generated tables,
// with a quick scan that leaves already-normalized text (nearly all text) untouched.

#include <stdlib.h>
#include <string.h>

#include "tokenizer/bpe_nfc.h"
#include "util/util.h"

#define SBASE 0xAC00u
#define LBASE 0x1100u
#define VBASE 0x1161u
#define TBASE 0x11A7u
#define LCOUNT 19u
#define VCOUNT 21u
#define TCOUNT 28u
#define NCOUNT (VCOUNT * TCOUNT)
#define SCOUNT (LCOUNT * NCOUNT)

int st_utf8_decode(const unsigned char *s, size_t n, uint32_t *cp) {
    unsigned b = s[0];
    if (b < 0x80) {
        *cp = b;
        return 1;
    }
    int len;
    uint32_t c;
    unsigned lo = 0x80, hi = 0xBF; // allowed range of the second byte
    if (b >= 0xC2 && b <= 0xDF) len = 2, c = b & 0x1F;
    else if (b >= 0xE0 && b <= 0xEF) {
        len = 3, c = b & 0x0F;
        if (b == 0xE0) lo = 0xA0;
        if (b == 0xED) hi = 0x9F; // no surrogates
    } else if (b >= 0xF0 && b <= 0xF4) {
        len = 4, c = b & 0x07;
        if (b == 0xF0) lo = 0x90;
        if (b == 0xF4) hi = 0x8F;
    } else
        return 0;
    if ((size_t)len > n) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    c = (c << 6) | (s[1] & 0x3F);
    for (int i = 2; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        c = (c << 6) | (s[i] & 0x3F);
    }
    *cp = c;
    return len;
}

void st_nfc_scratch_free(st_nfc_scratch *s) {
    free(s->cps);
    free(s->out);
    memset(s, 0, sizeof *s);
}

static const st_nfc_decomp *find_decomp(uint32_t cp) {
    int lo = 0, hi = st_nfc_n_decomps - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (st_nfc_decomps[mid].cp == cp) return &st_nfc_decomps[mid];
        if (st_nfc_decomps[mid].cp < cp) lo = mid + 1;
        else hi = mid - 1;
    }
    return NULL;
}

// The primary composite of (a, b), or 0 when there is none.
static uint32_t compose(uint32_t a, uint32_t b) {
    if (a >= LBASE && a < LBASE + LCOUNT && b >= VBASE && b < VBASE + VCOUNT)
        return SBASE + ((a - LBASE) * VCOUNT + (b - VBASE)) * TCOUNT;
    if (a >= SBASE && a < SBASE + SCOUNT && (a - SBASE) % TCOUNT == 0 && b > TBASE &&
        b < TBASE + TCOUNT)
        return a + (b - TBASE);
    if (a >= 0x110000 || b >= 0x110000) return 0;
    uint64_t key = ((uint64_t)a << 21) | b;
    int lo = 0, hi = st_nfc_n_comps - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (st_nfc_comps[mid].key == key) return st_nfc_comps[mid].cp;
        if (st_nfc_comps[mid].key < key) lo = mid + 1;
        else hi = mid - 1;
    }
    return 0;
}

static unsigned ccc_of(uint32_t cp) {
    return (cp & ST_NFC_RAW) ? 0 : (st_nfc_props(cp) & 0xFF);
}

// True when text needs no change: no code point flagged by the tables.
static bool quick_check(const unsigned char *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        int n = st_utf8_decode(s + i, len - i, &cp);
        if (n == 0) {
            i++;
            continue;
        }
        if (st_nfc_props(cp) & ST_NFC_FLAG) return false;
        i += (size_t)n;
    }
    return true;
}

int st_nfc(const char *text, size_t len, st_nfc_scratch *s, const char **out, size_t *out_len) {
    const unsigned char *u = (const unsigned char *)text;
    if (quick_check(u, len)) return 0;

    // Decompose. A code point decomposes into at most 4 (the tables' longest), Hangul into 3.
    size_t need = len * 4 + 4;
    if (need > s->cap_cps) {
        uint32_t *p = realloc(s->cps, need * sizeof *p);
        if (!p) {
            st_fail(ST_ERR_NOMEM, "NFC: out of memory for %zu code points", need);
            return -1;
        }
        s->cps = p, s->cap_cps = need;
    }
    uint32_t *c = s->cps;
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        int k = st_utf8_decode(u + i, len - i, &cp);
        if (k == 0) {
            c[n++] = ST_NFC_RAW | u[i++];
            continue;
        }
        i += (size_t)k;
        if (cp >= SBASE && cp < SBASE + SCOUNT) {
            uint32_t si = cp - SBASE;
            c[n++] = LBASE + si / NCOUNT;
            c[n++] = VBASE + (si % NCOUNT) / TCOUNT;
            if (si % TCOUNT) c[n++] = TBASE + si % TCOUNT;
            continue;
        }
        const st_nfc_decomp *d = (st_nfc_props(cp) & ST_NFC_DECOMP) ? find_decomp(cp) : NULL;
        if (d) {
            for (int j = 0; j < d->len; j++) c[n++] = st_nfc_decomp_seq[d->off + j];
        } else
            c[n++] = cp;
    }

    // Canonical ordering: stable insertion sort of each run of non-starters by class.
    for (size_t i = 1; i < n; i++) {
        unsigned ci = ccc_of(c[i]);
        if (ci == 0) continue;
        size_t j = i;
        uint32_t v = c[i];
        while (j > 0 && ccc_of(c[j - 1]) > ci) {
            c[j] = c[j - 1];
            j--;
        }
        c[j] = v;
    }

    // Recompose: a character joins the last starter unless something between them blocks it
    // (a starter, or a mark of the same or higher class).
    size_t w = 0;
    long starter = -1;
    int last_ccc = -1; // -1: nothing since the starter
    for (size_t i = 0; i < n; i++) {
        uint32_t cp = c[i];
        if (cp & ST_NFC_RAW) {
            c[w++] = cp;
            starter = -1;
            continue;
        }
        unsigned cc = ccc_of(cp);
        if (starter >= 0 && (last_ccc == -1 || last_ccc < (int)cc)) {
            uint32_t comp = compose(c[starter], cp);
            if (comp) {
                c[starter] = comp;
                continue;
            }
        }
        if (cc == 0) {
            starter = (long)w;
            last_ccc = -1;
        } else
            last_ccc = (int)cc;
        c[w++] = cp;
    }

    size_t need_out = w * 4 + 1;
    if (need_out > s->cap_out) {
        char *p = realloc(s->out, need_out);
        if (!p) {
            st_fail(ST_ERR_NOMEM, "NFC: out of memory for %zu bytes", need_out);
            return -1;
        }
        s->out = p, s->cap_out = need_out;
    }
    size_t o = 0;
    for (size_t i = 0; i < w; i++) {
        if (c[i] & ST_NFC_RAW) s->out[o++] = (char)(c[i] & 0xFF);
        else o += (size_t)st_utf8_encode(s->out + o, c[i]);
    }
    *out = s->out;
    *out_len = o;
    return 1;
}
