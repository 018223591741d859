"""Flags whose default and meaning the laptop's tasks and a host script must share, each set once.

A host script's argparse adds them from here (``add``), and the laptop's argv builders and Invoke
tasks take their defaults and help from here (through ``specops.shared``), so ``inv eval`` and
``eval.py`` cannot drift apart. Stdlib only and importing nothing, for that reason.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    name: str  # the Python name; the flag is --NAME with '_' as '-'
    type: type
    default: object
    help: str

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


EVAL = {f.name: f for f in (
    Flag("n", int, 100, "prompts to send (the file's first N usable rows)"),
    Flag("k", int, 3, "num_speculative_tokens"),
)}


def add(parser, flags: dict) -> None:
    """Each flag on an argparse parser, as the host script takes it."""
    for f in flags.values():
        parser.add_argument(f.option, type=f.type, default=f.default, help=f.help)
