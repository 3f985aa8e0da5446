/* The registry of the e4m3 decoder variants (e4m3_decoders.h) and their entries in
 * q3_check.h: a variant found by name (or a message naming those this CPU runs), the decoding
 * of given codes, and the GEMV and dequantization a benchmark times (in Python). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "e4m3_decoders.h"
#include "q3_check.h"

typedef const q3_e4m3_variant *variants_fn(int *n);
static variants_fn *const files[] = {q3_e4m3_variants_avx2, q3_e4m3_variants_avx512, q3_e4m3_variants_vbmi};

/* the variant of index id over all files (every one compiled, runnable here or not), or NULL */
static const q3_e4m3_variant *variant_at(int id) {
    for (size_t f = 0; f < sizeof files / sizeof files[0]; f++) {
        int n;
        const q3_e4m3_variant *v = files[f](&n);
        if (id < n) return &v[id];
        id -= n;
    }
    return NULL;
}

int q3_check_e4m3_variants(q3_e4m3_variant_info *out, int max, int all) {
    int n = 0;
    for (int id = 0; variant_at(id); id++) {
        const q3_e4m3_variant *v = variant_at(id);
        const int runs = v->supported();
        if (!runs && !all) continue;
        if (n < max) out[n] = (q3_e4m3_variant_info){v->name, v->isa, v->what, v->shipped, v->width, runs};
        n++;
    }
    return n;
}

/* "'a', 'b', ..." of the variants this CPU runs */
static void runnable_names(char *buf, size_t size) {
    size_t used = 0;
    buf[0] = '\0';
    for (int id = 0; variant_at(id) && used < size; id++) {
        const q3_e4m3_variant *v = variant_at(id);
        if (v->supported())
            used += (size_t)snprintf(buf + used, size - used, "%s'%s'", used ? ", " : "", v->name);
    }
    if (!buf[0]) snprintf(buf, size, "none");
}

static q3_status find(const char *name, const q3_e4m3_variant **out, q3_error *err) {
    char names[256];
    for (int id = 0; variant_at(id); id++) {
        const q3_e4m3_variant *v = variant_at(id);
        if (strcmp(v->name, name)) continue;
        if (v->supported()) {
            *out = v;
            return Q3_OK;
        }
        runnable_names(names, sizeof names);
        return q3_fail(err, Q3_ERR_VALUE, "variant: '%s' needs %s, which this CPU lacks; expected one of %s", name,
                       v->isa, names);
    }
    runnable_names(names, sizeof names);
    return q3_fail(err, Q3_ERR_VALUE, "variant: expected one of %s (those this CPU runs), got '%s'", names, name);
}

q3_status q3_check_e4m3_decode(const char *variant, int fast, float *dst, const uint8_t *src, int64_t n,
                               q3_error *err) {
    const q3_e4m3_variant *v;
    const q3_status st = find(variant, &v, err);
    if (st != Q3_OK) return st;
    v->decode(dst, src, n, fast);
    return Q3_OK;
}

q3_status q3_check_e4m3_gemv(const char *variant, float *y, const float *x, const uint8_t *w, const float *scale,
                             int64_t N, int64_t K, int threads, int repeats, q3_error *err) {
    const q3_e4m3_variant *v;
    const q3_status st = find(variant, &v, err);
    if (st != Q3_OK) return st;
    float *xp = malloc((size_t)(K ? K : 1) * sizeof(float));
    if (!xp) return q3_fail(err, Q3_ERR_NOMEM, "e4m3_gemv: out of memory for x in the decoder's order (%lld floats)",
                            (long long)K);
    const q3_e4m3_job job = {y, x, xp, w, scale, N, K, N, threads};
    for (int r = 0; r < repeats; r++) {
        /* x in the decoder's lane order, once a call as a kernel would (its columns past the last
           full chunk are read from x itself) */
        int64_t k = 0;
        for (; v->perm && k + v->width <= K; k += v->width)
            for (int j = 0; j < v->width; j++) xp[k + j] = x[k + v->perm[j]];
        memcpy(xp + k, x + k, (size_t)(K - k) * sizeof(float));
        v->gemv(&job);
    }
    free(xp);
    return Q3_OK;
}

q3_status q3_check_e4m3_dequant(const char *variant, float *dst, const uint8_t *w, const float *scale, int64_t N,
                                int64_t K, int64_t rows, int threads, int repeats, q3_error *err) {
    const q3_e4m3_variant *v;
    const q3_status st = find(variant, &v, err);
    if (st != Q3_OK) return st;
    const q3_e4m3_job job = {dst, NULL, NULL, w, scale, N, K, rows, threads};
    for (int r = 0; r < repeats; r++) v->dequant(&job);
    return Q3_OK;
}
