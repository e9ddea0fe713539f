"""/metrics: the server's Prometheus metrics (prometheus-client), names prefixed `nanoinfer:` (as
vLLM's are `vllm:`). Gauges come from the engine's stats in each of its messages; counters and
latency histograms from each finished request's output, and inter-token latency from stream
deltas as they reach the HTTP process. Every series is labelled with `model_name` and `engine`, the
data-parallel replica that served it ("0" with one engine; vLLM's labels)."""
import copy
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from nanoinfer.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST
_FINISH_REASONS = ("stop", "length", "abort")  # the finish reasons a request_success series starts with


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.running = Gauge("nanoinfer:num_requests_running", "Sequences running in the engine", labels, registry=r)
        self.waiting = Gauge("nanoinfer:num_requests_waiting", "Sequences waiting to run", labels, registry=r)
        self.kv_usage = Gauge("nanoinfer:kv_cache_usage_perc", "Share of KV-cache blocks in use (0-1)", labels,
                              registry=r)
        self.preemptions = Gauge("nanoinfer:num_preemptions", "Preemptions since start", labels, registry=r)
        self.prompt_tokens = Counter("nanoinfer:prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=r)
        self.generation_tokens = Counter("nanoinfer:generation_tokens", "Generated tokens of finished requests",
                                         labels, registry=r)
        self.success = Counter("nanoinfer:request_success", "Finished requests by finish reason",
                               labels + ["finished_reason"], registry=r)
        self.prefix_queries = Counter("nanoinfer:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter("nanoinfer:prefix_cache_hits", "Prompt tokens served by the prefix cache",
                                   labels, registry=r)
        self.ttft = Histogram("nanoinfer:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("nanoinfer:inter_token_latency_seconds", "Time between tokens of a stream", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("nanoinfer:time_per_output_token_seconds", "A request's mean time per output token "
                              "after its first", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("nanoinfer:e2e_request_latency_seconds", "Arrival to finish", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.spec = [Counter(f"nanoinfer:spec_decode_{name}", text, labels, registry=r) for name, text in (
            ("num_drafts", "Speculative rows verified"), ("num_draft_tokens", "Tokens proposed"),
            ("num_accepted_tokens", "Proposed tokens accepted"))]
        self._spec_seen = (0, 0, 0)  # the engine's totals at its last message
        self.expert_load = Counter("nanoinfer:expert_parallel_rank_tokens", "Tokens routed to each expert-parallel "
                                   "rank's experts, summed over MoE layers (read about once a second)",
                                   labels + ["ep_rank"], registry=r)
        self._load_seen: list[int] = []
        self.model_name = model_name
        self.engine = "0"
        self._last_delta: dict[tuple[int, int], float] = {}  # (request, completion) -> its last delta's time
        self._export_zeros()

    def _export_zeros(self):
        """Every series of this engine at zero from the start (as vLLM's), so that a scrape before the
        first request sees the metrics and rate() has a starting point."""
        for metric in (self.running, self.waiting, self.kv_usage, self.preemptions, self.prompt_tokens,
                       self.generation_tokens, self.prefix_queries, self.prefix_hits, self.ttft, self.itl,
                       self.tpot, self.e2e, *self.spec):
            self._m(metric)
        for reason in _FINISH_REASONS:
            self._m(self.success, finished_reason=reason)

    def for_engine(self, index: int) -> "ServerMetrics":
        """The same series, fed by data-parallel replica `index` (its request ids are its own)."""
        view = copy.copy(self)
        view.engine, view._last_delta, view._load_seen = str(index), {}, []
        view._export_zeros()
        return view

    def _m(self, metric, **labels):
        return metric.labels(model_name=self.model_name, engine=self.engine, **labels)

    def engine_stats(self, stats):
        self._m(self.running).set(stats.running)
        self._m(self.waiting).set(stats.waiting)
        self._m(self.kv_usage).set(stats.kv_blocks_used / max(stats.kv_blocks, 1))
        self._m(self.preemptions).set(stats.preemptions)
        if stats.spec is not None:  # (totals since start: the counters grow by what is new)
            for counter, now, seen in zip(self.spec, stats.spec, self._spec_seen):
                if now > seen:
                    self._m(counter).inc(now - seen)
            self._spec_seen = stats.spec
        load = (stats.counters or {}).get("expert_parallel_rank_tokens")
        if load is not None:  # (expert parallel: a value per rank; totals since start)
            seen = self._load_seen or [0] * len(load)
            for rank, (now, before) in enumerate(zip(load, seen)):
                self._m(self.expert_load, ep_rank=str(rank)).inc(max(now - before, 0))
            self._load_seen = load

    def stream_delta(self, request_id: int, completion: int, num_tokens: int, finished: bool):
        now = time.monotonic()
        key = (request_id, completion)
        last = self._last_delta.pop(key, None) if finished else self._last_delta.get(key)
        if last is not None and num_tokens:
            gap = (now - last) / num_tokens
            for _ in range(min(num_tokens, 64)):
                self._m(self.itl).observe(gap)
        if not finished:
            self._last_delta[key] = now

    def finished(self, out: RequestOutput):
        self._m(self.prompt_tokens).inc(len(out.prompt_token_ids))
        self._m(self.prefix_queries).inc(len(out.prompt_token_ids))
        self._m(self.prefix_hits).inc(out.num_cached_tokens)
        if not isinstance(out, RequestOutput):  # an embedding (PoolingRequestOutput): no tokens generated
            self._m(self.success, finished_reason="stop" if out.finished else "abort").inc()
            return
        generated = sum(len(c.token_ids) for c in out.outputs)
        self._m(self.generation_tokens).inc(generated)
        for c in out.outputs:
            self._m(self.success, finished_reason=c.finish_reason or "abort").inc()
            self._last_delta.pop((out.request_id, c.index), None)
        m = out.metrics
        if m.first_token_time is not None:
            self._m(self.ttft).observe(m.first_token_time - m.arrival_time)
            if m.finished_time is not None:
                longest = max((len(c.token_ids) for c in out.outputs), default=0)
                if longest > 1:
                    self._m(self.tpot).observe((m.finished_time - m.first_token_time) / (longest - 1))
        if m.finished_time is not None:
            self._m(self.e2e).observe(m.finished_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
