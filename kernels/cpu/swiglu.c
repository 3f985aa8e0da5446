/* SiLU(gate) * up, elementwise, in the variant's vector width (the exp of vec.h). */
#include "ops.h"
#include "team.h"
#include "vec.h"

static inline q3_vf swiglu_v(q3_vf g, q3_vf u) { return g / (1.0f + q3_vexp_v(-g)) * u; }

void Q3_CPU_FN(q3_swiglu)(float *act, const float *gate, const float *up, int64_t n) {
    const int64_t full = n / Q3_LANES * Q3_LANES;
    if (!q3_team(n > (1 << 16), 0)) { /* inline (team.h) */
        for (int64_t i = 0; i < full; i += Q3_LANES)
            q3_vstore(act + i, swiglu_v(q3_vload(gate + i), q3_vload(up + i)));
    } else {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < full; i += Q3_LANES)
            q3_vstore(act + i, swiglu_v(q3_vload(gate + i), q3_vload(up + i)));
    }
    if (full < n) {
        float g[Q3_LANES] = {0}, u[Q3_LANES] = {0}, a[Q3_LANES];
        memcpy(g, gate + full, (size_t)(n - full) * sizeof(float));
        memcpy(u, up + full, (size_t)(n - full) * sizeof(float));
        q3_vstore(a, swiglu_v(q3_vload(g), q3_vload(u)));
        memcpy(act + full, a, (size_t)(n - full) * sizeof(float));
    }
}
