/* The self-check cases of attention under a call's tree (issue 42: tree verification; kernels/
 * attention.h's q3_attn_seq.tree, tree_first, tree_tokens): each tree below in each scenario,
 * on each path of the launchers, against the CPU kernels (kernel_check_attention.c runs them).
 * A tree of T tokens is given by its parents (-1: the token follows the cached ones), token t
 * seeing its ancestors and itself, as q3_tree_inputs lays them out. */
#include "kernel_check.h"

enum { CHAIN, BRANCHES, ALONE, RANDOM, N_TREES };
static const char *const TREE_NAMES[N_TREES] = {"chain", "branches", "alone", "random"};

/* - chain: the causal mask, spelled as a tree;
 * - branches: over a prefix, tokens 0 and 1 a chain, then two branches from token 1 (2, 4, 6,
 *   ... and 3, 5, 7, ...);
 * - alone: every token a root (sees the cache and itself);
 * - random: each token's parent drawn among the earlier ones, or none. */
static int64_t parent_of(int tree, int64_t t) {
    switch (tree) {
    case CHAIN: return t - 1;
    case BRANCHES: return t < 2 ? t - 1 : t < 4 ? 1 : t - 2;
    case ALONE: return -1;
    default: return t == 0 ? -1 : (int64_t)((uint64_t)(t * 2654435761u + 12345u) % (uint64_t)(t + 1)) - 1;
    }
}

/* rows [T, T] <- the tree's ancestors-and-self mask */
static void lay_tree(uint8_t *rows, int tree, int64_t T) {
    memset(rows, 0, (size_t)(T * T));
    for (int64_t t = 0; t < T; t++)
        for (int64_t u = t; u >= 0; u = parent_of(tree, u)) rows[t * T + u] = 1;
}

/* - fresh: one sequence, nothing cached, the whole call in one pass;
 * - cached: two sequences with different trees (the second the next tree of the
 *   list), 40 and 33 cached rows (the second's first 5 padding) with hidden keys among them,
 *   and the pass the call's tokens from 3 on (its first 3 cached by an earlier pass, seen
 *   through the tree alone) */
typedef struct {
    const char *name;
    int n_seqs;
    int64_t cached[2], start[2], t0;
} scenario;
static const scenario SCENARIOS[] = {
    {"fresh", 1, {0}, {0}, 0},
    {"cached", 2, {40, 33}, {0, 5}, 3},
};

/* The launchers' paths: a pass of 1 token and of 4 split in slices, 17 tokens over an fp32
 * cache (a block per token), 17 on tensor cores at Qwen3-MoE's G = 8, D = 128; the maps of 4
 * tokens and of 17 */
static const q3_masked_path PATHS[] = {
    {"1 token split", "attention", 1, 4, 64, Q3_BF16, 2100, 0},
    {"4 tokens split", "attention", 4, 4, 64, Q3_BF16, 2100, 0},
    {"17 tokens f32", "attention", 17, 2, 64, Q3_F32, 0, 0},
    {"17 tokens", "attention", 17, 8, 128, Q3_BF16, 0, 1},
    {"4 tokens", "attention_probs", 4, 4, 64, Q3_BF16, 0, 0},
    {"17 tokens f32", "attention_probs", 17, 2, 72, Q3_F32, 0, 0},
};

#define N_SCENARIOS (int)(sizeof SCENARIOS / sizeof SCENARIOS[0])
#define N_PATHS (int)(sizeof PATHS / sizeof PATHS[0])

int q3_tree_cases(void) { return N_TREES * N_SCENARIOS * N_PATHS; }

const char *q3_tree_case(int i, char *name, size_t n, double *tol) {
    const int tree = i / (N_SCENARIOS * N_PATHS);
    const scenario *sc = &SCENARIOS[i / N_PATHS % N_SCENARIOS];
    const q3_masked_path *ph = &PATHS[i % N_PATHS];
    const int probs = strcmp(ph->kernel, "attention_probs") == 0;
    snprintf(name, n, "attention %stree, %s, %s: %s", probs ? "probs " : ph->tc ? "tc " : "", TREE_NAMES[tree],
             sc->name, ph->name);
    *tol = q3_masked_path_tol(ph);
    return ph->kernel;
}

double q3_case_tree(check *k, int i) {
    if (i < 0 || i >= q3_tree_cases()) return INFINITY;
    const int tree = i / (N_SCENARIOS * N_PATHS);
    const scenario *sc = &SCENARIOS[i / N_PATHS % N_SCENARIOS];
    const q3_masked_path *ph = &PATHS[i % N_PATHS];
    const int64_t T = sc->t0 + ph->L, ld = 64 + T;
    q3_check_tree tr = {NULL, T, {0}};
    uint8_t *bytes = host(k, (size_t)(sc->n_seqs * T * T)), *flags = host(k, (size_t)(sc->n_seqs * ld));
    if (k->failed) return INFINITY;
    int64_t past[2], most = 0;
    for (int s = 0; s < sc->n_seqs; s++) {
        lay_tree(bytes + s * T * T, (tree + s) % N_TREES, T);
        tr.first[s] = sc->cached[s];
        past[s] = sc->cached[s] + sc->t0;
        most = past[s] + ph->L > most ? past[s] + ph->L : most;
    }
    tr.bytes = bytes;
    /* hidden keys among the cached rows: holes every 7 and a run in the first sequence, a run
     * past the second's padding (none when nothing is cached) */
    for (int64_t j = 3; j < sc->cached[0]; j += 7) flags[j] = 1;
    for (int64_t j = 20; j < 26 && j < sc->cached[0]; j++) flags[j] = 1;
    for (int64_t j = 9; sc->n_seqs > 1 && j < 12 && j < sc->cached[1]; j++) flags[ld + j] = 1;
    if (strcmp(ph->kernel, "attention_probs") == 0) {
        q3_probs_case c = {ph->L, sc->t0, T, 3, sc->n_seqs, {0}, {0}, 2 * ph->G, 2, ph->D, ph->dt, flags, ld, &tr};
        for (int s = 0; s < sc->n_seqs; s++) c.past[s] = past[s], c.start[s] = sc->start[s];
        return q3_case_attention_probs(k, &c);
    }
    const q3_attn_shape sh = {ph->L, 2 * ph->G, 2, ph->D, ph->bound ? ph->bound : most + 5, ph->dt,
                              1.0f / sqrtf((float)ph->D), ph->bound ? ph->bound : most};
    return q3_case_attention_tree(k, &sh, sc->n_seqs, past, sc->start, flags, ld, &tr);
}
