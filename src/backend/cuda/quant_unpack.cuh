// backend/cuda: the weight blocks of every quantized type unpacked on the device, 32 elements
// (a "chunk") at a time, into int8 values and per-16 scales/offsets: the one place that knows
// the layouts (REFERENCE.md §4.2); matvec, dequantize and the expert kernels all go through it.
#pragma once

#include <stdint.h>

#include "backend/cuda/cuda_common.cuh"

// The IQ tables, copied from the CPU's (quant/iq_tables.c) at first use: grids are read with
// lane-dependent indices, so they live in global memory (cached in L1) rather than __constant__.
__device__ uint64_t st_dq_iq2xxs[256];
__device__ uint64_t st_dq_iq2xs[512];
__device__ uint64_t st_dq_iq2s[1024];
__device__ uint32_t st_dq_iq3xxs[256];
__device__ uint32_t st_dq_iq3s[512];
__device__ uint64_t st_dq_iq1s[2048];
__device__ uint8_t st_dq_ksigns[128];
__constant__ uint32_t st_dq_kvalues[4]; // IQ4 values, 4 per word (read uniformly: __constant__)

// One chunk of 32 weights: element e = byte (e % 4) of q[e / 4] (as int8), and
// w_e = s0 * q_e + m0 for e < 16, s1 * q_e + m1 for e >= 16 (m only for types with HAS_MIN).
struct st_wchunk {
    int q[8];
    float s0, s1, m0, m1;
};

// Loads. Blocks sit block-size apart from a 16-byte aligned base (the launchers check the
// base), so each type knows the alignment of its fields at compile time.
__device__ __forceinline__ uint32_t ld_a4(const uint8_t *p) { return *(const uint32_t *)p; }
__device__ __forceinline__ uint32_t ld_a2(const uint8_t *p) {
    const uint16_t *h = (const uint16_t *)p;
    return (uint32_t)h[0] | (uint32_t)h[1] << 16;
}
__device__ __forceinline__ uint32_t ld_u16(const uint8_t *p) { return *(const uint16_t *)p; }
__device__ __forceinline__ float ld_f16(const uint8_t *p) { return __half2float(*(const __half *)p); }
__device__ __forceinline__ void ld_a16x2(const uint8_t *p, int v[8]) {
    uint4 a = ((const uint4 *)p)[0], b = ((const uint4 *)p)[1];
    v[0] = (int)a.x; v[1] = (int)a.y; v[2] = (int)a.z; v[3] = (int)a.w;
    v[4] = (int)b.x; v[5] = (int)b.y; v[6] = (int)b.z; v[7] = (int)b.w;
}

// 32 bytes at a 2-aligned q as eight words: eight aligned words from the word holding q[0],
// plus q[30..31] as a halfword when q is not word-aligned, then funnel shifts. 9 or 10 loads
// instead of 16 halfword loads, the same instructions on every lane whatever q's alignment.
// Reads nothing past q + 32, and before q only q - 2 when q is 2 mod 4 (inside any matrix
// whose base is 16-byte aligned).
__device__ __forceinline__ void ld32_a2(const uint8_t *q, uint32_t (&v)[8]) {
    uintptr_t qa = (uintptr_t)q;
    uint32_t sh = (uint32_t)(qa & 3) * 8; // 0 or 16
    const uint32_t *p = (const uint32_t *)(qa & ~(uintptr_t)3);
    uint32_t u[9];
#pragma unroll
    for (int i = 0; i < 8; i++) u[i] = p[i];
    u[8] = sh ? (uint32_t)*(const uint16_t *)(p + 8) : 0u;
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = __funnelshift_r(u[i], u[i + 1], sh);
}

// Bit i (i < 4) of b to bit 8i: four flags to four bytes.
__device__ __forceinline__ uint32_t spread4(uint32_t b) {
    return (b & 1u) | (b & 2u) << 7 | (b & 4u) << 14 | (b & 8u) << 21;
}

// Negates the bytes of v whose flag (bit j of bits, j < 4) is set: (v ^ m) - m per byte.
__device__ __forceinline__ int apply_signs(uint32_t v, uint32_t bits) {
    uint32_t m = spread4(bits & 15u) * 0xffu;
    return (int)__vsub4(v ^ m, m);
}

// IQ4 non-linear values for four nibbles held in the low halves of four bytes.
__device__ __forceinline__ int iq4_lookup(uint32_t n) {
    uint32_t sel = (n & 0xfu) | ((n >> 4) & 0xf0u) | ((n >> 8) & 0xf00u) | ((n >> 12) & 0xf000u);
    uint32_t lo = __byte_perm(st_dq_kvalues[0], st_dq_kvalues[1], sel & 0x7777u);
    uint32_t hi = __byte_perm(st_dq_kvalues[2], st_dq_kvalues[3], sel & 0x7777u);
    uint32_t m = ((n >> 3) & 0x01010101u) * 0xffu;
    return (int)((hi & m) | (lo & ~m));
}

// IQ1 grid bytes g in {-1, 0, 1} to 8g ± 1: the ±1/8 shift folded into the integers (the
// scale carries the 1/8, a power of two, so values stay exact).
__device__ __forceinline__ int iq1_fold(uint32_t g, bool neg) {
    uint32_t t = (g << 3) & 0xf8f8f8f8u;
    return neg ? (int)__vsub4(t, 0x01010101u) : (int)(t | 0x01010101u);
}

// Q4_K / Q5_K: 6-bit scale and min of sub-block j from the 12 packed bytes at b.
__device__ __forceinline__ void kq_scale_min(const uint8_t *b, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = b[j] & 63;
        *m = b[j + 4] & 63;
    } else {
        *sc = (b[j + 4] & 15) | ((b[j - 4] >> 6) << 4);
        *m = (b[j + 4] >> 4) | ((b[j] >> 6) << 4);
    }
}

// Per type: QK elements and BS bytes per block, HAS_MIN, and unpack(row, c, w) for chunk c
// (elements 32c .. 32c+31 of the row). Float operations match dequant.c's order (products
// rounded one at a time, no fused multiply-add in the scale math) so dequantize is exact.
template <int T> struct st_qt;

template <> struct st_qt<ST_TYPE_Q4_0> {
    static constexpr int QK = 32, BS = 18;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)c * BS;
        w.s0 = w.s1 = ld_f16(b);
        w.m0 = w.m1 = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint32_t v = ld_a2(b + 2 + 4 * i);
            w.q[i] = (int)__vsub4(v & 0x0f0f0f0fu, 0x08080808u);
            w.q[i + 4] = (int)__vsub4((v >> 4) & 0x0f0f0f0fu, 0x08080808u);
        }
    }
};

template <> struct st_qt<ST_TYPE_Q4_1> {
    static constexpr int QK = 32, BS = 20;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)c * BS;
        w.s0 = w.s1 = ld_f16(b);
        w.m0 = w.m1 = ld_f16(b + 2);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint32_t v = ld_a4(b + 4 + 4 * i);
            w.q[i] = (int)(v & 0x0f0f0f0fu);
            w.q[i + 4] = (int)((v >> 4) & 0x0f0f0f0fu);
        }
    }
};

// Q5: bit e of qh is bit 4 of element e.
template <bool SIGNED>
__device__ __forceinline__ void q5_unpack(const uint8_t *qs, uint32_t qh, st_wchunk &w, bool a4) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint32_t v = a4 ? ld_a4(qs + 4 * i) : ld_a2(qs + 4 * i);
        uint32_t lo = (v & 0x0f0f0f0fu) | spread4((qh >> (4 * i)) & 15u) << 4;
        uint32_t hi = ((v >> 4) & 0x0f0f0f0fu) | spread4((qh >> (16 + 4 * i)) & 15u) << 4;
        w.q[i] = SIGNED ? (int)__vsub4(lo, 0x10101010u) : (int)lo;
        w.q[i + 4] = SIGNED ? (int)__vsub4(hi, 0x10101010u) : (int)hi;
    }
}

template <> struct st_qt<ST_TYPE_Q5_0> {
    static constexpr int QK = 32, BS = 22;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)c * BS;
        w.s0 = w.s1 = ld_f16(b);
        w.m0 = w.m1 = 0.0f;
        q5_unpack<true>(b + 6, ld_a2(b + 2), w, false);
    }
};

template <> struct st_qt<ST_TYPE_Q5_1> {
    static constexpr int QK = 32, BS = 24;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)c * BS;
        w.s0 = w.s1 = ld_f16(b);
        w.m0 = w.m1 = ld_f16(b + 2);
        q5_unpack<false>(b + 8, ld_a4(b + 4), w, true);
    }
};

template <> struct st_qt<ST_TYPE_Q8_0> {
    static constexpr int QK = 32, BS = 34;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)c * BS;
        w.s0 = w.s1 = ld_f16(b);
        w.m0 = w.m1 = 0.0f;
        uint32_t v[8];
        ld32_a2(b + 2, v);
#pragma unroll
        for (int i = 0; i < 8; i++) w.q[i] = (int)v[i];
    }
};

template <> struct st_qt<ST_TYPE_IQ4_NL> {
    static constexpr int QK = 32, BS = 18;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)c * BS;
        w.s0 = w.s1 = ld_f16(b);
        w.m0 = w.m1 = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint32_t v = ld_a2(b + 2 + 4 * i);
            w.q[i] = iq4_lookup(v & 0x0f0f0f0fu);
            w.q[i + 4] = iq4_lookup((v >> 4) & 0x0f0f0f0fu);
        }
    }
};

// K-quants: 256-element blocks of 8 chunks; chunk sub = 4h + j for the 2-bit layouts
// (element 128h + 32j + l).
template <> struct st_qt<ST_TYPE_Q2_K> {
    static constexpr int QK = 256, BS = 84;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)(c >> 3) * BS;
        int sub = c & 7, h = sub >> 2, j = sub & 3;
        float d = ld_f16(b + 80), dmin = ld_f16(b + 82);
        int sc0 = b[2 * sub], sc1 = b[2 * sub + 1];
        w.s0 = __fmul_rn(d, (float)(sc0 & 15));
        w.s1 = __fmul_rn(d, (float)(sc1 & 15));
        w.m0 = -__fmul_rn(dmin, (float)(sc0 >> 4));
        w.m1 = -__fmul_rn(dmin, (float)(sc1 >> 4));
#pragma unroll
        for (int i = 0; i < 8; i++) w.q[i] = (int)((ld_a4(b + 16 + 32 * h + 4 * i) >> (2 * j)) & 0x03030303u);
    }
};

template <> struct st_qt<ST_TYPE_Q3_K> {
    static constexpr int QK = 256, BS = 110;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ int scale(const uint8_t *sb, int s) {
        int lo = s < 8 ? sb[s] & 15 : sb[s - 8] >> 4;
        int hi = (sb[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
        return (lo | hi << 4) - 32;
    }
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)(c >> 3) * BS;
        int sub = c & 7, h = sub >> 2, j = sub & 3;
        float d = ld_f16(b + 108);
        w.s0 = __fmul_rn(d, (float)scale(b + 96, 2 * sub));
        w.s1 = __fmul_rn(d, (float)scale(b + 96, 2 * sub + 1));
        w.m0 = w.m1 = 0.0f;
        uint32_t vl[8], vh[8];
        ld32_a2(b + 32 + 32 * h, vl);
        ld32_a2(b, vh);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            uint32_t lo = (vl[i] >> (2 * j)) & 0x03030303u;
            uint32_t hbit = (vh[i] >> (4 * h + j)) & 0x01010101u;
            w.q[i] = (int)__vsub4(lo, (hbit ^ 0x01010101u) << 2); // no high bit: minus 4
        }
    }
};

template <> struct st_qt<ST_TYPE_Q4_K> {
    static constexpr int QK = 256, BS = 144;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)(c >> 3) * BS;
        int sb = c & 7, sc, m;
        kq_scale_min(b + 4, sb, &sc, &m);
        w.s0 = w.s1 = __fmul_rn(ld_f16(b), (float)sc);
        w.m0 = w.m1 = -__fmul_rn(ld_f16(b + 2), (float)m);
        int v[8];
        ld_a16x2(b + 16 + 32 * (sb >> 1), v); // 16-byte aligned: 144 = 9 * 16
        int shift = 4 * (sb & 1);
#pragma unroll
        for (int i = 0; i < 8; i++) w.q[i] = (int)(((uint32_t)v[i] >> shift) & 0x0f0f0f0fu);
    }
};

template <> struct st_qt<ST_TYPE_Q5_K> {
    static constexpr int QK = 256, BS = 176;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)(c >> 3) * BS;
        int sb = c & 7, sc, m;
        kq_scale_min(b + 4, sb, &sc, &m);
        w.s0 = w.s1 = __fmul_rn(ld_f16(b), (float)sc);
        w.m0 = w.m1 = -__fmul_rn(ld_f16(b + 2), (float)m);
        int v[8], hv[8];
        ld_a16x2(b + 48 + 32 * (sb >> 1), v); // 176 = 11 * 16
        ld_a16x2(b + 16, hv);
        int shift = 4 * (sb & 1);
#pragma unroll
        for (int i = 0; i < 8; i++)
            w.q[i] = (int)((((uint32_t)v[i] >> shift) & 0x0f0f0f0fu) | (((uint32_t)hv[i] >> sb) & 0x01010101u) << 4);
    }
};

template <> struct st_qt<ST_TYPE_Q6_K> {
    static constexpr int QK = 256, BS = 210;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)(c >> 3) * BS;
        int sub = c & 7, h = sub >> 2, k = sub & 3;
        float d = ld_f16(b + 208);
        w.s0 = __fmul_rn(d, (float)(int8_t)b[192 + 2 * sub]);
        w.s1 = __fmul_rn(d, (float)(int8_t)b[192 + 2 * sub + 1]);
        w.m0 = w.m1 = 0.0f;
        uint32_t vl[8], vh[8];
        ld32_a2(b + 64 * h + 32 * (k & 1), vl);
        ld32_a2(b + 128 + 32 * h, vh);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            uint32_t lo = (vl[i] >> (4 * (k >> 1))) & 0x0f0f0f0fu;
            uint32_t hi = ((vh[i] >> (2 * k)) & 0x03030303u) << 4;
            w.q[i] = (int)__vsub4(lo | hi, 0x20202020u);
        }
    }
};

// IQ types: chunk ib of a 256 block; grid rows of 8 bytes with ksigns / explicit signs.
template <> struct st_qt<ST_TYPE_IQ2_XXS> {
    static constexpr int QK = 256, BS = 66;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)(c >> 3) * BS;
        int ib = c & 7;
        uint32_t idx = ld_a2(b + 2 + 8 * ib), aux = ld_a2(b + 2 + 8 * ib + 4);
        w.s0 = w.s1 = __fmul_rn(__fmul_rn(ld_f16(b), 0.5f + (float)(aux >> 28)), 0.25f);
        w.m0 = w.m1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            uint64_t g = st_dq_iq2xxs[(idx >> (8 * k)) & 255];
            uint32_t s = st_dq_ksigns[(aux >> (7 * k)) & 127];
            w.q[2 * k] = apply_signs((uint32_t)g, s);
            w.q[2 * k + 1] = apply_signs((uint32_t)(g >> 32), s >> 4);
        }
    }
};

// IQ2_XS / IQ2_S: one 4-bit scale per 16 elements, low nibble first.
__device__ __forceinline__ void iq2_scales(float d, uint8_t sc, st_wchunk &w) {
    w.s0 = __fmul_rn(__fmul_rn(d, 0.5f + (float)(sc & 15)), 0.25f);
    w.s1 = __fmul_rn(__fmul_rn(d, 0.5f + (float)(sc >> 4)), 0.25f);
    w.m0 = w.m1 = 0.0f;
}

template <> struct st_qt<ST_TYPE_IQ2_XS> {
    static constexpr int QK = 256, BS = 74;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)(c >> 3) * BS;
        int ib = c & 7;
        iq2_scales(ld_f16(b), b[66 + ib], w);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            uint32_t v = ld_u16(b + 2 + 2 * (4 * ib + k));
            uint64_t g = st_dq_iq2xs[v & 511];
            uint32_t s = st_dq_ksigns[v >> 9];
            w.q[2 * k] = apply_signs((uint32_t)g, s);
            w.q[2 * k + 1] = apply_signs((uint32_t)(g >> 32), s >> 4);
        }
    }
};

template <> struct st_qt<ST_TYPE_IQ2_S> {
    static constexpr int QK = 256, BS = 82;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)(c >> 3) * BS;
        int ib = c & 7;
        iq2_scales(ld_f16(b), b[74 + ib], w);
        uint32_t qh = b[66 + ib];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int r = 4 * ib + k;
            uint64_t g = st_dq_iq2s[b[2 + r] | ((qh >> (2 * k)) & 3) << 8];
            uint32_t s = b[34 + r];
            w.q[2 * k] = apply_signs((uint32_t)g, s);
            w.q[2 * k + 1] = apply_signs((uint32_t)(g >> 32), s >> 4);
        }
    }
};

template <> struct st_qt<ST_TYPE_IQ3_XXS> {
    static constexpr int QK = 256, BS = 98;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)(c >> 3) * BS;
        int ib = c & 7;
        uint32_t aux = ld_a2(b + 66 + 4 * ib);
        w.s0 = w.s1 = __fmul_rn(__fmul_rn(ld_f16(b), 0.5f + (float)(aux >> 28)), 0.5f);
        w.m0 = w.m1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            uint32_t s = st_dq_ksigns[(aux >> (7 * k)) & 127];
            w.q[2 * k] = apply_signs(st_dq_iq3xxs[b[2 + 8 * ib + 2 * k]], s);
            w.q[2 * k + 1] = apply_signs(st_dq_iq3xxs[b[2 + 8 * ib + 2 * k + 1]], s >> 4);
        }
    }
};

template <> struct st_qt<ST_TYPE_IQ3_S> {
    static constexpr int QK = 256, BS = 110;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)(c >> 3) * BS;
        int ib = c & 7;
        w.s0 = w.s1 = __fmul_rn(ld_f16(b), (float)(1 + 2 * ((b[106 + ib / 2] >> (4 * (ib & 1))) & 15)));
        w.m0 = w.m1 = 0.0f;
        uint32_t qh = b[66 + ib];
#pragma unroll
        for (int m = 0; m < 8; m++) {
            uint32_t g = st_dq_iq3s[b[2 + 8 * ib + m] | ((qh >> m) & 1) << 8];
            w.q[m] = apply_signs(g, (uint32_t)b[74 + 4 * ib + (m >> 1)] >> (4 * (m & 1)));
        }
    }
};

template <> struct st_qt<ST_TYPE_IQ1_S> {
    static constexpr int QK = 256, BS = 50;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)(c >> 3) * BS;
        int ib = c & 7;
        uint32_t h = ld_u16(b + 34 + 2 * ib);
        float dl = __fmul_rn(ld_f16(b), (float)(2 * ((h >> 12) & 7) + 1));
        w.s0 = w.s1 = dl * 0.125f;
        w.m0 = w.m1 = 0.0f;
        bool neg = h & 0x8000u;
#pragma unroll
        for (int l = 0; l < 4; l++) {
            uint64_t g = st_dq_iq1s[b[2 + 4 * ib + l] | ((h >> (3 * l)) & 7) << 8];
            w.q[2 * l] = iq1_fold((uint32_t)g, neg);
            w.q[2 * l + 1] = iq1_fold((uint32_t)(g >> 32), neg);
        }
    }
};

template <> struct st_qt<ST_TYPE_IQ1_M> {
    static constexpr int QK = 256, BS = 56;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)(c >> 3) * BS;
        int ib = c & 7;
        uint32_t s0 = ld_u16(b + 48), s1 = ld_u16(b + 50), s2 = ld_u16(b + 52), s3 = ld_u16(b + 54);
        // The fp16 block scale is spread over the top nibbles of the four scale words.
        uint16_t dh = (uint16_t)((s0 >> 12) | ((s1 >> 8) & 0x00f0u) | ((s2 >> 4) & 0x0f00u) | (s3 & 0xf000u));
        float d = __half2float(__ushort_as_half(dh));
        uint32_t sw = ld_u16(b + 48 + 2 * (ib / 2)) >> (6 * (ib & 1));
        w.s0 = __fmul_rn(d, (float)(2 * (sw & 7) + 1)) * 0.125f;
        w.s1 = __fmul_rn(d, (float)(2 * ((sw >> 3) & 7) + 1)) * 0.125f;
        w.m0 = w.m1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int r = 4 * ib + k;
            uint32_t hq = (b[32 + r / 2] >> (4 * (r & 1))) & 15;
            uint64_t g = st_dq_iq1s[b[r] | (hq & 7) << 8];
            w.q[2 * k] = iq1_fold((uint32_t)g, hq & 8);
            w.q[2 * k + 1] = iq1_fold((uint32_t)(g >> 32), hq & 8);
        }
    }
};

template <> struct st_qt<ST_TYPE_IQ4_XS> {
    static constexpr int QK = 256, BS = 136;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void unpack(const uint8_t *row, int c, st_wchunk &w) {
        const uint8_t *b = row + (size_t)(c >> 3) * BS;
        int ib = c & 7;
        int ls = ((b[4 + ib / 2] >> (4 * (ib & 1))) & 15) | ((ld_u16(b + 2) >> (2 * ib)) & 3) << 4;
        w.s0 = w.s1 = __fmul_rn(ld_f16(b), (float)(ls - 32));
        w.m0 = w.m1 = 0.0f;
        const uint2 *p = (const uint2 *)(b + 8 + 16 * ib); // 8-byte aligned: 136 = 17 * 8
        uint2 a = p[0], a2 = p[1];
        uint32_t v[4] = {a.x, a.y, a2.x, a2.y};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w.q[i] = iq4_lookup(v[i] & 0x0f0f0f0fu);
            w.q[i + 4] = iq4_lookup((v[i] >> 4) & 0x0f0f0f0fu);
        }
    }
};

// The quantized types with a chunk unpacker, for dispatch: X(type) for each.
#define ST_CUQ_QUANT_TYPES(X)                                                                          \
    X(ST_TYPE_Q8_0) X(ST_TYPE_Q4_K) X(ST_TYPE_Q5_K) X(ST_TYPE_Q6_K) X(ST_TYPE_IQ4_XS) X(ST_TYPE_IQ3_XXS) \
    X(ST_TYPE_IQ3_S) X(ST_TYPE_IQ2_XS) X(ST_TYPE_Q4_0) X(ST_TYPE_Q4_1) X(ST_TYPE_Q5_0) X(ST_TYPE_Q5_1)   \
    X(ST_TYPE_Q2_K) X(ST_TYPE_Q3_K) X(ST_TYPE_IQ2_XXS) X(ST_TYPE_IQ2_S) X(ST_TYPE_IQ1_S)                 \
    X(ST_TYPE_IQ1_M) X(ST_TYPE_IQ4_NL)
