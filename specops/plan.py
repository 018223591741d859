"""Row plans: which host of a group generates which dataset rows, across re-plans.

A group's generate run gives each host a *shard spec*: residue classes of the dataset row
index, ``"I/K"`` (rows whose index mod K == I), several joined by ``,``. The first plan is
``i/K`` for host i of K. When hosts stop answering, :func:`replan` hands each gone host's spec
to the hosts that answer, split by the index once more: ``1/3`` split between two heirs is
``1/6`` and ``4/6``. A row's index (and so its stable id) is the same on every host, so the plan
says exactly which host owns which row however often it was re-planned; the merge
(:func:`covered`) checks that the hosts at hand own every class between them, and keeps one
copy of a row that a gone host finished as well as its heir.
"""

from __future__ import annotations

import math
from functools import reduce

from .errors import SpecopsError
from .shared import remote_module

_script = remote_module("script")

Spec = tuple[tuple[int, int], ...]  # ((I, K), ...): rows whose index mod K == I for some pair


def parse_spec(text: str) -> Spec:
    """``"0/3,1/6"`` -> ((0, 3), (1, 6)); SpecopsError on anything else (remote/script.py's reading)."""
    try:
        return _script.shard_spec(text)
    except ValueError as e:
        raise SpecopsError(str(e), exit_code=2) from None


def format_spec(spec: Spec) -> str:
    return ",".join(f"{i}/{k}" for i, k in spec)


def first_plan(names: list[str]) -> dict[str, str]:
    """Host i of K takes i/K (K > 1); a single host takes every row (no spec)."""
    return {name: f"{i}/{len(names)}" for i, name in enumerate(names)} if len(names) > 1 else {}


def split(spec: Spec, parts: int) -> list[Spec]:
    """``spec`` cut into ``parts`` disjoint specs that together are ``spec``: I/K -> (I + K*j)/(K*parts)."""
    return [tuple((i + k * j, k * parts) for i, k in spec) for j in range(parts)]


def replan(plan: dict[str, str], live: list[str]) -> dict[str, str]:
    """Each gone host's rows (plan hosts not in ``live``) split among the ``live`` ones, in order.

    The result holds the live hosts only; together they own exactly the rows the plan did.
    """
    heirs = [h for h in live if h in plan]
    if not heirs:
        raise SpecopsError("no host of the run answers: nothing to re-plan onto", exit_code=1)
    new = {h: list(parse_spec(plan[h])) for h in heirs}
    for gone in [h for h in plan if h not in live]:
        for heir, part in zip(heirs, split(parse_spec(plan[gone]), len(heirs))):
            new[heir] += part
    return {h: format_spec(tuple(spec)) for h, spec in new.items()}


def _modulus(specs: list[Spec]) -> int:
    return reduce(math.lcm, (k for spec in specs for _, k in spec), 1)


def covered(specs: list[Spec]) -> tuple[list[int], bool, int]:
    """(residues no spec owns, whether two specs share a residue, the modulus) of these specs together."""
    m = _modulus(specs)
    owners = [0] * m
    for spec in specs:
        for r in range(m):
            if any(r % k == i for i, k in spec):
                owners[r] += 1
    return [r for r in range(m) if owners[r] == 0], any(n > 1 for n in owners), m


def rows_in(spec: Spec, n: int) -> int:
    """How many of the first n row indices the spec owns."""
    return sum(1 for r in range(n) if any(r % k == i for i, k in spec))
