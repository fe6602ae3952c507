/* kvcr.store._core.KeyTable: the key table (block keys -> records) in C.
 *
 * Why C: ``query`` runs on the engine's thread at every scheduler step with tens to hundreds
 * of keys; a lookup in Python or numpy costs microseconds of fixed cost per call (issue 36).
 * Here one call looks a batch up and answers it, with no object per key.
 *
 * Layout (see keytable.py for the interface):
 * - ``rows``: capacity x width bytes, a record's key zero-padded (width: 32 to 64, grown by a
 *   rebuild when a longer key comes). A key longer than 64 bytes is filed under its 32-byte
 *   digest (code DIGEST), the key itself kept in a dict by record.
 * - ``lens``: a record's length code (0-64, or DIGEST).
 * - ``slots``: an open-addressing table of ``size`` int32 entries (a power of two, at least
 *   four per record): a record, EMPTY or TOMB. Linear probing.
 * - ``entry``: where each record's entry is; stale once its key is gone, so a removal checks
 *   that the entry still names the record. Invariant: slots[p] == rec iff rec is filed at p.
 *
 * Threads: every call runs holding the GIL and never lets it go while the table is half
 * written (a long key's digest, the one call back into Python, is taken before anything is
 * written), so engine threads read while the runtime writes, as with the Python table
 * before it. Releasing the GIL would take a lock of our own on every call: each call here
 * is a few microseconds at most per thousand keys.
 *
 * Boundary: every record number that comes in is checked against the capacity, every batch
 * against its declared shape; a bad one raises ValueError (or KeyError, TypeError) before
 * anything is written.
 *
 * CPython's limited API 3.10 only (one abi3 wheel): no buffer protocol, so arrays come in as
 * bytes (native intp) and go out as bytearrays that numpy views without a copy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "_core.h"

#define EMPTY (-1)
#define TOMB (-2)
#define SEEN (-1) /* a record's entry while its batch is checked (check_keyless) */
#define DIGEST 255
#define MAX_WIDTH 64
#define DIGEST_BYTES 32
#define MIN_WIDTH 32
/* Live entries and tombstones, as a share of the table, before a rebuild: 7/10. */
#define USED_NUM 7
#define USED_DEN 10

static const uint64_t SEED = 0x9E3779B97F4A7C15ULL;
static const uint64_t MUL = 0xBF58476D1CE4E5B9ULL;
static const uint64_t FIN = 0x94D049BB133111EBULL;

/* Zeroed memory; from 2 MiB up, a mapping of its own with transparent huge pages asked
 * for: a lookup at a million records reads an entry and a row at random, and on 4 KiB pages
 * each read is a TLB miss too. */
#define HUGE_FROM ((size_t)2 << 20)
static void *zalloc(size_t bytes) {
    if (bytes < HUGE_FROM) return calloc(1, bytes ? bytes : 1);
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    (void)madvise(p, bytes, MADV_HUGEPAGE); /* advice: where THP is off, 4 KiB pages */
    return p;
}

static void zfree(void *p, size_t bytes) {
    if (p == NULL) return;
    if (bytes < HUGE_FROM) free(p);
    else munmap(p, bytes);
}

typedef struct {
    PyObject_HEAD
    Py_ssize_t capacity;
    Py_ssize_t width;
    Py_ssize_t size; /* entries in slots, a power of two */
    Py_ssize_t count; /* live keys */
    Py_ssize_t used; /* live entries and tombstones */
    unsigned long long filings;
    unsigned long long rebuilds; /* for tests and gauges */
    uint8_t *rows;
    uint8_t *lens;
    int32_t *entry;
    int32_t *slots;
    PyObject *long_keys; /* dict: rec -> key, for keys filed under a digest */
    PyObject *digest; /* callable: key -> 32 bytes */
} KeyTable;

/* A key as the table files it: its row (zero-padded), its code and its hash. */
typedef struct {
    uint8_t row[MAX_WIDTH];
    int code;
    uint64_t hash;
} Ident;

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v; /* little-endian machines only (Linux x86_64, aarch64) */
}

static uint64_t hash_row(const uint8_t *row, int code) {
    uint64_t x = ((uint64_t)code + 1) * SEED;
    int words = code == DIGEST ? DIGEST_BYTES / 8 : (code + 7) / 8;
    for (int j = 0; j < words; j++) {
        x = (x ^ load64(row + 8 * j)) * MUL;
        x ^= x >> 32;
    }
    /* splitmix64's finaliser: every input bit reaches the low bits (the home entry). */
    x = (x ^ (x >> 30)) * MUL;
    x = (x ^ (x >> 27)) * FIN;
    return x ^ (x >> 31);
}

static inline int key_bytes(int code) { return code == DIGEST ? DIGEST_BYTES : code; }

/* The key of ``obj`` (bytes, or a bytes subclass), as a pointer and length. */
static int key_of(PyObject *obj, const char **data, Py_ssize_t *len) {
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "key table: a block key must be bytes, not %s",
                     Py_TYPE(obj) == NULL ? "?" : "another type");
        return -1;
    }
    char *p;
    if (PyBytes_AsStringAndSize(obj, &p, len) < 0) return -1;
    *data = p;
    return 0;
}

/* The identity of a key: 0 found, 1 cannot be in this table (too wide for it), -1 error.
 * A key longer than MAX_WIDTH calls the digest function: before anything is written. */
static int ident_of(KeyTable *t, const char *data, Py_ssize_t len, PyObject *obj, Ident *id) {
    memset(id->row, 0, sizeof id->row);
    if (len <= MAX_WIDTH) {
        if (len > t->width) return 1;
        memcpy(id->row, data, (size_t)len);
        id->code = (int)len;
    } else {
        PyObject *made = NULL;
        if (obj == NULL) {
            made = PyBytes_FromStringAndSize(data, len);
            if (made == NULL) return -1;
            obj = made;
        }
        PyObject *digest = PyObject_CallFunctionObjArgs(t->digest, obj, NULL);
        Py_XDECREF(made);
        if (digest == NULL) return -1;
        char *d;
        Py_ssize_t n;
        if (!PyBytes_Check(digest) || PyBytes_AsStringAndSize(digest, &d, &n) < 0 ||
            n != DIGEST_BYTES) {
            Py_DECREF(digest);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "key table: the digest function must give 32 bytes");
            return -1;
        }
        memcpy(id->row, d, DIGEST_BYTES);
        Py_DECREF(digest);
        id->code = DIGEST;
    }
    id->hash = hash_row(id->row, id->code);
    return 0;
}

static inline int row_matches(const KeyTable *t, int32_t rec, const Ident *id) {
    return t->lens[rec] == id->code &&
           memcmp(t->rows + (size_t)rec * t->width, id->row, (size_t)key_bytes(id->code)) == 0;
}

static int32_t probe_find(const KeyTable *t, const Ident *id) {
    size_t mask = (size_t)t->size - 1, p = id->hash & mask;
    for (;;) {
        int32_t s = t->slots[p];
        if (s == EMPTY) return -1;
        if (s >= 0 && row_matches(t, s, id)) return s;
        p = (p + 1) & mask;
    }
}

/* One key's record, or -1; -2 on error. */
static Py_ssize_t find_obj(KeyTable *t, PyObject *obj) {
    const char *data;
    Py_ssize_t len;
    Ident id;
    if (key_of(obj, &data, &len) < 0) return -2;
    if (t->count == 0 && len <= MAX_WIDTH) return -1;
    int r = ident_of(t, data, len, obj, &id);
    if (r < 0) return -2;
    return r ? -1 : probe_find(t, &id);
}

/* Rows first, then the entry: a lookup reads a row only through an entry. */
static void write_row(KeyTable *t, int32_t rec, const Ident *id) {
    memcpy(t->rows + (size_t)rec * t->width, id->row, (size_t)t->width);
    t->lens[rec] = (uint8_t)id->code;
}

/* File ``rec`` under ``id``; returns the record that holds the key instead, or -1.
 * ``absent``: the key is known absent, so the first free entry takes it, with no compare. */
static int32_t place(KeyTable *t, int32_t rec, const Ident *id, int absent) {
    size_t mask = (size_t)t->size - 1, p = id->hash & mask;
    Py_ssize_t free_at = -1;
    for (;;) {
        int32_t s = t->slots[p];
        if (s == EMPTY) break;
        if (s == TOMB) {
            if (free_at < 0) free_at = (Py_ssize_t)p;
            if (absent) break;
        } else if (!absent && row_matches(t, s, id)) {
            return s;
        }
        p = (p + 1) & mask;
    }
    size_t at = free_at >= 0 ? (size_t)free_at : p;
    write_row(t, rec, id);
    if (t->slots[at] == EMPTY) t->used++;
    t->slots[at] = rec;
    t->entry[rec] = (int32_t)at;
    t->count++;
    return -1;
}

static inline int has_key(const KeyTable *t, Py_ssize_t rec) {
    int32_t p = t->entry[rec];
    return p >= 0 && p < t->size && t->slots[p] == rec;
}

/* A fresh table with no tombstones at ``width`` (at least the current one), swapped in. */
static int rebuild(KeyTable *t, Py_ssize_t width) {
    uint8_t *rows = t->rows;
    if (width != t->width) {
        rows = zalloc((size_t)t->capacity * (size_t)width);
        if (rows == NULL) return (PyErr_NoMemory(), -1);
        for (Py_ssize_t r = 0; r < t->capacity; r++)
            memcpy(rows + (size_t)r * width, t->rows + (size_t)r * t->width, (size_t)t->width);
    }
    int32_t *slots = zalloc(sizeof(int32_t) * (size_t)t->size);
    if (slots == NULL) {
        if (rows != t->rows) zfree(rows, (size_t)t->capacity * (size_t)width);
        return (PyErr_NoMemory(), -1);
    }
    memset(slots, 0xff, sizeof(int32_t) * (size_t)t->size); /* EMPTY */
    size_t mask = (size_t)t->size - 1;
    for (Py_ssize_t i = 0; i < t->size; i++) {
        int32_t rec = t->slots[i];
        if (rec < 0) continue;
        size_t p = hash_row(rows + (size_t)rec * width, t->lens[rec]) & mask;
        while (slots[p] != EMPTY) p = (p + 1) & mask;
        slots[p] = rec;
        t->entry[rec] = (int32_t)p;
    }
    zfree(t->slots, sizeof(int32_t) * (size_t)t->size);
    if (rows != t->rows) zfree(t->rows, (size_t)t->capacity * (size_t)t->width);
    t->slots = slots;
    t->rows = rows;
    t->width = width;
    t->used = t->count;
    t->rebuilds++;
    return 0;
}

/* Room for ``n`` more entries, and rows for keys of ``widest`` bytes. */
static int make_room(KeyTable *t, Py_ssize_t n, Py_ssize_t widest) {
    Py_ssize_t width = t->width;
    if (widest > width) width = (widest + 7) & ~(Py_ssize_t)7;
    if (width != t->width || (t->used + n) * USED_DEN > t->size * USED_NUM) return rebuild(t, width);
    return 0;
}

static void free_arrays(KeyTable *t) {
    size_t cap = (size_t)t->capacity;
    zfree(t->rows, cap * (size_t)t->width);
    zfree(t->lens, cap);
    zfree(t->entry, cap * sizeof(int32_t));
    zfree(t->slots, (size_t)t->size * sizeof(int32_t));
    t->rows = t->lens = NULL;
    t->entry = t->slots = NULL;
}

/* ---- arguments ---------------------------------------------------------------------- */

/* ``keys`` as a list or tuple (a new reference), with its length. */
static PyObject *as_sequence(PyObject *keys, Py_ssize_t *n) {
    PyObject *seq;
    if (PyList_Check(keys) || PyTuple_Check(keys)) {
        Py_INCREF(keys);
        seq = keys;
    } else {
        seq = PySequence_List(keys);
        if (seq == NULL) return NULL;
    }
    *n = PyList_Check(seq) ? PyList_Size(seq) : PyTuple_Size(seq);
    return seq;
}

static inline PyObject *item(PyObject *seq, Py_ssize_t i) {
    return PyList_Check(seq) ? PyList_GetItem(seq, i) : PyTuple_GetItem(seq, i);
}

/* Records given as native intp bytes: checked against the capacity, ``n`` of them. */
static const Py_ssize_t *records_arg(KeyTable *t, PyObject *obj, Py_ssize_t n, const char *op) {
    char *data;
    Py_ssize_t len;
    if (!PyBytes_Check(obj) || PyBytes_AsStringAndSize(obj, &data, &len) < 0) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "key table %s: records must be intp bytes", op);
        return NULL;
    }
    if (n < 0) n = len / (Py_ssize_t)sizeof(Py_ssize_t);
    if (len != n * (Py_ssize_t)sizeof(Py_ssize_t)) {
        PyErr_Format(PyExc_ValueError, "key table %s: %zd bytes of records for %zd keys", op, len, n);
        return NULL;
    }
    const Py_ssize_t *recs = (const Py_ssize_t *)data;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (recs[i] < 0 || recs[i] >= t->capacity) {
            PyErr_Format(PyExc_ValueError, "key table %s: record %zd is outside 0..%zd", op, recs[i],
                         t->capacity - 1);
            return NULL;
        }
    }
    return recs;
}

/* A batch's records are checked before anything is written, a record given twice included:
 * while they are, each one's ``entry`` is marked negative (it never is otherwise), and the
 * marks go before these return. */

/* Records to file keys under: none has a key (so its entry is free: marked SEEN, then 0),
 * none is given twice. */
static int check_keyless(KeyTable *t, const Py_ssize_t *recs, Py_ssize_t n, const char *op) {
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        if (t->entry[recs[i]] == SEEN) {
            PyErr_Format(PyExc_ValueError, "key table %s: record %zd is given twice", op, recs[i]);
            break;
        }
        if (has_key(t, recs[i])) {
            PyErr_Format(PyExc_ValueError, "key table %s: record %zd already has a key", op, recs[i]);
            break;
        }
        t->entry[recs[i]] = SEEN;
    }
    for (Py_ssize_t j = 0; j < i; j++) t->entry[recs[j]] = 0;
    return i < n ? -1 : 0;
}

/* Records to drop the keys of: each has one (its entry p marked ~p, then restored), none is
 * given twice. */
static int check_keyed(KeyTable *t, const Py_ssize_t *recs, Py_ssize_t n, const char *op) {
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        if (t->entry[recs[i]] < 0) {
            PyErr_Format(PyExc_ValueError, "key table %s: record %zd is given twice", op, recs[i]);
            break;
        }
        if (!has_key(t, recs[i])) {
            PyErr_Format(PyExc_KeyError, "key table: record %zd has no key", recs[i]);
            break;
        }
        t->entry[recs[i]] = ~t->entry[recs[i]];
    }
    for (Py_ssize_t j = 0; j < i; j++) t->entry[recs[j]] = ~t->entry[recs[j]];
    return i < n ? -1 : 0;
}

/* ---- methods ------------------------------------------------------------------------ */

static PyObject *kt_find(KeyTable *t, PyObject *key) {
    Py_ssize_t rec = find_obj(t, key);
    return rec == -2 ? NULL : PyLong_FromSsize_t(rec);
}

/* The records of keys [start, start + m) of ``seq`` (m <= GROUP) into ``out``: every
 * key's hash first, its home entry prefetched; then each home's row prefetched; then the
 * probes. At a million records a key's object, entry, row and flags byte are a cache miss
 * each; a group has them in flight together rather than one after the other. */
#define GROUP 16
static int find_group(KeyTable *t, PyObject *seq, Py_ssize_t start, Py_ssize_t m, Py_ssize_t *out,
                      const uint8_t *flags) {
    Ident ids[GROUP];
    size_t mask = (size_t)t->size - 1;
    /* The key objects first: an engine's keys are objects of its own, often not in cache,
     * and reading one is a cache miss of its own before its hash can even start. */
    for (Py_ssize_t i = 0; i < m; i++) __builtin_prefetch(item(seq, start + i));
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *obj = item(seq, start + i);
        const char *data;
        Py_ssize_t len;
        if (key_of(obj, &data, &len) < 0) return -1;
        out[i] = 0;
        if (t->count == 0 && len <= MAX_WIDTH) {
            out[i] = -1;
            continue;
        }
        int r = ident_of(t, data, len, obj, &ids[i]);
        if (r < 0) return -1;
        if (r) out[i] = -1; /* too wide for this table: absent */
        else __builtin_prefetch(&t->slots[ids[i].hash & mask]);
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        if (out[i] < 0) continue;
        int32_t s = t->slots[ids[i].hash & mask];
        if (s < 0) continue;
        __builtin_prefetch(t->rows + (size_t)s * t->width);
        if (flags != NULL) __builtin_prefetch(flags + s); /* answers reads the record's flags */
    }
    for (Py_ssize_t i = 0; i < m; i++)
        if (out[i] == 0) out[i] = probe_find(t, &ids[i]);
    return 0;
}

/* lookup(keys) -> bytearray of intp: each key's record, -1 where it has none. */
static PyObject *kt_lookup(KeyTable *t, PyObject *keys) {
    Py_ssize_t n, *out;
    PyObject *seq = as_sequence(keys, &n);
    if (seq == NULL) return NULL;
    PyObject *buf = new_intp(n, &out);
    for (Py_ssize_t i = 0; buf != NULL && i < n; i += GROUP) {
        Py_ssize_t m = n - i < GROUP ? n - i : GROUP;
        if (find_group(t, seq, i, m, out + i, NULL) < 0) Py_CLEAR(buf);
    }
    Py_DECREF(seq);
    return buf;
}

/* answers(keys, flags, table) -> list: table[flags[rec] & 7] for each key's record, and
 * table[0] for a key without one. ``flags``: the index's bytearray, one byte per record. */
static PyObject *kt_answers(KeyTable *t, PyObject *args) {
    PyObject *keys, *flags, *table;
    if (!PyArg_ParseTuple(args, "OO!O!:answers", &keys, &PyByteArray_Type, &flags, &PyList_Type, &table))
        return NULL;
    if (PyByteArray_Size(flags) < t->capacity || PyList_Size(table) != 8) {
        PyErr_SetString(PyExc_ValueError, "key table answers: flags must cover every record, the table 8 answers");
        return NULL;
    }
    const uint8_t *f = (const uint8_t *)PyByteArray_AsString(flags);
    Py_ssize_t n, recs[GROUP];
    PyObject *seq = as_sequence(keys, &n);
    if (seq == NULL) return NULL;
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i += GROUP) {
        Py_ssize_t m = n - i < GROUP ? n - i : GROUP;
        if (find_group(t, seq, i, m, recs, f) < 0) {
            Py_CLEAR(out);
            break;
        }
        for (Py_ssize_t j = 0; j < m; j++) {
            PyObject *answer = PyList_GetItem(table, recs[j] < 0 ? 0 : (f[recs[j]] & 7));
            Py_INCREF(answer);
            PyList_SetItem(out, i + j, answer);
        }
    }
    Py_DECREF(seq);
    return out;
}

/* file(keys, recs, absent) -> bytearray of intp: per key, the record that holds it instead
 * (-1: filed under its record). ``absent``: the keys are distinct and known absent. */
static PyObject *kt_file(KeyTable *t, PyObject *args) {
    PyObject *keys, *recs_obj;
    int absent;
    if (!PyArg_ParseTuple(args, "OOp:file", &keys, &recs_obj, &absent)) return NULL;
    Py_ssize_t n, *out, widest = 0;
    PyObject *seq = as_sequence(keys, &n);
    if (seq == NULL) return NULL;
    PyObject *buf = NULL;
    Ident *ids = NULL;
    const Py_ssize_t *recs = records_arg(t, recs_obj, n, "file");
    if (recs == NULL || check_keyless(t, recs, n, "file") < 0) goto done;
    /* Every identity first: the digests call Python, and nothing is written yet. */
    ids = malloc(sizeof(Ident) * (size_t)(n ? n : 1));
    if (ids == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *data;
        Py_ssize_t len;
        PyObject *key = item(seq, i);
        if (key_of(key, &data, &len) < 0) goto done;
        if (len <= MAX_WIDTH) {
            if (len > widest) widest = len;
            memset(ids[i].row, 0, MAX_WIDTH);
            memcpy(ids[i].row, data, (size_t)len);
            ids[i].code = (int)len;
            ids[i].hash = hash_row(ids[i].row, ids[i].code);
        } else if (ident_of(t, data, len, key, &ids[i]) < 0) {
            goto done;
        }
    }
    buf = new_intp(n, &out);
    if (buf == NULL || make_room(t, n, widest) < 0) {
        Py_CLEAR(buf);
        goto done;
    }
    t->filings++;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (has_key(t, recs[i])) { /* filed meanwhile, by a digest function that called in */
            PyErr_Format(PyExc_ValueError, "key table file: record %zd is given twice", recs[i]);
            Py_CLEAR(buf);
            goto done;
        }
        out[i] = place(t, (int32_t)recs[i], &ids[i], absent);
        if (out[i] < 0 && ids[i].code == DIGEST) {
            PyObject *rec = PyLong_FromSsize_t(recs[i]);
            int failed = rec == NULL || PyDict_SetItem(t->long_keys, rec, item(seq, i)) < 0;
            Py_XDECREF(rec);
            if (failed) {
                Py_CLEAR(buf);
                goto done;
            }
        }
    }
done:
    free(ids);
    Py_DECREF(seq);
    return buf;
}

/* file_rows(rows, length, recs) -> holders, as file(): keys given as n rows of ``length``
 * bytes in one bytes object (a journal batch's keys), no object per key. */
static PyObject *kt_file_rows(KeyTable *t, PyObject *args) {
    const char *rows;
    Py_ssize_t size, length;
    PyObject *recs_obj;
    if (!PyArg_ParseTuple(args, "y#nO:file_rows", &rows, &size, &length, &recs_obj)) return NULL;
    if (length < 0 || length > MAX_WIDTH || (length == 0 ? size != 0 : size % length)) {
        PyErr_Format(PyExc_ValueError, "key table file_rows: %zd bytes are not rows of %zd (at most %d)",
                     size, length, MAX_WIDTH);
        return NULL;
    }
    Py_ssize_t n = length ? size / length : 0, *out;
    const Py_ssize_t *recs = records_arg(t, recs_obj, length ? n : -1, "file_rows");
    if (recs == NULL) return NULL;
    if (length == 0) n = PyBytes_Size(recs_obj) / (Py_ssize_t)sizeof(Py_ssize_t);
    if (check_keyless(t, recs, n, "file_rows") < 0) return NULL;
    PyObject *buf = new_intp(n, &out);
    if (buf == NULL) return NULL;
    if (make_room(t, n, length) < 0) {
        Py_DECREF(buf);
        return NULL;
    }
    t->filings++;
    Ident id;
    memset(id.row, 0, sizeof id.row);
    id.code = (int)length;
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(id.row, rows + i * length, (size_t)length);
        id.hash = hash_row(id.row, id.code);
        out[i] = place(t, (int32_t)recs[i], &id, 0);
    }
    return buf;
}

static int drop_one(KeyTable *t, Py_ssize_t rec) {
    t->slots[t->entry[rec]] = TOMB;
    t->count--;
    if (t->lens[rec] == DIGEST) {
        PyObject *key = PyLong_FromSsize_t(rec);
        if (key == NULL) return -1;
        int r = PyDict_DelItem(t->long_keys, key);
        Py_DECREF(key);
        if (r < 0) return -1;
    }
    return 0;
}

/* drop(recs): drop the keys of distinct records that have one (KeyError, nothing dropped,
 * if one has none; ValueError, nothing dropped, if one is given twice). */
static PyObject *kt_drop(KeyTable *t, PyObject *recs_obj) {
    const Py_ssize_t *recs = records_arg(t, recs_obj, -1, "drop");
    if (recs == NULL) return NULL;
    Py_ssize_t n = PyBytes_Size(recs_obj) / (Py_ssize_t)sizeof(Py_ssize_t);
    if (check_keyed(t, recs, n, "drop") < 0) return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (drop_one(t, recs[i]) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *key_at(KeyTable *t, Py_ssize_t rec) {
    if (!has_key(t, rec)) {
        PyErr_Format(PyExc_KeyError, "key table: record %zd has no key", rec);
        return NULL;
    }
    if (t->lens[rec] == DIGEST) {
        PyObject *r = PyLong_FromSsize_t(rec);
        if (r == NULL) return NULL;
        PyObject *key = PyDict_GetItemWithError(t->long_keys, r);
        Py_DECREF(r);
        if (key == NULL && !PyErr_Occurred())
            PyErr_Format(PyExc_KeyError, "key table: record %zd lost its long key", rec);
        Py_XINCREF(key);
        return key;
    }
    return PyBytes_FromStringAndSize((const char *)t->rows + (size_t)rec * t->width, t->lens[rec]);
}

static PyObject *kt_key(KeyTable *t, PyObject *arg) {
    Py_ssize_t rec = PyLong_AsSsize_t(arg);
    if (rec == -1 && PyErr_Occurred()) return NULL;
    if (rec < 0 || rec >= t->capacity) {
        PyErr_Format(PyExc_ValueError, "key table key: record %zd is outside 0..%zd", rec, t->capacity - 1);
        return NULL;
    }
    return key_at(t, rec);
}

/* keys_of(recs) -> list of the keys of records that have one. */
static PyObject *kt_keys_of(KeyTable *t, PyObject *recs_obj) {
    const Py_ssize_t *recs = records_arg(t, recs_obj, -1, "keys_of");
    if (recs == NULL) return NULL;
    Py_ssize_t n = PyBytes_Size(recs_obj) / (Py_ssize_t)sizeof(Py_ssize_t);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *key = key_at(t, recs[i]);
        if (key == NULL) Py_CLEAR(out);
        else PyList_SetItem(out, i, key);
    }
    return out;
}

/* live() -> bytearray of intp: every record with a key, in table order. */
static PyObject *kt_live(KeyTable *t, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t *out, k = 0;
    PyObject *buf = new_intp(t->count, &out);
    if (buf == NULL) return NULL;
    for (Py_ssize_t i = 0; i < t->size && k < t->count; i++)
        if (t->slots[i] >= 0) out[k++] = t->slots[i];
    return buf;
}

static Py_ssize_t kt_len(KeyTable *t) { return t->count; }

static PyObject *kt_get_width(KeyTable *t, void *Py_UNUSED(c)) { return PyLong_FromSsize_t(t->width); }
static PyObject *kt_get_capacity(KeyTable *t, void *Py_UNUSED(c)) { return PyLong_FromSsize_t(t->capacity); }
static PyObject *kt_get_filings(KeyTable *t, void *Py_UNUSED(c)) { return PyLong_FromUnsignedLongLong(t->filings); }
static PyObject *kt_get_rebuilds(KeyTable *t, void *Py_UNUSED(c)) { return PyLong_FromUnsignedLongLong(t->rebuilds); }
static PyObject *kt_get_used(KeyTable *t, void *Py_UNUSED(c)) { return PyLong_FromSsize_t(t->used); }
static PyObject *kt_get_size(KeyTable *t, void *Py_UNUSED(c)) { return PyLong_FromSsize_t(t->size); }

/* KeyTable(capacity, width, digest) */
static int kt_init(KeyTable *t, PyObject *args, PyObject *kwds) {
    static char *names[] = {"capacity", "width", "digest", NULL};
    Py_ssize_t capacity, width;
    PyObject *digest;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nnO:KeyTable", names, &capacity, &width, &digest))
        return -1;
    if (capacity < 0 || capacity > INT32_MAX / 4 || width < 0 || width > MAX_WIDTH || !PyCallable_Check(digest)) {
        PyErr_Format(PyExc_ValueError, "KeyTable: capacity %zd (at most %d) or width %zd (at most %d) "
                     "out of range, or digest not callable", capacity, INT32_MAX / 4, width, MAX_WIDTH);
        return -1;
    }
    width = width < MIN_WIDTH ? MIN_WIDTH : (width + 7) & ~(Py_ssize_t)7;
    Py_ssize_t size = 16;
    while (size < 4 * capacity) size <<= 1; /* at most a quarter full of live keys */
    free_arrays(t);
    Py_CLEAR(t->long_keys);
    Py_CLEAR(t->digest);
    t->capacity = capacity;
    t->width = width;
    t->size = size;
    t->count = t->used = 0;
    t->filings = t->rebuilds = 0;
    size_t cap = (size_t)(capacity ? capacity : 1);
    t->rows = zalloc(cap * (size_t)width);
    t->lens = zalloc(cap);
    t->entry = zalloc(cap * sizeof(int32_t));
    t->slots = zalloc(sizeof(int32_t) * (size_t)size);
    t->long_keys = PyDict_New();
    if (t->rows == NULL || t->lens == NULL || t->entry == NULL || t->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (t->long_keys == NULL) return -1;
    memset(t->slots, 0xff, sizeof(int32_t) * (size_t)size);
    Py_INCREF(digest);
    t->digest = digest;
    return 0;
}

static int kt_traverse(KeyTable *t, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(t));
    Py_VISIT(t->long_keys);
    Py_VISIT(t->digest);
    return 0;
}

static int kt_clear(KeyTable *t) {
    Py_CLEAR(t->long_keys);
    Py_CLEAR(t->digest);
    return 0;
}

static void kt_dealloc(KeyTable *t) {
    PyTypeObject *tp = Py_TYPE(t);
    PyObject_GC_UnTrack(t);
    kt_clear(t);
    free_arrays(t);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(t);
    Py_DECREF(tp);
}

static PyMethodDef kt_methods[] = {
    {"find", (PyCFunction)kt_find, METH_O, "find(key) -> the key's record, or -1"},
    {"lookup", (PyCFunction)kt_lookup, METH_O, "lookup(keys) -> bytearray of intp records (-1: none)"},
    {"answers", (PyCFunction)kt_answers, METH_VARARGS,
     "answers(keys, flags, table) -> [table[flags[rec] & 7] or table[0] per key]"},
    {"file", (PyCFunction)kt_file, METH_VARARGS,
     "file(keys, recs: intp bytes, absent) -> bytearray of intp holders (-1: filed)"},
    {"file_rows", (PyCFunction)kt_file_rows, METH_VARARGS,
     "file_rows(rows: bytes, length, recs: intp bytes) -> holders, as file()"},
    {"drop", (PyCFunction)kt_drop, METH_O, "drop(recs: intp bytes): drop the keys of these records"},
    {"key", (PyCFunction)kt_key, METH_O, "key(rec) -> the record's key (KeyError: none)"},
    {"keys_of", (PyCFunction)kt_keys_of, METH_O, "keys_of(recs: intp bytes) -> their keys"},
    {"live", (PyCFunction)kt_live, METH_NOARGS, "live() -> bytearray of intp: every record with a key"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef kt_getset[] = {
    {"width", (getter)kt_get_width, NULL, "bytes per row (32 to 64)", NULL},
    {"capacity", (getter)kt_get_capacity, NULL, "records: 0..capacity-1", NULL},
    {"filings", (getter)kt_get_filings, NULL, "bumped by every filing", NULL},
    {"rebuilds", (getter)kt_get_rebuilds, NULL, "rebuilds so far (tombstones cleared, rows widened)", NULL},
    {"used", (getter)kt_get_used, NULL, "live entries and tombstones", NULL},
    {"size", (getter)kt_get_size, NULL, "entries in the table", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot kt_slots[] = {
    {Py_tp_doc, "Block keys -> records in range(capacity), in C (see keytable.py)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, kt_init},
    {Py_tp_dealloc, kt_dealloc},
    {Py_tp_traverse, kt_traverse},
    {Py_tp_clear, kt_clear},
    {Py_tp_methods, kt_methods},
    {Py_tp_getset, kt_getset},
    {Py_sq_length, kt_len},
    {0, NULL},
};

static PyType_Spec kt_spec = {
    .name = "kvcr.store._core.KeyTable",
    .basicsize = sizeof(KeyTable),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = kt_slots,
};

int keytable_exec(PyObject *module) {
    PyObject *type = PyType_FromSpec(&kt_spec);
    if (type == NULL) return -1;
    if (PyModule_AddObject(module, "KeyTable", type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return PyModule_AddIntConstant(module, "MAX_WIDTH", MAX_WIDTH) < 0 ||
                   PyModule_AddIntConstant(module, "DIGEST", DIGEST) < 0
               ? -1
               : 0;
}
