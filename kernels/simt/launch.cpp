// A launch on the SIMT executor: the configuration checked as the hardware checks it (block
// size, grid size, shared memory against the kernel's attributes), then every block run by
// run_block, blocks spread over a few OS threads (they share nothing but global memory and
// atomics, as on hardware). The first failing block fails the launch.
#include <stdio.h>
#include <stdlib.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "block.h"

namespace simt {

static std::atomic<int> g_schedule{FORWARD};
static std::atomic<uint64_t> g_seed{0};

extern "C" void q3_simt_set_schedule(int schedule, uint64_t seed) {
    g_schedule = schedule;
    g_seed = seed;
}
int schedule_kind() { return g_schedule; }
uint64_t schedule_seed() { return g_seed; }

// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, n)
static std::mutex g_attr_mutex;
static std::unordered_map<const void *, int> g_max_dynamic_shared;

extern "C" cudaError_t cudaFuncSetAttribute(const void *func, enum cudaFuncAttribute attr, int value) {
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess; // no other is modelled
    if (value < 0 || value > 227 * 1024) {
        record_error(cudaErrorInvalidValue, "cudaFuncSetAttribute: MaxDynamicSharedMemorySize " +
                                                std::to_string(value) + " past the 227 KiB a block may have");
        return cudaErrorInvalidValue;
    }
    std::lock_guard<std::mutex> lock(g_attr_mutex);
    g_max_dynamic_shared[func] = value;
    return cudaSuccess;
}

static int max_dynamic_shared(const void *kernel) {
    std::lock_guard<std::mutex> lock(g_attr_mutex);
    auto it = g_max_dynamic_shared.find(kernel);
    return it == g_max_dynamic_shared.end() ? 48 * 1024 : it->second;
}

static std::string config_error(const Launch *l) {
    char buf[300];
    const dim3 g = l->grid, b = l->block;
    const unsigned long long threads = (unsigned long long)b.x * b.y * b.z;
    if (threads == 0 || threads > 1024 || b.z > 64)
        snprintf(buf, sizeof buf, "block of (%u, %u, %u) = %llu threads (expected 1 to 1024, z at most 64)", b.x,
                 b.y, b.z, threads);
    else if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 2147483647u || g.y > 65535 || g.z > 65535)
        snprintf(buf, sizeof buf, "grid of (%u, %u, %u) blocks (expected x 1 to 2^31 - 1, y and z 1 to 65535)",
                 g.x, g.y, g.z);
    else if (l->dynamic_shared > (size_t)max_dynamic_shared(l->kernel))
        snprintf(buf, sizeof buf, "%zu bytes of dynamic shared memory, past the kernel's limit of %d (48 KiB "
                 "unless cudaFuncSetAttribute(MaxDynamicSharedMemorySize) raises it, 227 KiB at most)",
                 l->dynamic_shared, max_dynamic_shared(l->kernel));
    else
        return "";
    return buf;
}

static int workers(unsigned long long blocks) {
    const char *env = getenv("Q3_SIMT_WORKERS");
    int n = env ? atoi(env) : (int)std::thread::hardware_concurrency();
    if (n < 1) n = 1;
    return blocks < (unsigned long long)n ? (int)blocks : n;
}

int run_launch(const Launch *l) {
    report_aborts();
    const std::string bad = config_error(l);
    if (!bad.empty()) {
        record_error(cudaErrorInvalidConfiguration, std::string("kernel ") + l->name + ": launch with " + bad);
        return cudaErrorInvalidConfiguration;
    }
    const unsigned long long blocks = (unsigned long long)l->grid.x * l->grid.y * l->grid.z;
    const int schedule = schedule_kind();
    const uint64_t seed = schedule_seed();
    std::atomic<unsigned long long> next{0};
    std::atomic<bool> failed{false};
    std::mutex first_error_mutex;
    std::string first_error;
    auto work = [&]() {
        Block b{};
        for (;;) {
            const unsigned long long i = next++;
            if (i >= blocks || failed) return;
            b.launch = l;
            b.idx = make_uint3((unsigned)(i % l->grid.x), (unsigned)(i / l->grid.x % l->grid.y),
                               (unsigned)(i / ((unsigned long long)l->grid.x * l->grid.y)));
            b.dim = l->block;
            b.threads = (int)(l->block.x * l->block.y * l->block.z);
            b.static_bytes = 0;
            b.error.clear();
            b.dynamic = nullptr;
            if (l->dynamic_shared && posix_memalign(&b.dynamic, 128, l->dynamic_shared) != 0) {
                b.error = "out of host memory for dynamic shared memory";
            } else {
                if (b.dynamic) __builtin_memset(b.dynamic, 0xA5, l->dynamic_shared);
                run_block(&b, schedule, seed);
            }
            free(b.dynamic);
            if (!b.error.empty()) {
                std::lock_guard<std::mutex> lock(first_error_mutex);
                if (!failed.exchange(true)) first_error = b.error;
                return;
            }
        }
    };
    const int n = workers(blocks);
    std::vector<std::thread> pool;
    for (int w = 1; w < n; w++) pool.emplace_back(work);
    work();
    for (std::thread &t : pool) t.join();
    if (failed) {
        record_error(cudaErrorLaunchFailure, first_error);
        return cudaErrorLaunchFailure;
    }
    return cudaSuccess;
}

int submit(Launch *launch, void *stream) {
    if (capture_launch(stream, launch)) return cudaSuccess; // the graph owns it now
    const int code = run_launch(launch);
    launch->free_args(launch->args);
    return code;
}

} // namespace simt
