// quant: the scalar reference dot kernels, one per weight type, each against the activation
// type REFERENCE.md §4.3 pairs it with. Quants are multiplied in integers per (sub-)block and
// scaled once per block, as ggml's reference vec_dot does; the SIMD paths are tested against these.

#include <string.h>

#include "quant/kernels.h"
#include "quant/blocks.h"
#include "quant/iq_tables.h"

static float f16(st_f16 h) { return st_f16_to_f32(h); }

static uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static int dot_i8(const int8_t *a, const int8_t *b, int n) {
    int s = 0;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static int sum_i8(const int8_t *a, int n) {
    int s = 0;
    for (int i = 0; i < n; i++) s += a[i];
    return s;
}

// ---------------------------------------------------------------------------------------------
// Plain types: products summed in double, as ggml's reference does.

static void dot_f32(int64_t n, float *s, const void *vw, const void *vx) {
    const float *w = vw, *x = vx;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += (double)w[i] * x[i];
    *s = (float)sum;
}

static void dot_f16(int64_t n, float *s, const void *vw, const void *vx) {
    const st_f16 *w = vw, *x = vx;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += (double)(f16(w[i]) * f16(x[i]));
    *s = (float)sum;
}

static void dot_bf16(int64_t n, float *s, const void *vw, const void *vx) {
    const st_bf16 *w = vw, *x = vx;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += (double)(st_bf16_to_f32(w[i]) * st_bf16_to_f32(x[i]));
    *s = (float)sum;
}

// ---------------------------------------------------------------------------------------------
// 32-element blocks against Q8_0 / Q8_1. Nibble j is element j, high nibble element j + 16.

static void dot_q4_0(int64_t n, float *s, const void *vw, const void *vx) {
    const block_q4_0 *w = vw;
    const block_q8_0 *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK4_0; i++) {
        int isum = 0;
        for (int j = 0; j < QK4_0 / 2; j++)
            isum += ((w[i].qs[j] & 15) - 8) * x[i].qs[j] + ((w[i].qs[j] >> 4) - 8) * x[i].qs[j + 16];
        sum += (float)isum * (f16(w[i].d) * f16(x[i].d));
    }
    *s = sum;
}

// (d q + m) . (dx qx) = d dx sum(q qx) + m * s, where the activation's s = dx * sum(qx).
static void dot_q4_1(int64_t n, float *s, const void *vw, const void *vx) {
    const block_q4_1 *w = vw;
    const block_q8_1 *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK4_1; i++) {
        int isum = 0;
        for (int j = 0; j < QK4_1 / 2; j++)
            isum += (w[i].qs[j] & 15) * x[i].qs[j] + (w[i].qs[j] >> 4) * x[i].qs[j + 16];
        sum += (float)isum * (f16(w[i].d) * f16(x[i].d)) + f16(w[i].m) * f16(x[i].s);
    }
    *s = sum;
}

// The 5th bit of element e is bit e of qh.
static int q5_value(const uint8_t *qs, uint32_t qh, int e) {
    int nib = e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
    return nib | (int)((qh >> e) & 1) << 4;
}

static void dot_q5_0(int64_t n, float *s, const void *vw, const void *vx) {
    const block_q5_0 *w = vw;
    const block_q8_0 *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK5_0; i++) {
        uint32_t qh = load_u32(w[i].qh);
        int isum = 0;
        for (int e = 0; e < QK5_0; e++) isum += (q5_value(w[i].qs, qh, e) - 16) * x[i].qs[e];
        sum += (float)isum * (f16(w[i].d) * f16(x[i].d));
    }
    *s = sum;
}

static void dot_q5_1(int64_t n, float *s, const void *vw, const void *vx) {
    const block_q5_1 *w = vw;
    const block_q8_1 *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK5_1; i++) {
        uint32_t qh = load_u32(w[i].qh);
        int isum = 0;
        for (int e = 0; e < QK5_1; e++) isum += q5_value(w[i].qs, qh, e) * x[i].qs[e];
        sum += (float)isum * (f16(w[i].d) * f16(x[i].d)) + f16(w[i].m) * f16(x[i].s);
    }
    *s = sum;
}

static void dot_q8_0(int64_t n, float *s, const void *vw, const void *vx) {
    const block_q8_0 *w = vw;
    const block_q8_0 *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK8_0; i++)
        sum += (float)dot_i8(w[i].qs, x[i].qs, QK8_0) * (f16(w[i].d) * f16(x[i].d));
    *s = sum;
}

static void dot_iq4_nl(int64_t n, float *s, const void *vw, const void *vx) {
    const block_iq4_nl *w = vw;
    const block_q8_0 *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK4_NL; i++) {
        int isum = 0;
        for (int j = 0; j < QK4_NL / 2; j++)
            isum += st_kvalues_iq4nl[w[i].qs[j] & 15] * x[i].qs[j] +
                    st_kvalues_iq4nl[w[i].qs[j] >> 4] * x[i].qs[j + 16];
        sum += (float)isum * (f16(w[i].d) * f16(x[i].d));
    }
    *s = sum;
}

// ---------------------------------------------------------------------------------------------
// K-quants against Q8_K. Each kernel unpacks a block's quants to int8 q[256], multiplies them
// with the activation per sub-block in integers, and scales once per block. Offsets (the
// "min" terms) use the activation's bsums (sums of 16 quants).

static void dot_q2_K(int64_t n, float *s, const void *vw, const void *vx) {
    const block_q2_K *w = vw;
    const block_q8_K *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int8_t q[QK_K];
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) q[128 * h + 32 * j + l] = (w[i].qs[32 * h + l] >> (2 * j)) & 3;
        int isum = 0, msum = 0;
        for (int sb = 0; sb < 16; sb++) {
            isum += (w[i].scales[sb] & 15) * dot_i8(q + 16 * sb, x[i].qs + 16 * sb, 16);
            msum += (w[i].scales[sb] >> 4) * x[i].bsums[sb];
        }
        sum += x[i].d * (f16(w[i].d) * (float)isum - f16(w[i].dmin) * (float)msum);
    }
    *s = sum;
}

static void dot_q3_K(int64_t n, float *s, const void *vw, const void *vx) {
    const block_q3_K *w = vw;
    const block_q8_K *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int8_t q[QK_K], sc[16];
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) {
                    int lo = (w[i].qs[32 * h + l] >> (2 * j)) & 3;
                    int high_set = (w[i].hmask[l] >> (4 * h + j)) & 1;
                    q[128 * h + 32 * j + l] = (int8_t)(lo - (high_set ? 0 : 4));
                }
        st_q3k_scales(w[i].scales, sc);
        int isum = 0;
        for (int sb = 0; sb < 16; sb++) isum += sc[sb] * dot_i8(q + 16 * sb, x[i].qs + 16 * sb, 16);
        sum += x[i].d * f16(w[i].d) * (float)isum;
    }
    *s = sum;
}

// Q4_K and Q5_K share everything after unpacking: 8 sub-blocks of 32 with 6-bit scale and min.
static float kq_block_dot(const int8_t *q, const uint8_t *scales, st_f16 d, st_f16 dmin,
                          const block_q8_K *x) {
    int isum = 0, msum = 0;
    for (int sb = 0; sb < 8; sb++) {
        uint8_t sc, m;
        st_kq_scale_min(scales, sb, &sc, &m);
        isum += sc * dot_i8(q + 32 * sb, x->qs + 32 * sb, 32);
        msum += m * (x->bsums[2 * sb] + x->bsums[2 * sb + 1]);
    }
    return x->d * (f16(d) * (float)isum - f16(dmin) * (float)msum);
}

static void dot_q4_K(int64_t n, float *s, const void *vw, const void *vx) {
    const block_q4_K *w = vw;
    const block_q8_K *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int8_t q[QK_K];
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                q[64 * c + l] = w[i].qs[32 * c + l] & 15;
                q[64 * c + 32 + l] = w[i].qs[32 * c + l] >> 4;
            }
        sum += kq_block_dot(q, w[i].scales, w[i].d, w[i].dmin, &x[i]);
    }
    *s = sum;
}

static void dot_q5_K(int64_t n, float *s, const void *vw, const void *vx) {
    const block_q5_K *w = vw;
    const block_q8_K *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int8_t q[QK_K];
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                q[64 * c + l] = (int8_t)((w[i].qs[32 * c + l] & 15) | ((w[i].qh[l] >> (2 * c)) & 1) << 4);
                q[64 * c + 32 + l] = (int8_t)((w[i].qs[32 * c + l] >> 4) | ((w[i].qh[l] >> (2 * c + 1)) & 1) << 4);
            }
        sum += kq_block_dot(q, w[i].scales, w[i].d, w[i].dmin, &x[i]);
    }
    *s = sum;
}

static void dot_q6_K(int64_t n, float *s, const void *vw, const void *vx) {
    const block_q6_K *w = vw;
    const block_q8_K *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int8_t q[QK_K];
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w[i].ql + 64 * h, *qh = w[i].qh + 32 * h;
            for (int l = 0; l < 32; l++) {
                int8_t *o = q + 128 * h + l;
                o[0] = (int8_t)(((ql[l] & 15) | ((qh[l] >> 0) & 3) << 4) - 32);
                o[32] = (int8_t)(((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4) - 32);
                o[64] = (int8_t)(((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32);
                o[96] = (int8_t)(((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32);
            }
        }
        int isum = 0;
        for (int sb = 0; sb < 16; sb++) isum += w[i].scales[sb] * dot_i8(q + 16 * sb, x[i].qs + 16 * sb, 16);
        sum += x[i].d * f16(w[i].d) * (float)isum;
    }
    *s = sum;
}

// ---------------------------------------------------------------------------------------------
// IQ types against Q8_K. Sub-block scales are odd integers ls = 2s+1 and the block's common
// factor (1/8 for IQ2, 1/4 for IQ3_XXS) is applied once at the end.

// One grid row of 8 with explicit sign bits (bit j set: element j negative) against 8 activations.
static int grid8_dot(uint64_t row, unsigned signs, const int8_t *y) {
    int s = 0;
    for (int j = 0; j < 8; j++) {
        int v = st_grid_elem(row, j) * y[j];
        s += (signs >> j) & 1 ? -v : v;
    }
    return s;
}

// Two IQ3 grid rows of 4 make 8 elements.
static int grid4x2_dot(uint32_t a, uint32_t b, unsigned signs, const int8_t *y) {
    return grid8_dot((uint64_t)a | (uint64_t)b << 32, signs, y);
}

static void dot_iq2_xxs(int64_t n, float *s, const void *vw, const void *vx) {
    const block_iq2_xxs *w = vw;
    const block_q8_K *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const uint8_t *qs = (const uint8_t *)w[i].qs;
        int bsum = 0;
        for (int ib = 0; ib < QK_K / 32; ib++) {
            uint32_t idx = load_u32(qs + 8 * ib), aux = load_u32(qs + 8 * ib + 4);
            int isum = 0;
            for (int k = 0; k < 4; k++)
                isum += grid8_dot(st_iq2xxs_grid[(idx >> (8 * k)) & 255], st_ksigns_iq2xs[(aux >> (7 * k)) & 127],
                                  x[i].qs + 32 * ib + 8 * k);
            bsum += (2 * (int)(aux >> 28) + 1) * isum;
        }
        sum += f16(w[i].d) * x[i].d * (float)bsum;
    }
    *s = 0.125f * sum;
}

// IQ2_XS and IQ2_S: 4-bit scales, one per 16 elements (low nibble first).
static int iq2_scale(const uint8_t *scales, int g16) {
    return 2 * ((scales[g16 / 2] >> (4 * (g16 % 2))) & 15) + 1;
}

static void dot_iq2_xs(int64_t n, float *s, const void *vw, const void *vx) {
    const block_iq2_xs *w = vw;
    const block_q8_K *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int bsum = 0;
        for (int g = 0; g < QK_K / 16; g++) {
            int isum = 0;
            for (int k = 0; k < 2; k++) {
                uint16_t v = w[i].qs[2 * g + k];
                isum += grid8_dot(st_iq2xs_grid[v & 511], st_ksigns_iq2xs[v >> 9], x[i].qs + 16 * g + 8 * k);
            }
            bsum += iq2_scale(w[i].scales, g) * isum;
        }
        sum += f16(w[i].d) * x[i].d * (float)bsum;
    }
    *s = 0.125f * sum;
}

static void dot_iq2_s(int64_t n, float *s, const void *vw, const void *vx) {
    const block_iq2_s *w = vw;
    const block_q8_K *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const uint8_t *qs = w[i].qs, *signs = w[i].qs + QK_K / 8;
        int bsum = 0;
        for (int g = 0; g < QK_K / 16; g++) {
            int isum = 0;
            for (int k = 0; k < 2; k++) {
                int r = 2 * g + k; // row of 8 elements
                int idx = qs[r] | ((w[i].qh[r / 4] >> (2 * (r % 4))) & 3) << 8;
                isum += grid8_dot(st_iq2s_grid[idx], signs[r], x[i].qs + 8 * r);
            }
            bsum += iq2_scale(w[i].scales, g) * isum;
        }
        sum += f16(w[i].d) * x[i].d * (float)bsum;
    }
    *s = 0.125f * sum;
}

static void dot_iq3_xxs(int64_t n, float *s, const void *vw, const void *vx) {
    const block_iq3_xxs *w = vw;
    const block_q8_K *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const uint8_t *qs = w[i].qs, *words = w[i].qs + QK_K / 4;
        int bsum = 0;
        for (int ib = 0; ib < QK_K / 32; ib++) {
            uint32_t aux = load_u32(words + 4 * ib);
            int isum = 0;
            for (int k = 0; k < 4; k++)
                isum += grid4x2_dot(st_iq3xxs_grid[qs[8 * ib + 2 * k]], st_iq3xxs_grid[qs[8 * ib + 2 * k + 1]],
                                    st_ksigns_iq2xs[(aux >> (7 * k)) & 127], x[i].qs + 32 * ib + 8 * k);
            bsum += (2 * (int)(aux >> 28) + 1) * isum;
        }
        sum += f16(w[i].d) * x[i].d * (float)bsum;
    }
    *s = 0.25f * sum;
}

static void dot_iq3_s(int64_t n, float *s, const void *vw, const void *vx) {
    const block_iq3_s *w = vw;
    const block_q8_K *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int bsum = 0;
        for (int ib = 0; ib < QK_K / 32; ib++) {
            int isum = 0;
            for (int k = 0; k < 8; k += 2) { // grid indices k, k+1 of this group: 8 elements
                int r = 8 * ib + k;
                int i0 = w[i].qs[r] | ((w[i].qh[ib] >> k) & 1) << 8;
                int i1 = w[i].qs[r + 1] | ((w[i].qh[ib] >> (k + 1)) & 1) << 8;
                isum += grid4x2_dot(st_iq3s_grid[i0], st_iq3s_grid[i1], w[i].signs[r / 2], x[i].qs + 4 * r);
            }
            bsum += (2 * ((w[i].scales[ib / 2] >> (4 * (ib % 2))) & 15) + 1) * isum;
        }
        sum += f16(w[i].d) * x[i].d * (float)bsum;
    }
    *s = sum;
}

// IQ1: y = dl (grid + delta): the delta term needs only the activation sums.
static void dot_iq1_s(int64_t n, float *s, const void *vw, const void *vx) {
    const block_iq1_s *w = vw;
    const block_q8_K *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int gsum = 0, dsum = 0;
        for (int ib = 0; ib < QK_K / 32; ib++) {
            unsigned h = w[i].qh[ib];
            int ls = 2 * ((h >> 12) & 7) + 1, isum = 0;
            for (int l = 0; l < 4; l++)
                isum += grid8_dot(st_iq1s_grid[w[i].qs[4 * ib + l] | ((h >> (3 * l)) & 7) << 8], 0,
                                  x[i].qs + 32 * ib + 8 * l);
            int ysum = x[i].bsums[2 * ib] + x[i].bsums[2 * ib + 1];
            gsum += ls * isum;
            dsum += ls * (h & 0x8000 ? -ysum : ysum);
        }
        sum += f16(w[i].d) * x[i].d * ((float)gsum + ST_IQ1_DELTA * (float)dsum);
    }
    *s = sum;
}

// IQ1_M's fp16 block scale is the top nibbles of its four scale words.
static float iq1m_scale(const uint8_t *scales) {
    uint16_t sc[4];
    memcpy(sc, scales, sizeof sc);
    return f16((st_f16)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000)));
}

static void dot_iq1_m(int64_t n, float *s, const void *vw, const void *vx) {
    const block_iq1_m *w = vw;
    const block_q8_K *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        uint16_t sc[4];
        memcpy(sc, w[i].scales, sizeof sc);
        int gsum = 0, dsum = 0;
        for (int r = 0; r < QK_K / 8; r++) { // rows of 8; 3-bit scale per 16, delta per 8
            int ib = r / 4;
            int ls = 2 * ((sc[ib / 2] >> (6 * (ib % 2) + 3 * ((r % 4) / 2))) & 7) + 1;
            int hq = (w[i].qh[r / 2] >> (4 * (r % 2))) & 15;
            const int8_t *y = x[i].qs + 8 * r;
            int ysum = sum_i8(y, 8);
            gsum += ls * grid8_dot(st_iq1s_grid[w[i].qs[r] | (hq & 7) << 8], 0, y);
            dsum += ls * (hq & 8 ? -ysum : ysum);
        }
        sum += iq1m_scale(w[i].scales) * x[i].d * ((float)gsum + ST_IQ1_DELTA * (float)dsum);
    }
    *s = sum;
}

static void dot_iq4_xs(int64_t n, float *s, const void *vw, const void *vx) {
    const block_iq4_xs *w = vw;
    const block_q8_K *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int bsum = 0;
        for (int ib = 0; ib < QK_K / 32; ib++) {
            int ls = ((w[i].scales_l[ib / 2] >> (4 * (ib % 2))) & 15) | ((w[i].scales_h >> (2 * ib)) & 3) << 4;
            const uint8_t *qs = w[i].qs + 16 * ib;
            const int8_t *y = x[i].qs + 32 * ib;
            int isum = 0;
            for (int j = 0; j < 16; j++)
                isum += st_kvalues_iq4nl[qs[j] & 15] * y[j] + st_kvalues_iq4nl[qs[j] >> 4] * y[j + 16];
            bsum += (ls - 32) * isum;
        }
        sum += f16(w[i].d) * x[i].d * (float)bsum;
    }
    *s = sum;
}

void st_quant_kernels_scalar(st_quant_kernels *k) {
    k->dot[ST_TYPE_F32] = dot_f32;
    k->dot[ST_TYPE_F16] = dot_f16;
    k->dot[ST_TYPE_BF16] = dot_bf16;
    k->dot[ST_TYPE_Q4_0] = dot_q4_0;
    k->dot[ST_TYPE_Q4_1] = dot_q4_1;
    k->dot[ST_TYPE_Q5_0] = dot_q5_0;
    k->dot[ST_TYPE_Q5_1] = dot_q5_1;
    k->dot[ST_TYPE_Q8_0] = dot_q8_0;
    k->dot[ST_TYPE_IQ4_NL] = dot_iq4_nl;
    k->dot[ST_TYPE_Q2_K] = dot_q2_K;
    k->dot[ST_TYPE_Q3_K] = dot_q3_K;
    k->dot[ST_TYPE_Q4_K] = dot_q4_K;
    k->dot[ST_TYPE_Q5_K] = dot_q5_K;
    k->dot[ST_TYPE_Q6_K] = dot_q6_K;
    k->dot[ST_TYPE_IQ2_XXS] = dot_iq2_xxs;
    k->dot[ST_TYPE_IQ2_XS] = dot_iq2_xs;
    k->dot[ST_TYPE_IQ2_S] = dot_iq2_s;
    k->dot[ST_TYPE_IQ3_XXS] = dot_iq3_xxs;
    k->dot[ST_TYPE_IQ3_S] = dot_iq3_s;
    k->dot[ST_TYPE_IQ1_S] = dot_iq1_s;
    k->dot[ST_TYPE_IQ1_M] = dot_iq1_m;
    k->dot[ST_TYPE_IQ4_XS] = dot_iq4_xs;
}
