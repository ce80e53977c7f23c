"""A headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`): no WebDriver, no
websocket, no Python dependency. The browser reads commands on its fd 3 and writes answers on its fd 4, each a JSON
message ended by a NUL byte. Enough of the protocol for the UI test: open a page, evaluate JavaScript (waiting for a
condition inside the page), click an element with real mouse events, collect the page's uncaught errors.

`find_chromium()` names the browser (ROLLEDGER_CHROMIUM, else chromium / chromium-browser / google-chrome on PATH;
None when there is none).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

FLAGS = (
    "--headless",
    "--no-sandbox",  # root in a container
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--no-first-run",
    "--no-default-browser-check",
    "--hide-scrollbars",
    "--window-size=1400,1000",
    "--remote-debugging-pipe",
)


class BrowserError(RuntimeError):
    """The browser died, answered an error, or did not answer in time."""


def find_chromium() -> str | None:
    explicit = os.environ.get("ROLLEDGER_CHROMIUM")
    if explicit:
        return shutil.which(explicit)
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Browser:
    """One headless browser process; `page(url)` opens a tab and returns its session."""

    def __init__(self, binary: str, profile: Path, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        to_browser_r, to_browser_w = os.pipe()
        from_browser_r, from_browser_w = os.pipe()
        # Above the low numbers so the redirections below never overwrite each other.
        child_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)
        child_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self.log = profile.parent / "chromium.log"
        script = f'exec 3<&{child_r} 4>&{child_w} {child_r}<&- {child_w}>&-; exec "$@"'
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["bash", "-c", script, "chromium", binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                pass_fds=(child_r, child_w),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # its renderers and helpers share its process group: stopped together
            )
        os.close(child_r)
        os.close(child_w)
        self._out = os.fdopen(to_browser_w, "wb", buffering=0)
        self._in = from_browser_r
        self._next_id = 0
        self._answers: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self.errors: list[str] = []  # uncaught exceptions and console.error of every page
        self._reader = threading.Thread(target=self._read, name="cdp-reader", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------ the pipe
    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._in, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                self._dispatch(json.loads(raw))

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if "id" in msg:
            with self._cond:
                self._answers[msg["id"]] = msg
                self._cond.notify_all()
            return
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text", "")
            self.errors.append(f"uncaught: {text}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.errors.append(
                "console.error: " + " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
            )

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        with self._cond:
            self._next_id += 1
            msg_id = self._next_id
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session is not None:
            msg["sessionId"] = session
        self._out.write(json.dumps(msg).encode() + b"\0")
        with self._cond:
            answered = self._cond.wait_for(lambda: msg_id in self._answers or self._closed, timeout=self.timeout_s)
            if msg_id not in self._answers:
                why = "closed its pipe" if self._closed else f"did not answer in {self.timeout_s:.0f} s"
                raise BrowserError(f"{method}: the browser {why} (log: {self.log})")
            answer = self._answers.pop(msg_id)
        assert answered
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    # ------------------------------------------------------------ pages
    def page(self, url: str) -> Page:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Runtime.enable", session=session)
        self.send("Page.enable", session=session)
        self.send("Page.navigate", {"url": url}, session=session)
        return Page(self, session, target)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("Browser.close")
        except BrowserError:
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this browser was started in
            self.proc.wait(timeout=15)
        self._out.close()


class Page:
    """One tab."""

    def __init__(self, browser: Browser, session: str, target: str) -> None:
        self.browser = browser
        self.session = session
        self.target = target

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (a promise is awaited)."""
        res = self.browser.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            session=self.session,
        )
        if "exceptionDetails" in res:
            details = res["exceptionDetails"]
            raise BrowserError(f"{expression!r}: {details.get('exception', {}).get('description') or details}")
        return res.get("result", {}).get("value")

    def wait_for(self, condition: str, timeout_s: float = 30.0) -> Any:
        """Wait inside the page until `condition` (a JavaScript expression) is truthy; return its value. The page
        checks it every 50 ms of its own clock; past the timeout the failure shows what the page displays."""
        js = (
            "new Promise(resolve => { const t0 = Date.now(); (function check() { let v = null;"
            f" try {{ v = ({condition}); }} catch (e) {{ v = null; }}"
            f" if (v) resolve(v); else if (Date.now() - t0 > {timeout_s * 1000:.0f}) resolve(null);"
            " else setTimeout(check, 50); })(); })"
        )
        value = self.evaluate(js)
        if not value:
            shown = self.evaluate("document.body ? document.body.innerText.slice(0, 1500) : ''")
            raise AssertionError(
                f"the page never showed {condition!r} within {timeout_s:.0f} s; errors: {self.browser.errors}; "
                f"it shows:\n{shown}"
            )
        return value

    def click(self, selector: str) -> None:
        """A real left click (mouse moved, pressed, released) at the middle of the first element `selector` names."""
        box = self.evaluate(
            f"(() => {{ const el = document.querySelector({json.dumps(selector)}); if (!el) return null;"
            " el.scrollIntoView({block: 'center', inline: 'center'}); const r = el.getBoundingClientRect();"
            " return {x: r.left + r.width / 2, y: r.top + r.height / 2}; })()"
        )
        if box is None:
            raise AssertionError(f"nothing to click: {selector!r}")
        for kind, button in (("mouseMoved", "none"), ("mousePressed", "left"), ("mouseReleased", "left")):
            params = {"type": kind, "x": box["x"], "y": box["y"], "button": button, "clickCount": 1}
            self.browser.send("Input.dispatchMouseEvent", params, session=self.session)

    def close(self) -> None:
        self.browser.send("Target.closeTarget", {"targetId": self.target})
