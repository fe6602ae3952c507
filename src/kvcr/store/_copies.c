/* kvcr.store._core.CopyPool: in-process copies on threads that never take the GIL.
 *
 * Why: the copy threads were Python threads. Each took the GIL to take a chunk off its
 * queue, to make the copy call, to count the chunk over and to wake the runtime through
 * trio (run_sync_soon), and each hand-over of the GIL between the engine's thread, the
 * runtime's and the copy threads costs tens of microseconds on a busy 2-core machine.
 * Here a copy is posted as address runs (dst, src, bytes), cut into chunks of about equal
 * bytes, one a thread; the threads are plain pthreads that only memmove, and the thread
 * that ends a copy writes to an eventfd the runtime waits on in trio.
 *
 * Memory safety is the caller's part: every run is inside memory that stays mapped and
 * registered until the copy is terminal (transport/copier.py checks the descriptors, and
 * the runtime frees a slot only when its transfer is terminal). A copy is terminal (state
 * DONE or ERR) only once no thread touches its memory: its last chunk sets the state after
 * its memmoves. ``cancel`` skips the chunks not started; one being copied runs to its end.
 *
 * Locking: one mutex per pool guards the queue and every job's counters; the threads hold
 * it only to take a chunk and to count one over, never during a copy. A job's state is
 * also read without it (an atomic load). Python holds a job through a CopyJob object,
 * which keeps its pool alive; the job's memory goes with its last reference (the object,
 * or a queued chunk).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "_core.h"

#define PROC 0
#define DONE 1
#define ERR 2
#define MAX_THREADS 64

typedef struct {
    uint64_t dst, src, len;
} Run;

typedef struct {
    int refs; /* the CopyJob object, and each chunk not over */
    int left; /* chunks not over */
    int running; /* chunks being copied */
    int cancelled;
    int state; /* PROC, DONE or ERR: written under the lock, read atomically */
} Job;

typedef struct Chunk {
    struct Chunk *next;
    Job *job;
    size_t n;
    Run runs[];
} Chunk;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    pthread_cond_t wake;
    Chunk *head, *tail;
    int stopping;
    int held; /* the gate: threads that took a chunk wait before copying (tests) */
    int at_gate; /* threads waiting there */
    int threads;
    int started;
    pthread_t *ids;
    int efd;
} CopyPool;

typedef struct {
    PyObject_HEAD
    CopyPool *pool;
    Job *job;
} CopyJob;

static PyObject *job_type; /* CopyJob's type, set at module exec */

/* The pool's lock, taken by a thread that holds the GIL: at once if free; else with the
 * GIL let go while it waits, so that a copy thread preempted while holding the lock (two
 * cores, more runnable threads) never keeps every Python thread waiting too. */
static void lock_with_gil(CopyPool *p) {
    if (pthread_mutex_trylock(&p->lock) == 0) return;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&p->lock);
    Py_END_ALLOW_THREADS;
}

/* Under the lock: one reference to ``job`` less. */
static void job_unref(Job *job) {
    if (--job->refs == 0) free(job);
}

static void *work(void *arg) {
    CopyPool *p = arg;
    pthread_mutex_lock(&p->lock);
    for (;;) {
        while (p->head == NULL && !p->stopping) pthread_cond_wait(&p->wake, &p->lock);
        Chunk *c = p->head;
        if (c == NULL) break; /* stopping, and every queued chunk is over */
        p->head = c->next;
        if (p->head == NULL) p->tail = NULL;
        Job *job = c->job;
        int run = !job->cancelled;
        if (run) job->running++;
        if (run && p->held) { /* a test holds copies being copied (see hold) */
            p->at_gate++;
            pthread_cond_broadcast(&p->wake);
            while (p->held) pthread_cond_wait(&p->wake, &p->lock);
            p->at_gate--;
        }
        pthread_mutex_unlock(&p->lock);
        if (run) {
            for (size_t i = 0; i < c->n; i++)
                memmove((void *)(uintptr_t)c->runs[i].dst, (const void *)(uintptr_t)c->runs[i].src,
                        (size_t)c->runs[i].len);
        }
        pthread_mutex_lock(&p->lock);
        if (run) job->running--;
        int ended = --job->left == 0;
        if (ended) __atomic_store_n(&job->state, job->cancelled ? ERR : DONE, __ATOMIC_RELEASE);
        job_unref(job);
        pthread_mutex_unlock(&p->lock);
        free(c);
        if (ended) {
            /* Outside the lock: the write wakes the runtime's thread, which may take this
             * core at once, and must not find the lock held by a thread it preempted. It
             * only fails once the fd is closed, after the threads are joined: never here. */
            uint64_t one = 1;
            ssize_t written = write(p->efd, &one, sizeof one);
            (void)written;
        }
        pthread_mutex_lock(&p->lock);
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

/* Stop the threads once the chunks queued before are over (the GIL let go meanwhile). */
static void pool_stop(CopyPool *p) {
    if (!p->started) return;
    pthread_mutex_lock(&p->lock);
    p->stopping = 1;
    p->held = 0;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    Py_BEGIN_ALLOW_THREADS;
    for (int i = 0; i < p->started; i++) pthread_join(p->ids[i], NULL);
    Py_END_ALLOW_THREADS;
    p->started = 0;
}

/* CopyPool(threads) */
static int pool_init(CopyPool *p, PyObject *args, PyObject *kwds) {
    static char *names[] = {"threads", NULL};
    int threads;
    if (p->ids != NULL || p->efd >= 0) {
        PyErr_SetString(PyExc_RuntimeError, "CopyPool: already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i:CopyPool", names, &threads)) return -1;
    if (threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "CopyPool: %d threads, not 1 to %d", threads, MAX_THREADS);
        return -1;
    }
    p->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (p->efd < 0) {
        p->efd = -1;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    p->ids = calloc((size_t)threads, sizeof(pthread_t));
    if (p->ids == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    p->threads = threads;
    for (int i = 0; i < threads; i++) {
        int err = pthread_create(&p->ids[i], NULL, work, p);
        if (err) {
            pool_stop(p);
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        p->started++;
        char name[16]; /* the name ps, top and /proc show (15 characters at most) */
        snprintf(name, sizeof name, "kvcr-copy-%d", i);
        (void)pthread_setname_np(p->ids[i], name);
    }
    return 0;
}

static PyObject *pool_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    (void)args;
    (void)kwds;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    CopyPool *p = (CopyPool *)alloc(type, 0);
    if (p != NULL) p->efd = -1;
    return (PyObject *)p;
}

/* post(runs, parts) -> CopyJob: ``runs`` as native uint64 triples (dst, src, bytes),
 * copied in ``parts`` chunks of about equal bytes (a run may be cut in two). */
static PyObject *pool_post(CopyPool *p, PyObject *args) {
    const char *data;
    Py_ssize_t size;
    int parts;
    if (!PyArg_ParseTuple(args, "y#i:post", &data, &size, &parts)) return NULL;
    if (!p->started || p->stopping) {
        PyErr_SetString(PyExc_RuntimeError, "CopyPool post: the pool is closed");
        return NULL;
    }
    if (size % (Py_ssize_t)sizeof(Run) || parts < 1) {
        PyErr_Format(PyExc_ValueError, "CopyPool post: %zd bytes are not runs of 24, or %d parts", size, parts);
        return NULL;
    }
    size_t n = (size_t)size / sizeof(Run);
    const Run *runs = (const Run *)data;
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) total += runs[i].len;
    if (parts > p->threads) parts = p->threads;
    if ((uint64_t)parts > total) parts = total ? (int)total : 1;
    uint64_t share = (total + (uint64_t)parts - 1) / (uint64_t)parts;

    Job *job = calloc(1, sizeof(Job));
    CopyJob *obj = job == NULL ? NULL : PyObject_New(CopyJob, (PyTypeObject *)job_type);
    if (obj == NULL) {
        free(job);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    obj->job = job;
    Py_INCREF(p);
    obj->pool = p;
    job->refs = 1;
    job->state = PROC;

    /* Cut the runs into chunks: each at most n + parts runs (a cut adds one). */
    Chunk *chunks[MAX_THREADS];
    int made = 0;
    size_t i = 0;
    uint64_t offset = 0; /* bytes of runs[i] already given to a chunk */
    while (i < n && made < parts) {
        Chunk *c = malloc(sizeof(Chunk) + sizeof(Run) * (n - i + 1));
        if (c == NULL) {
            for (int k = 0; k < made; k++) free(chunks[k]);
            job->refs = 1;
            Py_DECREF(obj);
            return PyErr_NoMemory();
        }
        c->next = NULL;
        c->job = job;
        c->n = 0;
        uint64_t room = made == parts - 1 ? UINT64_MAX : share;
        while (i < n && room) {
            uint64_t left = runs[i].len - offset, take = left < room ? left : room;
            if (take) c->runs[c->n++] = (Run){runs[i].dst + offset, runs[i].src + offset, take};
            room -= take;
            offset += take;
            if (offset == runs[i].len) {
                i++;
                offset = 0;
            }
        }
        chunks[made++] = c;
    }
    if (made == 0) { /* nothing to copy */
        job->state = DONE;
        return (PyObject *)obj;
    }
    lock_with_gil(p);
    job->refs += made;
    job->left = made;
    for (int k = 0; k < made; k++) {
        if (p->tail) p->tail->next = chunks[k];
        else p->head = chunks[k];
        p->tail = chunks[k];
    }
    pthread_mutex_unlock(&p->lock);
    /* After the unlock: a woken thread does not wait for the lock its waker holds. */
    if (made == 1) pthread_cond_signal(&p->wake);
    else pthread_cond_broadcast(&p->wake);
    return (PyObject *)obj;
}

/* drain() -> copies ended since the last drain (reads the eventfd; 0 if none). */
static PyObject *pool_drain(CopyPool *p, PyObject *Py_UNUSED(ignored)) {
    uint64_t count = 0;
    if (p->efd >= 0 && read(p->efd, &count, sizeof count) != (ssize_t)sizeof count) count = 0;
    return PyLong_FromUnsignedLongLong(count);
}

static PyObject *pool_fileno(CopyPool *p, PyObject *Py_UNUSED(ignored)) {
    if (p->efd < 0) {
        PyErr_SetString(PyExc_ValueError, "CopyPool fileno: the pool is closed");
        return NULL;
    }
    return PyLong_FromLong(p->efd);
}

/* close(): the threads end once the chunks queued before are over; then the eventfd is
 * closed (the runtime stopped waiting on it before). */
static PyObject *pool_close(CopyPool *p, PyObject *Py_UNUSED(ignored)) {
    pool_stop(p);
    if (p->efd >= 0) {
        close(p->efd);
        p->efd = -1;
    }
    Py_RETURN_NONE;
}

static void pool_dealloc(CopyPool *p) {
    PyTypeObject *tp = Py_TYPE(p);
    pool_stop(p); /* CopyJob objects hold the pool: no chunk can be queued any more */
    if (p->efd >= 0) close(p->efd);
    if (p->ids != NULL) {
        pthread_mutex_destroy(&p->lock);
        pthread_cond_destroy(&p->wake);
        free(p->ids);
    }
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(p);
    Py_DECREF(tp);
}

static PyObject *job_state(CopyJob *j, void *Py_UNUSED(c)) {
    return PyLong_FromLong(__atomic_load_n(&j->job->state, __ATOMIC_ACQUIRE));
}

/* cancel() -> bool: skip the chunks not started; True if none is being copied (then no
 * thread touches the memory once the queued ones are skipped). */
static PyObject *job_cancel(CopyJob *j, PyObject *Py_UNUSED(ignored)) {
    CopyPool *p = j->pool;
    lock_with_gil(p);
    j->job->cancelled = 1;
    int idle = j->job->running == 0;
    pthread_mutex_unlock(&p->lock);
    return PyBool_FromLong(idle);
}

static void job_dealloc(CopyJob *j) {
    PyTypeObject *tp = Py_TYPE(j);
    CopyPool *p = j->pool;
    lock_with_gil(p);
    job_unref(j->job);
    pthread_mutex_unlock(&p->lock);
    Py_DECREF(p);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(j);
    Py_DECREF(tp);
}

/* hold(held, wait_for=0) -> threads at the gate: while held, a thread that takes a chunk
 * of a copy not cancelled counts it as being copied, then waits before its memmoves. For
 * tests of what a copy being copied may do (cancel, state); ``wait_for``: wait until that
 * many threads are at the gate (the GIL let go meanwhile). */
static PyObject *pool_hold(CopyPool *p, PyObject *args) {
    int held, wait_for = 0;
    if (!PyArg_ParseTuple(args, "p|i:hold", &held, &wait_for)) return NULL;
    if (!p->started) {
        PyErr_SetString(PyExc_RuntimeError, "CopyPool hold: the pool is closed");
        return NULL;
    }
    int at;
    Py_BEGIN_ALLOW_THREADS;
    pthread_mutex_lock(&p->lock);
    p->held = held;
    pthread_cond_broadcast(&p->wake);
    while (p->held && p->at_gate < wait_for) pthread_cond_wait(&p->wake, &p->lock);
    at = p->at_gate;
    pthread_mutex_unlock(&p->lock);
    Py_END_ALLOW_THREADS;
    return PyLong_FromLong(at);
}

static PyMethodDef pool_methods[] = {
    {"hold", (PyCFunction)pool_hold, METH_VARARGS, "hold(held, wait_for=0): the tests' gate before a copy"},
    {"post", (PyCFunction)pool_post, METH_VARARGS, "post(runs: bytes of uint64 triples, parts) -> CopyJob"},
    {"drain", (PyCFunction)pool_drain, METH_NOARGS, "drain() -> copies ended since the last drain"},
    {"fileno", (PyCFunction)pool_fileno, METH_NOARGS, "fileno() -> the eventfd readable when a copy ended"},
    {"close", (PyCFunction)pool_close, METH_NOARGS, "close(): end the threads once queued copies are over"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef job_methods[] = {
    {"cancel", (PyCFunction)job_cancel, METH_NOARGS, "cancel() -> True if no chunk is being copied"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef job_getset[] = {
    {"state", (getter)job_state, NULL, "0: in flight, 1: done, 2: cancelled (terminal)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot pool_slots[] = {
    {Py_tp_doc, "Copy threads that never take the GIL (see _copies.c)."},
    {Py_tp_new, pool_new},
    {Py_tp_init, pool_init},
    {Py_tp_dealloc, pool_dealloc},
    {Py_tp_methods, pool_methods},
    {0, NULL},
};

static PyType_Slot job_slots[] = {
    {Py_tp_doc, "A copy posted to a CopyPool."},
    {Py_tp_dealloc, job_dealloc},
    {Py_tp_methods, job_methods},
    {Py_tp_getset, job_getset},
    {0, NULL},
};

static PyType_Spec pool_spec = {
    .name = "kvcr.store._core.CopyPool",
    .basicsize = sizeof(CopyPool),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = pool_slots,
};

static PyType_Spec job_spec = {
    .name = "kvcr.store._core.CopyJob",
    .basicsize = sizeof(CopyJob),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = job_slots,
};

int copies_exec(PyObject *module) {
    PyObject *pool = PyType_FromSpec(&pool_spec);
    if (pool == NULL) return -1;
    if (PyModule_AddObject(module, "CopyPool", pool) < 0) {
        Py_DECREF(pool);
        return -1;
    }
    job_type = PyType_FromSpec(&job_spec);
    if (job_type == NULL) return -1;
    Py_INCREF(job_type); /* the module's reference, and this file's */
    if (PyModule_AddObject(module, "CopyJob", job_type) < 0) {
        Py_DECREF(job_type);
        return -1;
    }
    return PyModule_AddIntConstant(module, "COPY_PROC", PROC) < 0 ||
                   PyModule_AddIntConstant(module, "COPY_DONE", DONE) < 0 ||
                   PyModule_AddIntConstant(module, "COPY_ERR", ERR) < 0
               ? -1
               : 0;
}
