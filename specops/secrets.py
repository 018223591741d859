"""The served model's secrets: VLLM_API_KEY and HF_TOKEN, taken from this machine only.

Sources, first wins: this process's environment, then a secrets file of ``NAME=value``
lines (``$SPECOPS_SECRETS_FILE``, default ``~/.config/specops/secrets.env``). The file
must be private to you (mode 0600 or stricter): a readable secrets file is refused,
because it has already leaked. The inventory never holds secrets (its validation
rejects key/token names).

On a host, secrets live only in the service's env file, written 0600 from birth; they
never reach a command line, a unit file or specops's output (see :func:`redact`).
"""

from __future__ import annotations

import os
import stat

from .errors import SpecopsError

NAMES = ("VLLM_API_KEY", "HF_TOKEN")
DEFAULT_FILE = "~/.config/specops/secrets.env"


def load(environ=None) -> dict[str, str]:
    """{NAME: value} for each secret that is set (empty values count as unset)."""
    environ = os.environ if environ is None else environ
    explicit = environ.get("SPECOPS_SECRETS_FILE")
    path = os.path.expanduser(explicit or DEFAULT_FILE)
    found = read_file(path) if (explicit or os.path.exists(path)) else {}
    for name in NAMES:
        if environ.get(name):
            found[name] = environ[name]
    return {name: found[name] for name in NAMES if found.get(name)}


def read_file(path: str) -> dict[str, str]:
    """Parse a private secrets file; SpecopsError (one line, never a value) if it is unsafe or malformed."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise SpecopsError(f"secrets file {path}: {e.strerror} (set SPECOPS_SECRETS_FILE or unset it)") from None
    if st.st_mode & 0o077:
        raise SpecopsError(f"secrets file {path} is mode {stat.S_IMODE(st.st_mode):04o}, readable by others; "
                           f"refusing it: chmod 600 {path} (and rotate the secrets it holds)")
    if st.st_uid != os.getuid():
        raise SpecopsError(f"secrets file {path} belongs to uid {st.st_uid}, not you; refusing it")
    found = {}
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, value = line.removeprefix("export ").partition("=")
            name, value = name.strip(), value.strip()
            if not sep or name not in NAMES:
                shown = name if sep else "a line without NAME="
                raise SpecopsError(f"secrets file {path} line {number}: expected NAME=value with NAME one of "
                                   f"{', '.join(NAMES)}; got {shown!r}")
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            found[name] = value
    return found


def redact(text: str, secrets: dict[str, str]) -> str:
    """``text`` with every secret value replaced by ``<NAME>``: for anything specops prints from a host."""
    for name, value in secrets.items():
        if value:
            text = text.replace(value, f"<{name}>")
    return text
