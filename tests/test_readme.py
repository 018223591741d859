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
        flags = re.findall(r"(?<![\w-])--([a-z][a-z-]*)", rest.split(" -- ")[0])
        for flag in flags:
            names = {flag, flag.removeprefix("no-")}
            assert any(f"--{n}" in helps[task] or f"--[no-]{n}" in helps[task] for n in names), \
                f"README: `inv {task} ... --{flag}` is not a flag of {task}"


def test_the_two_commands_and_ci():
    assert "./scripts/demo" in README.split("##")[0] and "./scripts/test" in README.split("##")[0]
    assert (REPO / ".ci/run").read_text().strip().endswith("exec ./scripts/test")
    for script in ("scripts/demo", "scripts/test", "scripts/setup"):
        assert (REPO / script).stat().st_mode & 0o111
