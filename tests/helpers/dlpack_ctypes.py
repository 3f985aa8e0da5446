"""The DLPack ABI's legacy structs in ctypes, written from the specification, for tests that
act as producers of their own (a tensor at an offset, on a device, with counted deleters):
DLDevice, DLDataType, DLTensor, DLManagedTensor, the deleter's type, and PyCapsule_New to
wrap one as a "dltensor" capsule; and Announcing, a tensor that says when it is imported."""
import ctypes
import threading


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]

capsule_new = ctypes.pythonapi.PyCapsule_New
capsule_new.restype = ctypes.py_object
capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class Announcing:
    """Tensor t, which sets `started` when a consumer (the glue) exports it: a test then knows
    the call has begun."""

    def __init__(self, t, started: threading.Event):
        self.t, self.started = t, started

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()

    def __dlpack__(self, **kw):
        self.started.set()
        return self.t.__dlpack__(**kw)
