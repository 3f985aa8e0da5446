/* The CUDA backend's door: libq3cuda.so (a GPU) or libq3simt.so (the same kernels on the
 * CPU's SIMT executor) is opened (dlopen) the first time a CUDA device is asked for, and its
 * one entry point fills the table of launchers (kernels/cuda/ops_cuda.h). Opened, it installs
 * itself as the engine's device backend: device memory for caches and the forward of CUDA
 * layers. One backend a process. Nothing here needs CUDA headers or libraries. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "../engine/device_backend.h"
#include "backend.h"
#include "passes.h"
#include "split_rows.h"

static q3_cuda_ops table;
static int opened;
static char opened_path[4096];
/* the SIMT executor's schedule switch (kernels/simt/simt.h), where the library has one */
static void (*set_schedule)(int schedule, uint64_t seed);

/* n zeroed bytes on the device, ready when this returns */
static void *device_alloc_zeroed(size_t n, int device) {
    void *p = NULL;
    if (table.set_device(device) || table.malloc_device(&p, n ? n : 1)) return NULL;
    if (table.memset_async(p, 0, n, NULL) || table.synchronize()) {
        table.free_device(p);
        return NULL;
    }
    return p;
}

static void device_free(void *p) { table.free_device(p); }

static q3_status device_copy_2d(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t width,
                                size_t rows, int device, void *stream, q3_error *err) {
    int code = table.set_device(device);
    if (!code) code = table.copy_2d_device_async(dst, dst_pitch, src, src_pitch, width, rows, stream);
    if (!code) return Q3_OK;
    return q3_fail(err, Q3_ERR_STATE, "cuda: a device copy of %zu rows of %zu bytes on device %d failed: %s", rows,
                   width, device, table.error_string(code));
}

static q3_status device_synchronize(int device, void *stream, q3_error *err) {
    int code = table.set_device(device);
    if (!code) code = stream ? table.stream_synchronize(stream) : table.synchronize();
    if (!code) return Q3_OK;
    return q3_fail(err, Q3_ERR_STATE, "cuda: synchronizing device %d failed: %s", device, table.error_string(code));
}

static q3_status device_copy_to_host(void *dst, const void *src, size_t bytes, int device, q3_error *err) {
    int code = table.set_device(device);
    if (!code) code = table.synchronize();
    if (!code && bytes) code = table.copy(dst, src, bytes, 0);
    return code ? q3_fail(err, Q3_ERR_STATE, "%s", table.error_string(code)) : Q3_OK;
}

static const q3_device_backend cuda_device = {
    .alloc_zeroed = device_alloc_zeroed,
    .free = device_free,
    .upload = q3_device_upload,
    .weight_align = Q3_CUDA_WEIGHT_ALIGN,
    .copy_2d = device_copy_2d,
    .synchronize = device_synchronize,
    .copy_to_host = device_copy_to_host,
    .layer_forward = q3_layer_forward_cuda,
    .layer_attention_half = q3_layer_attention_half_cuda,
    .layer_expert_half = q3_layer_expert_half_cuda,
    .take_rows = q3_take_rows_cuda,
    .combine_rows = q3_combine_rows_cuda,
    .layer_release = q3_layer_cuda_release,
    .layer_workspace_bytes = q3_layer_cuda_workspace_bytes,
    .layer_config_check = q3_layer_cuda_config_check,
};

q3_status q3_cuda_open(const char *path, int *devices, q3_error *err) {
    *devices = 0;
    if (opened && strcmp(path, opened_path) == 0) {
        *devices = q3_cuda_device_count();
        return Q3_OK;
    }
    if (opened)
        return q3_fail(err, Q3_ERR_STATE, "cuda: %s is the CUDA backend of this process already; cannot also open %s "
                       "(one backend a process: call qwen3layer.cuda.emulate() before any CUDA device is used, or "
                       "in a new process)", opened_path, path);
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) return q3_fail(err, Q3_ERR_STATE, "cuda: cannot load %s: %s", path, dlerror());
    q3_cuda_ops found;
    int (*get)(q3_cuda_ops *) = (int (*)(q3_cuda_ops *))dlsym(lib, "q3_cuda_ops_get");
    if (!get || get(&found) != 0) {
        dlclose(lib);
        return q3_fail(err, Q3_ERR_STATE, "cuda: %s has no usable q3_cuda_ops_get", path);
    }
    int n = 0;
    if (found.device_count(&n) != 0 || n <= 0) {
        /* no device: not the backend. The library stays loaded (its CUDA runtime has run;
         * unloading it is not worth the risk), only this open's reference is dropped when an
         * earlier open holds one. */
        static void *without_devices;
        if (lib == without_devices) dlclose(lib);
        without_devices = lib;
        return Q3_OK;
    }
    *devices = n;
    table = found;
    set_schedule = (void (*)(int, uint64_t))dlsym(lib, "q3_simt_set_schedule");
    snprintf(opened_path, sizeof opened_path, "%s", path);
    opened = 1;
    q3_device_backend_install(&cuda_device);
    return Q3_OK;
}

int q3_cuda_schedules(void) { return set_schedule ? 3 : 1; }

q3_status q3_cuda_set_schedule(int schedule, uint64_t seed, q3_error *err) {
    if (schedule < 0 || schedule >= q3_cuda_schedules())
        return q3_fail(err, Q3_ERR_VALUE, "schedule: expected 0 to %d (this backend's), got %d",
                       q3_cuda_schedules() - 1, schedule);
    if (set_schedule) set_schedule(schedule, seed);
    return Q3_OK;
}

const q3_cuda_ops *q3_cuda(void) { return opened ? &table : NULL; }

int q3_cuda_device_count(void) {
    int n = 0;
    if (!opened || table.device_count(&n) != 0) return 0;
    return n;
}
