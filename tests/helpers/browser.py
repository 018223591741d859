"""A real headless Chromium (the system package), driven over the DevTools protocol.

Enough to open a page the way a person's browser does and ask what it shows: which images
loaded and at what size, which requests failed or were refused, what the console said,
and a screenshot of the whole page.
"""
import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from websockets.sync.client import connect

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def executable() -> str | None:
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


@dataclass
class Rendered:
    images: list[dict]  # per <img>: complete, width, height (natural), src length
    failed: list[str] = field(default_factory=list)  # requests that failed or were blocked
    console: list[str] = field(default_factory=list)  # console/log errors (CSP violations land here)
    screenshot: bytes = b""


class Chromium:
    """``with Chromium() as browser: browser.render(path)``; the browser process dies with the block."""

    def __init__(self, width: int = 1280, height: int = 900):
        self.width, self.height = width, height

    def __enter__(self):
        self.profile = tempfile.mkdtemp(prefix="specops-chromium-")
        argv = [executable(), "--headless=new", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--hide-scrollbars",  # a scrollbar would narrow the page as it is measured
                "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
                f"--window-size={self.width},{self.height}", "about:blank"]
        if os.geteuid() == 0:
            argv.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"chromium did not start (exit {self.proc.poll()})")
            time.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def render(self, path: Path, timeout: float = 60) -> Rendered:
        """Open file://PATH in a fresh tab, wait for its load event, and report what it shows."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(request, timeout=10) as r:
            target = json.load(r)
        with connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=10) as ws:
            return _Tab(ws, timeout).render(Path(path).resolve().as_uri(), self.width, self.height)


class _Tab:
    def __init__(self, ws, timeout):
        self.ws, self.timeout, self.next_id, self.events = ws, timeout, 0, []

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_for(self, method: str) -> dict:
        for i, event in enumerate(self.events):
            if event.get("method") == method:
                return self.events.pop(i)
        deadline = time.monotonic() + self.timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("method") == method:
                return msg
            self.events.append(msg)

    def render(self, url: str, width: int, height: int) -> Rendered:
        for domain in ("Page", "Network", "Log", "Runtime"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")
        images = self.call("Runtime.evaluate", returnByValue=True, expression="""
            Array.from(document.images).map(i => ({complete: i.complete, width: i.naturalWidth,
                                                   height: i.naturalHeight, src_length: i.src.length}))""")
        metrics = self.call("Page.getLayoutMetrics")["cssContentSize"]
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": metrics["width"], "height": metrics["height"], "scale": 1})
        failed = [f"{e['params'].get('errorText')} {e['params'].get('blockedReason', '')}".strip()
                  for e in self.events if e.get("method") == "Network.loadingFailed"]
        console = [e["params"]["entry"]["text"] for e in self.events
                   if e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error"]
        console += [json.dumps(e["params"]) for e in self.events if e.get("method") == "Runtime.exceptionThrown"]
        return Rendered(images["result"]["value"], failed, console, base64.b64decode(shot["data"]))
