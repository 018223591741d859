"""The output directory of remote/generate.py, kept so that every row lands exactly once.

    data.jsonl    one complete line per finished row, appended and flushed as a single write
    errors.jsonl  rows that failed in the latest run (started afresh each run: they are retried)
    stats.json    counts and rates, replaced atomically every few seconds and at the end

A crash can leave at most one torn line, the last one of data.jsonl. Opening the directory finds
it, cuts it off, and reads the ids of the complete lines: those rows are skipped, every other row
is (re)generated. A lock file keeps a second generator out of the same directory.
"""
import fcntl
import json
import os


class RunDirError(Exception):
    """The directory cannot be used; the message is one line for the user."""


class RunFiles:
    def __init__(self, out_dir):
        os.makedirs(out_dir, exist_ok=True)
        self.dir = out_dir
        self.data_path = os.path.join(out_dir, "data.jsonl")
        self._lock = open(os.path.join(out_dir, ".lock"), "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirError(f"{out_dir}: another generator is writing here") from None
        self.torn_bytes = 0
        self.done_ids = self._read_done_ids()
        self._data = os.open(self.data_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._errors = os.open(os.path.join(out_dir, "errors.jsonl"),
                               os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o644)

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
        write_line(self._data, record)
        self.done_ids.add(record["id"])

    def add_error(self, error):
        write_line(self._errors, error)

    def write_stats(self, stats):
        path = os.path.join(self.dir, "stats.json")
        with open(path + ".tmp", "w") as f:
            json.dump(stats, f, indent=1)
        os.replace(path + ".tmp", path)

    def close(self):
        os.close(self._data)
        os.close(self._errors)
        self._lock.close()


def write_line(fd, obj):
    """Append obj as one JSON line with as few writes as the kernel allows (one, in practice)."""
    buf = memoryview((json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode())
    while buf:
        buf = buf[os.write(fd, buf):]
