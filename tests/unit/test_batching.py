"""remote/batching.py's held-out rows: whole rows, a fixed share, the same for every rank and resume."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "remote"))
from batching import held_out_rows  # noqa: E402


def test_held_out_rows_are_a_seeded_share_of_the_rows():
    rows = held_out_rows(200, 0.15, seed=0)
    assert len(rows) == 30 and rows <= set(range(200))
    assert rows == held_out_rows(200, 0.15, seed=0)  # every rank, every resume: the same rows
    assert rows != held_out_rows(200, 0.15, seed=1)
    assert rows != set(range(30))  # drawn, not the file's head (a sorted file would hold out one kind)


def test_held_out_rows_never_take_every_row_and_zero_takes_none():
    assert held_out_rows(10, 0.0, seed=0) == set()
    assert held_out_rows(1, 0.5, seed=0) == set()  # one row: it is trained on
    assert len(held_out_rows(2, 0.9, seed=0)) == 1
    assert len(held_out_rows(100, 0.001, seed=0)) == 1  # a positive share holds out at least one row
