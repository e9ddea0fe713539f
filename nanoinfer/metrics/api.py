"""LLM.stats / get_metrics / spec_stats (the offline API of the engine's statistics and counters)."""
from nanoinfer.metrics.stats import StatLogger, engine_metrics


class MetricsAPI:
    """Mixed into LLM: reads its registered features, row planner and runner."""

    @property
    def stats(self) -> StatLogger | None:
        """The engine's statistics (None with disable_log_stats=True)."""
        return self.feature(StatLogger)

    @property
    def spec_stats(self):
        """The row planner's counters (a draft's acceptance), None if it keeps none."""
        return self.rows.stats

    def get_metrics(self) -> list:
        """vLLM's LLM.get_metrics(): a list of metrics, each with `name` and `value` (the engine's
        totals since start, and the row planner's counters)."""
        return engine_metrics(self)
