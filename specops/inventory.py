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

The file is the user's, but its values end up in command lines, systemd units and shell
scripts on the hosts, so it is read as untrusted text: at most MAX_BYTES of UTF-8, at most
MAX_NODES YAML nodes once aliases are expanded (an alias "billion laughs" fails at once
instead of eating memory), no duplicate keys, no control characters in any value, host
names by Ansible's rules, ports in range, and an absolute workdir on remote hosts. A host
listed in two groups gets the vars of both (a child group's over its parent's, as Ansible
does); two unrelated groups that set one key differently are an error, not a silent pick.
"""

from __future__ import annotations

import os
import posixpath
import re
import reprlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import yaml

from .errors import InventoryError

DEFAULT_PATH = "inventory.yaml"
DEFAULT_GROUP = "local"
MAX_BYTES = 16 << 20  # an inventory is a few kB; anything this big is the wrong file
MAX_NODES = 100_000  # YAML nodes after alias expansion: thousands of hosts, not a billion laughs
MAX_GROUP_DEPTH = 50
# Ansible's host names: a name or address, no spaces; ':' (host:port) and '[a:b]' (ranges) mean
# something else to Ansible, so they are refused rather than read differently.
HOST_NAME = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,251}[A-Za-z0-9_])?$")
GROUP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,99}$")  # Ansible: identifier-like (dashes tolerated)
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _str(v):
    return isinstance(v, str) and v != ""


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _port(v):
    return _int(v) and v <= 65535


def _word(v):
    """An address or user name: becomes an ssh/rsync argument, so never option-like or spaced."""
    return _str(v) and not v.startswith("-") and not any(c.isspace() for c in v)


def _str_list(v):
    return isinstance(v, list) and all(isinstance(x, (str, int, float)) and not isinstance(x, bool) for x in v)


def _str_map(v):
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, (str, int, float)) for k, x in v.items())


def _one_of(*choices):
    def check(v):
        return v in choices

    check.expected = "one of " + ", ".join(choices)
    return check


def _share(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1


def _gpus(v):
    return (_str(v) and all(p.strip().isdigit() for p in v.split(","))) or (
        isinstance(v, int) and not isinstance(v, bool) and v >= 0
    )


_str.expected = "a non-empty string"
_int.expected = "a positive integer"
_port.expected = "a port number from 1 to 65535"
_word.expected = "a name without spaces that does not start with '-'"
_str_list.expected = "a list of strings"
_str_map.expected = "a mapping of NAME: value"
_gpus.expected = "GPU indices like '0,1,2,3'"
_share.expected = "a fraction between 0 and 1, e.g. 0.2"

def _setting(check: Callable[[Any], bool], default: Any = None):
    """A host setting (a field of Host): how its value is checked, and its default (None: unset)."""
    return field(init=False, compare=False, repr=False, metadata={"check": check, "default": default})


@dataclass(frozen=True)
class Host:
    """One host and its merged settings (all.vars < group vars < host vars), each a field below.

    The settings are the inventory's keys, documented in README's inventory reference.
    """

    name: str
    groups: tuple[str, ...]
    vars: dict = field(compare=False, hash=False, repr=False)
    # how to reach the host
    ansible_host: str | None = _setting(_word)  # address; default: the host's name
    ansible_user: str | None = _setting(_word)  # default: ssh_config / current user
    ansible_port: int = _setting(_port, 22)
    ansible_ssh_private_key_file: str | None = _setting(_str)
    ansible_connection: str = _setting(_one_of("ssh", "local"), "ssh")
    known_hosts: str | None = _setting(_str)  # extra known_hosts file, besides the system ones
    private_address: str | None = _setting(_word)  # where the group's other hosts reach this one; default: ansible_host
    # where and with what specops works there
    workdir: str = _setting(_str, "~/specops")
    python: str = _setting(_str, "python3")
    flavor: str = _setting(_one_of("gpu", "cpu"), "gpu")
    supervisor: str = _setting(_one_of("auto", "systemd", "tmux"), "auto")
    # the served model
    model: str | None = _setting(_str)
    served_model_name: str | None = _setting(_str)
    bind: str = _setting(_str, "127.0.0.1")
    port: int = _setting(_port, 8000)
    tp: int = _setting(_int, 1)
    gpus: str | None = _setting(_gpus)
    reasoning_parser: str | None = _setting(_str)
    max_model_len: int | None = _setting(_int)
    vllm_args: tuple[str, ...] = _setting(_str_list, ())
    env: dict = _setting(_str_map, {})
    train_eval_gpu_share: float | None = _setting(_share)  # GPU memory a vLLM measuring drafts may take beside training

    def __post_init__(self):
        for key, (_, default) in KEYS.items():
            value = self.vars.get(key, default)
            if isinstance(value, (list, dict)):  # a host's own copy, never the shared default
                value = tuple(value) if isinstance(value, list) else dict(value)
            object.__setattr__(self, key, value)

    @property
    def is_local(self) -> bool:
        return self.vars.get("ansible_connection") == "local"

    @property
    def address(self) -> str:
        return self.vars.get("ansible_host") or self.name


# key -> (check, default), from Host's fields: the one list of inventory keys.
KEYS: dict[str, tuple[Callable[[Any], bool], Any]] = {
    f.name: (f.metadata["check"], f.metadata["default"]) for f in fields(Host) if "check" in f.metadata}
PATH_KEYS = ("ansible_ssh_private_key_file", "known_hosts")


@dataclass
class Inventory:
    path: Path
    hosts: dict[str, Host]  # in file order
    groups: dict[str, list[str]]  # group -> host names, in file order

    def select(self, name: str | None) -> list[Host]:
        """Hosts for ``--on NAME``: a host, or a group (in the group's order); no name: :meth:`default_group`."""
        name = name or self.default_group()
        if name in self.hosts:
            return [self.hosts[name]]
        if name in self.groups:
            return [self.hosts[h] for h in self.groups[name]]
        known = ", ".join(sorted(set(self.hosts) | set(self.groups))) or "none"
        raise InventoryError(f"{self.path}: --on {name!r} is neither a host nor a group (known: {known})")

    def default_group(self) -> str:
        """The group a command without ``--on`` acts on: the one group of hosts besides the embedded
        ``local`` one where there is exactly one (the host a user just added), ``local`` where there is
        none; with several, the user must say which (a guess could act on the wrong machines)."""
        remote = [g for g, members in self.groups.items() if g not in ("all", DEFAULT_GROUP) and members
                  and not any(set(members) < set(self.groups[o]) for o in self.groups if o not in ("all", g))]
        if len(remote) == 1:
            return remote[0]
        if not remote:
            return DEFAULT_GROUP
        raise InventoryError(f"{self.path}: several groups of hosts ({', '.join(remote)}): pass --on GROUP "
                             f"(or set specops.on in invoke.yaml)")


def load(path: str | os.PathLike | None = None) -> Inventory:
    """Read and validate an inventory; InventoryError (exit 2) on any problem."""
    path = Path(path or os.environ.get("SPECOPS_INVENTORY") or DEFAULT_PATH)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        hint = " (./scripts/setup writes it from inventory.example.yaml)" if str(path) == DEFAULT_PATH else ""
        raise InventoryError(f"{path}: cannot read the inventory (no such file){hint}; pass --inventory PATH") from None
    except OSError as e:
        raise InventoryError(f"{path}: cannot read the inventory ({e.strerror}); pass --inventory PATH") from None
    if len(raw) > MAX_BYTES:
        raise InventoryError(f"{path}: larger than {MAX_BYTES >> 20} MiB; an inventory is a few kB: is this "
                             f"the right file? (pass --inventory PATH)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise InventoryError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line}); "
                             f"save it as UTF-8") from None
    return _parse(path, _yaml(path, text))


def _yaml(path: Path, text: str):
    """The YAML document, checked at the node level before anything is built from it."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(path, node)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        ini = " (this looks like an INI inventory: specops reads only Ansible's YAML shape, see " \
              "inventory.example.yaml; `ansible-inventory -i FILE -y --list` converts one)" if _looks_ini(text) else ""
        raise InventoryError(f"{path}: YAML syntax error{where}: {problem}{ini}") from None
    except RecursionError:
        raise InventoryError(f"{path}: YAML nested too deeply to be an inventory") from None
    finally:
        loader.dispose()


def _looks_ini(text: str) -> bool:
    """An Ansible INI inventory opens with a ``[group]`` header (after comments)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith(("#", ";"))]
    return bool(lines) and re.fullmatch(r"\[[^\]]+\]", lines[0]) is not None


def _check_nodes(path: Path, root: yaml.Node) -> None:
    """Refuse duplicate keys, recursive aliases and documents that expand to more than MAX_NODES
    nodes. Aliases share nodes, so the expanded size is counted once per node (linear time)."""
    size: dict[int, int] = {}
    open_: set[int] = set()  # nodes whose subtree is being walked: meeting one again is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = ([x for pair in node.value for x in pair] if isinstance(node, yaml.MappingNode)
                    else node.value if isinstance(node, yaml.SequenceNode) else [])
        if done:
            open_.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children)
            if size[key] > MAX_NODES:
                raise InventoryError(f"{path}: expands to more than {MAX_NODES} YAML nodes through its aliases "
                                     f"(line {node.start_mark.line + 1}); an inventory is never that big")
            continue
        if key in size:
            continue
        if key in open_:
            raise InventoryError(f"{path}: line {node.start_mark.line + 1}: a YAML alias refers to a node that "
                                 f"contains it; an inventory cannot be recursive")
        open_.add(key)
        if isinstance(node, yaml.MappingNode):
            _no_duplicate_keys(path, node)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)


def _no_duplicate_keys(path: Path, node: yaml.MappingNode) -> None:
    seen: dict[str, int] = {}
    for key, _ in node.value:
        if key.tag == "tag:yaml.org,2002:merge" or not isinstance(key, yaml.ScalarNode):
            continue
        line = key.start_mark.line + 1
        if key.value in seen:
            raise InventoryError(f"{path}: line {line}: duplicate key {_shown(key.value)} (first on line "
                                 f"{seen[key.value]}); YAML would keep only the last one: write it once")
        seen[key.value] = line


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 2, 60, 60, 4, 4


def _shown(value) -> str:
    """A value as an error message shows it: repr, bounded (one short line whatever the file holds)."""
    return _REPR.repr(value)


def _parse(path: Path, doc) -> Inventory:
    def fail(msg):
        raise InventoryError(f"{path}: {msg}")

    if not isinstance(doc, dict) or set(doc) != {"all"} or not isinstance(doc["all"], dict):
        fail("expected a single top-level 'all:' mapping (Ansible YAML inventory shape)")
    root = doc["all"]
    if root.get("hosts"):
        name = next(iter(root["hosts"])) if isinstance(root["hosts"], dict) else root["hosts"]
        fail(f"host {_shown(name)} is in no group: put it under all.children.<group>.hosts")
    host_groups: dict[str, list[str]] = {}
    host_vars: dict[str, dict] = {}  # in file order
    groups: dict[str, list[str]] = {}
    chains: dict[str, list[list[tuple[str, dict]]]] = {}  # host -> every (group, vars) path that lists it
    parents: dict[str, set[str]] = {}

    def walk(gname: str, node, inherited: list[tuple[str, dict]], lineage: tuple[str, ...]):
        where = f"group {_shown(gname)}"
        if len(lineage) > MAX_GROUP_DEPTH:
            fail(f"{where}: groups nested more than {MAX_GROUP_DEPTH} deep")
        if node is None:
            node = {}
        if not isinstance(node, dict):
            fail(f"{where}: expected a mapping with vars/hosts/children, got {type(node).__name__}")
        extra = set(node) - {"vars", "hosts", "children"}
        if extra:
            fail(f"{where}: unknown key {_shown(sorted(map(str, extra))[0])} (expected vars, hosts or children)")
        chain = inherited + [(gname, _check_vars(fail, where, node.get("vars")))]
        members = groups.setdefault(gname, [])
        hnode = node.get("hosts") or {}
        if not isinstance(hnode, dict):
            fail(f"{where}: 'hosts' must be a mapping of NAME: {{vars}}")
        for hname, hv in hnode.items():
            hname = _host_name(fail, hname)
            hvars = _check_vars(fail, f"host {hname!r}", hv)
            if hname not in host_vars:
                host_vars[hname] = hvars
                host_groups[hname] = []
            for key, value in hvars.items():  # listed twice: its own vars are the union, never a silent pick
                if host_vars[hname].setdefault(key, value) != value:
                    fail(f"host {hname!r} is listed twice with different values for {key!r} "
                         f"({_shown(host_vars[hname][key])} vs {_shown(value)}); give it once")
            host_groups[hname].extend(g for g in lineage + (gname,) if g not in host_groups[hname])
            chains.setdefault(hname, []).append(chain)
            if hname not in members:
                members.append(hname)
        cnode = node.get("children") or {}
        if not isinstance(cnode, dict):
            fail(f"{where}: 'children' must be a mapping of GROUP: {{...}}")
        for child, cn in cnode.items():
            child = _group_name(fail, child)
            parents.setdefault(child, set()).add(gname)
            walk(child, cn, chain, lineage + (gname,))
            for h in groups[child]:
                if h not in members:
                    members.append(h)

    walk("all", {k: v for k, v in root.items() if k != "hosts"}, [], ())
    hosts: dict[str, Host] = {}
    for hname in host_vars:
        merged = _merge(fail, hname, chains[hname], host_vars[hname], _ancestors(parents))
        for key in PATH_KEYS:
            if key in merged:
                merged[key] = str((path.parent / Path(merged[key]).expanduser()).resolve())
        workdir = merged.get("workdir", KEYS["workdir"][1])
        if not (workdir.startswith("/") or workdir == "~" or workdir.startswith("~/")):
            if merged.get("ansible_connection") != "local":
                fail(f"host {hname!r}: key 'workdir': expected an absolute path or ~/PATH, got {_shown(workdir)} "
                     f"(a relative path has no fixed meaning on a remote host)")
            merged["workdir"] = str((path.parent / workdir).resolve())  # this machine: beside the inventory
        if "gpus" in merged:
            merged["gpus"] = str(merged["gpus"])
        hosts[hname] = Host(hname, tuple(g for g in host_groups[hname] if g != "all"), merged)
    if not hosts:
        fail("no hosts defined: add one under all.children.<group>.hosts")
    _no_shared_workdir(fail, hosts)
    return Inventory(path, hosts, groups)


def _no_shared_workdir(fail, hosts: dict[str, Host]) -> None:
    """Two entries for one machine (same address and port, or both this machine) must not share a
    workdir: they would share its service (each `inv serve` restarting the other's), its runs and
    their tmux sessions."""
    seen: dict[tuple, str] = {}
    for host in hosts.values():
        key = _workdir_key(host)
        if key in seen:
            where = "this machine" if host.is_local else f"{host.address} port {host.ansible_port}"
            fail(f"hosts {seen[key]!r} and {host.name!r} are one machine ({where}) with one workdir "
                 f"{_shown(host.workdir)}: each `inv serve` would restart the other's service and their runs "
                 f"would mix; give each entry its own workdir (and port)")
        seen[key] = host.name


def _workdir_key(host: Host) -> tuple:
    """(machine, workdir) as the host sees it: ``~`` is the login user's home, so on one machine
    ``~/specops`` of two users are two workdirs."""
    workdir = host.workdir
    if host.is_local:
        return ("local", posixpath.normpath(os.path.expanduser(workdir)))
    user = host.ansible_user if workdir == "~" or workdir.startswith("~/") else None
    return (host.address.lower(), host.ansible_port, user, posixpath.normpath(workdir))


def _host_name(fail, name) -> str:
    if isinstance(name, bool) or not isinstance(name, (str, int)):
        fail(f"host {_shown(name)}: a host name is a string")
    name = str(name)
    if not HOST_NAME.match(name):
        fail(f"host {_shown(name)}: not a valid host name: letters, digits, '.', '-' and '_' only (an address "
             f"or a port goes in ansible_host / ansible_port)")
    return name


def _group_name(fail, name) -> str:
    if not isinstance(name, str) or not GROUP_NAME.match(name):
        fail(f"group {_shown(name)}: not a valid group name: a letter or '_', then letters, digits, '_' or '-'")
    return name


def _ancestors(parents: dict[str, set[str]]):
    """ancestors(group): every group above it, through any parent."""
    memo: dict[str, set[str]] = {}

    def ancestors(group: str) -> set[str]:
        if group not in memo:
            seen, todo = set(), list(parents.get(group, ()))
            while todo:
                g = todo.pop()
                if g not in seen:
                    seen.add(g)
                    todo.extend(parents.get(g, ()))
            memo[group] = seen
        return memo[group]

    return ancestors


def _merge(fail, hname: str, chains: list[list[tuple[str, dict]]], own: dict, ancestors) -> dict:
    """A host's settings: its own vars over its groups' (a child group's over its parents', all's last).

    A host listed under several groups takes each key from the deepest group that sets it; when
    two groups neither of which is inside the other set it differently, and the host does not set
    it itself, there is no right answer: refuse, naming both."""
    merged: dict = {}
    keys = list(dict.fromkeys(k for chain in chains for _, layer in chain for k in layer))
    for key in keys:
        deciding: dict[str, object] = {}  # group -> its value, the innermost setter along each path
        for chain in chains:
            for group, layer in reversed(chain):
                if key in layer:
                    deciding.setdefault(group, layer[key])
                    break
        winners = [g for g in deciding if not any(g in ancestors(o) for o in deciding if o != g)] or list(deciding)
        first = deciding[winners[0]]
        other = next((g for g in winners if deciding[g] != first), None)
        if other is not None and key not in own:
            fail(f"host {hname!r} is in groups {winners[0]!r} and {other!r}, which set {key!r} differently "
                 f"({_shown(first)} vs {_shown(deciding[other])}); set it on the host, or in one group only")
        merged[key] = first
    merged.update(own)
    return merged


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
            fail(f"{where}: unknown key {_shown(key)}{hint}; known keys: {', '.join(KEYS)}")
        check = KEYS[key][0]
        if not check(value):
            fail(f"{where}: key {key!r}: expected {check.expected}, got {_shown(value)}")
        if _has_control(value):
            fail(f"{where}: key {key!r} holds a newline or another control character; its values go into "
                 f"command lines and service files, which cannot hold one")
    return dict(node)


def _has_control(value) -> bool:
    if isinstance(value, str):
        return bool(CONTROL.search(value))
    if isinstance(value, dict):
        return any(_has_control(k) or _has_control(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_control(v) for v in value)
    return False
