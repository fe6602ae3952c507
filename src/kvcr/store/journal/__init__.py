"""The recovery journal: committed residency changes of one pool group, in its mapping.

``format.py``: the bytes (header slots, frames, entries) and their encoding; ``replay.py``:
readers, which replay the whole frames into a state; ``writer.py``: the holder's writer,
with compaction. Callers that use many of them say ``journal.X``: the names they use are
re-exported here.
"""

from kvcr.store.journal.format import (
    BATCH,
    BATCH_HEAD,
    DATA_START,
    ENTRY_HEAD,
    FRAME_HEAD,
    FRAME_MAGIC,
    OPS,
    PUT_G2,
    PUT_G3,
    REMOVE,
    REMOVE_G3,
    SIZING_KEY_BYTES,
    JournalError,
    Keys,
    Position,
    encode_batch,
    encode_flat,
    encode_snapshot,
    half_bytes,
    listed,
    snapshot_bytes,
)
from kvcr.store.journal.replay import (
    DictState,
    Follower,
    Replay,
    Residency,
    State,
    apply_payload,
    read,
)
from kvcr.store.journal.writer import Writer

__all__ = [
    "BATCH",
    "BATCH_HEAD",
    "DATA_START",
    "ENTRY_HEAD",
    "FRAME_HEAD",
    "FRAME_MAGIC",
    "OPS",
    "PUT_G2",
    "PUT_G3",
    "REMOVE",
    "REMOVE_G3",
    "SIZING_KEY_BYTES",
    "DictState",
    "Follower",
    "JournalError",
    "Keys",
    "Position",
    "Replay",
    "Residency",
    "State",
    "Writer",
    "apply_payload",
    "encode_batch",
    "encode_flat",
    "encode_snapshot",
    "half_bytes",
    "listed",
    "read",
    "snapshot_bytes",
]
