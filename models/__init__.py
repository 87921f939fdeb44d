"""Neural modules, memory math and kernels, training over given sequences.

Knows nothing of Kafka, gRPC or files: the bottom layer of recmem.
"""
