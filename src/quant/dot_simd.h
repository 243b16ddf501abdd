// quant: what the AVX2 and AVX-512 kernel files share (each includes it after its intrinsics
// header; their own flags decide the instructions): small scale unpackers and loads, and
// DEFINE_DOTS, which makes a type's dot and dot_multi from its row routine.
#ifndef ST_QUANT_DOT_SIMD_H
#define ST_QUANT_DOT_SIMD_H

#include <immintrin.h>
#include <string.h>

#include "quant/blocks.h"
#include "quant/iq_tables.h"

#define AI static inline __attribute__((always_inline))

AI float f16(st_f16 h) { return _cvtsh_ss(h); }

AI float hsum_ps128(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// 16 packed nibbles -> 32 bytes: low nibbles (elements 0..15) then high nibbles (16..31).
AI __m256i nibbles_32(const uint8_t *qs) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    v = _mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0));
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
}

// IQ4_XS: the 8 six-bit scales as bytes (scale j = nibble j of the scales_l word, with bits
// 2j..2j+1 of scales_h on top), spread with shifts and masks in a register: building them in a
// stack array and reloading it stalls on store forwarding; pdep would do it but is microcoded
// (hundreds of cycles) on AMD before Zen 3.
AI uint64_t iq4xs_scales8(uint32_t lo4, uint16_t hi2) {
    uint64_t l = lo4;
    l = (l | l << 16) & 0x0000ffff0000ffffull;
    l = (l | l << 8) & 0x00ff00ff00ff00ffull;
    l = (l | l << 4) & 0x0f0f0f0f0f0f0f0full;
    uint64_t h = hi2;
    h = (h | h << 24) & 0x000000ff000000ffull;
    h = (h | h << 12) & 0x000f000f000f000full;
    h = (h | h << 6) & 0x0303030303030303ull;
    return l | h << 4;
}

// Q3_K's 16 six-bit scales (minus 32): low nibbles from bytes 0..7 (scales 0..7 low, 8..15
// high), 2 high bits from bytes 8..11 (byte 8 + s%4, shifted by 2 (s/4)).
AI __m128i q3k_scales8(const uint8_t *b12) {
    uint64_t lo8;
    uint32_t hi4;
    memcpy(&lo8, b12, 8);
    memcpy(&hi4, b12 + 8, 4);
    uint64_t la = lo8 & 0x0f0f0f0f0f0f0f0full, lb = (lo8 >> 4) & 0x0f0f0f0f0f0f0f0full;
    uint64_t ha = (hi4 & 0x03030303u) | (uint64_t)((hi4 >> 2) & 0x03030303u) << 32;
    uint64_t hb = ((hi4 >> 4) & 0x03030303u) | (uint64_t)((hi4 >> 6) & 0x03030303u) << 32;
    __m128i v = _mm_set_epi64x((long long)(lb | hb << 4), (long long)(la | ha << 4));
    return _mm_sub_epi8(v, _mm_set1_epi8(32));
}

// IQ2_XS / IQ2_S: the 16 odd scales 2s+1 (one per 16 elements, low nibble first) as bytes.
AI __m128i iq2_scales16(const uint8_t *scales) {
    uint64_t v;
    memcpy(&v, scales, 8);
    __m128i lo = _mm_cvtsi64_si128((long long)(v & 0x0f0f0f0f0f0f0f0full));
    __m128i hi = _mm_cvtsi64_si128((long long)((v >> 4) & 0x0f0f0f0f0f0f0f0full));
    __m128i x = _mm_unpacklo_epi8(lo, hi);
    return _mm_add_epi8(_mm_add_epi8(x, x), _mm_set1_epi8(1));
}

AI float load1(const int kind, const void *p, int64_t i) {
    if (kind == 0) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return kind == 1 ? f16(h) : st_bf16_to_f32(h);
}

// A type's dot and dot_multi from its row routine rows_fn(n, NR, s, w, x, xs) of NR <= G
// activation rows (a compile-time constant after inlining): rows in groups of G, then the rest.
#define DEFINE_DOTS_G(name, rows_fn, G)                                                         \
    static void name##_multi(int64_t n, int nx, float *s, const void *w, const void *x,        \
                             size_t xs) {                                                       \
        const uint8_t *xb = x;                                                                  \
        int r = 0;                                                                              \
        for (; r + (G) <= nx; r += (G)) rows_fn(n, (G), s + r, w, xb + (size_t)r * xs, xs);     \
        if ((G) > 3 && nx - r == 3) rows_fn(n, 3, s + r, w, xb + (size_t)r * xs, xs);          \
        else if ((G) > 2 && nx - r == 2) rows_fn(n, 2, s + r, w, xb + (size_t)r * xs, xs);     \
        else if (nx - r == 1) rows_fn(n, 1, s + r, w, xb + (size_t)r * xs, xs);                \
    }                                                                                           \
    static void name##_dot(int64_t n, float *s, const void *w, const void *x) {                 \
        rows_fn(n, 1, s, w, x, 0);                                                              \
    }
#define DEFINE_DOTS(name, rows_fn) DEFINE_DOTS_G(name, rows_fn, 4)

#define XROW(T, r) ((const T *)((const uint8_t *)x + (size_t)(r) * xs))

#endif
