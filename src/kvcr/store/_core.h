/* The parts of kvcr.store._core, each adding its types to the module. */
#ifndef KVCR_CORE_H
#define KVCR_CORE_H

#include <Python.h>

/* _copies.c: CopyPool, CopyJob and the COPY_* states. */
int copies_exec(PyObject *module);

#endif
