"""Inventory parsing and validation: every malformed file → exit 2 and one clear line."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specops import inventory
from specops.errors import InventoryError

REPO = Path(__file__).resolve().parents[2]

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
    inv = inventory.load(REPO / "inventory.example.yaml")
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
                        ["host 'a'", "key 'port'", "port number", "eighty"]),
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
    # nothing silently resolved, nothing out of range
    "conflicting_groups": ("all:\n  children:\n    a:\n      vars: {port: 8000}\n      hosts: {h: {}}\n"
                           "    b:\n      vars: {port: 8100}\n      hosts: {h: {}}\n",
                           ["host 'h'", "groups 'a' and 'b'", "'port'", "8000 vs 8100"]),
    "host_listed_twice_differently": ("all:\n  children:\n    a:\n      hosts: {h: {tp: 1}}\n"
                                      "    b:\n      hosts: {h: {tp: 2}}\n", ["host 'h'", "'tp'", "1 vs 2"]),
    "duplicate_key": ("all:\n  children:\n    g:\n      hosts:\n        a: {port: 8000, port: 8001}\n",
                      ["line 5", "duplicate key 'port'"]),
    "duplicate_host": ("all:\n  children:\n    g:\n      hosts:\n        a: {}\n        a: {tp: 2}\n",
                       ["line 6", "duplicate key 'a'", "first on line 5"]),
    "port_out_of_range": ("all:\n  children:\n    g:\n      hosts:\n        a: {port: 70000}\n",
                          ["host 'a'", "key 'port'", "1 to 65535", "70000"]),
    "ssh_port_zero": ("all:\n  children:\n    g:\n      vars: {ansible_port: 0}\n      hosts: {a: {}}\n",
                      ["group 'g'", "key 'ansible_port'", "1 to 65535"]),
    "relative_workdir": ("all:\n  children:\n    g:\n      hosts:\n        a: {workdir: specops}\n",
                         ["host 'a'", "key 'workdir'", "absolute path"]),
    "newline_in_host_name": ('all:\n  children:\n    g:\n      hosts:\n        "a\\nExecStartPre=/bin/touch /tmp/x": {}\n',
                             ["not a valid host name", "\\n"]),
    "newline_in_a_var": ('all:\n  children:\n    g:\n      hosts:\n        a: {served_model_name: "m\\nExecStartPre=/x"}\n',
                         ["host 'a'", "key 'served_model_name'", "newline"]),
    "newline_in_env": ('all:\n  children:\n    g:\n      vars: {env: {A: "1\\ntouch /tmp/x"}}\n      hosts: {a: {}}\n',
                       ["group 'g'", "key 'env'", "newline"]),
    "option_like_address": ("all:\n  children:\n    g:\n      hosts:\n        a: {ansible_host: -oProxyCommand=x}\n",
                            ["key 'ansible_host'", "start with '-'"]),
    "recursive_alias": ("all:\n  children: &c\n    g:\n      children: *c\n", ["recursive"]),
}


def _inv(args, inventory_path):
    env = {**os.environ, "SPECOPS_INVENTORY": str(inventory_path)}
    return subprocess.run([sys.executable, "-m", "specops", *args], cwd=REPO, env=env,
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
    proc = _inv(["hosts", "--on", "local", "--json"], REPO / "inventory.example.yaml")
    assert proc.returncode == 0, proc.stderr
    import json

    (row,) = json.loads(proc.stdout)
    assert row["ok"] and row["host"] == "localhost"
    assert row["python"].startswith("3.") and row["gpus"] == "none" and row["tmux"] in (True, False)


def test_host_in_several_groups_gets_each_groups_vars_child_over_parent(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text("""
all:
  vars: {port: 8000}
  children:
    parent:
      vars: {tp: 2, flavor: cpu}
      hosts: {h: {}}
      children:
        child:
          vars: {tp: 4}
          hosts: {h: {}}
    other:
      vars: {max_model_len: 4096}
      hosts: {h: {}}
    clash:
      vars: {tp: 8}
      hosts: {h: {tp: 1}}
""")
    (h,) = inventory.load(path).select("other")
    # child's tp over its parent's; other's key added (it used to be dropped: first group only);
    # the host's own tp settles the clash between unrelated groups
    assert (h.tp, h.flavor, h.max_model_len, h.port) == (1, "cpu", 4096, 8000)
    path.write_text(path.read_text().replace("hosts: {h: {tp: 1}}", "hosts: {h: {}}"))
    with pytest.raises(InventoryError, match="groups 'child' and 'clash', which set 'tp' differently"):
        inventory.load(path)


def _limited(max_bytes):
    """A child process that cannot take more than max_bytes of memory (so a regression fails, not swaps)."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))
    return limit


def test_yaml_alias_bomb_fails_fast_with_a_short_line(tmp_path):
    levels = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    levels += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    path = tmp_path / "inventory.yaml"  # 10 levels of 9: 3.5 billion strings once expanded
    path.write_text("all:\n  children:\n    g:\n      hosts:\n        a:\n          vllm_args:\n"
                    + "".join(f"            - {line.split(': ', 1)[1]}\n" for line in levels))
    started = time.monotonic()
    env = {**os.environ, "SPECOPS_INVENTORY": str(path)}
    proc = subprocess.run([sys.executable, "-m", "specops", "hosts"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60, preexec_fn=_limited(3 << 30))
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr[-500:]
    (line,) = proc.stderr.strip().splitlines()
    assert "more than 100000 YAML nodes" in line and len(line) < 300, line
    assert elapsed < 20, elapsed


def test_non_utf8_inventory_is_one_line(tmp_path):
    path = tmp_path / "inventory.yaml"
    path.write_bytes(b"all:\n  children:\n    g:\n      hosts:\n        caf\xe9: {}\n")
    with pytest.raises(InventoryError, match=r"not UTF-8 text \(byte 0xe9 on line 5\); save it as UTF-8"):
        inventory.load(path)
    proc = _inv(["hosts"], path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {path}: not UTF-8 text (byte 0xe9 on line 5); save it as UTF-8"]
