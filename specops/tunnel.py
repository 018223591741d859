"""`inv tunnel`: reach a host's loopback-only vLLM (or TensorBoard) from here, through the SSH connection.

vLLM binds the host's 127.0.0.1 by default, so nothing but SSH can reach it. The tunnel
forwards 127.0.0.1:LOCAL here to 127.0.0.1:PORT there for as long as the task runs
(Ctrl-C closes it) and prints the base URL to give an OpenAI client. ``remote_port`` reaches
another loopback service of the host instead, e.g. a TensorBoard started there on 6006.
"""

from __future__ import annotations

import errno
import socket
import time

from .errors import SpecopsError
from .host import connect


def forward(hosts, *, local_port: int | None = None, remote_port: int | None = None, out=None) -> int:
    if len(hosts) != 1:
        raise SpecopsError(f"inv tunnel takes one host, got {len(hosts)}: pass --on HOST", exit_code=2)
    host = hosts[0]
    for flag, value in (("--local-port", local_port), ("--remote-port", remote_port)):
        if value is not None and not 0 < value < 65536:
            raise SpecopsError(f"{flag} {value} is not a port (1-65535)", exit_code=2)
    there = remote_port or host.port
    path = "/v1" if there == host.port else "/"  # vLLM's OpenAI base URL, or the other service's root
    if host.is_local:
        print(f"{host.name} is this machine: http://127.0.0.1:{there}{path} (no tunnel needed)", file=out, flush=True)
        return 0
    port = local_port or there
    if not _bindable(port):
        raise SpecopsError(f"local port {port} is in use; pick another with --local-port N")
    with connect(host) as session, session.tunnel(port, there):
        print(f"http://127.0.0.1:{port}{path}  ->  {host.name}:127.0.0.1:{there}   (Ctrl-C closes the tunnel)",
              file=out, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


def _bindable(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:port (SO_REUSEADDR, like Fabric's listener, so this
    check can never make Fabric's own bind fail)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise
