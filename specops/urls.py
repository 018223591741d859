"""A server's URL from the address it binds: the one rule, for every client of the host's vLLM.

A bind address is where a server listens, not where a client connects: a wildcard (``0.0.0.0``,
``::``) or ``localhost`` is reached at ``127.0.0.1`` by a client on the same host and at the
host's own address by one elsewhere. An IPv6 literal goes in brackets (``http://[::1]:8000``,
RFC 3986), or the port would read as part of the address.
"""

from __future__ import annotations

WILDCARDS = ("0.0.0.0", "::", "")
LOCAL_NAMES = ("localhost",)


def url(address: str, port: int, path: str = "") -> str:
    """``http://ADDRESS:PORT`` + path, with an IPv6 literal bracketed."""
    shown = f"[{address}]" if ":" in address and not address.startswith("[") else address
    return f"http://{shown}:{int(port)}{path}"


def connect_address(bind: str, host_address: str | None = None) -> str:
    """Where a client reaches a server bound to ``bind``: ``host_address`` is the server host's
    address for a client elsewhere; None for a client on the same host."""
    if bind in WILDCARDS or bind in LOCAL_NAMES:
        return host_address if host_address and bind in WILDCARDS else "127.0.0.1"
    return bind


def server_url(bind: str, port: int, *, host_address: str | None = None, path: str = "") -> str:
    """The URL a client uses for a server bound to ``bind``:``port`` (see :func:`connect_address`)."""
    return url(connect_address(bind, host_address), port, path)
