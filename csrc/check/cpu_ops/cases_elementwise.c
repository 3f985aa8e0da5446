/* The elementwise and row-wise ops' cases (cpu_ops.h): RMSNorm (the layer norms and QK-norm,
 * in place too), the SwiGLU activation (gates far into exp's tails), the fp32 <-> bf16
 * conversions (NaN, infinities, zeros, subnormals, rounding ties: bit for bit), the random
 * fill (a pure function of seed, stream and index) and the machine probes (the read's checksum
 * bit for bit; the multiply-add chains' value, which a fused multiply-add rounds once and the
 * portable path twice: adding 1e-7 to values above 1 (below half their ulp) the two part by up
 * to an ulp a round, 2^-23 of the value, so their tolerance is rounds x 2^-23). The probes'
 * other result, the multiply-adds done, counts the path's own lanes and is not compared. */
#include "cpu_ops.h"

void ops_rmsnorm(ops_run *r) {
    static const struct {
        int64_t rows, n;
        q3_dtype wdt;
        int in_place;
    } forms[] = {{7, 72, Q3_F32, 0}, {7, 72, Q3_BF16, 1}, {3, 4099, Q3_BF16, 0}, {40, 20, Q3_F32, 1}, {1, 1, Q3_F32, 0},
                 {17, 129, Q3_BF16, 0}, {5, 136, Q3_F16, 0}, {9, 72, Q3_F16, 1}, {2, 4099, Q3_F16, 0}};
    for (int i = 0; i < (int)(sizeof forms / sizeof forms[0]); i++) {
        const int64_t n = forms[i].rows * forms[i].n;
        float *x = ops_random(r, n, Q3_F32, 1100 + i, 3.0f), *got = ops_alloc(r, (size_t)n * 4),
              *want = ops_alloc(r, (size_t)n * 4);
        const void *w = ops_random(r, forms[i].n, forms[i].wdt, 1110 + i, 1.0f);
        if (r->oom) return ops_check_f32(r, "rmsnorm", NULL, NULL, 0, 0);
        r->ref->rmsnorm(want, x, w, forms[i].wdt, forms[i].rows, forms[i].n, 1e-6f);
        if (forms[i].in_place) {
            memcpy(got, x, (size_t)n * 4);
            r->path->rmsnorm(got, got, w, forms[i].wdt, forms[i].rows, forms[i].n, 1e-6f);
        } else
            r->path->rmsnorm(got, x, w, forms[i].wdt, forms[i].rows, forms[i].n, 1e-6f);
        char label[64];
        snprintf(label, sizeof label, "%lld rows of %lld, %s weight%s", (long long)forms[i].rows, (long long)forms[i].n,
                 ops_dt(forms[i].wdt), forms[i].in_place ? ", in place" : "");
        ops_check_f32(r, label, got, want, n, 2e-6);
        ops_release(r);
    }
}

void ops_swiglu(ops_run *r) {
    static const float tails[] = {-100.0f, -88.5f, -30.0f, -1e-30f, 0.0f, 1e-30f, 30.0f, 88.5f, 100.0f};
    for (int i = 0; i < 4; i++) {
        const int64_t n = (int64_t[]){1003, 1, 16, 4099}[i];
        float *gate = ops_random(r, n, Q3_F32, 1200 + i, 8.0f), *up = ops_random(r, n, Q3_F32, 1210 + i, 1.0f);
        float *got = ops_alloc(r, (size_t)n * 4), *want = ops_alloc(r, (size_t)n * 4);
        if (r->oom) return ops_check_f32(r, "swiglu", NULL, NULL, 0, 0);
        for (int j = 0; j < 9 && j < n; j++) gate[j * (n / 9 + 1) % n] = tails[j];
        r->ref->swiglu(want, gate, up, n);
        memcpy(got, gate, (size_t)n * 4); /* the path in place, over its gate */
        r->path->swiglu(got, got, up, n);
        char label[32];
        snprintf(label, sizeof label, "n=%lld, in place", (long long)n);
        ops_check_f32(r, label, got, want, n, 1e-6);
        ops_release(r);
    }
}

/* fp32 values that every conversion must get right: NaNs of both signs (one with a payload),
 * infinities, zeros, the largest finite, a subnormal, and ties of the bf16 rounding, the
 * rest random over many binades */
static float *specials(ops_run *r, int64_t n, uint64_t seed) {
    static const uint32_t bits[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7f800000u, 0xff800000u, 0x00000000u,
                                    0x80000000u, 0x7f7fffffu, 0x00000001u, 0x807fffffu, 0x3f808000u, 0x3f818000u,
                                    0xbf808000u, 0x3f80c000u, 0x7f7f8000u, 0x3f807fffu,
                                    /* fp16's: ties at 1 + 2^-11 and 1 + 3 2^-11, 65520 (-> inf) and just
                                     * below, 2^-25 (a tie with 0) and just above, a subnormal's tie */
                                    0x3f801000u, 0x3f803000u, 0x477ff000u, 0x477fefffu, 0x33000000u, 0x33000001u,
                                    0x34400000u};
    float *x = ops_random(r, n, Q3_F32, seed, 1.0f);
    for (int64_t i = 0; x && i < n; i++) x[i] *= ldexpf(1.0f, (int)(q3_mix64(seed + i) % 60) - 30);
    for (int i = 0; x && i < (int)(sizeof bits / sizeof bits[0]) && i < n; i++) memcpy(&x[i * 7 % n], &bits[i], 4);
    return x;
}

static const int64_t OPS_CONVERT_N[3] = {131, 4099, 69635};

void ops_from_f32(ops_run *r) {
    for (int i = 0; i < 9; i++) { /* n: tails of the vectors, and a call threaded in chunks with a tail */
        const q3_dtype dt = OPS_FLOATS[i % 3];
        const int64_t n = OPS_CONVERT_N[i / 3];
        const size_t bytes = (size_t)n * q3_dtype_size(dt);
        const float *src = specials(r, n, 1300 + i);
        void *got = ops_alloc(r, bytes), *want = ops_alloc(r, bytes);
        if (r->oom) return ops_check_bits(r, "from_f32", NULL, NULL, 0);
        for (int64_t k = 0; k < n; k++) q3_float_put(want, dt, k, src[k]); /* element by element, unthreaded */
        r->path->from_f32(got, dt, src, n);
        char label[32];
        snprintf(label, sizeof label, "to %s, n=%lld", ops_dt(dt), (long long)n);
        ops_check_bits(r, label, got, want, bytes);
        ops_release(r);
    }
}

void ops_to_f32(ops_run *r) {
    for (int i = 0; i < 9; i++) { /* n: tails of the vectors, and a call threaded in chunks with a tail */
        const q3_dtype dt = OPS_FLOATS[i % 3];
        const int64_t n = OPS_CONVERT_N[i / 3];
        const float *x = specials(r, n, 1400 + i);
        void *src = ops_alloc(r, (size_t)n * q3_dtype_size(dt));
        float *got = ops_alloc(r, (size_t)n * 4), *want = ops_alloc(r, (size_t)n * 4);
        if (r->oom) return ops_check_bits(r, "to_f32", NULL, NULL, 0);
        r->ref->from_f32(src, dt, x, n);
        for (int64_t k = 0; k < n; k++) want[k] = q3_float_at(src, dt, k);
        r->path->to_f32(got, src, dt, n);
        char label[32];
        snprintf(label, sizeof label, "from %s, n=%lld", ops_dt(dt), (long long)n);
        ops_check_bits(r, label, got, want, (size_t)n * 4);
        ops_release(r);
    }
}

void ops_fill_normal(ops_run *r) {
    for (int i = 0; i < 6; i++) {
        const q3_dtype dt = OPS_FLOATS[i % 3];
        const int64_t n = i / 3 ? 1003 : 64;
        const uint64_t first = i / 3 ? 12345 : 0;
        const float mean = i / 3 ? 0.5f : 0.0f, std = i / 3 ? 0.02f : 1.0f;
        void *got = ops_alloc(r, (size_t)n * 4), *want = ops_alloc(r, (size_t)n * 4);
        if (r->oom) return ops_check_f32(r, "fill_normal", NULL, NULL, 0, 0);
        r->ref->fill_normal(want, dt, n, 77, 5 + i, first, mean, std);
        r->path->fill_normal(got, dt, n, 77, 5 + i, first, mean, std);
        char label[64];
        snprintf(label, sizeof label, "%s, %lld from %llu, mean %.1f std %.2f", ops_dt(dt),
                 (long long)n, (unsigned long long)first, mean, std);
        if (dt != Q3_F32) ops_check_half(r, label, dt, got, want, n, 1e-6);
        else ops_check_f32(r, label, got, want, n, 1e-6);
        ops_release(r);
    }
}

void ops_probe_read(ops_run *r) {
    for (int i = 0; i < 2; i++) {
        const size_t bytes = i ? (size_t)1 << 20 : 4096;
        unsigned char *raw = ops_random(r, (int64_t)(bytes + 64) / 4, Q3_F32, 1500 + i, 1.0f);
        if (r->oom) return ops_check_bits(r, "probe_read", NULL, NULL, 0);
        const void *buf = raw + (64 - (uintptr_t)raw % 64) % 64; /* 64-byte aligned, as probe.h asks */
        uint64_t want = r->ref->probe_read(buf, bytes), got = r->path->probe_read(buf, bytes);
        char label[32];
        snprintf(label, sizeof label, "checksum of %zu bytes", bytes);
        ops_check_bits(r, label, &got, &want, sizeof got);
        ops_release(r);
    }
}

void ops_probe_fma(ops_run *r) {
    for (int i = 0; i < 2; i++) {
        const int64_t iters = i ? 5000 : 1;
        float want = 0.0f, got = 0.0f;
        r->ref->probe_fma(iters, &want);
        r->path->probe_fma(iters, &got);
        char label[48];
        snprintf(label, sizeof label, "the chains' value after %lld rounds", (long long)iters);
        ops_check_f32(r, label, &got, &want, 1, (double)(iters + 1) * 0x1p-23);
    }
}
