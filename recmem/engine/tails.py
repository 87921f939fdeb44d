"""Each user's latest applied events and the masked queries q~ the engine computed for them.

They are a replay request's routing query and the "question" re-read after the notes when
the request carries no context (recmem/ranking.py). They travel in the partition checkpoint
next to the notes (arrays ``recent.*``), so a restarted service routes exactly as before.
Owned by the engine (one thread): no lock.
"""

from __future__ import annotations

import numpy as np
import torch

from recmem.ranking import UserEvents

PREFIX = "recent."


class RecentEvents:
    """The last ``keep`` events of every user with their q~ [n, L, H, K] (float32, host)."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError("RecentEvents keeps at least one event")
        self.keep = keep
        self._tails: dict[str, UserEvents] = {}
        self._queries: dict[str, np.ndarray] = {}

    def observe(
        self,
        user_ids: list[str],
        items: np.ndarray,
        actions: np.ndarray,
        ts_ms: np.ndarray,
        lengths: np.ndarray,
        q_tilde: torch.Tensor,
        packed: bool = False,
    ) -> None:
        """New events of a step: [B, T] host arrays, ``lengths`` [B], q~ [B, T, L, H, K]
        (``packed``: [N, L, H, K], one row per event, user by user)."""
        k = self.keep
        rows = [b for b in range(len(user_ids)) if lengths[b] > 0]
        if not rows:
            return
        # the q~ of each user's last <= keep new events, moved to the host in one copy
        T = items.shape[1]
        cols = np.arange(T - k, T)[None, :] + (lengths[rows][:, None] - T)
        cols = np.clip(cols, 0, None)
        if packed:
            starts = np.cumsum(lengths) - lengths
            flat = torch.as_tensor(starts[rows][:, None] + cols, device=q_tilde.device)
            picked = q_tilde[flat]
        else:
            take = torch.as_tensor(cols, device=q_tilde.device)
            b_idx = torch.as_tensor(rows, device=q_tilde.device)[:, None]
            picked = q_tilde[b_idx, take]
        tail_q = picked.detach().to("cpu", torch.float32).numpy()
        tails, queries = self._tails, self._queries
        for j, b in enumerate(rows):
            user, n = user_ids[b], int(lengths[b])
            lo = max(0, n - k)  # only the last k new events can stay
            it, ac, ts = items[b, lo:n], actions[b, lo:n], ts_ms[b, lo:n]
            q = tail_q[j, max(0, k - n) :]
            if n < k:  # older events fill the rest (most users: one or two new events)
                old, old_q = tails.get(user), queries.get(user)
                if old is not None:
                    it = np.concatenate([old.items, it])[-k:]
                    ac = np.concatenate([old.actions, ac])[-k:]
                    ts = np.concatenate([old.ts_ms, ts])[-k:]
                if old_q is not None:
                    q = np.concatenate([old_q, q])[-k:]
            tails[user] = UserEvents(
                it.astype(np.int64), ac.astype(np.int64), ts.astype(np.int64)
            )  # copies: nothing keeps the batch's arrays alive
            queries[user] = q.copy()

    def recent(self, user_id: str, n: int) -> UserEvents:
        tail = self._tails.get(user_id)
        if tail is None:
            return UserEvents.empty()
        return UserEvents(tail.items[-n:], tail.actions[-n:], tail.ts_ms[-n:])

    def recent_queries(self, user_id: str, n: int) -> np.ndarray | None:
        """q~ [n', L, H, K] of the events ``recent(user_id, n)`` returns (None if unknown)."""
        q = self._queries.get(user_id)
        return None if q is None else q[-n:]

    def export(self, user_ids: list[str]) -> dict[str, np.ndarray]:
        """The tails of ``user_ids`` as flat arrays (keys ``recent.*``) for a checkpoint."""
        tails = [self._tails.get(u, UserEvents.empty()) for u in user_ids]
        queries = [self._queries.get(u) for u, t in zip(user_ids, tails) if len(t)]
        out = {PREFIX + "lengths": np.array([len(t) for t in tails], dtype=np.int64)}
        joined = UserEvents.concat(tails)
        out[PREFIX + "items"] = joined.items
        out[PREFIX + "actions"] = joined.actions
        out[PREFIX + "ts_ms"] = joined.ts_ms
        if queries and all(q is not None for q in queries):
            out[PREFIX + "queries"] = np.concatenate(queries).astype(np.float32)  # type: ignore[arg-type]
        return out

    def load(self, user_ids: list[str], arrays: dict[str, np.ndarray]) -> None:
        """Install the tails ``export`` wrote for ``user_ids`` (arrays without ``recent.*``
        keys: the users have no tails)."""
        lengths = arrays.get(PREFIX + "lengths")
        self.drop(user_ids)
        if lengths is None:
            return
        if len(lengths) != len(user_ids):
            raise ValueError(
                f"checkpoint has recent events of {len(lengths)} users, "
                f"{len(user_ids)} users restored"
            )
        ends = np.cumsum(lengths)
        starts = ends - lengths
        queries = arrays.get(PREFIX + "queries")
        if queries is not None and len(queries) != int(ends[-1] if len(ends) else 0):
            raise ValueError("checkpoint recent.queries do not match recent.lengths")
        for user, s, e in zip(user_ids, starts, ends):
            if e > s:
                self._tails[user] = UserEvents(
                    arrays[PREFIX + "items"][s:e].astype(np.int64),
                    arrays[PREFIX + "actions"][s:e].astype(np.int64),
                    arrays[PREFIX + "ts_ms"][s:e].astype(np.int64),
                )
                if queries is not None:
                    self._queries[user] = queries[s:e].astype(np.float32)

    def drop(self, user_ids: list[str]) -> None:
        for user in user_ids:
            self._tails.pop(user, None)
            self._queries.pop(user, None)
