"""The pure cores: what a worker holds and how it is recorded, with no I/O of their own.

The key table, the block index, eviction and the recovery journal. Nothing here imports
trio, NIXL, the runtime or the guard: both of those import this package, and this package is
where a compiled core plugs in (batches of keys and records in, batches out).
"""
