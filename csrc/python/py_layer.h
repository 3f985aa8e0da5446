/* The layer object shared by py_layer.c (construction) and py_layer_call.c (calls). */
#ifndef Q3_PY_LAYER_H
#define Q3_PY_LAYER_H

#include "py_glue.h"

typedef struct {
    PyObject_HEAD
    q3_layer *layer;
    q3_view *views;      /* borrowed weights, released at dealloc */
    int n_views;
    void **owned;        /* converted weights (q3_alloc) */
    int n_owned;
    const void **expert_ptrs; /* [Q3_X_COUNT][E] */
    PyObject *converted; /* list of names converted at construction */
    PyObject *weight_ptrs; /* dict name -> address the engine reads */
    PyThread_type_lock lock;
    int device;          /* -1: cpu; else the CUDA device of weights, caches and outputs */
} q3_layer_object;

extern PyMethodDef q3_layer_methods[];
extern PyGetSetDef q3_layer_getset[];

#endif
