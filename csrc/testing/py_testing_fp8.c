/* Test entries for the FP8 kernels (kernels/fp8.h, kernels/cpu/matmul_fp8.c) and the dense
 * matmul they are measured against: buffers in (numpy arrays, bytearrays: anything with the
 * buffer protocol, C contiguous), sizes checked against the shapes, then the harness's entry
 * (csrc/check/entries.c) runs the kernel of the active CPU path. And the e4m3 decoder
 * variants measured against each other (csrc/check/e4m3_decoders.c): e4m3_variants,
 * e4m3_decode, e4m3_gemv, e4m3_dequant. */
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

/* threads (1 to the engine's threads) and repeats (1 to 2^20) of a decoder entry */
static int check_threads_repeats(int threads, int repeats) {
    const int most = q3_max_threads();
    if (threads < 1 || threads > most) {
        PyErr_Format(PyExc_ValueError, "threads: expected 1 to %d, got %d", most, threads);
        return -1;
    }
    if (repeats < 1 || repeats > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "repeats: expected 1 to 2^20, got %d", repeats);
        return -1;
    }
    return 0;
}

/* e4m3_variants(all=False) -> [{'name', 'isa', 'what', 'shipped', 'width', 'runs'}]: the variants
 * this CPU runs, or every one compiled */
static PyObject *e4m3_variants(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"all", NULL};
    int all = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|p:e4m3_variants", names, &all)) return NULL;
    enum { MAX_VARIANTS = 64 };
    q3_e4m3_variant_info info[MAX_VARIANTS];
    int n = q3_check_e4m3_variants(info, MAX_VARIANTS, all);
    n = n < MAX_VARIANTS ? n : MAX_VARIANTS;
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        PyObject *d = Py_BuildValue("{s:s,s:s,s:s,s:z,s:i,s:O}", "name", info[i].name, "isa", info[i].isa, "what",
                                    info[i].what, "shipped", info[i].shipped, "width", info[i].width, "runs",
                                    info[i].runs ? Py_True : Py_False);
        if (!d) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, d);
    }
    return list;
}

/* e4m3_decode(variant, src, dst, fast=False): dst [n] fp32 <- the codes src [n] */
static PyObject *e4m3_decode(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"variant", "src", "dst", "fast", NULL};
    const char *variant;
    PyObject *src_obj, *dst_obj;
    int fast = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOO|p:e4m3_decode", names, &variant, &src_obj, &dst_obj, &fast))
        return NULL;
    Py_buffer src, dst;
    if (get_buf(src_obj, "src", &src, 0, 0) < 0) return NULL;
    const int64_t n = (int64_t)src.len;
    if (get_buf(dst_obj, "dst", &dst, 4 * n, 1) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    q3_error err;
    q3_status st;
    Py_BEGIN_ALLOW_THREADS
    st = q3_check_e4m3_decode(variant, fast, dst.buf, src.buf, n, &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    if (st != Q3_OK) return q3_raise(NULL, &err);
    Py_RETURN_NONE;
}

/* e4m3_gemv(variant, y, x, w, scale, N, K, threads=1, repeats=1): y [N] = W x, W = w [N, K]
 * e4m3 times the fp32 block scales scale [ceil(N/128), ceil(K/128)] */
static PyObject *e4m3_gemv(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"variant", "y", "x", "w", "scale", "N", "K", "threads", "repeats", NULL};
    const char *variant;
    PyObject *y_obj, *x_obj, *w_obj, *s_obj;
    long long N, K;
    int threads = 1, repeats = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOOOOLL|ii:e4m3_gemv", names, &variant, &y_obj, &x_obj, &w_obj,
                                     &s_obj, &N, &K, &threads, &repeats))
        return NULL;
    if (check_sizes(1, N, K) < 0 || check_threads_repeats(threads, repeats) < 0) return NULL;
    Py_buffer y, x, w, s;
    if (get_buf(y_obj, "y", &y, 4 * N, 1) < 0) return NULL;
    if (get_buf(x_obj, "x", &x, 4 * K, 0) < 0) goto fail_y;
    if (get_buf(w_obj, "w", &w, N * K, 0) < 0) goto fail_x;
    if (get_buf(s_obj, "scale", &s, 4 * q3_check_fp8_scales(N, K), 0) < 0) goto fail_w;
    q3_error err;
    q3_status st;
    Py_BEGIN_ALLOW_THREADS
    st = q3_check_e4m3_gemv(variant, y.buf, x.buf, w.buf, s.buf, N, K, threads, repeats, &err);
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

/* e4m3_dequant(variant, dst, w, scale, N, K, rows=N, threads=1, repeats=1): dst [rows, K] <- W
 * by rows (rows < N: a ring, q3_check.h) */
static PyObject *e4m3_dequant(PyObject *m, PyObject *args, PyObject *kw) {
    static char *names[] = {"variant", "dst", "w", "scale", "N", "K", "rows", "threads", "repeats", NULL};
    const char *variant;
    PyObject *d_obj, *w_obj, *s_obj;
    long long N, K, rows = -1;
    int threads = 1, repeats = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOOOLL|Lii:e4m3_dequant", names, &variant, &d_obj, &w_obj, &s_obj,
                                     &N, &K, &rows, &threads, &repeats))
        return NULL;
    if (check_sizes(1, N, K) < 0 || check_threads_repeats(threads, repeats) < 0) return NULL;
    if (rows == -1) rows = N;
    if (rows < 1 || rows > N || (rows < N && rows < threads)) {
        PyErr_Format(PyExc_ValueError, "rows: expected N (%lld) or from threads (%d) to N, got %lld", N, threads, rows);
        return NULL;
    }
    Py_buffer d, w, s;
    if (get_buf(d_obj, "dst", &d, 4 * rows * K, 1) < 0) return NULL;
    if (get_buf(w_obj, "w", &w, N * K, 0) < 0) goto fail_d;
    if (get_buf(s_obj, "scale", &s, 4 * q3_check_fp8_scales(N, K), 0) < 0) goto fail_w;
    q3_error err;
    q3_status st;
    Py_BEGIN_ALLOW_THREADS
    st = q3_check_e4m3_dequant(variant, d.buf, w.buf, s.buf, N, K, rows, threads, repeats, &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&s);
    PyBuffer_Release(&w);
    PyBuffer_Release(&d);
    if (st != Q3_OK) return q3_raise(NULL, &err);
    Py_RETURN_NONE;
fail_w:
    PyBuffer_Release(&w);
fail_d:
    PyBuffer_Release(&d);
    return NULL;
}

#define KW(f) (PyCFunction)(void (*)(void))(f), METH_VARARGS | METH_KEYWORDS
PyMethodDef q3py_fp8_methods[] = {
    {"matmul_dense", matmul_dense, METH_VARARGS,
     "matmul_dense(y, x, w, w_dtype, T, N, K, accumulate=0)\n--\n\nThe fp32/bf16 matmul of the active CPU path."},
    {"fp8_to_f32", fp8_to_f32, METH_VARARGS, "fp8_to_f32(src, dst)\n--\n\ne4m3 bytes to fp32."},
    {"f32_to_fp8", f32_to_fp8, METH_VARARGS,
     "f32_to_fp8(src, dst)\n--\n\nfp32 to e4m3 bytes, round to nearest even, NaN past 464."},
    {"fp8_matmul", fp8_matmul, METH_VARARGS,
     "fp8_matmul(y, x, w, scale, scale_dtype, T, N, K, accumulate=0, dequant=0)\n--\n\n"
     "The block-scaled e4m3 matmul of the active CPU path (or the scalar dequantization)."},
    {"e4m3_variants", KW(e4m3_variants),
     "e4m3_variants(all=False)\n--\n\n[{'name', 'isa', 'what', 'shipped', 'width', 'runs'}]: the e4m3 decoder "
     "variants this CPU runs, or with all every one compiled (shipped: the CPU path whose GEMV decodes so, or None; "
     "width: codes a decoder call; runs: whether this CPU has its instruction sets)."},
    {"e4m3_decode", KW(e4m3_decode),
     "e4m3_decode(variant, src, dst, fast=False)\n--\n\ndst [n] fp32 <- the e4m3 codes src [n], every one through "
     "the variant's vector decoder: its exact one (NaN codes NaN), or with fast the GEMV's (NaN codes unspecified)."},
    {"e4m3_gemv", KW(e4m3_gemv),
     "e4m3_gemv(variant, y, x, w, scale, N, K, threads=1, repeats=1)\n--\n\ny [N] = W x, w [N, K] e4m3 with fp32 "
     "block scales [ceil(N/128), ceil(K/128)], by the variant's decoder, repeats times."},
    {"e4m3_dequant", KW(e4m3_dequant),
     "e4m3_dequant(variant, dst, w, scale, N, K, rows=N, threads=1, repeats=1)\n--\n\ndst [rows, K] fp32 <- W by "
     "the variant's exact decoder, repeats times; rows < N: each thread's rows in turn into its own rows / threads "
     "rows of dst (a ring that stays in cache)."},
    {NULL},
};
