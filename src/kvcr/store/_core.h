/* The parts of kvcr.store._core, each adding its types to the module. */
#ifndef KVCR_CORE_H
#define KVCR_CORE_H

#include <Python.h>

/* _keytable.c: KeyTable, MAX_WIDTH and DIGEST. */
int keytable_exec(PyObject *module);

/* _copies.c: CopyPool, CopyJob and the COPY_* states. */
int copies_exec(PyObject *module);

/* A bytearray of ``n`` native intp (numpy views it without a copy), and where they go. */
static inline PyObject *new_intp(Py_ssize_t n, Py_ssize_t **out) {
    PyObject *buf = PyByteArray_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(Py_ssize_t));
    if (buf != NULL) *out = (Py_ssize_t *)PyByteArray_AsString(buf);
    return buf;
}

#endif
