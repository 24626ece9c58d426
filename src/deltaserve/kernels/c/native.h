/* native.h: the constants and structs that the C files and Python share. kernels/native.py reads this file and
 * builds its ctypes structs and constants from it, so nothing here is declared twice. Keep to the forms it
 * reads: `#define DS_NAME number`, and `typedef struct { ... } name_t;` whose members are `int`, `float`,
 * pointers, another struct of this file, or an array of one with a DS_ constant as its length. */
#ifndef DS_NATIVE_H
#define DS_NATIVE_H

#define DS_ABI 19           /* the library's interface version: a cached library of another one is rebuilt */
#define DS_MAX_ROWS 8       /* activation rows per product, and sequences per batched decode call */
#define DS_MAX_SEGMENTS 4   /* parts of a stacked linear that keep their own block kinds */
#define DS_Q6K 14           /* GGUF Q6_K blocks, read as the file has them */
#define DS_I8 100           /* an int8 table with per-row scales (tables_avx512.c) */
#define DS_Q4KR 112         /* Q4_K blocks repacked at load (scale bits unpacked; tables_avx512.c) */
#define DS_MAX_USED 32      /* routed experts a token may use in an MoE layer */
#define DS_KV_F32 0         /* a decode call's KV cache type (ds_decode_tokens' kv_type): f32 */
#define DS_KV_F16 1         /* IEEE half */
#define DS_KV_BF16 2        /* bfloat16 */

typedef struct {
    int type;               /* a GGUF type id of the file's blocks (quants.h: F16 1, Q4_0 2, Q8_0 8, Q4_K 12,
                               Q5_K 13, Q6_K 14, BF16 30, ...), 0 F32 rows, or tables.h's DS_I8, DS_Q4KR */
    int rows;               /* output rows of this segment (segments follow each other along the output) */
    const void *data;
    const float *scale;     /* the int8 table's row scales */
} seg_t;

typedef struct {
    int nseg;
    int K;
    seg_t seg[DS_MAX_SEGMENTS];
} lin_t;

typedef struct {
    int type;               /* a GGUF type id of the experts' blocks (quants.h), or 0 for F32 rows */
    int rows;               /* output rows of one expert */
    int stride;             /* rows from one expert's first row to the next one's (rows, or 2 rows where a fused
                               gate_up tensor holds each expert's gate rows, then its up rows) */
    const void *data;       /* expert 0's first row */
} experts_t;

typedef struct {
    int attention;          /* 1: gated attention; 0: Gated DeltaNet */
    const float *attn_norm;
    const float *post_norm;
    lin_t mix_in;
    lin_t mix_out;
    lin_t gate_up;          /* the FFN's gate and up rows (an MoE layer's shared expert) */
    lin_t down;
    int n_expert;           /* 0: a dense FFN; else an MoE block: the router over n_expert experts, n_used a token */
    int n_used;
    lin_t router;           /* ffn_gate_inp's n_expert rows, then the shared expert's gate (one row) */
    experts_t exp_gate;     /* [n_expert x rows, hidden] */
    experts_t exp_up;
    experts_t exp_down;     /* [n_expert x hidden, rows] */
    const float *conv_w;    /* DeltaNet */
    const float *a_neg;
    const float *dt_bias;
    const float *norm_w;
    const float *q_norm;    /* attention */
    const float *k_norm;
} layer_t;

typedef struct {
    int n_layers;
    int hidden;
    int nk;                 /* DeltaNet */
    int dk;
    int nv;
    int dv;
    int Kc;
    int tiled;
    int nh;                 /* attention */
    int nkv;
    int hd;
    int rotary;
    float eps;
    float theta;
    const float *final_norm;
    lin_t head;
    const layer_t *layers;
} model_t;

#endif
