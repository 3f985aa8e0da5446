/* Test entries for the FP8 kernels (kernels/fp8.h, kernels/cpu/matmul_fp8.c) and the dense
 * matmul they are measured against: buffers in (numpy arrays, bytearrays: anything with the
 * buffer protocol, C contiguous), sizes checked against the shapes, then the harness's entry
 * (csrc/check/entries.c) runs the kernel of the active CPU path. */
#include "../check/q3_check.h"
#include "py_testing.h"

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

/* T, N, K of a matmul: each 0 to 2^20 */
static int check_sizes(long long T, long long N, long long K) {
    if (T >= 0 && N >= 0 && K >= 0 && T <= (1 << 20) && N <= (1 << 20) && K <= (1 << 20)) return 0;
    PyErr_Format(PyExc_ValueError, "T, N, K: expected each 0 to 2^20, got %lld, %lld, %lld", T, N, K);
    return -1;
}

/* fp8_to_f32(src, dst): dst [n] fp32 <- the e4m3 bytes src [n], the scalar conversion;
 * f32_to_fp8(src, dst): dst [n] e4m3 bytes <- the fp32 values src [n] */
static PyObject *convert(PyObject *args, const char *format, int to_fp8) {
    PyObject *src_obj, *dst_obj;
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, format, &src_obj, &dst_obj)) return NULL;
    if (get_buf(src_obj, "src", &src, 0, 0) < 0) return NULL;
    const int64_t n = to_fp8 ? (int64_t)src.len / 4 : (int64_t)src.len;
    if (get_buf(dst_obj, "dst", &dst, to_fp8 ? n : 4 * n, 1) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (to_fp8) q3_check_f32_to_e4m3(dst.buf, src.buf, n);
    else q3_check_e4m3_to_f32(dst.buf, src.buf, n);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

static PyObject *fp8_to_f32(PyObject *m, PyObject *args) { return convert(args, "OO:fp8_to_f32", 0); }
static PyObject *f32_to_fp8(PyObject *m, PyObject *args) { return convert(args, "OO:f32_to_fp8", 1); }

/* fp8_matmul(y, x, w, scale, scale_dtype, T, N, K, accumulate=0, dequant=0): y [T, N] (+)=
 * x [T, K] W^T by the active path's matmul_fp8; dequant=1 instead writes y [N, K] = W with
 * the scalar reference dequantization (x unused) */
static PyObject *fp8_matmul(PyObject *m, PyObject *args) {
    PyObject *y_obj, *x_obj, *w_obj, *s_obj, *sdt_obj;
    long long T, N, K;
    int acc = 0, dequant = 0;
    if (!PyArg_ParseTuple(args, "OOOOOLLL|ii:fp8_matmul", &y_obj, &x_obj, &w_obj, &s_obj, &sdt_obj, &T, &N, &K,
                          &acc, &dequant))
        return NULL;
    q3_dtype sdt;
    if (q3_parse_dtype(sdt_obj, "scale_dtype", &sdt) < 0 || check_sizes(T, N, K) < 0) return NULL;
    Py_buffer y, x, w, s;
    if (get_buf(y_obj, "y", &y, 4 * (dequant ? N * K : T * N), 1) < 0) return NULL;
    if (get_buf(x_obj, "x", &x, dequant ? 0 : 4 * T * K, 0) < 0) goto fail_y;
    if (get_buf(w_obj, "w", &w, N * K, 0) < 0) goto fail_x;
    if (get_buf(s_obj, "scale", &s, q3_check_fp8_scales(N, K) * (int64_t)q3_dtype_size(sdt), 0) < 0)
        goto fail_w;
    q3_error err;
    q3_status st = Q3_OK;
    Py_BEGIN_ALLOW_THREADS
    if (dequant) q3_check_fp8_dequant(y.buf, w.buf, s.buf, sdt, N, K);
    else st = q3_check_matmul_fp8(y.buf, x.buf, w.buf, s.buf, sdt, T, N, K, acc, &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&s);
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    if (st != Q3_OK) return q3_raise(NULL, &err);
    Py_RETURN_NONE;
fail_w:
    PyBuffer_Release(&w);
fail_x:
    PyBuffer_Release(&x);
fail_y:
    PyBuffer_Release(&y);
    return NULL;
}

/* matmul_dense(y, x, w, w_dtype, T, N, K, accumulate=0): y [T, N] (+)= x [T, K] W^T by the
 * active path's fp32/bf16 matmul, with the bf16 scratch the layer gives it: the FP8 kernel's
 * yardstick, and the paths' matmuls against each other */
static PyObject *matmul_dense(PyObject *m, PyObject *args) {
    PyObject *y_obj, *x_obj, *w_obj, *wdt_obj;
    long long T, N, K;
    int accumulate = 0;
    if (!PyArg_ParseTuple(args, "OOOOLLL|p:matmul_dense", &y_obj, &x_obj, &w_obj, &wdt_obj, &T, &N, &K, &accumulate))
        return NULL;
    q3_dtype wdt;
    if (q3_parse_dtype(wdt_obj, "w_dtype", &wdt) < 0 || check_sizes(T, N, K) < 0) return NULL;
    Py_buffer y, x, w;
    if (get_buf(y_obj, "y", &y, 4 * T * N, 1) < 0) return NULL;
    if (get_buf(x_obj, "x", &x, 4 * T * K, 0) < 0) goto fail_y;
    if (get_buf(w_obj, "w", &w, N * K * (int64_t)q3_dtype_size(wdt), 0) < 0) goto fail_x;
    q3_error err;
    q3_status st;
    Py_BEGIN_ALLOW_THREADS
    st = q3_check_matmul_dense(y.buf, x.buf, w.buf, wdt, T, N, K, accumulate, &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    if (st != Q3_OK) return q3_raise(NULL, &err);
    Py_RETURN_NONE;
fail_x:
    PyBuffer_Release(&x);
fail_y:
    PyBuffer_Release(&y);
    return NULL;
}

PyMethodDef q3py_fp8_methods[] = {
    {"matmul_dense", matmul_dense, METH_VARARGS,
     "matmul_dense(y, x, w, w_dtype, T, N, K, accumulate=0)\n--\n\nThe fp32/bf16 matmul of the active CPU path."},
    {"fp8_to_f32", fp8_to_f32, METH_VARARGS, "fp8_to_f32(src, dst)\n--\n\ne4m3 bytes to fp32."},
    {"f32_to_fp8", f32_to_fp8, METH_VARARGS,
     "f32_to_fp8(src, dst)\n--\n\nfp32 to e4m3 bytes, round to nearest even, NaN past 464."},
    {"fp8_matmul", fp8_matmul, METH_VARARGS,
     "fp8_matmul(y, x, w, scale, scale_dtype, T, N, K, accumulate=0, dequant=0)\n--\n\n"
     "The block-scaled e4m3 matmul of the active CPU path (or the scalar dequantization)."},
    {NULL},
};
