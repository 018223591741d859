"""Every `inv ...` command the README shows names a real task and real flags; the two commands exist."""

import re

from tests.helpers.invoke_cli import REPO

README = (REPO / "README.md").read_text()


def _parsers() -> dict:
    """{task name: the flags Invoke's parser accepts for it}, read from tasks.py as `inv` loads it."""
    import tasks
    from specops.cli import Collection

    return {ctx.name: set(ctx.flag_names()) for ctx in Collection.from_module(tasks).to_contexts()}


def test_every_inv_command_in_readme_exists():
    commands = re.findall(r"\binv ([a-z_]+)((?: [^`|\n]*)?)", README)
    assert len(commands) > 20
    parsers = _parsers()
    for task, rest in commands:
        assert task in parsers, f"README names a task that does not exist: inv {task}"
        for flag in re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", rest.split(" -- ")[0]):
            assert flag in parsers[task], \
                f"README: `inv {task} ... {flag}` is not a flag of {task} ({sorted(parsers[task])})"


def test_the_two_commands_and_ci():
    assert "./scripts/demo" in README.split("##")[0] and "./scripts/test" in README.split("##")[0]
    assert (REPO / ".ci/run").read_text().strip().endswith("exec ./scripts/test")
    for script in ("scripts/demo", "scripts/test", "scripts/setup"):
        assert (REPO / script).stat().st_mode & 0o111


def test_the_layout_section_names_every_module():
    """README's "How the code is laid out" says what each module owns: a module added or renamed shows here."""
    section = README.split("## How the code is laid out", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+)(?:\.py|\.sh)?`", section))
    for folder in ("specops", "remote"):
        modules = {p.stem for p in (REPO / folder).iterdir() if p.suffix in (".py", ".sh") and p.stem != "__init__"}
        assert modules <= named, f"README's layout section does not name {sorted(modules - named)} ({folder}/)"
