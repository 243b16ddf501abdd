// quant: AVX2 (+FMA, F16C) dot and dot_multi kernels. Each type has one row routine templated on
// the number of activation rows (1..4, a compile-time constant after inlining): the weight block
// is unpacked once into registers and multiplied with every activation row.

#include <immintrin.h>
#include <string.h>

#include "quant/blocks.h"
#include "quant/iq_tables.h"
#include "quant/dot_simd.h"
#include "quant/kernels.h"

AI float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// u8 x s8 products summed in fours into int32 lanes (pairs never saturate int16 here: every
// caller keeps |u| * |s| * 2 below 32768).
AI __m256i mul_sum_us8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// 32 bits -> 32 bytes, 0xff where bit e of the word is set.
AI __m256i bits_to_bytes(const uint8_t *p) {
    uint32_t x32;
    memcpy(&x32, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
}

// Broadcast int16 lane j of an 8-lane vector (duplicated in both halves) to all 16 lanes.
AI __m256i bcast16(__m256i v8x2, int j) {
    return _mm256_shuffle_epi8(v8x2, _mm256_set1_epi16((short)((2 * j + 1) << 8 | 2 * j)));
}

// dot_multi for any row routine: groups of 4 activation rows, then the rest.

// ---------------------------------------------------------------------------------------------
// Q8_0 x Q8_0

// Each row's blocks of 32 run in two accumulation chains (even, odd): with a single chain each
// block would wait a multiply-add latency. Up to 4 rows (DEFINE_DOTS), each summed exactly as
// alone, so a window's rows get a row's bits (st_matmul_args.row_exact).

// acc += dw dy * sum(q qy) for signed weights q (sign trick) and a Q8_0 activation block.
AI __m256 q8_block_dot(__m256i q, float dw, const block_q8_0 *y, __m256 acc) {
    __m256i qy = _mm256_loadu_si256((const __m256i *)y->qs);
    __m256i p = mul_sum_us8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(qy, q));
    return _mm256_fmadd_ps(_mm256_set1_ps(dw * f16(y->d)), _mm256_cvtepi32_ps(p), acc);
}

// The two chains of NR <= 4 rows against Q8_0 activations: BLOCK(i, &dw) unpacks weight block
// i, and each row's chain i % 2 takes it; s[r] is the sum of row r's two chains.
#define TWO_CHAIN_ROWS(NR, nb, BLOCK)                                                           \
    do {                                                                                        \
        __m256 acc0[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),        \
                          _mm256_setzero_ps()};                                                 \
        __m256 acc1[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),        \
                          _mm256_setzero_ps()};                                                 \
        int64_t i = 0;                                                                          \
        for (; i + 2 <= (nb); i += 2) {                                                         \
            float dw0, dw1;                                                                     \
            __m256i q0 = BLOCK(i, &dw0), q1 = BLOCK(i + 1, &dw1);                               \
            _Pragma("GCC unroll 4") for (int r = 0; r < (NR); r++) {                            \
                acc0[r] = q8_block_dot(q0, dw0, XROW(block_q8_0, r) + i, acc0[r]);              \
                acc1[r] = q8_block_dot(q1, dw1, XROW(block_q8_0, r) + i + 1, acc1[r]);          \
            }                                                                                   \
        }                                                                                       \
        if (i < (nb)) {                                                                         \
            float dw0;                                                                          \
            __m256i q0 = BLOCK(i, &dw0);                                                        \
            _Pragma("GCC unroll 4") for (int r = 0; r < (NR); r++) acc0[r] =                    \
                q8_block_dot(q0, dw0, XROW(block_q8_0, r) + i, acc0[r]);                        \
        }                                                                                       \
        _Pragma("GCC unroll 4") for (int r = 0; r < (NR); r++) s[r] =                           \
            hsum_ps(_mm256_add_ps(acc0[r], acc1[r]));                                           \
    } while (0)

AI __m256i q8_0_block(const block_q8_0 *b, int64_t i, float *dw) {
    *dw = f16(b[i].d);
    return _mm256_loadu_si256((const __m256i *)b[i].qs);
}

AI void q8_0_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    const block_q8_0 *b = w;
#define Q8_BLOCK(i, dw) q8_0_block(b, i, dw)
    TWO_CHAIN_ROWS(NR, n / QK8_0, Q8_BLOCK);
#undef Q8_BLOCK
}
DEFINE_DOTS(q8_0, q8_0_rows)

// ---------------------------------------------------------------------------------------------
// Q4_0, IQ4_NL x Q8_0; Q5_0 x Q8_0 (all signed values: sign trick)

AI __m256i iq4nl_table(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)st_kvalues_iq4nl));
}

// Block i's 32 signed values and its d. kind 0: Q4_0, 1: IQ4_NL, 2: Q5_0.
AI __m256i legacy_signed_block(const int kind, const uint8_t *wb, int64_t i, __m256i tbl, float *dw) {
    if (kind == 2) {
        const block_q5_0 *b = (const block_q5_0 *)wb + i;
        *dw = f16(b->d);
        __m256i hb = bits_to_bytes(b->qh);
        // 5th bit clear: the value is nibble - 16, i.e. the byte nibble | 0xf0.
        return _mm256_or_si256(nibbles_32(b->qs), _mm256_andnot_si256(hb, _mm256_set1_epi8((char)0xf0)));
    }
    const block_q4_0 *b = (const block_q4_0 *)wb + i;
    *dw = f16(b->d);
    __m256i q = nibbles_32(b->qs);
    return kind == 1 ? _mm256_shuffle_epi8(tbl, q) : _mm256_sub_epi8(q, _mm256_set1_epi8(8));
}

AI void legacy_signed_rows(const int kind, int64_t n, const int NR, float *s, const void *w,
                           const void *x, size_t xs) {
    const uint8_t *wb = w;
    const __m256i tbl = iq4nl_table();
#define SIGNED_BLOCK(i, dw) legacy_signed_block(kind, wb, i, tbl, dw)
    TWO_CHAIN_ROWS(NR, n / 32, SIGNED_BLOCK);
#undef SIGNED_BLOCK
}
AI void q4_0_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    legacy_signed_rows(0, n, NR, s, w, x, xs);
}
AI void iq4_nl_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    legacy_signed_rows(1, n, NR, s, w, x, xs);
}
AI void q5_0_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    legacy_signed_rows(2, n, NR, s, w, x, xs);
}
DEFINE_DOTS(q4_0, q4_0_rows)
DEFINE_DOTS(iq4_nl, iq4_nl_rows)
DEFINE_DOTS(q5_0, q5_0_rows)

// ---------------------------------------------------------------------------------------------
// Q4_1, Q5_1 x Q8_1: unsigned values, plus m * s (s = d_x * sum(q_x))

// Block i of a Q4_1 / Q5_1 row against row r of the activations: acc += d dy * sum(q qy); the
// {d dy, m sy} pair (both converted in one instruction) is returned for the m term.
AI __m128 legacy_min_block(const int is_q5, const uint8_t *blk, const block_q8_1 *y, __m256 *acc) {
    __m256i q;
    if (is_q5) {
        const block_q5_1 *b = (const block_q5_1 *)blk;
        __m256i hb = bits_to_bytes(b->qh);
        q = _mm256_or_si256(nibbles_32(b->qs), _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
    } else {
        q = nibbles_32(((const block_q4_1 *)blk)->qs);
    }
    uint32_t dm, ds; // the block's d and m, the row's d and s: the first two halves of each
    memcpy(&dm, blk, 4);
    memcpy(&ds, y, 4);
    __m128 t = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)dm)), _mm_cvtph_ps(_mm_cvtsi32_si128((int)ds)));
    __m256i p = mul_sum_us8(q, _mm256_loadu_si256((const __m256i *)y->qs));
    *acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(t), _mm256_cvtepi32_ps(p), *acc);
    return t;
}

AI void legacy_min_rows(const int is_q5, int64_t n, const int NR, float *s, const void *w,
                        const void *x, size_t xs) {
    const int64_t nb = n / 32;
    const uint8_t *wb = w;
    const size_t bsz = is_q5 ? sizeof(block_q5_1) : sizeof(block_q4_1);
    // Each row's even and odd blocks in two chains (not one multiply-add latency a block), up to
    // 3 rows a pass (registers), each summed exactly as alone.
    __m256 acc0[3] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 acc1[3] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m128 accm0[3] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    __m128 accm1[3] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        #pragma GCC unroll 3
        for (int r = 0; r < NR; r++) {
            const block_q8_1 *y = XROW(block_q8_1, r) + i;
            accm0[r] = _mm_add_ps(accm0[r], legacy_min_block(is_q5, wb + (size_t)i * bsz, y, &acc0[r]));
            accm1[r] = _mm_add_ps(accm1[r], legacy_min_block(is_q5, wb + (size_t)(i + 1) * bsz, y + 1, &acc1[r]));
        }
    }
    if (i < nb) {
        #pragma GCC unroll 3
        for (int r = 0; r < NR; r++)
            accm0[r] = _mm_add_ps(accm0[r], legacy_min_block(is_q5, wb + (size_t)i * bsz, XROW(block_q8_1, r) + i, &acc0[r]));
    }
    #pragma GCC unroll 3
    for (int r = 0; r < NR; r++) {
        __m128 m = _mm_add_ps(accm0[r], accm1[r]);
        s[r] = hsum_ps(_mm256_add_ps(acc0[r], acc1[r])) + _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1));
    }
}
AI void q4_1_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    legacy_min_rows(0, n, NR, s, w, x, xs);
}
AI void q5_1_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    legacy_min_rows(1, n, NR, s, w, x, xs);
}
DEFINE_DOTS_G(q4_1, q4_1_rows, 3)
DEFINE_DOTS_G(q5_1, q5_1_rows, 3)

// ---------------------------------------------------------------------------------------------
// Q4_K, Q5_K x Q8_K

// The 8 six-bit scales and mins, as 8 int16 lanes each (duplicated in both 128-bit halves
// for the scales, which are broadcast per sub-block with bcast16).
AI void kq_scales(const uint8_t *b12, __m256i *sc, __m128i *mins) {
    uint32_t a0, a1, a2;
    memcpy(&a0, b12, 4);
    memcpy(&a1, b12 + 4, 4);
    memcpy(&a2, b12 + 8, 4);
    uint32_t sc_lo = a0 & 0x3f3f3f3f, m_lo = a1 & 0x3f3f3f3f;
    uint32_t sc_hi = (a2 & 0x0f0f0f0f) | ((a0 >> 2) & 0x30303030);
    uint32_t m_hi = ((a2 >> 4) & 0x0f0f0f0f) | ((a1 >> 2) & 0x30303030);
    __m128i s8 = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)sc_hi, (int)sc_lo));
    *sc = _mm256_broadcastsi128_si256(s8);
    *mins = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)m_hi, (int)m_lo));
}

// sum over sub-blocks j of mins[j] * (bsums[2j] + bsums[2j+1]), as 4 int32 lanes.
AI __m128i kq_min_dot(__m128i mins, const int16_t *bsums) {
    __m128i b0 = _mm_loadu_si128((const __m128i *)bsums);
    __m128i b1 = _mm_loadu_si128((const __m128i *)(bsums + 8));
    return _mm_madd_epi16(mins, _mm_hadd_epi16(b0, b1));
}

AI void q45k_rows(const int is_q5, int64_t n, const int NR, float *s, const void *w,
                  const void *x, size_t xs) {
    const int64_t nb = n / QK_K;
    const uint8_t *wb = w;
    const size_t bsz = is_q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m128 accm[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *blk = wb + (size_t)i * bsz;
        // Q4_K and Q5_K share d, dmin, scales[12] at the start.
        const block_q4_K *b4 = (const block_q4_K *)blk;
        const uint8_t *qs = is_q5 ? ((const block_q5_K *)blk)->qs : b4->qs;
        float d = f16(b4->d), dmin = f16(b4->dmin);
        __m256i sc;
        __m128i mins;
        kq_scales(b4->scales, &sc, &mins);
        __m256i hb = is_q5 ? _mm256_loadu_si256((const __m256i *)((const block_q5_K *)blk)->qh)
                           : _mm256_setzero_si256();
        __m256i sumi[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                           _mm256_setzero_si256()};
        // Sub-block pairs outermost: each pair's values and scales serve every row while in
        // registers (eight pairs' worth held for the row loop spilled at one row).
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i q[2] = {_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)};
            if (is_q5) {
                // Bit s of qh[l] is the 5th bit of element 32s + l.
                #pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    __m256i bit = _mm256_and_si256(hb, _mm256_set1_epi8(1));
                    q[h] = _mm256_or_si256(q[h], _mm256_slli_epi16(bit, 4));
                    hb = _mm256_srli_epi16(hb, 1);
                }
            }
            __m256i s0 = bcast16(sc, 2 * j), s1 = bcast16(sc, 2 * j + 1);
            #pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const block_q8_K *y = XROW(block_q8_K, r) + i;
                __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(q[0], _mm256_loadu_si256((const __m256i *)(y->qs + 64 * j))), s0);
                __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(q[1], _mm256_loadu_si256((const __m256i *)(y->qs + 64 * j + 32))), s1);
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p0, p1));
            }
        }
        #pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const block_q8_K *y = XROW(block_q8_K, r) + i;
            __m256i sumi_r = sumi[r];
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y->d), _mm256_cvtepi32_ps(sumi_r), acc[r]);
            __m128i pm = kq_min_dot(mins, y->bsums);
            accm[r] = _mm_fmadd_ps(_mm_set1_ps(dmin * y->d), _mm_cvtepi32_ps(pm), accm[r]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) s[r] = hsum_ps(acc[r]) - hsum_ps128(accm[r]);
}
AI void q4_K_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    q45k_rows(0, n, NR, s, w, x, xs);
}
AI void q5_K_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    q45k_rows(1, n, NR, s, w, x, xs);
}
DEFINE_DOTS(q4_K, q4_K_rows)
DEFINE_DOTS(q5_K, q5_K_rows)

// ---------------------------------------------------------------------------------------------
// Q6_K x Q8_K: unsigned 6-bit values times int8 scales, minus 32 * sum(scale * bsum)

AI void q6_K_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    const block_q6_K *b = w;
    const int64_t nb = n / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < nb; i++) {
        float d = f16(b[i].d);
        __m128i sc8 = _mm_loadu_si128((const __m128i *)b[i].scales);
        __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        // Each row's sum starts with the -32 offset: -32 * sum(scale * bsum).
        __m256i sumi[4];
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const block_q8_K *y = XROW(block_q8_K, r) + i;
            __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
            sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
        }
        // Halves outermost: each half's values and scales serve every row while in registers.
        #pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(b[i].ql + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(b[i].ql + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(b[i].qh + 32 * h));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
            #pragma GCC unroll 4
            for (int u = 0; u < 4; u++) {
                // Vector t = 4h + u covers sub-blocks 2t and 2t+1 (16 elements each): int16 scales 8 + 8.
                int t = 4 * h + u;
                __m128i ctl = _mm_set_epi64x(0x0101010101010101LL * (2 * t + 1), 0x0101010101010101LL * (2 * t));
                __m256i scp = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, ctl));
                #pragma GCC unroll 4
                for (int r = 0; r < NR; r++) {
                    const block_q8_K *y = XROW(block_q8_K, r) + i;
                    __m256i qy = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * t));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q[u], qy), scp));
                }
            }
        }
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const block_q8_K *y = XROW(block_q8_K, r) + i;
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y->d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) s[r] = hsum_ps(acc[r]);
}
DEFINE_DOTS(q6_K, q6_K_rows)

// ---------------------------------------------------------------------------------------------
// IQ4_XS x Q8_K: table values, one 6-bit scale (minus 32) per 32 elements

AI void iq4_xs_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    const block_iq4_xs *b = w;
    const int64_t nb = n / QK_K;
    const __m256i tbl = iq4nl_table();
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < nb; i++) {
        float d = f16(b[i].d);
        // Scale j: nibble j of scales_l, bits 2j..2j+1 of scales_h on top, minus 32.
        uint32_t sl;
        memcpy(&sl, b[i].scales_l, 4);
        uint64_t ls8 = iq4xs_scales8(sl, b[i].scales_h);
        __m128i ls = _mm_sub_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)ls8)), _mm_set1_epi16(32));
        __m256i sc = _mm256_broadcastsi128_si256(ls);
        __m256i q[8], aq[8], scj[8];
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            q[j] = _mm256_shuffle_epi8(tbl, nibbles_32(b[i].qs + 16 * j));
            aq[j] = _mm256_sign_epi8(q[j], q[j]);
            scj[j] = bcast16(sc, j);
        }
        #pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const block_q8_K *y = XROW(block_q8_K, r) + i;
            __m256i sumi = _mm256_setzero_si256();
            #pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                __m256i qy = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * j));
                __m256i p = _mm256_maddubs_epi16(aq[j], _mm256_sign_epi8(qy, q[j]));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, scj[j]));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y->d), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) s[r] = hsum_ps(acc[r]);
}
DEFINE_DOTS(iq4_xs, iq4_xs_rows)

// ---------------------------------------------------------------------------------------------
// Q2_K, Q3_K x Q8_K. 16-element sub-blocks: vector t (32 elements) pairs scales 2t and 2t+1,
// the same layout as Q6_K.

// A block's 16 scales widened to int16 (_mm256_cvtepi8_epi16) as two vectors with scales 0..7
// and 8..15 in both 128-bit lanes, so that each pair below is one in-lane shuffle.
typedef struct { __m256i lo, hi; } scale_halves;
AI scale_halves split_scales(__m256i sc16) {
    scale_halves h = {_mm256_permute2x128_si256(sc16, sc16, 0x00), _mm256_permute2x128_si256(sc16, sc16, 0x11)};
    return h;
}

// int16 scales of sub-blocks 2t, 2t+1 (8 lanes each).
AI __m256i pair_scales(scale_halves h, int t) {
    int j = 2 * (t % 4); // scale 2t's place in its half
    __m256i ctl = _mm256_set_m128i(_mm_set1_epi16((short)((2 * j + 2) | (2 * j + 3) << 8)),
                                   _mm_set1_epi16((short)((2 * j) | (2 * j + 1) << 8)));
    return _mm256_shuffle_epi8(t < 4 ? h.lo : h.hi, ctl);
}

AI void q2_K_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    const block_q2_K *b = w;
    const int64_t nb = n / QK_K;
    const __m256i m3 = _mm256_set1_epi8(3);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < nb; i++) {
        float d = f16(b[i].d), dmin = f16(b[i].dmin);
        __m128i raw = _mm_loadu_si128((const __m128i *)b[i].scales);
        scale_halves sch = split_scales(_mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(15))));
        __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15)));
        __m256i sumi[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                           _mm256_setzero_si256()};
        // Vectors outermost: each one's values and scales serve every row while in registers.
        #pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * (t / 4)));
            __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, 2 * (t % 4)), m3);
            __m256i scp = pair_scales(sch, t);
            #pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const block_q8_K *y = XROW(block_q8_K, r) + i;
                __m256i qy = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * t));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, qy), scp));
            }
        }
        #pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const block_q8_K *y = XROW(block_q8_K, r) + i;
            __m256i msum = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)y->bsums));
            __m256 f = _mm256_fmsub_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[r]),
                                       _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(msum)));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(y->d), f, acc[r]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) s[r] = hsum_ps(acc[r]);
}
DEFINE_DOTS(q2_K, q2_K_rows)

AI void q3_K_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    const block_q3_K *b = w;
    const int64_t nb = n / QK_K;
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < nb; i++) {
        float d = f16(b[i].d);
        __m128i sc8 = q3k_scales8(b[i].scales);
        __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        scale_halves sch = split_scales(sc16);
        __m256i hm = _mm256_loadu_si256((const __m256i *)b[i].hmask);
        // Each row's sum starts with the correction for the values being stored unsigned.
        __m256i sumi[4];
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const block_q8_K *y = XROW(block_q8_K, r) + i;
            __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
            sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 2));
        }
        // Element 128h + 32j + l: 2 bits from qs[32h + l] >> 2j, the 3rd from hmask bit 4h + j;
        // stored unsigned (q + 4). Vectors outermost: each one's values and scales serve every
        // row while in registers.
        #pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * (t / 4)));
            __m256i hb = _mm256_slli_epi16(_mm256_and_si256(hm, one), 2);
            hm = _mm256_srli_epi16(hm, 1);
            __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 2 * (t % 4)), m3), hb);
            __m256i scp = pair_scales(sch, t);
            #pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const block_q8_K *y = XROW(block_q8_K, r) + i;
                __m256i qy = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * t));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, qy), scp));
            }
        }
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const block_q8_K *y = XROW(block_q8_K, r) + i;
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y->d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) s[r] = hsum_ps(acc[r]);
}
DEFINE_DOTS(q3_K, q3_K_rows)

// ---------------------------------------------------------------------------------------------
// IQ2 / IQ3 / IQ1_S x Q8_K. Grid rows are gathered with scalar loads; signs become +1/-1 bytes
// (signs32) applied to the activations with vpsignb; every group of 32 has one odd scale (two
// for IQ2_XS/IQ2_S, one per 16).

AI __m256i set_u64x4(uint64_t a, uint64_t b, uint64_t c, uint64_t d) { // a lowest
    return _mm256_set_epi64x((long long)d, (long long)c, (long long)b, (long long)a);
}

// A group's 32 +-1 bytes from its four sign bytes (bit j of byte k: element 8k + j negative): the
// bytes spread 8 to a lane, each lane's bit picked by a mask, a compare; no table loads or
// inserts on the shuffle port beyond the one spreading shuffle.
AI __m256i signs32(uint32_t sb) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                            3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i e = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)sb), spread), bit);
    return _mm256_or_si256(_mm256_cmpeq_epi8(e, bit), _mm256_set1_epi8(1));
}

AI uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

enum { IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S };

// Group g (32 elements) of block blk: unsigned grid bytes, +-1 signs and int16 scales.
// A 7-bit sign field (0..127 in the low byte of each 16- or 32-bit lane, the lane's other bytes
// zero) with its eighth bit, the one that makes the count of set bits even: the nibbles'
// parities by a table shuffle.
AI __m256i with_parity7(__m256i f) {
    const __m256i par4 = _mm256_setr_epi8(0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 0, 1, 1, 0, 1, 0, 0, 1,
                                          1, 0, 0, 1, 0, 1, 1, 0);
    __m256i par = _mm256_xor_si256(_mm256_shuffle_epi8(par4, _mm256_and_si256(f, _mm256_set1_epi8(15))),
                                   _mm256_shuffle_epi8(par4, _mm256_srli_epi16(f, 4)));
    return _mm256_or_si256(f, _mm256_slli_epi16(par, 7));
}

// IQ2_XS: the block's 32 sign bytes (7 stored bits plus the parity bit) from a few vector
// operations, for signs32; four table loads and inserts a group cost more (0.70 of ggml's speed
// against 1.00, one core).
AI __m256i iq2xs_sign_bytes(const uint16_t *qs) {
    __m256i v[2];
    #pragma GCC unroll 2
    for (int h = 0; h < 2; h++) // the top 7 bits of each index word
        v[h] = with_parity7(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(qs + 16 * h)), 9));
    // packus interleaves the halves by 64 bits: put the 32 bytes back in order.
    return _mm256_permute4x64_epi64(_mm256_packus_epi16(v[0], v[1]), 0xD8);
}

// IQ2_XXS / IQ3_XXS: the sign bytes of a block's eight groups (as iq2xs_sign_bytes, a dword per
// group) from its eight aux words (four 7-bit sign fields each, the scale in the top nibble): the
// fields and their parity bits with vector operations. Four table loads a group (the sign bytes
// of each 7-bit field, ready-made) measured 1.9-2.1 GB/s for IQ2_XXS on a Zen 3 core against
// 2.4-2.7 this way (IQ3_XXS 2.3-2.9 against 2.8-3.4; ggml 2.6 and 2.1).
AI __m256i aux_sign_words(__m256i aux) {
    const __m256i m127 = _mm256_set1_epi32(127);
    __m256i words = _mm256_setzero_si256();
    #pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        __m256i f = _mm256_and_si256(_mm256_srli_epi32(aux, 7 * j), m127); // one field a dword
        words = _mm256_or_si256(words, _mm256_slli_epi32(with_parity7(f), 8 * j));
    }
    return words;
}

// sch: the block's scales (iq2_scales16, split_scales) for IQ2_XS / IQ2_S, sb: the group's four
// sign bytes for IQ2_XS, IQ2_XXS and IQ3_XXS (both unused otherwise).
AI void iq_group(const int kind, const void *blk, scale_halves sch, uint32_t sb, int g, __m256i *grid,
                 __m256i *sgn, __m256i *sc) {
    if (kind == IQ2_XXS) {
        const block_iq2_xxs *b = blk;
        uint32_t idx, aux;
        memcpy(&idx, (const uint8_t *)b->qs + 8 * g, 4);
        memcpy(&aux, (const uint8_t *)b->qs + 8 * g + 4, 4);
        *grid = set_u64x4(st_iq2xxs_grid[idx & 255], st_iq2xxs_grid[(idx >> 8) & 255],
                          st_iq2xxs_grid[(idx >> 16) & 255], st_iq2xxs_grid[idx >> 24]);
        *sgn = signs32(sb);
        *sc = _mm256_set1_epi16((short)(2 * (aux >> 28) + 1));
    } else if (kind == IQ2_XS) {
        const uint16_t *q = ((const block_iq2_xs *)blk)->qs + 4 * g; // low 9 bits: grid index
        *grid = set_u64x4(st_iq2xs_grid[q[0] & 511], st_iq2xs_grid[q[1] & 511], st_iq2xs_grid[q[2] & 511],
                          st_iq2xs_grid[q[3] & 511]);
        *sgn = signs32(sb);
        *sc = pair_scales(sch, g);
    } else if (kind == IQ2_S) {
        const block_iq2_s *b = blk;
        const uint8_t *q = b->qs + 4 * g, *sg = b->qs + QK_K / 8 + 4 * g;
        unsigned h = b->qh[g];
        *grid = set_u64x4(st_iq2s_grid[q[0] | (h << 8 & 0x300)], st_iq2s_grid[q[1] | (h << 6 & 0x300)],
                          st_iq2s_grid[q[2] | (h << 4 & 0x300)], st_iq2s_grid[q[3] | (h << 2 & 0x300)]);
        *sgn = signs32(load_u32(sg));
        *sc = pair_scales(sch, g);
    } else if (kind == IQ3_XXS) {
        const block_iq3_xxs *b = blk;
        const uint8_t *q = b->qs + 8 * g;
        uint32_t aux;
        memcpy(&aux, b->qs + QK_K / 4 + 4 * g, 4);
        *grid = _mm256_set_epi32((int)st_iq3xxs_grid[q[7]], (int)st_iq3xxs_grid[q[6]], (int)st_iq3xxs_grid[q[5]],
                                 (int)st_iq3xxs_grid[q[4]], (int)st_iq3xxs_grid[q[3]], (int)st_iq3xxs_grid[q[2]],
                                 (int)st_iq3xxs_grid[q[1]], (int)st_iq3xxs_grid[q[0]]);
        *sgn = signs32(sb);
        *sc = _mm256_set1_epi16((short)(2 * (aux >> 28) + 1));
    } else {
        const block_iq3_s *b = blk;
        const uint8_t *q = b->qs + 8 * g, *sg = b->signs + 4 * g;
        unsigned h = b->qh[g];
        *grid = _mm256_set_epi32((int)st_iq3s_grid[q[7] | (h << 1 & 256)], (int)st_iq3s_grid[q[6] | (h << 2 & 256)],
                                 (int)st_iq3s_grid[q[5] | (h << 3 & 256)], (int)st_iq3s_grid[q[4] | (h << 4 & 256)],
                                 (int)st_iq3s_grid[q[3] | (h << 5 & 256)], (int)st_iq3s_grid[q[2] | (h << 6 & 256)],
                                 (int)st_iq3s_grid[q[1] | (h << 7 & 256)], (int)st_iq3s_grid[q[0] | (h << 8 & 256)]);
        *sgn = signs32(load_u32(sg));
        *sc = _mm256_set1_epi16((short)(2 * ((b->scales[g / 2] >> (4 * (g % 2))) & 15) + 1));
    }
}

AI void iq_rows(const int kind, int64_t n, const int NR, float *s, const void *w, const void *x,
                size_t xs) {
    static const size_t sizes[] = {sizeof(block_iq2_xxs), sizeof(block_iq2_xs), sizeof(block_iq2_s),
                                   sizeof(block_iq3_xxs), sizeof(block_iq3_s)};
    // The odd scales are 2s+1; the formats' common factors (1/8, 1/4) are applied once.
    const float factor = kind <= IQ2_S ? 0.125f : kind == IQ3_XXS ? 0.25f : 1.0f;
    const int64_t nb = n / QK_K;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *blk = (const uint8_t *)w + (size_t)i * sizes[kind];
        st_f16 dh;
        memcpy(&dh, blk, 2); // every IQ2/IQ3 block starts with d
        float d = f16(dh) * factor;
        scale_halves sch = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        if (kind == IQ2_XS) sch = split_scales(_mm256_cvtepi8_epi16(iq2_scales16(((const block_iq2_xs *)blk)->scales)));
        if (kind == IQ2_S) sch = split_scales(_mm256_cvtepi8_epi16(iq2_scales16(((const block_iq2_s *)blk)->scales)));
        uint32_t sb[8] = {0};
        if (kind == IQ2_XS) _mm256_storeu_si256((__m256i *)sb, iq2xs_sign_bytes(((const block_iq2_xs *)blk)->qs));
        if (kind == IQ2_XXS) { // the aux words are the odd dwords of qs
            const uint8_t *q = (const uint8_t *)((const block_iq2_xxs *)blk)->qs;
            __m256 lo = _mm256_loadu_ps((const float *)q), hi = _mm256_loadu_ps((const float *)(q + 32));
            __m256i aux = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(lo, hi, 0xDD)), 0xD8);
            _mm256_storeu_si256((__m256i *)sb, aux_sign_words(aux));
        }
        if (kind == IQ3_XXS)
            _mm256_storeu_si256((__m256i *)sb, aux_sign_words(_mm256_loadu_si256(
                                                   (const __m256i *)(((const block_iq3_xxs *)blk)->qs + QK_K / 4))));
        __m256i sumi[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                           _mm256_setzero_si256()};
        #pragma GCC unroll 8
        for (int g = 0; g < 8; g++) { // group-major: a group's grid, signs and scales serve every row
            __m256i grid, sgn, sc;
            iq_group(kind, blk, sch, sb[g], g, &grid, &sgn, &sc);
            #pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const block_q8_K *y = XROW(block_q8_K, r) + i;
                __m256i qy = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(y->qs + 32 * g)), sgn);
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(grid, qy), sc));
            }
        }
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const block_q8_K *y = XROW(block_q8_K, r) + i;
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y->d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) s[r] = hsum_ps(acc[r]);
}

#define IQ_ROWS(name, kind)                                                                     \
    AI void name##_rows(int64_t n, const int NR, float *s, const void *w, const void *x,       \
                        size_t xs) {                                                            \
        iq_rows(kind, n, NR, s, w, x, xs);                                                      \
    }                                                                                           \
    DEFINE_DOTS(name, name##_rows)
IQ_ROWS(iq2_xxs, IQ2_XXS)
IQ_ROWS(iq2_xs, IQ2_XS)
IQ_ROWS(iq2_s, IQ2_S)
IQ_ROWS(iq3_xxs, IQ3_XXS)
IQ_ROWS(iq3_s, IQ3_S)

// IQ1_S: grid values -1/0/1 (vpsignb multiplies by them), plus delta * sum(y) per group from
// the activation's bsums.
AI void iq1_s_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    const block_iq1_s *b = w;
    const int64_t nb = n / QK_K;
    const __m256i ones8 = _mm256_set1_epi8(1);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m128 accd[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    for (int64_t i = 0; i < nb; i++) {
        float d = f16(b[i].d);
        __m256i grid[8], sc[8];
        int16_t lsd[8];
        #pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            unsigned h = b[i].qh[g];
            const uint8_t *q = b[i].qs + 4 * g;
            grid[g] = set_u64x4(st_iq1s_grid[q[0] | (h << 8 & 0x700)], st_iq1s_grid[q[1] | (h << 5 & 0x700)],
                                st_iq1s_grid[q[2] | (h << 2 & 0x700)], st_iq1s_grid[q[3] | (h >> 1 & 0x700)]);
            int ls = 2 * ((h >> 12) & 7) + 1;
            sc[g] = _mm256_set1_epi16((short)ls);
            lsd[g] = (int16_t)(h & 0x8000 ? -ls : ls);
        }
        __m128i lsdv = _mm_loadu_si128((const __m128i *)lsd);
        #pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const block_q8_K *y = XROW(block_q8_K, r) + i;
            __m256i sumi = _mm256_setzero_si256();
            #pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                __m256i p = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(y->qs + 32 * g)), grid[g]);
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, p), sc[g]));
            }
            __m128i b0 = _mm_loadu_si128((const __m128i *)y->bsums);
            __m128i b1 = _mm_loadu_si128((const __m128i *)(y->bsums + 8));
            __m128i ds = _mm_madd_epi16(lsdv, _mm_hadd_epi16(b0, b1));
            float dd = d * y->d;
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(sumi), acc[r]);
            accd[r] = _mm_fmadd_ps(_mm_set1_ps(dd * ST_IQ1_DELTA), _mm_cvtepi32_ps(ds), accd[r]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) s[r] = hsum_ps(acc[r]) + hsum_ps128(accd[r]);
}
DEFINE_DOTS(iq1_s, iq1_s_rows)

// IQ1_M: like IQ1_S with a 3-bit scale per 16 elements and the delta sign per 8. The value
// grid + delta = (8 grid +- 1) / 8 is kept as the int8 8 grid +- 1 (never 0), multiplied with
// the sign trick; the 1/8 goes into the block factor. A group's four delta signs and its two
// scales are each one table load (not assembled lane by lane on the shuffle port).
#define IQ1M_DSG(b, k) ((b) >> (k) & 1 ? ~0ull : 0x0101010101010101ull)
#define IQ1M_DSG4(b) {IQ1M_DSG(b, 0), IQ1M_DSG(b, 1), IQ1M_DSG(b, 2), IQ1M_DSG(b, 3)}
#define IQ1M_DSG16(b) IQ1M_DSG4(b), IQ1M_DSG4((b) + 1), IQ1M_DSG4((b) + 2), IQ1M_DSG4((b) + 3), \
    IQ1M_DSG4((b) + 4), IQ1M_DSG4((b) + 5), IQ1M_DSG4((b) + 6), IQ1M_DSG4((b) + 7), IQ1M_DSG4((b) + 8), \
    IQ1M_DSG4((b) + 9), IQ1M_DSG4((b) + 10), IQ1M_DSG4((b) + 11), IQ1M_DSG4((b) + 12), IQ1M_DSG4((b) + 13), \
    IQ1M_DSG4((b) + 14), IQ1M_DSG4((b) + 15)
// iq1m_dsg[b]: the four 8-element runs of a group as +1 bytes, or -1 where bit k of b is set.
static _Alignas(32) const uint64_t iq1m_dsg[16][4] = {IQ1M_DSG16(0)};
#define IQ1M_LO(v) (2 * ((v) & 7) + 1)
#define IQ1M_HI(v) (2 * ((v) >> 3 & 7) + 1)
#define IQ1M_SC(v) {IQ1M_LO(v), IQ1M_LO(v), IQ1M_LO(v), IQ1M_LO(v), IQ1M_LO(v), IQ1M_LO(v), IQ1M_LO(v), \
    IQ1M_LO(v), IQ1M_HI(v), IQ1M_HI(v), IQ1M_HI(v), IQ1M_HI(v), IQ1M_HI(v), IQ1M_HI(v), IQ1M_HI(v), IQ1M_HI(v)}
#define IQ1M_SC4(v) IQ1M_SC(v), IQ1M_SC((v) + 1), IQ1M_SC((v) + 2), IQ1M_SC((v) + 3)
#define IQ1M_SC16(v) IQ1M_SC4(v), IQ1M_SC4((v) + 4), IQ1M_SC4((v) + 8), IQ1M_SC4((v) + 12)
// iq1m_sc[v]: a group's two 3-bit scales v (low 3 bits: its first 16 elements) as 2 s + 1 in
// int16 lanes, eight for each half.
static _Alignas(32) const int16_t iq1m_sc[64][16] = {IQ1M_SC16(0), IQ1M_SC16(16), IQ1M_SC16(32), IQ1M_SC16(48)};

AI void iq1_m_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    const block_iq1_m *b = w;
    const int64_t nb = n / QK_K;
    const __m128i m7 = _mm_set1_epi8(7), m15 = _mm_set1_epi8(15);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < nb; i++) {
        uint64_t sc;
        memcpy(&sc, b[i].scales, sizeof sc);
        st_f16 dh = (st_f16)((sc >> 12 & 0x000f) | (sc >> 24 & 0x00f0) | (sc >> 36 & 0x0f00) | (sc >> 48 & 0xf000));
        float d = f16(dh) * 0.125f;
        // The block's 32 grid indices at once (qs byte | the low 3 bits of its qh nibble << 8)
        // and its 32 delta signs (bit 3 of each nibble) as one mask: per group, four loads of
        // ready indices and a shift instead of ~30 scalar operations (one Zen 3 core: 1.1-1.7
        // -> 1.8-2.3 GB/s of weights; ggml 1.6-2.6 in the same runs).
        __m128i qh = _mm_loadu_si128((const __m128i *)b[i].qh);
        __m128i lo = _mm_and_si128(qh, m15), hi = _mm_and_si128(_mm_srli_epi16(qh, 4), m15);
        __m128i n0 = _mm_unpacklo_epi8(lo, hi), n1 = _mm_unpackhi_epi8(lo, hi); // nibble j of the block
        __m128i q0 = _mm_loadu_si128((const __m128i *)b[i].qs), q1 = _mm_loadu_si128((const __m128i *)(b[i].qs + 16));
        _Alignas(32) uint16_t idx[32];
        __m128i h0 = _mm_and_si128(n0, m7), h1 = _mm_and_si128(n1, m7);
        _mm_store_si128((__m128i *)idx, _mm_unpacklo_epi8(q0, h0));
        _mm_store_si128((__m128i *)(idx + 8), _mm_unpackhi_epi8(q0, h0));
        _mm_store_si128((__m128i *)(idx + 16), _mm_unpacklo_epi8(q1, h1));
        _mm_store_si128((__m128i *)(idx + 24), _mm_unpackhi_epi8(q1, h1));
        // Read back through memory (loads are cheap; left to itself the compiler moves each
        // index out with a pextrw, two operations on the vector-to-integer path).
        __asm__ volatile("" : : "r"(idx) : "memory");
        uint32_t dmask = (uint32_t)_mm_movemask_epi8(_mm_slli_epi16(n0, 4)) |
                         (uint32_t)_mm_movemask_epi8(_mm_slli_epi16(n1, 4)) << 16;
        // Group by group (its vectors used by every row while in registers), not all eight
        // groups first: 24 live vectors would not fit in 16 registers.
        __m256i sumi[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                           _mm256_setzero_si256()};
        #pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            const uint16_t *ix = idx + 4 * g;
            __m256i grid = set_u64x4(st_iq1s_grid[ix[0]], st_iq1s_grid[ix[1]], st_iq1s_grid[ix[2]], st_iq1s_grid[ix[3]]);
            __m256i g8 = _mm256_and_si256(_mm256_slli_epi16(grid, 3), _mm256_set1_epi8((char)0xf8));
            __m256i q = _mm256_add_epi8(g8, _mm256_load_si256((const __m256i *)iq1m_dsg[dmask >> (4 * g) & 15]));
            __m256i aq = _mm256_abs_epi8(q);
            __m256i scv = _mm256_load_si256((const __m256i *)iq1m_sc[sc >> (16 * (g / 2) + 6 * (g % 2)) & 63]);
            #pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const block_q8_K *y = XROW(block_q8_K, r) + i;
                __m256i qy = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(y->qs + 32 * g)), q);
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, qy), scv));
            }
        }
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const block_q8_K *y = XROW(block_q8_K, r) + i;
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y->d), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) s[r] = hsum_ps(acc[r]);
}
DEFINE_DOTS(iq1_m, iq1_m_rows)

// ---------------------------------------------------------------------------------------------
// F32, F16, BF16 (activations of the same type)

// kind 0: f32, 1: f16, 2: bf16. Loads 8 elements as f32.
AI __m256 load8(const int kind, const void *p, int64_t i) {
    if (kind == 0) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (kind == 1) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AI void float_rows(const int kind, int64_t n, const int NR, float *s, const void *w,
                   const void *x, size_t xs) {
    // FMA latency: one row needs 4 independent accumulators to keep both FMA units busy. Up to
    // 3 rows a pass (12 accumulators), each with the 4 of a row alone: the same sums, the same
    // bits.
    enum { NA = 4 };
    __m256 acc[3][NA];
    #pragma GCC unroll 12
    for (int r = 0; r < 3; r++)
        for (int a = 0; a < NA; a++) acc[r][a] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 * NA <= n; i += 8 * NA) {
        #pragma GCC unroll 4
        for (int a = 0; a < NA; a++) {
            __m256 wv = load8(kind, w, i + 8 * a);
            #pragma GCC unroll 8
            for (int r = 0; r < NR; r++) {
                const void *y = (const uint8_t *)x + (size_t)r * xs;
                acc[r][a] = _mm256_fmadd_ps(wv, load8(kind, y, i + 8 * a), acc[r][a]);
            }
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) {
        const void *y = (const uint8_t *)x + (size_t)r * xs;
        __m256 t8 = _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3]));
        float t = hsum_ps(t8);
        for (int64_t k = i; k < n; k++) t += load1(kind, w, k) * load1(kind, y, k);
        s[r] = t;
    }
}
AI void f32_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    float_rows(0, n, NR, s, w, x, xs);
}
AI void f16_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    float_rows(1, n, NR, s, w, x, xs);
}
AI void bf16_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    float_rows(2, n, NR, s, w, x, xs);
}
DEFINE_DOTS_G(f32, f32_rows, 3)
DEFINE_DOTS_G(f16, f16_rows, 3)
DEFINE_DOTS_G(bf16, bf16_rows, 3)

// ---------------------------------------------------------------------------------------------
// GEMM: 8 weight rows x many activation rows (prompt chunks). The 8 rows are packed so that one
// vector holds 4 consecutive values of each row; an activation's 4 values, broadcast, then meet
// all 8 rows in one vpmaddubsw, and the results land in one lane per weight row (no horizontal
// sums; 8 outputs stored at once). Activation rows go 4 at a time, each packed vector reused 4x.

// 8 vectors of 8 dwords (rows) -> 8 vectors of 8 dwords (columns): out[c] dword r = in[r] dword c.
AI void transpose8x32(const __m256i in[8], __m256i out[8]) {
    __m256i t[8], u[8];
    #pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        t[2 * k] = _mm256_unpacklo_epi32(in[2 * k], in[2 * k + 1]);
        t[2 * k + 1] = _mm256_unpackhi_epi32(in[2 * k], in[2 * k + 1]);
    }
    #pragma GCC unroll 2
    for (int h = 0; h < 2; h++) { // rows 0-3, then 4-7
        u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h + 0], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h + 0], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    #pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        out[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
        out[c + 4] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
    }
}

AI __m256i bcast32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// An empty asm that "changes" v: GCC would otherwise reassociate a running integer sum into a
// tree over all of a block's products, which needs far more than 16 registers and spills.
AI void pin(__m256i *v) { __asm__("" : "+x"(*v)); }

AI void gemm_out(float *y, __m256 v, bool add) {
    if (add) v = _mm256_add_ps(v, _mm256_loadu_ps(y));
    _mm256_storeu_ps(y, v);
}

// Runs rows_fn over nx activation rows, 4 at a time and then the rest.
#define DEFINE_GEMM(name, rows_fn)                                                              \
    static void name##_gemm(int64_t nb, int nx, float *y, int64_t ldy, const void *pk,         \
                            const void *x, size_t xs, bool add) {                              \
        int r = 0;                                                                              \
        const uint8_t *xb = x;                                                                  \
        for (; r + 4 <= nx; r += 4) rows_fn(nb, 4, y + r * ldy, ldy, pk, xb + (size_t)r * xs, xs, add); \
        switch (nx - r) {                                                                       \
        case 3: rows_fn(nb, 3, y + r * ldy, ldy, pk, xb + (size_t)r * xs, xs, add); break;      \
        case 2: rows_fn(nb, 2, y + r * ldy, ldy, pk, xb + (size_t)r * xs, xs, add); break;      \
        case 1: rows_fn(nb, 1, y + r * ldy, ldy, pk, xb + (size_t)r * xs, xs, add); break;      \
        default: break;                                                                         \
        }                                                                                       \
    }

// Q8_0, packed per block: qs[8 groups][8 rows][4] (signed), d[8] as f32.
typedef struct { int8_t qs[8][8][4]; float d[8]; } gemm_q8_0;
_Static_assert(sizeof(gemm_q8_0) == 288, "gemm_q8_0");

static void q8_0_gemm_pack(int64_t nb, void *dst, const void *w, size_t rb) {
    gemm_q8_0 *p = dst;
    for (int64_t i = 0; i < nb; i++) {
        __m256i in[8], out[8];
        #pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            const block_q8_0 *b = (const block_q8_0 *)((const uint8_t *)w + (size_t)r * rb) + i;
            in[r] = _mm256_loadu_si256((const __m256i *)b->qs);
            p[i].d[r] = f16(b->d);
        }
        transpose8x32(in, out);
        #pragma GCC unroll 8
        for (int g = 0; g < 8; g++) _mm256_store_si256((__m256i *)p[i].qs[g], out[g]);
    }
}

AI void q8_0_gemm_rows(int64_t nb, const int NX, float *y, int64_t ldy, const void *pk,
                       const void *x, size_t xs, bool add) {
    const gemm_q8_0 *p = pk;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < nb; i++) {
        __m256i sumi[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                           _mm256_setzero_si256()};
        #pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            __m256i q = _mm256_load_si256((const __m256i *)p[i].qs[g]);
            __m256i aq = _mm256_sign_epi8(q, q);
            #pragma GCC unroll 4
            for (int r = 0; r < NX; r++) {
                __m256i qy = bcast32(XROW(block_q8_0, r)[i].qs + 4 * g);
                __m256i pr = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(qy, q));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(pr, ones));
                pin(&sumi[r]);
            }
        }
        __m256 d = _mm256_load_ps(p[i].d);
        #pragma GCC unroll 4
        for (int r = 0; r < NX; r++) {
            __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(f16(XROW(block_q8_0, r)[i].d)));
            acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NX; r++) gemm_out(y + r * ldy, acc[r], add);
}
DEFINE_GEMM(q8_0, q8_0_gemm_rows)

// Q4_K (and Q5_K), packed per block: qs[8 sub-blocks][8 groups][8 rows][4] (values 0..15,
// 0..31 for Q5_K); sc[j] the
// sub-block scales as int16 pairs (lanes 2r, 2r+1 = row r's scale j, for vpmaddwd); mn[t] the
// mins of sub-blocks 2t, 2t+1 (lane 2r: row r's min 2t, lane 2r+1: min 2t+1); d and dmin in f32.
typedef struct {
    uint8_t qs[8][8][8][4];
    int16_t sc[8][16];
    int16_t mn[4][16];
    float d[8], dmin[8];
} gemm_q4_K;
_Static_assert(sizeof(gemm_q4_K) == 2496, "gemm_q4_K");

// Q5_K packs the same way, with the 5th bit or-ed into each value (0..31).
AI void q45k_gemm_pack(const int is_q5, int64_t nb, void *dst, const void *w, size_t rb) {
    gemm_q4_K *p = dst;
    const size_t bsz = is_q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t i = 0; i < nb; i++) {
        const block_q4_K *b[8]; // Q4_K and Q5_K share d, dmin, scales[12] at the start
        const uint8_t *qs[8];
        __m256i sc[8], out[8], qh[8];
        __m128i mn[8];
        #pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            b[r] = (const block_q4_K *)((const uint8_t *)w + (size_t)r * rb + (size_t)i * bsz);
            qs[r] = is_q5 ? ((const block_q5_K *)b[r])->qs : b[r]->qs;
            if (is_q5) qh[r] = _mm256_loadu_si256((const __m256i *)((const block_q5_K *)b[r])->qh);
            p[i].d[r] = f16(b[r]->d);
            p[i].dmin[r] = f16(b[r]->dmin);
            uint32_t a0, a1, a2;
            memcpy(&a0, b[r]->scales, 4);
            memcpy(&a1, b[r]->scales + 4, 4);
            memcpy(&a2, b[r]->scales + 8, 4);
            // The same 6-bit unpacking as kq_scales: the 8 scales and the 8 mins as bytes.
            uint64_t s8 = (a0 & 0x3f3f3f3f) | (uint64_t)((a2 & 0x0f0f0f0f) | ((a0 >> 2) & 0x30303030)) << 32;
            uint64_t m8 = (a1 & 0x3f3f3f3f) | (uint64_t)(((a2 >> 4) & 0x0f0f0f0f) | ((a1 >> 2) & 0x30303030)) << 32;
            sc[r] = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)s8)); // dword j: scale j
            mn[r] = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)m8));    // dword t: mins 2t, 2t+1
        }
        transpose8x32(sc, out);
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) // dword r = row r's scale j, in both int16 halves
            _mm256_store_si256((__m256i *)p[i].sc[j], _mm256_or_si256(out[j], _mm256_slli_epi32(out[j], 16)));
        // 4x4 dword transposes of rows 0-3 (low lane) and 4-7 (high lane).
        __m256i rr[4], a[4];
        #pragma GCC unroll 4
        for (int k = 0; k < 4; k++) rr[k] = _mm256_set_m128i(mn[k + 4], mn[k]);
        a[0] = _mm256_unpacklo_epi32(rr[0], rr[1]);
        a[1] = _mm256_unpackhi_epi32(rr[0], rr[1]);
        a[2] = _mm256_unpacklo_epi32(rr[2], rr[3]);
        a[3] = _mm256_unpackhi_epi32(rr[2], rr[3]);
        _mm256_store_si256((__m256i *)p[i].mn[0], _mm256_unpacklo_epi64(a[0], a[2]));
        _mm256_store_si256((__m256i *)p[i].mn[1], _mm256_unpackhi_epi64(a[0], a[2]));
        _mm256_store_si256((__m256i *)p[i].mn[2], _mm256_unpacklo_epi64(a[1], a[3]));
        _mm256_store_si256((__m256i *)p[i].mn[3], _mm256_unpackhi_epi64(a[1], a[3]));
        __m256i qht[8]; // qht[g] dword r: row r's qh bytes 4g..4g+3; bit j: 5th bit of sub-block j
        if (is_q5) transpose8x32(qh, qht);
        #pragma GCC unroll 1
        for (int c = 0; c < 4; c++) { // 32 bytes of qs: sub-blocks 2c (low nibbles), 2c+1 (high)
            // Transposed as packed bytes, then split: moving whole dwords keeps each byte's
            // two nibbles together (and the 16-bit lanes the shift works in).
            __m256i v[8];
            #pragma GCC unroll 8
            for (int r = 0; r < 8; r++) v[r] = _mm256_loadu_si256((const __m256i *)(qs[r] + 32 * c));
            transpose8x32(v, out);
            #pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                __m256i lo = _mm256_and_si256(out[g], m4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(out[g], 4), m4);
                if (is_q5) { // bit j of each qh byte, moved to bit 4 (the 16-bit shifts stay per byte)
                    const __m256i one = _mm256_set1_epi8(1);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qht[g], 2 * c), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qht[g], 2 * c + 1), one), 4));
                }
                _mm256_store_si256((__m256i *)p[i].qs[2 * c][g], lo);
                _mm256_store_si256((__m256i *)p[i].qs[2 * c + 1][g], hi);
            }
        }
    }
}

static void q4_K_gemm_pack(int64_t nb, void *dst, const void *w, size_t rb) {
    q45k_gemm_pack(0, nb, dst, w, rb);
}
static void q5_K_gemm_pack(int64_t nb, void *dst, const void *w, size_t rb) {
    q45k_gemm_pack(1, nb, dst, w, rb);
}

AI void q45k_gemm_rows(const int is_q5, int64_t nb, const int NX, float *y, int64_t ldy,
                       const void *pk, const void *x, size_t xs, bool add) {
    const gemm_q4_K *p = pk;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < nb; i++) {
        __m256i sumi[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                           _mm256_setzero_si256()};
        #pragma GCC unroll 1
        for (int j = 0; j < 8; j++) {
            // A sub-block's products per lane summed in int16 over 8 groups for Q4_K
            // (|8 * 2 * 15 * 127| < 32768: q8_K activations stay within +-127), over 4 for Q5_K.
            const int span = is_q5 ? 4 : 8;
            __m256i sc = _mm256_load_si256((const __m256i *)p[i].sc[j]);
            #pragma GCC unroll 2
            for (int g0 = 0; g0 < 8; g0 += span) {
                __m256i s16[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                                  _mm256_setzero_si256()};
                #pragma GCC unroll 8
                for (int g = g0; g < g0 + span; g++) {
                    __m256i q = _mm256_load_si256((const __m256i *)p[i].qs[j][g]);
                    #pragma GCC unroll 4
                    for (int r = 0; r < NX; r++) {
                        __m256i qy = bcast32(XROW(block_q8_K, r)[i].qs + 32 * j + 4 * g);
                        s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(q, qy));
                        pin(&s16[r]);
                    }
                }
                #pragma GCC unroll 4
                for (int r = 0; r < NX; r++) sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(s16[r], sc));
            }
        }
        __m256 d = _mm256_load_ps(p[i].d), dmin = _mm256_load_ps(p[i].dmin);
        #pragma GCC unroll 4
        for (int r = 0; r < NX; r++) {
            const block_q8_K *yb = XROW(block_q8_K, r) + i;
            // mins: sum over sub-blocks j of min[j] * (bsums[2j] + bsums[2j+1])
            __m128i b0 = _mm_loadu_si128((const __m128i *)yb->bsums);
            __m128i b1 = _mm_loadu_si128((const __m128i *)(yb->bsums + 8));
            __m256i bs = _mm256_broadcastsi128_si256(_mm_hadd_epi16(b0, b1));
            __m256i mi = _mm256_madd_epi16(_mm256_load_si256((const __m256i *)p[i].mn[0]), _mm256_shuffle_epi32(bs, 0x00));
            mi = _mm256_add_epi32(mi, _mm256_madd_epi16(_mm256_load_si256((const __m256i *)p[i].mn[1]), _mm256_shuffle_epi32(bs, 0x55)));
            mi = _mm256_add_epi32(mi, _mm256_madd_epi16(_mm256_load_si256((const __m256i *)p[i].mn[2]), _mm256_shuffle_epi32(bs, 0xaa)));
            mi = _mm256_add_epi32(mi, _mm256_madd_epi16(_mm256_load_si256((const __m256i *)p[i].mn[3]), _mm256_shuffle_epi32(bs, 0xff)));
            __m256 yd = _mm256_set1_ps(yb->d);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, yd), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, yd), _mm256_cvtepi32_ps(mi), acc[r]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NX; r++) gemm_out(y + r * ldy, acc[r], add);
}
AI void q4_K_gemm_rows(int64_t nb, const int NX, float *y, int64_t ldy, const void *pk,
                       const void *x, size_t xs, bool add) {
    q45k_gemm_rows(0, nb, NX, y, ldy, pk, x, xs, add);
}
AI void q5_K_gemm_rows(int64_t nb, const int NX, float *y, int64_t ldy, const void *pk,
                       const void *x, size_t xs, bool add) {
    q45k_gemm_rows(1, nb, NX, y, ldy, pk, x, xs, add);
}
DEFINE_GEMM(q4_K, q4_K_gemm_rows)
DEFINE_GEMM(q5_K, q5_K_gemm_rows)
typedef gemm_q4_K gemm_q5_K;

// Q6_K, packed per block: qs[8 vectors][8 groups][8 rows][4] (values 0..63: vector t holds
// elements 32t..32t+31, i.e. sub-blocks 2t (groups 0-3) and 2t+1 (groups 4-7)); sc[s] the
// sub-block scales as int16 pairs (lanes 2r, 2r+1 = row r's scale s); sp[k] scales 2k, 2k+1
// (lane 2r: row r's scale 2k, 2r+1: scale 2k+1) for the -32 offset against the bsums; d in f32.
typedef struct {
    uint8_t qs[8][8][8][4];
    int16_t sc[16][16];
    int16_t sp[8][16];
    float d[8];
} gemm_q6_K;
_Static_assert(sizeof(gemm_q6_K) == 2848, "gemm_q6_K");

static void q6_K_gemm_pack(int64_t nb, void *dst, const void *w, size_t rb) {
    gemm_q6_K *p = dst;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    for (int64_t i = 0; i < nb; i++) {
        const block_q6_K *b[8];
        __m256i s32[8], out[8];
        #pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            b[r] = (const block_q6_K *)((const uint8_t *)w + (size_t)r * rb) + i;
            p[i].d[r] = f16(b[r]->d);
            // dword k: scales 2k, 2k+1 as int16 (the pair layout of sp)
            __m128i s8 = _mm_loadu_si128((const __m128i *)b[r]->scales);
            s32[r] = _mm256_cvtepi8_epi16(s8);
        }
        transpose8x32(s32, out); // out[k] dword r: row r's scales 2k (low half), 2k+1 (high)
        #pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            _mm256_store_si256((__m256i *)p[i].sp[k], out[k]);
            __m256i lo = _mm256_shufflelo_epi16(_mm256_shufflehi_epi16(out[k], 0xa0), 0xa0); // low halves doubled
            __m256i hi = _mm256_shufflelo_epi16(_mm256_shufflehi_epi16(out[k], 0xf5), 0xf5); // high halves doubled
            _mm256_store_si256((__m256i *)p[i].sc[2 * k], lo);
            _mm256_store_si256((__m256i *)p[i].sc[2 * k + 1], hi);
        }
        #pragma GCC unroll 1
        for (int h = 0; h < 2; h++) { // elements 128h..128h+127: vectors 4h..4h+3, as in q6_K_rows
            __m256i q[4][8];
            #pragma GCC unroll 8
            for (int r = 0; r < 8; r++) {
                __m256i l0 = _mm256_loadu_si256((const __m256i *)(b[r]->ql + 64 * h));
                __m256i l1 = _mm256_loadu_si256((const __m256i *)(b[r]->ql + 64 * h + 32));
                __m256i qh = _mm256_loadu_si256((const __m256i *)(b[r]->qh + 32 * h));
                q[0][r] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
                q[1][r] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
                q[2][r] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
                q[3][r] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                          _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
            }
            #pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                transpose8x32(q[t], out);
                #pragma GCC unroll 8
                for (int g = 0; g < 8; g++) _mm256_store_si256((__m256i *)p[i].qs[4 * h + t][g], out[g]);
            }
        }
    }
}

AI void q6_K_gemm_rows(int64_t nb, const int NX, float *y, int64_t ldy, const void *pk,
                       const void *x, size_t xs, bool add) {
    const gemm_q6_K *p = pk;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < nb; i++) {
        __m256i sumi[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                           _mm256_setzero_si256()};
        #pragma GCC unroll 1
        for (int t = 0; t < 8; t++) {
            // Two groups per int16 sum: |2 * 2 * 63 * 127| < 32768.
            #pragma GCC unroll 4
            for (int g = 0; g < 8; g += 2) {
                __m256i q0 = _mm256_load_si256((const __m256i *)p[i].qs[t][g]);
                __m256i q1 = _mm256_load_si256((const __m256i *)p[i].qs[t][g + 1]);
                __m256i sc = _mm256_load_si256((const __m256i *)p[i].sc[2 * t + g / 4]);
                #pragma GCC unroll 4
                for (int r = 0; r < NX; r++) {
                    const int8_t *qy = XROW(block_q8_K, r)[i].qs + 32 * t + 4 * g;
                    __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(q0, bcast32(qy)),
                                                   _mm256_maddubs_epi16(q1, bcast32(qy + 4)));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(s16, sc));
                    pin(&sumi[r]);
                }
            }
        }
        __m256 d = _mm256_load_ps(p[i].d);
        #pragma GCC unroll 4
        for (int r = 0; r < NX; r++) {
            const block_q8_K *yb = XROW(block_q8_K, r) + i;
            // the -32 offset: sum over sub-blocks s of scale[s] * bsums[s]
            __m256i off = _mm256_setzero_si256();
            #pragma GCC unroll 8
            for (int k = 0; k < 8; k++)
                off = _mm256_add_epi32(off, _mm256_madd_epi16(_mm256_load_si256((const __m256i *)p[i].sp[k]),
                                                              bcast32(yb->bsums + 2 * k)));
            __m256i v = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(off, 5));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(yb->d)), _mm256_cvtepi32_ps(v), acc[r]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NX; r++) gemm_out(y + r * ldy, acc[r], add);
}
DEFINE_GEMM(q6_K, q6_K_gemm_rows)

// IQ4_XS, packed per block: qs[8 sub-blocks][8 groups][8 rows][4] (the signed table values);
// sc[j] the sub-block scales (ls - 32) as int16 pairs (lanes 2r, 2r+1 = row r's scale j); d in
// f32. Signed x signed: |w| times the activation with w's sign, one scale multiply per group
// (a group's pair sums reach 2 * 127 * 127, so no int16 sums across groups).
typedef struct {
    int8_t qs[8][8][8][4];
    int16_t sc[8][16];
    float d[8];
} gemm_iq4_xs;
_Static_assert(sizeof(gemm_iq4_xs) == 2336, "gemm_iq4_xs");

static void iq4_xs_gemm_pack(int64_t nb, void *dst, const void *w, size_t rb) {
    gemm_iq4_xs *p = dst;
    const __m256i tbl = iq4nl_table();
    for (int64_t i = 0; i < nb; i++) {
        const block_iq4_xs *b[8];
        __m256i sc[8], out[8];
        #pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            b[r] = (const block_iq4_xs *)((const uint8_t *)w + (size_t)r * rb) + i;
            p[i].d[r] = f16(b[r]->d);
            uint32_t sl;
            memcpy(&sl, b[r]->scales_l, 4);
            sc[r] = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)iq4xs_scales8(sl, b[r]->scales_h)));
        }
        transpose8x32(sc, out);
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m256i v = _mm256_sub_epi32(out[j], _mm256_set1_epi32(32));
            _mm256_store_si256((__m256i *)p[i].sc[j], _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)),
                                                                      _mm256_slli_epi32(v, 16)));
        }
        #pragma GCC unroll 1
        for (int j = 0; j < 8; j++) {
            __m256i v[8];
            #pragma GCC unroll 8
            for (int r = 0; r < 8; r++) v[r] = _mm256_shuffle_epi8(tbl, nibbles_32(b[r]->qs + 16 * j));
            transpose8x32(v, out);
            #pragma GCC unroll 8
            for (int g = 0; g < 8; g++) _mm256_store_si256((__m256i *)p[i].qs[j][g], out[g]);
        }
    }
}

AI void iq4_xs_gemm_rows(int64_t nb, const int NX, float *y, int64_t ldy, const void *pk,
                         const void *x, size_t xs, bool add) {
    const gemm_iq4_xs *p = pk;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < nb; i++) {
        __m256i sumi[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                           _mm256_setzero_si256()};
        #pragma GCC unroll 1
        for (int j = 0; j < 8; j++) {
            __m256i sc = _mm256_load_si256((const __m256i *)p[i].sc[j]);
            #pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                __m256i q = _mm256_load_si256((const __m256i *)p[i].qs[j][g]);
                __m256i aq = _mm256_sign_epi8(q, q);
                #pragma GCC unroll 4
                for (int r = 0; r < NX; r++) {
                    __m256i qy = bcast32(XROW(block_q8_K, r)[i].qs + 32 * j + 4 * g);
                    __m256i pr = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(qy, q));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(pr, sc));
                    pin(&sumi[r]);
                }
            }
        }
        __m256 d = _mm256_load_ps(p[i].d);
        #pragma GCC unroll 4
        for (int r = 0; r < NX; r++) {
            __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(XROW(block_q8_K, r)[i].d));
            acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NX; r++) gemm_out(y + r * ldy, acc[r], add);
}
DEFINE_GEMM(iq4_xs, iq4_xs_gemm_rows)

// ---------------------------------------------------------------------------------------------

#define SET(T, name)                                                                            \
    do {                                                                                        \
        k->dot[T] = name##_dot;                                                                 \
        k->dot_multi[T] = name##_multi;                                                         \
    } while (0)

#define SET_GEMM(T, name)                                                                       \
    do {                                                                                        \
        k->gemm_pack[T] = name##_gemm_pack;                                                     \
        k->gemm[T] = name##_gemm;                                                               \
        k->gemm_block_bytes[T] = (int)sizeof(gemm_##name);                                      \
    } while (0)

// ---------------------------------------------------------------------------------------------
// Activation quantizers, byte for byte quantize.c's.

// roundf (half away from zero) exactly: the truncation plus one step away from zero where the
// dropped part (v - trunc(v), exact in floats) is at least one half.
AI __m256 round_away(__m256 v) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256 frac = _mm256_andnot_ps(sign_bit, _mm256_sub_ps(v, t));
    __m256 step = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(v, sign_bit));
    return _mm256_add_ps(t, _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ), step));
}

// 32 integral floats (four vectors, in order) to 32 int8 with saturation.
AI __m256i pack_i8(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256i ab = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
    __m256i cd = _mm256_packs_epi32(_mm256_cvtps_epi32(c), _mm256_cvtps_epi32(d));
    // The packs work within 128-bit lanes: 4-byte groups come out as a0 b0 c0 d0 a1 b1 c1 d1.
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

AI float hmax_ps(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// F16 rows (the attention's KV cache) to f32 with F16C, 8 at a time: the conversion is exact,
// so the values are the scalar code's (a signalling NaN comes back quiet). The scalar code's
// bit manipulation per element was 2.8% of decode's perf samples at a 16-token context on the
// 2-core Xeon VM (30B shapes); this is 1.0%.
static void dequantize_f16(const void *vx, float *y, int64_t n) {
    const st_f16 *x = vx;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    for (; i < n; i++) y[i] = f16(x[i]);
}

static void quantize_q8_0(const float *x, void *vy, int64_t nb) {
    block_q8_0 *y = vy;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t i = 0; i < nb; i++, x += QK8_0) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + 8 * j);
            m = _mm256_max_ps(m, _mm256_and_ps(v[j], abs_mask));
        }
        float d = hmax_ps(m) / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = st_f32_to_f16(d);
        __m256 s = _mm256_set1_ps(id);
        for (int j = 0; j < 4; j++) v[j] = round_away(_mm256_mul_ps(v[j], s));
        _mm256_storeu_si256((__m256i *)y[i].qs, pack_i8(v[0], v[1], v[2], v[3]));
    }
}

// Q8_K: the scale from the first value of largest magnitude (mapped to -127), rounding to
// nearest even, values capped at 127, and the sums of each 16.
static void quantize_q8_K(const float *x, void *vy, int64_t nb) {
    block_q8_K *y = vy;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < QK_K; j += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + j), abs_mask));
        float amax = hmax_ps(m);
        if (amax == 0.0f) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        __m256 am = _mm256_set1_ps(amax);
        float max = 0.0f;
        for (int j = 0; j < QK_K; j += 8) {
            int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), abs_mask), am, _CMP_EQ_OQ));
            if (hit) {
                max = x[j + __builtin_ctz((unsigned)hit)];
                break;
            }
        }
        float iscale = -127.0f / max;
        __m256 s = _mm256_set1_ps(iscale), cap = _mm256_set1_ps(127.0f);
        for (int j = 0; j < QK_K; j += 32) {
            __m256 v[4];
            for (int u = 0; u < 4; u++)
                v[u] = _mm256_min_ps(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * u), s),
                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), cap);
            __m256i q = pack_i8(v[0], v[1], v[2], v[3]);
            _mm256_storeu_si256((__m256i *)(y[i].qs + j), q);
            // Sums of each 16: bytes to int16 pairs, then the 16-lane halves added up.
            __m256i w = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)), _mm256_set1_epi16(1));
            __m256i z = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)), _mm256_set1_epi16(1));
            __m256i h = _mm256_hadd_epi32(w, z); // w01 w23 z01 z23 | w45 w67 z45 z67
            h = _mm256_hadd_epi32(h, h);         // w0-3 z0-3 . . | w4-7 z4-7 . .
            int32_t t[8];
            _mm256_storeu_si256((__m256i *)t, h);
            y[i].bsums[j / 16] = (int16_t)(t[0] + t[4]);
            y[i].bsums[j / 16 + 1] = (int16_t)(t[1] + t[5]);
        }
        y[i].d = 1.0f / iscale;
    }
}

void st_quant_kernels_avx2(st_quant_kernels *k) {
    k->dequantize[ST_TYPE_F16] = dequantize_f16;
    k->quantize[ST_TYPE_Q8_0] = quantize_q8_0;
    k->quantize[ST_TYPE_Q8_K] = quantize_q8_K;
    SET_GEMM(ST_TYPE_Q8_0, q8_0);
    SET_GEMM(ST_TYPE_Q4_K, q4_K);
    SET_GEMM(ST_TYPE_Q5_K, q5_K);
    SET_GEMM(ST_TYPE_Q6_K, q6_K);
    SET_GEMM(ST_TYPE_IQ4_XS, iq4_xs);
    SET(ST_TYPE_Q8_0, q8_0);
    SET(ST_TYPE_Q4_0, q4_0);
    SET(ST_TYPE_Q4_1, q4_1);
    SET(ST_TYPE_Q5_0, q5_0);
    SET(ST_TYPE_Q5_1, q5_1);
    SET(ST_TYPE_IQ4_NL, iq4_nl);
    SET(ST_TYPE_Q4_K, q4_K);
    SET(ST_TYPE_Q5_K, q5_K);
    SET(ST_TYPE_Q6_K, q6_K);
    SET(ST_TYPE_IQ4_XS, iq4_xs);
    SET(ST_TYPE_Q2_K, q2_K);
    SET(ST_TYPE_Q3_K, q3_K);
    SET(ST_TYPE_IQ2_XXS, iq2_xxs);
    SET(ST_TYPE_IQ2_XS, iq2_xs);
    SET(ST_TYPE_IQ2_S, iq2_s);
    SET(ST_TYPE_IQ3_XXS, iq3_xxs);
    SET(ST_TYPE_IQ3_S, iq3_s);
    SET(ST_TYPE_IQ1_S, iq1_s);
    SET(ST_TYPE_IQ1_M, iq1_m);
    SET(ST_TYPE_F32, f32);
    SET(ST_TYPE_F16, f16);
    SET(ST_TYPE_BF16, bf16);
}
