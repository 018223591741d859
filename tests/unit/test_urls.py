"""The bind address -> URL rule (specops/urls.py), without hosts; and that every client uses it."""
from types import SimpleNamespace

import pytest

from specops import jobs, serve, supervisors, urls
from specops.inventory import Host
from specops.service_spec import Layout


@pytest.mark.parametrize("bind, url", [
    ("127.0.0.1", "http://127.0.0.1:8000"),
    ("::1", "http://[::1]:8000"),              # bracketed, or the port reads as part of the address
    ("0.0.0.0", "http://127.0.0.1:8000"),      # a wildcard is reached on loopback from the same host
    ("::", "http://127.0.0.1:8000"),
    ("localhost", "http://127.0.0.1:8000"),
    ("fd00::5", "http://[fd00::5]:8000"),
    ("10.0.0.5", "http://10.0.0.5:8000"),      # a specific address is where the server is, even locally
    ("gpu-a.internal", "http://gpu-a.internal:8000"),
])
def test_a_client_on_the_same_host(bind, url):
    assert urls.server_url(bind, 8000) == url


@pytest.mark.parametrize("bind, address, url", [
    ("0.0.0.0", "203.0.113.10", "http://203.0.113.10:8001/v1"),  # a wildcard: the host's own address
    ("::", "2001:db8::7", "http://[2001:db8::7]:8001/v1"),
    ("::", "gpu-a", "http://gpu-a:8001/v1"),
    ("10.0.0.5", "203.0.113.10", "http://10.0.0.5:8001/v1"),
    ("localhost", "203.0.113.10", "http://127.0.0.1:8001/v1"),  # only that host's loopback
])
def test_a_client_elsewhere(bind, address, url):
    assert urls.server_url(bind, 8001, host_address=address, path="/v1") == url


def host(**settings):
    return Host(name="gpu-a", groups=("gpu",), vars={"ansible_host": "2001:db8::7", "port": 8002, **settings})


@pytest.mark.parametrize("bind", ["::1", "0.0.0.0", "::", "fd00::5", "gpu-a.internal"])
def test_generate_the_readiness_probe_and_serve_use_the_rule(bind):
    """The three places that once had their own rule (only one bracketed IPv6) give the rule's URL."""
    session = SimpleNamespace(host=host(bind=bind), workdir="/w")
    assert jobs.endpoint_url(session) == urls.server_url(bind, 8002)
    sup = SimpleNamespace(session=session, name="tmux", layout=Layout("/w"), facts=SimpleNamespace(uid=0),
                          log_argv=lambda lines, follow: ["tail"])
    assert supervisors.Supervisor.probe_config(sup, "m")["url"] == urls.server_url(bind, 8002)
    shown = serve.endpoint(session)
    if bind in ("0.0.0.0", "::"):
        assert shown == "http://[2001:db8::7]:8002/v1"
    elif bind != "::1":
        assert shown == urls.server_url(bind, 8002, path="/v1")
