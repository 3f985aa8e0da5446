/* The expert activation: act = silu(gate) * up, silu(z) = z * sigmoid(z). */
#ifndef Q3_KERNELS_SWIGLU_H
#define Q3_KERNELS_SWIGLU_H

#include "dtype.h"

/* act [n] fp32 (may alias gate or up) <- gate [n], up [n] fp32 */
typedef void q3_swiglu_fn(float *act, const float *gate, const float *up, int64_t n);

#endif
