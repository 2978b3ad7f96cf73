/* cacheroute_proxy.http1._chunk_pass: a relayed stream's reads passed to the client as the
 * instance framed them, with no Python frame in between (client.py, UpstreamResponse.relay).
 *
 * Once a chunked answer's head has arrived whole in one read, every read of its body goes
 * through a ChunkPass first (what that read brought of the body too, before the relay lets it
 * pass anything). It follows the framing (where the current chunk ends) across reads. A read
 * that starts and ends at a chunk boundary and holds only whole chunks, none the last, is
 * written to the client's transport as it came when the relay lets it (`relaying`, set by the
 * response while a relay waits; `ready`, by the consumer: it would pass such data on unchanged)
 * and the last chunk's data ends with a line end with no `marker` in its last `look_back` bytes
 * (so the consumer's own tail check would have let it through). Any other read is left to the
 * ordinary path (the parser), which sees the same bytes: the two stay in step because whole
 * chunks leave the parser where it was, before a size line.
 *
 * What it does not follow -- a chunk extension, a size line cut by the read, the last chunk
 * -- it stops following: from then on every read takes the ordinary path.
 *
 * Calling it with a read returns 0 (not passed: parse it), 1 (passed) or 2 (passed, and the
 * client's socket is full now: stop reading).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define MAX_SIZE_DIGITS 16

typedef struct {
    PyObject_HEAD
    PyObject *transport;  /* the client's: write(), is_closing() */
    PyObject *conn;       /* the client's connection: write_paused */
    PyObject *marker;     /* bytes */
    Py_ssize_t look_back;
    Py_ssize_t left;      /* of the chunk in progress: data and CRLF still to come */
    int lost;             /* the framing is no longer followed */
    int relaying;
    int ready;
    unsigned long long passed;
} ChunkPass;

static PyObject *str_write, *str_is_closing, *str_write_paused;

static int hex_value(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* A read ended inside a chunk, `left` bytes of it (data and CRLF) still to come: noted, and if
 * only the CRLF's '\n' is left, the read's last byte must be its '\r'. */
static void cut_inside(ChunkPass *self, const char *buf, Py_ssize_t n, Py_ssize_t left) {
    self->left = left;
    if (left == 1 && buf[n - 1] != '\r')
        self->lost = 1;
}

/* Walk `buf` from a boundary at `pos`; whole chunks up to the end: 1 with the last one's data
 * span; a chunk cut at the end: 0 (self->left set); anything not followed: -1 (self->lost). */
static int walk(ChunkPass *self, const char *buf, Py_ssize_t pos, Py_ssize_t n,
                Py_ssize_t *data_start, Py_ssize_t *data_end) {
    while (pos < n) {
        Py_ssize_t i = pos, digits = 0;
        unsigned long long size = 0;
        int v;
        while (i < n && digits < MAX_SIZE_DIGITS && (v = hex_value((unsigned char)buf[i])) >= 0) {
            size = size * 16 + (unsigned long long)v;
            i++;
            digits++;
        }
        /* A size line cut by the read, an extension, no digits, or the last chunk. */
        if (digits == 0 || i + 1 >= n || buf[i] != '\r' || buf[i + 1] != '\n' || size == 0
                || size > (unsigned long long)(PY_SSIZE_T_MAX / 2)) {
            self->lost = 1;
            return -1;
        }
        Py_ssize_t start = i + 2, end = start + (Py_ssize_t)size + 2;
        if (end > n) {
            cut_inside(self, buf, n, end - n);
            return self->lost ? -1 : 0;
        }
        if (buf[end - 2] != '\r' || buf[end - 1] != '\n') {
            self->lost = 1;
            return -1;
        }
        *data_start = start;
        *data_end = end - 2;
        pos = end;
    }
    return 1;
}

static int tail_passes(ChunkPass *self, const char *buf, Py_ssize_t start, Py_ssize_t end) {
    Py_ssize_t look = self->look_back;
    if (end - start < look || buf[end - 1] != '\n')
        return 0;
    Py_ssize_t m = PyBytes_GET_SIZE(self->marker);
    const char *window = buf + end - look;
    if (m == 0 || m > look)
        return 1;
    const char *mark = PyBytes_AS_STRING(self->marker);
    for (Py_ssize_t k = 0; k + m <= look; k++) {
        if (window[k] == mark[0] && memcmp(window + k, mark, (size_t)m) == 0)
            return 0;
    }
    return 1;
}

/* The truth of a new reference, which it releases; -1 (an exception set) for NULL or a failure. */
static int truth_of(PyObject *value) {
    if (value == NULL)
        return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

static PyObject *ChunkPass_call(ChunkPass *self, PyObject *args, PyObject *kwargs) {
    /* One bytes argument, checked by hand: a token's call, where a format string's parse shows. */
    if (PyTuple_GET_SIZE(args) != 1 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)
            || !PyBytes_Check(PyTuple_GET_ITEM(args, 0))) {
        PyErr_SetString(PyExc_TypeError, "ChunkPass takes one bytes argument");
        return NULL;
    }
    PyObject *data = PyTuple_GET_ITEM(args, 0);
    if (self->lost)
        return PyLong_FromLong(0);
    const char *buf = PyBytes_AS_STRING(data);
    Py_ssize_t n = PyBytes_GET_SIZE(data), pos = 0;
    int at_boundary = self->left == 0;
    if (!at_boundary) {  /* the rest of a chunk in progress first */
        if (n < self->left) {
            cut_inside(self, buf, n, self->left - n);
            return PyLong_FromLong(0);
        }
        pos = self->left;
        if (buf[pos - 1] != '\n' || (pos >= 2 && buf[pos - 2] != '\r')) {
            self->lost = 1;
            return PyLong_FromLong(0);
        }
        self->left = 0;
    }
    Py_ssize_t start = -1, end = -1;
    int whole = walk(self, buf, pos, n, &start, &end);
    if (whole != 1 || !at_boundary || start < 0 || !self->relaying || !self->ready
            || !tail_passes(self, buf, start, end))
        return PyLong_FromLong(0);
    int is_closing = truth_of(PyObject_CallMethodNoArgs(self->transport, str_is_closing));
    if (is_closing < 0)
        return NULL;
    if (!is_closing) {
        PyObject *written = PyObject_CallMethodOneArg(self->transport, str_write, data);
        if (written == NULL)
            return NULL;
        Py_DECREF(written);
    }
    self->passed++;
    int full = truth_of(PyObject_GetAttr(self->conn, str_write_paused));
    if (full < 0)
        return NULL;
    return PyLong_FromLong(full ? 2 : 1);
}

static int ChunkPass_init(ChunkPass *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"transport", "conn", "marker", "look_back", NULL};
    PyObject *transport, *conn, *marker;
    Py_ssize_t look_back;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOSn", kwlist, &transport, &conn, &marker, &look_back))
        return -1;
    if (look_back < 0) {
        PyErr_SetString(PyExc_ValueError, "look_back must not be negative");
        return -1;
    }
    Py_INCREF(transport);
    Py_XSETREF(self->transport, transport);
    Py_INCREF(conn);
    Py_XSETREF(self->conn, conn);
    Py_INCREF(marker);
    Py_XSETREF(self->marker, marker);
    self->look_back = look_back;
    self->left = 0;
    self->lost = self->relaying = self->ready = 0;
    self->passed = 0;
    return 0;
}

static int ChunkPass_traverse(ChunkPass *self, visitproc visit, void *arg) {
    Py_VISIT(self->transport);
    Py_VISIT(self->conn);
    Py_VISIT(self->marker);
    return 0;
}

static int ChunkPass_clear(ChunkPass *self) {
    Py_CLEAR(self->transport);
    Py_CLEAR(self->conn);
    Py_CLEAR(self->marker);
    return 0;
}

static void ChunkPass_dealloc(ChunkPass *self) {
    PyObject_GC_UnTrack(self);
    ChunkPass_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *get_flag(ChunkPass *self, void *which) {
    int value = which == (void *)0 ? self->relaying : which == (void *)1 ? self->ready : self->lost;
    return PyBool_FromLong(value);
}

static int set_flag(ChunkPass *self, PyObject *value, void *which) {
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete");
        return -1;
    }
    int truth = PyObject_IsTrue(value);
    if (truth < 0)
        return -1;
    if (which == (void *)0)
        self->relaying = truth;
    else if (which == (void *)1)
        self->ready = truth;
    else
        self->lost = self->lost || truth;  /* once lost, lost */
    return 0;
}

static PyObject *get_passed(ChunkPass *self, void *unused) {
    return PyLong_FromUnsignedLongLong(self->passed);
}

static PyGetSetDef ChunkPass_getset[] = {
    {"relaying", (getter)get_flag, (setter)set_flag, "a relay waits for the body", (void *)0},
    {"ready", (getter)get_flag, (setter)set_flag, "the consumer would pass such data on as it is", (void *)1},
    {"lost", (getter)get_flag, (setter)set_flag, "the framing is no longer followed", (void *)2},
    {"passed", (getter)get_passed, NULL, "reads passed as they came", NULL},
    {NULL}
};

static PyTypeObject ChunkPassType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cacheroute_proxy.http1._chunk_pass.ChunkPass",
    .tp_basicsize = sizeof(ChunkPass),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A chunked body's reads passed to a client as they came (see the module).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ChunkPass_init,
    .tp_dealloc = (destructor)ChunkPass_dealloc,
    .tp_traverse = (traverseproc)ChunkPass_traverse,
    .tp_clear = (inquiry)ChunkPass_clear,
    .tp_call = (ternaryfunc)ChunkPass_call,
    .tp_getset = ChunkPass_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chunk_pass", "A chunked body passed on as it came.", -1, NULL,
};

PyMODINIT_FUNC PyInit__chunk_pass(void) {
    if (PyType_Ready(&ChunkPassType) < 0)
        return NULL;
    str_write = PyUnicode_InternFromString("write");
    str_is_closing = PyUnicode_InternFromString("is_closing");
    str_write_paused = PyUnicode_InternFromString("write_paused");
    if (!str_write || !str_is_closing || !str_write_paused)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ChunkPassType);
    if (PyModule_AddObject(m, "ChunkPass", (PyObject *)&ChunkPassType) < 0) {
        Py_DECREF(&ChunkPassType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
