"""The pure cores: what a worker holds and how it is recorded, with no I/O of their own.

Nothing here imports trio, NIXL, the runtime, the guard or the API (not even for type
checking; ``tests/unit/store/test_store_imports.py`` checks it): both the runtime and the
guard import this package, and this package is where a compiled core plugs in.

Modules:

- ``slots.py``: a pool's free slots (:class:`~kvcr.store.slots.SlotPool`);
- ``records.py``: a block index's record arrays and the :class:`~kvcr.store.records.Block`
  view over one record;
- ``batches.py``: what batch calls hand back (``Found``, ``Filling``, ``Claim``);
- ``index.py``: the block index (query answers, fills and commits, claims, eviction);
- ``recovery.py``: what a journal replay does to the records, and a snapshot's read;
- ``eviction.py``: the eviction queue (records by score);
- ``keytable.py``: block keys -> records, over the compiled core's ``KeyTable``;
- ``native.py``: loads the compiled core, ``kvcr.store._core`` (``_core.c``: the module and
  ``take_free``; ``_keytable.c``: the key table; ``_copies.c``: the copy pool that
  ``transport/copier.py`` uses), with no fallback;
- ``journal/``: the recovery journal: ``format.py`` (bytes), ``replay.py`` (readers),
  ``writer.py`` (the holder's writer, with compaction).

The interface the compiled core keeps: batches in, batches out, as numpy arrays of records
(``recs``), generations, flags and slots (n x pools), keys as a list of bytes or a journal
batch's keys in place. The block index's batch calls the runtime and the guard use:

- ``answers(keys)`` (``query``, from engine threads), ``lookup(keys)`` and
  ``lookup_to_fill(keys)`` -> ``Found`` (recs, flags);
- ``add_fills(keys, now, absent)`` -> ``Filling`` (keys, recs, gens, slots);
  ``held(fill)`` -> mask; ``commit_fills(fill, scores)``;
- ``claim_ready(found, now)`` -> ``Claim`` (recs, gens); ``unclaim_records(claim)`` -> recs;
- ``align(keys, now)`` -> recs; ``requeue(recs, scores)``; ``slots_of(recs)``;
  ``views(recs)``; ``evict(wanted)`` -> keys;
- recovery: ``put_recovered(keys, slots)``, ``forget_recovered(keys)``,
  ``queue_recovered(None)``, ``ready_records()`` -> (keys, slots flat).

Under them the key table (``find_many``, ``probe``, ``add_many``, ``add_probed``,
``add_rows``, ``remove_many``, ``keys``; in C, with ``answers`` for ``query``), the pools'
free slots (``take_many``: C's ``take_free``) and the eviction queue (``push_many``,
``pop_many``, ``drop_many``, ``push_all``; still numpy) take and give arrays too. The per-block calls
(``get``, ``holds``, ``commit``, ``remove``, ``claim``, ``touch``, ...) take a ``Block`` view:
the paths that hand blocks on (hooks, release handles) use them.
"""
