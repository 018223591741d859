"""Glue between Invoke tasks and specops: host selection and clean user errors."""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import sys

import invoke

from . import inventory
from .errors import SpecopsError


class Task(invoke.Task):
    """An Invoke task whose flags read the same in every task.

    Long flags only (Invoke would otherwise hand out one-letter flags by first free letter, so
    ``-a`` meant a different flag in each task); a one-letter parameter keeps its ``-n`` and also
    answers to ``--n`` (:class:`ParserContext`); a parameter annotated ``int`` or ``float`` is
    parsed as one even when its default is None; ``--help`` shows each default.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("auto_shortflags", False)
        super().__init__(*args, **kwargs)

    def arg_opts(self, name, default, taken_names):
        opts = super().arg_opts(name, default, taken_names)
        kind = inspect.signature(self.body).parameters[name].annotation
        kind = {"int": int, "float": float}.get(kind, kind)  # string annotations too
        if kind in (int, float) and opts.get("kind") is not list:
            opts["kind"] = kind
        shown = _shown_default(default)
        if shown and "default" not in opts.get("help", "") and not opts.get("positional"):
            opts["help"] = f"{opts.get('help', '')} (default: {shown})".lstrip()
        return opts


def _shown_default(default) -> str | None:
    if default in (None, False, [], "", inspect.Parameter.empty) or isinstance(default, bool):
        return None
    return str(default)


class ParserContext(invoke.ParserContext):
    """Invoke's parser context, where a one-letter flag also has a long spelling: ``-n 10`` and
    ``--n 10`` (the design card's ``inv generate --n 10000``) are the same flag. Invoke itself only
    ever spells a one-letter flag with one dash."""

    def add_arg(self, *args, **kwargs):
        arg = args[0] if len(args) == 1 and isinstance(args[0], invoke.Argument) else invoke.Argument(*args, **kwargs)
        super().add_arg(arg)
        for name in arg.names:
            if len(name) == 1:
                self.flags.alias(f"--{name}", to=f"-{name}")

    def help_for(self, flag):
        names, text = super().help_for(flag)
        value = {list: "STRING", float: "NUMBER"}.get(self.flags[flag].kind)  # Invoke draws only STRING and INT
        if value and "=" not in names:
            names = ", ".join(f"{n}={value}" if n.startswith("--") else f"{n} {value}" for n in names.split(", "))
        return names, text


class Collection(invoke.Collection):
    """A task collection parsed with :class:`ParserContext`."""

    @classmethod
    def of(cls, other: invoke.Collection) -> "Collection":
        """``other``'s tasks, sub-collections and configuration in a :class:`Collection`."""
        new = cls(other.name)
        for name, t in other.tasks.items():
            new.add_task(t, name=name, default=other.default == name)
        for name, sub in other.collections.items():
            new.add_collection(sub, name=name)
        new.configure(other.configuration())
        return new

    def to_contexts(self, ignore_unknown_help=None):
        return [ParserContext(name=c.name, aliases=c.aliases, args=c.args.values())
                for c in super().to_contexts(ignore_unknown_help=ignore_unknown_help)]


class Program(invoke.Program):
    """Invoke's ``inv``, reading tasks.py as Invoke does and parsing it with :class:`ParserContext`.

    pyproject installs it as the venv's ``inv`` (and ``python -m specops``)."""

    def load_collection(self):
        super().load_collection()
        self.collection = Collection.of(self.collection)


program = Program(name="specops", binary="inv", binary_names=["inv"], version=importlib.metadata.version("specops"))


def task(*args, **kwargs):
    """:class:`Task` whose SpecopsErrors become one line on stderr and an exit code."""

    def decorate(body):
        @functools.wraps(body)
        def wrapper(c, *a, **kw):
            try:
                code = body(c, *a, **kw)
            except SpecopsError as e:
                raise invoke.Exit(f"error: {e}", code=e.exit_code) from None
            if code:
                raise invoke.Exit(code=code)

        return invoke.task(*args, klass=Task, **kwargs)(wrapper)

    return decorate


def select_hosts(c, inventory_path: str | None, on: str | None):
    """The hosts for ``--on`` (default: invoke.yaml's specops.on, else the inventory's default group)."""
    inv = inventory.load(inventory_path or c.config.get("specops", {}).get("inventory"))
    return inv.select(on or c.config.get("specops", {}).get("on"))


HOST_HELP = {
    "on": "host or group to act on (default: the inventory's one group besides `local`, else `local`)",
    "inventory": "inventory file (default: $SPECOPS_INVENTORY or inventory.yaml)",
}


def remainder() -> list[str]:
    """Arguments after ``--`` on the command line, token for token (passed on to a remote script).

    Invoke keeps only a space-joined string of them, which loses quoting; argv does not.
    """
    return sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
