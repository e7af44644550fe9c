"""A real vLLM server as the environment's engine: ``ServingEnv(backend="vllm")``.

vLLM's OpenAI server runs from its own venv (``.venv-vllm``, ``make vllm-setup``) with tidegate's
scheduler plugin and admission middleware, the controller ``learned`` inside its shield, and an
action channel (``engine.vllm.actions``): the learned controller in vLLM's scheduler computes its
features every ``control_interval`` steps, as deployed, and asks the env for the action instead of
its policy file. The env's traffic goes over HTTP as streamed completions, so what the reward counts
is what a client sees: TTFT from sending to the first token, TPOT over the stream, 429s.

vLLM keeps stepping while the agent thinks (and while PPO updates): this is the wall clock. An
answer later than the controller's time budget is missed as the deployed controller would miss it.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import random
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

import numpy as np

from tidegate.engine.bench.vllm.arms import MIDDLEWARE, SCHEDULER_CLS
from tidegate.engine.bench.vllm.clients import body, dropped_record, send, session
from tidegate.engine.bench.vllm.model import model_folder, prompt_token_ids
from tidegate.engine.bench.vllm.server import VLLM_PYTHON, ServerError, VllmServer
from tidegate.engine.core.profile import Profile
from tidegate.engine.core.profile_file import profile_to_dict
from tidegate.engine.vllm.actions import ActionWriter
from tidegate.engine.vllm.channel import EngineRecord, EngineRecordReader
from tidegate.engine.vllm.config import ReplicaLimits

#: seconds vLLM may take to start (model load and warm-up: about a minute on two cores)
START_TIMEOUT_S = 600.0
#: seconds without a policy call, while requests are in flight, before the replica counts as stalled
STALL_S = 120.0
#: seconds an episode's end waits for vLLM to let go of the requests it aborted
IDLE_TIMEOUT_S = 120.0
#: seconds one request may stay open (then it ends ``cut``, a miss)
REQUEST_TIMEOUT_S = 3600.0
#: how often a waiting env looks at the engine's half of the action channel
POLL_S = 1e-3
#: the env's clients: streams open at once at most (an arrival past them is dropped, a miss)
MAX_OPEN = 512


class VllmReplicaError(ValueError):
    """The vLLM replica could not start or stopped answering; one sentence."""


class VllmReplica:
    """vLLM with the plugin, its traffic and its action channel, for one ``ServingEnv``.

    :param model: ``tiny`` (built from a config with seeded weights) or a Hugging Face folder.
    :param profile: the profile the plugin's controller estimates with (its limits become vLLM's).
    :param control_interval: vLLM steps between two policy calls.
    :param shield_mode: the learned controller's shield mode.
    :param time_budget_s: the learned controller's time budget for the env's answer.
    :param kv_cache_gib: vLLM's KV cache (``VLLM_CPU_KVCACHE_SPACE``).
    :param vllm_python: vLLM's venv's python.
    :param vllm_args: more server arguments.
    :param work_dir: the model, channel and log folder (None: a temporary one).
    :param log: progress lines (None: quiet).
    :param wait: wait for vLLM and warm it up here; False: only launch it, and :meth:`ready` (which
        ``ServingEnv`` calls) waits. Several replicas launched side by side start in about half the time
        they take one after another.
    :param max_open: the clients' streams open at once at most, each on a connection of its own. An
        arrival that finds them all open is not sent: it ends ``dropped`` (a miss), as a client pool's
        would. Past a few hundred arrivals a second vLLM's API process (one Python thread) answers
        slower than they come, even with 429s, and an unbounded sender only grows its own backlog,
        starving the server it shares the CPUs with of the time to answer it: at 64 x the tiny
        model's bound on two cores, 30,000 streams waited on the client's side and vLLM's engine
        went two minutes without a request.
    """

    def __init__(self, model: str, profile: Profile, control_interval: int, shield_mode: str, time_budget_s: float,
                 kv_cache_gib: float = 1.0, vllm_python: str | Path | None = None, vllm_args: tuple[str, ...] = (),
                 work_dir: str | Path | None = None, log: Callable[[str], None] | None = None,
                 wait: bool = True, max_open: int = MAX_OPEN) -> None:
        python = Path(vllm_python) if vllm_python else VLLM_PYTHON
        if not python.exists():
            raise VllmReplicaError(f"no vLLM python at {python}: run `make vllm-setup` or give vllm_python.")
        if max_open < 1:
            raise VllmReplicaError(f"max_open must be at least 1, got {max_open}")
        self.dir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="tidegate-env-vllm-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        folder = model_folder(model, self.dir / "models")
        self.token_ids = prompt_token_ids(folder)
        config = json.loads((folder / "config.json").read_text())
        self.max_model_len = int(config.get("max_position_embeddings") or 1 << 30)
        profile_path = self.dir / "profile.json"
        profile_path.write_text(json.dumps(profile_to_dict(profile)))
        channel = str(self.dir / "channel")
        self.actions = ActionWriter(channel)
        self.records = EngineRecordReader(channel)
        self.profile, self.control_interval, self.shield_mode = profile, control_interval, shield_mode
        spec = (f"learned:control_interval={control_interval},time_budget_s={time_budget_s:g},"
                f"shield_mode={shield_mode},residual_scale=1")
        plugin = {"controller": spec, "profile": str(profile_path), "channel": channel, "action_channel": channel,
                  "decide_timeout_s": time_budget_s + 0.1}
        args = ["--scheduler-cls", SCHEDULER_CLS, "--middleware", MIDDLEWARE,
                "--additional-config", json.dumps({"tidegate": plugin}), "--served-model-name", "env", *vllm_args]
        self.server = VllmServer(python, folder, args, self.dir / "vllm.log",
                                 {"VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}"})
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tidegate-env-client", daemon=True)
        self._thread.start()
        self._ended: deque[dict] = deque()
        self._tasks: set[asyncio.Future] = set()
        self._sender: asyncio.Future | None = None
        self.sent = 0
        #: arrivals not sent because ``max_open`` streams were open
        self.dropped = 0
        self.max_open = max_open
        self._closed = False
        atexit.register(self.close)  # the server runs in a session of its own: never left behind
        self._log = log
        self.limits: ReplicaLimits | None = None
        if log:
            log(f"starting vLLM ({folder}) with the plugin and the env's action channel")
        self.server.launch()
        if wait:
            self.ready()

    def ready(self) -> ReplicaLimits:
        """Wait for vLLM (once) and warm it up; the replica's limits. On failure the replica is closed.

        :raises VllmReplicaError: vLLM exited or did not answer, in one sentence.
        """
        if self.limits is not None:
            return self.limits
        if self._closed:
            raise VllmReplicaError("this vLLM replica is closed")
        try:
            self.server.wait_ready(START_TIMEOUT_S)
        except ServerError as exc:
            self.close()
            raise VllmReplicaError(str(exc).splitlines()[0]) from None
        if self._log:
            self._log(f"vLLM answered after {self.server.ready_after_s:.0f} s")
        try:
            self.limits = self._warm_up()
        except BaseException:
            self.close()
            raise
        return self.limits

    # ------------------------------------------------------------------ start-up
    def _warm_up(self) -> ReplicaLimits:
        """Two short requests; the limits vLLM's engine published after them."""
        rng = random.Random(-1)
        for _ in range(2):
            self._run(self._send_now(rng, 16, 4))
        deadline = time.monotonic() + 30.0
        while (record := self.records.read()) is None:
            if time.monotonic() > deadline:
                raise VllmReplicaError(f"vLLM's engine published no observation; its log: {self.server.log_path}")
            time.sleep(0.1)
        return record.limits

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _send_now(self, rng: random.Random, prompt: int, output: int) -> dict:
        async with session(1) as client:
            return await send(client, self.server.url, self._body(rng, prompt, output), time.monotonic() + 60.0)

    def _body(self, rng: random.Random, prompt: int, output: int) -> dict:
        """A streamed completion of ``prompt`` random ordinary ids and exactly ``output`` tokens."""
        return body({"model": "env", "token_ids": self.token_ids, "prompt_tokens": prompt, "max_tokens": output}, rng)

    # ------------------------------------------------------------------ traffic
    def start_traffic(self, next_arrival: Callable[[], tuple[float, int, int]], seed: int) -> None:
        """Send requests until :meth:`stop_traffic`: ``next_arrival()`` gives the next one's time
        (seconds from now), prompt length and output length; prompt content is random ids."""
        self._sender = asyncio.run_coroutine_threadsafe(self._send_all(next_arrival, seed), self._loop)

    async def _send_all(self, next_arrival: Callable[[], tuple[float, int, int]], seed: int) -> None:
        rng = random.Random(seed)
        client = session(self.max_open)
        tasks: set[asyncio.Future] = set()
        self._tasks = tasks
        t0 = time.monotonic()
        try:
            while True:
                at_s, prompt, output = next_arrival()
                prompt = max(1, min(prompt, self.max_model_len // 2))
                output = max(1, min(output, self.max_model_len - prompt))
                delay = t0 + at_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if len(tasks) >= self.max_open:  # every client waits on a stream: this arrival is a miss
                    self.dropped += 1
                    self._ended.append(dropped_record())
                    continue
                task = asyncio.ensure_future(send(client, self.server.url, self._body(rng, prompt, output),
                                                  time.monotonic() + REQUEST_TIMEOUT_S))
                tasks.add(task)
                task.add_done_callback(lambda t: self._done(t, tasks))
                self.sent += 1
        finally:
            for task in list(tasks):
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            await client.close()

    def _done(self, task: asyncio.Future, tasks: set[asyncio.Future]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is None and tasks is self._tasks:
            self._ended.append(task.result())

    def in_flight(self) -> int:
        return len(self._tasks)

    def ended(self) -> list[dict]:
        """The records of the requests that ended since the last call (``engine.bench.vllm.clients``)."""
        out = []
        while self._ended:
            out.append(self._ended.popleft())
        return out

    def stop_traffic(self) -> None:
        """Stop sending, cut every open stream (vLLM aborts them), wait until vLLM holds nothing."""
        sender = self._sender
        self._sender = None
        if sender is not None:
            sender.cancel()
            try:
                sender.result(timeout=IDLE_TIMEOUT_S)
            except BaseException:  # cancelled: the sender's finally block cuts the streams
                pass
        self._tasks = set()
        self._ended.clear()
        try:
            self.server.wait_idle(IDLE_TIMEOUT_S)
        except ServerError as exc:
            raise VllmReplicaError(str(exc)) from None

    # ------------------------------------------------------------------ the policy's calls
    def latest_call(self) -> tuple[int, np.ndarray | None]:
        call, _, x = self.actions.latest_call()
        return call, x

    def answer_and_wait(self, call: int, action) -> tuple[int, np.ndarray]:
        """Answer policy call ``call`` with ``action``, then wait for a later call: its number and
        features (the latest, if several came while the agent was away)."""
        self.actions.answer(call, action)
        last_progress = time.monotonic()
        next_check = last_progress + 1.0
        while True:
            latest, _, x = self.actions.latest_call()
            if latest > call and x is not None:
                return latest, x
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 1.0
                if self.server.proc is not None and self.server.proc.poll() is not None:
                    raise VllmReplicaError(f"vLLM exited with code {self.server.proc.returncode}; its log: "
                                           f"{self.server.log_path}")
                if not self._tasks:
                    last_progress = now  # nothing to serve: vLLM waits for the next arrival, and so does the env
                elif now - last_progress > STALL_S:
                    raise VllmReplicaError(f"vLLM made no policy call in {STALL_S:.0f} s with "
                                           f"{len(self._tasks)} requests open; its log: {self.server.log_path}")
            time.sleep(POLL_S)

    def record(self) -> EngineRecord | None:
        """The engine's latest published record (observation, limits, counters)."""
        return self.records.read()

    def close(self) -> None:
        """Stop sending and stop vLLM (again: nothing)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._sender is not None:
            self._sender.cancel()
            self._sender = None
        self.server.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self.records.close()
        self.actions.close()
