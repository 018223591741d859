"""Inventory parsing and validation: every malformed file → exit 2 and one clear line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specops import inventory
from specops.errors import InventoryError

REPO = Path(__file__).resolve().parent.parent

GOOD = """
all:
  vars: {workdir: /srv/specops, port: 8000}
  children:
    gpu:
      vars: {flavor: gpu, tp: 8, port: 8100}
      hosts:
        a: {ansible_host: 10.1.1.1, port: 8200}
        b: {ansible_host: 10.1.1.2}
    local:
      hosts:
        me: {ansible_connection: local, flavor: cpu, workdir: .specops/x}
"""


def test_vars_merge_host_over_group_over_all(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text(GOOD)
    inv = inventory.load(path)
    a, b = inv.select("gpu")
    assert (a.name, a.port, a.tp, a.workdir, a.flavor) == ("a", 8200, 8, "/srv/specops", "gpu")
    assert (b.port, b.address, b.ansible_port, b.python) == (8100, "10.1.1.2", 22, "python3")
    me = inv.select("me")[0]
    assert me.is_local and me.workdir == str(tmp_path / ".specops/x")
    assert [h.name for h in inv.select("all")] == ["a", "b", "me"]


def test_shipped_inventory_is_valid():
    inv = inventory.load(REPO / "inventory.yaml")
    (local,) = inv.select(None)
    assert local.is_local and local.flavor == "cpu" and local.bind == "127.0.0.1"


# (inventory text, words the one-line message must contain)
MALFORMED = {
    "yaml_syntax": ("all:\n  children: [unclosed\n", ["YAML syntax error", "line"]),
    "not_all": ("hosts:\n  a: {}\n", ["top-level 'all:'"]),
    "unknown_host_key": ("all:\n  children:\n    g:\n      hosts:\n        a: {prot: 8000}\n",
                         ["host 'a'", "unknown key 'prot'"]),
    "secret_in_inventory": ("all:\n  children:\n    g:\n      hosts:\n        a: {api_key: sk-123}\n",
                            ["host 'a'", "'api_key'", "secrets"]),
    "wrong_type_port": ("all:\n  children:\n    g:\n      hosts:\n        a: {port: eighty}\n",
                        ["host 'a'", "key 'port'", "positive integer", "eighty"]),
    "bad_flavor": ("all:\n  children:\n    g:\n      vars: {flavor: tpu}\n      hosts: {a: {}}\n",
                   ["group 'g'", "key 'flavor'", "one of gpu, cpu"]),
    "vllm_args_not_list": ("all:\n  children:\n    g:\n      hosts:\n        a: {vllm_args: --enforce-eager}\n",
                           ["key 'vllm_args'", "list of strings"]),
    "env_not_map": ("all:\n  children:\n    g:\n      hosts:\n        a: {env: [A=1]}\n",
                    ["key 'env'", "mapping"]),
    "host_in_no_group": ("all:\n  hosts:\n    lonely: {}\n", ["'lonely'", "in no group"]),
    "no_hosts": ("all:\n  children:\n    g: {}\n", ["no hosts defined"]),
    "bad_gpus": ("all:\n  children:\n    g:\n      hosts:\n        a: {gpus: 'zero,one'}\n",
                 ["key 'gpus'", "GPU indices"]),
    "unknown_group_key": ("all:\n  children:\n    g:\n      host: {a: {}}\n", ["group 'g'", "unknown key 'host'"]),
}


def _inv(args, inventory_path):
    env = {**os.environ, "SPECOPS_INVENTORY": str(inventory_path)}
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_inventory_exits_2_with_one_line(tmp_path, case):
    text, words = MALFORMED[case]
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    with pytest.raises(InventoryError) as info:
        inventory.load(path)
    message = str(info.value)
    assert str(path) in message
    for word in words:
        assert word in message, message
    proc = _inv(["hosts"], path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {message}"]


def test_unknown_on_name_and_missing_file(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text(GOOD)
    proc = _inv(["hosts", "--on", "nosuch"], path)
    assert proc.returncode == 2 and "'nosuch' is neither a host nor a group" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = _inv(["hosts"], tmp_path / "absent.yaml")
    assert proc.returncode == 2 and "cannot read the inventory" in proc.stderr


def test_inv_hosts_local_prints_a_real_row():
    proc = _inv(["hosts", "--on", "local", "--json"], REPO / "inventory.yaml")
    assert proc.returncode == 0, proc.stderr
    import json

    (row,) = json.loads(proc.stdout)
    assert row["ok"] and row["host"] == "localhost"
    assert row["python"].startswith("3.") and row["gpus"] == "none" and row["tmux"] in (True, False)
