/* CPU path selection: the levels this build compiled, which of them this CPU (and OS) can
 * run, and the one in use. Levels, lowest first: portable (the baseline C), avx2 (with FMA),
 * avx512 (F, BW, VL, DQ), avx512bf16 (+ bf16 and VNNI int8 dot products), amx (+ AMX-BF16 tiles, granted
 * by the kernel on request); on aarch64 portable (scalar), neon (ASIMD), neon_bf16 (+ BFDOT
 * products) and sve (the kernels compiled for SVE: opt-in, never the default, until measured
 * faster than neon on a machine). The best available level is the default. avx512bf16 was kept
 * from being the default for a while, on a measurement made while its tile spilled its 24
 * accumulators to the stack at every step (matmul_dot.c's dot_tile): with that fixed, on
 * an AMD Zen 5 (2 threads) vdpbf16ps runs at the fp32 FMA's instruction rate (6.6 against
 * 7.2 G zmm instructions/s a core: twice the FLOPs) and the layer's prefill of 512 tokens at
 * 789 tok/s against avx512's 382; on the Intel Xeon measured before, where it ran at half the
 * FMA rate (AMX is the default there), it has not been measured since. */
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
/* the kernel's bits (asm/hwcap.h): HWCAP_ASIMD, HWCAP_SVE, HWCAP2_BF16 (FEAT_BF16) */
#define Q3_HWCAP_ASIMD (1ul << 1)
#define Q3_HWCAP_SVE (1ul << 22)
#define Q3_HWCAP2_BF16 (1ul << 14)
#endif

#include "../../kernels/cpu/matmul_packed.h"
#include "cpu_dispatch.h"

typedef struct {
    const char *name;
    const q3_cpu_ops *ops;
    q3_cpu_ops with_matmul; /* for the levels that only swap the matmul */
    int opt_in;             /* offered where named, never the default */
} level;

static level levels[5];
static int n_levels;      /* compiled levels, lowest first */
static const q3_cpu_ops *active;
static const char *active_name;

#if defined(__x86_64__)
static int cpuid_bit(unsigned leaf, unsigned sub, int reg, int bit) {
    unsigned r[4] = {0};
    if (!__get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3])) return 0;
    return (r[reg] >> bit) & 1;
}

/* Linux hands out the AMX tile state only to processes that ask (5.16 and later) */
static int amx_granted(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}
#endif

static char hidden[5]; /* levels q3_cpu_hide took away, by index in levels */

static int is_hidden(const char *name) {
    for (int i = 0; i < n_levels; i++)
        if (!strcmp(levels[i].name, name)) return hidden[i];
    return 0;
}

static int supported(const char *name) {
    if (!strcmp(name, "portable")) return 1;
    if (is_hidden(name)) return 0;
#if defined(__x86_64__)
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    /* leaf 7.1 EAX bit 5: AVX512_BF16; leaf 7.0 ECX bit 11: AVX512_VNNI (every CPU with the first
     * has the second: Cooper Lake, Sapphire Rapids, Zen 4 and 5; the int4 decode uses it) */
    const int bf16 = avx512 && cpuid_bit(7, 1, 0, 5) && cpuid_bit(7, 0, 2, 11);
    if (!strcmp(name, "avx2")) return avx2;
    if (!strcmp(name, "avx512")) return avx512;
    if (!strcmp(name, "avx512bf16")) return bf16;
    if (!strcmp(name, "amx")) /* leaf 7.0 EDX bit 22: AMX-BF16, bit 24: AMX-TILE */
        return bf16 && cpuid_bit(7, 0, 3, 22) && cpuid_bit(7, 0, 3, 24) && amx_granted();
#endif
#if defined(__aarch64__) && defined(__linux__)
    const unsigned long hwcap = getauxval(AT_HWCAP);
    if (!strcmp(name, "neon")) return (hwcap & Q3_HWCAP_ASIMD) != 0;
    if (!strcmp(name, "neon_bf16")) return (hwcap & Q3_HWCAP_ASIMD) && (getauxval(AT_HWCAP2) & Q3_HWCAP2_BF16);
    if (!strcmp(name, "sve")) return (hwcap & Q3_HWCAP_ASIMD) && (hwcap & Q3_HWCAP_SVE);
#endif
    return 0;
}

static void init_levels(void) {
    if (n_levels) return;
    levels[n_levels++] = (level){"portable", &q3_ops_cpu_portable, {0}, 0};
#if defined(__x86_64__)
    levels[n_levels++] = (level){"avx2", &q3_ops_cpu_avx2, {0}, 0};
    levels[n_levels++] = (level){"avx512", &q3_ops_cpu_avx512, {0}, 0};
    q3_cpu_ops bf16 = q3_ops_cpu_avx512, amx = q3_ops_cpu_avx512;
    bf16.name = "avx512bf16";
    bf16.matmul = q3_matmul_cpu_avx512bf16;
    bf16.matmul_fp8 = q3_matmul_fp8_cpu_avx512bf16;
    bf16.matmul_int4 = q3_matmul_int4_cpu_avx512bf16;
    amx.name = "amx";
    amx.matmul = q3_matmul_cpu_amx;
    amx.matmul_fp8 = q3_matmul_fp8_cpu_amx;
    amx.matmul_int4 = q3_matmul_int4_cpu_amx; /* the prefill on AMX tiles, the VNNI decode */
    levels[n_levels] = (level){"avx512bf16", NULL, bf16, 0};
    levels[n_levels].ops = &levels[n_levels].with_matmul;
    n_levels++;
    levels[n_levels] = (level){"amx", NULL, amx, 0};
    levels[n_levels].ops = &levels[n_levels].with_matmul;
    n_levels++;
#endif
#if defined(__aarch64__) && defined(__linux__)
    levels[n_levels++] = (level){"neon", &q3_ops_cpu_neon, {0}, 0};
    q3_cpu_ops neon_bf16 = q3_ops_cpu_neon_bf16; /* its variant's ops, the bf16 products on BFDOT */
    neon_bf16.matmul = q3_matmul_bfdot_cpu_neon_bf16;
    neon_bf16.matmul_int4 = q3_matmul_int4_sdot_cpu_neon_bf16; /* its decode on SDOT, given xb */
    levels[n_levels] = (level){"neon_bf16", NULL, neon_bf16, 0};
    levels[n_levels].ops = &levels[n_levels].with_matmul;
    n_levels++;
    levels[n_levels++] = (level){"sve", &q3_ops_cpu_sve, {0}, 1};
#endif
}

int q3_cpu_paths(const char **names, int max) {
    init_levels();
    int n = 0;
    for (int i = 0; i < n_levels && n < max; i++)
        if (supported(levels[i].name)) names[n++] = levels[i].name;
    return n;
}

q3_status q3_cpu_select(const char *name, q3_error *err) {
    init_levels();
    const char *avail[8];
    const int n = q3_cpu_paths(avail, 8);
    if (!name || !*name) { /* the best available that is not opt-in (portable at least) */
        name = "portable";
        for (int i = 0; i < n_levels; i++)
            for (int j = 0; j < n; j++)
                if (!strcmp(levels[i].name, avail[j]) && !levels[i].opt_in) name = avail[j];
    }
    for (int i = 0; i < n_levels; i++) {
        if (strcmp(levels[i].name, name)) continue;
        if (!supported(name)) {
            char list[96] = "";
            for (int j = 0; j < n; j++) {
                strncat(list, avail[j], sizeof list - strlen(list) - 1);
                if (j + 1 < n) strncat(list, ", ", sizeof list - strlen(list) - 1);
            }
            return q3_fail(err, Q3_ERR_VALUE, "cpu path: '%s' is compiled but this CPU cannot run it "
                           "(available: %s)", name, list);
        }
        active = levels[i].ops;
        active_name = levels[i].name;
        return Q3_OK;
    }
    return q3_fail(err, Q3_ERR_VALUE, "cpu path: expected one of portable, avx2, avx512, avx512bf16, amx (x86-64), "
                   "neon, neon_bf16, sve (aarch64), as this build and CPU allow, got '%s'", name);
}

const char *q3_cpu_path(void) {
    if (!active) q3_cpu_select(NULL, NULL);
    return active_name;
}

const q3_cpu_ops *q3_cpu_ops_active(void) {
    if (!active) q3_cpu_select(NULL, NULL);
    return active;
}

q3_status q3_cpu_set_packed_kc(const char *value, q3_error *err) {
    char *end = NULL;
    const long kc = value && *value ? strtol(value, &end, 10) : -1;
    if (!value || !*value || *end || kc < 0 || kc > Q3_PACKED_KC_MAX)
        return q3_fail(err, Q3_ERR_VALUE, "packed k block: expected 0 (from the L1 data cache) to %d columns, "
                       "got '%s'", Q3_PACKED_KC_MAX, value ? value : "");
#if defined(__x86_64__)
    q3_matmul_packed_set_kc_cpu_avx2(kc);
    q3_matmul_packed_set_kc_cpu_avx512(kc);
#endif
    return Q3_OK;
}

q3_status q3_cpu_hide(const char *names, q3_error *err) {
    init_levels();
    char hide[5] = {0};
    for (const char *p = names; p && *p;) {
        const char *end = strchr(p, ',');
        const size_t len = end ? (size_t)(end - p) : strlen(p);
        int found = -1;
        for (int i = 0; i < n_levels; i++)
            if (strlen(levels[i].name) == len && !strncmp(levels[i].name, p, len)) found = i;
        if (found <= 0) /* portable (0) is what every CPU runs: it cannot be hidden */
            return q3_fail(err, Q3_ERR_VALUE, "cpu paths to hide: expected a comma-separated list of avx2, avx512, "
                           "avx512bf16, amx (x86-64), neon, neon_bf16, sve (aarch64), as this build compiled them, "
                           "got '%.*s'", (int)len, p);
        hide[found] = 1;
        p = end ? end + 1 : p + len;
    }
    memcpy(hidden, hide, sizeof hidden);
    if (active && is_hidden(active_name)) active = NULL; /* chosen again at the next use */
    return Q3_OK;
}

q3_status q3_cpu_configure_from_env(q3_error *err) {
    static const char *const vars[] = {"QWEN3LAYER_CPU_HIDE", "QWEN3LAYER_CPU_PATH", "QWEN3LAYER_PACKED_KC"};
    const char *hide = getenv(vars[0]), *path = getenv(vars[1]), *kc = getenv(vars[2]);
    int which = 0;
    q3_status s = hide ? q3_cpu_hide(hide, err) : Q3_OK;
    if (s == Q3_OK && (s = q3_cpu_select(path, err)) != Q3_OK) which = 1;
    else if (s == Q3_OK && kc && (s = q3_cpu_set_packed_kc(kc, err)) != Q3_OK) which = 2;
    if (s == Q3_OK) return s;
    char cause[sizeof err->msg];
    memcpy(cause, err->msg, sizeof cause);
    return q3_fail(err, s, "%s: %s", vars[which], cause);
}
