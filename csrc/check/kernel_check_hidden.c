/* The self-check cases of attention over hidden keys (issue 42: a call's token mask hides
 * tokens from every later query; kernels/attention.h's q3_attn_seq.hidden and first_key):
 * each pattern of hidden rows below on each path of the launchers, against the CPU kernels
 * (kernel_check_attention.c runs them). A pattern is a batch of sequences, each with its
 * cached tokens, its left padding and the runs of rows its flags hide, counted so that the
 * same pattern reads at 1 and at 17 new tokens; the flags of a sequence with none past its
 * padding stay NULL, as the cache gives them (q3_cache_attn_seq). */
#include "kernel_check.h"

/* a bound of a run: a row, or END - n: n rows before the sequence's end (past + L) */
#define END ((int64_t)1 << 40)
#define MAX_RUNS 3

typedef struct {
    int64_t from, to, step; /* rows from, from + step, ... before to (step 0: each) */
} rows_run;

typedef struct {
    const char *name;
    int n_seqs;
    int64_t past[3], start[3];
    rows_run hide[3][MAX_RUNS]; /* per sequence; a run with to == 0 ends the list */
} pattern;

/* - holes: rows every 7 (and 5) through the cached and the new tokens, and a run of 6;
 * - right padding: a run at the end, the new tokens' (hidden queries, which still see the
 *   keys before them) and, for the second sequence, the 2 rows before them at 17 tokens;
 * - first rows hidden: the rows after the padding hidden, so first_key > start and the
 *   queries before it see only themselves (the third sequence hidden whole: every query);
 * - mixed: a sequence without flags (NULL) between two with, left padding and both ends;
 * - long run: 400 hidden keys, whole slices of split-KV's with nothing to see. */
static const pattern PATTERNS[] = {
    {"holes", 2, {40, 33}, {0, 5}, {{{3, END, 7}, {20, 26, 0}}, {{9, END, 5}}}},
    {"right padding", 2, {30, 30}, {0, 3}, {{{END - 4, END, 0}}, {{END - 19, END, 0}}}},
    {"first rows hidden", 3, {7, 0, 3}, {4, 0, 2}, {{{4, 10, 0}}, {{0, 3, 0}}, {{2, END, 0}}}},
    {"mixed", 3, {50, 25, 40}, {0, 0, 5}, {{{10, 20, 0}, {30, END, 4}}, {{0}}, {{5, 7, 0}, {END - 3, END, 0}}}},
    {"long run", 2, {700, 300}, {0, 20}, {{{100, 500, 0}, {650, 660, 0}}, {{30, 290, 0}}}},
};

/* The launchers' paths: a decode step unsplit (split in 2 for the long run), split in 8
 * slices, 4 tokens split, 17 tokens over an fp32 cache (a block per token), 17 on tensor
 * cores at Qwen3-MoE's G = 8, D = 128; the maps of a decode step and of 17 tokens */
static const q3_masked_path PATHS[] = {
    {"decode", "attention", 1, 4, 64, Q3_BF16, 0, 0},
    {"decode split", "attention", 1, 4, 64, Q3_BF16, 2100, 0},
    {"4 tokens split", "attention", 4, 4, 64, Q3_BF16, 2100, 0},
    {"17 tokens f32", "attention", 17, 2, 64, Q3_F32, 0, 0},
    {"17 tokens", "attention", 17, 8, 128, Q3_BF16, 0, 1},
    {"decode", "attention_probs", 1, 4, 64, Q3_BF16, 0, 0},
    {"17 tokens f32", "attention_probs", 17, 2, 72, Q3_F32, 0, 0},
};

#define N_PATTERNS (int)(sizeof PATTERNS / sizeof PATTERNS[0])
#define N_PATHS (int)(sizeof PATHS / sizeof PATHS[0])

int q3_hidden_cases(void) { return N_PATTERNS * N_PATHS; }

const char *q3_hidden_case(int i, char *name, size_t n, double *tol) {
    const pattern *pt = &PATTERNS[i / N_PATHS];
    const q3_masked_path *ph = &PATHS[i % N_PATHS];
    const int probs = strcmp(ph->kernel, "attention_probs") == 0;
    snprintf(name, n, "attention %shidden keys, %s: %s", probs ? "probs " : ph->tc ? "tc " : "", pt->name, ph->name);
    *tol = q3_masked_path_tol(ph);
    return ph->kernel;
}

static int64_t bound_of(int64_t b, int64_t end) { return b >= END / 2 ? end - (END - b) : b; }

/* flags [n_seqs, ld] <- pattern pt's hidden rows at L new tokens a sequence */
static void lay_flags(uint8_t *flags, int64_t ld, const pattern *pt, int64_t L) {
    for (int s = 0; s < pt->n_seqs; s++) {
        const int64_t end = pt->past[s] + L;
        for (int r = 0; r < MAX_RUNS && pt->hide[s][r].to; r++) {
            const rows_run *run = &pt->hide[s][r];
            const int64_t step = run->step ? run->step : 1, to = bound_of(run->to, end);
            for (int64_t j = bound_of(run->from, end); j < to && j < end; j += step)
                if (j >= 0) flags[s * ld + j] = 1;
        }
    }
}

double q3_case_hidden(check *k, int i) {
    if (i < 0 || i >= q3_hidden_cases()) return INFINITY;
    const pattern *pt = &PATTERNS[i / N_PATHS];
    const q3_masked_path *ph = &PATHS[i % N_PATHS];
    int64_t most = 0;
    for (int s = 0; s < pt->n_seqs; s++) most = pt->past[s] + ph->L > most ? pt->past[s] + ph->L : most;
    const int64_t ld = most + 8;
    uint8_t *flags = host(k, (size_t)(pt->n_seqs * ld));
    if (k->failed) return INFINITY;
    lay_flags(flags, ld, pt, ph->L);
    if (strcmp(ph->kernel, "attention_probs") == 0) {
        q3_probs_case c = {ph->L, 0, ph->L, 3, pt->n_seqs, {0}, {0}, 2 * ph->G, 2, ph->D, ph->dt, flags, ld, NULL};
        for (int s = 0; s < pt->n_seqs; s++) c.past[s] = pt->past[s], c.start[s] = pt->start[s];
        return q3_case_attention_probs(k, &c);
    }
    const q3_attn_shape sh = {ph->L, 2 * ph->G, 2, ph->D, ph->bound ? ph->bound : most + 5, ph->dt,
                              1.0f / sqrtf((float)ph->D), ph->bound ? ph->bound : most};
    return q3_case_attention_masked(k, &sh, pt->n_seqs, pt->past, pt->start, flags, ld);
}
