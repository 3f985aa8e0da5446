/* SiLU(gate) * up, elementwise. */
#include <math.h>

#include "../swiglu.h"

void q3_swiglu_cpu(float *act, const float *gate, const float *up, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        act[i] = g / (1.0f + expf(-g)) * up[i];
    }
}
