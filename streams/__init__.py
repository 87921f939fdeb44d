"""Kafka I/O: decode, validate, batch, offsets, dead letters, and an event producer.

Knows nothing of memories or datasets: it hands validated batches to a sink.
"""
