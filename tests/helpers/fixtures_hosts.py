"""Pytest fixtures for real SSH hosts (tests/helpers/hostbed.py): loopback, netns and systemd levels.

A missing capability skips on a laptop and fails under CI=true (tests/helpers/capability.py).
"""
import os
import secrets
import socket

import pytest

from tests.helpers.capability import require
from tests.helpers.hostbed import loopback_sshd, missing_capability, netns_hosts, systemd_machine

os.environ["SPECOPS_SSH_CONFIG"] = "none"  # never let the developer's ~/.ssh/config leak into tests


def require_level(level: str) -> None:
    """Skip (laptop) or fail (CI) unless a bed of this level can start here."""
    reason = missing_capability(level)
    require(reason is None, f"{level} test host: {reason}")


@pytest.fixture
def loopback(tmp_path_factory):
    """{user: SshHost} for root and ml on a fresh sshd; everything they started dies with it."""
    require_level("loopback")
    with loopback_sshd(tmp_path_factory.mktemp("sshd")) as hosts:
        yield {h.user: h for h in hosts}


@pytest.fixture
def ipv6_host(tmp_path_factory):
    """root on a loopback sshd listening on [::1] only: its ansible_host is an IPv6 literal."""
    require_level("loopback")
    require(socket.has_ipv6 and _ipv6_loopback(), "IPv6 test host: no ::1 on this machine")
    with loopback_sshd(tmp_path_factory.mktemp("sshd6"), users=("root",), listen="::1") as hosts:
        yield hosts[0]


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture
def ssh_host(loopback):
    """root on a loopback sshd (shares this machine's filesystem; workdir is fresh per test)."""
    return loopback["root"]


@pytest.fixture
def ml_host(loopback):
    """ml (NOPASSWD sudo for systemctl/journalctl/install only) on the same sshd as ssh_host."""
    return loopback["ml"]


@pytest.fixture(scope="module")
def netns_trio(tmp_path_factory):
    """Three root NetnsHosts node1..node3 with their own IP, hostname, /tmp, /home, /root; .cut()/.restore()."""
    require_level("netns")
    with netns_hosts(3, tmp_path_factory.mktemp("netns")) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def systemd_host(tmp_path_factory):
    """{user: SshHost} for root and ml on a booted systemd machine (writes go to a tmpfs)."""
    require_level("nspawn")
    with systemd_machine(tmp_path_factory.mktemp("machine")) as hosts:
        yield {h.user: h for h in hosts}


@pytest.fixture
def api_key(tmp_path, monkeypatch):
    """A fresh API key in a private secrets file, the way a user keeps it."""
    key = "sk-" + secrets.token_hex(16)
    f = tmp_path / "secrets.env"
    f.write_text(f"VLLM_API_KEY={key}\n")
    f.chmod(0o600)
    monkeypatch.setenv("SPECOPS_SECRETS_FILE", str(f))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    return key
