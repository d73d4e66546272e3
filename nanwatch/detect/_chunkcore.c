/* The compiled chunk core: mmengine iteration lines of a whole chunk, read without a regex.

   It reads exactly what the rows regex of the `mmengine.iter_line` columns rule matches
   (parsers/mmengine.toml; the regex is built in nanwatch/detect/columns.py):

     ^HEAD(?:Epoch|Iter)\((?P<stage>train|val|test)\) *(?:\[(?P<epoch>\d+)\])? *\[ *(?P<iter>\d+)
     /(?P<iters>\d+)\](?: +base_lr: \S+)?(?: +lr: (?P<lr>\S+))?(?: +eta: (?:\d+ days?, )?\d+:\d\d
     :\d\d)?(?: +time: (?P<time>[\d.]+))?(?: +data_time: (?P<data_time>[\d.]+))?(?: +memory:
     (?P<memory>\d+))?(?: +grad_norm: (?P<grad_norm>\S+))?(?: +loss: (?P<loss>\S+))?[^\n]*

   with HEAD = (?:(?P<_date>(?:19|20)\d\d/[01]\d/[0-3]\d [0-2]\d:[0-5]\d):(?P<_sec>[0-6]\d)
   |[01]\d/[0-3]\d [0-2]\d:[0-5]\d:[0-6]\d) - mmengine - [A-Z]+ - , in Python's bytes-regex
   semantics (\d is [0-9], \S is not one of " \t\n\r\f\v"). The regex needs no backtracking
   across its optional groups (the tail [^\n]* always matches), so each group is taken when it
   matches where it stands and skipped otherwise; the two places where it does backtrack (the
   epoch bracket, eta's day count) are spelled out below.

   Numbers are converted as Python converts them: float(bytes) is PyOS_string_to_double on
   the whole text (this core gives up on text float() would first strip or de-underscore),
   int(bytes) of at most 18 digits. Whatever it does not read as Python would (a number float()
   refuses, a longer integer, a line longer than the rule examines) makes it return None for the
   whole chunk, and the pure-Python reader reads that chunk.

   Portable C99 and the CPython C API only. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <stdint.h>
#include <string.h>

typedef const unsigned char *P;

static PyObject *STAGES[3]; /* b"train", b"val", b"test": shared by every row */

static int dig(unsigned char c) { return c >= '0' && c <= '9'; }
static int ws(unsigned char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
static int in(unsigned char c, char lo, char hi) { return c >= (unsigned char)lo && c <= (unsigned char)hi; }

/* the literal s (n bytes) at p (NULL: not there), the end of it otherwise */
static P lit_n(P p, P e, const char *s, size_t n)
{
    if ((size_t)(e - p) < n || memcmp(p, s, n) != 0)
        return NULL;
    return p + n;
}
#define lit(p, e, s) lit_n((p), (e), (s), sizeof(s) - 1)
static P digits(P p, P e)
{
    while (p < e && dig(*p))
        p++;
    return p;
}
static P spaces(P p, P e)
{
    while (p < e && *p == ' ')
        p++;
    return p;
}
static P nonspace(P p, P e)
{
    while (p < e && !ws(*p))
        p++;
    return p;
}
static P digits_dots(P p, P e)
{
    while (p < e && (dig(*p) || *p == '.'))
        p++;
    return p;
}

/* " +NAME: " at p: the end of it (NULL: not there) */
static P key_n(P p, P e, const char *name, size_t n)
{
    P q = spaces(p, e);
    if (q == p)
        return NULL;
    return lit_n(q, e, name, n);
}
#define key(p, e, s) key_n((p), (e), (s), sizeof(s) - 1)

/* \d+:\d\d:\d\d at p */
static P hms(P p, P e)
{
    P q = digits(p, e);
    if (q == p || q >= e || *q != ':')
        return NULL;
    q++;
    if (e - q < 5 || !dig(q[0]) || !dig(q[1]) || q[2] != ':' || !dig(q[3]) || !dig(q[4]))
        return NULL;
    return q + 5;
}

typedef struct {
    P lo, hi; /* a group's text; lo NULL: the group did not take part */
} Span;

typedef struct {
    P head_end;
    P date; /* 16 bytes "YYYY/MM/DD HH:MM", or NULL (the year-less head) */
    int sec;
    int stage;
    Span epoch, iter, iters;
    Span m[6]; /* lr, time, data_time, memory, grad_norm, loss */
} Row;

/* The match at line start p (the line ends at e, its newline or the chunk's end): 1 when the
   line is a row, with its groups in *r. */
static int match(P p, P e, Row *r)
{
    P q;
    memset(r, 0, sizeof *r);
    /* HEAD: the dated alternative, else the year-less one (which cannot match where the dated
       one read its first five bytes: it needs a '/' third) */
    if (e - p >= 19 && (lit(p, e, "19") || lit(p, e, "20")) && dig(p[2]) && dig(p[3]) &&
        p[4] == '/' && in(p[5], '0', '1') && dig(p[6]) && p[7] == '/' && in(p[8], '0', '3') &&
        dig(p[9]) && p[10] == ' ' && in(p[11], '0', '2') && dig(p[12]) && p[13] == ':' &&
        in(p[14], '0', '5') && dig(p[15]) && p[16] == ':' && in(p[17], '0', '6') && dig(p[18])) {
        r->date = p;
        r->sec = (p[17] - '0') * 10 + (p[18] - '0');
        q = p + 19;
    } else if (e - p >= 14 && in(p[0], '0', '1') && dig(p[1]) && p[2] == '/' &&
               in(p[3], '0', '3') && dig(p[4]) && p[5] == ' ' && in(p[6], '0', '2') &&
               dig(p[7]) && p[8] == ':' && in(p[9], '0', '5') && dig(p[10]) && p[11] == ':' &&
               in(p[12], '0', '6') && dig(p[13])) {
        r->sec = -1;
        q = p + 14;
    } else {
        return 0;
    }
    if (!(q = lit(q, e, " - mmengine - ")))
        return 0;
    {
        P a = q;
        while (q < e && in(*q, 'A', 'Z'))
            q++;
        if (q == a)
            return 0;
    }
    if (!(q = lit(q, e, " - ")))
        return 0;
    r->head_end = q;
    {
        P a = lit(q, e, "Epoch(");
        q = a ? a : lit(q, e, "Iter(");
        if (!q)
            return 0;
    }
    {
        P a;
        if ((a = lit(q, e, "train)")) != NULL)
            r->stage = 0;
        else if ((a = lit(q, e, "val)")) != NULL)
            r->stage = 1;
        else if ((a = lit(q, e, "test)")) != NULL)
            r->stage = 2;
        else
            return 0;
        q = a;
    }
    q = spaces(q, e);
    {
        /* (?:\[(\d+)\])? *\[ *(\d+)/(\d+)\] : with the epoch bracket, else without it */
        P t = NULL;
        if (q < e && *q == '[') {
            P d = digits(q + 1, e);
            if (d > q + 1 && d < e && *d == ']') {
                P b = spaces(d + 1, e);
                if (b < e && *b == '[') {
                    P i0 = spaces(b + 1, e), i1 = digits(i0, e);
                    if (i1 > i0 && i1 < e && *i1 == '/') {
                        P n1 = digits(i1 + 1, e);
                        if (n1 > i1 + 1 && n1 < e && *n1 == ']') {
                            r->epoch.lo = q + 1;
                            r->epoch.hi = d;
                            r->iter.lo = i0;
                            r->iter.hi = i1;
                            r->iters.lo = i1 + 1;
                            r->iters.hi = n1;
                            t = n1 + 1;
                        }
                    }
                }
            }
        }
        if (!t) {
            if (!(q < e && *q == '['))
                return 0;
            {
                P i0 = spaces(q + 1, e), i1 = digits(i0, e);
                P n1;
                if (!(i1 > i0 && i1 < e && *i1 == '/'))
                    return 0;
                n1 = digits(i1 + 1, e);
                if (!(n1 > i1 + 1 && n1 < e && *n1 == ']'))
                    return 0;
                r->iter.lo = i0;
                r->iter.hi = i1;
                r->iters.lo = i1 + 1;
                r->iters.hi = n1;
                t = n1 + 1;
            }
        }
        q = t;
    }
    /* the optional fields, each taken where it stands or skipped */
    {
        P v, w;
        if ((v = key(q, e, "base_lr: ")) && (w = nonspace(v, e)) > v)
            q = w;
        if ((v = key(q, e, "lr: ")) && (w = nonspace(v, e)) > v) {
            r->m[0].lo = v;
            r->m[0].hi = w;
            q = w;
        }
        if ((v = key(q, e, "eta: "))) {
            /* (?:\d+ days?, )? first; without it when the clock does not follow */
            P d = digits(v, e), c = NULL;
            if (d > v) {
                P a = lit(d, e, " day");
                if (a) {
                    P s = (a < e && *a == 's') ? a + 1 : a;
                    P k = lit(s, e, ", ");
                    if (k)
                        c = hms(k, e);
                }
            }
            if (!c)
                c = hms(v, e);
            if (c)
                q = c;
        }
        if ((v = key(q, e, "time: ")) && (w = digits_dots(v, e)) > v) {
            r->m[1].lo = v;
            r->m[1].hi = w;
            q = w;
        }
        if ((v = key(q, e, "data_time: ")) && (w = digits_dots(v, e)) > v) {
            r->m[2].lo = v;
            r->m[2].hi = w;
            q = w;
        }
        if ((v = key(q, e, "memory: ")) && (w = digits(v, e)) > v) {
            r->m[3].lo = v;
            r->m[3].hi = w;
            q = w;
        }
        if ((v = key(q, e, "grad_norm: ")) && (w = nonspace(v, e)) > v) {
            r->m[4].lo = v;
            r->m[4].hi = w;
            q = w;
        }
        if ((v = key(q, e, "loss: ")) && (w = nonspace(v, e)) > v) {
            r->m[5].lo = v;
            r->m[5].hi = w;
        }
    }
    return 1;
}

/* int(text) of a \d+ group: 0 and *out when it has at most 18 digits, -1 otherwise */
static int to_int(Span s, long long *out)
{
    long long v = 0;
    P p;
    if (s.hi - s.lo > 18)
        return -1;
    for (p = s.lo; p < s.hi; p++)
        v = v * 10 + (*p - '0');
    *out = v;
    return 0;
}

/* Decimal text of at most 15 digits and a power of ten up to 22: the digits (below 2**53)
   and the power are exact doubles, so one IEEE multiplication or division rounds correctly,
   as float() does (Clinger's fast path). Only where doubles are evaluated as doubles (SSE2,
   aarch64: FLT_EVAL_METHOD 0); -1 for any other text. */
static const double POW10[23] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                 1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

static int fast_float(P p, P e, double *out)
{
#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD == 0
    int neg = 0, nd = 0, frac = 0, ex = 0, exneg = 0, exd = 0, k;
    int64_t m = 0;
    if (p < e && (*p == '-' || *p == '+'))
        neg = *p++ == '-';
    for (; p < e && dig(*p); p++, nd++)
        m = m * 10 + (*p - '0');
    if (p < e && *p == '.') {
        for (p++; p < e && dig(*p); p++, nd++, frac++)
            m = m * 10 + (*p - '0');
    }
    if (nd == 0 || nd > 15)
        return -1;
    if (p < e && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < e && (*p == '-' || *p == '+'))
            exneg = *p++ == '-';
        for (; p < e && dig(*p) && exd < 4; p++, exd++)
            ex = ex * 10 + (*p - '0');
        if (exd == 0 || exd >= 4)
            return -1;
    }
    if (p != e)
        return -1;
    k = (exneg ? -ex : ex) - frac;
    if (k < -22 || k > 22)
        return -1;
    *out = k < 0 ? (double)m / POW10[-k] : (double)m * POW10[k];
    if (neg)
        *out = -*out;
    return 0;
#else
    (void)p;
    (void)e;
    (void)out;
    return -1;
#endif
}

/* float(text): 0 and *out when Python's float() reads the text exactly so, -1 otherwise */
static int to_float(Span s, double *out)
{
    char buf[64];
    char *end = NULL;
    size_t n = (size_t)(s.hi - s.lo);
    size_t i;
    double v;
    if (fast_float(s.lo, s.hi, out) == 0)
        return 0;
    if (n == 0 || n >= sizeof buf)
        return -1;
    for (i = 0; i < n; i++) {
        unsigned char c = s.lo[i];
        /* float() strips whitespace and underscores first, and never reads a NUL or a byte
           beyond ASCII: such text is left to the Python reader */
        if (c == '_' || c == 0 || c >= 0x80)
            return -1;
        buf[i] = (char)c;
    }
    buf[n] = 0;
    v = PyOS_string_to_double(buf, &end, NULL);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    if (end != buf + n)
        return -1;
    *out = v;
    return 0;
}

static int append_new(PyObject *list, PyObject *item)
{
    int rc;
    if (!item)
        return -1;
    rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

#define NCOLS 16
/* starts, ends, newlines before, heads, dates, secs, stages, epochs, iters, iters_per,
   lr, time, data_time, memory, grad_norm, loss */

static PyObject *rows(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t limit;
    PyObject *cols[NCOLS] = {NULL};
    PyObject *out = NULL;
    PyObject *last_date = NULL;
    P base, p, end;
    Py_ssize_t line = 0;
    int i, ok = 0, mine = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*n", &buf, &limit))
        return NULL;
    for (i = 0; i < NCOLS; i++)
        if (!(cols[i] = PyList_New(0)))
            goto done;
    base = (P)buf.buf;
    end = base + buf.len;
    for (p = base; p < end && mine; line++) {
        P nl = memchr(p, '\n', (size_t)(end - p));
        P e = nl ? nl : end;
        Row r;
        if (in(*p, '0', '2') && match(p, e, &r)) {
            long long iv;
            double fv;
            int k;
            if (e - p > limit) {
                mine = 0; /* the rule examines only its first bytes: the line engine's */
                break;
            }
            /* (cols[1], the rows' ends, stays empty: the Python reader's line count needs them,
               this core gives line indexes instead) */
            if (append_new(cols[0], PyLong_FromSsize_t(p - base)) < 0 ||
                append_new(cols[2], PyLong_FromSsize_t(line)) < 0)
                goto done;
            if (r.date) {
                if (!last_date || memcmp(PyBytes_AS_STRING(last_date), r.date, 16) != 0) {
                    Py_XDECREF(last_date);
                    if (!(last_date = PyBytes_FromStringAndSize((const char *)r.date, 16)))
                        goto done;
                }
                if (PyList_Append(cols[3], Py_None) < 0 || PyList_Append(cols[4], last_date) < 0 ||
                    append_new(cols[5], PyLong_FromLong(r.sec)) < 0)
                    goto done;
            } else {
                if (append_new(cols[3], PyBytes_FromStringAndSize((const char *)p,
                                                                  r.head_end - p)) < 0 ||
                    PyList_Append(cols[4], Py_None) < 0 || PyList_Append(cols[5], Py_None) < 0)
                    goto done;
            }
            if (PyList_Append(cols[6], STAGES[r.stage]) < 0)
                goto done;
            {
                Span ints[3];
                ints[0] = r.epoch;
                ints[1] = r.iter;
                ints[2] = r.iters;
                for (k = 0; k < 3; k++) {
                    if (!ints[k].lo) {
                        if (PyList_Append(cols[7 + k], Py_None) < 0)
                            goto done;
                        continue;
                    }
                    if (to_int(ints[k], &iv) < 0) {
                        mine = 0;
                        break;
                    }
                    if (append_new(cols[7 + k], PyLong_FromLongLong(iv)) < 0)
                        goto done;
                }
            }
            for (k = 0; k < 6 && mine; k++) {
                if (!r.m[k].lo) {
                    if (PyList_Append(cols[10 + k], Py_None) < 0)
                        goto done;
                    continue;
                }
                if (to_float(r.m[k], &fv) < 0) {
                    mine = 0;
                    break;
                }
                if (append_new(cols[10 + k], PyFloat_FromDouble(fv)) < 0)
                    goto done;
            }
        }
        p = e + 1;
    }
    if (!mine) {
        Py_INCREF(Py_None);
        out = Py_None;
    } else {
        if (!(out = PyTuple_New(NCOLS)))
            goto done;
        for (i = 0; i < NCOLS; i++) {
            PyTuple_SET_ITEM(out, i, cols[i]);
            cols[i] = NULL;
        }
    }
    ok = 1;
done:
    for (i = 0; i < NCOLS; i++)
        Py_XDECREF(cols[i]);
    Py_XDECREF(last_date);
    PyBuffer_Release(&buf);
    if (!ok) {
        Py_XDECREF(out);
        return NULL;
    }
    return out;
}

/* zip_rows(cls, columns) -> [cls(*row) for row in zip(*columns)] for tuple or a tuple
   subclass (a NamedTuple such as Metric) and equally long lists or tuples; None for anything
   else. */
static PyObject *zip_rows(PyObject *self, PyObject *args)
{
    PyObject *cls, *cols, *out;
    PyTypeObject *type;
    Py_ssize_t k, n, i, j;
    int gc, atoms;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO!", &cls, &PyTuple_Type, &cols))
        return NULL;
    k = PyTuple_GET_SIZE(cols);
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type) || k == 0)
        Py_RETURN_NONE;
    type = (PyTypeObject *)cls;
    n = -1;
    for (j = 0; j < k; j++) {
        PyObject *c = PyTuple_GET_ITEM(cols, j);
        if (!(PyList_CheckExact(c) || PyTuple_CheckExact(c)) ||
            (n >= 0 && PySequence_Fast_GET_SIZE(c) != n))
            Py_RETURN_NONE;
        n = PySequence_Fast_GET_SIZE(c);
    }
    if (!(out = PyList_New(n)))
        return NULL;
    /* no collection in the middle of the loop: the new tuples hold no cycle, and a generation
       0 pass every few hundred of them cost three times the loop itself */
    gc = PyGC_Disable();
    for (i = 0; i < n; i++) {
        PyObject *t = type == &PyTuple_Type ? PyTuple_New(k) : type->tp_alloc(type, k);
        if (!t) {
            if (gc)
                PyGC_Enable();
            Py_DECREF(out);
            return NULL;
        }
        atoms = 1;
        for (j = 0; j < k; j++) {
            PyObject *v = PySequence_Fast_GET_ITEM(PyTuple_GET_ITEM(cols, j), i);
            Py_INCREF(v);
            PyTuple_SET_ITEM(t, j, v);
            atoms = atoms && !PyObject_IS_GC(v);
        }
        /* a tuple of numbers, text and None is in no cycle: the collector need never look at
           it (what it does itself on its first pass over such a tuple) */
        if (atoms && PyObject_IS_GC(t))
            PyObject_GC_UnTrack(t);
        PyList_SET_ITEM(out, i, t);
    }
    if (gc)
        PyGC_Enable();
    return out;
}

/* count_all(chunk, needles): bytes.count of each needle (non-overlapping occurrences), in one
   pass over the chunk instead of one per needle: a table of the needles' first bytes says
   where a comparison is worth making. None when a needle is empty or there are more than 64
   (the caller counts them itself). */
static PyObject *count_all(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    PyObject *needles, *out = NULL;
    Py_ssize_t k, i, n, p;
    const char *nd[64];
    Py_ssize_t nl[64], next[64], cnt[64];
    unsigned char first[256];
    unsigned char byfirst[256][8]; /* up to 8 needles per first byte */
    unsigned char nfirst[256];
    (void)self;
    if (!PyArg_ParseTuple(args, "y*O!", &buf, &PyTuple_Type, &needles))
        return NULL;
    k = PyTuple_GET_SIZE(needles);
    if (k > 64)
        goto none;
    memset(first, 0, sizeof first);
    memset(nfirst, 0, sizeof nfirst);
    for (i = 0; i < k; i++) {
        PyObject *o = PyTuple_GET_ITEM(needles, i);
        unsigned char c;
        if (!PyBytes_Check(o) || PyBytes_GET_SIZE(o) == 0)
            goto none;
        nd[i] = PyBytes_AS_STRING(o);
        nl[i] = PyBytes_GET_SIZE(o);
        next[i] = 0;
        cnt[i] = 0;
        c = (unsigned char)nd[i][0];
        if (nfirst[c] >= 8)
            goto none;
        byfirst[c][nfirst[c]++] = (unsigned char)i;
        first[c] = 1;
    }
    n = buf.len;
    {
        P b = (P)buf.buf;
        for (p = 0; p < n; p++) {
            unsigned char c = b[p];
            int j;
            if (!first[c])
                continue;
            for (j = 0; j < nfirst[c]; j++) {
                Py_ssize_t x = byfirst[c][j];
                if (p >= next[x] && n - p >= nl[x] && memcmp(b + p, nd[x], (size_t)nl[x]) == 0) {
                    cnt[x]++;
                    next[x] = p + nl[x];
                }
            }
        }
    }
    if (!(out = PyList_New(k)))
        goto done;
    for (i = 0; i < k; i++) {
        PyObject *v = PyLong_FromSsize_t(cnt[i]);
        if (!v) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, v);
    }
    goto done;
none:
    out = Py_None;
    Py_INCREF(out);
done:
    PyBuffer_Release(&buf);
    return out;
}

static PyMethodDef methods[] = {
    {"zip_rows", zip_rows, METH_VARARGS,
     "zip_rows(cls, columns) -> a list of cls tuples, one per row of the equally long lists in "
     "the tuple columns (None when cls is no tuple type or a column no list)."},
    {"count_all", count_all, METH_VARARGS,
     "count_all(chunk, needles) -> [chunk.count(n) for n in needles] in one pass (None when a "
     "needle is empty or there are more than 64 of them or 8 with one first byte)."},
    {"rows", rows, METH_VARARGS,
     "rows(chunk, max_bytes) -> 16 lists (starts, [] (no ends), line index, head or None, date or "
     "None, second or None, stage, epoch, iter, iters, lr, time, data_time, memory, grad_norm, "
     "loss), or None when the chunk holds something only the Python reader reads as it must."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chunkcore", "The compiled chunk core (see _chunkcore.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__chunkcore(void)
{
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    STAGES[0] = PyBytes_FromString("train");
    STAGES[1] = PyBytes_FromString("val");
    STAGES[2] = PyBytes_FromString("test");
    if (!STAGES[0] || !STAGES[1] || !STAGES[2]) {
        Py_DECREF(m);
        return NULL;
    }
    /* what core.py expects (CORE_VERSION): a build left over from an older source (an
       editable install not rebuilt) is not used */
    if (PyModule_AddIntConstant(m, "VERSION", 3) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
