"""Every file and folder a host's workdir and a run directory hold is named once, in remote/layout.py.

A name typed by hand elsewhere is a second home for a file format the laptop and the hosts must agree
on; this test finds one in the code (string literals, docstrings and comments aside: those explain,
they do not open files) of specops/, remote/ and tasks.py.
"""
import ast
import re
from pathlib import Path

from specops.shared import layout

ROOT = Path(__file__).resolve().parents[2]

# Files this test does not read yet, each with why.
ALLOWED = {
    "remote/layout.py": "the one home of the names",
    "remote/run.sh": "bash cannot import the layout; test_run_sh_names_are_the_layouts checks it instead",
    **{f"remote/{name}.py": "being restructured in a concurrent change; its names move to the layout there"
       for name in ("states_from_shards", "draft_model", "ttt_objective", "train_plan",
                    "torchrun_node", "batching", "muon", "held_out", "acceptance")},
}

# Names that are also plain words or keys ("log", "data", "exit_code") count only where a string uses them as
# a path part (or a shell redirect's target).
FILE_NAMES = [layout.META, layout.MANIFEST, layout.REPORT_HTML, layout.ROWS,
              layout.ERRORS, layout.STATS, layout.INPUT, layout.METRICS, layout.EVALS, layout.HELDOUT,
              layout.CHECKPOINT, layout.TRAIN_PLAN, layout.REPORT_JSON, layout.MERGED, layout.VERSION,
              layout.SERVICE_ENV, layout.SERVICE_LOG, layout.SERVICE_SCRIPT, layout.SERVICE_PID,
              layout.SUPERVISOR_PID]
# (models/ is the user's: no code names it.)
WORDS = [layout.EXIT_CODE, layout.DISK_FULL, layout.CODE, layout.VENV, layout.RUNS, layout.DATA, layout.SERVICE, layout.LOG, layout.CMD,
         layout.DRAFT, layout.EVALS_DIR, layout.HIDDEN_STATES]
PATTERN = re.compile("|".join([*(rf"(?<![\w.-]){re.escape(n)}(?![\w-]|\.\w)" for n in FILE_NAMES),
                               *(rf"(?:(?<=/)|(?<=>)){re.escape(w)}(?![\w.-])|(?<![\w.$-]){re.escape(w)}/"
                                 for w in WORDS)]))


def _strings(tree: ast.AST):
    """The string constants of a module that are not docstrings or bare string statements."""
    prose = {id(node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            yield node


def hand_typed(source: str) -> list[tuple[int, str]]:
    """(line, name) of each layout name typed into a string of this Python source."""
    return sorted((node.lineno, m.group(0)) for node in _strings(ast.parse(source))
                  for m in PATTERN.finditer(node.value))


def sources():
    for path in [ROOT / "tasks.py", *sorted((ROOT / "specops").glob("*.py")), *sorted((ROOT / "remote").glob("*.py"))]:
        rel = path.relative_to(ROOT).as_posix()
        if rel not in ALLOWED:
            yield rel, path.read_text()


def test_no_run_file_name_is_typed_outside_the_layout():
    found = [f"{rel}:{line}: {name}" for rel, text in sources() for line, name in hand_typed(text)]
    assert not found, "name these through remote/layout.py (specops.shared.layout):\n" + "\n".join(found)


def test_the_check_sees_a_typed_name():
    assert hand_typed('p = f"{d}/data.jsonl"\nq = "cat $d/exit_code"\nr = w + "/code/x"\n') == [
        (1, "data.jsonl"), (2, "exit_code"), (3, "code")]
    assert hand_typed('"""data.jsonl in prose"""\nx = {"exit_code": 1, "data": 2}  # log\n') == []


def test_run_sh_names_are_the_layouts():
    text = (ROOT / "remote" / "run.sh").read_text()
    for name in (layout.CMD, layout.LOG, layout.EXIT_CODE, layout.DISK_FULL):
        assert re.search(rf"(?<![\w.]){name}(?![\w.])", text.split("\nmain() {", 1)[1]), name
    assert '"$here/manifest.py"' in text  # which writes layout.MANIFEST


def test_allowed_files_exist():
    assert all((ROOT / rel).is_file() for rel in ALLOWED)
