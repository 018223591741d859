"""The one module that talks to hosts.

Everything else in specops asks a :class:`Session` to run a command, move a file or
build an rsync/ssh command line; nothing else knows SSH options. A Session hides
whether the host is remote (Fabric/paramiko over SSH) or the machine we are on
(``ansible_connection: local``, Invoke's local runner) behind one interface.

Safety rules enforced here, so callers cannot forget them:

* host keys are verified against known_hosts (system files + the inventory's
  ``known_hosts``) with paramiko's RejectPolicy: an unknown or changed key is refused
  with a message that says how to add it;
* every command has a timeout and the connection a connect timeout and keepalive, so a
  host whose link is cut fails within bounded time instead of hanging;
* :meth:`Session.run` takes an argv and quotes every argument; shell snippets go
  through :meth:`Session.sh` and must be built with :func:`quote`;
* nothing is ever passed through Fabric's ``env=`` (it inlines values on the command
  line); secrets travel only as files written with :meth:`Session.write_file`, which
  creates a private file (mode 0600) with that mode in the create request itself, inside
  a directory it makes 0700: no other user on the host can open it at any moment;
* rsync gets ``-s`` (``--protect-args``, ``--secluded-args`` since 3.4): remote paths go
  to the remote rsync over its protocol, never through the remote shell. An rsync here
  that cannot do that (older than 3.0, e.g. macOS's 2.6.9) is not used: SFTP instead.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import os
import select
import shlex
import shutil
import socket
import subprocess
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import fabric
import invoke
import paramiko

from .errors import HostError
from .inventory import Host
from .shared import layout

CONNECT_TIMEOUT = float(os.environ.get("SPECOPS_CONNECT_TIMEOUT", 10))
KEEPALIVE_S = 5
COMMAND_TIMEOUT = 120
WATCHDOG_GRACE_S = 2
SFTP_TIMEOUT = 60
SYSTEM_KNOWN_HOSTS = ("/etc/ssh/ssh_known_hosts", "~/.ssh/known_hosts")


def quote(value) -> str:
    """Quote one shell word: a path with spaces or ``$(...)`` stays data, never code."""
    return shlex.quote(str(value))


def ssh_config_path() -> str | None:
    """The ssh_config to honour (ProxyJump, IdentityFile...); SPECOPS_SSH_CONFIG=none disables it."""
    configured = os.environ.get("SPECOPS_SSH_CONFIG", "~/.ssh/config")
    if configured == "none":
        return None
    path = os.path.expanduser(configured)
    return path if os.path.exists(path) else None


@dataclass
class Result:
    stdout: str
    stderr: str
    exit_code: int

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class Session:
    """An open line to one host. Use :func:`connect`."""

    def __init__(self, host: Host):
        self.host = host
        self._home: str | None = None
        self._conn: fabric.Connection | None = None
        self._local: invoke.Context | None = None
        self._timed_out = False

    # -- opening ---------------------------------------------------------------------
    def open(self) -> "Session":
        if self.host.is_local:
            self._local = invoke.Context(invoke.Config(overrides={"run": {"in_stream": False}}))
            return self
        self._host_key_policy = _RejectUnknownKey()
        self._conn = _fabric_connection(self.host, self._host_key_policy)
        try:
            self._conn.open()
        except Exception as e:  # paramiko raises many types; each maps to one clear line
            raise HostError(self._explain_connect_error(e)) from None
        self._conn.transport.set_keepalive(KEEPALIVE_S)
        with _OPEN_LOCK:
            _OPEN.add(self)
        return self

    def close(self) -> None:
        with _OPEN_LOCK:
            _OPEN.discard(self)
        if self._conn is not None:
            self._conn.close()

    def hang_up(self) -> None:
        """Drop the connection now, from any thread: a command blocked on it fails at once, and one
        run with ``pty=True`` gets SIGHUP on the host (its terminal is gone), so nothing is left behind."""
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()

    def _explain_connect_error(self, e: Exception) -> str:
        h = self.host
        where = h.address if h.ansible_port == 22 else f"[{h.address}]:{h.ansible_port}"
        files = " ".join(known_hosts_files(h))
        add_to = h.known_hosts or "~/.ssh/known_hosts"
        if isinstance(e, paramiko.BadHostKeyException):
            return (
                f"{h.name}: host key for {where} has CHANGED (man-in-the-middle, or the host was reinstalled); "
                f"refusing to connect. If the change is expected: ssh-keygen -R '{where}' -f {add_to}, "
                f"then add the new key after checking its fingerprint"
            )
        if isinstance(e, paramiko.SSHException) and "not found in known_hosts" in str(e):
            offered = self._host_key_policy.offered
            seen = f" It offered {offered}." if offered else ""
            folder = os.path.dirname(add_to) or "."
            return (
                f"{h.name}: host key for {where} is unknown (not in {files}); refusing to connect.{seen} "
                f"Check that fingerprint out of band (on the host: ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub), "
                f"then: mkdir -p -m 700 {folder} && ssh-keyscan -p {h.ansible_port} {h.address} >> {add_to}"
            )
        if isinstance(e, paramiko.AuthenticationException):
            key = h.ansible_ssh_private_key_file or "your ssh keys/agent"
            return f"{h.name}: authentication failed for user {self._conn.user!r} at {where} (key: {key})"
        if isinstance(e, (socket.timeout, TimeoutError)):
            return f"{h.name}: unreachable: connecting to {where} timed out after {CONNECT_TIMEOUT:g}s"
        if isinstance(e, (paramiko.ssh_exception.NoValidConnectionsError, OSError)):
            reason = getattr(e, "strerror", None) or str(e)
            return f"{h.name}: unreachable: cannot connect to {where}: {reason}"
        return f"{h.name}: SSH to {where} failed: {e}"

    # -- running commands ------------------------------------------------------------
    def run(self, argv, **kwargs) -> Result:
        """Run an argv on the host; every argument is quoted."""
        return self.sh(shlex.join(str(a) for a in argv), **kwargs)

    def sh(self, script: str, *, timeout: float | None = COMMAND_TIMEOUT, check: bool = True,
           hide: bool = True, pty: bool = False, out_stream=None) -> Result:
        """Run a bash snippet built with :func:`quote`. ``timeout=None`` only for streams the
        user ends (``--follow``); everything else is bounded."""
        opts = dict(warn=True, hide=hide, pty=pty, timeout=timeout, in_stream=False)
        if out_stream is not None:
            opts["out_stream"] = out_stream
        try:
            if self._local is not None:
                r = self._local.run(script, **opts)
            else:
                with self._watchdog(timeout):
                    r = self._conn.run("bash -c " + quote(script), **opts)
        except invoke.exceptions.CommandTimedOut:
            raise HostError(f"{self.host.name}: command timed out after {timeout:g}s: {_short(script)}") from None
        except (paramiko.SSHException, EOFError, OSError) as e:
            if self._timed_out:
                raise HostError(f"{self.host.name}: no answer within {timeout:g}s (link down?) while running "
                                f"{_short(script)}") from None
            raise HostError(f"{self.host.name}: connection lost while running {_short(script)}: {e}") from None
        result = Result(r.stdout, r.stderr, r.exited)
        if check and not result.ok:
            detail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or ["no output"]
            raise HostError(f"{self.host.name}: {_short(script)} failed (exit {result.exit_code}): {detail[0]}")
        return result

    @contextmanager
    def _watchdog(self, timeout: float | None):
        """Close the transport if a call outlives its timeout: on a cut link paramiko waits forever
        (opening a channel, reading a reply) and Invoke's own timer cannot interrupt that."""
        if timeout is None:
            yield
            return
        timer = threading.Timer(timeout + WATCHDOG_GRACE_S, self._expire)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def _expire(self) -> None:
        self._timed_out = True
        self._conn.transport.close()

    # -- paths -----------------------------------------------------------------------
    @property
    def home(self) -> str:
        if self._home is None:
            self._home = self.sh('printf %s "$HOME"', timeout=30).stdout.strip()
        return self._home

    def path(self, value: str) -> str:
        """An absolute host path: ``~`` is the login user's home, relative means under workdir."""
        if value == "~" or value.startswith("~/"):
            return self.home + value[1:]
        if value.startswith("/"):
            return value
        return f"{self.workdir}/{value}"

    @property
    def workdir(self) -> str:
        value = self.host.workdir
        return self.home + value[1:] if value == "~" or value.startswith("~/") else value

    @property
    def venv_python(self) -> str:
        return layout.venv_python(self.workdir)

    # -- files -----------------------------------------------------------------------
    def write_file(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        """Write a whole file atomically; it has ``mode`` from birth (secrets are never readable).

        A private ``mode`` (no group or other bits: a file holding secrets) also makes its
        directory private first (:meth:`private_dir`), so neither the file nor its temporary
        is ever reachable by another user, however briefly."""
        data = data.encode() if isinstance(data, str) else data
        parent = os.path.dirname(path)
        private = not mode & 0o077
        tmp = f"{parent}/.{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp"
        if self._local is not None:
            os.makedirs(parent, exist_ok=True)
            if private:
                os.chmod(parent, 0o700)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, mode)
            os.replace(tmp, path)
            return
        sftp = self.sftp()
        try:
            with self._watchdog(SFTP_TIMEOUT):
                if private:
                    self.private_dir(parent)
                try:
                    f = _sftp_create(sftp, tmp, mode)
                except FileNotFoundError:  # first write into a new directory: one extra round trip
                    self.run(["mkdir", "-p", parent], timeout=30)
                    f = _sftp_create(sftp, tmp, mode)
                with f:
                    f.chmod(mode)  # exactly `mode`, whatever the server's umask took from it at birth
                    f.write(data)
                sftp.posix_rename(tmp, path)
        except (OSError, paramiko.SSHException) as e:
            self.run(["rm", "-f", tmp], timeout=30, check=False)
            raise HostError(f"{self.host.name}: cannot write {path}: {e}") from None

    def private_dir(self, path: str) -> None:
        """Make ``path`` a directory only the login user can enter (0700), creating it if needed;
        HostError if it cannot be (another user's directory)."""
        if self._local is not None:
            os.makedirs(path, exist_ok=True)
            os.chmod(path, 0o700)
            return
        sftp = self.sftp()
        try:
            with self._watchdog(SFTP_TIMEOUT):
                try:
                    sftp.chmod(path, 0o700)
                except FileNotFoundError:
                    self.run(["mkdir", "-p", "-m", "700", path], timeout=30)
                    sftp.chmod(path, 0o700)
        except (OSError, paramiko.SSHException) as e:
            raise HostError(f"{self.host.name}: cannot make {path} private (mode 0700): {e}") from None

    def read_file(self, path: str) -> bytes | None:
        """A file's bytes, or None if it does not exist."""
        if self._local is not None:
            try:
                return Path(path).read_bytes()
            except FileNotFoundError:
                return None
        buf = io.BytesIO()
        try:
            with self._watchdog(SFTP_TIMEOUT):
                self._conn.sftp().getfo(path, buf)
        except FileNotFoundError:
            return None
        except (OSError, paramiko.SSHException) as e:
            raise HostError(f"{self.host.name}: cannot read {path}: {e}") from None
        return buf.getvalue()

    def sftp(self) -> paramiko.SFTPClient:
        """The SFTP channel, for the transfer fallback when rsync is missing."""
        if self._conn is None:
            raise HostError(f"{self.host.name}: SFTP is for remote hosts; local hosts use plain files")
        sftp = self._conn.sftp()
        sftp.get_channel().settimeout(SFTP_TIMEOUT)  # a cut link fails the next call instead of hanging
        return sftp

    # -- rsync / ssh -----------------------------------------------------------------
    def ssh_argv(self) -> list[str]:
        """An OpenSSH command line with exactly this session's settings (for rsync -e, tails)."""
        h = self.host
        argv = ["ssh", "-F", ssh_config_path() or "/dev/null", "-p", str(h.ansible_port),
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
                "-o", "UserKnownHostsFile=" + " ".join(f'"{p}"' for p in known_hosts_files(h)),
                "-o", f"ConnectTimeout={int(CONNECT_TIMEOUT)}",
                "-o", f"ServerAliveInterval={KEEPALIVE_S}", "-o", "ServerAliveCountMax=3"]
        if h.ansible_ssh_private_key_file:
            argv += ["-i", h.ansible_ssh_private_key_file, "-o", "IdentitiesOnly=yes"]
        if h.ansible_user:
            argv += ["-l", h.ansible_user]
        return argv

    def rsync_location(self, path: str) -> tuple[list[str], str]:
        """(extra rsync args, destination spec) for a path on this host.

        ``-s``: an rsync before 3.2.4 (macOS's, older distributions) otherwise hands the remote
        path to the remote shell, which splits it at spaces and runs any ``$(...)`` in it. An IPv6
        address is bracketed: bare, rsync reads its ``::`` as the daemon's module separator."""
        if self._local is not None:
            return [], path
        user, address = self._conn.user, self.host.address
        host = f"[{address}]" if ":" in address else address
        return ["-s", "-e", shlex.join(self.ssh_argv())], f"{user}@{host}:{path}"

    @contextmanager
    def tunnel(self, local_port: int, remote_port: int):
        """Forward 127.0.0.1:local_port here to 127.0.0.1:remote_port on the host, one SSH channel a connection.

        Not Fabric's forward_local: its listener thread dies on the first connection the host refuses
        (nothing listening there yet, say a vLLM still loading) and leaves the port bound, so every
        later connection hangs. Here a refused connection is closed and the tunnel keeps listening.
        """
        if self._local is not None:
            raise HostError(f"{self.host.name}: is this machine; no tunnel needed (port {remote_port})")
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", local_port))
        listener.listen(16)
        listener.settimeout(0.2)
        transport, stop = self._conn.transport, threading.Event()

        def accept() -> None:
            while not stop.is_set():
                try:
                    client, peer = listener.accept()
                except socket.timeout:
                    continue
                except OSError:
                    return
                try:
                    channel = transport.open_channel("direct-tcpip", ("127.0.0.1", remote_port), peer, timeout=30)
                except (paramiko.SSHException, OSError):  # nothing listens there (yet): this connection only
                    client.close()
                    continue
                threading.Thread(target=_pump, args=(client, channel, stop), daemon=True).start()

        thread = threading.Thread(target=accept, name=f"tunnel-{local_port}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            listener.close()


def _pump(client: socket.socket, channel: paramiko.Channel, stop: threading.Event) -> None:
    """Copy bytes both ways between a local connection and its SSH channel; an end-of-file on one
    side is passed on as a half-close, and the pair is closed when both sides have ended."""
    sinks = {client: channel, channel: client}
    try:
        while sinks and not stop.is_set():
            ready, _, _ = select.select(list(sinks), [], [], 0.5)
            for source in ready:
                sink, data = sinks[source], source.recv(65536)
                if data:
                    sink.sendall(data)
                    continue
                del sinks[source]
                sink.shutdown_write() if sink is channel else sink.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        channel.close()
        client.close()


_OPEN: set[Session] = set()  # remote sessions open now, for hang_up_all
_OPEN_LOCK = threading.Lock()


def hang_up_all() -> None:
    """Hang up every open remote session (Ctrl-C: the steps running in other threads stop with it)."""
    with _OPEN_LOCK:
        sessions = list(_OPEN)
    for session in sessions:
        session.hang_up()


def known_hosts_files(host: Host) -> list[str]:
    files = [os.path.expanduser(p) for p in SYSTEM_KNOWN_HOSTS if os.path.exists(os.path.expanduser(p))]
    if host.known_hosts:
        files.append(host.known_hosts)
    return files or ["~/.ssh/known_hosts"]


def _fabric_connection(host: Host, host_key_policy: paramiko.MissingHostKeyPolicy) -> fabric.Connection:
    overrides = {"run": {"in_stream": False}}
    path = ssh_config_path()
    config = (fabric.Config(runtime_ssh_path=path, overrides=overrides) if path
              else fabric.Config(ssh_config=paramiko.SSHConfig(), overrides=overrides))
    connect_kwargs = {}
    if host.ansible_ssh_private_key_file:
        connect_kwargs.update(key_filename=host.ansible_ssh_private_key_file, look_for_keys=False)
    conn = fabric.Connection(
        host.address, user=host.ansible_user, port=host.ansible_port, config=config,
        connect_timeout=CONNECT_TIMEOUT, connect_kwargs=connect_kwargs,
    )
    # Fabric trusts any new host key and never reads known_hosts: undo both.
    for path in known_hosts_files(host):
        if os.path.exists(path):
            conn.client.load_host_keys(path)
    conn.client.set_missing_host_key_policy(host_key_policy)
    return conn


class _RejectUnknownKey(paramiko.RejectPolicy):
    """paramiko's RejectPolicy that keeps the refused key's fingerprint, so the error can show the
    user what to compare out of band (the form ``ssh-keygen -l`` prints)."""

    offered: str | None = None

    def missing_host_key(self, client, hostname, key):
        digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
        self.offered = f"{key.get_name()} key SHA256:{digest}"
        super().missing_host_key(client, hostname, key)


@contextmanager
def connect(host: Host):
    """Open a Session to ``host``; HostError (one clear line) if it cannot be reached."""
    session = Session(host).open()
    try:
        yield session
    finally:
        session.close()


def local_rsync_available() -> bool:
    """An rsync here that can keep remote paths away from the remote shell (-s, rsync >= 3.0);
    without one, transfers go over SFTP."""
    path = shutil.which("rsync")
    return path is not None and _protects_args(path)


@functools.lru_cache(maxsize=None)
def _protects_args(rsync: str) -> bool:
    try:
        usage = subprocess.run([rsync, "--help"], capture_output=True, text=True, timeout=10,
                               stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--protect-args" in usage or "--secluded-args" in usage


def _sftp_create(sftp: paramiko.SFTPClient, path: str, mode: int) -> paramiko.SFTPFile:
    """``sftp.open(path, "wx")``, but with ``mode`` in the OPEN request itself: paramiko's open()
    sends no attributes, so the server creates the file with its umask's mode (0644, readable by
    all) and only a later chmod narrows it. (SFTPClient has no public call for this.)"""
    attrs = paramiko.SFTPAttributes()
    attrs.st_mode = mode
    flags = paramiko.sftp.SFTP_FLAG_WRITE | paramiko.sftp.SFTP_FLAG_CREATE | paramiko.sftp.SFTP_FLAG_EXCL
    kind, msg = sftp._request(paramiko.sftp.CMD_OPEN, path, flags, attrs)
    if kind != paramiko.sftp.CMD_HANDLE:
        raise paramiko.SFTPError("expected a handle")
    return paramiko.SFTPFile(sftp, msg.get_binary(), "wx")


def _short(script: str, limit: int = 80) -> str:
    line = " ".join(script.split())
    return f"`{line[:limit]}…`" if len(line) > limit else f"`{line}`"
