"""The names of every file and folder a host's workdir and a run directory hold, each typed once.

These files are the contract between what a host writes and what the laptop reads, so both sides
take the names from here: the host scripts import this module as a sibling (``import layout``), the
laptop loads it through ``specops.shared``. Stdlib only and importing nothing, for that reason.
Renaming a value here changes a file format users and older run directories rely on: don't.

A workdir (the inventory's ``workdir``, ``~/specops`` by default)::

    code/              the deployed tree (deploy); code/VERSION holds the deployed git commit
    venv/              the Python the scripts run under (deps)
    runs/RUN/          one run directory per run (below)
    data/RUN/          merged.jsonl: a group's data, on every node (group training)
    service/           the vLLM service: its env file (secrets), log, supervisor files
    models/            the user's checkpoints (specops never writes there)

A run directory (``runs/RUN``, the command's working directory)::

    cmd, meta.json     what runs, and the run's id, kind, host, argv, shard, code version
    log                stdout and stderr of the whole run
    exit_code          written when the command ends (remote/run.sh); disk_full beside it
                       when the disk filled up
    manifest.json      size and sha256 of every file, written after exit_code
    report.html        the run drawn for a person (remote/report.py)
    data.jsonl, errors.jsonl, stats.json, input.json     generate (remote/run_files.py)
    metrics.jsonl, evals.jsonl, evals/, heldout.jsonl, draft/, checkpoint.pt    train
    report.json        eval's measurement (also each evals/step-N/ of train)
"""

# -- the workdir -------------------------------------------------------------------------------
CODE = "code"
VENV = "venv"
RUNS = "runs"
DATA = "data"
SERVICE = "service"
MODELS = "models"
VERSION = "VERSION"  # in code/: the deployed git commit
OWNED = (CODE, VENV, RUNS, DATA, SERVICE)  # the folders specops creates and marks as its own

# -- service/ -----------------------------------------------------------------------------------
SERVICE_ENV = "vllm.env"  # 0600: holds the secrets
SERVICE_LOG = "vllm.log"  # tmux supervisor: vLLM's output + notes
SERVICE_SCRIPT = "supervise.sh"
SERVICE_PID = "vllm.pid"
SUPERVISOR_PID = "supervisor.pid"
SERVICE_STATE = "state"
SERVICE_UNIT = "vllm.service"  # staged here, copied to /etc/systemd/system by `install`
SUPERVISOR = "supervisor"  # which supervisor `inv serve` used last
HIDDEN_STATES = "hidden_states"  # `--extract`: per-request state files

# -- a run directory ----------------------------------------------------------------------------
CMD = "cmd"
META = "meta.json"
LOG = "log"
EXIT_CODE = "exit_code"
DISK_FULL = "disk_full"
MANIFEST = "manifest.json"
REPORT_HTML = "report.html"
ROWS = "data.jsonl"  # generate's output, train's input
ERRORS = "errors.jsonl"
STATS = "stats.json"
INPUT = "input.json"
METRICS = "metrics.jsonl"
EVALS = "evals.jsonl"
EVALS_DIR = "evals"  # train: evals/step-N/, one in-training measurement each
HELDOUT = "heldout.jsonl"
DRAFT = "draft"
CHECKPOINT = "checkpoint.pt"
TRAIN_PLAN = "train_plan.json"
REPORT_JSON = "report.json"
MERGED = "merged.jsonl"  # data/RUN/ on a host; artifacts/RUN/ on the laptop


def code_dir(workdir: str) -> str:
    return f"{workdir}/{CODE}"


def code_file(workdir: str, rel: str) -> str:
    """A file of the deployed tree, e.g. ``code_file(w, "remote/eval.py")``."""
    return f"{workdir}/{CODE}/{rel}"


def venv_dir(workdir: str) -> str:
    return f"{workdir}/{VENV}"


def venv_python(workdir: str) -> str:
    return f"{workdir}/{VENV}/bin/python"


def runs_dir(workdir: str) -> str:
    return f"{workdir}/{RUNS}"


def service_dir(workdir: str) -> str:
    return f"{workdir}/{SERVICE}"


def merged_data(workdir: str, run_id: str) -> str:
    """Where a group's merged rows live on each of its nodes."""
    return f"{workdir}/{DATA}/{run_id}/{MERGED}"
