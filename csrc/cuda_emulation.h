/* The emulated CUDA device's two halves (csrc/cuda_emulation.c: memory, copies, streams and
 * the graph tape; csrc/cuda_emulation_kernels.c: the launchers, as CPU twins). */
#ifndef Q3_ENGINE_CUDA_EMULATION_H
#define Q3_ENGINE_CUDA_EMULATION_H

#include <stddef.h>

#include "cuda_backend.h"

/* Runs a launch now, or records it (its arguments copied) while a stream is capturing:
 * a replay of the graph runs the recorded launches in order, as a CUDA graph would. */
typedef int q3_emu_run_fn(const void *args);
int q3_emu_submit(q3_emu_run_fn *run, const void *args, size_t size);

/* fills the kernel launchers of the table */
void q3_emu_kernels(q3_cuda_ops *table);

#endif
