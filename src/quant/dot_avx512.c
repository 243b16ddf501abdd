// quant: AVX-512 (F/BW/VL/DQ/VNNI) dot and dot_multi kernels, laid over the AVX2 table for the
// types where they measured faster on the H200 machine's Xeon. The 32-element types (Q8_0, Q4_0,
// Q5_0, Q4_1, Q5_1, IQ4_NL) keep AVX2's: a two-blocks-per-zmm form measured 10-20% slower there
// (16 threads, 1200 MiB: 78 / 48 / 50 GB/s against 89 / 60 / 60 for Q8_0 / Q4_0 / Q5_0). Same
// structure as dot_avx2.c: a row routine templated on 1..4 activation rows; a zmm covers 64
// elements (two 32-element blocks or sub-blocks); int16 pair sums are scaled and accumulated
// with VNNI's vpdpwssd, signed x signed products use |w| and a masked negation of x.

#if defined(__GNUC__) && !defined(__clang__)
// The path requires F/BW/VL/DQ/VNNI only (cpu.c); CMake also passes -mavx512bf16, which
// Ice Lake lacks: keep the compiler from emitting BF16 instructions on its own.
#pragma GCC target("no-avx512bf16")
#endif

#include <immintrin.h>
#include <string.h>

#include "quant/blocks.h"
#include "quant/iq_tables.h"
#include "quant/dot_simd.h"
#include "quant/kernels.h"

AI float hsum512(__m512 v) {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    return hsum_ps128(_mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1)));
}

AI __m512i join256(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// int16 vector whose lane L holds v[idx(L)], for scale broadcasting: each group of `span`
// lanes takes the next entry starting at `first`.
AI __m512i spread16(__m512i v, int first, int span) {
    int16_t idx[32];
    for (int l = 0; l < 32; l++) idx[l] = (int16_t)(first + l / span);
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(idx), v);
}

#define ZERO4_PS {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()}

// ---------------------------------------------------------------------------------------------
// Q4_K, Q5_K x Q8_K. zmm j holds sub-blocks 2j (low nibbles) and 2j+1 (high nibbles).

AI void q45k_rows(const int is_q5, int64_t n, const int NR, float *s, const void *w,
                  const void *x, size_t xs) {
    const int64_t nb = n / QK_K;
    const uint8_t *wb = w;
    const size_t bsz = is_q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m512 acc[4] = ZERO4_PS;
    __m128 accm[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *blk = wb + (size_t)i * bsz;
        const block_q4_K *b4 = (const block_q4_K *)blk;
        const uint8_t *qs = is_q5 ? ((const block_q5_K *)blk)->qs : b4->qs;
        float d = f16(b4->d), dmin = f16(b4->dmin);
        uint32_t a0, a1, a2;
        memcpy(&a0, b4->scales, 4);
        memcpy(&a1, b4->scales + 4, 4);
        memcpy(&a2, b4->scales + 8, 4);
        uint32_t sc_lo = a0 & 0x3f3f3f3f, m_lo = a1 & 0x3f3f3f3f;
        uint32_t sc_hi = (a2 & 0x0f0f0f0f) | ((a0 >> 2) & 0x30303030);
        uint32_t m_hi = ((a2 >> 4) & 0x0f0f0f0f) | ((a1 >> 2) & 0x30303030);
        __m512i sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)sc_hi, (int)sc_lo)));
        __m128i mins = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)m_hi, (int)m_lo));
        __m512i q[4], scj[4];
        __m512i qh2 = is_q5 ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)((const block_q5_K *)blk)->qh))
                            : _mm512_setzero_si512();
        #pragma GCC unroll 8
        for (int j = 0; j < 4; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            q[j] = join256(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
            if (is_q5) {
                // Bit s of qh[l] is the 5th bit of element 32s + l; s = 2j (low half), 2j+1.
                __m512i bitsel = join256(_mm256_set1_epi8((char)(1 << (2 * j))), _mm256_set1_epi8((char)(1 << (2 * j + 1))));
                __mmask64 hk = _mm512_test_epi8_mask(qh2, bitsel);
                q[j] = _mm512_mask_add_epi8(q[j], hk, q[j], _mm512_set1_epi8(16));
            }
            scj[j] = spread16(sc, 2 * j, 16);
        }
        #pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const block_q8_K *y = XROW(block_q8_K, r) + i;
            // Two accumulators: vpdpwssd's latency would otherwise chain the four steps.
            __m512i sumi = _mm512_setzero_si512(), sumi1 = _mm512_setzero_si512();
            #pragma GCC unroll 8
            for (int j = 0; j < 4; j += 2) {
                sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(q[j], _mm512_loadu_si512(y->qs + 64 * j)), scj[j]);
                sumi1 = _mm512_dpwssd_epi32(sumi1, _mm512_maddubs_epi16(q[j + 1], _mm512_loadu_si512(y->qs + 64 * j + 64)), scj[j + 1]);
            }
            sumi = _mm512_add_epi32(sumi, sumi1);
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * y->d), _mm512_cvtepi32_ps(sumi), acc[r]);
            __m128i b0 = _mm_loadu_si128((const __m128i *)y->bsums);
            __m128i b1 = _mm_loadu_si128((const __m128i *)(y->bsums + 8));
            __m128i pm = _mm_madd_epi16(mins, _mm_hadd_epi16(b0, b1));
            accm[r] = _mm_fmadd_ps(_mm_set1_ps(dmin * y->d), _mm_cvtepi32_ps(pm), accm[r]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) s[r] = hsum512(acc[r]) - hsum_ps128(accm[r]);
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
// Q6_K x Q8_K. zmm t holds elements 64t..64t+63 (four 16-element sub-blocks 4t..4t+3).

AI void q6_K_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    const block_q6_K *b = w;
    const int64_t nb = n / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    __m512 acc[4] = ZERO4_PS;
    for (int64_t i = 0; i < nb; i++) {
        float d = f16(b[i].d);
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b[i].scales));
        __m512i sc = _mm512_castsi256_si512(sc16);
        __m512i q[4], scp[4];
        #pragma GCC unroll 8
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(b[i].ql + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(b[i].ql + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(b[i].qh + 32 * h));
            __m256i e0 = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
            __m256i e1 = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
            __m256i e2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
            __m256i e3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                         _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
            q[2 * h] = join256(e0, e1);
            q[2 * h + 1] = join256(e2, e3);
        }
        #pragma GCC unroll 8
        for (int t = 0; t < 4; t++) scp[t] = spread16(sc, 4 * t, 8);
        #pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const block_q8_K *y = XROW(block_q8_K, r) + i;
            __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
            __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);
            __m512i sumi = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), corr));
            __m512i sumi1 = _mm512_setzero_si512();
            #pragma GCC unroll 8
            for (int t = 0; t < 4; t += 2) {
                sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(q[t], _mm512_loadu_si512(y->qs + 64 * t)), scp[t]);
                sumi1 = _mm512_dpwssd_epi32(sumi1, _mm512_maddubs_epi16(q[t + 1], _mm512_loadu_si512(y->qs + 64 * t + 64)), scp[t + 1]);
            }
            sumi = _mm512_add_epi32(sumi, sumi1);
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * y->d), _mm512_cvtepi32_ps(sumi), acc[r]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) s[r] = hsum512(acc[r]);
}
DEFINE_DOTS(q6_K, q6_K_rows)

// ---------------------------------------------------------------------------------------------
// IQ4_XS x Q8_K. zmm j holds sub-blocks 2j and 2j+1.

AI void iq4_xs_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    const block_iq4_xs *b = w;
    const int64_t nb = n / QK_K;
    const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)st_kvalues_iq4nl));
    __m512 acc[4] = ZERO4_PS;
    for (int64_t i = 0; i < nb; i++) {
        float d = f16(b[i].d);
        // Scale j: nibble j of scales_l, bits 2j..2j+1 of scales_h on top, minus 32.
        uint32_t sl;
        memcpy(&sl, b[i].scales_l, 4);
        uint64_t ls8 = iq4xs_scales8(sl, b[i].scales_h);
        __m128i ls = _mm_sub_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)ls8)), _mm_set1_epi16(32));
        __m512i sc = _mm512_castsi128_si512(ls);
        __m512i aq[4], scj[4];
        __mmask64 neg[4];
        #pragma GCC unroll 8
        for (int j = 0; j < 4; j++) {
            __m256i v0 = _mm256_shuffle_epi8(tbl, nibbles_32(b[i].qs + 32 * j));
            __m256i v1 = _mm256_shuffle_epi8(tbl, nibbles_32(b[i].qs + 32 * j + 16));
            __m512i q = join256(v0, v1);
            aq[j] = _mm512_abs_epi8(q);
            neg[j] = _mm512_movepi8_mask(q);
            scj[j] = spread16(sc, 2 * j, 16);
        }
        #pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const block_q8_K *y = XROW(block_q8_K, r) + i;
            __m512i sumi = _mm512_setzero_si512(), sumi1 = _mm512_setzero_si512();
            #pragma GCC unroll 8
            for (int j = 0; j < 4; j++) {
                __m512i qy = _mm512_loadu_si512(y->qs + 64 * j);
                qy = _mm512_mask_sub_epi8(qy, neg[j], _mm512_setzero_si512(), qy);
                if (j & 1) sumi1 = _mm512_dpwssd_epi32(sumi1, _mm512_maddubs_epi16(aq[j], qy), scj[j]);
                else sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(aq[j], qy), scj[j]);
            }
            sumi = _mm512_add_epi32(sumi, sumi1);
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * y->d), _mm512_cvtepi32_ps(sumi), acc[r]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) s[r] = hsum512(acc[r]);
}
DEFINE_DOTS(iq4_xs, iq4_xs_rows)

// ---------------------------------------------------------------------------------------------
// Q2_K, Q3_K x Q8_K. zmm t holds elements 64t..64t+63, i.e. the AVX2 kernel's vectors 2t and
// 2t+1 side by side: the 32 qs bytes of half h = t / 2 shifted by 2j (j = 2 (t % 2), low 256
// bits) and by 2j + 2 (high 256 bits). Four 16-element sub-blocks 4t..4t+3, scales as in Q6_K.

// The 2-bit fields of elements 64t..64t+63 (element 128h + 32j + l is qs[32h + l] >> 2j).
AI __m512i q2k_bits(const uint8_t *qs, int t) {
    __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * (t / 2))));
    const int j = 2 * (t % 2);
    __m512i sh = join256(_mm256_set1_epi16((short)(2 * j)), _mm256_set1_epi16((short)(2 * j + 2)));
    return _mm512_and_si512(_mm512_srlv_epi16(v, sh), _mm512_set1_epi8(3));
}

AI void q2_K_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    const block_q2_K *b = w;
    const int64_t nb = n / QK_K;
    __m512 acc[4] = ZERO4_PS;
    for (int64_t i = 0; i < nb; i++) {
        float d = f16(b[i].d), dmin = f16(b[i].dmin);
        __m128i raw = _mm_loadu_si128((const __m128i *)b[i].scales);
        __m512i sc = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(15))));
        __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15)));
        __m512i q[4], scp[4];
        #pragma GCC unroll 8
        for (int t = 0; t < 4; t++) {
            q[t] = q2k_bits(b[i].qs, t);
            scp[t] = spread16(sc, 4 * t, 8);
        }
        #pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const block_q8_K *y = XROW(block_q8_K, r) + i;
            __m512i sumi = _mm512_setzero_si512(), sumi1 = _mm512_setzero_si512();
            #pragma GCC unroll 8
            for (int t = 0; t < 4; t += 2) {
                sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(q[t], _mm512_loadu_si512(y->qs + 64 * t)), scp[t]);
                sumi1 = _mm512_dpwssd_epi32(sumi1, _mm512_maddubs_epi16(q[t + 1], _mm512_loadu_si512(y->qs + 64 * t + 64)), scp[t + 1]);
            }
            sumi = _mm512_add_epi32(sumi, sumi1);
            __m256i msum = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)y->bsums));
            __m512 f = _mm512_fmsub_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sumi),
                                       _mm512_mul_ps(_mm512_set1_ps(dmin), _mm512_cvtepi32_ps(_mm512_zextsi256_si512(msum))));
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(y->d), f, acc[r]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) s[r] = hsum512(acc[r]);
}
DEFINE_DOTS(q2_K, q2_K_rows)

AI void q3_K_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    const block_q3_K *b = w;
    const int64_t nb = n / QK_K;
    __m512 acc[4] = ZERO4_PS;
    for (int64_t i = 0; i < nb; i++) {
        float d = f16(b[i].d);
        __m256i sc16 = _mm256_cvtepi8_epi16(q3k_scales8(b[i].scales));
        __m512i sc = _mm512_castsi256_si512(sc16);
        __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)b[i].hmask));
        __m512i q[4], scp[4];
        // Element 128h + 32j + l: 2 bits from qs[32h + l] >> 2j, the 3rd from hmask bit 4h + j
        // of hmask[l]; stored unsigned (q + 4), the 4 * sum(scale * bsum) correction comes per row.
        #pragma GCC unroll 8
        for (int t = 0; t < 4; t++) {
            const int h = t / 2, j = 2 * (t % 2);
            __m512i bit = join256(_mm256_set1_epi8((char)(1 << (4 * h + j))), _mm256_set1_epi8((char)(1 << (4 * h + j + 1))));
            __m512i v = q2k_bits(b[i].qs, t);
            q[t] = _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(hm, bit), v, _mm512_set1_epi8(4));
            scp[t] = spread16(sc, 4 * t, 8);
        }
        #pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const block_q8_K *y = XROW(block_q8_K, r) + i;
            __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
            __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 2);
            __m512i sumi = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), corr));
            __m512i sumi1 = _mm512_setzero_si512();
            #pragma GCC unroll 8
            for (int t = 0; t < 4; t += 2) {
                sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(q[t], _mm512_loadu_si512(y->qs + 64 * t)), scp[t]);
                sumi1 = _mm512_dpwssd_epi32(sumi1, _mm512_maddubs_epi16(q[t + 1], _mm512_loadu_si512(y->qs + 64 * t + 64)), scp[t + 1]);
            }
            sumi = _mm512_add_epi32(sumi, sumi1);
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * y->d), _mm512_cvtepi32_ps(sumi), acc[r]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) s[r] = hsum512(acc[r]);
}
DEFINE_DOTS(q3_K, q3_K_rows)

// ---------------------------------------------------------------------------------------------
// IQ2_S x Q8_K. zmm p holds the 32-element groups 2p and 2p+1 (elements 64p..64p+63). Grid rows
// are gathered with scalar loads as in AVX2; the sign bits become a 64-bit mask that negates the
// activations (vpsignb has no 512-bit form); scales are int16 lanes for vpdpwssd (one per 16
// elements: lanes 8k..8k+7 belong to elements 64p+16k..+15). IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_S,
// IQ1_S and IQ1_M use the AVX2 kernels: on the Xeon of the H200 machine this form was slower
// for them (16 threads, 1200 MiB: 24 / 20 / 25 / 25 / 18 / 13 GB/s against AVX2's 28 / 24 / 33
// / 26 / 21 / 15; the same order on the 768x2048 expert shape), faster only for IQ2_S (35 vs 31).

AI __m512i set_u64x8(uint64_t a0, uint64_t a1, uint64_t a2, uint64_t a3, uint64_t a4, uint64_t a5,
                     uint64_t a6, uint64_t a7) { // a0 lowest
    return _mm512_set_epi64((long long)a7, (long long)a6, (long long)a5, (long long)a4, (long long)a3,
                            (long long)a2, (long long)a1, (long long)a0);
}

AI uint64_t load_u64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

// Groups 2p, 2p+1 of block b: unsigned grid bytes, the mask of negative elements and the int16
// scales. sc16: the block's 16 scales as int16 lanes.
AI void iq2_s_pair(const block_iq2_s *b, __m512i sc16, int p, __m512i *grid, __mmask64 *neg, __m512i *sc) {
    const uint8_t *q = b->qs + 8 * p; // grid index low bytes; the sign bytes follow at QK_K/8
    unsigned h0 = b->qh[2 * p], h1 = b->qh[2 * p + 1];
    *grid = set_u64x8(st_iq2s_grid[q[0] | (h0 << 8 & 0x300)], st_iq2s_grid[q[1] | (h0 << 6 & 0x300)],
                      st_iq2s_grid[q[2] | (h0 << 4 & 0x300)], st_iq2s_grid[q[3] | (h0 << 2 & 0x300)],
                      st_iq2s_grid[q[4] | (h1 << 8 & 0x300)], st_iq2s_grid[q[5] | (h1 << 6 & 0x300)],
                      st_iq2s_grid[q[6] | (h1 << 4 & 0x300)], st_iq2s_grid[q[7] | (h1 << 2 & 0x300)]);
    *neg = load_u64(b->qs + QK_K / 8 + 8 * p);
    *sc = spread16(sc16, 4 * p, 8);
}

AI void iq2_s_rows(int64_t n, const int NR, float *s, const void *w, const void *x, size_t xs) {
    const block_iq2_s *b = w;
    const int64_t nb = n / QK_K;
    __m512 acc[4] = ZERO4_PS;
    for (int64_t i = 0; i < nb; i++) {
        float d = f16(b[i].d) * 0.125f; // the odd scales are 2s+1; the format's 1/8 applied once
        __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(iq2_scales16(b[i].scales)));
        __m512i grid[4], sc[4];
        __mmask64 neg[4];
        #pragma GCC unroll 8
        for (int p = 0; p < 4; p++) iq2_s_pair(&b[i], sc16, p, &grid[p], &neg[p], &sc[p]);
        #pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const block_q8_K *y = XROW(block_q8_K, r) + i;
            __m512i sumi = _mm512_setzero_si512(), sumi1 = _mm512_setzero_si512();
            #pragma GCC unroll 8
            for (int p = 0; p < 4; p++) {
                __m512i qy = _mm512_loadu_si512(y->qs + 64 * p);
                qy = _mm512_mask_sub_epi8(qy, neg[p], _mm512_setzero_si512(), qy);
                if (p & 1) sumi1 = _mm512_dpwssd_epi32(sumi1, _mm512_maddubs_epi16(grid[p], qy), sc[p]);
                else sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(grid[p], qy), sc[p]);
            }
            sumi = _mm512_add_epi32(sumi, sumi1);
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * y->d), _mm512_cvtepi32_ps(sumi), acc[r]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) s[r] = hsum512(acc[r]);
}
DEFINE_DOTS(iq2_s, iq2_s_rows)

// ---------------------------------------------------------------------------------------------
// F32, F16, BF16

AI __m512 load16(const int kind, const void *p, int64_t i) {
    if (kind == 0) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (kind == 1) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AI void float_rows(const int kind, int64_t n, const int NR, float *s, const void *w,
                   const void *x, size_t xs) {
    __m512 acc[4][2];
    #pragma GCC unroll 8
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 w0 = load16(kind, w, i), w1 = load16(kind, w, i + 16);
        #pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const void *y = (const uint8_t *)x + (size_t)r * xs;
            acc[r][0] = _mm512_fmadd_ps(w0, load16(kind, y, i), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(w1, load16(kind, y, i + 16), acc[r][1]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < NR; r++) {
        const void *y = (const uint8_t *)x + (size_t)r * xs;
        float t = hsum512(_mm512_add_ps(acc[r][0], acc[r][1]));
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
DEFINE_DOTS(f32, f32_rows)
DEFINE_DOTS(f16, f16_rows)
DEFINE_DOTS(bf16, bf16_rows)

// ---------------------------------------------------------------------------------------------

// A type with its own AVX-512 kernels uses them for one row and for windows, and keeps the AVX2
// table's GEMM (8 weight rows x many activation rows) for batches of 4 rows or more: on this
// project's Sapphire-Rapids-class Xeon (one thread, 4096 x 4096, 32 rows: `strata bench kernels
// --path all --nx 32`) the GEMM reads q4_K 1.75x, q5_K 1.6x, q6_K 2.2x and iq4_xs 1.75x as fast
// as these VNNI kernels' dot_multi (bench/results/2026-12-07-cpu-window-exact.md).
#define SET(T, name)                                                                            \
    do {                                                                                        \
        k->dot[T] = name##_dot;                                                                 \
        k->dot_multi[T] = name##_multi;                                                         \
    } while (0)

void st_quant_kernels_avx512(st_quant_kernels *k) {
    SET(ST_TYPE_Q4_K, q4_K);
    SET(ST_TYPE_Q5_K, q5_K);
    SET(ST_TYPE_Q6_K, q6_K);
    SET(ST_TYPE_IQ4_XS, iq4_xs);
    SET(ST_TYPE_Q2_K, q2_K);
    SET(ST_TYPE_Q3_K, q3_K);
    SET(ST_TYPE_IQ2_S, iq2_s);
    SET(ST_TYPE_F32, f32);
    SET(ST_TYPE_F16, f16);
    SET(ST_TYPE_BF16, bf16);
}
