"""`inv serve` on the test hosts: commands over SSH, a tmux host's inventory, what a host's vLLM answers."""
import re
import subprocess
from pathlib import Path

from tests.helpers.hostbed import write_inventory
from tests.helpers.vllm_proc import free_port


PHASE = re.compile(r"(loading weights|weights loaded|engine initialised|starting API server|startup complete)")


def host_sh(host, cmd, input=None, check=True):
    done = subprocess.run(host.ssh_argv(cmd), input=input, capture_output=True, text=True, timeout=60)
    if check and done.returncode:
        raise AssertionError(f"{cmd!r} on {host.name} failed: {done.stderr}")
    return done.stdout


def outputs(*procs) -> str:
    return "".join(p.stdout + p.stderr for p in procs)


def tmux_inventory(tmp_path, host, workdir, **extra):
    vars_ = {"workdir": workdir, "flavor": "cpu", "served_model_name": "standin", "port": free_port(),
             "python": "/usr/bin/python3", **extra}
    return write_inventory(tmp_path / "inventory.yaml", {"box": [host]}, host_vars={host.name: vars_})


def inventory_port(path) -> int:
    return int(re.search(r"^\s+port: (\d+)$", Path(path).read_text(), re.M).group(1))


HOST_GET = """
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=10)
    print(200)
except urllib.error.HTTPError as e:
    print(e.code)
"""
