// Fiber contexts and their stacks (context.h).
#include <fenv.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>
#include <vector>

#include <cuda_runtime.h> // the executor's: its simt.h declares the stacks' geometry

#include "context.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

#if defined(__x86_64__)
// q3_simt_switch(save, load): pushes the callee-saved registers, stores the stack pointer in
// *save, loads `load`, pops them back, returns into the other context. The floating-point
// control words (MXCSR, the x87 control word) are not switched: every fiber of a block runs
// with the defaults, which run_block sets once for the whole block (context.h). A new context
// starts in q3_simt_entry with entry in r12 and its argument in r13.
extern "C" void q3_simt_switch(void **save, void *load);
extern "C" void q3_simt_entry();
asm(R"(
    .text
    .globl q3_simt_switch
    .type q3_simt_switch, @function
q3_simt_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size q3_simt_switch, .-q3_simt_switch

    .globl q3_simt_entry
    .type q3_simt_entry, @function
q3_simt_entry:
    movq %r13, %rdi
    callq *%r12
    ud2
    .size q3_simt_entry, .-q3_simt_entry
)");
#endif

namespace simt {

#if defined(__x86_64__)
void context_make(Context *c, void *stack, size_t bytes, void (*entry)(void *), void *arg) {
    // from the 16-byte aligned top: the return address (q3_simt_entry), rbp, rbx, r12 = entry,
    // r13 = arg, r14, r15; after the `ret`, rsp is the aligned top, as a call expects before
    // it pushes its return address
    uintptr_t top = ((uintptr_t)stack + bytes) & ~(uintptr_t)15;
    uint64_t *slot = (uint64_t *)top;
    slot[-1] = (uint64_t)(uintptr_t)&q3_simt_entry;
    slot[-2] = 0;                      // rbp
    slot[-3] = 0;                      // rbx
    slot[-4] = (uint64_t)(uintptr_t)entry; // r12
    slot[-5] = (uint64_t)(uintptr_t)arg;   // r13
    slot[-6] = 0;                      // r14
    slot[-7] = 0;                      // r15
    c->sp = &slot[-7];
}

void context_switch(Context *from, Context *to) { q3_simt_switch(&from->sp, to->sp); }
#else
static void trampoline(unsigned lo_entry, unsigned hi_entry, unsigned lo_arg, unsigned hi_arg) {
    void (*entry)(void *) = (void (*)(void *))(((uintptr_t)hi_entry << 32) | lo_entry);
    entry((void *)(((uintptr_t)hi_arg << 32) | lo_arg));
}

void context_make(Context *c, void *stack, size_t bytes, void (*entry)(void *), void *arg) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = bytes;
    c->uc.uc_link = nullptr;
    const uintptr_t e = (uintptr_t)entry, a = (uintptr_t)arg;
    makecontext(&c->uc, (void (*)())trampoline, 4, (unsigned)e, (unsigned)(e >> 32), (unsigned)a,
                (unsigned)(a >> 32));
}

void context_switch(Context *from, Context *to) { swapcontext(&from->uc, &to->uc); }
#endif

FloatControl float_control_defaults() {
    FloatControl saved;
    fegetenv(&saved.env);
    fesetenv(FE_DFL_ENV);
    return saved;
}

void float_control_restore(const FloatControl &saved) { fesetenv(&saved.env); }

// ---- stacks ------------------------------------------------------------------------------------

uintptr_t g_stack_base_mask; // simt.h

size_t stack_bytes() {
    static const size_t bytes = [] {
        const char *env = getenv("Q3_SIMT_STACK_KB");
#if defined(__SANITIZE_ADDRESS__)
        const size_t kb = env ? strtoul(env, nullptr, 10) : 256; // frames with redzones
#else
        const size_t kb = env ? strtoul(env, nullptr, 10) : 128; // 94 KiB or more left below the color (block.cpp)
#endif
        unsigned shift = 14; // the next power of two, 16 KiB at least (stacks are aligned to their size: simt.h)
        while (((size_t)1 << shift) < kb * 1024 && shift < 30) shift++;
        g_stack_base_mask = ~(((uintptr_t)1 << shift) - 1);
        return (size_t)1 << shift;
    }();
    return bytes;
}

static std::mutex g_pool_mutex;
static std::vector<void *> g_pool;

void **stacks_acquire(int n) {
    void **out = (void **)malloc((size_t)n * sizeof(void *));
    if (!out) return nullptr;
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    for (int i = 0; i < n; i++) {
        if (!g_pool.empty()) {
            out[i] = g_pool.back();
            g_pool.pop_back();
        } else if (posix_memalign(&out[i], stack_bytes(), stack_bytes()) != 0) {
            for (int j = 0; j < i; j++) g_pool.push_back(out[j]);
            free(out);
            return nullptr;
        }
    }
    return out;
}

void stacks_release(void **stacks, int n) {
    if (!stacks) return;
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    for (int i = 0; i < n; i++) {
#if defined(__SANITIZE_ADDRESS__)
        // a fiber that ended by switching away left its frames' poisoning behind
        __asan_unpoison_memory_region(stacks[i], stack_bytes());
#endif
        g_pool.push_back(stacks[i]);
    }
    free(stacks);
}

} // namespace simt
