"""What remote/generate.py reads, refuses and parses, without a server: its arguments and output
directory, dataset files and rows in every shape (the one conversation normaliser, shared with the
trainer), and where a reply's reasoning is found.
"""
import fcntl
import json
import sys

import pytest

from tests.helpers.generate_cli import ROOT, generate, padded_rows, prompt_rows, write_jsonl

sys.path.insert(0, str(ROOT / "remote"))

from chat_render import normalise  # noqa: E402
from datasets_io import prompt_chunks, row_messages  # noqa: E402

SHAPES = {
    "openai": {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                            {"role": "assistant", "content": "A", "reasoning": "R"}]},
    "sharegpt": {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                   {"from": "gpt", "value": "A", "reasoning": "R"}]},
    "specforge": {"conversations": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                                    {"role": "assistant", "content": "A", "reasoning_content": "R"}]},
    "aliases": {"messages": [{"role": "developer", "content": "S"}, {"role": "user", "content": "Q"},
                             {"role": "model", "content": "A", "reasoning": "R"}]},
}


def test_reasoning_field_then_reasoning_content_then_think_tags():
    from generate import split_reasoning

    assert split_reasoning({"content": "\n\nA", "reasoning": "\nR\n"}) == ("\nR\n", "\n\nA")
    assert split_reasoning({"content": "A", "reasoning_content": "R"}) == ("R", "A")
    assert split_reasoning({"content": "<think>\nR\n</think>\n\nA"}) == ("\nR\n", "\n\nA")
    assert split_reasoning({"content": "R</think>A"}) == ("R", "A")  # <think> was in the prompt
    assert split_reasoning({"content": "A"}) == (None, "A")
    assert split_reasoning({"content": None, "reasoning": "R"}) == ("R", None)


def test_a_damaged_line_before_the_last_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "data.jsonl").write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    result = generate("--endpoint", "http://127.0.0.1:9", "--dataset",
                      write_jsonl(tmp_path / "p.jsonl", prompt_rows(2)), "--out", out)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"generate: {out / 'data.jsonl'}: line 2 is not a complete record; repair or remove it"]


def test_missing_dataset_is_one_clear_line(tmp_path):
    # Offline mode answers at once; without it the hub client retries for ~25 s, same message.
    result = generate("--endpoint", "http://127.0.0.1:9", "--out", tmp_path / "out",
                      env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "generate: cannot open dataset 'mlabonne/open-perfectblend': "), result.stderr


@pytest.mark.parametrize("args, message", [
    (["--shard", "2/2"], "need I/K with 0 <= I < K"),
    (["--resume"], "holds no data.jsonl to resume"),
    (["--concurrency", "0"], "must be at least 1"),
])
def test_bad_arguments_exit_2_with_a_reason(tmp_path, args, message):
    result = generate("--endpoint", "http://127.0.0.1:9", "--dataset",
                      write_jsonl(tmp_path / "p.jsonl", prompt_rows(2)), "--out",
                      tmp_path / "out", *args)
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_second_generator_in_the_same_directory_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = generate("--endpoint", "http://127.0.0.1:9", "--dataset",
                          write_jsonl(tmp_path / "p.jsonl", prompt_rows(2)), "--out", out)
    assert result.returncode == 2
    assert result.stderr.strip() == f"generate: {out}: another generator is writing here"


def test_a_directory_of_json_files_is_read_line_by_line_too(tmp_path):
    from datasets_io import open_rows

    # A directory went through `datasets` with its default 10 MB chunks: the bad row comes after them.
    (tmp_path / "data").mkdir()
    rows = padded_rows(30, 400_000) + [{"id": "bad", "pad": "", "conversations": "What is 2 + 2?"}]
    write_jsonl(tmp_path / "data" / "train-0.jsonl", rows)
    write_jsonl(tmp_path / "data" / "train-1.jsonl", [{"id": "next-file", "prompt": "Is 5 odd?"}])
    write_jsonl(tmp_path / "data" / "test.jsonl", [{"id": "other-split", "prompt": "Is 6 odd?"}])
    read = [(where.rsplit("/", 1)[1], row["id"]) for where, row in open_rows(str(tmp_path))]
    assert read == [*((f"train-0.jsonl:{i + 1}", f"r{i}") for i in range(30)), ("train-0.jsonl:31", "bad"),
                    ("train-1.jsonl:1", "next-file")]
    with pytest.raises(Exception, match=r"has no split 'validation' \(it has train, test\)"):
        open_rows(str(tmp_path), "validation")


@pytest.mark.parametrize("rows, seen", [
    ([{"text": "hello", "label": 1}, {"text": "bye", "label": 0}], '{"text": str, "label": int}'),
    ([{"messages": [{"speaker": "me", "says": "hi"}]}] * 3, '{"messages": [{"speaker", "says"}]}'),
])
def test_a_dataset_in_no_shape_generate_reads_fails_in_one_line(tmp_path, rows, seen):
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    for check in ([], ["--check"]):  # --check is inv generate's preflight: it refuses at launch
        result = generate("--endpoint", "http://127.0.0.1:9", "--model", "tiny", "--dataset", prompts,
                          "--out", tmp_path / "out", *check)
        assert result.returncode == 2, result
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"generate: none of the first {len(rows)} rows of {prompts} is a "
                               'conversation generate reads: expected OpenAI {"messages": [{"role", '
                               '"content"}]}, ShareGPT {"conversations": [{"from", "value"}]} or '
                               '[{"role", "content"}], or {"prompt": str}; saw ' + seen), line
        assert f"({prompts}:1: " in line
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["outcome"] == "bad dataset"


@pytest.mark.parametrize("shape", SHAPES)
def test_generator_and_trainer_read_the_same_shapes_the_same_way(shape):
    expected = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A", "reasoning": "R"}]
    assert normalise(SHAPES[shape]) == expected
    assert prompt_chunks(row_messages(SHAPES[shape])) == [expected[:2]]


@pytest.mark.parametrize("record, reason", [
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning": 7}]},
     "message 1 reasoning is int, not a string"),
    ({"messages": [{"role": "user", "content": ["Q"]}, {"role": "assistant", "content": "A"}]},
     "message 0 content is list, not a string"),
    ({"messages": [{"role": "tool", "content": "Q"}, {"role": "assistant", "content": "A"}]},
     'message 0 has unknown role "tool"'),
    (["not", "an", "object"], "row is list, not an object"),
])
def test_generator_and_trainer_refuse_the_same_rows_with_the_same_reason(record, reason):
    for read in (normalise, row_messages):
        with pytest.raises(ValueError) as refused:
            read(record)
        assert str(refused.value) == reason
