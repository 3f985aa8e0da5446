/* A stand-in CUDA backend for tests on machines without a GPU: "device" memory is host
 * memory and each launcher runs its CPU twin. Installed, it lets the whole CUDA path of the
 * engine and the glue (device workspace, host staging, expert grouping, cache and outputs on
 * the device, uploads) run and be compared with the CPU layer; only the .cu kernels
 * themselves are left to qwen3layer.cuda.check_kernels on a real GPU. */
#include <stdlib.h>
#include <string.h>

#include "cpu_dispatch.h"
#include "cuda_backend.h"
#include "profile.h"

static const q3_cpu_ops *cpu(void) { return q3_cpu_ops_active(); }

static int count(int *n) { *n = 1; return 0; }
static int set_device(int d) { return d == 0 ? 0 : 101; /* cudaErrorInvalidDevice */ }
static int malloc_device(void **p, size_t bytes) { return (*p = q3_alloc(bytes)) ? 0 : 2; }
static int free_device(void *p) { q3_free(p); return 0; }
static int copy(void *dst, const void *src, size_t bytes, int to_device) {
    (void)to_device;
    memcpy(dst, src, bytes);
    return 0;
}
static int copy_async(void *dst, const void *src, size_t bytes, int to_device, void *s) {
    (void)s;
    return copy(dst, src, bytes, to_device);
}
static int memset_async(void *p, int v, size_t bytes, void *s) {
    (void)s;
    memset(p, v, bytes);
    return 0;
}
static int stream_sync(void *s) { (void)s; return 0; }
static int sync_all(void) { return 0; }
static const char *error_string(int code) { return code ? "emulated CUDA error" : "no error"; }
/* an event is the host clock at its record */
static int event_create(void **e) { return (*e = calloc(1, sizeof(double))) ? 0 : 2; }
static int event_destroy(void *e) { free(e); return 0; }
static int event_record(void *e, void *s) {
    (void)s;
    *(double *)e = q3_now();
    return 0;
}
static int blas_open(const char *path) { (void)path; return 1; /* no cuBLAS here */ }
static int blas_enable(int on) { (void)on; return 0; }
static int event_elapsed_ms(float *ms, void *a, void *b) {
    *ms = (float)((*(double *)b - *(double *)a) * 1e3);
    return 0;
}
static int time_copy(size_t bytes, int repeats, float *ms) { (void)bytes; (void)repeats; *ms = 0.0f; return 0; }
static int time_matmul(int64_t T, int64_t N, int64_t K, q3_dtype dt, int repeats, float *ms) {
    (void)T; (void)N; (void)K; (void)dt; (void)repeats;
    *ms = 0.0f;
    return 0;
}

static int rmsnorm(float *o, const float *x, const void *w, q3_dtype dt, int64_t r, int64_t n, float eps, void *s) {
    (void)s;
    cpu()->rmsnorm(o, x, w, dt, r, n, eps);
    return 0;
}
static int matmul(float *y, const float *x, const void *w, q3_dtype dt, int64_t T, int64_t N, int64_t K, int acc,
                  void *s) {
    (void)s;
    cpu()->matmul(y, x, w, dt, T, N, K, acc, NULL);
    return 0;
}
static int gate_up(float *act, const float *x, const void *g, const void *u, q3_dtype dt, int64_t T, int64_t I,
                   int64_t K, void *s) {
    (void)s;
    float *up = malloc((size_t)(T * I) * sizeof(float));
    if (!up) return 2;
    cpu()->matmul(act, x, g, dt, T, I, K, 0, NULL);
    cpu()->matmul(up, x, u, dt, T, I, K, 0, NULL);
    cpu()->swiglu(act, act, up, T * I);
    free(up);
    return 0;
}
static int matmul_tc(float *y, const float *x, const void *w, int64_t T, int64_t N, int64_t K, int acc, uint16_t *xb,
                     void *s) {
    (void)s;
    (void)xb;
    float *xr = malloc((size_t)(T * K) * sizeof(float));
    if (!xr) return 2;
    for (int64_t i = 0; i < T * K; i++) xr[i] = q3_bf16_to_f32(q3_f32_to_bf16(x[i])); /* as the tensor cores see x */
    cpu()->matmul(y, xr, w, Q3_BF16, T, N, K, acc, NULL);
    free(xr);
    return 0;
}
static int rope(float *x, const int64_t *pos, int64_t rows, int heads, int D, float theta, void *s) {
    (void)s;
    cpu()->rope(x, pos, rows, heads, D, theta);
    return 0;
}
static int kv_write(void *c, q3_dtype dt, const float *src, int64_t stride, int64_t L, int kvh, int D, int64_t cap,
                    int64_t start, void *s) {
    (void)s;
    cpu()->kv_write(c, dt, src, stride, L, kvh, D, cap, start);
    return 0;
}
static int qk_rope_kv(float *q, float *k, const float *v, const void *qn, const void *kn, q3_dtype dt,
                      const int64_t *pos, const q3_attn_seq *seqs, int n, const q3_attn_shape *sh, float eps,
                      float theta, void *s) {
    (void)s;
    q3_qk_rope_kv_host(q, k, v, qn, kn, dt, pos, seqs, n, sh, eps, theta);
    return 0;
}
static int attention(float *out, const float *q, const q3_attn_seq *seqs, int n, const q3_attn_shape *sh,
                     float *partial, void *s) {
    (void)s;
    (void)partial;
    float *scratch = malloc((size_t)q3_attention_scratch_floats(sh) * sizeof(float));
    if (!scratch) return 2;
    cpu()->attention(out, q, seqs, n, sh, scratch, 1);
    free(scratch);
    return 0;
}
static int router(int32_t *idx, float *w, const float *lg, int64_t T, int E, int k, int norm, void *s) {
    (void)s;
    cpu()->router_topk(idx, w, lg, T, E, k, norm);
    return 0;
}
static int swiglu(float *a, const float *g, const float *u, int64_t n, void *s) {
    (void)s;
    cpu()->swiglu(a, g, u, n);
    return 0;
}
static int gather(float *d, const float *src, const int32_t *rows, int64_t n, int64_t H, void *s) {
    (void)s;
    cpu()->gather_rows(d, src, rows, n, H);
    return 0;
}
static int scatter(float *d, const float *src, const int32_t *rows, const float *sc, int64_t n, int64_t H, void *s) {
    (void)s;
    cpu()->scatter_add_rows(d, src, rows, sc, n, H);
    return 0;
}
static int to_f32(float *d, const void *src, q3_dtype dt, int64_t n, void *s) {
    (void)s;
    cpu()->to_f32(d, src, dt, n);
    return 0;
}
static int from_f32(void *d, q3_dtype dt, const float *src, int64_t n, void *s) {
    (void)s;
    cpu()->from_f32(d, dt, src, n);
    return 0;
}

q3_status q3_cuda_emulate(q3_error *err) {
    static const q3_cuda_ops table = {
        .device_count = count, .set_device = set_device, .malloc_device = malloc_device,
        .free_device = free_device, .copy = copy, .copy_async = copy_async, .memset_async = memset_async,
        .stream_synchronize = stream_sync, .synchronize = sync_all, .error_string = error_string,
        .event_create = event_create, .event_destroy = event_destroy, .event_record = event_record,
        .event_elapsed_ms = event_elapsed_ms, .blas_open = blas_open, .blas_enable = blas_enable,
        .time_copy = time_copy, .time_matmul = time_matmul, .rmsnorm = rmsnorm, .matmul = matmul, .matmul_tc = matmul_tc, .gate_up = gate_up,
        .rope = rope, .kv_write = kv_write, .qk_rope_kv = qk_rope_kv, .attention = attention, .router_topk = router,
        .swiglu = swiglu, .gather_rows = gather, .scatter_add_rows = scatter, .to_f32 = to_f32,
        .from_f32 = from_f32,
    };
    return q3_cuda_install(&table, err);
}
