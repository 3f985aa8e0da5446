/* KVCache operations (the engine's q3_cache_call: cache_ops.c, cache_accept.c, cache_copy.c),
 * each a row of one table: the engine's op, its arguments and what each fills of the call's
 * q3_cache_call_args; one runner parses, converts and runs any row. Also the inputs of a tree
 * verify (_tree_inputs), and the method table of KVCache (its views and attributes: py_cache.c).
 * Each call runs through q3py_cache_run: the cache busy while the engine works without the GIL,
 * so that a layer call on another thread cannot append to it meanwhile. The copying ones take
 * `stream=` (keyword only): on a CUDA cache the copies are queued on that cudaStream_t (an int,
 * as torch's `current_stream().cuda_stream`), after the caller's layer calls on it; None or 0
 * (no stream named, or the legacy default one): the device is synchronized before and after
 * them, so they are ordered against every stream. */
#include "py_glue.h"

/* What an argument fills: N r.n (a count, a length, a position), SEQ r.seq (not given: 0),
 * SEQ_OR_EVERY r.seq (not given or None: every sequence), SRC r.src_seq, INDEX r.index [r.n]
 * (a 1-D sequence of ints), STREAM r.stream (not given: None) */
typedef enum { END, N, SEQ, SEQ_OR_EVERY, SRC, INDEX, STREAM } arg_kind;

typedef struct {
    const char *fmt; /* PyArg's: every argument "O" */
    char *names[5];
    arg_kind kinds[4];
} cache_op_row;

/* indexed by q3_cache_op */
static cache_op_row rows[] = {
    [Q3_CACHE_RESET] = {"|O:reset", {"seq"}, {SEQ_OR_EVERY}},
    [Q3_CACHE_TRUNCATE] = {"O|O:truncate", {"n", "seq"}, {N, SEQ}},
    [Q3_CACHE_SET_PADDING] = {"O|O:set_padding", {"n", "seq"}, {N, SEQ}},
    [Q3_CACHE_SET_FIRST_POSITION] = {"O|O:set_first_position", {"position", "seq"}, {N, SEQ}},
    [Q3_CACHE_CROP] = {"O|O:crop", {"length", "seq"}, {N, SEQ_OR_EVERY}},
    [Q3_CACHE_COPY_PREFIX] = {"OOO|$O:copy_prefix", {"src_seq", "dst_seq", "length", "stream"}, {SRC, SEQ, N, STREAM}},
    [Q3_CACHE_REORDER] = {"O|$O:reorder", {"index", "stream"}, {INDEX, STREAM}},
    [Q3_CACHE_SELECT] = {"O|$O:select", {"index", "stream"}, {INDEX, STREAM}},
    [Q3_CACHE_REPEAT_INTERLEAVE] = {"O|$O:repeat_interleave", {"n", "stream"}, {N, STREAM}},
    [Q3_CACHE_COPY] = {"|$O:copy", {"stream"}, {STREAM}},
    [Q3_CACHE_GROW] = {"O|$O:grow", {"max_tokens", "stream"}, {N, STREAM}},
    [Q3_CACHE_ACCEPT] = {"OO|$O:accept", {"seq", "kept", "stream"}, {SEQ, INDEX, STREAM}},
};

/* argument i of row `row` (NULL: not given) into r; 0, or -1 with the exception */
static int fill(q3py_cache_object *o, const cache_op_row *row, int i, PyObject *v, q3_cache_call_args *r) {
    const char *name = row->names[i];
    const char *too_big = r->op == Q3_CACHE_GROW ? "expected at most 2^40 (the positions RoPE takes)" : NULL;
    switch (row->kinds[i]) {
    case N: return q3py_int64(v, name, 0, too_big, &r->n) < 0 ? -1 : 0;
    case SEQ: case SRC: /* (not given: 0) */
        return v && q3py_int64(v, name, 0, NULL, row->kinds[i] == SEQ ? &r->seq : &r->src_seq) < 0 ? -1 : 0;
    case SEQ_OR_EVERY: {
        const int given = v ? q3py_int64(v, name, Q3PY_NONE_OK, NULL, &r->seq) : 0;
        r->every_seq = given == 0;
        return given < 0 ? -1 : 0;
    }
    case INDEX: return (r->index = q3py_index_list(v, name, &r->n)) ? 0 : -1;
    case STREAM: return q3py_stream_on(v ? v : Py_None, q3_cache_device(o->cache), "a cache on the cpu", &r->stream);
    default: return 0;
    }
}

/* a new KVCache of the call's (r->out), or None */
static PyObject *result_of(q3py_cache_object *o, q3_cache_call_args *r) {
    q3_module_state *st = q3_state_of_type(Py_TYPE(o));
    if (!st || q3py_cache_run(o, r) < 0) return NULL;
    return r->out ? (PyObject *)q3py_cache_wrap(st, r->out) : Py_NewRef(Py_None);
}

static PyObject *cache_op(q3py_cache_object *o, PyObject *args, PyObject *kw, q3_cache_op op) {
    const cache_op_row *row = &rows[op];
    PyObject *v[4] = {NULL};
    q3_cache_call_args r = {.op = op};
    if (!PyArg_ParseTupleAndKeywords(args, kw, row->fmt, rows[op].names, &v[0], &v[1], &v[2], &v[3])) return NULL;
    int failed = 0;
    for (int i = 0; !failed && i < 4 && row->kinds[i] != END; i++) failed = fill(o, row, i, v[i], &r) < 0;
    PyObject *result = failed ? NULL : result_of(o, &r);
    PyMem_Free((void *)r.index);
    return result;
}

#define CACHE_OP(fn, op) \
    static PyObject *fn(q3py_cache_object *o, PyObject *a, PyObject *k) { return cache_op(o, a, k, op); }
CACHE_OP(cache_reset, Q3_CACHE_RESET)
CACHE_OP(cache_truncate, Q3_CACHE_TRUNCATE)
CACHE_OP(cache_set_padding, Q3_CACHE_SET_PADDING)
CACHE_OP(cache_set_first_position, Q3_CACHE_SET_FIRST_POSITION)
CACHE_OP(cache_crop, Q3_CACHE_CROP)
CACHE_OP(cache_copy_prefix, Q3_CACHE_COPY_PREFIX)
CACHE_OP(cache_reorder, Q3_CACHE_REORDER)
CACHE_OP(cache_select, Q3_CACHE_SELECT)
CACHE_OP(cache_repeat_interleave, Q3_CACHE_REPEAT_INTERLEAVE)
CACHE_OP(cache_copy, Q3_CACHE_COPY)
CACHE_OP(cache_grow, Q3_CACHE_GROW)
CACHE_OP(cache_accept, Q3_CACHE_ACCEPT)

/* copy.copy(cache) and copy.deepcopy(cache, memo): no stream named (the memo needs nothing from
 * us: copy records the result itself) */
static PyObject *cache_copy_noargs(q3py_cache_object *o, PyObject *unused) {
    q3_cache_call_args r = {.op = Q3_CACHE_COPY};
    return result_of(o, &r);
}

/* _tree_inputs(parents, seq=None): (tree, positions) of a verify call (the engine's
 * q3_tree_inputs: its checks and shapes first, then the fill), host tensors: parents [T]
 * (sequence seq, default 0) or [batch, T] int64 */
static PyObject *cache_tree_inputs(q3py_cache_object *o, PyObject *args, PyObject *kw) {
    static char *names[] = {"parents", "seq", NULL};
    PyObject *parents_obj, *seq_obj = Py_None, *result = NULL;
    q3_module_state *st = q3_state_of_type(Py_TYPE(o));
    q3_view parents = {0};
    q3_error err;
    int ndim, seq = 0;
    int64_t shape[3];
    if (!st || !PyArg_ParseTupleAndKeywords(args, kw, "O|O:_tree_inputs", names, &parents_obj, &seq_obj) ||
        q3_view_acquire_on(parents_obj, "parents", &parents, -1, Q3_VIEW_HOST | Q3_VIEW_I64, NULL) < 0)
        return NULL;
    if (q3py_status(q3_tree_inputs(o->cache, &parents, 0, &ndim, shape, NULL, NULL, &err), &err) == 0 &&
        (parents.ndim == 2 || seq_obj == Py_None || q3py_seq(seq_obj, q3_cache_batch(o->cache), &seq) == 0)) {
        q3py_tensor_object *tree = q3py_tensor_new(st, Q3_BOOL, ndim, shape);
        q3py_tensor_object *pos = q3py_tensor_new(st, Q3_I64, parents.ndim, parents.shape);
        if (tree && pos &&
            q3py_status(q3_tree_inputs(o->cache, &parents, seq, &ndim, shape, tree->data, pos->data, &err), &err) == 0)
            result = PyTuple_Pack(2, (PyObject *)tree, (PyObject *)pos);
        Py_XDECREF(tree);
        Py_XDECREF(pos);
    }
    q3_view_release(&parents);
    return result;
}

/* keys, values, all_keys, all_values: views of the blocks (py_cache.c) */
#define CACHE_VIEW(fn, values, all) \
    static PyObject *fn(q3py_cache_object *o, PyObject *a, PyObject *k) { return q3py_cache_view(o, a, k, values, all); }
CACHE_VIEW(cache_keys, 0, 0)
CACHE_VIEW(cache_values, 1, 0)
CACHE_VIEW(cache_all_keys, 0, 1)
CACHE_VIEW(cache_all_values, 1, 1)

#define KW (METH_VARARGS | METH_KEYWORDS)
/* the copying operations' stream rule (py_cache_ops.c) */
#define STREAM_DOC                                                                                               \
    "On a CUDA cache the copies are queued on `stream` (a cudaStream_t as int, e.g. torch's "                    \
    "current_stream().cuda_stream: the stream of the layer calls they must follow); None or 0: the device is "   \
    "synchronized before and after them. None for a cpu cache."

PyMethodDef q3py_cache_methods[] = {
    {"reset", (PyCFunction)(void (*)(void))cache_reset, KW,
     "reset(seq=None)\n--\n\nEmpty sequence `seq`, or every sequence when seq is None."},
    {"truncate", (PyCFunction)(void (*)(void))cache_truncate, KW,
     "truncate(n, seq=0)\n--\n\nKeep the first n tokens of sequence `seq`."},
    {"set_padding", (PyCFunction)(void (*)(void))cache_set_padding, KW,
     "set_padding(n, seq=0)\n--\n\nThe first n tokens sequence `seq` receives are padding (left padding of a "
     "batch): later tokens do not attend to them and positions count from the first real token. Only while "
     "the sequence is empty; reset() clears it."},
    {"set_first_position", (PyCFunction)(void (*)(void))cache_set_first_position, KW,
     "set_first_position(position, seq=0)\n--\n\nThe first real token sequence `seq` receives sits at RoPE position "
     "`position` (default 0; the next at position + 1, ...): for callers whose positions count the left padding or "
     "run on from elsewhere. Only while the sequence is empty; reset() clears it; the cache operations carry it."},
    {"keys", (PyCFunction)(void (*)(void))cache_keys, KW,
     "keys(seq=0)\n--\n\nZero-copy view [num_kv_heads, length, head_dim] of the sequence's keys "
     "(after QK-norm and RoPE), with __dlpack__. The view keeps the length it had when taken."},
    {"values", (PyCFunction)(void (*)(void))cache_values, KW,
     "values(seq=0)\n--\n\nZero-copy view [num_kv_heads, length, head_dim] of the sequence's values."},
    {"all_keys", (PyCFunction)(void (*)(void))cache_all_keys, KW,
     "all_keys(tokens=None)\n--\n\nZero-copy view [batch, num_kv_heads, tokens, head_dim] of every sequence's keys "
     "(transformers' cache layout); tokens defaults to the length all sequences share (ValueError when they "
     "differ), at most the capacity (positions never written read zeros)."},
    {"all_values", (PyCFunction)(void (*)(void))cache_all_values, KW,
     "all_values(tokens=None)\n--\n\nZero-copy view [batch, num_kv_heads, tokens, head_dim] of every sequence's "
     "values, as all_keys."},
    {"reorder", (PyCFunction)(void (*)(void))cache_reorder, KW,
     "reorder(index, *, stream=None)\n--\n\nIn place: sequence i becomes a copy of old sequence index[i] "
     "(len(index) == batch; indices may repeat: beam search). Tokens, lengths and padding move together. "
     STREAM_DOC},
    {"select", (PyCFunction)(void (*)(void))cache_select, KW,
     "select(index, *, stream=None)\n--\n\nA new KVCache of len(index) >= 1 sequences (same capacity): "
     "sequence i is a copy of this cache's sequence index[i] (indices may repeat). " STREAM_DOC},
    {"repeat_interleave", (PyCFunction)(void (*)(void))cache_repeat_interleave, KW,
     "repeat_interleave(n, *, stream=None)\n--\n\nA new KVCache of batch * n sequences: sequence i * n + j "
     "is a copy of sequence i (a prompt expanded to n beams). " STREAM_DOC},
    {"crop", (PyCFunction)(void (*)(void))cache_crop, KW,
     "crop(length, seq=None)\n--\n\nKeep the first `length` tokens of sequence `seq`, or of every sequence "
     "when seq is None; a sequence holding fewer keeps what it holds. length < 0 drops -length tokens from "
     "the end of each (transformers' Cache.crop)."},
    {"copy", (PyCFunction)(void (*)(void))cache_copy, KW,
     "copy(*, stream=None)\n--\n\nA new KVCache with the same contents (copy.copy and copy.deepcopy call it, "
     "with no stream). " STREAM_DOC},
    {"grow", (PyCFunction)(void (*)(void))cache_grow, KW,
     "grow(max_tokens, *, stream=None)\n--\n\nEvery sequence's room becomes max_tokens tokens (at least the "
     "capacity now; equal: nothing happens). New K and V of the new capacity are allocated and each sequence's "
     "tokens copied into them once; lengths, padding and first positions stay. Peak memory: the old and the new "
     "K and V together (nbytes before and after). Views taken before keep reading the old memory, which lives as "
     "long as they do; take views anew. A decode graph captured before refuses to replay. " STREAM_DOC
     " (a CUDA cache's growth waits for its copies)."},
    {"__copy__", (PyCFunction)cache_copy_noargs, METH_NOARGS, "The same as copy()."},
    /* the memo needs nothing from us (copy records the result itself) */
    {"__deepcopy__", (PyCFunction)cache_copy_noargs, METH_O, "The same as copy()."},
    {"accept", (PyCFunction)(void (*)(void))cache_accept, KW,
     "accept(seq, kept, *, stream=None)\n--\n\nAfter a verify of sequence seq (its last call, no operation since): "
     "the verify's tokens kept (increasing indices into them: the accepted path) become the rows after the tokens "
     "before it, in that order; the others are dropped. " STREAM_DOC},
    {"_tree_inputs", (PyCFunction)(void (*)(void))cache_tree_inputs, KW,
     "_tree_inputs(parents, seq=None)\n--\n\n(tree, positions) of a verify call from parents [T] or [batch, T] "
     "(-1: a root after the cache, else an earlier token): DecoderLayer.verify's."},
    {"copy_prefix", (PyCFunction)(void (*)(void))cache_copy_prefix, KW,
     "copy_prefix(src_seq, dst_seq, length, *, stream=None)\n--\n\nSequence dst_seq becomes a copy of the "
     "first `length` tokens of sequence src_seq (prefix reuse); what dst_seq held is dropped. " STREAM_DOC},
    {NULL},
};
