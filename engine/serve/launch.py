"""Running the server: its settings, the listening sockets, loading the model into an engine
service, a quick step-time fit at start-up, and uvicorn with a draining shutdown."""

from __future__ import annotations

import dataclasses
import errno
import gc
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from tidegate.engine.serve.config import ServeConfig
from tidegate.engine.serve.connections import http_protocol
from tidegate.engine.serve.metrics import ServerMetrics
from tidegate.engine.serve.service import EngineService

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("tidegate.server")

#: the start-up fit: timed runs per batch shape of the quick grid, and walks over it
_FIT_REPEATS = 2
_FIT_PASSES = 2


#: seconds an idle keep-alive connection stays open. Longer than any common client keeps one
#: (httpx, under the openai client: 5 s), so the client always closes first: with uvicorn's default
#: of 5 s, a request sent on a connection the server was closing at that moment failed with a
#: read error (1 of 9,859 requests in the overload benchmark).
KEEP_ALIVE_S = 75

def build_service(config: ServeConfig, model_and_tokenizer=None) -> EngineService:
    """Start the engine (in a process of its own, or, given an already loaded ``(model, tokenizer)``
    or ``engine_process=False``, in a thread here) and wait until it serves.

    :raises ValueError: one sentence, when the engine cannot start (bad model, device, sizes).
    """
    service = EngineService(config, ServerMetrics(config.model_name), model_and_tokenizer)
    service.start()
    _cap_context(service, config.max_model_len)
    return service


def _cap_context(service: EngineService, max_model_len: int | None) -> None:
    """Serve at most ``max_model_len`` tokens of context: the HTTP side checks every request against
    ``service.info.max_model_len``, so a longer one gets its 400 before it reaches the engine."""
    info = service.info
    if max_model_len is None or info is None:
        return
    model_len = info.max_model_len
    if model_len is not None and max_model_len > model_len:
        log.warning("--max-model-len %d is more than the model's context of %d tokens; serving %d",
                    max_model_len, model_len, model_len)
        return
    service.info = dataclasses.replace(info, max_model_len=max_model_len)


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to ``host:port`` (every address the host resolves to, as uvicorn binds them), not
    yet listening: the port is held while the model loads, and uvicorn listens on them once the
    engine serves.

    :raises ValueError: one sentence, when the port is in use or the host cannot be listened on.
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"the host {host!r} cannot be resolved ({exc.strerror})") from None
    sockets: list[socket.socket] = []
    for family, kind, proto, _, address in dict.fromkeys(infos):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:  # a family this machine lacks; asyncio skips it too
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # one socket per family, as asyncio does
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRNOTAVAIL:  # e.g. ::1 where IPv6 is off; asyncio skips it too
                continue
            for bound in sockets:
                bound.close()
            if exc.errno == errno.EADDRINUSE:
                raise ValueError(f"port {port} on {host} is already in use") from None
            raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
        sockets.append(sock)
    if not sockets:
        raise ValueError(f"cannot listen on {host}:{port} (no address of it can be bound here)")
    return sockets


def fit_profile(config: ServeConfig, out_path: Path) -> Path:
    """Fit a quick step-time profile of ``config.model`` on its device and write it to ``out_path``.

    The fit runs in a process of its own, which loads the model once more and frees its memory
    when it ends, so the engine process finds the device as it would without the fit.

    :raises ValueError: one sentence, when the model cannot be loaded or timed.
    """
    out_path.parent.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
        future = pool.submit(_fit_and_save, config.model, config.device, config.dtype, config.threads,
                             str(out_path))
        try:
            future.result()
        except BrokenProcessPool:
            raise ValueError("the start-up profile fit ended without a result (its process died)") from None
        except ValueError:
            raise
        except Exception as exc:
            raise ValueError(f"the start-up profile fit failed: {type(exc).__name__}: {exc}") from None
    return out_path


def _fit_and_save(model: str, device: str | None, dtype: str | None, threads: int | None, out_path: str) -> None:
    import torch

    from tidegate.engine.real.profiler import run_profile

    # the threads the engine process will step with, so the fit times what it will serve
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(threads or max(1, cores - 1))
    name = f"fit-{Path(model).name}"
    profile = run_profile(model, device=device, dtype=dtype, name=name, repeats=_FIT_REPEATS,
                          passes=_FIT_PASSES, quick=True)
    profile.save(Path(out_path))


def _uvicorn_log_level(level: str) -> str:
    # uvicorn's info lines repeat the banner; its debug, warnings and errors come through
    return "warning" if level == "info" else level


class GracefulServer:
    """uvicorn with a draining shutdown: on SIGTERM stop admitting (503), let in-flight requests
    finish within ``drain_timeout_s``, then exit. A second signal exits at once.

    :param sockets: already bound sockets to listen on (:func:`bind_sockets`); None: uvicorn binds
        ``config.host`` and ``config.port`` itself
    :param on_started: called once the server listens
    """

    def __init__(self, app: FastAPI, service: EngineService, config: ServeConfig,
                 sockets: list[socket.socket] | None = None, on_started: Callable[[], None] | None = None) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            def handle_exit(inner, sig: int, frame) -> None:  # noqa: N805
                if service.draining or sig != signal.SIGTERM:
                    return uvicorn.Server.handle_exit(inner, sig, frame)
                service.draining = True
                log.warning("SIGTERM: draining %d in-flight requests (up to %.0f s)", service.in_flight,
                            config.drain_timeout_s)
                threading.Thread(target=self._drain_then_exit, daemon=True).start()

            async def startup(inner, sockets: list[socket.socket] | None = None) -> None:  # noqa: N805
                await uvicorn.Server.startup(inner, sockets)
                if inner.started and on_started is not None:
                    on_started()

        self.service = service
        self.config = config
        self.sockets = sockets
        self.server = _Server(uvicorn.Config(app, host=config.host, port=config.port,
                                             log_level=_uvicorn_log_level(config.log_level),
                                             access_log=config.access_log, timeout_graceful_shutdown=5,
                                             timeout_keep_alive=KEEP_ALIVE_S, http=http_protocol(), ws="none"))
        if config.access_log:  # its lines are at info, whatever uvicorn's own level
            logging.getLogger("uvicorn.access").setLevel(logging.INFO)

    def _drain_then_exit(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.service.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.server.should_exit = True

    def run(self) -> None:
        # What is loaded by now lives as long as the server: out of the collector's reach, a full
        # collection under load no longer walks it (what vLLM's API server does too).
        gc.collect()
        gc.freeze()
        try:
            self.server.run(sockets=self.sockets)
        finally:
            self.service.stop()
            for sock in self.sockets or ():
                sock.close()
