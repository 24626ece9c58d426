/* quants.c: the block types' sizes, and the IQ types' grids (gguf's own, handed over once at load). */
#include <stdlib.h>

#include "quants.h"

/* The IQ types' lookup tables, gguf's own (gguf.quants builds its grids from ggml's): kernels/native.py hands
 * them over once (ds_set_tables); until then those types are not taken. Grids as floats, rows of 8 (IQ2_XXS 256,
 * IQ2_XS 512, IQ2_S 1024, IQ1_S 2048) or 4 (IQ3_XXS 256, IQ3_S 512) values; ksigns: 128 bytes of sign bits. */
DS_INTERNAL const float *g_iq2xxs, *g_iq2xs, *g_iq2s, *g_iq3xxs, *g_iq3s, *g_iq1s;
DS_INTERNAL const uint8_t *g_ksigns;
/* the same grids as int8 (their values are small integers: IQ2 8..43, IQ3 1..62, IQ1 -1..1), for the products */
DS_INTERNAL int8_t *i_iq2xxs, *i_iq2xs, *i_iq2s, *i_iq3xxs, *i_iq3s, *i_iq1s;

static int8_t *int8_grid(const float *g, int n) {
    int8_t *out = malloc((size_t)n);
    if (out)
        for (int i = 0; i < n; i++) out[i] = (int8_t)g[i];
    return out;
}

int ds_set_tables(const float *iq2xxs, const float *iq2xs, const float *iq2s, const float *iq3xxs, const float *iq3s,
                  const float *iq1s, const uint8_t *ksigns) {
    if (g_ksigns) return 0;  /* once per process (the tables are gguf's, the same every time) */
    g_iq2xxs = iq2xxs, g_iq2xs = iq2xs, g_iq2s = iq2s, g_iq3xxs = iq3xxs, g_iq3s = iq3s, g_iq1s = iq1s;
    i_iq2xxs = int8_grid(iq2xxs, 256 * 8), i_iq2xs = int8_grid(iq2xs, 512 * 8), i_iq2s = int8_grid(iq2s, 1024 * 8);
    i_iq3xxs = int8_grid(iq3xxs, 256 * 4), i_iq3s = int8_grid(iq3s, 512 * 4), i_iq1s = int8_grid(iq1s, 2048 * 8);
    if (!i_iq2xxs || !i_iq2xs || !i_iq2s || !i_iq3xxs || !i_iq3s || !i_iq1s) return -1;
    g_ksigns = ksigns;
    return 0;
}

int block_info(int type, int *elems, int *bytes) {
    switch (type) {
    case T_F32: *elems = 1; *bytes = 4; return 0;
    case T_F16: *elems = 1; *bytes = 2; return 0;
    case T_BF16: *elems = 1; *bytes = 2; return 0;
    case T_Q4_0: *elems = 32; *bytes = 18; return 0;
    case T_Q8_0: *elems = 32; *bytes = 34; return 0;
    case T_Q4_K: *elems = 256; *bytes = 144; return 0;
    case T_Q5_K: *elems = 256; *bytes = 176; return 0;
    case T_Q6_K: *elems = 256; *bytes = 210; return 0;
    case T_Q4_1: *elems = 32; *bytes = 20; return 0;
    case T_Q5_0: *elems = 32; *bytes = 22; return 0;
    case T_Q5_1: *elems = 32; *bytes = 24; return 0;
    case T_IQ4_NL: *elems = 32; *bytes = 18; return 0;
    case T_MXFP4: *elems = 32; *bytes = 17; return 0;
    case T_NVFP4: *elems = 64; *bytes = 36; return 0;
    case T_Q2_K: *elems = 256; *bytes = 84; return 0;
    case T_Q3_K: *elems = 256; *bytes = 110; return 0;
    case T_IQ4_XS: *elems = 256; *bytes = 136; return 0;
    case T_TQ1_0: *elems = 256; *bytes = 54; return 0;
    case T_TQ2_0: *elems = 256; *bytes = 66; return 0;
    }
    if (!g_ksigns) return -1;
    switch (type) {
    case T_IQ2_XXS: *elems = 256; *bytes = 66; return 0;
    case T_IQ2_XS: *elems = 256; *bytes = 74; return 0;
    case T_IQ2_S: *elems = 256; *bytes = 82; return 0;
    case T_IQ3_XXS: *elems = 256; *bytes = 98; return 0;
    case T_IQ3_S: *elems = 256; *bytes = 110; return 0;
    case T_IQ1_S: *elems = 256; *bytes = 50; return 0;
    case T_IQ1_M: *elems = 256; *bytes = 56; return 0;
    default: return -1;
    }
}
