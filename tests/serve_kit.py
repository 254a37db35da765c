"""A live `kvstore serve` for the tests: the real executable in its own process, on a free
loopback port, with a private home; the official `openai` client pointed at it.

    with LiveServer(home, model_folder, "--chunk-size", "16") as server:
        client = server.client()            # openai.OpenAI(base_url=server.url + "/v1")
        server.kill_engine()                 # SIGKILL the engine process, the API stays up
        server.kill(); server.start()        # SIGKILL the whole server, start it again (same port)

`wrap` runs the server's command line through another command (its words first, the server's after:
e.g. `unshare` with a small tmpfs mounted on the home, for a disk that really fills up).

Output (both streams) goes to `server.log_path`; `server.log()` reads it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL_NAME = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def executable() -> str:
    beside = Path(sys.executable).parent / "kvstore"
    assert beside.exists(), "the kvstore executable is not installed (pip install -e .)"
    return str(beside)


class LiveServer:
    def __init__(self, home: Path, model: str | Path, *args: str, env: dict[str, str] | None = None,
                 name: str = MODEL_NAME, ready_timeout: float = 120.0, wrap: list[str] | None = None):
        self.home, self.model, self.args, self.name = Path(home), str(model), list(args), name
        self.wrap = list(wrap or [])  # a command that runs the server's command line (its words follow)
        self.env = {k: v for k, v in os.environ.items() if k != "KVSTORE_API_KEYS"}
        self.env.update(env or {})
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.home.parent / f"serve-{self.port}.log"
        self.ready_timeout = ready_timeout
        self.process: subprocess.Popen | None = None

    # -- life ------------------------------------------------------------------------------------
    def start(self, wait: bool = True) -> "LiveServer":
        log = open(self.log_path, "a", encoding="utf-8")
        cmd = [*self.wrap, executable(), "--home", str(self.home), "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--model", self.model, "--served-model-name", self.name, *self.args]
        self.process = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"kvstore serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"kvstore serve was not ready after {self.ready_timeout} s:\n{self.log()}")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def engine_pids(self) -> list[int]:
        return self.health()["engines"]

    def kill_engine(self, index: int = 0) -> int:
        pid = self.engine_pids()[index]
        os.kill(pid, signal.SIGKILL)
        return pid

    def kill(self) -> None:
        """SIGKILL the API process (its engines see their pipe close, checkpoint and exit)."""
        pids = self.engine_pids() if self.process.poll() is None else []
        self.process.kill()
        self.process.wait(30)
        deadline = time.monotonic() + 30
        for pid in pids:  # the engines leave on their own once their pipe closes
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.05)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then wait: the exit status."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            raise AssertionError(f"kvstore serve did not stop within {timeout} s of SIGTERM:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> "LiveServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- clients ---------------------------------------------------------------------------------
    def client(self, api_key: str = "unused", **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120, **kw)

    def http(self, api_key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
