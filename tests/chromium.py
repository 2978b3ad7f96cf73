"""Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`):
standard library only, no debugging port to find or to leave open.

The browser runs in its own process group with a fresh profile directory; `close()` asks it to
quit, then kills the whole group by its id, so no renderer or zygote outlives a test.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

# Flags that keep the browser off the network and quiet: it talks to 127.0.0.1 only.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars",
         "--no-default-browser-check", "--metrics-recording-only", "--password-store=basic"]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    pass


class Chromium:
    """One headless browser with one page attached (flat session)."""

    def __init__(self, profile_dir: Path, log_path: Path, width: int = 1280, height: int = 900) -> None:
        binary = find_chromium()
        if binary is None:
            raise BrowserError("chromium is not installed (apt-get install chromium)")
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire_pipes() -> None:
            # The protocol pipe is fd 3 (commands in) and fd 4 (replies out). Copy both above
            # 10 first so the dup2s below cannot overwrite one with the other.
            inbound = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)
            outbound = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
            os.dup2(inbound, 3)
            os.dup2(outbound, 4)

        self._log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the browser
        self.popen = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile_dir}", "--remote-debugging-pipe",
             f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=False, preexec_fn=wire_pipes)  # noqa: PLW1509
        os.close(to_browser_r)
        os.close(from_browser_w)
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            for domain in ("Page", "Runtime", "Log"):
                self.page(f"{domain}.enable")
            self.page("Emulation.setDeviceMetricsOverride", width=width, height=height,
                      deviceScaleFactor=1, mobile=False)
        except Exception:
            self.close()
            raise

    # --- protocol -----------------------------------------------------------------------------
    def call(self, method: str, session: str | None = None, timeout: float = 30.0, **params: Any) -> Any:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline, method)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def page(self, method: str, timeout: float = 30.0, **params: Any) -> Any:
        return self.call(method, self._session, timeout, **params)

    def _read(self, deadline: float, method: str) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise BrowserError(f"{method}: no reply from chromium")
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise BrowserError(f"{method}: chromium closed the pipe (exit {self.popen.poll()})")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    # --- page helpers -------------------------------------------------------------------------
    def navigate(self, url: str, timeout: float = 30.0) -> None:
        """Open `url` and wait until its document (scripts included) has loaded."""
        result = self.page("Page.navigate", url=url)
        if result.get("errorText"):
            raise BrowserError(f"navigating to {url}: {result['errorText']}")
        deadline = time.monotonic() + timeout
        check = f"location.href === {json.dumps(url)} && document.readyState === 'complete'"
        while not self.evaluate(check):
            if time.monotonic() > deadline:
                raise BrowserError(f"{url} did not finish loading within {timeout:.0f} s")
            time.sleep(0.05)

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page (promises are awaited)."""
        result = self.page("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            error = result["exceptionDetails"].get("exception", {}).get("description")
            raise BrowserError(f"evaluating {expression[:60]!r}...: {error}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        data = self.page("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def problems(self) -> list[str]:
        """Exceptions thrown in the page, console errors and logged errors (CSP violations among
        them) seen so far."""
        found = []
        for event in self.events:
            params = event.get("params", {})
            if event["method"] == "Runtime.exceptionThrown":
                found.append(str(params["exceptionDetails"].get("exception", {}).get("description")))
            elif event["method"] == "Runtime.consoleAPICalled" and params.get("type") == "error":
                found.append(" ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif event["method"] == "Log.entryAdded" and params["entry"].get("level") == "error":
                found.append(params["entry"].get("text", ""))
        return found

    def drain_events(self) -> None:
        """Read the events that arrived since the last call (a cheap no-op command)."""
        self.call("Browser.getVersion")

    # --- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Ask the browser to quit, then kill its process group (renderers, zygotes) by id."""
        if self.popen.poll() is None:
            try:
                self.call("Browser.close", timeout=5)
            except (BrowserError, OSError):
                pass
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # the group the browser leads
        except ProcessLookupError:
            pass
        if self.popen.poll() is None:
            self.popen.wait(10)
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        self._log.close()

    @property
    def group(self) -> int:
        return self.popen.pid

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
