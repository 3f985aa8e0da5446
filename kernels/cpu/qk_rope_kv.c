/* The CPU twin of kernels/cuda/qk_rope_kv.cu (twins.h): QK-norm, RoPE and the KV-cache
 * append as the portable rmsnorm, rope and kv_write in turn. Portable variant only.
 * q [n_seqs * L, heads, D], k and v [n_seqs * L, kv_heads, D]; seqs[s].k, .v the caches. */
#include "ops.h"
#include "twins.h"

#if Q3_CPU_TWINS

void q3_qk_rope_kv_host(float *q, float *k, const float *v, const void *q_norm, const void *k_norm, q3_dtype w_dt,
                        const int64_t *pos, const q3_attn_seq *seqs, int n_seqs, const q3_attn_shape *sh,
                        float eps, const float *inv_freq, float scale) {
    const int64_t R = n_seqs * sh->L, D = sh->head_dim, KVD = (int64_t)sh->kv_heads * D;
    q3_rmsnorm_cpu_portable(q, q, q_norm, w_dt, R * sh->heads, D, eps);
    q3_rmsnorm_cpu_portable(k, k, k_norm, w_dt, R * sh->kv_heads, D, eps);
    q3_rope_cpu_portable(q, pos, R, sh->heads, (int)D, inv_freq, scale);
    q3_rope_cpu_portable(k, pos, R, sh->kv_heads, (int)D, inv_freq, scale);
    for (int s = 0; s < n_seqs; s++) {
        q3_kv_write_cpu_portable((void *)seqs[s].k, sh->kv_dtype, k + s * sh->L * KVD, KVD, sh->L, sh->kv_heads,
                                 (int)D, sh->capacity, seqs[s].n_past);
        q3_kv_write_cpu_portable((void *)seqs[s].v, sh->kv_dtype, v + s * sh->L * KVD, KVD, sh->L, sh->kv_heads,
                                 (int)D, sh->capacity, seqs[s].n_past);
    }
}

#endif
