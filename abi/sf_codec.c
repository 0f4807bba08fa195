/* The message codec's fast path (superfluid.abi._codec): records to slot
 * bytes and back in one C call, for abi/codec.py.
 *
 * Why: a tick's plan and events are ~100 records each way. The Python codec
 * takes 25-45 us a message with warm caches, but right after a tick (the
 * model's weights and KV have been through the caches) 90-150 us: most of the
 * daemon path's cost over an in-process executor was these four calls. Here a
 * message touches a few KB of code and the records themselves.
 *
 * The layouts come from Python (packers.py's schema, read from cffi), so this
 * file knows no record. It does what codec.py's pure-Python path does, byte for
 * byte, for the common inputs; anything else -- a value out of range, a type it
 * does not take, a span that breaks a rule, a message that does not fit --
 * returns None and codec.py runs its own path, which raises the error that names
 * the field (or handles the rarer input). So the messages and the errors are
 * the Python codec's; tests/abi/test_codec_native.py checks the two agree. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the wire format is little-endian; this fast path copies words as they are in memory"
#endif

#define HDR 24 /* MsgHeader: kind u32, record_bytes u32, arena_bytes u64, session u64 */
#define ALIGN 8 /* SF_ARENA_ALIGN */
#define ALIGNED(n) (((n) + ALIGN - 1) / ALIGN * ALIGN)

enum { K_SCALAR, K_STRUCT, K_ARRAY, K_CHARS, K_BYTES, K_ROWS };

typedef struct {
    int kind;
    Py_ssize_t off; /* within the record */
    char code;      /* struct code of a scalar or an array's items */
    Py_ssize_t length; /* array items or chars bytes */
    int sub;        /* record index: K_STRUCT, K_ROWS */
} Fld;

typedef struct {
    PyObject *cls; /* the namedtuple class */
    Py_ssize_t size;
    int has_struct_size;
    Py_ssize_t nf;
    Fld *f;
} Rec;

static Rec *RECS;
static Py_ssize_t NRECS;

/* A failure that codec.py should look at: no Python error is left set. */
#define FAIL (-1)

static int code_width(char c) {
    switch (c) {
    case 'B': case 'b': return 1;
    case 'H': case 'h': return 2;
    case 'I': case 'i': case 'f': return 4;
    case 'Q': case 'q': case 'd': return 8;
    }
    return 0;
}

/* ------------------------------------------------------------------ encode */

typedef struct {
    char *arena;   /* where the arena starts in the buffer */
    Py_ssize_t cap; /* bytes the buffer has from there */
    Py_ssize_t len; /* arena bytes written */
} Arena;

static int put_scalar(char code, PyObject *v, char *p) {
    if (code == 'f' || code == 'd') {
        double x = PyFloat_AsDouble(v);
        if (x == -1.0 && PyErr_Occurred()) goto fail;
        if ((code == 'f' ? PyFloat_Pack4(x, p, 1) : PyFloat_Pack8(x, p, 1)) < 0) goto fail;
        return 0;
    }
    PyObject *iv = v;
    if (!PyLong_Check(v)) {
        /* struct takes anything with __index__ (a numpy integer); not a float */
        if (PyFloat_Check(v) || Py_TYPE(v)->tp_as_number == NULL || Py_TYPE(v)->tp_as_number->nb_index == NULL)
            return FAIL;
        iv = PyNumber_Index(v);
        if (iv == NULL) goto fail;
    }
    int w = code_width(code), bad = 0;
    if (code == 'B' || code == 'H' || code == 'I' || code == 'Q') {
        unsigned long long x = PyLong_AsUnsignedLongLong(iv);
        if (x == (unsigned long long)-1 && PyErr_Occurred()) bad = 1;
        else if (w < 8 && x >> (8 * w)) bad = 1;
        else memcpy(p, &x, w);
    } else {
        long long x = PyLong_AsLongLong(iv);
        if (x == -1 && PyErr_Occurred()) bad = 1;
        else if (w < 8 && (x < -(1LL << (8 * w - 1)) || x >= (1LL << (8 * w - 1)))) bad = 1;
        else memcpy(p, &x, w);
    }
    if (iv != v) Py_DECREF(iv);
    if (!bad) return 0;
fail:
    PyErr_Clear();
    return FAIL;
}

/* Room for `n` more arena bytes at `at`, or FAIL (codec.py says how many the message needs). */
static int room(Arena *a, Py_ssize_t at, Py_ssize_t n) {
    return (n < 0 || at > a->cap || n > a->cap - at) ? FAIL : 0;
}

/* Append `n` bytes at the next aligned offset; the span {offset, count} goes to `span`. */
static int place(Arena *a, const char *data, Py_ssize_t n, Py_ssize_t count, char *span) {
    Py_ssize_t off = ALIGNED(a->len);
    if (room(a, off, n) || off > UINT32_MAX || count > UINT32_MAX) return FAIL;
    memset(a->arena + a->len, 0, off - a->len);
    memcpy(a->arena + off, data, n);
    a->len = off + n;
    uint32_t s[2] = {(uint32_t)off, (uint32_t)count};
    memcpy(span, s, 8);
    return 0;
}

static int enc_record(const Rec *r, PyObject *obj, char *dst, Arena *a, int top);

static int enc_span_rows(const Rec *sub, PyObject *v, char *span, Arena *a) {
    if (v == Py_None) return 0;
    if (!PyTuple_Check(v) && !PyList_Check(v)) return FAIL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
    if (n == 0) return 0;
    if (n > (a->cap - ALIGNED(a->len)) / sub->size) return FAIL; /* the rows alone overrun the slot */
    char *rows = PyMem_Calloc(n, sub->size);
    if (rows == NULL) {
        PyErr_Clear();
        return FAIL;
    }
    PyObject **items = PySequence_Fast_ITEMS(v);
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) rc = enc_record(sub, items[i], rows + i * sub->size, a, 0);
    if (rc == 0) rc = place(a, rows, n * sub->size, n, span);
    PyMem_Free(rows);
    return rc;
}

/* The bytes of a bytes or str value (str as UTF-8, as codec.py encodes it), or FAIL. */
static int bytes_of(PyObject *v, const char **data, Py_ssize_t *n) {
    if (PyBytes_Check(v)) {
        *data = PyBytes_AS_STRING(v);
        *n = PyBytes_GET_SIZE(v);
        return 0;
    }
    if (!PyUnicode_Check(v)) return FAIL;
    *data = PyUnicode_AsUTF8AndSize(v, n);
    if (*data == NULL) {
        PyErr_Clear();
        return FAIL;
    }
    return 0;
}

static int enc_span_bytes(PyObject *v, char *span, Arena *a) {
    const char *data;
    Py_ssize_t n;
    if (v == Py_None) return 0;
    if (bytes_of(v, &data, &n)) return FAIL;
    return n == 0 ? 0 : place(a, data, n, n, span);
}

static int enc_field(const Fld *f, PyObject *v, char *dst, Arena *a) {
    char *p = dst + f->off;
    switch (f->kind) {
    case K_SCALAR:
        return put_scalar(f->code, v, p);
    case K_STRUCT:
        return enc_record(&RECS[f->sub], v, p, a, 0);
    case K_ARRAY: {
        if (!PyTuple_Check(v) && !PyList_Check(v)) return FAIL;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
        if (n > f->length) return FAIL;
        PyObject **items = PySequence_Fast_ITEMS(v);
        int w = code_width(f->code);
        for (Py_ssize_t i = 0; i < n; i++)
            if (put_scalar(f->code, items[i], p + i * w)) return FAIL;
        return 0;
    }
    case K_CHARS: {
        const char *s;
        Py_ssize_t n;
        if (bytes_of(v, &s, &n) || n > f->length) return FAIL;
        memcpy(p, s, n);
        return 0;
    }
    case K_BYTES:
        return enc_span_bytes(v, p, a);
    case K_ROWS:
        return enc_span_rows(&RECS[f->sub], v, p, a);
    }
    return FAIL;
}

/* `obj` (a tuple: a namedtuple, or longer, as codec.py's indexing takes it)
 * into the zeroed record at `dst`; its spans into the arena, in field order. */
static int enc_record(const Rec *r, PyObject *obj, char *dst, Arena *a, int top) {
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) < r->nf) return FAIL;
    for (Py_ssize_t i = 0; i < r->nf; i++) {
        PyObject *v = PyTuple_GET_ITEM(obj, i);
        if (i == 0 && top && r->has_struct_size) {
            int truth = PyObject_IsTrue(v); /* codec.py's `struct_size or size`: 0 is this ABI's size */
            if (truth < 0) {
                PyErr_Clear();
                return FAIL;
            }
            if (!truth) {
                uint64_t s = (uint64_t)r->size;
                memcpy(dst + r->f[0].off, &s, code_width(r->f[0].code));
                continue;
            }
        }
        if (enc_field(&r->f[i], v, dst, a)) return FAIL;
    }
    return 0;
}

/* The record a call names in args[1], its arguments counted; NULL with the error set. */
static const Rec *called_rec(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *signature) {
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, signature);
        return NULL;
    }
    if (RECS == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_codec.setup() was not called");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0 || i >= NRECS) {
        PyErr_SetString(PyExc_IndexError, "record index out of range");
        return NULL;
    }
    return &RECS[i];
}

/* encode_into(buf, index, record, kind, session) -> bytes written, or None */
static PyObject *py_encode_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const Rec *r = called_rec(args, nargs, 5, "encode_into(buf, index, record, kind, session)");
    if (r == NULL) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *res = Py_None;
    Py_ssize_t start = HDR + ALIGNED(r->size);
    char *buf = view.buf;
    if (view.len >= start) {
        char hdr[HDR] = {0};
        memset(buf + HDR, 0, start - HDR);
        Arena a = {buf + start, view.len - start, 0};
        if (put_scalar('I', args[3], hdr) == 0 && put_scalar('Q', args[4], hdr + 16) == 0 &&
            enc_record(r, args[2], buf + HDR, &a, 1) == 0) {
            uint32_t rb = (uint32_t)r->size;
            uint64_t ab = (uint64_t)a.len;
            memcpy(hdr + 4, &rb, 4);
            memcpy(hdr + 8, &ab, 8);
            memcpy(buf, hdr, HDR);
            res = PyLong_FromSsize_t(start + a.len);
        }
    }
    PyBuffer_Release(&view);
    if (res == Py_None) {
        PyErr_Clear(); /* (none is set: every failure above clears its own) */
        Py_INCREF(res);
    }
    return res;
}

/* ------------------------------------------------------------------ decode */

typedef struct {
    const char *base;
    Py_ssize_t n;
} View;

static PyObject *get_scalar(char code, const char *p) {
    switch (code) {
    case 'B': return PyLong_FromLong(*(const uint8_t *)p);
    case 'b': return PyLong_FromLong(*(const int8_t *)p);
    case 'H': { uint16_t x; memcpy(&x, p, 2); return PyLong_FromLong(x); }
    case 'h': { int16_t x; memcpy(&x, p, 2); return PyLong_FromLong(x); }
    case 'I': { uint32_t x; memcpy(&x, p, 4); return PyLong_FromUnsignedLong(x); }
    case 'i': { int32_t x; memcpy(&x, p, 4); return PyLong_FromLong(x); }
    case 'Q': { uint64_t x; memcpy(&x, p, 8); return PyLong_FromUnsignedLongLong(x); }
    case 'q': { int64_t x; memcpy(&x, p, 8); return PyLong_FromLongLong(x); }
    case 'f': {
        double x = PyFloat_Unpack4(p, 1);
        return (x == -1.0 && PyErr_Occurred()) ? NULL : PyFloat_FromDouble(x);
    }
    case 'd': {
        double x = PyFloat_Unpack8(p, 1);
        return (x == -1.0 && PyErr_Occurred()) ? NULL : PyFloat_FromDouble(x);
    }
    }
    PyErr_SetString(PyExc_SystemError, "unknown scalar code");
    return NULL;
}

/* Decoding results: a new reference; NULL with no error set is a message
 * codec.py must look at; NULL with an error set is a real error. */
static PyObject *dec_record(const Rec *r, const char *src, const View *arena);

static int span_at(const char *p, const View *arena, Py_ssize_t item, uint32_t *off, uint32_t *count) {
    memcpy(off, p, 4);
    memcpy(count, p + 4, 4);
    if (*off == 0 && *count == 0) return 1; /* empty */
    if (*off % ALIGN || *off > arena->n) return FAIL;
    if ((Py_ssize_t)*count > (arena->n - *off) / item) return FAIL;
    return 0;
}

static PyObject *dec_field(const Fld *f, const char *src, const View *arena) {
    const char *p = src + f->off;
    switch (f->kind) {
    case K_SCALAR:
        return get_scalar(f->code, p);
    case K_STRUCT:
        return dec_record(&RECS[f->sub], p, arena);
    case K_ARRAY: {
        PyObject *t = PyTuple_New(f->length);
        if (t == NULL) return NULL;
        int w = code_width(f->code);
        for (Py_ssize_t i = 0; i < f->length; i++) {
            PyObject *x = get_scalar(f->code, p + i * w);
            if (x == NULL) {
                Py_DECREF(t);
                return NULL;
            }
            PyTuple_SET_ITEM(t, i, x);
        }
        return t;
    }
    case K_CHARS: {
        Py_ssize_t n = f->length;
        while (n > 0 && p[n - 1] == 0) n--;
        return PyBytes_FromStringAndSize(p, n);
    }
    case K_BYTES: {
        uint32_t off, count;
        int e = span_at(p, arena, 1, &off, &count);
        if (e == FAIL) return NULL;
        return e ? PyBytes_FromStringAndSize(NULL, 0) : PyBytes_FromStringAndSize(arena->base + off, count);
    }
    case K_ROWS: {
        const Rec *sub = &RECS[f->sub];
        uint32_t off, count;
        int e = span_at(p, arena, sub->size, &off, &count);
        if (e == FAIL) return NULL;
        if (e || count == 0) return PyTuple_New(0);
        PyObject *t = PyTuple_New(count);
        if (t == NULL) return NULL;
        for (uint32_t i = 0; i < count; i++) {
            PyObject *x = dec_record(sub, arena->base + off + (Py_ssize_t)i * sub->size, arena);
            if (x == NULL) {
                Py_DECREF(t);
                return NULL;
            }
            PyTuple_SET_ITEM(t, i, x);
        }
        return t;
    }
    }
    PyErr_SetString(PyExc_SystemError, "unknown field kind");
    return NULL;
}

static PyObject *dec_record(const Rec *r, const char *src, const View *arena) {
    /* What tuple.__new__(cls, values) makes, without the values' tuple. */
    PyTypeObject *cls = (PyTypeObject *)r->cls;
    PyObject *t = cls->tp_alloc(cls, r->nf);
    if (t == NULL) return NULL;
    for (Py_ssize_t i = 0; i < r->nf; i++) {
        PyObject *x = dec_field(&r->f[i], src, arena);
        if (x == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/* decode(buf, index, kind) -> record, or None */
static PyObject *py_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const Rec *r = called_rec(args, nargs, 3, "decode(buf, index, kind)");
    if (r == NULL) return NULL;
    unsigned long want = PyLong_AsUnsignedLong(args[2]);
    if (want == (unsigned long)-1 && PyErr_Occurred()) {
        PyErr_Clear(); /* not a kind a message has: codec.py says so */
        Py_RETURN_NONE;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *res = NULL;
    const char *buf = view.buf;
    Py_ssize_t start = HDR + ALIGNED(r->size);
    uint32_t kind, record_bytes;
    uint64_t struct_size = 0;
    uint64_t arena_bytes;
    if (view.len >= start) {
        memcpy(&kind, buf, 4);
        memcpy(&record_bytes, buf + 4, 4);
        memcpy(&arena_bytes, buf + 8, 8);
        if (r->has_struct_size) memcpy(&struct_size, buf + HDR + r->f[0].off, code_width(r->f[0].code));
        if (kind == want && record_bytes == r->size && arena_bytes <= (uint64_t)(view.len - start) &&
            (!r->has_struct_size || struct_size == r->size)) {
            View arena = {buf + start, (Py_ssize_t)arena_bytes};
            res = dec_record(r, buf + HDR, &arena);
        }
    }
    PyBuffer_Release(&view);
    if (res == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return res;
}

/* ------------------------------------------------------------------- setup */

static void free_recs(void) {
    for (Py_ssize_t i = 0; i < NRECS; i++) {
        Py_XDECREF(RECS[i].cls);
        PyMem_Free(RECS[i].f);
    }
    PyMem_Free(RECS);
    RECS = NULL;
    NRECS = 0;
}

/* setup(schema): schema[i] = (cls, size, has_struct_size, fields), each field
 * (kind, offset, code, length, sub) as packers.py builds them. */
static PyObject *py_setup(PyObject *self, PyObject *schema) {
    if (!PyTuple_Check(schema)) {
        PyErr_SetString(PyExc_TypeError, "schema must be a tuple");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(schema);
    Rec *recs = PyMem_Calloc(n ? n : 1, sizeof(Rec));
    if (recs == NULL) return PyErr_NoMemory();
    free_recs();
    RECS = recs;
    NRECS = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *cls, *fields;
        Py_ssize_t size;
        int has_ss;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(schema, i), "OnpO!", &cls, &size, &has_ss, &PyTuple_Type, &fields))
            goto bad;
        if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type)) {
            PyErr_SetString(PyExc_TypeError, "a record class must be a tuple type");
            goto bad;
        }
        Rec *r = &RECS[i];
        Py_INCREF(cls);
        r->cls = cls;
        r->size = size;
        r->has_struct_size = has_ss;
        r->nf = PyTuple_GET_SIZE(fields);
        r->f = PyMem_Calloc(r->nf ? r->nf : 1, sizeof(Fld));
        if (r->f == NULL) {
            PyErr_NoMemory();
            goto bad;
        }
        for (Py_ssize_t j = 0; j < r->nf; j++) {
            Fld *f = &r->f[j];
            int code;
            if (!PyArg_ParseTuple(PyTuple_GET_ITEM(fields, j), "inCni", &f->kind, &f->off, &code, &f->length, &f->sub))
                goto bad;
            f->code = (char)code;
            int w = code_width(f->code);
            Py_ssize_t end = f->off + (f->kind == K_SCALAR ? w : f->kind == K_ARRAY ? w * f->length
                                       : f->kind == K_CHARS ? f->length : f->kind == K_STRUCT ? 0 : 8);
            if (f->kind < K_SCALAR || f->kind > K_ROWS || f->off < 0 || end > size ||
                ((f->kind == K_SCALAR || f->kind == K_ARRAY) && w == 0) ||
                ((f->kind == K_STRUCT || f->kind == K_ROWS) && (f->sub < 0 || f->sub >= n))) {
                PyErr_Format(PyExc_ValueError, "schema[%zd] field %zd is not a field this codec knows", i, j);
                goto bad;
            }
        }
        if (has_ss && (r->nf == 0 || r->f[0].kind != K_SCALAR || (r->f[0].code != 'I' && r->f[0].code != 'Q'))) {
            PyErr_Format(PyExc_ValueError, "schema[%zd]: struct_size must be a leading uint32 or uint64", i);
            goto bad;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++)
        for (Py_ssize_t j = 0; j < RECS[i].nf; j++) {
            Fld *f = &RECS[i].f[j];
            if ((f->kind == K_STRUCT && f->off + RECS[f->sub].size > RECS[i].size) ||
                (f->kind == K_ROWS && RECS[f->sub].size <= 0)) {
                PyErr_Format(PyExc_ValueError, "schema[%zd] field %zd: its record does not fit", i, j);
                goto bad;
            }
        }
    Py_RETURN_NONE;
bad:
    free_recs();
    return NULL;
}

static PyMethodDef methods[] = {
    {"setup", py_setup, METH_O, "setup(schema): the record layouts (packers.py builds them)."},
    {"encode_into", (PyCFunction)(void (*)(void))py_encode_into, METH_FASTCALL,
     "encode_into(buf, index, record, kind, session) -> bytes written, or None for codec.py to handle."},
    {"decode", (PyCFunction)(void (*)(void))py_decode, METH_FASTCALL,
     "decode(buf, index, kind) -> the record, or None for codec.py to handle."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_codec", "The message codec's fast path.", -1, methods};

PyMODINIT_FUNC PyInit__codec(void) { return PyModule_Create(&module); }
