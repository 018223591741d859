"""The inventory: an Ansible-shaped YAML file naming hosts, groups and their settings.

Shape (so `ansible-inventory -i inventory.yaml --list` reads the same file)::

    all:
      vars: {workdir: ~/specops}          # every host
      children:
        gpu:                              # a group
          vars: {flavor: gpu, tp: 8}
          hosts:
            gpu1: {ansible_host: 10.0.0.5, port: 8000}   # host vars win

Every host must sit in a group under ``all.children``. Validation errors name the
file, the host (or group) and the key, say what was expected, and exit with code 2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from .errors import InventoryError

DEFAULT_PATH = "inventory.yaml"
DEFAULT_GROUP = "local"


def _str(v):
    return isinstance(v, str) and v != ""


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _str_list(v):
    return isinstance(v, list) and all(isinstance(x, (str, int, float)) and not isinstance(x, bool) for x in v)


def _str_map(v):
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, (str, int, float)) for k, x in v.items())


def _one_of(*choices):
    def check(v):
        return v in choices

    check.expected = "one of " + ", ".join(choices)
    return check


def _gpus(v):
    return (_str(v) and all(p.strip().isdigit() for p in v.split(","))) or (
        isinstance(v, int) and not isinstance(v, bool) and v >= 0
    )


_str.expected = "a non-empty string"
_int.expected = "a positive integer"
_str_list.expected = "a list of strings"
_str_map.expected = "a mapping of NAME: value"
_gpus.expected = "GPU indices like '0,1,2,3'"

# key -> (check, default). None default = unset. Documented in README's inventory reference.
KEYS: dict[str, tuple[Callable[[Any], bool], Any]] = {
    # how to reach the host
    "ansible_host": (_str, None),  # address; default: the host's name
    "ansible_user": (_str, None),  # default: ssh_config / current user
    "ansible_port": (_int, 22),
    "ansible_ssh_private_key_file": (_str, None),
    "ansible_connection": (_one_of("ssh", "local"), "ssh"),
    "known_hosts": (_str, None),  # extra known_hosts file, besides the system ones
    # where and with what specops works there
    "workdir": (_str, "~/specops"),
    "python": (_str, "python3"),
    "flavor": (_one_of("gpu", "cpu"), "gpu"),
    "supervisor": (_one_of("auto", "systemd", "tmux"), "auto"),
    # the served model
    "model": (_str, None),
    "served_model_name": (_str, None),
    "bind": (_str, "127.0.0.1"),
    "port": (_int, 8000),
    "tp": (_int, 1),
    "gpus": (_gpus, None),
    "reasoning_parser": (_str, None),
    "max_model_len": (_int, None),
    "vllm_args": (_str_list, []),
    "env": (_str_map, {}),
}
PATH_KEYS = ("ansible_ssh_private_key_file", "known_hosts")


@dataclass(frozen=True)
class Host:
    """One host and its merged settings (all.vars < group vars < host vars)."""

    name: str
    groups: tuple[str, ...]
    vars: dict = field(compare=False, hash=False)

    def __getattr__(self, key):
        if key in KEYS:
            value = self.vars.get(key, KEYS[key][1])
            return list(value) if isinstance(value, list) else value
        raise AttributeError(key)

    @property
    def is_local(self) -> bool:
        return self.vars.get("ansible_connection") == "local"

    @property
    def address(self) -> str:
        return self.vars.get("ansible_host") or self.name


@dataclass
class Inventory:
    path: Path
    hosts: dict[str, Host]  # in file order
    groups: dict[str, list[str]]  # group -> host names, in file order

    def select(self, name: str | None) -> list[Host]:
        """Hosts for ``--on NAME``: a host, or a group (in the group's order)."""
        name = name or DEFAULT_GROUP
        if name in self.hosts:
            return [self.hosts[name]]
        if name in self.groups:
            return [self.hosts[h] for h in self.groups[name]]
        known = ", ".join(sorted(set(self.hosts) | set(self.groups))) or "none"
        raise InventoryError(f"{self.path}: --on {name!r} is neither a host nor a group (known: {known})")


def load(path: str | os.PathLike | None = None) -> Inventory:
    """Read and validate an inventory; InventoryError (exit 2) on any problem."""
    path = Path(path or os.environ.get("SPECOPS_INVENTORY") or DEFAULT_PATH)
    try:
        text = path.read_text()
    except OSError as e:
        raise InventoryError(f"{path}: cannot read the inventory ({e.strerror}); pass --inventory PATH") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise InventoryError(f"{path}: YAML syntax error{where}: {problem}") from None
    return _parse(path, doc)


def _parse(path: Path, doc) -> Inventory:
    def fail(msg):
        raise InventoryError(f"{path}: {msg}")

    if not isinstance(doc, dict) or set(doc) != {"all"} or not isinstance(doc["all"], dict):
        fail("expected a single top-level 'all:' mapping (Ansible YAML inventory shape)")
    root = doc["all"]
    if root.get("hosts"):
        name = next(iter(root["hosts"]))
        fail(f"host {name!r} is in no group: put it under all.children.<group>.hosts")
    hosts: dict[str, Host] = {}
    host_groups: dict[str, list[str]] = {}
    host_vars: dict[str, list[dict]] = {}
    groups: dict[str, list[str]] = {}
    chains: dict[str, list[dict]] = {}

    def walk(gname: str, node, inherited: list[dict], lineage: tuple[str, ...]):
        where = f"group {gname!r}"
        if node is None:
            node = {}
        if not isinstance(node, dict):
            fail(f"{where}: expected a mapping with vars/hosts/children, got {type(node).__name__}")
        extra = set(node) - {"vars", "hosts", "children"}
        if extra:
            fail(f"{where}: unknown key {sorted(extra)[0]!r} (expected vars, hosts or children)")
        gvars = _check_vars(fail, where, node.get("vars"))
        chain = inherited + [gvars]
        members = groups.setdefault(gname, [])
        hnode = node.get("hosts") or {}
        if not isinstance(hnode, dict):
            fail(f"{where}: 'hosts' must be a mapping of NAME: {{vars}}")
        for hname, hv in hnode.items():
            hname = str(hname)
            hvars = _check_vars(fail, f"host {hname!r}", hv)
            if hname not in host_vars:
                host_vars[hname] = hvars
                host_groups[hname] = []
                hosts[hname] = None  # keep file order
            host_groups[hname].extend(g for g in lineage + (gname,) if g not in host_groups[hname])
            chains.setdefault(hname, chain)  # a host's first group fixes which group vars it gets
            if hname not in members:
                members.append(hname)
        cnode = node.get("children") or {}
        if not isinstance(cnode, dict):
            fail(f"{where}: 'children' must be a mapping of GROUP: {{...}}")
        for child, cn in cnode.items():
            walk(str(child), cn, chain, lineage + (gname,))
            for h in groups[str(child)]:
                if h not in members:
                    members.append(h)

    walk("all", {k: v for k, v in root.items() if k != "hosts"}, [], ())
    for hname in list(hosts):
        merged: dict = {}
        for layer in chains[hname] + [host_vars[hname]]:
            merged.update(layer)
        for key in PATH_KEYS:
            if key in merged:
                merged[key] = str((path.parent / Path(merged[key]).expanduser()).resolve())
        workdir = merged.get("workdir", "")
        if merged.get("ansible_connection") == "local" and workdir and workdir[0] not in "~/":
            merged["workdir"] = str((path.parent / workdir).resolve())  # this machine: beside the inventory
        if "gpus" in merged:
            merged["gpus"] = str(merged["gpus"])
        hosts[hname] = Host(hname, tuple(g for g in host_groups[hname] if g != "all"), merged)
    if not hosts:
        fail("no hosts defined: add one under all.children.<group>.hosts")
    return Inventory(path, hosts, groups)


def _check_vars(fail, where: str, node) -> dict:
    if node is None:
        return {}
    if not isinstance(node, dict):
        fail(f"{where}: expected a mapping of settings, got {type(node).__name__}")
    for key, value in node.items():
        if key not in KEYS:
            hint = " (secrets belong in the environment or a secrets file, never the inventory)" if "key" in str(
                key
            ).lower() or "token" in str(key).lower() else ""
            fail(f"{where}: unknown key {key!r}{hint}; known keys: {', '.join(KEYS)}")
        check = KEYS[key][0]
        if not check(value):
            fail(f"{where}: key {key!r}: expected {check.expected}, got {value!r}")
    return dict(node)
