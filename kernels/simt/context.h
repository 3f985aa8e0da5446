// Fiber contexts for the SIMT executor's blocks: a stack of its own and a switch that saves
// only what the C ABI asks a callee to keep. On x86-64 a few instructions (callee-saved
// registers, MXCSR and the x87 control word pushed on the fiber's own stack, then the stack
// pointer swapped); elsewhere ucontext, whose swapcontext also saves the signal mask (a
// system call a switch, so several times slower). Stacks come from a pool shared by the
// launches, so a block does not map and unmap its threads' stacks.
#ifndef Q3_SIMT_CONTEXT_H
#define Q3_SIMT_CONTEXT_H

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

// `n` stacks of stack_bytes() each, from the pool; back to it
void **stacks_acquire(int n);
void stacks_release(void **stacks, int n);
size_t stack_bytes();

} // namespace simt

#endif
