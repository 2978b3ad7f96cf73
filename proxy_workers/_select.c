/* proxy_workers._select: the least_load plan's choice (proxy_workers/fast_score.py) in one C call.
 *
 * SelectionPlan generates, per directory snapshot, a Python function that reads the candidates'
 * lane halves, checks their generations, adds the weighted counts and the predicted backlog, and
 * takes the lowest total. Under an exact scale (fast_score._exact_scale: the default weights)
 * every count term is an int, so this file computes the very same totals: the int sums exactly
 * (int64; the backlog in 128 bits), each converted to a double once, with the same double
 * operations in the same order, hence the same bits. tests/test_selection_plan.py holds the two
 * choice for choice and total for total.
 *
 * Nothing here knows the segment's layout: every byte offset (the candidates' count and
 * generation halves, the directory sequence, the snapshot generation) comes from shm_schema via
 * fast_score at construction. The buffer is the segment's memoryview, taken for the length of
 * one call only, so a closed segment is a ValueError here and never a dangling pointer.
 *
 * Why C: the generated Python costs 3-5 us for 16 candidates (one struct call, ~100 bytecodes of
 * arithmetic, the snapshot check); this is well under one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    Py_ssize_t offset;
    int64_t factor;
} CountTerm;

typedef struct {
    PyObject_HEAD
    PyObject *buffer;      /* the segment's memoryview */
    PyObject *candidates;  /* tuple: what `pick` returns one of */
    PyObject *ties;        /* ties(candidates, totals) -> candidate */
    PyObject *derive;      /* derive() -> None: re-reads the snapshot, calls set_pressure */
    Py_ssize_t n, terms_per_candidate, seq_offset, pressure_generation_offset;
    uint64_t seq;
    Py_ssize_t *generation_offsets;  /* n: each candidate's generation half */
    uint32_t *generations;           /* n: the generation the snapshot names */
    Py_ssize_t *inflight_offsets;    /* n: each candidate's inflight count half */
    CountTerm *terms;                /* n * terms_per_candidate: weighted count halves */
    int has_queue, has_counts, has_backlog;
    double unscale, backlog_weight;  /* 2**-J, and the backlog weight per microsecond */
    /* The pressure layer, as set_pressure last left it. */
    uint64_t pressure_generation;
    int pressure_known, pressure_state;  /* state: 0 none (queue only), 1 usable, 2 unusable */
    int64_t published, stale_us;
    int64_t *counts, *free_at, *announced, *marginal;  /* n each (relative to `published`) */
} Plan;

enum { PRESSURE_NONE = 0, PRESSURE_USABLE = 1, PRESSURE_UNUSABLE = 2 };

static int64_t *new_int64s(Py_ssize_t n) {
    int64_t *values = PyMem_Calloc(n ? n : 1, sizeof(int64_t));
    if (values == NULL)
        PyErr_NoMemory();
    return values;
}

/* offsets: a sequence of n ints, each a byte offset of a 4-byte half inside the buffer. */
static Py_ssize_t *read_offsets(PyObject *seq, Py_ssize_t n, Py_ssize_t length) {
    PyObject *fast = PySequence_Fast(seq, "offsets must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t *offsets = NULL;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_SetString(PyExc_ValueError, "one offset per candidate");
        goto done;
    }
    offsets = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    if (offsets == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t offset = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, i));
        if (offset == -1 && PyErr_Occurred())
            goto fail;
        if (offset < 0 || offset % 4 || offset + 4 > length) {
            PyErr_SetString(PyExc_ValueError, "an offset outside the buffer or not aligned");
            goto fail;
        }
        offsets[i] = offset;
    }
    goto done;
fail:
    PyMem_Free(offsets);
    offsets = NULL;
done:
    Py_DECREF(fast);
    return offsets;
}

static int Plan_init(Plan *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"buffer", "candidates", "ties", "derive", "seq_offset", "seq",
                            "pressure_generation_offset", "generation_offsets", "generations",
                            "inflight_offsets", "term_offsets", "term_factors", "unscale",
                            "has_counts", "backlog_weight", NULL};
    PyObject *buffer, *candidates, *ties, *derive, *generation_offsets, *generations;
    PyObject *inflight_offsets, *term_offsets, *term_factors;
    Py_ssize_t seq_offset, pressure_generation_offset;
    unsigned long long seq;
    double unscale, backlog_weight;
    int has_counts;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!OOnKnOOOOOdpd", names, &buffer,
                                     &PyTuple_Type, &candidates, &ties, &derive, &seq_offset,
                                     &seq, &pressure_generation_offset, &generation_offsets,
                                     &generations, &inflight_offsets, &term_offsets,
                                     &term_factors, &unscale, &has_counts, &backlog_weight))
        return -1;
    if (self->buffer != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Plan is initialised once");
        return -1;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE) < 0)
        return -1;
    Py_ssize_t length = view.len;
    PyBuffer_Release(&view);
    Py_ssize_t n = PyTuple_GET_SIZE(candidates);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "a plan needs a candidate");
        return -1;
    }
    if (seq_offset < 0 || seq_offset % 8 || seq_offset + 8 > length || pressure_generation_offset < 0
        || pressure_generation_offset % 8 || pressure_generation_offset + 8 > length) {
        PyErr_SetString(PyExc_ValueError, "a header offset outside the buffer or not aligned");
        return -1;
    }
    self->n = n;
    self->seq_offset = seq_offset;
    self->seq = seq;
    self->pressure_generation_offset = pressure_generation_offset;
    self->unscale = unscale;
    self->has_counts = has_counts;
    self->has_backlog = backlog_weight != 0.0;
    self->backlog_weight = backlog_weight;
    Py_INCREF(buffer);
    self->buffer = buffer;
    Py_INCREF(candidates);
    self->candidates = candidates;
    Py_INCREF(ties);
    self->ties = ties;
    Py_INCREF(derive);
    self->derive = derive;

    if ((self->generation_offsets = read_offsets(generation_offsets, n, length)) == NULL
        || (self->inflight_offsets = read_offsets(inflight_offsets, n, length)) == NULL)
        return -1;
    self->generations = PyMem_Calloc(n, sizeof(uint32_t));
    if (self->generations == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *fast = PySequence_Fast(generations, "generations must be a sequence");
    if (fast == NULL)
        return -1;
    int ok = PySequence_Fast_GET_SIZE(fast) == n;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        unsigned long value = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(fast, i));
        ok = !(value == (unsigned long)-1 && PyErr_Occurred()) && value <= UINT32_MAX;
        self->generations[i] = (uint32_t)value;
    }
    Py_DECREF(fast);
    if (!ok) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "one 32-bit generation per candidate");
        return -1;
    }

    /* term_offsets / term_factors: n sequences each, of equal length (the weighted lanes). */
    PyObject *offsets_fast = PySequence_Fast(term_offsets, "term offsets must be a sequence");
    PyObject *factors_fast = offsets_fast ? PySequence_Fast(term_factors, "term factors must be a sequence") : NULL;
    ok = factors_fast != NULL && PySequence_Fast_GET_SIZE(offsets_fast) == n
         && PySequence_Fast_GET_SIZE(factors_fast) == n;
    if (!ok && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "one term list per candidate");
    Py_ssize_t width = ok ? PySequence_Size(PySequence_Fast_GET_ITEM(offsets_fast, 0)) : 0;
    if (ok && width < 0)
        ok = 0;
    if (ok) {
        self->terms_per_candidate = width;
        self->has_queue = width > 0;
        self->terms = PyMem_Calloc(n * (width ? width : 1), sizeof(CountTerm));
        if (self->terms == NULL) {
            PyErr_NoMemory();
            ok = 0;
        }
    }
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        Py_ssize_t *offsets = read_offsets(PySequence_Fast_GET_ITEM(offsets_fast, i), width, length);
        PyObject *factors = offsets ? PySequence_Fast(PySequence_Fast_GET_ITEM(factors_fast, i),
                                                      "factors must be a sequence") : NULL;
        ok = factors != NULL && PySequence_Fast_GET_SIZE(factors) == width;
        if (!ok && !PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "one factor per term");
        for (Py_ssize_t j = 0; ok && j < width; j++) {
            long long factor = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(factors, j));
            ok = !(factor == -1 && PyErr_Occurred());
            if (ok && (factor < -(1LL << 20) || factor > (1LL << 20))) {
                PyErr_SetString(PyExc_ValueError, "a factor outside -2**20 .. 2**20");
                ok = 0;
            }
            self->terms[i * width + j] = (CountTerm){offsets[j], factor};
        }
        Py_XDECREF(factors);
        PyMem_Free(offsets);
    }
    Py_XDECREF(offsets_fast);
    Py_XDECREF(factors_fast);
    if (!ok)
        return -1;
    if ((self->counts = new_int64s(n)) == NULL || (self->free_at = new_int64s(n)) == NULL
        || (self->announced = new_int64s(n)) == NULL || (self->marginal = new_int64s(n)) == NULL)
        return -1;
    return 0;
}

/* The plan and its SelectionPlan refer to each other (derive is a bound method of it): the
 * collector must see the references to break that cycle when the directory moves on. */
static int Plan_traverse(Plan *self, visitproc visit, void *arg) {
    Py_VISIT(self->buffer);
    Py_VISIT(self->candidates);
    Py_VISIT(self->ties);
    Py_VISIT(self->derive);
    return 0;
}

static int Plan_clear(Plan *self) {
    Py_CLEAR(self->buffer);
    Py_CLEAR(self->candidates);
    Py_CLEAR(self->ties);
    Py_CLEAR(self->derive);
    return 0;
}

static void Plan_dealloc(Plan *self) {
    PyObject_GC_UnTrack(self);
    Plan_clear(self);
    PyMem_Free(self->generation_offsets);
    PyMem_Free(self->generations);
    PyMem_Free(self->inflight_offsets);
    PyMem_Free(self->terms);
    PyMem_Free(self->counts);
    PyMem_Free(self->free_at);
    PyMem_Free(self->announced);
    PyMem_Free(self->marginal);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A value of the pressure tuple as int64; every one fast_score derives is below 2**62. */
static int take(PyObject *values, Py_ssize_t *at, int64_t *into) {
    long long value = PyLong_AsLongLong(PyTuple_GET_ITEM(values, (*at)++));
    if (value == -1 && PyErr_Occurred())
        return -1;
    *into = value;
    return 0;
}

/* set_pressure(generation, published, values, stale_us): what SelectionPlan derived of the
 * snapshot `generation`, published at `published` (0: never): False if it describes other
 * generations, else its tuple (the published time, then per candidate the scaled counts if
 * has_counts, and free_at, announced, marginal if the backlog is weighted). */
static PyObject *Plan_set_pressure(Plan *self, PyObject *args) {
    unsigned long long generation;
    long long published, stale_us;
    PyObject *values;
    if (!PyArg_ParseTuple(args, "KLOL", &generation, &published, &values, &stale_us))
        return NULL;
    self->pressure_known = 0;
    if (values == Py_False) {
        self->pressure_state = PRESSURE_UNUSABLE;
    } else {
        Py_ssize_t width = self->has_counts + 3 * self->has_backlog;
        if (!PyTuple_Check(values) || PyTuple_GET_SIZE(values) != 1 + width * self->n) {
            PyErr_SetString(PyExc_ValueError, "pressure values of another shape");
            return NULL;
        }
        Py_ssize_t at = 1;  /* [0] is the published time again */
        for (Py_ssize_t i = 0; i < self->n; i++) {
            if ((self->has_counts && take(values, &at, &self->counts[i]) < 0)
                || (self->has_backlog && (take(values, &at, &self->free_at[i]) < 0
                                          || take(values, &at, &self->announced[i]) < 0
                                          || take(values, &at, &self->marginal[i]) < 0)))
                return NULL;
        }
        self->pressure_state = PRESSURE_USABLE;
    }
    self->published = published;
    self->stale_us = stale_us;
    self->pressure_generation = generation;
    self->pressure_known = 1;
    Py_RETURN_NONE;
}

static inline uint32_t half_at(const char *base, Py_ssize_t offset) {
    return __atomic_load_n((const uint32_t *)(base + offset), __ATOMIC_RELAXED);
}

static inline uint64_t word_at(const char *base, Py_ssize_t offset) {
    return __atomic_load_n((const uint64_t *)(base + offset), __ATOMIC_SEQ_CST);
}

/* The totals into `totals` (n doubles): 0, or 1 when the plan has no choice (the directory
 * moved, a generation changed, the snapshot describes other generations), -1 on an error.
 * The steps of the generated function, in its order. */
static int compute(Plan *self, int64_t now, double *totals) {
    if (self->buffer == NULL) {
        PyErr_SetString(PyExc_ValueError, "a plan without a buffer (never initialised, or cleared)");
        return -1;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(self->buffer, &view, PyBUF_SIMPLE) < 0)
        return -1;
    const char *base = view.buf;
    Py_ssize_t n = self->n, width = self->terms_per_candidate;
    int64_t queue[n], inflight[n];
    int moved = 0;
    /* The halves first, then the sequence: all of them carry the snapshot's generations
     * while the sequence still reads the even value the snapshot was decoded at. */
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t sum = 0;
        const CountTerm *term = &self->terms[i * width];
        for (Py_ssize_t j = 0; j < width; j++)
            sum += (int64_t)half_at(base, term[j].offset) * term[j].factor;
        queue[i] = sum;
        inflight[i] = half_at(base, self->inflight_offsets[i]);
        moved |= half_at(base, self->generation_offsets[i]) != self->generations[i];
    }
    int directory_moved = word_at(base, self->seq_offset) != self->seq;
    uint64_t pressure_generation = word_at(base, self->pressure_generation_offset);
    PyBuffer_Release(&view);
    if (directory_moved)
        return 1;
    if (!self->pressure_known || pressure_generation != self->pressure_generation) {
        PyObject *result = PyObject_CallNoArgs(self->derive);
        if (result == NULL)
            return -1;
        Py_DECREF(result);
        if (!self->pressure_known) {
            PyErr_SetString(PyExc_RuntimeError, "derive() did not call set_pressure");
            return -1;
        }
    }
    int state = self->pressure_state;
    if (!self->published || now - self->published > self->stale_us)
        state = PRESSURE_NONE;  /* never published, or stale: the queue terms alone */
    if (moved || state == PRESSURE_UNUSABLE)
        return 1;
    int64_t since = now - self->published;  /* the generated code's T */
    int scaled = self->has_queue || self->has_counts;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (state == PRESSURE_NONE) {
            totals[i] = (double)queue[i] * self->unscale;
            continue;
        }
        int64_t counted = queue[i] + (self->has_counts ? self->counts[i] : 0);
        double total = (double)counted * self->unscale;
        if (self->has_backlog) {
            __int128 backlog = self->free_at[i] > since ? (__int128)self->free_at[i] - since : 0;
            if (inflight[i] > self->announced[i])
                backlog += (__int128)(inflight[i] - self->announced[i]) * self->marginal[i];
            double term = (double)backlog * self->backlog_weight;
            total = scaled ? total + term : term;
        }
        totals[i] = total;
    }
    return 0;
}

static PyObject *totals_list(const double *totals, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list != NULL && i < n; i++) {
        PyObject *value = PyFloat_FromDouble(totals[i]);
        if (value == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, value);
    }
    return list;
}

/* The totals at the call's one argument, `now` (as compute): `usage` names the call. */
static int totals_now(Plan *self, PyObject *const *args, Py_ssize_t nargs, const char *usage,
                      double *totals) {
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    int64_t now = PyLong_AsLongLong(args[0]);
    if (now == -1 && PyErr_Occurred())
        return -1;
    return compute(self, now, totals);
}

/* pick(now): the candidate with the lowest total (ties: ties(candidates, totals)), or None. */
static PyObject *Plan_pick(Plan *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t n = self->n;
    double totals[n];
    int outcome = totals_now(self, args, nargs, "pick(now)", totals);
    if (outcome < 0)
        return NULL;
    if (outcome > 0)
        Py_RETURN_NONE;
    /* The lowest total, the first of equals (min's choice); any equal one is a tie. */
    Py_ssize_t best = 0;
    int tie = 0;
    for (Py_ssize_t i = 1; i < n; i++) {
        if (totals[i] < totals[best]) {
            best = i;
            tie = 0;
        } else if (totals[i] == totals[best]) {
            tie = 1;
        }
    }
    if (!tie)
        return Py_NewRef(PyTuple_GET_ITEM(self->candidates, best));
    PyObject *list = totals_list(totals, n);
    if (list == NULL)
        return NULL;
    PyObject *choice = PyObject_CallFunctionObjArgs(self->ties, self->candidates, list, NULL);
    Py_DECREF(list);
    return choice;
}

/* totals(now): the list of totals, or None (as pick). */
static PyObject *Plan_totals(Plan *self, PyObject *const *args, Py_ssize_t nargs) {
    double totals[self->n];
    int outcome = totals_now(self, args, nargs, "totals(now)", totals);
    if (outcome < 0)
        return NULL;
    if (outcome > 0)
        Py_RETURN_NONE;
    return totals_list(totals, self->n);
}

static PyMethodDef Plan_methods[] = {
    {"pick", (PyCFunction)(void (*)(void))Plan_pick, METH_FASTCALL,
     "pick(now) -> the candidate with the lowest total, or None when the plan has no choice."},
    {"totals", (PyCFunction)(void (*)(void))Plan_totals, METH_FASTCALL,
     "totals(now) -> every candidate's total, or None."},
    {"set_pressure", (PyCFunction)Plan_set_pressure, METH_VARARGS,
     "set_pressure(generation, published, values, stale_us): the derived pressure layer."},
    {NULL},
};

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "proxy_workers._select.Plan",
    .tp_basicsize = sizeof(Plan),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Plan_traverse,
    .tp_clear = (inquiry)Plan_clear,
    .tp_doc = "least_load's choice over one directory snapshot's candidates (fast_score.SelectionPlan).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Plan_init,
    .tp_dealloc = (destructor)Plan_dealloc,
    .tp_methods = Plan_methods,
};

static struct PyModuleDef select_module = {
    PyModuleDef_HEAD_INIT, "proxy_workers._select",
    "least_load's choice in C (see proxy_workers/fast_score.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__select(void) {
    if (PyType_Ready(&PlanType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&select_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Plan", (PyObject *)&PlanType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
