"""The command line a user types: one flag vocabulary across tasks, the card's own spellings, one-line refusals."""

import re

import pytest

from specops import inventory
from specops.errors import InventoryError
from tests.helpers.invoke_cli import REPO, inv


def _contexts() -> dict:
    import tasks
    from specops.cli import Collection

    return {ctx.name: ctx for ctx in Collection.from_module(tasks).to_contexts()}


def test_a_one_letter_flag_has_both_spellings_and_no_task_hands_out_letters():
    contexts = _contexts()
    assert {"-n", "--n"} <= set(contexts["generate"].flag_names())
    assert {"-n", "--n", "-k", "--k"} <= set(contexts["eval"].flag_names())
    for name, ctx in contexts.items():
        shorts = {f for f in ctx.flag_names() if re.fullmatch(r"-[a-z]", f)}
        own = {f"-{a.name}" for a in ctx.args.values() if len(a.name) == 1}
        assert shorts == own, f"inv {name}: one-letter flags {sorted(shorts - own)} are not its own parameters"


def test_counts_are_typed_and_defaults_are_shown():
    ctx = _contexts()
    train = dict(ctx["train"].help_tuples())
    assert "--steps=INT" in train and "--epochs=NUMBER" in train
    assert "--data=STRING" in train  # repeatable: a value placeholder all the same
    assert "(default: 60" in train["--rendezvous-timeout=NUMBER"]
    generate = dict(ctx["generate"].help_tuples())
    assert "-n INT, --n INT" in generate


@pytest.mark.parametrize("spelling", [["--n", "7"], ["--n=7"], ["-n", "7"], ["-n7"]])
def test_the_card_spelling_parses(spelling):
    from invoke import Parser
    ctx = _contexts()["generate"]
    result = Parser(contexts=[ctx]).parse_argv(["generate", *spelling])
    assert result[0].args["n"].value == 7


def test_help_shows_the_long_spelling():
    proc = inv("--help", "generate", inventory=REPO / "inventory.example.yaml")
    assert proc.returncode == 0 and "--n INT" in proc.stdout, proc.stdout


def _inventory(tmp_path, text):
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    return inventory.load(path)


LOCAL = "    local:\n      hosts:\n        me: {ansible_connection: local, workdir: .x}\n"


def test_without_on_a_task_acts_on_the_one_group_a_user_added(tmp_path):
    inv_ = _inventory(tmp_path, "all:\n  children:\n" + LOCAL +
                      "    gpu:\n      hosts:\n        a: {ansible_host: 10.0.0.1}\n")
    assert [h.name for h in inv_.select(None)] == ["a"]
    only_local = _inventory(tmp_path, "all:\n  children:\n" + LOCAL)
    assert [h.name for h in only_local.select(None)] == ["me"]
    nested = _inventory(tmp_path, "all:\n  children:\n" + LOCAL + "    gpu:\n      children:\n"
                        "        a8: {hosts: {a: {ansible_host: 10.0.0.1}}}\n"
                        "        b8: {hosts: {b: {ansible_host: 10.0.0.2}}}\n")
    assert [h.name for h in nested.select(None)] == ["a", "b"]  # the parent, not one of its children


def test_without_on_several_groups_are_refused_by_name(tmp_path):
    inv_ = _inventory(tmp_path, "all:\n  children:\n" + LOCAL + "    gpu:\n      hosts:\n        a: {}\n"
                      "    cpu:\n      hosts:\n        b: {}\n")
    with pytest.raises(InventoryError, match=r"several groups of hosts \(gpu, cpu\): pass --on GROUP"):
        inv_.select(None)
    assert [h.name for h in inv_.select("cpu")] == ["b"]


def test_an_ini_inventory_is_told_only_yaml_is_read(tmp_path):
    path = tmp_path / "hosts.ini"
    path.write_text("# my hosts\n[gpu]\nh200-a ansible_host=10.0.0.5 ansible_user=ml\n")
    proc = inv("hosts", inventory=path)
    assert proc.returncode == 2 and "INI inventory" in proc.stderr and "YAML shape" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("flag,value", [("--local-port", "70000"), ("--remote-port", "0"), ("--local-port", "-1")])
def test_a_port_out_of_range_is_one_line(flag, value):
    proc = inv("tunnel", "--on", "local", flag, value, inventory=REPO / "inventory.example.yaml")
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {flag} {value} is not a port (1-65535)", proc.stderr
