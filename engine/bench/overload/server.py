"""``tidegate serve`` as a subprocess under test, and a sampler of its ``/metrics`` and memory."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil


class ServerError(RuntimeError):
    """The server did not start or stopped answering."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``tidegate serve`` as a subprocess in a session of its own, so stopping it stops its children too.

    :param serve_args: options after ``serve`` (``--port`` is added)
    :param log_path: where the server's stdout and stderr go
    """

    def __init__(self, serve_args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "tidegate", "serve", "--port", str(self.port), *serve_args]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.known: dict[int, psutil.Process] = {}

    def start(self, timeout_s: float) -> None:
        """Start the server and wait until ``/ready`` answers 200."""
        with open(self.log_path, "w") as log_file:
            self.proc = subprocess.Popen(self.cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.ready_status() == 200:
                return
            if self.proc.poll() is not None:
                raise ServerError(f"the server exited with code {self.proc.returncode}; log: {self.log_path}")
            if time.monotonic() > deadline:
                raise ServerError(f"/ready did not answer 200 within {timeout_s:.0f} s; log: {self.log_path}")
            time.sleep(0.2)

    def ready_status(self, timeout_s: float = 2.0) -> int:
        try:
            return httpx.get(self.url + "/ready", timeout=timeout_s).status_code
        except httpx.HTTPError:
            return 0

    def model_info(self) -> tuple[str, int | None]:
        """(the served model's name, its context length)."""
        model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]
        return model["id"], model.get("max_model_len")

    def tree(self) -> list[psutil.Process]:
        """The server process and all its descendants (remembered, so :meth:`stop` can end strays)."""
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return []
        for p in procs:
            self.known.setdefault(p.pid, p)
        return procs

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system) the server's processes have used."""
        total = 0.0
        for p in self.tree():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def rss_mib(self) -> float:
        total = 0
        for p in self.tree():
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total / 2**20

    def engine_pid(self) -> int | None:
        """The engine's process while ``/health`` answers 200: its ``engine_pid``, else the one child of
        the server that is not multiprocessing's resource tracker; None while ``/health`` does not."""
        try:
            resp = httpx.get(self.url + "/health", timeout=5)
            pid = resp.json().get("engine_pid") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        if resp.status_code != 200:
            return None
        if pid:
            return int(pid)
        for p in self.tree()[1:]:
            try:
                if p.ppid() == self.proc.pid and "resource_tracker" not in " ".join(p.cmdline()):
                    return p.pid
            except psutil.Error:
                continue
        return None

    def metrics(self) -> dict[str, float]:
        """Every sample of ``/metrics``, keyed by name with its labels."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def stop(self) -> None:
        """SIGTERM to the session (the server drains), SIGKILL after 15 s, then any descendant left."""
        if self.proc is None:
            return
        self.tree()
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        for p in self.known.values():
            try:
                if p.is_running():
                    p.kill()
            except psutil.Error:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def log_errors(self, limit: int = 5) -> dict:
        """How many tracebacks and ERROR lines the server logged, with the first few."""
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        hits = [ln for ln in lines if "Traceback" in ln or "ERROR" in ln or "Error:" in ln]
        return {"count": len(hits), "first": hits[:limit], "log": str(self.log_path)}


def metric(values: dict[str, float], name: str) -> float:
    """The sum of every series of one metric."""
    return sum(v for k, v in values.items() if k == name or k.startswith(name + "{"))


class Poller(threading.Thread):
    """Calls :meth:`sample` every ``period_s`` (on the clock, not after each call) until :meth:`stop`;
    ``samples`` holds what it appended, ``failures`` the polls whose ``/metrics`` failed."""

    def __init__(self, period_s: float) -> None:
        super().__init__(daemon=True)
        self.period_s = period_s
        self.samples: list[tuple] = []
        self.failures = 0
        self.halt = threading.Event()

    def sample(self, t: float) -> None:
        raise NotImplementedError

    def run(self) -> None:
        while not self.halt.is_set():
            t = time.monotonic()
            self.sample(t)
            self.halt.wait(max(0.0, t + self.period_s - time.monotonic()))

    def stop(self) -> None:
        self.halt.set()
        self.join(10)


class Sampler(Poller):
    """Polls ``/metrics`` for KV usage and the server tree's resident memory every ``period_s``:
    (time, kv usage, rss MiB)."""

    def __init__(self, server: Server, period_s: float) -> None:
        super().__init__(period_s)
        self.server = server

    def sample(self, t: float) -> None:
        try:
            kv = metric(self.server.metrics(), "tidegate:kv_cache_usage_perc")
        except (httpx.HTTPError, ValueError):
            kv, self.failures = None, self.failures + 1
        self.samples.append((t, kv, self.server.rss_mib()))

