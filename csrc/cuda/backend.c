/* The CUDA backend's door: libq3cuda.so is opened (dlopen) the first time a CUDA device is
 * asked for, and its one entry point fills the table of launchers (kernels/cuda/ops_cuda.h).
 * Opened (or given a table), it installs itself as the engine's device backend: device
 * memory for caches and the forward of CUDA layers. Nothing here needs CUDA headers or
 * libraries. */
#include <dlfcn.h>
#include <stdio.h>

#include "../engine/device_backend.h"
#include "backend.h"
#include "layer.h"

static q3_cuda_ops table;
static int opened;

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

static const q3_device_backend cuda_device = {
    device_alloc_zeroed, device_free, q3_layer_forward_cuda, q3_layer_cuda_release, q3_layer_cuda_workspace_bytes,
};

q3_status q3_cuda_open(const char *path, q3_error *err) {
    if (opened) return Q3_OK;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) return q3_fail(err, Q3_ERR_STATE, "cuda: cannot load %s: %s", path, dlerror());
    int (*get)(q3_cuda_ops *) = (int (*)(q3_cuda_ops *))dlsym(lib, "q3_cuda_ops_get");
    if (!get || get(&table) != 0) {
        dlclose(lib);
        return q3_fail(err, Q3_ERR_STATE, "cuda: %s has no usable q3_cuda_ops_get", path);
    }
    opened = 1;
    q3_device_backend_install(&cuda_device);
    return Q3_OK;
}

q3_status q3_cuda_install(const q3_cuda_ops *t, q3_error *err) {
    if (opened) return q3_fail(err, Q3_ERR_STATE, "cuda: a CUDA backend is already in use in this process");
    table = *t;
    opened = 1;
    q3_device_backend_install(&cuda_device);
    return Q3_OK;
}

const q3_cuda_ops *q3_cuda(void) { return opened ? &table : NULL; }

int q3_cuda_device_count(void) {
    int n = 0;
    if (!opened || table.device_count(&n) != 0) return 0;
    return n;
}
