"""`inv tunnel`: reach a host's loopback-only vLLM from here, through the SSH connection.

vLLM binds the host's 127.0.0.1 by default, so nothing but SSH can reach it. The tunnel
forwards 127.0.0.1:LOCAL here to 127.0.0.1:PORT there for as long as the task runs
(Ctrl-C closes it) and prints the base URL to give an OpenAI client.
"""

from __future__ import annotations

import errno
import socket
import time

from .errors import SpecopsError
from .host import connect


def forward(hosts, *, local_port: int | None = None, out=None) -> int:
    if len(hosts) != 1:
        raise SpecopsError(f"inv tunnel takes one host, got {len(hosts)}: pass --on HOST", exit_code=2)
    host = hosts[0]
    if host.is_local:
        print(f"{host.name} is this machine: http://127.0.0.1:{host.port}/v1 (no tunnel needed)", file=out, flush=True)
        return 0
    port = local_port or host.port
    if not _bindable(port):
        raise SpecopsError(f"local port {port} is in use; pick another with --local-port N")
    with connect(host) as session, session.tunnel(port, host.port):
        _wait_listening(port)
        print(f"http://127.0.0.1:{port}/v1  ->  {host.name}:127.0.0.1:{host.port}   (Ctrl-C closes the tunnel)",
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


def _wait_listening(port: int, timeout: float = 5) -> None:
    """Fabric's forward_local returns before its listener is bound; a port we can no longer bind is bound."""
    deadline = time.monotonic() + timeout
    while _bindable(port):
        if time.monotonic() > deadline:
            raise SpecopsError(f"the tunnel's listener on 127.0.0.1:{port} did not come up")
        time.sleep(0.02)
