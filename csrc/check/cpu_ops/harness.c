/* The harness's buffers and comparisons (cpu_ops.h): each check reduces a case to err / tol,
 * counts it, and keeps the first failure's label. With r->plant, each check first moves one
 * element of the path's result past the tolerance: the planted defect a run must catch. */
#include "cpu_ops.h"

void *ops_alloc(ops_run *r, size_t bytes) {
    void *p = NULL;
    if (!r->oom && r->n_mem < (int)(sizeof r->mem / sizeof r->mem[0])) p = calloc(1, bytes ? bytes : 1);
    if (!p) {
        r->oom = 1;
        return NULL;
    }
    r->mem[r->n_mem++] = p;
    return p;
}

void *ops_random(ops_run *r, int64_t n, q3_dtype dt, uint64_t seed, float std) {
    void *p = ops_alloc(r, (size_t)n * q3_dtype_size(dt));
    if (p) r->ref->fill_normal(p, dt, n, 1234, seed, 0, 0.0f, std);
    return p;
}

void ops_release(ops_run *r) {
    for (int i = 0; i < r->n_mem; i++) free(r->mem[i]);
    r->n_mem = 0;
}

static void record(ops_run *r, const char *label, double err, double tol) {
    if (isnan(err)) err = INFINITY;
    const double ratio = tol > 0 ? err / tol : (err > 0 ? INFINITY : 0.0);
    r->cases++;
    r->worst = ratio > r->worst ? ratio : r->worst;
    if ((err <= tol && !r->oom) || r->failed++) return;
    if (r->oom) snprintf(r->first_failure, sizeof r->first_failure, "%s: out of memory", label);
    else snprintf(r->first_failure, sizeof r->first_failure, "%s: err %.3g > tol %.3g", label, err, tol);
}

/* an element of want [n] that is finite, near the middle (where to plant the defect) */
static int64_t finite_at(const float *want, int64_t n) {
    for (int64_t i = n / 2; i < n; i++)
        if (isfinite(want[i])) return i;
    for (int64_t i = 0; i < n / 2; i++)
        if (isfinite(want[i])) return i;
    return -1;
}

static double scale_of(const float *want, int64_t n) {
    double scale = 0.0;
    for (int64_t i = 0; i < n; i++)
        if (isfinite(want[i]) && fabs(want[i]) > scale) scale = fabs(want[i]);
    return scale > 0.0 ? scale : 1.0;
}

void ops_check_f32(ops_run *r, const char *label, float *got, const float *want, int64_t n, double tol) {
    if (r->oom) return record(r, label, INFINITY, tol);
    const double scale = scale_of(want, n);
    const int64_t at = finite_at(want, n);
    if (r->plant && at >= 0) got[at] = (float)(want[at] + (3.0 * tol + 1e-6) * scale);
    double worst = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(got[i]) != isnan(want[i])) worst = INFINITY;
        else if (!isnan(want[i]) && got[i] != want[i]) { /* equal infinities match */
            const double d = fabs((double)got[i] - want[i]) / scale;
            worst = d > worst ? d : worst;
        }
    }
    record(r, label, worst, tol);
}

void ops_check_half(ops_run *r, const char *label, q3_dtype dt, uint16_t *got, const uint16_t *want, int64_t n,
                    double tol) {
    float *g = ops_alloc(r, (size_t)n * 4), *w = ops_alloc(r, (size_t)n * 4);
    if (!g || !w) return record(r, label, INFINITY, tol);
    for (int64_t i = 0; i < n; i++) w[i] = q3_float_at(want, dt, i);
    const int64_t at = finite_at(w, n);
    if (r->plant && at >= 0) q3_float_put(got, dt, at, (float)(w[at] + (3.0 * tol + 1e-2) * scale_of(w, n)));
    for (int64_t i = 0; i < n; i++) g[i] = q3_float_at(got, dt, i);
    const int plant = r->plant;
    r->plant = 0; /* planted above, in the 16-bit values */
    ops_check_f32(r, label, g, w, n, tol);
    r->plant = plant;
}

void ops_check_bound(ops_run *r, const char *label, float *got, const float *want, const double *bound,
                     int64_t n, double tol) {
    if (r->oom) return record(r, label, INFINITY, tol);
    const int64_t at = finite_at(want, n);
    if (r->plant && at >= 0) got[at] = (float)(want[at] + (3.0 * tol + 1e-6) * bound[at]);
    double worst = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(got[i]) != isnan(want[i])) worst = INFINITY;
        else if (!isnan(want[i])) {
            const double d = fabs((double)got[i] - want[i]) / bound[i];
            worst = d > worst ? d : worst;
        }
    }
    record(r, label, worst, tol);
}

void ops_check_bits(ops_run *r, const char *label, void *got, const void *want, size_t bytes) {
    if (r->oom) return record(r, label, INFINITY, 0.0);
    if (r->plant && bytes) ((unsigned char *)got)[bytes / 2] ^= 1u;
    record(r, label, memcmp(got, want, bytes) ? INFINITY : 0.0, 0.0);
}
