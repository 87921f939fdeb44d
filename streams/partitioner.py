"""The partition of a record key, as Kafka's default partitioner picks it for a keyed record:
``murmur2(key) & 0x7fffffff`` modulo the number of partitions (the Java client's
``Utils.murmur2`` / ``toPositive``; kafka-python's and librdkafka's ``murmur2_random``
partitioners agree). The producer sends every event keyed by its user id, so this is the
partition, and therefore the consumer-group member, that owns a user's state; the rank
service and ``recmem.client.RankClient`` route with it.

Pure Python and free of any Kafka import, so that a rank client can use it alone.
"""

from __future__ import annotations

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's 32-bit murmur2 of ``data`` as a signed int (what the Java client returns)."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    end = length - length % 4
    for i in range(0, end, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = length % 4
    if tail == 3:
        h ^= data[end + 2] << 16
    if tail >= 2:
        h ^= data[end + 1] << 8
    if tail >= 1:
        h ^= data[end]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for(key: str | bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives a record keyed ``key`` (a str is
    encoded as UTF-8, as the producer sends user ids)."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    raw = key.encode("utf-8") if isinstance(key, str) else key
    return (murmur2(raw) & 0x7FFFFFFF) % partitions
