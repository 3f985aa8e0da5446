/* The CPU kernel table in use (kernels/cpu/ops.h), chosen once at import (q3_cpu_select). */
#ifndef Q3_ENGINE_CPU_DISPATCH_H
#define Q3_ENGINE_CPU_DISPATCH_H

#include "../../kernels/cpu/ops.h"
#include "q3.h"

const q3_cpu_ops *q3_cpu_ops_active(void);

#endif
