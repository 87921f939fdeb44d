"""Checkpoints: the states of one Kafka partition's users, their archive notes and the next
offset of that partition, written as one unit (like a Kafka Streams task's state store,
changelog and input offsets), in a directory or an object store (recmem/blobstore.py).

Layout under the checkpoint root (``<checkpoint.dir>/<topic>/<group>``), one prefix per
partition::

    p-00003/MANIFEST.json                 names the complete checkpoints, newest first, and
                                          the partition's fence (the owner's generation)
    p-00003/ckpt-000000000042-g7-1f2e3d/  meta.json (offset, kind, parent, generation,
                                          CRCs), users.json, state.*.bin, notes.*.npy
    p-00003/fence-000000000007.json       one per claim, never replaced

A checkpoint is full (every user of the partition) or a delta (only the users that changed
since its parent, an earlier checkpoint); restoring a delta reads its chain back to the last
full one, later states winning. The manifest keeps the newest ``keep`` restore points and
every checkpoint their chains need.

Files are written (and fsynced) under a fresh name, ``meta.json`` last; then the manifest is
replaced, which is the commit. A crash at any point leaves the previous manifest naming only
complete checkpoints. Every file carries a CRC32 in meta.json; a checkpoint that fails its
checks is skipped with a warning and the previous one is used.

Fencing. A member that is given a partition by the group first *claims* it with its group
generation (``claim``): a create-only fence object and, conditionally, the manifest's
fence. Every later write carries the writer's generation and commits only if no newer
claim exists, through a conditional replace of the manifest (S3 ``If-Match``; a lock in a
directory): an owner that was paused (SIGSTOP, a long GC, a network partition) and resumed
after the group gave its partitions to another member is refused at write time
(``Fenced``). Where a store cannot write conditionally, a restore ignores every checkpoint
written by an older generation after the newest claim (it names the checkpoint it started
from), so a stale owner's write is never the restore point.
"""

from recmem.checkpoint.fencing import NO_GENERATION, Fence, Fenced
from recmem.checkpoint.settings import (
    RUNTIME_ONLY,
    checkpoint_root,
    data_settings,
    settings_diff,
)
from recmem.checkpoint.store import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    CheckpointStore,
    IncompatibleCheckpoint,
    PartitionCheckpoint,
)

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "NO_GENERATION",
    "RUNTIME_ONLY",
    "CheckpointError",
    "CheckpointStore",
    "Fence",
    "Fenced",
    "IncompatibleCheckpoint",
    "PartitionCheckpoint",
    "checkpoint_root",
    "data_settings",
    "settings_diff",
]
