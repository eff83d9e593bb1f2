/* yuebing.transfer._streamcopy: copy large buffers with non-temporal (streaming) stores.
 *
 * Called by yuebing.transfer.copy.stream_copy (the shared-memory transport's copy threads and
 * the store client's same-host direct path) for copies of at least STREAM_MIN bytes. A plain
 * memcpy of a large block first reads every destination cache line it writes ("read for
 * ownership") and fills the caches with data nobody on this core reads again; streaming
 * stores write whole lines straight to memory, so a copy into another process's segment moves
 * about a third less memory traffic. The GIL is released while copying, so copy threads
 * overlap. On CPUs without SSE2 (not x86-64) it is a memcpy without the GIL.
 *
 * copy(dst, src) -> None: dst a writable, src any C-contiguous buffer of the same length.
 * Overlapping ranges (views of one buffer) are copied with memmove, as numpy.copyto would: a
 * forward streaming copy would read bytes it had already overwritten.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>

static void stream_copy(char *dst, const char *src, size_t n)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    /* streaming stores are weakly ordered: make them visible before anything that follows
     * (the commit that publishes the value to other processes) */
    _mm_sfence();
    memcpy(dst + i, src + i, n - i);
}
#define STREAMING 1
#else
static void stream_copy(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }
#define STREAMING 0
#endif

/* whether [a, a + n) and [b, b + n) share a byte */
static int overlaps(const char *a, const char *b, size_t n)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return n > 0 && (x < y ? y - x < n : x - y < n);
}

static PyObject *copy(PyObject *self, PyObject *args)
{
    Py_buffer d, s;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*:copy", &d, &s))
        return NULL;
    if (d.len != s.len) {
        PyErr_Format(PyExc_ValueError, "copy: destination has %zd bytes, source %zd",
                     d.len, s.len);
        PyBuffer_Release(&d);
        PyBuffer_Release(&s);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (overlaps((const char *)d.buf, (const char *)s.buf, (size_t)d.len))
        memmove(d.buf, s.buf, (size_t)d.len);
    else
        stream_copy((char *)d.buf, (const char *)s.buf, (size_t)d.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(dst, src): copy src into dst (same length) with streaming stores, GIL released"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_streamcopy",
    "Large copies with non-temporal stores (see yuebing.transfer.copy).", -1, methods,
};

PyMODINIT_FUNC PyInit__streamcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
