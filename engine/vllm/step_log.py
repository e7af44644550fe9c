"""One CSV row per vLLM step: the batch's composition, its duration and what the plugin decided.

The columns ``tokens``, ``kv_tokens_read``, ``real_s``, ``decodes``, ``prefills``, ``prefill_pairs``
and ``first_decodes`` are those of a ``twin_steps.csv``, so ``tidegate profile --from-steps FILE``
fits a step-time profile of the vLLM replica from the log as it is. No field holds a comma.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(slots=True)
class StepRow:
    """One step of vLLM.

    :param step: the step's index (schedule calls since start-up).
    :param time_s: when it was scheduled, in seconds since the scheduler started.
    :param real_s: its duration: from the start of ``schedule()`` to the end of ``update_from_output()``.
    :param tokens: new tokens computed (prefill plus decode; prefix-cache hits are not computed).
    :param prefill_tokens: of them, prompt (or recompute) tokens.
    :param decode_tokens: of them, decode tokens (spec tokens included).
    :param requests: requests in the batch.
    :param decodes: requests that decode.
    :param prefills: requests that prefill a chunk.
    :param prefill_pairs: attention pairs of the prefill chunks, sum of ``c * computed + c (c + 1) / 2``.
    :param first_decodes: decodes that are their request's first.
    :param kv_tokens_read: KV tokens the batch attends to (each request's context after the step).
    :param cached_tokens: prompt tokens that the requests activated in this step found in the prefix cache.
    :param preempted: requests preempted (by recompute) since the last step.
    :param waiting: requests waiting when the step was scheduled.
    :param running: requests running when the step was scheduled.
    :param kv_used_tokens: KV tokens in use when the step was scheduled (whole blocks).
    :param kv_capacity_tokens: the KV cache's capacity in tokens.
    :param activation_budget: activations the decision allowed (empty: vLLM's own scheduling).
    :param token_budget: the step's token budget applied (with ``--controller vllm``: vLLM's configured one).
    :param running_cap: the running cap applied (with ``--controller vllm``: vLLM's ``max_num_seqs``).
    :param fallback: why the step took the conservative decision (empty: it did not).
    :param plugin_s: seconds the plugin's own work took in this step (observing, deciding, logging).
    :param decide_s: of them, seconds the step waited for the controller's decision.
    :param block_size: tokens in a KV block.
    """

    step: int
    time_s: float
    real_s: float
    tokens: int
    prefill_tokens: int
    decode_tokens: int
    requests: int
    decodes: int
    prefills: int
    prefill_pairs: int
    first_decodes: int
    kv_tokens_read: int
    cached_tokens: int
    preempted: int
    waiting: int
    running: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    activation_budget: int | None = None
    token_budget: int | None = None
    running_cap: int | None = None
    fallback: str = ""
    plugin_s: float = 0.0
    decide_s: float = 0.0
    block_size: int = 0


COLUMNS = tuple(f.name for f in fields(StepRow))


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.10g}"  # time_s: microseconds over a day
    return str(value).replace(",", ";").replace("\n", " ")


class StepLog:
    """Appends :class:`StepRow` lines to a CSV file (made, with its header, at start-up).

    :param path: the file; its folder is made if missing.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", buffering=1)  # a line per step, readable while vLLM runs
        self._file.write(",".join(COLUMNS) + "\n")

    def write(self, row: StepRow) -> None:
        self._file.write(",".join(_cell(getattr(row, c)) for c in COLUMNS) + "\n")

    def close(self) -> None:
        self._file.close()
