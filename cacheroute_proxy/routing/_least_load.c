/* cacheroute_proxy.routing._least_load: least_load's score and choice (least_load.py) in C,
 * and the booking of the request it chose (LoadView.booking's answer, from the same reads).
 *
 * One Selector per directory snapshot: it reads its candidates' counter halves straight from
 * the shared segment and computes, per candidate, what least_load.least_load_totals computes
 * from LoadView.components -- Sigma weight x value over the weighted components, in the
 * order of the weights (the counter lanes, then the pending and decoding counts, then the
 * predicted backlog) -- with the same double operations in the same order, hence the same
 * bits: every value is an integer below 2**53 (exact as a double), every division by 1000
 * is the correctly rounded one Python's int / int makes, and the build turns off fused
 * multiply-adds (setup.py). tests/test_least_load_selection.py holds the two equal on
 * randomised tables.
 *
 * Nothing here knows the segment's layout: every byte offset (the candidates' count and
 * generation halves, the directory sequence, the snapshot generation) comes from shm_schema
 * via least_load.py at construction, and the snapshot's records come through `derive`, a
 * Python callable, once per published snapshot generation. The buffer is the segment's
 * memoryview, taken for the length of one call only, so a closed segment is a ValueError here
 * and never a dangling pointer.
 *
 * The selector steps aside (None) wherever the component path would see something it does not:
 * the directory moved, a slot changed generation, a record describes another generation, a
 * value is beyond 2**53, or no weighted component is known (Python's round-robin then).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#define EXACT_LIMIT (INT64_C(1) << 53)  /* integers below this are exact as doubles */
#define RECORD_VALUES 5                 /* per candidate, as `derive` hands them over */

typedef struct {
    PyObject_HEAD
    PyObject *weakrefs;    /* a test sees a replaced selector freed */
    PyObject *buffer;      /* the segment's memoryview */
    PyObject *candidates;  /* tuple: what `pick` returns one of */
    PyObject *ties;        /* ties(candidates, totals) -> candidate */
    PyObject *derive;      /* derive() -> (snapshot generation, published us, values or False) */
    Py_ssize_t n, width, seq_offset, pressure_generation_offset;
    uint64_t seq;
    Py_ssize_t *generation_offsets;  /* n: each candidate's generation half */
    uint32_t *generations;           /* n: the generation the directory snapshot names */
    Py_ssize_t *inflight_offsets;    /* n: each candidate's inflight count half */
    uint32_t *batch_limits;          /* n: each candidate's max_num_seqs, 0 for none */
    Py_ssize_t *lane_offsets;        /* n * width: the weighted lanes' count halves */
    double *lane_weights;            /* width: their weights, in the order of the weights */
    double pending_weight, decoding_weight, backlog_weight;
    int has_predicted;
    int64_t stale_us;
    /* The snapshot's part, as `derive` last handed it over. */
    uint64_t pressure_generation;
    int pressure_known, pressure_state;
    int64_t published;
    int64_t *pending, *decoding, *marginal;  /* n each */
    int64_t *free_at, *announced;  /* n each: the later of the two free times; pending + decoding */
    /* A marginal backlog of 2**21 us or more: unseen (a count, below 2**32) x marginal may
     * pass 2**53, so compute checks it before it adds (below, it cannot). */
    int marginal_may_overflow;
} Selector;

/* What the snapshot offers: nothing (never published, or stale: the lanes alone), a record of
 * the right generation for every candidate, or records of other generations (step aside). */
enum { PRESSURE_NONE = 0, PRESSURE_USABLE = 1, PRESSURE_UNUSABLE = 2 };

static void *new_array(Py_ssize_t n, size_t size) {
    void *values = PyMem_Calloc(n ? n : 1, size);
    if (values == NULL)
        PyErr_NoMemory();
    return values;
}

/* offsets: a sequence of n ints, each a byte offset of a 4-byte half inside the buffer. */
static int read_offsets(PyObject *seq, Py_ssize_t n, Py_ssize_t length, Py_ssize_t *into) {
    PyObject *fast = PySequence_Fast(seq, "offsets must be a sequence");
    if (fast == NULL)
        return -1;
    int ok = PySequence_Fast_GET_SIZE(fast) == n;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "an offset list of another length");
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        Py_ssize_t offset = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, i));
        ok = !(offset == -1 && PyErr_Occurred());
        if (ok && (offset < 0 || offset % 4 || offset + 4 > length)) {
            PyErr_SetString(PyExc_ValueError, "an offset outside the buffer or not aligned");
            ok = 0;
        }
        into[i] = offset;
    }
    Py_DECREF(fast);
    return ok ? 0 : -1;
}

static int read_doubles(PyObject *seq, Py_ssize_t n, double *into) {
    PyObject *fast = PySequence_Fast(seq, "weights must be a sequence");
    if (fast == NULL)
        return -1;
    int ok = PySequence_Fast_GET_SIZE(fast) == n;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "one weight per lane");
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        into[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, i));
        ok = !(into[i] == -1.0 && PyErr_Occurred());
    }
    Py_DECREF(fast);
    return ok ? 0 : -1;
}

/* seq: n ints, each 0 .. 2**32 - 1; `what` says what they are when one is not. */
static int read_halves(PyObject *seq, Py_ssize_t n, const char *what, uint32_t *into) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    int ok = PySequence_Fast_GET_SIZE(fast) == n;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        unsigned long value = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(fast, i));
        ok = !(value == (unsigned long)-1 && PyErr_Occurred()) && value <= UINT32_MAX;
        into[i] = (uint32_t)value;
    }
    Py_DECREF(fast);
    if (!ok && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, what);
    return ok ? 0 : -1;
}

static int Selector_init(Selector *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"buffer", "candidates", "ties", "derive", "seq_offset", "seq",
                            "pressure_generation_offset", "generation_offsets", "generations",
                            "inflight_offsets", "lane_offsets", "lane_weights", "pending_weight",
                            "decoding_weight", "backlog_weight", "stale_us", "batch_limits", NULL};
    PyObject *buffer, *candidates, *ties, *derive, *generation_offsets, *generations;
    PyObject *batch_limits;
    PyObject *inflight_offsets, *lane_offsets, *lane_weights;
    Py_ssize_t seq_offset, pressure_generation_offset;
    unsigned long long seq;
    long long stale_us;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!OOnKnOOOOOdddLO", names, &buffer,
                                     &PyTuple_Type, &candidates, &ties, &derive, &seq_offset,
                                     &seq, &pressure_generation_offset, &generation_offsets,
                                     &generations, &inflight_offsets, &lane_offsets,
                                     &lane_weights, &self->pending_weight, &self->decoding_weight,
                                     &self->backlog_weight, &stale_us, &batch_limits))
        return -1;
    if (self->buffer != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Selector is initialised once");
        return -1;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE) < 0)
        return -1;
    Py_ssize_t length = view.len;
    PyBuffer_Release(&view);
    Py_ssize_t n = PyTuple_GET_SIZE(candidates);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "a selector needs a candidate");
        return -1;
    }
    if (seq_offset < 0 || seq_offset % 8 || seq_offset + 8 > length || pressure_generation_offset < 0
        || pressure_generation_offset % 8 || pressure_generation_offset + 8 > length) {
        PyErr_SetString(PyExc_ValueError, "a header offset outside the buffer or not aligned");
        return -1;
    }
    Py_ssize_t width = PySequence_Size(lane_weights);
    if (width < 0)
        return -1;
    self->n = n;
    self->width = width;
    self->seq_offset = seq_offset;
    self->seq = seq;
    self->pressure_generation_offset = pressure_generation_offset;
    self->has_predicted = self->pending_weight != 0.0 || self->decoding_weight != 0.0
                          || self->backlog_weight != 0.0;
    self->stale_us = stale_us;
    self->buffer = Py_NewRef(buffer);
    self->candidates = Py_NewRef(candidates);
    self->ties = Py_NewRef(ties);
    self->derive = Py_NewRef(derive);

    if ((self->generation_offsets = new_array(n, sizeof(Py_ssize_t))) == NULL
        || (self->generations = new_array(n, sizeof(uint32_t))) == NULL
        || (self->inflight_offsets = new_array(n, sizeof(Py_ssize_t))) == NULL
        || (self->batch_limits = new_array(n, sizeof(uint32_t))) == NULL
        || (self->lane_offsets = new_array(n * width, sizeof(Py_ssize_t))) == NULL
        || (self->lane_weights = new_array(width, sizeof(double))) == NULL
        || (self->pending = new_array(n, sizeof(int64_t))) == NULL
        || (self->decoding = new_array(n, sizeof(int64_t))) == NULL
        || (self->free_at = new_array(n, sizeof(int64_t))) == NULL
        || (self->announced = new_array(n, sizeof(int64_t))) == NULL
        || (self->marginal = new_array(n, sizeof(int64_t))) == NULL)
        return -1;
    if (read_offsets(generation_offsets, n, length, self->generation_offsets) < 0
        || read_offsets(inflight_offsets, n, length, self->inflight_offsets) < 0
        || read_doubles(lane_weights, width, self->lane_weights) < 0)
        return -1;

    if (read_halves(generations, n, "one 32-bit generation per candidate", self->generations) < 0
        || read_halves(batch_limits, n, "one 32-bit batch limit per candidate", self->batch_limits) < 0)
        return -1;

    /* lane_offsets: n sequences of `width` offsets each, in the order of lane_weights. */
    PyObject *fast = PySequence_Fast(lane_offsets, "lane offsets must be a sequence");
    if (fast == NULL)
        return -1;
    int ok = PySequence_Fast_GET_SIZE(fast) == n;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "one lane offset list per candidate");
    for (Py_ssize_t i = 0; ok && i < n; i++)
        ok = read_offsets(PySequence_Fast_GET_ITEM(fast, i), width, length,
                          &self->lane_offsets[i * width]) == 0;
    Py_DECREF(fast);
    return ok ? 0 : -1;
}

/* The selector and its policy refer to each other (`ties` is a bound method of the policy,
 * which keeps its current selector): the collector must see the references to break that
 * cycle when the directory moves on. */
static int Selector_traverse(Selector *self, visitproc visit, void *arg) {
    Py_VISIT(self->buffer);
    Py_VISIT(self->candidates);
    Py_VISIT(self->ties);
    Py_VISIT(self->derive);
    return 0;
}

static int Selector_clear(Selector *self) {
    Py_CLEAR(self->buffer);
    Py_CLEAR(self->candidates);
    Py_CLEAR(self->ties);
    Py_CLEAR(self->derive);
    return 0;
}

static void Selector_dealloc(Selector *self) {
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    Selector_clear(self);
    PyMem_Free(self->generation_offsets);
    PyMem_Free(self->generations);
    PyMem_Free(self->inflight_offsets);
    PyMem_Free(self->batch_limits);
    PyMem_Free(self->lane_offsets);
    PyMem_Free(self->lane_weights);
    PyMem_Free(self->pending);
    PyMem_Free(self->decoding);
    PyMem_Free(self->free_at);
    PyMem_Free(self->announced);
    PyMem_Free(self->marginal);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A value of the records tuple, which least_load.py keeps in 0 .. 2**53. */
static int take(PyObject *values, Py_ssize_t at, int64_t *into) {
    long long value = PyLong_AsLongLong(PyTuple_GET_ITEM(values, at));
    if (value == -1 && PyErr_Occurred())
        return -1;
    if (value < 0 || value >= EXACT_LIMIT) {
        PyErr_SetString(PyExc_ValueError, "a record value outside 0 .. 2**53");
        return -1;
    }
    *into = value;
    return 0;
}

/* Call derive() and keep what it read: (generation, published, values), values False if the
 * records describe other generations, else per candidate (pending, decoding, next slot free
 * at, prefill free at, marginal backlog), RECORD_VALUES ints each. */
static int derive(Selector *self) {
    PyObject *result = PyObject_CallNoArgs(self->derive);
    if (result == NULL)
        return -1;
    unsigned long long generation;
    long long published;
    PyObject *values;
    int ok = PyArg_ParseTuple(result, "KLO", &generation, &published, &values);
    self->pressure_known = 0;
    if (ok && values == Py_False) {
        self->pressure_state = PRESSURE_UNUSABLE;
    } else if (ok) {
        ok = PyTuple_Check(values) && PyTuple_GET_SIZE(values) == RECORD_VALUES * self->n;
        if (!ok)
            PyErr_SetString(PyExc_ValueError, "record values of another shape");
        self->marginal_may_overflow = 0;
        for (Py_ssize_t i = 0; ok && i < self->n; i++) {
            Py_ssize_t at = RECORD_VALUES * i;
            int64_t slot_free_at, prefill_free_at;
            ok = take(values, at, &self->pending[i]) == 0
                 && take(values, at + 1, &self->decoding[i]) == 0
                 && take(values, at + 2, &slot_free_at) == 0
                 && take(values, at + 3, &prefill_free_at) == 0
                 && take(values, at + 4, &self->marginal[i]) == 0;
            self->free_at[i] = slot_free_at > prefill_free_at ? slot_free_at : prefill_free_at;
            self->announced[i] = self->pending[i] + self->decoding[i];
            self->marginal_may_overflow |= self->marginal[i] >= INT64_C(1) << 21;
        }
        self->pressure_state = PRESSURE_USABLE;
    }
    Py_DECREF(result);
    if (!ok)
        return -1;
    self->published = published;
    self->pressure_generation = generation;
    self->pressure_known = 1;
    return 0;
}

static inline uint32_t half_at(const char *base, Py_ssize_t offset) {
    return __atomic_load_n((const uint32_t *)(base + offset), __ATOMIC_RELAXED);
}

static inline uint64_t word_at(const char *base, Py_ssize_t offset) {
    return __atomic_load_n((const uint64_t *)(base + offset), __ATOMIC_SEQ_CST);
}

/* The segment's bytes for the length of one call (a closed segment: ValueError). */
static int open_buffer(Selector *self, Py_buffer *view) {
    if (self->buffer == NULL) {
        PyErr_SetString(PyExc_ValueError, "a selector without a buffer (never initialised, or cleared)");
        return -1;
    }
    return PyObject_GetBuffer(self->buffer, view, PyBUF_SIMPLE);
}

/* What the snapshot offers at `now`, given the pressure generation just read (derived again
 * where it moved): PRESSURE_NONE when never published or stale, -1 on an error. */
static int pressure_at(Selector *self, uint64_t pressure_generation, int64_t now) {
    if ((!self->pressure_known || pressure_generation != self->pressure_generation)
        && derive(self) < 0)
        return -1;
    if (!self->published || now - self->published > self->stale_us)
        return PRESSURE_NONE;
    return self->pressure_state;
}

/* The totals into `totals` (n doubles): 0, or 1 when the selector steps aside, -1 on an error. */
static int compute(Selector *self, int64_t now, double *totals) {
    Py_buffer view;
    if (open_buffer(self, &view) < 0)
        return -1;
    const char *base = view.buf;
    Py_ssize_t n = self->n, width = self->width;
    uint32_t counts[n * (width ? width : 1)], inflight[n];
    int moved = 0;
    /* The halves first, then the sequence: all of them carry the snapshot's generations
     * while the sequence still reads the even value the snapshot was decoded at. */
    for (Py_ssize_t i = 0; i < n; i++) {
        for (Py_ssize_t j = 0; j < width; j++)
            counts[i * width + j] = half_at(base, self->lane_offsets[i * width + j]);
        inflight[i] = half_at(base, self->inflight_offsets[i]);
        moved |= half_at(base, self->generation_offsets[i]) != self->generations[i];
    }
    int directory_moved = word_at(base, self->seq_offset) != self->seq;
    uint64_t pressure_generation = word_at(base, self->pressure_generation_offset);
    PyBuffer_Release(&view);
    if (directory_moved)
        return 1;
    int state = pressure_at(self, pressure_generation, now);  /* NONE: the lanes alone */
    if (state < 0)
        return -1;
    if (moved || state == PRESSURE_UNUSABLE)
        return 1;
    int predicted = state == PRESSURE_USABLE && self->has_predicted;
    if (width == 0 && !predicted)
        return 1;  /* no weighted component known of anyone: Python's round-robin */
    if (predicted && self->backlog_weight != 0.0 && self->marginal_may_overflow) {
        /* An unseen x marginal product below 2**53 is exact as a double, as Python's int
         * product; from 2**53 on Python's division is exact where a double's is not. */
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t unseen = inflight[i] > self->announced[i] ? inflight[i] - self->announced[i] : 0;
            if ((__int128)unseen * self->marginal[i] >= EXACT_LIMIT)
                return 1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* 0.0 + the first term is that term exactly (terms are never negative), as Python's
         * sum starting at its first term. */
        double total = 0.0;
        for (Py_ssize_t j = 0; j < width; j++)
            total += (double)counts[i * width + j] * self->lane_weights[j];
        if (predicted) {
            if (self->pending_weight != 0.0)
                total += (double)self->pending[i] * self->pending_weight;
            if (self->decoding_weight != 0.0)
                total += (double)self->decoding[i] * self->decoding_weight;
            if (self->backlog_weight != 0.0) {
                /* load_view._backlog_ms: the later of the next free slot and the free
                 * prefill chain, in ms from now and never negative, plus the requests in
                 * flight the snapshot has not seen at the marginal backlog each. Python
                 * divides each time by 1000 and takes the larger; a correctly rounded division
                 * keeps order, so dividing the larger once is the same float. */
                int64_t free_at = self->free_at[i];
                double free_in = free_at > now ? (double)(free_at - now) / 1000.0 : 0.0;
                int64_t unseen = inflight[i] > self->announced[i] ? inflight[i] - self->announced[i] : 0;
                double unannounced = (double)unseen * (double)self->marginal[i];
                total += (free_in + unannounced / 1000.0) * self->backlog_weight;
            }
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
static int totals_now(Selector *self, PyObject *const *args, Py_ssize_t nargs, const char *usage,
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
static PyObject *Selector_pick(Selector *self, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *Selector_totals(Selector *self, PyObject *const *args, Py_ssize_t nargs) {
    double totals[self->n];
    int outcome = totals_now(self, args, nargs, "totals(now)", totals);
    if (outcome < 0)
        return NULL;
    if (outcome > 0)
        Py_RETURN_NONE;
    return totals_list(totals, self->n);
}

/* booking(instance, now): what a request booked on `instance` at `now` is predicted from, as
 * LoadView.booking gives it -- (its ready wait in ms, None where the snapshot is stale or was
 * never published; the batch it decodes in: the instance's live inflight count, at least 1, at
 * most its batch limit) -- from one read of its halves. None where the selector steps aside:
 * `instance` is not one of its candidates (another directory snapshot's), the directory moved,
 * the slot changed generation, or a record describes another generation. */
static PyObject *Selector_booking(Selector *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "booking(instance, now)");
        return NULL;
    }
    int64_t now = PyLong_AsLongLong(args[1]);
    if (now == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (open_buffer(self, &view) < 0)
        return NULL;
    Py_ssize_t i = 0;
    while (i < self->n && PyTuple_GET_ITEM(self->candidates, i) != args[0])
        i++;
    if (i == self->n) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    const char *base = view.buf;
    int64_t inflight = half_at(base, self->inflight_offsets[i]);
    int moved = half_at(base, self->generation_offsets[i]) != self->generations[i];
    moved |= word_at(base, self->seq_offset) != self->seq;  /* the halves first, as compute */
    uint64_t pressure_generation = word_at(base, self->pressure_generation_offset);
    PyBuffer_Release(&view);
    if (moved)
        Py_RETURN_NONE;
    int state = pressure_at(self, pressure_generation, now);
    if (state < 0)
        return NULL;
    if (state == PRESSURE_UNUSABLE)
        Py_RETURN_NONE;
    int64_t limit = self->batch_limits[i], batch = inflight ? inflight : 1;
    if (limit && batch >= limit)
        batch = limit;
    PyObject *wait;
    if (state == PRESSURE_NONE) {
        wait = Py_NewRef(Py_None);
    } else {
        /* load_view.ready_wait: until the later free time, in ms, never negative; times the
         * share of the requests the snapshot announced that are still in flight. */
        int64_t free_at = self->free_at[i], announced = self->announced[i];
        double free_in = free_at > now ? (double)(free_at - now) / 1000.0 : 0.0;
        double share = inflight < announced ? (double)inflight / (double)announced : 1.0;
        if ((wait = PyFloat_FromDouble(free_in * share)) == NULL)
            return NULL;
    }
    PyObject *count = PyLong_FromLongLong(batch);
    if (count == NULL) {
        Py_DECREF(wait);
        return NULL;
    }
    PyObject *booking = PyTuple_Pack(2, wait, count);
    Py_DECREF(wait);
    Py_DECREF(count);
    return booking;
}

static PyMethodDef Selector_methods[] = {
    {"booking", (PyCFunction)(void (*)(void))Selector_booking, METH_FASTCALL,
     "booking(instance, now) -> (ready wait ms or None, decode batch), or None when the selector steps aside."},
    {"pick", (PyCFunction)(void (*)(void))Selector_pick, METH_FASTCALL,
     "pick(now) -> the candidate with the lowest total, or None when the selector steps aside."},
    {"totals", (PyCFunction)(void (*)(void))Selector_totals, METH_FASTCALL,
     "totals(now) -> every candidate's total, or None."},
    {NULL},
};

static PyTypeObject SelectorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cacheroute_proxy.routing._least_load.Selector",
    .tp_basicsize = sizeof(Selector),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Selector_traverse,
    .tp_clear = (inquiry)Selector_clear,
    .tp_weaklistoffset = offsetof(Selector, weakrefs),
    .tp_doc = "least_load's score and choice over one directory snapshot's candidates.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Selector_init,
    .tp_dealloc = (destructor)Selector_dealloc,
    .tp_methods = Selector_methods,
};

static struct PyModuleDef least_load_module = {
    PyModuleDef_HEAD_INIT, "cacheroute_proxy.routing._least_load",
    "least_load's score and choice in C (see cacheroute_proxy/routing/least_load.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__least_load(void) {
    if (PyType_Ready(&SelectorType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&least_load_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Selector", (PyObject *)&SelectorType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
