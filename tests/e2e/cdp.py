"""A minimal Chrome DevTools Protocol client over `--remote-debugging-pipe` (no websocket
library needed): headless Chromium reads commands on its fd 3 and writes replies and events
on its fd 4, each message a JSON object followed by a NUL byte."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium with one page; `send` runs a command on that page's session."""

    def __init__(self, binary: str, profile_dir: Path, width: int = 1400,
                 height: int = 1800) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        args = [binary, "--headless=new", "--remote-debugging-pipe", "--no-sandbox",
                "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--no-default-browser-check", f"--user-data-dir={profile_dir}",
                f"--window-size={width},{height}", "about:blank"]
        # NOTE: bash (dash takes single-digit fds only) moves the pipe ends onto fds 3 and 4,
        # where Chromium expects them; from copies numbered 10 or more, so that neither
        # lands on the other's target.
        r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10)
        w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{r} 4>&{w} {r}<&- {w}>&-', "bash", *args],
            pass_fds=(r, w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for fd in (r, w, to_chrome_r, from_chrome_w):
            os.close(fd)
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self.events: list[dict] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self._call("Target.attachToTarget",
                                  {"targetId": target, "flatten": True})["sessionId"]

    def _read(self) -> None:
        buf = b""
        while True:
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                return
            buf += chunk
            *messages, buf = buf.split(b"\0")
            with self._cond:
                for raw in messages:
                    msg = json.loads(raw)
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self.events.append(msg)
                self._cond.notify_all()

    def _call(self, method: str, params: dict | None = None, session: str | None = None,
              timeout_s: float = 30.0) -> dict[str, Any]:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._next_id not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise TimeoutError(f"no reply to {method} (chromium rc {self.proc.poll()})")
                self._cond.wait(left)
            reply = self._replies.pop(self._next_id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def send(self, method: str, params: dict | None = None) -> dict[str, Any]:
        return self._call(method, params, self.session)

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression,
                                                "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def console_errors(self) -> list[str]:
        """Uncaught exceptions, console.error calls and error log entries (failed loads)."""
        with self._cond:
            events = list(self.events)
        out = []
        for e in events:
            p = e.get("params", {})
            if e.get("method") == "Runtime.exceptionThrown":
                out.append(json.dumps(p.get("exceptionDetails"))[:500])
            elif e.get("method") == "Runtime.consoleAPICalled" and p.get("type") == "error":
                out.append(json.dumps(p.get("args"))[:500])
            elif e.get("method") == "Log.entryAdded" and p["entry"].get("level") == "error":
                out.append(f"{p['entry'].get('text')} {p['entry'].get('url', '')}")
        return out

    def close(self) -> None:
        try:
            self._call("Browser.close", timeout_s=5.0)
        except (TimeoutError, RuntimeError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        os.close(self._to_chrome)
        self._reader.join(timeout=10)
        os.close(self._from_chrome)
