/* Router: softmax + top-k selection + renormalisation, one token per iteration. */
#include <math.h>

#include "ops.h"
#include "team.h"

static void route_token(int32_t *idx, float *w, const float *logit, int E, int k, int normalize) {
    float mx = logit[0];
    for (int e = 1; e < E; e++) mx = logit[e] > mx ? logit[e] : mx;
    float p[E], sum = 0.0f;
    for (int e = 0; e < E; e++) {
        p[e] = expf(logit[e] - mx);
        sum += p[e];
    }
    /* selection by insertion into a sorted list of k: k is small (8 of 128). Experts come in
     * ascending index and compare with a strict >, so none displaces or passes an expert of
     * equal probability: ties go to the lower index (router.h) */
    int n = 0;
    for (int e = 0; e < E; e++) {
        const float pe = p[e];
        if (n == k && !(pe > p[idx[k - 1]])) continue;
        int pos = n < k ? n++ : k - 1;
        while (pos > 0 && pe > p[idx[pos - 1]]) {
            idx[pos] = idx[pos - 1];
            pos--;
        }
        idx[pos] = e;
    }
    float sel = 0.0f;
    for (int j = 0; j < k; j++) {
        w[j] = p[idx[j]] / sum;
        sel += w[j];
    }
    if (normalize)
        for (int j = 0; j < k; j++) w[j] /= sel;
}

void Q3_CPU_FN(q3_router_topk)(int32_t *idx, float *weight, const float *logits, int64_t T, int E,
                        int k, int normalize) {
    if (!q3_team(T > 16, 0)) { /* inline (team.h) */
        for (int64_t t = 0; t < T; t++) route_token(idx + t * k, weight + t * k, logits + t * E, E, k, normalize);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) route_token(idx + t * k, weight + t * k, logits + t * E, E, k, normalize);
}
