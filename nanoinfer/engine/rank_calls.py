"""The calls the engine's process makes to its tensor-parallel workers (engine/tp_executor.py), and
what rank 0 reports back: typed, plain data, pickled through each worker's pipe. A step's own data
(step/step_message.py) travels in the group's shared-memory payload, named by byte spans."""
from dataclasses import dataclass

from nanoinfer.step.step_message import StepResult


@dataclass(slots=True)
class Launch:
    """Run step `step_id`, whose in-flight rows read the tokens of step `prev_id`. sample_span:
    where rank 0's SampleInput lies (None for the other ranks). report_now: answer with this step's
    results at once (a step that runs user code, which may raise)."""
    step_id: int
    prev_id: int | None
    step_span: tuple[int, int]
    sample_span: tuple[int, int] | None
    report_now: bool


@dataclass(slots=True)
class Flush:
    """Report the last step launched (nobody reports it unasked)."""


@dataclass(slots=True)
class AllocateKVCache:
    num_blocks: int


@dataclass(slots=True)
class Info:
    """ModelRunner.info()."""


@dataclass(slots=True)
class Ping:
    """A round trip without a forward."""


@dataclass(slots=True)
class Exit:
    pass


@dataclass(slots=True)
class Reported:
    """Rank 0's report of one step: its results, or why its sampling failed."""
    step_id: int
    result: StepResult | None = None
    error: str | None = None
