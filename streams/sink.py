"""The interface between the consumer and whatever applies the events (the engine's ingest
adapter). The consumer owns Kafka; the sink owns state and its checkpoint, which holds the
offsets of the events it applied (state and offsets move together, one unit).

Call order, all on the consumer's thread:

- optional ``on_rebalancing()`` (kafka-python client only) when the member has to rejoin
  its group and is about to wait for the join: nothing has changed hands yet; a sink may
  prepare (recmem's adapter reads other partitions' checkpoints ahead,
  ``checkpoint.prefetch_mb``). It may be called again while the same join is under way.
- optional ``on_group(view)`` (a ``streams.group.GroupView``) when a rebalance's assignment
  arrives, before that rebalance's ``on_revoked`` / ``on_assigned``: the generation (the
  epoch the sink's checkpoints carry) and every partition's owner.
- ``on_assigned(partitions)`` after each group rebalance, before any batch of those
  partitions, with the partitions this member gained (under the cooperative protocol only
  the new ones; under an eager one all of them): the sink returns, per partition, where to
  resume (a ``Resume``: the next offset, and what the checkpoint recorded about the topic;
  a plain int is a next offset with nothing recorded; 0 = the partition's first offset),
  or ``RESTORING`` when it restores the partition in the background: the consumer then
  pauses the partition and asks ``restored()`` after every poll, which returns the resume
  points of the partitions whose restore finished; those are resumed. (Kafka-python runs
  rebalance callbacks on its network thread, where a long restore would stall heartbeats.)
  The consumer checks each resume point against the broker (streams/positions.py: topic
  id, the record before the offset, the log's bounds) and seeks there, or applies
  ``kafka.on_topic_mismatch`` / ``kafka.on_offset_out_of_range`` (default: fail). Partitions
  left out start from the group's committed offset, else the earliest.
- ``apply_batch(events, next_offsets, source)`` for each micro-batch: ``events`` in
  partition order, each partition's events in offset order; ``next_offsets`` has, for
  every partition that had records in the batch, the offset after its last record (dead
  letters included), so a batch made only of dead letters still advances the offsets;
  ``source`` (``SourceMarks``) the topic's id and a fingerprint of each such partition's
  last record, to be stored with the offsets. When this returns the sink owns the batch:
  a later checkpoint must include both its effects and these offsets.
- ``checkpoint_due()`` after each poll; when true, ``checkpoint()`` persists state and
  offsets atomically and returns the offsets it wrote; the consumer then commits them to the
  group (for monitoring and as the fallback start; the sink's checkpoint is the truth).
- ``on_revoked(partitions)`` before a rebalance takes partitions away (cooperative: only
  those that move) and when the consumer closes: the sink writes its checkpoint for them
  and drops them (a partition still restoring is dropped once its restore is abandoned).
- optional ``on_lost(partitions)``: the group evicted this consumer (session expired), so
  another member may already own these partitions; the sink should drop them without
  writing a checkpoint. A sink without this method gets ``on_revoked`` instead.

Calls run on the consumer's thread, or on kafka-python's network thread while the consumer
thread waits inside ``poll()`` / ``close()`` (rebalance callbacks), never at the same time.

After an exception from the sink (or from writing dead letters) the consumer closes
without calling the sink again: a half-applied batch is never checkpointed.

Dead letters of a batch are flushed to the dead-letter topic before ``apply_batch``, so a
crash after a checkpoint can never lose a bad record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

from streams.validate import ValidEvent


class Restoring:
    def __repr__(self) -> str:
        return "RESTORING"

    def __reduce__(self) -> str:
        # pickled by name, so that it is still ``RESTORING`` after crossing a process
        # boundary (streams/processes.py): callers test ``is RESTORING``
        return "RESTORING"


RESTORING: Final = Restoring()
"""``on_assigned``'s answer for a partition the sink restores in the background."""


@dataclass(frozen=True)
class Resume:
    """Where a partition resumes, as the sink's checkpoint records it."""

    next_offset: int
    """The offset after the last record applied (0: nothing applied, read from the start)."""
    topic_id: str = ""
    """The broker's id of the topic the checkpoint's records came from ("" unknown)."""
    last_record: str = ""
    """Fingerprint (``streams.positions.fingerprint``) of the record at next_offset - 1
    ("" unknown)."""


@dataclass(frozen=True)
class SourceMarks:
    """What identifies the records behind a batch's next offsets."""

    topic_id: str = ""
    last_records: dict[int, str] = field(default_factory=dict)
    """Per partition with records in the batch: fingerprint of its last record."""


class BatchSink(Protocol):
    def on_assigned(self, partitions: list[int]) -> Mapping[int, Resume | int | Restoring]:
        """Partition -> where to resume, from the sink's checkpoint (missing = committed
        offset, else earliest), or RESTORING (then ``restored()`` gives it later)."""
        ...

    def on_revoked(self, partitions: list[int]) -> None:
        """Checkpoint these partitions and drop them."""
        ...

    def apply_batch(
        self,
        events: list[ValidEvent],
        next_offsets: dict[int, int],
        source: SourceMarks | None = None,
    ) -> None:
        """Apply one micro-batch; ``next_offsets`` per partition, after the batch."""
        ...

    def checkpoint_due(self) -> bool:
        """Whether the consumer should call :meth:`checkpoint` now."""
        ...

    def checkpoint(self) -> dict[int, int]:
        """Persist state and offsets as one unit; return the offsets written."""
        ...
