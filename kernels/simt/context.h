// Fiber contexts for the SIMT executor's blocks: a stack of its own and a switch that saves
// only what the C ABI asks a callee to keep. On x86-64 a few instructions (the callee-saved
// registers pushed on the fiber's own stack, then the stack pointer swapped); elsewhere
// ucontext, whose swapcontext also saves the signal mask (a system call a switch, so several
// times slower). The floating-point control state (rounding, flush-to-zero: MXCSR and the x87
// control word) is not switched, which cost half of a switch: a block's fibers all run with
// the defaults, set once around the block (float_control_defaults), as CUDA kernels have no
// such state to change (their rounding is per instruction). Stacks come from a pool shared
// by the launches, so a block does not map and unmap its threads' stacks.
#ifndef Q3_SIMT_CONTEXT_H
#define Q3_SIMT_CONTEXT_H

#include <fenv.h>
#include <stddef.h>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace simt {

struct Context {
    void *sp; // x86-64: the saved stack pointer
#if !defined(__x86_64__)
    ucontext_t uc;
#endif
};

// a context that, switched to, runs entry(arg) on [stack, stack + bytes); entry never returns
void context_make(Context *c, void *stack, size_t bytes, void (*entry)(void *), void *arg);
// saves the running context in `from` and continues `to`
void context_switch(Context *from, Context *to);

// the calling thread's floating-point environment, replaced by the defaults (round to
// nearest, exceptions masked, no flush-to-zero) until float_control_restore
struct FloatControl {
    fenv_t env;
};
FloatControl float_control_defaults();
void float_control_restore(const FloatControl &saved);

// `n` stacks of stack_bytes() each, each aligned to its size, from the pool; back to it
void **stacks_acquire(int n);
void stacks_release(void **stacks, int n);
// Q3_SIMT_STACK_KB (128 by default, 256 under AddressSanitizer) up to a power of two, at least
// 16 KiB, of which the thread's record and its frames' color (up to 34 KiB, block.cpp) are not
// the frames'; sets g_stack_base_mask (simt.h) the first time
size_t stack_bytes();

} // namespace simt

#endif
