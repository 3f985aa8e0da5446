/* The CPU twin of kernels/cuda/decode_prepare.cu (twins.h): a decode step's bookkeeping from
 * the sequence lengths (kernels/cuda/ops_cuda.h's decode_prepare). Portable variant only.
 * seqs, pos, lengths [n_seqs]. */
#include "ops.h"
#include "twins.h"

#if Q3_CPU_TWINS

void q3_decode_prepare_host(q3_attn_seq *seqs, int64_t *pos, int64_t *lengths, int n_seqs) {
    for (int s = 0; s < n_seqs; s++) {
        const int64_t n = lengths[s];
        seqs[s].n_past = n;
        pos[s] = n >= seqs[s].start ? seqs[s].first_pos + n - seqs[s].start : 0;
        lengths[s] = n + 1;
    }
}

#endif
