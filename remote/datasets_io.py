"""Dataset rows in, chat prompts out: the input side of remote/generate.py.

Rows come through `datasets` in streaming mode (a hub name, or local jsonl/json/parquet files), so
memory stays flat whatever the dataset's size. Each row of a recognised schema becomes a list of
chat messages; a row that cannot become one raises RowError with a reason, which the caller records
instead of crashing.

Recognised schemas, first match wins:
  - OpenAI:                 {"messages": [{"role": "system"|"user"|"assistant", "content": str}]}
  - ShareGPT / perfectblend: {"conversations": [{"from": "system"|"human"|"gpt", "value": str}]}
  - plain prompt:           {"prompt": str}
"""
import hashlib
import itertools
import json
import os

ROLE_ALIASES = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "chatgpt": "assistant",
}
# Local files by extension: the `datasets` builder, and how much it reads at a time. Its defaults
# (10 MB of JSON, a whole parquet row group) cost ~150 MB of RSS at once; these cost ~20.
FILE_BUILDERS = {
    ".jsonl": ("json", {"chunksize": 1 << 20}),
    ".json": ("json", {"chunksize": 1 << 20}),
    ".parquet": ("parquet", {"batch_size": 1024}),
}


class DatasetError(Exception):
    """The dataset cannot be opened or read; the message is one line for the user."""


class RowError(Exception):
    """This row cannot be turned into a prompt; the message is the reason recorded for it."""


def open_rows(name_or_path, split="train", shuffle_seed=None):
    """An iterator over the dataset's rows (dicts), checked to yield at least its first row.

    Raises DatasetError when the dataset cannot be found, reached or read. The first row is read
    here so that a missing hub dataset or an unreadable file fails before any work starts.
    """
    import datasets
    import huggingface_hub

    # datasets imports torch (~190 MB) for DataLoader workers, which a streaming reader never uses.
    datasets.config.TORCH_AVAILABLE = False
    # Both libraries log every retry of an unreachable hub; the caller prints one line instead.
    datasets.logging.set_verbosity_error()
    huggingface_hub.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        if os.path.isfile(name_or_path):
            ext = os.path.splitext(name_or_path)[1].lower()
            if ext not in FILE_BUILDERS:
                raise DatasetError(f"{name_or_path}: unsupported file type '{ext}' "
                                   f"(expected one of {', '.join(FILE_BUILDERS)})")
            builder, read_size = FILE_BUILDERS[ext]
            ds = datasets.load_dataset(builder, data_files=name_or_path, split=split,
                                       streaming=True, **read_size)
        else:
            ds = datasets.load_dataset(name_or_path, split=split, streaming=True)
        if shuffle_seed is not None:
            ds = ds.shuffle(seed=shuffle_seed, buffer_size=10_000)
        rows = iter(ds)
        first = next(rows, None)
    except DatasetError:
        raise
    except Exception as e:  # datasets raises many kinds; all mean the same thing here
        raise DatasetError(f"cannot open dataset '{name_or_path}': {one_line(e)}") from None
    if first is None:
        raise DatasetError(f"dataset '{name_or_path}' (split {split}) has no rows")
    return reading_errors(itertools.chain([first], rows), name_or_path)


def reading_errors(rows, name):
    """Re-raise any failure while reading further rows as a one-line DatasetError."""
    try:
        yield from rows
    except Exception as e:
        raise DatasetError(f"reading dataset '{name}' failed: {one_line(e)}") from None


def one_line(e):
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:300]


def take_shard(rows, n=None, shard=(0, 1)):
    """(index, row) for the first n rows (all if n is None) whose index mod K == I.

    n counts dataset rows before sharding, so K hosts with the same n cover n rows together.
    """
    index, count = shard
    for i, row in enumerate(rows if n is None else itertools.islice(rows, n)):
        if i % count == index:
            yield i, row


def shard_size(n, shard):
    """How many of the first n rows fall in the shard."""
    index, count = shard
    return max(0, (n - index + count - 1) // count)


def row_messages(row):
    """The row's conversation as [{"role", "content"}], roles normalised; RowError if malformed."""
    if row.get("messages") is not None:
        raw, role_key, content_key = row["messages"], "role", "content"
    elif row.get("conversations") is not None:
        raw, role_key, content_key = row["conversations"], "from", "value"
    elif row.get("prompt") is not None:
        raw, role_key, content_key = [{"role": "user", "content": row["prompt"]}], "role", "content"
    else:
        raise RowError("no messages, conversations or prompt column")
    if not isinstance(raw, list):
        raise RowError(f"conversation is a {type(raw).__name__}, not a list")
    if not raw:
        raise RowError("empty conversation")
    messages = []
    for k, m in enumerate(raw):
        if not isinstance(m, dict):
            raise RowError(f"message {k} is a {type(m).__name__}, not an object")
        role = ROLE_ALIASES.get(m.get(role_key))
        if role is None:
            raise RowError(f"message {k} has unknown role {m.get(role_key)!r}")
        content = m.get(content_key)
        if not isinstance(content, str):
            raise RowError(f"message {k} content is {type(content).__name__}, not a string")
        messages.append({"role": role, "content": content})
    return messages


def prompt_chunks(messages):
    """The conversation cut where the model answers: each chunk ends with the user turn(s) that an
    answer follows. The dataset's own assistant messages are dropped (the model writes its own);
    system messages stay where they are. Raises RowError when no user message exists.
    """
    chunks, current, has_user = [], [], False
    for m in messages:
        if m["role"] == "assistant":
            if has_user:
                chunks.append(current)
                current, has_user = [], False
            continue
        current.append(m)
        has_user = has_user or m["role"] == "user"
    if has_user:
        chunks.append(current)
    if not chunks:
        raise RowError("no user message")
    return chunks


def row_id(row, chunks=None):
    """The row's stable id: its id column if set, else a hash of its prompt messages (the raw row
    for a malformed one), so re-runs and other hosts name the same row the same way."""
    given = row.get("id")
    if given is not None and str(given) != "":
        return str(given)
    basis = chunks if chunks is not None else row
    text = json.dumps(basis, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]
