// The SIMT executor: kernels/cuda/*.cu compiled by the host C++ compiler (g++ -std=c++17,
// -DQ3_SIMT, kernels/simt/include first on the include path) run on the CPU under CUDA's
// execution model. This header is the device side the kernels see: the thread and block
// indices, __syncthreads and the warp primitives, shared memory, atomics and the intrinsics
// the kernels use, and the launch that replaces <<< >>> (Q3_LAUNCH, kernels/cuda/common.cuh).
//
// Model: a grid's blocks run one at a time per worker OS thread; the threads of a block are
// fibers on that OS thread. A fiber runs until it reaches a barrier, a warp primitive or its
// end, then the block's scheduler picks the next one in the launch's schedule order (forward,
// reverse, or the warps in a seeded order, each run ahead to its next barrier: Schedule
// below), so a missing barrier shows as a difference between schedules. What the hardware
// would reject (threads at different barriers, a lane missing from a warp primitive, too
// much shared memory, a misaligned tensor-core pointer or access) fails the launch with a
// message naming the kernel, the block and the thread: cudaGetErrorString of the launch's
// error returns it.
#ifndef Q3_SIMT_H
#define Q3_SIMT_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include <tuple>
#include <utility>

#ifndef Q3_SIMT
#error "kernels/simt/simt.h is the SIMT executor's device environment: build with -DQ3_SIMT"
#endif

namespace simt {

// ---- the running thread --------------------------------------------------------------------

struct Fiber;
struct Block;

// the fiber and block running now on this OS thread (NULL outside a kernel)
Fiber *current_fiber();
Block *current_block();

// What a running thread is, kept at the base (lowest address) of its fiber's stack. Every
// stack is aligned to its size, a power of two (context.h), so a kernel finds its record from
// its stack pointer: threadIdx costs a mask and a load, not a call and a thread-local lookup.
struct ThreadRecord {
    uint3 thread, block;
    dim3 block_dim, grid_dim;
    Fiber *fiber;
    Block *block_of;
};
extern uintptr_t g_stack_base_mask; // ~(stack bytes - 1), set before the first block runs (context.cpp)

// the running thread's record: only inside a kernel, on its fiber's stack
inline ThreadRecord &thread_record() {
    uintptr_t sp;
#if defined(__x86_64__)
    __asm__("movq %%rsp, %0" : "=r"(sp)); // not volatile: a fiber never leaves its stack
#else
    sp = (uintptr_t)__builtin_frame_address(0);
#endif
    return *reinterpret_cast<ThreadRecord *>(sp & g_stack_base_mask);
}
inline const uint3 &thread_idx() { return thread_record().thread; }
inline const uint3 &block_idx() { return thread_record().block; }
inline const dim3 &block_dim() { return thread_record().block_dim; }
inline const dim3 &grid_dim() { return thread_record().grid_dim; }

// ---- synchronisation ---------------------------------------------------------------------------

// every thread of the block arrives here before any goes on; `site` names the call
void syncthreads(const char *site);

// warp collectives: every lane named in `mask` calls the same primitive with the same mask;
// each gets the result computed from all lanes' values
enum Collective { SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR, BALLOT, ANY, ALL, MATCH_ANY, SYNCWARP, WMMA };
uint64_t warp_collective(Collective kind, unsigned mask, uint64_t value, int arg, int width, const char *site);
unsigned active_mask();

// the launch fails at the next scheduling point with this message (printf-style), naming
// the kernel, block and thread
[[noreturn]] void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

// ---- shared memory -----------------------------------------------------------------------------

// the block's instance of a static shared variable declared at `key` (a heap block of its
// own, so AddressSanitizer sees an access past it); every thread of the block gets the same
void *shared_static(const void *key, size_t bytes, size_t align, const char *name);
// the launch's dynamic shared memory (a heap block of exactly the launch's bytes)
void *shared_dynamic();

template <class T> using type_t = T; // array types in declarations: type_t<float[32]> &name

template <class T> T &shared(const void *key, const char *name) {
    return *static_cast<T *>(shared_static(key, sizeof(T), alignof(T) > 32 ? alignof(T) : 32, name));
}

// ---- launches ----------------------------------------------------------------------------------

// one launch: the kernel run by every thread of every block
struct Launch {
    const char *name;
    dim3 grid, block;
    size_t dynamic_shared;
    const void *kernel; // the function, for its attributes (cudaFuncSetAttribute)
    void (*body)(void *args);
    void *args; // owned: freed by `free_args`
    void (*free_args)(void *args);
};

// queues the launch on the stream (runs it now, or records it while the stream captures);
// the result is the launch's error code (also what cudaGetLastError returns next)
int submit(Launch *launch, void *stream);

template <class... A> struct Bound {
    void (*kernel)(A...);
    std::tuple<A...> args;
    static void run(void *self) {
        Bound *b = static_cast<Bound *>(self);
        std::apply(b->kernel, b->args);
    }
    static void release(void *self) { delete static_cast<Bound *>(self); }
};

// `Q3_LAUNCH(kernel, grid, block, smem, stream)(args...)`: the arguments are converted to the
// kernel's parameter types and copied, as a CUDA launch copies them
template <class... A> struct Launcher {
    void (*kernel)(A...);
    const char *name;
    dim3 grid, block;
    size_t smem;
    void *stream;
    template <class... B> void operator()(B &&...args) const {
        Bound<A...> *b = new Bound<A...>{kernel, std::tuple<A...>(static_cast<A>(std::forward<B>(args))...)};
        Launch l = {name, grid, block, smem, (const void *)kernel, &Bound<A...>::run, b, &Bound<A...>::release};
        submit(&l, stream);
    }
};

template <class... A>
Launcher<A...> launch(void (*kernel)(A...), const char *name, dim3 grid, dim3 block, size_t smem, void *stream) {
    return Launcher<A...>{kernel, name, grid, block, smem, stream};
}

// ---- schedules (for the race check) --------------------------------------------------------------

// FORWARD, REVERSE: one step (to its next synchronisation point) of each ready fiber in turn,
// in index order or its reverse, so the warps go in lockstep; SHUFFLE: the warps in a seeded
// order, each run with its lanes in a seeded order until all of them wait at a barrier or
// have ended, so one warp gets a barrier interval ahead of the others (a tile staged over
// one that other warps still read shows)
enum Schedule { FORWARD = 0, REVERSE = 1, SHUFFLE = 2 };
// the order in which the fibers of each block are run, for the launches that follow (seed:
// of the shuffle)
extern "C" void q3_simt_set_schedule(int schedule, uint64_t seed);

} // namespace simt

// ---- what the kernels write -----------------------------------------------------------------------

#define threadIdx (simt::thread_idx())
#define blockIdx (simt::block_idx())
#define blockDim (simt::block_dim())
#define gridDim (simt::grid_dim())
#define warpSize 32

#define Q3_SIMT_STR2(x) #x
#define Q3_SIMT_STR(x) Q3_SIMT_STR2(x)
#define Q3_SIMT_SITE __FILE__ ":" Q3_SIMT_STR(__LINE__)

// the primitives with optional arguments are objects called with the kernel's arguments
#define __syncthreads() simt::syncthreads(Q3_SIMT_SITE)
#define __syncwarp simt::SyncWarp{Q3_SIMT_SITE}
#define __shfl_sync simt::Shfl{simt::SHFL_IDX, Q3_SIMT_SITE}
#define __shfl_up_sync simt::Shfl{simt::SHFL_UP, Q3_SIMT_SITE}
#define __shfl_down_sync simt::Shfl{simt::SHFL_DOWN, Q3_SIMT_SITE}
#define __shfl_xor_sync simt::Shfl{simt::SHFL_XOR, Q3_SIMT_SITE}
#define __ballot_sync(mask, p) ((unsigned)simt::warp_collective(simt::BALLOT, mask, (p) != 0, 0, 32, Q3_SIMT_SITE))
#define __any_sync(mask, p) ((int)simt::warp_collective(simt::ANY, mask, (p) != 0, 0, 32, Q3_SIMT_SITE))
#define __all_sync(mask, p) ((int)simt::warp_collective(simt::ALL, mask, (p) != 0, 0, 32, Q3_SIMT_SITE))
#define __match_any_sync(mask, v) simt::match_any(mask, v, Q3_SIMT_SITE)
#define __activemask() simt::active_mask()

// the launch and shared memory of kernels/cuda/common.cuh
#define Q3_LAUNCH(kernel, grid, block, smem, stream) \
    simt::launch(kernel, #kernel, dim3(grid), dim3(block), (size_t)(smem), (void *)(stream))
#define Q3_SHARED(T, name)                 \
    static const char name##_simt_key = 0; \
    simt::type_t<T> &name = simt::shared<simt::type_t<T>>(&name##_simt_key, #name)
#define Q3_DYNAMIC_SHARED(T, name) T *const name = static_cast<T *>(simt::shared_dynamic())

namespace simt {

struct SyncWarp {
    const char *site;
    void operator()(unsigned mask = 0xffffffffu) const { warp_collective(SYNCWARP, mask, 0, 0, 32, site); }
};

template <class T> inline uint64_t bits_of(T v) {
    static_assert(sizeof(T) <= 8, "a warp primitive moves at most 8 bytes a lane");
    uint64_t u = 0;
    __builtin_memcpy(&u, &v, sizeof v);
    return u;
}

template <class T> inline T of_bits(uint64_t u) {
    T v;
    __builtin_memcpy(&v, &u, sizeof v);
    return v;
}

struct Shfl {
    Collective kind;
    const char *site;
    template <class T> T operator()(unsigned mask, T v, int arg, int width = 32) const {
        return of_bits<T>(warp_collective(kind, mask, bits_of(v), arg, width, site));
    }
};

template <class T> inline unsigned match_any(unsigned mask, T v, const char *site) {
    return (unsigned)warp_collective(MATCH_ANY, mask, bits_of(v), 0, 32, site);
}

} // namespace simt

// ---- atomics and fences (blocks run in parallel: real atomics) ------------------------------

namespace simt {
// *p = op(*p, v) atomically; the old value
template <class T, class Op> inline T atomic_update(T *p, T v, Op op) {
    T old, want;
    __atomic_load(p, &old, __ATOMIC_RELAXED);
    do want = op(old, v);
    while (!__atomic_compare_exchange(p, &old, &want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return old;
}
} // namespace simt

inline int atomicAdd(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicAdd(unsigned *p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline float atomicAdd(float *p, float v) {
    return simt::atomic_update(p, v, [](float a, float b) { return a + b; });
}
inline int atomicMax(int *p, int v) { return simt::atomic_update(p, v, [](int a, int b) { return a > b ? a : b; }); }
inline int atomicMin(int *p, int v) { return simt::atomic_update(p, v, [](int a, int b) { return a < b ? a : b; }); }
inline int atomicExch(int *p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
inline int atomicCAS(int *p, int expect, int want) {
    __atomic_compare_exchange_n(p, &expect, want, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return expect;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// ---- intrinsics ------------------------------------------------------------------------------------

inline float __uint_as_float(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t u; __builtin_memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int32_t i) { float f; __builtin_memcpy(&f, &i, 4); return f; }
inline int32_t __float_as_int(float f) { int32_t i; __builtin_memcpy(&i, &f, 4); return i; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __clz(int v) { return v ? __builtin_clz((unsigned)v) : 32; }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
// sin(pi x) and cos(pi x): x less a whole number of turns (exact in fp32), then in double
inline void sincospif(float x, float *s, float *c) {
    const double t = 3.14159265358979323846 * (double)(x - 2.0f * rintf(0.5f * x));
    *s = (float)sin(t);
    *c = (float)cos(t);
}
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
template <class T> inline T __ldg(const T *p) { return *p; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

#endif
