/* The DLPack C ABI (data interchange between array libraries), declared from the DLPack
 * specification, version 1.x, for what this extension exchanges: CPU (and later CUDA)
 * tensors of float32 and bfloat16, and float8 e4m3fn weights. Struct layouts must match the specification exactly;
 * names carry a q3_ prefix to make clear these are our declarations. */
#ifndef Q3_DLPACK_ABI_H
#define Q3_DLPACK_ABI_H

#include <stdint.h>

/* device types (DLDeviceType) */
enum { Q3_DL_CPU = 1, Q3_DL_CUDA = 2, Q3_DL_CUDA_HOST = 3, Q3_DL_CUDA_MANAGED = 13 };
/* type codes (DLDataTypeCode) */
enum { Q3_DL_INT = 0, Q3_DL_UINT = 1, Q3_DL_FLOAT = 2, Q3_DL_BFLOAT = 4, Q3_DL_COMPLEX = 5, Q3_DL_BOOL = 6 };
/* the 8-bit float codes of DLPack 1.1, in their order (7 .. 14); bits 8, lanes 1 */
enum { Q3_DL_FLOAT8_FIRST = 7, Q3_DL_FLOAT8_E4M3FN = 10, Q3_DL_FLOAT8_LAST = 14 };
/* DLManagedTensorVersioned.flags bits */
#define Q3_DL_FLAG_READ_ONLY ((uint64_t)1 << 0)
#define Q3_DL_FLAG_IS_COPIED ((uint64_t)1 << 1)

/* the version this extension produces (1.1: float8 codes); it consumes any 1.x */
#define Q3_DL_MAJOR 1
#define Q3_DL_MINOR 1

typedef struct {
    int32_t device_type;
    int32_t device_id;
} q3_dl_device;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} q3_dl_dtype;

typedef struct {
    void *data;           /* element [0...0] is at data + byte_offset */
    q3_dl_device device;
    int32_t ndim;
    q3_dl_dtype dtype;
    int64_t *shape;       /* [ndim] */
    int64_t *strides;     /* [ndim] in elements; NULL means compact row-major */
    uint64_t byte_offset;
} q3_dl_tensor;

/* legacy capsule "dltensor" */
typedef struct q3_dl_managed {
    q3_dl_tensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct q3_dl_managed *self);
} q3_dl_managed;

typedef struct {
    uint32_t major;
    uint32_t minor;
} q3_dl_version;

/* versioned capsule "dltensor_versioned" (DLPack >= 1.0) */
typedef struct q3_dl_managed_v {
    q3_dl_version version;
    void *manager_ctx;
    void (*deleter)(struct q3_dl_managed_v *self);
    uint64_t flags;
    q3_dl_tensor dl_tensor;
} q3_dl_managed_v;

#endif
