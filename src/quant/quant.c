// quant: the table of ggml tensor types (names, block sizes, bytes, CPU dot pairing) and the
// lookups over it. Sizes follow REFERENCE.md §4.1; the dot pairing follows §4.3.

#include <stdio.h>
#include <strings.h>

#include "quant/quant.h"
#include "quant/blocks.h"

#define PLAIN(nm, bytes, dot, comp) {nm, 1, bytes, dot, false, comp}
#define BLOCK(nm, elems, bytes, dot, comp) {nm, elems, bytes, dot, true, comp}

// Indexed by ggml id. Ids left out (4, 5, 31-33, 36-38) were removed from ggml and never occur
// in current files. Types without kernels pair with themselves: the field has no meaning there.
static const st_type_info type_table[ST_TYPE_COUNT] = {
    [ST_TYPE_F32] = PLAIN("f32", 4, ST_TYPE_F32, true),
    [ST_TYPE_F16] = PLAIN("f16", 2, ST_TYPE_F16, true),
    [ST_TYPE_BF16] = PLAIN("bf16", 2, ST_TYPE_BF16, true),
    [ST_TYPE_Q4_0] = BLOCK("q4_0", QK4_0, sizeof(block_q4_0), ST_TYPE_Q8_0, true),
    [ST_TYPE_Q4_1] = BLOCK("q4_1", QK4_1, sizeof(block_q4_1), ST_TYPE_Q8_1, true),
    [ST_TYPE_Q5_0] = BLOCK("q5_0", QK5_0, sizeof(block_q5_0), ST_TYPE_Q8_0, true),
    [ST_TYPE_Q5_1] = BLOCK("q5_1", QK5_1, sizeof(block_q5_1), ST_TYPE_Q8_1, true),
    [ST_TYPE_Q8_0] = BLOCK("q8_0", QK8_0, sizeof(block_q8_0), ST_TYPE_Q8_0, true),
    // Activation-only formats: quantize and dequantize exist, no weight kernels.
    [ST_TYPE_Q8_1] = BLOCK("q8_1", QK8_1, sizeof(block_q8_1), ST_TYPE_Q8_1, false),
    [ST_TYPE_Q8_K] = BLOCK("q8_K", QK_K, sizeof(block_q8_K), ST_TYPE_Q8_K, false),
    [ST_TYPE_Q2_K] = BLOCK("q2_K", QK_K, sizeof(block_q2_K), ST_TYPE_Q8_K, true),
    [ST_TYPE_Q3_K] = BLOCK("q3_K", QK_K, sizeof(block_q3_K), ST_TYPE_Q8_K, true),
    [ST_TYPE_Q4_K] = BLOCK("q4_K", QK_K, sizeof(block_q4_K), ST_TYPE_Q8_K, true),
    [ST_TYPE_Q5_K] = BLOCK("q5_K", QK_K, sizeof(block_q5_K), ST_TYPE_Q8_K, true),
    [ST_TYPE_Q6_K] = BLOCK("q6_K", QK_K, sizeof(block_q6_K), ST_TYPE_Q8_K, true),
    [ST_TYPE_IQ2_XXS] = BLOCK("iq2_xxs", QK_K, sizeof(block_iq2_xxs), ST_TYPE_Q8_K, true),
    [ST_TYPE_IQ2_XS] = BLOCK("iq2_xs", QK_K, sizeof(block_iq2_xs), ST_TYPE_Q8_K, true),
    [ST_TYPE_IQ3_XXS] = BLOCK("iq3_xxs", QK_K, sizeof(block_iq3_xxs), ST_TYPE_Q8_K, true),
    [ST_TYPE_IQ1_S] = BLOCK("iq1_s", QK_K, sizeof(block_iq1_s), ST_TYPE_Q8_K, true),
    [ST_TYPE_IQ4_NL] = BLOCK("iq4_nl", QK4_NL, sizeof(block_iq4_nl), ST_TYPE_Q8_0, true),
    [ST_TYPE_IQ3_S] = BLOCK("iq3_s", QK_K, sizeof(block_iq3_s), ST_TYPE_Q8_K, true),
    [ST_TYPE_IQ2_S] = BLOCK("iq2_s", QK_K, sizeof(block_iq2_s), ST_TYPE_Q8_K, true),
    [ST_TYPE_IQ4_XS] = BLOCK("iq4_xs", QK_K, sizeof(block_iq4_xs), ST_TYPE_Q8_K, true),
    [ST_TYPE_IQ1_M] = BLOCK("iq1_m", QK_K, sizeof(block_iq1_m), ST_TYPE_Q8_K, true),
    [ST_TYPE_I8] = PLAIN("i8", 1, ST_TYPE_I8, false),
    [ST_TYPE_I16] = PLAIN("i16", 2, ST_TYPE_I16, false),
    [ST_TYPE_I32] = PLAIN("i32", 4, ST_TYPE_I32, false),
    [ST_TYPE_I64] = PLAIN("i64", 8, ST_TYPE_I64, false),
    [ST_TYPE_F64] = PLAIN("f64", 8, ST_TYPE_F64, false),
    // Known so files holding them can be listed; TQ1_0: qs[48] qh[4] d, TQ2_0: qs[64] d,
    // MXFP4: e8m0 exponent + qs[16].
    [ST_TYPE_TQ1_0] = BLOCK("tq1_0", QK_K, 54, ST_TYPE_Q8_K, false),
    [ST_TYPE_TQ2_0] = BLOCK("tq2_0", QK_K, 66, ST_TYPE_Q8_K, false),
    [ST_TYPE_MXFP4] = BLOCK("mxfp4", 32, 17, ST_TYPE_Q8_0, false),
};

const st_type_info *st_type_get(int type) {
    if (type < 0 || type >= ST_TYPE_COUNT || !type_table[type].name) return NULL;
    return &type_table[type];
}

const char *st_type_name(int type) {
    const st_type_info *info = st_type_get(type);
    if (info) return info->name;
    static _Thread_local char buf[32];
    snprintf(buf, sizeof buf, "unknown(%d)", type);
    return buf;
}

bool st_type_from_name(const char *name, st_type *type) {
    for (int t = 0; t < ST_TYPE_COUNT; t++)
        if (type_table[t].name && !strcasecmp(type_table[t].name, name)) {
            *type = (st_type)t;
            return true;
        }
    return false;
}

size_t st_row_bytes(st_type type, int64_t n) {
    const st_type_info *info = st_type_get(type);
    ST_ASSERT(info && n >= 0 && n % info->block == 0);
    return (size_t)(n / info->block) * (size_t)info->block_bytes;
}
