"""The held-out rows: batching's seeded draw, and train.py's flags around them."""
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


def test_train_refuses_held_out_flags_that_cannot_work(capsys):
    import pytest
    from train import parse_args

    base = ["--target", "t", "--data", "d", "--out", "o"]
    assert parse_args(base).val_fraction == 0.05
    assert parse_args(base + ["--states", "s", "--stream", "--epochs", "1"]).val_fraction == 0.0  # shards go
    for bad, why in ((["--eval-every", "10", "--val-fraction", "0"], "give --val-fraction > 0"),
                     (["--eval-vllm", "--val-fraction", "0"], "give --val-fraction > 0"),
                     (["--states", "s", "--stream", "--val-fraction", "0.1"], "--stream holds nothing out"),
                     (["--val-fraction", "1"], "a fraction in [0, 1)"),
                     (["--label-temperature", "0"], "--label-temperature must be positive")):
        with pytest.raises(SystemExit) as e:
            parse_args(base + bad)
        assert e.value.code == 2 and why in capsys.readouterr().err
