"""The two ways specops keeps vLLM running on a host: a systemd unit, or a detached tmux session.

Both run the rendered command line and env file (:mod:`specops.service_spec`) under the same
restart policy, and offer the same operations: put the files in place (saying whether they
changed), start or restart, stop, tell whether it runs, and name the command that reads the log.

Which one: ``--supervisor``, else the inventory's ``supervisor`` (unless ``auto``), else the one
`inv serve` used last on the host (recorded in ``<workdir>/service/supervisor``), else systemd
where it is usable (PID 1 is systemd and ``systemctl`` answers), tmux elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import owned, urls
from .errors import HostError, SpecopsError
from .host import Session, quote
from .service_spec import Layout, Policy, Rendered
from .shared import layout

TOOLS = ("tmux", "install", "systemctl", "journalctl")
# systemd is usable when PID 1 is systemd and systemctl answers (a container's systemctl may not): prints systemd=yes|no
SYSTEMD_PROBE = ('if [ "$(cat /proc/1/comm 2>/dev/null)" = systemd ] && systemctl show --property=Version >/dev/null 2>&1; '
                 'then echo systemd=yes; else echo systemd=no; fi')
_FACTS = r"""
echo "user=$(id -un)"; echo "uid=$(id -u)"
{systemd_probe}
for tool in {tools}; do echo "$tool=$(command -v $tool)"; done
echo "last=$(cat {marker} 2>/dev/null)"
"""


@dataclass(frozen=True)
class HostFacts:
    user: str
    uid: int
    systemd: bool
    tools: dict  # name -> absolute path ("" when missing)
    last: str  # supervisor `inv serve` used last here, or ""


def host_facts(session: Session, layout: Layout) -> HostFacts:
    """Who we are on the host and what it offers, in one round trip."""
    script = _FACTS.format(tools=" ".join(TOOLS), marker=quote(layout.marker), systemd_probe=SYSTEMD_PROBE)
    out = session.sh(script, timeout=30).stdout
    kv = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return HostFacts(kv.get("user", "?"), int(kv.get("uid", -1)), kv.get("systemd") == "yes",
                     {t: kv.get(t, "") for t in TOOLS}, kv.get("last", ""))


def choose(session: Session, facts: HostFacts, layout: Layout, requested: str | None, policy: Policy):
    """The Systemd or Tmux supervisor for this host (see the module docstring for the order)."""
    host = session.host
    name = requested or (host.supervisor if host.supervisor != "auto" else None) or facts.last or (
        "systemd" if facts.systemd else "tmux")
    return SUPERVISORS[name](session, facts, layout, policy)


class Supervisor:
    """What both supervisors offer: write(), running(), start(restart), stop(), log_argv(lines, follow)."""

    name = "?"

    def __init__(self, session: Session, facts: HostFacts, layout: Layout, policy: Policy):
        self.session, self.facts, self.layout, self.policy = session, facts, layout, policy
        self.host = session.host.name

    def write(self, rendered: Rendered) -> bool:
        """Put the rendered files in place; True if any of them changed."""
        owned.claim(self.session, layout.SERVICE)  # a user's own service/ is neither closed nor written into
        self.session.private_dir(self.layout.dir)  # also when the env file is unchanged (an older, open dir)
        changed = self._replace(self.layout.env_file, rendered.env, 0o600)  # secrets: private from birth
        changed |= self._install(rendered)
        if self.facts.last != self.name:
            self.session.write_file(self.layout.marker, self.name + "\n")
        return changed

    def _replace(self, path: str, text: str, mode: int) -> bool:
        if self.session.read_file(path) == text.encode():
            return False
        self.session.write_file(path, text, mode)
        return True

    def log_command(self, lines: int, follow: bool) -> str:
        """The shell command that prints the service log on the host."""
        return " ".join(quote(a) for a in self.log_argv(lines, follow))

    def probe_config(self, model: str, timeout: float = 0, tail_lines: int = 50) -> dict:
        """What remote/service_probe.py needs to find this service on the host (no secrets)."""
        h, L = self.session.host, self.layout
        return {"supervisor": self.name, "unit": self.layout.unit_name, "sudo": self.facts.uid != 0,
                "url": urls.server_url(h.bind, h.port),
                "model": model, "env_file": L.env_file, "log_file": L.log_file, "pid_file": L.pid_file,
                "supervisor_pid_file": L.supervisor_pid_file, "state_file": L.state_file,
                "tail_argv": self.log_argv(tail_lines, follow=False), "timeout": timeout, "interval": 0.25}


class Systemd(Supervisor):
    """A system unit, ``specops-<workdir hash>-vllm.service``, running as the login user; root steps
    via ``sudo -n``."""

    name = "systemd"

    def __init__(self, *args):
        super().__init__(*args)
        if not self.facts.systemd:
            raise SpecopsError(f"{self.host}: systemd is not usable here (PID 1 is not systemd, or systemctl "
                               f"fails); use --supervisor tmux")

    def _install(self, rendered: Rendered) -> bool:
        if self.session.read_file(self.layout.unit_path) == rendered.unit.encode():
            return False
        self.session.write_file(self.layout.staged_unit, rendered.unit, 0o644)
        self._root(["install", "-m", "0644", self.layout.staged_unit, self.layout.unit_path])
        self._root(["systemctl", "daemon-reload"])
        return True

    def running(self) -> bool:
        return self.session.run(["systemctl", "is-active", "--quiet", self.layout.unit_name], check=False,
                                timeout=30).ok

    def start(self, restart: bool) -> None:
        self._root(["systemctl", "enable", "--quiet", self.layout.unit_name])
        self._root(["systemctl", "reset-failed", self.layout.unit_name], check=False)  # a manual start: limit reset
        self._root(["systemctl", "restart" if restart else "start", self.layout.unit_name],
                   timeout=self.policy.stop_timeout_s + 60)

    def stop(self) -> None:
        self._root(["systemctl", "disable", "--now", "--quiet", self.layout.unit_name],
                   timeout=self.policy.stop_timeout_s + 60)

    def log_argv(self, lines: int, follow: bool) -> list[str]:
        # --all: progress bars hold \r, which journalctl would otherwise show as "[blob data]"
        return self._sudo(["journalctl", "-u", self.layout.unit_name, "--all", "--no-pager", "-n", str(lines)]
                          + (["-f"] if follow else []))

    def _sudo(self, argv: list[str]) -> list[str]:
        return argv if self.facts.uid == 0 else ["sudo", "-n", *argv]

    def _root(self, argv: list[str], *, check: bool = True, timeout: float = 60):
        """Run a root command (through ``sudo -n`` when not root); a missing sudo rule is one clear line."""
        result = self.session.run(self._sudo(argv), check=False, timeout=timeout)
        if result.ok or not check:
            return result
        if self.facts.uid != 0 and result.stderr.lstrip().startswith("sudo:"):
            paths = ", ".join(self.facts.tools.get(t) or f"/usr/bin/{t}" for t in ("systemctl", "journalctl", "install"))
            raise SpecopsError(
                f"{self.host}: `sudo -n {argv[0]}` was refused for {self.facts.user} ({result.stderr.strip()}); "
                f"add the rule `{self.facts.user} ALL=(root) NOPASSWD: {paths}` to /etc/sudoers.d/specops "
                f"(visudo -f), or log in as root")
        detail = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise HostError(f"{self.host}: `{' '.join(argv)}` failed (exit {result.exit_code}): {detail}")


class Tmux(Supervisor):
    """``<workdir>/service/supervise.sh`` in the detached tmux session ``specops-<workdir hash>-vllm``."""

    name = "tmux"

    def __init__(self, *args):
        super().__init__(*args)
        if not self.facts.tools.get("tmux"):
            raise SpecopsError(f"{self.host}: tmux is not installed (apt-get install tmux), and the tmux "
                               f"supervisor needs it")

    def _install(self, rendered: Rendered) -> bool:
        return self._replace(self.layout.script, rendered.script, 0o755)

    def running(self) -> bool:
        return self.session.sh(self._alive_check(), check=False, timeout=30).ok

    def _alive_check(self) -> str:
        """Shell test: the supervisor lives. It records its own exit in the state file (tmux reaps
        its pane lazily, so kill -0 alone would see a finished one), and needs its tmux session."""
        L = self.layout
        return (f"{{ pid=$(cat {quote(L.supervisor_pid_file)} 2>/dev/null) && [ -n \"$pid\" ] && "
                f"! grep -qE '^(inactive|failed)' {quote(L.state_file)} 2>/dev/null && kill -0 \"$pid\" 2>/dev/null "
                f"&& tmux has-session -t ={L.name} 2>/dev/null; }}")

    def start(self, restart: bool) -> None:
        if restart:
            self.stop()
        L = self.layout
        launch = (f"rm -f {quote(L.pid_file)} {quote(L.supervisor_pid_file)}; "
                  f"echo 'activating (start)' >{quote(L.state_file)}; "
                  f"tmux kill-session -t ={L.name} 2>/dev/null; "
                  f"tmux new-session -d -s {L.name} -c {quote(L.workdir)} {quote('exec bash ' + quote(L.script))}")
        self.session.sh(launch, timeout=30)

    def stop(self) -> None:
        """SIGTERM to the supervisor, which stops vLLM's process group (SIGKILL after the stop timeout)."""
        wait_s = self.policy.stop_timeout_s + 10
        alive = self._alive_check()
        self.session.sh(f"if {alive}; then kill -TERM \"$pid\"; for ((i = 0; i < {wait_s * 10}; i++)); do "
                        f"{alive} || break; sleep 0.1; done; fi; "
                        f"tmux kill-session -t ={self.layout.name} 2>/dev/null; true", timeout=wait_s + 30)

    def log_argv(self, lines: int, follow: bool) -> list[str]:
        return ["tail", "-n", str(lines), *(["-F"] if follow else []), self.layout.log_file]


SUPERVISORS = {"systemd": Systemd, "tmux": Tmux}
