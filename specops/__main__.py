"""``python -m specops TASK``: the same program as the venv's ``inv``."""

from .cli import program

program.run()
