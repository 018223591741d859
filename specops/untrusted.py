"""Text that came from a host, made safe to show on this terminal.

A run's log, its progress line, an error a host printed: whoever can write a run directory on
a shared GPU box writes them, and a script may print a token it was given. Printed raw, a log
line can clear the screen (``ESC [2J``), set the clipboard (OSC 52), retitle the window or
hide text (a bidi override), and a token shows verbatim. :func:`clean` is what every such
text goes through before specops prints it::

    >>> clean("ok \\x1b[2J\\x1b]52;c;ZWNobyBwd25lZA==\\x07token hf_abc", {"HF_TOKEN": "hf_abc"})
    'ok token <HF_TOKEN>'

Escape sequences are dropped whole (CSI, OSC, DCS/APC/PM/SOS, two-byte ESC forms, their 8-bit
C1 spellings); other control characters but tab are dropped; a carriage return keeps what a
terminal would finally show (the text after the last one), so progress bars collapse. Secrets
are redacted after that, so an escape spliced into a token cannot hide it from the redaction.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from . import secrets as secrets_mod
from .errors import SpecopsError
from .host import Session
from .service_spec import Layout

_ESCAPES = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"  # CSI ... final byte (a torn one is dropped too)
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"  # OSC/DCS/SOS/PM/APC ... ST
    r"|\x1b[ -/]*[0-~]?"  # two-byte and nF escapes (ESC c resets the terminal)
)
# C0 but tab, DEL, C1, and the bidirectional overrides/isolates that reorder what is shown.
_CONTROLS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


Secrets = dict[str, str] | Iterable[tuple[str, str]]  # {NAME: value} or (NAME, value) pairs


def clean(text: str, secrets: Secrets | None = None) -> str:
    """One line of host text as a terminal would finally show it, minus controls, secrets redacted."""
    text = _ESCAPES.sub("", text)
    if "\r" in text:
        parts = [p for p in text.split("\r") if p]
        text = parts[-1] if parts else ""
    text = _CONTROLS.sub("", text)
    pairs = secrets.items() if isinstance(secrets, dict) else secrets or ()
    for name, value in sorted(pairs, key=lambda p: -len(p[1])):  # a longer secret before its prefix
        text = secrets_mod.redact(text, {name: value})
    return text


def clean_lines(text: str, secrets: Secrets | None = None) -> str:
    """:func:`clean` for each line of a multi-line text (a host's error, a log tail)."""
    return "\n".join(clean(line, secrets) for line in text.split("\n"))


def known_secrets(session: Session | None = None) -> list[tuple[str, str]]:
    """The secrets to redact: this machine's (environment, secrets file) and, given a session,
    those in the host's service env file, which a run's script may print although this machine
    no longer has them. A missing or unreadable env file adds nothing."""
    found: list[tuple[str, str]] = []
    if session is not None:
        try:
            data = session.read_file(Layout(session.workdir).env_file)
        except (SpecopsError, OSError):  # best effort: the local secrets are still redacted
            data = None
        for line in (data or b"").decode("utf-8", "replace").splitlines():
            name, sep, value = line.strip().removeprefix("export ").partition("=")
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            if sep and name.strip() in secrets_mod.NAMES and value:
                found.append((name.strip(), value))
    try:
        found += secrets_mod.load().items()
    except SpecopsError:  # a bad secrets file is refused where it is used; here, redact what the environment has
        found += [(name, os.environ[name]) for name in secrets_mod.NAMES if os.environ.get(name)]
    return found
