"""``npuw-kv serve`` started in a child process on 127.0.0.1 for a test, stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# the settings of tests/conftest.py's f32_pipe: exact f32 compute and KV on the paged path
EXACT_ARGS = (
    "--exact", "--kv-precision", "f32", "--chunk", "256", "--max-prompt-len", "1024",
    "--min-response-len", "64", "--attention", "pa",
)  # fmt: skip
START_S = 300  # a cold model cache converts the GGUF first


class ServeProcess:
    def __init__(self, *args: str) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115 (closed by stop)
        command = [sys.executable, "-m", "npuw_kv.cli", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(
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
        return Path(self.log.name).read_text()

    def health(self) -> dict:
        return httpx.get(self.root + "/health", timeout=10).json()

    def wait_idle(self, timeout_s: float = 120.0) -> dict:
        """/health once no request runs or waits."""
        deadline = time.monotonic() + timeout_s
        while True:
            health = self.health()
            if (health["running"] == 0 and health["admitted"] == 0) or time.monotonic() > deadline:
                return health
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            self.log.close()
        return code
