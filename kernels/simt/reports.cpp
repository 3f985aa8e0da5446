// What the SIMT executor reports beyond its own checks (block.cpp, launch.cpp):
//  - a misaligned access: the executor is compiled with -fsanitize=alignment (setup.py), and
//    the check's handler is this one, not UBSan's runtime, so a kernel's load or store at an
//    address not aligned to its type (a uint4 at an odd offset) fails the launch as the
//    hardware's "misaligned address" does, with the kernel, block, thread and source line;
//  - an abort inside a kernel (a sanitizer's report in the sanitized build, which aborts):
//    a SIGABRT handler, installed at the first launch and chained to the one before it,
//    prints the kernel, block and thread the report came from.
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <mutex>

#include "block.h"

// ---- -fsanitize=alignment ------------------------------------------------------------------------

namespace {
// the compiler's description of a checked access (the layout UBSan's runtime reads)
struct SourceLocation {
    const char *file;
    uint32_t line, column;
};
struct TypeDescriptor {
    uint16_t kind, info;
    char name[1];
};
struct TypeMismatchData {
    SourceLocation loc;
    const TypeDescriptor *type;
    unsigned char log_alignment, check_kind;
};
} // namespace

// hidden: calls from this library bind here even where UBSan's runtime is loaded too
extern "C" __attribute__((visibility("hidden"))) void __ubsan_handle_type_mismatch_v1(TypeMismatchData *d,
                                                                                     uintptr_t pointer) {
    static const char *const kinds[] = {"load of", "store to", "reference to", "member access in", "member call on",
                                        "constructor call on", "downcast of", "downcast of", "upcast of",
                                        "cast to virtual base of", "nonnull binding to", "dynamic operation on"};
    const char *kind = d->check_kind < sizeof kinds / sizeof kinds[0] ? kinds[d->check_kind] : "access to";
    if (!pointer) simt::fail("%s:%u: %s a null pointer of type %s", d->loc.file, d->loc.line, kind, d->type->name);
    simt::fail("%s:%u: %s misaligned address %p of type %s, which needs %u-byte alignment (on a GPU: misaligned "
               "address)", d->loc.file, d->loc.line, kind, (void *)pointer, d->type->name, 1u << d->log_alignment);
}

// ---- aborts inside a kernel ----------------------------------------------------------------------

namespace simt {

static struct sigaction g_previous;

static void on_abort(int sig) {
    char where_[256], line[320];
    if (where(where_, sizeof where_)) {
        const int n = snprintf(line, sizeof line, "simt: aborted in %s\n", where_);
        if (n > 0 && write(2, line, (size_t)n) < 0) { /* nothing more to do */
        }
    }
    sigaction(SIGABRT, &g_previous, nullptr); // the previous handler (or the default) runs next
    raise(sig);
}

void report_aborts() {
    static std::once_flag once;
    std::call_once(once, [] {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_abort;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGABRT, &sa, &g_previous);
    });
}

} // namespace simt
