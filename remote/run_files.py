"""The output directory of remote/generate.py, kept so that every row lands exactly once.

    data.jsonl    one complete line per finished row, appended and flushed as a single write
    errors.jsonl  rows that failed in the latest run (started afresh each run: they are retried)
    stats.json    counts and rates, replaced atomically every few seconds and at the end
    input.json    the dataset (and split) the run reads, and the type of its ids: a resume reads the same

A crash can leave at most one torn line, the last one of data.jsonl. Opening the directory finds
it, cuts it off, and reads the ids of the complete lines: those rows are skipped, every other row
is (re)generated. A lock file keeps a second generator out of the same directory.

Every file here is created 0600 (a directory generate creates, 0700): replies and errors may quote
what a user would not share. A record whose text is not valid UTF-8 (a lone surrogate that came
in as a JSON escape) or that carries a known secret is refused with Unwritable, before any byte of
it is written; an error line has secrets redacted and such text replaced, so it always lands.
"""
import fcntl
import json
import os
import re

import layout

PRIVATE_FILE, PRIVATE_DIR = 0o600, 0o700
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # a str from json.loads pairs valid ones itself


class RunDirError(Exception):
    """The directory cannot be used; the message is one line for the user."""


class Unwritable(ValueError):
    """A record that must not reach data.jsonl as it is; the message says why (one line)."""


class RunFiles:
    def __init__(self, out_dir, secrets=None):
        os.makedirs(out_dir, mode=PRIVATE_DIR, exist_ok=True)  # an existing one keeps its mode: not ours
        self.dir, self.secrets = out_dir, secrets
        self.data_path = os.path.join(out_dir, layout.ROWS)
        self._lock = os.fdopen(open_private(os.path.join(out_dir, ".lock"), 0), "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirError(f"{out_dir}: another generator is writing here") from None
        self.torn_bytes = 0
        self.done_ids = self._read_done_ids()
        self._data = open_private(self.data_path, os.O_APPEND)
        self._errors = open_private(os.path.join(out_dir, layout.ERRORS), os.O_APPEND | os.O_TRUNC)

    def _read_done_ids(self):
        """Ids of the complete lines of data.jsonl, after cutting off a torn last line."""
        ids, good_end = set(), 0
        if not os.path.exists(self.data_path):
            return ids
        with open(self.data_path, "rb") as f:
            for number, line in enumerate(f, 1):
                try:
                    if not line.endswith(b"\n"):
                        raise ValueError("no newline")
                    ids.add(json.loads(line)["id"])
                except (ValueError, KeyError, TypeError):
                    if f.read(1):  # not the last line: this is not a crash's doing
                        raise RunDirError(f"{self.data_path}: line {number} is not a complete "
                                          f"record; repair or remove it") from None
                    self.torn_bytes = len(line)
                    break
                good_end += len(line)
        if self.torn_bytes:
            os.truncate(self.data_path, good_end)
        return ids

    def add_record(self, record):
        """Append the row's record; Unwritable (nothing written) if it cannot be kept as it is."""
        write_all(self._data, record_bytes(record, self.secrets))
        self.done_ids.add(record["id"])

    def add_error(self, error):
        write_all(self._errors, self.clean(json.dumps(error, ensure_ascii=False, separators=(",", ":")))
                  .encode() + b"\n")

    def clean(self, text):
        """text with secrets redacted and lone surrogates replaced: fit for any file or log."""
        text = self.secrets.redact(text) if self.secrets else text
        return LONE_SURROGATE.sub("\ufffd", text)

    def write_stats(self, stats):
        self.replace(layout.STATS, json.dumps(stats, indent=1))

    def replace(self, name, text):
        """Write the file `name` whole, atomically, cleaned (see clean)."""
        path = os.path.join(self.dir, name)
        with os.fdopen(open_private(path + ".tmp", os.O_TRUNC), "w") as f:
            f.write(self.clean(text))
        os.replace(path + ".tmp", path)

    def write_input(self, record):
        self.replace(layout.INPUT, json.dumps(record, indent=1))

    def close(self):
        os.close(self._data)
        os.close(self._errors)
        self._lock.close()


def read_input(out_dir):
    """What input.json in out_dir records (see RunFiles), or None when there is none to read."""
    try:
        with open(os.path.join(out_dir, layout.INPUT), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def open_private(path, flags):
    """A write descriptor of path, created 0600; one an older run left readable is narrowed to 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, PRIVATE_FILE)
    os.fchmod(fd, PRIVATE_FILE)
    return fd


def record_bytes(record, secrets=None):
    """The record as one JSON line in UTF-8; Unwritable when its text cannot be (see the module doc)."""
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
    try:
        data = text.encode()
    except UnicodeEncodeError:
        raise Unwritable(f"{bad_text_at(record) or 'its text'} is not valid UTF-8 text "
                         f"(a lone surrogate)") from None
    if secrets and (name := secrets.found_in(text)):
        raise Unwritable(f"the record carries a known secret (<{name}>); not kept")
    return data


def bad_text_at(value, path=""):
    """Where in value the first string that is not valid UTF-8 text is (a key or a value), or None."""
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    if isinstance(value, str):
        return None if not LONE_SURROGATE.search(value) else path
    for key, item in items:
        where = (f"{path}.{key}" if path else key) if isinstance(key, str) else f"{path}[{key}]"
        if isinstance(key, str) and LONE_SURROGATE.search(key):
            return f"a key of {path or 'the record'}"
        if found := bad_text_at(item, where):
            return found
    return None


def write_all(fd, buf):
    """Append buf with as few writes as the kernel allows (one, in practice)."""
    buf = memoryview(buf)
    while buf:
        buf = buf[os.write(fd, buf):]
