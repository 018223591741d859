#!/usr/bin/env python3
"""Start this host's node of a multi-node torchrun job, after checking it can reach the master.

    python remote/torchrun_node.py --master-addr A --master-port P --node-rank R [--timeout 60] -- CMD...

Why: a node that cannot reach the master's address otherwise sits in torchrun's store connect
for its whole rendezvous timeout and ends in a page of traceback. Here a node other than rank 0
first opens a TCP connection to the master: a refusal means the master's host answered before
its torchrun listens, which is fine (torchrun retries); a timeout or an unreachable network is
retried until --timeout, then it fails with one line naming the address (exit 2).

It also sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (each unless set) to the interface that routes to
the master, so gloo's and NCCL's peers advertise an address the other nodes can reach, not the 127.0.1.1 that a host's
own name often resolves to. Then it replaces itself with CMD (torchrun).
"""
import argparse
import fcntl
import os
import socket
import struct
import sys
import time

ATTEMPT_S = 3.0


def reach(address: str, port: int, timeout: float) -> str | None:
    """None once the master's host answers on address:port (a refusal counts), else why not at the deadline."""
    deadline = time.monotonic() + timeout
    why = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return why
        try:
            with socket.create_connection((address, port), timeout=min(ATTEMPT_S, left)):
                return None
        except ConnectionRefusedError:
            return None  # the host is there; its torchrun is not listening yet
        except socket.timeout:
            why = "connection timed out"
        except socket.gaierror as e:
            why = f"cannot resolve it ({e.strerror})"
        except OSError as e:  # unreachable network or host, reset: the link may come up, so retry
            why = os.strerror(e.errno) if e.errno else str(e)
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def interface_for(address: str) -> str | None:
    """The name of the local interface whose IPv4 address routes to `address` (None if unknown)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # UDP: no packet is sent, the kernel only picks the route
            local = s.getsockname()[0]
        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                except OSError:
                    continue
            if socket.inet_ntoa(packed[20:24]) == local:
                return name
    except OSError:
        return None
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--master-addr", required=True)
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--node-rank", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to reach the master before failing")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the torchrun command")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command after --")
    where = f"{args.master_addr}:{args.master_port}"
    if args.node_rank != 0:
        why = reach(args.master_addr, args.master_port, args.timeout)
        if why:
            print(f"torchrun_node.py: node {args.node_rank} cannot reach the master at {where} within "
                  f"{args.timeout:g}s ({why}); set the master's private_address in the inventory to an "
                  f"address this host can reach", file=sys.stderr, flush=True)
            return 2
    name = None  # NCCL's bootstrap picks an interface as gloo does, and can pick one other nodes cannot reach
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if variable not in os.environ:
            name = name or interface_for(args.master_addr)
            if name:
                os.environ[variable] = name
    sys.stdout.flush()
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main())
