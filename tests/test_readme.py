"""Every `inv ...` command the README shows names a real task and real flags; the two commands exist."""

import re
import subprocess
import sys

from tests.invoke_cli import REPO

README = (REPO / "README.md").read_text()


def _help(task: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "invoke", "--help", task], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, f"README names a task that does not exist: inv {task}"
    return proc.stdout


def test_every_inv_command_in_readme_exists():
    commands = re.findall(r"\binv ([a-z_]+)((?: [^`|\n]*)?)", README)
    assert len(commands) > 20
    helps = {}
    for task, rest in commands:
        helps.setdefault(task, _help(task))
        flags = re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", rest.split(" -- ")[0])
        known = _flags(helps[task])
        for flag in flags:
            assert flag in known or flag.replace("--no-", "--") in known, \
                f"README: `inv {task} ... {flag}` is not a flag of {task} ({sorted(known)})"


def _flags(help_text: str) -> set:
    """Flags a task accepts as Invoke spells them: `--name`, `--[no-]follow`, and `-n` for a one-letter parameter."""
    options = help_text[help_text.index("Options:"):].replace("[no-]", "")
    return set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", options))


def test_the_two_commands_and_ci():
    assert "./scripts/demo" in README.split("##")[0] and "./scripts/test" in README.split("##")[0]
    assert (REPO / ".ci/run").read_text().strip().endswith("exec ./scripts/test")
    for script in ("scripts/demo", "scripts/test", "scripts/setup"):
        assert (REPO / script).stat().st_mode & 0o111
