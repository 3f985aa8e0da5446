// One block of a launch: its threads as fibers (context.h) on the calling OS thread, run in
// the schedule's order until each reaches a barrier, a warp primitive or its end; barriers
// release when every thread has arrived at the same one, warp primitives when every lane
// of their mask has. What cannot complete (threads at different barriers, a thread that
// exited while others wait, a lane missing from a warp primitive) fails the block with a
// message naming the kernel, the block and the threads.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <new>

#include "block.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define Q3_SIMT_ASAN 1
#else
#define Q3_SIMT_ASAN 0
#endif

namespace simt {

static thread_local Block *tl_block;
static thread_local Fiber *tl_fiber;

Fiber *current_fiber() { return tl_fiber; }
Block *current_block() { return tl_block; }

bool where(char *buf, size_t n) {
    const Block *b = tl_block;
    if (!b) snprintf(buf, n, "outside a kernel");
    else if (tl_fiber)
        snprintf(buf, n, "kernel %s, block (%u, %u, %u), thread (%u, %u, %u)", b->launch->name, b->idx.x, b->idx.y,
                 b->idx.z, tl_fiber->idx.x, tl_fiber->idx.y, tl_fiber->idx.z);
    else
        snprintf(buf, n, "kernel %s, block (%u, %u, %u)", b->launch->name, b->idx.x, b->idx.y, b->idx.z);
    return b != nullptr;
}

std::string where() {
    char buf[256];
    where(buf, sizeof buf);
    return buf;
}

// ---- switching -------------------------------------------------------------------------------
// The scheduler enters the first fiber of a pass; from then on a fiber that stops (at a
// barrier, a warp primitive, its end) switches straight to the next one the schedule runs
// (next_in_schedule), one switch a step instead of two through the scheduler, and back to the
// scheduler only when the pass ran nothing more, the schedule's order unchanged.

static Fiber *next_in_schedule(Block *b);

// from the scheduler into fiber f, until a fiber switches back to the scheduler
static void enter(Block *b, Fiber *f) {
    b->running = f;
    tl_fiber = f;
    b->from_scheduler = true;
#if Q3_SIMT_ASAN
    __sanitizer_start_switch_fiber(&b->scheduler_fake_stack, f->stack, f->stack_bytes);
#endif
    context_switch(&b->scheduler, &f->context);
#if Q3_SIMT_ASAN
    __sanitizer_finish_switch_fiber(b->scheduler_fake_stack, nullptr, nullptr);
#endif
    tl_fiber = nullptr;
    b->running = nullptr;
}

// in a fiber that has just been switched to
static void arrived(Block *b, Fiber *f) {
#if Q3_SIMT_ASAN
    const void *bottom;
    size_t size;
    __sanitizer_finish_switch_fiber(f->fake_stack, b->from_scheduler ? &b->scheduler_stack_bottom : &bottom,
                                    b->from_scheduler ? &b->scheduler_stack_size : &size);
#else
    (void)b, (void)f;
#endif
}

// from the running fiber, which stopped (done: never to come back), to the next fiber of the
// schedule, or to the scheduler when there is none
static void yield(Block *b, Fiber *f, bool done) {
    Fiber *next = next_in_schedule(b);
    b->running = next;
    tl_fiber = next;
    b->from_scheduler = false;
#if Q3_SIMT_ASAN
    if (next) __sanitizer_start_switch_fiber(done ? nullptr : &f->fake_stack, next->stack, next->stack_bytes);
    else
        __sanitizer_start_switch_fiber(done ? nullptr : &f->fake_stack, b->scheduler_stack_bottom,
                                       b->scheduler_stack_size);
#else
    (void)done;
#endif
    context_switch(&f->context, next ? &next->context : &b->scheduler);
    arrived(b, f);
}

static void fiber_main(void *self) {
    Fiber *f = (Fiber *)self;
    Block *b = tl_block;
    arrived(b, f);
    b->launch->body(b->launch->args);
    f->state = DONE;
    yield(b, f, true);
}

void fail(const char *fmt, ...) {
    Block *b = tl_block;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (b && b->error.empty()) b->error = where() + ": " + msg;
    if (!b || !tl_fiber) { /* outside a fiber: nothing to abandon */
        fprintf(stderr, "simt: %s\n", msg);
        abort();
    }
    Fiber *f = tl_fiber;
    f->state = DONE;
    for (;;) yield(b, f, true); // the scheduler stops the block; this fiber never runs again
}

// ---- barriers ----------------------------------------------------------------------------------

void syncthreads(const char *site) {
    Block *b = tl_block;
    Fiber *f = tl_fiber;
    if (!f) fail("__syncthreads outside a kernel");
    f->state = AT_BARRIER;
    f->site = site;
    yield(b, f, false);
}

// "threads 0-31 at a.cu:10; threads 32-63 exited": who is where, for a failed barrier
static std::string whereabouts(const Block *b) {
    std::string out;
    size_t i = 0;
    while (i < b->fibers.size()) {
        const Fiber &f = b->fibers[i];
        size_t j = i + 1;
        while (j < b->fibers.size() && b->fibers[j].state == f.state &&
               (f.state == DONE || strcmp(b->fibers[j].site, f.site) == 0))
            j++;
        char part[200];
        const char *what = f.state == DONE ? "exited" : f.state == AT_BARRIER ? "at __syncthreads" : "at a warp primitive";
        snprintf(part, sizeof part, "%sthreads %zu-%zu %s%s%s", out.empty() ? "" : "; ", i, j - 1, what,
                 f.state == DONE ? "" : " ", f.state == DONE ? "" : f.site);
        out += part;
        i = j;
    }
    return out;
}

// every thread waits: release a complete barrier, or fail
static bool release_barrier(Block *b) {
    const Fiber *first = nullptr;
    bool exited = false, divergent = false, warp_op = false;
    for (const Fiber &f : b->fibers) {
        if (f.state == DONE) exited = true;
        else if (f.state == IN_WARP_OP) warp_op = true;
        else if (!first) first = &f;
        else if (strcmp(f.site, first->site) != 0) divergent = true;
    }
    if (!first || exited || divergent || warp_op) {
        const char *why = !first ? "a warp primitive that cannot complete (a lane of its mask is missing)"
                          : divergent ? "a divergent barrier (threads wait at different __syncthreads)"
                          : exited ? "a barrier some threads exited before (they never arrive)"
                                   : "a barrier while other threads wait at a warp primitive";
        char buf[160];
        snprintf(buf, sizeof buf, "kernel %s, block (%u, %u, %u): deadlock at %s: ", b->launch->name, b->idx.x,
                 b->idx.y, b->idx.z, why);
        b->error = buf + whereabouts(b);
        return false;
    }
    for (Fiber &f : b->fibers) f.state = READY;
    return true;
}

// ---- warp collectives ----------------------------------------------------------------------------

void warp_sync(Collective kind, unsigned mask, int width, const char *site, void *ctx,
               void (*complete)(void *const ctx[32], unsigned mask)) {
    const ThreadRecord &here = thread_record(); // only kernels call it: always on a fiber's stack
    Block *b = here.block_of;
    Fiber *f = here.fiber;
    const int warp = f->linear / 32, lane = f->linear % 32;
    const int in_warp = std::min(32, b->threads - warp * 32);
    const unsigned existing = in_warp == 32 ? 0xffffffffu : (1u << in_warp) - 1u;
    if (!(mask >> lane & 1u)) fail("%s with mask 0x%08x, which does not name the calling lane %d", site, mask, lane);
    if (mask & ~existing)
        fail("%s with mask 0x%08x naming lanes past the block's last thread (warp %d has lanes 0-%d)", site, mask,
             warp, in_warp - 1);
    if (width != 32 && (width <= 0 || width > 32 || (width & (width - 1))))
        fail("%s with width %d (expected a power of 2 up to 32)", site, width);
    PendingCollective &p = b->warps[(size_t)warp];
    if (!p.open) {
        p.open = true; // (ctx[] of the lanes not arrived is never read)
        p.kind = kind;
        p.width = width;
        p.mask = mask;
        p.arrived = 0;
        p.site = site;
        p.complete = complete;
    } else if (p.kind != kind || p.mask != mask || p.width != width) {
        fail("lanes of warp %d at different warp primitives: this lane at %s (mask 0x%08x), lanes 0x%08x at %s "
             "(mask 0x%08x)", warp, site, mask, p.arrived, p.site, p.mask);
    }
    p.ctx[lane] = ctx;
    p.arrived |= 1u << lane;
    if (p.arrived != p.mask) {
        f->state = IN_WARP_OP;
        f->site = site;
        yield(b, f, false);
        return;
    }
    // the last lane: the collective runs once, for every lane, before anyone goes on
    const unsigned lanes = p.mask;
    p.open = false;
    p.arrived = 0;
    if (p.complete) p.complete(p.ctx, lanes);
    Fiber *lane0 = &b->fibers[(size_t)warp * 32];
    for (unsigned rest = lanes & ~(1u << lane); rest; rest &= rest - 1) lane0[__builtin_ctz(rest)].state = READY;
}

struct LaneValue {
    uint64_t value;
    int arg;
    Collective kind;
    int width;
    uint64_t result;
};

static void complete_values(void *const ctx[32], unsigned mask) {
    LaneValue *v[32];
    for (int l = 0; l < 32; l++) v[l] = (LaneValue *)ctx[l];
    for (int l = 0; l < 32; l++) {
        if (!(mask >> l & 1u)) continue;
        LaneValue *me = v[l];
        const int w = me->width, base = l & ~(w - 1);
        int src = l;
        switch (me->kind) {
        case SHFL_IDX: src = base + ((me->arg % w + w) % w); break;
        case SHFL_UP: src = l - me->arg >= base ? l - me->arg : l; break;
        case SHFL_DOWN: src = l + me->arg < base + w ? l + me->arg : l; break;
        case SHFL_XOR: src = (l ^ me->arg) < base + w && (l ^ me->arg) >= base ? l ^ me->arg : l; break;
        default: break;
        }
        if (me->kind <= SHFL_XOR) {
            // a lane outside the mask gives an undefined value on hardware: here, an error
            if (!(mask >> src & 1u)) {
                me->result = 0;
                me->arg = -1 - src; // reported by the lane itself
            } else {
                me->result = v[src]->value;
            }
            continue;
        }
        unsigned bits = 0;
        for (int o = 0; o < 32; o++)
            if (mask >> o & 1u) {
                if (me->kind == MATCH_ANY) bits |= (unsigned)(v[o]->value == me->value) << o;
                else bits |= (unsigned)(v[o]->value != 0) << o;
            }
        me->result = me->kind == BALLOT || me->kind == MATCH_ANY ? bits
                     : me->kind == ANY                           ? bits != 0
                     : me->kind == ALL                           ? bits == mask
                                                                 : 0;
    }
}

uint64_t warp_collective(Collective kind, unsigned mask, uint64_t value, int arg, int width, const char *site) {
    LaneValue me = {value, arg, kind, width, 0};
    warp_sync(kind, mask, width, site, &me, kind == SYNCWARP ? nullptr : complete_values);
    if (kind <= SHFL_XOR && me.arg < 0)
        fail("%s reads lane %d, which is not in the mask (its value is undefined on hardware)", site, -1 - me.arg);
    return me.result;
}

void warp_all(const char *site, void *ctx, void (*complete)(void *const ctx[32], unsigned mask)) {
    warp_sync(WMMA, 0xffffffffu, 32, site, ctx, complete);
}

void wmma_check(const void *p, unsigned ldm, size_t element_bytes, const char *op) {
    if ((uintptr_t)p % 32)
        fail("%s at %p, which is not 32-byte (256-bit) aligned as the hardware requires", op, p);
    if ((ldm * element_bytes) % 16 || ldm < 16)
        fail("%s with ldm %u: expected at least 16 and a multiple of %zu elements (16 bytes)", op, ldm,
             16 / element_bytes);
}

unsigned active_mask() {
    Block *b = tl_block;
    Fiber *f = tl_fiber;
    const int warp = f->linear / 32;
    unsigned m = 0;
    for (int l = 0; l < 32 && warp * 32 + l < b->threads; l++)
        if (b->fibers[warp * 32 + l].state != DONE) m |= 1u << l;
    return m;
}

// ---- the block's scheduler -----------------------------------------------------------------------
// FORWARD and REVERSE: one step of every ready fiber a pass, in index order or its reverse,
// so the warps go in lockstep. SHUFFLE: the warps in a seeded order, each run (its lanes in a
// seeded order, shuffled again each round) until none of its lanes is ready, i.e. to a
// barrier or its end, before the next: one warp gets a whole barrier interval ahead of the
// others, so a shared buffer overwritten without a barrier while other warps still read it
// shows.

// the lanes of warp_order[c.warp] as the range, in a fresh seeded order
static void shuffle_warp(Block *b) {
    Cursor &c = b->cursor;
    const int first = b->warp_order[(size_t)c.warp] * 32, n = std::min(32, b->threads - first);
    std::shuffle(b->order.begin() + first, b->order.begin() + first + n, b->rng);
    c.pos = first;
    c.end = first + n;
    c.ran_range = false;
}

static void begin_pass(Block *b) {
    Cursor &c = b->cursor;
    c.ran_pass = false;
    if (b->schedule == SHUFFLE) {
        std::shuffle(b->warp_order.begin(), b->warp_order.end(), b->rng);
        c.warp = 0;
        shuffle_warp(b);
    } else {
        c.pos = 0;
        c.end = b->threads;
        c.ran_range = false;
    }
}

// the next fiber the schedule runs; NULL when the block has failed, or when a pass ran no
// fiber (all wait at a barrier or have ended: the scheduler decides), the next pass begun
static Fiber *next_in_schedule(Block *b) {
    Cursor &c = b->cursor;
    while (b->error.empty()) {
        while (c.pos < c.end) {
            Fiber *f = &b->fibers[(size_t)b->order[(size_t)c.pos++]];
            if (f->state == READY) {
                c.ran_range = c.ran_pass = true;
                return f;
            }
        }
        if (b->schedule == SHUFFLE) {
            if (c.ran_range) { // the warp again, until none of its lanes is ready
                shuffle_warp(b);
                continue;
            }
            if (++c.warp < (int)b->warp_order.size()) {
                shuffle_warp(b);
                continue;
            }
        }
        const bool ran = c.ran_pass;
        begin_pass(b);
        if (!ran) return nullptr;
    }
    return nullptr;
}

bool run_block(Block *b, int schedule, uint64_t seed) {
    const size_t bytes = stack_bytes();
    const size_t record_bytes = (sizeof(ThreadRecord) + 63) & ~(size_t)63;
    b->fibers.assign((size_t)b->threads, Fiber{});
    b->warps.assign((size_t)(b->threads + 31) / 32, PendingCollective{});
    void **stacks = stacks_acquire(b->threads);
    if (!stacks) b->error = "simt: cannot make the block's threads (out of host memory for their stacks)";
    tl_block = b;
    for (int i = 0; stacks && i < b->threads; i++) {
        Fiber &f = b->fibers[(size_t)i];
        f.linear = i;
        f.idx = make_uint3((unsigned)i % b->dim.x, (unsigned)i / b->dim.x % b->dim.y,
                           (unsigned)i / (b->dim.x * b->dim.y));
        // the thread's record at the stack's base (simt.h), its frames above it
        new (stacks[i]) ThreadRecord{f.idx, b->idx, b->dim, b->launch->grid, &f, b};
        f.stack_bytes = bytes - record_bytes;
        f.stack = (char *)stacks[i] + record_bytes;
        f.state = READY;
        f.site = "";
        // the frames start below the top by a color of 17 cache lines a thread (32 colors):
        // stacks aligned to their size would otherwise put every thread's top frames in the
        // same cache sets, and each switch would miss
        const size_t color = (size_t)(i % 32) * 17 * 64;
        context_make(&f.context, f.stack, f.stack_bytes - color, fiber_main, &f);
    }
    b->schedule = schedule;
    b->order.resize((size_t)b->threads);
    for (int i = 0; i < b->threads; i++) b->order[(size_t)i] = schedule == REVERSE ? b->threads - 1 - i : i;
    b->warp_order.resize((size_t)(b->threads + 31) / 32);
    for (size_t w = 0; w < b->warp_order.size(); w++) b->warp_order[w] = (int)w;
    b->rng.seed(seed ^ ((uint64_t)b->idx.x * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)b->idx.y << 32) ^ b->idx.z);
    begin_pass(b);
    const FloatControl caller = float_control_defaults(); // for every fiber of the block (context.h)
    while (b->error.empty()) {
        if (Fiber *f = next_in_schedule(b)) {
            enter(b, f); // the fibers run one after another until a pass runs none
            continue;
        }
        if (!b->error.empty()) break;
        if (std::all_of(b->fibers.begin(), b->fibers.end(), [](const Fiber &f) { return f.state == DONE; })) break;
        if (!release_barrier(b)) break;
    }
    float_control_restore(caller);
    stacks_release(stacks, b->threads);
    for (auto &s : b->statics) free(s.second);
    b->statics.clear();
    tl_block = nullptr;
    return b->error.empty();
}

// ---- shared memory -------------------------------------------------------------------------------

void *shared_static(const void *key, size_t bytes, size_t align, const char *name) {
    Block *b = tl_block;
    if (!b) fail("shared variable %s outside a kernel", name);
    for (auto &s : b->statics)
        if (s.first == key) return s.second;
    b->static_bytes += bytes;
    if (b->static_bytes > 48 * 1024)
        fail("static shared memory of %zu bytes with %s (at most 48 KiB a block)", b->static_bytes, name);
    void *p = nullptr;
    if (posix_memalign(&p, align, bytes ? bytes : 1) != 0) fail("out of host memory for shared %s", name);
    memset(p, 0xA5, bytes); // shared memory starts undefined: a read before a write shows
    b->statics.emplace_back(key, p);
    return p;
}

void *shared_dynamic() {
    Block *b = tl_block;
    if (!b) fail("dynamic shared memory outside a kernel");
    return b->dynamic;
}

} // namespace simt
