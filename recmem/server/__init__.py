"""The gRPC rank service (SPEC section 6): validation, auth/TLS, metrics, the servicer and
the server around them, in front of the engine loop (recmem/engine). ``recmem serve`` puts
one together in recmem/server/serve.py; with ``server.frontends`` the public port is served
by front-end processes (recmem/server/frontend.py, supervised by
recmem/server/frontends.py).

The names below load on first use, so that a front-end process importing a module of this
package does not load the engine (and torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recmem.server.app import RankServer, limits_from_config

__all__ = ["RankServer", "limits_from_config"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from recmem.server import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
