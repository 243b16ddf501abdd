// quant: dequantization of every computable type to f32, one function per type, with ggml's
// exact layouts (REFERENCE.md §4.2). The float operations are done in the order gguf-py's NumPy
// dequantizers use, so results match gguf.quants.dequantize bit for bit. A path's kernel table
// may hold a faster one for a type (AVX2's F16), with the same values.

#include <string.h>

#include "quant/quant.h"
#include "quant/blocks.h"
#include "quant/iq_tables.h"
#include "quant/kernels.h"

static float f16(st_f16 h) { return st_f16_to_f32(h); }

static void dequant_f16(const void *src, float *y, int64_t n) {
    const st_f16 *x = src;
    for (int64_t i = 0; i < n; i++) y[i] = f16(x[i]);
}

static void dequant_bf16(const void *src, float *y, int64_t n) {
    const st_bf16 *x = src;
    for (int64_t i = 0; i < n; i++) y[i] = st_bf16_to_f32(x[i]);
}

// ---------------------------------------------------------------------------------------------
// 32-element blocks: nibble j is element j, the high nibble element j + 16.

static void dequant_q4_0(const void *src, float *y, int64_t n) {
    const block_q4_0 *x = src;
    for (int64_t i = 0; i < n / QK4_0; i++, y += QK4_0) {
        float d = f16(x[i].d);
        for (int j = 0; j < QK4_0 / 2; j++) {
            y[j] = d * (float)((x[i].qs[j] & 15) - 8);
            y[j + 16] = d * (float)((x[i].qs[j] >> 4) - 8);
        }
    }
}

static void dequant_q4_1(const void *src, float *y, int64_t n) {
    const block_q4_1 *x = src;
    for (int64_t i = 0; i < n / QK4_1; i++, y += QK4_1) {
        float d = f16(x[i].d), m = f16(x[i].m);
        for (int j = 0; j < QK4_1 / 2; j++) {
            y[j] = d * (float)(x[i].qs[j] & 15) + m;
            y[j + 16] = d * (float)(x[i].qs[j] >> 4) + m;
        }
    }
}

// 5-bit value of element e: the nibble plus bit e of qh as bit 4.
static int q5_value(const uint8_t *qs, const uint8_t *qh4, int e) {
    uint32_t qh;
    memcpy(&qh, qh4, sizeof qh);
    int nib = e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
    return nib | (int)((qh >> e) & 1) << 4;
}

static void dequant_q5_0(const void *src, float *y, int64_t n) {
    const block_q5_0 *x = src;
    for (int64_t i = 0; i < n / QK5_0; i++, y += QK5_0) {
        float d = f16(x[i].d);
        for (int e = 0; e < QK5_0; e++) y[e] = d * (float)(q5_value(x[i].qs, x[i].qh, e) - 16);
    }
}

static void dequant_q5_1(const void *src, float *y, int64_t n) {
    const block_q5_1 *x = src;
    for (int64_t i = 0; i < n / QK5_1; i++, y += QK5_1) {
        float d = f16(x[i].d), m = f16(x[i].m);
        for (int e = 0; e < QK5_1; e++) y[e] = d * (float)q5_value(x[i].qs, x[i].qh, e) + m;
    }
}

static void dequant_q8_0(const void *src, float *y, int64_t n) {
    const block_q8_0 *x = src;
    for (int64_t i = 0; i < n / QK8_0; i++, y += QK8_0) {
        float d = f16(x[i].d);
        for (int j = 0; j < QK8_0; j++) y[j] = d * (float)x[i].qs[j];
    }
}

static void dequant_q8_1(const void *src, float *y, int64_t n) {
    const block_q8_1 *x = src;
    for (int64_t i = 0; i < n / QK8_1; i++, y += QK8_1) {
        float d = f16(x[i].d);
        for (int j = 0; j < QK8_1; j++) y[j] = d * (float)x[i].qs[j];
    }
}

static void dequant_iq4_nl(const void *src, float *y, int64_t n) {
    const block_iq4_nl *x = src;
    for (int64_t i = 0; i < n / QK4_NL; i++, y += QK4_NL) {
        float d = f16(x[i].d);
        for (int j = 0; j < QK4_NL / 2; j++) {
            y[j] = d * (float)st_kvalues_iq4nl[x[i].qs[j] & 15];
            y[j + 16] = d * (float)st_kvalues_iq4nl[x[i].qs[j] >> 4];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// K-quants: 256-element super-blocks. Element e = 128h + 32j + l for the 2-bit layouts.

static void dequant_q2_K(const void *src, float *y, int64_t n) {
    const block_q2_K *x = src;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        float d = f16(x[i].d), dmin = f16(x[i].dmin);
        for (int e = 0; e < QK_K; e++) {
            int h = e / 128, j = (e / 32) % 4, l = e % 32;
            uint8_t sc = x[i].scales[e / 16];
            int q = (x[i].qs[32 * h + l] >> (2 * j)) & 3;
            y[e] = (d * (float)(sc & 15)) * (float)q - dmin * (float)(sc >> 4);
        }
    }
}

static void dequant_q3_K(const void *src, float *y, int64_t n) {
    const block_q3_K *x = src;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        float d = f16(x[i].d);
        int8_t sc[16];
        st_q3k_scales(x[i].scales, sc);
        for (int e = 0; e < QK_K; e++) {
            int h = e / 128, j = (e / 32) % 4, l = e % 32;
            int q = ((x[i].qs[32 * h + l] >> (2 * j)) & 3) - ((x[i].hmask[l] >> (4 * h + j)) & 1 ? 0 : 4);
            y[e] = (d * (float)sc[e / 16]) * (float)q;
        }
    }
}

static void dequant_q4_K(const void *src, float *y, int64_t n) {
    const block_q4_K *x = src;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        float d = f16(x[i].d), dmin = f16(x[i].dmin);
        for (int sb = 0; sb < 8; sb++) { // sub-block sb: nibble (sb % 2) of qs[32 (sb / 2) + l]
            uint8_t sc, m;
            st_kq_scale_min(x[i].scales, sb, &sc, &m);
            float dl = d * (float)sc, ml = dmin * (float)m;
            const uint8_t *qs = x[i].qs + 32 * (sb / 2);
            for (int l = 0; l < 32; l++) y[32 * sb + l] = dl * (float)((qs[l] >> (4 * (sb % 2))) & 15) - ml;
        }
    }
}

static void dequant_q5_K(const void *src, float *y, int64_t n) {
    const block_q5_K *x = src;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        float d = f16(x[i].d), dmin = f16(x[i].dmin);
        for (int sb = 0; sb < 8; sb++) {
            uint8_t sc, m;
            st_kq_scale_min(x[i].scales, sb, &sc, &m);
            float dl = d * (float)sc, ml = dmin * (float)m;
            const uint8_t *qs = x[i].qs + 32 * (sb / 2);
            for (int l = 0; l < 32; l++) {
                int q = ((qs[l] >> (4 * (sb % 2))) & 15) | ((x[i].qh[l] >> sb) & 1) << 4;
                y[32 * sb + l] = dl * (float)q - ml;
            }
        }
    }
}

static void dequant_q6_K(const void *src, float *y, int64_t n) {
    const block_q6_K *x = src;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        float d = f16(x[i].d);
        for (int e = 0; e < QK_K; e++) {
            int h = e / 128, k = (e / 32) % 4, l = e % 32; // k: which of the four 32-rows in the half
            uint8_t ql = x[i].ql[64 * h + 32 * (k % 2) + l];
            int lo = k < 2 ? ql & 15 : ql >> 4;
            int hi = (x[i].qh[32 * h + l] >> (2 * k)) & 3;
            y[e] = (d * (float)x[i].scales[e / 16]) * (float)((lo | hi << 4) - 32);
        }
    }
}

static void dequant_q8_K(const void *src, float *y, int64_t n) {
    const block_q8_K *x = src;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K)
        for (int j = 0; j < QK_K; j++) y[j] = x[i].d * (float)x[i].qs[j];
}

// ---------------------------------------------------------------------------------------------
// IQ types: lattice grids (iq_tables.c) with signs and sub-block scales.

// Writes 8 elements of a grid row, scaled by db, with sign bits (bit j set: element j negative).
static void grid8_write(float *y, float db, uint64_t row, unsigned signs) {
    for (int j = 0; j < 8; j++) {
        float v = db * (float)st_grid_elem(row, j);
        y[j] = (signs >> j) & 1 ? -v : v;
    }
}

static void dequant_iq2_xxs(const void *src, float *y, int64_t n) {
    const block_iq2_xxs *x = src;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        float d = f16(x[i].d);
        const uint8_t *qs = (const uint8_t *)x[i].qs;
        for (int ib = 0; ib < QK_K / 32; ib++) {
            uint32_t idx, aux;
            memcpy(&idx, qs + 8 * ib, 4);
            memcpy(&aux, qs + 8 * ib + 4, 4);
            float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
            for (int k = 0; k < 4; k++)
                grid8_write(y + 32 * ib + 8 * k, db, st_iq2xxs_grid[(idx >> (8 * k)) & 255],
                            st_ksigns_iq2xs[(aux >> (7 * k)) & 127]);
        }
    }
}

// IQ2_XS / IQ2_S: one 4-bit scale per 16 elements, low nibble first.
static float iq2_db(float d, const uint8_t *scales, int g16) {
    return d * (0.5f + (float)((scales[g16 / 2] >> (4 * (g16 % 2))) & 15)) * 0.25f;
}

static void dequant_iq2_xs(const void *src, float *y, int64_t n) {
    const block_iq2_xs *x = src;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        float d = f16(x[i].d);
        for (int r = 0; r < QK_K / 8; r++) {
            uint16_t v = x[i].qs[r];
            grid8_write(y + 8 * r, iq2_db(d, x[i].scales, r / 2), st_iq2xs_grid[v & 511], st_ksigns_iq2xs[v >> 9]);
        }
    }
}

static void dequant_iq2_s(const void *src, float *y, int64_t n) {
    const block_iq2_s *x = src;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        float d = f16(x[i].d);
        const uint8_t *qs = x[i].qs, *signs = x[i].qs + QK_K / 8;
        for (int r = 0; r < QK_K / 8; r++) {
            int idx = qs[r] | ((x[i].qh[r / 4] >> (2 * (r % 4))) & 3) << 8;
            grid8_write(y + 8 * r, iq2_db(d, x[i].scales, r / 2), st_iq2s_grid[idx], signs[r]);
        }
    }
}

static void dequant_iq3_xxs(const void *src, float *y, int64_t n) {
    const block_iq3_xxs *x = src;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        float d = f16(x[i].d);
        const uint8_t *qs = x[i].qs, *words = x[i].qs + QK_K / 4;
        for (int ib = 0; ib < QK_K / 32; ib++) {
            uint32_t aux;
            memcpy(&aux, words + 4 * ib, 4);
            float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
            for (int k = 0; k < 4; k++) {
                uint64_t row = st_iq3xxs_grid[qs[8 * ib + 2 * k]] | (uint64_t)st_iq3xxs_grid[qs[8 * ib + 2 * k + 1]] << 32;
                grid8_write(y + 32 * ib + 8 * k, db, row, st_ksigns_iq2xs[(aux >> (7 * k)) & 127]);
            }
        }
    }
}

static void dequant_iq3_s(const void *src, float *y, int64_t n) {
    const block_iq3_s *x = src;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        float d = f16(x[i].d);
        for (int ib = 0; ib < QK_K / 32; ib++) {
            float db = d * (float)(1 + 2 * ((x[i].scales[ib / 2] >> (4 * (ib % 2))) & 15));
            for (int k = 0; k < 8; k += 2) { // two 9-bit indices of 4 elements each
                int r = 8 * ib + k;
                int i0 = x[i].qs[r] | ((x[i].qh[ib] >> k) & 1) << 8;
                int i1 = x[i].qs[r + 1] | ((x[i].qh[ib] >> (k + 1)) & 1) << 8;
                uint64_t row = st_iq3s_grid[i0] | (uint64_t)st_iq3s_grid[i1] << 32;
                grid8_write(y + 4 * r, db, row, x[i].signs[r / 2]);
            }
        }
    }
}

// IQ1: y = dl (grid + delta), grid in {-1, 0, 1}, delta = ±ST_IQ1_DELTA.
static void iq1_write(float *y, float dl, uint64_t row, bool negative_delta) {
    float delta = negative_delta ? -ST_IQ1_DELTA : ST_IQ1_DELTA;
    for (int j = 0; j < 8; j++) y[j] = dl * ((float)st_grid_elem(row, j) + delta);
}

static void dequant_iq1_s(const void *src, float *y, int64_t n) {
    const block_iq1_s *x = src;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        float d = f16(x[i].d);
        for (int ib = 0; ib < QK_K / 32; ib++) {
            unsigned h = x[i].qh[ib];
            float dl = d * (float)(2 * ((h >> 12) & 7) + 1);
            for (int l = 0; l < 4; l++)
                iq1_write(y + 32 * ib + 8 * l, dl, st_iq1s_grid[x[i].qs[4 * ib + l] | ((h >> (3 * l)) & 7) << 8],
                          h & 0x8000);
        }
    }
}

static void dequant_iq1_m(const void *src, float *y, int64_t n) {
    const block_iq1_m *x = src;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        uint16_t sc[4];
        memcpy(sc, x[i].scales, sizeof sc);
        // The fp16 block scale is spread over the top nibbles of the four scale words.
        float d = f16((st_f16)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000)));
        for (int r = 0; r < QK_K / 8; r++) { // rows of 8: 3-bit scale per 16, own delta sign
            int ib = r / 4;
            int s = (sc[ib / 2] >> (6 * (ib % 2) + 3 * ((r % 4) / 2))) & 7;
            int hq = (x[i].qh[r / 2] >> (4 * (r % 2))) & 15;
            iq1_write(y + 8 * r, d * (float)(2 * s + 1), st_iq1s_grid[x[i].qs[r] | (hq & 7) << 8], hq & 8);
        }
    }
}

static void dequant_iq4_xs(const void *src, float *y, int64_t n) {
    const block_iq4_xs *x = src;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        float d = f16(x[i].d);
        for (int ib = 0; ib < QK_K / 32; ib++) {
            int ls = ((x[i].scales_l[ib / 2] >> (4 * (ib % 2))) & 15) | ((x[i].scales_h >> (2 * ib)) & 3) << 4;
            float dl = d * (float)(ls - 32);
            const uint8_t *qs = x[i].qs + 16 * ib;
            for (int j = 0; j < 16; j++) {
                y[32 * ib + j] = dl * (float)st_kvalues_iq4nl[qs[j] & 15];
                y[32 * ib + j + 16] = dl * (float)st_kvalues_iq4nl[qs[j] >> 4];
            }
        }
    }
}

typedef void (*dequant_fn)(const void *src, float *y, int64_t n);

static const dequant_fn dequant_table[ST_TYPE_COUNT] = {
    [ST_TYPE_F16] = dequant_f16,         [ST_TYPE_BF16] = dequant_bf16,
    [ST_TYPE_Q4_0] = dequant_q4_0,       [ST_TYPE_Q4_1] = dequant_q4_1,
    [ST_TYPE_Q5_0] = dequant_q5_0,       [ST_TYPE_Q5_1] = dequant_q5_1,
    [ST_TYPE_Q8_0] = dequant_q8_0,       [ST_TYPE_Q8_1] = dequant_q8_1,
    [ST_TYPE_IQ4_NL] = dequant_iq4_nl,   [ST_TYPE_Q2_K] = dequant_q2_K,
    [ST_TYPE_Q3_K] = dequant_q3_K,       [ST_TYPE_Q4_K] = dequant_q4_K,
    [ST_TYPE_Q5_K] = dequant_q5_K,       [ST_TYPE_Q6_K] = dequant_q6_K,
    [ST_TYPE_Q8_K] = dequant_q8_K,       [ST_TYPE_IQ2_XXS] = dequant_iq2_xxs,
    [ST_TYPE_IQ2_XS] = dequant_iq2_xs,   [ST_TYPE_IQ2_S] = dequant_iq2_s,
    [ST_TYPE_IQ3_XXS] = dequant_iq3_xxs, [ST_TYPE_IQ3_S] = dequant_iq3_s,
    [ST_TYPE_IQ1_S] = dequant_iq1_s,     [ST_TYPE_IQ1_M] = dequant_iq1_m,
    [ST_TYPE_IQ4_XS] = dequant_iq4_xs,
};

// Types with kernels, plus the activation types Q8_1 and Q8_K (tests read them back).
void st_dequantize(st_type type, const void *src, float *dst, int64_t n) {
    const st_type_info *info = st_type_get(type);
    ST_ASSERT(info && n >= 0 && n % info->block == 0);
    if (type == ST_TYPE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    st_dequantize_fn fast = st_quant_kernels_now()->dequantize[type];
    if (fast) {
        fast(src, dst, n);
        return;
    }
    ST_ASSERT(dequant_table[type] != NULL);
    dequant_table[type](src, dst, n);
}
