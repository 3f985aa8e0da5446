/* Element types shared by every kernel, and the bf16 <-> fp32 conversions.
 *
 * Storage is float32 or bfloat16 (the top 16 bits of an IEEE float32), and for the
 * matrices of an FP8 layer float8 e4m3fn bytes (kernels/fp8.h; never an activation).
 * All arithmetic in the kernels is fp32; bf16 and e4m3 are storage formats only. */
#ifndef Q3_KERNELS_DTYPE_H
#define Q3_KERNELS_DTYPE_H

#include <stdint.h>
#include <string.h>

/* Q3_I32: only the router's chosen experts (a layer call's introspection output, and what
 * expert_counts reads back): no kernel's data argument takes it, and an imported tensor
 * carries it only where the glue asks for it (Q3_VIEW_I32) */
/* Q3_F16: only the scales of a GPTQ int4 matrix (kernels/int4.h), whose packed words are Q3_I32 */
/* Q3_BOOL and Q3_I64: only a layer call's per-token inputs (its token mask, bool or uint8
 * bytes, and its positions), imported where the glue asks for them (Q3_VIEW_BOOL, Q3_VIEW_I64) */
typedef enum { Q3_F32 = 0, Q3_BF16 = 1, Q3_E4M3 = 2, Q3_I32 = 3, Q3_F16 = 4, Q3_BOOL = 5, Q3_I64 = 6 } q3_dtype;

static inline size_t q3_dtype_size(q3_dtype dt) {
    return dt == Q3_BF16 || dt == Q3_F16 ? 2 : dt == Q3_E4M3 || dt == Q3_BOOL ? 1 : dt == Q3_I64 ? 8 : 4;
}
/* torch's and numpy's name of each: "float32", "bfloat16", "float8_e4m3fn", "int32", "float16",
 * "bool", "int64" */
static inline const char *q3_dtype_name(q3_dtype dt) {
    return dt == Q3_BF16 ? "bfloat16" : dt == Q3_E4M3 ? "float8_e4m3fn" : dt == Q3_I32 ? "int32"
                                      : dt == Q3_F16  ? "float16" : dt == Q3_BOOL ? "bool"
                                      : dt == Q3_I64  ? "int64" : "float32";
}

static inline float q3_bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest, ties to even; NaN stays a (quiet) NaN. */
static inline uint16_t q3_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif
