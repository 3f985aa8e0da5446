/* The installed device backend (device_backend.h): one per process, set by the backend. */
#include "device_backend.h"

static const q3_device_backend *installed;

void q3_device_backend_install(const q3_device_backend *b) { installed = b; }

const q3_device_backend *q3_device(void) { return installed; }
