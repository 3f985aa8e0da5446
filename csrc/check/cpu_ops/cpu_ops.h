/* The CPU op harness, in the manner of ggml's test-backend-ops: every op of the CPU kernel
 * table (kernels/cpu/ops.h) on every CPU path this machine runs, each against the portable
 * path on the same random inputs, at odd sizes. A standalone program (main.c; built from the
 * engine's path selection and the kernels by benchmarks/cpu_ops_check.py), linked into no
 * Python module: it needs no Python, so it also runs under emulation on another architecture.
 *
 * A case runs the op on both tables and reduces the difference to one error, which passes at
 * err <= tol; the tolerance of each op says what the paths may round differently (the same
 * bounds tests/ops/ and tests/fp8/ hold each path to against float64, twice: both sides may
 * be off by one bound). A planted defect (--plant OP:PATH) moves one element of that op's
 * result on that path by three tolerances before the comparison, so a run shows the
 * comparison failing where it must. */
#ifndef Q3_CHECK_CPU_OPS_H
#define Q3_CHECK_CPU_OPS_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../../kernels/cpu/ops.h"

/* one op on one path: the cases it compared, how many failed, the worst err / tol */
typedef struct {
    const q3_cpu_ops *ref;  /* the portable path */
    const q3_cpu_ops *path; /* the path under test */
    int threads;            /* for the ops that take a thread count (and their scratch) */
    int plant;              /* move one element of each result of the path (a planted defect) */
    void *mem[48];          /* this case's buffers, freed by ops_release */
    int n_mem;
    int oom;
    int cases, failed;
    double worst; /* max err / tol over the cases (0 for an exact match) */
    char first_failure[160];
} ops_run;

/* n zeroed bytes, freed with the case; NULL (and r->oom) when out of memory or buffers */
void *ops_alloc(ops_run *r, size_t bytes);
/* n normal draws of dtype dt (stream `seed`), scaled by std, as the portable table fills them */
void *ops_random(ops_run *r, int64_t n, q3_dtype dt, uint64_t seed, float std);
void ops_release(ops_run *r);

/* got [n] fp32 (the path's, planted) against want [n]: max |got - want| / max |want|, a NaN
 * where the other has none failing */
void ops_check_f32(ops_run *r, const char *label, float *got, const float *want, int64_t n, double tol);
/* the same for bf16 or fp16 results (dt): max |got - want| / max |want| of the values */
void ops_check_half(ops_run *r, const char *label, q3_dtype dt, uint16_t *got, const uint16_t *want, int64_t n,
                    double tol);
/* the float storage dtypes a case runs over (OPS_FLOATS[i % 3]), and each one's short name */
static const q3_dtype OPS_FLOATS[3] = {Q3_F32, Q3_BF16, Q3_F16};
static inline const char *ops_dt(q3_dtype dt) { return dt == Q3_BF16 ? "bf16" : dt == Q3_F16 ? "f16" : "f32"; }
/* a sum's error against the magnitude of its terms: max_i |got_i - want_i| / bound_i */
void ops_check_bound(ops_run *r, const char *label, float *got, const float *want, const double *bound,
                     int64_t n, double tol);
/* the matmuls' references where a path may round (cases_matmul.c): x rounded to bf16, as fp32;
 * bound [T, N] = |x| |W|^T + |y0| (accumulate) + extra, the magnitude of each sum's terms; and
 * the candidate reference closest to got (the operands the path multiplies) */
float *ops_rounded(ops_run *r, const float *x, int64_t n);
double *ops_term_bound(ops_run *r, const float *x, const float *w, int64_t T, int64_t N, int64_t K, const float *y0,
                       double extra);
const float *ops_closest(const float *got, const float *const *want, int n_want, const double *bound, int64_t n);
/* bytes equal, bit for bit (indices, copies, conversions, checksums) */
void ops_check_bits(ops_run *r, const char *label, void *got, const void *want, size_t bytes);

/* the ops' cases, one function an op (cases_*.c) */
typedef void ops_op(ops_run *r);
ops_op ops_matmul, ops_matmul_fp8, ops_e4m3_decode;                   /* cases_matmul.c */
ops_op ops_matmul_int4, ops_int4_digits;                              /* cases_int4.c */
ops_op ops_attention, ops_attention_probs, ops_kv_write, ops_rope;    /* cases_attention.c */
ops_op ops_router_topk, ops_moe_group, ops_gather_rows, ops_scatter_add_rows, ops_take_rows,
    ops_add_rows;                                                     /* cases_rows.c */
ops_op ops_rmsnorm, ops_swiglu, ops_to_f32, ops_from_f32, ops_fill_normal, ops_probe_read,
    ops_probe_fma;                                                    /* cases_elementwise.c */

#endif
