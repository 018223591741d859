"""What every remote script shares: the one-line refusal, the machine progress line, the shard spec.

A script raises :class:`Refused` for bad input or state; :func:`main_of` turns it into one line on
stderr and exit code 2, never a traceback. :func:`progress` prints the ``specops-progress {json}``
line that the laptop's watcher (specops.progress) reads from the run's log. :func:`shard_spec` is the
one reading of a shard spec: generate.py's ``--shard``, the laptop's row plans (specops.plan, through
specops.shared) and what a host's meta.json claims (specops.pull). Stdlib only, for that reason.
:class:`Secrets` are the values a script must never write down (the laptop's specops.secrets does
the same for what it prints).
"""
import json
import os
import re
import sys

PROGRESS_PREFIX = "specops-progress "
PROGRESS_EVERY_S = 5.0  # seconds between progress lines while a script works


# "I/K" pairs joined by ","; bounded, as a host's meta.json is read through it
SHARD_SPEC = re.compile(r"\d{1,6}/\d{1,6}(,\d{1,6}/\d{1,6}){0,255}")


def shard_spec(text) -> tuple[tuple[int, int], ...]:
    """"I/K" (rows whose index mod K == I), several joined by "," -> ((I, K), ...); ValueError otherwise."""
    pairs = tuple(tuple(map(int, p.split("/"))) for p in text.split(",")) \
        if isinstance(text, str) and SHARD_SPEC.fullmatch(text) else ()
    if not pairs or any(i >= k for i, k in pairs):
        raise ValueError(f"shard spec {text!r:.60}: need I/K with 0 <= I < K, several joined by ','")
    return pairs


# The secrets a run's environment may hold (the host's vllm.env is sourced into it).
SECRET_ENV = ("VLLM_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "OPENAI_API_KEY")
# A shorter value is not looked for: it would match ordinary text, and such a key is no secret anyway.
SECRET_MIN_CHARS = 8


class Secrets:
    """Known secret values, by the name of the variable that held them: redacted as <NAME>."""

    def __init__(self, environ=None, names=()):
        environ = os.environ if environ is None else environ
        found = {name: environ.get(name) or "" for name in (*SECRET_ENV, *names)}
        # Longest first, so a secret that contains another is replaced whole.
        self.values = sorted(((v, n) for n, v in found.items() if len(v) >= SECRET_MIN_CHARS),
                             key=lambda vn: -len(vn[0]))

    def redact(self, text: str) -> str:
        for value, name in self.values:
            if value in text:
                text = text.replace(value, f"<{name}>")
        return text

    def found_in(self, text: str):
        """The name of the first secret in text, or None."""
        return next((name for value, name in self.values if value in text), None)


class RedactingStream:
    """A text stream (stdout, stderr) that writes every piece with the secrets in it redacted."""

    def __init__(self, stream, secrets: Secrets):
        self._stream, self._secrets = stream, secrets

    def write(self, text):
        return self._stream.write(self._secrets.redact(text))

    def __getattr__(self, name):
        return getattr(self._stream, name)


class Refused(Exception):
    """Bad input or state: one line on stderr, exit 2."""


def progress(**fields) -> None:
    """One machine line (rank 0 only, under torchrun)."""
    if int(os.environ.get("RANK", 0)) != 0:
        return
    print(PROGRESS_PREFIX + json.dumps(fields, separators=(",", ":")), flush=True)


def main_of(main, name: str) -> None:
    """Run a script's ``main()``: its return value is the exit code, a :class:`Refused` is one line."""
    try:
        sys.exit(main())
    except Refused as e:
        print(f"{name}: {e}", file=sys.stderr)
        sys.exit(2)
