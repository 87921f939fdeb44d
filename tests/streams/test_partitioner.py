"""The key -> partition function the rank service and client route with: Kafka's murmur2,
checked against the Java client's published values, kafka-python's partitioner and where the
broker actually put records our producer sent."""

from __future__ import annotations

import random

from kafka import KafkaConsumer, TopicPartition
from kafka.partitioner.default import murmur2 as kafka_python_murmur2

from streams.admin import client_settings
from streams.partitioner import murmur2, partition_for
from streams.producer import EventProducer
from tests.streams.test_consumer import events_for

# org.apache.kafka.common.utils.UtilsTest#testMurmur2
JAVA_CASES = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


def test_murmur2_matches_the_java_client():
    for data, want in JAVA_CASES.items():
        assert murmur2(data) == want, data


def test_partition_for_matches_kafka_python_on_random_keys():
    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(0, 40)
        key = bytes(rng.randrange(256) for _ in range(n))
        for partitions in (1, 6, 7, 64):
            want = (kafka_python_murmur2(key) & 0x7FFFFFFF) % partitions
            assert partition_for(key, partitions) == want
    assert partition_for("user-ü", 6) == partition_for("user-ü".encode(), 6)


def test_records_land_where_partition_for_says(kafka_config):
    cfg = kafka_config(partitions=6)
    events = events_for(n_users=40, per_user=2)
    with EventProducer(cfg) as producer:
        producer.send(events, progress=False)
    consumer = KafkaConsumer(enable_auto_commit=False, **client_settings(cfg))
    try:
        tps = [TopicPartition(cfg.topic, p) for p in range(6)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        seen = 0
        for _ in range(100):
            for tp, records in consumer.poll(timeout_ms=200).items():
                for rec in records:
                    assert tp.partition == partition_for(rec.key, 6)
                    seen += 1
            if seen == len(events):
                break
        assert seen == len(events)
    finally:
        consumer.close()
