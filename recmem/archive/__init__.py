"""NoteBank archive (SPEC section 5): salient spans of each user's events, written at
ingest, addressed with the model's own query features, routed at rank time for replay.

``bank`` (NoteBank: write path, route, persistence), ``selection`` (span scoring, pure),
``index`` (per-user FAISS address index), ``store`` (notes, one user's open chunk),
``open_chunks`` (the open chunks of all users in one arena), ``persist``
(flat-array checkpoint form), ``tuning`` (evidence recall for choosing the defaults).
Design notes and measurements: docs/archive.md.
"""

from recmem.archive.bank import NoteBank, PlainNoteBank, check_archive_config
from recmem.archive.store import ItemIdRows, Note, ReplayEvents, replay_events

__all__ = [
    "ItemIdRows",
    "Note",
    "NoteBank",
    "PlainNoteBank",
    "ReplayEvents",
    "check_archive_config",
    "replay_events",
]
