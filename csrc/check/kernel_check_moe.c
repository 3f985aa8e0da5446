/* The self-check cases of the MoE kernels (see kernel_check.c): device-side grouping, the
 * grouped decode experts, the grouped prefill experts and their combine, each against its
 * twin (kernels/cpu/twins.h), on hand-made tiles and on the routings of kernel_check.c's
 * lists (top-k 1 to 8, 1 and 17 tokens). */
#include "kernel_check.h"

/* the expert grouping on the device: offsets, rows, weights, active and slot exactly */
double q3_case_moe_route(check *k, int64_t T, int top, int E) {
    const int P = (int)T * top;
    if (top > E) return INFINITY;
    int32_t *idx = host(k, P * 4), *rows = host(k, P * 4), *slot = host(k, P * 4), *active = host(k, (E + 1) * 4);
    int32_t *rows_got = host(k, P * 4), *slot_got = host(k, P * 4), *active_got = host(k, (E + 1) * 4);
    int64_t *offsets = host(k, (E + 1) * 8), *offsets_got = host(k, (E + 1) * 8);
    float *w = host_random(k, P, Q3_F32, 33), *weights = host(k, P * 4), *weights_got = host(k, P * 4);
    if (k->failed) return INFINITY;
    pick_experts(idx, T, top, E, 34);
    int32_t *didx = device(k, idx, P * 4), *drows = device(k, NULL, P * 4), *dslot = device(k, NULL, P * 4);
    int32_t *dactive = device(k, active, (E + 1) * 4); /* zeros past the active experts, as on the host */
    int64_t *doffsets = device(k, NULL, (E + 1) * 8);
    float *dw = device(k, w, P * 4), *dweights = device(k, NULL, P * 4);
    q3_moe_route_host(offsets, rows, weights, active, slot, idx, w, T, top, E);
    if (!k->failed)
        cuda_ok(k, k->g->moe_route(doffsets, drows, dweights, dactive, dslot, didx, dw, T, top, E, NULL),
                "moe_route launch");
    fetch(k, offsets_got, doffsets, (E + 1) * 8);
    fetch(k, rows_got, drows, P * 4);
    fetch(k, weights_got, dweights, P * 4);
    fetch(k, active_got, dactive, (E + 1) * 4);
    fetch(k, slot_got, dslot, P * 4);
    if (k->failed || memcmp(offsets_got, offsets, (E + 1) * 8) || memcmp(rows_got, rows, P * 4) ||
        memcmp(weights_got, weights, P * 4) || memcmp(active_got, active, (E + 1) * 4) ||
        memcmp(slot_got, slot, P * 4))
        return INFINITY;
    return 0.0;
}

/* device arrays of E device pointers, one per expert's [rows, cols] block of dtype dt of `all` */
static const void *const *expert_table(check *k, const void *all, q3_dtype dt, int E, int64_t rows, int64_t cols) {
    const void *ptrs[64];
    if (k->failed || E > 64) return NULL;
    for (int e = 0; e < E; e++) ptrs[e] = (const char *)all + e * rows * cols * (int64_t)q3_dtype_size(dt);
    return device(k, ptrs, E * sizeof ptrs[0]);
}

/* the routed experts (weights of wdt) on grouping from the host twin: gate_up, down and the
 * weighted combine, each against its twin (act, y and x) */
double q3_case_moe_experts(check *k, q3_dtype wdt, int64_t T, int top, int E, int64_t I, int64_t H) {
    const int P = (int)T * top;
    if (top > E || E > 64) return INFINITY;
    int32_t *idx = host(k, P * 4), *rows = host(k, P * 4), *slot = host(k, P * 4), *active = host(k, (E + 1) * 4);
    int64_t *offsets = host(k, (E + 1) * 8);
    float *x = host_random(k, T * H, Q3_F32, 35), *w = host_random(k, P, Q3_F32, 36), *weights = host(k, P * 4);
    const size_t es = q3_dtype_size(wdt), bytes = (size_t)(E * I * H) * es;
    char *gate = (char *)host_random(k, E * I * H, wdt, 37), *up = (char *)host_random(k, E * I * H, wdt, 38);
    char *down = (char *)host_random(k, E * H * I, wdt, 39);
    float *act = host(k, P * I * 4), *y = host(k, P * H * 4), *act_got = host(k, P * I * 4);
    float *y_got = host(k, P * H * 4), *x_got = host(k, T * H * 4);
    if (k->failed) return INFINITY;
    pick_experts(idx, T, top, E, 40);
    q3_moe_route_host(offsets, rows, weights, active, slot, idx, w, T, top, E);
    const void *hg[64], *hu[64], *hd[64];
    for (int e = 0; e < E; e++) {
        hg[e] = gate + e * I * H * es;
        hu[e] = up + e * I * H * es;
        hd[e] = down + e * H * I * es;
    }
    float *dx = device(k, x, T * H * 4), *dweights = device(k, weights, P * 4);
    float *dact = device(k, NULL, P * I * 4), *dy = device(k, NULL, P * H * 4);
    int32_t *drows = device(k, rows, P * 4), *dslot = device(k, slot, P * 4);
    int32_t *dactive = device(k, active, (E + 1) * 4);
    int64_t *doffsets = device(k, offsets, (E + 1) * 8);
    const void *const *dg = expert_table(k, device(k, gate, bytes), wdt, E, I, H);
    const void *const *du = expert_table(k, device(k, up, bytes), wdt, E, I, H);
    const void *const *dd = expert_table(k, device(k, down, bytes), wdt, E, H, I);
    if (q3_moe_gate_up_host(act, x, rows, offsets, active, hg, hu, wdt, I, H)) return INFINITY;
    q3_moe_down_host(y, act, offsets, active, hd, wdt, H, I);
    q3_moe_combine_host(x, y, weights, slot, T, top, H);
    const int max_active = E < P ? E : P;
    if (!k->failed)
        cuda_ok(k, k->g->moe_gate_up(dact, dx, drows, doffsets, dactive, dg, du, wdt, max_active, I, H, NULL),
                "moe_gate_up launch");
    if (!k->failed)
        cuda_ok(k, k->g->moe_down(dy, dact, doffsets, dactive, dd, wdt, max_active, H, I, NULL), "moe_down launch");
    if (!k->failed) cuda_ok(k, k->g->moe_combine(dx, dy, dweights, dslot, T, top, H, NULL), "moe_combine launch");
    fetch(k, act_got, dact, P * I * 4);
    fetch(k, y_got, dy, P * H * 4);
    fetch(k, x_got, dx, T * H * 4);
    if (k->failed) return INFINITY;
    const double e_act = max_err(act_got, act, Q3_F32, P * I), e_y = max_err(y_got, y, Q3_F32, P * H);
    const double e_x = max_err(x_got, x, Q3_F32, T * H);
    return e_act > e_y ? (e_act > e_x ? e_act : e_x) : (e_y > e_x ? e_y : e_x);
}

/* the prefill MoE on tensor cores against its twins, on hand-made tiles: a full tile of 64
 * slots, a single slot, two tiles of one expert, slots no tile covers (left as they were) and
 * rows that map slots to tokens with repeats. down gets the twin's act on both sides, so
 * each product is checked alone (bf16 rounding of act would amplify gate_up's differences) */
double q3_case_moe_prefill_tc(check *k) {
    enum { E = 6, T = 70, S = 160, N_TILES = 5 };
    const int64_t I = 96, H = 256;
    const q3_moe_tile tiles[N_TILES] = {{4, 0, 64, 0}, {1, 64, 1, 0}, {3, 65, 40, 0}, {3, 105, 17, 0}, {0, 130, 29, 0}};
    int32_t rows[S];
    for (int s = 0; s < S; s++) rows[s] = (s * 37 + 11) % T; /* each token about twice */
    float *x = host_random(k, T * H, Q3_F32, 41);
    uint16_t *gate = (uint16_t *)host_random(k, E * I * H, Q3_BF16, 42);
    uint16_t *up = (uint16_t *)host_random(k, E * I * H, Q3_BF16, 43);
    uint16_t *down = (uint16_t *)host_random(k, E * H * I, Q3_BF16, 44);
    float *act = host_random(k, S * I, Q3_F32, 45), *y = host_random(k, S * H, Q3_F32, 46);
    float *act_got = host(k, S * I * 4), *y_got = host(k, S * H * 4);
    if (k->failed) return INFINITY;
    const void *hg[E], *hu[E], *hd[E];
    for (int e = 0; e < E; e++) {
        hg[e] = gate + e * I * H;
        hu[e] = up + e * I * H;
        hd[e] = down + e * H * I;
    }
    /* the untouched slots start alike on both sides */
    float *dx = device(k, x, T * H * 4), *dact = device(k, act, S * I * 4), *dy = device(k, y, S * H * 4);
    int32_t *drows = device(k, rows, sizeof rows);
    q3_moe_tile *dtiles = device(k, tiles, sizeof tiles);
    const void *const *dg = expert_table(k, device(k, gate, E * I * H * 2), Q3_BF16, E, I, H);
    const void *const *du = expert_table(k, device(k, up, E * I * H * 2), Q3_BF16, E, I, H);
    const void *const *dd = expert_table(k, device(k, down, E * H * I * 2), Q3_BF16, E, H, I);
    if (q3_moe_gate_up_tc_host(act, x, rows, tiles, N_TILES, hg, hu, I, H)) return INFINITY;
    if (q3_moe_down_tc_host(y, act, tiles, N_TILES, hd, H, I)) return INFINITY;
    float *dact_twin = device(k, act, S * I * 4);
    if (!k->failed)
        cuda_ok(k, k->g->moe_gate_up_tc(dact, dx, drows, dtiles, N_TILES, dg, du, I, H, NULL), "moe_gate_up_tc launch");
    if (!k->failed)
        cuda_ok(k, k->g->moe_down_tc(dy, dact_twin, dtiles, N_TILES, dd, H, I, NULL), "moe_down_tc launch");
    fetch(k, act_got, dact, S * I * 4);
    fetch(k, y_got, dy, S * H * 4);
    if (k->failed) return INFINITY;
    const double e_act = max_err(act_got, act, Q3_F32, S * I), e_y = max_err(y_got, y, Q3_F32, S * H);
    return e_act > e_y ? e_act : e_y;
}

/* the prefill combine: 4 of 6 tokens with 1, 2, 3 and 2 slots in no sorted order, H not a
 * multiple of the block */
double q3_case_moe_combine_csr(check *k) {
    enum { T = 6, S = 10, N = 4 };
    const int64_t H = 300;
    const int32_t tokens[N] = {5, 0, 3, 2}, ptr[N + 1] = {0, 1, 3, 6, 8}, slot[8] = {7, 2, 9, 0, 4, 8, 1, 6};
    float *x = host_random(k, T * H, Q3_F32, 47), *y = host_random(k, S * H, Q3_F32, 48);
    float *weights = host_random(k, S, Q3_F32, 49), *got = host(k, T * H * 4);
    if (k->failed) return INFINITY;
    float *dx = device(k, x, T * H * 4), *dy = device(k, y, S * H * 4), *dweights = device(k, weights, S * 4);
    int32_t *dtokens = device(k, tokens, sizeof tokens), *dptr = device(k, ptr, sizeof ptr);
    int32_t *dslot = device(k, slot, sizeof slot);
    q3_moe_combine_csr_host(x, y, weights, tokens, ptr, slot, N, H);
    if (!k->failed)
        cuda_ok(k, k->g->moe_combine_csr(dx, dy, dweights, dtokens, dptr, dslot, N, H, NULL), "moe_combine_csr launch");
    fetch(k, got, dx, T * H * 4);
    return k->failed ? INFINITY : max_err(got, x, Q3_F32, T * H);
}


/* the prefill MoE as the layer plans it (csrc/cuda/passes.c, one batch of every expert): T
 * tokens' top `top` of E experts grouped on the host, each expert's slots cut into tiles of
 * at most 64, and the token list with each token's slots ascending; gate_up, down and the
 * combine each against its twin on the twin's input (act, y and x) */
double q3_case_moe_prefill_batch(check *k, int64_t T, int top, int E, int64_t I, int64_t H) {
    const int P = (int)T * top;
    int32_t *idx = host(k, P * 4), *rows = host(k, P * 4), *slot = host(k, P * 4), *active = host(k, (E + 1) * 4);
    int32_t *plan = host(k, (3 * T + 1 + P) * 4); /* tokens [n], ptr [n + 1], slots [P] */
    int64_t *offsets = host(k, (E + 1) * 8);
    q3_moe_tile *tiles = host(k, (P + E) * sizeof *tiles);
    float *x = host_random(k, T * H, Q3_F32, 50), *w = host_random(k, P, Q3_F32, 51), *weights = host(k, P * 4);
    uint16_t *gate = (uint16_t *)host_random(k, E * I * H, Q3_BF16, 52);
    uint16_t *up = (uint16_t *)host_random(k, E * I * H, Q3_BF16, 53);
    uint16_t *down = (uint16_t *)host_random(k, E * H * I, Q3_BF16, 54);
    float *act = host(k, P * I * 4), *y = host(k, P * H * 4), *x_want = host(k, T * H * 4);
    float *act_got = host(k, P * I * 4), *y_got = host(k, P * H * 4), *x_got = host(k, T * H * 4);
    if (k->failed || top > E || E > 64) return INFINITY;
    pick_experts(idx, T, top, E, 55);
    q3_moe_route_host(offsets, rows, weights, active, slot, idx, w, T, top, E);
    int n_tiles = 0, n = 0;
    for (int e = 0; e < E; e++)
        for (int64_t f = offsets[e]; f < offsets[e + 1]; f += Q3_MOE_TILE_ROWS) {
            const int64_t r = offsets[e + 1] - f < Q3_MOE_TILE_ROWS ? offsets[e + 1] - f : Q3_MOE_TILE_ROWS;
            tiles[n_tiles++] = (q3_moe_tile){e, (int32_t)f, (int32_t)r, 0};
        }
    int32_t *tokens = plan, seen[64] = {0}; /* seen[t]: 1 + t's place in tokens */
    if (T > 64) return INFINITY;
    for (int s = 0; s < P; s++)
        if (!seen[rows[s]]) {
            tokens[n] = rows[s];
            seen[rows[s]] = ++n;
        }
    int32_t *ptr = tokens + n, *slots = ptr + n + 1;
    ptr[0] = 0;
    for (int i = 0; i < n; i++) {
        int at = ptr[i];
        for (int s = 0; s < P; s++) /* slots ascending: each token's in expert order */
            if (rows[s] == tokens[i]) slots[at++] = s;
        ptr[i + 1] = at;
    }
    const void *hg[64], *hu[64], *hd[64];
    for (int e = 0; e < E; e++) {
        hg[e] = gate + e * I * H;
        hu[e] = up + e * I * H;
        hd[e] = down + e * H * I;
    }
    float *dx = device(k, x, T * H * 4), *dweights = device(k, weights, P * 4);
    float *dact = device(k, NULL, P * I * 4), *dy = device(k, NULL, P * H * 4);
    int32_t *drows = device(k, rows, P * 4), *dplan = device(k, plan, (2 * n + 1 + P) * 4);
    q3_moe_tile *dtiles = device(k, tiles, n_tiles * sizeof *tiles);
    const void *const *dg = expert_table(k, device(k, gate, E * I * H * 2), Q3_BF16, E, I, H);
    const void *const *du = expert_table(k, device(k, up, E * I * H * 2), Q3_BF16, E, I, H);
    const void *const *dd = expert_table(k, device(k, down, E * H * I * 2), Q3_BF16, E, H, I);
    if (q3_moe_gate_up_tc_host(act, x, rows, tiles, n_tiles, hg, hu, I, H)) return INFINITY;
    if (q3_moe_down_tc_host(y, act, tiles, n_tiles, hd, H, I)) return INFINITY;
    memcpy(x_want, x, T * H * 4);
    q3_moe_combine_csr_host(x_want, y, weights, tokens, ptr, slots, n, H);
    float *dact_twin = device(k, act, P * I * 4), *dy_twin = device(k, y, P * H * 4);
    if (!k->failed)
        cuda_ok(k, k->g->moe_gate_up_tc(dact, dx, drows, dtiles, n_tiles, dg, du, I, H, NULL), "moe_gate_up_tc launch");
    if (!k->failed)
        cuda_ok(k, k->g->moe_down_tc(dy, dact_twin, dtiles, n_tiles, dd, H, I, NULL), "moe_down_tc launch");
    if (!k->failed)
        cuda_ok(k, k->g->moe_combine_csr(dx, dy_twin, dweights, dplan, dplan ? dplan + n : NULL,
                                         dplan ? dplan + 2 * n + 1 : NULL, n, H, NULL),
                "moe_combine_csr launch");
    fetch(k, act_got, dact, P * I * 4);
    fetch(k, y_got, dy, P * H * 4);
    fetch(k, x_got, dx, T * H * 4);
    if (k->failed) return INFINITY;
    const double e_act = max_err(act_got, act, Q3_F32, P * I), e_y = max_err(y_got, y, Q3_F32, P * H);
    const double e_x = max_err(x_got, x_want, Q3_F32, T * H);
    return e_act > e_y ? (e_act > e_x ? e_act : e_x) : (e_y > e_x ? e_y : e_x);
}
