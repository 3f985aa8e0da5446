/* Test entries for the FP8 kernels (kernels/fp8.h, kernels/cpu/matmul_fp8.c), not yet used by
 * the layer, and for the dense matmul they are measured against: buffers in (numpy arrays, bytearrays: anything with the buffer protocol, C
 * contiguous), sizes checked against the shapes, the kernel of the active CPU path called. */
#include <stdlib.h>

#include "../engine/cpu_dispatch.h"
#include "py_glue.h"

/* acquire `obj` as a contiguous buffer of at least `need` bytes (writable if asked) */
static int get_buf(PyObject *obj, const char *arg, Py_buffer *b, int64_t need, int writable) {
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if ((int64_t)b->len < need) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected at least %lld", arg, b->len, (long long)need);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* _fp8_to_f32(src, dst): dst [n] fp32 <- the e4m3 bytes src [n], the scalar conversion */
static PyObject *fp8_to_f32(PyObject *m, PyObject *args) {
    PyObject *src_obj, *dst_obj;
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "OO:_fp8_to_f32", &src_obj, &dst_obj)) return NULL;
    if (get_buf(src_obj, "src", &src, 0, 0) < 0) return NULL;
    if (get_buf(dst_obj, "dst", &dst, (int64_t)src.len * 4, 1) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < src.len; i++) ((float *)dst.buf)[i] = q3_e4m3_to_f32(((const uint8_t *)src.buf)[i]);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

/* _f32_to_fp8(src, dst): dst [n] e4m3 bytes <- the fp32 values src [n], q3_f32_to_e4m3 */
static PyObject *f32_to_fp8(PyObject *m, PyObject *args) {
    PyObject *src_obj, *dst_obj;
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "OO:_f32_to_fp8", &src_obj, &dst_obj)) return NULL;
    if (get_buf(src_obj, "src", &src, 0, 0) < 0) return NULL;
    if (get_buf(dst_obj, "dst", &dst, (int64_t)src.len / 4, 1) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < src.len / 4; i++) ((uint8_t *)dst.buf)[i] = q3_f32_to_e4m3(((const float *)src.buf)[i]);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

/* _fp8_matmul(y, x, w, scale, scale_dtype, T, N, K, accumulate=0, dequant=0): y [T, N] (+)=
 * x [T, K] W^T by the active path's matmul_fp8; dequant=1 instead writes y [N, K] = W with
 * the scalar reference q3_fp8_dequant_rows (x unused) */
static PyObject *fp8_matmul(PyObject *m, PyObject *args) {
    PyObject *y_obj, *x_obj, *w_obj, *s_obj, *sdt_obj;
    long long T, N, K;
    int acc = 0, dequant = 0;
    if (!PyArg_ParseTuple(args, "OOOOOLLL|ii:_fp8_matmul", &y_obj, &x_obj, &w_obj, &s_obj, &sdt_obj, &T, &N, &K,
                          &acc, &dequant))
        return NULL;
    q3_dtype sdt;
    if (q3_parse_dtype(sdt_obj, "scale_dtype", &sdt) < 0) return NULL;
    if (T < 0 || N < 0 || K < 0 || T > (1 << 20) || N > (1 << 20) || K > (1 << 20))
        return PyErr_Format(PyExc_ValueError, "T, N, K: expected each 0 to 2^20, got %lld, %lld, %lld", T, N, K);
    Py_buffer y, x, w, s;
    if (get_buf(y_obj, "y", &y, 4 * (dequant ? N * K : T * N), 1) < 0) return NULL;
    if (get_buf(x_obj, "x", &x, dequant ? 0 : 4 * T * K, 0) < 0) goto fail_y;
    if (get_buf(w_obj, "w", &w, N * K, 0) < 0) goto fail_x;
    if (get_buf(s_obj, "scale", &s, q3_fp8_blocks(N) * q3_fp8_blocks(K) * (int64_t)q3_dtype_size(sdt), 0) < 0)
        goto fail_w;
    float *scratch = NULL;
    const int threads = q3_max_threads();
    const int64_t n_scratch = dequant ? 0 : threads * q3_matmul_fp8_scratch_floats(T, K);
    if (n_scratch && !(scratch = malloc((size_t)n_scratch * sizeof(float)))) {
        PyErr_NoMemory();
        goto fail_s;
    }
    Py_BEGIN_ALLOW_THREADS
    if (dequant)
        q3_fp8_dequant_rows(y.buf, w.buf, s.buf, sdt, 0, N, K);
    else
        q3_cpu_ops_active()->matmul_fp8(y.buf, x.buf, w.buf, s.buf, sdt, T, N, K, acc, scratch, threads);
    Py_END_ALLOW_THREADS
    free(scratch);
    PyBuffer_Release(&s);
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    Py_RETURN_NONE;
fail_s:
    PyBuffer_Release(&s);
fail_w:
    PyBuffer_Release(&w);
fail_x:
    PyBuffer_Release(&x);
fail_y:
    PyBuffer_Release(&y);
    return NULL;
}

/* _matmul_dense(y, x, w, w_dtype, T, N, K): y [T, N] = x [T, K] W^T by the active path's
 * fp32/bf16 matmul, with the bf16 scratch the layer gives it: the FP8 kernel's yardstick */
static PyObject *matmul_dense(PyObject *m, PyObject *args) {
    PyObject *y_obj, *x_obj, *w_obj, *wdt_obj;
    long long T, N, K;
    if (!PyArg_ParseTuple(args, "OOOOLLL:_matmul_dense", &y_obj, &x_obj, &w_obj, &wdt_obj, &T, &N, &K)) return NULL;
    q3_dtype wdt;
    if (q3_parse_dtype(wdt_obj, "w_dtype", &wdt) < 0) return NULL;
    if (T < 0 || N < 0 || K < 0 || T > (1 << 20) || N > (1 << 20) || K > (1 << 20))
        return PyErr_Format(PyExc_ValueError, "T, N, K: expected each 0 to 2^20, got %lld, %lld, %lld", T, N, K);
    Py_buffer y, x, w;
    if (get_buf(y_obj, "y", &y, 4 * T * N, 1) < 0) return NULL;
    if (get_buf(x_obj, "x", &x, 4 * T * K, 0) < 0) goto fail_y;
    if (get_buf(w_obj, "w", &w, N * K * (int64_t)q3_dtype_size(wdt), 0) < 0) goto fail_x;
    uint16_t *xb = malloc((size_t)q3_matmul_scratch_elems(T, K) * sizeof(uint16_t) + 1);
    if (!xb) {
        PyErr_NoMemory();
        goto fail_w;
    }
    Py_BEGIN_ALLOW_THREADS
    q3_cpu_ops_active()->matmul(y.buf, x.buf, w.buf, wdt, T, N, K, 0, xb);
    Py_END_ALLOW_THREADS
    free(xb);
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    Py_RETURN_NONE;
fail_w:
    PyBuffer_Release(&w);
fail_x:
    PyBuffer_Release(&x);
fail_y:
    PyBuffer_Release(&y);
    return NULL;
}

PyMethodDef q3_fp8_methods[] = {
    {"_matmul_dense", matmul_dense, METH_VARARGS,
     "_matmul_dense(y, x, w, w_dtype, T, N, K)\n--\n\nTest entry: the fp32/bf16 matmul of the active CPU path."},
    {"_fp8_to_f32", fp8_to_f32, METH_VARARGS, "_fp8_to_f32(src, dst)\n--\n\nTest entry: e4m3 bytes to fp32."},
    {"_f32_to_fp8", f32_to_fp8, METH_VARARGS,
     "_f32_to_fp8(src, dst)\n--\n\nTest entry: fp32 to e4m3 bytes, round to nearest even, NaN past 464."},
    {"_fp8_matmul", fp8_matmul, METH_VARARGS,
     "_fp8_matmul(y, x, w, scale, scale_dtype, T, N, K, accumulate=0, dequant=0)\n--\n\n"
     "Test entry: the block-scaled e4m3 matmul of the active CPU path (or the scalar dequantization)."},
    {NULL},
};
