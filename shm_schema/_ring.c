/* shm_schema._ring: a worker's write of one event into its row's ring (shm_schema/events.py)
 * in one C call.
 *
 * The same steps as the Python twin `events.PythonRing.put`, in the same order, with the same
 * sequentially consistent atomics: load the head the sidecar has consumed to (full: nothing
 * written), store the record's words, publish the new tail, then, for an event that wakes, load
 * the header's `sidecar_sleeping` word and call `wake` if it is set. Every position comes from
 * the Python side at construction (shm_schema.layout, the row's geometry): nothing here knows
 * the layout but that a record is whole native words.
 *
 * Why C: the Python `put` costs three atomic calls, a struct pack and the attribute work
 * around them; a plain request writes two events, a stream three, each on caches its tokens
 * left cold (bench/flow_profile.py: about 1.6 us an event in flow, 5 us in a stream's).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MAX_WORDS 16

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    Py_ssize_t tail_offset, head_offset, sleeping_offset, ring_offset;
    Py_ssize_t words;     /* a record's words */
    uint64_t capacity;    /* records in the ring */
    uint64_t tail;        /* the next record's index (single producer: this writer) */
    uint64_t written;     /* records this writer published */
    PyObject *wake;       /* called after a waking event is published while the sidecar sleeps */
} RingWriter;

static inline uint64_t *word_at(RingWriter *w, Py_ssize_t offset) {
    return (uint64_t *)((char *)w->view.buf + offset);
}

static int RingWriter_init(RingWriter *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"buffer", "tail_offset", "head_offset", "sleeping_offset",
                            "ring_offset", "capacity", "record_words", "wake", NULL};
    PyObject *buffer, *wake = Py_None;
    unsigned long long capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnnnnKn|O", names, &buffer,
                                     &self->tail_offset, &self->head_offset,
                                     &self->sleeping_offset, &self->ring_offset, &capacity,
                                     &self->words, &wake))
        return -1;
    if (self->has_view) {
        PyErr_SetString(PyExc_RuntimeError, "already initialised");
        return -1;
    }
    if (capacity == 0 || self->words < 1 || self->words > MAX_WORDS) {
        PyErr_SetString(PyExc_ValueError, "a ring holds at least one record of 1 to 16 words");
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &self->view, PyBUF_WRITABLE) < 0)
        return -1;
    self->has_view = 1;
    Py_ssize_t ring_end = self->ring_offset + (Py_ssize_t)(8 * self->words * capacity);
    if (self->tail_offset < 0 || self->tail_offset + 8 > self->view.len
        || self->head_offset < 0 || self->head_offset + 8 > self->view.len
        || self->sleeping_offset < 0 || self->sleeping_offset + 8 > self->view.len
        || self->ring_offset < 0 || ring_end > self->view.len || ring_end < self->ring_offset) {
        PyErr_SetString(PyExc_ValueError, "an offset outside the buffer");
        return -1;
    }
    if (((uintptr_t)self->view.buf | (uintptr_t)self->tail_offset | (uintptr_t)self->head_offset
         | (uintptr_t)self->sleeping_offset | (uintptr_t)self->ring_offset) % 8) {
        PyErr_SetString(PyExc_ValueError, "every word must be 8-byte aligned");
        return -1;
    }
    self->capacity = capacity;
    self->tail = __atomic_load_n(word_at(self, self->tail_offset), __ATOMIC_SEQ_CST);
    self->written = 0;
    Py_INCREF(wake);
    Py_XSETREF(self->wake, wake);
    return 0;
}

/* put(record, wakes=True) -> bool: False (nothing written) when the ring is full. */
static PyObject *RingWriter_put(RingWriter *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2 || !PyTuple_Check(args[0])
        || PyTuple_GET_SIZE(args[0]) != self->words) {
        PyErr_Format(PyExc_TypeError, "put(record, wakes=True): record a tuple of %zd ints",
                     self->words);
        return NULL;
    }
    if (!self->has_view) {
        PyErr_SetString(PyExc_ValueError, "the segment is closed");
        return NULL;
    }
    int wakes = nargs < 2 ? 1 : PyObject_IsTrue(args[1]);
    if (wakes < 0)
        return NULL;
    uint64_t values[MAX_WORDS];
    for (Py_ssize_t i = 0; i < self->words; i++) {
        values[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(args[0], i));
        if (values[i] == (uint64_t)-1 && PyErr_Occurred())
            return NULL;
    }
    uint64_t tail = self->tail;
    if (tail - __atomic_load_n(word_at(self, self->head_offset), __ATOMIC_SEQ_CST) >= self->capacity)
        Py_RETURN_FALSE;
    uint64_t *record = word_at(self, self->ring_offset
                                     + (Py_ssize_t)(8 * self->words * (tail % self->capacity)));
    for (Py_ssize_t i = 0; i < self->words; i++)
        record[i] = values[i];
    self->tail = tail + 1;
    __atomic_store_n(word_at(self, self->tail_offset), tail + 1, __ATOMIC_SEQ_CST);  /* publish */
    self->written++;
    if (wakes && self->wake != Py_None
        && __atomic_load_n(word_at(self, self->sleeping_offset), __ATOMIC_SEQ_CST)) {
        PyObject *rung = PyObject_CallNoArgs(self->wake);
        if (rung == NULL)
            return NULL;
        Py_DECREF(rung);
    }
    Py_RETURN_TRUE;
}

static PyObject *RingWriter_close(RingWriter *self, PyObject *unused) {
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    Py_RETURN_NONE;
}

static void RingWriter_dealloc(RingWriter *self) {
    RingWriter_close(self, NULL);
    Py_CLEAR(self->wake);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *RingWriter_written(RingWriter *self, void *unused) {
    return PyLong_FromUnsignedLongLong(self->written);
}

static PyMethodDef RingWriter_methods[] = {
    {"put", (PyCFunction)(void (*)(void))RingWriter_put, METH_FASTCALL,
     "put(record, wakes=True) -> bool: the record's words published at the tail, and `wake` "
     "called if `wakes` and the sidecar sleeps; False, with nothing written, if the ring is full."},
    {"close", (PyCFunction)RingWriter_close, METH_NOARGS, "Release the buffer; puts fail afterwards."},
    {NULL}
};

static PyGetSetDef RingWriter_getset[] = {
    {"written", (getter)RingWriter_written, NULL, "records this writer published", NULL},
    {NULL}
};

static PyTypeObject RingWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shm_schema._ring.RingWriter",
    .tp_basicsize = sizeof(RingWriter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The single producer of one worker row's event ring over a writable buffer.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)RingWriter_init,
    .tp_dealloc = (destructor)RingWriter_dealloc,
    .tp_methods = RingWriter_methods,
    .tp_getset = RingWriter_getset,
};

static struct PyModuleDef ring_module = {
    PyModuleDef_HEAD_INIT, "shm_schema._ring",
    "A worker's event-ring write in one C call (see shm_schema/events.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__ring(void) {
    if (PyType_Ready(&RingWriterType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&ring_module);
    if (module == NULL)
        return NULL;
    Py_INCREF(&RingWriterType);
    if (PyModule_AddObject(module, "RingWriter", (PyObject *)&RingWriterType) < 0) {
        Py_DECREF(&RingWriterType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
