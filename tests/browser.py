"""A real headless Chromium for tests, driven by the DevTools protocol over a pipe
(`--remote-debugging-pipe`: JSON messages, each ended by a NUL byte, on the browser's fds 3
(in) and 4 (out)), so nothing beyond Debian's `chromium` package is needed: no driver, no
websocket library, no browser download.

    with Browser() as b:
        b.open("file:///.../index.html")
        b.eval("document.title")
        b.click("th[data-key=norm]")
        b.problems   # console errors, uncaught exceptions, failed loads, as text

`Browser.missing()` says why no browser can run here (None when one can); the tests skip
with that reason, as .ci/run installs Chromium.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe", "--window-size=1200,900"]


def executable() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _above_4(fd: int) -> int:
    """The same file on a descriptor >= 10 (the original closed)."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return high


class BrowserError(RuntimeError):
    pass


class Browser:
    def __init__(self, timeout: float = 30.0):
        self.timeout = timeout
        self.problems: list[str] = []
        self._id = 0
        self._buffer = b""
        self._events: list[dict] = []

    @staticmethod
    def missing() -> str | None:
        if executable() is None:
            return "no chromium on PATH (.ci/run installs Debian's: apt-get install chromium)"
        return None

    def __enter__(self) -> Browser:
        self._profile = tempfile.mkdtemp(prefix="ppgd-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # above 4, so that the shell's redirections below cannot overwrite one another
        to_browser_r, from_browser_w = (_above_4(to_browser_r), _above_4(from_browser_w))

        # the browser reads commands on fd 3 and writes answers on fd 4: bash puts the
        # pipes there (no Python runs between fork and exec)
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w}',
             executable(), *FLAGS, f"--user-data-dir={self._profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(to_browser_r, from_browser_w))
        os.close(to_browser_r)
        os.close(from_browser_w)
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.call("Target.attachToTarget", targetId=target,
                                  flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=True)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.call("Browser.close")
        except (BrowserError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self._profile, ignore_errors=True)

    # -------------------------------------------------------------- protocol

    def _read(self) -> dict:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise BrowserError("chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def _note(self, event: dict) -> None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            self.problems.append(f"console.{params['type']}: {args}")
        elif method == "Runtime.exceptionThrown":
            d = params["exceptionDetails"]
            what = d.get("exception", {}).get("description") or d["text"]
            self.problems.append(f"uncaught: {what}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            e = params["entry"]
            self.problems.append(f"log: {e['text']} {e.get('url', '')}".strip())
        self._events.append(event)

    def call(self, method: str, session: bool = False, **params) -> dict:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply["result"]
            self._note(reply)

    # -------------------------------------------------------------- page

    def open(self, url: str) -> None:
        """Navigates and waits for the load event (scripts run by then)."""
        self._events.clear()
        self.call("Page.navigate", session=True, url=url)
        deadline = time.monotonic() + self.timeout
        while not any(e.get("method") == "Page.loadEventFired" for e in self._events):
            if time.monotonic() > deadline:
                raise BrowserError(f"{url}: no load event in {self.timeout} s")
            self._note(self._read())

    def eval(self, expression: str):
        """The value of a JS expression in the page (promises awaited)."""
        result = self.call("Runtime.evaluate", session=True, expression=expression,
                           returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str) -> None:
        """Polls until the expression is truthy (in JS: a DOM node is)."""
        deadline = time.monotonic() + self.timeout
        while True:
            if self.eval(f"Boolean({expression})"):
                return
            if time.monotonic() > deadline:
                shown = self.eval("document.body.innerText.slice(0, 300)")
                raise BrowserError(f"still false after {self.timeout} s: {expression}; the "
                                   f"page shows {shown!r}; problems: {self.problems}")
            time.sleep(0.05)

    def click(self, selector: str) -> None:
        """A real mouse click (pressed and released) at the centre of the element."""
        box = self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                        "e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect(); "
                        "return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", session=True, type=kind, x=box[0], y=box[1],
                      button="left", clickCount=1)
