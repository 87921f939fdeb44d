"""Prometheus metrics of the rank service. ``recmem serve`` puts them on the same registry
as the ingest metrics and serves both on ``server.metrics_port``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class RankMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, prefix: str = "recmem_rank"):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{prefix}_requests", "Rank calls by gRPC status code", ["code"], registry=r
        )
        self.latency = Histogram(
            f"{prefix}_latency_seconds",
            "Rank call time in the servicer (validation, batching wait, engine step)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            f"{prefix}_batch_size", "Requests per micro-batch", buckets=BATCH_BUCKETS, registry=r
        )
        self.notes_replayed = Counter(
            f"{prefix}_notes_replayed", "NoteBank notes replayed by rank calls", registry=r
        )
        self.cold_starts = Counter(
            f"{prefix}_cold_starts", "Rank calls answered from popularity", registry=r
        )
        self.undecodable = Counter(
            f"{prefix}_undecodable_requests",
            "Calls whose payload did not parse (answered INVALID_ARGUMENT), by method",
            ["method"],
            registry=r,
        )
        self.routes = Counter(
            f"{prefix}_routes",
            "Rank and InspectUser calls by where they went: local (owned here), forwarded "
            "(to the owner), redirected (FAILED_PRECONDITION naming the owner), unavailable "
            "(no owner now, or no assignment yet)",
            ["route"],
            registry=r,
        )
        self.packed_requests = Counter(
            f"{prefix}_packed_requests",
            "Rank calls a front end sent packed (server.frontend_packed), also counted in "
            f"{prefix}_requests_total",
            registry=r,
        )
        self.replay_cache_hits = Counter(
            f"{prefix}_replay_cache_hits",
            "Replay rank calls answered from the replay cache (server.replay_cache_users)",
            registry=r,
        )
