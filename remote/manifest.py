"""A run directory's manifest: every file's size and sha256, and the line count of JSONL files.

    python manifest.py RUN_DIR           write RUN_DIR/manifest.json (remote/run.sh does, when the command ends)
    python manifest.py --verify DIR      check a copy against DIR/manifest.json (`inv pull` does, locally)

The manifest is what makes a pulled copy trustworthy: --verify names every file that is missing,
has the wrong size or the wrong hash, prints one line per problem and exits 1. Files that are not
in the manifest (written after it, or left by an earlier pull) are not checked.

Files matching HOST_ONLY are counted, not hashed, and `inv pull` does not copy them.

Self-contained (stdlib only): it runs on the GPU host and on the laptop alike.
"""

import argparse
import fnmatch
import hashlib
import json
import os
import sys

import layout

NAME = layout.MANIFEST
# An extract run's target-state shards: terabytes for a large target, read where they lie by
# `train --states`, and cheaper to recompute than to hash or copy home.
HOST_ONLY = ("shard-*.safetensors", "shard-*.safetensors.tmp")


def host_only(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in HOST_ONLY)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))


def files_under(root: str):
    """Relative paths of the regular files under root, sorted; the manifest itself and temp files excluded."""
    for parent, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(parent, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if rel == NAME or name.startswith(".") or os.path.islink(path) or not os.path.isfile(path):
                continue
            yield rel


def describe(root: str, rel: str) -> dict | None:
    """The file's entry; None if it vanished after it was listed."""
    path = os.path.join(root, rel)
    try:
        entry = {"path": rel, "size": os.path.getsize(path), "sha256": sha256(path)}
        if rel.endswith(".jsonl"):
            entry["lines"] = count_lines(path)
    except FileNotFoundError:
        return None
    return entry


def size_or_none(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return None


def write(root: str) -> None:
    """Describe what is under root now.

    Other processes may still write the directory while this walks it (a streaming trainer
    deletes the shards of an extract run; a shard's .tmp is renamed into place): a file that
    vanishes between listing and reading was not there to describe, and is left out.
    """
    rels = list(files_under(root))
    kept = {rel for rel in rels if host_only(os.path.basename(rel))}
    entries = [describe(root, rel) for rel in rels if rel not in kept]
    kept_sizes = [size for size in (size_or_none(os.path.join(root, r)) for r in kept) if size is not None]
    doc = {"files": [e for e in entries if e is not None],
           "host_only": {"files": len(kept_sizes), "bytes": sum(kept_sizes)}}
    tmp = os.path.join(root, "." + NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, os.path.join(root, NAME))


def read(root: str) -> dict:
    """The manifest of root; OSError or ValueError if missing or unreadable."""
    with open(os.path.join(root, NAME)) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), list):
        raise ValueError("no list of files")
    return doc


def verify(root: str) -> list[str]:
    """One line per problem; empty when the copy matches its manifest."""
    try:
        entries = read(root)["files"]
    except FileNotFoundError:
        return [f"{NAME}: missing (the run did not finish writing it)"]
    except (OSError, ValueError) as e:
        return [f"{NAME}: unreadable: {e}"]
    problems = []
    for entry in entries:
        if not isinstance(entry, dict) or not {"path", "size", "sha256"} <= entry.keys():
            return [f"{NAME}: unreadable: entry {entry!r}"]
        rel = entry["path"]
        path = os.path.join(root, rel)
        try:
            size = os.path.getsize(path) if os.path.isfile(path) else None
            if size is None:
                problems.append(f"{rel}: missing")
            elif size != entry["size"]:
                problems.append(f"{rel}: size {size}, expected {entry['size']}")
            elif sha256(path) != entry["sha256"]:
                problems.append(f"{rel}: sha256 mismatch (content differs from the run's manifest)")
        except FileNotFoundError:
            problems.append(f"{rel}: missing")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--verify", action="store_true", help="check DIR against its manifest instead of writing one")
    args = ap.parse_args()
    if not os.path.isdir(args.dir):
        print(f"manifest: {args.dir}: not a directory", file=sys.stderr)
        return 2
    if not args.verify:
        write(args.dir)
        return 0
    problems = verify(args.dir)
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
