// quant: f32 weights to the weight types `strata quantize` writes. The 32-element legacy types use
// the format's plain rounding (what gguf-py and ggml's reference write, so files match byte for
// byte); K and IQ4 types search every sub-block's scale (and min) for the least squared error,
// then quantize the sub-block scales against the super-block's fp16 scale and re-fit the codes.

#include <math.h>
#include <string.h>

#include "quant/quant.h"
#include "quant/blocks.h"
#include "quant/iq_tables.h"

// The integer code nearest v within [lo, hi] (halves round up). Clamping first keeps the
// conversion defined for any input, NaN included (it lands on lo); inline, unlike nearbyintf.
static inline int code(float v, int lo, int hi) {
    if (!(v >= (float)lo)) return lo;
    if (v >= (float)hi) return hi;
    return lo + (int)(v - (float)lo + 0.5f);
}
static inline float f16_round(float v) { return st_f16_to_f32(st_f32_to_f16(v)); }

// The element of largest magnitude, with its sign (the first one on ties).
static float signed_amax(const float *x, int n) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < n; j++)
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    return max;
}

// The legacy types' code: v truncated toward zero into [0, hi] (v is already shifted by +½, so
// this rounds). Clamped before the conversion, so NaN or infinite weights cannot make it undefined.
static inline int trunc_code(float v, int hi) {
    if (!(v >= 0.0f)) return 0;
    return v >= (float)hi ? hi : (int)v;
}

// (fminf/fmaxf are library calls at -O2; plain comparisons are not.)
static void min_max(const float *x, int n, float *min, float *max) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < n; j++) {
        lo = x[j] < lo ? x[j] : lo;
        hi = x[j] > hi ? x[j] : hi;
    }
    *min = lo;
    *max = hi;
}

// ---------------------------------------------------------------------------------------------
// Legacy 32-element blocks. The rounding is deliberately the simple one (truncate x·id + ½ after
// shifting to unsigned): llama.cpp writes exactly this without an importance matrix.

static void q4_0_block(const float *x, void *out) {
    block_q4_0 *y = out;
    float max = signed_amax(x, QK4_0);
    float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    y->d = st_f32_to_f16(d);
    for (int j = 0; j < QK4_0 / 2; j++) {
        int a = trunc_code(x[j] * id + 8.5f, 15), b = trunc_code(x[j + 16] * id + 8.5f, 15);
        y->qs[j] = (uint8_t)(a | b << 4);
    }
}

static void q4_1_block(const float *x, void *out) {
    block_q4_1 *y = out;
    float min, max;
    min_max(x, QK4_1, &min, &max);
    float d = (max - min) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    y->d = st_f32_to_f16(d);
    y->m = st_f32_to_f16(min);
    for (int j = 0; j < QK4_1 / 2; j++) {
        int a = trunc_code((x[j] - min) * id + 0.5f, 15);
        int b = trunc_code((x[j + 16] - min) * id + 0.5f, 15);
        y->qs[j] = (uint8_t)(a | b << 4);
    }
}

// 5-bit codes: low nibbles as Q4, bit 4 of element e in bit e of qh.
static void q5_pack(const int q[32], uint8_t qs[16], uint8_t qh[4]) {
    uint32_t h = 0;
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)((q[j] & 15) | (q[j + 16] & 15) << 4);
    for (int e = 0; e < 32; e++) h |= (uint32_t)(q[e] >> 4) << e;
    memcpy(qh, &h, 4);
}

static void q5_0_block(const float *x, void *out) {
    block_q5_0 *y = out;
    float max = signed_amax(x, QK5_0);
    float d = max / -16.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int q[32];
    for (int e = 0; e < 32; e++) q[e] = trunc_code(x[e] * id + 16.5f, 31);
    y->d = st_f32_to_f16(d);
    q5_pack(q, y->qs, y->qh);
}

static void q5_1_block(const float *x, void *out) {
    block_q5_1 *y = out;
    float min, max;
    min_max(x, QK5_1, &min, &max);
    float d = (max - min) / 31.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int q[32];
    for (int e = 0; e < 32; e++) q[e] = trunc_code((x[e] - min) * id + 0.5f, 31);
    y->d = st_f32_to_f16(d);
    y->m = st_f32_to_f16(min);
    q5_pack(q, y->qs, y->qh);
}

// ---------------------------------------------------------------------------------------------
// Scale searches for one sub-block.
//
// Every search tries a few candidate inverse scales around the one that maps the extreme value to
// the extreme code, rounds the sub-block with each, solves the least-squares scale (and offset)
// for those codes, and keeps the candidate with the least squared error. Why candidates around
// the extreme: a slightly smaller range clips one outlier but rounds the other 31 values finer,
// which often wins; the best shrink depends on the data, so it is searched, not fixed.

// Candidate inverse scales: `steps` on each side of the extreme-to-extreme one, reaching ± span
// (relative). Types with many levels gain little from a wide search (q6_K: 0.1% from 2 to 10
// steps), so each type takes only what pays for itself.
typedef struct search {
    float span;
    int steps;
} search;

// x ≈ s·q − m with q in [0, nmax] and m >= 0 (Q2_K/Q4_K/Q5_K subtract an unsigned min).
// Returns the squared error; *s >= 0.
static float fit_affine(const float *x, int n, int nmax, search sr, float *s_out, float *m_out) {
    float lo, hi;
    min_max(x, n, &lo, &hi);
    if (lo > 0.0f) lo = 0.0f; // the offset can only move codes down, so 0 must stay reachable
    float sx = 0.0f, sxx = 0.0f;
    for (int j = 0; j < n; j++) sx += x[j], sxx += x[j] * x[j];
    float range = hi - lo;
    if (!(range > 0.0f)) { // a constant sub-block: q = 0 and the min carry it
        *s_out = 0.0f;
        *m_out = -lo;
        float err = 0.0f;
        for (int j = 0; j < n; j++) err += (x[j] - lo) * (x[j] - lo);
        return err;
    }
    // The plain min/max mapping, should no candidate give a positive scale.
    float best_s = range / (float)nmax, best_m = -lo, best_err = INFINITY;
    for (int k = -sr.steps; k <= sr.steps; k++) {
        float iscale = (float)nmax * (1.0f + sr.span * (float)k / (float)sr.steps) / range;
        float sq = 0.0f, sqq = 0.0f, sqx = 0.0f;
        for (int j = 0; j < n; j++) {
            float q = (float)code((x[j] - lo) * iscale, 0, nmax);
            sq += q;
            sqq += q * q;
            sqx += q * x[j];
        }
        // Least squares for x ≈ s·q + b, then b <= 0 enforced.
        float det = (float)n * sqq - sq * sq, s, b;
        if (det <= 0.0f) continue;
        s = ((float)n * sqx - sq * sx) / det;
        b = (sqq * sx - sq * sqx) / det;
        if (b > 0.0f) {
            b = 0.0f;
            s = sqx / sqq;
        }
        if (!(s > 0.0f)) continue;
        // Σ(s·q + b − x)² expanded into the sums at hand.
        float err = sxx + s * s * sqq + (float)n * b * b - 2.0f * s * sqx - 2.0f * b * sx + 2.0f * s * b * sq;
        if (err < best_err) best_err = err, best_s = s, best_m = -b;
    }
    *s_out = best_s;
    *m_out = best_m;
    return best_err;
}

// x ≈ s·q with q in [-nneg, npos]; s may be negative (the formats' scales are signed, and
// mapping the extreme to the longer negative side gains half a step). Returns s.
static float fit_symmetric(const float *x, int n, int nneg, int npos, search sr) {
    float max = signed_amax(x, n);
    if (max == 0.0f) return 0.0f;
    float best_s = 0.0f, best_gain = -1.0f;
    for (int side = 0; side < 2; side++) {
        float target = side == 0 ? -(float)nneg : (float)npos;
        for (int k = -sr.steps; k <= sr.steps; k++) {
            float iscale = target * (1.0f + sr.span * (float)k / (float)sr.steps) / max;
            float sqq = 0.0f, sqx = 0.0f;
            for (int j = 0; j < n; j++) {
                int q = code(x[j] * iscale, -nneg, npos);
                sqq += (float)(q * q);
                sqx += (float)q * x[j];
            }
            // error = Σx² − (Σqx)²/Σq² at the least-squares s = Σqx/Σq²: maximize the gain.
            if (sqq <= 0.0f) continue;
            float gain = sqx * sqx / sqq;
            if (gain > best_gain) best_gain = gain, best_s = sqx / sqq;
        }
    }
    return best_s;
}

// IQ4's non-linear grid as floats, the 15 midpoints between neighbours (values ascending), and
// the nearest index for every half-unit cell of [-128, 128): every midpoint is a multiple of
// 0.5, so a cell's nearest value is fixed except at its left edge, where v equal to a midpoint
// goes down (one comparison fixes that). Built once per st_quantize_weights call.
typedef struct iq4_grid {
    float v[16], mid[15];
    uint8_t cell[512]; // cell c covers [(c - 256) / 2, (c - 255) / 2)
} iq4_grid;

static void iq4_grid_init(iq4_grid *g) {
    for (int k = 0; k < 16; k++) g->v[k] = (float)st_kvalues_iq4nl[k];
    for (int k = 0; k < 15; k++) g->mid[k] = 0.5f * (g->v[k] + g->v[k + 1]);
    for (int c = 0, i = 0; c < 512; c++) {
        float lo = (float)(c - 256) * 0.5f;
        while (i < 15 && lo >= g->mid[i]) i++; // the cell starts at or above midpoint i
        g->cell[c] = (uint8_t)i;
    }
}

// Index of the grid value nearest v (ties go to the lower value).
static inline int iq4_index(const iq4_grid *g, float v) {
    float c = 2.0f * v + 256.0f;
    int i = !(c >= 0.0f) ? 0 : c >= 511.0f ? 15 : g->cell[(int)c];
    if (i > 0 && v <= g->mid[i - 1]) i--;
    return i;
}

// x ≈ s·grid[idx]; s signed (the grid is not symmetric, so both orientations are tried).
static float fit_iq4(const iq4_grid *g, const float *x, int n, search sr) {
    float max = signed_amax(x, n);
    if (max == 0.0f) return 0.0f;
    float best_s = 0.0f, best_gain = -1.0f;
    for (int side = 0; side < 2; side++) {
        float target = side == 0 ? g->v[0] : g->v[15];
        for (int k = -sr.steps; k <= sr.steps; k++) {
            float iscale = target * (1.0f + sr.span * (float)k / (float)sr.steps) / max;
            float svv = 0.0f, svx = 0.0f;
            for (int j = 0; j < n; j++) {
                float v = g->v[iq4_index(g, x[j] * iscale)];
                svv += v * v;
                svx += v * x[j];
            }
            float gain = svx * svx / svv;
            if (gain > best_gain) best_gain = gain, best_s = svx / svv;
        }
    }
    return best_s;
}

// Codes and squared error of a sub-block under a fixed IQ4 scale dl.
static float iq4_codes(const iq4_grid *g, const float *x, int n, float dl, uint8_t *idx) {
    float id = dl != 0.0f ? 1.0f / dl : 0.0f, err = 0.0f;
    for (int j = 0; j < n; j++) {
        idx[j] = (uint8_t)iq4_index(g, x[j] * id);
        float e = dl * g->v[idx[j]] - x[j];
        err += e * e;
    }
    return err;
}

// Affine codes (q in [0, nmax]) and squared error under fixed dl, ml (y = dl·q − ml).
static float affine_codes(const float *x, int n, int nmax, float dl, float ml, uint8_t *q) {
    float id = dl != 0.0f ? 1.0f / dl : 0.0f, err = 0.0f;
    for (int j = 0; j < n; j++) {
        q[j] = (uint8_t)code((x[j] + ml) * id, 0, nmax);
        float e = dl * (float)q[j] - ml - x[j];
        err += e * e;
    }
    return err;
}

// Signed codes (q in [-nneg, npos]) under a fixed dl.
static void symmetric_codes(const float *x, int n, int nneg, int npos, float dl, int8_t *q) {
    float id = dl != 0.0f ? 1.0f / dl : 0.0f;
    for (int j = 0; j < n; j++) q[j] = (int8_t)code(x[j] * id, -nneg, npos);
}

// ---------------------------------------------------------------------------------------------
// Super-blocks with affine sub-blocks (Q2_K: 16 × 16, 4-bit scales; Q4_K/Q5_K: 8 × 32, 6-bit).
// The sub-block scales and mins are quantized against d = max(s)/smax and dmin = max(m)/smax;
// each sub-block then tries its integer scale and min ±1 and keeps the pair with the least error.

typedef struct affine_plan {
    int nsub, sub, nmax, smax; // sub-blocks, elements each, code max, scale/min code max
    search sr;
} affine_plan;

static void affine_superblock(const float *x, const affine_plan *p, float *d_out, float *dmin_out,
                              uint8_t *sc, uint8_t *mc, uint8_t *q) {
    float s[16], m[16], smax = 0.0f, mmax = 0.0f;
    for (int i = 0; i < p->nsub; i++) {
        fit_affine(x + i * p->sub, p->sub, p->nmax, p->sr, &s[i], &m[i]);
        smax = fmaxf(smax, s[i]);
        mmax = fmaxf(mmax, m[i]);
    }
    float d = f16_round(smax / (float)p->smax), dmin = f16_round(mmax / (float)p->smax);
    float id = d > 0.0f ? 1.0f / d : 0.0f, idmin = dmin > 0.0f ? 1.0f / dmin : 0.0f;
    for (int i = 0; i < p->nsub; i++) {
        const float *xs = x + i * p->sub;
        int sc0 = code(s[i] * id, 0, p->smax), mc0 = code(m[i] * idmin, 0, p->smax);
        float best = INFINITY;
        uint8_t qt[32];
        for (int a = sc0 - 1; a <= sc0 + 1; a++) {
            if (a < 0 || a > p->smax) continue;
            for (int b = mc0 - 1; b <= mc0 + 1; b++) {
                if (b < 0 || b > p->smax) continue;
                float err = affine_codes(xs, p->sub, p->nmax, d * (float)a, dmin * (float)b, qt);
                if (err < best) {
                    best = err;
                    sc[i] = (uint8_t)a;
                    mc[i] = (uint8_t)b;
                    memcpy(q + i * p->sub, qt, (size_t)p->sub);
                }
            }
        }
    }
    *d_out = d;
    *dmin_out = dmin;
}

static const affine_plan plan_q2_K = {16, 16, 3, 15, {0.4f, 5}};
static const affine_plan plan_q4_K = {8, 32, 15, 63, {0.2f, 5}};
static const affine_plan plan_q5_K = {8, 32, 31, 63, {0.1f, 3}};

static void q2_K_block(const float *x, void *out) {
    block_q2_K *y = out;
    float d, dmin;
    uint8_t sc[16], mc[16], q[QK_K];
    affine_superblock(x, &plan_q2_K, &d, &dmin, sc, mc, q);
    y->d = st_f32_to_f16(d);
    y->dmin = st_f32_to_f16(dmin);
    for (int i = 0; i < 16; i++) y->scales[i] = (uint8_t)(sc[i] | mc[i] << 4);
    memset(y->qs, 0, sizeof y->qs);
    for (int e = 0; e < QK_K; e++) { // e = 128h + 32j + l: bits 2j of qs[32h + l]
        int h = e / 128, j = (e / 32) % 4, l = e % 32;
        y->qs[32 * h + l] |= (uint8_t)(q[e] << (2 * j));
    }
}

// Q4_K/Q5_K scale packing (the inverse of st_kq_scale_min).
static void kq_pack_scales(const uint8_t sc[8], const uint8_t mc[8], uint8_t b[12]) {
    for (int j = 0; j < 4; j++) {
        b[j] = (uint8_t)((sc[j] & 63) | (sc[j + 4] >> 4) << 6);
        b[j + 4] = (uint8_t)((mc[j] & 63) | (mc[j + 4] >> 4) << 6);
        b[j + 8] = (uint8_t)((sc[j + 4] & 15) | (mc[j + 4] & 15) << 4);
    }
}

static void q4_K_block(const float *x, void *out) {
    block_q4_K *y = out;
    float d, dmin;
    uint8_t sc[8], mc[8], q[QK_K];
    affine_superblock(x, &plan_q4_K, &d, &dmin, sc, mc, q);
    y->d = st_f32_to_f16(d);
    y->dmin = st_f32_to_f16(dmin);
    kq_pack_scales(sc, mc, y->scales);
    for (int c = 0; c < 4; c++) // chunk c: low nibbles sub-block 2c, high nibbles 2c + 1
        for (int l = 0; l < 32; l++) y->qs[32 * c + l] = (uint8_t)(q[64 * c + l] | q[64 * c + 32 + l] << 4);
}

static void q5_K_block(const float *x, void *out) {
    block_q5_K *y = out;
    float d, dmin;
    uint8_t sc[8], mc[8], q[QK_K];
    affine_superblock(x, &plan_q5_K, &d, &dmin, sc, mc, q);
    y->d = st_f32_to_f16(d);
    y->dmin = st_f32_to_f16(dmin);
    kq_pack_scales(sc, mc, y->scales);
    memset(y->qh, 0, sizeof y->qh);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++)
            y->qs[32 * c + l] = (uint8_t)((q[64 * c + l] & 15) | (q[64 * c + 32 + l] & 15) << 4);
    for (int e = 0; e < QK_K; e++) y->qh[e % 32] |= (uint8_t)((q[e] >> 4) << (e / 32));
}

// ---------------------------------------------------------------------------------------------
// Super-blocks with symmetric 16-element sub-blocks (Q3_K: codes -4..3, 6-bit signed scales;
// Q6_K: codes -32..31, int8 scales). The sub-block scale of largest magnitude maps to the most
// negative scale code, so the super-block scale d may be negative.

static void symmetric_superblock(const float *x, int nneg, int npos, int sneg, int spos, search sr,
                                 float *d_out, int8_t sc[16], int8_t q[QK_K]) {
    float s[16];
    for (int i = 0; i < 16; i++) s[i] = fit_symmetric(x + 16 * i, 16, nneg, npos, sr);
    float smax = signed_amax(s, 16);
    float d = f16_round(smax / -(float)sneg), id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < 16; i++) {
        sc[i] = (int8_t)code(s[i] * id, -sneg, spos);
        symmetric_codes(x + 16 * i, 16, nneg, npos, d * (float)sc[i], q + 16 * i);
    }
    *d_out = d;
}

static void q3_K_block(const float *x, void *out) {
    block_q3_K *y = out;
    float d;
    int8_t sc[16], q[QK_K];
    symmetric_superblock(x, 4, 3, 32, 31, (search){0.4f, 5}, &d, sc, q);
    y->d = st_f32_to_f16(d);
    memset(y->scales, 0, sizeof y->scales);
    for (int s = 0; s < 16; s++) { // 6-bit u = sc + 32: low nibble in byte s % 8, top 2 bits in 8 + s % 4
        int u = sc[s] + 32;
        y->scales[s % 8] |= (uint8_t)((u & 15) << (4 * (s / 8)));
        y->scales[8 + s % 4] |= (uint8_t)((u >> 4) << (2 * (s / 4)));
    }
    memset(y->qs, 0, sizeof y->qs);
    memset(y->hmask, 0, sizeof y->hmask);
    for (int e = 0; e < QK_K; e++) { // u = q + 4: low 2 bits in qs, bit 2 in hmask
        int h = e / 128, j = (e / 32) % 4, l = e % 32, u = q[e] + 4;
        y->qs[32 * h + l] |= (uint8_t)((u & 3) << (2 * j));
        y->hmask[l] |= (uint8_t)((u >> 2) << (4 * h + j));
    }
}

static void q6_K_block(const float *x, void *out) {
    block_q6_K *y = out;
    float d;
    int8_t sc[16], q[QK_K];
    symmetric_superblock(x, 32, 31, 128, 127, (search){0.1f, 2}, &d, sc, q);
    y->d = st_f32_to_f16(d);
    memcpy(y->scales, sc, sizeof y->scales);
    memset(y->ql, 0, sizeof y->ql);
    memset(y->qh, 0, sizeof y->qh);
    for (int e = 0; e < QK_K; e++) { // e = 128h + 32k + l; u = q + 32
        int h = e / 128, k = (e / 32) % 4, l = e % 32, u = q[e] + 32;
        y->ql[64 * h + 32 * (k % 2) + l] |= (uint8_t)((u & 15) << (4 * (k / 2)));
        y->qh[32 * h + l] |= (uint8_t)((u >> 4) << (2 * k));
    }
}

// ---------------------------------------------------------------------------------------------
// IQ4_NL (32 elements, one fp16 scale) and IQ4_XS (8 × 32 with 6-bit signed sub-block scales).

static const search iq4_search = {0.2f, 4};

static void iq4_nl_block(const iq4_grid *g, const float *x, block_iq4_nl *y) {
    float d = f16_round(fit_iq4(g, x, QK4_NL, iq4_search));
    uint8_t idx[QK4_NL];
    iq4_codes(g, x, QK4_NL, d, idx);
    y->d = st_f32_to_f16(d);
    for (int j = 0; j < 16; j++) y->qs[j] = (uint8_t)(idx[j] | idx[j + 16] << 4);
}

static void iq4_xs_block(const iq4_grid *g, const float *x, block_iq4_xs *y) {
    float s[8];
    for (int i = 0; i < 8; i++) s[i] = fit_iq4(g, x + 32 * i, 32, iq4_search);
    float smax = signed_amax(s, 8);
    float d = f16_round(smax / -32.0f), id = d != 0.0f ? 1.0f / d : 0.0f;
    y->d = st_f32_to_f16(d);
    y->scales_h = 0;
    memset(y->scales_l, 0, sizeof y->scales_l);
    for (int i = 0; i < 8; i++) {
        const float *xs = x + 32 * i;
        int l0 = code(s[i] * id, -32, 31), best_l = l0;
        uint8_t idx[32], tmp[32];
        float best = INFINITY;
        for (int l = l0 - 1; l <= l0 + 1; l++) {
            if (l < -32 || l > 31) continue;
            float err = iq4_codes(g, xs, 32, d * (float)l, tmp);
            if (err < best) {
                best = err;
                best_l = l;
                memcpy(idx, tmp, sizeof idx);
            }
        }
        int ls = best_l + 32;
        y->scales_l[i / 2] |= (uint8_t)((ls & 15) << (4 * (i % 2)));
        y->scales_h |= (uint16_t)((ls >> 4) << (2 * i));
        for (int j = 0; j < 16; j++) y->qs[16 * i + j] = (uint8_t)(idx[j] | idx[j + 16] << 4);
    }
}

// ---------------------------------------------------------------------------------------------

typedef void (*block_fn)(const float *x, void *y);

static block_fn block_quantizer(st_type type) {
    switch (type) {
    case ST_TYPE_Q4_0: return q4_0_block;
    case ST_TYPE_Q4_1: return q4_1_block;
    case ST_TYPE_Q5_0: return q5_0_block;
    case ST_TYPE_Q5_1: return q5_1_block;
    case ST_TYPE_Q2_K: return q2_K_block;
    case ST_TYPE_Q3_K: return q3_K_block;
    case ST_TYPE_Q4_K: return q4_K_block;
    case ST_TYPE_Q5_K: return q5_K_block;
    case ST_TYPE_Q6_K: return q6_K_block;
    default: return NULL;
    }
}

bool st_quantize_weights_supported(st_type type) {
    switch (type) {
    case ST_TYPE_IQ4_NL:
    case ST_TYPE_IQ4_XS:
    case ST_TYPE_F32:
    case ST_TYPE_F16:
    case ST_TYPE_BF16:
    case ST_TYPE_Q8_0: return true;
    default: return block_quantizer(type) != NULL;
    }
}

void st_quantize_weights(st_type type, const float *src, void *dst, int64_t rows, int64_t n) {
    const st_type_info *info = st_type_get(type);
    ST_ASSERT(info && st_quantize_weights_supported(type) && rows >= 0 && n >= 0 && n % info->block == 0);
    int64_t nb = rows * n / info->block;
    block_fn fn = block_quantizer(type);
    if (fn) {
        uint8_t *out = dst;
        for (int64_t i = 0; i < nb; i++) fn(src + i * info->block, out + i * (size_t)info->block_bytes);
    } else if (type == ST_TYPE_IQ4_NL || type == ST_TYPE_IQ4_XS) {
        iq4_grid g;
        iq4_grid_init(&g);
        for (int64_t i = 0; i < nb; i++) {
            if (type == ST_TYPE_IQ4_NL) iq4_nl_block(&g, src + i * QK4_NL, (block_iq4_nl *)dst + i);
            else iq4_xs_block(&g, src + i * QK_K, (block_iq4_xs *)dst + i);
        }
    } else { // the plain types and Q8_0: the activation quantizer is the weight quantizer
        st_quantize(type, src, dst, rows * n);
    }
}
