"""What specops may delete on a host: only the directories it made itself.

specops writes into five directories of a host's workdir: ``code/`` (deploy replaces it with the
project's tree, deleting what the tree lacks), ``venv/`` (deps installs and uninstalls there),
``runs/``, ``data/`` and ``service/``. A workdir may be a place the user keeps other things (a
workdir of ``~`` puts ``code/`` beside the user's own ``~/code``), so each of those directories
carries a marker, ``.specops-owned``, written when specops creates it. Before writing into one,
specops *claims* it (:func:`claim`):

* absent: created, with the marker;
* holding the marker: specops's, go ahead;
* empty: nothing in it can be lost; marked and taken;
* an older specops's workdir (its ``code/`` unmarked but holding only what deploy puts there,
  ``VERSION`` included): every one of the five directories that exists is marked and taken, once;
* anything else: refused, one line naming the directory and what to do, nothing written.

``models/`` is never written by specops (the user copies a model there), so it needs no marker.
"""

from __future__ import annotations

from .errors import HostError
from .host import Session, quote
from .shared import layout

MARK = ".specops-owned"
OWNED = layout.OWNED
DEPLOYED = (layout.VERSION, "remote", "templates", "requirements", "examples")  # what deploy puts in code/
TEXT = "created by specops, which may replace or delete anything in this directory"
NOT_OURS = 17  # exit code of a script that met a directory specops did not make
CANNOT_MARK = 18

# Shell functions (their variables local: the snippets they join use names like d) for any remote snippet that writes under a workdir: `claim WORKDIR NAME...` (exit
# NOT_OURS, the directory on stderr, when one is not specops's) and `owned_or_new WORKDIR NAME...`
# (the same test, writing nothing: a dry run's).
FUNCTIONS = r"""
owned_mark={mark}
mark() {{ [ -f "$1/$owned_mark" ] || printf '%s\n' {text} >"$1/$owned_mark"; }}
legacy_workdir() {{
  local c=$1/{code} e
  [ -d "$c" ] && [ ! -L "$c" ] && [ ! -e "$c/$owned_mark" ] && [ -f "$c/{version}" ] || return 1
  for e in "$c"/* "$c"/.[!.]* "$c"/..?*; do
    [ -e "$e" ] || [ -L "$e" ] || continue
    case ${{e##*/}} in {deployed}) ;; *) return 1;; esac
  done
}}
is_empty_dir() {{ [ -d "$1" ] && [ -z "$(ls -A -- "$1" 2>/dev/null)" ]; }}
claim() {{
  local w=$1 n d o; shift
  for n in "$@"; do
    d=$w/$n
    [ -f "$d/$owned_mark" ] && continue
    if [ ! -e "$d" ] && [ ! -L "$d" ]; then mkdir -p -- "$d" && mark "$d" || exit {cannot}; continue; fi
    if is_empty_dir "$d"; then mark "$d" || exit {cannot}; continue; fi
    if legacy_workdir "$w"; then
      for o in {owned}; do [ -d "$w/$o" ] && {{ mark "$w/$o" || exit {cannot}; }}; done
    fi
    [ -f "$d/$owned_mark" ] && continue
    printf '%s\n' "$d" >&2; exit {not_ours}
  done
}}
owned_or_new() {{
  local w=$1 n d; shift
  for n in "$@"; do
    d=$w/$n
    [ -f "$d/$owned_mark" ] || {{ [ ! -e "$d" ] && [ ! -L "$d" ]; }} || is_empty_dir "$d" || legacy_workdir "$w" \
      || {{ printf '%s\n' "$d" >&2; exit {not_ours}; }}
  done
}}
""".format(mark=quote(MARK), text=quote(TEXT), deployed="|".join(DEPLOYED), owned=" ".join(OWNED),
           cannot=CANNOT_MARK, not_ours=NOT_OURS, code=layout.CODE, version=layout.VERSION)


def claim_line(session: Session, *names: str, write: bool = True) -> str:
    """The shell line that claims ``names`` (of :data:`OWNED`) in this host's workdir, for a snippet
    that starts with :data:`FUNCTIONS`; ``write=False`` only checks (a dry run)."""
    unknown = set(names) - set(OWNED)
    if unknown:
        raise ValueError(f"not a directory specops owns: {sorted(unknown)}")
    verb = "claim" if write else "owned_or_new"
    return " ".join([verb, quote(session.workdir), *map(quote, names)])


def claim(session: Session, *names: str, write: bool = True) -> None:
    """Make sure each ``<workdir>/NAME`` is specops's (created and marked if absent); HostError, one
    line naming the directory, if one is not."""
    r = session.sh(FUNCTIONS + claim_line(session, *names, write=write), check=False, timeout=60)
    problem = refusal(session, r.exit_code, r.stderr)
    if problem:
        raise problem
    if not r.ok:
        detail = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
        raise HostError(f"{session.host.name}: cannot check {session.workdir}: {detail}")


def refusal(session: Session, exit_code: int, stderr: str) -> HostError | None:
    """The HostError for a claim's exit code (None when the claim did not stop the script)."""
    lines = stderr.strip().splitlines()
    path = lines[-1] if lines else session.workdir
    name = session.host.name
    if exit_code == NOT_OURS:
        return HostError(
            f"{name}: {path} exists and was not made by specops (no {MARK} in it); refusing to write into or "
            f"delete from it: give the host a workdir of its own in the inventory (e.g. workdir: ~/specops), "
            f"or, if specops made it, mark it: touch {quote(path + '/' + MARK)}")
    if exit_code == CANNOT_MARK:
        return HostError(f"{name}: cannot create or mark {path}: {stderr.strip() or 'permission denied?'}")
    return None
