"""Dataset rows in, chat prompts out: the input side of remote/generate.py.

Local JSON files (.jsonl, .json, a directory's) are read here, one line at a time: each line is one
row, and a line that does not parse is that row's error, naming its line, while the rows around it
go on. (Through `datasets`' JSON reader, one row whose types differ from the first chunk's fails the
whole stream, again at the same place on every resume.) Hub datasets and parquet files, whose
columns are typed, come through `datasets` in streaming mode. Memory stays flat whatever the size.

A row becomes a conversation through remote/conversations.py (the shapes read are listed there);
one that cannot raises RowError with a reason, which the caller records instead of crashing.
"""
import hashlib
import itertools
import json
import os
import random

from conversations import ConversationError as RowError
from conversations import conversation as row_messages

# Local files by extension: read line by line here, or by a `datasets` builder with how much it reads
# at a time (its default, a whole parquet row group, costs ~150 MB of RSS at once; this ~20).
JSON_SUFFIXES = (".jsonl", ".json")
FILE_BUILDERS = {".parquet": ("parquet", {"batch_size": 1024})}
SHUFFLE_BUFFER = 10_000


class DatasetError(Exception):
    """The dataset cannot be opened or read; the message is one line for the user."""


class UnreadableRow(RowError):
    """A line the reader cannot parse, yielded in place of its row (its text keeps its id stable)."""

    def __init__(self, reason, text):
        super().__init__(reason)
        self.text = text


def open_rows(name_or_path, split="train", shuffle_seed=None):
    """An iterator of (where, row): where is "FILE:LINE" for a row of a local JSON file, else None;
    row is a dict, or an UnreadableRow for a line that does not parse.

    Raises DatasetError when the dataset cannot be found, reached or read. The first row is read
    here so that a missing hub dataset or an unreadable file fails before any work starts.
    """
    try:
        if files := json_files(name_or_path, split):
            rows = itertools.chain.from_iterable(map(json_rows, files))
            if shuffle_seed is not None:
                rows = buffered_shuffle(rows, shuffle_seed)
        else:
            rows = zip(itertools.repeat(None), hf_rows(name_or_path, split, shuffle_seed))
        first = next(rows, None)
    except DatasetError:
        raise
    except Exception as e:  # datasets raises many kinds; all mean the same thing here
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")
        why = (" (HF_HUB_OFFLINE is set on this host, so the hub is not asked: put the dataset in the host's "
               "hub cache, pass a local file with --dataset, or drop HF_HUB_OFFLINE from the inventory's env)"
               if offline and not os.path.exists(name_or_path) and not isinstance(e, ImportError) else "")
        raise DatasetError(f"cannot open dataset '{name_or_path}': {one_line(e)}{why}") from None
    if first is None:
        raise DatasetError(f"dataset '{name_or_path}' (split {split}) has no rows")
    return reading_errors(itertools.chain([first], rows), name_or_path)


def json_files(name_or_path, split):
    """The local JSON files that make the dataset's split (a directory's: by `datasets`' own rules),
    to be read here; None for anything else, which `datasets` streams."""
    if os.path.isfile(name_or_path):
        return [name_or_path] if name_or_path.lower().endswith(JSON_SUFFIXES) else None
    if not os.path.isdir(name_or_path):
        return None
    builder = import_datasets().load_dataset_builder(name_or_path)
    if builder.name != "json":
        return None
    splits = builder.config.data_files
    if split not in splits:
        raise DatasetError(f"{name_or_path} has no split '{split}' (it has {', '.join(map(str, splits))})")
    files = list(splits[split])
    return files if all(f.lower().endswith(JSON_SUFFIXES) for f in files) else None


def json_rows(path):
    """(where, row) for every non-blank line of a JSON-lines file, or every item of a JSON array."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith(b"["):  # one JSON array: `datasets` loads these whole too
            try:
                items = json.load(f)
            except ValueError as e:
                raise DatasetError(f"{path}: not a valid JSON array ({one_line(e)})") from None
            for k, item in enumerate(items, 1):
                yield f"{path}:item {k}", item
            return
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                text = line.decode("utf-8", "replace")
                yield f"{path}:{number}", UnreadableRow(f"line is not valid JSON ({one_line(e)})", text)
                continue
            yield f"{path}:{number}", row


def buffered_shuffle(rows, seed, buffer_size=SHUFFLE_BUFFER):
    """Rows in a seeded random order, holding at most buffer_size of them (as `datasets` does)."""
    rng, buffer = random.Random(seed), []
    for row in rows:
        if len(buffer) < buffer_size:
            buffer.append(row)
            continue
        i = rng.randrange(buffer_size)
        yield buffer[i]
        buffer[i] = row
    rng.shuffle(buffer)
    yield from buffer


def hf_rows(name_or_path, split, shuffle_seed):
    """The rows of a hub dataset, a parquet file or a directory, streamed by `datasets`."""
    datasets = import_datasets()
    if os.path.isfile(name_or_path):
        ext = os.path.splitext(name_or_path)[1].lower()
        if ext not in FILE_BUILDERS:
            expected = ", ".join((*JSON_SUFFIXES, *FILE_BUILDERS))
            raise DatasetError(f"{name_or_path}: unsupported file type '{ext}' (expected one of {expected})")
        builder, read_size = FILE_BUILDERS[ext]
        ds = datasets.load_dataset(builder, data_files=name_or_path, split=split, streaming=True,
                                   **read_size)
    else:
        ds = datasets.load_dataset(name_or_path, split=split, streaming=True)
    if shuffle_seed is not None:
        ds = ds.shuffle(seed=shuffle_seed, buffer_size=SHUFFLE_BUFFER)
    return iter(ds)


def import_datasets():
    """`datasets`, imported only for what this module does not read itself, and made quiet."""
    import datasets
    import huggingface_hub

    # datasets imports torch (~190 MB) for DataLoader workers, which a streaming reader never uses.
    datasets.config.TORCH_AVAILABLE = False
    # Both libraries log every retry of an unreachable hub; the caller prints one line instead.
    datasets.logging.set_verbosity_error()
    huggingface_hub.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    return datasets


def reading_errors(rows, name):
    """Re-raise any failure while reading further rows as a one-line DatasetError."""
    read = 0
    try:
        for read, row in enumerate(rows, 1):
            yield row
    except DatasetError:
        raise
    except Exception as e:  # `datasets` typing a column from the first rows: one row that differs
        raise DatasetError(f"reading dataset '{name}' failed after row {read}: {one_line(e)} "
                           f"(a JSON dataset read as a local .jsonl file costs only the bad row)") from None


def one_line(e):
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:300]


def in_shard(index, shard):
    """Whether row `index` is in the shard: a tuple of (I, K) pairs, rows whose index mod K == I for
    any of them (one pair per host at first; a re-planned host holds a gone host's share as more)."""
    return any(index % count == i for i, count in shard)


def take_shard(rows, n=None, shard=((0, 1),)):
    """(index, where, row) for the first n rows (all if n is None) in the shard (see in_shard).

    n counts dataset rows before sharding, so K hosts with the same n cover n rows together.
    """
    for i, (where, row) in enumerate(rows if n is None else itertools.islice(rows, n)):
        if in_shard(i, shard):
            yield i, where, row


def shard_size(n, shard):
    """How many of the first n rows fall in the shard."""
    if len(shard) == 1:
        index, count = shard[0]
        return max(0, (n - index + count - 1) // count)
    return sum(1 for i in range(n) if in_shard(i, shard))


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


def first_prompt(row) -> list[dict] | None:
    """The messages a one-turn request sends for this row (its first user turn, with any system message),
    or None for a row that has none: what eval.py sends, and what training's held-out prediction replays."""
    try:
        return prompt_chunks(row_messages(row))[0]
    except RowError:
        return None


def given_id(row):
    """The row's id column: a string or an integer, None when unset or empty; RowError for any other
    type (a float, a list: no one id to write down)."""
    given = row.get("id") if isinstance(row, dict) else None
    if given is None or given == "":
        return None
    if isinstance(given, str) or type(given) is int:
        return given
    raise RowError(f"id is {type(given).__name__}, not a string or an integer")


def id_type(given):
    """The name of an id's type, as the run records it: "string" or "integer"."""
    return "string" if isinstance(given, str) else "integer"


def row_id(row, chunks=None):
    """The row's stable id: its id column (as text) if set, else a hash of its prompt messages (the
    raw row or line for a malformed one), so re-runs and other hosts name the same row the same way."""
    try:
        given = given_id(row)
    except RowError:  # the row is refused for it; its error still needs a name
        given = None
    if given is not None:
        return str(given)
    basis = chunks if chunks is not None else row.text if isinstance(row, UnreadableRow) else row
    text = json.dumps(basis, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]
