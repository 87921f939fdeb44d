"""recmem core: configuration, dataset access, engine, state store, archive, scoring, gRPC."""

__version__ = "0.1.0"
