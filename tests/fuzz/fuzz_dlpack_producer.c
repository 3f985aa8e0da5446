/* The C half of tests/fuzz/fuzz_dlpack.py's producer: its DLPack deleters and capsule destructor.
 * They must be C: a consumer may call them with a Python exception set (after a rejected
 * tensor), where a ctypes callback would lose it. Built by fuzz_dlpack.py with the system's
 * cc; the structs follow the DLPack specification (1.x), not the project's header.
 *
 * Each managed tensor carries a record (manager_ctx): how often it was released and the
 * blocks (struct, shape, strides, data) to free on the first release. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int calls;
    int n;
    void *blocks[4];
} q3fuzz_record;

typedef struct {
    void *data;
    int32_t device_type, device_id;
    int32_t ndim;
    uint8_t code, bits;
    uint16_t lanes;
    int64_t *shape, *strides;
    uint64_t byte_offset;
} dl_tensor;

typedef struct {
    dl_tensor t;
    void *manager_ctx;
    void (*deleter)(void *self);
} dl_managed;

typedef struct {
    uint32_t major, minor;
    void *manager_ctx;
    void (*deleter)(void *self);
    uint64_t flags;
    dl_tensor t;
} dl_managed_versioned;

/* the CPython capsule functions, from the interpreter that loads this library */
typedef struct _object PyObject;
extern const char *PyCapsule_GetName(PyObject *capsule);
extern void *PyCapsule_GetContext(PyObject *capsule);

static void release(q3fuzz_record *r) {
    if (++r->calls != 1) return;
    for (int i = 0; i < r->n; i++) {
        free(r->blocks[i]);
        r->blocks[i] = NULL;
    }
}

void q3fuzz_delete_legacy(void *self) { release(((dl_managed *)self)->manager_ctx); }
void q3fuzz_delete_versioned(void *self) { release(((dl_managed_versioned *)self)->manager_ctx); }

/* a capsule that nobody consumed (its name is still the one it was made with) releases its
 * tensor; a consumed one was renamed "used_..." and the consumer calls the deleter */
void q3fuzz_capsule_destructor(PyObject *capsule) {
    const char *name = PyCapsule_GetName(capsule);
    if (name && strncmp(name, "used_", 5) != 0) {
        q3fuzz_record *r = PyCapsule_GetContext(capsule);
        if (r) release(r);
    }
}
