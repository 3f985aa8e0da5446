/* Element types shared by every kernel, and the bf16 and fp16 <-> fp32 conversions.
 *
 * Storage is float32, bfloat16 (the top 16 bits of an IEEE float32) or float16 (IEEE
 * binary16), and for the matrices of an FP8 layer float8 e4m3fn bytes (kernels/fp8.h; never an
 * activation). All arithmetic in the kernels is fp32; bf16, fp16 and e4m3 are storage formats
 * only. A kernel taking a q3_dtype for its float storage takes these three (q3_float_at). */
#ifndef Q3_KERNELS_DTYPE_H
#define Q3_KERNELS_DTYPE_H

#include <stdint.h>
#include <string.h>

/* q3_dtype_size and the fp16 conversions are the CUDA kernels' too (kernels/cuda/common.cuh's
 * q3_load and q3_store): nvcc compiles them for the device as well, so a kernel widens and
 * rounds fp16 bit for bit as the CPU does. Elsewhere (C, and the SIMT executor's C++ build of the
 * kernels, where device code is host code) the mark is empty. */
#ifdef __CUDACC__
#define Q3_HOST_DEVICE __host__ __device__
#else
#define Q3_HOST_DEVICE
#endif

/* Q3_I32: only the router's chosen experts (a layer call's introspection output, and what
 * expert_counts reads back): no kernel's data argument takes it, and an imported tensor
 * carries it only where the glue asks for it (Q3_VIEW_I32) */
/* Q3_F16: a float16 layer's weights, activations and cache, and the scales of a GPTQ int4 matrix
 * (kernels/int4.h), whose packed words are Q3_I32 */
/* Q3_BOOL and Q3_I64: only a layer call's per-token inputs (its token mask, bool or uint8
 * bytes, and its positions), imported where the glue asks for them (Q3_VIEW_BOOL, Q3_VIEW_I64) */
typedef enum { Q3_F32 = 0, Q3_BF16 = 1, Q3_E4M3 = 2, Q3_I32 = 3, Q3_F16 = 4, Q3_BOOL = 5, Q3_I64 = 6 } q3_dtype;

Q3_HOST_DEVICE static inline size_t q3_dtype_size(q3_dtype dt) {
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

/* fp16 bits -> fp32, exact (subnormals, infinities and NaN included); without branches, so
 * that a loop over it vectorizes: a normal's bits moved into place with the exponent rebased
 * (15 -> 127), a subnormal m 2^-24 made by an exact multiply, inf and NaN their payload kept */
Q3_HOST_DEVICE static inline float q3_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = h & 0x7c00u, m = h & 0x3ffu;
    union { uint32_t u; float f; } sub, out;
    sub.f = (float)(int32_t)m * (1.0f / 16777216.0f);
    out.u = (e == 0 ? sub.u : e == 0x7c00u ? 0x7f800000u | (m << 13) : ((uint32_t)(h & 0x7fffu) << 13) + (112u << 23)) | sign;
    return out.f;
}

/* fp32 -> fp16 bits, round to nearest even, overflow to inf, NaN kept (as torch's .half()) */
Q3_HOST_DEVICE static inline uint16_t q3_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7e00u;  /* NaN */
    if (u >= 0x477ff000u) return sign | 0x7c00u; /* 65520 and up: inf */
    if (u >= 0x38800000u) {                      /* 2^-14 and up: a normal fp16 */
        u += 0xfffu + ((u >> 13) & 1u);
        return sign | (uint16_t)((u - (112u << 23)) >> 13);
    }
    /* below 2^-14: a multiple q of 2^-24 */
    const uint32_t e = u >> 23;
    if (e < 102u) return sign; /* below 2^-25: rounds to 0 */
    const uint32_t sig = (u & 0x7fffffu) | 0x800000u, shift = 126u - e; /* f = sig 2^(e-150) */
    uint32_t q = sig >> shift;
    const uint32_t rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    q += rem > half || (rem == half && (q & 1u));
    return sign | (uint16_t)q;
}

/* whether dt is a float storage dtype (float32, bfloat16 or float16): a layer's, a cache's, an
 * activation's */
static inline int q3_dtype_is_float(q3_dtype dt) { return dt == Q3_F32 || dt == Q3_BF16 || dt == Q3_F16; }

/* element i of float storage p of dtype dt (float32, bfloat16 or float16) as fp32 */
static inline float q3_float_at(const void *p, q3_dtype dt, int64_t i) {
    return dt == Q3_BF16 ? q3_bf16_to_f32(((const uint16_t *)p)[i])
           : dt == Q3_F16 ? q3_f16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* fp32 f stored as element i of float storage p of dtype dt (float32, bfloat16 or float16) */
static inline void q3_float_put(void *p, q3_dtype dt, int64_t i, float f) {
    if (dt == Q3_BF16) ((uint16_t *)p)[i] = q3_f32_to_bf16(f);
    else if (dt == Q3_F16) ((uint16_t *)p)[i] = q3_f32_to_f16(f);
    else ((float *)p)[i] = f;
}

#endif
