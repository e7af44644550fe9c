"""What the gateway knows of each replica: its gauges, their age, its requests in flight, its health.

A replica is any OpenAI-compatible server that exports the load gauges of vLLM, SGLang, tidegate,
Hugging Face TGI or llama.cpp's server on ``/metrics`` (both generations of vLLM's KV gauge; TGI exports
no KV gauge, llama.cpp's only in some builds). The gauges are scraped on a short period and
are only as fresh as their scrape: a view older than ``stale_after_s`` is stale, and the gateway
then judges that replica by what it counts itself (its requests in flight there). Dispatches made
since a scrape began are counted on top of the scraped queue, so a burst that arrives between two
scrapes spreads over the fleet instead of landing on the replica that looked idle.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from tidegate.engine.core.stats import RateEstimator

#: gauge -> (the engine's metric names, newest first)
GAUGE_NAMES = {
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "tidegate:num_requests_waiting",
                "tgi_queue_size", "llamacpp:requests_deferred"),
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs", "tidegate:num_requests_running",
                "tgi_batch_current_size", "llamacpp:requests_processing"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
                 "tidegate:kv_cache_usage_perc", "llamacpp:kv_cache_usage_ratio"),
    # a counter: requests the replica preempted (evicted from its KV, to run again) since it started
    "preemptions": ("vllm:num_preemptions_total", "tidegate:num_preemptions_total"),
}
_NAME_TO_GAUGE = {name: gauge for gauge, names in GAUGE_NAMES.items() for name in names}
#: the query that asks a replica's ``/metrics`` for these series alone, as prometheus_client's exposition app and
#: ``tidegate serve`` answer it (its whole page costs the replica 3 ms of CPU a read, these 0.35 ms:
#: ``benchmarks/scrape_cost.py``); a server that does not (vLLM 0.32 serves the page through an instrumentator's
#: route) answers the whole page, read the same
METRICS_QUERY = "?" + "&".join(f"name[]={name}" for name in _NAME_TO_GAUGE)
#: outlier ejection judges a replica by its last ``OUTLIER_MIN_ANSWERS`` answers of the last ``OUTLIER_PERIOD_S``
#: (``OUTLIER_MEMORY`` kept at most), against the other replicas' answers over the same time
OUTLIER_PERIOD_S = 10.0
OUTLIER_MEMORY = 1024
OUTLIER_MIN_ANSWERS = 10


def parse_gauges(text: str) -> dict[str, float]:
    """The load gauges of a Prometheus text exposition, each summed over its label sets (several
    models or engines in one server); a gauge the text does not hold is absent.

    Only the lines of the gauges read here go to the parser: an engine's page is mostly histogram
    buckets, and parsing them all at every scrape cost the gateway more than relaying the streams."""
    wanted = "\n".join(line for line in text.splitlines() if _mentions_gauge(line))
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(wanted):
        # the parser names a counter's family without its ``_total`` and keeps the suffix on its samples
        name = family.name + "_total" if family.type == "counter" else family.name
        gauge = _NAME_TO_GAUGE.get(name)
        if gauge is None:
            continue
        values = [s.value for s in family.samples if s.name == name and math.isfinite(s.value)]
        total = float(sum(values))
        # the first name of a gauge found wins (vLLM's newer KV name); a count is never below zero, and a sum past
        # a float's range (a replica's nonsense) is no figure at all
        if values and gauge not in out and math.isfinite(total):
            out[gauge] = max(0.0, total)
    return out


def _mentions_gauge(line: str) -> bool:
    """A sample or TYPE/HELP line of one of the gauges read here."""
    if line.startswith("#"):
        parts = line.split(None, 3)
        return len(parts) > 2 and parts[2] in _NAME_TO_GAUGE
    end = len(line)
    for stop in ("{", " "):
        i = line.find(stop)
        if 0 <= i < end:
            end = i
    return line[:end] in _NAME_TO_GAUGE


@dataclass
class ReplicaView:
    """One replica as the gateway sees it. Times are ``time.monotonic()`` seconds.

    :param url: the replica's base URL (``http://host:port``)
    :param stale_after_s: how old the scraped gauges may be before they are not trusted
    """

    url: str
    stale_after_s: float = 2.0
    #: the time per output token the replica's running requests should see (None: no concurrency limit)
    tpot_slo_s: float | None = None
    #: the most of the gateway's requests the replica may hold: additive increase while the streams'
    #: time per token meets the SLO and the replica neither queued nor preempted at its last scrape (+1 a
    #: completion and +1 a stream that starts until the first cut or refusal, as TCP's slow start; then
    #: +1/limit a completion), cut by a fifth of what was in flight when the time per token does not, and by
    #: the requests preempted (at most that fifth) when a scrape finds the replica preempted since the one
    #: before (it holds more than its KV cache runs: a loss, in TCP's terms), either at most once a request
    #: lifetime (``cut``), and to what the replica runs and the queue it may hold (``queue_allowed``) when
    #: two scrapes in a row find it queueing more than that
    limit: float = 4.0
    slow_start: bool = True
    #: seconds per token between the streams' chunks, exponentially weighted, and the lowest it has been
    #: once ``FLOOR_AFTER`` chunks have been weighed (two chunks sent back to back are not a floor)
    tpot_s: float | None = None
    tpot_floor_s: float = math.inf
    tpot_samples: int = 0
    #: seconds a completed request took, exponentially weighted
    lifetime_s: float = 1.0
    last_cut: float = -math.inf
    #: scrapes in a row that found the replica queueing more than ``queue_allowed``
    queued_scrapes: int = 0
    #: the last scrape's gauges (None: never scraped, or the replica exports no queue gauge)
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    #: the replica's preemption counter at the last scrape, and whether it had grown since the scrape before
    preemptions: float | None = None
    preempting: bool = False
    #: when the scrape whose gauges these are was sent
    scraped_at: float | None = None
    #: False after a connection failure or a failed health check, until a health check passes
    up: bool = True
    #: why the replica was last marked down
    down_reason: str = ""
    #: the gateway's requests dispatched there and not yet ended
    in_flight: int = 0
    #: the replica answered 429 or 503 after this time: it has no room until a later scrape says so
    refused_at: float | None = None
    dispatches: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    completions: RateEstimator = field(default_factory=lambda: RateEstimator(10.0, min_events=16))
    #: seconds from dispatch to the replica's first streamed byte, exponentially weighted
    ttft_s: float | None = None
    #: the replica's answers of the last ``OUTLIER_PERIOD_S``, when and whether a server error (5xx but 503, its
    #: "busy"), and how many of them are; what outlier ejection judges it by
    answers: deque[tuple[float, bool]] = field(default_factory=deque)
    answer_errors: int = 0
    #: times the replica was ejected since it last answered a whole window well, and when the last ejection ends
    ejections: int = 0
    ejected_until: float = -math.inf
    #: what the gauges are asked for with (``METRICS_QUERY``; empty once the replica answered it with none)
    metrics_query: str = METRICS_QUERY
    #: totals for the gateway's metrics
    dispatched_total: int = 0
    completed_total: int = 0
    failed_total: int = 0
    ejected_total: int = 0

    #: chunks weighed before the lowest time per token counts as a floor
    FLOOR_AFTER = 20

    @property
    def name(self) -> str:
        return self.url.split("://", 1)[-1]

    def stale(self, now: float) -> bool:
        return self.scraped_at is None or self.waiting is None or now - self.scraped_at > self.stale_after_s

    def pending(self) -> int:
        """Dispatches sent since the last scrape began: the replica may not have counted them yet."""
        since = self.scraped_at
        if since is None:
            return len(self.dispatches)
        n = 0
        for t in reversed(self.dispatches):
            if t < since:
                break
            n += 1
        return n

    def queued(self, now: float) -> float:
        """Requests queued in the replica by the latest word: the scraped queue and the dispatches since;
        when the gauges are stale, the gateway's own requests there beyond what last ran."""
        if self.stale(now):
            return max(0.0, self.in_flight - (self.running or 0.0))
        return (self.waiting or 0.0) + self.pending()

    def load(self, now: float) -> float:
        """Requests held by the replica: running and queued, and never fewer than the gateway has there; and one more
        for each server error it answered lately (a replica that fails fast looks idle: without this, routers by load
        send it every request, the others answer none, and nothing tells a broken replica from failing requests)."""
        errors = float(self.recent_errors(now)) if self.answer_errors else 0.0
        if self.stale(now):
            return float(self.in_flight) + errors
        return max(float(self.in_flight), (self.running or 0.0) + self.queued(now)) + errors

    def completion_rate(self, now: float) -> float:
        return self.completions.rate(now)

    def room(self, now: float, scrape_period_s: float) -> bool:
        """Whether the replica may take a request now: it is up, has not refused since its last scrape,
        holds fewer of the gateway's requests than its limit, and, if it was queueing at the last
        scrape, queues less than it starts before the next scrape can say more (its measured rate of
        completions over two scrape periods, and at least one request)."""
        if not self.up or self.refusing(now):
            return False
        if self.in_flight >= max(1, int(self.limit)):
            return False
        if self.stale(now) or not self.waiting:
            return True  # it queued nothing at the last word: the limit alone bounds what it holds
        return self.queued(now) < self.queue_allowed(now, scrape_period_s)

    def queue_allowed(self, now: float, scrape_period_s: float) -> float:
        """What the replica may queue: what it starts before the next scrape can say more (its measured rate of
        completions over two scrape periods), and at least one request."""
        return max(1.0, math.ceil(self.completion_rate(now) * 2 * scrape_period_s))

    def refusing(self, now: float) -> bool:
        """The replica refused a request after its last scrape began, and not longer ago than its
        gauges stay fresh (a replica whose scrapes fail is not shut out for good by one refusal)."""
        r = self.refused_at
        return r is not None and now - r <= self.stale_after_s and (self.scraped_at is None or self.scraped_at <= r)

    def tpot_target(self) -> float | None:
        """The time per token to hold: the SLO, or 1.25 times the lowest seen when even that is over it
        (a limit cut for an SLO no concurrency meets would only cost throughput)."""
        if self.tpot_slo_s is None:
            return None
        return max(self.tpot_slo_s, 1.25 * self.tpot_floor_s)

    def tokens_streamed(self, now: float, gap_s: float, tokens: int) -> None:
        """A stream's chunk of ``tokens`` came ``gap_s`` after that stream's previous one."""
        if tokens <= 0:
            return
        sample = gap_s / tokens
        self.tpot_s = sample if self.tpot_s is None else 0.9 * self.tpot_s + 0.1 * sample
        self.tpot_samples += 1
        if self.tpot_samples >= self.FLOOR_AFTER:
            self.tpot_floor_s = min(self.tpot_floor_s, self.tpot_s)
        target = self.tpot_target()
        if target is not None and self.tpot_s > target:
            self.cut(now)

    def cut(self, now: float, by: float = math.inf) -> None:
        """Cut the limit to what is in flight less a fifth of it, or less ``by`` when that is fewer, unless a
        cut came less than a request lifetime ago (what is in flight then still holds what the last cut let
        through) or one request is."""
        if self.in_flight > 1 and now - self.last_cut > self.lifetime_s:
            held = min(self.limit, self.in_flight)
            self.limit = max(1.0, held - min(by, 0.2 * held))
            self.slow_start = False
            self.last_cut = now

    # ------------------------------------------------------------------------------- events
    def scraped(self, sent_at: float, gauges: dict[str, float]) -> None:
        period = sent_at - self.scraped_at if self.scraped_at is not None else None
        self.scraped_at = sent_at
        self.waiting = gauges.get("waiting")
        self.running = gauges.get("running")
        self.kv_usage = gauges.get("kv_usage")
        count = gauges.get("preemptions")
        preempted = count - self.preemptions if count is not None and self.preemptions is not None else 0.0
        self.preempting = preempted > 0
        self.preemptions = count
        if self.preempting and self.tpot_slo_s is not None:
            self.cut(sent_at, preempted)
        if self.waiting and self.running is not None and self.tpot_slo_s is not None and period is not None:
            allowed = self.queue_allowed(sent_at, period)
            self.queued_scrapes = self.queued_scrapes + 1 if self.waiting > allowed else 0
            if self.queued_scrapes >= 2:
                self.limit = max(1.0, min(self.limit, self.running + allowed))
        else:
            self.queued_scrapes = 0
        while self.dispatches and self.dispatches[0] < sent_at - 60.0:
            self.dispatches.popleft()

    def dispatched(self, now: float) -> None:
        self.in_flight += 1
        self.dispatched_total += 1
        self.dispatches.append(now)

    def first_byte(self, dispatched_at: float, now: float) -> None:
        """A request dispatched here at ``dispatched_at`` streamed its first byte: the replica started it. In slow
        start that is TCP's acknowledgement: the limit grows by one while at least half of it is in use (RFC 7661),
        the replica neither queued nor preempted at its last scrape, and the first byte came within twice the
        usual time (one that came later says the replica is busy, as a longer round trip says to a delay-based
        TCP). The limit then doubles in about a time to first token instead of a request's lifetime: a fleet that
        starts under steady traffic otherwise holds a few requests a replica for the whole first lifetime, and
        refuses what waits past them."""
        sample = now - dispatched_at
        usual = self.ttft_s
        self.ttft_s = sample if self.ttft_s is None else 0.8 * self.ttft_s + 0.2 * sample
        if (self.slow_start and 2 * self.in_flight >= self.limit and (usual is None or sample <= 2.0 * usual)
                and self._may_grow()):
            self.limit += 1.0

    def _may_grow(self) -> bool:
        """The limit may grow: the replica neither queued nor preempted at its last scrape, and its streams' time per
        token holds (a limit of one grows back whatever the time per token: one at a time is no cure for a slow
        replica)."""
        target = self.tpot_target()
        meets = target is None or self.tpot_s is None or self.tpot_s <= target or self.limit < 2.0
        return not self.waiting and not self.preempting and meets

    def ended(self, now: float, completed: bool, lifetime_s: float | None = None) -> None:
        """A request dispatched here ended: ``completed`` when the replica answered it whole, after
        ``lifetime_s`` from its dispatch."""
        binding = self.in_flight >= int(self.limit)
        self.in_flight = max(0, self.in_flight - 1)
        if completed:
            self.completed_total += 1
            self.completions.add(now)
            if lifetime_s is not None:
                self.lifetime_s = 0.9 * self.lifetime_s + 0.1 * lifetime_s
            if binding and self._may_grow():
                self.limit += 1.0 if self.slow_start else 1.0 / self.limit

    def refused(self, now: float) -> None:
        """The replica refused a request (429 or 503; it was ended here first): it takes nothing until its next
        scrape, and slow start ends, as at TCP's loss (the limit stays: a replica that admits by its own rule
        refuses one request while it has room for another, and the limit held at what it held when it refused
        lost a tenth of the goodput on long prompts in the twin)."""
        self.refused_at = now
        self.slow_start = False

    def answered(self, status: int, now: float) -> None:
        """The replica answered a request with ``status`` (its headers; a stream that breaks off later marks it down
        by itself). A 4xx is the request's fault and counts as a good answer; 429 and 503 say the replica is busy
        and count for nothing."""
        if status in (429, 503):
            return
        self._forget(now)
        if len(self.answers) >= OUTLIER_MEMORY:
            self.answer_errors -= self.answers.popleft()[1]
        failed = status >= 500
        self.answers.append((now, failed))
        self.answer_errors += failed
        if self.ejections and not self.answer_errors and len(self.answers) >= OUTLIER_MIN_ANSWERS:
            self.ejections = 0  # answered well for a while since its return: the next ejection starts short

    def _forget(self, now: float) -> None:
        while self.answers and self.answers[0][0] < now - OUTLIER_PERIOD_S:
            self.answer_errors -= self.answers.popleft()[1]

    def recent_errors(self, now: float) -> int:
        """Server errors among the replica's answers of the last ``OUTLIER_PERIOD_S``."""
        self._forget(now)
        return self.answer_errors

    def server_errors(self, now: float, since: float = -math.inf, most: int | None = None) -> tuple[int, int]:
        """Server errors among the replica's answers of the last ``OUTLIER_PERIOD_S`` from ``since`` on (the ``most``
        latest of them), and those answers."""
        self._forget(now)
        if most is None and (not self.answers or self.answers[0][0] >= since):
            return self.answer_errors, len(self.answers)
        errors = answers = 0
        for t, failed in reversed(self.answers):
            if t < since or answers == most:
                break
            answers += 1
            errors += failed
        return errors, answers

    def eject(self, now: float, reason: str, base_s: float) -> float:
        """Take the replica out for ``base_s`` times the ejections in a row (ten at most), as Envoy's outlier
        detection does; it comes back when that time is over and a health check passes. Returns the seconds."""
        self.ejections += 1
        self.ejected_total += 1
        seconds = base_s * min(self.ejections, 10)
        self.ejected_until = now + seconds
        self.mark_down(reason)
        return seconds

    def mark_down(self, reason: str) -> None:
        self.up = False
        self.down_reason = reason
        self.failed_total += 1

    def mark_up(self) -> None:
        self.up = True
        self.down_reason = ""
        self.refused_at = None
        self.answers.clear()  # judged afresh: the errors that took it out are not held against it twice
        self.answer_errors = 0


def outlier(view: ReplicaView, views: list[ReplicaView], now: float, most_ejected: float = 0.5) -> str | None:
    """Why ``view`` should be ejected, or None: half or more of its last ``OUTLIER_MIN_ANSWERS`` answers (within
    ``OUTLIER_PERIOD_S``) were server errors, while the other replicas that are up answered half that many or more
    since the first of them and failed at under half its share, each judged by its own latest answers of that time
    (at most as many).

    The comparison is what keeps requests that fail everywhere (a prompt that crashes every replica, a client's
    attack) from taking replicas out: they raise every replica's share alike, over the same time. Without the
    others' answers there is nothing to compare with, and nothing is ejected: a replica that fails fast counts its
    errors as load (``ReplicaView.load``), so the routers send the next requests elsewhere and the others' answers
    come. Another replica must stay up, and at most ``most_ejected`` of the fleet (one replica at least) is down at
    once, so the worst a client who steers its failing requests at one replica (by a shared prefix, say) can do is
    keep that share out for the ejection time.
    """
    errors, answers = view.server_errors(now, most=OUTLIER_MIN_ANSWERS)
    if answers < OUTLIER_MIN_ANSWERS or 2 * errors < answers:
        return None
    others = [v for v in views if v is not view]
    if not any(v.up for v in others):
        return None
    if sum(not v.up for v in others) + 1 > max(1, int(most_ejected * len(views))):
        return None
    since = view.answers[-answers][0]
    their = [v.server_errors(now, since, most=OUTLIER_MIN_ANSWERS) for v in others if v.up]
    their_errors, their_answers = sum(e for e, _ in their), sum(n for _, n in their)
    if 2 * their_answers < OUTLIER_MIN_ANSWERS or 2 * their_errors * answers >= errors * their_answers:
        return None
    return (f"it answered {errors} of its last {answers} requests with a server error (the other replicas up "
            f"{their_errors} of their last {their_answers} meanwhile)")
