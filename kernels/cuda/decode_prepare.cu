// A decode step's bookkeeping on the device (twin: kernels/cpu/decode_prepare.c),
// so that a captured decode step reads the sequence lengths where the previous step left
// them instead of taking them from the host. One thread per sequence.
#include "../attention.h"
#include "common.cuh"

// seqs[s].n_past = lengths[s]; pos[s] = seqs[s].first_pos + lengths[s] - seqs[s].start, 0
// inside the padding; lengths[s] += 1
__global__ void decode_prepare_kernel(q3_attn_seq *seqs, int64_t *pos, int64_t *lengths, int n_seqs) {
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= n_seqs) return;
    const int64_t n = lengths[s], start = seqs[s].start;
    seqs[s].n_past = n;
    pos[s] = n >= start ? seqs[s].first_pos + n - start : 0;
    lengths[s] = n + 1;
}

// seqs [n_seqs], pos [n_seqs], lengths [n_seqs]: device arrays
extern "C" int q3_decode_prepare_cuda(q3_attn_seq *seqs, int64_t *pos, int64_t *lengths, int n_seqs, void *stream) {
    if (n_seqs < 0) return (int)cudaErrorInvalidValue;
    if (n_seqs == 0) return 0;
    Q3_LAUNCH(decode_prepare_kernel, (unsigned)((n_seqs + 127) / 128), 128, 0, (cudaStream_t)stream)(seqs, pos, lengths,
                                                                                            n_seqs);
    return q3_launch_status();
}
