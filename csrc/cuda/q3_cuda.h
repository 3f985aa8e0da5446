/* The CUDA backend's public API, beside the engine's (csrc/engine/q3.h): opening the
 * launcher library (libq3cuda.so for a GPU, or libq3simt.so, the same kernels on the CPU's
 * SIMT executor), decode graphs, thread schedules, and a switch for comparisons. A layer or cache on a CUDA
 * device is made with the engine's own calls (q3_layer_create with device >= 0 weights,
 * q3_cache_create_on) once the backend is open. */
#ifndef Q3_CUDA_PUBLIC_H
#define Q3_CUDA_PUBLIC_H

#include "../engine/q3.h"

/* CUDA backend (backend.c): opens the launcher library at `path` once; the
 * number of CUDA devices it sees (0 before opening, or without a driver). */
q3_status q3_cuda_open(const char *path, q3_error *err);
int q3_cuda_device_count(void);

/* The thread schedules the open backend runs a kernel's threads in: 1 on a GPU (the
 * hardware's); 3 on the SIMT executor (libq3simt.so: 0 forward, 1 reverse, 2 a shuffle
 * seeded by `seed`, between synchronisation points), so that a race shows as a difference.
 * q3_cuda_set_schedule applies to the launches that follow. */
int q3_cuda_schedules(void);
q3_status q3_cuda_set_schedule(int schedule, uint64_t seed, q3_error *err);

/* The prefill MoE of CUDA layers with bf16 weights: grouped (a few launches per batch of
 * experts, tensor cores) when on (the default), else one launch per chosen expert and step.
 * on < 0 only reads the setting; returns the setting now. For comparisons. */
int q3_cuda_grouped_prefill(int on);

/* ---- decode graphs (CUDA layers) ------------------------------------------------- */

/* One decode step of a fixed set of sequences, captured once in a CUDA graph and replayed
 * per token: no host synchronisation and no allocation inside, one launch per step. The
 * graph owns its device input and output ([n_seqs, 1, hidden] of io_dtype: write the next
 * tokens into the input, read the step's result from the output) and its own workspace; it
 * borrows the layer and the cache, which must outlive it. Each replay appends one token to
 * each of its sequences, as q3_layer_forward would; calls of the layer on the same cache may
 * be mixed with replays (lengths and padding are re-uploaded when they changed). */
#define Q3_GRAPH_MAX_BATCH 64
typedef struct q3_decode_graph q3_decode_graph;
q3_status q3_decode_graph_create(q3_decode_graph **out, q3_layer *layer, q3_cache *cache, const int32_t *seqs,
                                 int n_seqs, q3_dtype io_dtype, q3_error *err);
void *q3_decode_graph_input(const q3_decode_graph *g);
void *q3_decode_graph_output(const q3_decode_graph *g);
/* queues one step on `stream` (NULL: the default stream); on failure nothing was queued and
 * the cache lengths are unchanged */
q3_status q3_decode_graph_replay(q3_decode_graph *g, void *stream, q3_error *err);
void q3_decode_graph_destroy(q3_decode_graph *g);

#endif
