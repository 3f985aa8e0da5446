/* A stand-in CUDA backend for tests on machines without a GPU: "device" memory is host
 * memory and each launcher runs its CPU twin (emulated_kernels.c). Installed, it
 * lets the whole CUDA path of the engine and the glue (device workspace, host staging, expert
 * grouping, cache and outputs on the device, uploads, decode graphs) run and be compared with
 * the CPU layer; only the .cu kernels themselves are left to qwen3layer.cuda.check_kernels
 * on a real GPU.
 *
 * Graph capture is emulated strictly: while a stream captures, launches are recorded, not
 * run, and what a real capture forbids (allocation, freeing, synchronous or host copies,
 * synchronisation) fails and invalidates the capture, so a decode pass that would need the
 * host cannot be captured here either. */
#include <stdlib.h>
#include <string.h>

#include "../engine/profile.h"
#include "emulated_device.h"

enum { ERR_MEMORY = 2, ERR_DEVICE = 101, ERR_CAPTURE_UNSUPPORTED = 900, ERR_CAPTURE_INVALIDATED = 901 };

typedef struct step {
    q3_emu_run_fn *run;
    struct step *next;
    size_t size;
    _Alignas(16) unsigned char args[];
} step;

typedef struct {
    step *first;
} graph;

static struct {
    int capturing;
    int broken;   /* a forbidden call happened during the capture */
    step *first, **last;
} tape;

static void free_steps(step *s) {
    while (s) {
        step *next = s->next;
        free(s);
        s = next;
    }
}

int q3_emu_submit(q3_emu_run_fn *run, const void *args, size_t size) {
    if (!tape.capturing) return run(args);
    step *s = malloc(sizeof *s + size);
    if (!s) {
        tape.broken = 1;
        return ERR_MEMORY;
    }
    s->run = run;
    s->next = NULL;
    s->size = size;
    memcpy(s->args, args, size);
    *tape.last = s;
    tape.last = &s->next;
    return 0;
}

/* what a capturing stream may not do */
static int forbidden(void) {
    if (!tape.capturing) return 0;
    tape.broken = 1;
    return ERR_CAPTURE_UNSUPPORTED;
}

static int count(int *n) { *n = 1; return 0; }
static int set_device(int d) { return d == 0 ? 0 : ERR_DEVICE; }
static int malloc_device(void **p, size_t bytes) {
    if (forbidden()) return ERR_CAPTURE_UNSUPPORTED;
    return (*p = q3_alloc(bytes)) ? 0 : ERR_MEMORY;
}
static int free_device(void *p) {
    if (forbidden()) return ERR_CAPTURE_UNSUPPORTED;
    q3_free(p);
    return 0;
}
static int copy(void *dst, const void *src, size_t bytes, int to_device) {
    (void)to_device;
    if (forbidden()) return ERR_CAPTURE_UNSUPPORTED;
    memcpy(dst, src, bytes);
    return 0;
}
/* copies from or to (pageable) host memory: not capturable */
static int copy_async(void *dst, const void *src, size_t bytes, int to_device, void *s) {
    (void)s;
    return copy(dst, src, bytes, to_device);
}
typedef struct { void *p; int v; size_t bytes; } memset_run_args;
static int memset_run(const void *a) {
    const memset_run_args *m = a;
    memset(m->p, m->v, m->bytes);
    return 0;
}
static int memset_async(void *p, int v, size_t bytes, void *s) {
    (void)s;
    const memset_run_args a = {p, v, bytes};
    return q3_emu_submit(memset_run, &a, sizeof a);
}
typedef struct { void *dst; const void *src; size_t bytes; } copy_run_args;
static int copy_run(const void *a) {
    const copy_run_args *c = a;
    memcpy(c->dst, c->src, c->bytes);
    return 0;
}
static int copy_device_async(void *dst, const void *src, size_t bytes, void *s) {
    (void)s;
    const copy_run_args a = {dst, src, bytes};
    return q3_emu_submit(copy_run, &a, sizeof a);
}
static int stream_sync(void *s) { (void)s; return forbidden(); }
static int sync_all(void) { return forbidden(); }
static const char *error_string(int code) {
    switch (code) {
    case 0: return "no error";
    case ERR_CAPTURE_UNSUPPORTED: return "operation not permitted when stream is capturing (emulated)";
    case ERR_CAPTURE_INVALIDATED: return "operation failed due to a previous error during capture (emulated)";
    default: return "emulated CUDA error";
    }
}
/* an event is the host clock at its record */
static int event_create(void **e) { return (*e = calloc(1, sizeof(double))) ? 0 : ERR_MEMORY; }
static int event_destroy(void *e) { free(e); return 0; }
static int event_record(void *e, void *s) {
    (void)s;
    if (forbidden()) return ERR_CAPTURE_UNSUPPORTED; /* legal in CUDA, but no pass records one */
    *(double *)e = q3_now();
    return 0;
}
static int event_elapsed_ms(float *ms, void *a, void *b) {
    *ms = (float)((*(double *)b - *(double *)a) * 1e3);
    return 0;
}
static int blas_open(const char *path) { (void)path; return 1; /* no cuBLAS here */ }
static int blas_enable(int on) { (void)on; return 0; }
static int time_copy(size_t bytes, int repeats, float *ms) { (void)bytes; (void)repeats; *ms = 0.0f; return 0; }
static int time_matmul(int64_t T, int64_t N, int64_t K, q3_dtype dt, int repeats, float *ms) {
    (void)T; (void)N; (void)K; (void)dt; (void)repeats;
    *ms = 0.0f;
    return 0;
}

/* ---- streams and graphs ---- */
static int stream_create(void **s) { return (*s = malloc(1)) ? 0 : ERR_MEMORY; }
static int stream_destroy(void *s) { free(s); return 0; }
static int capture_begin(void *s) {
    if (!s || tape.capturing) return ERR_CAPTURE_UNSUPPORTED; /* never the default stream */
    tape.capturing = 1;
    tape.broken = 0;
    tape.first = NULL;
    tape.last = &tape.first;
    return 0;
}
static int capture_end(void *s, void **out) {
    (void)s;
    *out = NULL;
    tape.capturing = 0;
    graph *g = tape.broken ? NULL : malloc(sizeof *g);
    if (!g) {
        free_steps(tape.first);
        return tape.broken ? ERR_CAPTURE_INVALIDATED : ERR_MEMORY;
    }
    g->first = tape.first;
    *out = g;
    return 0;
}
static int graph_launch(void *p, void *s) {
    (void)s;
    if (forbidden()) return ERR_CAPTURE_UNSUPPORTED;
    for (const step *st = ((const graph *)p)->first; st; st = st->next) {
        const int code = st->run(st->args);
        if (code) return code;
    }
    return 0;
}
static int graph_destroy(void *p) {
    free_steps(((graph *)p)->first);
    free(p);
    return 0;
}

q3_status q3_cuda_emulate(q3_error *err) {
    q3_cuda_ops table = {
        .device_count = count, .set_device = set_device, .malloc_device = malloc_device,
        .free_device = free_device, .copy = copy, .copy_async = copy_async, .memset_async = memset_async,
        .copy_device_async = copy_device_async,
        .stream_synchronize = stream_sync, .synchronize = sync_all, .error_string = error_string,
        .event_create = event_create, .event_destroy = event_destroy, .event_record = event_record,
        .event_elapsed_ms = event_elapsed_ms, .blas_open = blas_open, .blas_enable = blas_enable,
        .time_copy = time_copy, .time_matmul = time_matmul, .stream_create = stream_create,
        .stream_destroy = stream_destroy, .capture_begin = capture_begin, .capture_end = capture_end,
        .graph_launch = graph_launch, .graph_destroy = graph_destroy,
    };
    q3_emu_kernels(&table);
    return q3_cuda_install(&table, err);
}
