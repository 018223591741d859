"""A job's shared flags (remote/job_specs.py) are what the host script parses, what the argv builder
sends and what the Invoke task defaults to and says in --help: nothing drifts between the three."""
import inspect
import sys
from pathlib import Path

import tasks
from specops import jobs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "remote"))
import eval as eval_script  # noqa: E402  (remote/eval.py, as a host runs it)


def test_eval_script_parses_the_spec():
    args = eval_script.parse_args(["--prompts", "p.jsonl", "--endpoint", "http://127.0.0.1:1"])
    for flag in jobs.EVAL.values():
        assert getattr(args, flag.name) == flag.default, flag.option


def test_eval_builder_and_task_default_to_the_spec():
    for fn in (jobs.eval_argv, jobs.evaluate, tasks.eval_.body):
        params = inspect.signature(fn).parameters
        for flag in jobs.EVAL.values():
            assert params[flag.name].default == flag.default, (fn.__name__, flag.name)
    source = inspect.getsource(tasks)
    for flag in jobs.EVAL.values():  # Invoke consumes a task's help dict once it builds the parser: read the source
        assert f'"{flag.name}": jobs.EVAL["{flag.name}"].help' in source, flag.name
