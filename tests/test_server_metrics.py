"""/metrics before the first request: every series at zero (as vLLM's), for each engine."""
from prometheus_client.parser import text_string_to_metric_families

from nanoinfer.serve.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> list:
    return [s for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples]


def test_every_series_starts_at_zero():
    metrics = ServerMetrics("m")
    metrics.for_engine(1)  # a second data-parallel replica
    samples = _samples(metrics)
    names = {s.name for s in samples}
    for name in ("nanoinfer:num_requests_running", "nanoinfer:num_requests_waiting", "nanoinfer:kv_cache_usage_perc",
                 "nanoinfer:num_preemptions", "nanoinfer:prompt_tokens_total", "nanoinfer:generation_tokens_total",
                 "nanoinfer:request_success_total", "nanoinfer:prefix_cache_hits_total",
                 "nanoinfer:time_to_first_token_seconds_count", "nanoinfer:e2e_request_latency_seconds_count",
                 "nanoinfer:spec_decode_num_drafts_total"):
        assert name in names, name
        assert {s.labels["engine"] for s in samples if s.name == name} == {"0", "1"}, name
    assert {s.labels["finished_reason"] for s in samples if s.name == "nanoinfer:request_success_total"} == \
        {"stop", "length", "abort"}
    assert all(s.value == 0 for s in samples if not s.name.endswith("_created")), \
        [s for s in samples if s.value and not s.name.endswith("_created")]
