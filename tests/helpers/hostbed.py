"""Real SSH hosts for tests, at three levels of realism.

A  loopback_sshd:   an sshd on 127.0.0.1:PORT that shares this machine's filesystem.
B  netns_hosts:     n hosts, each with its own network, hostname, pid ns, /tmp, /home and /root,
                    an address on a private bridge, and sshd on :22.
C  systemd_machine: a booted systemd (systemd-nspawn -b) on an overlay of /, in its own netns.

Every process a bed starts runs in a pid namespace whose init is killed at teardown (and,
through PDEATHSIG, when this Python process dies), so nothing a test started on a host can
outlive it. Namespaced mounts vanish with their processes; bridges and named netns are
removed at teardown, and a bed left behind by a killed run is reclaimed by the next one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

ML_USER = "ml"
ML_SUDOERS = Path("/etc/sudoers.d/specops-ml")
ML_SUDO_RULE = f"{ML_USER} ALL=(root) NOPASSWD: /usr/bin/systemctl, /usr/bin/journalctl, /usr/bin/install\n"
SUBNET = "10.231"  # 10.231.K.0/24 per bed; private to this sandbox
LOCK = "/run/lock/specops-hostbed.lock"
SSHD = "/usr/sbin/sshd"
REPO = Path(__file__).resolve().parents[2]  # sshd re-executes itself and needs an absolute path


@dataclasses.dataclass(frozen=True)
class SshHost:
    name: str
    address: str
    port: int
    user: str
    key_path: str  # client private key
    known_hosts_path: str  # holds exactly this host's key line
    host_key_line: str
    tmux_tmpdir: str | None  # set by sshd (level A); None where /tmp is private
    workdir: str  # an empty directory on the host, owned by user, gone with the bed

    def inventory_vars(self, **extra) -> dict:
        return {
            "ansible_host": self.address,
            "ansible_port": self.port,
            "ansible_user": self.user,
            "ansible_ssh_private_key_file": self.key_path,
            "known_hosts": self.known_hosts_path,
            "workdir": self.workdir,
            **extra,
        }

    def ssh_argv(self, cmd: str, connect_timeout: int = 5) -> list[str]:
        """Plain OpenSSH client argv that trusts only this host's key and ignores ~/.ssh."""
        return [
            "ssh", "-F", "/dev/null", "-i", self.key_path, "-p", str(self.port),
            "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts_path}",
            "-o", "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes",
            "-o", f"ConnectTimeout={connect_timeout}",
            f"{self.user}@{self.address}", cmd,
        ]


@dataclasses.dataclass(frozen=True)
class NetnsHost(SshHost):
    veth: str = ""  # this host's cable into the bridge, on this side

    def cut(self) -> None:
        _sh("ip", "link", "set", self.veth, "down")

    def restore(self, wait_s: float = 15.0) -> None:
        """Plug the cable back in, and return once sshd answers with its banner: right after the link
        comes up a connection can still be reset (seen once in a fresh CI), which is the bed, not the code."""
        _sh("ip", "link", "set", self.veth, "up")
        deadline = time.monotonic() + wait_s
        while True:
            try:
                with socket.create_connection((self.address, self.port), timeout=2) as conn:
                    if conn.recv(4) == b"SSH-":
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: sshd does not answer {wait_s:.0f} s after its link came back up")
            time.sleep(0.1)


# ---------------------------------------------------------------- capabilities

@functools.lru_cache
def missing_capability(level: str) -> str | None:
    """Why a bed of this level ("loopback", "netns", "nspawn") cannot start here, or None."""
    if os.geteuid() != 0:
        return "test hosts need root (namespaces, useradd, sudoers)"
    tools = {"loopback": ["unshare", "setpriv", "ssh-keygen", "ssh", "useradd", "visudo", "sudo"],
             "netns": ["ip", "nsenter"], "nspawn": ["systemd-nspawn", "ip", "nsenter"]}[level]
    if not Path(SSHD).exists():
        return f"{SSHD} missing (apt-get install openssh-server)"
    for tool in tools:
        if not shutil.which(tool):
            return f"{tool} missing (apt-get install openssh-server openssh-client sudo iproute2 util-linux systemd-container)"
    probe = {"loopback": ["unshare", "--pid", "--fork", "true"],
             "netns": ["unshare", "--net", "--uts", "--mount", "--pid", "--fork", "true"],
             "nspawn": ["unshare", "--net", "--mount", "--pid", "--fork", "true"]}[level]
    if subprocess.run(probe, capture_output=True).returncode:
        return f"cannot create namespaces: {shlex.join(probe)} failed"
    if level == "nspawn" and "overlay" not in Path("/proc/filesystems").read_text():
        return "kernel has no overlayfs"
    return None


# ---------------------------------------------------------------- level A

@contextlib.contextmanager
def loopback_sshd(tmpdir, users=("root", ML_USER), extra_config=(), listen="127.0.0.1"):
    """Yield one SshHost per user, all served by one sshd on 127.0.0.1:free-port (``listen="::1"``: the
    IPv6 loopback, the address as the hosts' ansible_host).

    Config, keys and log stay in tmpdir (root only); workdirs and TMUX_TMPDIR live in a
    fresh /tmp/specops-hostbed-PID-* that every user can reach, removed at teardown.
    """
    tmpdir = Path(tmpdir)
    if ML_USER in users:
        ensure_ml_user()
    _privsep_dir()
    client_pub = _keypair(tmpdir / "client_key")
    host_pub = _keypair(tmpdir / "ssh_host_ed25519_key")
    _reclaim_stale_shared_dirs()
    shared = Path(tempfile.mkdtemp(prefix=f"specops-hostbed-{os.getpid()}-"))
    proc = None
    try:
        shared.chmod(0o755)
        (shared / "tmux").mkdir(mode=0o1777)
        (shared / "tmux").chmod(0o1777)
        workdirs = {u: _owned_dir(shared / u, u) for u in users}
        for _attempt in range(5):  # a free port can be taken by another test before sshd binds it
            port = _free_port()
            conf = tmpdir / "sshd_config"
            conf.write_text(_sshd_config(
                port, listen, tmpdir / "ssh_host_ed25519_key", client_pub,
                f"SetEnv TMUX_TMPDIR={shared / 'tmux'}", *extra_config))
            _sh(SSHD, "-t", "-f", str(conf))
            proc = _spawn(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c",
                           QUIET_STARTUP + 'exec "$@"', "sh", SSHD, "-D", "-e", "-f", str(conf)], tmpdir / "sshd.log")
            if _wait_banner(listen, port, proc, 10):
                break
            _stop(proc)
            proc = None
        else:
            raise RuntimeError(f"sshd would not start; see {tmpdir / 'sshd.log'}")
        line = _known_hosts_line(listen, port, host_pub)
        yield [SshHost(f"loop-{u}", listen, port, u, str(tmpdir / "client_key"),
                       _write(tmpdir / f"loop-{u}.known_hosts", line + "\n"), line,
                       str(shared / "tmux"), str(workdirs[u])) for u in users]
    finally:
        if proc:
            _stop(proc)
        shutil.rmtree(shared, ignore_errors=True)


# Each command over ssh runs the login shell, which sources the user's ~/.bashrc (Debian's bash does
# so under sshd). The bed's hosts see this machine's home, whose startup hooks (a `pyenv rehash`,
# say) can wait on a lock another process holds: inside the sshd's own mount namespace the file is
# empty, so what the test bed runs never depends on what else this machine is doing.
QUIET_STARTUP = 'for f in "$HOME/.bashrc" "$HOME/.bash_profile" "$HOME/.profile"; do ' \
                '[ -f "$f" ] && mount --bind /dev/null "$f"; done; '


def _reclaim_stale_shared_dirs() -> None:
    """Remove /tmp/specops-hostbed-PID-* left by a test process that was killed."""
    for path in Path(tempfile.gettempdir()).glob("specops-hostbed-*-*"):
        pid = path.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


def ensure_ml_user() -> None:
    """The non-root ops user of a GPU host: key login, NOPASSWD sudo for systemctl/journalctl/install only.

    Idempotent; changes this machine (the user, its sudoers file, o+x on /root so it can reach
    the pyenv interpreter behind the checkout's .venv/bin/python) and leaves them in place.
    """
    with _locked():
        if subprocess.run(["id", "-u", ML_USER], capture_output=True).returncode:
            _sh("useradd", "--create-home", "--shell", "/bin/bash", ML_USER)
        _sh("usermod", "-p", "*", ML_USER)  # unlocked but passwordless: sshd refuses locked accounts
        home = Path(pwd.getpwnam(ML_USER).pw_dir)
        home.chmod(0o755)
        if not ML_SUDOERS.exists() or ML_SUDOERS.read_text() != ML_SUDO_RULE:
            staged = ML_SUDOERS.with_name(".specops-ml.new")  # visudo ignores names with a dot
            _write(staged, ML_SUDO_RULE, 0o440)
            _sh("visudo", "-c", "-q", "-f", str(staged))
            staged.replace(ML_SUDOERS)
        root_home = Path("/root")
        root_home.chmod(root_home.stat().st_mode | 0o001)


# ---------------------------------------------------------------- level B

@contextlib.contextmanager
def netns_hosts(n: int, tmpdir, user: str = "root"):
    """Yield n NetnsHosts (node1..nodeN) as `user`, each a separate machine as far as SSH can tell."""
    tmpdir = Path(tmpdir)
    if user == ML_USER:
        ensure_ml_user()
    _privsep_dir()
    client_pub = _keypair(tmpdir / "client_key")
    procs = []
    with _Subnet() as net:
        try:
            hosts = []
            addresses = {f"node{i}": net.address(i) for i in range(1, n + 1)}
            for i, name in enumerate(addresses, 1):
                ns, veth = net.add_netns(i)
                hdir = tmpdir / name
                host_pub = _private_host_dirs(hdir, name, addresses, client_pub)
                script = _bind_private_dirs(hdir) + ["exec " + SSHD + " -D -e"]
                procs.append(_spawn(
                    ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts", "--pid", "--fork",
                     "--kill-child", "--mount-proc", "sh", "-ec", "\n".join([f"hostname {name}", *script])],
                    hdir / "sshd.log"))
                line = _known_hosts_line(addresses[name], 22, host_pub)
                hosts.append(NetnsHost(name, addresses[name], 22, user, str(tmpdir / "client_key"),
                                       _write(tmpdir / f"{name}.known_hosts", line + "\n"), line, None,
                                       _home(user) + "/work", veth))
            for host, proc in zip(hosts, procs):
                if not _wait_banner(host.address, 22, proc, 10):
                    raise RuntimeError(f"sshd on {host.name} did not start; see {tmpdir / host.name / 'sshd.log'}")
            yield hosts
        finally:
            for proc in procs:
                _stop(proc)


def _private_host_dirs(hdir: Path, name: str, addresses: dict, client_pub: str) -> str:
    """Lay out the files a B host sees as its own /etc/ssh, /etc/hosts, /tmp, /home and /root."""
    shutil.copytree("/etc/ssh", hdir / "etc-ssh", ignore=shutil.ignore_patterns("ssh_host_*", "sshd_config*"))
    host_pub = _keypair(hdir / "etc-ssh/ssh_host_ed25519_key")
    _write(hdir / "etc-ssh/sshd_config",
           _sshd_config(22, "0.0.0.0", "/etc/ssh/ssh_host_ed25519_key", client_pub))
    peers = "".join(f"{addr} {peer}\n" for peer, addr in addresses.items() if peer != name)
    _write(hdir / "hosts", f"127.0.0.1 localhost\n127.0.1.1 {name}\n{peers}")
    _write(hdir / "hostname", name + "\n")
    (hdir / "tmp").mkdir(mode=0o1777)
    (hdir / "tmp").chmod(0o1777)
    (hdir / "home").mkdir()
    _owned_dir(hdir / "root", "root", 0o711)  # o+x: ml reaches /root/.pyenv (the venv's interpreter)
    _owned_dir(hdir / "root/work", "root")
    (hdir / "root/.pyenv").mkdir()
    if _user_exists(ML_USER):
        _owned_dir(hdir / "home" / ML_USER, ML_USER)
        _owned_dir(hdir / "home" / ML_USER / "work", ML_USER)
    return host_pub


def _bind_private_dirs(hdir: Path) -> list[str]:
    """Shell lines, run in the host's own mount namespace, that swap in its private dirs."""
    h = shlex.quote(str(hdir))
    return [
        f"mount --bind {h}/etc-ssh /etc/ssh",
        f"mount --bind {h}/hosts /etc/hosts",
        f"mount --bind {h}/hostname /etc/hostname",
        f"mount --bind /root/.pyenv {h}/root/.pyenv",  # keep the checkout's .venv interpreter reachable
        *_keep_repo_visible(hdir),
        f"mount --rbind {h}/root /root",
        f"mount --rbind {h}/home /home",
        f"mount --rbind {h}/tmp /tmp",  # last: it hides hdir, which lives under /tmp
    ]


def _keep_repo_visible(hdir: Path) -> list[str]:
    """The checkout under test (and its .venv) must stay reachable on a host whose /tmp, /root or
    /home are private: CI may clone it anywhere. Bind it into the private copy at the same path."""
    for private in ("tmp", "root", "home"):
        if REPO.is_relative_to(f"/{private}"):
            mirror = shlex.quote(str(hdir / private / REPO.relative_to(f"/{private}")))
            return [f"mkdir -p {mirror}", f"mount --bind {shlex.quote(str(REPO))} {mirror}"]
    return []


# ---------------------------------------------------------------- level C

MACHINE_TARGET = """\
[Unit]
Description=specops hostbed: the least a GPU host's ops user needs
Wants=ssh.service systemd-logind.service dbus.service systemd-user-sessions.service
AllowIsolate=yes
"""


@contextlib.contextmanager
def systemd_machine(tmpdir, boot_timeout: float = 90):
    """Yield [root, ml] SshHosts on a booted systemd container whose writes go to a tmpfs.

    The overlay (lower /, upper tmpfs) is mounted in a private mount namespace that
    systemd-nspawn then inherits, so the mounts vanish with it; this machine's files are
    never written.
    """
    tmpdir = Path(tmpdir)
    client_pub = _keypair(tmpdir / "client_key")
    seed = tmpdir / "seed"  # files copied into the upper layer before boot
    host_pub = _keypair(seed / "etc/ssh/ssh_host_ed25519_key")
    _write(seed / "etc/ssh/sshd_config", _sshd_config(22, "0.0.0.0", "/etc/ssh/ssh_host_ed25519_key", client_pub))
    _write(seed / "etc/systemd/system/hostbed.target", MACHINE_TARGET)
    (seed / "etc/systemd/system/default.target").symlink_to("hostbed.target")
    _write(seed / "etc/sudoers.d/specops-ml", ML_SUDO_RULE, 0o440)
    for startup in (".bashrc", ".bash_profile", ".profile"):  # as QUIET_STARTUP: the overlay shows this machine's /root
        _write(seed / "root" / startup, "# the test bed's root: no startup hooks\n")
    _sh("visudo", "-c", "-q", "-f", str(seed / "etc/sudoers.d/specops-ml"))
    proc = None
    with _Subnet() as net:
        ns, _veth = net.add_netns(1)
        machine, address = f"specops-hb{net.k}", net.address(1)
        _write(seed / "etc/hosts", f"127.0.0.1 localhost\n127.0.1.1 {machine}\n")
        _write(seed / "etc/hostname", machine + "\n")
        d = {k: shlex.quote(str(tmpdir / k)) for k in ("ovl", "root", "seed")}
        for k in ("ovl", "root"):
            (tmpdir / k).mkdir()
        setup = [
            f"mount -t tmpfs -o mode=755 hostbed {d['ovl']}",
            f"mkdir {d['ovl']}/upper {d['ovl']}/work",
            f"cp -a {d['seed']}/. {d['ovl']}/upper/",
            f"mount -t overlay overlay -o lowerdir=/,upperdir={d['ovl']}/upper,workdir={d['ovl']}/work {d['root']}",
            f"chroot {d['root']} sh -ec 'id -u {ML_USER} >/dev/null 2>&1 || useradd -m -s /bin/bash {ML_USER};"
            f" usermod -p \"*\" {ML_USER}; chmod o+x /root; install -d -o root -m 755 /root/work;"
            f" install -d -o {ML_USER} -g {ML_USER} -m 755 /home/{ML_USER}/work'",
            f"mount -t tmpfs -o mode=755 dev {d['root']}/dev",  # nspawn wants an empty /dev
            f"exec systemd-nspawn --quiet -D {d['root']} --machine={machine} --register=no --keep-unit"
            f" --link-journal=no --network-namespace-path=/run/netns/{ns} --console=pipe --boot"
            f" --bind-ro={shlex.quote(str(REPO))}",  # the checkout under test, wherever CI cloned it
        ]
        try:
            proc = _spawn(["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
                           "--mount-proc", "sh", "-ec", "\n".join(setup)],
                          tmpdir / "machine.log", stop_signal=signal.SIGTERM)  # SIGTERM: clean poweroff
            if not _wait_banner(address, 22, proc, boot_timeout):
                raise RuntimeError(f"systemd machine did not boot; see {tmpdir / 'machine.log'}")
            line = _known_hosts_line(address, 22, host_pub)
            known = _write(tmpdir / "sysd.known_hosts", line + "\n")
            hosts = [SshHost(f"sysd-{u}", address, 22, u, str(tmpdir / "client_key"), known, line, None,
                             _home(u) + "/work") for u in ("root", ML_USER)]
            state = subprocess.run(hosts[0].ssh_argv("systemctl is-system-running --wait"),
                                   capture_output=True, text=True, timeout=boot_timeout).stdout.strip()
            if state not in ("running", "degraded"):
                raise RuntimeError(f"systemd machine state {state!r}; see {tmpdir / 'machine.log'}")
            yield hosts
        finally:
            if proc:
                _stop(proc)
            shutil.rmtree(f"/run/systemd/nspawn/propagate/{machine}", ignore_errors=True)


# ---------------------------------------------------------------- inventory

def write_inventory(path, groups: dict, group_vars: dict | None = None, host_vars: dict | None = None) -> Path:
    """Write an Ansible-shaped inventory: all → children → GROUP → hosts → NAME → vars.

    group_vars may hold "all" for all → vars; host_vars (by host name) win over inventory_vars().
    """
    group_vars, host_vars = group_vars or {}, host_vars or {}
    children = {}
    for group, hosts in groups.items():
        children[group] = {"hosts": {h.name: h.inventory_vars(**host_vars.get(h.name, {})) for h in hosts}}
        if group in group_vars:
            children[group]["vars"] = group_vars[group]
    top = {"vars": group_vars["all"]} if "all" in group_vars else {}
    _write(Path(path), yaml.safe_dump({"all": {**top, "children": children}}, sort_keys=False))
    return Path(path)


# ---------------------------------------------------------------- plumbing

class _Subnet:
    """Bridge hbK holding 10.231.K.1/24 on this side, claimed atomically; named netns hbK-I hang off it.

    The bridge's alias records the owning pid, so a bed whose test process was killed is
    reclaimed (namespaces and bridge deleted) by the next claim.
    """

    def __enter__(self):
        with _locked():
            for k in range(1, 255):
                add = ("ip", "link", "add", f"hb{k}", "type", "bridge")
                if _try(*add) or (_reclaim_if_stale(k) and _try(*add)):
                    self.k, self.bridge, self.namespaces = k, f"hb{k}", []
                    _sh("ip", "link", "set", self.bridge, "alias", f"specops-hostbed pid={os.getpid()}")
                    _sh("ip", "addr", "add", f"{SUBNET}.{k}.1/24", "dev", self.bridge)
                    _sh("ip", "link", "set", self.bridge, "up")
                    return self
        raise RuntimeError("no free hostbed subnet (hb1..hb254 all in use)")

    def address(self, i: int) -> str:
        return f"{SUBNET}.{self.k}.{10 + i}"

    def add_netns(self, i: int) -> tuple[str, str]:
        ns, veth = f"hb{self.k}-{i}", f"hb{self.k}v{i}"
        with _locked():  # against another bed's __exit__ unmounting /run/netns meanwhile
            _sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _sh("ip", "link", "set", veth, "master", self.bridge, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns, veth

    def __exit__(self, *exc):
        for i, ns in enumerate(self.namespaces, 1):  # a netns frees its veth lazily: delete it first
            _try("ip", "link", "del", f"hb{self.k}v{i}")
            _try("ip", "netns", "del", ns)
        _try("ip", "link", "del", self.bridge)
        with _locked():  # `ip netns add` left /run/netns mounted; the last bed out unmounts it
            if Path("/run/netns").is_dir() and not any(Path("/run/netns").iterdir()):
                _try("umount", "/run/netns")
                _try("rmdir", "/run/netns")


def _reclaim_if_stale(k: int) -> bool:
    """Remove bed hbK if the process that claimed it is gone; True if it was removed."""
    out = subprocess.run(["ip", "-o", "link", "show", f"hb{k}"], capture_output=True, text=True).stdout
    if "specops-hostbed pid=" not in out:
        return False
    pid = int(out.split("specops-hostbed pid=")[1].split()[0])
    if Path(f"/proc/{pid}").exists():
        return False
    for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split():
        if ns.startswith(f"hb{k}-"):
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            _try("ip", "link", "del", ns.replace("-", "v"))  # hbK-I's cable is hbKvI
            _try("ip", "netns", "del", ns)
    shutil.rmtree(f"/run/systemd/nspawn/propagate/specops-hb{k}", ignore_errors=True)
    return _try("ip", "link", "del", f"hb{k}")


def _privsep_dir() -> None:
    """sshd refuses to start without its privilege separation directory; apt does not make it here."""
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)


def _sshd_config(port: int, listen: str, host_key, client_pub: str, *extra: str) -> str:
    """The sshd_config seen to work here; the client key is served by echo, so no file
    under a 0700 pytest dir has to be readable by the target user."""
    key = " ".join(client_pub.split()[:2])
    return "\n".join([
        f"Port {port}", f"ListenAddress {listen}", f"HostKey {host_key}", "PidFile none",
        "AuthorizedKeysFile none", f"AuthorizedKeysCommand /bin/echo {key}", "AuthorizedKeysCommandUser root",
        "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "UsePAM no", "AllowTcpForwarding yes", "UseDNS no", "MaxStartups 100:30:200", "MaxSessions 64",
        "ClientAliveInterval 5", "ClientAliveCountMax 3", "Subsystem sftp /usr/lib/openssh/sftp-server",
        "LogLevel INFO", *extra, ""])


def _spawn(argv: list[str], log: Path, stop_signal=None) -> subprocess.Popen:
    """Start argv with PDEATHSIG=KILL, so it dies with this process even if teardown never runs.

    The signal follows the *thread* that started it: start beds from a thread that outlives
    them (pytest's main thread does).
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(["setpriv", "--pdeathsig", "KILL", *argv], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT)
    proc.stop_signal = stop_signal
    return proc


def _stop(proc: subprocess.Popen) -> None:
    """Stop a bed process and wait until everything in its namespaces has exited.

    `unshare --fork` ignores SIGTERM, so its child, init of the pid ns, gets the signal
    (SIGKILL, or stop_signal such as nspawn's clean-poweroff SIGTERM); unshare reaps it only
    after the kernel has killed the rest of the namespace, nested ones included.
    """
    if proc.poll() is not None:
        return
    with contextlib.suppress(FileNotFoundError):
        for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(child), proc.stop_signal or signal.SIGKILL)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_banner(address: str, port: int, proc: subprocess.Popen, timeout: float) -> bool:
    """True once something speaking SSH answers on address:port; False if proc dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):
            with socket.create_connection((address, port), timeout=1) as s:
                s.settimeout(2)
                if s.recv(64).startswith(b"SSH-"):
                    return True
        time.sleep(0.02)
    return False


def _keypair(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "specops-hostbed", "-f", str(path))
    return Path(f"{path}.pub").read_text().strip()


def _known_hosts_line(address: str, port: int, host_pub: str) -> str:
    where = address if port == 22 else f"[{address}]:{port}"
    return f"{where} {' '.join(host_pub.split()[:2])}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _home(user: str) -> str:
    return "/root" if user == "root" else f"/home/{user}"


def _user_exists(user: str) -> bool:
    try:
        pwd.getpwnam(user)
        return True
    except KeyError:
        return False


def _owned_dir(path: Path, user: str, mode: int = 0o755) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    entry = pwd.getpwnam(user)
    os.chown(path, entry.pw_uid, entry.pw_gid)
    path.chmod(mode)
    return path


def _write(path: Path, text: str, mode: int = 0o644) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return str(path)


@contextlib.contextmanager
def _locked():
    """Serialise machine-wide changes (user, sudoers, bridges) between concurrent test runs."""
    Path(LOCK).parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _sh(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise RuntimeError(f"{shlex.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _try(*argv: str) -> bool:
    return subprocess.run(argv, capture_output=True, timeout=60).returncode == 0
