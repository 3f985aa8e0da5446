/* cpu_ops_check: the CPU op harness's program (cpu_ops.h). For each CPU path the engine knows
 * (csrc/engine/cpu_dispatch.c), lowest first: "not supported on this CPU" where this build or
 * CPU cannot run it, "the reference" for portable, and otherwise a line an op: the cases it
 * compared against portable, the worst err / tol, OK or FAIL with the first failing case.
 * Exit status 0 only when something was compared and nothing failed: a machine whose only
 * path is portable has compared nothing (portable against itself proves nothing) and fails.
 *
 *     cpu_ops_check [--hide avx512,amx] [--plant OP:PATH[,OP:PATH...]]
 *
 * --hide: paths to treat as absent (as QWEN3LAYER_CPU_HIDE); --plant: a defect in these ops
 * (* for all) of these paths (cpu_ops.h), which must then be the run's failures. */
#include "../../engine/cpu_dispatch.h"
#include "cpu_ops.h"
#if defined(__aarch64__) && defined(__linux__)
#include <sys/prctl.h>
#define Q3_PR_SVE_GET_VL 51 /* linux/prctl.h: the SVE vector length in bytes (low 16 bits), < 0 without SVE */
#endif

static const struct {
    const char *name;
    ops_op *run;
} OPS[] = {
    {"matmul", ops_matmul},
    {"matmul_fp8", ops_matmul_fp8},
    {"matmul_int4", ops_matmul_int4},
    {"int4_digits", ops_int4_digits},
    {"e4m3_decode", ops_e4m3_decode},
    {"rmsnorm", ops_rmsnorm},
    {"rope", ops_rope},
    {"kv_write", ops_kv_write},
    {"attention", ops_attention},
    {"attention_probs", ops_attention_probs},
    {"router_topk", ops_router_topk},
    {"moe_group", ops_moe_group},
    {"gather_rows", ops_gather_rows},
    {"scatter_add_rows", ops_scatter_add_rows},
    {"take_rows", ops_take_rows},
    {"add_rows", ops_add_rows},
    {"swiglu", ops_swiglu},
    {"to_f32", ops_to_f32},
    {"from_f32", ops_from_f32},
    {"fill_normal", ops_fill_normal},
    {"probe_read", ops_probe_read},
    {"probe_fma", ops_probe_fma},
};
#define N_OPS (int)(sizeof OPS / sizeof OPS[0])
/* every level cpu_dispatch.c may compile for this architecture, lowest first (another
 * architecture's are not listed: they are never compiled here) */
#if defined(__x86_64__)
static const char *const LEVELS[] = {"portable", "avx2", "avx512", "avx512bf16", "amx"};
#elif defined(__aarch64__) && defined(__linux__)
static const char *const LEVELS[] = {"portable", "neon", "neon_bf16", "sve"};
#else
static const char *const LEVELS[] = {"portable"};
#endif
#define N_LEVELS (int)(sizeof LEVELS / sizeof LEVELS[0])

static int runs(const char *level, const char *const *avail, int n) {
    for (int i = 0; i < n; i++)
        if (!strcmp(avail[i], level)) return 1;
    return 0;
}

static int usage(const char *why) {
    fprintf(stderr, "cpu_ops_check: %s\nusage: cpu_ops_check [--hide PATH,...] [--plant OP:PATH,...]\n", why);
    return 2;
}

/* --plant OP:PATH[,OP:PATH...]: OP an op of OPS or * for all, PATH a level but portable (the
 * reference); into plant[level], a bit an op */
static int parse_plant(const char *arg, unsigned *plant) {
    for (const char *p = arg;; p++) {
        const char *end = p + strcspn(p, ","), *colon = memchr(p, ':', (size_t)(end - p));
        if (!colon) return 0;
        unsigned ops = 0;
        for (int i = 0; i < N_OPS; i++)
            if ((strlen(OPS[i].name) == (size_t)(colon - p) && !strncmp(OPS[i].name, p, (size_t)(colon - p))) ||
                (colon - p == 1 && *p == '*'))
                ops |= 1u << i;
        int level = 0;
        for (int i = 1; i < N_LEVELS; i++)
            if (strlen(LEVELS[i]) == (size_t)(end - colon - 1) && !strncmp(LEVELS[i], colon + 1, (size_t)(end - colon - 1)))
                level = i;
        if (!ops || !level) return 0;
        plant[level] |= ops;
        if (!*end) return 1;
        p = end;
    }
}

int main(int argc, char **argv) {
    unsigned plant[N_LEVELS] = {0};
    q3_error err;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--plant") && i + 1 < argc) {
            if (!parse_plant(argv[++i], plant))
                return usage("--plant: expected OP:PATH[,OP:PATH...], OP an op of the harness or *, PATH a path of "
                             "this architecture's but portable (cpu_dispatch.c)");
        } else if (!strcmp(argv[i], "--hide") && i + 1 < argc) {
            if (q3_cpu_hide(argv[++i], &err) != Q3_OK) return usage(err.msg);
        } else
            return usage(argv[i]);
    }
    const char *avail[8];
    const int n_avail = q3_cpu_paths(avail, 8);
    if (q3_cpu_select("portable", &err) != Q3_OK) return usage(err.msg);
    const q3_cpu_ops *ref = q3_cpu_ops_active();
    printf("cpu op harness: %d ops, each path against portable, %d threads\n", N_OPS, q3_max_threads());
#if defined(__aarch64__) && defined(__linux__)
    const int sve_bytes = prctl(Q3_PR_SVE_GET_VL);
    if (sve_bytes >= 0) printf("sve vector length: %d bits\n", (sve_bytes & 0xffff) * 8);
#endif
    int paths = 0, compared = 0, failed = 0;
    long cases = 0;
    for (int l = 0; l < N_LEVELS; l++) {
        const char *level = LEVELS[l];
        if (!runs(level, avail, n_avail)) {
            printf("%-10s not supported on this CPU\n", level);
            continue;
        }
        if (!strcmp(level, "portable")) {
            printf("%-10s the reference: not compared (against itself)\n", level);
            continue;
        }
        if (q3_cpu_select(level, &err) != Q3_OK) return usage(err.msg);
        paths++;
        for (int o = 0; o < N_OPS; o++) {
            ops_run r = {.ref = ref, .path = q3_cpu_ops_active(), .threads = q3_max_threads(),
                         .plant = plant[l] >> o & 1};
            OPS[o].run(&r);
            ops_release(&r);
            compared += r.cases > 0;
            failed += r.failed > 0 || r.cases == 0;
            cases += r.cases;
            printf("%-10s %-16s %4d cases  worst err/tol %8.3g  %s%s%s\n", level, OPS[o].name, r.cases, r.worst,
                   r.failed || !r.cases ? "FAIL" : "OK", r.failed ? ": " : "",
                   r.cases ? r.first_failure : " nothing compared");
        }
    }
    if (!paths)
        printf("compared nothing: no path but portable runs here, and portable against itself is no comparison: "
               "FAIL\n");
    else
        printf("compared %d ops on %d paths (%ld cases) against portable: %d failed: %s\n", compared, paths, cases,
               failed, failed ? "FAIL" : "OK");
    return paths && !failed ? 0 : 1;
}
