"""What the engine records of each step for benchmarks (`LLMEngine.step_log`, read by bench.py)."""
from dataclasses import dataclass

from nanoinfer.engine.scheduler import ScheduledBatch


@dataclass(slots=True)
class StepRecord:
    """One step: its rows as (query_len, context_len), its decode rows, perf_counter times (start,
    scheduled, launched, end of the host's processing), and the seconds spent waiting in the
    runner's collect() (the host's own work is the rest: `host_s`)."""
    rows: list[tuple[int, int]]
    num_decode: int
    start: float
    scheduled: float
    launched: float
    end: float
    waited: float = 0.0

    @property
    def host_s(self) -> float:
        return self.end - self.start - self.waited

    @classmethod
    def of(cls, batch: ScheduledBatch, t0: float, t1: float, t2: float, t3: float, waited: float) -> "StepRecord":
        return cls([(q, start + q) for start, q in zip(batch.starts, batch.query_lens)], batch.num_decode,
                   t0, t1, t2, t3, waited)
