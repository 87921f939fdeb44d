"""The archive of a set of users as flat numpy arrays (no pickle, no object arrays), the
form the checkpoint stores per Kafka partition next to the users' memory states and the
consumer offsets. Strings are UTF-8 bytes (uint8) with int64 offsets; per-user and
per-note groups are CSR offsets. Every key starts with ``archive.``.

Layout (U users, N notes, E note events, P buffered events):
  meta [4] (format, key_dim, n_channels, address_dim), coords [d_rho] (P),
  user_id(_offsets), user_n_written [U], user_last_position [U],
  user_note_offsets [U+1], note_serial [N], note_event_offsets [N+1],
  note_addresses [N, C_ch, d_rho], note_items/actions/ts_ms/positions [E],
  note_item_id(_offsets), user_pending_offsets [U+1],
  pending_items/actions/ts_ms/positions [P], pending_item_id(_offsets),
  pending_k [P, C_ch, K], pending_u [P, C_ch, d_rho] (float16, see PENDING_DTYPE).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from recmem.archive.store import PENDING_DTYPE, Note, PendingEvents, UserArchive

FORMAT_VERSION = 1
PREFIX = "archive."
_EVENT_FIELDS = ("items", "actions", "ts_ms", "positions")


def pack_strings(strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Strings -> (UTF-8 bytes uint8, offsets int64 [n+1])."""
    encoded = [s.encode("utf-8") for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(b) for b in encoded], dtype=np.int64)
    return np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(), offsets


def unpack_strings(data: np.ndarray, offsets: np.ndarray, what: str) -> list[str]:
    _check_offsets(offsets, len(data), what)
    raw = data.astype(np.uint8, copy=False).tobytes()
    try:
        return [raw[a:b].decode("utf-8") for a, b in zip(offsets[:-1], offsets[1:])]
    except UnicodeDecodeError as e:
        raise ValueError(f"archive state: {what} is not valid UTF-8 ({e})") from None


def _check_offsets(offsets: np.ndarray, total: int, what: str) -> None:
    if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(f"archive state: {what} offsets do not span 0..{total}")
    if np.any(np.diff(offsets) < 0):
        raise ValueError(f"archive state: {what} offsets decrease")


def pack_users(
    users: Sequence[tuple[str, UserArchive]], coords: np.ndarray, key_dim: int, n_channels: int
) -> dict[str, np.ndarray]:
    """The archive state of ``users`` as a dict of flat arrays (see the module docstring)."""
    d_rho = len(coords)
    notes = [n for _, ua in users for n in ua.notes]
    pend = [ua.pending for _, ua in users]
    out: dict[str, np.ndarray] = {
        "meta": np.array([FORMAT_VERSION, key_dim, n_channels, d_rho], dtype=np.int64),
        "coords": coords.astype(np.int64),
        "user_n_written": np.array([ua.n_written for _, ua in users], dtype=np.int64),
        "user_last_position": np.array([ua.last_position for _, ua in users], dtype=np.int64),
        "user_note_offsets": _offsets([len(ua.notes) for _, ua in users]),
        "note_serial": np.array([n.serial for n in notes], dtype=np.int64),
        "note_event_offsets": _offsets([len(n) for n in notes]),
        "note_addresses": (
            np.stack([n.addresses for n in notes]).astype(np.float32)
            if notes
            else np.zeros((0, n_channels, d_rho), np.float32)
        ),
        "user_pending_offsets": _offsets([len(p) for p in pend]),
        "pending_k": np.concatenate([p.k for p in pend]).astype(PENDING_DTYPE)
        if pend
        else np.zeros((0, n_channels, key_dim), PENDING_DTYPE),
        "pending_u": np.concatenate([p.u for p in pend]).astype(PENDING_DTYPE)
        if pend
        else np.zeros((0, n_channels, d_rho), PENDING_DTYPE),
    }
    out["user_id"], out["user_id_offsets"] = pack_strings([u for u, _ in users])
    for f in _EVENT_FIELDS:
        out[f"note_{f}"] = _cat_int([getattr(n, f) for n in notes])
        out[f"pending_{f}"] = _cat_int([getattr(p, f) for p in pend])
    out["note_item_id"], out["note_item_id_offsets"] = pack_strings(
        [i for n in notes for i in n.item_ids]
    )
    out["pending_item_id"], out["pending_item_id_offsets"] = pack_strings(
        [i for p in pend for i in p.item_ids]
    )
    return {PREFIX + k: v for k, v in out.items()}


def unpack_users(
    state: Mapping[str, np.ndarray], coords: np.ndarray, key_dim: int, n_channels: int
) -> list[tuple[str, UserArchive]]:
    """Inverse of ``pack_users``; validates everything (ValueError naming the problem)
    before returning, so a bad dict changes nothing."""
    a = _Reader(state)
    meta = a.ints("meta")
    d_rho = len(coords)
    if len(meta) != 4 or int(meta[0]) != FORMAT_VERSION:
        raise ValueError(f"archive state: unsupported format {meta.tolist()}")
    if (int(meta[1]), int(meta[2]), int(meta[3])) != (key_dim, n_channels, d_rho):
        raise ValueError(
            "archive state: written for key_dim, channels, address_dim = "
            f"{meta[1:].tolist()}, this archive has {[key_dim, n_channels, d_rho]}"
        )
    if not np.array_equal(a.ints("coords"), coords):
        raise ValueError("archive state: address coordinates P differ from this archive's")
    user_ids = unpack_strings(a.ints("user_id", np.uint8), a.ints("user_id_offsets"), "user_id")
    n_users = len(user_ids)
    if len(set(user_ids)) != n_users:
        raise ValueError("archive state: a user id appears twice")
    n_written = a.ints("user_n_written", length=n_users)
    last_pos = a.ints("user_last_position", length=n_users)
    note_off = a.ints("user_note_offsets", length=n_users + 1)
    serial = a.ints("note_serial")
    _check_offsets(note_off, len(serial), "user_note_offsets")
    ev_off = a.ints("note_event_offsets", length=len(serial) + 1)
    addr = a.floats("note_addresses", (len(serial), n_channels, d_rho))
    note_ev = {f: a.ints(f"note_{f}") for f in _EVENT_FIELDS}
    n_ev = len(note_ev["items"])
    _check_offsets(ev_off, n_ev, "note_event_offsets")
    note_ids = unpack_strings(
        a.ints("note_item_id", np.uint8), a.ints("note_item_id_offsets"), "note_item_id"
    )
    pend_off = a.ints("user_pending_offsets", length=n_users + 1)
    pend_ev = {f: a.ints(f"pending_{f}") for f in _EVENT_FIELDS}
    n_pend = len(pend_ev["items"])
    _check_offsets(pend_off, n_pend, "user_pending_offsets")
    pend_k = a.floats("pending_k", (n_pend, n_channels, key_dim), PENDING_DTYPE)
    pend_u = a.floats("pending_u", (n_pend, n_channels, d_rho), PENDING_DTYPE)
    pend_ids = unpack_strings(
        a.ints("pending_item_id", np.uint8), a.ints("pending_item_id_offsets"), "pending_item_id"
    )
    for what, arrays, ids, n in (
        ("note", note_ev, note_ids, n_ev),
        ("pending", pend_ev, pend_ids, n_pend),
    ):
        if any(len(v) != n for v in arrays.values()) or len(ids) != n:
            raise ValueError(f"archive state: {what} event arrays differ in length")
    if n_ev and np.any(np.diff(ev_off) < 1):
        raise ValueError("archive state: a note has no events")

    users: list[tuple[str, UserArchive]] = []
    for u, uid in enumerate(user_ids):
        notes = [
            Note(
                serial=int(serial[i]),
                items=note_ev["items"][ev_off[i] : ev_off[i + 1]].copy(),
                item_ids=tuple(note_ids[ev_off[i] : ev_off[i + 1]]),
                actions=note_ev["actions"][ev_off[i] : ev_off[i + 1]].copy(),
                ts_ms=note_ev["ts_ms"][ev_off[i] : ev_off[i + 1]].copy(),
                positions=note_ev["positions"][ev_off[i] : ev_off[i + 1]].copy(),
                addresses=addr[i].copy(),
            )
            for i in range(note_off[u], note_off[u + 1])
        ]
        p0, p1 = pend_off[u], pend_off[u + 1]
        pending = PendingEvents(
            items=pend_ev["items"][p0:p1].copy(),
            item_ids=pend_ids[p0:p1],
            actions=pend_ev["actions"][p0:p1].copy(),
            ts_ms=pend_ev["ts_ms"][p0:p1].copy(),
            positions=pend_ev["positions"][p0:p1].copy(),
            k=pend_k[p0:p1].copy(),
            u=pend_u[p0:p1].copy(),
        )
        users.append((uid, UserArchive(pending, notes, int(n_written[u]), int(last_pos[u]))))
    return users


class _Reader:
    """Typed access to the prefixed arrays with clear errors."""

    def __init__(self, state: Mapping[str, np.ndarray]) -> None:
        self.state = state

    def _get(self, key: str) -> np.ndarray:
        if PREFIX + key not in self.state:
            raise ValueError(f"archive state: missing array '{PREFIX + key}'")
        return np.asarray(self.state[PREFIX + key])

    def ints(self, key: str, dtype: type = np.int64, length: int | None = None) -> np.ndarray:
        arr = self._get(key)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"archive state: '{PREFIX + key}' must be a 1-d integer array")
        if length is not None and len(arr) != length:
            raise ValueError(f"archive state: '{PREFIX + key}' has {len(arr)} rows, not {length}")
        return arr.astype(dtype, copy=False)

    def floats(self, key: str, shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
        arr = self._get(key)
        if arr.shape != shape or arr.dtype.kind != "f":
            raise ValueError(
                f"archive state: '{PREFIX + key}' is {arr.dtype}{list(arr.shape)}, "
                f"expected float{list(shape)}"
            )
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"archive state: '{PREFIX + key}' has non-finite values")
        return arr.astype(dtype, copy=False)


def _offsets(lengths: Sequence[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    out[1:] = np.cumsum(lengths, dtype=np.int64)
    return out


def _cat_int(parts: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
