"""Host side of `inv serve --wait` and `inv serve --status`: the vLLM service, seen from its host.

specops runs this with the host's system Python (stdlib only), passing the source inline, so it
needs no deployed code:

    python3 -c SOURCE status CONFIG_JSON   one JSON line: state, pid, uptime_s, health, models, running
    python3 -c SOURCE watch CONFIG_JSON    JSON lines until the served model is listed ("ready"),
                                           the process dies ("dead") or the deadline passes
                                           ("timeout"); new server log lines ride along ("log"),
                                           a heartbeat comes at least every second, and "dead"
                                           brings the log's last lines ("tail").

HTTP goes to the server's own address from here, so a remote host's 127.0.0.1 port needs no
tunnel, and the API key is read from the service's env file here: it never leaves the host.
CONFIG_JSON (no secrets): supervisor ("systemd"|"tmux"), unit, sudo (journalctl needs it),
url, model, env_file, log_file, pid_file, supervisor_pid_file, state_file, tail_argv (prints the
log's last lines), timeout, interval.
"""
import fcntl
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

START_MARK = b"specops-supervise: starting vLLM"  # written by the tmux supervisor before each start
LINE_LIMIT = 1000
DEAD_STATES = ("failed", "inactive", "deactivating")
STARTING = "activating (start)"
START_GRACE_S = 10  # how long a tmux start may take to show a vLLM pid before it counts as dead


def main(command, config):
    cfg = json.loads(config)
    if command == "status":
        emit(status(cfg))
    elif command == "watch":
        watch(cfg)
    else:
        sys.exit(f"unknown command {command!r}")


def emit(obj):
    print(json.dumps(obj), flush=True)


# ---------------------------------------------------------------- the supervised process

def supervisor_state(cfg):
    """{"state": "active (running)"-style text, "pid": vLLM's pid or None, "uptime_s", "invocation"}.

    Liveness uses kill(pid, 0), never /proc: pids in the supervisor's files are those of its
    pid namespace, which /proc need not show (containers, the test bed)."""
    if cfg["supervisor"] == "systemd":
        out = subprocess.run(["systemctl", "show", cfg["unit"], "-p", "ActiveState", "-p", "SubState",
                              "-p", "MainPID", "-p", "InvocationID", "-p", "ExecMainStartTimestampMonotonic"],
                             capture_output=True, text=True, timeout=10).stdout
        props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        pid = int(props.get("MainPID") or 0) or None
        started_us = int(props.get("ExecMainStartTimestampMonotonic") or 0)
        return {"state": f"{props.get('ActiveState', '?')} ({props.get('SubState', '?')})", "pid": pid,
                "uptime_s": round(time.monotonic() - started_us / 1e6) if pid and started_us else None,
                "invocation": props.get("InvocationID") or None}
    recorded = read_text(cfg["state_file"]) or "inactive (dead)"
    # the supervisor records every transition, its own exit included; tmux reaps it lazily, so a
    # finished supervisor can still answer kill(pid, 0) for a while: its recorded state decides
    if recorded.startswith(DEAD_STATES) or not alive(read_pid(cfg["supervisor_pid_file"])):
        state = recorded if recorded.startswith(DEAD_STATES) or recorded == STARTING else "failed (supervisor gone)"
        return {"state": state, "pid": None, "uptime_s": None, "invocation": None}
    child = read_pid(cfg["pid_file"])
    child = child if alive(child) else None
    return {"state": recorded, "pid": child, "uptime_s": age_s(cfg["pid_file"]) if child else None,
            "invocation": None}


def read_text(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def read_pid(path):
    text = read_text(path)
    return int(text) if text.isdigit() else None


def alive(pid):
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        pass
    return True


def age_s(path):
    """Seconds since path was written (the tmux supervisor writes vLLM's pid file when it starts it)."""
    try:
        return round(time.time() - os.stat(path).st_mtime)
    except OSError:
        return None


# ---------------------------------------------------------------- HTTP

def api_key(cfg):
    """VLLM_API_KEY from the service's env file (NAME='value' lines), or None."""
    for line in read_text(cfg["env_file"]).splitlines():
        name, _, value = line.partition("=")
        if name.strip() == "VLLM_API_KEY":
            return value.strip().strip("'\"") or None
    return None


def get(cfg, path, key=None, timeout=1.0):
    """(status code, body) or (None, why) when nothing answers."""
    request = urllib.request.Request(cfg["url"] + path)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (OSError, ValueError) as e:
        return None, str(getattr(e, "reason", e))


def listed_model(cfg, key):
    """The served model's /v1/models entry ({"id", "max_model_len"}) once listed, else None."""
    code, body = get(cfg, "/v1/models", key)
    if code != 200:
        return None
    try:
        models = json.loads(body).get("data", [])
    except ValueError:
        return None
    for m in models:
        if m.get("id") == cfg["model"]:
            return {"id": m["id"], "max_model_len": m.get("max_model_len")}
    return None


def requests_running(cfg):
    code, body = get(cfg, "/metrics")
    if code != 200:
        return None
    values = re.findall(rb"^vllm:num_requests_running(?:\{[^}]*\})? ([0-9.e+-]+)$", body, re.M)
    return int(sum(float(v) for v in values)) if values else None


def status(cfg):
    sup = supervisor_state(cfg)
    code, _ = get(cfg, "/health")
    model = listed_model(cfg, api_key(cfg)) if code == 200 else None
    return {**sup, "health": code, "model": model, "running": requests_running(cfg) if code == 200 else None}


# ---------------------------------------------------------------- following the log

class LogFollower:
    """New lines of the current start's server output, split at \\n and \\r (progress bars)."""

    def __init__(self, cfg):
        self.cfg, self.partial, self.proc, self.file = cfg, b"", None, None
        self.shown_partial = b""

    def open(self, sup):
        """Start following once this start is identifiable: by its invocation id (systemd), or once
        its pid is known (tmux: the start note is written before that, so it marks this start)."""
        if self.cfg["supervisor"] == "systemd":
            if sup["invocation"] and self.proc is None:
                argv = ["journalctl", f"_SYSTEMD_INVOCATION_ID={sup['invocation']}", "-o", "cat", "--all",
                        "-n", "all", "-f", "--no-pager"]
                self.proc = subprocess.Popen((["sudo", "-n"] if self.cfg["sudo"] else []) + argv,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL)
                fd = self.proc.stdout.fileno()
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        elif self.file is None and sup["pid"] and os.path.exists(self.cfg["log_file"]):
            self.file = open(self.cfg["log_file"], "rb")
            self.file.seek(self.last_start(self.file))

    @staticmethod
    def last_start(f):
        """Offset of the latest start note, so only this start's lines are followed."""
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - (8 << 20)))
        tail = f.read()
        mark = tail.rfind(START_MARK)
        return size - len(tail) + (tail.rfind(b"\n", 0, mark) + 1 if mark >= 0 else 0)

    def read(self):
        data = b""
        if self.proc is not None:
            try:
                data = os.read(self.proc.stdout.fileno(), 1 << 20) or b""
            except BlockingIOError:
                pass
        elif self.file is not None:
            data = self.file.read()
        *lines, self.partial = re.split(rb"[\r\n]", self.partial + data)
        # a progress bar is rewritten after \r and ends only when the next one starts: pass on
        # the unfinished segment too (once per change), or the display lags one update behind
        if self.partial.strip() and self.partial != self.shown_partial:
            lines.append(self.partial)
        self.shown_partial = self.partial
        return [line.decode("utf-8", "replace")[:LINE_LIMIT] for line in lines if line.strip()]

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def log_tail(cfg):
    """The service log's last lines (tail_argv: journalctl or tail), for the failure report."""
    done = subprocess.run(cfg["tail_argv"], capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
    return (done.stdout or done.stderr).decode("utf-8", "replace")


def watch(cfg):
    started = time.monotonic()
    deadline = started + cfg["timeout"]
    key, log = api_key(cfg), LogFollower(cfg)
    first_pid, last_emit, last = None, 0.0, None
    try:
        while True:
            now = time.monotonic()
            sup = supervisor_state(cfg)
            log.open(sup)
            first_pid = first_pid or sup["pid"]
            lines = log.read()
            starting = sup["pid"] is None and sup["state"] == STARTING and now - started < START_GRACE_S
            if not starting and (sup["pid"] is None or sup["pid"] != first_pid
                                 or sup["state"].startswith(DEAD_STATES)):
                time.sleep(0.3)  # the dying process's last words are still on their way to the log
                emit({"log": lines + log.read(), "dead": sup, "tail": log_tail(cfg)})
                return
            code, why = get(cfg, "/health")
            report = {"log": lines, "health": code, "pid": sup["pid"]}
            if code == 200:
                model = listed_model(cfg, key)
                if model:
                    emit({**report, "ready": model})
                    return
            if now >= deadline:
                emit({**report, "timeout": cfg["timeout"], "why": why})
                return
            if lines or (code, sup["pid"]) != last or now - last_emit >= 1:
                emit(report)
                last_emit, last = now, (code, sup["pid"])
            time.sleep(cfg["interval"])
    finally:
        log.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
