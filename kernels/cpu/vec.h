/* GNU C vector types as wide as the variant's registers (zmm, ymm, or 16 bytes for the
 * portable baseline), so one source compiles to each variant's widest code; and exp over
 * them: 2^n * 2^f with |f| <= 1/2, a degree-6 Taylor polynomial for 2^f (relative error
 * < 2e-7), 2^n built in the exponent bits; below -87.3 (and -inf) gives 0. */
#ifndef Q3_KERNELS_CPU_VEC_H
#define Q3_KERNELS_CPU_VEC_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define Q3_VBYTES 64
#elif defined(__AVX__)
#define Q3_VBYTES 32
#else
#define Q3_VBYTES 16
#endif
#define Q3_LANES (Q3_VBYTES / 4)

typedef float q3_vf __attribute__((vector_size(Q3_VBYTES)));
typedef int32_t q3_vi __attribute__((vector_size(Q3_VBYTES)));
/* the same, for loads and stores at any float alignment */
typedef float q3_vfu __attribute__((vector_size(Q3_VBYTES), aligned(4)));

static inline q3_vf q3_vload(const float *p) { return *(const q3_vfu *)p; }
static inline void q3_vstore(float *p, q3_vf v) { *(q3_vfu *)p = v; }
static inline q3_vf q3_vsplat(float x) { return (q3_vf){0} + x; }

/* lanes of a where mask is set (all ones), else of b */
static inline q3_vf q3_vsel(q3_vi mask, q3_vf a, q3_vf b) {
    return (q3_vf)(((q3_vi)a & mask) | ((q3_vi)b & ~mask));
}
static inline q3_vf q3_vmax(q3_vf a, q3_vf b) { return q3_vsel(a > b, a, b); }

static inline q3_vf q3_vexp_v(q3_vf x) {
    const q3_vi zero = x < -87.3f;
    x = q3_vsel(zero, q3_vsplat(-87.3f), x);
    x = q3_vsel(x > 88.5f, q3_vsplat(88.5f), x);
    const q3_vf t = x * 1.44269504088896341f;
    const q3_vf n = (t + 12582912.0f) - 12582912.0f;
    const q3_vf f = t - n;
    q3_vf p = q3_vsplat(1.54035304e-4f);
    p = p * f + 1.33335581e-3f;
    p = p * f + 9.61812911e-3f;
    p = p * f + 5.55041087e-2f;
    p = p * f + 2.40226507e-1f;
    p = p * f + 6.93147181e-1f;
    p = p * f + 1.0f;
    const q3_vi bits = (__builtin_convertvector(n, q3_vi) + 127) << 23;
    const q3_vf r = p * (q3_vf)bits;
    return (q3_vf)((q3_vi)r & ~zero);
}

#endif
