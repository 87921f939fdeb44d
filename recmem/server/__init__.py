"""The gRPC rank service (SPEC section 6): validation, micro-batching, auth/TLS, the
servicer and the server around them. ``recmem serve`` builds one in recmem/server/serve.py."""

from recmem.server.app import RankServer, limits_from_config
from recmem.server.servicer import UserInfo

__all__ = ["RankServer", "UserInfo", "limits_from_config"]
