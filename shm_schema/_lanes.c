/* shm_schema._lanes: WorkerRow's counter-lane update (shm_schema/counters.py) in one C call.
 *
 * The same steps as the Python closure `WorkerRow._update`, in the same order, with the same
 * sequentially consistent atomics: journal "pending", CAS loop on the host-wide lane word
 * (refused on another generation, at the floor or past the limit), this worker's share word,
 * journal "idle". Every position and bit format comes from the Python side at construction
 * (shm_schema.layout, shm_schema.bitfields): nothing here knows the layout.
 *
 * Why C: the Python closure costs about five atomic calls and a dozen big-int operations,
 * 0.8-1.5 us per update, and a request makes at least two (begin, end).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    Py_ssize_t journal_offset, contributions_base, counters_offset;
    uint64_t journal;       /* the last op sequence's idle word */
    uint64_t journal_step;  /* JournalWord.idle(1) */
    unsigned lanes, generation_shift, lane_shift;
    uint64_t count_mask, end_bit;
} Updater;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Updater *updater;
    unsigned lane;
    int delta;
    PyObject *results;  /* (refused, applied, stale) */
} LaneOp;

static PyTypeObject LaneOpType;

static inline uint64_t *word_at(Updater *u, Py_ssize_t offset) {
    return (uint64_t *)((char *)u->view.buf + offset);
}

/* 1 applied, 0 refused (floor or limit), -1 stale generation; as the Python closure. */
static int apply(Updater *u, unsigned lane, int delta, Py_ssize_t slot, uint64_t generation,
                 uint64_t limit) {
    uint64_t journal = (u->journal += u->journal_step);
    uint64_t pending = journal | ((uint64_t)lane << u->lane_shift) | (delta < 0 ? u->end_bit : 0)
                       | (uint64_t)(slot + 1);
    Py_ssize_t index = (Py_ssize_t)u->lanes * slot + lane;
    uint64_t *jword = word_at(u, u->journal_offset);
    uint64_t *lane_word = word_at(u, u->counters_offset + 8 * index);
    uint64_t *share_word = word_at(u, u->contributions_base + 8 * index);
    uint64_t tag = generation << u->generation_shift;
    int result = 0;

    __atomic_store_n(jword, pending, __ATOMIC_SEQ_CST);
    uint64_t word = __atomic_load_n(lane_word, __ATOMIC_SEQ_CST);
    for (;;) {
        /* The word carries `generation` exactly when word - tag is a count. */
        if (word < tag || word - tag > u->count_mask) {
            result = -1;
            break;
        }
        uint64_t count = word - tag;  /* then count + delta must be 0 .. limit */
        if (delta < 0 ? (count == 0 || count - 1 > limit) : count + 1 > limit)
            break;
        uint64_t wanted = delta < 0 ? word - 1 : word + 1;
        if (__atomic_compare_exchange_n(lane_word, &word, wanted, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST)) {
            result = 1;
            break;
        }  /* `word` now holds what another process left: try again from it */
    }
    /* The share: an increment counts only if it landed; a decrement always gives back. */
    if (result > 0 || delta < 0) {
        uint64_t share = __atomic_load_n(share_word, __ATOMIC_SEQ_CST);
        uint64_t own;
        if (share < tag || share - tag > u->count_mask) {  /* another generation's: 0 */
            share = tag;
            own = 0;
        } else {
            own = share - tag;
        }
        if (delta > 0 || own > 0) {
            share = delta < 0 ? share - 1 : share + 1;
            __atomic_store_n(share_word, share, __ATOMIC_SEQ_CST);
        }
    }
    __atomic_store_n(jword, journal, __ATOMIC_SEQ_CST);
    return result;
}

/* --- Updater ----------------------------------------------------------------------------- */

static int Updater_init(Updater *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"buffer", "journal_offset", "contributions_base", "counters_offset",
                            "journal_start", "journal_step", "lanes", "generation_shift",
                            "count_mask", "lane_shift", "end_bit", NULL};
    PyObject *buffer;
    unsigned long long journal, step, count_mask, end_bit;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnnnKKIIKIK", names, &buffer,
                                     &self->journal_offset, &self->contributions_base,
                                     &self->counters_offset, &journal, &step, &self->lanes,
                                     &self->generation_shift, &count_mask, &self->lane_shift,
                                     &end_bit))
        return -1;
    if (self->has_view) {
        PyErr_SetString(PyExc_RuntimeError, "already initialised");
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &self->view, PyBUF_WRITABLE) < 0)
        return -1;
    self->has_view = 1;
    if (self->journal_offset < 0 || self->journal_offset + 8 > self->view.len
        || self->contributions_base < 0 || self->counters_offset < 0) {
        PyErr_SetString(PyExc_ValueError, "an offset outside the buffer");
        return -1;
    }
    if (((uintptr_t)self->view.buf | (uintptr_t)self->journal_offset
         | (uintptr_t)self->contributions_base | (uintptr_t)self->counters_offset) % 8) {
        PyErr_SetString(PyExc_ValueError, "every word must be 8-byte aligned");
        return -1;
    }
    self->journal = journal;
    self->journal_step = step;
    self->count_mask = count_mask;
    self->end_bit = end_bit;
    return 0;
}

static PyObject *Updater_close(Updater *self, PyObject *unused) {
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    Py_RETURN_NONE;
}

static void Updater_dealloc(Updater *self) {
    Updater_close(self, NULL);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Updater_journal(Updater *self, void *unused) {
    return PyLong_FromUnsignedLongLong(self->journal);
}

static int Updater_set_journal(Updater *self, PyObject *value, void *unused) {
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "the journal cannot be deleted");
        return -1;
    }
    unsigned long long journal = PyLong_AsUnsignedLongLong(value);
    if (PyErr_Occurred())
        return -1;
    self->journal = journal;
    return 0;
}

static PyObject *LaneOp_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames);

static PyObject *Updater_bind(Updater *self, PyObject *args) {
    unsigned lane;
    int delta;
    PyObject *results;
    if (!PyArg_ParseTuple(args, "IiO!", &lane, &delta, &PyTuple_Type, &results))
        return NULL;
    if ((delta != 1 && delta != -1) || PyTuple_GET_SIZE(results) != 3 || lane >= self->lanes) {
        PyErr_SetString(PyExc_ValueError, "bind(lane < lanes, delta +1 or -1, a 3-tuple of results)");
        return NULL;
    }
    LaneOp *op = PyObject_New(LaneOp, &LaneOpType);
    if (op == NULL)
        return NULL;
    op->vectorcall = LaneOp_vectorcall;
    Py_INCREF(self);
    op->updater = self;
    op->lane = lane;
    op->delta = delta;
    Py_INCREF(results);
    op->results = results;
    return (PyObject *)op;
}

static PyMethodDef Updater_methods[] = {
    {"bind", (PyCFunction)Updater_bind, METH_VARARGS,
     "bind(lane, delta, results) -> op(slot, generation, limit=count_mask): results[r] for r = "
     "1 applied, 0 refused, -1 stale."},
    {"close", (PyCFunction)Updater_close, METH_NOARGS, "Release the buffer; ops fail afterwards."},
    {NULL}
};

static PyGetSetDef Updater_getset[] = {
    {"journal", (getter)Updater_journal, (setter)Updater_set_journal,
     "the idle journal word of the last operation (the next one is one step on)", NULL},
    {NULL}
};

static PyTypeObject UpdaterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shm_schema._lanes.Updater",
    .tp_basicsize = sizeof(Updater),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One worker row's counter-lane updates over a writable buffer (the segment).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Updater_init,
    .tp_dealloc = (destructor)Updater_dealloc,
    .tp_methods = Updater_methods,
    .tp_getset = Updater_getset,
};

/* --- LaneOp: begin, end, add, remove, try_admit ------------------------------------------ */

static PyObject *LaneOp_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames) {
    LaneOp *op = (LaneOp *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Updater *u = op->updater;
    if (kwnames != NULL || nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "op(slot, generation, limit=...) takes 2 or 3 positional arguments");
        return NULL;
    }
    if (!u->has_view) {
        PyErr_SetString(PyExc_ValueError, "the segment is closed");
        return NULL;
    }
    Py_ssize_t slot = PyLong_AsSsize_t(args[0]);
    unsigned long long generation = PyLong_AsUnsignedLongLong(args[1]);
    unsigned long long limit = nargs == 3 ? PyLong_AsUnsignedLongLong(args[2]) : u->count_mask;
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t words = (Py_ssize_t)u->lanes * (slot + 1);
    if (slot < 0 || slot > 0xFFFE
        || u->counters_offset + 8 * words > u->view.len
        || u->contributions_base + 8 * words > u->view.len) {
        PyErr_SetString(PyExc_IndexError, "slot outside the segment");
        return NULL;
    }
    int result = apply(u, op->lane, op->delta, slot, (uint64_t)generation, (uint64_t)limit);
    PyObject *value = PyTuple_GET_ITEM(op->results, result < 0 ? 2 : result);
    Py_INCREF(value);
    return value;
}

static void LaneOp_dealloc(LaneOp *op) {
    Py_DECREF(op->updater);
    Py_DECREF(op->results);
    PyObject_Free(op);
}

static PyTypeObject LaneOpType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shm_schema._lanes.LaneOp",
    .tp_basicsize = sizeof(LaneOp),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(LaneOp, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)LaneOp_dealloc,
    .tp_doc = "One lane and direction of an Updater: op(slot, generation[, limit]).",
};

static struct PyModuleDef lanes_module = {
    PyModuleDef_HEAD_INIT, "shm_schema._lanes",
    "WorkerRow's counter-lane update in one C call (see shm_schema/counters.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__lanes(void) {
    if (PyType_Ready(&UpdaterType) < 0 || PyType_Ready(&LaneOpType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&lanes_module);
    if (module == NULL)
        return NULL;
    Py_INCREF(&UpdaterType);
    if (PyModule_AddObject(module, "Updater", (PyObject *)&UpdaterType) < 0) {
        Py_DECREF(&UpdaterType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
