/* kvcr.store._core: kvcr's compiled core, one extension module in three files.
 *
 * - _keytable.c: KeyTable, block keys -> records (store/keytable.py wraps it);
 * - _copies.c: CopyPool and CopyJob, copies on threads that never take the GIL
 *   (transport/copier.py uses them);
 * - here: the module, and take_free (a pool's free slots, store/slots.py).
 *
 * Why C, and why the limited API of CPython 3.10: docs/design.md, "The compiled core".
 * Every call checks what comes in (records against the capacity, batches against their
 * shape) before it writes anything: a malformed call raises, never crashes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_core.h"

/* take_free(taken, start, count) -> (slots, next): the ``count`` lowest slots at or after
 * ``start`` whose byte in ``taken`` (a pool's bytearray, 0: free) is 0, marked 1, as a
 * bytearray of intp, and the slot after the last. ValueError, nothing marked, if fewer are
 * free there. A pool's free slots, one memchr a run instead of a Python step a slot. */
static PyObject *core_take_free(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *taken;
    Py_ssize_t start, count;
    if (!PyArg_ParseTuple(args, "O!nn:take_free", &PyByteArray_Type, &taken, &start, &count)) return NULL;
    Py_ssize_t size = PyByteArray_Size(taken);
    if (start < 0 || count < 0 || start > size) {
        PyErr_Format(PyExc_ValueError, "take_free: start %zd or count %zd outside a pool of %zd", start, count, size);
        return NULL;
    }
    uint8_t *bytes = (uint8_t *)PyByteArray_AsString(taken);
    Py_ssize_t *out;
    PyObject *buf = new_intp(count, &out);
    if (buf == NULL) return NULL;
    Py_ssize_t at = start, k = 0;
    while (k < count) {
        const uint8_t *hole = at < size ? memchr(bytes + at, 0, (size_t)(size - at)) : NULL;
        if (hole == NULL) {
            for (Py_ssize_t i = 0; i < k; i++) bytes[out[i]] = 0; /* nothing marked */
            Py_DECREF(buf);
            PyErr_Format(PyExc_ValueError, "take_free: %zd free slots wanted from slot %zd, %zd there",
                         count, start, k);
            return NULL;
        }
        at = hole - bytes;
        while (k < count && at < size && bytes[at] == 0) {
            bytes[at] = 1;
            out[k++] = at++;
        }
    }
    return Py_BuildValue("(Nn)", buf, at);
}

static PyMethodDef core_functions[] = {
    {"take_free", core_take_free, METH_VARARGS, "take_free(taken, start, count) -> (slots, next)"},
    {NULL, NULL, 0, NULL},
};

static int core_exec(PyObject *module) {
    return keytable_exec(module) < 0 || copies_exec(module) < 0 ? -1 : 0;
}

static PyModuleDef_Slot core_slots[] = {{Py_mod_exec, core_exec}, {0, NULL}};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvcr.store._core",
    .m_doc = "kvcr's compiled core: the key table (keytable.py) and the copy pool (transport/copier.py).",
    .m_size = 0,
    .m_slots = core_slots,
    .m_methods = core_functions,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&core_module); }
