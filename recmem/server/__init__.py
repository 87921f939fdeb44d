"""The gRPC rank service (SPEC section 6): validation, auth/TLS, metrics, the servicer and
the server around them, in front of the engine loop (recmem/engine). ``recmem serve`` puts
one together in recmem/server/serve.py."""

from recmem.server.app import RankServer, limits_from_config

__all__ = ["RankServer", "limits_from_config"]
