"""Which samples train together, and the held-out rows: batching's seeded draws, held_out's exclusion of
duplicate prompts, and train.py's flags around them."""
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "remote"))
from batching import cut_batches, epoch_batches, held_out_rows, shuffled  # noqa: E402


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


def test_batches_of_like_lengths_take_every_sample_once_with_far_less_padding():
    rng = random.Random(0)
    lengths = [rng.randint(20, 400) for _ in range(3000)]

    def padding(batches):
        return 1 - sum(lengths[i] for b in batches for i in b) / sum(len(b) * max(lengths[i] for i in b) for b in batches)

    batches = epoch_batches(lengths, 2048, seed=0, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 2048 for b in batches)
    assert batches == epoch_batches(lengths, 2048, seed=0, epoch=0)  # every rank, every resume
    assert batches != epoch_batches(lengths, 2048, seed=0, epoch=1)
    mixed = cut_batches(shuffled(len(lengths), 0, 0), lengths, 2048)
    assert padding(mixed) > 0.3 and padding(batches) < 0.05


def test_rows_asking_a_held_out_prompt_are_not_trained_on(tmp_path):
    import held_out

    def row(prompt, answer, system=None):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        return {"messages": messages}

    rows = [row("2+2?", "4"), row("3+3?", "6"), row("2+2?", "four"), row("2+2?", "4", system="Be brief."),
            row("3+3?", "6")]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, untrained = held_out.records([str(data)], {2})
    assert records == [rows[2]]
    assert untrained == {0, 2}  # the same first prompt; another system message makes another prompt
    assert held_out.records([str(data)], {1, 3})[1] == {1, 3, 4}
