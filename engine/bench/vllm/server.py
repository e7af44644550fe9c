"""vLLM's OpenAI server from ``.venv-vllm`` as a subprocess: started, polled for readiness, stopped.

It reuses :class:`tidegate.engine.bench.overload.server.Server` (a session of its own, ``/metrics``,
the process tree's memory, a SIGTERM-then-SIGKILL stop) with vLLM's command line and ``/health``.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

from tidegate.engine.bench.overload.server import Server, ServerError, metric

#: the python of vLLM's venv (``make vllm-setup``), relative to the repository root
VLLM_PYTHON = Path(".venv-vllm/bin/python")


class VllmServer(Server):
    """``python -m vllm.entrypoints.openai.api_server`` on a free port.

    :param python: vLLM's venv's python.
    :param model_dir: the model folder.
    :param args: every other server argument (common ones, then the arm's).
    :param log_path: where the server's stdout and stderr go.
    :param env: added to this process's environment (e.g. ``VLLM_CPU_KVCACHE_SPACE``).
    """

    def __init__(self, python: Path, model_dir: Path, args: list[str], log_path: Path, env: dict[str, str]) -> None:
        super().__init__([], log_path)
        self.cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                    "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
        self.ready_after_s: float | None = None

    def start(self, timeout_s: float) -> None:
        """Start vLLM and wait until ``/health`` answers 200 (the engine is up: vLLM listens only then)."""
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start vLLM's processes; :meth:`wait_ready` waits for them."""
        self._launched_at = time.monotonic()
        with open(self.log_path, "w") as log_file:
            self.proc = subprocess.Popen(self.cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until ``/health`` answers 200, at most ``timeout_s`` from the launch.

        :raises ServerError: vLLM exited or did not answer in time.
        """
        assert self.proc is not None, "launch() first"
        t0 = self._launched_at
        while self.ready_status() != 200:
            if self.proc.poll() is not None:
                raise ServerError(f"vLLM exited with code {self.proc.returncode} while starting; log: "
                                  f"{self.log_path}:\n{self.log_tail()}")
            if time.monotonic() - t0 > timeout_s:
                raise ServerError(f"vLLM's /health did not answer 200 within {timeout_s:.0f} s; log: {self.log_path}")
            time.sleep(1.0)
        self.ready_after_s = time.monotonic() - t0

    def ready_status(self, timeout_s: float = 2.0) -> int:
        try:
            return httpx.get(self.url + "/health", timeout=timeout_s).status_code
        except httpx.HTTPError:
            return 0

    def log_tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def in_flight(self) -> float:
        """Requests vLLM holds now, running or waiting (from ``/metrics``)."""
        values = self.metrics()
        return metric(values, "vllm:num_requests_running") + metric(values, "vllm:num_requests_waiting")

    def wait_idle(self, timeout_s: float) -> float:
        """Wait until vLLM holds no request (aborted streams included); the seconds it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            try:
                if self.in_flight() == 0:
                    return time.monotonic() - t0
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise ServerError(f"vLLM still held requests {timeout_s:.0f} s after the load ended")

    def kv_info(self) -> dict:
        """vLLM's ``cache_config_info`` labels (block size, KV blocks, prefix caching) from ``/metrics``."""
        for key in self.metrics():
            if key.startswith("vllm:cache_config_info{"):
                labels = key[len("vllm:cache_config_info{"):-1]
                return dict(part.split("=", 1) for part in labels.replace('"', "").split(",") if "=" in part)
        return {}
