"""What the engine records of each step for benchmarks (`LLMEngine.step_log`, read by bench.py)."""
from dataclasses import dataclass

from nanoinfer.engine.scheduler import ScheduledBatch


@dataclass(slots=True)
class StepRecord:
    """One step, for benchmarks: its rows as (query_len, context_len), the number of decode rows,
    and perf_counter times: start, scheduled, launched, and the end of the host's processing."""
    rows: list[tuple[int, int]]
    num_decode: int
    start: float
    scheduled: float
    launched: float
    end: float

    @classmethod
    def of(cls, batch: ScheduledBatch, t0: float, t1: float, t2: float, t3: float) -> "StepRecord":
        return cls([(q, start + q) for start, q in zip(batch.starts, batch.query_lens)], batch.num_decode,
                   t0, t1, t2, t3)
