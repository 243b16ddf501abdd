// quant (internal): ggml's IQ lookup tables (generated into iq_tables.c) and the small unpack
// helpers for packed sub-block scales that dequantize and every dot kernel share.
#pragma once

#include <stdint.h>

// Grid rows: element j is byte j of the word. IQ2 bytes are 8, 25 or 43; IQ3_XXS bytes are
// 4..62; IQ3_S bytes are odd 1..15; IQ1 bytes are int8 -1, 0 or 1.
extern const uint64_t st_iq2xxs_grid[256];
extern const uint64_t st_iq2xs_grid[512];
extern const uint64_t st_iq2s_grid[1024];
extern const uint32_t st_iq3xxs_grid[256];
extern const uint32_t st_iq3s_grid[512];
extern const uint64_t st_iq1s_grid[2048];
// 7 sign bits (bit j set: element j negative) plus an 8th that makes the parity even.
extern const uint8_t st_ksigns_iq2xs[128];
// IQ4_NL / IQ4_XS non-linear 4-bit values.
extern const int8_t st_kvalues_iq4nl[16];

// IQ1_S / IQ1_M: the grid point is shifted by ±this before scaling.
#define ST_IQ1_DELTA 0.125f

// Q4_K / Q5_K: 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes.
static inline void st_kq_scale_min(const uint8_t *b, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = b[j] & 63;
        *m = b[j + 4] & 63;
    } else {
        *sc = (uint8_t)((b[j + 4] & 15) | ((b[j - 4] >> 6) << 4));
        *m = (uint8_t)((b[j + 4] >> 4) | ((b[j] >> 6) << 4));
    }
}

// Q3_K: the 16 signed 6-bit scales (-32..31) from the 12 packed bytes.
static inline void st_q3k_scales(const uint8_t *b, int8_t out[16]) {
    for (int s = 0; s < 16; s++) {
        int lo = s < 8 ? b[s] & 15 : b[s - 8] >> 4;
        int hi = (b[8 + s % 4] >> (2 * (s / 4))) & 3;
        out[s] = (int8_t)((lo | hi << 4) - 32);
    }
}

// Element j (0..7) of a grid row as a signed byte.
static inline int st_grid_elem(uint64_t row, int j) {
    return (int8_t)(row >> (8 * j));
}
