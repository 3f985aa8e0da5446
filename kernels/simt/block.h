// The SIMT executor's inside (kernels/simt/block.cpp, launch.cpp, runtime_api.cpp): a block
// of fibers and its scheduler, the warp collectives, and the launch queue.
#ifndef Q3_SIMT_BLOCK_H
#define Q3_SIMT_BLOCK_H

#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h> // the executor's (kernels/simt/include first on the include path)

#include "context.h"

namespace simt {

enum FiberState { READY, AT_BARRIER, IN_WARP_OP, DONE };

struct Fiber {
    Context context;
    void *stack;
    size_t stack_bytes;
    uint3 idx;       // threadIdx
    int linear;      // its index in the block
    FiberState state;
    const char *site; // where it waits (a barrier or a warp primitive)
    void *fake_stack; // AddressSanitizer's, across switches
};

// a warp primitive that some lanes have reached and others not yet
struct PendingCollective {
    bool open;
    Collective kind;
    int width;
    unsigned mask, arrived;
    const char *site;
    void *ctx[32];
    void (*complete)(void *const ctx[32], unsigned mask);
};

// where the schedule stands (run_block): the pass, and in a SHUFFLE pass the warp being run
struct Cursor {
    int pos, end;       // the next index into `order` to look at, and the end of the range
    int warp;           // SHUFFLE: the index into warp_order of the warp being run
    bool ran_range;     // a fiber of the range ran since the range began (SHUFFLE: run it again)
    bool ran_pass;      // a fiber ran in this pass
};

struct Block {
    const Launch *launch;
    uint3 idx;
    dim3 dim;
    int threads;
    std::vector<Fiber> fibers;
    std::vector<PendingCollective> warps; // one pending collective per warp at most
    std::vector<std::pair<const void *, void *>> statics; // shared variables by declaration
    size_t static_bytes;
    void *dynamic;
    Context scheduler;
    void *scheduler_fake_stack;
    const void *scheduler_stack_bottom;
    size_t scheduler_stack_size;
    std::string error; // the first failure: the launch fails with it
    Fiber *running;
    bool from_scheduler; // whether the fiber switched to last came from the scheduler (AddressSanitizer)
    // the schedule: fibers by index in the order they run, warps in theirs (SHUFFLE), the seed
    int schedule;
    std::vector<int> order, warp_order;
    Cursor cursor;
    std::mt19937_64 rng;
};

// runs every thread of the block to its end under the launch's schedule; false with
// block->error set when the block fails
bool run_block(Block *block, int schedule, uint64_t seed);

// the schedule for launches from now on (kernels/simt/simt.h q3_simt_set_schedule)
int schedule_kind();
uint64_t schedule_seed();

// a warp collective at `site`: waits until every lane in `mask` has arrived, then
// complete(ctx of each lane) runs once before any lane goes on
void warp_sync(Collective kind, unsigned mask, int width, const char *site, void *ctx,
               void (*complete)(void *const ctx[32], unsigned mask));

// "kernel k, block (x, y, z), thread (x, y, z)": where the running fiber is
std::string where();
// the same into buf[n], without allocating (for a signal handler); false outside a kernel
bool where(char *buf, size_t n);

// from the first launch on, an abort inside a kernel (a sanitizer's report) prints where it
// came from (reports.cpp)
void report_aborts();

// ---- launches and the runtime (launch.cpp, runtime_api.cpp) -----------------------------------

// runs the launch now: every block, on up to Q3_SIMT_WORKERS OS threads; the CUDA error code
// (0, or the launch's failure, whose message record_error keeps)
int run_launch(const Launch *launch);
// the message cudaGetErrorString gives for `code` until the next failure; and the error
// cudaGetLastError returns next
void record_error(int code, const std::string &message);
// a launch or queued operation on `stream`: true when the stream is capturing, and the
// operation was recorded into its graph instead of run (launch->args then belong to it)
bool capture_launch(void *stream, const Launch *launch);
// work of the host (a copy, a memset, the cuBLAS stand-in's GEMM) queued on `stream` like a
// launch: run now, or recorded while it captures; args are released by free_args either way
int submit_host(void *stream, const char *name, void (*body)(void *), void *args, void (*free_args)(void *));

} // namespace simt

#endif
