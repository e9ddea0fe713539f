"""The engine's statistics (disable_log_stats=False): counted as steps are processed, logged every
few seconds as one line, vLLM's:

    Avg prompt throughput: 1234.5 tokens/s, Avg generation throughput: 456.7 tokens/s, Running: 3 reqs,
    Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%, Preemptions: 0

Prompt tokens count once per request, when its prompt is done (its first token, or its embedding);
generation tokens are the tokens appended to completions; the hit rate is prompt tokens served by
the prefix cache over prompt tokens looked up in it, since start. Totals since start are kept
(`totals()`) for tests and /metrics. The engine reports to it through the feature hooks
(EngineFeature.processed, .stepped: step/feature.py)."""
import logging
import os
import time
from dataclasses import dataclass

from nanoinfer.step.feature import EngineFeature

logger = logging.getLogger("nanoinfer.stats")


def log_interval_s() -> float:
    """Seconds between lines (NANOINFER_LOG_STATS_INTERVAL, default 5; 0 logs every step)."""
    return float(os.environ.get("NANOINFER_LOG_STATS_INTERVAL", "5"))


class StatLogger(EngineFeature):
    def __init__(self, interval_s: float | None = None):
        self.interval_s = log_interval_s() if interval_s is None else interval_s
        self.prompt_tokens = self.generation_tokens = self.requests_finished = 0  # totals since start
        self._logged = (0, 0)  # the token totals at the last line
        self._last_log = time.monotonic()
        if not logger.hasHandlers():  # offline use without logging configured: still show the lines
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("INFO %(name)s: %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)

    def processed(self, batch, update, finished: list) -> None:
        self.record(batch, update.appended, finished, update.counts)

    def stepped(self, scheduler) -> None:
        self.maybe_log(scheduler)

    def record(self, batch, appended: list[int], finished: list, counts: dict | None = None):
        """A processed step: the rows whose token was appended (counts: rows that appended several,
        speculative ones), the sequences it finished."""
        for row in appended:
            seq = batch.seqs[row]
            if seq.num_completion_tokens == 1 and seq.index == 0:
                self.prompt_tokens += seq.num_prompt_tokens
            if seq.pooling is None:
                self.generation_tokens += counts.get(row, 1) if counts else 1
        self.requests_finished += sum(1 for seq in finished if seq.index == 0 and seq.finish_reason != "abort")

    def maybe_log(self, scheduler, force: bool = False):
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self.interval_s and not force:
            return
        prompt, generation = self.prompt_tokens - self._logged[0], self.generation_tokens - self._logged[1]
        self._logged, self._last_log = (self.prompt_tokens, self.generation_tokens), now
        elapsed = max(elapsed, 1e-9)
        t = self.totals(scheduler)
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
                    "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, Preemptions: %d",
                    prompt / elapsed, generation / elapsed, t["running"], t["waiting"], 100 * t["kv_cache_usage"],
                    100 * t["prefix_cache_hit_rate"], t["preemptions"])

    def totals(self, scheduler) -> dict:
        """Now: requests running and waiting, KV-cache usage (0-1); since start: prompt and
        generation tokens, finished requests, prefix-cache queries and hits (tokens), preemptions."""
        bm = scheduler.block_manager
        running = {seq.request_id for seq in scheduler.running}
        waiting = {seq.request_id for seq in scheduler.waiting} - running  # (held samples wait with their first)
        return dict(running=len(running), waiting=len(waiting),
                    kv_cache_usage=1 - bm.num_free_blocks / bm.num_blocks,
                    prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
                    requests_finished=self.requests_finished,
                    prefix_cache_queries=bm.num_queried_tokens, prefix_cache_hits=bm.num_hits * bm.block_size,
                    prefix_cache_hit_rate=bm.num_hits * bm.block_size / max(bm.num_queried_tokens, 1),
                    preemptions=scheduler.num_preemptions)


@dataclass(frozen=True, slots=True)
class Metric:
    """One of LLM.get_metrics()'s entries (vLLM's shape: name and value)."""
    name: str
    value: float


@dataclass(frozen=True, slots=True)
class Vector:
    """An entry of LLM.get_metrics() with one value per index (vLLM's Vector): a model's counter
    of one value per rank, say (utils/counters.py)."""
    name: str
    values: list[int]


def engine_metrics(engine) -> list[Metric | Vector]:
    """The engine's totals (when it keeps statistics), speculative decoding's counters, and the
    counters the model keeps on its device (read now: a round trip to the ranks)."""
    out = []
    stats = engine.feature(StatLogger)
    if stats is not None:
        out += [Metric(f"nanoinfer:{k}", v) for k, v in stats.totals(engine.scheduler).items()]
    if engine.spec_stats is not None:
        out += [Metric(k, v) for k, v in engine.spec_stats.metrics().items()]
    if not engine._exited:
        out += [Vector(f"nanoinfer:{k}", v) for k, v in engine.model_runner.info().get("counters", {}).items()]
    return out
