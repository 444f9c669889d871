"""``npuw-kv serve`` in a child process on 127.0.0.1, for tests, benchmarks and the demo:
started with ``--port 0``, its URL read from the line it prints once it listens, stopped by a
signal (its exit code returned)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from ..tools import children

START_S = 300  # a cold model cache converts the GGUF first


class ServeProcess:
    def __init__(self, *args: str) -> None:
        # the child's stderr: read by stderr(), closed by stop()
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        self._stderr: str | None = None
        command = [sys.executable, "-m", "npuw_kv.cli", "serve", "--port", "0", *args]
        self.proc = children.start(
            command, stdout=subprocess.PIPE, stderr=self.log, text=True, env=dict(os.environ)
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_S
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "listening on" in line or not line:
                break
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"npuw-kv serve did not start: {self.stderr()}")
        self.url = line.split("listening on ")[1].split()[0]  # http://127.0.0.1:PORT/v1
        self.root = self.url.removesuffix("/v1")

    def stderr(self) -> str:
        """What the server wrote to stderr (kept after :meth:`stop`)."""
        if self._stderr is None:
            return Path(self.log.name).read_text()
        return self._stderr

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.root + "/health", timeout=10) as reply:
            return dict(json.load(reply))

    def models(self) -> list[str]:
        """The model names the server answers to (``/v1/models``)."""
        with urllib.request.urlopen(self.url + "/models", timeout=10) as reply:
            return [model["id"] for model in json.load(reply)["data"]]

    def wait_idle(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """/health once no request runs or waits (or after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            health = self.health()
            if (health["running"] == 0 and health["admitted"] == 0) or time.monotonic() > deadline:
                return health
            time.sleep(0.05)

    def rss_mb(self) -> float:
        """The server's resident memory now."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS in /proc (Linux only)")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            self._stderr = self.stderr()
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
